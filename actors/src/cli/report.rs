//! `populora report DIR [--out DIR]`: plots and an index.html from a run's
//! journal and metrics (and `eval.json` when `populora eval` has written it).

use std::path::PathBuf;

use clap::Parser;

#[derive(Parser)]
pub struct Args {
    /// The run directory.
    pub dir: PathBuf,
    /// Where to write (default: DIR/report).
    #[arg(long)]
    pub out: Option<PathBuf>,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let out = args.out.unwrap_or_else(|| args.dir.join("report"));
    let summary = populora::report::write(&args.dir, &out)?;
    for warning in &summary.warnings {
        eprintln!("warning: {warning}");
    }
    println!("{}", summary.index.display());
    Ok(())
}
