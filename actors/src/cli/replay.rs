//! `populora replay DIR`: re-execute a finished run from its scenario and
//! journal (live commands included) into DIR/replay and verify every
//! member's checksum at every step; exits non-zero at the first divergence.

use std::path::PathBuf;

use clap::Parser;

use crate::runtime::replay;

#[derive(Parser)]
pub struct Args {
    /// The finished run directory.
    pub dir: PathBuf,
    /// By default a run on worker nodes replays on the same nodes (its
    /// scenario.toml's `[cluster]`); these name others. Bits match only
    /// with the same number of nodes (the same placement).
    #[command(flatten)]
    pub cluster: super::run::ClusterFlags,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let summary = replay::replay(&args.dir, |s| args.cluster.apply(s))?;
    println!(
        "replay matches: {} steps, every member checksum identical ({})",
        summary.steps,
        args.dir.join("replay").display()
    );
    Ok(())
}
