//! `populora generate`: continue a prompt; `populora bench generate`: decode speed.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Context;
use clap::Parser;
use populora::base::{self, BaseModel, Message};
use populora::compute::{self, AdapterSet, GenRequest, Sampling};
use populora::keyed_stream;

#[derive(Parser)]
pub struct Args {
    /// The prompt (a user turn in the chat format, unless --raw).
    pub prompt: String,
    /// Feed the prompt verbatim, without the chat template.
    #[arg(long)]
    pub raw: bool,
    /// Always pick the most likely token (the default when no temperature is given).
    #[arg(long, conflicts_with = "temperature")]
    pub greedy: bool,
    /// Sampling temperature (0 = greedy).
    #[arg(long)]
    pub temperature: Option<f32>,
    /// Nucleus sampling mass.
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Seed of the sampling stream: same seed, same output.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    #[arg(long, default_value_t = 128)]
    pub max_new_tokens: usize,
    /// A GGUF file or HF model directory (default: SmolLM2-135M-Instruct, fetched on first use).
    #[arg(long)]
    pub model: Option<PathBuf>,
}

pub fn load_model(path: Option<&Path>) -> anyhow::Result<BaseModel> {
    let path = base::resolve_model(path, &mut |m| eprintln!("{m}"))?;
    BaseModel::load(&path).with_context(|| format!("loading {}", path.display()))
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let base = load_model(args.model.as_deref())?;
    let tok = &base.tokenizer;
    let prompt = if args.raw {
        tok.encode(&args.prompt)?
    } else {
        tok.encode_chat(&[Message::new("user", args.prompt.clone())])?
    };
    let sampling = match args.temperature {
        Some(t) if !args.greedy => Sampling {
            temperature: t,
            top_p: args.top_p,
        },
        _ => Sampling::GREEDY,
    };
    let request = GenRequest {
        adapter: None,
        prompt,
        max_new_tokens: args.max_new_tokens,
        stop: tok.stop_ids.clone(),
        sampling,
        rng: keyed_stream!(args.seed, "generate"),
    };
    let out = compute::generate(&base.model, &AdapterSet::new(), vec![request])?;
    let mut tokens = out[0].tokens.clone();
    if tokens.last().is_some_and(|t| tok.stop_ids.contains(t)) {
        tokens.pop();
    }
    println!("{}", tok.decode(&tokens)?);
    Ok(())
}

#[derive(Parser)]
pub struct BenchArgs {
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
    /// New tokens per row.
    #[arg(long, default_value_t = 64)]
    pub tokens: usize,
    #[arg(long)]
    pub model: Option<PathBuf>,
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
    let requests = prompts
        .iter()
        .map(|p| GenRequest {
            adapter: None,
            prompt: p.clone(),
            max_new_tokens: tokens,
            stop: Vec::new(),
            sampling: Sampling::GREEDY,
            rng: keyed_stream!(0, "bench"),
        })
        .collect();
    let start = Instant::now();
    let out = compute::generate(&base.model, &AdapterSet::new(), requests)?;
    let generated: usize = out.iter().map(|g| g.tokens.len()).sum();
    Ok(generated as f64 / start.elapsed().as_secs_f64())
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
    let base = load_model(args.model.as_deref())?;
    let prompts = bench_prompts(&base)?;
    // Warm up allocations and caches once.
    decode_tok_s(&base, &prompts[..1], 4)?;
    let batch1 = decode_tok_s(&base, &prompts[..1], args.tokens)?;
    let batch32 = decode_tok_s(&base, &prompts, args.tokens)?;
    let peer = if base.source == base::Source::Gguf {
        Some(peer_tok_s(&base.path, &prompts[0], args.tokens)?)
    } else {
        None
    };
    let value = serde_json::json!({
        "batch1_tok_s": batch1,
        "batch32_tok_s": batch32,
        "peer_batch1_tok_s": peer,
        "batch32_over_batch1": batch32 / batch1,
        "batch1_over_peer": peer.map(|p| batch1 / p),
        "new_tokens_per_row": args.tokens,
        "threads": candle_core::utils::get_num_threads(),
    });
    super::bench::report(args.json, &value);
    Ok(())
}
