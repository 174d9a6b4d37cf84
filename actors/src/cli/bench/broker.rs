//! `populora bench broker`: the multi-adapter engine's decode and train speed
//! on the real model, measured side by side in one run.

use std::time::Instant;

use candle_core::{Device, Tensor};
use populora::base::{BaseModel, Message};
use populora::compute::{
    self, AdapterSet, Cost, DecodeOptions, GenRequest, Sampling, TrainConfig, TrainRow,
};
use populora::keyed_stream;
use populora::lora::{Adapter, LoraConfig};
use rand::Rng;

use super::model::BenchModel;

#[derive(clap::Args)]
pub struct Args {
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
    /// New tokens per row in the decode runs.
    #[arg(long, default_value_t = 32)]
    pub tokens: usize,
    /// Sequence length of the train run.
    #[arg(long, default_value_t = 256)]
    pub train_len: usize,
    /// Interleaved repeats of the three decode runs, then repeats of the train
    /// step (the best of each is reported).
    #[arg(long, default_value_t = 2)]
    pub repeats: usize,
    /// Leave out the grouped case (rollouts sharing prompts, with prompt
    /// sharing on and off: several minutes on 2 cores).
    #[arg(long)]
    pub skip_grouped: bool,
    #[command(flatten)]
    pub model: BenchModel,
}

const ADAPTERS: usize = 8;
const ROWS_PER_ADAPTER: usize = 4;

/// Rank-8 adapters on every projection, with non-zero B so they change the output.
fn adapters(base: &BaseModel) -> anyhow::Result<Vec<Adapter>> {
    (0..ADAPTERS as u64)
        .map(|i| {
            let mut rng = keyed_stream!(i, "bench-adapter");
            let adapter =
                Adapter::new(LoraConfig::default(), base.config(), &mut rng, &Device::Cpu)?;
            for m in adapter.modules.values() {
                let n = m.b.elem_count();
                let values: Vec<f32> = (0..n).map(|_| rng.random_range(-1e-3f32..1e-3)).collect();
                m.b.set(&Tensor::from_vec(values, m.b.dims(), &Device::Cpu)?)?;
            }
            Ok(adapter)
        })
        .collect()
}

fn prompts(base: &BaseModel, n: usize) -> anyhow::Result<Vec<Vec<u32>>> {
    (0..n)
        .map(|i| {
            let text =
                format!("Write a Python function number {i} that counts the vowels in a string.");
            Ok(base.tokenizer.encode_chat(&[Message::new("user", text)])?)
        })
        .collect()
}

/// Decode tokens/s for `rows` = (adapter, prompt) in one batch.
fn decode(
    base: &BaseModel,
    set: &AdapterSet,
    rows: &[(u64, Vec<u32>)],
    tokens: usize,
) -> anyhow::Result<(usize, f64)> {
    let requests = rows
        .iter()
        .map(|(a, p)| GenRequest {
            adapter: Some(*a),
            prompt: p.clone(),
            max_new_tokens: tokens,
            stop: vec![],
            sampling: Sampling::GREEDY,
            rng: keyed_stream!(0, "bench"),
            grammar: None,
        })
        .collect();
    let start = Instant::now();
    let out = compute::generate(&base.model, set, requests)?;
    Ok((
        out.iter().map(|g| g.tokens.len()).sum(),
        start.elapsed().as_secs_f64(),
    ))
}

/// f32 GEMM rate of `device` through candle, GFLOP/s (best of 5): a
/// train-step-sized product on the CPU, a 4096³ one on a GPU (smaller ones
/// there measure launch latency, not the GEMM).
fn matmul_gflops(device: &Device) -> anyhow::Result<f64> {
    let (m, k, n) = if device.is_cpu() {
        (2048, 576, 1536)
    } else {
        (4096, 4096, 4096)
    };
    let a = Tensor::randn(0f32, 1.0, (m, k), device)?;
    let b = Tensor::randn(0f32, 1.0, (k, n), device)?;
    a.matmul(&b)?.sum_all()?.to_scalar::<f32>()?;
    let mut best = f64::MAX;
    for _ in 0..5 {
        let start = Instant::now();
        let c = a.matmul(&b)?;
        c.sum_all()?.to_scalar::<f32>()?;
        best = best.min(start.elapsed().as_secs_f64());
    }
    Ok(2.0 * (m * k * n) as f64 / best / 1e9)
}

/// FLOPs of one train step, as a run counts them ([`Cost::training`]).
fn train_flops(base: &BaseModel, rows: usize, len: usize, scored: usize) -> f64 {
    rows as f64 * Cost::training(base.config(), len, scored).flops
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let bases = args.model.load_each()?;
    let first = &bases[0].1;
    let device = first.model.device().clone();
    // The GEMM reference is taken before and after the runs and the better one
    // kept: a single sample swings by ±15 % on a shared machine.
    let matmul_before = matmul_gflops(&device)?;
    let adapters = adapters(first)?;
    let mut set = AdapterSet::new();
    for (i, a) in adapters.iter().enumerate() {
        set = set.with(i as u64, a);
    }
    let prompts = prompts(first, ADAPTERS * ROWS_PER_ADAPTER)?;
    let multi_rows: Vec<(u64, Vec<u32>)> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| ((i / ROWS_PER_ADAPTER) as u64, p.clone()))
        .collect();
    let single_rows: Vec<(u64, Vec<u32>)> = prompts.iter().map(|p| (0, p.clone())).collect();
    // Warm up at full batch size so neither measured run pays first-use costs.
    for (_, base) in &bases {
        decode(base, &set, &multi_rows, 4)?;
        decode(base, &set, &single_rows, 4)?;
    }

    // Interleaved repeats (every setting in each), best of each: run-to-run
    // noise on this machine is larger than the effect being measured.
    let mut speeds = vec![DecodeSpeed::default(); bases.len()];
    for _ in 0..args.repeats {
        for ((_, base), speed) in bases.iter().zip(&mut speeds) {
            let (n, t) = decode(base, &set, &single_rows, args.tokens)?;
            speed.single = speed.single.max(n as f64 / t);
            let (n, t) = decode(base, &set, &multi_rows, args.tokens)?;
            speed.multi = speed.multi.max(n as f64 / t);
            let (mut n_seq, mut t_seq) = (0, 0.0);
            for chunk in multi_rows.chunks(ROWS_PER_ADAPTER) {
                let (n, t) = decode(base, &set, chunk, args.tokens)?;
                n_seq += n;
                t_seq += t;
            }
            speed.sequential = speed.sequential.max(n_seq as f64 / t_seq);
        }
    }

    let trains = train_speed(&bases, &set, &args)?;
    let mut grouped = Vec::new();
    for (_, base) in &bases {
        grouped.push(if args.skip_grouped {
            None
        } else {
            Some(grouped_speed(base, &set)?)
        });
    }
    let matmul = matmul_gflops(&device)?.max(matmul_before);
    let mut by_weights = serde_json::Map::new();
    for (i, (name, base)) in bases.iter().enumerate() {
        let side = setting_report(base, &speeds[i], &trains[i], grouped[i].take(), matmul);
        by_weights.insert(name.to_string(), side);
    }
    let mut value = by_weights[bases[0].0].clone();
    value["weights"] = bases
        .iter()
        .map(|(name, _)| *name)
        .collect::<Vec<_>>()
        .into();
    if let (Some(native), Some(f32)) = (by_weights.get("native"), by_weights.get("f32")) {
        let ratio =
            |key: &str| native[key].as_f64().unwrap_or(0.0) / f32[key].as_f64().unwrap_or(f64::NAN);
        value["native_over_f32"] = serde_json::json!({
            "multi_tok_s": ratio("multi_tok_s"),
            "single_tok_s": ratio("single_tok_s"),
            "sequential_tok_s": ratio("sequential_tok_s"),
            "train_tok_s": ratio("train_tok_s"),
        });
    }
    value["by_weights"] = by_weights.into();
    value["matmul_gflops"] = matmul.into();
    value["repeats"] = args.repeats.into();
    value["new_tokens_per_row"] = args.tokens.into();
    value["threads"] = candle_core::utils::get_num_threads().into();
    value["device"] = args.model.device.clone().into();
    value["random_weights"] = args.model.random_weights.into();
    super::report(args.json, &value);
    Ok(())
}

/// Decode tokens/s: 8 adapters' rows in one batch (`multi`), the same rows
/// on one adapter (`single`), and 8 batches of one adapter's rows
/// (`sequential`).
#[derive(Debug, Clone, Copy, Default)]
struct DecodeSpeed {
    multi: f64,
    single: f64,
    sequential: f64,
}

/// One setting's figures.
fn setting_report(
    base: &BaseModel,
    decode: &DecodeSpeed,
    train: &TrainSpeed,
    grouped: Option<serde_json::Value>,
    matmul: f64,
) -> serde_json::Value {
    serde_json::json!({
        "multi_tok_s": decode.multi,
        "single_tok_s": decode.single,
        "sequential_tok_s": decode.sequential,
        "multi_over_single": decode.multi / decode.single,
        "multi_over_sequential": decode.multi / decode.sequential,
        "train_tok_s": train.multi,
        "train_single_tok_s": train.single,
        "train_sequential_tok_s": train.sequential,
        "train_multi_over_single": train.multi / train.single,
        "train_multi_over_sequential": train.multi / train.sequential,
        "train_gflops": train.gflops,
        "train_over_matmul": train.gflops / matmul,
        "train_micro_batches": train.micro_batches,
        "train_micro_batch_tokens": TrainConfig::default().micro_batch_tokens,
        "grouped": grouped,
        "adapters": ADAPTERS,
        "rows": ADAPTERS * ROWS_PER_ADAPTER,
        "resident_weight_bytes": base.model.resident_bytes(),
        "shape": {
            "hidden": base.config().hidden_size,
            "layers": base.config().num_layers,
            "ffn": base.config().intermediate_size,
            "vocab": base.config().vocab_size,
        },
    })
}

/// Train-step tokens/s of 8 adapters × 4 rows of `train_len` tokens in one
/// step (`multi`, with its GFLOP/s), of the same rows all on one adapter
/// (`single`), and of 8 steps of one adapter's 4 rows each (`sequential`).
struct TrainSpeed {
    multi: f64,
    single: f64,
    sequential: f64,
    gflops: f64,
    micro_batches: usize,
}

/// [`TrainSpeed`] of each setting's base, their steps interleaved.
fn train_speed(
    bases: &[(&'static str, BaseModel)],
    set: &AdapterSet,
    args: &Args,
) -> anyhow::Result<Vec<TrainSpeed>> {
    let config = bases[0].1.config();
    let len = args.train_len;
    let scored = len - len / 4;
    let mut rng = keyed_stream!(0, "bench-train");
    let rows: Vec<TrainRow> = (0..ADAPTERS * ROWS_PER_ADAPTER)
        .map(|i| TrainRow {
            adapter: (i / ROWS_PER_ADAPTER) as u64,
            tokens: (0..len)
                .map(|_| rng.random_range(0..config.vocab_size as u32))
                .collect(),
            prompt_len: 0,
            loss_mask: (0..len).map(|t| t >= len - scored).collect(),
            advantages: (0..len).map(|_| rng.random_range(-1.0f32..1.0)).collect(),
            old_logprobs: vec![-10.0; len],
            allowed: vec![None; len],
            temperature: 1.0,
        })
        .collect();
    let single_rows: Vec<TrainRow> = rows
        .iter()
        .map(|r| TrainRow {
            adapter: 0,
            ..r.clone()
        })
        .collect();
    let step = |base: &BaseModel, rows: &[TrainRow]| -> anyhow::Result<(f64, usize)> {
        let start = Instant::now();
        let out = compute::train_step(&base.model, set, rows, TrainConfig::default())?;
        Ok((start.elapsed().as_secs_f64(), out.micro_batches))
    };
    // Interleaved, best of `repeats`, as for decode and the GEMM reference:
    // one sample swings by ±20 % on a shared machine.
    let mut best = vec![(f64::MAX, f64::MAX, f64::MAX, 0); bases.len()];
    for _ in 0..args.repeats.max(1) {
        for ((_, base), (multi_s, single_s, sequential_s, micro_batches)) in
            bases.iter().zip(&mut best)
        {
            let (s, batches) = step(base, &rows)?;
            (*multi_s, *micro_batches) = (multi_s.min(s), batches);
            *single_s = single_s.min(step(base, &single_rows)?.0);
            let mut sum = 0.0;
            for chunk in rows.chunks(ROWS_PER_ADAPTER) {
                sum += step(base, chunk)?.0;
            }
            *sequential_s = sequential_s.min(sum);
        }
    }
    let tokens = (rows.len() * len) as f64;
    Ok(bases
        .iter()
        .zip(best)
        .map(
            |((_, base), (multi_s, single_s, sequential_s, micro_batches))| TrainSpeed {
                multi: tokens / multi_s,
                single: tokens / single_s,
                sequential: tokens / sequential_s,
                gflops: train_flops(base, rows.len(), len, scored) / multi_s / 1e9,
                micro_batches,
            },
        )
        .collect())
}

/// The grouped case: 8 adapters × 4 prompts of [`GROUPED_PROMPT`] tokens,
/// [`GROUPED_ANSWERS`] sampled answers of [`GROUPED_ANSWER`] tokens per
/// prompt (a self-play step's solver rollouts), decoded and trained with
/// prompt sharing on and off; tokens/s count every rollout's prompt and
/// answer, as a run's per-rollout token counts do.
const GROUPED_PROMPT: usize = 128;
const GROUPED_ANSWERS: usize = 8;
const GROUPED_ANSWER: usize = 32;

fn grouped_speed(base: &BaseModel, set: &AdapterSet) -> anyhow::Result<serde_json::Value> {
    let vocab = base.config().vocab_size as u32;
    let mut rng = keyed_stream!(0, "bench-grouped");
    let prompts: Vec<(u64, Vec<u32>)> = (0..ADAPTERS * ROWS_PER_ADAPTER)
        .map(|i| {
            let prompt = (0..GROUPED_PROMPT)
                .map(|_| rng.random_range(0..vocab))
                .collect();
            ((i / ROWS_PER_ADAPTER) as u64, prompt)
        })
        .collect();
    let requests: Vec<GenRequest> = prompts
        .iter()
        .enumerate()
        .flat_map(|(i, (adapter, prompt))| {
            (0..GROUPED_ANSWERS).map(move |j| GenRequest {
                adapter: Some(*adapter),
                prompt: prompt.clone(),
                max_new_tokens: GROUPED_ANSWER,
                stop: vec![],
                sampling: Sampling::default(),
                rng: keyed_stream!(i as u64, "bench-grouped-row", j as u64),
                grammar: None,
            })
        })
        .collect();
    let rollout_tokens = (requests.len() * (GROUPED_PROMPT + GROUPED_ANSWER)) as f64;
    let mut value = serde_json::json!({
        "adapters": ADAPTERS,
        "prompts_per_adapter": ROWS_PER_ADAPTER,
        "prompt_tokens": GROUPED_PROMPT,
        "answers_per_prompt": GROUPED_ANSWERS,
        "answer_tokens": GROUPED_ANSWER,
    });
    let mut rows = Vec::new();
    for share_prefixes in [true, false] {
        let options = DecodeOptions {
            share_prefixes,
            ..DecodeOptions::default()
        };
        let start = Instant::now();
        let (out, _) = compute::generate_with(&base.model, set, requests.clone(), options)?;
        let decode_s = start.elapsed().as_secs_f64();
        if rows.is_empty() {
            rows = grouped_train_rows(&requests, &out, &mut rng);
        }
        let config = TrainConfig {
            share_prefixes,
            ..TrainConfig::default()
        };
        let start = Instant::now();
        let trained = compute::train_step(&base.model, set, &rows, config)?;
        let train_s = start.elapsed().as_secs_f64();
        let side = if share_prefixes { "shared" } else { "plain" };
        value[side] = serde_json::json!({
            "decode_tok_s": rollout_tokens / decode_s,
            "train_tok_s": rollout_tokens / train_s,
            "train_tokens_run": trained.tokens_run,
        });
    }
    for what in ["decode_tok_s", "train_tok_s"] {
        let ratio = value["shared"][what].as_f64().unwrap_or(0.0)
            / value["plain"][what].as_f64().unwrap_or(f64::NAN);
        value[format!("{what}_shared_over_plain")] = ratio.into();
    }
    Ok(value)
}

/// One train row per generated answer: its prompt, then its answer in the
/// loss with a random non-zero advantage (nothing is skipped: the case
/// measures sharing alone).
fn grouped_train_rows(
    requests: &[GenRequest],
    generations: &[compute::Generation],
    rng: &mut impl Rng,
) -> Vec<TrainRow> {
    requests
        .iter()
        .zip(generations)
        .map(|(r, g)| {
            let (p, n) = (r.prompt.len(), r.prompt.len() + g.tokens.len());
            let advantage = rng.random_range(0.1f32..1.0) * if rng.random() { 1.0 } else { -1.0 };
            TrainRow {
                adapter: r.adapter.unwrap_or_default(),
                tokens: [r.prompt.as_slice(), &g.tokens].concat(),
                prompt_len: p,
                loss_mask: (0..n).map(|t| t >= p).collect(),
                advantages: vec![advantage; n],
                old_logprobs: std::iter::repeat_n(0.0, p)
                    .chain(g.logprobs.iter().copied())
                    .collect(),
                allowed: vec![None; n],
                temperature: 1.0,
            }
        })
        .collect()
}
