//! `populora bench evolve`: one offspring (crossover + mutation) at
//! Qwen2.5-7B adapter shape on the rank-preserving low-rank path, against the
//! dense paths that form each module's ΔW and truncate it by a full or a
//! randomized SVD.

use std::time::Instant;

use candle_core::Device;
use populora::base::Target;
use populora::base::{Arch, ModelConfig};
use populora::evolve::dense::{self, Truncation};
use populora::evolve::{self, OperatorSpec};
use populora::keyed_stream;
use populora::lora::{Adapter, LoraConfig};
use rand::Rng;
use serde_json::json;

#[derive(clap::Args)]
pub struct Args {
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
    /// The offspring's crossover.
    #[arg(long, default_value = "average")]
    pub crossover: String,
    /// The offspring's mutation.
    #[arg(long, default_value = "svd_noise")]
    pub mutation: String,
    /// Timed offspring runs (the median is reported).
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// Skip the full-SVD dense path (minutes at this shape); the randomized
    /// SVD (seconds) still runs.
    #[arg(long, alias = "skip-dense")]
    pub skip_full_svd: bool,
    /// Extra probes of the randomized SVD beyond the rank.
    #[arg(long, default_value_t = 10)]
    pub oversample: usize,
    /// Power iterations of the randomized SVD.
    #[arg(long, default_value_t = 2)]
    pub power_iterations: usize,
}

const RANK: usize = 16;

/// Qwen2.5-7B: 28 layers, hidden 3584, FFN 18944, 28 heads of 128, 4 KV heads.
fn qwen7b() -> ModelConfig {
    ModelConfig {
        arch: Arch::Qwen2,
        name: "Qwen2.5-7B (shape only)".to_string(),
        vocab_size: 152064,
        hidden_size: 3584,
        intermediate_size: 18944,
        num_layers: 28,
        num_heads: 28,
        num_kv_heads: 4,
        head_dim: 128,
        rope_theta: 1_000_000.0,
        rms_norm_eps: 1e-6,
        max_position_embeddings: 32768,
        tie_word_embeddings: false,
    }
}

/// A trained-looking adapter: A Kaiming-uniform, B uniform ±0.01 (not zero, or
/// every operator would have nothing to do).
fn random_adapter(model: &ModelConfig, seed: u64) -> anyhow::Result<Adapter> {
    let config = LoraConfig {
        rank: RANK,
        alpha: 32.0,
        targets: Target::ALL.to_vec(),
        use_rslora: false,
    };
    let mut rng = keyed_stream!(seed, "bench-evolve-adapter");
    let mut adapter = Adapter::new(config, model, &mut rng, &Device::Cpu)?;
    for module in adapter.modules.values_mut() {
        let (out, r) = module.b.as_tensor().dims2()?;
        let b: Vec<f32> = (0..out * r)
            .map(|_| rng.random_range(-0.01f32..0.01))
            .collect();
        module
            .b
            .set(&candle_core::Tensor::from_vec(b, (out, r), &Device::Cpu)?)?;
    }
    Ok(adapter)
}

/// Median milliseconds of `repeats` runs of `f(run)`.
fn median_ms(
    repeats: usize,
    mut f: impl FnMut(u64) -> anyhow::Result<()>,
) -> anyhow::Result<(f64, Vec<f64>)> {
    let mut times = Vec::new();
    for run in 0..repeats.max(1) {
        let started = Instant::now();
        f(run as u64)?;
        times.push(started.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(f64::total_cmp);
    Ok((times[times.len() / 2], times))
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let model = qwen7b();
    let parents = [random_adapter(&model, 1)?, random_adapter(&model, 2)?];
    let refs: Vec<&Adapter> = parents.iter().collect();
    let crossover = OperatorSpec::parse(&args.crossover)?;
    let mutation = OperatorSpec::parse(&args.mutation)?;
    let (offspring_ms, offspring_runs) = median_ms(args.repeats, |run| {
        let mut rng = keyed_stream!(run, "bench-evolve");
        evolve::offspring(&crossover, &mutation, &refs, &[0.4, 0.6], &mut rng)?;
        Ok(())
    })?;
    // The low-rank path of exactly what the dense paths compute: the average.
    let average = OperatorSpec::new("average");
    let mut low_rank = None;
    let (average_ms, _) = median_ms(args.repeats, |run| {
        let mut rng = keyed_stream!(run, "bench-evolve-average");
        low_rank = Some(evolve::crossover(&average, &refs, &[], &mut rng)?.0);
        Ok(())
    })?;
    let low_rank = low_rank.expect("median_ms runs at least once");
    let mut value = json!({
        "offspring_ms": offspring_ms,
        "offspring_runs_ms": offspring_runs,
        "crossover": args.crossover,
        "mutation": args.mutation,
        "average_ms": average_ms,
        "shape": {
            "model": "Qwen2.5-7B", "layers": model.num_layers, "hidden": model.hidden_size,
            "ffn": model.intermediate_size, "kv_dim": model.kv_dim(), "targets": 7,
            "rank": RANK, "dtype": "f32",
        },
        "threads": threads(),
        "dense_method": "ΔW average formed densely in f64, then truncated to rank 16 (faer, 1 thread), \
            timed once per distinct module shape on layer 0 and extrapolated to all 196 modules, divided by \
            the thread count for ideal scaling; compared with `average_ms` (the low-rank average alone). \
            Over those modules, the largest gap = ‖ΔW_dense − ΔW_low-rank‖_F / ‖ΔW_low-rank‖_F and the \
            largest excess = ‖ΔW − ΔW_dense‖_F / ‖ΔW − ΔW_low-rank‖_F − 1 (ΔW the untruncated average; \
            the low-rank result is the best rank-16 approximation, so 0 is optimal)",
    });
    let randomized = Truncation::Randomized {
        oversample: args.oversample,
        power_iterations: args.power_iterations,
        seed: 0,
    };
    let mut paths = vec![("randomized_svd", randomized)];
    if !args.skip_full_svd {
        paths.push(("full_svd", Truncation::FullSvd));
    }
    for (name, truncation) in paths {
        let estimate = dense_estimate(&parents, &low_rank, truncation)?;
        value[format!("{name}_ms")] = estimate.ms.into();
        value[format!("{name}_over_average")] = (estimate.ms / average_ms).into();
        value[format!("{name}_gap")] = estimate.gap.into();
        value[format!("{name}_excess")] = estimate.excess.into();
        value[format!("{name}_per_module_s")] = estimate.per_shape;
    }
    value["randomized_svd"] = json!({
        "probes": RANK + args.oversample,
        "oversample": args.oversample,
        "power_iterations": args.power_iterations,
    });
    super::report(args.json, &value);
    Ok(())
}

struct DenseEstimate {
    /// The whole adapter, extrapolated.
    ms: f64,
    /// The largest relative gap to the low-rank child over the modules timed.
    gap: f64,
    /// The largest excess truncation error over the low-rank child's.
    excess: f64,
    /// Seconds, gap and excess per distinct module shape.
    per_shape: serde_json::Value,
}

/// The dense path's time for the whole adapter, extrapolated from one module
/// of each distinct shape on layer 0 (time depends on the shape only), with
/// ideal scaling over the cores the low-rank path used.
fn dense_estimate(
    parents: &[Adapter; 2],
    low_rank: &Adapter,
    truncation: Truncation,
) -> anyhow::Result<DenseEstimate> {
    let mut timed: Vec<((usize, usize), f64)> = Vec::new();
    let (mut total, mut gap, mut excess) = (0.0, 0.0f64, 0.0f64);
    let mut per_shape = serde_json::Map::new();
    for (key, module) in &parents[0].modules {
        let shape = (module.b.as_tensor().dim(0)?, module.a.as_tensor().dim(1)?);
        if let Some((_, seconds)) = timed.iter().find(|(s, _)| *s == shape) {
            total += seconds;
            continue;
        }
        eprintln!("dense path ({truncation:?}): module {key} ...");
        let modules = [module, &parents[1].modules[key]];
        let (child, seconds) =
            dense::weighted_sum_module(key, &modules, &[0.5, 0.5], RANK, truncation)?;
        let low_rank = &low_rank.modules[key];
        let module_gap = dense::frobenius_of_sum(key, &[&child, low_rank], &[1.0, -1.0])?
            / dense::frobenius_of_sum(key, &[low_rank], &[1.0])?;
        let residual = |truncated| {
            let terms = [modules[0], modules[1], truncated];
            dense::frobenius_of_sum(key, &terms, &[0.5, 0.5, -1.0])
        };
        let module_excess = residual(&child)? / residual(low_rank)? - 1.0;
        gap = gap.max(module_gap);
        excess = excess.max(module_excess);
        per_shape.insert(
            format!("{}x{} ({})", shape.0, shape.1, key.target),
            json!({ "s": seconds, "gap": module_gap, "excess": module_excess }),
        );
        timed.push((shape, seconds));
        total += seconds;
    }
    Ok(DenseEstimate {
        ms: total * 1e3 / threads() as f64,
        gap,
        excess,
        per_shape: per_shape.into(),
    })
}

fn threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}
