//! `populora`: the command-line edge. Every subcommand lives in its own file
//! under `cli/`; this file only parses and dispatches.

mod cli;
mod experiment;
mod runtime;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "populora",
    version,
    about = "Population-based self-play RL of LLMs with LoRA adapters"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run a scenario: a population (or the solo baseline) self-play run.
    Run(cli::run::Args),
    /// Start a worker node that hosts members of a run on several machines.
    Node(cli::node::Args),
    /// Control a live run: status, kill, inject, pause, resume, stop.
    Ctl(cli::ctl::Args),
    /// Re-execute a finished run and verify every checksum bit for bit.
    Replay(cli::replay::Args),
    /// Continue a crashed or stopped run from its newest checkpoint that loads.
    Resume(cli::resume::Args),
    /// Write the run report: plots (SVG, PNG) and index.html.
    Report(cli::report::Args),
    /// Evaluate every member of a run on held-out benchmarks.
    Eval(cli::eval::Args),
    /// A population against a compute-matched single-adapter baseline: run, evaluate, compare.
    Experiment(cli::experiment::Args),
    /// Fetch the default model into the cache and print its path.
    Fetch(cli::fetch::Args),
    /// Print the model's configuration and the cache location.
    Info(cli::info::Args),
    /// Continue a prompt with the base model or with adapters (ours or PEFT's).
    Generate(cli::generate::Args),
    /// Apply one evolution operator (mutation or crossover) to saved adapters.
    Evolve(cli::evolve::Args),
    /// Validate one Python program exactly as a proposal is validated, in the sandbox.
    Exec(cli::exec::Args),
    /// Measure throughput (prints JSON with --json).
    #[command(subcommand)]
    Bench(cli::bench::Bench),
    /// Write an adapter as a Hugging Face PEFT LoRA directory.
    Export(cli::export::Args),
    /// Read a Hugging Face PEFT LoRA directory into an adapter.
    ImportPeft(cli::import_peft::Args),
    /// Make a fresh adapter (as a run makes a member's) or describe one.
    #[command(subcommand)]
    Adapter(cli::adapter::Command),
}

fn main() {
    settle_thread_count();
    keep_freed_memory();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Run(args) => cli::run::run(args),
        Command::Node(args) => cli::node::run(args),
        Command::Ctl(args) => cli::ctl::run(args),
        Command::Replay(args) => cli::replay::run(args),
        Command::Resume(args) => cli::resume::run(args),
        Command::Report(args) => cli::report::run(args),
        Command::Eval(args) => cli::eval::run(args),
        Command::Experiment(args) => cli::experiment::run(args),
        Command::Fetch(args) => cli::fetch::run(args),
        Command::Info(args) => cli::info::run(args),
        Command::Generate(args) => cli::generate::run(args),
        Command::Evolve(args) => cli::evolve::run(args),
        Command::Exec(args) => cli::exec::run(args),
        Command::Bench(bench) => cli::bench::run(bench),
        Command::Export(args) => cli::export::run(args),
        Command::ImportPeft(args) => cli::import_peft::run(args),
        Command::Adapter(command) => cli::adapter::run(command),
    };
    if let Err(err) = result {
        eprintln!("error: {err:#}");
        std::process::exit(1);
    }
}

/// candle looks up its thread count before every matmul and, unless
/// RAYON_NUM_THREADS is set, parses /proc/cpuinfo to do it (≈ 20 ms of each
/// SmolLM2 decode step went there). Settled once here, while the process has
/// one thread, to the value candle would find (physical cores). rayon's global
/// pool, which the engine's own kernels use, then has that size too, instead of
/// one thread per logical CPU.
fn settle_thread_count() {
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        let threads = candle_core::utils::get_num_threads();
        std::env::set_var("RAYON_NUM_THREADS", threads.to_string());
    }
}

/// A train step allocates and frees ≈ 2 GB of activations per micro-batch, in
/// blocks of 1–30 MB. glibc hands blocks above its mmap threshold (128 KiB,
/// rising with use up to 32 MiB) straight back to the kernel when freed, so each
/// micro-batch faulted in and zeroed fresh pages again. Serving blocks up to
/// 32 MiB (glibc's largest threshold) from the heap, never trimming it (-1) and
/// growing it 256 MiB at a time lets the next micro-batch reuse the same pages.
/// One arena for every thread: the runtime runs train steps on whichever
/// blocking-pool thread is free, and with an arena per thread each could keep
/// a step's peak. These settings override glibc's `MALLOC_*_` variables.
///
/// Kept because it pays (BENCHMARKS.md, "`mallopt` settings"; machine F,
/// 2026-12-04, alternated with `POPULORA_NO_MALLOPT=1`, which skips them and
/// is read here only): `bench broker`'s train step +6 % (median of 3 pairs,
/// train/GEMM 0.66–0.73 against 0.60–0.66), a sixth of the page faults; a
/// quickstart run takes the same time (637 against 640 s over an ABBA
/// quartet, identical results) at a lower peak RSS (1.16–1.17 against
/// 1.45–1.62 GiB: the one arena). Its cost: the heap stays at its peak until exit, and
/// in the same broker runs the 1-adapter and sequential decode runs were
/// 3–15 % slower while the batched multi-adapter run was 1–20 % faster.
fn keep_freed_memory() {
    if std::env::var_os("POPULORA_NO_MALLOPT").is_some_and(|v| v == "1") {
        return; // glibc's defaults, for A/B measurements
    }
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    for (param, value) in [
        (libc::M_MMAP_THRESHOLD, 32 << 20),
        (libc::M_TRIM_THRESHOLD, -1),
        (libc::M_TOP_PAD, 256 << 20),
        (libc::M_ARENA_MAX, 1),
    ] {
        // SAFETY: mallopt only changes glibc's allocation policy (it takes
        // glibc's own locks).
        let accepted = unsafe { libc::mallopt(param, value) };
        debug_assert_eq!(accepted, 1, "mallopt({param}, {value})");
    }
}
