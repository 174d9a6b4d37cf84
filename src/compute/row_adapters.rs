//! Per-row adapters: the LoRA hook of a mixed batch.
//!
//! For every module, the factors of the adapters a batch uses are concatenated
//! once along the rank axis (`A_cat [n·r, in]`, `B_cat [out, n·r]`, B
//! pre-scaled, ranks zero-padded to the largest). One GEMM shrinks every row
//! against all adapters, a one-hot mask keeps each row's own block of rank
//! coordinates, and one GEMM expands: `Δ = ((x·A_catᵀ) ⊙ mask_row)·B_catᵀ`.
//! The extra shrink work is `n·r` columns instead of `r`, small next to the
//! frozen projection, and two large GEMMs beat many tiny per-adapter ones on a
//! CPU. Masked coordinates are exact zeros, so each row equals its
//! single-adapter pass. Gradients flow through the concatenation back to each
//! adapter's factors.
//!
//! The mask costs n times the shrink and expand FLOPs. That is less than the
//! fixed costs of a GEMM pair per adapter until an adapter's rows hold about a
//! thousand tokens ([`MIN_SEGMENT_TOKENS`]); from there, as in scoring long
//! sequences, each run of rows sharing an adapter (SGMV's segments) is shrunk
//! and expanded with its own factors only. An f32 decode
//! step without gradient (one token per row) skips both for one fused pass
//! ([`kernels::row_lora`]). The train step does not use this hook: it has its
//! own per-segment LoRA with a hand-written backward (`tape::SegmentLora`).
//!
//! On a GPU every pass goes through [`lora_delta`]: our SGMV kernels shrink
//! and expand each row against its own adapter's block only, in one launch
//! each, so the masked GEMMs' n-fold work is never done there.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;

use candle_core::{DType, Device, Tensor, D};

use super::lora_op::{lora_delta, TokenSlots, NO_SLOT};
use crate::base::Target;
use crate::base::{gemm, kernels, LoraHook, ModelConfig};
use crate::lora::{Adapter, ModuleKey};

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
    /// Adapters in the concatenation.
    blocks: usize,
    /// The GPU path's per-token slots of the last token count seen.
    token_slots: Mutex<Option<TokenSlots>>,
}

impl RowAdapters {
    pub fn new(set: &AdapterSet, rows: &[Option<AdapterId>]) -> super::Result<Self> {
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
                a: a_cat.contiguous()?,
                b_t: b_cat.t()?.contiguous()?,
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
        Ok(RowAdapters {
            modules,
            mask,
            segments,
            rank,
            row_slots,
            blocks: used.len(),
            token_slots: Mutex::new(None),
        })
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
        let slots = TokenSlots::new(slots, self.blocks, device)?;
        *cached = Some(slots.clone());
        Ok(slots)
    }

    /// `y + Δ` through the SGMV kernels (any token count, gradients tracked).
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

    /// The same factors cut loose from the adapters' `Var`s and placed on
    /// `device` (the model's), for passes that take no gradient. Without the
    /// cut every activation computed from a LoRA factor records its inputs for
    /// backprop, and a KV cache built step by step keeps the whole
    /// generation's graph alive (tens of GB).
    pub fn detached_on(&self, device: &Device) -> super::Result<Self> {
        let place = |t: &Tensor| t.detach().to_device(device);
        let modules = self
            .modules
            .iter()
            .map(|(&key, m)| {
                let factors = ModuleFactors {
                    a: place(&m.a)?,
                    b_t: place(&m.b_t)?,
                };
                Ok((key, factors))
            })
            .collect::<candle_core::Result<_>>()?;
        Ok(RowAdapters {
            modules,
            mask: self.mask.as_ref().map(place).transpose()?,
            segments: self.segments.clone(),
            rank: self.rank,
            row_slots: self.row_slots.clone(),
            blocks: self.blocks,
            token_slots: Mutex::new(None),
        })
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

    /// `y + Δ` of a decode step (one token per row, no gradient, f32) in
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

    /// `Δ` one segment at a time: each run of rows against its own adapter's
    /// factors only (rows are grouped by adapter by every caller).
    fn segmented_delta(&self, f: &ModuleFactors, x: &Tensor) -> candle_core::Result<Tensor> {
        let (_, tokens, in_dim) = x.dims3()?;
        let out_dim = f.b_t.dim(1)?;
        let parts = self
            .segments
            .iter()
            .map(|seg| {
                let Some(slot) = seg.slot else {
                    return Tensor::zeros((seg.rows * tokens, out_dim), x.dtype(), x.device());
                };
                let x = x
                    .narrow(0, seg.start, seg.rows)?
                    .reshape((seg.rows * tokens, in_dim))?;
                let a = f.a.narrow(0, slot * self.rank, self.rank)?;
                let b_t = f.b_t.narrow(0, slot * self.rank, self.rank)?;
                gemm::matmul(&gemm::matmul(&x, &a.t()?)?, &b_t)
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        Tensor::cat(&parts, 0)
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
    let a = m.a.as_tensor().pad_with_zeros(0, 0, pad)?;
    let b = (m.b.as_tensor() * adapter.scale())?.pad_with_zeros(1, 0, pad)?;
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
    ) -> crate::base::Result<Tensor> {
        let Some(f) = self.modules.get(&ModuleKey { layer, target }) else {
            return Ok(y);
        };
        if x.device().is_cuda() {
            return Ok(self.sgmv_add(f, x, y)?);
        }
        let (rows, tokens, _) = x.dims3()?;
        let untracked = [x, &y, &f.a, &f.b_t].iter().all(|t| !t.track_op());
        let f32_cpu = [x, &y]
            .iter()
            .all(|t| t.dtype() == DType::F32 && t.device().is_cpu());
        if tokens == 1 && untracked && f32_cpu {
            let out = self.decode_add(f, x, &y.reshape((rows, ()))?)?;
            return Ok(out.reshape(y.shape())?);
        }
        let delta =
            if self.mask.is_some() && rows * tokens >= MIN_SEGMENT_TOKENS * self.segments.len() {
                self.segmented_delta(f, x)?
            } else {
                self.masked_delta(f, x)?
            };
        Ok((y + delta.reshape((rows, tokens, delta.dim(D::Minus1)?))?)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::base::tiny::{self, TinySpec};
    use crate::lora::LoraConfig;
    use candle_core::{DType, Device, Var};

    /// The segmented path (prefill, training) and the masked path (decode)
    /// give the same deltas and the same factor gradients.
    #[test]
    fn segments_and_mask_agree_in_value_and_gradient() {
        let model = tiny::build(&TinySpec::default()).unwrap().0;
        let config = LoraConfig {
            rank: 2,
            ..LoraConfig::default()
        };
        let adapters: Vec<Adapter> = (0..2)
            .map(|seed| {
                let mut rng = crate::rng::stream(seed, &["segments".into()]);
                let a =
                    Adapter::new(config.clone(), &model.config, &mut rng, &Device::Cpu).unwrap();
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
        let hook = RowAdapters::new(&set, &rows).unwrap();
        let key = *hook.modules.keys().next().unwrap();
        let in_dim = key.target.dims(&model.config).0;
        let tokens = MIN_SEGMENT_TOKENS;
        let x = Var::randn(0f32, 1.0, (rows.len(), tokens, in_dim), &Device::Cpu).unwrap();
        let factors = &hook.modules[&key];
        let masked = hook.masked_delta(factors, x.as_tensor()).unwrap();
        let segmented = hook.segmented_delta(factors, x.as_tensor()).unwrap();
        let diff = (&masked - &segmented)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap();
        assert!(diff.to_scalar::<f32>().unwrap() < 1e-5);
        assert_eq!(hook.segments.len(), 3);
        // A decode step's fused pass agrees too (one token per row, no gradient).
        let one = x.as_tensor().narrow(1, 0, 1).unwrap().detach();
        let out_dim = masked.dim(1).unwrap();
        let y = Tensor::randn(0f32, 1.0, (rows.len(), out_dim), &Device::Cpu).unwrap();
        let fused = (hook.decode_add(factors, &one, &y).unwrap() - &y).unwrap();
        let plain = hook.masked_delta(factors, &one).unwrap();
        let diff = (&fused - &plain).unwrap().abs().unwrap().max_all().unwrap();
        assert!(diff.to_scalar::<f32>().unwrap() < 1e-5);
        let none_row = fused
            .narrow(0, 2, 1)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap();
        assert_eq!(none_row.to_scalar::<f32>().unwrap(), 0.0);
        // With trainable factors the hook keeps the graph, even for one token per row.
        let zeros = Tensor::zeros((rows.len(), 1, out_dim), DType::F32, &Device::Cpu).unwrap();
        let tracked = hook.add_delta(key.layer, key.target, &one, zeros).unwrap();
        assert!(tracked.track_op());

        let weights = Tensor::randn(0f32, 1.0, masked.dims(), &Device::Cpu).unwrap();
        let grads = |d: &Tensor| {
            (d * &weights)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap()
        };
        let (g_masked, g_segmented) = (grads(&masked), grads(&segmented));
        for adapter in &adapters {
            let m = &adapter.modules[&key];
            for factor in [&m.a, &m.b] {
                let a = g_masked.get(factor.as_tensor()).unwrap();
                let b = g_segmented.get(factor.as_tensor()).unwrap();
                let scale = a
                    .abs()
                    .unwrap()
                    .max_all()
                    .unwrap()
                    .to_scalar::<f32>()
                    .unwrap();
                let diff = (a - b).unwrap().abs().unwrap().max_all().unwrap();
                assert!(diff.to_scalar::<f32>().unwrap() <= 1e-5 * scale.max(1.0));
                assert_eq!(a.dtype(), DType::F32);
            }
        }
    }
}
