//! Reading (and, for tests, writing) HF checkpoints: a directory with
//! `config.json`, `model.safetensors` or sharded `model-*.safetensors` with
//! `model.safetensors.index.json`, `tokenizer.json`, and the chat template and
//! special tokens of `tokenizer_config.json` (or `chat_template.jinja`).
//! Llama and Qwen2.

use std::collections::{BTreeSet, HashMap};
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use serde::Deserialize;

use super::blocks::{BlockFormat, BlockMatrix, BLOCK};
use super::chat::ChatTemplate;
use super::config::{Arch, ModelConfig};
use super::error::{Error, Result};
use super::model::{Block, Linear, Llama};
use super::tiny::TinyVocab;
use super::tokenizer::Tokenizer;
use super::weight::{Weight, WeightsSetting};

#[derive(Deserialize)]
struct HfConfig {
    #[serde(default)]
    architectures: Vec<String>,
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    rope_theta: Option<f64>,
    rms_norm_eps: f64,
    max_position_embeddings: usize,
    #[serde(default)]
    tie_word_embeddings: bool,
    #[serde(default)]
    _name_or_path: Option<String>,
}

#[derive(Deserialize)]
struct ShardIndex {
    weight_map: HashMap<String, String>,
}

/// Read `config.json` of an HF model directory.
pub fn read_config(dir: &Path) -> Result<ModelConfig> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(Error::io(&path))?;
    let hf: HfConfig = serde_json::from_str(&text).map_err(|e| Error::bad_file(&path, e))?;
    let arch = match hf.architectures.first().map(String::as_str) {
        Some("LlamaForCausalLM") => Arch::Llama,
        Some("Qwen2ForCausalLM") => Arch::Qwen2,
        other => {
            return Err(Error::UnsupportedArch {
                path,
                arch: other.unwrap_or("(none)").to_string(),
                supported: "LlamaForCausalLM, Qwen2ForCausalLM",
            })
        }
    };
    let heads = hf.num_attention_heads;
    let kv_heads = hf.num_key_value_heads.unwrap_or(heads);
    if heads == 0 || kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
        return Err(Error::bad_file(
            &path,
            format!("heads {heads} not a multiple of kv heads {kv_heads}"),
        ));
    }
    let name = hf._name_or_path.clone().unwrap_or_else(|| {
        dir.file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default()
    });
    Ok(ModelConfig {
        arch,
        name,
        vocab_size: hf.vocab_size,
        hidden_size: hf.hidden_size,
        intermediate_size: hf.intermediate_size,
        num_layers: hf.num_hidden_layers,
        num_heads: heads,
        num_kv_heads: kv_heads,
        head_dim: hf.head_dim.unwrap_or(hf.hidden_size / heads),
        rope_theta: hf.rope_theta.unwrap_or(10_000.0),
        rms_norm_eps: hf.rms_norm_eps,
        max_position_embeddings: hf.max_position_embeddings,
        tie_word_embeddings: hf.tie_word_embeddings,
    })
}

/// Every tensor of the checkpoint, by name, in its stored dtype.
fn read_tensors(dir: &Path) -> Result<HashMap<String, Tensor>> {
    let index = dir.join("model.safetensors.index.json");
    let files: BTreeSet<String> = if index.exists() {
        let text = std::fs::read_to_string(&index).map_err(Error::io(&index))?;
        let idx: ShardIndex =
            serde_json::from_str(&text).map_err(|e| Error::bad_file(&index, e))?;
        idx.weight_map.into_values().collect()
    } else {
        ["model.safetensors".to_string()].into()
    };
    let mut all = HashMap::new();
    for file in files {
        let path = dir.join(&file);
        if !path.exists() {
            return Err(Error::io(&path)(std::io::ErrorKind::NotFound.into()));
        }
        let tensors = candle_core::safetensors::load(&path, &Device::Cpu)
            .map_err(|e| Error::bad_file(&path, e))?;
        all.extend(tensors);
    }
    Ok(all)
}

/// Load an HF model directory: matrices stored in F16 or BF16 kept so under
/// [`WeightsSetting::Native`] (when their rows are whole blocks of 32), every
/// other tensor in f32.
pub fn load(dir: &Path, setting: WeightsSetting) -> Result<(Llama, Tokenizer)> {
    let cfg = read_config(dir)?;
    let tok_path = dir.join("tokenizer.json");
    let inner =
        tokenizers::Tokenizer::from_file(&tok_path).map_err(|e| Error::bad_file(&tok_path, e))?;
    let tok_config = TokenizerConfig::read(dir)?;
    let chat = tok_config.chat_template(dir)?;
    let eos_ids = eos_ids(dir, &tok_config, &inner)?;
    let tokenizer = Tokenizer::from_inner(inner, chat, &eos_ids);
    let mut tensors = read_tensors(dir)?;
    let mut stored = |name: &str, shape: &[usize]| -> Result<Tensor> {
        let t = tensors.remove(name).ok_or_else(|| Error::BadTensor {
            path: dir.to_path_buf(),
            name: name.to_string(),
            reason: "missing".into(),
        })?;
        if t.dims() != shape {
            return Err(Error::BadTensor {
                path: dir.to_path_buf(),
                name: name.to_string(),
                reason: format!("shape {:?}, expected {shape:?}", t.dims()),
            });
        }
        Ok(t)
    };
    let f32 = |t: Tensor| t.to_dtype(DType::F32);
    let (h, ffn, qd, kvd) = (
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.q_dim(),
        cfg.kv_dim(),
    );
    let weight = |name: &str, t: Tensor| as_weight(t, setting, dir, name);
    let name = "model.embed_tokens.weight";
    let embed = weight(name, stored(name, &[cfg.vocab_size, h])?)?;
    let mut blocks = Vec::with_capacity(cfg.num_layers);
    for i in 0..cfg.num_layers {
        let p = format!("model.layers.{i}");
        let mut linear = |name: &str, out: usize, inp: usize, bias: bool| -> Result<Linear> {
            let name = format!("{p}.{name}");
            let w = format!("{name}.weight");
            Ok(Linear {
                weight: weight(&w, stored(&w, &[out, inp])?)?,
                bias: if bias {
                    Some(f32(stored(&format!("{name}.bias"), &[out])?)?)
                } else {
                    None
                },
            })
        };
        let qkv_bias = cfg.attention_bias();
        let q = linear("self_attn.q_proj", qd, h, qkv_bias)?;
        let k = linear("self_attn.k_proj", kvd, h, qkv_bias)?;
        let v = linear("self_attn.v_proj", kvd, h, qkv_bias)?;
        let o = linear("self_attn.o_proj", h, qd, false)?;
        let gate = linear("mlp.gate_proj", ffn, h, false)?;
        let up = linear("mlp.up_proj", ffn, h, false)?;
        let down = linear("mlp.down_proj", h, ffn, false)?;
        blocks.push(Block {
            attn_norm: f32(stored(&format!("{p}.input_layernorm.weight"), &[h])?)?,
            mlp_norm: f32(stored(
                &format!("{p}.post_attention_layernorm.weight"),
                &[h],
            )?)?,
            q,
            k,
            v,
            o,
            gate,
            up,
            down,
        });
    }
    let final_norm = f32(stored("model.norm.weight", &[h])?)?;
    let lm_head = if cfg.tie_word_embeddings {
        None
    } else {
        let name = "lm_head.weight";
        Some(weight(name, stored(name, &[cfg.vocab_size, h])?)?)
    };
    Ok((
        Llama::new(cfg, embed, blocks, final_norm, lm_head)?,
        tokenizer,
    ))
}

/// Matrix `t` as `setting` keeps it: in blocks when stored in F16 or BF16
/// with rows of whole blocks under `Native`, else in f32.
fn as_weight(t: Tensor, setting: WeightsSetting, dir: &Path, name: &str) -> Result<Weight> {
    let format = match (setting, t.dtype()) {
        (WeightsSetting::Native, DType::F16) => BlockFormat::F16,
        (WeightsSetting::Native, DType::BF16) => BlockFormat::Bf16,
        _ => return Ok(Weight::Dense(t.to_dtype(DType::F32)?)),
    };
    let (rows, cols) = t.dims2()?;
    if !cols.is_multiple_of(BLOCK) {
        return Ok(Weight::Dense(t.to_dtype(DType::F32)?));
    }
    // The 16-bit values' bits, little-endian, as the file holds them.
    let bytes: Vec<u8> = match t.dtype() {
        DType::F16 => t
            .flatten_all()?
            .to_vec1::<half::f16>()?
            .iter()
            .flat_map(|v| v.to_bits().to_le_bytes())
            .collect(),
        _ => t
            .flatten_all()?
            .to_vec1::<half::bf16>()?
            .iter()
            .flat_map(|v| v.to_bits().to_le_bytes())
            .collect(),
    };
    BlockMatrix::new(format, rows, cols, bytes)
        .map(Weight::from)
        .map_err(|reason| Error::BadTensor {
            path: dir.to_path_buf(),
            name: name.to_string(),
            reason,
        })
}

/// A JSON file of the directory, if it is there.
fn read_json(path: &Path) -> Result<Option<serde_json::Value>> {
    if !path.exists() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path).map_err(Error::io(path))?;
    let value = serde_json::from_str(&text).map_err(|e| Error::bad_file(path, e))?;
    Ok(Some(value))
}

/// `tokenizer_config.json` (empty when absent): the chat template and the
/// special tokens transformers hands it.
struct TokenizerConfig {
    path: std::path::PathBuf,
    json: serde_json::Value,
}

impl TokenizerConfig {
    fn read(dir: &Path) -> Result<TokenizerConfig> {
        let path = dir.join("tokenizer_config.json");
        let json = read_json(&path)?.unwrap_or_default();
        Ok(TokenizerConfig { path, json })
    }

    /// A special token's text: a string, or an added token's `content`.
    fn token(&self, key: &str) -> Option<&str> {
        let value = self.json.get(key)?;
        value.as_str().or_else(|| value.get("content")?.as_str())
    }

    /// The template as transformers finds it: `chat_template.jinja` when the
    /// directory has one, else `chat_template` (a string, or a list of named
    /// templates of which we take `default`).
    fn chat_template(&self, dir: &Path) -> Result<ChatTemplate> {
        let jinja = dir.join("chat_template.jinja");
        let (source, origin) = if jinja.exists() {
            let source = std::fs::read_to_string(&jinja).map_err(Error::io(&jinja))?;
            (source, jinja.display().to_string())
        } else {
            let source = match self.json.get("chat_template") {
                Some(serde_json::Value::String(s)) => Some(s.clone()),
                Some(serde_json::Value::Array(named)) => named
                    .iter()
                    .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                    .and_then(|t| t.get("template")?.as_str().map(str::to_string)),
                _ => None,
            };
            let source = source.ok_or_else(|| Error::NoChatTemplate {
                path: dir.to_path_buf(),
                key: "chat_template.jinja, or chat_template in tokenizer_config.json",
            })?;
            (source, format!("{} (chat_template)", self.path.display()))
        };
        ChatTemplate::new(
            &source,
            origin,
            self.token("bos_token").map(str::to_string),
            self.token("eos_token").map(str::to_string),
        )
    }
}

/// The end-of-sequence ids: `tokenizer_config.json`'s `eos_token` first (in
/// chat models it ends the assistant's turn), then `eos_token_id` (a number
/// or a list) of `generation_config.json` and of `config.json`.
fn eos_ids(
    dir: &Path,
    tok_config: &TokenizerConfig,
    inner: &tokenizers::Tokenizer,
) -> Result<Vec<u32>> {
    let mut ids = Vec::new();
    if let Some(eos) = tok_config.token("eos_token") {
        let id = inner.token_to_id(eos).ok_or_else(|| {
            Error::bad_file(
                &tok_config.path,
                format!("eos_token {eos:?} is not in tokenizer.json"),
            )
        })?;
        ids.push(id);
    }
    for file in ["generation_config.json", "config.json"] {
        let path = dir.join(file);
        let Some(json) = read_json(&path)? else {
            continue;
        };
        let declared = match json.get("eos_token_id") {
            Some(serde_json::Value::Array(list)) => list.clone(),
            Some(one) if !one.is_null() => vec![one.clone()],
            _ => Vec::new(),
        };
        for value in declared {
            let id = value
                .as_u64()
                .and_then(|id| u32::try_from(id).ok())
                .filter(|&id| inner.id_to_token(id).is_some())
                .ok_or_else(|| {
                    Error::bad_file(
                        &path,
                        format!("eos_token_id {value} is not a token of tokenizer.json"),
                    )
                })?;
            ids.push(id);
        }
    }
    if ids.is_empty() {
        return Err(Error::NoEosToken {
            path: dir.to_path_buf(),
            looked: "eos_token in tokenizer_config.json, eos_token_id in \
                     generation_config.json and config.json",
        });
    }
    Ok(ids)
}

/// The HF tensor names and values of `model` (for writing test checkpoints;
/// weights in blocks decoded to f32).
pub fn named_tensors(model: &Llama) -> Result<Vec<(String, Tensor)>> {
    let mut out = vec![(
        "model.embed_tokens.weight".to_string(),
        model.embed.dense()?,
    )];
    for (i, b) in model.blocks.iter().enumerate() {
        let p = format!("model.layers.{i}");
        out.push((format!("{p}.input_layernorm.weight"), b.attn_norm.clone()));
        out.push((
            format!("{p}.post_attention_layernorm.weight"),
            b.mlp_norm.clone(),
        ));
        for (name, lin) in [
            ("self_attn.q_proj", &b.q),
            ("self_attn.k_proj", &b.k),
            ("self_attn.v_proj", &b.v),
            ("self_attn.o_proj", &b.o),
            ("mlp.gate_proj", &b.gate),
            ("mlp.up_proj", &b.up),
            ("mlp.down_proj", &b.down),
        ] {
            out.push((format!("{p}.{name}.weight"), lin.weight.dense()?));
            if let Some(bias) = &lin.bias {
                out.push((format!("{p}.{name}.bias"), bias.clone()));
            }
        }
    }
    out.push(("model.norm.weight".to_string(), model.final_norm.clone()));
    if !model.config.tie_word_embeddings {
        out.push(("lm_head.weight".to_string(), model.lm_head.dense()?));
    }
    Ok(out)
}

/// The `config.json` an HF checkpoint of a model with `cfg` holds (its
/// end-of-sequence id is the tokenizer's, so [`write`] adds it).
pub fn config_json(cfg: &ModelConfig) -> serde_json::Value {
    let arch = match cfg.arch {
        Arch::Llama => "LlamaForCausalLM",
        Arch::Qwen2 => "Qwen2ForCausalLM",
    };
    serde_json::json!({
        "architectures": [arch],
        "model_type": if cfg.arch == Arch::Llama { "llama" } else { "qwen2" },
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "hidden_act": "silu",
        "_name_or_path": cfg.name,
        "sliding_window": cfg.max_position_embeddings,
        "max_window_layers": cfg.num_layers,
        "use_sliding_window": false,
    })
}

/// Write `model` as an HF directory split into `shards` safetensors files
/// (one file without an index when `shards == 1`), with `config.json`, and
/// `tokenizer.json` and `tokenizer_config.json` of `vocab`.
pub fn write(dir: &Path, model: &Llama, vocab: &TinyVocab, shards: usize) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(Error::io(dir))?;
    let mut config = config_json(&model.config);
    config["eos_token_id"] = vocab.eos.into();
    let config_path = dir.join("config.json");
    std::fs::write(
        &config_path,
        serde_json::to_string_pretty(&config).unwrap_or_default(),
    )
    .map_err(Error::io(&config_path))?;
    let tok_path = dir.join("tokenizer.json");
    vocab
        .tokenizer()?
        .inner()
        .save(&tok_path, false)
        .map_err(|e| Error::Tokenizer(format!("{}: {e}", tok_path.display())))?;
    let tok_config = serde_json::json!({
        "chat_template": vocab.chat_template,
        "eos_token": vocab.text(vocab.eos),
    });
    let tok_config_path = dir.join("tokenizer_config.json");
    std::fs::write(&tok_config_path, tok_config.to_string())
        .map_err(Error::io(&tok_config_path))?;

    let tensors = named_tensors(model)?;
    let shards = shards.max(1);
    let per_shard = tensors.len().div_ceil(shards);
    let mut weight_map = serde_json::Map::new();
    for (s, chunk) in tensors.chunks(per_shard).enumerate() {
        let file = if shards == 1 {
            "model.safetensors".to_string()
        } else {
            format!("model-{:05}-of-{:05}.safetensors", s + 1, shards)
        };
        let map: HashMap<String, Tensor> = chunk.iter().cloned().collect();
        for name in map.keys() {
            weight_map.insert(name.clone(), file.clone().into());
        }
        let path = dir.join(&file);
        candle_core::safetensors::save(&map, &path).map_err(|e| Error::bad_file(&path, e))?;
    }
    if shards > 1 {
        let index = serde_json::json!({ "metadata": {}, "weight_map": weight_map });
        let path = dir.join("model.safetensors.index.json");
        std::fs::write(&path, index.to_string()).map_err(Error::io(&path))?;
    }
    Ok(())
}
