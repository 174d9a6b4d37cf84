//! The Llama-family forward pass (Llama, Qwen2), the one every pass runs:
//! generation (with a KV cache), scoring, and the train step (which asks it to
//! save the activations its backward, `compute::tape`, reads). A LoRA delta is
//! added to every linear projection through [`LoraHook`].
//!
//! ```text
//! h₀ = embed(tokens)
//! for each block:
//!     a  = RMSNorm(h)                 q,k,v = a·Wqᵀ (+bias) + Δq(a), ...
//!     q,k = RoPE(q,k, positions)      attn  = softmax(q·kᵀ/√d + mask)·v   (GQA)
//!     h  = h + attn·Woᵀ + Δo(attn)
//!     m  = RMSNorm(h)                 h = h + down(silu(gate(m)) ⊙ up(m))
//! logits = RMSNorm(h)·Eᵀ              (E = lm_head, or the embedding when tied)
//! ```
//!
//! Rows of a batch may have different lengths: they are left-padded, each row
//! carries its own RoPE positions, and an additive mask hides padding and the
//! future. No pass records candle autograd (the base is frozen; the train
//! step's gradients are written out by hand): on the CPU, in f32 or f64, RMSNorm,
//! RoPE with the head split, the attention softmax, SwiGLU and the residual
//! additions are the fused kernels of [`super::kernels`], whose backwards
//! `compute::tape` uses; elsewhere (CUDA) candle's fused ops.

use std::collections::BTreeMap;

use candle_core::{DType, Device, IndexOp, Module, Tensor};

use super::blocks::{BlockFormat, BlockMatrix, BLOCK};
use super::config::ModelConfig;
use super::decode_attention;
use super::error::Result;
use super::gemm;
use super::kernels::{self, Heads};
use super::ops::{frozen_matmul, target_logprobs};
use super::weight::Weight;
use super::Target;

/// Added to masked attention scores. Finite so that a fully masked (padding)
/// query row yields a harmless uniform distribution instead of NaN.
const MASKED: f32 = -1e9;

/// Supplies the low-rank update of a projection: `Δ(x) = s·(x·Aᵀ)·Bᵀ` per row.
/// The base model knows nothing about adapters beyond this hook.
pub trait LoraHook {
    /// `y`, the frozen projection `target` of `layer` for input `x`
    /// (`[rows, tokens, in]` → `[rows, tokens, out]`), plus each row's delta
    /// (`y` itself when no row has an adapter there). `y` is given up: a hook
    /// may add into its storage in place. With `keep`, the hook also leaves
    /// there what its own backward will need.
    fn add_delta(
        &self,
        layer: usize,
        target: Target,
        x: &Tensor,
        y: Tensor,
        keep: Option<&mut LoraKept>,
    ) -> Result<Tensor>;
}

/// What a [`LoraHook`] keeps of one projection for its backward: each
/// segment's `x·Aᵀ` (`None` where that segment has no delta there).
pub type LoraKept = Vec<Option<Tensor>>;

/// The hook of the plain base model.
pub struct NoLora;

impl LoraHook for NoLora {
    fn add_delta(
        &self,
        _: usize,
        _: Target,
        _: &Tensor,
        y: Tensor,
        _: Option<&mut LoraKept>,
    ) -> Result<Tensor> {
        Ok(y)
    }
}

/// What one block's forward saves for the train step's backward.
/// Activations are `[tokens, width]` (rows flattened) unless noted. The two
/// norms' outputs are not kept: [`BlockActivations::norms`] recomputes them
/// with the forward's own kernel, so with the forward's bits, for a sixth of
/// the tape's memory.
#[derive(Debug)]
pub struct BlockActivations {
    /// The block's input.
    pub x: Tensor,
    /// `[rows, heads, n, head_dim]`, after RoPE.
    pub q: Tensor,
    /// `[rows, kv_heads, n, head_dim]`, after RoPE.
    pub k: Tensor,
    /// `[rows, kv_heads, n, head_dim]`.
    pub v: Tensor,
    /// The attention output, the input of o.
    pub attn: Tensor,
    /// `x` plus the attention's projection.
    pub x2: Tensor,
    pub gate: Tensor,
    pub up: Tensor,
    /// What the LoRA hook kept of each projection.
    pub lora: BTreeMap<Target, LoraKept>,
}

impl BlockActivations {
    /// Block `block`'s two norms as its forward formed them: `RMSNorm(x)`,
    /// the input of q, k and v, and `RMSNorm(x2)`, the input of gate and up.
    pub fn norms(&self, block: &Block, eps: f64) -> Result<(Tensor, Tensor)> {
        Ok((
            rms_norm(&self.x, &block.attn_norm, eps)?,
            rms_norm(&self.x2, &block.mlp_norm, eps)?,
        ))
    }
}

/// A frozen projection `y = x·Wᵀ + b`, `W` `[out, in]`.
#[derive(Debug, Clone)]
pub struct Linear {
    pub weight: Weight,
    pub bias: Option<Tensor>,
}

impl Linear {
    /// `W` a tensor, no bias.
    pub fn dense(weight: Tensor) -> Linear {
        Linear {
            weight: Weight::Dense(weight),
            bias: None,
        }
    }
}

impl Module for Linear {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        // Flatten to 2-D so candle runs one GEMM instead of a batched one.
        let (rows, tokens, dim) = x.dims3()?;
        let y = frozen_matmul(&x.reshape((rows * tokens, dim))?, &self.weight)?.reshape((
            rows,
            tokens,
            (),
        ))?;
        match &self.bias {
            Some(b) => y.broadcast_add(b),
            None => Ok(y),
        }
    }
}

#[derive(Debug, Clone)]
pub struct Block {
    pub attn_norm: Tensor,
    pub q: Linear,
    pub k: Linear,
    pub v: Linear,
    pub o: Linear,
    pub mlp_norm: Tensor,
    pub gate: Linear,
    pub up: Linear,
    pub down: Linear,
}

impl Block {
    pub fn linear(&self, target: Target) -> &Linear {
        match target {
            Target::Q => &self.q,
            Target::K => &self.k,
            Target::V => &self.v,
            Target::O => &self.o,
            Target::Gate => &self.gate,
            Target::Up => &self.up,
            Target::Down => &self.down,
        }
    }
}

/// The frozen weights of a Llama-family model, in HF layout. The matrices
/// are [`Weight`]s (tensors, or blocks as a GGUF holds them); the norms and
/// biases are tensors in the dtype the activations take ([`Llama::dtype`]).
#[derive(Debug, Clone)]
pub struct Llama {
    pub config: ModelConfig,
    pub embed: Weight,
    pub blocks: Vec<Block>,
    pub final_norm: Tensor,
    /// `[vocab, hidden]`; the embedding itself when tied.
    pub lm_head: Weight,
    rope_cos: Tensor,
    rope_sin: Tensor,
}

/// Keys and values of earlier positions, one pair per layer,
/// `[rows, kv_heads, slots, head_dim]`. Each layer's buffers keep spare slots
/// so a decode step writes its new position in place: re-concatenating the
/// whole cache every step cost a 32-row SmolLM2 step ≈ 75 ms of ≈ 200.
/// Generation only: a train step runs without one.
#[derive(Debug, Default)]
pub struct KvCache {
    layers: Vec<Option<LayerCache>>,
}

/// One layer's key and value buffers and how many of their slots are filled.
#[derive(Debug)]
struct LayerCache {
    k: Tensor,
    v: Tensor,
    len: usize,
}

/// Buffers grow in steps of this many slots (default 128): one copy of the
/// cache per 128 decode steps, at most 127 empty slots per row.
pub const CACHE_SLOT_BLOCK: usize = 128;

impl LayerCache {
    fn filled(&self) -> Result<(Tensor, Tensor)> {
        Ok((
            self.k.narrow(2, 0, self.len)?,
            self.v.narrow(2, 0, self.len)?,
        ))
    }

    /// Room for `slots` positions, keeping the filled ones.
    fn reserve(&mut self, slots: usize) -> Result<()> {
        let capacity = self.k.dim(2)?;
        if slots <= capacity {
            return Ok(());
        }
        let grow = |t: &Tensor| -> Result<Tensor> {
            let (rows, heads, _, hd) = t.dims4()?;
            let spare = slots.next_multiple_of(CACHE_SLOT_BLOCK) - self.len;
            let empty = Tensor::zeros((rows, heads, spare, hd), t.dtype(), t.device())?;
            Ok(Tensor::cat(&[&t.narrow(2, 0, self.len)?, &empty], 2)?)
        };
        self.k = grow(&self.k)?;
        self.v = grow(&self.v)?;
        Ok(())
    }
}

impl KvCache {
    pub fn new(num_layers: usize) -> KvCache {
        KvCache {
            layers: (0..num_layers).map(|_| None).collect(),
        }
    }

    /// Number of cached positions (including left padding).
    pub fn len(&self) -> usize {
        self.layers
            .first()
            .and_then(|l| l.as_ref())
            .map_or(0, |l| l.len)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Keep only the given rows (finished rows leave the batch).
    pub fn select_rows(&mut self, rows: &Tensor) -> Result<()> {
        for l in self.layers.iter_mut().flatten() {
            l.k = l.k.index_select(rows, 0)?;
            l.v = l.v.index_select(rows, 0)?;
        }
        Ok(())
    }

    /// Write the new positions' `k`, `v` after the cached ones; returns all
    /// filled positions (views into the buffers).
    fn append(&mut self, layer: usize, k: Tensor, v: Tensor) -> Result<(Tensor, Tensor)> {
        let (k, v) = (k.contiguous()?, v.contiguous()?);
        let mut cache = match self.layers[layer].take() {
            Some(cache) => cache,
            None => LayerCache {
                k: k.narrow(2, 0, 0)?,
                v: v.narrow(2, 0, 0)?,
                len: 0,
            },
        };
        cache.reserve(cache.len + k.dim(2)?)?;
        cache.k.slice_set(&k, 2, cache.len)?;
        cache.v.slice_set(&v, 2, cache.len)?;
        cache.len += k.dim(2)?;
        let filled = cache.filled();
        self.layers[layer] = Some(cache);
        filled
    }
}

/// Where each new token sits: per-row RoPE positions and the attention mask
/// over all (cached + new) key slots.
#[derive(Debug, Clone)]
pub struct Positions {
    /// `[rows, new_tokens]` u32: the RoPE position of each new token.
    pub positions: Tensor,
    /// `[rows, 1, new_tokens, total_slots]` f32, 0 where visible, `MASKED` elsewhere.
    pub mask: Tensor,
}

impl Positions {
    /// For rows that are left-padded by `pad[r]` slots: the new tokens occupy
    /// slots `past..past+new`; a key slot is visible to a query when it is not
    /// padding and not in the query's future.
    pub fn left_padded(
        pad: &[usize],
        past: usize,
        new: usize,
        device: &Device,
    ) -> Result<Positions> {
        let total = past + new;
        let rows = pad.len();
        let mut positions = Vec::with_capacity(rows * new);
        let mut mask = Vec::with_capacity(rows * new * total);
        for &p in pad {
            for q in past..total {
                positions.push(q.saturating_sub(p) as u32);
                mask.extend((0..total).map(|k| if k >= p && k <= q { 0.0 } else { MASKED }));
            }
        }
        Ok(Positions {
            positions: Tensor::from_vec(positions, (rows, new), device)?,
            mask: Tensor::from_vec(mask, (rows, 1, new, total), device)?,
        })
    }

    /// Rows of `width` slots, no cache, where each slot carries any RoPE
    /// position (`positions[r][slot]`, `width` of them per row) and a query
    /// slot sees a key slot where `visible(row, query, key)`: packed train
    /// rows, several sequences sharing one prompt.
    pub fn packed(
        positions: &[Vec<u32>],
        width: usize,
        visible: impl Fn(usize, usize, usize) -> bool,
        device: &Device,
    ) -> Result<Positions> {
        let rows = positions.len();
        let mut mask = Vec::with_capacity(rows * width * width);
        for r in 0..rows {
            for q in 0..width {
                mask.extend((0..width).map(|k| if visible(r, q, k) { 0.0 } else { MASKED }));
            }
        }
        Ok(Positions {
            positions: Tensor::from_vec(positions.concat(), (rows, width), device)?,
            mask: Tensor::from_vec(mask, (rows, 1, width, width), device)?,
        })
    }
}

/// What every block of one pass shares: each row's RoPE cos/sin
/// `[rows, 1, new, head_dim/2]` and the attention mask.
#[derive(Debug, Clone)]
pub struct BlockContext {
    pub cos: Tensor,
    pub sin: Tensor,
    /// `[rows, 1, new, total_slots]`, 0 where visible, a large negative number elsewhere.
    pub mask: Tensor,
}

/// Which positions to turn into logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    All,
    Last,
}

impl Llama {
    pub fn new(
        config: ModelConfig,
        embed: Weight,
        blocks: Vec<Block>,
        final_norm: Tensor,
        lm_head: Option<Weight>,
    ) -> Result<Llama> {
        let lm_head = lm_head.unwrap_or_else(|| embed.clone());
        let (rope_cos, rope_sin) = rope_tables(&config, final_norm.device())?;
        Ok(Llama {
            config,
            embed,
            blocks,
            final_norm,
            lm_head,
            rope_cos,
            rope_sin,
        })
    }

    /// The same model with every tensor in `dtype` (f64 for gradient
    /// checks); weights in blocks stay blocks, and the activations then take
    /// `dtype`.
    pub fn to_dtype(&self, dtype: DType) -> Result<Llama> {
        self.map_weights(|t| t.to_dtype(dtype), false)
    }

    /// The same model with every weight on `device` (a GPU for the CUDA
    /// broker): weights in blocks go as f32 tensors.
    pub fn to_device(&self, device: &Device) -> Result<Llama> {
        self.map_weights(|t| t.to_device(device), !device.is_cpu())
    }

    /// The same model with every matrix an f32 tensor: the values of its
    /// blocks (what `[model] weights = "f32"` loads).
    pub fn dequantized(&self) -> Result<Llama> {
        self.map_weights(|t| Ok(t.clone()), true)
    }

    /// The same model with its matrices quantized by candle, as llama.cpp
    /// quantizes a GGUF: the blocks' projections to `linear`, the embedding
    /// and LM head to `embedding` (matrices whose rows are not whole blocks
    /// stay as they are). For tests and speed measurements of random models;
    /// a loaded GGUF keeps the file's own blocks.
    pub fn quantized(&self, linear: BlockFormat, embedding: BlockFormat) -> Result<Llama> {
        let quantize = |w: &Weight, format: BlockFormat| -> Result<Weight> {
            let t = w.dense()?.to_dtype(DType::F32)?;
            if !t.dim(1)?.is_multiple_of(BLOCK) {
                return Ok(w.clone());
            }
            Ok(BlockMatrix::quantize(&t, format)?.into())
        };
        let mut model = self.clone();
        for block in &mut model.blocks {
            for l in [
                &mut block.q,
                &mut block.k,
                &mut block.v,
                &mut block.o,
                &mut block.gate,
                &mut block.up,
                &mut block.down,
            ] {
                l.weight = quantize(&l.weight, linear)?;
            }
        }
        model.embed = quantize(&self.embed, embedding)?;
        model.lm_head = if self.lm_head.same(&self.embed) {
            model.embed.clone()
        } else {
            quantize(&self.lm_head, embedding)?
        };
        Ok(model)
    }

    /// Every tensor through `f`, blocks too when `dense_blocks` (decoded to
    /// f32 first); a tied head stays tied (one copy).
    fn map_weights(
        &self,
        f: impl Fn(&Tensor) -> candle_core::Result<Tensor>,
        dense_blocks: bool,
    ) -> Result<Llama> {
        let linear = |l: &Linear| -> Result<Linear> {
            Ok(Linear {
                weight: l.weight.map(&f, dense_blocks)?,
                bias: l.bias.as_ref().map(&f).transpose()?,
            })
        };
        let blocks = self
            .blocks
            .iter()
            .map(|b| {
                Ok(Block {
                    attn_norm: f(&b.attn_norm)?,
                    q: linear(&b.q)?,
                    k: linear(&b.k)?,
                    v: linear(&b.v)?,
                    o: linear(&b.o)?,
                    mlp_norm: f(&b.mlp_norm)?,
                    gate: linear(&b.gate)?,
                    up: linear(&b.up)?,
                    down: linear(&b.down)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let embed = self.embed.map(&f, dense_blocks)?;
        let lm_head = if self.lm_head.same(&self.embed) {
            embed.clone()
        } else {
            self.lm_head.map(&f, dense_blocks)?
        };
        Ok(Llama {
            config: self.config.clone(),
            embed,
            blocks,
            final_norm: f(&self.final_norm)?,
            lm_head,
            rope_cos: f(&self.rope_cos)?,
            rope_sin: f(&self.rope_sin)?,
        })
    }

    pub fn device(&self) -> &Device {
        self.final_norm.device()
    }

    /// The activations' dtype: the norms' (f32, or f64 for gradient checks).
    pub fn dtype(&self) -> DType {
        self.final_norm.dtype()
    }

    /// Look up token embeddings: `[rows, tokens]` u32 → `[rows, tokens, hidden]`.
    pub fn embed(&self, tokens: &Tensor) -> Result<Tensor> {
        let (rows, n) = tokens.dims2()?;
        let flat = self.embed.rows(&tokens.flatten_all()?, self.dtype())?;
        Ok(flat.reshape((rows, n, self.config.hidden_size))?)
    }

    /// Bytes the frozen weights hold: every matrix (a tied head once), the
    /// norms and biases.
    pub fn resident_bytes(&self) -> usize {
        let tensor = |t: &Tensor| t.elem_count() * t.dtype().size_in_bytes();
        let head = if self.lm_head.same(&self.embed) {
            0
        } else {
            self.lm_head.resident_bytes()
        };
        let blocks: usize = self
            .blocks
            .iter()
            .map(|b| {
                let linears: usize = Target::ALL
                    .iter()
                    .map(|&t| {
                        let l = b.linear(t);
                        l.weight.resident_bytes() + l.bias.as_ref().map_or(0, tensor)
                    })
                    .sum();
                linears + tensor(&b.attn_norm) + tensor(&b.mlp_norm)
            })
            .sum();
        self.embed.resident_bytes() + head + blocks + tensor(&self.final_norm)
    }

    /// Logits for `tokens` (`[rows, new]`), continuing `cache` when given.
    pub fn forward(
        &self,
        tokens: &Tensor,
        at: &Positions,
        cache: Option<&mut KvCache>,
        lora: &dyn LoraHook,
        logits: Logits,
    ) -> Result<Tensor> {
        let h = self.embed(tokens)?;
        self.forward_embeds(&h, at, cache, lora, logits)
    }

    /// The forward from input embeddings `[rows, new, hidden]` (the entry point
    /// of a pass over embeddings built elsewhere).
    pub fn forward_embeds(
        &self,
        embeds: &Tensor,
        at: &Positions,
        cache: Option<&mut KvCache>,
        lora: &dyn LoraHook,
        logits: Logits,
    ) -> Result<Tensor> {
        let h = self.hidden_states(embeds, at, cache, lora, None)?;
        let h = match logits {
            Logits::All => h,
            Logits::Last => h.i((.., h.dim(1)? - 1..))?,
        };
        self.head(&h)
    }

    /// The last block's output `[rows, new, hidden]`, before the final norm.
    /// With `save`, each block's [`BlockActivations`] are pushed there, first
    /// block first (the train step; no cache then).
    pub fn hidden_states(
        &self,
        embeds: &Tensor,
        at: &Positions,
        mut cache: Option<&mut KvCache>,
        lora: &dyn LoraHook,
        mut save: Option<&mut Vec<BlockActivations>>,
    ) -> Result<Tensor> {
        if save.is_some() && cache.is_some() {
            return Err(candle_core::Error::Msg(
                "a pass that saves activations for the backward cannot continue a KV cache".into(),
            )
            .into());
        }
        let shared = self.block_context(at, embeds.dtype())?;
        let mut h = embeds.clone();
        for layer in 0..self.blocks.len() {
            let pass = BlockPass {
                model: self,
                layer,
                ctx: &shared,
                lora,
            };
            let (y, saved) = pass.forward(h, cache.as_deref_mut(), save.is_some())?;
            if let (Some(save), Some(saved)) = (save.as_deref_mut(), saved) {
                save.push(saved);
            }
            h = y;
        }
        Ok(h)
    }

    /// What every block of a pass over `at` shares, in `dtype`.
    pub fn block_context(&self, at: &Positions, dtype: DType) -> Result<BlockContext> {
        let (cos, sin) = self.rope_at(&at.positions)?;
        Ok(BlockContext {
            cos: cos.to_dtype(dtype)?,
            sin: sin.to_dtype(dtype)?,
            mask: at.mask.to_dtype(dtype)?,
        })
    }

    /// Final norm and LM head: `[..., hidden]` → `[..., vocab]`.
    pub fn head(&self, h: &Tensor) -> Result<Tensor> {
        let h = rms_norm(h, &self.final_norm, self.config.rms_norm_eps)?;
        let dims = h.dims().to_vec();
        let hidden = self.config.hidden_size;
        let flat = frozen_matmul(&h.reshape(((), hidden))?, &self.lm_head)?;
        let mut out_dims = dims[..dims.len() - 1].to_vec();
        out_dims.push(self.config.vocab_size);
        Ok(flat.reshape(out_dims)?)
    }

    /// `log p(target | prefix)` for last-block outputs `h` `[n, hidden]` and
    /// one target token per row: `[n]`, without forming `[n, vocab]` logits
    /// all at once.
    pub fn target_logprobs(&self, h: &Tensor, targets: &[u32]) -> Result<Tensor> {
        let h = rms_norm(h, &self.final_norm, self.config.rms_norm_eps)?;
        Ok(target_logprobs(&h, &self.lm_head, targets)?)
    }

    /// cos/sin for each row's positions: `[rows, 1, new, head_dim/2]`.
    fn rope_at(&self, positions: &Tensor) -> Result<(Tensor, Tensor)> {
        let (rows, n) = positions.dims2()?;
        let flat = positions.flatten_all()?;
        let gather = |table: &Tensor| -> Result<Tensor> {
            Ok(table
                .index_select(&flat, 0)?
                .reshape((rows, 1, n, self.config.head_dim / 2))?)
        };
        Ok((gather(&self.rope_cos)?, gather(&self.rope_sin)?))
    }
}

/// One block of one pass.
struct BlockPass<'a> {
    model: &'a Llama,
    layer: usize,
    ctx: &'a BlockContext,
    lora: &'a dyn LoraHook,
}

impl BlockPass<'_> {
    /// The block's output for input `h` `[rows, new, hidden]`, continuing
    /// `cache` when given, and with `save` what the backward needs.
    fn forward(
        &self,
        h: Tensor,
        cache: Option<&mut KvCache>,
        save: bool,
    ) -> Result<(Tensor, Option<BlockActivations>)> {
        let cfg = &self.model.config;
        let block = &self.model.blocks[self.layer];
        let BlockContext { cos, sin, mask } = self.ctx;
        let (rows, n, _) = h.dims3()?;
        let (heads, kv_heads, hd) = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
        let eps = cfg.rms_norm_eps;
        let mut kept = save.then(BTreeMap::new);
        let mut proj = |target: Target, x: &Tensor| -> Result<Tensor> {
            let y = block.linear(target).forward(x)?;
            let Some(kept) = kept.as_mut() else {
                return self.lora.add_delta(self.layer, target, x, y, None);
            };
            let mut keep = LoraKept::new();
            let y = self
                .lora
                .add_delta(self.layer, target, x, y, Some(&mut keep))?;
            kept.insert(target, keep);
            Ok(y)
        };

        let a = rms_norm(&h, &block.attn_norm, eps)?;
        let q = split_rope(&proj(Target::Q, &a)?, heads, hd, cos, sin)?;
        let k = split_rope(&proj(Target::K, &a)?, kv_heads, hd, cos, sin)?;
        let v = split_heads(&proj(Target::V, &a)?, kv_heads, hd)?;
        let (all_k, all_v) = match cache {
            Some(c) => c.append(self.layer, k.clone(), v.clone())?,
            None => (k.clone(), v.clone()),
        };
        let attn = attention(&q, &all_k, &all_v, mask, kv_heads)?;
        let attn = attn.transpose(1, 2)?.reshape((rows, n, heads * hd))?;
        let x2 = residual(&h, &proj(Target::O, &attn)?)?;

        let m = rms_norm(&x2, &block.mlp_norm, eps)?;
        let gate = proj(Target::Gate, &m)?;
        let up = proj(Target::Up, &m)?;
        let y = residual(&x2, &proj(Target::Down, &swiglu(&gate, &up)?)?)?;

        let Some(lora) = kept else {
            return Ok((y, None));
        };
        let tokens = |t: Tensor| t.reshape((rows * n, ()));
        let saved = BlockActivations {
            x: tokens(h)?,
            q,
            k,
            v,
            attn: tokens(attn)?,
            x2: tokens(x2)?,
            gate: tokens(gate)?,
            up: tokens(up)?,
            lora,
        };
        Ok((y, Some(saved)))
    }
}

fn rope_tables(cfg: &ModelConfig, device: &Device) -> Result<(Tensor, Tensor)> {
    let half = cfg.head_dim / 2;
    let inv_freq: Vec<f32> = (0..half)
        .map(|i| 1.0 / cfg.rope_theta.powf(2.0 * i as f64 / cfg.head_dim as f64) as f32)
        .collect();
    let max = cfg.max_position_embeddings;
    let inv_freq = Tensor::from_vec(inv_freq, (1, half), device)?;
    let t = Tensor::arange(0u32, max as u32, device)?
        .to_dtype(DType::F32)?
        .reshape((max, 1))?;
    let freqs = t.matmul(&inv_freq)?;
    Ok((freqs.cos()?, freqs.sin()?))
}

/// The dtype of `t` when it can go through our kernels (f32 or f64 on the
/// CPU); `None` sends it to candle's ops.
fn kernel_dtype(t: &Tensor) -> Option<DType> {
    let real = matches!(t.dtype(), DType::F32 | DType::F64);
    (real && t.device().is_cpu()).then_some(t.dtype())
}

/// RMSNorm: `x / √(mean(x²) + ε) · w`.
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    let x = x.contiguous()?;
    Ok(match kernel_dtype(&x) {
        Some(DType::F32) => kernels::rms_norm::<f32>(&x, weight, eps)?,
        Some(_) => kernels::rms_norm::<f64>(&x, weight, eps)?,
        None => candle_nn::ops::rms_norm(&x, weight, eps as f32)?,
    })
}

/// `h + y`, on the CPU in one vectorised pass on the same threads as the rest
/// of the pass's kernels.
fn residual(h: &Tensor, y: &Tensor) -> Result<Tensor> {
    let (h, y) = (h.contiguous()?, y.contiguous()?);
    Ok(match kernel_dtype(&h) {
        Some(DType::F32) => kernels::add::<f32>(&h, &y)?,
        Some(_) => kernels::add::<f64>(&h, &y)?,
        None => (h + y)?,
    })
}

/// SwiGLU's product `silu(gate) ⊙ up`.
fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    let (gate, up) = (gate.contiguous()?, up.contiguous()?);
    Ok(match kernel_dtype(&gate) {
        Some(DType::F32) => kernels::swiglu::<f32>(&gate, &up)?,
        Some(_) => kernels::swiglu::<f64>(&gate, &up)?,
        None => (gate.silu()? * up)?,
    })
}

/// A projection `[rows, new, heads·head_dim]` split into heads:
/// `[rows, heads, new, head_dim]`.
fn split_heads(t: &Tensor, heads: usize, head_dim: usize) -> Result<Tensor> {
    let (rows, n, _) = t.dims3()?;
    Ok(t.reshape((rows, n, heads, head_dim))?
        .transpose(1, 2)?
        .contiguous()?)
}

/// [`split_heads`] then HF ("rotate half") RoPE, on the CPU in one fused pass.
fn split_rope(
    t: &Tensor,
    heads: usize,
    head_dim: usize,
    cos: &Tensor,
    sin: &Tensor,
) -> Result<Tensor> {
    let (rows, n, _) = t.dims3()?;
    if rows * n == 0 {
        return split_heads(t, heads, head_dim);
    }
    let Some(dtype) = kernel_dtype(t) else {
        let flat = |c: &Tensor| c.reshape((rows, n, head_dim / 2));
        let x = split_heads(t, heads, head_dim)?;
        return Ok(candle_nn::rotary_emb::rope(&x, &flat(cos)?, &flat(sin)?)?);
    };
    let shape = Heads {
        rows,
        n,
        heads,
        head_dim,
    };
    let flat = t.reshape((rows * n, heads * head_dim))?.contiguous()?;
    let (cos, sin) = (cos.contiguous()?, sin.contiguous()?);
    Ok(match dtype {
        DType::F32 => kernels::rope_heads::<f32>(&flat, &cos, &sin, shape)?,
        _ => kernels::rope_heads::<f64>(&flat, &cos, &sin, shape)?,
    })
}

/// Grouped-query attention. Query heads come in groups that share one KV head,
/// so folding each group into the token axis lets one matmul serve the group
/// without copying K and V.
fn attention(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Tensor, kv_heads: usize) -> Result<Tensor> {
    if decode_attention::applies(q, k, v) {
        return Ok(decode_attention::decode_attention(q, k, v, mask)?);
    }
    let (rows, heads, n, hd) = q.dims4()?;
    let slots = k.dim(2)?;
    let group = heads / kv_heads;
    let scale = 1.0 / (hd as f64).sqrt();
    let fused = kernel_dtype(q).filter(|_| q.elem_count() > 0 && slots > 0);
    // Unfused, scaling q rather than the scores touches n·hd values instead
    // of n·slots; fused, scale, mask and softmax are one pass over the scores.
    let q = match fused {
        Some(_) => q.clone(),
        None => (q * scale)?,
    };
    let q = q.reshape((rows, kv_heads, group * n, hd))?;
    let scores = gemm::matmul(&q, &k.t()?)?.reshape((rows, heads, n, slots))?;
    let mask = mask.contiguous()?;
    let probs = match fused {
        Some(DType::F32) => kernels::masked_softmax::<f32>(&scores, &mask, scale)?,
        Some(_) => kernels::masked_softmax::<f64>(&scores, &mask, scale)?,
        None => candle_nn::ops::softmax_last_dim(&scores.broadcast_add(&mask)?)?,
    };
    let probs = probs.reshape((rows, kv_heads, group * n, slots))?;
    Ok(gemm::matmul(&probs, v)?.reshape((rows, heads, n, hd))?)
}
