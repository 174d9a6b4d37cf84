//! The seeding stage of a run (`[seeding]`): AZR's buffers written by the
//! base model before step 1 ([`populora::selfplay::seed_buffers`]), kept in
//! the run directory as `seeding.json` with its checksum journaled, so that
//! replay and resume start from the same buffers. An experiment runs the
//! stage once per seed and hands the result to both arms.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{bail, Context};
use populora::run_files::Event;
use populora::scenario::Scenario;
use populora::selfplay::{seed_buffers, Seeded, SeedingConfig};
use populora::task::TaskKind;
use populora::verify::VerifierPool;
use sha2::{Digest, Sha256};

use super::engine::Engine;

/// The stage's file in a run directory.
pub const SEEDING_FILE: &str = "seeding.json";

/// Runs the stage for `scenario` (its seed, `[seeding]` and self-play
/// settings) on `engine`'s base, validating in a sandbox pool of its own.
pub fn run_stage(scenario: &Scenario, engine: &Engine) -> anyhow::Result<Seeded> {
    let config = SeedingConfig::of(&scenario.seeding)
        .context("the scenario has no seeding stage (seeding.entries = 0)")?;
    eprintln!(
        "seeding: the base model proposes until each buffer holds {} tasks",
        config.entries
    );
    let pool = VerifierPool::new(engine.sandbox.clone())?;
    let seeded = seed_buffers(
        scenario.seed,
        &engine.settings,
        &engine.tokenizer,
        &engine.grammars,
        &engine.model,
        &pool,
        config,
    )?;
    eprintln!(
        "seeding: {} proposals in {} rounds, {} valid ({:.2} TFLOP)",
        seeded.proposals,
        seeded.rounds,
        seeded.valid,
        seeded.cost.flops / 1e12
    );
    Ok(seeded)
}

/// `seeded` is what `scenario` asks for: its seed and `[seeding]`.
pub fn check(seeded: &Seeded, scenario: &Scenario, origin: &Path) -> anyhow::Result<()> {
    let wanted = SeedingConfig::of(&scenario.seeding);
    if seeded.seed != scenario.seed || Some(seeded.config) != wanted {
        bail!(
            "{} was seeded with seed {} and {:?}, the scenario asks for seed {} and {:?}",
            origin.display(),
            seeded.seed,
            seeded.config,
            scenario.seed,
            wanted
        );
    }
    Ok(())
}

/// Writes `seeded` into `dir` (written aside and renamed into place, so
/// the file is always a whole stage); its SHA-256.
pub fn save(dir: &Path, seeded: &Seeded) -> anyhow::Result<String> {
    let bytes = serde_json::to_vec_pretty(seeded)?;
    let (path, partial) = (dir.join(SEEDING_FILE), dir.join(".seeding.json.partial"));
    std::fs::write(&partial, &bytes)
        .and_then(|()| std::fs::rename(&partial, &path))
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(checksum(&bytes))
}

/// Reads a stage's file and its SHA-256.
pub fn load(path: &Path) -> anyhow::Result<(Seeded, String)> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let seeded = serde_json::from_slice(&bytes)
        .with_context(|| format!("{} is not a seeding stage's file", path.display()))?;
    Ok((seeded, checksum(&bytes)))
}

/// The journal's record of the stage.
pub fn event(seeded: &Seeded, checksum: String) -> Event {
    let entries: BTreeMap<String, usize> = TaskKind::ALL
        .iter()
        .map(|&kind| (kind.name().to_string(), seeded.buffers.len(kind)))
        .collect();
    Event::Seeding {
        checksum,
        entries,
        rounds: seeded.rounds,
        proposals: seeded.proposals,
        valid: seeded.valid,
        compute: seeded.cost,
    }
}

fn checksum(bytes: &[u8]) -> String {
    format!("{:x}", Sha256::digest(bytes))
}
