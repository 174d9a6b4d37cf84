//! `populora eval DIR [--baseline DIR]`: every member of a finished run (and
//! of a baseline run) on held-out benchmarks, batched through the
//! multi-adapter engine, scored in the sandbox. Prints a table (or JSON) and
//! writes `DIR/eval.json` for the report and `DIR/eval/samples-<member>.jsonl`
//! for the official HumanEval harness.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use clap::Parser;
use populora::base::{fetch, Message};
use populora::compute::{generate, AdapterSet, GenRequest, Sampling};
use populora::eval::{humaneval, humaneval_io, math, table, BenchmarkResult};
use populora::keyed_stream;
use populora::lora::Adapter;
use populora::scenario::{check_operator, Scenario};
use populora::task::{
    parse_answer, solver_prompt, ChatPrompt, PromptConfig, SolverTask, TaskKind, Triplet,
};
use populora::verify::{SandboxConfig, VerifierPool};

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
    /// Only the first N items of each benchmark (0 = all).
    #[arg(long, default_value_t = 0)]
    pub limit: usize,
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
    #[arg(long)]
    pub json: bool,
}

type Scorer = Box<dyn Fn(&VerifierPool, &str) -> anyhow::Result<bool>>;
type Exporter = Box<dyn Fn(&str) -> String>;

/// One prompt and how to score a response to it.
struct Item {
    id: String,
    chat: ChatPrompt,
    score: Scorer,
    /// HumanEval: the response as the official harness's `completion`.
    export: Option<Exporter>,
}

struct Benchmark {
    name: String,
    items: Vec<Item>,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let scenario = Scenario::from_file(args.dir.join("scenario.toml"), check_operator)?;
    let engine = Engine::load(&scenario, &mut |m| eprintln!("{m}"))?;
    let pool = VerifierPool::new(SandboxConfig::default())?;
    let benchmarks = benchmarks(&args, &pool)?;
    let members = members(&args.dir, "")?;
    let baseline = match &args.baseline {
        Some(dir) => members_of_baseline(dir)?,
        None => Vec::new(),
    };
    let all: Vec<(String, Adapter)> = members
        .into_iter()
        .chain(baseline.iter().cloned())
        .collect();
    let mut results = Vec::new();
    for bench in &benchmarks {
        eprintln!(
            "{}: {} items × {} members",
            bench.name,
            bench.items.len(),
            all.len()
        );
        results.extend(evaluate(&args, &engine, &pool, bench, &all, scenario.seed)?);
    }
    let (base, own): (Vec<_>, Vec<_>) = results
        .into_iter()
        .partition(|r| r.member.starts_with("baseline/"));
    std::fs::write(args.dir.join("eval.json"), serde_json::to_vec_pretty(&own)?)?;
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({ "members": own, "baseline": base }))?
        );
    } else {
        println!(
            "{}",
            table(&own, (!base.is_empty()).then_some(base.as_slice()))
        );
    }
    Ok(())
}

/// The adapters under `DIR/members/*/adapter`, by member name.
fn members(dir: &Path, prefix: &str) -> anyhow::Result<Vec<(String, Adapter)>> {
    let root = dir.join("members");
    let mut names: Vec<String> = std::fs::read_dir(&root)
        .with_context(|| format!("{} has no members/ (is it a run directory?)", dir.display()))?
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
    names
        .into_iter()
        .map(|n| {
            let (adapter, _) =
                Adapter::load(&root.join(&n).join("adapter"), &candle_core::Device::Cpu)
                    .with_context(|| format!("loading member {n}"))?;
            Ok((format!("{prefix}{n}"), adapter))
        })
        .collect()
}

fn members_of_baseline(dir: &Path) -> anyhow::Result<Vec<(String, Adapter)>> {
    members(dir, "baseline/")
}

fn benchmarks(args: &Args, pool: &VerifierPool) -> anyhow::Result<Vec<Benchmark>> {
    let mut out = Vec::new();
    let limit = |n: usize| {
        if args.limit == 0 {
            n
        } else {
            n.min(args.limit)
        }
    };
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
                let items = problems[..limit(problems.len())]
                    .iter()
                    .map(|p| {
                        let (p, q) = (p.clone(), p.clone());
                        Item {
                            id: p.task_id.clone(),
                            chat: humaneval::prompt(&p),
                            score: Box::new(move |pool, response| {
                                let completion = humaneval::completion_from_response(&p, response);
                                Ok(humaneval::score(pool, &p, &completion)?)
                            }),
                            export: Some(Box::new(move |response| {
                                humaneval::completion_from_response(&q, response)
                            })),
                        }
                    })
                    .collect();
                out.push(Benchmark { name: "humaneval".into(), items });
            }
            "humaneval-io" => {
                let set = humaneval_io::build(pool, &problems, &humaneval_io::IoConfig::default())?;
                eprintln!("humaneval-io: {:?}", set.stats);
                for kind in [humaneval_io::IoKind::Output, humaneval_io::IoKind::Input] {
                    let chosen: Vec<_> = set.items.iter().filter(|i| i.kind == kind).cloned().collect();
                    let items = chosen[..limit(chosen.len())].iter().map(io_item).collect::<anyhow::Result<_>>()?;
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
        let set = math::load_gsm8k(path)?;
        let items = set[..limit(set.len())]
            .iter()
            .map(|p| {
                let p = p.clone();
                Item {
                    id: String::new(),
                    export: None,
                    chat: math::gsm8k_prompt(&p),
                    score: Box::new(move |_, response| Ok(math::score_gsm8k(&p, response))),
                }
            })
            .collect();
        out.push(Benchmark {
            name: "gsm8k".into(),
            items,
        });
    }
    if let Some(path) = &args.math {
        let set = math::load_math(path)?;
        let items = set[..limit(set.len())]
            .iter()
            .map(|p| {
                let p = p.clone();
                Item {
                    id: String::new(),
                    export: None,
                    chat: math::math_prompt(&p),
                    score: Box::new(move |_, response| Ok(math::score_math(&p, response))),
                }
            })
            .collect();
        out.push(Benchmark {
            name: "math".into(),
            items,
        });
    }
    Ok(out)
}

/// A HumanEval-IO item in the self-play solver format, scored by AZR's rules.
fn io_item(item: &humaneval_io::IoItem) -> anyhow::Result<Item> {
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
    let item = item.clone();
    Ok(Item {
        id: item.task_id.clone(),
        export: None,
        chat: prompt.chat,
        score: Box::new(move |pool, response| match parse_answer(kind, response) {
            Ok(answer) => Ok(humaneval_io::score(pool, &item, answer.text())?),
            Err(_) => Ok(false),
        }),
    })
}

/// Every member answers every item `samples` times; rows of different
/// members share batches (the multi-adapter engine).
fn evaluate(
    args: &Args,
    engine: &Engine,
    pool: &VerifierPool,
    bench: &Benchmark,
    members: &[(String, Adapter)],
    seed: u64,
) -> anyhow::Result<Vec<BenchmarkResult>> {
    let tokenizer = &engine.tokenizer;
    let set = members
        .iter()
        .enumerate()
        .fold(AdapterSet::new(), |s, (i, (_, a))| s.with(i as u64, a));
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
    let mut rows = Vec::new();
    for m in 0..members.len() {
        for i in 0..bench.items.len() {
            for s in 0..args.samples.max(1) {
                rows.push((m, i, s));
            }
        }
    }
    let mut correct = vec![vec![0usize; bench.items.len()]; members.len()];
    let mut samples_out: Vec<Vec<(String, String)>> = vec![Vec::new(); members.len()];
    for chunk in rows.chunks(args.batch.max(1)) {
        let requests = chunk
            .iter()
            .map(|&(m, i, s)| GenRequest {
                adapter: Some(m as u64),
                prompt: prompts[i].clone(),
                max_new_tokens: args.max_new_tokens,
                stop: tokenizer.stop_ids.clone(),
                sampling,
                rng: keyed_stream!(seed, "eval", bench.name.as_str(), m, i, s),
                grammar: None,
            })
            .collect();
        let generations = generate(&engine.model, &set, requests)?;
        for (&(m, i, _), g) in chunk.iter().zip(generations) {
            let text = tokenizer.decode(&g.tokens)?;
            let text = text.trim_end_matches("<|im_end|>");
            correct[m][i] += usize::from((bench.items[i].score)(pool, text)?);
            if let Some(export) = &bench.items[i].export {
                samples_out[m].push((bench.items[i].id.clone(), export(text)));
            }
        }
    }
    if bench.items.iter().any(|i| i.export.is_some()) {
        let dir = args.dir.join("eval");
        std::fs::create_dir_all(&dir)?;
        for (m, (name, _)) in members.iter().enumerate() {
            let file = dir.join(format!("samples-{}.jsonl", name.replace('/', "-")));
            humaneval::write_samples_jsonl(&file, &samples_out[m])?;
        }
    }
    let n = args.samples.max(1);
    let k = (n > 1).then_some(args.k.min(n));
    Ok(members
        .iter()
        .enumerate()
        .map(|(m, (name, _))| {
            let counts: Vec<(usize, usize)> = correct[m].iter().map(|&c| (n, c)).collect();
            BenchmarkResult::from_counts(&bench.name, name, &counts, k)
        })
        .collect())
}
