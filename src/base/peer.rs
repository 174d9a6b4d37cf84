//! candle-transformers' Llama built from our model's weights: the independent
//! implementation that the parity tests and `populora bench generate` compare
//! against. It holds the very tensors our forward uses (no copy), and is
//! configured from the `config.json` an HF checkpoint of the model holds.

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use candle_transformers::models::llama;

use super::config::Arch;
use super::error::{Error, Result};
use super::hf;
use super::model::Llama;

pub struct CandleLlama {
    pub model: llama::Llama,
    pub config: llama::Config,
    device: Device,
}

impl CandleLlama {
    /// The peer of `model` (a Llama; candle's `llama` has no Qwen2 biases).
    pub fn new(model: &Llama) -> Result<CandleLlama> {
        if model.config.arch != Arch::Llama {
            return Err(Error::Peer(format!(
                "candle-transformers' llama takes Llama models, not {:?}",
                model.config.arch
            )));
        }
        let config: llama::LlamaConfig = serde_json::from_value(hf::config_json(&model.config))
            .map_err(|e| Error::Peer(format!("it cannot read our config.json: {e}")))?;
        let config = config.into_config(false);
        let device = model.device().clone();
        let tensors: HashMap<String, Tensor> = hf::named_tensors(model)?.into_iter().collect();
        let vb = VarBuilder::from_tensors(tensors, DType::F32, &device);
        Ok(CandleLlama {
            model: llama::Llama::load(vb, &config)?,
            config,
            device,
        })
    }

    /// An empty KV cache for one sequence.
    pub fn cache(&self) -> Result<llama::Cache> {
        Ok(llama::Cache::new(
            true,
            DType::F32,
            &self.config,
            &self.device,
        )?)
    }
}
