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

use candle_core::{IndexOp, Tensor};
use rand::Rng;
use rand_chacha::ChaCha12Rng;
use rayon::prelude::*;

use super::row_adapters::{AdapterId, AdapterSet, RowAdapters};
use super::{Error, Result};
use crate::base::{kernels, KvCache, Llama, Logits, Positions};

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
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    StopToken,
    MaxTokens,
    ContextFull,
}

#[derive(Debug, Clone)]
pub struct Generation {
    pub tokens: Vec<u32>,
    /// log π(token) under the adapter at temperature 1, one per token.
    pub logprobs: Vec<f32>,
    pub stop: StopReason,
}

/// A row still decoding.
struct Active {
    request: usize,
    pad: usize,
}

/// Generate for every request in one batch; results in request order.
pub fn generate(
    model: &Llama,
    adapters: &AdapterSet,
    requests: Vec<GenRequest>,
) -> Result<Vec<Generation>> {
    adapters.check(&model.config)?;
    let context = model.config.max_position_embeddings;
    for (row, r) in requests.iter().enumerate() {
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
    }
    let mut requests = requests;
    let mut out: Vec<Generation> = requests
        .iter()
        .map(|_| Generation {
            tokens: Vec::new(),
            logprobs: Vec::new(),
            stop: StopReason::MaxTokens,
        })
        .collect();
    // Group rows by adapter (stable: ties keep request order).
    let mut order: Vec<usize> = (0..requests.len()).collect();
    order.sort_by_key(|&i| requests[i].adapter);
    let longest = requests.iter().map(|r| r.prompt.len()).max().unwrap_or(0);
    let mut active: Vec<Active> = order
        .iter()
        .map(|&i| Active {
            request: i,
            pad: longest - requests[i].prompt.len(),
        })
        .filter(|a| requests[a.request].max_new_tokens > 0)
        .collect();
    if active.is_empty() {
        return Ok(out);
    }
    let device = model.device().clone();
    let mut cache = KvCache::new(model.config.num_layers);
    let mut step_tokens: Vec<u32> = Vec::with_capacity(active.len() * longest);
    for a in &active {
        step_tokens.extend(std::iter::repeat_n(0, a.pad));
        step_tokens.extend(&requests[a.request].prompt);
    }
    let mut width = longest;
    let hook_for = |active: &[Active], requests: &[GenRequest]| {
        let rows: Vec<_> = active.iter().map(|a| requests[a.request].adapter).collect();
        RowAdapters::new(adapters, &rows).map(|hook| hook.detached())
    };
    let mut hook = hook_for(&active, &requests)?;
    loop {
        let rows = active.len();
        let tokens = Tensor::from_vec(step_tokens, (rows, width), &device)?;
        let pads: Vec<usize> = active.iter().map(|a| a.pad).collect();
        let at = Positions::left_padded(&pads, cache.len(), width, &device)?;
        let logits = model.forward(&tokens, &at, Some(&mut cache), &hook, Logits::Last)?;
        let logits = logits.i((.., 0))?.to_vec2::<f32>()?;
        let picked = pick_tokens(&active, &mut requests, &logits)?;

        let mut keep = Vec::with_capacity(rows);
        let mut next = Vec::with_capacity(rows);
        for (slot, (a, (token, logprob))) in active.iter().zip(picked).enumerate() {
            let req = &requests[a.request];
            let gen = &mut out[a.request];
            gen.tokens.push(token);
            gen.logprobs.push(logprob);
            let used = req.prompt.len() + gen.tokens.len();
            gen.stop = if req.stop.contains(&token) {
                StopReason::StopToken
            } else if gen.tokens.len() >= req.max_new_tokens {
                StopReason::MaxTokens
            } else if a.pad + used >= context {
                StopReason::ContextFull
            } else {
                keep.push(slot as u32);
                next.push(token);
                continue;
            };
        }
        if keep.is_empty() {
            return Ok(out);
        }
        if keep.len() < rows {
            cache.select_rows(&Tensor::new(keep.as_slice(), &device)?)?;
            let mut slot = 0u32;
            active.retain(|_| {
                let kept = keep.contains(&slot);
                slot += 1;
                kept
            });
            hook = hook_for(&active, &requests)?;
        }
        step_tokens = next;
        width = 1;
    }
}

/// Each active row's next token and its log-probability, rows in parallel
/// (each samples from its own stream, so the order of work does not matter).
fn pick_tokens(
    active: &[Active],
    requests: &mut [GenRequest],
    logits: &[Vec<f32>],
) -> Result<Vec<(u32, f32)>> {
    let mut by_request: Vec<Option<&mut GenRequest>> = requests.iter_mut().map(Some).collect();
    let rows: Option<Vec<&mut GenRequest>> = active
        .iter()
        .map(|a| by_request.get_mut(a.request)?.take())
        .collect();
    let rows = rows
        .filter(|rows| rows.len() == logits.len())
        .ok_or(Error::BadRow {
            row: 0,
            reason: "decoding rows do not match their requests one to one".into(),
        })?;
    Ok(rows
        .into_par_iter()
        .zip(logits)
        .map(|(req, row_logits)| {
            let token = sample_token(row_logits, req.sampling, &mut req.rng);
            (token, kernels::log_softmax_at(row_logits, token as usize))
        })
        .collect())
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
    *candidates.last().unwrap_or(&0) as u32
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
