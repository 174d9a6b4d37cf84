//! Tiny random Llama/Qwen2 models for tests: any dimensions, seeded, writable
//! as real GGUF files or HF directories.

use candle_core::{Device, Tensor};
use rand::Rng;

use super::chat::ChatTemplate;
use super::config::{Arch, ModelConfig};
use super::error::Result;
use super::model::{Block, Linear, Llama};
use super::tokenizer::{byte_to_char, Tokenizer};

/// The shape of a tiny model. `vocab` must be at least 259 (bytes + 3 specials).
#[derive(Debug, Clone)]
pub struct TinySpec {
    pub arch: Arch,
    pub vocab: usize,
    pub hidden: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub ffn: usize,
    pub max_positions: usize,
    pub tied: bool,
    pub seed: u64,
}

impl Default for TinySpec {
    fn default() -> Self {
        TinySpec {
            arch: Arch::Llama,
            vocab: 300,
            hidden: 32,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            ffn: 48,
            max_positions: 256,
            tied: true,
            seed: 0,
        }
    }
}

impl TinySpec {
    /// An error naming the sizes unless heads divide `hidden` into even head
    /// sizes, `kv_heads` divide the heads, every size is at least 1 and the
    /// vocabulary holds the 259 byte and special tokens.
    pub fn check(&self) -> Result<()> {
        let fits = self.heads > 0
            && self.kv_heads > 0
            && self.hidden.is_multiple_of(self.heads)
            && self.heads.is_multiple_of(self.kv_heads)
            && (self.hidden / self.heads).is_multiple_of(2)
            && self.layers > 0
            && self.ffn > 0
            && self.vocab >= 259;
        if fits {
            return Ok(());
        }
        Err(super::Error::BadTinySpec(format!(
            "hidden {} with {} heads and {} kv heads, {} layers, ffn {}, vocab {}: heads must \
             divide hidden into even head sizes, kv_heads divide heads, vocab be at least 259",
            self.hidden, self.heads, self.kv_heads, self.layers, self.ffn, self.vocab
        )))
    }

    /// The default model's shape (SmolLM2-135M-Instruct's `config.json`:
    /// 30 blocks of width 576, 9 query and 3 key/value heads, MLP 1536,
    /// 49152 tokens, tied embeddings): random weights of the real size, for
    /// speed measurements where the model cannot be fetched.
    pub fn default_model_shape() -> TinySpec {
        TinySpec {
            arch: Arch::Llama,
            vocab: 49152,
            hidden: 576,
            layers: 30,
            heads: 9,
            kv_heads: 3,
            ffn: 1536,
            max_positions: 8192,
            tied: true,
            seed: 0,
        }
    }
}

/// The vocabulary of a tiny model: the 256 byte tokens, `<|endoftext|>`,
/// `<|im_start|>`, `<|im_end|>`, then filler tokens; and what its metadata
/// says about chatting: a ChatML template, `<|im_end|>` as its eos.
#[derive(Debug, Clone)]
pub struct TinyVocab {
    pub tokens: Vec<String>,
    pub merges: Vec<String>,
    pub special: Vec<u32>,
    pub chat_template: &'static str,
    pub eos: u32,
}

/// The tiny models' chat template: ChatML, as in Hugging Face's ChatML models.
pub const TINY_CHAT_TEMPLATE: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

impl TinyVocab {
    pub fn new(vocab: usize) -> TinyVocab {
        let mut tokens: Vec<String> = byte_to_char().iter().map(|c| c.to_string()).collect();
        let special_start = tokens.len() as u32;
        tokens.extend(["<|endoftext|>", "<|im_start|>", "<|im_end|>"].map(String::from));
        let mut filler = 0;
        while tokens.len() < vocab {
            tokens.push(format!("<extra_{filler}>"));
            filler += 1;
        }
        TinyVocab {
            tokens,
            merges: Vec::new(),
            special: (special_start..special_start + 3).collect(),
            chat_template: TINY_CHAT_TEMPLATE,
            eos: special_start + 2,
        }
    }

    /// Write `model` with this vocabulary as a Llama GGUF file.
    pub fn write_gguf(&self, path: &std::path::Path, model: &Llama) -> Result<()> {
        super::gguf::GgufContents::of(model, self)?.write(path)
    }

    /// The text of token `id` (empty outside the vocabulary).
    pub fn text(&self, id: u32) -> &str {
        self.tokens.get(id as usize).map_or("", String::as_str)
    }

    pub fn tokenizer(&self) -> Result<Tokenizer> {
        let chat = ChatTemplate::new(
            self.chat_template,
            "the tiny model's chat template",
            None,
            Some(self.text(self.eos).to_string()),
        )?;
        Tokenizer::from_bpe(&self.tokens, &self.merges, &self.special, chat, &[self.eos])
    }
}

fn uniform(rng: &mut impl Rng, shape: &[usize], scale: f32, offset: f32) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let data: Vec<f32> = (0..n)
        .map(|_| offset + scale * rng.random_range(-1.0f32..1.0))
        .collect();
    Ok(Tensor::from_vec(data, shape, &Device::Cpu)?)
}

/// A random model of the given shape, weights drawn from the seeded stream.
pub fn build(spec: &TinySpec) -> Result<(Llama, TinyVocab)> {
    spec.check()?;
    let vocab = TinyVocab::new(spec.vocab);
    let config = ModelConfig {
        arch: spec.arch,
        name: format!("tiny-{:?}-{}", spec.arch, spec.seed).to_lowercase(),
        vocab_size: vocab.tokens.len(),
        hidden_size: spec.hidden,
        intermediate_size: spec.ffn,
        num_layers: spec.layers,
        num_heads: spec.heads,
        num_kv_heads: spec.kv_heads,
        head_dim: spec.hidden / spec.heads,
        rope_theta: 10_000.0,
        rms_norm_eps: 1.0 / 65536.0, // exact in f32, so GGUF round trips compare equal
        max_position_embeddings: spec.max_positions,
        tie_word_embeddings: spec.tied,
    };
    let mut rng = crate::keyed_stream!(spec.seed, "tiny-model");
    let (h, f, qd, kvd) = (
        config.hidden_size,
        config.intermediate_size,
        config.q_dim(),
        config.kv_dim(),
    );
    let linear = |rng: &mut _, out: usize, inp: usize, bias: bool| -> Result<Linear> {
        let scale = 1.0 / (inp as f32).sqrt();
        Ok(Linear {
            weight: uniform(rng, &[out, inp], scale * 1.5, 0.0)?.into(),
            bias: if bias {
                Some(uniform(rng, &[out], 0.1, 0.0)?)
            } else {
                None
            },
        })
    };
    let embed = uniform(&mut rng, &[config.vocab_size, h], 1.0, 0.0)?.into();
    let bias = config.attention_bias();
    let mut blocks = Vec::new();
    for _ in 0..config.num_layers {
        blocks.push(Block {
            attn_norm: uniform(&mut rng, &[h], 0.1, 1.0)?,
            q: linear(&mut rng, qd, h, bias)?,
            k: linear(&mut rng, kvd, h, bias)?,
            v: linear(&mut rng, kvd, h, bias)?,
            o: linear(&mut rng, h, qd, false)?,
            mlp_norm: uniform(&mut rng, &[h], 0.1, 1.0)?,
            gate: linear(&mut rng, f, h, false)?,
            up: linear(&mut rng, f, h, false)?,
            down: linear(&mut rng, h, f, false)?,
        });
    }
    let final_norm = uniform(&mut rng, &[h], 0.1, 1.0)?;
    let lm_head = if spec.tied {
        None
    } else {
        Some(uniform(&mut rng, &[config.vocab_size, h], 0.5, 0.0)?.into())
    };
    Ok((
        Llama::new(config, embed, blocks, final_norm, lm_head)?,
        vocab,
    ))
}
