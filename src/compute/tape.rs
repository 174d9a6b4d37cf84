//! The train step's backward, written out by hand, over the activations that
//! the model's one forward saved (`Llama::hidden_states` with `save`).
//!
//! The base is frozen, so the backward needs only input gradients through the
//! frozen projections and the LoRA factors' own gradients. candle's autograd
//! would also allocate a zeroed gradient and add into it for every edge of the
//! graph, and keep every intermediate alive; here each block saves its
//! activations (about 5.8k values per token, 23 KB in f32 for SmolLM2, so 1.4 GB
//! for a 2048-token micro-batch of its 30 blocks) and the backward reads them
//! top down (the norms' outputs are recomputed rather than saved):
//!
//! ```text
//! forward (per block)                       backward (per block, reversed)
//! a   = RMSNorm(x)                          ∂s      = ∂y·W_down + LoRA
//! q,k = RoPE(a·Wq, a·Wk), v = a·Wv          ∂gate, ∂up from ∂s (SwiGLU)
//! P   = softmax(q·kᵀ/√d + mask)             ∂m      = ∂gate·W_gate + ∂up·W_up
//! x₂  = x + (P·v)·Wo                        ∂x₂     = ∂y + RMSNorm'(∂m)
//! m   = RMSNorm(x₂)                         ∂attn   = ∂x₂·Wo;  P recomputed
//! y   = x₂ + (silu(m·Wg) ⊙ m·Wu)·W_down     ∂v = Pᵀ·∂o, ∂S = P⊙(∂P − Σ∂P⊙P)
//!                                           ∂q = ∂S·k/√d, ∂k = ∂Sᵀ·q/√d, RoPE⁻¹
//!                                           ∂x      = ∂x₂ + RMSNorm'(∂q·Wq + ∂k·Wk + ∂v·Wv)
//! ```
//!
//! Every projection's LoRA backward is [`RowAdapters::factor_grads`]. The
//! first block's input gradient is never formed (the embeddings are frozen).

use std::collections::BTreeMap;

use candle_core::Tensor;

use super::row_adapters::{AdapterId, RowAdapters};
use super::Result;
use crate::base::gemm;
use crate::base::kernels::{self, Heads, Policy, Real};
use crate::base::ops;
use crate::base::{BlockActivations, BlockContext, Llama, Positions, Target};
use crate::lora::{AdapterGrads, ModuleKey};

/// The forward pass's saved activations, block by block.
pub struct Tape {
    saved: Vec<BlockActivations>,
    ctx: BlockContext,
}

/// Runs the blocks on `embeds` (`[rows, n, hidden]`), saving what the
/// backward needs; returns the tape and the last block's output `[rows·n, hidden]`.
pub fn forward(
    model: &Llama,
    lora: &RowAdapters,
    embeds: &Tensor,
    at: &Positions,
) -> Result<(Tape, Tensor)> {
    let (rows, n, hidden) = embeds.dims3()?;
    let mut saved = Vec::with_capacity(model.blocks.len());
    let top = model.hidden_states(embeds, at, None, lora, Some(&mut saved))?;
    let ctx = model.block_context(at, embeds.dtype())?;
    Ok((Tape { saved, ctx }, top.reshape((rows * n, hidden))?))
}

/// One micro-batch's pass back through the blocks.
pub(super) struct Pass<'a> {
    pub model: &'a Llama,
    pub lora: &'a RowAdapters,
    pub ctx: &'a BlockContext,
    pub rows: usize,
    pub n: usize,
}

/// Scored rows per chunk of the LM head (512: a `[512, 49152]` f32 logits
/// block is 100 MB, and its gradient overwrites it; the head's two GEMMs ran at
/// 208–219 GFLOP/s with 512 rows against 166–189 with 256).
pub(super) const HEAD_CHUNK_ROWS: usize = 512;

/// The log-probabilities of `targets` at rows `index` of the last block's
/// output `top` (`[rows·n, hidden]`), and the gradient at `top` of a loss
/// whose derivative with respect to the `i`th log-prob is `dloss(i, logp)`:
/// through the final norm and the LM head, each chunk of rows' logits used
/// for both before the next is formed. The `i`th log-prob is under
/// `policies[i]`: its mask and temperature ([`kernels::Policy`]).
pub fn head<T: Real>(
    model: &Llama,
    top: &Tensor,
    index: &Tensor,
    targets: &[u32],
    policies: &[Policy],
    dloss: impl Fn(usize, f64) -> f64 + Sync,
) -> Result<(Vec<f64>, Tensor)> {
    let eps = model.config.rms_norm_eps;
    let hidden = top.index_select(index, 0)?;
    let normed = kernels::rms_norm::<T>(&hidden, &model.final_norm, eps)?;
    let mut logps = Vec::with_capacity(targets.len());
    let mut d_normed = Vec::new();
    // One buffer for every chunk's logits, overwritten by their gradient.
    let mut logits = Vec::new();
    for start in (0..targets.len()).step_by(HEAD_CHUNK_ROWS) {
        let len = HEAD_CHUNK_ROWS.min(targets.len() - start);
        let rows = normed.narrow(0, start, len)?;
        let shape = ops::write_matmul_t::<T>(&mut logits, &rows, &model.lm_head)?;
        let (_, vocab) = shape.dims2()?;
        let lp = kernels::target_logprob_grad::<T>(
            &mut logits,
            vocab,
            &targets[start..start + len],
            &policies[start..start + len],
            |i, lp| dloss(start + i, lp),
        )?;
        logps.extend(lp);
        let d_rows = ops::slice_input_grad(&logits, (len, vocab), &model.lm_head)?;
        d_normed.push(gemm::tensor(d_rows)?);
    }
    if d_normed.is_empty() {
        return Ok((logps, top.zeros_like()?));
    }
    let d_normed = Tensor::cat(&d_normed, 0)?;
    let d_hidden =
        kernels::rms_norm_backward::<T>(&hidden, &model.final_norm, eps, &d_normed, None)?;
    Ok((logps, top.zeros_like()?.index_add(index, &d_hidden, 0)?))
}

/// Backpropagates `grad` (∂loss/∂ last block's output, `[rows·n, hidden]`)
/// through every block, adding the factor gradients to `grads`.
pub fn backward<T: Real>(
    model: &Llama,
    lora: &RowAdapters,
    tape: Tape,
    grad: Tensor,
    grads: &mut BTreeMap<AdapterId, AdapterGrads>,
) -> Result<()> {
    tape.down(model, lora, grad, |pass, layer, s, dy| {
        pass.block_backward::<T>(layer, s, dy, grads)
    })
}

impl Tape {
    /// `block(pass, layer, its activations, ∂loss/∂ its output)` for every
    /// block, last first, from `grad` at the last block's output; each call
    /// returns ∂loss/∂ the block's input, `None` to stop (the first block).
    pub(super) fn down(
        self,
        model: &Llama,
        lora: &RowAdapters,
        mut grad: Tensor,
        mut block: impl FnMut(&Pass, usize, BlockActivations, &Tensor) -> Result<Option<Tensor>>,
    ) -> Result<()> {
        let Tape { mut saved, ctx } = self;
        let Some(first) = saved.first() else {
            return Ok(());
        };
        let (rows, _, n, _) = first.q.dims4()?;
        let pass = Pass {
            model,
            lora,
            ctx: &ctx,
            rows,
            n,
        };
        while let Some(s) = saved.pop() {
            let layer = saved.len();
            match block(&pass, layer, s, &grad)? {
                Some(dx) => grad = dx,
                None => break,
            }
        }
        Ok(())
    }
}

impl Pass<'_> {
    fn heads(&self, heads: usize) -> Heads {
        Heads {
            rows: self.rows,
            n: self.n,
            heads,
            head_dim: self.model.config.head_dim,
        }
    }

    /// `1/√head_dim`, applied to the scores inside the softmax.
    pub(super) fn score_scale(&self) -> f64 {
        1.0 / (self.model.config.head_dim as f64).sqrt()
    }

    /// Query heads folded per KV head: `[rows, kv_heads, group·n, head_dim]`,
    /// so one matmul serves each group without copying K and V.
    pub(super) fn grouped(&self, q: &Tensor) -> Result<Tensor> {
        let cfg = &self.model.config;
        let group = cfg.num_heads / cfg.num_kv_heads;
        Ok(q.reshape((self.rows, cfg.num_kv_heads, group * self.n, cfg.head_dim))?)
    }

    /// Attention probabilities `[rows, kv_heads, group·n, n]`.
    fn probs<T: Real>(&self, q: &Tensor, k: &Tensor) -> Result<Tensor> {
        let scores = gemm::matmul(&self.grouped(q)?, &k.t()?)?;
        Ok(kernels::masked_softmax::<T>(
            &scores,
            &self.ctx.mask,
            self.score_scale(),
        )?)
    }

    /// `[rows, n, heads·hd]` flattened to tokens ↔ `[rows, heads, n, hd]`.
    pub(super) fn split_heads(&self, t: &Tensor, heads: usize) -> Result<Tensor> {
        let hd = self.model.config.head_dim;
        Ok(t.reshape((self.rows, self.n, heads, hd))?
            .transpose(1, 2)?
            .contiguous()?)
    }

    pub(super) fn merge_heads(&self, t: &Tensor) -> Result<Tensor> {
        let (rows, heads, n, hd) = t.dims4()?;
        Ok(t.transpose(1, 2)?
            .contiguous()?
            .reshape((rows * n, heads * hd))?)
    }

    /// ∂loss/∂ block input given `dy` = ∂loss/∂ block output, after adding
    /// the block's factor gradients to `grads`; `None` for the first block.
    fn block_backward<T: Real>(
        &self,
        layer: usize,
        s: BlockActivations,
        dy: &Tensor,
        grads: &mut BTreeMap<AdapterId, AdapterGrads>,
    ) -> Result<Option<Tensor>> {
        let cfg = &self.model.config;
        let block = &self.model.blocks[layer];
        let (cos, sin) = (&self.ctx.cos, &self.ctx.sin);
        let eps = cfg.rms_norm_eps;
        // Factor gradients of `target`, and ∂ of its input added to `into`
        // (`[tokens, in]` values and shape) or to zeros.
        type Values<T> = (Vec<T>, candle_core::Shape);
        let mut back = |target: Target,
                        x: &Tensor,
                        dy: &Tensor,
                        into: Option<Values<T>>|
         -> Result<Values<T>> {
            let (mut dx, shape) = ops::input_grad::<T>(into, dy, &block.linear(target).weight)?;
            let key = ModuleKey { layer, target };
            self.lora
                .factor_grads(key, x, &s.lora[&target], dy, Some(&mut dx), grads)?;
            Ok((dx, shape))
        };

        let (a, m) = s.norms(block, eps)?;
        let d_swiglu = back(
            Target::Down,
            &kernels::swiglu::<T>(&s.gate, &s.up)?,
            dy,
            None,
        )?;
        let (d_gate, d_up) =
            kernels::swiglu_backward::<T>(&s.gate, &s.up, &gemm::tensor(d_swiglu)?)?;
        let dm = back(Target::Gate, &m, &d_gate, None)?;
        let dm = gemm::tensor(back(Target::Up, &m, &d_up, Some(dm))?)?;
        let dx2 = kernels::rms_norm_backward::<T>(&s.x2, &block.mlp_norm, eps, &dm, Some(dy))?;

        let d_attn = gemm::tensor(back(Target::O, &s.attn, &dx2, None)?)?;
        let d_out = self.grouped(&self.split_heads(&d_attn, cfg.num_heads)?)?;
        let p = self.probs::<T>(&s.q, &s.k)?;
        let dv = gemm::matmul(&p.t()?, &d_out)?;
        let d_scores = kernels::masked_softmax_backward::<T>(
            &p,
            &gemm::matmul(&d_out, &s.v.t()?)?,
            self.score_scale(),
        )?;
        let dq = gemm::matmul(&d_scores, &s.k)?.reshape(s.q.dims())?;
        let dk = gemm::matmul(&d_scores.t()?, &self.grouped(&s.q)?)?;
        let dq = kernels::rope_heads_backward::<T>(&dq, cos, sin, self.heads(cfg.num_heads))?;
        let dk = kernels::rope_heads_backward::<T>(&dk, cos, sin, self.heads(cfg.num_kv_heads))?;
        let dv = self.merge_heads(&dv)?;

        if layer == 0 {
            // The embeddings are frozen: only the factors need these gradients.
            for (target, d) in [(Target::Q, &dq), (Target::K, &dk), (Target::V, &dv)] {
                let key = ModuleKey { layer, target };
                self.lora
                    .factor_grads::<T>(key, &a, &s.lora[&target], d, None, grads)?;
            }
            return Ok(None);
        }
        let da = back(Target::Q, &a, &dq, None)?;
        let da = back(Target::K, &a, &dk, Some(da))?;
        let da = gemm::tensor(back(Target::V, &a, &dv, Some(da))?)?;
        let dx = kernels::rms_norm_backward::<T>(&s.x, &block.attn_norm, eps, &da, Some(&dx2))?;
        Ok(Some(dx))
    }
}
