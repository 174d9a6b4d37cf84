//! The dense reference paths: form each module's out×in ΔW, then get back to
//! rank r by a full SVD (exact) or a randomized one (approximate, far
//! cheaper). What the stacked-factor operators avoid; kept for the benchmark
//! that measures the difference (and as an independent check).

use std::time::Instant;

use faer::{Mat, MatRef};

use super::lowrank::A_ROW_NORM;
use super::{mats_to_module, stacked_factors, standard_normal, Error, Result};
use crate::lora::{LoraModule, ModuleKey};

/// How the dense path truncates ΔW to rank r.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Truncation {
    /// A full thin SVD of ΔW.
    FullSvd,
    /// A randomized range finder with power iterations (Halko, Martinsson &
    /// Tropp 2011, Algorithms 4.4 and 5.1): r + `oversample` Gaussian probes
    /// from a ChaCha stream of `seed`, `power_iterations` rounds of ΔW·ΔWᵀ
    /// with QR between products, then the SVD of the small projected matrix.
    Randomized {
        oversample: usize,
        power_iterations: usize,
        seed: u64,
    },
}

/// Rank-`rank` approximation of `Σ wᵢ·Bᵢ·Aᵢ` through the dense matrix, in
/// the children's canonical form (B = U·S/c, Aᵀ = V·c, c = [`A_ROW_NORM`]). Also returns the seconds spent
/// after the factors were read (forming ΔW included).
pub fn weighted_sum_module(
    key: &ModuleKey,
    modules: &[&LoraModule],
    weights: &[f64],
    rank: usize,
    truncation: Truncation,
) -> Result<(LoraModule, f64)> {
    let (b, at) = stacked_factors(key, modules, rank)?;
    let started = Instant::now();
    let (out, fan_in) = (b.nrows(), at.nrows());
    // One product, k = parents × r: ΔW = (B·diag(w))·Aᵀ.
    let weighted_b = Mat::from_fn(out, b.ncols(), |i, j| b[(i, j)] * weights[j / rank]);
    let dense = &weighted_b * at.transpose();
    let numerical = |e| Error::Numerical(format!("dense SVD of module {key}: {e:?}"));
    let (u, s, v) = match truncation {
        Truncation::FullSvd => {
            let svd = dense.thin_svd().map_err(numerical)?;
            let s: Vec<f64> = svd.S().column_vector().iter().copied().collect();
            (svd.U().to_owned(), s, svd.V().to_owned())
        }
        Truncation::Randomized {
            oversample,
            power_iterations,
            seed,
        } => {
            let width = (rank + oversample).min(out).min(fan_in);
            let q = range_finder(dense.as_ref(), width, power_iterations, seed);
            // ΔW ≈ Q·(QᵀΔW): the SVD of the small width × in matrix gives ΔW's.
            let svd = (q.transpose() * &dense).thin_svd().map_err(numerical)?;
            let s: Vec<f64> = svd.S().column_vector().iter().copied().collect();
            (&q * svd.U(), s, svd.V().to_owned())
        }
    };
    let b = Mat::from_fn(out, rank, |i, j| u[(i, j)] * s[j] / A_ROW_NORM);
    let at = Mat::from_fn(fan_in, rank, |i, j| v[(i, j)] * A_ROW_NORM);
    let seconds = started.elapsed().as_secs_f64();
    let device = modules[0].b.as_tensor().device();
    Ok((mats_to_module(key, &b, &at, device)?, seconds))
}

/// An orthonormal `out × width` basis that nearly holds ΔW's range.
fn range_finder(
    dense: MatRef<'_, f64>,
    width: usize,
    power_iterations: usize,
    seed: u64,
) -> Mat<f64> {
    let mut rng = crate::rng::stream(seed, &["randomized-svd".into()]);
    let probes = Mat::from_fn(dense.ncols(), width, |_, _| standard_normal(&mut rng));
    let orthonormal = |m: Mat<f64>| m.qr().compute_thin_Q();
    let mut q = orthonormal(dense * &probes);
    for _ in 0..power_iterations {
        let z = orthonormal(dense.transpose() * &q);
        q = orthonormal(dense * &z);
    }
    q
}

/// ‖Σ wᵢ·ΔWᵢ‖_F of modules of one shape and rank (ΔW = B·A, without the
/// adapter's scale), in f64, from the r×r blocks of the factors' Gram
/// matrices: ΔW itself is never formed.
pub fn frobenius_of_sum(key: &ModuleKey, modules: &[&LoraModule], weights: &[f64]) -> Result<f64> {
    let rank = modules[0].b.as_tensor().dim(1)?;
    let (b, at) = stacked_factors(key, modules, rank)?;
    let (gram_b, gram_a) = (b.transpose() * &b, at.transpose() * &at);
    // ‖B·D·Aᵀ‖² = tr(D·BᵀB·D·AᵀA) with D = diag(w), both Grams symmetric.
    let mut sum = 0.0;
    for row in 0..b.ncols() {
        for col in 0..b.ncols() {
            let w = weights[row / rank] * weights[col / rank];
            sum += w * gram_b[(row, col)] * gram_a[(row, col)];
        }
    }
    Ok(sum.max(0.0).sqrt())
}
