//! [`Target`]: the linear projections of a Llama block, by their HF names
//! and shapes. Adapters attach to them; the architecture defines them.

use serde::{Deserialize, Serialize};

use super::ModelConfig;

/// A linear projection of a Llama block that an adapter can target.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Target {
    Q,
    K,
    V,
    O,
    Gate,
    Up,
    Down,
}

impl Target {
    pub const ALL: [Target; 7] = [
        Target::Q,
        Target::K,
        Target::V,
        Target::O,
        Target::Gate,
        Target::Up,
        Target::Down,
    ];

    /// The HF/PEFT module name (`q_proj`, ..., `down_proj`).
    pub fn hf_name(self) -> &'static str {
        match self {
            Target::Q => "q_proj",
            Target::K => "k_proj",
            Target::V => "v_proj",
            Target::O => "o_proj",
            Target::Gate => "gate_proj",
            Target::Up => "up_proj",
            Target::Down => "down_proj",
        }
    }

    /// `self_attn` or `mlp`: the HF parent module of this projection.
    pub fn hf_parent(self) -> &'static str {
        match self {
            Target::Q | Target::K | Target::V | Target::O => "self_attn",
            Target::Gate | Target::Up | Target::Down => "mlp",
        }
    }

    /// Parse `q`, `q_proj`, `gate`, `gate_proj`, ...
    pub fn parse(name: &str) -> Option<Target> {
        let short = name.strip_suffix("_proj").unwrap_or(name);
        Target::ALL
            .into_iter()
            .find(|t| t.hf_name().strip_suffix("_proj") == Some(short))
    }

    /// `(in_features, out_features)` of this projection in `cfg`.
    pub fn dims(self, cfg: &ModelConfig) -> (usize, usize) {
        let h = cfg.hidden_size;
        match self {
            Target::Q => (h, cfg.q_dim()),
            Target::K | Target::V => (h, cfg.kv_dim()),
            Target::O => (cfg.q_dim(), h),
            Target::Gate | Target::Up => (h, cfg.intermediate_size),
            Target::Down => (cfg.intermediate_size, h),
        }
    }
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.hf_name())
    }
}
