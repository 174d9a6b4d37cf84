//! The train step's backward on any device: [`super::tape`]'s formulas (the
//! table at its top) over the same saved activations, written with candle's
//! device-generic tensor ops, and the LoRA factors' gradients from the
//! kernels of [`super::lora_op`] (`kernels/lora.cu` on a GPU). The train step
//! runs it where the model is not on the CPU ([`super::Backward`]); on the
//! CPU it is the tape's reference, and the tests hold the two together.
//!
//! ```text
//! RMSNorm'   ∂x = r·(g⊙w − x̂·mean(g⊙w⊙x̂)),  x̂ = x·r,  r = 1/√(mean(x²) + ε)
//! SwiGLU'    ∂gate = ∂s⊙up⊙σ(gate)(1 + gate(1 − σ(gate))),  ∂up = ∂s⊙silu(gate)
//! softmax'   ∂S = scale·P⊙(∂P − Σ∂P⊙P)
//! RoPE'      ∂x = RoPE(∂y, cos, −sin)            (the inverse rotation)
//! LoRA'      ∂s = shrink(∂y, (s·B)ᵀ),  ∂x += expand(∂s, A),
//!            ∂A = outer(∂s, x),  ∂B = s·outer(u, ∂y)ᵀ,  u = shrink(x, A)
//! head       z = (h·Eᵀ)/T over the allowed tokens,  ∂z = g·(onehot − softmax(z))
//! ```

use std::collections::BTreeMap;

use candle_core::{DType, Device, Tensor, D};

use super::row_adapters::{AdapterId, RowAdapters};
use super::tape::{Pass, Tape, HEAD_CHUNK_ROWS};
use super::Result;
use crate::base::kernels::{mask_out, Policy};
use crate::base::ops;
use crate::base::{rms_norm, BlockActivations, Llama, Target};
use crate::lora::{AdapterGrads, ModuleKey};

/// [`super::tape::head`] in generic ops: the log-probabilities of `targets`
/// at rows `index` of the last block's output `top` (`[rows·n, hidden]`),
/// and the gradient at `top` of a loss whose derivative with respect to the
/// `i`th log-prob is `dloss(i, logp)`, under each target's [`Policy`].
pub fn head(
    model: &Llama,
    top: &Tensor,
    index: &Tensor,
    targets: &[u32],
    policies: &[Policy],
    dloss: impl Fn(usize, f64) -> f64,
) -> Result<(Vec<f64>, Tensor)> {
    let eps = model.config.rms_norm_eps;
    let hidden = top.index_select(index, 0)?;
    let normed = rms_norm(&hidden, &model.final_norm, eps)?;
    let mut logps = Vec::with_capacity(targets.len());
    let mut d_normed = Vec::new();
    for start in (0..targets.len()).step_by(HEAD_CHUNK_ROWS) {
        let len = HEAD_CHUNK_ROWS.min(targets.len() - start);
        let chunk = start..start + len;
        let (lp, d_rows) = head_chunk(
            model,
            &normed.narrow(0, start, len)?,
            &targets[chunk.clone()],
            &policies[chunk],
            |i, lp| dloss(start + i, lp),
        )?;
        logps.extend(lp);
        d_normed.push(d_rows);
    }
    if d_normed.is_empty() {
        return Ok((logps, top.zeros_like()?));
    }
    let d_hidden = rms_norm_backward(&hidden, &model.final_norm, eps, &Tensor::cat(&d_normed, 0)?)?;
    Ok((logps, top.zeros_like()?.index_add(index, &d_hidden, 0)?))
}

/// One chunk of [`head`]: `normed` `[len, hidden]` after the final norm.
/// Each step replaces the chunk's logits, so that at most two `[len, vocab]`
/// blocks are alive at once.
fn head_chunk(
    model: &Llama,
    normed: &Tensor,
    targets: &[u32],
    policies: &[Policy],
    dloss: impl Fn(usize, f64) -> f64,
) -> Result<(Vec<f64>, Tensor)> {
    let (device, dtype) = (normed.device(), normed.dtype());
    let len = targets.len();
    let column = |values: Vec<f64>| -> Result<Tensor> {
        Ok(Tensor::from_vec(values, (len, 1), device)?.to_dtype(dtype)?)
    };
    let inv_temperature = column(policies.iter().map(|p| p.inv_temperature).collect())?;
    let mut z = ops::matmul_t_generic(normed, &model.lm_head)?;
    z = z.broadcast_mul(&inv_temperature)?;
    if let Some(allowed) = allowed(policies, z.dim(1)?, device)? {
        let forbidden = Tensor::new(f32::NEG_INFINITY, device)?.to_dtype(dtype)?;
        z = allowed.where_cond(&z, &forbidden.broadcast_as(z.shape())?)?;
    }
    // z becomes the log-softmax, in place of the logits.
    z = z.broadcast_sub(&z.max_keepdim(D::Minus1)?)?;
    let log_sum = z.exp()?.sum_keepdim(D::Minus1)?.log()?;
    z = z.broadcast_sub(&log_sum)?;
    let target_index = Tensor::from_vec(targets.to_vec(), (len, 1), device)?;
    let logps = z
        .gather(&target_index, 1)?
        .flatten_all()?
        .to_dtype(DType::F64)?
        .to_vec1::<f64>()?;
    let g = column(
        logps
            .iter()
            .enumerate()
            .map(|(i, &lp)| dloss(i, lp))
            .collect(),
    )?;
    // ∂z = g·(onehot − softmax), then through the temperature.
    z = z.exp()?;
    z = z.broadcast_mul(&g.neg()?)?;
    z = z.scatter_add(&target_index, &g, 1)?;
    z = z.broadcast_mul(&inv_temperature)?;
    Ok((logps, ops::matmul_generic(&z, &model.lm_head)?))
}

/// `[len, vocab]` u8, 1 where each target's grammar allows the token (every
/// token of a row without a mask); `None` when no row has a mask.
fn allowed(policies: &[Policy], vocab: usize, device: &Device) -> Result<Option<Tensor>> {
    if policies.iter().all(|p| p.mask.is_none()) {
        return Ok(None);
    }
    let mut flags = vec![1u8; policies.len() * vocab];
    for (row, p) in flags.chunks_mut(vocab).zip(policies) {
        if let Some(words) = p.mask {
            mask_out(row, words, 0);
        }
    }
    Ok(Some(Tensor::from_vec(
        flags,
        (policies.len(), vocab),
        device,
    )?))
}

/// [`super::tape::backward`] in generic ops: backpropagates `grad`
/// (∂loss/∂ last block's output, `[rows·n, hidden]`) through every block,
/// adding the factor gradients to `grads`. The forward must have kept for
/// this backward ([`RowAdapters::for_backward`]).
pub fn backward(
    model: &Llama,
    lora: &RowAdapters,
    tape: Tape,
    grad: Tensor,
    grads: &mut BTreeMap<AdapterId, AdapterGrads>,
) -> Result<()> {
    tape.down(model, lora, grad, |pass, layer, s, dy| {
        pass.block_backward_generic(layer, s, dy, grads)
    })
}

impl Pass<'_> {
    /// ∂loss/∂ block input given `dy` = ∂loss/∂ block output, after adding
    /// the block's factor gradients to `grads`; `None` for the first block.
    fn block_backward_generic(
        &self,
        layer: usize,
        s: BlockActivations,
        dy: &Tensor,
        grads: &mut BTreeMap<AdapterId, AdapterGrads>,
    ) -> Result<Option<Tensor>> {
        let cfg = &self.model.config;
        let block = &self.model.blocks[layer];
        let eps = cfg.rms_norm_eps;
        // ∂ of projection `target`'s input `x` given its output gradient
        // `dy`, the frozen part and the LoRA part; the factor gradients go
        // to `grads`.
        let mut back = |target: Target, x: &Tensor, dy: &Tensor| -> Result<Tensor> {
            let dx = ops::matmul_generic(dy, &block.linear(target).weight)?;
            let key = ModuleKey { layer, target };
            match self
                .lora
                .factor_grads_generic(key, x, &s.lora[&target], dy, grads)?
            {
                Some(lora) => Ok((dx + lora)?),
                None => Ok(dx),
            }
        };

        let (a, m) = s.norms(block, eps)?;
        let d_swiglu = back(Target::Down, &(s.gate.silu()? * &s.up)?, dy)?;
        let (d_gate, d_up) = swiglu_backward(&s.gate, &s.up, &d_swiglu)?;
        let dm = (back(Target::Gate, &m, &d_gate)? + back(Target::Up, &m, &d_up)?)?;
        let dx2 = (rms_norm_backward(&s.x2, &block.mlp_norm, eps, &dm)? + dy)?;

        let d_attn = back(Target::O, &s.attn, &dx2)?;
        let d_out = self.grouped(&self.split_heads(&d_attn, cfg.num_heads)?)?;
        let p = self.probs_generic(&s.q, &s.k)?;
        let dv = p.t()?.matmul(&d_out)?;
        // ∂S = P⊙(∂P − Σ∂P⊙P); the softmax's scale is applied to ∂q and ∂k,
        // which are smaller than the square.
        let dp = d_out.matmul(&s.v.t()?)?;
        let row_dot = (&dp * &p)?.sum_keepdim(D::Minus1)?;
        let d_scores = (dp.broadcast_sub(&row_dot)? * p)?;
        let scale = self.score_scale();
        let dq = (d_scores.matmul(&s.k)? * scale)?.reshape(s.q.dims())?;
        let dk = (d_scores.t()?.matmul(&self.grouped(&s.q)?)? * scale)?;
        let dq = self.rope_backward(&dq)?;
        let dk = self.rope_backward(&dk)?;
        let dv = self.merge_heads(&dv)?;

        if layer == 0 {
            // The embeddings are frozen: only the factors need these gradients.
            for (target, d) in [(Target::Q, &dq), (Target::K, &dk), (Target::V, &dv)] {
                let key = ModuleKey { layer, target };
                self.lora
                    .factor_grads_generic(key, &a, &s.lora[&target], d, grads)?;
            }
            return Ok(None);
        }
        let da =
            ((back(Target::Q, &a, &dq)? + back(Target::K, &a, &dk)?)? + back(Target::V, &a, &dv)?)?;
        let dx = (rms_norm_backward(&s.x, &block.attn_norm, eps, &da)? + dx2)?;
        Ok(Some(dx))
    }

    /// Attention probabilities `softmax(scale·q·kᵀ + mask)`, grouped:
    /// `[rows, kv_heads, group·n, n]`. q is scaled rather than the scores
    /// (as the forward off the CPU does), so that at most two squares are
    /// alive at once.
    fn probs_generic(&self, q: &Tensor, k: &Tensor) -> Result<Tensor> {
        let cfg = &self.model.config;
        let q = self.grouped(&(q * self.score_scale())?)?;
        let mut scores = q.matmul(&k.t()?)?;
        scores = scores
            .reshape((self.rows, cfg.num_heads, self.n, self.n))?
            .broadcast_add(&self.ctx.mask)?;
        let probs = candle_nn::ops::softmax_last_dim(&scores)?;
        Ok(probs.reshape((self.rows, cfg.num_kv_heads, (), self.n))?)
    }

    /// RoPE's backward, the inverse rotation, then the heads merged:
    /// `[rows, heads, n, hd]` → `[rows·n, heads·hd]`.
    fn rope_backward(&self, d: &Tensor) -> Result<Tensor> {
        let (rows, heads, n, hd) = d.dims4()?;
        let table = |t: &Tensor| t.reshape((rows, n, hd / 2))?.contiguous();
        let cos = table(&self.ctx.cos)?;
        let neg_sin = table(&self.ctx.sin.neg()?)?;
        let d = d.reshape((rows, heads, n, hd))?.contiguous()?;
        self.merge_heads(&candle_nn::rotary_emb::rope(&d, &cos, &neg_sin)?)
    }
}

/// `1 / √(mean(x²) + ε)` of each row, `[tokens, 1]`.
fn inv_rms(x: &Tensor, eps: f64) -> Result<Tensor> {
    Ok((x.sqr()?.mean_keepdim(D::Minus1)? + eps)?.sqrt()?.recip()?)
}

/// ∂/∂x of RMSNorm given its output gradient `g`.
fn rms_norm_backward(x: &Tensor, w: &Tensor, eps: f64, g: &Tensor) -> Result<Tensor> {
    let r = inv_rms(x, eps)?;
    let x_hat = x.broadcast_mul(&r)?;
    let gw = g.broadcast_mul(w)?;
    let mean = (&gw * &x_hat)?.mean_keepdim(D::Minus1)?;
    Ok((gw - x_hat.broadcast_mul(&mean)?)?.broadcast_mul(&r)?)
}

/// The gradients of `silu(gate) ⊙ up` given its output gradient `d`.
fn swiglu_backward(gate: &Tensor, up: &Tensor, d: &Tensor) -> Result<(Tensor, Tensor)> {
    let sigmoid = (gate.neg()?.exp()? + 1.0)?.recip()?;
    let silu = (gate * &sigmoid)?;
    // σ(g)·(1 + g·(1 − σ(g))) = σ(g) + silu(g)·(1 − σ(g))
    let d_silu = (&sigmoid + (&silu * sigmoid.affine(-1.0, 1.0)?)?)?;
    Ok((((d * up)? * d_silu)?, (d * silu)?))
}
