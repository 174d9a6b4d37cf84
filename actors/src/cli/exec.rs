//! `populora exec`: validate one program exactly as a proposal is validated
//! (every check, determinism included) and print the result; and
//! `populora bench verifier`: sandboxed throughput vs a fresh `python3` per program.

use anyhow::{bail, Context};
use populora::verify::{Job, Limits, Outcome, SandboxConfig, Status, VerifierPool};
use serde_json::json;
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

#[derive(clap::Args)]
pub struct Args {
    /// Python file with exactly one top-level function.
    #[arg(long)]
    pub program: PathBuf,
    /// The arguments as written between the call's parentheses, e.g. `"Hello world"` or `[1, 2], 3`.
    #[arg(long, default_value = "")]
    pub input: String,
    /// Wall-clock limit for the run.
    #[arg(long, default_value_t = Limits::default().timeout_ms)]
    pub timeout_ms: u64,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let program = std::fs::read_to_string(&args.program)
        .with_context(|| format!("cannot read the program {}", args.program.display()))?;
    let config = SandboxConfig {
        workers: 1,
        limits: Limits {
            timeout_ms: args.timeout_ms,
            ..Limits::default()
        },
        ..SandboxConfig::default()
    };
    let pool = VerifierPool::new(config).context("cannot start the sandbox")?;
    let v = pool
        .validate_proposal(&program, &args.input)
        .with_context(|| format!("sandbox failed while validating {}", args.program.display()))?;
    let value = json!({
        "status": v.status.name(),
        "output": v.output,
        "reason": v.reason,
        "wall_ms": v.wall_ms,
        "features": v.features,
        "layers": pool.layers(),
        "checker_layers": pool.checker_layers(),
    });
    if args.json {
        println!("{value}");
    } else {
        println!("status: {}", v.status.name());
        match &v.output {
            Some(output) => println!("output: {output}"),
            None => println!("reason: {}", v.reason),
        }
        println!("wall:   {:.1} ms", v.wall_ms);
    }
    Ok(())
}

#[derive(clap::Args)]
pub struct BenchArgs {
    /// Number of distinct small programs (each validated with the determinism check).
    #[arg(long, default_value_t = 2000)]
    pub programs: usize,
    /// Workers for both sides (default: available parallelism).
    #[arg(long)]
    pub workers: Option<usize>,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// AZR-style program shapes; `{c}` becomes a per-program constant so no two
/// programs are the same text.
const TEMPLATES: [(&str, &str); 8] = [
    ("def f(s):\n    return s[::-1] + str(len(s) + {c})", "'word{c}'"),
    ("def f(xs):\n    return sorted(xs)[::2] + [{c}]", "[{c} % 7, {c}, 3, {c} % 5]"),
    (
        "def f(n):\n    total = {c}\n    for k in range(n):\n        if k % 3 == 0:\n            total += k\n    return total",
        "{c} % 50",
    ),
    (
        "def f(s):\n    counts = {}\n    for ch in s:\n        counts[ch] = counts.get(ch, 0) + {c}\n    return sorted(counts.items())",
        "'abracadabra{c}'",
    ),
    ("def f(a, b):\n    return [x * b for x in a if x % 2 == 0] + [{c}]", "[1, 2, 3, 4, {c}], 3"),
    ("def f(s):\n    return ' '.join(w.capitalize() for w in s.split()) * ({c} % 3 + 1)", "'hello big world'"),
    ("import math\ndef f(n):\n    return [math.gcd(n + {c}, k) for k in range(1, 8)]", "{c}"),
    ("def f(n):\n    return 1 if n < 2 else f(n - 1) + f(n - 2) + {c} % 2", "{c} % 15"),
];

fn bench_jobs(n: usize) -> Vec<(String, String)> {
    (0..n)
        .map(|i| {
            let (program, input) = TEMPLATES[i % TEMPLATES.len()];
            let c = (i / TEMPLATES.len()).to_string();
            (program.replace("{c}", &c), input.replace("{c}", &c))
        })
        .collect()
}

/// What the baseline runs in each fresh interpreter: the same parse, two runs
/// and repr as a validated proposal (without our isolation).
const SPAWN_RUNNER: &str = r#"import ast, sys
src, inp = sys.argv[1], sys.argv[2]
tree = ast.parse(src)
name = [n.name for n in tree.body if isinstance(n, ast.FunctionDef)][0]
code = compile(tree, "<program>", "exec")
def run():
    g = {"__name__": "__main__"}
    exec(code, g)
    args = eval("_(\n" + inp + "\n)", {"_": lambda *a: a})
    return repr(g[name](*args))[:400]
a, b = run(), run()
print(a if a == b else "NONDETERMINISTIC", end="")
"#;

pub fn bench(args: BenchArgs) -> anyhow::Result<()> {
    let mut config = SandboxConfig::default();
    if let Some(workers) = args.workers {
        config.workers = workers;
    }
    let workers = config.workers;
    let programs = bench_jobs(args.programs);

    let started = Instant::now();
    let pool = VerifierPool::new(config.clone()).context("cannot start the sandbox")?;
    let pool_start_ms = started.elapsed().as_secs_f64() * 1e3;
    let jobs: Vec<Job> = programs
        .iter()
        .map(|(program, input)| Job::Proposal {
            program: program.clone(),
            input: input.clone(),
        })
        .collect();
    let started = Instant::now();
    let results = pool.batch(&jobs);
    let sandboxed_s = started.elapsed().as_secs_f64();
    let mut sandboxed_outputs = Vec::with_capacity(results.len());
    for (i, result) in results.into_iter().enumerate() {
        match result.with_context(|| format!("sandbox error on program {i}"))? {
            Outcome::Proposal(v) if v.status == Status::Ok => {
                sandboxed_outputs.push(v.output.unwrap_or_default())
            }
            // A benchmark program that fails validation would make the figure meaningless.
            other => bail!("benchmark program {i} was not valid: {other:?}"),
        }
    }

    let started = Instant::now();
    let spawn_outputs = spawn_each(&config.python, &programs, workers)?;
    let spawn_s = started.elapsed().as_secs_f64();
    let agree = spawn_outputs == sandboxed_outputs;

    let sandboxed_per_s = programs.len() as f64 / sandboxed_s;
    let spawn_per_s = programs.len() as f64 / spawn_s;
    let value = json!({
        "sandboxed_per_s": sandboxed_per_s,
        "spawn_per_s": spawn_per_s,
        "ratio": sandboxed_per_s / spawn_per_s,
        "programs": programs.len(),
        "workers": workers,
        "pool_start_ms": pool_start_ms,
        "outputs_agree": agree,
        "layers": pool.layers(),
        "checker_layers": pool.checker_layers(),
        "python": config.python.display().to_string(),
    });
    super::bench::report(args.json, &value);
    Ok(())
}

/// The baseline: one fresh `python3` process per program, `workers` at a time.
fn spawn_each(
    python: &PathBuf,
    programs: &[(String, String)],
    workers: usize,
) -> anyhow::Result<Vec<String>> {
    let next = AtomicUsize::new(0);
    let mut indexed: Vec<(usize, anyhow::Result<String>)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..workers.max(1))
            .map(|_| {
                scope.spawn(|| {
                    let mut done = Vec::new();
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some((program, input)) = programs.get(i) else {
                            break;
                        };
                        let output = Command::new(python)
                            .args(["-c", SPAWN_RUNNER, program, input])
                            .output()
                            .with_context(|| format!("cannot run {}", python.display()))
                            .map(|out| String::from_utf8_lossy(&out.stdout).into_owned());
                        done.push((i, output));
                    }
                    done
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap_or_default())
            .collect()
    });
    indexed.sort_by_key(|(i, _)| *i);
    indexed.into_iter().map(|(_, r)| r).collect()
}
