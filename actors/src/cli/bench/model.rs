//! Which model the model benchmarks (`bench generate`, `bench broker`) run,
//! and where.

use std::path::PathBuf;

use populora::base::{self, BaseModel};

#[derive(clap::Args)]
pub struct BenchModel {
    /// A GGUF file or HF model directory (default: the default model, fetched on first use).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// `cpu`, `cuda` or `cuda:N` (`cuda` needs a build with `--features cuda`).
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Random weights in the default model's shape, built in memory: for speed
    /// only, on a machine that cannot fetch the model (replies are not text).
    #[arg(long, conflicts_with = "model")]
    pub random_weights: bool,
}

impl BenchModel {
    /// The model on its device. The device is checked first, so a bad one
    /// fails before anything loads.
    pub fn load(&self) -> anyhow::Result<BaseModel> {
        let device = base::device::open(&self.device)?;
        let base = if self.random_weights {
            let (model, vocab) = base::tiny::build(&base::tiny::TinySpec::default_model_shape())?;
            BaseModel {
                model,
                tokenizer: vocab.tokenizer()?,
                source: base::Source::Random,
                path: PathBuf::from("random-weights"),
            }
        } else {
            crate::cli::generate::load_model(self.model.as_deref())?
        };
        Ok(base.to_device(&device)?)
    }
}
