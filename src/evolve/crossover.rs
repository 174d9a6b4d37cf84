//! Crossovers: several parents in, one child of the same rank out.
//!
//! Each crossover chooses a small core (see [`super::lowrank`]) describing the
//! child's ΔW in the span of the parents' factors; the child is the best rank-r
//! approximation of it. `layer_pick` and `clone` copy modules unchanged.

use std::collections::{BTreeMap, BTreeSet};

use faer::Mat;
use rand::Rng;

use super::lowrank::Stack;
use super::spec::{LineageRecord, OperatorKind, Resolved};
use super::{copy_module, map_modules, Error, Result};
use crate::lora::Adapter;

pub(super) fn run(
    resolved: &Resolved,
    parents: &[&Adapter],
    fitness: &[f64],
    rng: &mut impl Rng,
) -> Result<(Adapter, LineageRecord)> {
    let name = resolved.info.name;
    let count = parents.len();
    let require = |needed: &'static str, ok: bool| {
        if ok {
            Ok(())
        } else {
            Err(Error::ParentCount {
                operator: name,
                needed,
                got: count,
            })
        }
    };
    let mut choices = BTreeMap::new();
    let child = match name {
        "average" => {
            require("at least 2", count >= 2)?;
            weighted_sum(parents, vec![1.0 / count as f64; count], rng)?
        }
        "extrapolate" => {
            require("exactly 2", count == 2)?;
            let (fit, other) = fitter_first(fitness);
            choices.insert("fitter".to_string(), vec![fit as f64]);
            let alpha = resolved.get("alpha");
            let mut weights = vec![0.0; 2];
            weights[fit] = 1.0 + alpha;
            weights[other] = -alpha;
            weighted_sum(parents, weights, rng)?
        }
        "fitness_weighted" => {
            require("at least 2", count >= 2)?;
            let weights = softmax_of_standardised(fitness, resolved.get("temperature"));
            choices.insert("weights".to_string(), weights.clone());
            weighted_sum(parents, weights, rng)?
        }
        "subspace_mix" => {
            require("exactly 2", count == 2)?;
            let (fit, other) = fitter_first(fitness);
            choices.insert("fitter".to_string(), vec![fit as f64]);
            let rank = parents[0].config.rank;
            let keep = ((resolved.get("keep") * rank as f64).round() as usize).min(rank);
            map_modules(parents, rng, |_, stack, rng| {
                let leading = stack.parent_svd(fit)?.core(0..keep);
                let trailing = stack.parent_svd(other)?.core(keep..rank);
                let svd = stack.svd_of_core((leading + trailing).as_ref())?;
                Ok(stack.child_factors(&svd, rng))
            })?
        }
        "dare" => {
            require("at least 2", count >= 2)?;
            let drop = resolved.get("drop");
            map_modules(parents, rng, |_, stack, rng| {
                merge_coordinates(stack, rng, |coordinates, rng| dare(coordinates, drop, rng))
            })?
        }
        "ties" => {
            require("at least 2", count >= 2)?;
            let density = resolved.get("density");
            let rank = parents[0].config.rank;
            map_modules(parents, rng, |_, stack, rng| {
                merge_coordinates(stack, rng, |coordinates, _| {
                    ties(coordinates, density, rank)
                })
            })?
        }
        "layer_pick" => {
            require("at least 2", count >= 2)?;
            let layers: BTreeSet<usize> = parents[0].modules.keys().map(|k| k.layer).collect();
            let picks: BTreeMap<usize, usize> = layers
                .into_iter()
                .map(|layer| (layer, rng.random_range(0..count)))
                .collect();
            choices.insert(
                "layer_parent".to_string(),
                picks.values().map(|&p| p as f64).collect(),
            );
            copy_modules(parents, |layer| picks[&layer])?
        }
        "clone" => {
            require("at least 1", count >= 1)?;
            let best = fittest(fitness);
            choices.insert("parent".to_string(), vec![best as f64]);
            copy_modules(parents, |_| best)?
        }
        other => {
            return Err(Error::Numerical(format!(
                "crossover `{other}` is registered but not implemented"
            )))
        }
    };
    let record = LineageRecord {
        kind: OperatorKind::Crossover,
        operator: resolved.spec(),
        parents: count,
        fitness: fitness.to_vec(),
        choices,
    };
    Ok((child, record))
}

/// Best rank-r approximation of `Σ wᵢ·ΔWᵢ`, module by module.
fn weighted_sum(parents: &[&Adapter], weights: Vec<f64>, rng: &mut impl Rng) -> Result<Adapter> {
    map_modules(parents, rng, |_, stack, rng| {
        let svd = stack.svd_of_core(stack.weighted_core(&weights).as_ref())?;
        Ok(stack.child_factors(&svd, rng))
    })
}

/// Merge the parents' coordinates in their shared basis with `merge`, then
/// truncate the merged update to rank r.
fn merge_coordinates(
    stack: &Stack,
    rng: &mut rand_chacha::ChaCha12Rng,
    merge: impl Fn(&[Mat<f64>], &mut rand_chacha::ChaCha12Rng) -> Mat<f64>,
) -> Result<(Mat<f64>, Mat<f64>)> {
    let joint = stack.joint_coordinates()?;
    let merged = merge(&joint.coordinates, rng);
    let svd = stack.svd_of_core(joint.core(merged.as_ref()).as_ref())?;
    Ok(stack.child_factors(&svd, rng))
}

/// DARE: each coordinate of each parent survives with probability 1 − drop and
/// is rescaled by 1/(1 − drop); the survivors are averaged over parents.
fn dare(coordinates: &[Mat<f64>], drop: f64, rng: &mut impl Rng) -> Mat<f64> {
    let (rows, cols) = (coordinates[0].nrows(), coordinates[0].ncols());
    let weight = 1.0 / (coordinates.len() as f64 * (1.0 - drop));
    let mut merged = Mat::zeros(rows, cols);
    for c in coordinates {
        for j in 0..cols {
            for i in 0..rows {
                if rng.random::<f64>() >= drop {
                    merged[(i, j)] += weight * c[(i, j)];
                }
            }
        }
    }
    merged
}

/// TIES: trim each parent to its largest-magnitude coordinates (the top
/// `density` fraction, never fewer than `rank`, so a rank-r parent survives
/// intact in its own singular basis), elect each coordinate's sign by the sum
/// of the trimmed values, and average only the values that agree with it.
fn ties(coordinates: &[Mat<f64>], density: f64, rank: usize) -> Mat<f64> {
    let (rows, cols) = (coordinates[0].nrows(), coordinates[0].ncols());
    let numel = rows * cols;
    let keep = ((density * numel as f64).ceil() as usize)
        .max(rank)
        .min(numel);
    let trimmed: Vec<Vec<f64>> = coordinates
        .iter()
        .map(|c| {
            let values: Vec<f64> = c.col_iter().flat_map(|col| col.iter().copied()).collect();
            let mut order: Vec<usize> = (0..numel).collect();
            order.sort_by(|&x, &y| values[y].abs().total_cmp(&values[x].abs()).then(x.cmp(&y)));
            let mut kept = vec![0.0; numel];
            for &i in order.iter().take(keep) {
                kept[i] = values[i];
            }
            kept
        })
        .collect();
    Mat::from_fn(rows, cols, |i, j| {
        let index = j * rows + i;
        let elected = trimmed.iter().map(|t| t[index]).sum::<f64>().signum();
        let agreeing: Vec<f64> = trimmed
            .iter()
            .map(|t| t[index])
            .filter(|v| *v != 0.0 && v.signum() == elected)
            .collect();
        if agreeing.is_empty() {
            0.0
        } else {
            agreeing.iter().sum::<f64>() / agreeing.len() as f64
        }
    })
}

/// Index of the fittest parent (the first on ties).
fn fittest(fitness: &[f64]) -> usize {
    let mut best = 0;
    for (i, f) in fitness.iter().enumerate() {
        if *f > fitness[best] {
            best = i;
        }
    }
    best
}

/// (fitter, other) of two parents; parent 0 counts as fitter on ties.
fn fitter_first(fitness: &[f64]) -> (usize, usize) {
    if fitness[1] > fitness[0] {
        (1, 0)
    } else {
        (0, 1)
    }
}

/// Softmax of `(f − mean)/std / temperature`; equal weights when all fitness
/// values are equal.
fn softmax_of_standardised(fitness: &[f64], temperature: f64) -> Vec<f64> {
    let n = fitness.len() as f64;
    let mean = fitness.iter().sum::<f64>() / n;
    let std = (fitness.iter().map(|f| (f - mean).powi(2)).sum::<f64>() / n).sqrt();
    let z: Vec<f64> = fitness
        .iter()
        .map(|f| {
            if std > 0.0 {
                (f - mean) / std / temperature
            } else {
                0.0
            }
        })
        .collect();
    let top = z.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let exps: Vec<f64> = z.iter().map(|v| (v - top).exp()).collect();
    let total: f64 = exps.iter().sum();
    exps.iter().map(|e| e / total).collect()
}

/// A child made of copies of whole modules: layer l from parent `source(l)`.
fn copy_modules(parents: &[&Adapter], source: impl Fn(usize) -> usize) -> Result<Adapter> {
    let modules = parents[0]
        .modules
        .keys()
        .map(|key| Ok((*key, copy_module(&parents[source(key.layer)].modules[key])?)))
        .collect::<Result<BTreeMap<_, _>>>()?;
    Ok(Adapter {
        config: parents[0].config.clone(),
        modules,
    })
}
