//! Rank-preserving LoRA weight-space operators: the mutations and crossovers
//! that the Evolution actor uses to spawn offspring.
//!
//! Every operator works on the update ΔW = B·A of each module, never on A and B
//! separately: `(B·M, M⁻¹·A)` is the same adapter for any invertible M, so
//! averaging factors mixes unrelated bases. The machinery ([`lowrank`]) holds the
//! parents' factors side by side and reduces everything to small K×K matrices
//! (K = parents × r): one Gram product per side in, one product per side out, in
//! f64. The child is written in canonical form, B = U·S/c, A = c·Vᵀ with U, V
//! the singular vectors of its ΔW (signed so that the sum of entries of uⱼ and vⱼ
//! is positive) and c = [`lowrank::A_ROW_NORM`], the norm of a Kaiming-uniform
//! row: A keeps its initial scale, so that under Adam an offspring's ΔW moves
//! as fast as its parent's (the balanced split B = U·S^½, A = S^½·Vᵀ shrinks a
//! young adapter's A with √σ and slows it several times over; DESIGN.md §6).
//! The child has the parents' rank and target modules and is never NaN/Inf.
//! Directions that end up with a zero singular value (zero parents, cancelling
//! parents) keep B = 0 and get a fresh Kaiming-uniform A row, as at
//! initialisation, so that they can learn again.
//!
//! DARE and TIES are defined elementwise on ΔW. Done literally they need the
//! dense out×in ΔW of every module and a full SVD to get back to rank r (the
//! dense path that `populora bench evolve` measures). Here they act on the
//! coordinates of each parent's ΔW in one shared orthonormal basis of the
//! parents' column and row spaces (the balanced factors U·S^½, V·S^½ of all parents, stacked,
//! orthonormalised): a 2r×2r matrix per parent and module, the smallest space in
//! which all parents live. That keeps them rank-r, O(r²) per module after the
//! Gram pass, and invariant under re-factorisation; the price is that "an
//! element" is a coordinate in that basis, not an entry of the weight matrix.
//!
//! Modules are independent: they are processed in parallel (rayon), each from
//! its own random stream derived from the caller's `rng` in module order, so the
//! result is the same bit for bit whatever the thread count. Scales: all parents
//! must share one [`LoraConfig`](crate::lora::LoraConfig), and the child keeps it.

mod crossover;
pub mod dense;
pub mod lowrank;
mod mutation;
pub mod select;
mod spec;

use std::collections::BTreeMap;

use candle_core::{Device, Tensor, Var};
use faer::Mat;
use rand::Rng;
use rand_chacha::ChaCha12Rng;
use rayon::prelude::*;

use crate::lora::{Adapter, LoraModule, ModuleKey};
use lowrank::Stack;

pub use spec::{
    operator_names, operators, resolve, LineageRecord, OperatorInfo, OperatorKind, OperatorSpec,
    ParamInfo,
};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("unknown operator `{name}` (known: {known})")]
    UnknownOperator { name: String, known: String },
    #[error("`{name}` is not a {expected:?} operator")]
    WrongKind {
        name: String,
        expected: OperatorKind,
    },
    #[error("operator `{operator}` has no parameter `{param}` (it takes: {known})")]
    UnknownParam {
        operator: &'static str,
        param: String,
        known: String,
    },
    #[error("operator `{operator}`: {param} = {value} is outside [{min}, {max}]")]
    BadParam {
        operator: &'static str,
        param: &'static str,
        value: f64,
        min: f64,
        max: f64,
    },
    #[error("cannot parse operator `{text}`: {problem}")]
    BadSpec { text: String, problem: String },
    #[error("operator `{operator}` needs {needed} parents, got {got}")]
    ParentCount {
        operator: &'static str,
        needed: &'static str,
        got: usize,
    },
    #[error("got {fitness} fitness values for {parents} parents (give one per parent, or none)")]
    FitnessCount { fitness: usize, parents: usize },
    #[error("fitness value {0} is not finite")]
    BadFitness(f64),
    #[error("parents do not match: {0}")]
    Mismatch(String),
    #[error("module {layer}.{target}: {what} contains NaN or Inf")]
    NonFinite {
        layer: usize,
        target: String,
        what: &'static str,
    },
    #[error(
        "module {layer}.{target}: factor shapes {b:?} (B) and {a:?} (A) do not fit rank {rank}"
    )]
    BadShape {
        layer: usize,
        target: String,
        b: Vec<usize>,
        a: Vec<usize>,
        rank: usize,
    },
    #[error("linear algebra failed: {0}")]
    Numerical(String),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

pub type Result<T> = std::result::Result<T, Error>;

/// Combine `parents` into one child with crossover `spec`. `fitness` holds one
/// value per parent (higher is better), or is empty when all are equally fit.
pub fn crossover(
    spec: &OperatorSpec,
    parents: &[&Adapter],
    fitness: &[f64],
    rng: &mut impl Rng,
) -> Result<(Adapter, LineageRecord)> {
    let resolved = spec::resolve(spec, OperatorKind::Crossover)?;
    check_parents(parents)?;
    let fitness = check_fitness(fitness, parents.len())?;
    crossover::run(&resolved, parents, &fitness, rng)
}

/// A mutated copy of `adapter`. Every mutation with strength 0 returns the same
/// ΔW (in canonical form).
pub fn mutate(
    spec: &OperatorSpec,
    adapter: &Adapter,
    rng: &mut impl Rng,
) -> Result<(Adapter, LineageRecord)> {
    let resolved = spec::resolve(spec, OperatorKind::Mutation)?;
    check_parents(&[adapter])?;
    mutation::run(&resolved, adapter, rng)
}

/// One offspring: crossover of `parents`, then a mutation of the child.
pub fn offspring(
    crossover_spec: &OperatorSpec,
    mutation_spec: &OperatorSpec,
    parents: &[&Adapter],
    fitness: &[f64],
    rng: &mut impl Rng,
) -> Result<(Adapter, Vec<LineageRecord>)> {
    let (child, first) = crossover(crossover_spec, parents, fitness, rng)?;
    let (child, second) = mutate(mutation_spec, &child, rng)?;
    Ok((child, vec![first, second]))
}

/// The same adapter (same ΔW per module) in canonical form, the one every
/// offspring is written in: B = U·S/c, A = c·Vᵀ, c = [`lowrank::A_ROW_NORM`].
/// Zero directions are re-initialised from a fixed stream.
pub fn canonicalize(adapter: &Adapter) -> Result<Adapter> {
    check_parents(&[adapter])?;
    let mut rng = crate::rng::stream(0, &["evolve-canonical".into()]);
    map_modules(&[adapter], &mut rng, |_, stack, module_rng| {
        let svd = stack.parent_svd(0)?;
        Ok(stack.child_factors(&svd, module_rng))
    })
}

/// The canonical singular values of every module's ΔW = B·A (scale excluded),
/// largest first: for tests, reports and distances between members.
pub fn singular_values(adapter: &Adapter) -> Result<BTreeMap<ModuleKey, Vec<f64>>> {
    let mut out = BTreeMap::new();
    for (key, module) in &adapter.modules {
        let (b, at) = stacked_factors(key, &[module], adapter.config.rank)?;
        let stack = Stack::new(b, at, adapter.config.rank, 1)?;
        out.insert(*key, stack.parent_svd(0)?.s);
    }
    Ok(out)
}

fn check_fitness(fitness: &[f64], parents: usize) -> Result<Vec<f64>> {
    if fitness.is_empty() {
        return Ok(vec![0.0; parents]);
    }
    if fitness.len() != parents {
        return Err(Error::FitnessCount {
            fitness: fitness.len(),
            parents,
        });
    }
    if let Some(bad) = fitness.iter().find(|f| !f.is_finite()) {
        return Err(Error::BadFitness(*bad));
    }
    Ok(fitness.to_vec())
}

/// All parents share one config, one set of modules, and factor shapes that fit it.
fn check_parents(parents: &[&Adapter]) -> Result<()> {
    let Some(first) = parents.first() else {
        return Ok(());
    };
    for (i, other) in parents.iter().enumerate().skip(1) {
        if other.config != first.config {
            return Err(Error::Mismatch(format!(
                "parent {i} has config {:?}, parent 0 has {:?}",
                other.config, first.config
            )));
        }
        if !other.modules.keys().eq(first.modules.keys()) {
            return Err(Error::Mismatch(format!(
                "parent {i} has different modules than parent 0"
            )));
        }
    }
    for (key, module) in &first.modules {
        let shapes: Vec<_> = parents
            .iter()
            .map(|p| {
                let m = &p.modules[key];
                (
                    m.b.as_tensor().dims().to_vec(),
                    m.a.as_tensor().dims().to_vec(),
                )
            })
            .collect();
        let (b, a) = &shapes[0];
        let rank = first.config.rank;
        if b.len() != 2 || a.len() != 2 || b[1] != rank || a[0] != rank {
            return Err(shape_error(key, module, rank));
        }
        if shapes.iter().any(|s| s != &shapes[0]) {
            return Err(Error::Mismatch(format!(
                "module {}.{} has different shapes across parents: {shapes:?}",
                key.layer, key.target
            )));
        }
    }
    Ok(())
}

fn shape_error(key: &ModuleKey, module: &LoraModule, rank: usize) -> Error {
    Error::BadShape {
        layer: key.layer,
        target: key.target.to_string(),
        b: module.b.as_tensor().dims().to_vec(),
        a: module.a.as_tensor().dims().to_vec(),
        rank,
    }
}

/// The factors of one module of several parents, stacked side by side in f64:
/// B as `out × K` and Aᵀ as `in × K` (K = parents × r, parent i in columns
/// `i·r..(i+1)·r`). Written in one pass: at 7B shape this conversion, not the
/// algebra, is most of an operator's time.
fn stacked_factors(
    key: &ModuleKey,
    modules: &[&LoraModule],
    rank: usize,
) -> Result<(Mat<f64>, Mat<f64>)> {
    let mut bs = Vec::with_capacity(modules.len());
    let mut as_ = Vec::with_capacity(modules.len());
    for module in modules {
        let b_dims = module.b.as_tensor().dims();
        let a_dims = module.a.as_tensor().dims();
        if b_dims.len() != 2 || a_dims.len() != 2 || b_dims[1] != rank || a_dims[0] != rank {
            return Err(shape_error(key, module, rank));
        }
        bs.push(finite_values(key, module.b.as_tensor(), "B")?);
        as_.push(finite_values(key, module.a.as_tensor(), "A")?);
    }
    let out = modules[0].b.as_tensor().dim(0)?;
    let fan_in = modules[0].a.as_tensor().dim(1)?;
    let width = modules.len() * rank;
    // B is row-major [out, r]: column j of parent i is strided; A is row-major
    // [r, in], so column j of Aᵀ is A's row j, contiguous.
    let b = Mat::from_fn(out, width, |row, col| {
        bs[col / rank][row * rank + col % rank] as f64
    });
    let at = Mat::from_fn(fan_in, width, |row, col| {
        as_[col / rank][(col % rank) * fan_in + row] as f64
    });
    Ok((b, at))
}

/// A factor's values (row-major), refused if any is NaN or Inf.
fn finite_values(key: &ModuleKey, t: &Tensor, what: &'static str) -> Result<Vec<f32>> {
    let values: Vec<f32> = t
        .flatten_all()?
        .to_dtype(candle_core::DType::F32)?
        .to_vec1()?;
    if values.iter().any(|v| !v.is_finite()) {
        return Err(Error::NonFinite {
            layer: key.layer,
            target: key.target.to_string(),
            what,
        });
    }
    Ok(values)
}

/// Back to a trainable module: B `[out, r]`, A `[r, in]`, f32 on `device`.
fn mats_to_module(
    key: &ModuleKey,
    b: &Mat<f64>,
    at: &Mat<f64>,
    device: &Device,
) -> Result<LoraModule> {
    let (out, rank, fan_in) = (b.nrows(), b.ncols(), at.nrows());
    let mut b_data = Vec::with_capacity(out * rank);
    for i in 0..out {
        b_data.extend((0..rank).map(|j| b[(i, j)] as f32));
    }
    let mut a_data = Vec::with_capacity(rank * fan_in);
    for j in 0..rank {
        a_data.extend(at.col(j).iter().map(|v| *v as f32));
    }
    for (data, what) in [(&b_data, "child B"), (&a_data, "child A")] {
        if data.iter().any(|v| !v.is_finite()) {
            return Err(Error::NonFinite {
                layer: key.layer,
                target: key.target.to_string(),
                what,
            });
        }
    }
    Ok(LoraModule {
        b: Var::from_vec(b_data, (out, rank), device)?,
        a: Var::from_vec(a_data, (rank, fan_in), device)?,
    })
}

/// A deep copy of a module (a `Var` shares storage with its clones, and the
/// child must not train its parent's weights).
fn copy_module(module: &LoraModule) -> Result<LoraModule> {
    Ok(LoraModule {
        a: Var::from_tensor(&module.a.as_tensor().copy()?)?,
        b: Var::from_tensor(&module.b.as_tensor().copy()?)?,
    })
}

/// Run `op` on every module's stack of parents, in parallel, each module with its
/// own stream drawn from `rng` in module order. `op` returns (B, Aᵀ).
fn map_modules<F>(parents: &[&Adapter], rng: &mut impl Rng, op: F) -> Result<Adapter>
where
    F: Fn(&ModuleKey, &Stack, &mut ChaCha12Rng) -> Result<(Mat<f64>, Mat<f64>)> + Sync,
{
    let first = parents[0];
    let rank = first.config.rank;
    let jobs: Vec<(ModuleKey, u64)> = first.modules.keys().map(|k| (*k, rng.random())).collect();
    let modules = jobs
        .par_iter()
        .map(|(key, seed)| {
            let modules: Vec<&LoraModule> = parents.iter().map(|p| &p.modules[key]).collect();
            let (b, at) = stacked_factors(key, &modules, rank)?;
            let stack = Stack::new(b, at, rank, parents.len())?;
            let mut module_rng = crate::rng::stream(*seed, &["evolve-module".into()]);
            let (b, at) = op(key, &stack, &mut module_rng)?;
            let device = first.modules[key].b.as_tensor().device();
            Ok((*key, mats_to_module(key, &b, &at, device)?))
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Adapter {
        config: first.config.clone(),
        modules: modules.into_iter().collect(),
    })
}

/// A standard normal draw (Box–Muller; one value per two uniforms, so the
/// stream position never depends on a cached second value).
fn standard_normal(rng: &mut impl Rng) -> f64 {
    let u1: f64 = 1.0 - rng.random::<f64>(); // (0, 1]: ln never sees 0
    let u2: f64 = rng.random();
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}
