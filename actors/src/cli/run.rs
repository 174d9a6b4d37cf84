//! `populora run SCENARIO [--out DIR]`: a population (or solo baseline) run.

use std::path::PathBuf;

use clap::Parser;
use populora::scenario::{check_operator, Scenario};

use crate::runtime::replay;

#[derive(Parser)]
pub struct Args {
    /// A scenario file (see scenarios/).
    pub scenario: PathBuf,
    /// Run directory (default: runs/<scenario name>-seed<seed>). Must not exist or be empty.
    #[arg(long)]
    pub out: Option<PathBuf>,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let scenario = Scenario::from_file(&args.scenario, check_operator)?;
    let out = args.out.unwrap_or_else(|| {
        PathBuf::from("runs").join(format!("{}-seed{}", scenario.name, scenario.seed))
    });
    eprintln!("run directory: {}", out.display());
    let summary = replay::fresh(scenario, &out)?;
    print_summary(&summary, &out);
    Ok(())
}

pub fn print_summary(summary: &crate::runtime::coordinator::Summary, out: &std::path::Path) {
    let how = match (summary.budget_reached, summary.stopped_early) {
        (true, _) => "finished (compute budget spent)",
        (false, true) => "stopped",
        (false, false) => "finished",
    };
    println!(
        "{how} after {} steps in {:.1}s, {:.1} TFLOP; {} members; run directory {}",
        summary.steps,
        summary.wall_s,
        summary.spent.flops / 1e12,
        summary.checksums.len(),
        out.display()
    );
}
