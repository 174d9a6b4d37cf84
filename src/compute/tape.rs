//! The train step's passes through the blocks: a forward that keeps what the
//! backward needs, and the backward written out by hand.
//!
//! The base is frozen, so the backward needs only input gradients through the
//! frozen projections and the LoRA factors' own gradients. candle's autograd
//! would also allocate a zeroed gradient and add into it for every edge of the
//! graph, and keep every intermediate alive; here each block saves its
//! activations (about 7k values per token, 28 KB in f32 for SmolLM2, so 1.7 GB
//! for a 2048-token micro-batch of its 30 blocks) and the backward reads them
//! top down:
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
//! Every projection adds its rows' LoRA delta `x·Aᵀ·(s·B)ᵀ`, segment by
//! segment (rows are grouped by adapter); its backward adds
//! `∂A = (∂y·s·B)ᵀ·x` and `∂B = s·∂yᵀ·(x·Aᵀ)` to that adapter's gradients.
//! The first block's input gradient is never formed (the embeddings are frozen).

use std::collections::btree_map::Entry;
use std::collections::BTreeMap;

use candle_core::Tensor;
use rayon::prelude::*;

use super::row_adapters::{AdapterId, AdapterSet};
use super::{Error, Result};
use crate::base::gemm::{self, Threads};
use crate::base::kernels::{self, Heads, Policy, Real};
use crate::base::Target;
use crate::base::{BlockContext, Linear, Llama, Positions};
use crate::lora::{Adapter, AdapterGrads, ModuleKey};

/// Rows of a micro-batch that share one adapter, as token rows
/// `start..start + len` of the flattened `[rows·n, hidden]` activations.
struct TokenSegment<'a> {
    start: usize,
    len: usize,
    id: AdapterId,
    adapter: &'a Adapter,
}

/// One adapter's factors of one module, cut loose from its `Var`s:
/// `A [r, in]` and `s·B [out, r]`.
struct Factors {
    a: Tensor,
    b_scaled: Tensor,
}

/// The LoRA of a micro-batch whose rows are grouped by adapter.
pub struct SegmentLora<'a> {
    segments: Vec<TokenSegment<'a>>,
    /// By (segment index, module).
    factors: BTreeMap<(usize, ModuleKey), Factors>,
}

impl<'a> SegmentLora<'a> {
    /// `rows[i]` is the adapter of row `i` (rows sharing one are adjacent),
    /// each row `n` tokens long; a row without one gets no delta.
    pub fn new(set: &AdapterSet<'a>, rows: &[Option<AdapterId>], n: usize) -> Result<Self> {
        let mut segments: Vec<TokenSegment> = Vec::new();
        for (row, &adapter) in rows.iter().enumerate() {
            let Some(id) = adapter else { continue };
            match segments.last_mut() {
                Some(last) if last.id == id && last.start + last.len == row * n => last.len += n,
                _ => segments.push(TokenSegment {
                    start: row * n,
                    len: n,
                    id,
                    adapter: set
                        .adapters
                        .get(&id)
                        .ok_or(Error::UnknownAdapter { row, adapter: id })?,
                }),
            }
        }
        let mut factors = BTreeMap::new();
        for (k, seg) in segments.iter().enumerate() {
            for (&key, m) in &seg.adapter.modules {
                let b_scaled = (m.b.as_tensor().detach() * seg.adapter.scale())?;
                let a = m.a.as_tensor().detach();
                factors.insert((k, key), Factors { a, b_scaled });
            }
        }
        Ok(SegmentLora { segments, factors })
    }

    /// `x·Wᵀ (+ bias)` plus each segment's delta, for `x` `[tokens, in]`, and
    /// each segment's `x·Aᵀ` (kept for the backward; `None` where its
    /// adapter lacks the module).
    fn project<T: Real>(
        &self,
        key: ModuleKey,
        linear: &Linear,
        x: &Tensor,
    ) -> Result<(Tensor, Vec<Option<Tensor>>)> {
        let (mut y, shape) = gemm::product_values::<T>(x, &linear.weight.t()?, Threads::All)?;
        let out_dim = linear.weight.dim(0)?;
        if let Some(bias) = &linear.bias {
            let bias = bias.to_vec1::<T>()?;
            for row in y.chunks_mut(out_dim) {
                row.iter_mut().zip(&bias).for_each(|(y, &b)| *y += b);
            }
        }
        let shrunk = self.each_segment(Some((&mut y, out_dim)), |k, seg, rows| {
            let Some(f) = self.factors.get(&(k, key)) else {
                return Ok(None);
            };
            let u = gemm::matmul_serial(&x.narrow(0, seg.start, seg.len)?, &f.a.t()?)?;
            if let Some(rows) = rows {
                gemm::add_product(rows, &u, &f.b_scaled.t()?, Threads::One)?;
            }
            Ok(Some(u))
        })?;
        Ok((gemm::tensor((y, shape))?, shrunk))
    }

    /// Adds each segment's factor gradients of `key` to `grads`, given the
    /// projection's input `x`, its saved `shrunk` and its output gradient
    /// `dy`; adds the LoRA part of `∂x` into `dx` (`[tokens, in]` values)
    /// when given.
    fn factor_grads<T: Real>(
        &self,
        key: ModuleKey,
        x: &Tensor,
        shrunk: &[Option<Tensor>],
        dy: &Tensor,
        dx: Option<&mut [T]>,
        grads: &mut BTreeMap<AdapterId, AdapterGrads>,
    ) -> Result<()> {
        let in_dim = x.dim(1)?;
        let parts = self.each_segment(dx.map(|dx| (dx, in_dim)), |k, seg, rows| {
            let (Some(f), Some(u)) = (
                self.factors.get(&(k, key)),
                shrunk.get(k).and_then(Option::as_ref),
            ) else {
                return Ok(None);
            };
            let dy = dy.narrow(0, seg.start, seg.len)?;
            let du = gemm::matmul_serial(&dy, &f.b_scaled)?;
            let da = gemm::matmul_serial(&du.t()?, &x.narrow(0, seg.start, seg.len)?)?;
            let db = (gemm::matmul_serial(&dy.t()?, u)? * seg.adapter.scale())?;
            if let Some(rows) = rows {
                gemm::add_product(rows, &du, &f.a, Threads::One)?;
            }
            Ok(Some((da, db)))
        })?;
        for (seg, part) in self.segments.iter().zip(parts) {
            if let Some((da, db)) = part {
                add_grads(grads, seg.id, key, da, db)?;
            }
        }
        Ok(())
    }

    /// `f(k, segment k, its rows of values)` for every segment, side by side
    /// on rayon's threads (each segment's products are too small to share
    /// out), results in segment order. `values` is `[tokens, width]`
    /// row-major; without it `f` gets `None`.
    fn each_segment<T: Send, R: Send>(
        &self,
        values: Option<(&mut [T], usize)>,
        f: impl Fn(usize, &TokenSegment, Option<&mut [T]>) -> Result<R> + Sync,
    ) -> Result<Vec<R>> {
        let mut blocks: Vec<Option<&mut [T]>> = Vec::with_capacity(self.segments.len());
        match values {
            None => blocks.resize_with(self.segments.len(), || None),
            Some((mut rest, width)) => {
                // Segments are in row order and disjoint (see `new`).
                let mut row = 0;
                for seg in &self.segments {
                    let skip = (seg.start - row) * width;
                    if rest.len() < skip + seg.len * width {
                        return Err(candle_core::Error::Msg(format!(
                            "segment at rows {}..{} outside {} rows",
                            seg.start,
                            seg.start + seg.len,
                            row + rest.len() / width.max(1)
                        ))
                        .into());
                    }
                    let (block, tail) = rest[skip..].split_at_mut(seg.len * width);
                    blocks.push(Some(block));
                    rest = tail;
                    row = seg.start + seg.len;
                }
            }
        }
        self.segments
            .par_iter()
            .zip(blocks)
            .enumerate()
            .map(|(k, (seg, block))| f(k, seg, block))
            .collect()
    }
}

fn add_grads(
    grads: &mut BTreeMap<AdapterId, AdapterGrads>,
    id: AdapterId,
    key: ModuleKey,
    da: Tensor,
    db: Tensor,
) -> Result<()> {
    match grads.entry(id).or_default().entry(key) {
        Entry::Occupied(mut e) => {
            let (a, b) = e.get_mut();
            *a = (&*a + da)?;
            *b = (&*b + db)?;
        }
        Entry::Vacant(e) => {
            e.insert((da, db));
        }
    }
    Ok(())
}

/// What one block's forward keeps for its backward. Activations are
/// `[tokens, width]` unless noted.
struct Saved {
    x: Tensor,
    a: Tensor,
    /// `[rows, heads, n, head_dim]`, after RoPE.
    q: Tensor,
    /// `[rows, kv_heads, n, head_dim]`, after RoPE.
    k: Tensor,
    /// `[rows, kv_heads, n, head_dim]`.
    v: Tensor,
    attn: Tensor,
    x2: Tensor,
    m: Tensor,
    gate: Tensor,
    up: Tensor,
    /// Each projection's per-segment `x·Aᵀ`.
    shrunk: BTreeMap<Target, Vec<Option<Tensor>>>,
}

/// The forward pass's saved activations, block by block.
pub struct Tape {
    saved: Vec<Saved>,
    ctx: BlockContext,
}

/// One micro-batch's pass through the blocks.
struct Pass<'a> {
    model: &'a Llama,
    lora: &'a SegmentLora<'a>,
    ctx: &'a BlockContext,
    rows: usize,
    n: usize,
}

/// Runs the blocks on `embeds` (`[rows, n, hidden]`), saving what the
/// backward needs; returns the tape and the last block's output `[rows·n, hidden]`.
pub fn forward<T: Real>(
    model: &Llama,
    lora: &SegmentLora,
    embeds: &Tensor,
    at: &Positions,
) -> Result<(Tape, Tensor)> {
    let (rows, n, hidden) = embeds.dims3()?;
    let ctx = model.block_context(at, embeds.dtype())?;
    let pass = Pass {
        model,
        lora,
        ctx: &ctx,
        rows,
        n,
    };
    let mut h = embeds.reshape((rows * n, hidden))?;
    let mut saved = Vec::with_capacity(model.blocks.len());
    for layer in 0..model.blocks.len() {
        let (y, s) = pass.block_forward::<T>(layer, h)?;
        saved.push(s);
        h = y;
    }
    Ok((Tape { saved, ctx }, h))
}

/// Scored rows per chunk of the LM head (512: a `[512, 49152]` f32 logits
/// block is 100 MB, and its gradient overwrites it; the head's two GEMMs ran at
/// 208–219 GFLOP/s with 512 rows against 166–189 with 256).
const HEAD_CHUNK_ROWS: usize = 512;

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
        let shape =
            gemm::write_product::<T>(&mut logits, &rows, &model.lm_head.t()?, Threads::All)?;
        let (_, vocab) = shape.dims2()?;
        let lp = kernels::target_logprob_grad::<T>(
            &mut logits,
            vocab,
            &targets[start..start + len],
            &policies[start..start + len],
            |i, lp| dloss(start + i, lp),
        )?;
        logps.extend(lp);
        let d_rows = gemm::slice_product(&logits, (len, vocab), &model.lm_head, Threads::All)?;
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
    lora: &SegmentLora,
    tape: Tape,
    mut grad: Tensor,
    grads: &mut BTreeMap<AdapterId, AdapterGrads>,
) -> Result<()> {
    let Tape { mut saved, ctx } = tape;
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
        match pass.block_backward::<T>(layer, s, &grad, grads)? {
            Some(dx) => grad = dx,
            None => break,
        }
    }
    Ok(())
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
    fn score_scale(&self) -> f64 {
        1.0 / (self.model.config.head_dim as f64).sqrt()
    }

    /// Query heads folded per KV head: `[rows, kv_heads, group·n, head_dim]`,
    /// so one matmul serves each group without copying K and V.
    fn grouped(&self, q: &Tensor) -> Result<Tensor> {
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
    fn split_heads(&self, t: &Tensor, heads: usize) -> Result<Tensor> {
        let hd = self.model.config.head_dim;
        Ok(t.reshape((self.rows, self.n, heads, hd))?
            .transpose(1, 2)?
            .contiguous()?)
    }

    fn merge_heads(&self, t: &Tensor) -> Result<Tensor> {
        let (rows, heads, n, hd) = t.dims4()?;
        Ok(t.transpose(1, 2)?
            .contiguous()?
            .reshape((rows * n, heads * hd))?)
    }

    fn block_forward<T: Real>(&self, layer: usize, x: Tensor) -> Result<(Tensor, Saved)> {
        let cfg = &self.model.config;
        let block = &self.model.blocks[layer];
        let (cos, sin) = (&self.ctx.cos, &self.ctx.sin);
        let mut shrunk = BTreeMap::new();
        let mut project = |target: Target, x: &Tensor| -> Result<Tensor> {
            let key = ModuleKey { layer, target };
            let (y, u) = self.lora.project::<T>(key, block.linear(target), x)?;
            shrunk.insert(target, u);
            Ok(y)
        };
        let a = kernels::rms_norm::<T>(&x, &block.attn_norm, cfg.rms_norm_eps)?;
        let q = project(Target::Q, &a)?;
        let q = kernels::rope_heads::<T>(&q, cos, sin, self.heads(cfg.num_heads))?;
        let k = project(Target::K, &a)?;
        let k = kernels::rope_heads::<T>(&k, cos, sin, self.heads(cfg.num_kv_heads))?;
        let v = self.split_heads(&project(Target::V, &a)?, cfg.num_kv_heads)?;
        let out = gemm::matmul(&self.probs::<T>(&q, &k)?, &v)?;
        let attn = self.merge_heads(&out.reshape(q.dims())?)?;
        let x2 = (&x + project(Target::O, &attn)?)?;
        let m = kernels::rms_norm::<T>(&x2, &block.mlp_norm, cfg.rms_norm_eps)?;
        let gate = project(Target::Gate, &m)?;
        let up = project(Target::Up, &m)?;
        let y = (&x2 + project(Target::Down, &kernels::swiglu::<T>(&gate, &up)?)?)?;
        let saved = Saved {
            x,
            a,
            q,
            k,
            v,
            attn,
            x2,
            m,
            gate,
            up,
            shrunk,
        };
        Ok((y, saved))
    }

    /// ∂loss/∂ block input given `dy` = ∂loss/∂ block output, after adding
    /// the block's factor gradients to `grads`; `None` for the first block.
    fn block_backward<T: Real>(
        &self,
        layer: usize,
        s: Saved,
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
            let w = &block.linear(target).weight;
            let (mut dx, shape) = match into {
                None => gemm::product_values::<T>(dy, w, Threads::All)?,
                Some((mut dx, shape)) => {
                    gemm::add_product(&mut dx, dy, w, Threads::All)?;
                    (dx, shape)
                }
            };
            let key = ModuleKey { layer, target };
            self.lora
                .factor_grads(key, x, &s.shrunk[&target], dy, Some(&mut dx), grads)?;
            Ok((dx, shape))
        };

        let d_swiglu = back(
            Target::Down,
            &kernels::swiglu::<T>(&s.gate, &s.up)?,
            dy,
            None,
        )?;
        let (d_gate, d_up) =
            kernels::swiglu_backward::<T>(&s.gate, &s.up, &gemm::tensor(d_swiglu)?)?;
        let dm = back(Target::Gate, &s.m, &d_gate, None)?;
        let dm = gemm::tensor(back(Target::Up, &s.m, &d_up, Some(dm))?)?;
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
                    .factor_grads::<T>(key, &s.a, &s.shrunk[&target], d, None, grads)?;
            }
            return Ok(None);
        }
        let da = back(Target::Q, &s.a, &dq, None)?;
        let da = back(Target::K, &s.a, &dk, Some(da))?;
        let da = gemm::tensor(back(Target::V, &s.a, &dv, Some(da))?)?;
        let dx = kernels::rms_norm_backward::<T>(&s.x, &block.attn_norm, eps, &da, Some(&dx2))?;
        Ok(Some(dx))
    }
}
