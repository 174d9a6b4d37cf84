//! `populora export --adapter DIR --peft OUTDIR`: one of our adapters as a
//! Hugging Face PEFT LoRA (`adapter_config.json` + `adapter_model.safetensors`).

use std::path::PathBuf;

use anyhow::{bail, Context};
use candle_core::Device;
use clap::Parser;
use populora::lora::{self, Adapter};

#[derive(Parser)]
pub struct Args {
    /// Adapter directory (adapter.json + adapter.safetensors).
    #[arg(long)]
    pub adapter: PathBuf,
    /// Directory to write the PEFT adapter into (created if absent).
    #[arg(long)]
    pub peft: PathBuf,
    /// `base_model_name_or_path` to record (default: the Hugging Face repo id
    /// of the adapter's base: `HuggingFaceTB/SmolLM2-135M-Instruct` for the
    /// default model, `config.json`'s `_name_or_path` for an HF directory).
    #[arg(long)]
    pub base_name: Option<String>,
    /// Replace a PEFT adapter already in the output directory.
    #[arg(long)]
    pub force: bool,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let existing = args.peft.join(lora::PEFT_TENSORS);
    if existing.exists() && !args.force {
        bail!("{} exists; pass --force to replace it", existing.display());
    }
    let (adapter, base) = Adapter::load(&args.adapter, &Device::Cpu)
        .with_context(|| format!("reading adapter {}", args.adapter.display()))?;
    let base_name = args.base_name.unwrap_or_else(|| base.hf_name().to_string());
    lora::export_peft(&adapter, &base_name, &args.peft)
        .with_context(|| format!("writing PEFT adapter {}", args.peft.display()))?;
    println!(
        "wrote {} ({} layers, targets {:?}, rank {}, alpha {}, base {base_name:?})",
        args.peft.display(),
        adapter.num_layers(),
        adapter
            .config
            .targets
            .iter()
            .map(|t| t.hf_name())
            .collect::<Vec<_>>(),
        adapter.config.rank,
        adapter.config.alpha,
    );
    Ok(())
}
