//! What each part of the engine takes from a scenario: the one place where
//! scenario sections become the engine's own settings types.

use super::{Scenario, TinyModelSection};
use crate::base::tiny::TinySpec;
use crate::base::Arch;
use crate::lora::AdamWConfig;
use crate::verify::{Limits, SandboxConfig};

impl Scenario {
    /// The adapters' shape and scale (`[lora]`).
    pub fn adapter_config(&self) -> crate::lora::LoraConfig {
        crate::lora::LoraConfig {
            rank: self.lora.rank,
            alpha: self.lora.alpha,
            targets: self.lora.targets.clone(),
            use_rslora: self.lora.rslora,
        }
    }

    /// Every member's optimizer (`[training]`).
    pub fn adamw_config(&self) -> AdamWConfig {
        let t = &self.training;
        AdamWConfig {
            lr: t.lr,
            beta1: t.beta1,
            beta2: t.beta2,
            eps: t.eps,
            weight_decay: t.weight_decay,
        }
    }

    /// The verifier's pool (`[verifier]`).
    pub fn sandbox_config(&self) -> SandboxConfig {
        SandboxConfig {
            workers: self.verifier.workers,
            limits: Limits {
                timeout_ms: self.verifier.timeout_ms,
                memory_mb: self.verifier.memory_mb,
                ..Limits::default()
            },
            ..SandboxConfig::default()
        }
    }
}

impl TinyModelSection {
    /// The random model `[model.tiny]` describes.
    pub fn spec(&self) -> TinySpec {
        TinySpec {
            arch: Arch::Llama,
            layers: self.layers,
            hidden: self.hidden,
            heads: self.heads,
            kv_heads: self.kv_heads,
            ffn: self.ffn,
            vocab: self.vocab,
            max_positions: self.max_positions,
            seed: self.seed,
            ..TinySpec::default()
        }
    }
}
