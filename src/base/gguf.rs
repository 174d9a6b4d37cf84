//! Reading (and, for tests, writing) Llama-architecture GGUF files.
//!
//! Matrices are kept in their blocks where a kernel reads the format
//! ([`WeightsSetting::Native`]: Q4_1, Q8_0, F16, BF16), else dequantized to
//! f32. llama.cpp's converter permutes the rows of q/k for interleaved RoPE;
//! we undo that here (moving whole rows of blocks, which keeps them exact) so
//! everything downstream is in HF layout (and an adapter trained here exports
//! to PEFT without any permutation).

use std::fs::File;
use std::io::{BufReader, Read, Seek};
use std::path::Path;

use candle_core::quantized::gguf_file::{self, Content, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};

use super::blocks::{BlockFormat, BlockMatrix};
use super::chat::ChatTemplate;
use super::config::{Arch, ModelConfig};
use super::error::{Error, Result};
use super::model::{Block, Linear, Llama};
use super::tiny::TinyVocab;
use super::tokenizer::Tokenizer;
use super::weight::{Weight, WeightsSetting};

/// GGUF `token_type` of control tokens (`<|im_start|>` etc.).
const TOKEN_TYPE_CONTROL: i32 = 3;

struct Reader<'a> {
    path: &'a Path,
    content: Content,
    file: BufReader<File>,
}

impl Reader<'_> {
    fn meta(&self, field: &str) -> Result<&Value> {
        self.content
            .metadata
            .get(field)
            .ok_or_else(|| Error::MissingField {
                path: self.path.to_path_buf(),
                field: field.to_string(),
            })
    }

    fn meta_usize(&self, field: &str) -> Result<usize> {
        let v = self.meta(field)?;
        let n = v
            .to_u64()
            .or_else(|_| v.to_u32().map(u64::from))
            .or_else(|_| v.to_i32().map(|x| x as u64))
            .map_err(|e| Error::bad_file(self.path, format!("{field}: {e}")))?;
        Ok(n as usize)
    }

    fn meta_f64(&self, field: &str) -> Result<f64> {
        let v = self.meta(field)?;
        v.to_f32()
            .map(f64::from)
            .or_else(|_| v.to_f64())
            .map_err(|e| Error::bad_file(self.path, format!("{field}: {e}")))
    }

    fn meta_strings(&self, field: &str) -> Result<Vec<String>> {
        let list = self
            .meta(field)?
            .to_vec()
            .map_err(|e| Error::bad_file(self.path, format!("{field}: {e}")))?;
        list.iter()
            .map(|v| v.to_string().cloned())
            .collect::<candle_core::Result<Vec<_>>>()
            .map_err(|e| Error::bad_file(self.path, format!("{field}: {e}")))
    }

    fn tensor(&mut self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let q = self.qtensor(name, shape)?;
        q.dequantize(&Device::Cpu)
            .map_err(|e| self.bad_tensor(name, e.to_string()))
    }

    /// A matrix, kept in blocks under `Native` when its type has a kernel.
    fn weight(&mut self, name: &str, shape: &[usize], setting: WeightsSetting) -> Result<Weight> {
        let q = self.qtensor(name, shape)?;
        let native = match setting {
            WeightsSetting::Native => BlockFormat::of_ggml(q.dtype()),
            WeightsSetting::F32 => None,
        };
        let (Some(format), &[rows, cols]) = (native, shape) else {
            let t = q
                .dequantize(&Device::Cpu)
                .map_err(|e| self.bad_tensor(name, e.to_string()))?;
            return Ok(Weight::Dense(t));
        };
        let bytes = q
            .data()
            .map_err(|e| self.bad_tensor(name, e.to_string()))?
            .into_owned();
        drop(q);
        match BlockMatrix::new(format, rows, cols, bytes) {
            Ok(blocks) => Ok(blocks.into()),
            Err(reason) => Err(self.bad_tensor(name, reason)),
        }
    }

    fn bad_tensor(&self, name: &str, reason: String) -> Error {
        Error::BadTensor {
            path: self.path.to_path_buf(),
            name: name.to_string(),
            reason,
        }
    }

    fn qtensor(&mut self, name: &str, shape: &[usize]) -> Result<QTensor> {
        if !self.content.tensor_infos.contains_key(name) {
            return Err(self.bad_tensor(name, "missing".into()));
        }
        let q = self
            .content
            .tensor(&mut self.file, name, &Device::Cpu)
            .map_err(|e| self.bad_tensor(name, e.to_string()))?;
        if q.shape().dims() != shape {
            return Err(self.bad_tensor(
                name,
                format!("shape {:?}, expected {shape:?}", q.shape().dims()),
            ));
        }
        Ok(q)
    }

    fn has(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }
}

fn open(path: &Path) -> Result<Reader<'_>> {
    let file = File::open(path).map_err(Error::io(path))?;
    let mut file = BufReader::new(file);
    let content = Content::read(&mut file).map_err(|e| Error::bad_file(path, e))?;
    Ok(Reader {
        path,
        content,
        file,
    })
}

/// Read only the model configuration of a GGUF file (fast: no tensors).
pub fn read_config(path: &Path) -> Result<ModelConfig> {
    config_of(&open(path)?)
}

fn config_of(r: &Reader) -> Result<ModelConfig> {
    let arch = r
        .meta("general.architecture")?
        .to_string()
        .map_err(|e| Error::bad_file(r.path, e))?
        .clone();
    if arch != "llama" {
        return Err(Error::UnsupportedArch {
            path: r.path.to_path_buf(),
            arch,
            supported: "llama (GGUF); llama and qwen2 (HF directories)",
        });
    }
    let hidden = r.meta_usize("llama.embedding_length")?;
    let heads = r.meta_usize("llama.attention.head_count")?;
    let kv_heads = match r.meta_usize("llama.attention.head_count_kv") {
        Ok(n) => n,
        Err(Error::MissingField { .. }) => heads,
        Err(e) => return Err(e),
    };
    if heads == 0
        || kv_heads == 0
        || !hidden.is_multiple_of(heads)
        || !heads.is_multiple_of(kv_heads)
    {
        return Err(Error::bad_file(
            r.path,
            format!("inconsistent heads: hidden {hidden}, heads {heads}, kv heads {kv_heads}"),
        ));
    }
    let vocab_size = match r.meta_usize("llama.vocab_size") {
        Ok(n) => n,
        Err(_) => r.meta_strings("tokenizer.ggml.tokens")?.len(),
    };
    let name = r
        .meta("general.name")
        .ok()
        .and_then(|v| v.to_string().ok().cloned())
        .unwrap_or_else(|| "unnamed".into());
    Ok(ModelConfig {
        arch: Arch::Llama,
        name,
        vocab_size,
        hidden_size: hidden,
        intermediate_size: r.meta_usize("llama.feed_forward_length")?,
        num_layers: r.meta_usize("llama.block_count")?,
        num_heads: heads,
        num_kv_heads: kv_heads,
        head_dim: hidden / heads,
        rope_theta: r.meta_f64("llama.rope.freq_base").unwrap_or(10_000.0),
        rms_norm_eps: r.meta_f64("llama.attention.layer_norm_rms_epsilon")?,
        max_position_embeddings: r.meta_usize("llama.context_length")?,
        tie_word_embeddings: !r.has("output.weight"),
    })
}

fn tokenizer_of(r: &Reader) -> Result<Tokenizer> {
    let model = r.meta("tokenizer.ggml.model")?.to_string().ok().cloned();
    if model.as_deref() != Some("gpt2") {
        return Err(Error::bad_file(
            r.path,
            format!(
                "tokenizer.ggml.model is {model:?}; only byte-level BPE (\"gpt2\") is supported"
            ),
        ));
    }
    let tokens = r.meta_strings("tokenizer.ggml.tokens")?;
    let merges = r.meta_strings("tokenizer.ggml.merges")?;
    let types = r
        .meta("tokenizer.ggml.token_type")
        .ok()
        .and_then(|v| v.to_vec().ok())
        .map(|v| {
            v.iter()
                .map(|t| t.to_i32().unwrap_or(1))
                .collect::<Vec<_>>()
        })
        .unwrap_or_default();
    let special: Vec<u32> = types
        .iter()
        .enumerate()
        .filter(|(_, &t)| t == TOKEN_TYPE_CONTROL)
        .map(|(i, _)| i as u32)
        .collect();
    let eos = token_id(r, EOS_FIELD, &tokens)?.ok_or_else(|| Error::MissingField {
        path: r.path.to_path_buf(),
        field: EOS_FIELD.into(),
    })?;
    // llama.cpp's end-of-turn token, when the file names one, is what ends an
    // assistant turn, so it goes first.
    let eot = token_id(r, "tokenizer.ggml.eot_token_id", &tokens)?;
    let eom = token_id(r, "tokenizer.ggml.eom_token_id", &tokens)?;
    let eos_ids: Vec<u32> = [eot, Some(eos), eom].into_iter().flatten().collect();
    let chat = chat_template(r, &tokens, eos)?;
    Tokenizer::from_bpe(&tokens, &merges, &special, chat, &eos_ids)
}

const EOS_FIELD: &str = "tokenizer.ggml.eos_token_id";
const CHAT_TEMPLATE_FIELD: &str = "tokenizer.chat_template";

/// A token id field of the metadata, if present, checked against the vocabulary.
fn token_id(r: &Reader, field: &str, tokens: &[String]) -> Result<Option<u32>> {
    let id = match r.meta_usize(field) {
        Ok(id) => id,
        Err(Error::MissingField { .. }) => return Ok(None),
        Err(e) => return Err(e),
    };
    if id >= tokens.len() {
        return Err(Error::bad_file(
            r.path,
            format!(
                "{field} is {id}, outside the vocabulary of {}",
                tokens.len()
            ),
        ));
    }
    Ok(Some(id as u32))
}

/// The file's chat template, with its bos and eos texts.
fn chat_template(r: &Reader, tokens: &[String], eos: u32) -> Result<ChatTemplate> {
    let source = match r.meta(CHAT_TEMPLATE_FIELD) {
        Ok(v) => v
            .to_string()
            .map_err(|e| Error::bad_file(r.path, format!("{CHAT_TEMPLATE_FIELD}: {e}")))?,
        Err(_) => {
            return Err(Error::NoChatTemplate {
                path: r.path.to_path_buf(),
                key: CHAT_TEMPLATE_FIELD,
            })
        }
    };
    let text = |id: u32| tokens[id as usize].clone();
    let bos = token_id(r, "tokenizer.ggml.bos_token_id", tokens)?.map(text);
    ChatTemplate::new(
        source,
        format!("{} ({CHAT_TEMPLATE_FIELD})", r.path.display()),
        bos,
        Some(text(eos)),
    )
}

/// llama.cpp's q/k permutation, `[heads·d, in]`: rows `(h, 2, d/2)` → `(h, d/2, 2)`.
pub fn permute_rows(w: &Tensor, heads: usize) -> Result<Tensor> {
    let (out, cols) = w.dims2()?;
    let half = out / heads / 2;
    Ok(w.reshape((heads, 2, half, cols))?
        .transpose(1, 2)?
        .reshape((out, cols))?)
}

/// The inverse of [`permute_rows`].
pub fn unpermute_rows(w: &Tensor, heads: usize) -> Result<Tensor> {
    let (out, cols) = w.dims2()?;
    let half = out / heads / 2;
    Ok(w.reshape((heads, half, 2, cols))?
        .transpose(1, 2)?
        .reshape((out, cols))?)
}

/// Which row of a permuted `[rows, ..]` q/k matrix row `r` of
/// [`unpermute_rows`]' result comes from: `(h, t, i)` ← `(h, i, t)`.
fn unpermuted_source(r: usize, rows: usize, heads: usize) -> usize {
    let half = rows / heads / 2;
    let (h, within) = (r / (2 * half), r % (2 * half));
    let (t, i) = (within / half, within % half);
    h * 2 * half + i * 2 + t
}

/// [`unpermute_rows`] on a weight in either form.
fn unpermute_weight(w: Weight, heads: usize) -> Result<Weight> {
    Ok(match w {
        Weight::Dense(t) => Weight::Dense(unpermute_rows(&t, heads)?),
        Weight::Blocks(b) => {
            let rows = b.rows();
            b.permute_rows(|r| unpermuted_source(r, rows, heads)).into()
        }
    })
}

/// Load a Llama GGUF file: weights kept as `setting` says, tokenizer from metadata.
pub fn load(path: &Path, setting: WeightsSetting) -> Result<(Llama, Tokenizer)> {
    let mut r = open(path)?;
    let cfg = config_of(&r)?;
    let tokenizer = tokenizer_of(&r)?;
    let (h, ffn, qd, kvd) = (
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.q_dim(),
        cfg.kv_dim(),
    );
    let embed = r.weight("token_embd.weight", &[cfg.vocab_size, h], setting)?;
    let mut blocks = Vec::with_capacity(cfg.num_layers);
    for i in 0..cfg.num_layers {
        let name = |n: &str| format!("blk.{i}.{n}.weight");
        let mut linear = |n: &str, shape: &[usize]| -> Result<Linear> {
            Ok(Linear {
                weight: r.weight(&name(n), shape, setting)?,
                bias: None,
            })
        };
        let q = linear("attn_q", &[qd, h])?;
        let k = linear("attn_k", &[kvd, h])?;
        let (v, o) = (
            linear("attn_v", &[kvd, h])?,
            linear("attn_output", &[h, qd])?,
        );
        let gate = linear("ffn_gate", &[ffn, h])?;
        let up = linear("ffn_up", &[ffn, h])?;
        let down = linear("ffn_down", &[h, ffn])?;
        blocks.push(Block {
            attn_norm: r.tensor(&name("attn_norm"), &[h])?,
            q: Linear {
                weight: unpermute_weight(q.weight, cfg.num_heads)?,
                bias: None,
            },
            k: Linear {
                weight: unpermute_weight(k.weight, cfg.num_kv_heads)?,
                bias: None,
            },
            v,
            o,
            mlp_norm: r.tensor(&name("ffn_norm"), &[h])?,
            gate,
            up,
            down,
        });
    }
    let final_norm = r.tensor("output_norm.weight", &[h])?;
    let lm_head = if cfg.tie_word_embeddings {
        None
    } else {
        Some(r.weight("output.weight", &[cfg.vocab_size, h], setting)?)
    };
    Ok((
        Llama::new(cfg, embed, blocks, final_norm, lm_head)?,
        tokenizer,
    ))
}

/// The metadata and tensors of a GGUF file, before writing: tests edit them
/// to make broken files.
pub struct GgufContents {
    pub metadata: Vec<(String, Value)>,
    pub tensors: Vec<(String, Tensor)>,
}

impl GgufContents {
    /// `model` (HF layout) and its vocabulary, chat template and eos as a
    /// llama.cpp-style Llama GGUF, with q/k rows permuted as llama.cpp does.
    pub fn of(model: &Llama, vocab: &TinyVocab) -> Result<Self> {
        let cfg = &model.config;
        let (tokens, special) = (&vocab.tokens, &vocab.special);
        let u32v = |n: usize| Value::U32(n as u32);
        let strings = |v: &[String]| Value::Array(v.iter().cloned().map(Value::String).collect());
        let types = (0..tokens.len() as u32)
            .map(|i| {
                Value::I32(if special.contains(&i) {
                    TOKEN_TYPE_CONTROL
                } else {
                    1
                })
            })
            .collect();
        let metadata: Vec<(String, Value)> = [
            ("general.architecture", Value::String("llama".into())),
            ("general.name", Value::String(cfg.name.clone())),
            ("llama.block_count", u32v(cfg.num_layers)),
            ("llama.context_length", u32v(cfg.max_position_embeddings)),
            ("llama.embedding_length", u32v(cfg.hidden_size)),
            ("llama.feed_forward_length", u32v(cfg.intermediate_size)),
            ("llama.attention.head_count", u32v(cfg.num_heads)),
            ("llama.attention.head_count_kv", u32v(cfg.num_kv_heads)),
            ("llama.rope.freq_base", Value::F32(cfg.rope_theta as f32)),
            ("llama.rope.dimension_count", u32v(cfg.head_dim)),
            (
                "llama.attention.layer_norm_rms_epsilon",
                Value::F32(cfg.rms_norm_eps as f32),
            ),
            ("llama.vocab_size", u32v(cfg.vocab_size)),
            ("tokenizer.ggml.model", Value::String("gpt2".into())),
            ("tokenizer.ggml.pre", Value::String("smollm".into())),
            (
                CHAT_TEMPLATE_FIELD,
                Value::String(vocab.chat_template.into()),
            ),
            (EOS_FIELD, Value::U32(vocab.eos)),
            ("tokenizer.ggml.tokens", strings(tokens)),
            ("tokenizer.ggml.merges", strings(&vocab.merges)),
            ("tokenizer.ggml.token_type", Value::Array(types)),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();

        let mut tensors: Vec<(String, Tensor)> =
            vec![("token_embd.weight".into(), model.embed.dense()?)];
        for (i, b) in model.blocks.iter().enumerate() {
            let name = |n: &str| format!("blk.{i}.{n}.weight");
            tensors.push((name("attn_norm"), b.attn_norm.clone()));
            let q = permute_rows(&b.q.weight.dense()?, cfg.num_heads)?;
            tensors.push((name("attn_q"), q));
            let k = permute_rows(&b.k.weight.dense()?, cfg.num_kv_heads)?;
            tensors.push((name("attn_k"), k));
            tensors.push((name("attn_v"), b.v.weight.dense()?));
            tensors.push((name("attn_output"), b.o.weight.dense()?));
            tensors.push((name("ffn_norm"), b.mlp_norm.clone()));
            tensors.push((name("ffn_gate"), b.gate.weight.dense()?));
            tensors.push((name("ffn_up"), b.up.weight.dense()?));
            tensors.push((name("ffn_down"), b.down.weight.dense()?));
        }
        tensors.push(("output_norm.weight".into(), model.final_norm.clone()));
        if !cfg.tie_word_embeddings {
            tensors.push(("output.weight".into(), model.lm_head.dense()?));
        }
        Ok(GgufContents { metadata, tensors })
    }

    /// Write as a GGUF file with f32 tensors.
    pub fn write(&self, path: &Path) -> Result<()> {
        self.write_as(path, GgmlDType::F32, GgmlDType::F32)
    }

    /// Write as a GGUF file as llama.cpp quantizes: the matrices of the
    /// blocks in `linear`, the embedding and LM head in `embedding`, the
    /// norms in f32.
    pub fn write_as(&self, path: &Path, linear: GgmlDType, embedding: GgmlDType) -> Result<()> {
        let qtensors = self
            .tensors
            .iter()
            .map(|(n, t)| {
                let dtype = match t.rank() {
                    1 => GgmlDType::F32,
                    _ if n == "token_embd.weight" || n == "output.weight" => embedding,
                    _ => linear,
                };
                Ok((n.clone(), QTensor::quantize(&t.contiguous()?, dtype)?))
            })
            .collect::<Result<Vec<_>>>()?;
        let meta: Vec<(&str, &Value)> =
            self.metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
        let tensors: Vec<(&str, &QTensor)> =
            qtensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
        let mut file = File::create(path).map_err(Error::io(path))?;
        gguf_file::write(&mut file, &meta, &tensors)?;
        Ok(())
    }
}

/// Whether `path` starts with the GGUF magic.
pub fn is_gguf(path: &Path) -> bool {
    let mut magic = [0u8; 4];
    File::open(path)
        .and_then(|mut f| {
            f.rewind()?;
            f.read_exact(&mut magic)
        })
        .is_ok()
        && &magic == b"GGUF"
}
