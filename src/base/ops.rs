//! The frozen base's products with kernels of their own: a projection
//! `x·Wᵀ` (chosen by row count: the few-row kernel, the row-lanes kernel,
//! gemm; for weights in blocks, their native counterparts in
//! [`super::native`]), the train step's product back through a frozen matrix
//! `∂y·W`, and the LM head's log-probability of one target token per row,
//! formed in row chunks so that scoring never holds all `[tokens, vocab]`
//! logits at once (49,152 columns for SmolLM2). None records a gradient:
//! the train step's backward is written out in `compute::tape`.

use candle_core::backend::BackendStorage;
use candle_core::{
    CpuStorage, CustomOp1, CustomOp2, DType, Layout, Result, Shape, Storage, Tensor, WithDType, D,
};

use super::blocks::BlockMatrix;
use super::gemm::{self, Threads};
use super::native::{self, PanelFloat};
use super::weight::Weight;
use super::{few_rows, row_lanes};

/// Scored rows per chunk of the LM head (default 256: a `[256, 49152]` f32
/// logits block is 50 MB).
pub const HEAD_CHUNK_ROWS: usize = 256;

/// `x·Wᵀ` for `x` `[m, in]` and a frozen `w` `[out, in]`. On the CPU,
/// contiguous f32 with up to [`few_rows::MAX_ROWS`] rows goes to the few-row
/// kernel, with up to [`row_lanes::MAX_ROWS`] to the row-lanes kernel, the
/// rest to gemm; weights in blocks to [`native::matmul_t`] (f32) or its
/// unpacked slices (f64).
pub fn frozen_matmul(x: &Tensor, w: &Weight) -> Result<Tensor> {
    match w {
        Weight::Dense(w) if x.device().is_cpu() => x.apply_op2_no_bwd(w, &FrozenMatmul),
        Weight::Dense(w) => x.matmul(&w.t()?),
        Weight::Blocks(b) => x.contiguous()?.apply_op1_no_bwd(&BlocksMatmul(b)),
    }
}

struct FrozenMatmul;

impl CustomOp2 for FrozenMatmul {
    fn name(&self) -> &'static str {
        "frozen-matmul"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        x_layout: &Layout,
        w: &CpuStorage,
        w_layout: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (m, k) = x_layout.shape().dims2()?;
        let (n, w_k) = w_layout.shape().dims2()?;
        if k != w_k {
            candle_core::bail!("frozen-matmul: x is [{m}, {k}] but W is [{n}, {w_k}]");
        }
        let y = match (
            x,
            w,
            x_layout.contiguous_offsets(),
            w_layout.contiguous_offsets(),
        ) {
            (CpuStorage::F32(x), CpuStorage::F32(w), Some((x0, x1)), Some((w0, w1)))
                if m <= row_lanes::MAX_ROWS =>
            {
                let (x, w) = (&x[x0..x1], &w[w0..w1]);
                let y = if m <= few_rows::MAX_ROWS {
                    few_rows::matmul_t(x, w, m, k, n)
                } else {
                    row_lanes::matmul_t(x, w, m, k, n)
                };
                CpuStorage::F32(y.map_err(candle_core::Error::Msg)?)
            }
            (CpuStorage::F32(_), CpuStorage::F32(_), ..)
            | (CpuStorage::F64(_), CpuStorage::F64(_), ..) => {
                let w_t = w_layout.transpose(0, 1)?;
                gemm::storage_product(x, x_layout, w, &w_t, Threads::All)?.0
            }
            _ => x.matmul(w, (1, m, n, k), x_layout, &w_layout.transpose(0, 1)?)?,
        };
        Ok((y, Shape::from((m, n))))
    }
}

/// `x·Wᵀ` for `W` in blocks.
struct BlocksMatmul<'a>(&'a BlockMatrix);

impl CustomOp1 for BlocksMatmul<'_> {
    fn name(&self) -> &'static str {
        "native-matmul"
    }

    fn cpu_fwd(&self, x: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let w = self.0;
        let (m, k) = layout.shape().dims2()?;
        if k != w.cols() {
            candle_core::bail!(
                "native matmul: x is [{m}, {k}] but W is [{}, {}]",
                w.rows(),
                w.cols()
            );
        }
        let Some((start, end)) = layout.contiguous_offsets() else {
            candle_core::bail!("native matmul: x must be contiguous");
        };
        let y = match x {
            CpuStorage::F32(x) => CpuStorage::F32(
                native::matmul_t(&x[start..end], w, m).map_err(candle_core::Error::Msg)?,
            ),
            CpuStorage::F64(x) => {
                let mut y = vec![0f64; m * w.rows()];
                native::unpacked_t(&x[start..end], m, w, &mut y);
                CpuStorage::F64(y)
            }
            other => candle_core::bail!(
                "native matmul: activations must be f32 or f64, not {:?}",
                other.dtype()
            ),
        };
        Ok((y, Shape::from((m, w.rows()))))
    }
}

/// `f` on the row-major values of CPU tensor `t` (made contiguous first).
fn with_values<T: WithDType, R>(t: &Tensor, f: impl FnOnce(&[T]) -> Result<R>) -> Result<R> {
    let t = t.contiguous()?;
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cpu(storage) = &*storage else {
        candle_core::bail!("weights in blocks take CPU activations");
    };
    let values = T::cpu_storage_as_slice(storage)?;
    let (start, end) = layout
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg("not contiguous".into()))?;
    f(&values[start..end])
}

/// `∂y·W` for `∂y` `[m, out]`, added into `into` (the values and shape of
/// an earlier product of the same shape, `[m, in]`) or on its own: the
/// train step's gradient through a frozen projection.
pub fn input_grad<T: PanelFloat>(
    into: Option<(Vec<T>, Shape)>,
    dy: &Tensor,
    w: &Weight,
) -> Result<(Vec<T>, Shape)> {
    match (w, into) {
        (Weight::Dense(w), None) => gemm::product_values::<T>(dy, w, Threads::All),
        (Weight::Dense(w), Some((mut dx, shape))) => {
            gemm::add_product(&mut dx, dy, w, Threads::All)?;
            Ok((dx, shape))
        }
        (Weight::Blocks(b), into) => with_values(dy, |dy: &[T]| {
            let m = dy.len() / b.rows().max(1);
            let dx = match into {
                Some((mut dx, _)) => native::add_input_grad(dy, m, b, &mut dx).map(|()| dx),
                None => native::input_grad_values(dy, m, b),
            };
            let dx = dx.map_err(candle_core::Error::Msg)?;
            Ok((dx, Shape::from((m, b.cols()))))
        }),
    }
}

/// `a·W` for row-major `a` `[m, out]` given as a slice: the LM head's
/// gradient back to its input.
pub fn slice_input_grad<T: PanelFloat>(
    a: &[T],
    (m, out): (usize, usize),
    w: &Weight,
) -> Result<(Vec<T>, Shape)> {
    match w {
        Weight::Dense(w) => gemm::slice_product(a, (m, out), w, Threads::All),
        Weight::Blocks(b) => {
            if out != b.rows() {
                candle_core::bail!("{out} columns against a head of {} rows", b.rows());
            }
            let dx = native::input_grad_values(a, m, b).map_err(candle_core::Error::Msg)?;
            Ok((dx, Shape::from((m, b.cols()))))
        }
    }
}

/// `x·Wᵀ` written over `dst` (its allocation kept, see
/// [`gemm::write_product`]); returns the product's shape: the train step's
/// LM head logits, chunk after chunk.
pub fn write_matmul_t<T: PanelFloat>(dst: &mut Vec<T>, x: &Tensor, w: &Weight) -> Result<Shape> {
    match w {
        Weight::Dense(w) => gemm::write_product(dst, x, &w.t()?, Threads::All),
        Weight::Blocks(b) => with_values(x, |x: &[T]| {
            let m = x.len() / b.cols().max(1);
            if x.len() != m * b.cols() {
                candle_core::bail!("{} values for rows of {}", x.len(), b.cols());
            }
            if dst.len() != m * b.rows() {
                dst.clear();
                dst.resize(m * b.rows(), T::zero());
            }
            native::unpacked_t(x, m, b, dst);
            Ok(Shape::from((m, b.rows())))
        }),
    }
}

/// `x·Wᵀ` by candle's matmul for a tensor `W` (any device: the generic
/// backward), by [`frozen_matmul`] for blocks.
pub fn matmul_t_generic(x: &Tensor, w: &Weight) -> Result<Tensor> {
    match w {
        Weight::Dense(w) => x.matmul(&w.t()?),
        Weight::Blocks(_) => frozen_matmul(x, w),
    }
}

/// `∂y·W` by candle's matmul for a tensor `W` (any device: the generic
/// backward), by [`input_grad`] for blocks.
pub fn matmul_generic(dy: &Tensor, w: &Weight) -> Result<Tensor> {
    match (w, dy.dtype()) {
        (Weight::Dense(w), _) => dy.matmul(w),
        (Weight::Blocks(_), DType::F64) => gemm::tensor(input_grad::<f64>(None, dy, w)?),
        (Weight::Blocks(_), _) => gemm::tensor(input_grad::<f32>(None, dy, w)?),
    }
}

/// `log softmax(h·Eᵀ)[target]` for every row of `h` `[n, hidden]`: the
/// log-probability of each row's target token under the LM head `e`
/// `[vocab, hidden]`. Returns `[n]`.
pub fn target_logprobs(h: &Tensor, e: &Weight, targets: &[u32]) -> Result<Tensor> {
    let (n, _) = h.dims2()?;
    if targets.len() != n {
        candle_core::bail!("{} targets for {n} rows", targets.len());
    }
    let targets = Tensor::new(targets, h.device())?;
    let mut parts = Vec::new();
    for start in (0..n).step_by(HEAD_CHUNK_ROWS) {
        let len = HEAD_CHUNK_ROWS.min(n - start);
        let rows = h.narrow(0, start, len)?;
        let logits = match e {
            Weight::Dense(e) => gemm::matmul(&rows, &e.t()?)?,
            Weight::Blocks(_) => frozen_matmul(&rows.contiguous()?, e)?,
        };
        let max = logits.max_keepdim(D::Minus1)?;
        let lse = (logits
            .broadcast_sub(&max)?
            .exp()?
            .sum_keepdim(D::Minus1)?
            .log()?
            + max)?;
        let picked = logits.gather(&targets.narrow(0, start, len)?.unsqueeze(1)?, 1)?;
        parts.push((picked - lse)?.squeeze(1)?);
    }
    Tensor::cat(&parts, 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::max_abs_diff;
    use candle_core::Device;

    /// f32 products at the row counts where the kernel changes (few-row,
    /// row-lanes, gemm) agree with candle's matmul, also for an input that
    /// is a view starting inside its storage.
    #[test]
    fn frozen_matmul_agrees_with_matmul_on_every_kernel() {
        let device = Device::Cpu;
        let (k, n) = (70, 53);
        let w = Tensor::randn(0f32, 1.0, (n, k), &device).unwrap();
        let all = Tensor::randn(0f32, 1.0, (40, k), &device).unwrap();
        for m in [1, 8, 9, 32, 33] {
            for start in [0, 3] {
                let x = all.narrow(0, start, m).unwrap();
                let ours = frozen_matmul(&x, &Weight::Dense(w.clone())).unwrap();
                let plain = x.matmul(&w.t().unwrap()).unwrap();
                let err = max_abs_diff(&ours, &plain);
                assert!(err < 1e-4, "{m} rows from {start}: {err}");
            }
        }
    }

    /// Across several head chunks, the chunked log-probabilities equal the
    /// plain definition.
    #[test]
    fn target_logprobs_match_log_softmax() {
        let device = Device::Cpu;
        let rows = HEAD_CHUNK_ROWS + 37;
        let (hidden, vocab) = (6, 11);
        let h = Tensor::randn(0f64, 1.0, (rows, hidden), &device).unwrap();
        let e = Tensor::randn(0f64, 1.0, (vocab, hidden), &device).unwrap();
        let targets: Vec<u32> = (0..rows as u32).map(|i| (i * 7) % vocab as u32).collect();
        let ours = target_logprobs(&h, &Weight::Dense(e.clone()), &targets).unwrap();
        let logits = h.matmul(&e.t().unwrap()).unwrap();
        let plain = candle_nn::ops::log_softmax(&logits, D::Minus1)
            .unwrap()
            .gather(
                &Tensor::new(targets.as_slice(), &device)
                    .unwrap()
                    .unsqueeze(1)
                    .unwrap(),
                1,
            )
            .unwrap()
            .squeeze(1)
            .unwrap();
        assert!(max_abs_diff(&ours, &plain) < 1e-12);
    }
}
