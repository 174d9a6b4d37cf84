//! AZR's seeding stage (`_init_seed_dataset` in Absolute-Zero-Reasoner):
//! before any training, the base model itself, with no adapter, proposes
//! under the proposer grammars until each task kind's buffer holds
//! `entries` valid, distinct tasks, so training starts from a buffer the
//! model wrote rather than from the identity triplet alone (AZR ships
//! 256-line seed files per model).
//!
//! A round asks for `batch` proposals of every kind still short, with
//! references drawn from the buffers as they stand (the identity triplet at
//! first), validates them in the sandbox exactly as a step's proposals are
//! validated, and appends the valid ones not already held, in proposal order,
//! until the kind is full. Every stream is keyed by the seed, the round and
//! [`SEEDING_AUTHOR`], so the stage is a pure function of the seed, the
//! settings and the model: two arms of an experiment with the same seed get
//! the same buffers.

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};

use super::{judge_proposals, proposal_jobs, AcceptedTask, Error, MemberId, Result};
use super::{Grammars, Roster, Settings, StepContext, Verdict};
use crate::base::{Llama, Tokenizer};
use crate::compute::{generate_with, AdapterSet, Cost, DecodeOptions};
use crate::scenario::SeedingSection;
use crate::task::{TaskBuffers, TaskKind};
use crate::verify::VerifierPool;

/// The proposer id the seeding stage's streams are keyed by: no member has it.
pub const SEEDING_AUTHOR: MemberId = u64::MAX;

/// How the stage runs (a scenario's `[seeding]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SeedingConfig {
    /// Valid, distinct tasks each kind's buffer must hold (the identity
    /// task included). AZR: 256.
    pub entries: usize,
    /// Proposals per kind per round (one generation batch per round).
    pub batch: usize,
    /// Rounds before the stage gives up with an error naming the kinds short.
    pub max_rounds: usize,
}

impl SeedingConfig {
    /// The stage `[seeding]` describes, when it has one (`entries` > 0).
    pub fn of(section: &SeedingSection) -> Option<SeedingConfig> {
        (section.entries > 0).then_some(SeedingConfig {
            entries: section.entries,
            batch: section.batch,
            max_rounds: section.max_rounds,
        })
    }
}

/// What the stage produced: the buffers training starts from and what it cost.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Seeded {
    pub seed: u64,
    pub config: SeedingConfig,
    pub buffers: TaskBuffers,
    pub rounds: usize,
    /// Proposals generated, and how many of them were valid (duplicates
    /// and those past a full buffer included).
    pub proposals: usize,
    pub valid: usize,
    /// Generation only: reported apart from training, never matched.
    pub cost: Cost,
}

/// Runs the stage: the base `model` proposes with `settings`' prompts,
/// sampling and grammars; `pool` validates.
pub fn seed_buffers(
    seed: u64,
    settings: &Settings,
    tokenizer: &Tokenizer,
    grammars: &Grammars,
    model: &Llama,
    pool: &VerifierPool,
    config: SeedingConfig,
) -> Result<Seeded> {
    let mut seeded = Seeded {
        seed,
        config,
        buffers: TaskBuffers::seeded(),
        rounds: 0,
        proposals: 0,
        valid: 0,
        cost: Cost::default(),
    };
    let mut held: Vec<BTreeSet<String>> = TaskKind::ALL
        .iter()
        .map(|&kind| keys(&seeded.buffers, kind))
        .collect();
    let roster = Roster {
        proposers: vec![SEEDING_AUTHOR],
        ..Roster::default()
    };
    while let Some(short) = short_kinds(&seeded.buffers, settings, config.entries) {
        if seeded.rounds == config.max_rounds {
            return Err(Error::Seeding(format!(
                "after {} rounds of {} proposals per kind, {short:?} still hold fewer than {} valid, distinct tasks ({}); raise seeding.max_rounds or lower seeding.entries",
                config.max_rounds,
                config.batch,
                config.entries,
                counts(&seeded.buffers, settings),
            )));
        }
        let round_settings = Settings {
            task_kinds: short,
            proposals_per_teacher: config.batch,
            ..settings.clone()
        };
        let ctx = StepContext {
            seed,
            step: seeded.rounds as u64,
            settings: &round_settings,
            tokenizer,
            grammars,
        };
        let jobs = proposal_jobs(&ctx, &roster, &seeded.buffers)?;
        let requests = jobs
            .iter()
            .map(|j| {
                let mut request = j.request(&ctx);
                request.adapter = None;
                request
            })
            .collect();
        let options = DecodeOptions::default();
        let (generations, _) = generate_with(model, &AdapterSet::new(), requests, options)?;
        seeded.cost.add(Cost::generations(
            &model.config,
            jobs.iter()
                .zip(&generations)
                .map(|(j, g)| (None, j.tokens.as_slice(), g.tokens.len())),
        ));
        seeded.proposals += jobs.len();
        for result in judge_proposals(&ctx, jobs, generations, pool)? {
            let Verdict::Valid { task, .. } = result.verdict else {
                continue;
            };
            seeded.valid += 1;
            let kind = result.job.kind;
            let slot = TaskKind::ALL.iter().position(|&k| k == kind).unwrap_or(0);
            if seeded.buffers.len(kind) < config.entries && held[slot].insert(key(&task)) {
                push(&mut seeded.buffers, kind, task)?;
            }
        }
        seeded.rounds += 1;
    }
    Ok(seeded)
}

/// The kinds whose buffer is not full yet, in `settings`' order; `None`
/// when every one is.
fn short_kinds(
    buffers: &TaskBuffers,
    settings: &Settings,
    entries: usize,
) -> Option<Vec<TaskKind>> {
    let short: Vec<TaskKind> = settings
        .task_kinds
        .iter()
        .copied()
        .filter(|&kind| buffers.len(kind) < entries)
        .collect();
    (!short.is_empty()).then_some(short)
}

fn counts(buffers: &TaskBuffers, settings: &Settings) -> String {
    settings
        .task_kinds
        .iter()
        .map(|&kind| format!("{} {}", kind.name(), buffers.len(kind)))
        .collect::<Vec<_>>()
        .join(", ")
}

/// What makes two tasks the same: the program and its input(s).
fn key(task: &AcceptedTask) -> String {
    match task {
        AcceptedTask::Triplet(t) => format!("{}\u{0}{}", t.program, t.input),
        AcceptedTask::Induction(t) => {
            let inputs: Vec<&str> = t.pairs.iter().map(|p| p.input.as_str()).collect();
            format!("{}\u{0}{}", t.program, inputs.join("\u{0}"))
        }
    }
}

/// The keys of what `kind`'s buffer already holds.
fn keys(buffers: &TaskBuffers, kind: TaskKind) -> BTreeSet<String> {
    match buffers.triplets(kind) {
        Ok(triplets) => triplets
            .iter()
            .map(|t| key(&AcceptedTask::Triplet(t.clone())))
            .collect(),
        Err(_) => buffers
            .induction_tasks()
            .iter()
            .map(|t| key(&AcceptedTask::Induction(t.clone())))
            .collect(),
    }
}

/// Appends a seeding task, written by no member at step 0.
fn push(buffers: &mut TaskBuffers, kind: TaskKind, task: AcceptedTask) -> Result<()> {
    match task {
        AcceptedTask::Triplet(mut t) => {
            (t.author, t.step) = (None, 0);
            buffers.push_triplet(kind, t)?;
        }
        AcceptedTask::Induction(mut t) => {
            (t.author, t.step) = (None, 0);
            buffers.push_induction(t);
        }
    }
    Ok(())
}
