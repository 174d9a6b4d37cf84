//! Batched, KV-cached decoding where every row has its own adapter, prompt,
//! limits, sampling settings and seeded random stream.
//!
//! A row's tokens do not depend on its neighbours: rows are left-padded and
//! masked, each samples from its own ChaCha stream, and finished rows leave the
//! batch. One limit: each frozen projection and the LM head pick their kernel
//! by the pass's number of token rows, rows × new tokens
//! (`base::ops::frozen_matmul`: the few-row kernel up to 8, the row-lanes
//! kernel up to 32, gemm above), and the three sum in different orders. A
//! row's logits can therefore differ in the last bits between two batches
//! whose token-row counts fall in different kernels' ranges, which can flip a
//! near-tie. A replay runs the same batches, so it gets the same bits. Rows
//! are internally grouped by adapter (segments) and the results returned in
//! request order.
//!
//! Structured decoding: a row may carry a grammar ([`crate::grammar`]). Its
//! next token is then sampled from the softmax at the row's temperature,
//! renormalised over the tokens the grammar allows (the others' logits at
//! −∞), and the recorded log-prob is of that same distribution, which is the
//! one PPO trains ([`super::train_step`]). Text the grammar fixes is appended
//! without sampling ([`Pick::Forced`]: log-prob 0, never trained); its first
//! run joins the prompt in the prefill, and a pass takes several tokens at
//! once when every row has that many decided. Masks are computed per row in
//! parallel and are a pure function of the row's tokens, so a constrained
//! row decodes the same in every replay. A batch without grammars decodes
//! exactly as before grammars existed.

use std::sync::Arc;
use std::time::Instant;

use candle_core::{IndexOp, Tensor};
use rand::Rng;
use rand_chacha::ChaCha12Rng;
use rayon::prelude::*;

use super::row_adapters::{AdapterId, AdapterSet, RowAdapters};
use super::{Error, Result};
use crate::base::{kernels, KvCache, Llama, Logits, Positions};
use crate::grammar::{Constraint, Grammar, Next, TokenMask};

/// How to pick the next token. `temperature <= 0` means greedy.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    /// Softmax temperature (default 1.0; 0 = greedy argmax).
    pub temperature: f32,
    /// Nucleus mass (default 1.0 = the whole distribution).
    pub top_p: f32,
}

impl Sampling {
    pub const GREEDY: Sampling = Sampling {
        temperature: 0.0,
        top_p: 1.0,
    };

    /// The temperature of the policy a token's log-prob is taken under: the
    /// sampling temperature (1 for greedy rows). Top-p truncation is not
    /// part of it.
    pub fn policy_temperature(self) -> f32 {
        if self.temperature > 0.0 {
            self.temperature
        } else {
            1.0
        }
    }
}

impl Default for Sampling {
    fn default() -> Self {
        Sampling {
            temperature: 1.0,
            top_p: 1.0,
        }
    }
}

/// One row of a generation batch.
#[derive(Debug, Clone)]
pub struct GenRequest {
    pub adapter: Option<AdapterId>,
    pub prompt: Vec<u32>,
    pub max_new_tokens: usize,
    /// Generation stops after emitting any of these (the stop token is kept).
    pub stop: Vec<u32>,
    pub sampling: Sampling,
    /// This row's own stream (e.g. keyed by seed, member, step, row).
    pub rng: ChaCha12Rng,
    /// The grammar the reply follows (structured decoding), if any.
    pub grammar: Option<Arc<Grammar>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum StopReason {
    StopToken,
    MaxTokens,
    ContextFull,
    /// The row's grammar failed (an llguidance error): the row ends where it
    /// was, its reply unfinished, and the batch's other rows go on.
    GrammarFailed,
}

/// How a generated token was chosen.
#[derive(Debug, Clone, PartialEq)]
pub enum Pick {
    /// Sampled from the whole vocabulary.
    Free,
    /// Sampled from the tokens the grammar allowed there.
    Masked(TokenMask),
    /// Written by the grammar (text it fixes, or the only token it allows):
    /// not the model's choice, so its log-prob is 0 and it is never trained.
    Forced,
}

impl Pick {
    /// The mask of a masked token.
    pub fn mask(&self) -> Option<TokenMask> {
        match self {
            Pick::Masked(mask) => Some(mask.clone()),
            _ => None,
        }
    }
}

#[derive(Debug, Clone)]
pub struct Generation {
    pub tokens: Vec<u32>,
    /// log π(token) under the adapter, one per token: of the softmax at the
    /// row's [`Sampling::policy_temperature`], renormalised over the mask for a
    /// masked token; 0 for a forced one.
    pub logprobs: Vec<f32>,
    /// How each token was chosen.
    pub picks: Vec<Pick>,
    /// Only from [`generate_with_top`] (empty otherwise): per token, the most
    /// likely tokens of the distribution it was picked from and their
    /// log-probs, best first, as `logprobs` records them (so the picked
    /// token's entry, when it is among them, equals its `logprobs` value).
    /// Empty for a forced token: nothing was picked.
    pub top: Vec<Vec<(u32, f32)>>,
    pub stop: StopReason,
}

/// Where a batch's decoding time went.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct DecodeStats {
    /// Passes through the model (the prefill included).
    pub passes: usize,
    /// Wall time of the model passes.
    pub model_ms: f64,
    /// Wall time of sampling and of the grammars' masks (rows in parallel),
    /// the grammars' work before the prefill included.
    pub pick_ms: f64,
    /// Of that, the grammars' share: wall time of the mask work (before the
    /// prefill: measured; per pass: the rows' summed mask time over the
    /// threads that could run them at once).
    pub mask_ms: f64,
    pub sampled_tokens: usize,
    pub forced_tokens: usize,
}

/// A row while it decodes.
struct Row {
    /// The request's place in the batch.
    index: usize,
    request: GenRequest,
    pad: usize,
    /// Tokens decided but not yet seen by the model: the prompt and the
    /// grammar's first forced tokens at first, then each new token and any
    /// forced ones after it.
    feed: Vec<u32>,
    constraint: Option<Constraint>,
    /// What the next token is sampled from (constrained rows).
    mask: Option<TokenMask>,
    /// How many of each pick's most likely tokens to record (0: none).
    top: usize,
    out: Generation,
    done: bool,
}

/// Generate for every request in one batch; results in request order.
pub fn generate(
    model: &Llama,
    adapters: &AdapterSet,
    requests: Vec<GenRequest>,
) -> Result<Vec<Generation>> {
    Ok(generate_with_stats(model, adapters, requests)?.0)
}

/// How a batch is decoded beyond what its requests say.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeOptions {
    /// Rows with the same adapter and the same prompt (and the grammar's
    /// same first forced tokens) run their prefill once, and its KV cache
    /// starts each of their caches (default true). Every row keeps its
    /// padding and its own stream, so it samples what it samples alone.
    pub share_prefixes: bool,
    /// How many of each picked token's most likely tokens to record
    /// ([`Generation::top`]; default 0).
    pub top: usize,
}

impl Default for DecodeOptions {
    fn default() -> Self {
        DecodeOptions {
            share_prefixes: true,
            top: 0,
        }
    }
}

/// [`generate`], also saying where the time went.
///
/// Constrained rows (a request with a grammar) sample from the masked,
/// renormalised distribution and record that distribution's log-prob. Tokens
/// the grammar forces are appended without sampling. The grammar's first
/// forced tokens join the prompt in the prefill; later, when every row has
/// more than one decided token waiting, the pass takes them all at once.
/// A batch without grammars decodes one token per pass, as it always did.
pub fn generate_with_stats(
    model: &Llama,
    adapters: &AdapterSet,
    requests: Vec<GenRequest>,
) -> Result<(Vec<Generation>, DecodeStats)> {
    generate_with(model, adapters, requests, DecodeOptions::default())
}

/// [`generate`], also recording for every picked token the `top` most likely
/// tokens with their log-probs ([`Generation::top`]).
///
/// They come from the very logits the token was picked from (after the
/// grammar's mask and the temperature), not from scoring the finished
/// sequence again: a second pass would run other kernels (a prefill instead
/// of decode steps, see the module doc) and could differ in the last bits,
/// and would have to redo the masks. The tokens themselves are the ones
/// [`generate`] gives.
pub fn generate_with_top(
    model: &Llama,
    adapters: &AdapterSet,
    requests: Vec<GenRequest>,
    top: usize,
) -> Result<Vec<Generation>> {
    let options = DecodeOptions {
        top,
        ..DecodeOptions::default()
    };
    Ok(generate_with(model, adapters, requests, options)?.0)
}

/// The decoder behind every `generate` function.
pub fn generate_with(
    model: &Llama,
    adapters: &AdapterSet,
    requests: Vec<GenRequest>,
    options: DecodeOptions,
) -> Result<(Vec<Generation>, DecodeStats)> {
    super::in_pool(|| decode_batch(model, adapters, requests, options))
}

/// [`generate_with`], on a thread of rayon's pool.
fn decode_batch(
    model: &Llama,
    adapters: &AdapterSet,
    requests: Vec<GenRequest>,
    options: DecodeOptions,
) -> Result<(Vec<Generation>, DecodeStats)> {
    let top = options.top;
    adapters.check(&model.config)?;
    let context = model.config.max_position_embeddings;
    for (row, r) in requests.iter().enumerate() {
        check_request(row, r, model)?;
    }
    let mut stats = DecodeStats::default();
    let count = requests.len();
    let mut rows: Vec<Row> = requests
        .into_iter()
        .enumerate()
        .map(|(i, request)| Row::new(i, request, top))
        .collect();
    // The grammars' first forced tokens, before the prefill.
    let started = Instant::now();
    rows.par_iter_mut().for_each(|r| r.start(context));
    stats.mask_ms += ms(started);
    stats.pick_ms += ms(started);
    // Group rows by adapter (stable: ties keep request order).
    rows.sort_by_key(|r| (r.request.adapter, r.index));
    let (mut active, mut finished): (Vec<Row>, Vec<Row>) = rows.into_iter().partition(|r| !r.done);
    let longest = active.iter().map(|r| r.feed.len()).max().unwrap_or(0);
    for r in &mut active {
        r.pad = longest - r.feed.len();
    }
    let device = model.device().clone();
    let mut cache = KvCache::new(model.config.num_layers);
    let hook_for = |active: &[Row]| {
        let ids: Vec<_> = active.iter().map(|r| r.request.adapter).collect();
        RowAdapters::new(adapters, &ids, &device)
    };
    let mut hook = hook_for(&active)?;
    let mut width = longest;
    let mut prefill = true;
    while !active.is_empty() {
        let started = Instant::now();
        let tokens = take_feed(&mut active, width);
        let pads: Vec<usize> = active.iter().map(|r| r.pad).collect();
        let logits = if prefill && options.share_prefixes {
            let ids: Vec<_> = active.iter().map(|r| r.request.adapter).collect();
            shared_prefill(model, adapters, &ids, &tokens, &pads, &mut cache)?
        } else {
            let tokens = Tensor::from_vec(tokens, (active.len(), width), &device)?;
            let at = Positions::left_padded(&pads, cache.len(), width, &device)?;
            let logits = model.forward(&tokens, &at, Some(&mut cache), &hook, Logits::Last)?;
            logits.i((.., 0))?.to_vec2::<f32>()?
        };
        prefill = false;
        stats.passes += 1;
        stats.model_ms += ms(started);

        let started = Instant::now();
        stats.mask_ms += pick_all(&mut active, logits, context);
        stats.pick_ms += ms(started);
        if active.iter().any(|r| r.done) {
            let keep: Vec<u32> = (0..active.len() as u32)
                .filter(|&i| !active[i as usize].done)
                .collect();
            let (live, done): (Vec<Row>, Vec<Row>) = active.into_iter().partition(|r| !r.done);
            finished.extend(done);
            active = live;
            if active.is_empty() {
                break;
            }
            cache.select_rows(&Tensor::new(keep.as_slice(), &device)?)?;
            hook = hook_for(&active)?;
        }
        // The longest run of decided tokens that every row has waiting.
        width = active.iter().map(|r| r.feed.len()).min().unwrap_or(1);
    }
    Ok((in_request_order(finished, count, &mut stats), stats))
}

/// The prefill of rows `ids` (their adapters) with tokens `tokens`
/// (`[rows, width]`, left-padded by `pads`), each distinct row run once:
/// rows with the same adapter, padding and tokens share one run, whose keys
/// and values then start each of their caches. (Padding is the pad id 0, so
/// equal token rows can still be different prompts: `[0, a]` and `[a]`.)
/// Returns each row's last logits.
fn shared_prefill(
    model: &Llama,
    adapters: &AdapterSet,
    ids: &[Option<AdapterId>],
    tokens: &[u32],
    pads: &[usize],
    cache: &mut KvCache,
) -> Result<Vec<Vec<f32>>> {
    let width = tokens.len() / ids.len().max(1);
    let row = |r: usize| &tokens[r * width..(r + 1) * width];
    // Each row's run: the first earlier row with the same adapter, padding and tokens.
    let mut runs: Vec<usize> = Vec::new();
    let mut run_of: Vec<u32> = Vec::with_capacity(ids.len());
    for r in 0..ids.len() {
        let same = runs
            .iter()
            .position(|&u| ids[u] == ids[r] && pads[u] == pads[r] && row(u) == row(r));
        run_of.push(same.unwrap_or_else(|| {
            runs.push(r);
            runs.len() - 1
        }) as u32);
    }
    let device = model.device();
    let run_tokens: Vec<u32> = runs.iter().flat_map(|&u| row(u).iter().copied()).collect();
    let run_pads: Vec<usize> = runs.iter().map(|&u| pads[u]).collect();
    let run_ids: Vec<_> = runs.iter().map(|&u| ids[u]).collect();
    let hook = RowAdapters::new(adapters, &run_ids, device)?;
    let at = Positions::left_padded(&run_pads, 0, width, device)?;
    let input = Tensor::from_vec(run_tokens, (runs.len(), width), device)?;
    let logits = model.forward(&input, &at, Some(&mut *cache), &hook, Logits::Last)?;
    let logits = logits.i((.., 0))?.to_vec2::<f32>()?;
    if runs.len() < ids.len() {
        cache.select_rows(&Tensor::new(run_of.as_slice(), device)?)?;
    }
    Ok(run_of.iter().map(|&u| logits[u as usize].clone()).collect())
}

/// The next pass's tokens, `width` from each row's feed; the prefill
/// (`width` = the longest feed) takes every row's whole feed, left-padded.
fn take_feed(active: &mut [Row], width: usize) -> Vec<u32> {
    let mut tokens = Vec::with_capacity(active.len() * width);
    for r in active {
        let take = r.feed.len().min(width);
        tokens.extend(std::iter::repeat_n(0, width - take));
        tokens.extend(r.feed.drain(..take));
    }
    tokens
}

/// Every row whose feed the pass used up picks its next token, rows in
/// parallel (each from its own stream, so the order of work does not
/// matter). Returns the mask work's share of the wall time: the rows' summed
/// mask time over the threads that could run them at once (no more threads
/// than picking rows).
fn pick_all(active: &mut [Row], logits: Vec<Vec<f32>>, context: usize) -> f64 {
    let picking = active.iter().filter(|r| r.feed.is_empty()).count();
    let mask_ms: f64 = active
        .par_iter_mut()
        .zip(logits)
        .filter(|(r, _)| r.feed.is_empty())
        .map(|(r, logits)| r.pick(logits, context))
        .sum();
    let threads = rayon::current_num_threads().min(picking).max(1);
    mask_ms / threads as f64
}

/// The finished rows' generations in request order, counted into `stats`.
fn in_request_order(finished: Vec<Row>, count: usize, stats: &mut DecodeStats) -> Vec<Generation> {
    let mut out: Vec<Option<Generation>> = (0..count).map(|_| None).collect();
    for r in finished {
        let forced = r.out.picks.iter().filter(|p| **p == Pick::Forced).count();
        stats.forced_tokens += forced;
        stats.sampled_tokens += r.out.picks.len() - forced;
        out[r.index] = Some(r.out);
    }
    out.into_iter()
        .map(|g| g.expect("every row finishes"))
        .collect()
}

fn check_request(row: usize, r: &GenRequest, model: &Llama) -> Result<()> {
    let context = model.config.max_position_embeddings;
    if r.prompt.is_empty() {
        return Err(Error::BadRow {
            row,
            reason: "empty prompt".into(),
        });
    }
    if r.prompt.len() >= context {
        return Err(crate::base::Error::TooLong {
            tokens: r.prompt.len(),
            context,
        }
        .into());
    }
    if let Some(&t) = r
        .prompt
        .iter()
        .find(|&&t| t as usize >= model.config.vocab_size)
    {
        return Err(Error::BadRow {
            row,
            reason: format!("token id {t} outside the vocabulary"),
        });
    }
    if let Some(g) = &r.grammar {
        if g.size() != model.config.vocab_size {
            return Err(Error::BadRow {
                row,
                reason: format!(
                    "the grammar was compiled for {} logits, the model has {}",
                    g.size(),
                    model.config.vocab_size
                ),
            });
        }
    }
    Ok(())
}

impl Row {
    fn new(index: usize, request: GenRequest, top: usize) -> Row {
        Row {
            index,
            feed: request.prompt.clone(),
            pad: 0,
            constraint: request.grammar.as_ref().map(|g| g.start()),
            mask: None,
            top,
            out: Generation {
                tokens: Vec::new(),
                logprobs: Vec::new(),
                picks: Vec::new(),
                top: Vec::new(),
                stop: StopReason::MaxTokens,
            },
            done: request.max_new_tokens == 0,
            request,
        }
    }

    /// The grammar's first forced tokens (they join the prompt in the
    /// prefill) and the first mask.
    fn start(&mut self, context: usize) {
        if !self.done {
            self.advance(context);
        }
    }

    /// Sample the next token from this pass's last logits (masked for a
    /// constrained row), then take what the grammar forces after it.
    /// Returns the milliseconds spent on the grammar.
    fn pick(&mut self, mut logits: Vec<f32>, context: usize) -> f64 {
        let pick = match self.mask.take() {
            Some(mask) => {
                mask.apply(&mut logits, f32::NEG_INFINITY);
                Pick::Masked(mask)
            }
            None => Pick::Free,
        };
        let sampling = self.request.sampling;
        let token = sample_token(&logits, sampling, &mut self.request.rng);
        let temperature = sampling.policy_temperature();
        if temperature != 1.0 {
            // As the train step scales them (`kernels::Policy`).
            let inv = (1.0 / temperature as f64) as f32;
            logits.iter_mut().for_each(|l| *l *= inv);
        }
        let logprob = kernels::log_softmax_at(&logits, token as usize);
        if self.top > 0 {
            self.out
                .top
                .push(kernels::top_log_softmax(&logits, self.top));
        }
        self.push(token, logprob, pick, context);
        if self.done {
            return 0.0;
        }
        self.feed.push(token);
        let started = Instant::now();
        if let Some(constraint) = &mut self.constraint {
            match constraint.commit(token) {
                Ok(()) => self.advance(context),
                Err(_) => self.end(StopReason::GrammarFailed),
            }
        }
        ms(started)
    }

    fn end(&mut self, reason: StopReason) {
        self.out.stop = reason;
        self.done = true;
        self.feed.clear();
    }

    /// Append the grammar's forced tokens and keep the mask that follows.
    fn advance(&mut self, context: usize) {
        let Some(constraint) = &mut self.constraint else {
            return;
        };
        let Ok(step) = constraint.advance() else {
            return self.end(StopReason::GrammarFailed);
        };
        for token in step.forced {
            if self.top > 0 {
                self.out.top.push(Vec::new());
            }
            self.push(token, 0.0, Pick::Forced, context);
            if self.done {
                return;
            }
            self.feed.push(token);
        }
        match step.next {
            Next::Sample(mask) => self.mask = Some(mask),
            Next::Finished => self.end(StopReason::StopToken),
        }
    }

    /// Record a token and whether the row ends with it.
    fn push(&mut self, token: u32, logprob: f32, pick: Pick, context: usize) {
        let r = &self.request;
        self.out.tokens.push(token);
        self.out.logprobs.push(logprob);
        self.out.picks.push(pick);
        let used = r.prompt.len() + self.out.tokens.len();
        let stop = if r.stop.contains(&token) {
            Some(StopReason::StopToken)
        } else if self.out.tokens.len() >= r.max_new_tokens {
            Some(StopReason::MaxTokens)
        } else if self.pad + used >= context {
            Some(StopReason::ContextFull)
        } else {
            None
        };
        if let Some(stop) = stop {
            self.out.stop = stop;
            self.done = true;
        }
    }
}

fn ms(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1e3
}

/// Pick a token: greedy (lowest index among ties) or sampled with temperature
/// and nucleus (top-p) from `rng`.
pub fn sample_token(logits: &[f32], sampling: Sampling, rng: &mut impl Rng) -> u32 {
    if sampling.temperature <= 0.0 {
        return argmax(logits);
    }
    let inv_t = 1.0 / sampling.temperature as f64;
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let weights: Vec<f64> = logits
        .iter()
        .map(|&l| ((l as f64 - max) * inv_t).exp())
        .collect();
    let total: f64 = weights.iter().sum();
    if !total.is_finite() || total <= 0.0 {
        return argmax(logits);
    }
    let mut candidates: Vec<usize> = (0..weights.len()).collect();
    let mut mass = total;
    if sampling.top_p < 1.0 {
        candidates.sort_by(|&a, &b| weights[b].total_cmp(&weights[a]).then(a.cmp(&b)));
        let target = sampling.top_p.max(0.0) as f64 * total;
        let mut cumulative = 0.0;
        let mut keep = 0;
        for &i in &candidates {
            cumulative += weights[i];
            keep += 1;
            if cumulative >= target {
                break;
            }
        }
        candidates.truncate(keep.max(1));
        mass = cumulative;
    }
    let mut u = rng.random::<f64>() * mass;
    for &i in &candidates {
        u -= weights[i];
        if u < 0.0 {
            return i as u32;
        }
    }
    // Rounding can leave `u` just above 0: take the last token that had weight.
    let last = candidates.iter().rev().find(|&&i| weights[i] > 0.0);
    *last.unwrap_or(&candidates[0]) as u32
}

fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}
