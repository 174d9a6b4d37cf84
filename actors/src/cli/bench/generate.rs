//! `populora bench generate`: decode speed of the base model at batch 1
//! (against candle-transformers' own models), over a curve of batch sizes,
//! and at batch 32 under a reply grammar; with `--weights native,f32`, for
//! both ways of keeping the weights, side by side in this one run.

use std::collections::BTreeMap;
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
    /// Token budget of each reply in the constrained batch-32 run (0: leave
    /// that run out).
    #[arg(long, default_value_t = 192)]
    pub grammar_tokens: usize,
    /// Interleaved repeats of every run (each setting, each peer, each batch
    /// size); the best of each is reported.
    #[arg(long, default_value_t = 2)]
    pub repeats: usize,
    /// Rows of the batch curve, each row its own prompt.
    #[arg(long, value_delimiter = ',', default_value = "1,4,8,16,32,64")]
    pub batch_curve: Vec<usize>,
    #[command(flatten)]
    pub model: BenchModel,
}

/// The new tokens of every warm-up run, ours and each peer's alike: first use
/// of every kernel and buffer is paid here, not in a measured run.
const WARM_UP_TOKENS: usize = 4;

pub fn run(args: Args) -> anyhow::Result<()> {
    let bases = args.model.load_each()?;
    let repeats = args.repeats.max(1);
    let (first_name, first) = (bases[0].0, &bases[0].1);
    let most_rows = args.batch_curve.iter().copied().max().unwrap_or(0).max(32);
    let prompts = bench_prompts(first, most_rows)?;
    let sides = batch1_sides(&bases, &prompts[0], args.tokens, repeats)?;
    let curve = batch_curve(&bases, &prompts, &args.batch_curve, args.tokens, repeats)?;
    let batch1 = sides.ours[0].tok_s;
    let batch32 = match curve[first_name].get(&32) {
        Some(&tok_s) => tok_s,
        None => decode(first, &prompts[..32], args.tokens, None, Sampling::GREEDY)?.0,
    };
    let mut constrained = serde_json::Map::new();
    for (name, base) in bases.iter().filter(|_| args.grammar_tokens > 0) {
        let value = constrained_batch32(base, &prompts[..32], args.grammar_tokens)?;
        constrained.insert(name.to_string(), value);
    }
    let (f32_peer, quantized) = (sides.f32_peer.measured(), sides.quantized.measured());
    let same_tokens = common_prefix(&sides.ours[0].tokens, &sides.f32_peer.tokens);
    let by_weights: serde_json::Map<_, _> = bases
        .iter()
        .zip(&sides.ours)
        .map(|((name, _), ours)| {
            let value = json!({
                "batch1_tok_s": ours.tok_s,
                "batch1_over_peer_llama_f32": f32_peer.map(|p| ours.tok_s / p),
                "batch1_over_peer_quantized": quantized.map(|p| ours.tok_s / p),
                "batch1_same_tokens_as_first": common_prefix(&ours.tokens, &sides.ours[0].tokens),
            });
            (name.to_string(), value)
        })
        .collect();
    let value = json!({
        "weights": bases.iter().map(|(name, _)| *name).collect::<Vec<_>>(),
        "batch1_tok_s": batch1,
        "batch32_tok_s": batch32,
        "batch32_over_batch1": batch32 / batch1,
        "by_weights": by_weights,
        "batch_curve": curve,
        "native_over_f32": native_over_f32(&curve),
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
        "repeats": repeats,
        "threads": candle_core::utils::get_num_threads(),
        "device": args.model.device,
        "random_weights": args.model.random_weights,
    });
    super::report(args.json, &value);
    Ok(())
}

/// Tokens/s by setting and batch size: `{"native": {"1": .., "4": ..}, ..}`.
type Curve = BTreeMap<&'static str, BTreeMap<usize, f64>>;

/// Every batch size of `sizes` for every setting, interleaved: one warm-up
/// each, then `repeats` rounds, the best of each kept.
fn batch_curve(
    bases: &[(&'static str, BaseModel)],
    prompts: &[Vec<u32>],
    sizes: &[usize],
    tokens: usize,
    repeats: usize,
) -> anyhow::Result<Curve> {
    let mut curve: Curve = bases
        .iter()
        .map(|(name, _)| (*name, BTreeMap::new()))
        .collect();
    for (round, tokens) in std::iter::once(WARM_UP_TOKENS)
        .chain(std::iter::repeat_n(tokens, repeats))
        .enumerate()
    {
        for &rows in sizes {
            for (name, base) in bases {
                let (tok_s, _, _) = decode(base, &prompts[..rows], tokens, None, Sampling::GREEDY)?;
                if round > 0 {
                    let best = curve
                        .get_mut(name)
                        .expect("every setting")
                        .entry(rows)
                        .or_default();
                    *best = best.max(tok_s);
                }
            }
        }
    }
    Ok(curve)
}

/// `native`'s tokens/s over `f32`'s at every batch size, when both ran.
fn native_over_f32(curve: &Curve) -> Option<BTreeMap<usize, f64>> {
    let (native, f32) = (curve.get("native")?, curve.get("f32")?);
    Some(
        native
            .iter()
            .filter_map(|(rows, n)| Some((*rows, n / f32.get(rows)?)))
            .collect(),
    )
}

/// Batch 1 on one prompt: ours under each setting, and each peer that can
/// run here.
struct Batch1 {
    ours: Vec<Best>,
    f32_peer: Best,
    quantized: Best,
}

/// Every side warmed up alike, then `repeats` interleaved runs, the best of
/// each kept: one sample swings by ±15 % on a shared machine. The peers
/// ([`Peers`], on the first setting's model) run on the CPU only, and only
/// in a build with them.
fn batch1_sides(
    bases: &[(&'static str, BaseModel)],
    prompt: &[u32],
    tokens: usize,
    repeats: usize,
) -> anyhow::Result<Batch1> {
    let mut peers = Peers::load(&bases[0].1)?;
    let prompts = [prompt.to_vec()];
    let mut sides = Batch1 {
        ours: bases.iter().map(|_| Best::default()).collect(),
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
        for ((_, base), ours) in bases.iter().zip(&mut sides.ours) {
            let (tok_s, _, out) = decode(base, &prompts, tokens, None, Sampling::GREEDY)?;
            let out = out.into_iter().next().map(|g| g.tokens).unwrap_or_default();
            keep(ours, (tok_s, out));
        }
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

/// `n` different short prompts (one per row of a batch).
fn bench_prompts(base: &BaseModel, n: usize) -> anyhow::Result<Vec<Vec<u32>>> {
    (0..n)
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
