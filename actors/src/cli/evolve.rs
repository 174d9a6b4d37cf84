//! `populora evolve`: apply one evolution operator to saved adapters;
//! `populora bench evolve`: one offspring at Qwen2.5-7B shape vs the dense path.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context};
use candle_core::Device;
use populora::base::Target;
use populora::base::{Arch, ModelConfig};
use populora::evolve::{self, OperatorKind, OperatorSpec};
use populora::keyed_stream;
use populora::lora::{Adapter, LoraConfig, LoraModule, ModuleKey};
use rand::Rng;

#[derive(clap::Args)]
pub struct Args {
    /// Operator, optionally with parameters: `dare` or `dare:drop=0.3`.
    #[arg(long, required_unless_present = "list")]
    pub op: Option<String>,
    /// Adapter directories (saved with `Adapter::save`): one for a mutation,
    /// two or more for a crossover.
    #[arg(long, num_args = 1.., required_unless_present = "list")]
    pub parents: Vec<PathBuf>,
    /// One fitness value per parent (higher is better); default all equal.
    #[arg(long, num_args = 1..)]
    pub fitness: Vec<f64>,
    /// Directory for the child adapter.
    #[arg(long, required_unless_present = "list")]
    pub out: Option<PathBuf>,
    /// Seed of the operator's random stream.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// List the operators and their parameters, then exit.
    #[arg(long)]
    pub list: bool,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    if args.list {
        print_operators();
        return Ok(());
    }
    let (Some(op), Some(out)) = (args.op, args.out) else {
        bail!("--op and --out are required");
    };
    let spec = OperatorSpec::parse(&op)?;
    let mut parents = Vec::new();
    let mut base = None;
    for dir in &args.parents {
        let (adapter, parent_base) = Adapter::load(dir, &Device::Cpu)
            .with_context(|| format!("loading {}", dir.display()))?;
        if base.as_ref().is_some_and(|b| *b != parent_base) {
            bail!(
                "{} was made for a different base model than {}",
                dir.display(),
                args.parents[0].display()
            );
        }
        base = Some(parent_base);
        parents.push(adapter);
    }
    let Some(base) = base else {
        bail!("--parents is empty");
    };
    let kind = evolve::operators()
        .iter()
        .find(|o| o.name == spec.name)
        .map(|o| o.kind)
        .with_context(|| {
            format!(
                "unknown operator `{}` (known: {})",
                spec.name,
                evolve::operator_names().join(", ")
            )
        })?;
    let mut rng = keyed_stream!(args.seed, "evolve-cli");
    let (child, record) = match kind {
        OperatorKind::Mutation => {
            if parents.len() != 1 {
                bail!(
                    "mutation `{}` takes exactly one parent, got {}",
                    spec.name,
                    parents.len()
                );
            }
            evolve::mutate(&spec, &parents[0], &mut rng)?
        }
        OperatorKind::Crossover => {
            let refs: Vec<&Adapter> = parents.iter().collect();
            evolve::crossover(&spec, &refs, &args.fitness, &mut rng)?
        }
    };
    child
        .save(&out, &base)
        .with_context(|| format!("saving {}", out.display()))?;
    println!("{}", serde_json::to_string(&record)?);
    Ok(())
}

fn print_operators() {
    for op in evolve::operators() {
        println!("{} ({:?}): {}", op.name, op.kind, op.doc);
        for p in op.params {
            println!(
                "    {} = {} in [{}, {}]: {}",
                p.name, p.default, p.min, p.max, p.doc
            );
        }
    }
}

#[derive(clap::Args)]
pub struct BenchArgs {
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
    /// Skip the dense path (minutes at this shape).
    #[arg(long)]
    pub skip_dense: bool,
}

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
fn random_adapter(model: &ModelConfig, rank: usize, seed: u64) -> anyhow::Result<Adapter> {
    let config = LoraConfig {
        rank,
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

pub fn bench(args: BenchArgs) -> anyhow::Result<()> {
    const RANK: usize = 16;
    let model = qwen7b();
    let parents = [
        random_adapter(&model, RANK, 1)?,
        random_adapter(&model, RANK, 2)?,
    ];
    let refs: Vec<&Adapter> = parents.iter().collect();
    let crossover = OperatorSpec::parse(&args.crossover)?;
    let mutation = OperatorSpec::parse(&args.mutation)?;
    let mut times = Vec::new();
    for run in 0..args.repeats.max(1) {
        let mut rng = keyed_stream!(run as u64, "bench-evolve");
        let started = Instant::now();
        let (child, _) = evolve::offspring(&crossover, &mutation, &refs, &[0.4, 0.6], &mut rng)?;
        times.push(started.elapsed().as_secs_f64() * 1e3);
        drop(child);
    }
    times.sort_by(f64::total_cmp);
    let offspring_ms = times[times.len() / 2];
    let mut value = serde_json::json!({
        "offspring_ms": offspring_ms,
        "offspring_runs_ms": times,
        "crossover": args.crossover,
        "mutation": args.mutation,
        "shape": {
            "model": "Qwen2.5-7B", "layers": model.num_layers, "hidden": model.hidden_size,
            "ffn": model.intermediate_size, "kv_dim": model.kv_dim(), "targets": 7,
            "rank": RANK, "dtype": "f32",
        },
        "threads": rayon_threads(),
    });
    if !args.skip_dense {
        let (dense_ms, per_shape) = dense_estimate(&parents, RANK)?;
        value["dense_ms"] = dense_ms.into();
        value["ratio"] = (dense_ms / offspring_ms).into();
        value["dense_per_module_s"] = per_shape;
        value["dense_method"] = "ΔW average formed densely in f64 + full thin SVD (faer, 1 thread) + rank-16 truncation, \
            timed once per distinct module shape on layer 0 and extrapolated to all 196 modules, divided by 2 for \
            ideal 2-core scaling; the mutation is not counted"
            .into();
    }
    super::bench::report(args.json, &value);
    Ok(())
}

/// The dense path's time for the whole adapter, extrapolated from one module of
/// each distinct shape (time depends on the shape only), with ideal scaling over
/// the cores the offspring path used.
fn dense_estimate(parents: &[Adapter; 2], rank: usize) -> anyhow::Result<(f64, serde_json::Value)> {
    let mut per_shape: Vec<((usize, usize), f64)> = Vec::new();
    let mut total = 0.0;
    let mut report = serde_json::Map::new();
    for (key, module) in &parents[0].modules {
        let shape = (
            module.b.as_tensor().dims()[0],
            module.a.as_tensor().dims()[1],
        );
        let seconds = match per_shape.iter().find(|(s, _)| *s == shape) {
            Some((_, seconds)) => *seconds,
            None => {
                let seconds = time_dense(key, [module, &parents[1].modules[key]], rank)?;
                report.insert(
                    format!("{}x{} ({})", shape.0, shape.1, key.target),
                    seconds.into(),
                );
                per_shape.push((shape, seconds));
                seconds
            }
        };
        total += seconds;
    }
    let threads = rayon_threads() as f64;
    Ok((total * 1e3 / threads, report.into()))
}

fn time_dense(key: &ModuleKey, modules: [&LoraModule; 2], rank: usize) -> anyhow::Result<f64> {
    eprintln!("dense path: module {key} ...");
    let (_, seconds) = evolve::dense::weighted_sum_module(key, &modules, &[0.5, 0.5], rank)?;
    Ok(seconds)
}

fn rayon_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}
