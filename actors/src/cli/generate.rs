//! `populora generate`: continue a prompt, with the base model or with
//! adapters (ours or PEFT's, several in one batch).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context;
use candle_core::Device;
use clap::Parser;
use populora::base::{self, BaseModel, Message, Tokenizer, WeightsSetting};
use populora::compute::{self, AdapterSet, GenRequest, Generation, Pick, Sampling, StopReason};
use populora::grammar::{Grammar, Vocabulary};
use populora::keyed_stream;
use populora::lora::AdapterDir;
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
    /// How the base keeps its weights, as the scenario key `[model] weights`:
    /// `native` (as the GGUF holds them) or `f32`.
    #[arg(long, default_value = "native", value_parser = parse_weights)]
    pub weights: WeightsSetting,
}

fn compile_grammar(base: &BaseModel, path: &Path) -> anyhow::Result<Grammar> {
    let lark = std::fs::read_to_string(path)
        .with_context(|| format!("reading the grammar {}", path.display()))?;
    let vocabulary = Vocabulary::new(&base.tokenizer, base.config().vocab_size)?;
    vocabulary
        .compile(&lark)
        .with_context(|| format!("in {}", path.display()))
}

pub fn load_model(path: Option<&Path>, weights: WeightsSetting) -> anyhow::Result<BaseModel> {
    let path = base::resolve_model(path, &mut |m| eprintln!("{m}"))?;
    BaseModel::load(&path, weights).with_context(|| format!("loading {}", path.display()))
}

/// `--weights`: `native` or `f32`.
pub fn parse_weights(name: &str) -> Result<WeightsSetting, String> {
    WeightsSetting::parse(name).ok_or_else(|| format!("{name:?} is not `native` or `f32`"))
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
    let base = load_model(args.model.as_deref(), args.weights)?;
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
