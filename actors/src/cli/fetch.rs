//! `populora fetch`: put the default model into the cache.

use clap::Parser;
use populora::base::fetch::DEFAULT_MODEL;

#[derive(Parser)]
pub struct Args {
    /// Fetch again even if the file is already cached.
    #[arg(long)]
    pub force: bool,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let mut progress = |msg: &str| eprintln!("{msg}");
    let path = if args.force {
        DEFAULT_MODEL.fetch(&mut progress)?
    } else {
        DEFAULT_MODEL.ensure(&mut progress)?
    };
    println!("{}", path.display());
    Ok(())
}
