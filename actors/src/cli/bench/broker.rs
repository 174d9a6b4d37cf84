//! `populora bench broker`: the multi-adapter engine's decode and train speed
//! on the real model, measured side by side in one run.

use std::time::Instant;

use candle_core::{Device, Tensor};
use populora::base::{BaseModel, Message};
use populora::compute::{self, AdapterSet, Cost, GenRequest, Sampling, TrainConfig, TrainRow};
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
    let base = args.model.load()?;
    let device = base.model.device().clone();
    // The GEMM reference is taken before and after the runs and the better one
    // kept: a single sample swings by ±15 % on a shared machine.
    let matmul_before = matmul_gflops(&device)?;
    let adapters = adapters(&base)?;
    let mut set = AdapterSet::new();
    for (i, a) in adapters.iter().enumerate() {
        set = set.with(i as u64, a);
    }
    let prompts = prompts(&base, ADAPTERS * ROWS_PER_ADAPTER)?;
    let multi_rows: Vec<(u64, Vec<u32>)> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| ((i / ROWS_PER_ADAPTER) as u64, p.clone()))
        .collect();
    let single_rows: Vec<(u64, Vec<u32>)> = prompts.iter().map(|p| (0, p.clone())).collect();
    // Warm up at full batch size so neither measured run pays first-use costs.
    decode(&base, &set, &multi_rows, 4)?;
    decode(&base, &set, &single_rows, 4)?;

    // Interleaved repeats, best of each: run-to-run noise on this machine is
    // larger than the effect being measured.
    let (mut single, mut multi, mut sequential) = (0f64, 0f64, 0f64);
    for _ in 0..args.repeats {
        let (n, t) = decode(&base, &set, &single_rows, args.tokens)?;
        single = single.max(n as f64 / t);
        let (n, t) = decode(&base, &set, &multi_rows, args.tokens)?;
        multi = multi.max(n as f64 / t);
        let (mut n_seq, mut t_seq) = (0, 0.0);
        for chunk in multi_rows.chunks(ROWS_PER_ADAPTER) {
            let (n, t) = decode(&base, &set, chunk, args.tokens)?;
            n_seq += n;
            t_seq += t;
        }
        sequential = sequential.max(n_seq as f64 / t_seq);
    }

    let train = if device.is_cpu() {
        Some(train_speed(&base, &set, &args)?)
    } else {
        // The train step's hand-written backward (compute::tape) runs on the
        // CPU only: nothing to measure on a GPU yet.
        None
    };
    let matmul = matmul_gflops(&device)?.max(matmul_before);
    let value = serde_json::json!({
        "multi_tok_s": multi,
        "single_tok_s": single,
        "sequential_tok_s": sequential,
        "multi_over_single": multi / single,
        "multi_over_sequential": multi / sequential,
        "train_tok_s": train.as_ref().map(|t| t.tok_s),
        "train_gflops": train.as_ref().map(|t| t.gflops),
        "matmul_gflops": matmul,
        "train_over_matmul": train.as_ref().map(|t| t.gflops / matmul),
        "train_micro_batches": train.as_ref().map(|t| t.micro_batches),
        "train_micro_batch_tokens": TrainConfig::default().micro_batch_tokens,
        "adapters": ADAPTERS,
        "rows": ADAPTERS * ROWS_PER_ADAPTER,
        "new_tokens_per_row": args.tokens,
        "repeats": args.repeats,
        "threads": candle_core::utils::get_num_threads(),
        "device": args.model.device,
        "random_weights": args.model.random_weights,
    });
    super::report(args.json, &value);
    Ok(())
}

struct TrainSpeed {
    tok_s: f64,
    gflops: f64,
    micro_batches: usize,
}

/// Train-step tokens/s and GFLOP/s of 8 adapters × 4 rows of `train_len` tokens.
fn train_speed(base: &BaseModel, set: &AdapterSet, args: &Args) -> anyhow::Result<TrainSpeed> {
    let len = args.train_len;
    let scored = len - len / 4;
    let mut rng = keyed_stream!(0, "bench-train");
    let rows: Vec<TrainRow> = (0..ADAPTERS * ROWS_PER_ADAPTER)
        .map(|i| TrainRow {
            adapter: (i / ROWS_PER_ADAPTER) as u64,
            tokens: (0..len)
                .map(|_| rng.random_range(0..base.config().vocab_size as u32))
                .collect(),
            prompt_len: 0,
            loss_mask: (0..len).map(|t| t >= len - scored).collect(),
            advantages: (0..len).map(|_| rng.random_range(-1.0f32..1.0)).collect(),
            old_logprobs: vec![-10.0; len],
            allowed: vec![None; len],
            temperature: 1.0,
        })
        .collect();
    // Best of `repeats`, as for decode and the GEMM reference: one sample
    // swings by ±20 % on a shared machine.
    let mut train_s = f64::MAX;
    let mut micro_batches = 0;
    for _ in 0..args.repeats.max(1) {
        let start = Instant::now();
        let out = compute::train_step(&base.model, set, &rows, TrainConfig::default())?;
        train_s = train_s.min(start.elapsed().as_secs_f64());
        micro_batches = out.micro_batches;
    }
    Ok(TrainSpeed {
        tok_s: (rows.len() * len) as f64 / train_s,
        gflops: train_flops(base, rows.len(), len, scored) / train_s / 1e9,
        micro_batches,
    })
}
