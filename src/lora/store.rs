//! Our own adapter format: a directory holding `adapter.safetensors` (F32
//! tensors keyed `layers.{N}.{q_proj}.lora_A` / `.lora_B`) and `adapter.json`
//! (format version, `LoraConfig`, the base model it was made for, and a
//! SHA-256 content checksum). Loading verifies the checksum and the shapes.
//!
//! The checksum covers the config and every factor's F32 bytes in module order,
//! so two adapters with the same checksum apply the same update; the journal
//! records it for every member at every step.

use std::collections::BTreeMap;
use std::path::Path;

use candle_core::{Device, Tensor, Var};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::error::{Error, Result};
use super::files::{f32_bytes, read_json, read_safetensors, to_json_bytes, write_atomically};
use super::shape::{FACTOR_A, FACTOR_B};
use super::{Adapter, LoraConfig, LoraModule, ModuleKey};
use crate::base::fetch::{hex, ModelIdentity, KNOWN_MODELS};
use crate::base::ModelConfig;

pub const ADAPTER_TENSORS: &str = "adapter.safetensors";
pub const ADAPTER_META: &str = "adapter.json";
const FORMAT: &str = "populora-adapter";
const FORMAT_VERSION: u32 = 1;

/// The base model an adapter was made for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BaseRef {
    /// The model's name as its loader reports it (or as a PEFT file states it).
    pub name: String,
    /// [`shape_fingerprint`] of the base, when it was known at save time.
    pub fingerprint: Option<String>,
}

impl BaseRef {
    pub fn of(cfg: &ModelConfig) -> BaseRef {
        BaseRef {
            name: cfg.name.clone(),
            fingerprint: Some(shape_fingerprint(cfg)),
        }
    }

    /// A base known only by name (a PEFT file's `base_model_name_or_path`).
    pub fn named(name: &str) -> BaseRef {
        BaseRef {
            name: name.to_string(),
            fingerprint: None,
        }
    }

    /// Whether this is plausibly `cfg`: the same shape fingerprint, if one was
    /// recorded, and a name of the same model ([`names_model`]).
    pub fn check(&self, cfg: &ModelConfig) -> Result<()> {
        let fingerprint_differs = self
            .fingerprint
            .as_ref()
            .is_some_and(|f| *f != shape_fingerprint(cfg));
        if fingerprint_differs || !names_model(&self.name, cfg) {
            return Err(Error::BaseMismatch {
                expected: model_label(cfg),
                found: self.name.clone(),
            });
        }
        Ok(())
    }

    /// The name PEFT and transformers load this base by (PEFT's
    /// `base_model_name_or_path`): the Hugging Face repo id of a known model
    /// ([`known_model`]; the default model's GGUF names itself otherwise),
    /// else the name as recorded, which for a Hugging Face directory is its
    /// `config.json`'s `_name_or_path`.
    pub fn hf_name(&self) -> &str {
        known_model(&self.name, self.fingerprint.as_deref()).map_or(&self.name, |m| m.hf_repo)
    }
}

/// The known model (`base::fetch::KNOWN_MODELS`) that `name` names, if its
/// shape is `fingerprint` (when given).
pub fn known_model(name: &str, fingerprint: Option<&str>) -> Option<&'static ModelIdentity> {
    KNOWN_MODELS.iter().find(|m| {
        fingerprint.is_none_or(|f| f == m.fingerprint)
            && m.names().any(|known| same_model_name(known, name))
    })
}

/// Whether `name` names the model `cfg`: the same name ([`same_model_name`]),
/// or two names of one known model whose shape `cfg` has (so a PEFT file's
/// `HuggingFaceTB/SmolLM2-135M-Instruct` names the GGUF that calls itself
/// `Smollm2 135M 8k Lc100K Mix1 Ep2`, and `HuggingFaceTB/SmolLM2-135M`,
/// another model of the same shape, does not).
pub fn names_model(name: &str, cfg: &ModelConfig) -> bool {
    if same_model_name(name, &cfg.name) {
        return true;
    }
    let fingerprint = shape_fingerprint(cfg);
    match (
        known_model(name, Some(&fingerprint)),
        known_model(&cfg.name, Some(&fingerprint)),
    ) {
        (Some(a), Some(b)) => a.hf_repo == b.hf_repo,
        _ => false,
    }
}

/// `cfg`'s name for messages, with its Hugging Face repo id when it is a
/// known model under another name.
pub fn model_label(cfg: &ModelConfig) -> String {
    match known_model(&cfg.name, Some(&shape_fingerprint(cfg))) {
        Some(m) if m.hf_repo != cfg.name => format!("{:?} ({})", cfg.name, m.hf_repo),
        _ => format!("{:?}", cfg.name),
    }
}

/// Model names compare equal when their last path component agrees ignoring
/// case and punctuation, so `HuggingFaceTB/SmolLM2-135M-Instruct` (HF),
/// `SmolLM2 135M Instruct` (GGUF metadata) and `smollm2-135m-instruct` match.
pub fn same_model_name(a: &str, b: &str) -> bool {
    fn normal(name: &str) -> String {
        let last = name
            .trim_end_matches('/')
            .rsplit('/')
            .next()
            .unwrap_or(name);
        last.chars()
            .filter(|c| c.is_alphanumeric())
            .flat_map(char::to_lowercase)
            .collect()
    }
    let (a, b) = (normal(a), normal(b));
    !a.is_empty() && a == b
}

/// SHA-256 (first 16 hex digits) of the base's shape: architecture, vocabulary,
/// widths, layer and head counts. Loading the same model from GGUF or HF
/// safetensors gives the same fingerprint.
pub fn shape_fingerprint(cfg: &ModelConfig) -> String {
    let arch = serde_json::to_string(&cfg.arch).unwrap_or_default();
    let text = format!(
        "arch={arch} vocab={} hidden={} ffn={} layers={} heads={} kv_heads={} head_dim={}",
        cfg.vocab_size,
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.num_layers,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim
    );
    hex(&Sha256::digest(text.as_bytes()))[..16].to_string()
}

#[derive(Debug, Serialize, Deserialize)]
struct AdapterMeta {
    format: String,
    version: u32,
    lora: LoraConfig,
    base: BaseRef,
    num_layers: usize,
    checksum: String,
}

impl Adapter {
    /// SHA-256 (hex) over the config (targets as a set) and every factor's
    /// shape and F32 bytes, in module order.
    pub fn checksum(&self) -> Result<String> {
        let mut h = Sha256::new();
        h.update(b"populora-adapter-v1");
        h.update((self.config.rank as u64).to_le_bytes());
        h.update(self.config.alpha.to_bits().to_le_bytes());
        h.update([u8::from(self.config.use_rslora)]);
        let mut targets = self.config.targets.clone();
        targets.sort();
        targets.dedup();
        h.update((targets.len() as u64).to_le_bytes());
        for target in targets {
            hash_str(&mut h, target.hf_name());
        }
        for (key, module) in &self.modules {
            h.update((key.layer as u64).to_le_bytes());
            hash_str(&mut h, key.target.hf_name());
            hash_tensor(&mut h, module.a.as_tensor())?;
            hash_tensor(&mut h, module.b.as_tensor())?;
        }
        Ok(hex(&h.finalize()))
    }

    /// Writes the adapter into `dir` (created if absent). The adapter is
    /// checked first, and both files are replaced atomically (see `files`).
    pub fn save(&self, dir: &Path, base: &BaseRef) -> Result<()> {
        self.check_consistent()?;
        let mut tensors = BTreeMap::new();
        for (key, module) in &self.modules {
            tensors.insert(tensor_key(*key, FACTOR_A), module.a.as_tensor().clone());
            tensors.insert(tensor_key(*key, FACTOR_B), module.b.as_tensor().clone());
        }
        let meta = AdapterMeta {
            format: FORMAT.into(),
            version: FORMAT_VERSION,
            lora: self.config.clone(),
            base: base.clone(),
            num_layers: self.num_layers(),
            checksum: self.checksum()?,
        };
        let tensor_bytes = super::files::encode_safetensors(&tensors, None)?;
        write_atomically(
            dir,
            &[
                (ADAPTER_TENSORS, tensor_bytes),
                (ADAPTER_META, to_json_bytes(&meta)?),
            ],
        )
    }

    /// Reads an adapter saved by [`Adapter::save`], verifying its checksum and
    /// internal consistency. Returns the adapter and the base it was made for.
    pub fn load(dir: &Path, device: &Device) -> Result<(Adapter, BaseRef)> {
        let meta_path = dir.join(ADAPTER_META);
        let meta: AdapterMeta = read_json(&meta_path)?;
        if meta.format != FORMAT || meta.version != FORMAT_VERSION {
            return Err(Error::UnsupportedFormat {
                path: meta_path,
                expected: FORMAT,
                found: meta.format,
                version: meta.version,
            });
        }
        let tensors_path = dir.join(ADAPTER_TENSORS);
        let mut tensors = read_safetensors(&tensors_path, device)?;
        let mut targets = meta.lora.targets.clone();
        targets.sort();
        targets.dedup();
        let mut modules = BTreeMap::new();
        for target in targets {
            for layer in 0..meta.num_layers {
                let key = ModuleKey { layer, target };
                let mut take = |factor| {
                    tensors
                        .remove(&tensor_key(key, factor))
                        .ok_or(Error::MissingModule(key))
                };
                let (a, b) = (take(FACTOR_A)?, take(FACTOR_B)?);
                modules.insert(key, module_from(&a, &b)?);
            }
        }
        if let Some(key) = tensors.into_keys().next() {
            return Err(Error::UnknownKey {
                path: tensors_path,
                key,
            });
        }
        let adapter = Adapter {
            config: meta.lora,
            modules,
        };
        adapter.check_consistent()?;
        let actual = adapter.checksum()?;
        if actual != meta.checksum {
            return Err(Error::ChecksumMismatch {
                path: tensors_path,
                recorded: meta.checksum,
                actual,
            });
        }
        Ok((adapter, meta.base))
    }

    /// A copy that shares no storage with `self`. (`clone` shares the `Var`s,
    /// so an optimizer step on a clone would also move the original.)
    pub fn deep_copy(&self) -> Result<Adapter> {
        let mut modules = BTreeMap::new();
        for (&key, module) in &self.modules {
            modules.insert(
                key,
                module_from(module.a.as_tensor(), module.b.as_tensor())?,
            );
        }
        Ok(Adapter {
            config: self.config.clone(),
            modules,
        })
    }

    /// [`Adapter::load`] for a known base: also checks the recorded base and
    /// every shape against `cfg`.
    pub fn load_for(dir: &Path, cfg: &ModelConfig, device: &Device) -> Result<Adapter> {
        let (adapter, base) = Adapter::load(dir, device)?;
        base.check(cfg)?;
        adapter.check_against(cfg)?;
        Ok(adapter)
    }
}

/// `layers.{N}.{q_proj}.{lora_A|lora_B}`: the key of a factor in our files.
pub(crate) fn tensor_key(key: ModuleKey, factor: &str) -> String {
    format!("{key}.{factor}")
}

/// A module owning fresh copies of `a` and `b`. (`Var::from_tensor` on a
/// variable would share its storage; detaching first forces the copy.)
pub(crate) fn module_from(a: &Tensor, b: &Tensor) -> Result<LoraModule> {
    Ok(LoraModule {
        a: Var::from_tensor(&a.detach())?,
        b: Var::from_tensor(&b.detach())?,
    })
}

pub(crate) fn hash_str(h: &mut Sha256, s: &str) {
    h.update((s.len() as u64).to_le_bytes());
    h.update(s.as_bytes());
}

pub(crate) fn hash_tensor(h: &mut Sha256, tensor: &Tensor) -> Result<()> {
    h.update((tensor.rank() as u64).to_le_bytes());
    for &dim in tensor.dims() {
        h.update((dim as u64).to_le_bytes());
    }
    h.update(f32_bytes(tensor)?);
    Ok(())
}
