//! `populora adapter new`: a fresh adapter, made exactly as a run makes a
//! member's first one; `populora adapter info`: what an adapter directory
//! (ours or PEFT's) holds.

use std::path::PathBuf;

use anyhow::{bail, Context};
use candle_core::Device;
use clap::{Parser, Subcommand};
use populora::base;
use populora::base::Target;
use populora::lora::{self, Adapter, AdapterDir, BaseRef, LoraConfig};
use serde_json::json;

#[derive(Subcommand)]
pub enum Command {
    /// Make a fresh adapter as a run makes a member's: A Kaiming-uniform from
    /// the stream keyed (seed, "init", member), B zero (so it changes nothing yet).
    New(NewArgs),
    /// Print an adapter's rank, alpha, targets, base, checksum and the norms
    /// of every module (ours or a PEFT directory).
    Info(InfoArgs),
}

#[derive(Parser)]
pub struct NewArgs {
    /// Rank r of every factor pair.
    #[arg(long, default_value_t = 8)]
    pub rank: usize,
    /// Scaling numerator: ΔW = B·A·alpha/r.
    #[arg(long, default_value_t = 16.0)]
    pub alpha: f64,
    /// Target projections, comma-separated: q, k, v, o, gate, up, down (or q_proj, ...).
    #[arg(long, default_value = "q,k,v,o,gate,up,down")]
    pub targets: String,
    /// rsLoRA scaling alpha/√r instead of alpha/r.
    #[arg(long)]
    pub rslora: bool,
    /// The run seed whose initialisation to reproduce.
    #[arg(long)]
    pub seed: u64,
    /// The member whose first adapter to make (with a run's seed and LoRA
    /// settings, e.g. `teacher-0`, it is that member's adapter before step 1).
    #[arg(long, default_value = "adapter")]
    pub member: String,
    /// Adapter directory to write (created if absent).
    #[arg(long)]
    pub out: PathBuf,
    /// The base the adapter is for: a GGUF file or HF model directory
    /// (default: the cached SmolLM2). Only its configuration is read.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Replace an adapter already in the output directory.
    #[arg(long)]
    pub force: bool,
}

#[derive(Parser)]
pub struct InfoArgs {
    /// An adapter directory: ours (adapter.json) or PEFT's (adapter_config.json).
    pub dir: PathBuf,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

pub fn run(command: Command) -> anyhow::Result<()> {
    match command {
        Command::New(args) => new(args),
        Command::Info(args) => info(args),
    }
}

/// `q,v,gate_proj` → targets, refusing unknown names.
fn parse_targets(list: &str) -> anyhow::Result<Vec<Target>> {
    list.split(',')
        .map(str::trim)
        .filter(|name| !name.is_empty())
        .map(|name| {
            Target::parse(name).with_context(|| {
                format!("unknown target `{name}` (known: q, k, v, o, gate, up, down)")
            })
        })
        .collect()
}

fn new(args: NewArgs) -> anyhow::Result<()> {
    let existing = args.out.join(lora::ADAPTER_META);
    if existing.exists() && !args.force {
        bail!("{} exists; pass --force to replace it", existing.display());
    }
    let config = LoraConfig {
        rank: args.rank,
        alpha: args.alpha,
        targets: parse_targets(&args.targets)?,
        use_rslora: args.rslora,
    };
    config.check()?;
    let path = base::resolve_model(args.model.as_deref(), &mut |m| eprintln!("{m}"))?;
    let cfg = base::read_config(&path).with_context(|| format!("reading {}", path.display()))?;
    let adapter = Adapter::for_member(config, &cfg, args.seed, &args.member, &Device::Cpu)?;
    adapter
        .save(&args.out, &BaseRef::of(&cfg))
        .with_context(|| format!("writing adapter {}", args.out.display()))?;
    println!(
        "wrote {} (member {:?}, seed {}, {} layers, rank {}, checksum {}) for base {}",
        args.out.display(),
        args.member,
        args.seed,
        adapter.num_layers(),
        adapter.config.rank,
        adapter.checksum()?,
        lora::model_label(&cfg),
    );
    Ok(())
}

fn info(args: InfoArgs) -> anyhow::Result<()> {
    let read = AdapterDir::read(&args.dir, &Device::Cpu)
        .with_context(|| format!("reading adapter {}", args.dir.display()))?;
    let adapter = &read.adapter;
    let config = &adapter.config;
    let scale = adapter.scale();
    let mut modules = Vec::with_capacity(adapter.modules.len());
    for (key, module) in &adapter.modules {
        let norms = module.norms()?;
        modules.push(json!({
            "module": key.to_string(),
            "a": norms.a,
            "b": norms.b,
            "delta_w": scale * norms.delta,
        }));
    }
    let value = json!({
        "dir": args.dir.display().to_string(),
        "format": read.format.name(),
        "rank": config.rank,
        "alpha": config.alpha,
        "use_rslora": config.use_rslora,
        "scale": scale,
        "targets": config.targets.iter().map(|t| t.hf_name()).collect::<Vec<_>>(),
        "layers": adapter.num_layers(),
        "base": {
            "name": read.base.name,
            "hf_name": read.base.hf_name(),
            "fingerprint": read.base.fingerprint,
        },
        "checksum": adapter.checksum()?,
        "modules": modules,
    });
    if args.json {
        println!("{}", serde_json::to_string_pretty(&value)?);
    } else {
        print_info(&value);
    }
    Ok(())
}

/// The text form of [`info`]'s JSON.
fn print_info(v: &serde_json::Value) {
    let targets: Vec<&str> = v["targets"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|t| t.as_str())
        .collect();
    let base = &v["base"];
    let fingerprint = base["fingerprint"].as_str().unwrap_or("not recorded");
    println!(
        "adapter      {} ({} format)",
        v["dir"].as_str().unwrap_or(""),
        v["format"].as_str().unwrap_or("")
    );
    println!("rank         {}", v["rank"]);
    println!(
        "alpha        {} (scale {}{})",
        v["alpha"],
        v["scale"],
        if v["use_rslora"] == true {
            ", rsLoRA"
        } else {
            ""
        }
    );
    println!("targets      {}", targets.join(", "));
    println!("layers       {}", v["layers"]);
    println!(
        "base         {} (PEFT name {}), shape fingerprint {fingerprint}",
        base["name"], base["hf_name"]
    );
    println!("checksum     {}", v["checksum"].as_str().unwrap_or(""));
    println!(
        "{:<24} {:>12} {:>12} {:>12}",
        "module", "|A|", "|B|", "|ΔW|"
    );
    for m in v["modules"].as_array().into_iter().flatten() {
        println!(
            "{:<24} {:>12.5} {:>12.5} {:>12.5}",
            m["module"].as_str().unwrap_or(""),
            m["a"].as_f64().unwrap_or(f64::NAN),
            m["b"].as_f64().unwrap_or(f64::NAN),
            m["delta_w"].as_f64().unwrap_or(f64::NAN),
        );
    }
}
