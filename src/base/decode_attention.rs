//! Attention of a decode step (one new token per row) in one
//! pass over the KV cache.
//!
//! The general path ([`super::model`]'s `attention`) runs a batched matmul for
//! the scores, a mask add, a softmax and a second batched matmul; for one
//! query per head each of those is a gemm call or a tensor per row and KV head
//! (32 rows × 3 KV heads × 2 products × 30 layers ≈ 5,800 calls per SmolLM2
//! step). Here each row's heads are done in one task: scores against the
//! cached keys, the masked softmax and the weighted sum of values, reading the
//! cache buffers in place.

use candle_core::{bail, CpuStorage, CustomOp3, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::few_rows::{self, Isa};
use super::kernels;

/// `softmax(q·kᵀ/√d + mask)·v` for `q` `[rows, heads, 1, d]` and `k`, `v`
/// `[rows, kv_heads, slots, d]` (views whose slots of one row and head are
/// contiguous, as the KV cache's buffers are), `mask`
/// `[rows, 1, 1, slots]`; f32 on the CPU. Query head `h` reads KV head
/// `h / (heads / kv_heads)`. Returns `[rows, heads, 1, d]`.
pub fn decode_attention(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Tensor) -> Result<Tensor> {
    let mask = mask.flatten_all()?.to_vec1::<f32>()?;
    q.contiguous()?
        .apply_op3_no_bwd(k, v, &DecodeAttention { mask })
}

/// Whether [`decode_attention`] serves these inputs.
pub fn applies(q: &Tensor, k: &Tensor, v: &Tensor) -> bool {
    let f32_cpu = [q, k, v]
        .iter()
        .all(|t| t.device().is_cpu() && t.dtype() == candle_core::DType::F32);
    let packed = [k, v].iter().all(|t| packed_slots(t.stride(), t.dims()));
    let nonempty = [q, k].iter().all(|t| t.dims().iter().all(|&d| d > 0));
    f32_cpu && packed && nonempty && q.dims().get(2) == Some(&1)
}

struct DecodeAttention {
    /// `[rows, slots]`, additive.
    mask: Vec<f32>,
}

/// Whether a `[rows, kv_heads, slots, d]` view holds each row and head's
/// slots as one contiguous `[slots, d]` block.
fn packed_slots(stride: &[usize], dims: &[usize]) -> bool {
    matches!((stride, dims), ([_, _, ss, 1], [_, _, _, d]) if ss == d)
}

/// A `[rows, kv_heads, slots, d]` view's `[slots, d]` blocks.
struct Blocks<'a> {
    values: &'a [f32],
    start: usize,
    row_stride: usize,
    head_stride: usize,
    len: usize,
}

impl Blocks<'_> {
    fn of(&self, row: usize, head: usize) -> &[f32] {
        let at = self.start + row * self.row_stride + head * self.head_stride;
        &self.values[at..][..self.len]
    }
}

fn blocks<'a>(storage: &'a CpuStorage, layout: &Layout, what: &str) -> Result<Blocks<'a>> {
    let (CpuStorage::F32(values), true) = (storage, packed_slots(layout.stride(), layout.dims()))
    else {
        bail!("decode attention: {what} is not f32 with packed slots")
    };
    let (_, _, slots, d) = layout.shape().dims4()?;
    Ok(Blocks {
        values,
        start: layout.start_offset(),
        row_stride: layout.stride()[0],
        head_stride: layout.stride()[1],
        len: slots * d,
    })
}

impl CustomOp3 for DecodeAttention {
    fn name(&self) -> &'static str {
        "decode-attention"
    }

    fn cpu_fwd(
        &self,
        q: &CpuStorage,
        q_layout: &Layout,
        k: &CpuStorage,
        k_layout: &Layout,
        v: &CpuStorage,
        v_layout: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (rows, heads, one, d) = q_layout.shape().dims4()?;
        let (k_rows, kv_heads, slots, k_d) = k_layout.shape().dims4()?;
        let fits = one == 1 && k_rows == rows && k_d == d && v_layout.dims() == k_layout.dims();
        let empty = [heads, kv_heads, slots, d].contains(&0);
        if !fits || empty || heads % kv_heads != 0 || self.mask.len() != rows * slots {
            bail!(
                "decode attention: q {:?}, k {:?}, v {:?}, mask of {} values",
                q_layout.dims(),
                k_layout.dims(),
                v_layout.dims(),
                self.mask.len()
            )
        }
        let (CpuStorage::F32(q), Some((q0, _))) = (q, q_layout.contiguous_offsets()) else {
            bail!("decode attention: q is not contiguous f32")
        };
        let (k, v) = (blocks(k, k_layout, "k")?, blocks(v, v_layout, "v")?);
        let group = heads / kv_heads;
        let scale = 1.0 / (d as f32).sqrt();
        let isa = Isa::best();
        let mut out = vec![0f32; rows * heads * d];
        out.par_chunks_mut(heads * d)
            .enumerate()
            .try_for_each(|(row, out)| {
                let mask = &self.mask[row * slots..][..slots];
                // One KV head's group of query heads at a time.
                for (kv, out) in out.chunks_exact_mut(group * d).enumerate() {
                    let q = &q[q0 + (row * heads + kv * group) * d..][..group * d];
                    let scores = few_rows::matmul_t_serial(q, k.of(row, kv), group, d, slots)
                        .map_err(candle_core::Error::Msg)?;
                    for (out, scores) in out.chunks_exact_mut(d).zip(scores.chunks_exact(slots)) {
                        weighted_values(isa, scores, mask, scale, v.of(row, kv), out);
                    }
                }
                Ok::<_, candle_core::Error>(())
            })?;
        Ok((CpuStorage::F32(out), Shape::from((rows, heads, 1, d))))
    }
}

/// `out = softmax(scores·scale + mask)·V` for one query, `V` `[slots, d]`.
fn weighted_values(isa: Isa, scores: &[f32], mask: &[f32], scale: f32, v: &[f32], out: &mut [f32]) {
    let mut weights = vec![0f32; scores.len()];
    kernels::softmax_row(isa, &mut weights, scores, mask, scale);
    kernels::expand(isa, out, &weights, v);
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, IndexOp};

    /// Against a plain f64 evaluation, reading keys and values from a
    /// cache-like buffer with spare slots, with padding masked out and
    /// grouped query heads.
    #[test]
    fn matches_plain_attention_over_a_cache_view() {
        let (rows, heads, kv_heads, d, slots, capacity) = (3, 6, 2, 20, 7, 12);
        let dev = Device::Cpu;
        let q = Tensor::randn(0f32, 1.0, (rows, heads, 1, d), &dev).unwrap();
        let buffer = |_| Tensor::randn(0f32, 1.0, (rows, kv_heads, capacity, d), &dev).unwrap();
        let (k_buf, v_buf) = (buffer(0), buffer(1));
        let (k, v) = (
            k_buf.narrow(2, 0, slots).unwrap(),
            v_buf.narrow(2, 0, slots).unwrap(),
        );
        // Row r is left-padded by r slots.
        let mask: Vec<f32> = (0..rows)
            .flat_map(|r| (0..slots).map(move |s| if s < r { -1e9 } else { 0.0 }))
            .collect();
        let mask = Tensor::from_vec(mask, (rows, 1, 1, slots), &dev).unwrap();
        assert!(applies(&q, &k, &v));
        let out = decode_attention(&q, &k, &v, &mask).unwrap();
        assert_eq!(out.dims(), [rows, heads, 1, d]);

        let f64s = |t: &Tensor| t.to_dtype(candle_core::DType::F64).unwrap();
        let (q, k, v, mask) = (f64s(&q), f64s(&k), f64s(&v), f64s(&mask));
        for r in 0..rows {
            for h in 0..heads {
                let kv = h / (heads / kv_heads);
                let qv = q.i((r, h, 0)).unwrap().to_vec1::<f64>().unwrap();
                let keys = k.i((r, kv)).unwrap().to_vec2::<f64>().unwrap();
                let values = v.i((r, kv)).unwrap().to_vec2::<f64>().unwrap();
                let m = mask.i((r, 0, 0)).unwrap().to_vec1::<f64>().unwrap();
                let logits: Vec<f64> = keys
                    .iter()
                    .zip(&m)
                    .map(|(key, m)| {
                        let dot: f64 = key.iter().zip(&qv).map(|(a, b)| a * b).sum();
                        dot / (d as f64).sqrt() + m
                    })
                    .collect();
                let max = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let weights: Vec<f64> = logits.iter().map(|l| (l - max).exp()).collect();
                let total: f64 = weights.iter().sum();
                let got = out.i((r, h, 0)).unwrap().to_vec1::<f32>().unwrap();
                for (i, &got) in got.iter().enumerate() {
                    let want: f64 = weights.iter().zip(&values).map(|(w, v)| w * v[i]).sum();
                    let want = want / total;
                    assert!((got as f64 - want).abs() < 1e-5, "row {r} head {h} [{i}]");
                }
            }
        }
    }

    #[test]
    fn serves_only_packed_f32_single_queries() {
        let dev = Device::Cpu;
        let q = Tensor::zeros((1, 2, 2, 4), candle_core::DType::F32, &dev).unwrap();
        let k = Tensor::zeros((1, 1, 3, 4), candle_core::DType::F32, &dev).unwrap();
        assert!(!applies(&q, &k, &k), "two queries per row");
        let q = q.narrow(2, 0, 1).unwrap();
        assert!(applies(&q, &k, &k));
        let k_t = k.transpose(2, 3).unwrap();
        assert!(!applies(&q, &k_t, &k_t), "slots not packed");
        let q64 = q.to_dtype(candle_core::DType::F64).unwrap();
        assert!(!applies(&q64, &k, &k), "f64");
    }
}
