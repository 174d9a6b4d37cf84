//! Per-token log-probabilities and the PPO-clip train step over many adapters
//! at once: one gradient set per adapter, accumulated over micro-batches.
//!
//! The policy trained is the one the tokens were sampled from
//! ([`super::generate`]): the softmax of the logits at the row's sampling
//! temperature, renormalised over the tokens a grammar allowed where a row
//! has a mask ([`TrainRow::allowed`]). Tokens the grammar forced carry no
//! loss (the caller leaves them out of `loss_mask`).
//!
//! Memory is bounded by the micro-batch token budget (padded tokens per
//! micro-batch, default [`DEFAULT_TOKEN_BUDGET`]): the blocks' saved
//! activations ([`tape`]) scale with it, and logits are only formed at scored
//! positions.

use std::collections::BTreeMap;

use candle_core::{DType, Device, Tensor};

use super::row_adapters::{AdapterId, AdapterSet, RowAdapters};
use super::tape;
use super::{Error, Result};
use crate::base::kernels::{with_real, Policy, Real};
use crate::base::{Llama, Positions};
use crate::grammar::TokenMask;
use crate::lora::AdapterGrads;
use crate::rl::ppo::token_loss_and_grad;

/// Padded tokens per micro-batch (default 2048). Peak memory grows with it:
/// the saved activations are ≈ 28 KB per token for SmolLM2-135M in f32, and a
/// train step in 2048-token micro-batches with rank-8 adapters on every
/// projection peaked at 2.6 GB RSS, model included (BENCHMARKS.md,
/// "Multi-adapter broker").
pub const DEFAULT_TOKEN_BUDGET: usize = 2048;

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
    /// The tokens a grammar allowed at each position (`None`: the whole
    /// vocabulary).
    pub allowed: Vec<Option<TokenMask>>,
    /// The temperature the tokens were sampled at (1 for greedy rows). The
    /// policy trained is the one sampled from: the softmax of the logits
    /// divided by it, renormalised over the allowed tokens.
    pub temperature: f32,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TrainConfig {
    pub clip: f64,
    pub micro_batch_tokens: usize,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            clip: crate::rl::ppo::AZR_PPO_CLIP,
            micro_batch_tokens: DEFAULT_TOKEN_BUDGET,
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

/// A micro-batch laid out for the model: rows left-padded to one width, and
/// where each scored position's hidden state sits once rows are flattened.
struct Layout {
    tokens: Tensor,
    at: Positions,
    /// `[n_scored]` into `[rows·width]`, in row order then position order.
    index: Tensor,
    targets: Vec<u32>,
    adapters: Vec<Option<AdapterId>>,
}

impl Layout {
    fn new(device: &Device, rows: &[ScoredRow]) -> Result<Layout> {
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
        Ok(Layout {
            tokens: Tensor::from_vec(flat, (rows.len(), width), device)?,
            at: Positions::left_padded(&pads, 0, width, device)?,
            index: Tensor::new(index.as_slice(), device)?,
            targets,
            adapters: rows.iter().map(|r| r.0).collect(),
        })
    }

    /// Log-probabilities at the scored positions, `[n_scored]`, from the last
    /// block's output `[rows, width, hidden]`.
    fn logprobs(&self, model: &Llama, hidden: &Tensor) -> Result<Tensor> {
        let hidden = hidden
            .reshape(((), model.config.hidden_size))?
            .index_select(&self.index, 0)?;
        Ok(model.target_logprobs(&hidden, &self.targets)?)
    }
}

/// One micro-batch through the model, saving nothing for a backward.
fn scored_logprobs(model: &Llama, adapters: &AdapterSet, rows: &[ScoredRow]) -> Result<Tensor> {
    let layout = Layout::new(model.device(), rows)?;
    let hook = RowAdapters::new(adapters, &layout.adapters, model.device())?;
    let embeds = model.embed(&layout.tokens)?;
    let hidden = model.hidden_states(&embeds, &layout.at, None, &hook, None)?;
    layout.logprobs(model, &hidden)
}

/// Row indices ordered by adapter (stable), so micro-batches hold few segments.
fn by_adapter<K: Ord + Copy>(keys: &[K]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..keys.len()).collect();
    order.sort_by_key(|&i| keys[i]);
    order
}

/// Per-token log-probabilities of the free softmax at temperature 1;
/// `result[i][j]` is for `rows[i].tokens[score_from + j]`. For rows sampled
/// under a grammar mask or another temperature these are not the policy's
/// log-probs ([`super::Generation::logprobs`] and the train step use the
/// masked, tempered distribution).
pub fn logprobs(
    model: &Llama,
    adapters: &AdapterSet,
    rows: &[ScoreRow],
    micro_batch_tokens: usize,
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
    for range in micro_batches(&lens, micro_batch_tokens) {
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

fn check_train_row(i: usize, r: &TrainRow, vocab: usize) -> Result<()> {
    let n = r.tokens.len();
    let bad = |reason: String| Err(Error::BadRow { row: i, reason });
    if r.loss_mask.len() != n
        || r.advantages.len() != n
        || r.old_logprobs.len() != n
        || r.allowed.len() != n
    {
        return bad(format!(
            "{n} tokens but {} mask, {} advantages, {} old log-probs, {} allowed sets",
            r.loss_mask.len(),
            r.advantages.len(),
            r.old_logprobs.len(),
            r.allowed.len()
        ));
    }
    if !(r.temperature.is_finite() && r.temperature > 0.0) {
        return bad(format!("temperature {} is not positive", r.temperature));
    }
    if let Some(t) = (0..n).find(|&t| {
        r.loss_mask[t]
            && r.allowed[t]
                .as_ref()
                .is_some_and(|m| m.size() != vocab || !m.allows(r.tokens[t]))
    }) {
        return bad(format!(
            "token {t} is trained under a mask that does not allow it or does not cover the {vocab} logits"
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
    if !model.device().is_cpu() {
        return Err(Error::Unsupported(
            "the train step's backward (compute::tape) runs on the CPU only: train with a CPU copy of the model",
        ));
    }
    adapters.check(&model.config)?;
    for (i, r) in rows.iter().enumerate() {
        check_train_row(i, r, model.config.vocab_size)?;
    }
    let mut tokens_per_adapter: BTreeMap<AdapterId, usize> = BTreeMap::new();
    for r in rows {
        *tokens_per_adapter.entry(r.adapter).or_default() +=
            r.loss_mask.iter().filter(|&&m| m).count();
    }
    let order = by_adapter(&rows.iter().map(|r| r.adapter).collect::<Vec<_>>());
    let lens: Vec<usize> = order.iter().map(|&i| rows[i].tokens.len()).collect();
    let mut out = TrainOutput::default();
    for range in micro_batches(&lens, config.micro_batch_tokens) {
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
        let mut targets = PpoTargets::default();
        for (r, (_, _, s)) in rows_here.iter().zip(&batch) {
            let n = tokens_per_adapter[&r.adapter].max(1) as f32;
            for &(t, _) in s {
                targets.advantages.push(r.advantages[t]);
                targets.old_logprobs.push(r.old_logprobs[t]);
                targets.weights.push(1.0 / n);
                targets.owners.push(r.adapter);
                targets.allowed.push(r.allowed[t].clone());
                targets.inv_temperature.push(1.0 / r.temperature as f64);
            }
        }
        if targets.owners.is_empty() {
            continue;
        }
        let logps = with_real!(model.embed.dtype(), T => micro_batch_step::<T>(
            model,
            adapters,
            &batch,
            &targets,
            config.clip,
            &mut out.grads,
        ))?;
        record_stats(&mut out.stats, &targets, &logps, config.clip);
        out.micro_batches += 1;
    }
    Ok(out)
}

/// The PPO inputs of a micro-batch's scored tokens, in [`Layout`] order.
#[derive(Debug, Default)]
struct PpoTargets {
    advantages: Vec<f32>,
    old_logprobs: Vec<f32>,
    /// 1 / (scored tokens of the owner's adapter in the whole step): token-mean loss.
    weights: Vec<f32>,
    owners: Vec<AdapterId>,
    /// The grammar's allowed tokens, where there was one.
    allowed: Vec<Option<TokenMask>>,
    inv_temperature: Vec<f64>,
}

/// Forward and backward of one micro-batch ([`tape`]). Adds the factor
/// gradients to `grads`; returns the scored tokens' log-probabilities.
fn micro_batch_step<T: Real>(
    model: &Llama,
    adapters: &AdapterSet,
    batch: &[ScoredRow],
    targets: &PpoTargets,
    clip: f64,
    grads: &mut BTreeMap<AdapterId, AdapterGrads>,
) -> Result<Vec<f64>> {
    let layout = Layout::new(model.device(), batch)?;
    let lora = RowAdapters::new(adapters, &layout.adapters, model.device())?;
    let embeds = model.embed(&layout.tokens)?;
    let (tape, top) = tape::forward(model, &lora, &embeds, &layout.at)?;
    let (logps, top_grad) = tape::head::<T>(
        model,
        &top,
        &layout.index,
        &layout.targets,
        &targets.policies(),
        |i, lp| targets.weights[i] as f64 * targets.token(i, lp, clip).1,
    )?;
    tape::backward::<T>(model, &lora, tape, top_grad, grads)?;
    Ok(logps)
}

impl PpoTargets {
    /// Each scored token's sampling distribution.
    fn policies(&self) -> Vec<Policy<'_>> {
        self.allowed
            .iter()
            .zip(&self.inv_temperature)
            .map(|(mask, &inv_temperature)| Policy {
                mask: mask.as_ref().map(TokenMask::words),
                inv_temperature,
            })
            .collect()
    }

    /// Scored token `i`'s PPO-clip loss term and its derivative with respect
    /// to its log-probability `logp` (see [`crate::rl::ppo`]).
    fn token(&self, i: usize, logp: f64, clip: f64) -> (f64, f64) {
        let log_ratio = logp - self.old_logprobs[i] as f64;
        token_loss_and_grad(log_ratio, self.advantages[i] as f64, clip)
    }
}

fn record_stats(
    stats: &mut BTreeMap<AdapterId, TrainStats>,
    targets: &PpoTargets,
    logps: &[f64],
    clip: f64,
) {
    for (i, (&id, &logp)) in targets.owners.iter().zip(logps).enumerate() {
        let s = stats.entry(id).or_default();
        let n = s.tokens as f64;
        let ratio = (logp - targets.old_logprobs[i] as f64).exp();
        s.loss += targets.token(i, logp, clip).0 * targets.weights[i] as f64;
        let clipped = (ratio - 1.0).abs() > clip;
        s.clip_fraction = (s.clip_fraction * n + clipped as u8 as f64) / (n + 1.0);
        s.mean_ratio = (s.mean_ratio * n + ratio) / (n + 1.0);
        s.tokens += 1;
    }
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
