//! One self-play step, written once. [`play_step`] runs every phase in order
//! and leaves the work it cannot do alone (generating, judging, training) to
//! a [`StepBackend`]. [`Local`] does that work with function calls in this
//! process ([`run_step`]); the actor runtime sends it to its broker, verifier
//! and members. Both therefore run the same algorithm on the same data.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::Instant;

use super::metrics::{step_cost, StepMetrics};
use super::{
    accept, apply_update, episodes, judge_proposals, judge_solutions, problems, proposal_jobs,
    solve_jobs, train_rows, Error, MemberId, Problem, ProposalJob, ProposalResult, Result, Roster,
    SolveJob, SolveResult, StepContext,
};
use crate::base::{Llama, ModelConfig};
use crate::compute::{
    generate_with, train_step, AdapterSet, DecodeOptions, GenRequest, Generation, TrainRow,
};
use crate::lora::{AdamW, Adapter};
use crate::task::TaskBuffers;
use crate::verify::VerifierPool;

/// A member's trainable state.
#[derive(Debug)]
pub struct Learner {
    pub adapter: Adapter,
    pub optimizer: AdamW,
}

/// What training did to one member.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Trained {
    /// Response tokens it trained on.
    pub tokens: usize,
    /// Token slots its sequences ran through the train step (prompts shared,
    /// rows that add nothing skipped: [`crate::compute::TrainStats::tokens_run`]).
    #[serde(default)]
    pub tokens_run: usize,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Its adapter's checksum after the update.
    pub checksum: String,
}

/// Everything a step produced, for metrics and inspection.
#[derive(Debug)]
pub struct StepReport {
    pub metrics: StepMetrics,
    pub proposals: Vec<ProposalResult>,
    pub problems: Arc<Vec<Problem>>,
    pub solves: Vec<SolveResult>,
    pub trained: BTreeMap<MemberId, Trained>,
}

/// The work of a step that needs the model, the sandbox or a member's
/// optimizer. Each call gets the whole phase as one batch, in the step's order.
///
/// The methods are `async` so the runtime can wait on its actors; the
/// runtime calls [`play_step`] with its own backend type, where the compiler
/// checks the futures are `Send`.
#[allow(async_fn_in_trait)]
pub trait StepBackend {
    /// How the backend fails; every engine error converts into it.
    type Error: From<Error>;

    /// A phase starts: `propose`, `validate`, `solve`, `score` or `train`.
    fn enter(&mut self, _phase: &'static str) {}

    /// Every request of the phase; each names the adapter that answers it.
    async fn generate(
        &mut self,
        requests: Vec<GenRequest>,
    ) -> std::result::Result<Vec<Generation>, Self::Error>;

    async fn judge_proposals(
        &mut self,
        ctx: &StepContext<'_>,
        jobs: Vec<ProposalJob>,
        generations: Vec<Generation>,
    ) -> std::result::Result<Vec<ProposalResult>, Self::Error>;

    async fn judge_solutions(
        &mut self,
        ctx: &StepContext<'_>,
        problems: &Arc<Vec<Problem>>,
        jobs: Vec<SolveJob>,
        generations: Vec<Generation>,
    ) -> std::result::Result<Vec<SolveResult>, Self::Error>;

    /// One PPO-clip train step on `rows`, then each member's AdamW update.
    async fn train(
        &mut self,
        ctx: &StepContext<'_>,
        rows: Vec<TrainRow>,
    ) -> std::result::Result<BTreeMap<MemberId, Trained>, Self::Error>;
}

/// One complete self-play step: propose, validate, solve, score, reward,
/// TRR++, one PPO-clip train step and an AdamW update of every member that
/// trained. Deterministic in `(seed, step)` and the inputs. `model` sizes the
/// compute count.
pub async fn play_step<B: StepBackend>(
    ctx: &StepContext<'_>,
    backend: &mut B,
    roster: &Roster,
    buffers: &mut TaskBuffers,
    model: &ModelConfig,
) -> std::result::Result<StepReport, B::Error> {
    let mut clock = Clock::default();

    backend.enter("propose");
    let jobs = proposal_jobs(ctx, roster, buffers)?;
    let requests = jobs.iter().map(|j| j.request(ctx)).collect();
    let generations = backend.generate(requests).await?;
    clock.lap("propose");
    backend.enter("validate");
    let proposals = backend.judge_proposals(ctx, jobs, generations).await?;
    clock.lap("validate");
    accept(buffers, &proposals)?;

    backend.enter("solve");
    let problems = Arc::new(problems(ctx, roster, &proposals, buffers)?);
    let jobs = solve_jobs(ctx, &problems);
    let requests = jobs.iter().map(|j| j.request(ctx, &problems)).collect();
    let generations = backend.generate(requests).await?;
    clock.lap("solve");
    backend.enter("score");
    let solves = backend
        .judge_solutions(ctx, &problems, jobs, generations)
        .await?;
    clock.lap("score");

    backend.enter("train");
    let episodes = episodes(ctx.settings, &proposals, &problems, &solves);
    let batch = train_rows(ctx.settings, &episodes)?;
    let trained = backend.train(ctx, batch.rows.clone()).await?;
    clock.lap("train");

    let mut metrics = StepMetrics::measure(
        ctx.step,
        ctx.settings,
        &proposals,
        &problems,
        &solves,
        &episodes,
        &batch,
    );
    metrics.compute = step_cost(model, &proposals, &problems, &solves, &batch);
    metrics.phase_ms = clock.phase_ms;
    metrics.grad_norm = trained.iter().map(|(&id, t)| (id, t.grad_norm)).collect();
    metrics.train_tokens = trained.iter().map(|(&id, t)| (id, t.tokens)).collect();
    metrics.train_tokens_run = trained.iter().map(|(&id, t)| (id, t.tokens_run)).collect();
    Ok(StepReport {
        metrics,
        proposals,
        problems,
        solves,
        trained,
    })
}

/// [`play_step`] in this process: the model, the sandbox pool and every
/// member's adapter and optimizer at hand.
pub fn run_step(
    ctx: &StepContext,
    model: &Llama,
    pool: &VerifierPool,
    learners: &mut BTreeMap<MemberId, Learner>,
    roster: &Roster,
    buffers: &mut TaskBuffers,
) -> Result<StepReport> {
    let mut local = Local {
        model,
        pool,
        learners,
        share_prefixes: ctx.settings.train.share_prefixes,
    };
    finish_now(play_step(ctx, &mut local, roster, buffers, &model.config))
}

/// The in-process backend: every call is a plain function call.
pub struct Local<'a> {
    pub model: &'a Llama,
    pub pool: &'a VerifierPool,
    pub learners: &'a mut BTreeMap<MemberId, Learner>,
    /// Share each prompt's prefill among its rows ([`DecodeOptions`]).
    pub share_prefixes: bool,
}

impl Local<'_> {
    /// The adapters of every member, by id.
    fn adapters(&self) -> AdapterSet<'_> {
        self.learners
            .iter()
            .fold(AdapterSet::new(), |set, (&id, l)| set.with(id, &l.adapter))
    }
}

impl StepBackend for Local<'_> {
    type Error = Error;

    async fn generate(&mut self, requests: Vec<GenRequest>) -> Result<Vec<Generation>> {
        let options = DecodeOptions {
            share_prefixes: self.share_prefixes,
            ..DecodeOptions::default()
        };
        Ok(generate_with(self.model, &self.adapters(), requests, options)?.0)
    }

    async fn judge_proposals(
        &mut self,
        ctx: &StepContext<'_>,
        jobs: Vec<ProposalJob>,
        generations: Vec<Generation>,
    ) -> Result<Vec<ProposalResult>> {
        judge_proposals(ctx, jobs, generations, self.pool)
    }

    async fn judge_solutions(
        &mut self,
        ctx: &StepContext<'_>,
        problems: &Arc<Vec<Problem>>,
        jobs: Vec<SolveJob>,
        generations: Vec<Generation>,
    ) -> Result<Vec<SolveResult>> {
        judge_solutions(ctx, problems, jobs, generations, self.pool)
    }

    async fn train(
        &mut self,
        ctx: &StepContext<'_>,
        rows: Vec<TrainRow>,
    ) -> Result<BTreeMap<MemberId, Trained>> {
        let mut out = train_step(self.model, &self.adapters(), &rows, ctx.settings.train)?;
        let mut trained = BTreeMap::new();
        for (id, grads) in std::mem::take(&mut out.grads) {
            let learner = self.learners.get_mut(&id).ok_or(Error::UnknownMember(id))?;
            let report = apply_update(
                &learner.adapter,
                &mut learner.optimizer,
                grads,
                ctx.settings.grad_clip,
            )?;
            let stats = out.stats.get(&id).cloned().unwrap_or_default();
            trained.insert(
                id,
                Trained {
                    tokens: stats.tokens,
                    tokens_run: stats.tokens_run,
                    grad_norm: report.grad_norm,
                    checksum: learner.adapter.checksum()?,
                },
            );
        }
        Ok(trained)
    }
}

/// Runs a future that never waits to its end. [`Local`]'s methods are plain
/// function calls, so [`play_step`] on it completes in its first poll.
fn finish_now<F: Future>(future: F) -> F::Output {
    match pin!(future).poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(out) => out,
        Poll::Pending => unreachable!("the in-process backend never waits"),
    }
}

/// Wall time of each phase, for the metrics' `phase_ms`.
struct Clock {
    phase_ms: BTreeMap<String, f64>,
    since: Instant,
}

impl Default for Clock {
    fn default() -> Self {
        Clock {
            phase_ms: BTreeMap::new(),
            since: Instant::now(),
        }
    }
}

impl Clock {
    /// Adds the time since the last lap to `phase`.
    fn lap(&mut self, phase: &str) {
        let now = Instant::now();
        let ms = (now - self.since).as_secs_f64() * 1e3;
        *self.phase_ms.entry(phase.to_string()).or_default() += ms;
        self.since = now;
    }
}
