//! Per-row adapters: the LoRA hook of a mixed batch.
//!
//! For every module, the factors of the adapters a batch uses are stacked once
//! (`[n, r, in]`, `[n, out, r]`, B pre-scaled, ranks zero-padded to the largest)
//! and gathered by each row's adapter slot, so one batched shrink and one
//! batched expand serve all rows whatever their adapters (BGMV in Punica's
//! terms). Rows without an adapter gather an all-zero slot. When every row uses
//! the same adapter the gather is skipped and the rows are flattened into one
//! plain GEMM. Gradients flow through stack and gather back to each adapter's
//! factors.

use std::collections::{BTreeMap, BTreeSet};

use candle_core::{Tensor, D};

use crate::base::{LoraHook, ModelConfig};
use crate::lora::{Adapter, ModuleKey, Target};

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

/// One module's factors for the rows of a batch, transposed for `x·Aᵀ·Bᵀ`.
enum RowFactors {
    /// Every row uses the same adapter: `[in, r]`, `[r, out]` (scaled).
    Shared(Tensor, Tensor),
    /// Gathered per row: `[rows, in, r]`, `[rows, r, out]` (scaled).
    PerRow(Tensor, Tensor),
}

/// The per-row adapter assignment of a batch.
pub struct RowAdapters {
    modules: BTreeMap<ModuleKey, RowFactors>,
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
        let zero_slot = rows.iter().any(Option::is_none);
        let shared = used.len() == 1 && !zero_slot;
        let slots: Vec<u32> = rows
            .iter()
            .map(|r| r.map_or(used.len(), |id| used.binary_search(&id).unwrap_or(0)) as u32)
            .collect();
        let keys: BTreeSet<ModuleKey> = adapters
            .iter()
            .flat_map(|a| a.modules.keys().copied())
            .collect();
        let rank = adapters.iter().map(|a| a.config.rank).max().unwrap_or(0);
        let mut modules = BTreeMap::new();
        for key in keys {
            let factors = if shared {
                let (a, b) = scaled(adapters[0], key, rank)?.expect("key comes from this adapter");
                RowFactors::Shared(a.t()?.contiguous()?, b.t()?.contiguous()?)
            } else {
                let (a, b) = gathered(&adapters, key, rank, zero_slot, &slots)?;
                RowFactors::PerRow(
                    a.transpose(1, 2)?.contiguous()?,
                    b.transpose(1, 2)?.contiguous()?,
                )
            };
            modules.insert(key, factors);
        }
        Ok(RowAdapters { modules })
    }
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

/// Stack the adapters' factors of `key` (plus a zero slot) and gather by row.
fn gathered(
    adapters: &[&Adapter],
    key: ModuleKey,
    rank: usize,
    zero_slot: bool,
    slots: &[u32],
) -> candle_core::Result<(Tensor, Tensor)> {
    let present: Vec<_> = adapters
        .iter()
        .map(|a| scaled(a, key, rank))
        .collect::<candle_core::Result<_>>()?;
    let (like_a, like_b) = present
        .iter()
        .flatten()
        .next()
        .expect("some adapter has the module");
    let (zero_a, zero_b) = (like_a.zeros_like()?, like_b.zeros_like()?);
    let mut a_stack = Vec::with_capacity(adapters.len() + 1);
    let mut b_stack = Vec::with_capacity(adapters.len() + 1);
    for p in &present {
        let (a, b) = p.as_ref().map_or((&zero_a, &zero_b), |(a, b)| (a, b));
        a_stack.push(a.clone());
        b_stack.push(b.clone());
    }
    if zero_slot {
        a_stack.push(zero_a);
        b_stack.push(zero_b);
    }
    let index = Tensor::new(slots, like_a.device())?;
    let a = Tensor::stack(&a_stack, 0)?.index_select(&index, 0)?;
    let b = Tensor::stack(&b_stack, 0)?.index_select(&index, 0)?;
    Ok((a, b))
}

impl LoraHook for RowAdapters {
    fn delta(
        &self,
        layer: usize,
        target: Target,
        x: &Tensor,
    ) -> crate::base::Result<Option<Tensor>> {
        let Some(factors) = self.modules.get(&ModuleKey { layer, target }) else {
            return Ok(None);
        };
        let (rows, tokens, in_dim) = x.dims3()?;
        let delta = match factors {
            RowFactors::Shared(at, bt) => {
                let flat = x.reshape((rows * tokens, in_dim))?.matmul(at)?.matmul(bt)?;
                flat.reshape((rows, tokens, bt.dim(D::Minus1)?))?
            }
            RowFactors::PerRow(at, bt) => x.contiguous()?.matmul(at)?.matmul(bt)?,
        };
        Ok(Some(delta))
    }
}
