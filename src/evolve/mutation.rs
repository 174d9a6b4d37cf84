//! Mutations: one adapter in, one perturbed adapter of the same rank out.
//!
//! Every mutation starts from the SVD of each module's ΔW, so the noise means
//! the same thing however the parent happened to be factored. `svd_noise` and
//! `mask` act only on the r×r singular structure; `gaussian`, `layer_gaussian`
//! and `neftune` add elementwise noise to the balanced factors U·S^½, V·S^½
//! (the frame their strength is defined in), and the noisy ΔW is then written
//! in the child split like every other child's (see [`super::lowrank::A_ROW_NORM`]).

use std::collections::{BTreeMap, BTreeSet};

use faer::Mat;
use rand::Rng;

use super::lowrank::{Stack, StackSvd, A_ROW_NORM};
use super::spec::{LineageRecord, OperatorKind, Resolved};
use super::{map_modules, standard_normal, Error, Result};
use crate::lora::Adapter;

pub(super) fn run(
    resolved: &Resolved,
    adapter: &Adapter,
    rng: &mut impl Rng,
) -> Result<(Adapter, LineageRecord)> {
    let mut choices = BTreeMap::new();
    let child = match resolved.info.name {
        "svd_noise" => {
            let (sigma, angle) = (resolved.get("sigma"), resolved.get("angle"));
            map_modules(&[adapter], rng, |_, stack, rng| {
                let mut svd = stack.parent_svd(0)?;
                perturb_spectrum(&mut svd, sigma, angle, rng);
                Ok(stack.child_factors(&svd, rng))
            })?
        }
        "mask" => {
            let fraction = resolved.get("fraction");
            map_modules(&[adapter], rng, |_, stack, rng| {
                let svd = stack.parent_svd(0)?;
                // Masked directions keep their A row (alive, at its usual
                // scale) and lose their B column, as at initialisation.
                let b_scale: Vec<f64> = svd
                    .s
                    .iter()
                    .map(|&s| {
                        if rng.random::<f64>() < fraction {
                            0.0
                        } else {
                            s / A_ROW_NORM
                        }
                    })
                    .collect();
                let a_scale = vec![A_ROW_NORM; svd.rank()];
                Ok(stack.factors(&svd, &b_scale, &a_scale, rng))
            })?
        }
        "gaussian" => {
            let sigma = resolved.get("sigma");
            noisy_factors(
                adapter,
                rng,
                |_| true,
                |rng, _| sigma * standard_normal(rng),
            )?
        }
        "layer_gaussian" => {
            let sigma = resolved.get("sigma");
            let layers = pick_layers(adapter, resolved.get("fraction"), rng);
            choices.insert(
                "layers".to_string(),
                layers.iter().map(|&l| l as f64).collect(),
            );
            noisy_factors(
                adapter,
                rng,
                |layer| layers.contains(&layer),
                |rng, _| sigma * standard_normal(rng),
            )?
        }
        "neftune" => {
            let alpha = resolved.get("alpha");
            noisy_factors(
                adapter,
                rng,
                |_| true,
                |rng, numel| alpha / (numel as f64).sqrt() * rng.random_range(-1.0..=1.0),
            )?
        }
        other => return Err(not_implemented(other)),
    };
    let record = LineageRecord {
        kind: OperatorKind::Mutation,
        operator: resolved.spec(),
        parents: 1,
        fitness: Vec::new(),
        choices,
    };
    Ok((child, record))
}

/// The registry and this match list the same names; reaching this is a bug.
fn not_implemented(name: &str) -> Error {
    Error::Numerical(format!(
        "mutation `{name}` is registered but not implemented"
    ))
}

/// Log-normal noise on the live singular values and a random rotation of the
/// live left and right singular vectors (a different one for each side).
fn perturb_spectrum(svd: &mut StackSvd, sigma: f64, angle: f64, rng: &mut impl Rng) {
    let live: Vec<usize> = (0..svd.rank()).filter(|&j| svd.is_live(j)).collect();
    for &j in &live {
        svd.s[j] *= (sigma * standard_normal(rng)).exp();
    }
    for basis in [&mut svd.p, &mut svd.q] {
        let rotation = random_rotation(live.len(), angle, rng);
        let block = Mat::from_fn(basis.nrows(), live.len(), |r, c| basis[(r, live[c])]);
        let rotated = &block * &rotation;
        for (c, &j) in live.iter().enumerate() {
            for r in 0..basis.nrows() {
                basis[(r, j)] = rotated[(r, c)];
            }
        }
    }
}

/// `exp(K)` for a random skew-symmetric K with entries of std `angle/√n`: an
/// exact rotation, the identity when `angle` is 0.
fn random_rotation(n: usize, angle: f64, rng: &mut impl Rng) -> Mat<f64> {
    let gaussian = Mat::from_fn(n, n, |_, _| standard_normal(rng));
    let scale = angle / (2.0 * n.max(1) as f64).sqrt();
    let skew = Mat::from_fn(n, n, |r, c| scale * (gaussian[(r, c)] - gaussian[(c, r)]));
    expm(&skew)
}

/// Matrix exponential by scaling and squaring with a Taylor series; plenty for
/// the small, well-scaled generators used here.
fn expm(m: &Mat<f64>) -> Mat<f64> {
    const TAYLOR_TERMS: usize = 16;
    let n = m.nrows();
    let norm = m.norm_l2();
    let halvings = if norm > 0.25 {
        (norm / 0.25).log2().ceil() as i32
    } else {
        0
    };
    let scaled = Mat::from_fn(n, n, |r, c| m[(r, c)] / 2f64.powi(halvings));
    let mut result = Mat::<f64>::identity(n, n);
    let mut term = Mat::<f64>::identity(n, n);
    for k in 1..=TAYLOR_TERMS {
        term = &term * &scaled;
        term = Mat::from_fn(n, n, |r, c| term[(r, c)] / k as f64);
        result += &term;
    }
    for _ in 0..halvings {
        result = &result * &result;
    }
    result
}

/// `ceil(fraction × layers)` distinct layers, chosen uniformly (partial Fisher–Yates).
fn pick_layers(adapter: &Adapter, fraction: f64, rng: &mut impl Rng) -> BTreeSet<usize> {
    let mut layers: Vec<usize> = adapter
        .modules
        .keys()
        .map(|k| k.layer)
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    let count = ((fraction * layers.len() as f64).ceil() as usize).min(layers.len());
    for i in 0..count {
        let j = rng.random_range(i..layers.len());
        layers.swap(i, j);
    }
    layers.into_iter().take(count).collect()
}

/// Elementwise noise on the balanced factors of the modules of the selected
/// layers, `x += noise(rng, numel) × std(x)` with std over the factor's
/// elements, then the noisy ΔW = B·A in the child split (one more Gram pass
/// per side: the noise's meaning stays that of the balanced split, the child's
/// A its initial scale). Other modules keep their ΔW.
fn noisy_factors(
    adapter: &Adapter,
    rng: &mut impl Rng,
    selected: impl Fn(usize) -> bool + Sync,
    noise: impl Fn(&mut rand_chacha::ChaCha12Rng, usize) -> f64 + Sync,
) -> Result<Adapter> {
    map_modules(&[adapter], rng, |key, stack: &Stack, rng| {
        let svd = stack.parent_svd(0)?;
        if !selected(key.layer) {
            return Ok(stack.child_factors(&svd, rng));
        }
        let (mut b, mut at) = stack.balanced_factors(&svd, rng);
        add_noise(&mut b, rng, &noise);
        add_noise(&mut at, rng, &noise);
        let noisy = Stack::new(b, at, stack.rank, 1)?;
        Ok(noisy.child_factors(&noisy.parent_svd(0)?, rng))
    })
}

fn add_noise(
    x: &mut Mat<f64>,
    rng: &mut rand_chacha::ChaCha12Rng,
    noise: &impl Fn(&mut rand_chacha::ChaCha12Rng, usize) -> f64,
) {
    let numel = x.nrows() * x.ncols();
    if numel == 0 {
        return;
    }
    let mean = x.col_iter().flat_map(|c| c.iter().copied()).sum::<f64>() / numel as f64;
    let variance = x
        .col_iter()
        .flat_map(|c| c.iter().map(move |v| (v - mean) * (v - mean)))
        .sum::<f64>()
        / numel as f64;
    let std = variance.sqrt();
    for j in 0..x.ncols() {
        for i in 0..x.nrows() {
            x[(i, j)] += std * noise(rng, numel);
        }
    }
}
