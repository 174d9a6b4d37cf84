//! `populora eval [DIR] [--baseline DIR] [--base]`: every member of a
//! finished run (and of a baseline run), and with `--base` the untouched
//! base model, on held-out benchmarks ([`crate::experiment::evaluate`]).
//! Without a run, `--base` evaluates the base model alone. Prints a table
//! (or JSON) and writes the evaluation's files under the run (or `--out`,
//! or the current directory): `eval.json` for the report, `eval/items.jsonl`
//! and each row's answers in the official harnesses' formats.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use clap::Parser;
use populora::base::WeightsSetting;
use populora::eval::math::MathPrompt;
use populora::scenario::{check_operator, Scenario};
use populora::verify::{SandboxConfig, VerifierPool};

use crate::experiment::evaluate::{
    evaluate_rows, members, rescore, rows_table, split_rows, write, Evaluation, Options, Row,
    BASE_ROW,
};
use crate::runtime::engine::Engine;
use populora::eval::ItemRecord;

#[derive(Parser)]
pub struct Args {
    /// A finished run directory (leave it out to evaluate the base model
    /// alone, with --base).
    pub dir: Option<PathBuf>,
    /// A second run (e.g. the solo baseline) to compare with.
    #[arg(long, requires = "dir")]
    pub baseline: Option<PathBuf>,
    /// Benchmarks, comma-separated: humaneval, humaneval-io, humaneval+,
    /// mbpp+, cruxeval-o, cruxeval-i, gsm8k, math500, minerva,
    /// olympiadbench, aime24, aime25, amc23.
    #[arg(long, default_value = "humaneval,humaneval-io")]
    pub benchmarks: String,
    /// A GSM8K-format JSONL file (`question`, `answer` ending in `#### N`),
    /// evaluated as `gsm8k` instead of the shipped test set.
    #[arg(long)]
    pub gsm8k: Option<PathBuf>,
    /// A MATH-format JSONL file (`problem`, an `answer` or a `solution` with
    /// `\boxed{}`), evaluated as the benchmark `math`.
    #[arg(long)]
    pub math: Option<PathBuf>,
    /// How math problems are asked: `boxed` (the final answer in \boxed{},
    /// the last one read) or `answer-tags` (<think> and <answer> tags).
    #[arg(long, default_value = "boxed", value_parser = clap::value_parser!(MathPrompt))]
    pub math_prompt: MathPrompt,
    /// Only the first N items of each benchmark (0 = all); after --tasks.
    #[arg(long, default_value_t = 0)]
    pub limit: usize,
    /// Only these tasks, comma-separated: HumanEval ids such as HumanEval/12
    /// (also selecting that problem's HumanEval-IO and HumanEval+ items),
    /// Mbpp/N (MBPP+), sample_N (CRUXEval, both O and I), SET/N (the Nth
    /// problem of a math set, from 0, e.g. gsm8k/5, math500/7, math/N for
    /// --math). Unknown ids are an error.
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
    /// Also evaluate the untouched base model (no adapter), as the row
    /// "base model"; without DIR, the base model alone.
    #[arg(long)]
    pub base: bool,
    /// Decode solver-format answers (HumanEval-IO, CRUXEval) freely, even
    /// under grammars (by default they follow the run's
    /// `selfplay.constrained`, without a run the solver grammar is on).
    #[arg(long)]
    pub free_decoding: bool,
    /// Without DIR: the base model, a GGUF file or HF model directory
    /// (default: SmolLM2-135M-Instruct, fetched on first use).
    #[arg(long, conflicts_with = "dir")]
    pub model: Option<PathBuf>,
    /// Without DIR: where the base model runs (cpu, cuda, cuda:N).
    #[arg(long, default_value = "cpu", conflicts_with = "dir")]
    pub device: String,
    /// Without DIR: the seed of the sampling streams (with --samples > 1).
    #[arg(long, default_value_t = 0, conflicts_with = "dir")]
    pub seed: u64,
    /// Without DIR: how the base keeps its weights (`[model] weights`):
    /// `native` or `f32` (with DIR, the run's scenario decides).
    #[arg(long, default_value = "native", value_parser = super::generate::parse_weights, conflicts_with = "dir")]
    pub weights: WeightsSetting,
    /// Score the answers recorded in this items.jsonl again instead of
    /// generating (every row of the file, each benchmark of --benchmarks);
    /// with --out for the files.
    #[arg(long, value_name = "ITEMS.jsonl", conflicts_with_all = ["dir", "base"])]
    pub rescore: Option<PathBuf>,
    /// Where the files go (default: DIR, or the current directory).
    #[arg(long)]
    pub out: Option<PathBuf>,
    #[arg(long)]
    pub json: bool,
}

impl Args {
    fn options(&self, out: &Path) -> anyhow::Result<Options> {
        Ok(Options {
            benchmarks: self.benchmarks.clone(),
            gsm8k: self.gsm8k.clone(),
            math: self.math.clone(),
            math_prompt: self.math_prompt,
            tasks: self.tasks()?,
            limit: self.limit,
            samples: self.samples,
            k: self.k,
            max_new_tokens: self.max_new_tokens,
            batch: self.batch,
            constrained: !self.free_decoding,
            progress: Some(out.join("eval")),
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

    /// The scenario the evaluation runs under: the run's, or without one the
    /// defaults (the solver grammar on) with --model and --device.
    fn scenario(&self) -> anyhow::Result<Scenario> {
        if let Some(dir) = &self.dir {
            // As recorded: a run older than `[model] weights` evaluates in f32.
            return Ok(Scenario::from_recorded_file(
                dir.join("scenario.toml"),
                check_operator,
            )?);
        }
        if !self.base && self.rescore.is_none() {
            bail!("give a run directory, or --base to evaluate the base model alone");
        }
        // A JSON string is a TOML basic string.
        let quoted = |text: &str| serde_json::Value::from(text).to_string();
        let source = match &self.model {
            Some(path) => quoted(&path.display().to_string()),
            None => quoted("default"),
        };
        let device = quoted(&self.device);
        let text = format!(
            "name = \"base-model\"\nseed = {}\nsteps = 1\n[model]\nsource = {source}\ndevice = {device}\nweights = {:?}\n",
            self.seed,
            self.weights.name()
        );
        Ok(Scenario::parse(&text, "eval --base", check_operator)?)
    }

    /// What decides the answers, so that an interrupted evaluation is only
    /// continued with the same settings.
    fn settings(&self, scenario: &Scenario, rows: &[Row]) -> String {
        let rows: Vec<&str> = rows.iter().map(|(name, _)| name.as_str()).collect();
        serde_json::json!({
            "benchmarks": self.benchmarks,
            "gsm8k": self.gsm8k,
            "math": self.math,
            "math_prompt": self.math_prompt.name(),
            "tasks": self.tasks().ok().flatten(),
            "limit": self.limit,
            "samples": self.samples,
            "k": self.k,
            "max_new_tokens": self.max_new_tokens,
            "batch": self.batch,
            "free_decoding": self.free_decoding,
            "model": scenario.model,
            "seed": scenario.seed,
            "rows": rows,
        })
        .to_string()
    }
}

/// An interrupted evaluation in `dir` (its progress files) is continued
/// only with the settings it started with (`progress-settings.json`).
fn claim_progress(dir: &Path, settings: &str) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)?;
    let file = dir.join("progress-settings.json");
    match std::fs::read_to_string(&file) {
        Ok(existing) if existing != settings => bail!(
            "{} holds an interrupted evaluation with other settings ({}); \
             delete its progress-* files to start this one, or run it again with the same flags",
            dir.display(),
            file.display()
        ),
        Ok(_) => Ok(()),
        Err(_) => Ok(std::fs::write(&file, settings)?),
    }
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let scenario = args.scenario()?;
    let out = match (&args.out, &args.dir) {
        (Some(out), _) => out.clone(),
        (None, Some(dir)) => dir.clone(),
        (None, None) => PathBuf::from("."),
    };
    let engine = Engine::load(&scenario, &mut |m| eprintln!("{m}"))?;
    let pool = VerifierPool::new(SandboxConfig::default())?;
    if let Some(items) = &args.rescore {
        let records = read_records(items)?;
        let options = Options {
            progress: None,
            ..args.options(&out)?
        };
        let evaluation = rescore(&options, &engine, &pool, &records)?;
        write(&out, &evaluation)?;
        return print(&args, evaluation);
    }
    let mut rows = match &args.dir {
        Some(dir) => members(dir, "")?,
        None => Vec::new(),
    };
    if let Some(dir) = &args.baseline {
        rows.extend(members(dir, "baseline/")?);
    }
    if args.base {
        rows.push((BASE_ROW.to_string(), None));
    }
    let options = args.options(&out)?;
    claim_progress(&out.join("eval"), &args.settings(&scenario, &rows))?;
    let evaluation = evaluate_rows(&options, &engine, &pool, &rows, scenario.seed)?;
    write(&out, &evaluation)?;
    print(&args, evaluation)
}

/// Every line of an items.jsonl.
fn read_records(path: &Path) -> anyhow::Result<Vec<ItemRecord>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    text.lines()
        .enumerate()
        .filter(|(_, line)| !line.trim().is_empty())
        .map(|(i, line)| {
            serde_json::from_str(line)
                .with_context(|| format!("{} line {}: not an answer record", path.display(), i + 1))
        })
        .collect()
}

/// The table, or with --json the results.
fn print(args: &Args, evaluation: Evaluation) -> anyhow::Result<()> {
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
