//! `populora resume DIR`: continue a crashed, killed or stopped run from its
//! newest checkpoint that loads (a newer, corrupt one is set aside and
//! journaled); it ends with the same checksums as an uninterrupted run.

use std::path::PathBuf;

use clap::Parser;

use crate::runtime::replay;

#[derive(Parser)]
pub struct Args {
    /// The run directory.
    pub dir: PathBuf,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let summary = replay::resume(&args.dir)?;
    super::run::print_summary(&summary, &args.dir);
    Ok(())
}
