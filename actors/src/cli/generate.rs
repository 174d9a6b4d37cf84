//! `populora generate`: continue a prompt, with the base model or with
//! adapters (ours or PEFT's, several in one batch); `populora bench
//! generate`: decode speed.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use candle_core::Device;
use clap::Parser;
use populora::base::{self, BaseModel, Message, Tokenizer};
use populora::compute::{
    self, AdapterSet, DecodeStats, GenRequest, Generation, Pick, Sampling, StopReason,
};
use populora::grammar::{Grammar, Vocabulary};
use populora::keyed_stream;
use populora::lora::AdapterDir;
use populora::task::grammar::{reply_grammar, ReplyShape};
use populora::task::{Role, TaskKind};
use serde_json::{json, Value};

#[derive(Parser)]
pub struct Args {
    /// The prompt (a user turn in the chat format, unless --raw).
    pub prompt: String,
    /// Feed the prompt verbatim, without the chat template.
    #[arg(long)]
    pub raw: bool,
    /// A system turn before the prompt (chat format only), e.g. the one
    /// `eval` gives a benchmark.
    #[arg(long, value_name = "TEXT", conflicts_with = "raw")]
    pub system: Option<String>,
    /// Always pick the most likely token (the default when no temperature is given).
    #[arg(long, conflicts_with = "temperature")]
    pub greedy: bool,
    /// Sampling temperature (0 = greedy).
    #[arg(long)]
    pub temperature: Option<f32>,
    /// Nucleus sampling mass.
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Seed of the sampling stream: same seed, same output. Every adapter's
    /// row draws from the same stream.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    #[arg(long, default_value_t = 128)]
    pub max_new_tokens: usize,
    /// Decode under this Lark grammar (llguidance's dialect, as the reply
    /// grammars in src/task/grammar.rs): only text it allows is generated.
    #[arg(long, value_name = "FILE.lark")]
    pub grammar: Option<PathBuf>,
    /// Generate with this adapter: one of ours (a directory with
    /// adapter.json, e.g. runs/X/members/ID/adapter) or a PEFT LoRA (a
    /// directory with adapter_config.json). Repeat it to generate with
    /// several adapters in one batch; each output is labelled.
    #[arg(long, value_name = "DIR")]
    pub adapter: Vec<PathBuf>,
    /// Print JSON: per output its text, stop reason and every generated token
    /// (id, text, log-prob, how it was picked).
    #[arg(long)]
    pub json: bool,
    /// With --json: also the K most likely tokens and their log-probs at every
    /// picked token, from the distribution it was picked from.
    #[arg(long, value_name = "K", requires = "json", value_parser = clap::value_parser!(u16).range(1..))]
    pub logits_top: Option<u16>,
    /// A GGUF file or HF model directory (default: SmolLM2-135M-Instruct, fetched on first use).
    #[arg(long)]
    pub model: Option<PathBuf>,
}

fn compile_grammar(base: &BaseModel, path: &Path) -> anyhow::Result<Grammar> {
    let lark = std::fs::read_to_string(path)
        .with_context(|| format!("reading the grammar {}", path.display()))?;
    let vocabulary = Vocabulary::new(&base.tokenizer, base.config().vocab_size)?;
    vocabulary
        .compile(&lark)
        .with_context(|| format!("in {}", path.display()))
}

pub fn load_model(path: Option<&Path>) -> anyhow::Result<BaseModel> {
    let path = base::resolve_model(path, &mut |m| eprintln!("{m}"))?;
    BaseModel::load(&path).with_context(|| format!("loading {}", path.display()))
}

/// Every `--adapter`, checked against the base it will run on.
fn load_adapters(base: &BaseModel, dirs: &[PathBuf]) -> anyhow::Result<Vec<AdapterDir>> {
    dirs.iter()
        .map(|dir| {
            AdapterDir::load_for(dir, base.config(), &Device::Cpu)
                .with_context(|| format!("loading adapter {}", dir.display()))
        })
        .collect()
}

fn prompt_tokens(tok: &Tokenizer, args: &Args) -> anyhow::Result<Vec<u32>> {
    if args.raw {
        return Ok(tok.encode(&args.prompt)?);
    }
    let mut messages = Vec::new();
    if let Some(system) = &args.system {
        messages.push(Message::new("system", system.clone()));
    }
    messages.push(Message::new("user", args.prompt.clone()));
    Ok(tok.encode_chat(&messages)?)
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let base = load_model(args.model.as_deref())?;
    let adapters = load_adapters(&base, &args.adapter)?;
    let tok = &base.tokenizer;
    let prompt = prompt_tokens(tok, &args)?;
    let sampling = match args.temperature {
        Some(t) if !args.greedy => Sampling {
            temperature: t,
            top_p: args.top_p,
        },
        _ => Sampling::GREEDY,
    };
    let grammar = match &args.grammar {
        Some(path) => Some(Arc::new(compile_grammar(&base, path)?)),
        None => None,
    };
    let set = adapters
        .iter()
        .enumerate()
        .fold(AdapterSet::new(), |set, (i, a)| {
            set.with(i as u64, &a.adapter)
        });
    // One row per adapter (ids in flag order), or one base-model row.
    let rows: Vec<Option<u64>> = match adapters.len() {
        0 => vec![None],
        n => (0..n as u64).map(Some).collect(),
    };
    let requests = rows
        .iter()
        .map(|&adapter| GenRequest {
            adapter,
            prompt: prompt.clone(),
            max_new_tokens: args.max_new_tokens,
            stop: tok.stop_ids.clone(),
            sampling,
            rng: keyed_stream!(args.seed, "generate"),
            grammar: grammar.clone(),
        })
        .collect();
    let top = args.logits_top.map_or(0, usize::from);
    let outputs = compute::generate_with_top(&base.model, &set, requests, top)?;
    let labels: Vec<Option<String>> = rows
        .iter()
        .map(|row| row.map(|i| args.adapter[i as usize].display().to_string()))
        .collect();
    for (label, out) in labels.iter().zip(&outputs) {
        let whose = label.as_ref().map_or(String::new(), |l| format!("{l}: "));
        match out.stop {
            StopReason::MaxTokens if args.grammar.is_some() => eprintln!(
                "note: {whose}the reply reached --max-new-tokens = {} before the grammar was complete",
                args.max_new_tokens
            ),
            StopReason::GrammarFailed => eprintln!(
                "note: {whose}the grammar failed (an llguidance error); the reply ends where it was"
            ),
            _ => {}
        }
    }
    if args.json {
        let values = labels
            .iter()
            .zip(&outputs)
            .map(|(label, out)| output_json(tok, label.as_deref(), out))
            .collect::<anyhow::Result<Vec<_>>>()?;
        println!("{}", serde_json::to_string_pretty(&values)?);
    } else {
        print_texts(tok, &labels, &outputs)?;
    }
    Ok(())
}

/// The replies as text: one alone as it is, several each under its label.
fn print_texts(
    tok: &Tokenizer,
    labels: &[Option<String>],
    outputs: &[Generation],
) -> anyhow::Result<()> {
    for (label, out) in labels.iter().zip(outputs) {
        if outputs.len() > 1 {
            println!("=== {} ===", label.as_deref().unwrap_or("base model"));
        }
        println!("{}", tok.decode_reply(&out.tokens)?);
    }
    Ok(())
}

/// One output as JSON: its adapter, text and stop reason, and every token
/// with its log-prob (and its `top` alternatives when they were asked for).
fn output_json(tok: &Tokenizer, label: Option<&str>, out: &Generation) -> anyhow::Result<Value> {
    let entry = |token: u32, logprob: f32| -> anyhow::Result<Value> {
        Ok(json!({ "id": token, "text": tok.decode(&[token])?, "logprob": logprob }))
    };
    let mut tokens = Vec::with_capacity(out.tokens.len());
    for (i, (&token, &logprob)) in out.tokens.iter().zip(&out.logprobs).enumerate() {
        let mut value = entry(token, logprob)?;
        value["pick"] = json!(match out.picks[i] {
            Pick::Free => "free",
            Pick::Masked(_) => "masked",
            Pick::Forced => "forced",
        });
        if let Some(top) = out.top.get(i) {
            let top = top
                .iter()
                .map(|&(t, l)| entry(t, l))
                .collect::<anyhow::Result<Vec<_>>>()?;
            value["top"] = Value::Array(top);
        }
        tokens.push(value);
    }
    Ok(json!({
        "adapter": label,
        "text": tok.decode_reply(&out.tokens)?,
        "stop": match out.stop {
            StopReason::StopToken => "stop_token",
            StopReason::MaxTokens => "max_tokens",
            StopReason::ContextFull => "context_full",
            StopReason::GrammarFailed => "grammar_failed",
        },
        "tokens": tokens,
    }))
}

#[derive(Parser)]
pub struct BenchArgs {
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
    /// New tokens per row.
    #[arg(long, default_value_t = 64)]
    pub tokens: usize,
    /// Token budget of each reply in the constrained batch-32 run.
    #[arg(long, default_value_t = 192)]
    pub grammar_tokens: usize,
    #[command(flatten)]
    pub model: BenchModel,
}

/// Which model a benchmark runs, and where.
#[derive(clap::Args)]
pub struct BenchModel {
    /// A GGUF file or HF model directory (default: the default model, fetched on first use).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// `cpu`, `cuda` or `cuda:N` (`cuda` needs a build with `--features cuda`).
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Random weights in the default model's shape, built in memory: for speed
    /// only, on a machine that cannot fetch the model (replies are not text).
    #[arg(long, conflicts_with = "model")]
    pub random_weights: bool,
}

pub fn load_bench_model(m: &BenchModel) -> anyhow::Result<BaseModel> {
    let device = base::device::open(&m.device)?;
    let base = if m.random_weights {
        let (model, vocab) = base::tiny::build(&base::tiny::TinySpec::default_model_shape())?;
        BaseModel {
            model,
            tokenizer: vocab.tokenizer()?,
            source: base::Source::Random,
            path: PathBuf::from("random-weights"),
        }
    } else {
        load_model(m.model.as_deref())?
    };
    Ok(base.to_device(&device)?)
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

fn decode_tok_s(base: &BaseModel, prompts: &[Vec<u32>], tokens: usize) -> anyhow::Result<f64> {
    Ok(decode(base, prompts, tokens, None, Sampling::GREEDY)?.0)
}

/// Tokens/s of one batch of `prompts`, and where its time went.
fn decode(
    base: &BaseModel,
    prompts: &[Vec<u32>],
    tokens: usize,
    grammar: Option<&Arc<Grammar>>,
    sampling: Sampling,
) -> anyhow::Result<(f64, DecodeStats)> {
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
    Ok((generated as f64 / start.elapsed().as_secs_f64(), stats))
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
    let (tok_s, stats) = decode(base, prompts, tokens, Some(&grammar), Sampling::default())?;
    let wall = stats.model_ms + stats.pick_ms;
    Ok(serde_json::json!({
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

/// candle-transformers' quantized_llama on the same GGUF (quantized weights), batch 1, greedy.
fn peer_tok_s(path: &Path, prompt: &[u32], tokens: usize) -> anyhow::Result<f64> {
    use candle_core::quantized::gguf_file;
    use candle_core::{Device, Tensor};
    use candle_transformers::models::quantized_llama::ModelWeights;
    let mut file = std::fs::File::open(path)?;
    let content = gguf_file::Content::read(&mut file)?;
    let mut model = ModelWeights::from_gguf(content, &mut file, &Device::Cpu)?;
    let start = Instant::now();
    let input = Tensor::new(prompt, &Device::Cpu)?.unsqueeze(0)?;
    let mut logits = model.forward(&input, 0)?;
    for pos in prompt.len()..prompt.len() + tokens {
        let next = logits.squeeze(0)?.argmax(0)?.to_scalar::<u32>()?;
        logits = model.forward(&Tensor::new(&[next], &Device::Cpu)?.unsqueeze(0)?, pos)?;
    }
    Ok(tokens as f64 / start.elapsed().as_secs_f64())
}

pub fn bench(args: BenchArgs) -> anyhow::Result<()> {
    let base = load_bench_model(&args.model)?;
    let prompts = bench_prompts(&base)?;
    // Warm up allocations and caches once.
    decode_tok_s(&base, &prompts[..1], 4)?;
    let batch1 = decode_tok_s(&base, &prompts[..1], args.tokens)?;
    let batch32 = decode_tok_s(&base, &prompts, args.tokens)?;
    let constrained = constrained_batch32(&base, &prompts, args.grammar_tokens)?;
    let peer = if base.source == base::Source::Gguf && base.model.device().is_cpu() {
        Some(peer_tok_s(&base.path, &prompts[0], args.tokens)?)
    } else {
        None
    };
    let value = serde_json::json!({
        "batch1_tok_s": batch1,
        "batch32_tok_s": batch32,
        "peer_batch1_tok_s": peer,
        "batch32_over_batch1": batch32 / batch1,
        "constrained_batch32": constrained,
        "batch1_over_peer": peer.map(|p| batch1 / p),
        "new_tokens_per_row": args.tokens,
        "threads": candle_core::utils::get_num_threads(),
        "device": args.model.device,
        "random_weights": args.model.random_weights,
    });
    super::bench::report(args.json, &value);
    Ok(())
}
