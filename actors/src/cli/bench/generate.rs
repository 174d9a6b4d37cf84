//! `populora bench generate`: decode speed of the base model at batch 1 and
//! 32 (free and under a reply grammar), against candle-transformers' own
//! models at batch 1.

use std::sync::Arc;
use std::time::Instant;

use populora::base::{BaseModel, Message};
use populora::compute::{self, AdapterSet, DecodeStats, GenRequest, Sampling};
use populora::grammar::{Grammar, Vocabulary};
use populora::keyed_stream;
use populora::task::grammar::{reply_grammar, ReplyShape};
use populora::task::{Role, TaskKind};
use serde_json::json;

use super::model::BenchModel;
use super::peers::{self, Peers};

#[derive(clap::Args)]
pub struct Args {
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
    /// New tokens per row.
    #[arg(long, default_value_t = 64)]
    pub tokens: usize,
    /// Token budget of each reply in the constrained batch-32 run.
    #[arg(long, default_value_t = 192)]
    pub grammar_tokens: usize,
    /// Interleaved repeats of the batch-1 runs (ours and each peer); the best
    /// of each is reported.
    #[arg(long, default_value_t = 2)]
    pub repeats: usize,
    #[command(flatten)]
    pub model: BenchModel,
}

/// The new tokens of every warm-up run, ours and each peer's alike: first use
/// of every kernel and buffer is paid here, not in a measured run.
const WARM_UP_TOKENS: usize = 4;

pub fn run(args: Args) -> anyhow::Result<()> {
    let base = args.model.load()?;
    let prompts = bench_prompts(&base)?;
    let sides = batch1_sides(&base, &prompts[0], args.tokens, args.repeats.max(1))?;
    let (batch32, _, _) = decode(&base, &prompts, args.tokens, None, Sampling::GREEDY)?;
    let constrained = constrained_batch32(&base, &prompts, args.grammar_tokens)?;
    let batch1 = sides.ours.tok_s;
    let (f32_peer, quantized) = (sides.f32_peer.measured(), sides.quantized.measured());
    let same_tokens = common_prefix(&sides.ours.tokens, &sides.f32_peer.tokens);
    let value = json!({
        "batch1_tok_s": batch1,
        "batch32_tok_s": batch32,
        "batch32_over_batch1": batch32 / batch1,
        "peer_llama_f32_tok_s": f32_peer,
        "batch1_over_peer_llama_f32": f32_peer.map(|p| batch1 / p),
        "peer_llama_f32_same_tokens": f32_peer.map(|_| same_tokens),
        "peer_quantized_tok_s": quantized,
        "batch1_over_peer_quantized": quantized.map(|p| batch1 / p),
        "peers": if peers::BUILT {
            json!({
                "llama_f32": "candle-transformers llama on the same f32 weights, warmed up as ours",
                "quantized": "candle-transformers quantized_llama Q4_1, scalar fallback, warmed up as ours",
            })
        } else {
            json!("not built: rebuild with `cargo build --release --features peer`")
        },
        "constrained_batch32": constrained,
        "new_tokens_per_row": args.tokens,
        "repeats": args.repeats.max(1),
        "threads": candle_core::utils::get_num_threads(),
        "device": args.model.device,
        "random_weights": args.model.random_weights,
    });
    super::report(args.json, &value);
    Ok(())
}

/// Batch 1 on one prompt: ours and each peer that can run here.
struct Batch1 {
    ours: Best,
    f32_peer: Best,
    quantized: Best,
}

/// Every side warmed up alike, then `repeats` interleaved runs, the best of
/// each kept: one sample swings by ±15 % on a shared machine. The peers
/// ([`Peers`]) run on the CPU only, and only in a build with them.
fn batch1_sides(
    base: &BaseModel,
    prompt: &[u32],
    tokens: usize,
    repeats: usize,
) -> anyhow::Result<Batch1> {
    let mut peers = Peers::load(base)?;
    let prompts = [prompt.to_vec()];
    let mut sides = Batch1 {
        ours: Best::default(),
        f32_peer: Best::default(),
        quantized: Best::default(),
    };
    // The warm-up (`WARM_UP_TOKENS`) is run 0, and not kept.
    for (run, tokens) in std::iter::once(WARM_UP_TOKENS)
        .chain(std::iter::repeat_n(tokens, repeats))
        .enumerate()
    {
        let keep = |side: &mut Best, (tok_s, out): (f64, Vec<u32>)| {
            if run > 0 {
                side.add(tok_s, out);
            }
        };
        let (tok_s, _, out) = decode(base, &prompts, tokens, None, Sampling::GREEDY)?;
        let out = out.into_iter().next().map(|g| g.tokens).unwrap_or_default();
        keep(&mut sides.ours, (tok_s, out));
        if let Some(out) = peers.greedy_f32(prompt, tokens) {
            keep(&mut sides.f32_peer, out?);
        }
        if let Some(out) = peers.greedy_quantized(prompt, tokens) {
            keep(&mut sides.quantized, out?);
        }
    }
    Ok(sides)
}

/// The fastest of a side's runs, and the tokens it generated.
#[derive(Default)]
struct Best {
    tok_s: f64,
    tokens: Vec<u32>,
}

impl Best {
    fn add(&mut self, tok_s: f64, tokens: Vec<u32>) {
        if tok_s > self.tok_s {
            *self = Best { tok_s, tokens };
        }
    }

    /// The rate, if this side ran at all.
    fn measured(&self) -> Option<f64> {
        (self.tok_s > 0.0).then_some(self.tok_s)
    }
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// 32 different short prompts (one per row of the batch-32 run).
fn bench_prompts(base: &BaseModel) -> anyhow::Result<Vec<Vec<u32>>> {
    (0..32)
        .map(|i| {
            let text = format!(
                "Write a Python function number {i} that adds {i} to each element of a list."
            );
            Ok(base.tokenizer.encode_chat(&[Message::new("user", text)])?)
        })
        .collect()
}

/// Tokens/s of one batch of `prompts` (prefill included), where its time
/// went, and the generations.
fn decode(
    base: &BaseModel,
    prompts: &[Vec<u32>],
    tokens: usize,
    grammar: Option<&Arc<Grammar>>,
    sampling: Sampling,
) -> anyhow::Result<(f64, DecodeStats, Vec<compute::Generation>)> {
    let stop = match grammar {
        Some(_) => base.tokenizer.stop_ids.clone(),
        None => Vec::new(),
    };
    let requests = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| GenRequest {
            adapter: None,
            prompt: p.clone(),
            max_new_tokens: tokens,
            stop: stop.clone(),
            sampling,
            rng: keyed_stream!(0, "bench", i),
            grammar: grammar.cloned(),
        })
        .collect();
    let start = Instant::now();
    let (out, stats) = compute::generate_with_stats(&base.model, &AdapterSet::new(), requests)?;
    let generated: usize = out.iter().map(|g| g.tokens.len()).sum();
    Ok((generated as f64 / start.elapsed().as_secs_f64(), stats, out))
}

/// Batch 32 under the deduction proposer's reply grammar (the longest
/// self-play replies: code), sampled at temperature 1 as in self-play.
fn constrained_batch32(
    base: &BaseModel,
    prompts: &[Vec<u32>],
    tokens: usize,
) -> anyhow::Result<serde_json::Value> {
    let shape = ReplyShape {
        max_new_tokens: tokens,
        arity: None,
        inputs: 1,
    };
    let lark = reply_grammar(TaskKind::Deduction, Role::Proposer, &shape)
        .map_err(anyhow::Error::msg)?
        .lark;
    let vocabulary = Vocabulary::new(&base.tokenizer, base.config().vocab_size)?;
    let grammar = Arc::new(vocabulary.compile(&lark)?);
    let (tok_s, stats, _) = decode(base, prompts, tokens, Some(&grammar), Sampling::default())?;
    let wall = stats.model_ms + stats.pick_ms;
    Ok(json!({
        "tok_s": tok_s,
        "max_new_tokens": tokens,
        "mask_share": stats.mask_ms / wall,
        "mask_ms": stats.mask_ms,
        "decode_ms": wall,
        "passes": stats.passes,
        "sampled_tokens": stats.sampled_tokens,
        "forced_tokens": stats.forced_tokens,
    }))
}
