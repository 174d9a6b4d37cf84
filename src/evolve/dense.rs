//! The dense reference path: form each module's out×in ΔW, take a full SVD,
//! truncate to rank r. What the stacked-factor operators avoid; kept for the
//! benchmark that measures the difference (and as an independent check).

use std::time::Instant;

use faer::Mat;

use super::{mats_to_module, stacked_factors, Error, Result};
use crate::lora::{LoraModule, ModuleKey};

/// Best rank-`rank` approximation of `Σ wᵢ·Bᵢ·Aᵢ` through the dense matrix and
/// a full (thin) SVD, in canonical form. Also returns the seconds spent.
pub fn weighted_sum_module(
    key: &ModuleKey,
    modules: &[&LoraModule],
    weights: &[f64],
    rank: usize,
) -> Result<(LoraModule, f64)> {
    let (b, at) = stacked_factors(key, modules, rank)?;
    let started = Instant::now();
    let (out, fan_in) = (b.nrows(), at.nrows());
    let mut dense = Mat::<f64>::zeros(out, fan_in);
    for (i, w) in weights.iter().enumerate() {
        let columns = i * rank..(i + 1) * rank;
        let (b_i, at_i) = (b.get(.., columns.clone()), at.get(.., columns));
        dense += faer::Scale(*w) * (b_i * at_i.transpose());
    }
    let svd = dense
        .thin_svd()
        .map_err(|e| Error::Numerical(format!("dense SVD of module {key}: {e:?}")))?;
    let s: Vec<f64> = svd.S().column_vector().iter().copied().collect();
    let b = Mat::from_fn(out, rank, |i, j| svd.U()[(i, j)] * s[j].sqrt());
    let at = Mat::from_fn(fan_in, rank, |i, j| svd.V()[(i, j)] * s[j].sqrt());
    let seconds = started.elapsed().as_secs_f64();
    let device = modules[0].b.as_tensor().device();
    Ok((mats_to_module(key, &b, &at, device)?, seconds))
}
