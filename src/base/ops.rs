//! The frozen base's two products with kernels of their own: a projection
//! `x·Wᵀ` (chosen by row count: the few-row kernel, the row-lanes kernel,
//! gemm) and the LM head's log-probability of one target token per row,
//! formed in row chunks so that scoring never holds all `[tokens, vocab]`
//! logits at once (49,152 columns for SmolLM2). Neither records a gradient:
//! the train step's backward is written out in `compute::tape`.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, Layout, Result, Shape, Tensor, D};

use super::gemm::{self, Threads};
use super::{few_rows, row_lanes};

/// Scored rows per chunk of the LM head (default 256: a `[256, 49152]` f32
/// logits block is 50 MB).
pub const HEAD_CHUNK_ROWS: usize = 256;

/// `x·Wᵀ` for `x` `[m, in]` and a frozen `w` `[out, in]`. On the CPU,
/// contiguous f32 with up to [`few_rows::MAX_ROWS`] rows goes to the few-row
/// kernel, with up to [`row_lanes::MAX_ROWS`] to the row-lanes kernel, the
/// rest to gemm.
pub fn frozen_matmul(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    if x.device().is_cpu() {
        x.apply_op2_no_bwd(w, &FrozenMatmul)
    } else {
        x.matmul(&w.t()?)
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

/// `log softmax(h·Eᵀ)[target]` for every row of `h` `[n, hidden]`: the
/// log-probability of each row's target token under the LM head `e`
/// `[vocab, hidden]`. Returns `[n]`.
pub fn target_logprobs(h: &Tensor, e: &Tensor, targets: &[u32]) -> Result<Tensor> {
    let (n, _) = h.dims2()?;
    if targets.len() != n {
        candle_core::bail!("{} targets for {n} rows", targets.len());
    }
    let targets = Tensor::new(targets, h.device())?;
    let mut parts = Vec::new();
    for start in (0..n).step_by(HEAD_CHUNK_ROWS) {
        let len = HEAD_CHUNK_ROWS.min(n - start);
        let logits = gemm::matmul(&h.narrow(0, start, len)?, &e.t()?)?;
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
                let ours = frozen_matmul(&x, &w).unwrap();
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
        let ours = target_logprobs(&h, &e, &targets).unwrap();
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
