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
    #[command(flatten)]
    pub cluster: ClusterFlags,
}

/// Where members run, replacing the scenario's `[cluster]` keys.
#[derive(clap::Args)]
pub struct ClusterFlags {
    /// Worker nodes, host:port,... (replaces `cluster.nodes`).
    #[arg(long, value_delimiter = ',')]
    pub nodes: Option<Vec<String>>,
    /// The cluster's cookie file (replaces `cluster.cookie_file`).
    #[arg(long)]
    pub cookie_file: Option<PathBuf>,
}

impl ClusterFlags {
    /// Apply the flags to `scenario` and check the result.
    pub fn apply(self, scenario: &mut Scenario) -> anyhow::Result<()> {
        if let Some(nodes) = self.nodes {
            scenario.cluster.nodes = nodes;
        }
        if let Some(file) = self.cookie_file {
            scenario.cluster.cookie_file = Some(file);
        }
        // The run directory's copy must find its files from any working directory.
        let cluster = &mut scenario.cluster;
        if let Some(file) = &mut cluster.cookie_file {
            *file = std::path::absolute(&*file)?;
        }
        if let Some(tls) = &mut cluster.tls {
            tls.ca = std::path::absolute(&tls.ca)?;
        }
        scenario.validate(check_operator)?;
        Ok(())
    }
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let mut scenario = Scenario::from_file(&args.scenario, check_operator)?;
    args.cluster.apply(&mut scenario)?;
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
