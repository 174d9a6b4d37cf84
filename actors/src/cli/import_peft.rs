//! `populora import-peft DIR --out PATH`: a Hugging Face PEFT LoRA as one of
//! our adapters, checked against the base model it will run on.

use std::path::PathBuf;

use anyhow::{bail, Context};
use candle_core::Device;
use clap::Parser;
use populora::base;
use populora::lora::{self, BaseRef};

#[derive(Parser)]
pub struct Args {
    /// PEFT directory (adapter_config.json + adapter_model.safetensors).
    pub dir: PathBuf,
    /// Adapter directory to write (created if absent).
    #[arg(long)]
    pub out: PathBuf,
    /// Base model the adapter must fit: a GGUF file or HF model directory
    /// (default: the cached SmolLM2).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Accept an adapter whose `base_model_name_or_path` names another model
    /// (its shapes must still fit the base).
    #[arg(long)]
    pub allow_other_base: bool,
    /// Replace an adapter already in the output directory.
    #[arg(long)]
    pub force: bool,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let existing = args.out.join(lora::ADAPTER_META);
    if existing.exists() && !args.force {
        bail!("{} exists; pass --force to replace it", existing.display());
    }
    let model = base::resolve_model(args.model.as_deref(), &mut |m| eprintln!("{m}"))?;
    let cfg = base::read_config(&model)?;
    let peft = match lora::import_peft(&args.dir, &cfg, args.allow_other_base, &Device::Cpu) {
        Err(err @ lora::Error::BaseMismatch { .. }) => {
            bail!("{err}; pass --allow-other-base to import it anyway")
        }
        other => other.with_context(|| format!("importing PEFT adapter {}", args.dir.display()))?,
    };
    peft.adapter
        .save(&args.out, &BaseRef::of(&cfg))
        .with_context(|| format!("writing adapter {}", args.out.display()))?;
    println!(
        "wrote {} ({} layers, rank {}, checksum {}) for base {:?}",
        args.out.display(),
        peft.adapter.num_layers(),
        peft.adapter.config.rank,
        peft.adapter.checksum()?,
        cfg.name,
    );
    Ok(())
}
