//! `populora evolve`: apply one evolution operator to saved adapters.

use std::path::PathBuf;

use anyhow::{bail, Context};
use candle_core::Device;
use populora::evolve::{self, OperatorKind, OperatorSpec};
use populora::keyed_stream;
use populora::lora::Adapter;

#[derive(clap::Args)]
pub struct Args {
    /// Operator, optionally with parameters: `dare` or `dare:drop=0.3`.
    #[arg(long, required_unless_present = "list")]
    pub op: Option<String>,
    /// Adapter directories (saved with `Adapter::save`): one for a mutation,
    /// two or more for a crossover.
    #[arg(long, num_args = 1.., required_unless_present = "list")]
    pub parents: Vec<PathBuf>,
    /// One fitness value per parent (higher is better); default all equal.
    #[arg(long, num_args = 1..)]
    pub fitness: Vec<f64>,
    /// Directory for the child adapter.
    #[arg(long, required_unless_present = "list")]
    pub out: Option<PathBuf>,
    /// Seed of the operator's random stream.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// List the operators and their parameters, then exit.
    #[arg(long)]
    pub list: bool,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    if args.list {
        print_operators();
        return Ok(());
    }
    let (Some(op), Some(out)) = (args.op, args.out) else {
        bail!("--op and --out are required");
    };
    let spec = OperatorSpec::parse(&op)?;
    let mut parents = Vec::new();
    let mut base = None;
    for dir in &args.parents {
        let (adapter, parent_base) = Adapter::load(dir, &Device::Cpu)
            .with_context(|| format!("loading {}", dir.display()))?;
        if base.as_ref().is_some_and(|b| *b != parent_base) {
            bail!(
                "{} was made for a different base model than {}",
                dir.display(),
                args.parents[0].display()
            );
        }
        base = Some(parent_base);
        parents.push(adapter);
    }
    let Some(base) = base else {
        bail!("--parents is empty");
    };
    let kind = evolve::operators()
        .iter()
        .find(|o| o.name == spec.name)
        .map(|o| o.kind)
        .with_context(|| {
            format!(
                "unknown operator `{}` (known: {})",
                spec.name,
                evolve::operator_names().join(", ")
            )
        })?;
    let mut rng = keyed_stream!(args.seed, "evolve-cli");
    let (child, record) = match kind {
        OperatorKind::Mutation => {
            if parents.len() != 1 {
                bail!(
                    "mutation `{}` takes exactly one parent, got {}",
                    spec.name,
                    parents.len()
                );
            }
            evolve::mutate(&spec, &parents[0], &mut rng)?
        }
        OperatorKind::Crossover => {
            let refs: Vec<&Adapter> = parents.iter().collect();
            evolve::crossover(&spec, &refs, &args.fitness, &mut rng)?
        }
    };
    child
        .save(&out, &base)
        .with_context(|| format!("saving {}", out.display()))?;
    println!("{}", serde_json::to_string(&record)?);
    Ok(())
}

fn print_operators() {
    for op in evolve::operators() {
        println!("{} ({:?}): {}", op.name, op.kind, op.doc);
        for p in op.params {
            println!(
                "    {} = {} in [{}, {}]: {}",
                p.name, p.default, p.min, p.max, p.doc
            );
        }
    }
}
