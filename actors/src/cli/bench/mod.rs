//! `populora bench ...`: throughput measurements, one module per benchmark.
//! Each prints a human summary, or one JSON object with `--json`. Benchmarks
//! measure; they never assert. Their figures are in BENCHMARKS.md.

mod broker;
mod evolve;
mod generate;
mod model;
mod peers;
mod verifier;

use clap::Subcommand;

#[derive(Subcommand)]
pub enum Bench {
    /// Decode tokens/s at batch 1 and 32, against candle-transformers' llama on the same f32 weights (and its quantized_llama).
    Generate(generate::Args),
    /// Multi-adapter decode (8 adapters x 4 rows) vs 1 adapter vs 8 sequential passes, and train-step speed.
    Broker(broker::Args),
    /// One offspring (crossover + mutation) at Qwen2.5-7B shape vs the dense ΔW paths (full and randomized SVD).
    Evolve(evolve::Args),
    /// Sandboxed program validations/s vs a fresh `python3` per program.
    Verifier(verifier::Args),
}

pub fn run(bench: Bench) -> anyhow::Result<()> {
    match bench {
        Bench::Generate(args) => generate::run(args),
        Bench::Broker(args) => broker::run(args),
        Bench::Evolve(args) => evolve::run(args),
        Bench::Verifier(args) => verifier::run(args),
    }
}

/// Print `value` as one JSON line, or pretty lines for a person.
fn report(json: bool, value: &serde_json::Value) {
    if json {
        println!("{value}");
    } else if let Some(map) = value.as_object() {
        for (k, v) in map {
            println!("{k:>24}: {v}");
        }
    }
}
