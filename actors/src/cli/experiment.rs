//! `populora experiment EXPERIMENT.toml [--out DIR]`: a population and a
//! compute-matched single-adapter baseline over several seeds, run,
//! evaluated and compared by the protocol in [`crate::experiment`]. Running
//! the same command again continues an interrupted experiment.

use std::path::PathBuf;

use clap::Parser;
use populora::scenario::check_operator;
use populora::scenario::experiment::Experiment;

#[derive(Parser)]
pub struct Args {
    /// An experiment file (see experiments/).
    pub experiment: PathBuf,
    /// Where everything goes (default: runs/<name>-experiment). Running the
    /// same command again continues an interrupted experiment.
    #[arg(long)]
    pub out: Option<PathBuf>,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let loaded = Experiment::from_file(&args.experiment, check_operator)?;
    let name = &loaded.experiment.name;
    let out = args
        .out
        .unwrap_or_else(|| PathBuf::from("runs").join(format!("{name}-experiment")));
    eprintln!("experiment {name}: {}", out.display());
    let summary = crate::experiment::run(&loaded, &args.experiment, &out)?;
    let index = populora::report::experiment::write(&out, &summary)?;
    println!("{}", populora::report::experiment::text(&summary));
    println!("{}", index.display());
    Ok(())
}
