//! `populora info`: the model's configuration and the cache location.

use std::path::PathBuf;

use clap::Parser;
use populora::base::{self, fetch};

#[derive(Parser)]
pub struct Args {
    /// A GGUF file or HF model directory (default: the cached SmolLM2).
    #[arg(long)]
    pub model: Option<PathBuf>,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let path = base::resolve_model(args.model.as_deref(), &mut |m| eprintln!("{m}"))?;
    let cfg = base::read_config(&path)?;
    println!("cache:  {}", fetch::cache_dir().display());
    println!("model:  {}", path.display());
    println!("{}", serde_json::to_string_pretty(&cfg)?);
    Ok(())
}
