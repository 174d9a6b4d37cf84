//! The shape of a Llama-family model, whichever file it came from.

use serde::{Deserialize, Serialize};

/// The architectures our forward implements. Qwen2 is Llama plus q/k/v biases.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Arch {
    Llama,
    Qwen2,
}

/// Where the frozen weights came from. It matters for one thing only: GGUF files
/// store q/k rows permuted for interleaved RoPE, and we un-permute them on load so
/// that every tensor we hold (and every adapter trained on it) is in HF layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Source {
    Gguf,
    HuggingFace,
    /// Random weights built in memory (speed measurements of a shape).
    Random,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    pub arch: Arch,
    pub name: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rope_theta: f64,
    pub rms_norm_eps: f64,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
}

impl ModelConfig {
    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// Whether q/k/v projections carry a bias (Qwen2).
    pub fn attention_bias(&self) -> bool {
        self.arch == Arch::Qwen2
    }

    /// Multiply-accumulate count of one token through every linear layer
    /// (attention scores excluded), used to turn tokens/s into FLOP/s.
    pub fn linear_params(&self) -> usize {
        let h = self.hidden_size;
        let attn = h * self.q_dim() * 2 + h * self.kv_dim() * 2;
        let mlp = 3 * h * self.intermediate_size;
        self.num_layers * (attn + mlp) + h * self.vocab_size
    }
}
