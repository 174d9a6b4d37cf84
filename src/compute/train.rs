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

use std::collections::btree_map::Entry;
use std::collections::BTreeMap;

use candle_core::{DType, Device, Tensor};

use super::row_adapters::{AdapterId, AdapterSet, RowAdapters};
use super::{generic_tape, tape};
use super::{Backward, Error, Result};
use crate::base::kernels::{with_real, Policy};
use crate::base::{Llama, Positions};
use crate::grammar::TokenMask;
use crate::lora::AdapterGrads;
use crate::rl::ppo::token_loss_and_grad;

/// Padded tokens per micro-batch (default 2048). Peak memory grows with it:
/// the saved activations are ≈ 23 KB per token for SmolLM2-135M in f32, and a
/// train step in 2048-token micro-batches with rank-8 adapters on every
/// projection peaked at 2.6 GB RSS, model included, when the tape still kept
/// the norms' outputs (28 KB a token; BENCHMARKS.md, "Multi-adapter broker").
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
    /// How many leading tokens are the prompt. Rows of one adapter with the
    /// same prompt are trained as one packed sequence, the prompt encoded once
    /// ([`TrainConfig::share_prefixes`]); 0 never groups the row.
    pub prompt_len: usize,
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

impl TrainRow {
    /// Positions in the loss.
    fn scored(&self) -> Vec<(usize, u32)> {
        scored(&self.tokens, |t| self.loss_mask[t])
    }

    /// The prompt the row may share with rows of its adapter in one packed
    /// train sequence; none without a prompt (or with `prompt_len` past its
    /// tokens): such a row runs alone. The cost rule counts by the same.
    pub fn shared_prompt(&self) -> Option<&[u32]> {
        let p = self.prompt_len;
        (p > 0 && p <= self.tokens.len()).then(|| &self.tokens[..p])
    }

    /// Whether the row adds exactly nothing to the loss and its gradient:
    /// every token in the loss has advantage 0 (PPO's term is then
    /// `max(−0·ρ, −0·clip(ρ))`, 0 for every ρ), or none is in the loss.
    pub fn contributes_nothing(&self) -> bool {
        (0..self.tokens.len()).all(|t| !self.loss_mask[t] || self.advantages[t] == 0.0)
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TrainConfig {
    pub clip: f64,
    pub micro_batch_tokens: usize,
    /// Encode each prompt once for all the rows that share it (Prefix
    /// Grouper: the rows packed as `[prompt | answer₁ | … | answer_G]`), and
    /// leave rows whose every advantage is 0 out of the forward and backward
    /// (default true). The loss and gradients are the same either way, up to
    /// the order of floating-point sums.
    pub share_prefixes: bool,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            clip: crate::rl::ppo::AZR_PPO_CLIP,
            micro_batch_tokens: DEFAULT_TOKEN_BUDGET,
            share_prefixes: true,
        }
    }
}

/// What one adapter's part of a train step measured.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TrainStats {
    pub loss: f64,
    /// Tokens in the loss, those of skipped rows included.
    pub tokens: usize,
    /// Fraction of tokens whose ratio left [1-ε, 1+ε] (of the tokens that
    /// ran: a skipped row's ratios are never computed).
    pub clip_fraction: f64,
    pub mean_ratio: f64,
    /// Token slots of this adapter's sequences that went through the forward
    /// and backward (padding left out): what sharing prompts and skipping
    /// save, measured.
    pub tokens_run: usize,
}

#[derive(Debug, Default)]
pub struct TrainOutput {
    pub grads: BTreeMap<AdapterId, AdapterGrads>,
    pub stats: BTreeMap<AdapterId, TrainStats>,
    /// Per row (in the order given): log π of each token in its loss, under
    /// the policy trained; `None` for a row left out because it adds nothing.
    pub logprobs: Vec<Option<Vec<f64>>>,
    pub micro_batches: usize,
    /// Token slots that went through the forward and backward, padding left
    /// out: the work that sharing prefixes and skipping save.
    pub tokens_run: usize,
}

/// The scored positions of one row: `(token index t, target token)`.
fn scored(tokens: &[u32], keep: impl Fn(usize) -> bool) -> Vec<(usize, u32)> {
    (1..tokens.len())
        .filter(|&t| keep(t))
        .map(|t| (t, tokens[t]))
        .collect()
}

/// Split sequences (already ordered) into micro-batches whose padded size fits `budget`.
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

/// One sequence the model runs: a prefix, then the rest of each of its rows,
/// `[prefix | tail₁ | … | tail_G]`. Each tail sits at the positions it has
/// in its own row and sees the prefix and its own earlier tokens only, so
/// every row's hidden states are those of running it alone. A row by itself
/// is a pack whose prefix is the whole row and whose one tail is empty.
#[derive(Debug)]
struct Pack<'a> {
    adapter: Option<AdapterId>,
    prefix: &'a [u32],
    tails: Vec<Tail<'a>>,
}

/// One row of a pack: its index, its scored `(position, target)` pairs, and
/// its tokens after the pack's prefix.
#[derive(Debug)]
struct Tail<'a> {
    row: usize,
    scored: Vec<(usize, u32)>,
    tokens: &'a [u32],
}

impl<'a> Pack<'a> {
    fn alone(
        adapter: Option<AdapterId>,
        row: usize,
        tokens: &'a [u32],
        scored: Vec<(usize, u32)>,
    ) -> Pack<'a> {
        Pack {
            adapter,
            prefix: tokens,
            tails: vec![Tail {
                row,
                scored,
                tokens: &[],
            }],
        }
    }

    fn width(&self) -> usize {
        self.prefix.len() + self.tails.iter().map(|t| t.tokens.len()).sum::<usize>()
    }

    /// Each slot's RoPE position and which part it is in (0: the prefix,
    /// g + 1: tail g).
    fn slots(&self) -> (Vec<u32>, Vec<usize>) {
        let p = self.prefix.len();
        let mut positions: Vec<u32> = (0..p as u32).collect();
        let mut part = vec![0; p];
        for (g, tail) in self.tails.iter().enumerate() {
            let n = tail.tokens.len();
            positions.extend((p..p + n).map(|i| i as u32));
            part.extend(std::iter::repeat_n(g + 1, n));
        }
        (positions, part)
    }
}

/// The sequences of one train step, in adapter order. Without sharing, one
/// per row. With it, rows that add nothing are left out, and the rows of an
/// adapter with the same prompt share a pack whose prefix is their longest
/// common prefix; a pack wider than `budget` is split into several, each
/// with the prefix again.
fn train_packs<'a>(
    rows: &'a [TrainRow],
    order: &[usize],
    share: bool,
    budget: usize,
) -> Vec<Pack<'a>> {
    let alone = |i: usize| Pack::alone(Some(rows[i].adapter), i, &rows[i].tokens, rows[i].scored());
    if !share {
        return order.iter().map(|&i| alone(i)).collect();
    }
    // Groups in order of their first row, so packs keep the adapter order.
    let mut groups: Vec<Vec<usize>> = Vec::new();
    let mut group_of: BTreeMap<(AdapterId, &[u32]), usize> = BTreeMap::new();
    for &i in order.iter().filter(|&&i| !rows[i].contributes_nothing()) {
        let r = &rows[i];
        let Some(prompt) = r.shared_prompt() else {
            groups.push(vec![i]);
            continue;
        };
        let key = (r.adapter, prompt);
        let g = *group_of.entry(key).or_insert_with(|| {
            groups.push(Vec::new());
            groups.len() - 1
        });
        groups[g].push(i);
    }
    let mut packs = Vec::new();
    for group in groups {
        if group.len() == 1 {
            packs.push(alone(group[0]));
            continue;
        }
        let first = &rows[group[0]].tokens;
        let shared = group
            .iter()
            .map(|&i| common_prefix(first, &rows[i].tokens))
            .min()
            .unwrap_or(0);
        let mut pack = Pack {
            adapter: Some(rows[group[0]].adapter),
            prefix: &first[..shared],
            tails: Vec::new(),
        };
        for i in group {
            let tail = &rows[i].tokens[shared..];
            if !pack.tails.is_empty() && pack.width() + tail.len() > budget {
                let prefix = pack.prefix;
                packs.push(std::mem::replace(
                    &mut pack,
                    Pack {
                        adapter: Some(rows[i].adapter),
                        prefix,
                        tails: Vec::new(),
                    },
                ));
            }
            pack.tails.push(Tail {
                row: i,
                scored: rows[i].scored(),
                tokens: tail,
            });
        }
        packs.push(pack);
    }
    packs
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// A micro-batch laid out for the model: packs left-padded to one width, and
/// where the hidden state that predicts each scored token sits once rows are
/// flattened.
struct Layout {
    tokens: Tensor,
    at: Positions,
    /// `[n_scored]` into `[packs·width]`, in pack, tail, then position order.
    index: Tensor,
    targets: Vec<u32>,
    /// The row of each scored token.
    owners: Vec<usize>,
    adapters: Vec<Option<AdapterId>>,
    /// Slots that are not padding.
    tokens_run: usize,
}

impl Layout {
    fn new(device: &Device, packs: &[Pack]) -> Result<Layout> {
        let width = packs.iter().map(Pack::width).max().unwrap_or(0);
        let mut flat = Vec::with_capacity(packs.len() * width);
        let mut positions = Vec::with_capacity(packs.len());
        let mut parts = Vec::with_capacity(packs.len());
        let (mut index, mut targets, mut owners) = (Vec::new(), Vec::new(), Vec::new());
        for (r, pack) in packs.iter().enumerate() {
            let pad = width - pack.width();
            let (at, part) = pack.slots();
            flat.extend(std::iter::repeat_n(0u32, pad));
            flat.extend_from_slice(pack.prefix);
            let p = pack.prefix.len();
            let mut offset = pad + p;
            for tail in &pack.tails {
                flat.extend_from_slice(tail.tokens);
                for &(t, target) in &tail.scored {
                    // Token t is predicted from position t-1: in the prefix,
                    // or in this row's tail.
                    let slot = if t - 1 < p {
                        pad + t - 1
                    } else {
                        offset + t - 1 - p
                    };
                    index.push((r * width + slot) as u32);
                    targets.push(target);
                    owners.push(tail.row);
                }
                offset += tail.tokens.len();
            }
            positions.push([vec![0; pad], at].concat());
            parts.push((pad, part));
        }
        // A query sees an earlier slot of the prefix or of its own part;
        // padding sees and is seen by nothing.
        let visible = |r: usize, q: usize, k: usize| {
            let (pad, part) = &parts[r];
            k <= q && k >= *pad && {
                let (pq, pk) = (part[q - pad], part[k - pad]);
                pk == 0 || pk == pq
            }
        };
        Ok(Layout {
            tokens: Tensor::from_vec(flat, (packs.len(), width), device)?,
            at: Positions::packed(&positions, width, visible, device)?,
            index: Tensor::new(index.as_slice(), device)?,
            targets,
            owners,
            adapters: packs.iter().map(|p| p.adapter).collect(),
            tokens_run: packs.iter().map(Pack::width).sum(),
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
fn scored_logprobs(model: &Llama, adapters: &AdapterSet, packs: &[Pack]) -> Result<Tensor> {
    let layout = Layout::new(model.device(), packs)?;
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
    super::in_pool(|| score_in_pool(model, adapters, rows, micro_batch_tokens))
}

/// [`logprobs`], on a thread of rayon's pool.
fn score_in_pool(
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
    let packs: Vec<Pack> = order
        .iter()
        .map(|&i| {
            let r = &rows[i];
            let scored = scored(&r.tokens, |t| t >= r.score_from);
            Pack::alone(r.adapter, i, &r.tokens, scored)
        })
        .collect();
    let lens: Vec<usize> = packs.iter().map(Pack::width).collect();
    let mut out = vec![Vec::new(); rows.len()];
    for range in micro_batches(&lens, micro_batch_tokens) {
        let batch = &packs[range];
        let values = scored_logprobs(model, adapters, batch)?
            .to_dtype(DType::F32)?
            .to_vec1::<f32>()?;
        let mut offset = 0;
        for pack in batch {
            let tail = &pack.tails[0];
            out[tail.row] = values[offset..offset + tail.scored.len()].to_vec();
            offset += tail.scored.len();
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
    if r.prompt_len > n {
        return bad(format!(
            "prompt_len {} is longer than its {n} tokens",
            r.prompt_len
        ));
    }
    if let Some(t) = (0..r.prompt_len).find(|&t| r.loss_mask[t]) {
        return bad(format!(
            "token {t} is in the loss but inside the {}-token prompt",
            r.prompt_len
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
///
/// With [`TrainConfig::share_prefixes`], rows that share an adapter and a
/// prompt run as one packed sequence, and a row whose every advantage is 0
/// does not run at all: its tokens still count in the token mean, and an
/// adapter whose rows all sit out still gets its (zero) gradients, so the
/// optimizer steps exactly as if they had run.
///
/// The backward is the one for the model's device ([`Backward::for_device`]);
/// the gradients come back on the device of each adapter's factors.
pub fn train_step(
    model: &Llama,
    adapters: &AdapterSet,
    rows: &[TrainRow],
    config: TrainConfig,
) -> Result<TrainOutput> {
    train_step_with(
        model,
        adapters,
        rows,
        config,
        Backward::for_device(model.device()),
    )
}

/// [`train_step`] with the backward named (the tape refuses a model off the CPU).
pub fn train_step_with(
    model: &Llama,
    adapters: &AdapterSet,
    rows: &[TrainRow],
    config: TrainConfig,
    backward: Backward,
) -> Result<TrainOutput> {
    super::in_pool(|| train_in_pool(model, adapters, rows, config, backward))
}

/// [`train_step_with`], on a thread of rayon's pool.
fn train_in_pool(
    model: &Llama,
    adapters: &AdapterSet,
    rows: &[TrainRow],
    config: TrainConfig,
    backward: Backward,
) -> Result<TrainOutput> {
    if backward == Backward::Tape && !model.device().is_cpu() {
        return Err(Error::Unsupported(
            "the tape backward (compute::tape) runs on the CPU only; a model on another device trains with the generic backward",
        ));
    }
    adapters.check(&model.config)?;
    for (i, r) in rows.iter().enumerate() {
        check_train_row(i, r, model.config.vocab_size)?;
        if !adapters.adapters.contains_key(&r.adapter) {
            return Err(Error::UnknownAdapter {
                row: i,
                adapter: r.adapter,
            });
        }
    }
    let mut tokens_per_adapter: BTreeMap<AdapterId, usize> = BTreeMap::new();
    for r in rows {
        *tokens_per_adapter.entry(r.adapter).or_default() +=
            r.loss_mask.iter().filter(|&&m| m).count();
    }
    let order = by_adapter(&rows.iter().map(|r| r.adapter).collect::<Vec<_>>());
    let packs = train_packs(
        rows,
        &order,
        config.share_prefixes,
        config.micro_batch_tokens,
    );
    let lens: Vec<usize> = packs.iter().map(Pack::width).collect();
    let mut out = TrainOutput {
        logprobs: vec![None; rows.len()],
        ..TrainOutput::default()
    };
    let mut ratios = RatioSums::default();
    for range in micro_batches(&lens, config.micro_batch_tokens) {
        let batch = &packs[range];
        let targets = PpoTargets::new(rows, batch, &tokens_per_adapter);
        if targets.owners.is_empty() {
            continue;
        }
        let layout = Layout::new(model.device(), batch)?;
        let step = MicroBatch {
            model,
            adapters,
            layout: &layout,
            targets: &targets,
            clip: config.clip,
        };
        let logps = step.run(backward, &mut out.grads)?;
        ratios.add(&targets, &logps, config.clip, &mut out.stats);
        for (&row, &lp) in layout.owners.iter().zip(&logps) {
            out.logprobs[row].get_or_insert_with(Vec::new).push(lp);
        }
        out.micro_batches += 1;
        out.tokens_run += layout.tokens_run;
        for pack in batch {
            if let Some(id) = pack.adapter {
                out.stats.entry(id).or_default().tokens_run += pack.width();
            }
        }
    }
    ratios.finish(&mut out.stats);
    for (id, grads) in &mut out.grads {
        to_adapter_device(grads, adapters.adapters[id])?;
    }
    for r in rows {
        let scored = r.loss_mask.iter().filter(|&&m| m).count();
        if scored > 0 {
            out.stats.entry(r.adapter).or_default().tokens += scored;
            if let Entry::Vacant(slot) = out.grads.entry(r.adapter) {
                slot.insert(zero_grads(adapters.adapters[&r.adapter])?);
            }
        }
    }
    Ok(out)
}

/// Gradients of zero for every factor of `adapter`.
fn zero_grads(adapter: &crate::lora::Adapter) -> Result<AdapterGrads> {
    adapter
        .modules
        .iter()
        .map(|(&key, m)| Ok((key, (m.a.zeros_like()?, m.b.zeros_like()?))))
        .collect()
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

impl PpoTargets {
    fn new(
        rows: &[TrainRow],
        packs: &[Pack],
        tokens_per_adapter: &BTreeMap<AdapterId, usize>,
    ) -> PpoTargets {
        let mut targets = PpoTargets::default();
        for tail in packs.iter().flat_map(|p| &p.tails) {
            let r = &rows[tail.row];
            let n = tokens_per_adapter[&r.adapter].max(1) as f32;
            for &(t, _) in &tail.scored {
                targets.advantages.push(r.advantages[t]);
                targets.old_logprobs.push(r.old_logprobs[t]);
                targets.weights.push(1.0 / n);
                targets.owners.push(r.adapter);
                targets.allowed.push(r.allowed[t].clone());
                targets.inv_temperature.push(1.0 / r.temperature as f64);
            }
        }
        targets
    }

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

/// Moves each gradient to where `adapter`'s factors live (the model's device
/// computed it); a no-op on one device.
fn to_adapter_device(grads: &mut AdapterGrads, adapter: &crate::lora::Adapter) -> Result<()> {
    for (key, (da, db)) in grads.iter_mut() {
        if let Some(m) = adapter.modules.get(key) {
            *da = da.to_device(m.a.device())?;
            *db = db.to_device(m.b.device())?;
        }
    }
    Ok(())
}

/// One micro-batch's forward and backward.
struct MicroBatch<'a> {
    model: &'a Llama,
    adapters: &'a AdapterSet<'a>,
    layout: &'a Layout,
    targets: &'a PpoTargets,
    clip: f64,
}

impl MicroBatch<'_> {
    /// The forward, saving for `backward`, then the head and `backward`.
    /// Adds the factor gradients to `grads`; returns the scored tokens'
    /// log-probabilities.
    fn run(
        &self,
        backward: Backward,
        grads: &mut BTreeMap<AdapterId, AdapterGrads>,
    ) -> Result<Vec<f64>> {
        let (model, layout) = (self.model, self.layout);
        let lora = RowAdapters::new(self.adapters, &layout.adapters, model.device())?
            .for_backward(backward);
        let embeds = model.embed(&layout.tokens)?;
        let (tape, top) = tape::forward(model, &lora, &embeds, &layout.at)?;
        let policies = self.targets.policies();
        let dloss = |i: usize, lp: f64| {
            self.targets.weights[i] as f64 * self.targets.token(i, lp, self.clip).1
        };
        let (index, targets) = (&layout.index, &layout.targets);
        match backward {
            Backward::Tape => with_real!(model.dtype(), T => {
                let (logps, top_grad) =
                    tape::head::<T>(model, &top, index, targets, &policies, dloss)?;
                tape::backward::<T>(model, &lora, tape, top_grad, grads)?;
                Ok(logps)
            }),
            Backward::Generic => {
                let (logps, top_grad) =
                    generic_tape::head(model, &top, index, targets, &policies, dloss)?;
                generic_tape::backward(model, &lora, tape, top_grad, grads)?;
                Ok(logps)
            }
        }
    }
}

/// Per adapter: the loss, and the sums behind the ratio statistics of the
/// tokens that ran.
#[derive(Debug, Default)]
struct RatioSums {
    sums: BTreeMap<AdapterId, (f64, f64, usize)>,
}

impl RatioSums {
    fn add(
        &mut self,
        targets: &PpoTargets,
        logps: &[f64],
        clip: f64,
        stats: &mut BTreeMap<AdapterId, TrainStats>,
    ) {
        for (i, (&id, &logp)) in targets.owners.iter().zip(logps).enumerate() {
            let ratio = (logp - targets.old_logprobs[i] as f64).exp();
            stats.entry(id).or_default().loss +=
                targets.token(i, logp, clip).0 * targets.weights[i] as f64;
            let (clipped, ratios, n) = self.sums.entry(id).or_default();
            *clipped += ((ratio - 1.0).abs() > clip) as u8 as f64;
            *ratios += ratio;
            *n += 1;
        }
    }

    fn finish(self, stats: &mut BTreeMap<AdapterId, TrainStats>) {
        for (id, (clipped, ratios, n)) in self.sums {
            let s = stats.entry(id).or_default();
            s.clip_fraction = clipped / n as f64;
            s.mean_ratio = ratios / n as f64;
        }
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
