//! `populora bench ...`: throughput measurements. Each prints a human summary,
//! or one JSON object with `--json`. Benchmarks measure; they never assert.

use clap::Subcommand;

#[derive(Subcommand)]
pub enum Bench {
    /// Decode tokens/s at batch 1 and 32, and candle-transformers' quantized_llama at batch 1.
    Generate(super::generate::BenchArgs),
    /// Multi-adapter decode (8 adapters x 4 rows) vs 1 adapter vs 8 sequential passes, and train-step speed.
    Broker(super::broker::BenchArgs),
    /// One offspring (crossover + mutation) at Qwen2.5-7B shape vs the dense ΔW + SVD path.
    Evolve(super::evolve::BenchArgs),
    /// Sandboxed program validations/s vs a fresh `python3` per program.
    Verifier(super::exec::BenchArgs),
}

pub fn run(bench: Bench) -> anyhow::Result<()> {
    match bench {
        Bench::Generate(args) => super::generate::bench(args),
        Bench::Broker(args) => super::broker::bench(args),
        Bench::Evolve(args) => super::evolve::bench(args),
        Bench::Verifier(args) => super::exec::bench(args),
    }
}

/// Print `value` as one JSON line, or pretty lines for a person.
pub fn report(json: bool, value: &serde_json::Value) {
    if json {
        println!("{value}");
    } else if let Some(map) = value.as_object() {
        for (k, v) in map {
            println!("{k:>24}: {v}");
        }
    }
}
