//! PEFT interchange: `adapter_config.json` + `adapter_model.safetensors` as
//! Hugging Face PEFT writes and reads them for a `CAUSAL_LM` LoRA.
//!
//! Keys are `base_model.model.model.layers.{N}.self_attn.q_proj.lora_A.weight`
//! (`[r, in]`) and `...lora_B.weight` (`[out, r]`), MLP projections under
//! `.mlp.gate_proj` etc.; ΔW = B·A·alpha/r (alpha/√r with rsLoRA), the same
//! convention as ours, so factors are copied unchanged.
//!
//! No q/k row permutation happens here. GGUF files store q/k rows permuted for
//! interleaved RoPE, but the base loader un-permutes them at load time (see
//! `base::Source`), so every tensor we hold, and therefore every adapter
//! trained on it, is already in HF layout, which is PEFT's layout.
//!
//! Import is strict: an unknown key or target module, a LoRA variant we do not
//! implement (DoRA, QA-LoRA, per-layer rank or alpha patterns, a layer subset
//! or replication, biases, `modules_to_save`, trainable tokens, aLoRA or
//! Arrow routing, an initialisation that changed the base), inconsistent
//! shapes or a different base is an error. The base is matched by identity: its name, or another
//! name of the same known model of the same shape (`base::fetch::KNOWN_MODELS`).
//! Every field PEFT 0.13 to 0.19 writes is understood.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use serde_json::{json, Map, Value};

use super::error::{Error, Result};
use super::files::{
    encode_safetensors, read_json, read_safetensors, to_json_bytes, write_atomically,
};
use super::shape::{FACTOR_A, FACTOR_B};
use super::store::module_from;
use super::{Adapter, BaseRef, LoraConfig, ModuleKey};
use crate::base::ModelConfig;
use crate::base::Target;

pub const PEFT_CONFIG: &str = "adapter_config.json";
pub const PEFT_TENSORS: &str = "adapter_model.safetensors";
const KEY_PREFIX: &str = "base_model.model.model.layers.";

/// An adapter read from a PEFT directory, with the base it names.
#[derive(Debug, Clone)]
pub struct PeftAdapter {
    pub adapter: Adapter,
    /// `base_model_name_or_path` (empty when the file has none).
    pub base_model: String,
}

/// The PEFT key of one factor of `key`.
pub fn peft_key(key: ModuleKey, factor: &str) -> String {
    format!(
        "{KEY_PREFIX}{}.{}.{}.{factor}.weight",
        key.layer,
        key.target.hf_parent(),
        key.target.hf_name()
    )
}

/// Writes `adapter` as a PEFT LoRA for `base_model` into `dir` (created if
/// absent). Both files are replaced atomically, after every check passed.
pub fn export_peft(adapter: &Adapter, base_model: &str, dir: &Path) -> Result<()> {
    adapter.check_consistent()?;
    let mut tensors: BTreeMap<String, Tensor> = BTreeMap::new();
    for (&key, module) in &adapter.modules {
        tensors.insert(peft_key(key, FACTOR_A), module.a.as_tensor().clone());
        tensors.insert(peft_key(key, FACTOR_B), module.b.as_tensor().clone());
    }
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    let tensor_bytes = encode_safetensors(&tensors, Some(metadata))?;
    let config = to_json_bytes(&peft_config(&adapter.config, base_model))?;
    write_atomically(dir, &[(PEFT_TENSORS, tensor_bytes), (PEFT_CONFIG, config)])
}

fn peft_config(config: &LoraConfig, base_model: &str) -> Value {
    let mut targets = config.targets.clone();
    targets.sort();
    let target_modules: Vec<&str> = targets.iter().map(|t| t.hf_name()).collect();
    // PEFT types lora_alpha as an int; keep it one when it is integral.
    let alpha = if config.alpha.fract() == 0.0 && config.alpha.abs() < 1e15 {
        json!(config.alpha as i64)
    } else {
        json!(config.alpha)
    };
    json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": config.rank,
        "lora_alpha": alpha,
        "use_rslora": config.use_rslora,
        "target_modules": target_modules,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": false,
        "inference_mode": true,
        "modules_to_save": null,
        "init_lora_weights": true,
        "layers_to_transform": null,
        "layers_pattern": null,
        "rank_pattern": {},
        "alpha_pattern": {},
        "use_dora": false,
        "revision": null,
    })
}

/// Reads a PEFT LoRA directory, checking the config, every key and the
/// consistency of all shapes, but not any base model (see [`import_peft`]).
pub fn read_peft(dir: &Path, device: &Device) -> Result<PeftAdapter> {
    let config_path = dir.join(PEFT_CONFIG);
    let raw: Map<String, Value> = read_json(&config_path)?;
    let fields = PeftFields {
        path: &config_path,
        raw: &raw,
    };
    let config = fields.lora_config()?;
    let base_model = fields.base_model()?;

    let tensors_path = dir.join(PEFT_TENSORS);
    let mut factors: BTreeMap<ModuleKey, (Option<Tensor>, Option<Tensor>)> = BTreeMap::new();
    for (name, tensor) in read_safetensors(&tensors_path, device)? {
        let (key, factor) = parse_peft_key(&name, &tensors_path)?;
        if !config.targets.contains(&key.target) {
            return Err(Error::UnexpectedModule(key));
        }
        let slot = factors.entry(key).or_default();
        match factor {
            Factor::A => slot.0 = Some(tensor),
            Factor::B => slot.1 = Some(tensor),
        }
    }
    let mut modules = BTreeMap::new();
    for (key, pair) in factors {
        let (Some(a), Some(b)) = pair else {
            return Err(Error::MissingModule(key));
        };
        modules.insert(key, module_from(&a, &b)?);
    }
    let adapter = Adapter { config, modules };
    adapter.check_consistent()?;
    Ok(PeftAdapter {
        adapter,
        base_model,
    })
}

/// [`read_peft`] for the base `cfg`: the named base must be `cfg` (unless
/// `allow_other_base`), by name or as a known model's alias
/// ([`super::names_model`]), and every shape must fit it.
pub fn import_peft(
    dir: &Path,
    cfg: &ModelConfig,
    allow_other_base: bool,
    device: &Device,
) -> Result<PeftAdapter> {
    let peft = read_peft(dir, device)?;
    if !allow_other_base {
        BaseRef::named(&peft.base_model).check(cfg)?;
    }
    peft.adapter.check_against(cfg)?;
    Ok(peft)
}

enum Factor {
    A,
    B,
}

/// `base_model.model.model.layers.{N}.{parent}.{name}.lora_{A|B}.weight`.
fn parse_peft_key(name: &str, path: &Path) -> Result<(ModuleKey, Factor)> {
    let unknown = || Error::UnknownKey {
        path: path.to_path_buf(),
        key: name.to_string(),
    };
    let rest = name.strip_prefix(KEY_PREFIX).ok_or_else(unknown)?;
    let parts: Vec<&str> = rest.split('.').collect();
    let [layer, parent, module, factor, "weight"] = parts[..] else {
        return Err(unknown());
    };
    let layer: usize = layer.parse().map_err(|_| unknown())?;
    let target = Target::ALL
        .into_iter()
        .find(|t| t.hf_name() == module)
        .ok_or_else(|| Error::UnknownTarget {
            path: path.to_path_buf(),
            name: module.to_string(),
        })?;
    if target.hf_parent() != parent {
        return Err(unknown());
    }
    let factor = match factor {
        FACTOR_A => Factor::A,
        FACTOR_B => Factor::B,
        _ => return Err(unknown()),
    };
    Ok((ModuleKey { layer, target }, factor))
}

/// Typed access to `adapter_config.json`, with errors naming the file.
struct PeftFields<'a> {
    path: &'a Path,
    raw: &'a Map<String, Value>,
}

impl PeftFields<'_> {
    fn get(&self, field: &str) -> Option<&Value> {
        self.raw.get(field).filter(|v| !v.is_null())
    }

    fn unsupported(&self, field: &'static str, value: impl ToString) -> Error {
        Error::UnsupportedPeftOption {
            path: PathBuf::from(self.path),
            field,
            value: value.to_string(),
        }
    }

    fn lora_config(&self) -> Result<LoraConfig> {
        self.require_defaults()?;
        let rank = self
            .get("r")
            .and_then(Value::as_u64)
            .filter(|&r| r > 0)
            .ok_or_else(|| self.unsupported("r", self.shown("r")))?;
        let alpha = self
            .get("lora_alpha")
            .and_then(Value::as_f64)
            .ok_or_else(|| self.unsupported("lora_alpha", self.shown("lora_alpha")))?;
        let use_rslora = match self.get("use_rslora") {
            None => false,
            Some(v) => v
                .as_bool()
                .ok_or_else(|| self.unsupported("use_rslora", v))?,
        };
        Ok(LoraConfig {
            rank: rank as usize,
            alpha,
            targets: self.targets()?,
            use_rslora,
        })
    }

    fn shown(&self, field: &str) -> String {
        self.raw
            .get(field)
            .map_or_else(|| "(missing)".to_string(), Value::to_string)
    }

    fn targets(&self) -> Result<Vec<Target>> {
        let listed = self
            .get("target_modules")
            .and_then(Value::as_array)
            .ok_or_else(|| self.unsupported("target_modules", self.shown("target_modules")))?;
        let mut targets = Vec::new();
        for name in listed {
            let name = name
                .as_str()
                .ok_or_else(|| self.unsupported("target_modules", name))?;
            let target = Target::ALL
                .into_iter()
                .find(|t| t.hf_name() == name)
                .ok_or_else(|| Error::UnknownTarget {
                    path: PathBuf::from(self.path),
                    name: name.to_string(),
                })?;
            if !targets.contains(&target) {
                targets.push(target);
            }
        }
        targets.sort();
        Ok(targets)
    }

    fn base_model(&self) -> Result<String> {
        match self.get("base_model_name_or_path") {
            None => Ok(String::new()),
            Some(v) => v
                .as_str()
                .map(str::to_string)
                .ok_or_else(|| self.unsupported("base_model_name_or_path", v)),
        }
    }

    /// Fields whose non-default values change what the adapter computes, up
    /// to PEFT 0.19 (a null counts as the default; fields PEFT adds later are
    /// ignored). Dropout, `inference_mode`, `revision`, the Megatron fields and
    /// initialisations that leave the base alone do not matter once trained.
    fn require_defaults(&self) -> Result<()> {
        if self.get("peft_type") != Some(&json!("LORA")) {
            return Err(self.unsupported("peft_type", self.shown("peft_type")));
        }
        let is_false = |v: &Value| v == &json!(false);
        let checks: [FieldCheck; 18] = [
            ("task_type", |v| v == &json!("CAUSAL_LM")),
            ("fan_in_fan_out", is_false),
            ("bias", |v| v == &json!("none")),
            ("lora_bias", is_false),
            ("use_dora", is_false),
            ("use_qalora", is_false),
            ("use_bdlora", is_false),
            ("layers_to_transform", |_| false),
            ("layer_replication", |_| false),
            ("rank_pattern", empty_map),
            ("alpha_pattern", empty_map),
            ("modules_to_save", empty_list),
            ("exclude_modules", empty_list),
            ("target_parameters", empty_list),
            ("trainable_token_indices", |_| false),
            ("alora_invocation_tokens", |_| false),
            ("arrow_config", |_| false),
            ("init_lora_weights", keeps_the_base),
        ];
        match checks
            .into_iter()
            .find(|(field, ok)| self.get(field).is_some_and(|v| !ok(v)))
        {
            Some((field, _)) => Err(self.unsupported(field, self.shown(field))),
            None => Ok(()),
        }
    }
}

/// A config field and whether a value of it is one we implement.
type FieldCheck = (&'static str, fn(&Value) -> bool);

/// Whether an `init_lora_weights` leaves the base weights as they were.
/// PiSSA, OLoRA, CorDA, LoRA-GA and LoftQ move part of the weight into the
/// factors (or quantize it): such an adapter belongs to a changed base.
fn keeps_the_base(v: &Value) -> bool {
    match v {
        Value::Bool(_) => true,
        Value::String(how) => !["pissa", "olora", "corda", "lora_ga", "loftq"]
            .iter()
            .any(|changes| how.starts_with(changes)),
        _ => false,
    }
}

fn empty_map(v: &Value) -> bool {
    v.as_object().is_some_and(Map::is_empty)
}

fn empty_list(v: &Value) -> bool {
    v.as_array().is_some_and(Vec::is_empty)
}
