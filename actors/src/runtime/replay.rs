//! Starting a run three ways: fresh from a scenario, resumed from the last
//! checkpoint of a crashed or stopped run, or replayed from a finished run's
//! scenario and journal (then compared checksum by checksum).

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use anyhow::{bail, Context};
use populora::lora::{AdamW, Adapter};
use populora::rating::{Rating, TrueSkillConfig};
use populora::scenario::{check_operator, Scenario};
use populora::selfplay::{Learner, MemberId, Seeded, SeedingConfig};
use ractor::Actor;
use tokio::sync::{mpsc, oneshot};

use super::cluster::{read_cookie, Unreachable};
use super::control::{self, Command, Shared};
use super::coordinator::{Coordinator, CoordinatorArgs, Summary, DEFERRED};
use super::engine::Engine;
use super::journal::{self, Event, Log, Source};
use super::league::League;
use super::member;
use super::rundir::RunDir;
use super::seeding;
use super::{NodeBack, NodeLost};

/// A new run of `scenario` in `out`. A worker node lost mid-run sends it
/// back to its last checkpoint on the nodes still up ([`recover`]). With a
/// `[seeding]` stage, the run starts by running it.
pub fn fresh(scenario: Scenario, out: &Path) -> anyhow::Result<Summary> {
    recover(out, fresh_with(scenario, out, BTreeMap::new(), None, None))
}

/// [`fresh`], starting from a seeding stage already run for `scenario`
/// (an experiment runs it once for both arms of a seed).
pub fn fresh_seeded(scenario: Scenario, out: &Path, seeded: Seeded) -> anyhow::Result<Summary> {
    recover(
        out,
        fresh_with(scenario, out, BTreeMap::new(), None, Some(seeded)),
    )
}

/// While `result` is a lost node: journal it and resume from the last
/// checkpoint without that node (its members move to the nodes still up,
/// or to this process when none is).
fn recover(root: &Path, mut result: anyhow::Result<Summary>) -> anyhow::Result<Summary> {
    // (the step the last change happened in, changes at that step)
    let mut stuck = (0, 0);
    loop {
        let Err(e) = &result else {
            return result;
        };
        let (step, change) = if let Some(lost) = e.downcast_ref::<NodeLost>() {
            eprintln!("{lost}; going back to the last checkpoint on the nodes still up");
            let event = Event::NodeLost {
                step: lost.step,
                node: lost.node.clone(),
                message: lost.message.clone(),
                resumed_from: 0,
            };
            (lost.step, event)
        } else if let Some(back) = e.downcast_ref::<NodeBack>() {
            eprintln!("{back}; continuing from that checkpoint with it");
            let event = Event::NodeBack {
                step: back.step,
                node: back.node.clone(),
            };
            (back.step, event)
        } else {
            return result;
        };
        stuck = if step > stuck.0 {
            (step, 1)
        } else {
            (stuck.0, stuck.1 + 1)
        };
        if stuck.1 > MAX_LAYOUT_CHANGES {
            return result.context(format!(
                "the nodes changed {MAX_LAYOUT_CHANGES} times without the run getting past step {step}; stopped (`populora resume` continues)"
            ));
        }
        result = resume_after(root, Some(change));
    }
}

/// Layout changes (a node lost or back) without progress before a `run` or
/// `resume` gives up: a node that dies at the same step every time cannot
/// keep the run looping.
const MAX_LAYOUT_CHANGES: usize = 16;

fn fresh_with(
    scenario: Scenario,
    out: &Path,
    scheduled: BTreeMap<u64, Vec<Command>>,
    last_step: Option<u64>,
    seeded: Option<Seeded>,
) -> anyhow::Result<Summary> {
    let dir = RunDir::create(out)?;
    std::fs::write(dir.scenario(), scenario.to_toml())?;
    let engine = Engine::load(&scenario, &mut |m| eprintln!("{m}"))?;
    let mut league = League::new(&scenario, Rating::fresh(&TrueSkillConfig::default()));
    let seeding = match (SeedingConfig::of(&scenario.seeding), seeded) {
        (None, _) => None,
        (Some(_), Some(seeded)) => Some(seeded),
        (Some(_), None) => Some(seeding::run_stage(&scenario, &engine)?),
    };
    let seeding = match seeding {
        Some(seeded) => {
            seeding::check(&seeded, &scenario, &dir.root.join(seeding::SEEDING_FILE))?;
            let checksum = seeding::save(&dir.root, &seeded)?;
            league.buffers = seeded.buffers.clone();
            Some(seeding::event(&seeded, checksum))
        }
        None => None,
    };
    let mut learners = BTreeMap::new();
    for (&id, info) in &league.members {
        let adapter = Adapter::for_member(
            engine.lora.clone(),
            &engine.model.config,
            scenario.seed,
            &info.name,
            &candle_core::Device::Cpu,
        )?;
        learners.insert(
            id,
            Learner {
                adapter,
                optimizer: AdamW::new(engine.adamw),
            },
        );
    }
    for (&id, learner) in &learners {
        league.checksums.insert(id, learner.adapter.checksum()?);
    }
    let mut journal = Log::open(&dir.journal(), None)?;
    journal.append(&Event::Start {
        seed: scenario.seed,
        scenario: scenario.name.clone(),
        members: league.entries(),
    })?;
    if let Some(event) = seeding {
        journal.append(&event)?;
    }
    let metrics = Log::open(&dir.metrics(), None)?;
    let last_step = last_step.unwrap_or(scenario.steps);
    let run = Run {
        scenario,
        dir,
        engine,
        league,
        learners,
        scheduled,
        last_step,
        journal,
        metrics,
        unreachable: Unreachable::Refuse,
    };
    launch(run)
}

/// Continue `dir` from its newest checkpoint that loads. A newer one that
/// does not (a corrupt file, a missing member) is moved aside and journaled,
/// and the steps since the older one run again. Live commands the crashed
/// run had applied after that checkpoint are applied again at their steps.
pub fn resume(root: &Path) -> anyhow::Result<Summary> {
    recover(root, resume_after(root, None))
}

/// [`resume`], journaling the layout change it follows (a `node_lost`'s
/// `resumed_from` is filled in here).
fn resume_after(root: &Path, change: Option<Event>) -> anyhow::Result<Summary> {
    let dir = RunDir::new(root);
    let scenario = Scenario::from_recorded_file(dir.scenario(), check_operator)?;
    let events = journal::read(&dir.journal())?;
    if let Some(Event::End { step: end, .. }) =
        events.iter().rev().find(|e| matches!(e, Event::End { .. }))
    {
        if *end >= scenario.steps {
            bail!(
                "{} finished all {} steps; nothing to resume",
                root.display(),
                scenario.steps
            );
        }
    }
    let (
        Checkpoint {
            step,
            league,
            learners,
        },
        skipped,
    ) = newest_loadable_checkpoint(&dir)?;
    let scheduled = live_commands(&events, |s| s > step);
    let engine = Engine::load(&scenario, &mut |m| eprintln!("{m}"))?;
    // What happened to the nodes and checkpoints after the checkpoint stays
    // in the history.
    let history: Vec<&Event> = events
        .iter()
        .skip(league.journal_lines)
        .filter(|e| {
            matches!(
                e,
                Event::Layout { .. }
                    | Event::NodeLost { .. }
                    | Event::NodeBack { .. }
                    | Event::CheckpointSkipped { .. }
            )
        })
        .collect();
    let mut journal = Log::open(&dir.journal(), Some(league.journal_lines))?;
    for event in history {
        journal.append(event)?;
    }
    // The commands still to apply, kept in the journal until they are (a
    // second loss before their step reads them from here).
    for (&at, commands) in &scheduled {
        for command in commands {
            journal.append(&Event::Control {
                step: at,
                command: command.clone(),
                source: Source::Ctl,
                outcome: format!("{DEFERRED}: rerun from the checkpoint of step {step}"),
            })?;
        }
    }
    for event in set_aside(&dir, skipped)? {
        journal.append(&event)?;
    }
    if let Some(mut change) = change {
        if let Event::NodeLost { resumed_from, .. } = &mut change {
            *resumed_from = step;
        }
        journal.append(&change)?;
    }
    let metrics = Log::open(&dir.metrics(), Some(league.metrics_lines))?;
    eprintln!("resuming {} from step {step}", root.display());
    let last_step = scenario.steps;
    let run = Run {
        scenario,
        dir,
        engine,
        league,
        learners,
        scheduled,
        last_step,
        journal,
        metrics,
        unreachable: Unreachable::Skip,
    };
    launch(run)
}

/// A checkpoint as resume needs it: the league and every live member.
struct Checkpoint {
    step: u64,
    league: League,
    learners: BTreeMap<MemberId, Learner>,
}

/// The newest checkpoint that loads, and every newer one that did not, with
/// why (newest first). An error, listing each reason, when none loads.
fn newest_loadable_checkpoint(dir: &RunDir) -> anyhow::Result<(Checkpoint, Vec<(u64, String)>)> {
    let mut skipped = Vec::new();
    for (step, path) in dir.checkpoints_newest_first()? {
        match load_checkpoint(step, &path) {
            Ok(checkpoint) => return Ok((checkpoint, skipped)),
            Err(err) => skipped.push((step, format!("{err:#}"))),
        }
    }
    if skipped.is_empty() {
        bail!("{} has no checkpoint to resume from", dir.root.display());
    }
    let reasons: Vec<String> = skipped
        .iter()
        .map(|(step, why)| format!("step {step}: {why}"))
        .collect();
    bail!(
        "no checkpoint of {} loads, so the run cannot resume:\n  {}",
        dir.root.display(),
        reasons.join("\n  ")
    )
}

/// Read `checkpoints/step-N`: its league (which must record step N) and
/// every member's adapter and optimizer, each verified against its checksum.
fn load_checkpoint(step: u64, checkpoint: &Path) -> anyhow::Result<Checkpoint> {
    let league_path = checkpoint.join("league.json");
    let league: League = serde_json::from_slice(
        &std::fs::read(&league_path)
            .with_context(|| format!("reading {}", league_path.display()))?,
    )
    .with_context(|| format!("{} is corrupt", league_path.display()))?;
    if league.step != step {
        bail!(
            "{} records step {}, not {step}",
            league_path.display(),
            league.step
        );
    }
    let mut learners = BTreeMap::new();
    for (&id, info) in &league.members {
        let member_dir = checkpoint.join("members").join(&info.name);
        let learner = member::load(&member_dir)
            .with_context(|| format!("loading {}", member_dir.display()))?;
        learners.insert(id, learner);
    }
    Ok(Checkpoint {
        step,
        league,
        learners,
    })
}

/// Move each skipped checkpoint to `checkpoints/skipped-step-N` (the rerun
/// writes `step-N` afresh) and say so; the journal events that record it.
fn set_aside(dir: &RunDir, skipped: Vec<(u64, String)>) -> anyhow::Result<Vec<Event>> {
    let mut events = Vec::with_capacity(skipped.len());
    for (step, reason) in skipped {
        let from = dir.checkpoint(step);
        let to = dir.skipped_checkpoint(step);
        if to.exists() {
            std::fs::remove_dir_all(&to).with_context(|| format!("clearing {}", to.display()))?;
        }
        std::fs::rename(&from, &to)
            .with_context(|| format!("moving {} to {}", from.display(), to.display()))?;
        eprintln!(
            "checkpoint of step {step} skipped ({reason}); moved to {}",
            to.display()
        );
        let moved_to = to.strip_prefix(&dir.root).unwrap_or(&to);
        events.push(Event::CheckpointSkipped {
            step,
            reason,
            moved_to: moved_to.display().to_string(),
        });
    }
    Ok(events)
}

/// Re-execute a finished run into `DIR/replay/` and compare every step's
/// checksums with the journal; the error names the first divergence.
pub fn replay(
    root: &Path,
    adjust: impl FnOnce(&mut Scenario) -> anyhow::Result<()>,
) -> anyhow::Result<Summary> {
    let dir = RunDir::new(root);
    let mut scenario = Scenario::from_recorded_file(dir.scenario(), check_operator)?;
    adjust(&mut scenario)?;
    let recorded = journal::read(&dir.journal())?;
    let Some(end) = recorded.iter().find_map(|e| match e {
        Event::End { step, .. } => Some(*step),
        _ => None,
    }) else {
        bail!(
            "{} did not finish (no end event in its journal); `populora resume` it first",
            root.display()
        );
    };
    let out = root.join("replay");
    if out.exists() {
        std::fs::remove_dir_all(&out).with_context(|| format!("clearing {}", out.display()))?;
    }
    // The recorded seeding stage, not a new one: its checksum is compared below.
    let seeded = match SeedingConfig::of(&scenario.seeding) {
        Some(_) => Some(seeding::load(&root.join(seeding::SEEDING_FILE))?.0),
        None => None,
    };
    let summary = fresh_with(
        scenario,
        &out,
        live_commands(&recorded, |_| true),
        Some(end),
        seeded,
    )?;
    let replayed = journal::read(&RunDir::new(&out).journal())?;
    compare(&recorded, &replayed)?;
    Ok(summary)
}

/// Kill and inject commands that came over the socket, by step.
/// Kill and inject commands that came over the socket, by step. A step
/// that committed journaled every command it applied; a step lost with a
/// node journaled its commands as deferred. The deferred ones count only
/// for a step that has no other record (it has not run again yet).
fn live_commands(events: &[Event], keep: impl Fn(u64) -> bool) -> BTreeMap<u64, Vec<Command>> {
    let mut applied: BTreeMap<u64, Vec<Command>> = BTreeMap::new();
    let mut deferred: BTreeMap<u64, Vec<Command>> = BTreeMap::new();
    for e in events {
        if let Event::Control {
            step,
            command,
            source: Source::Ctl,
            outcome,
        } = e
        {
            if keep(*step) && command.changes_results() {
                let by_step = if outcome.starts_with(DEFERRED) {
                    &mut deferred
                } else {
                    &mut applied
                };
                by_step.entry(*step).or_default().push(command.clone());
            }
        }
    }
    for (step, commands) in deferred {
        applied.entry(step).or_insert(commands);
    }
    applied
}

fn step_checksums(events: &[Event]) -> Vec<(u64, &BTreeMap<String, String>)> {
    events
        .iter()
        .filter_map(|e| match e {
            Event::Step { step, checksums } => Some((*step, checksums)),
            _ => None,
        })
        .collect()
}

fn seeding_checksum(events: &[Event]) -> Option<&str> {
    events.iter().find_map(|e| match e {
        Event::Seeding { checksum, .. } => Some(checksum.as_str()),
        _ => None,
    })
}

/// The first step whose checksums differ, named (the seeding stage's
/// buffers first).
pub fn compare(recorded: &[Event], replayed: &[Event]) -> anyhow::Result<()> {
    if seeding_checksum(recorded) != seeding_checksum(replayed) {
        bail!(
            "the seeding stage's buffers differ (recorded {:?}, replayed {:?})",
            seeding_checksum(recorded),
            seeding_checksum(replayed)
        );
    }
    let (a, b) = (step_checksums(recorded), step_checksums(replayed));
    for ((step, want), (_, got)) in a.iter().zip(&b) {
        for (member, sum) in *want {
            match got.get(member) {
                Some(g) if g == sum => {}
                Some(g) => bail!("step {step}: {member} diverged (recorded {sum}, replayed {g})"),
                None => bail!("step {step}: {member} is missing from the replay"),
            }
        }
        if let Some(extra) = got.keys().find(|m| !want.contains_key(*m)) {
            bail!("step {step}: the replay has {extra}, the recording does not");
        }
    }
    if a.len() != b.len() {
        bail!(
            "the recording has {} steps, the replay {}",
            a.len(),
            b.len()
        );
    }
    Ok(())
}

/// Everything a coordinator starts from.
struct Run {
    scenario: Scenario,
    dir: RunDir,
    engine: Engine,
    league: League,
    learners: BTreeMap<MemberId, Learner>,
    scheduled: BTreeMap<u64, Vec<Command>>,
    last_step: u64,
    journal: Log,
    metrics: Log,
    unreachable: Unreachable,
}

fn launch(run: Run) -> anyhow::Result<Summary> {
    let Run {
        scenario,
        dir,
        engine,
        league,
        learners,
        scheduled,
        last_step,
        journal,
        metrics,
        unreachable,
    } = run;
    let cookie = match (&scenario.cluster.cookie_file, scenario.cluster.is_local()) {
        (_, true) => None,
        (Some(file), false) => Some(read_cookie(file)?),
        (None, false) => anyhow::bail!(
            "the scenario names worker nodes but no cookie file: set cluster.cookie_file or pass --cookie-file"
        ),
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let status = Shared::default();
        let (queue, control) = mpsc::unbounded_channel();
        let socket = dir.socket();
        control::serve(&socket, status.clone(), queue)?;
        let (done, result) = oneshot::channel();
        let args = CoordinatorArgs {
            scenario,
            dir,
            engine: Arc::new(engine),
            league,
            learners,
            scheduled,
            last_step,
            control,
            status,
            journal,
            metrics,
            cookie,
            unreachable,
            done,
        };
        let (_coordinator, handle) = Actor::spawn(None, Coordinator, args)
            .await
            .map_err(|e| anyhow::anyhow!("starting the run: {e}"))?;
        let result = result
            .await
            .unwrap_or_else(|_| Err(anyhow::anyhow!("the coordinator stopped without a result")));
        let _ = handle.await;
        let _ = std::fs::remove_file(&socket);
        result
    })
}
