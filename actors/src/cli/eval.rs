//! `populora eval DIR [--baseline DIR]`: every member of a finished run (and
//! of a baseline run) on held-out benchmarks ([`crate::experiment::evaluate`]).
//! Prints a table (or JSON) and writes `DIR/eval.json` for the report and
//! `DIR/eval/samples-<member>.jsonl` for the official HumanEval harness.

use std::collections::BTreeSet;
use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::Parser;
use populora::scenario::{check_operator, Scenario};
use populora::verify::{SandboxConfig, VerifierPool};

use crate::experiment::evaluate::{
    evaluate_rows, members, rows_table, split_rows, write, Options, BASE_ROW,
};
use crate::runtime::engine::Engine;

#[derive(Parser)]
pub struct Args {
    /// A finished run directory.
    pub dir: PathBuf,
    /// A second run (e.g. the solo baseline) to compare with.
    #[arg(long)]
    pub baseline: Option<PathBuf>,
    /// Benchmarks, comma-separated: humaneval, humaneval-io.
    #[arg(long, default_value = "humaneval,humaneval-io")]
    pub benchmarks: String,
    /// A GSM8K-format JSONL file (`question`, `answer` ending in `#### N`).
    #[arg(long)]
    pub gsm8k: Option<PathBuf>,
    /// A MATH-format JSONL file (`problem`, `solution` with `\boxed{}`).
    #[arg(long)]
    pub math: Option<PathBuf>,
    /// Only the first N items of each benchmark (0 = all); after --tasks.
    #[arg(long, default_value_t = 0)]
    pub limit: usize,
    /// Only these tasks, comma-separated: HumanEval ids such as HumanEval/12
    /// (also selecting that problem's HumanEval-IO items), gsm8k/N or math/N
    /// (the Nth problem of --gsm8k / --math, from 0). Unknown ids are an error.
    #[arg(long, value_name = "ID,...", conflicts_with = "tasks_from")]
    pub tasks: Option<String>,
    /// Like --tasks, one task id per line (blank lines and lines starting
    /// with # are skipped).
    #[arg(long, value_name = "FILE")]
    pub tasks_from: Option<PathBuf>,
    /// Samples per item: 1 = greedy pass@1; more adds pass@k (temperature 0.8).
    #[arg(long, default_value_t = 1)]
    pub samples: usize,
    #[arg(long, default_value_t = 10)]
    pub k: usize,
    #[arg(long, default_value_t = 384)]
    pub max_new_tokens: usize,
    /// Rows per generation batch.
    #[arg(long, default_value_t = 32)]
    pub batch: usize,
    /// Also evaluate the untouched base model (no adapter), as the row "base model".
    #[arg(long)]
    pub base: bool,
    /// Decode HumanEval-IO answers freely, even when the run decoded under
    /// grammars (by default they follow the run's `selfplay.constrained`: the
    /// solver grammar the members were trained under).
    #[arg(long)]
    pub free_decoding: bool,
    #[arg(long)]
    pub json: bool,
}

impl Args {
    fn options(&self) -> anyhow::Result<Options> {
        Ok(Options {
            benchmarks: self.benchmarks.clone(),
            gsm8k: self.gsm8k.clone(),
            math: self.math.clone(),
            tasks: self.tasks()?,
            limit: self.limit,
            samples: self.samples,
            k: self.k,
            max_new_tokens: self.max_new_tokens,
            batch: self.batch,
            constrained: !self.free_decoding,
            progress: None,
        })
    }

    /// The ids of --tasks or --tasks-from.
    fn tasks(&self) -> anyhow::Result<Option<BTreeSet<String>>> {
        let ids: Vec<String> = match (&self.tasks, &self.tasks_from) {
            (Some(list), _) => list.split(',').map(|id| id.trim().to_string()).collect(),
            (None, Some(path)) => std::fs::read_to_string(path)
                .with_context(|| format!("reading --tasks-from {}", path.display()))?
                .lines()
                .map(|line| line.trim().to_string())
                .filter(|line| !line.starts_with('#'))
                .collect(),
            (None, None) => return Ok(None),
        };
        let ids: BTreeSet<String> = ids.into_iter().filter(|id| !id.is_empty()).collect();
        if ids.is_empty() {
            bail!("no task ids given (--tasks or --tasks-from is empty)");
        }
        Ok(Some(ids))
    }
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let scenario = Scenario::from_recorded_file(args.dir.join("scenario.toml"), check_operator)?;
    let engine = Engine::load(&scenario, &mut |m| eprintln!("{m}"))?;
    let pool = VerifierPool::new(SandboxConfig::default())?;
    let mut rows = members(&args.dir, "")?;
    if let Some(dir) = &args.baseline {
        rows.extend(members(dir, "baseline/")?);
    }
    if args.base {
        rows.push((BASE_ROW.to_string(), None));
    }
    let options = args.options()?;
    let evaluation = evaluate_rows(&options, &engine, &pool, &rows, scenario.seed)?;
    write(&args.dir, &evaluation)?;
    let (members, baseline, base) = split_rows(evaluation.results);
    if args.json {
        let value =
            serde_json::json!({ "members": members, "baseline": baseline, "base_model": base });
        println!("{}", serde_json::to_string_pretty(&value)?);
    } else {
        println!("{}", rows_table(&members, &baseline, &base));
    }
    Ok(())
}
