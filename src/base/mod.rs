//! The frozen base model: loading (GGUF and HF safetensors), tokenizer and chat
//! format, the Llama-family forward with a LoRA hook and KV cache, fetching the
//! default model into the cache, and tiny random models for tests.

pub mod blocks;
mod chat;
mod config;
mod decode_attention;
pub mod device;
mod error;
pub mod fetch;
pub mod few_rows;
pub mod gemm;
pub mod gguf;
pub mod hf;
pub(crate) mod kernels;
mod model;
pub mod native;
pub(crate) mod ops;
#[cfg(feature = "peer")]
pub mod peer;
pub mod row_lanes;
pub mod target;
pub mod tiny;
mod tokenizer;
pub(crate) mod unpack;
mod weight;

use std::path::{Path, PathBuf};

pub use chat::{ChatTemplate, Message};
pub use config::{Arch, ModelConfig, Source};
pub use error::{Error, Result};
pub use model::{
    rms_norm, Block, BlockActivations, BlockContext, KvCache, Linear, Llama, Logits, LoraHook,
    LoraKept, NoLora, Positions,
};
pub use target::Target;
pub use tokenizer::{byte_to_char, Tokenizer};
pub use weight::{Weight, WeightsSetting};

/// A loaded base: weights, tokenizer, and where they came from.
#[derive(Debug, Clone)]
pub struct BaseModel {
    pub model: Llama,
    pub tokenizer: Tokenizer,
    pub source: Source,
    pub path: PathBuf,
}

impl BaseModel {
    /// Load a GGUF file or an HF model directory, its matrices kept as
    /// `weights` says.
    pub fn load(path: &Path, weights: WeightsSetting) -> Result<BaseModel> {
        let (source, (model, tokenizer)) = if path.is_dir() {
            (Source::HuggingFace, hf::load(path, weights)?)
        } else {
            check_gguf(path)?;
            (Source::Gguf, gguf::load(path, weights)?)
        };
        Ok(BaseModel {
            model,
            tokenizer,
            source,
            path: path.to_path_buf(),
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.model.config
    }

    /// The same base with its weights on `device`.
    pub fn to_device(self, device: &candle_core::Device) -> Result<BaseModel> {
        Ok(BaseModel {
            model: self.model.to_device(device)?,
            ..self
        })
    }
}

/// The configuration of a GGUF file or HF directory, without loading weights.
pub fn read_config(path: &Path) -> Result<ModelConfig> {
    if path.is_dir() {
        hf::read_config(path)
    } else {
        check_gguf(path)?;
        gguf::read_config(path)
    }
}

fn check_gguf(path: &Path) -> Result<()> {
    if !path.exists() {
        return Err(Error::io(path)(std::io::ErrorKind::NotFound.into()));
    }
    if !gguf::is_gguf(path) {
        return Err(Error::bad_file(
            path,
            "neither a GGUF file (no GGUF magic) nor an HF model directory",
        ));
    }
    Ok(())
}

/// The model at `path`, or the default model (fetched on first use) when `None`.
pub fn resolve_model(path: Option<&Path>, progress: &mut dyn FnMut(&str)) -> Result<PathBuf> {
    match path {
        Some(p) => Ok(p.to_path_buf()),
        None => fetch::DEFAULT_MODEL.ensure(progress),
    }
}
