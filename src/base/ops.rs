//! Ops with hand-written backwards for the differentiable forward pass of
//! [`super::model`] (autograd through the frozen base, as the gradient checks
//! use it; the train step itself has its own backward, `compute::tape`):
//! gradients with respect to activations only, never to the frozen base
//! weights, and fused kernels that keep one tensor for the backward pass
//! instead of a chain of intermediates.
//!
//! candle's matmul backward always forms both operand gradients. For `x·Wᵀ`
//! with a frozen `W` that is one GEMM as large as the forward one, wasted, and
//! a weight-sized gradient per projection held until the backward pass ends. At
//! the LM head it is worse: scoring a token as `log_softmax(h·Eᵀ)[target]` with
//! plain ops materialises several `[tokens, vocab]` tensors (49,152 columns for
//! SmolLM2) and their gradients, and forms the `[hidden, vocab]` gradient of
//! the embedding. [`frozen_matmul`] and [`target_logprobs`] are custom ops with
//! input-only backwards; the head works in row chunks, so its memory does not
//! grow with the number of scored tokens. [`softmax`] keeps only its output for the
//! backward: the plain-op softmax over attention scores kept five score-sized
//! tensors per layer alive until the backward pass.

use candle_core::backend::BackendStorage;
use candle_core::{
    CpuStorage, CustomOp1, CustomOp2, Device, Layout, Result, Shape, Storage, Tensor, D,
};
use rayon::prelude::*;

use super::gemm::{self, Threads};
use super::{few_rows, row_lanes};

/// Scored rows per chunk of the LM head (default 256: a `[256, 49152]` f32
/// logits block is 50 MB).
pub const HEAD_CHUNK_ROWS: usize = 256;

/// `x·Wᵀ` for `x` `[m, in]` and a frozen `w` `[out, in]`. When `x` carries no
/// gradient (generation, scoring) no backward is recorded. On the CPU,
/// contiguous f32 with up to [`few_rows::MAX_ROWS`] rows goes to the few-row
/// kernel, with up to [`row_lanes::MAX_ROWS`] to the row-lanes kernel, the
/// rest to gemm.
pub fn frozen_matmul(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    match (x.device().is_cpu() && !w.track_op(), x.track_op()) {
        (true, true) => x.apply_op2(w, FrozenMatmul),
        (true, false) => x.apply_op2_no_bwd(w, &FrozenMatmul),
        (false, _) => x.matmul(&w.t()?),
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

    fn bwd(
        &self,
        _x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        grad_y: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        Ok((Some(grad_y.matmul(w)?), None))
    }
}

/// `log softmax(h·Eᵀ)[target]` for every row of `h` `[n, hidden]`: the
/// log-probability of each row's target token under the LM head `e`
/// `[vocab, hidden]`. Returns `[n]`; the gradient flows to `h` only.
pub fn target_logprobs(h: &Tensor, e: &Tensor, targets: &[u32]) -> Result<Tensor> {
    let (n, _) = h.dims2()?;
    if targets.len() != n {
        candle_core::bail!("{} targets for {n} rows", targets.len());
    }
    let head = TargetLogprobs {
        head: e.detach(),
        targets: Tensor::new(targets, h.device())?,
    };
    let h = h.contiguous()?;
    if h.track_op() && h.device().is_cpu() {
        h.apply_op1(head)
    } else {
        head.forward(&h.detach())
    }
}

struct TargetLogprobs {
    head: Tensor,
    /// `[n]` u32.
    targets: Tensor,
}

impl TargetLogprobs {
    /// Row chunks of `h` with their targets.
    fn chunks<'a>(&'a self, h: &'a Tensor) -> impl Iterator<Item = Result<(Tensor, Tensor)>> + 'a {
        let n = self.targets.dim(0).unwrap_or(0);
        (0..n).step_by(HEAD_CHUNK_ROWS).map(move |start| {
            let len = HEAD_CHUNK_ROWS.min(n - start);
            Ok((
                h.narrow(0, start, len)?,
                self.targets.narrow(0, start, len)?,
            ))
        })
    }

    fn logits(&self, h: &Tensor) -> Result<Tensor> {
        gemm::matmul(h, &self.head.t()?)
    }

    fn forward(&self, h: &Tensor) -> Result<Tensor> {
        let mut parts = Vec::new();
        for chunk in self.chunks(h) {
            let (h, targets) = chunk?;
            let logits = self.logits(&h)?;
            let max = logits.max_keepdim(D::Minus1)?;
            let lse = (logits
                .broadcast_sub(&max)?
                .exp()?
                .sum_keepdim(D::Minus1)?
                .log()?
                + max)?;
            let picked = logits.gather(&targets.unsqueeze(1)?, 1)?;
            parts.push((picked - lse)?.squeeze(1)?);
        }
        Tensor::cat(&parts, 0)
    }
}

impl CustomOp1 for TargetLogprobs {
    fn name(&self) -> &'static str {
        "target-logprobs"
    }

    fn cpu_fwd(&self, h: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        cpu_storage(&self.forward(&cpu_tensor(h, layout)?)?)
    }

    /// d log p[t] / d logits = onehot(t) − softmax(logits), so
    /// `grad_h = g·(E[t] − softmax(h·Eᵀ)·E)`, recomputed chunk by chunk.
    fn bwd(&self, h: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let h = h.detach();
        let grad = grad.detach();
        let mut parts = Vec::new();
        for (i, chunk) in self.chunks(&h).enumerate() {
            let (h, targets) = chunk?;
            let g = grad
                .narrow(0, i * HEAD_CHUNK_ROWS, h.dim(0)?)?
                .unsqueeze(1)?;
            let probs = candle_nn::ops::softmax_last_dim(&self.logits(&h)?)?;
            let expected = probs.broadcast_mul(&g)?.matmul(&self.head)?;
            let picked = self.head.index_select(&targets, 0)?.broadcast_mul(&g)?;
            parts.push((picked - expected)?);
        }
        Ok(Some(Tensor::cat(&parts, 0)?))
    }
}

/// Softmax over the last axis. On the CPU a tracked pass keeps only its
/// output for the backward: `∂L/∂x = p ⊙ (g − Σⱼ gⱼ·pⱼ)`. candle's fused softmax records no backward, so it serves untracked passes
/// only; a tracked one off the CPU takes plain ops (the max shift is a
/// constant: softmax does not depend on it).
pub fn softmax(x: &Tensor) -> Result<Tensor> {
    match (x.track_op(), x.device().is_cpu()) {
        (true, true) => x.contiguous()?.apply_op1(Softmax),
        (true, false) => {
            let max = x.max_keepdim(D::Minus1)?.detach();
            let e = x.broadcast_sub(&max)?.exp()?;
            e.broadcast_div(&e.sum_keepdim(D::Minus1)?)
        }
        (false, _) => candle_nn::ops::softmax_last_dim(x),
    }
}

struct Softmax;

/// `exp(x − max) / Σ exp(x − max)` over each run of `width` values, in parallel.
macro_rules! softmax_rows {
    ($src:expr, $width:expr, $t:ty) => {{
        let src: &[$t] = $src;
        let mut dst = vec![0 as $t; src.len()];
        src.par_chunks($width)
            .zip(dst.par_chunks_mut($width))
            .for_each(|(x, y)| {
                let max = x.iter().copied().fold(<$t>::NEG_INFINITY, <$t>::max);
                let mut sum = 0 as $t;
                for (x, y) in x.iter().zip(y.iter_mut()) {
                    *y = (*x - max).exp();
                    sum += *y;
                }
                y.iter_mut().for_each(|y| *y /= sum);
            });
        dst
    }};
}

impl CustomOp1 for Softmax {
    fn name(&self) -> &'static str {
        "softmax"
    }

    /// Row by row on the input's own storage: no copy in, none out.
    fn cpu_fwd(&self, x: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let Some((start, end)) = layout.contiguous_offsets() else {
            candle_core::bail!("softmax: input is not contiguous")
        };
        let width = layout.shape().dims().last().copied().unwrap_or(1).max(1);
        let out = match x {
            CpuStorage::F32(v) => CpuStorage::F32(softmax_rows!(&v[start..end], width, f32)),
            CpuStorage::F64(v) => CpuStorage::F64(softmax_rows!(&v[start..end], width, f64)),
            other => candle_core::bail!("softmax: unsupported dtype {:?}", other.dtype()),
        };
        Ok((out, layout.shape().clone()))
    }

    fn bwd(&self, _x: &Tensor, p: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let p = p.detach();
        let dot = (grad * &p)?.sum_keepdim(D::Minus1)?;
        Ok(Some((grad.broadcast_sub(&dot)? * p)?))
    }
}

/// The storage of a tensor computed inside a custom op's CPU forward.
fn cpu_storage(t: &Tensor) -> Result<(CpuStorage, Shape)> {
    let t = t.contiguous()?;
    let shape = t.shape().clone();
    let (storage, layout) = t.storage_and_layout();
    match (&*storage, layout.contiguous_offsets()) {
        (Storage::Cpu(s), Some((0, end))) if end == shape.elem_count() => Ok((s.clone(), shape)),
        _ => candle_core::bail!("custom op: result is not a whole CPU tensor"),
    }
}

/// A contiguous CPU storage region as a tensor without history (a copy).
fn cpu_tensor(storage: &CpuStorage, layout: &Layout) -> Result<Tensor> {
    let Some((start, end)) = layout.contiguous_offsets() else {
        candle_core::bail!("custom op: input is not contiguous")
    };
    let shape = layout.shape().clone();
    let device = Device::Cpu;
    match storage {
        CpuStorage::F32(v) => Tensor::from_slice(&v[start..end], shape, &device),
        CpuStorage::F64(v) => Tensor::from_slice(&v[start..end], shape, &device),
        other => candle_core::bail!("custom op: unsupported dtype {:?}", other.dtype()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::max_abs_diff;
    use candle_core::{DType, Var};

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
                let ours = frozen_matmul(&x, &w).unwrap();
                let plain = x.matmul(&w.t().unwrap()).unwrap();
                let err = max_abs_diff(&ours, &plain);
                assert!(err < 1e-4, "{m} rows from {start}: {err}");
            }
        }
    }

    /// Values and input gradients equal the plain-op definition, across
    /// several head chunks, and the frozen weights receive no gradient.
    #[test]
    fn custom_ops_match_plain_ops_in_value_and_gradient() {
        let device = Device::Cpu;
        let rows = HEAD_CHUNK_ROWS + 37;
        let (hidden, vocab, out) = (6, 11, 5);
        let h = Var::randn(0f64, 1.0, (rows, hidden), &device).unwrap();
        let e = Tensor::randn(0f64, 1.0, (vocab, hidden), &device).unwrap();
        let w = Tensor::randn(0f64, 1.0, (out, hidden), &device).unwrap();
        let targets: Vec<u32> = (0..rows as u32).map(|i| (i * 7) % vocab as u32).collect();
        let weights = Tensor::randn(0f64, 1.0, rows, &device).unwrap();

        let ours = target_logprobs(h.as_tensor(), &e, &targets).unwrap();
        let logits = h.as_tensor().matmul(&e.t().unwrap()).unwrap();
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
        let grad = |loss: Tensor| {
            (&loss * &weights)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap()
        };
        let (g_ours, g_plain) = (grad(ours), grad(plain));
        let dh = |g: &candle_core::backprop::GradStore| g.get(h.as_tensor()).unwrap().clone();
        assert!(max_abs_diff(&dh(&g_ours), &dh(&g_plain)) < 1e-12);
        assert!(g_ours.get(&e).is_none());

        let ours = frozen_matmul(h.as_tensor(), &w).unwrap();
        let plain = h.as_tensor().matmul(&w.t().unwrap()).unwrap();
        assert_eq!(ours.dtype(), DType::F64);
        assert!(max_abs_diff(&ours, &plain) < 1e-12);
        let (g_ours, g_plain) = (grad(ours.sum(1).unwrap()), grad(plain.sum(1).unwrap()));
        assert!(max_abs_diff(&dh(&g_ours), &dh(&g_plain)) < 1e-12);
        assert!(g_ours.get(&w).is_none());

        let ours = softmax(h.as_tensor()).unwrap();
        let plain = {
            let x = h.as_tensor();
            let e = x
                .broadcast_sub(&x.max_keepdim(D::Minus1).unwrap())
                .unwrap()
                .exp()
                .unwrap();
            e.broadcast_div(&e.sum_keepdim(D::Minus1).unwrap()).unwrap()
        };
        assert!(max_abs_diff(&ours, &plain) < 1e-12);
        let mix = Tensor::randn(0f64, 1.0, (rows, hidden), &device).unwrap();
        let (g_ours, g_plain) = (
            grad((ours * &mix).unwrap().sum(1).unwrap()),
            grad((plain * &mix).unwrap().sum(1).unwrap()),
        );
        assert!(max_abs_diff(&dh(&g_ours), &dh(&g_plain)) < 1e-12);
    }
}
