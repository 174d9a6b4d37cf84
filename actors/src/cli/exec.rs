//! `populora exec`: validate one program exactly as a proposal is validated
//! (every check, determinism included) and print the result.

use anyhow::Context;
use populora::verify::{Limits, SandboxConfig, VerifierPool};
use serde_json::json;
use std::path::PathBuf;

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
