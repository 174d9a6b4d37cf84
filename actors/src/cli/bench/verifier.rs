//! `populora bench verifier`: sandboxed validations/s against a fresh
//! `python3` per program, the way a harness without a sandbox runs them.

use std::path::Path;
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context};
use populora::verify::{parallel_map, Job, Outcome, SandboxConfig, Status, VerifierPool};
use serde_json::json;

#[derive(clap::Args)]
pub struct Args {
    /// Number of distinct small programs (each validated with the determinism check).
    #[arg(long, default_value_t = 2000)]
    pub programs: usize,
    /// Workers for both sides (default: available parallelism).
    #[arg(long)]
    pub workers: Option<usize>,
    /// Measure the sandbox alone, without the fresh-interpreter baselines
    /// (for A/B runs of the sandbox's own settings, whose CPU time and page
    /// faults the baselines' thousands of processes would swamp).
    #[arg(long)]
    pub sandbox_only: bool,
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

/// The baselines: the interpreter started the fastest plain way (no site
/// module, no environment or user paths: `-c pass` in 7.9 ms against 11.3 ms
/// plain, /usr/bin/python3 3.11 on machine F, BENCHMARKS.md), and the way a
/// harness usually starts it.
const SPAWNS: [(&str, &[&str]); 2] = [("bare", &["-I", "-S"]), ("plain", &[])];

pub fn run(args: Args) -> anyhow::Result<()> {
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
    let sandboxed_per_s = programs.len() as f64 / started.elapsed().as_secs_f64();
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

    let mut value = json!({
        "sandboxed_per_s": sandboxed_per_s,
        "programs": programs.len(),
        "workers": workers,
        "pool_start_ms": pool_start_ms,
        "layers": pool.layers(),
        "checker_layers": pool.checker_layers(),
        "python": config.python.display().to_string(),
    });
    let mut agree = true;
    let spawns = if args.sandbox_only {
        &[][..]
    } else {
        &SPAWNS[..]
    };
    for &(name, flags) in spawns {
        let started = Instant::now();
        let outputs = spawn_each(&config.python, flags, &programs, workers)?;
        let per_s = programs.len() as f64 / started.elapsed().as_secs_f64();
        agree &= outputs == sandboxed_outputs;
        value[format!("spawn_{name}_per_s")] = per_s.into();
        value[format!("over_spawn_{name}")] = (sandboxed_per_s / per_s).into();
        let command: Vec<&str> = ["python3"]
            .into_iter()
            .chain(flags.iter().copied())
            .collect();
        value[format!("spawn_{name}")] = format!("{} -c RUNNER", command.join(" ")).into();
    }
    if !args.sandbox_only {
        value["outputs_agree"] = agree.into();
    }
    super::report(args.json, &value);
    Ok(())
}

/// A baseline: one fresh `python3 FLAGS -c` per program, `workers` at a time.
fn spawn_each(
    python: &Path,
    flags: &[&str],
    programs: &[(String, String)],
    workers: usize,
) -> anyhow::Result<Vec<String>> {
    parallel_map(workers, programs, |(program, input)| {
        Command::new(python)
            .args(flags)
            .args(["-c", SPAWN_RUNNER, program, input])
            .output()
            .with_context(|| format!("cannot run {}", python.display()))
            .map(|out| String::from_utf8_lossy(&out.stdout).into_owned())
    })
    .into_iter()
    .map(|r| r.unwrap_or_else(|| Err(anyhow::anyhow!("a baseline thread panicked"))))
    .collect()
}
