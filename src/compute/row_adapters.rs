//! Per-row adapters: the LoRA of a mixed batch, for every pass (generation,
//! scoring, the train step) and its backward.
//!
//! For every module, the factors of the adapters a batch uses are concatenated
//! once along the rank axis (`A_cat [n·r, in]`, `B_cat [out, n·r]`, B
//! pre-scaled, ranks zero-padded to the largest). One GEMM shrinks every row
//! against all adapters, a one-hot mask keeps each row's own block of rank
//! coordinates, and one GEMM expands: `Δ = ((x·A_catᵀ) ⊙ mask_row)·B_catᵀ`.
//! The extra shrink work is `n·r` columns instead of `r`, small next to the
//! frozen projection, and two large GEMMs beat many tiny per-adapter ones on a
//! CPU. Masked coordinates are exact zeros, so each row equals its
//! single-adapter pass.
//!
//! The mask costs n times the shrink and expand FLOPs. That is less than the
//! fixed costs of a GEMM pair per adapter until an adapter's rows hold about a
//! thousand tokens ([`MIN_SEGMENT_TOKENS`]); from there, as in scoring long
//! sequences, each run of rows sharing an adapter (SGMV's segments) is shrunk
//! and expanded with its own factors only, side by side on rayon's threads.
//! An f32 decode step (one token per row) skips both for one fused pass
//! ([`kernels::row_lora`]). All three compute the same delta.
//!
//! The train step's forward asks the hook to keep what its backward needs.
//! For the CPU's tape every projection goes segment by segment, each
//! segment's `u = x·Aᵀ` kept, and [`RowAdapters::factor_grads`] later adds
//! `∂A = (∂y·s·B)ᵀ·x` and `∂B = s·∂yᵀ·u` to that adapter's gradients and the
//! LoRA part of `∂x`. For the generic backward (a model off the CPU,
//! [`Backward::Generic`]) every token's shrink is kept from the SGMV kernels
//! and [`RowAdapters::factor_grads_generic`] computes the same with them.
//!
//! On a GPU every inference pass goes through [`lora_delta`]: our SGMV kernels shrink
//! and expand each row against its own adapter's block only, in one launch
//! each, so the masked GEMMs' n-fold work is never done there.

use std::collections::btree_map::Entry;
use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;
use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, Device, InplaceOp1, Layout, Tensor, WithDType, D};
use rayon::prelude::*;

use super::lora_op::{self, lora_delta, TokenSlots, NO_SLOT};
use super::Backward;
use crate::base::gemm::{self, Threads};
use crate::base::kernels::{self, Real};
use crate::base::{LoraHook, LoraKept, ModelConfig, Target};
use crate::lora::{Adapter, AdapterGrads, ModuleKey};

/// Our own adapter id (a member id in the runtime). Ordered, so batches are too.
pub type AdapterId = u64;

/// The adapters a batch may use, by id.
#[derive(Debug, Default, Clone)]
pub struct AdapterSet<'a> {
    pub adapters: BTreeMap<AdapterId, &'a Adapter>,
}

impl<'a> AdapterSet<'a> {
    pub fn new() -> Self {
        AdapterSet {
            adapters: BTreeMap::new(),
        }
    }

    pub fn with(mut self, id: AdapterId, adapter: &'a Adapter) -> Self {
        self.adapters.insert(id, adapter);
        self
    }

    /// Check every adapter's factor shapes against the base (any float dtype,
    /// so f64 gradient checks pass through the same path).
    pub fn check(&self, cfg: &ModelConfig) -> super::Result<()> {
        for (&id, adapter) in &self.adapters {
            for (key, m) in &adapter.modules {
                let mismatch = |reason: String| super::Error::AdapterMismatch {
                    adapter: id,
                    reason,
                };
                if key.layer >= cfg.num_layers {
                    return Err(mismatch(format!(
                        "layer {} >= {} layers",
                        key.layer, cfg.num_layers
                    )));
                }
                let (inp, out) = key.target.dims(cfg);
                let r = adapter.config.rank;
                if m.a.dims() != [r, inp] || m.b.dims() != [out, r] {
                    return Err(mismatch(format!(
                        "layer {} {}: A {:?}, B {:?}, expected A [{r}, {inp}], B [{out}, {r}]",
                        key.layer,
                        key.target,
                        m.a.dims(),
                        m.b.dims()
                    )));
                }
            }
        }
        Ok(())
    }
}

/// One module's factors for a batch: `A_cat [n·r, in]` and, transposed for
/// `x·Aᵀ·Bᵀ`, `B_catᵀ [n·r, out]` (scaled).
struct ModuleFactors {
    a: Tensor,
    b_t: Tensor,
    /// Whether each slot's adapter has this module (its block is zeros if not).
    present: Vec<bool>,
}

impl ModuleFactors {
    /// Slot `slot`'s `A [r, in]` and `(s·B)ᵀ [r, out]`, `r` the batch's rank.
    fn of_slot(&self, slot: usize, rank: usize) -> candle_core::Result<(Tensor, Tensor)> {
        Ok((
            self.a.narrow(0, slot * rank, rank)?,
            self.b_t.narrow(0, slot * rank, rank)?,
        ))
    }
}

/// The adapter in one slot of the concatenation.
#[derive(Debug, Clone, Copy)]
struct SlotAdapter {
    id: AdapterId,
    rank: usize,
    scale: f64,
}

/// A run of consecutive rows that share one adapter (`slot` in the batch's
/// concatenation, `None` for rows without an adapter).
#[derive(Debug, Clone, Copy)]
struct Segment {
    start: usize,
    rows: usize,
    slot: Option<usize>,
}

/// Below this many tokens per segment the one masked GEMM pair beats a GEMM
/// pair per segment; above it, segments do n times fewer FLOPs (prefill,
/// scoring). Default 1024: with gemm's AVX-512 kernels, 8 adapters' masked
/// pair was faster at both 180 and 964 tokens per segment: the per-segment
/// calls' fixed costs dominate (BENCHMARKS.md, broker, "AVX-512 GEMM, decode
/// GEMM orientation").
const MIN_SEGMENT_TOKENS: usize = 1024;

/// The per-row adapter assignment of a batch.
pub struct RowAdapters {
    modules: BTreeMap<ModuleKey, ModuleFactors>,
    /// `[rows, 1, n·r]`: 1 on the row's own adapter block; `None` when every
    /// row uses the one adapter of the batch.
    mask: Option<Tensor>,
    segments: Vec<Segment>,
    rank: usize,
    /// Each row's block in the concatenation, [`NO_SLOT`] for none.
    row_slots: Vec<u32>,
    /// The adapters in the concatenation, by slot.
    slots: Vec<SlotAdapter>,
    /// The GPU path's per-token slots of the last token count seen.
    token_slots: Mutex<Option<TokenSlots>>,
    /// What a pass that keeps for a backward keeps: each segment's `x·Aᵀ`
    /// for the tape, every token's shrink `[tokens, rank]` for the generic one.
    backward: Backward,
}

impl RowAdapters {
    /// The hook for a batch whose row `i` uses adapter `rows[i]` (rows sharing
    /// one adjacent), with the factors cut loose from the adapters' `Var`s and
    /// placed on `device` (the model's). Where no copy is needed (one adapter
    /// at the batch's rank, on its own device) they share the `Var`s'
    /// storage: build a hook per pass, not across an update.
    pub fn new(
        set: &AdapterSet,
        rows: &[Option<AdapterId>],
        device: &Device,
    ) -> super::Result<Self> {
        let mut used: Vec<AdapterId> = Vec::new();
        for (row, &adapter) in rows.iter().enumerate() {
            if let Some(id) = adapter {
                if !set.adapters.contains_key(&id) {
                    return Err(super::Error::UnknownAdapter { row, adapter: id });
                }
                used.push(id);
            }
        }
        used.sort_unstable();
        used.dedup();
        let adapters: Vec<&Adapter> = used.iter().map(|id| set.adapters[id]).collect();
        let rank = adapters.iter().map(|a| a.config.rank).max().unwrap_or(0);
        let keys: BTreeSet<ModuleKey> = adapters
            .iter()
            .flat_map(|a| a.modules.keys().copied())
            .collect();
        let mut modules = BTreeMap::new();
        for key in keys {
            let (a_cat, b_cat) = concatenated(&adapters, key, rank)?;
            let factors = ModuleFactors {
                a: a_cat.to_device(device)?.contiguous()?,
                b_t: b_cat.t()?.to_device(device)?.contiguous()?,
                present: adapters
                    .iter()
                    .map(|a| a.modules.contains_key(&key))
                    .collect(),
            };
            modules.insert(key, factors);
        }
        let everyone_shares_one = used.len() == 1 && rows.iter().all(Option::is_some);
        let mask = match (everyone_shares_one, modules.values().next()) {
            (false, Some(m)) => Some(row_mask(rows, &used, rank, &m.a)?),
            _ => None,
        };
        let segments = segments(rows, &used);
        let row_slots = segments
            .iter()
            .flat_map(|seg| std::iter::repeat_n(seg.slot.map_or(NO_SLOT, |s| s as u32), seg.rows))
            .collect();
        let slots = used
            .iter()
            .zip(&adapters)
            .map(|(&id, a)| SlotAdapter {
                id,
                rank: a.config.rank,
                scale: a.scale(),
            })
            .collect();
        Ok(RowAdapters {
            modules,
            mask,
            segments,
            rank,
            row_slots,
            slots,
            token_slots: Mutex::new(None),
            backward: Backward::Tape,
        })
    }

    /// The same hook, keeping what `backward` reads (the tape's by default).
    pub fn for_backward(self, backward: Backward) -> Self {
        RowAdapters { backward, ..self }
    }

    /// Every token's block for rows of `tokens` tokens, kept on `device`
    /// across the calls of one pass (one upload per pass shape, not per module).
    fn token_slots(&self, tokens: usize, device: &Device) -> candle_core::Result<TokenSlots> {
        let mut cached = self.token_slots.lock().expect("token slot cache poisoned");
        if let Some(slots) = cached.as_ref() {
            if slots.len() == self.row_slots.len() * tokens {
                return Ok(slots.clone());
            }
        }
        let slots = self
            .row_slots
            .iter()
            .flat_map(|&k| std::iter::repeat_n(k, tokens))
            .collect();
        let slots = TokenSlots::new(slots, self.slots.len(), device)?;
        *cached = Some(slots.clone());
        Ok(slots)
    }

    /// `y + Δ` through the SGMV kernels (any token count).
    fn sgmv_add(&self, f: &ModuleFactors, x: &Tensor, y: Tensor) -> candle_core::Result<Tensor> {
        let (rows, tokens, in_dim) = x.dims3()?;
        let slots = self.token_slots(tokens, x.device())?;
        let delta = lora_delta(
            &x.reshape((rows * tokens, in_dim))?,
            &f.a,
            &f.b_t,
            &slots,
            self.rank,
        )?;
        y + delta.reshape((rows, tokens, ()))?
    }

    /// [`Self::sgmv_add`] in its two halves, keeping the shrink `x·Aᵀ`
    /// (`[rows·tokens, rank]`, every token against its own block) for
    /// [`Self::factor_grads_generic`].
    fn sgmv_keep(
        &self,
        f: &ModuleFactors,
        x: &Tensor,
        y: Tensor,
        keep: &mut LoraKept,
    ) -> candle_core::Result<Tensor> {
        let (rows, tokens, in_dim) = x.dims3()?;
        let slots = self.token_slots(tokens, x.device())?;
        let s = lora_op::shrink(
            &x.reshape((rows * tokens, in_dim))?,
            &f.a,
            &slots,
            self.rank,
        )?;
        let delta = lora_op::expand(&s, &f.b_t, &slots, self.rank)?;
        *keep = vec![Some(s)];
        y + delta.reshape((rows, tokens, ()))?
    }

    /// `Δ` for all rows at once: shrink against every adapter of the batch,
    /// keep each row's own block, expand. `[rows·tokens, out]`.
    fn masked_delta(&self, f: &ModuleFactors, x: &Tensor) -> candle_core::Result<Tensor> {
        let (rows, tokens, in_dim) = x.dims3()?;
        let shrunk = gemm::matmul(&x.reshape((rows * tokens, in_dim))?, &f.a.t()?)?;
        let shrunk = match &self.mask {
            Some(mask) => shrunk
                .reshape((rows, tokens, ()))?
                .broadcast_mul(mask)?
                .reshape((rows * tokens, ()))?,
            None => shrunk,
        };
        gemm::matmul(&shrunk, &f.b_t)
    }

    /// `y + Δ` of a decode step (one token per row, f32 on the CPU) in
    /// one fused pass; `y` is `[rows, out]`.
    fn decode_add(&self, f: &ModuleFactors, x: &Tensor, y: &Tensor) -> candle_core::Result<Tensor> {
        let (rows, _, in_dim) = x.dims3()?;
        let x = x.reshape((rows, in_dim))?.contiguous()?;
        let slots: Vec<Option<usize>> = self
            .segments
            .iter()
            .flat_map(|seg| std::iter::repeat_n(seg.slot, seg.rows))
            .collect();
        kernels::row_lora(&x, &f.a, &f.b_t, &slots, self.rank, &y.contiguous()?)
    }
}

/// Runs of consecutive rows with the same adapter.
fn segments(rows: &[Option<AdapterId>], used: &[AdapterId]) -> Vec<Segment> {
    let mut out: Vec<Segment> = Vec::new();
    for (r, adapter) in rows.iter().enumerate() {
        let slot = adapter.and_then(|id| used.binary_search(&id).ok());
        match out.last_mut() {
            Some(last) if last.slot == slot => last.rows += 1,
            _ => out.push(Segment {
                start: r,
                rows: 1,
                slot,
            }),
        }
    }
    out
}

/// `[rows, 1, n·rank]` with ones on each row's adapter block.
fn row_mask(
    rows: &[Option<AdapterId>],
    used: &[AdapterId],
    rank: usize,
    like: &Tensor,
) -> candle_core::Result<Tensor> {
    let width = used.len() * rank;
    let mut mask = vec![0f32; rows.len() * width];
    for (r, adapter) in rows.iter().enumerate() {
        if let Some(slot) = adapter.and_then(|id| used.binary_search(&id).ok()) {
            mask[r * width + slot * rank..r * width + (slot + 1) * rank].fill(1.0);
        }
    }
    Tensor::from_vec(mask, (rows.len(), 1, width), like.device())?.to_dtype(like.dtype())
}

/// `(A, s·B)` of `key` in `adapter`, zero-padded to `rank`, or `None` when absent.
fn scaled(
    adapter: &Adapter,
    key: ModuleKey,
    rank: usize,
) -> candle_core::Result<Option<(Tensor, Tensor)>> {
    let Some(m) = adapter.modules.get(&key) else {
        return Ok(None);
    };
    let pad = rank - adapter.config.rank;
    let a = m.a.as_tensor().detach().pad_with_zeros(0, 0, pad)?;
    let b = (m.b.as_tensor().detach() * adapter.scale())?.pad_with_zeros(1, 0, pad)?;
    Ok(Some((a, b)))
}

/// The adapters' factors of `key` side by side along the rank axis
/// (zeros for an adapter without the module).
fn concatenated(
    adapters: &[&Adapter],
    key: ModuleKey,
    rank: usize,
) -> candle_core::Result<(Tensor, Tensor)> {
    let present: Vec<_> = adapters
        .iter()
        .map(|a| scaled(a, key, rank))
        .collect::<candle_core::Result<_>>()?;
    let Some((like_a, like_b)) = present.iter().flatten().next() else {
        candle_core::bail!("no adapter of the batch has module {key}")
    };
    let (zero_a, zero_b) = (like_a.zeros_like()?, like_b.zeros_like()?);
    let (mut a_parts, mut b_parts) = (Vec::new(), Vec::new());
    for p in &present {
        let (a, b) = p.as_ref().map_or((&zero_a, &zero_b), |(a, b)| (a, b));
        a_parts.push(a.clone());
        b_parts.push(b.clone());
    }
    Ok((Tensor::cat(&a_parts, 0)?, Tensor::cat(&b_parts, 1)?))
}

impl LoraHook for RowAdapters {
    fn add_delta(
        &self,
        layer: usize,
        target: Target,
        x: &Tensor,
        y: Tensor,
        keep: Option<&mut LoraKept>,
    ) -> crate::base::Result<Tensor> {
        let key = ModuleKey { layer, target };
        let Some(f) = self.modules.get(&key) else {
            if let Some(keep) = keep {
                keep.clear();
            }
            return Ok(y);
        };
        if let Some(keep) = keep {
            return Ok(match self.backward {
                Backward::Tape => self.segments_add(f, x, y, keep)?,
                Backward::Generic => self.sgmv_keep(f, x, y, keep)?,
            });
        }
        if x.device().is_cuda() {
            return Ok(self.sgmv_add(f, x, y)?);
        }
        let (rows, tokens, _) = x.dims3()?;
        let f32_cpu = [x, &y]
            .iter()
            .all(|t| t.dtype() == DType::F32 && t.device().is_cpu());
        if tokens == 1 && f32_cpu {
            let out = self.decode_add(f, x, &y.reshape((rows, ()))?)?;
            return Ok(out.reshape(y.shape())?);
        }
        if self.mask.is_some() && rows * tokens >= MIN_SEGMENT_TOKENS * self.segments.len() {
            return Ok(self.segments_add(f, x, y, &mut LoraKept::new())?);
        }
        let delta = self.masked_delta(f, x)?;
        Ok((y + delta.reshape((rows, tokens, delta.dim(D::Minus1)?))?)?)
    }
}

fn unsupported(y: &Tensor) -> candle_core::Error {
    candle_core::Error::Msg(format!(
        "per-segment LoRA (the train step, long segments) runs in f32 or f64 on the CPU, \
         not {:?} on {:?}",
        y.dtype(),
        y.device().location()
    ))
}

impl RowAdapters {
    /// `y + Δ` one segment at a time, each run of rows against its own
    /// adapter's factors only, keeping each segment's `u = x·Aᵀ` in `keep`
    /// for [`Self::factor_grads`]. `x` `[rows, tokens, in]` and `y` in f32
    /// or f64 on the CPU; `y` is added into in place.
    fn segments_add(
        &self,
        f: &ModuleFactors,
        x: &Tensor,
        y: Tensor,
        keep: &mut LoraKept,
    ) -> candle_core::Result<Tensor> {
        if !(x.device().is_cpu() && matches!(y.dtype(), DType::F32 | DType::F64)) {
            return Err(unsupported(&y));
        }
        let (rows, tokens, in_dim) = x.dims3()?;
        let x = x.reshape((rows * tokens, in_dim))?;
        let threads = self.segment_threads();
        *keep = self.each_segment::<f32, _>(tokens, None, |_, seg, range, _| {
            let Some(slot) = seg.slot.filter(|&slot| f.present[slot]) else {
                return Ok(None);
            };
            let (a, _) = f.of_slot(slot, self.rank)?;
            let x = x.narrow(0, range.start, range.len())?;
            Ok(Some(product(&x, &a.t()?, threads)?))
        })?;
        let y = y.contiguous()?;
        let expand = ExpandSegments {
            hook: self,
            factors: f,
            kept: keep,
            tokens,
        };
        y.inplace_op1(&expand)?;
        Ok(y)
    }

    /// Adds each segment's factor gradients of `key` to `grads`, given the
    /// projection's input `x` `[tokens, in]`, what [`Self::segments_add`] kept
    /// and the output gradient `dy` `[tokens, out]`; adds the LoRA part of
    /// `∂x` into `dx` (`[tokens, in]` values) when given.
    pub fn factor_grads<T: Real>(
        &self,
        key: ModuleKey,
        x: &Tensor,
        kept: &LoraKept,
        dy: &Tensor,
        dx: Option<&mut [T]>,
        grads: &mut BTreeMap<AdapterId, AdapterGrads>,
    ) -> super::Result<()> {
        let Some(f) = self.modules.get(&key) else {
            return Ok(());
        };
        let (n, in_dim) = x.dims2()?;
        let rows = self.row_slots.len();
        if rows == 0 || n % rows != 0 || dy.dim(0)? != n || kept.len() != self.segments.len() {
            return Err(candle_core::Error::Msg(format!(
                "LoRA backward of {key}: x has {n} tokens and dy {} for {rows} rows, \
                 {} kept values for {} segments",
                dy.dim(0)?,
                kept.len(),
                self.segments.len()
            ))
            .into());
        }
        let tokens = n / rows;
        let threads = self.segment_threads();
        let parts = self.each_segment(tokens, dx.map(|dx| (dx, in_dim)), |k, seg, range, dx| {
            let u = kept.get(k).and_then(Option::as_ref);
            let (Some(slot), Some(u)) = (seg.slot, u) else {
                return Ok(None);
            };
            let (a, b_t) = f.of_slot(slot, self.rank)?;
            let dy = dy.narrow(0, range.start, range.len())?;
            let du = product(&dy, &b_t.t()?, threads)?;
            let da = product(&du.t()?, &x.narrow(0, range.start, range.len())?, threads)?;
            let db = (product(&dy.t()?, u, threads)? * self.slots[slot].scale)?;
            if let Some(dx) = dx {
                gemm::add_product(dx, &du, &a, threads)?;
            }
            let r = self.slots[slot].rank;
            Ok(Some((
                slot,
                da.narrow(0, 0, r)?,
                db.narrow(1, 0, r)?.contiguous()?,
            )))
        })?;
        for (slot, da, db) in parts.into_iter().flatten() {
            add_grads(grads, self.slots[slot].id, key, da, db)?;
        }
        Ok(())
    }

    /// [`Self::factor_grads`] for the generic backward, from the shrink `u`
    /// that [`Self::sgmv_keep`] kept: with `s` the adapter's scale,
    /// `∂u = shrink(∂y, (s·B)ᵀ)`, then `∂A = outer(∂u, x)` and
    /// `∂B = s·outer(u, ∂y)ᵀ` per adapter block.
    /// Returns the LoRA part of `∂x` (`[tokens, in]`), `None` where no
    /// adapter of the batch has the module.
    pub fn factor_grads_generic(
        &self,
        key: ModuleKey,
        x: &Tensor,
        kept: &LoraKept,
        dy: &Tensor,
        grads: &mut BTreeMap<AdapterId, AdapterGrads>,
    ) -> super::Result<Option<Tensor>> {
        let Some(f) = self.modules.get(&key) else {
            return Ok(None);
        };
        let (n, rows) = (x.dim(0)?, self.row_slots.len());
        let u = match kept.as_slice() {
            [Some(u)] if rows > 0 && n % rows == 0 && dy.dim(0)? == n => u,
            _ => {
                return Err(candle_core::Error::Msg(format!(
                    "LoRA backward of {key}: x has {n} tokens and dy {} for {rows} rows, \
                     {} kept values where the generic backward keeps one",
                    dy.dim(0)?,
                    kept.len()
                ))
                .into())
            }
        };
        let slots = self.token_slots(n / rows, x.device())?;
        let rank = self.rank;
        let du = lora_op::shrink(dy, &f.b_t, &slots, rank)?;
        let d_a = lora_op::outer(&du, x, &slots, rank)?;
        let d_bt = lora_op::outer(u, dy, &slots, rank)?;
        for (slot, adapter) in self.slots.iter().enumerate() {
            if !f.present[slot] {
                continue;
            }
            let da = d_a.narrow(0, slot * rank, adapter.rank)?;
            let db = (d_bt.narrow(0, slot * rank, adapter.rank)?.t()? * adapter.scale)?;
            add_grads(grads, adapter.id, key, da.contiguous()?, db.contiguous()?)?;
        }
        Ok(Some(lora_op::expand(&du, &f.a, &slots, rank)?))
    }

    /// Threads for each segment's products: the calling one when the segments
    /// side by side fill rayon's pool, else the whole pool (one long segment
    /// on a 16-thread machine).
    fn segment_threads(&self) -> Threads {
        if self.segments.len() >= rayon::current_num_threads() {
            Threads::One
        } else {
            Threads::All
        }
    }

    /// `f(k, segment k, its token range, its rows of values)` for every segment,
    /// side by side on rayon's threads, results in segment order. `values` is `[rows·tokens,
    /// width]` row-major; without it `f` gets `None`.
    fn each_segment<T: Send, R: Send>(
        &self,
        tokens: usize,
        values: Option<(&mut [T], usize)>,
        f: impl Fn(usize, &Segment, Range<usize>, Option<&mut [T]>) -> candle_core::Result<R> + Sync,
    ) -> candle_core::Result<Vec<R>> {
        let ranges: Vec<Range<usize>> = self
            .segments
            .iter()
            .map(|seg| seg.start * tokens..(seg.start + seg.rows) * tokens)
            .collect();
        let mut blocks: Vec<Option<&mut [T]>> = Vec::with_capacity(ranges.len());
        match values {
            None => blocks.resize_with(ranges.len(), || None),
            Some((mut rest, width)) => {
                let end = ranges.last().map_or(0, |r| r.end);
                if rest.len() != end * width {
                    candle_core::bail!(
                        "{} values of width {width} for {} rows of {tokens} tokens",
                        rest.len(),
                        self.row_slots.len()
                    );
                }
                // Segments tile the rows in order.
                for range in &ranges {
                    let (block, tail) = rest.split_at_mut(range.len() * width);
                    blocks.push(Some(block));
                    rest = tail;
                }
            }
        }
        self.segments
            .par_iter()
            .zip(ranges)
            .zip(blocks)
            .enumerate()
            .map(|(k, ((seg, range), block))| f(k, seg, range, block))
            .collect()
    }
}

/// `y += u·(s·B)ᵀ` for every segment's kept `u`, in `y`'s own storage: a
/// projection's output is fresh and held nowhere else, and writing into it
/// spares a `[tokens, out]` copy per projection in the train step.
struct ExpandSegments<'a> {
    hook: &'a RowAdapters,
    factors: &'a ModuleFactors,
    kept: &'a LoraKept,
    tokens: usize,
}

impl ExpandSegments<'_> {
    fn add<T: WithDType>(&self, y: &mut [T], width: usize) -> candle_core::Result<()> {
        let rank = self.hook.rank;
        let threads = self.hook.segment_threads();
        self.hook
            .each_segment(self.tokens, Some((y, width)), |k, seg, _, y| {
                let (Some(slot), Some(u), Some(y)) = (seg.slot, &self.kept[k], y) else {
                    return Ok(());
                };
                let (_, b_t) = self.factors.of_slot(slot, rank)?;
                gemm::add_product(y, u, &b_t, threads)
            })
            .map(drop)
    }
}

impl InplaceOp1 for ExpandSegments<'_> {
    fn name(&self) -> &'static str {
        "lora-expand-segments"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let (Some((start, end)), Some(&width)) =
            (layout.contiguous_offsets(), layout.dims().last())
        else {
            candle_core::bail!("lora-expand-segments: y must be contiguous");
        };
        match storage {
            CpuStorage::F32(y) => self.add(&mut y[start..end], width),
            CpuStorage::F64(y) => self.add(&mut y[start..end], width),
            other => candle_core::bail!("lora-expand-segments: y is {:?}", other.dtype()),
        }
    }
}

fn product(a: &Tensor, b: &Tensor, threads: Threads) -> candle_core::Result<Tensor> {
    match threads {
        Threads::All => gemm::matmul(a, b),
        Threads::One => gemm::matmul_serial(a, b),
    }
}

fn add_grads(
    grads: &mut BTreeMap<AdapterId, AdapterGrads>,
    id: AdapterId,
    key: ModuleKey,
    da: Tensor,
    db: Tensor,
) -> candle_core::Result<()> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::base::tiny::{self, TinySpec};
    use crate::lora::LoraConfig;
    use crate::test_util::max_abs_diff;
    use candle_core::{DType, Device, Var};

    fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
        let d = (a - b).unwrap().abs().unwrap().max_all().unwrap();
        d.to_scalar::<f32>().unwrap()
    }

    /// Every path computes the same delta: the masked concatenation (short
    /// batches), the fused decode step and a GEMM pair per segment (long
    /// segments, the train step); and the per-segment path's gradients
    /// equal candle's autograd of the plain `x·Aᵀ·(s·B)ᵀ`, also for an
    /// adapter of smaller rank than the batch's.
    #[test]
    fn every_path_gives_the_same_delta_and_the_kept_path_the_right_gradients() {
        let model = tiny::build(&TinySpec::default()).unwrap().0;
        let adapters: Vec<Adapter> = [(1, 2), (2, 3)]
            .into_iter()
            .map(|(seed, rank)| {
                let config = LoraConfig {
                    rank,
                    ..LoraConfig::default()
                };
                let mut rng = crate::rng::stream(seed, &["segments".into()]);
                let a = Adapter::new(config, &model.config, &mut rng, &Device::Cpu).unwrap();
                for m in a.modules.values() {
                    m.b.set(&Tensor::randn(0f32, 1.0, m.b.dims(), &Device::Cpu).unwrap())
                        .unwrap();
                }
                a
            })
            .collect();
        let set = AdapterSet::new()
            .with(7, &adapters[0])
            .with(9, &adapters[1]);
        let rows = [Some(7), Some(7), None, Some(9)];
        let hook = RowAdapters::new(&set, &rows, &Device::Cpu).unwrap();
        let key = *hook.modules.keys().next().unwrap();
        let (in_dim, out_dim) = key.target.dims(&model.config);
        let tokens = MIN_SEGMENT_TOKENS;
        let x = Var::randn(0f32, 1.0, (rows.len(), tokens, in_dim), &Device::Cpu).unwrap();
        let factors = &hook.modules[&key];
        let masked = hook.masked_delta(factors, &x).unwrap();
        let zeros = Tensor::zeros((rows.len(), tokens, out_dim), DType::F32, &Device::Cpu).unwrap();
        let mut kept = LoraKept::new();
        let with_kept = hook
            .add_delta(key.layer, key.target, &x, zeros, Some(&mut kept))
            .unwrap()
            .reshape(masked.shape())
            .unwrap();
        assert!(max_diff(&masked, &with_kept) < 1e-5);
        assert_eq!(hook.segments.len(), 3);
        assert_eq!(
            kept.iter().map(Option::is_some).collect::<Vec<_>>(),
            [true, false, true]
        );

        // A decode step's fused pass agrees too (one token per row).
        let one = x.narrow(1, 0, 1).unwrap();
        let y = Tensor::randn(0f32, 1.0, (rows.len(), out_dim), &Device::Cpu).unwrap();
        let fused = (hook.decode_add(factors, &one, &y).unwrap() - &y).unwrap();
        let plain = hook.masked_delta(factors, &one).unwrap();
        assert!(max_diff(&fused, &plain) < 1e-5);
        let none_row = fused.narrow(0, 2, 1).unwrap().abs().unwrap();
        assert_eq!(none_row.max_all().unwrap().to_scalar::<f32>().unwrap(), 0.0);

        // Gradients of Σ w ⊙ Δ.
        let flat_x = x.reshape((rows.len() * tokens, in_dim)).unwrap();
        let weights = Tensor::randn(0f32, 1.0, masked.dims(), &Device::Cpu).unwrap();
        let mut dx = vec![0f32; flat_x.elem_count()];
        let mut grads = BTreeMap::new();
        hook.factor_grads::<f32>(key, &flat_x, &kept, &weights, Some(&mut dx), &mut grads)
            .unwrap();
        let dx = Tensor::from_vec(dx, flat_x.shape(), &Device::Cpu).unwrap();
        let close = |ours: &Tensor, plain: &Tensor| {
            let scale = plain.abs().unwrap().max_all().unwrap();
            let scale = scale.to_scalar::<f32>().unwrap().max(1.0);
            assert_eq!(ours.dims(), plain.dims());
            assert!(
                max_diff(ours, plain) <= 1e-4 * scale,
                "{}",
                max_diff(ours, plain)
            );
        };
        for (id, adapter, first, count) in [(7, &adapters[0], 0, 2), (9, &adapters[1], 3, 1)] {
            let m = &adapter.modules[&key];
            let a = Var::from_tensor(m.a.as_tensor()).unwrap();
            let b = Var::from_tensor(m.b.as_tensor()).unwrap();
            let part = |t: &Tensor| t.narrow(0, first * tokens, count * tokens).unwrap();
            let delta = part(&flat_x)
                .matmul(&a.t().unwrap())
                .unwrap()
                .matmul(&(b.as_tensor() * adapter.scale()).unwrap().t().unwrap())
                .unwrap();
            let loss = (delta * part(&weights)).unwrap().sum_all().unwrap();
            let plain = loss.backward().unwrap();
            let (da, db) = &grads[&id][&key];
            close(da, plain.get(&a).unwrap());
            close(db, plain.get(&b).unwrap());
            let plain_dx = plain.get(&x).unwrap().reshape(flat_x.shape()).unwrap();
            close(&part(&dx), &part(&plain_dx));
        }
        assert_eq!(grads.len(), 2);
    }

    /// The generic backward's forward keep and factor gradients equal the
    /// tape's in f64, for a batch with a row that has no adapter and two
    /// adapters of different ranks; that row's delta and `∂x` are zeros.
    #[test]
    fn the_generic_keep_and_backward_equal_the_tapes() {
        let model = tiny::build(&TinySpec::default()).unwrap().0;
        let f64_adapter = |seed: u64, rank: usize| {
            let config = LoraConfig {
                rank,
                ..LoraConfig::default()
            };
            let mut rng = crate::rng::stream(seed, &["generic".into()]);
            let mut a = Adapter::new(config, &model.config, &mut rng, &Device::Cpu).unwrap();
            for m in a.modules.values_mut() {
                let random = |t: &Var| {
                    let t = Tensor::randn(0f64, 0.5, t.dims(), &Device::Cpu).unwrap();
                    Var::from_tensor(&t).unwrap()
                };
                *m = crate::lora::LoraModule {
                    a: random(&m.a),
                    b: random(&m.b),
                };
            }
            a
        };
        let adapters = [f64_adapter(3, 2), f64_adapter(4, 3)];
        let set = AdapterSet::new()
            .with(7, &adapters[0])
            .with(9, &adapters[1]);
        let rows = [Some(9), None, Some(7), Some(7)];
        let tape = RowAdapters::new(&set, &rows, &Device::Cpu).unwrap();
        let generic = RowAdapters::new(&set, &rows, &Device::Cpu)
            .unwrap()
            .for_backward(Backward::Generic);
        let key = *tape.modules.keys().next().unwrap();
        let (in_dim, out_dim) = key.target.dims(&model.config);
        let tokens = 5;
        let x = Tensor::randn(0f64, 1.0, (rows.len(), tokens, in_dim), &Device::Cpu).unwrap();
        let zeros = Tensor::zeros((rows.len(), tokens, out_dim), DType::F64, &Device::Cpu).unwrap();
        let close = |a: &Tensor, b: &Tensor| {
            let scale = max_abs_diff(a, &a.zeros_like().unwrap());
            let diff = max_abs_diff(a, b);
            assert!(diff <= 1e-12 * scale.max(1.0), "{diff} of {scale}");
        };
        let is_zero = |t: &Tensor| max_abs_diff(t, &t.zeros_like().unwrap()) == 0.0;
        let (mut kept_tape, mut kept_generic) = (LoraKept::new(), LoraKept::new());
        let forward = |hook: &RowAdapters, kept: &mut LoraKept| {
            hook.add_delta(key.layer, key.target, &x, zeros.clone(), Some(kept))
                .unwrap()
        };
        let delta = forward(&generic, &mut kept_generic);
        close(&forward(&tape, &mut kept_tape), &delta);
        assert!(is_zero(&delta.narrow(0, 1, 1).unwrap()));

        let flat_x = x.reshape((rows.len() * tokens, in_dim)).unwrap();
        let dy = Tensor::randn(0f64, 1.0, (rows.len() * tokens, out_dim), &Device::Cpu).unwrap();
        let (mut grads_tape, mut grads_generic) = (BTreeMap::new(), BTreeMap::new());
        let mut dx = vec![0f64; flat_x.elem_count()];
        tape.factor_grads::<f64>(
            key,
            &flat_x,
            &kept_tape,
            &dy,
            Some(&mut dx),
            &mut grads_tape,
        )
        .unwrap();
        let dx_generic = generic
            .factor_grads_generic(key, &flat_x, &kept_generic, &dy, &mut grads_generic)
            .unwrap()
            .unwrap();
        close(
            &Tensor::from_vec(dx, flat_x.shape(), &Device::Cpu).unwrap(),
            &dx_generic,
        );
        assert!(is_zero(&dx_generic.narrow(0, tokens, tokens).unwrap()));
        assert!(grads_tape.keys().eq(grads_generic.keys()));
        for (id, grads) in &grads_tape {
            let ((ta, tb), (ga, gb)) = (&grads[&key], &grads_generic[id][&key]);
            assert_eq!((ta.dims(), tb.dims()), (ga.dims(), gb.dims()));
            close(ta, ga);
            close(tb, gb);
        }
    }
}
