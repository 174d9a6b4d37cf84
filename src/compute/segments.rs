//! Rows grouped by adapter: the SGMV-style LoRA hook.

use std::collections::BTreeMap;

use candle_core::{Tensor, D};

use crate::base::{LoraHook, ModelConfig};
use crate::lora::{Adapter, Target};

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

    /// Check every adapter's factor shapes against the base.
    pub fn check(&self, cfg: &ModelConfig) -> super::Result<()> {
        for (&id, adapter) in &self.adapters {
            for (key, m) in &adapter.modules {
                let mismatch = |reason: String| super::Error::AdapterMismatch { adapter: id, reason };
                if key.layer >= cfg.num_layers {
                    return Err(mismatch(format!("layer {} >= {} layers", key.layer, cfg.num_layers)));
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

/// A contiguous run of rows that share one adapter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Segment {
    start: usize,
    len: usize,
    adapter: Option<AdapterId>,
}

/// The per-row adapter assignment of a batch, as contiguous segments.
/// Rows must already be ordered so that equal adapters are adjacent.
pub struct RowAdapters<'a> {
    set: &'a AdapterSet<'a>,
    segments: Vec<Segment>,
}

impl<'a> RowAdapters<'a> {
    pub fn new(set: &'a AdapterSet<'a>, rows: &[Option<AdapterId>]) -> super::Result<Self> {
        let mut segments: Vec<Segment> = Vec::new();
        for (row, &adapter) in rows.iter().enumerate() {
            if let Some(id) = adapter {
                if !set.adapters.contains_key(&id) {
                    return Err(super::Error::UnknownAdapter { row, adapter: id });
                }
            }
            match segments.last_mut() {
                Some(s) if s.adapter == adapter => s.len += 1,
                _ => segments.push(Segment {
                    start: row,
                    len: 1,
                    adapter,
                }),
            }
        }
        Ok(RowAdapters { set, segments })
    }
}

impl LoraHook for RowAdapters<'_> {
    fn delta(&self, layer: usize, target: Target, x: &Tensor) -> crate::base::Result<Option<Tensor>> {
        let (_, tokens, _) = x.dims3()?;
        let mut parts = Vec::with_capacity(self.segments.len());
        let mut any = false;
        let mut out_dim = None;
        for seg in &self.segments {
            let module = seg
                .adapter
                .and_then(|id| self.set.adapters.get(&id))
                .and_then(|a| a.get(layer, target).map(|m| (a.scale(), m)));
            match module {
                Some((scale, m)) => {
                    let in_dim = x.dim(D::Minus1)?;
                    let xs = x.narrow(0, seg.start, seg.len)?.reshape((seg.len * tokens, in_dim))?;
                    // shrink to rank r, then expand: (x·Aᵀ)·Bᵀ·s
                    let shrunk = xs.matmul(&m.a.as_tensor().t()?)?;
                    let expanded = (shrunk.matmul(&m.b.as_tensor().t()?)? * scale)?;
                    let dim = expanded.dim(D::Minus1)?;
                    out_dim = Some(dim);
                    parts.push(Some(expanded.reshape((seg.len, tokens, dim))?));
                    any = true;
                }
                None => parts.push(None),
            }
        }
        if !any {
            return Ok(None);
        }
        let out_dim = out_dim.unwrap_or(0);
        let parts = parts
            .into_iter()
            .zip(&self.segments)
            .map(|(p, seg)| match p {
                Some(t) => Ok(t),
                None => Tensor::zeros((seg.len, tokens, out_dim), x.dtype(), x.device()),
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(Some(Tensor::cat(&parts, 0)?))
    }
}
