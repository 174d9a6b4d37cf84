//! [`run_step`]: every phase in order, in one process. The runtime runs the
//! same phases spread over its actors.

use std::collections::BTreeMap;
use std::time::Instant;

use super::metrics::{step_cost, StepMetrics};
use super::{
    accept, apply_update, episodes, judge_proposals, judge_solutions, problems, proposal_jobs,
    solve_jobs, train_rows, Error, MemberId, ProposalResult, Result, Roster, SolveResult,
    StepContext,
};
use crate::base::Llama;
use crate::compute::{generate, train_step, AdapterSet, GenRequest, Generation, TrainOutput};
use crate::lora::{AdamW, Adapter};
use crate::task::TaskBuffers;
use crate::verify::VerifierPool;

/// A member's trainable state.
#[derive(Debug)]
pub struct Learner {
    pub adapter: Adapter,
    pub optimizer: AdamW,
}

/// Everything a step produced, for metrics and inspection.
#[derive(Debug)]
pub struct StepReport {
    pub metrics: StepMetrics,
    pub proposals: Vec<ProposalResult>,
    pub solves: Vec<SolveResult>,
    pub train: TrainOutput,
}

/// Times phases into the metrics' `phase_ms`.
struct Clock {
    phase_ms: BTreeMap<String, f64>,
}

impl Clock {
    fn time<T>(&mut self, phase: &str, f: impl FnOnce() -> T) -> T {
        let start = Instant::now();
        let out = f();
        *self.phase_ms.entry(phase.to_string()).or_default() += start.elapsed().as_secs_f64() * 1e3;
        out
    }
}

/// One complete self-play step: propose, validate, solve, score, reward,
/// TRR++, one PPO-clip train step and an AdamW update of every member that
/// trained. Deterministic in `(seed, step)` and the inputs.
pub fn run_step(
    ctx: &StepContext,
    model: &Llama,
    pool: &VerifierPool,
    learners: &mut BTreeMap<MemberId, Learner>,
    roster: &Roster,
    buffers: &mut TaskBuffers,
) -> Result<StepReport> {
    let mut clock = Clock {
        phase_ms: BTreeMap::new(),
    };
    let adapters = adapter_set(learners, roster)?;
    let generate_all = |requests: Vec<GenRequest>| -> Result<Vec<Generation>> {
        Ok(generate(model, &adapters, requests)?)
    };

    let jobs = proposal_jobs(ctx, roster, buffers)?;
    let requests = jobs.iter().map(|j| j.request(ctx)).collect();
    let generations = clock.time("propose", || generate_all(requests))?;
    let proposals = clock.time("validate", || judge_proposals(ctx, jobs, generations, pool))?;
    accept(buffers, &proposals)?;

    let problems = problems(ctx, roster, &proposals, buffers)?;
    let jobs = solve_jobs(ctx, &problems);
    let requests = jobs.iter().map(|j| j.request(ctx, &problems)).collect();
    let generations = clock.time("solve", || generate_all(requests))?;
    let solves = clock.time("score", || {
        judge_solutions(ctx, &problems, jobs, generations, pool)
    })?;

    let episodes = episodes(ctx.settings, &proposals, &problems, &solves);
    let batch = train_rows(ctx.settings, &episodes)?;
    let train = clock.time("train", || {
        train_step(model, &adapters, &batch.rows, ctx.settings.train)
    })?;
    drop(adapters);
    let mut grad_norm = BTreeMap::new();
    clock.time("train", || -> Result<()> {
        for (&id, grads) in &train.grads {
            let learner = learners.get_mut(&id).ok_or(Error::UnknownMember(id))?;
            let report = apply_update(
                &learner.adapter,
                &mut learner.optimizer,
                grads.clone(),
                ctx.settings.grad_clip,
            )?;
            grad_norm.insert(id, report.grad_norm);
        }
        Ok(())
    })?;

    let mut metrics = StepMetrics::measure(
        ctx.step,
        ctx.settings,
        &proposals,
        &problems,
        &solves,
        &episodes,
        &batch,
    );
    metrics.compute = step_cost(&model.config, &proposals, &problems, &solves, &batch);
    metrics.phase_ms = clock.phase_ms;
    metrics.grad_norm = grad_norm;
    metrics.train_tokens = train.stats.iter().map(|(&id, s)| (id, s.tokens)).collect();
    Ok(StepReport {
        metrics,
        proposals,
        solves,
        train,
    })
}

/// The adapters of every member in the roster.
fn adapter_set<'a>(
    learners: &'a BTreeMap<MemberId, Learner>,
    roster: &Roster,
) -> Result<AdapterSet<'a>> {
    roster
        .members()
        .into_iter()
        .try_fold(AdapterSet::new(), |set, id| {
            let learner = learners.get(&id).ok_or(Error::UnknownMember(id))?;
            Ok(set.with(id, &learner.adapter))
        })
}
