//! Per-token log-probabilities and the PPO-clip train step over many adapters
//! at once: one forward and one backward per micro-batch, one gradient set per
//! adapter.
//!
//! Memory is bounded by the micro-batch token budget (padded tokens per
//! micro-batch, default [`DEFAULT_TOKEN_BUDGET`]): activations scale with it,
//! and logits are only formed at scored positions.

use std::collections::BTreeMap;

use candle_core::{DType, Tensor};

use super::row_adapters::{AdapterId, AdapterSet, RowAdapters};
use super::{Error, Result};
use crate::base::{Llama, Positions};
use crate::lora::AdapterGrads;

/// Padded tokens per micro-batch (default 2048). Peak memory grows with it:
/// a 2048-token micro-batch of SmolLM2-135M with rank-8 adapters on every
/// projection peaked at 13.4 GB RSS (BENCHMARKS.md, "Multi-adapter broker").
pub const DEFAULT_TOKEN_BUDGET: usize = 2048;

/// PPO's clip range ε (AZR: 0.2).
pub const DEFAULT_CLIP: f64 = 0.2;

/// A sequence to score: log π(tokens[t] | tokens[..t]) for every t ≥ `score_from` (≥ 1).
#[derive(Debug, Clone)]
pub struct ScoreRow {
    pub adapter: Option<AdapterId>,
    pub tokens: Vec<u32>,
    pub score_from: usize,
}

/// A sequence to train on. Vectors are indexed by token position; entry `t`
/// concerns predicting `tokens[t]` from `tokens[..t]`, so `loss_mask[0]` is false.
#[derive(Debug, Clone)]
pub struct TrainRow {
    pub adapter: AdapterId,
    pub tokens: Vec<u32>,
    pub loss_mask: Vec<bool>,
    pub advantages: Vec<f32>,
    pub old_logprobs: Vec<f32>,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TrainConfig {
    pub clip: f64,
    pub token_budget: usize,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            clip: DEFAULT_CLIP,
            token_budget: DEFAULT_TOKEN_BUDGET,
        }
    }
}

/// What one adapter's part of a train step measured.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TrainStats {
    pub loss: f64,
    pub tokens: usize,
    /// Fraction of tokens whose ratio left [1-ε, 1+ε].
    pub clip_fraction: f64,
    pub mean_ratio: f64,
}

#[derive(Debug, Default)]
pub struct TrainOutput {
    pub grads: BTreeMap<AdapterId, AdapterGrads>,
    pub stats: BTreeMap<AdapterId, TrainStats>,
    pub micro_batches: usize,
}

/// The scored positions of one row: `(token index t, target token)`.
fn scored(tokens: &[u32], keep: impl Fn(usize) -> bool) -> Vec<(usize, u32)> {
    (1..tokens.len())
        .filter(|&t| keep(t))
        .map(|t| (t, tokens[t]))
        .collect()
}

/// Split rows (already ordered) into micro-batches whose padded size fits `budget`.
fn micro_batches(lens: &[usize], budget: usize) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let mut start = 0;
    let mut width = 0;
    for (i, &len) in lens.iter().enumerate() {
        let new_width = width.max(len);
        if i > start && new_width * (i + 1 - start) > budget {
            out.push(start..i);
            start = i;
            width = len;
        } else {
            width = new_width;
        }
    }
    if start < lens.len() {
        out.push(start..lens.len());
    }
    out
}

/// A row of a micro-batch: its adapter, tokens and scored `(position, target)` pairs.
type ScoredRow<'a> = (Option<AdapterId>, &'a [u32], Vec<(usize, u32)>);

/// One micro-batch through the model: log-probabilities at the scored
/// positions, `[n_scored]`, in row order then position order.
fn scored_logprobs(model: &Llama, adapters: &AdapterSet, rows: &[ScoredRow]) -> Result<Tensor> {
    let device = model.device();
    let width = rows.iter().map(|r| r.1.len()).max().unwrap_or(0);
    let mut flat = Vec::with_capacity(rows.len() * width);
    let mut pads = Vec::with_capacity(rows.len());
    let mut index = Vec::new();
    let mut targets = Vec::new();
    for (r, (_, tokens, scored)) in rows.iter().enumerate() {
        let pad = width - tokens.len();
        pads.push(pad);
        flat.extend(std::iter::repeat_n(0u32, pad));
        flat.extend_from_slice(tokens);
        for &(t, target) in scored {
            // The hidden state at slot pad+t-1 predicts token t.
            index.push((r * width + pad + t - 1) as u32);
            targets.push(target);
        }
    }
    let tokens = Tensor::from_vec(flat, (rows.len(), width), device)?;
    let at = Positions::left_padded(&pads, 0, width, device)?;
    let row_adapters: Vec<_> = rows.iter().map(|r| r.0).collect();
    let hook = RowAdapters::new(adapters, &row_adapters)?;
    let hidden = model.hidden_states(&model.embed(&tokens)?, &at, None, &hook)?;
    let hidden = hidden
        .reshape(((), model.config.hidden_size))?
        .index_select(&Tensor::new(index.as_slice(), device)?, 0)?;
    Ok(model.target_logprobs(&hidden, &targets)?)
}

/// Row indices ordered by adapter (stable), so micro-batches hold few segments.
fn by_adapter<K: Ord + Copy>(keys: &[K]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..keys.len()).collect();
    order.sort_by_key(|&i| keys[i]);
    order
}

/// Per-token log-probabilities; `result[i][j]` is for `rows[i].tokens[score_from + j]`.
pub fn logprobs(
    model: &Llama,
    adapters: &AdapterSet,
    rows: &[ScoreRow],
    token_budget: usize,
) -> Result<Vec<Vec<f32>>> {
    adapters.check(&model.config)?;
    for (i, r) in rows.iter().enumerate() {
        if r.score_from == 0 || r.score_from > r.tokens.len() {
            return Err(Error::BadRow {
                row: i,
                reason: format!("score_from {} outside 1..={}", r.score_from, r.tokens.len()),
            });
        }
    }
    let order = by_adapter(&rows.iter().map(|r| r.adapter).collect::<Vec<_>>());
    let lens: Vec<usize> = order.iter().map(|&i| rows[i].tokens.len()).collect();
    let mut out = vec![Vec::new(); rows.len()];
    for range in micro_batches(&lens, token_budget) {
        let batch: Vec<_> = order[range.clone()]
            .iter()
            .map(|&i| {
                let r = &rows[i];
                (
                    r.adapter,
                    r.tokens.as_slice(),
                    scored(&r.tokens, |t| t >= r.score_from),
                )
            })
            .collect();
        let values = scored_logprobs(model, adapters, &batch)?
            .to_dtype(DType::F32)?
            .to_vec1::<f32>()?;
        let mut offset = 0;
        for (&i, (_, _, s)) in order[range].iter().zip(&batch) {
            out[i] = values[offset..offset + s.len()].to_vec();
            offset += s.len();
        }
    }
    Ok(out)
}

fn check_train_row(i: usize, r: &TrainRow) -> Result<()> {
    let n = r.tokens.len();
    let bad = |reason: String| Err(Error::BadRow { row: i, reason });
    if r.loss_mask.len() != n || r.advantages.len() != n || r.old_logprobs.len() != n {
        return bad(format!(
            "{n} tokens but {} mask, {} advantages, {} old log-probs",
            r.loss_mask.len(),
            r.advantages.len(),
            r.old_logprobs.len()
        ));
    }
    if r.loss_mask.first() == Some(&true) {
        return bad("loss_mask[0] is set, but the first token has no prefix".into());
    }
    if let Some(t) = (0..n).find(|&t| {
        r.loss_mask[t] && !(r.advantages[t].is_finite() && r.old_logprobs[t].is_finite())
    }) {
        return bad(format!("non-finite advantage or old log-prob at token {t}"));
    }
    Ok(())
}

/// The PPO-clip token-mean loss of every adapter, and its gradients:
/// `L_a = mean over a's masked tokens of -min(ρ·Â, clip(ρ, 1-ε, 1+ε)·Â)`,
/// `ρ = exp(log π - log π_old)`. No KL term (AZR).
pub fn train_step(
    model: &Llama,
    adapters: &AdapterSet,
    rows: &[TrainRow],
    config: TrainConfig,
) -> Result<TrainOutput> {
    adapters.check(&model.config)?;
    for (i, r) in rows.iter().enumerate() {
        check_train_row(i, r)?;
    }
    let mut tokens_per_adapter: BTreeMap<AdapterId, usize> = BTreeMap::new();
    for r in rows {
        *tokens_per_adapter.entry(r.adapter).or_default() +=
            r.loss_mask.iter().filter(|&&m| m).count();
    }
    let order = by_adapter(&rows.iter().map(|r| r.adapter).collect::<Vec<_>>());
    let lens: Vec<usize> = order.iter().map(|&i| rows[i].tokens.len()).collect();
    let mut out = TrainOutput::default();
    let device = model.device();
    for range in micro_batches(&lens, config.token_budget) {
        let rows_here: Vec<&TrainRow> = order[range].iter().map(|&i| &rows[i]).collect();
        let batch: Vec<_> = rows_here
            .iter()
            .map(|r| {
                (
                    Some(r.adapter),
                    r.tokens.as_slice(),
                    scored(&r.tokens, |t| r.loss_mask[t]),
                )
            })
            .collect();
        let (mut adv, mut old, mut weight, mut owner) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (r, (_, _, s)) in rows_here.iter().zip(&batch) {
            let n = tokens_per_adapter[&r.adapter].max(1) as f32;
            for &(t, _) in s {
                adv.push(r.advantages[t]);
                old.push(r.old_logprobs[t]);
                weight.push(1.0 / n);
                owner.push(r.adapter);
            }
        }
        if adv.is_empty() {
            continue;
        }
        let logp = scored_logprobs(model, adapters, &batch)?;
        let dtype = logp.dtype();
        let vector = |v: &[f32]| Tensor::new(v, device).and_then(|t| t.to_dtype(dtype));
        let adv_t = vector(&adv)?;
        let ratio = (logp - vector(&old)?)?.exp()?;
        let unclipped = (&ratio * &adv_t)?;
        let clipped = (ratio.clamp(1.0 - config.clip, 1.0 + config.clip)? * &adv_t)?;
        let per_token = unclipped.minimum(&clipped)?.neg()?;
        let loss = (&per_token * vector(&weight)?)?.sum_all()?;
        let grads = loss.backward()?;
        accumulate(&mut out.grads, adapters, &rows_here, &grads)?;
        record_stats(
            &mut out.stats,
            &owner,
            &per_token,
            &ratio,
            &weight,
            config.clip,
        )?;
        out.micro_batches += 1;
    }
    Ok(out)
}

fn accumulate(
    acc: &mut BTreeMap<AdapterId, AdapterGrads>,
    adapters: &AdapterSet,
    rows: &[&TrainRow],
    grads: &candle_core::backprop::GradStore,
) -> Result<()> {
    let mut seen: Vec<AdapterId> = rows.iter().map(|r| r.adapter).collect();
    seen.dedup();
    for id in seen {
        let adapter = adapters.adapters[&id];
        let entry = acc.entry(id).or_default();
        for (key, m) in &adapter.modules {
            let zeros = |t: &Tensor| Tensor::zeros(t.dims(), t.dtype(), t.device());
            let ga = grads
                .get(m.a.as_tensor())
                .cloned()
                .map_or_else(|| zeros(m.a.as_tensor()), Ok)?;
            let gb = grads
                .get(m.b.as_tensor())
                .cloned()
                .map_or_else(|| zeros(m.b.as_tensor()), Ok)?;
            match entry.get_mut(key) {
                Some((a, b)) => {
                    *a = (&*a + ga)?;
                    *b = (&*b + gb)?;
                }
                None => {
                    entry.insert(*key, (ga, gb));
                }
            }
        }
    }
    Ok(())
}

fn record_stats(
    stats: &mut BTreeMap<AdapterId, TrainStats>,
    owner: &[AdapterId],
    per_token: &Tensor,
    ratio: &Tensor,
    weight: &[f32],
    clip: f64,
) -> Result<()> {
    let losses = per_token.to_dtype(DType::F64)?.to_vec1::<f64>()?;
    let ratios = ratio.to_dtype(DType::F64)?.to_vec1::<f64>()?;
    for (i, &id) in owner.iter().enumerate() {
        let s = stats.entry(id).or_default();
        let n = s.tokens as f64;
        s.loss += losses[i] * weight[i] as f64;
        let clipped = (ratios[i] - 1.0).abs() > clip;
        s.clip_fraction = (s.clip_fraction * n + clipped as u8 as f64) / (n + 1.0);
        s.mean_ratio = (s.mean_ratio * n + ratios[i]) / (n + 1.0);
        s.tokens += 1;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn micro_batches_respect_the_padded_budget() {
        let lens = [10, 10, 30, 5, 5, 5, 5];
        let batches = micro_batches(&lens, 40);
        assert_eq!(batches, vec![0..2, 2..3, 3..7]);
        // A single row larger than the budget still gets its own batch.
        assert_eq!(micro_batches(&[100, 3], 40), vec![0..1, 1..2]);
        assert!(micro_batches(&[], 40).is_empty());
    }
}
