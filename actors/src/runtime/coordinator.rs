//! The `Coordinator`: the step loop. Each step is a sequence of phases with
//! barriers — evolve (at the start of step E + 1, 2E + 1, ...) → commands →
//! match → propose → validate → solve → score → reward → train → rate →
//! checkpoint — and commits (journal, metrics, checkpoint) only when every
//! phase succeeded. Evolution opens a step rather than closing one, so that
//! a run that ends (its last step, `ctl stop`, its budget) is evaluated as
//! it trained: no offspring without an update, no member lost unseen. A member that dies
//! mid-step is restarted from the step's starting snapshot, every other
//! member is rolled back to it, and the step runs again: all randomness is
//! keyed by (seed, step, purpose), so the retry gives the same result.
//! More than `MAX_RESTARTS` restarts within `RESTART_WINDOW` stop the run
//! cleanly with a checkpoint of the last good step.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use populora::compute::{Cost, GenRequest, Generation, TrainRow};
use populora::rating::{match_teachers, record_problem, MatchConfig, Player, TrueSkillConfig};
use populora::run_files::WireBytes;
use populora::scenario::{EventAction, Mode, Role, Scenario};
use populora::selfplay::{
    self, play_step, Learner, MemberId, Problem, ProposalJob, ProposalResult, Roster, SolveJob,
    SolveResult, StepBackend, StepContext, StepMetrics, Trained,
};
use ractor::{Actor, ActorProcessingErr, ActorRef, SupervisionEvent};
use serde::Serialize;
use tokio::sync::{mpsc, oneshot};

use super::cluster::{self, Unreachable};
use super::control::{Command, LiveStatus, Shared};
use super::engine::Engine;
use super::evolution::{Contender, Evolution, EvolutionArgs, EvolutionMsg, Newborn};
use super::journal::{Event, Log, Source};
use super::league::League;
use super::member;
use super::rundir::RunDir;
use super::site::{LocalSite, Sites};
use super::verifier::{Verifier, VerifierArgs, VerifierMsg};
use super::{ask, StepError};

/// Restart intensity: more than this many member restarts ...
const MAX_RESTARTS: usize = 3;
/// ... within this window stop the run.
const RESTART_WINDOW: Duration = Duration::from_secs(60);

/// How a run ended.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    pub steps: u64,
    /// Ended before its last step: stopped, or its compute budget spent.
    pub stopped_early: bool,
    pub budget_reached: bool,
    /// Compute spent over the whole run.
    pub spent: Cost,
    pub checksums: BTreeMap<String, String>,
    pub wall_s: f64,
}

pub struct CoordinatorArgs {
    pub scenario: Scenario,
    pub dir: RunDir,
    pub engine: Arc<Engine>,
    pub league: League,
    pub learners: BTreeMap<MemberId, Learner>,
    /// Commands to apply at given steps (replay and resume), beside the scenario's events.
    pub scheduled: BTreeMap<u64, Vec<Command>>,
    /// Run no further than this step (replay stops where the original stopped).
    pub last_step: u64,
    pub control: mpsc::UnboundedReceiver<Command>,
    pub status: Shared,
    pub journal: Log,
    pub metrics: Log,
    /// The cluster's cookie (needed when the scenario names nodes).
    pub cookie: Option<String>,
    /// Whether a node that does not answer is an error or left out.
    pub unreachable: Unreachable,
    pub done: oneshot::Sender<anyhow::Result<Summary>>,
}

#[derive(ractor_cluster::RactorMessage)]
pub enum CoordinatorMsg {
    /// Start every member on its site (first).
    Place,
    Step,
}

pub struct Coordinator;

pub struct State {
    args: CoordinatorArgs,
    done: Option<oneshot::Sender<anyhow::Result<Summary>>>,
    /// Where each member runs: this process, or worker nodes.
    sites: Sites,
    /// Wire bytes (sent, received) at the last metrics line.
    traffic_mark: (u64, u64),
    verifier: ActorRef<VerifierMsg>,
    evolution: ActorRef<EvolutionMsg>,
    restarts: VecDeque<Instant>,
    paused: bool,
    stop: bool,
    started: Instant,
    step_times: Vec<f64>,
}

type StepResult<T> = Result<T, StepError>;

impl Actor for Coordinator {
    type Msg = CoordinatorMsg;
    type State = State;
    type Arguments = CoordinatorArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<CoordinatorMsg>,
        mut args: CoordinatorArgs,
    ) -> Result<State, ActorProcessingErr> {
        let engine = args.engine.clone();
        let cell = myself.get_cell();
        let sites = match &args.cookie {
            None => Sites::local(LocalSite::start(&engine, cell.clone()).await?),
            Some(cookie) => {
                let cookie = cookie.clone();
                let cluster =
                    cluster::connect(&args.scenario, &engine, cookie, args.unreachable).await?;
                if cluster.links.is_empty() {
                    eprintln!("no worker node is up: every member runs in this process");
                    Sites::fallback(LocalSite::start(&engine, cell.clone()).await?, cluster)
                } else {
                    Sites::nodes(cluster, args.scenario.cluster.clone())
                }
            }
        };
        let (verifier, _) = Actor::spawn_linked(
            None,
            Verifier,
            VerifierArgs {
                sandbox: engine.sandbox.clone(),
                seed: args.scenario.seed,
                tokenizer: engine.tokenizer.clone(),
                settings: engine.settings.clone(),
                grammars: engine.grammars.clone(),
            },
            cell.clone(),
        )
        .await?;
        let (evolution, _) = Actor::spawn_linked(
            None,
            Evolution,
            EvolutionArgs {
                seed: args.scenario.seed,
                config: args.scenario.evolution.clone(),
                adamw: engine.adamw,
            },
            cell.clone(),
        )
        .await?;
        let done = Some(std::mem::replace(&mut args.done, oneshot::channel().0));
        let state = State {
            args,
            done,
            sites,
            traffic_mark: (0, 0),
            verifier,
            evolution,
            restarts: VecDeque::new(),
            paused: false,
            stop: false,
            started: Instant::now(),
            step_times: Vec::new(),
        };
        publish(&state, "ready");
        Ok(state)
    }

    async fn post_start(
        &self,
        myself: ActorRef<CoordinatorMsg>,
        _state: &mut State,
    ) -> Result<(), ActorProcessingErr> {
        myself.cast(CoordinatorMsg::Place)?;
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<CoordinatorMsg>,
        msg: CoordinatorMsg,
        state: &mut State,
    ) -> Result<(), ActorProcessingErr> {
        let result = match msg {
            // Placing reaches the nodes: a node lost here ends the run as a
            // lost node (through `done`), which a start-up error could not.
            CoordinatorMsg::Place => place_all(state).await.map(|()| true),
            CoordinatorMsg::Step => step(state).await,
        };
        match result {
            Ok(true) => myself.cast(CoordinatorMsg::Step)?,
            Ok(false) => finish(&myself, state, Ok(())).await,
            Err(e) => finish(&myself, state, Err(e)).await,
        }
        Ok(())
    }

    /// Members that die are restarted by the step loop; never stop because a
    /// child stopped (ractor's default handler would).
    async fn handle_supervisor_evt(
        &self,
        _myself: ActorRef<CoordinatorMsg>,
        event: SupervisionEvent,
        _state: &mut State,
    ) -> Result<(), ActorProcessingErr> {
        if let SupervisionEvent::ActorFailed(who, why) = event {
            eprintln!("supervisor: actor {} failed: {why}", who.get_id());
        }
        Ok(())
    }
}

/// Start the run's members where they run, journal the layout, and on
/// nodes write a checkpoint if there is none (a node lost before the first
/// one sends the run back to it).
async fn place_all(state: &mut State) -> anyhow::Result<()> {
    let s = state.args.league.step;
    let learners = std::mem::take(&mut state.args.learners);
    if !state.args.scenario.cluster.is_local() && state.args.dir.latest_checkpoint()?.is_none() {
        let aside = Checkpoint::begin(state)?;
        for (&id, learner) in &learners {
            aside.save(state, id, learner)?;
        }
        aside.finish(state)?;
    }
    for (id, learner) in learners {
        spawn_member(state, id, learner)
            .await
            .map_err(|e| into_anyhow(e, s))?;
    }
    journal_layout(state)
}

async fn spawn_member(state: &mut State, id: MemberId, learner: Learner) -> StepResult<()> {
    let name = state.args.league.name(id);
    state.sites.place(id, &name, learner).await
}

/// A run on nodes journals where each member runs (and which nodes are down).
fn journal_layout(state: &mut State) -> anyhow::Result<()> {
    if state.args.scenario.cluster.is_local() {
        return Ok(());
    }
    let league = &state.args.league;
    let members = league
        .members
        .keys()
        .map(|&id| {
            let node = state.sites.node_of(id).unwrap_or("local").to_string();
            (league.name(id), node)
        })
        .collect();
    state.args.journal.append(&Event::Layout {
        step: league.step,
        members,
        down: state.sites.down(),
    })?;
    Ok(())
}

/// A step error of step `s` as the run's error; a lost node stays a
/// [`super::NodeLost`] (the caller resumes on the nodes still up).
fn into_anyhow(e: StepError, s: u64) -> anyhow::Error {
    match e {
        StepError::Died(d) => anyhow::anyhow!(d.message),
        StepError::NodeLost(n) => anyhow::Error::new(super::NodeLost { step: s, ..n }),
        StepError::Fatal(e) => e,
    }
}

fn publish(state: &State, phase: &str) {
    let league = &state.args.league;
    let status = LiveStatus {
        step: league.step,
        steps: state.args.last_step,
        phase: phase.to_string(),
        paused: state.paused,
        solo: state.args.scenario.population.mode == Mode::Solo,
        students_per_teacher: state.args.scenario.population.students_per_teacher,
        proposals_per_teacher: state.args.scenario.selfplay.proposals_per_teacher,
        members: league.entries(),
        nodes: state.sites.status(|id| league.name(id)),
    };
    *state.args.status.lock().unwrap_or_else(|p| p.into_inner()) = status;
    super::progress::phase(
        league.step + 1,
        state.args.last_step,
        phase,
        &state.step_times,
    );
}

/// Run the next step (with retries); `Ok(false)` when the run is over.
async fn step(state: &mut State) -> anyhow::Result<bool> {
    let s = state.args.league.step + 1;
    if s > state.args.last_step || state.stop || budget_spent(state) {
        return Ok(false);
    }
    let commands = gather_commands(state, s).await;
    if state.stop {
        return Ok(false);
    }
    let result = run_step(state, s, &commands).await;
    if let Some(lost) = result
        .as_ref()
        .err()
        .and_then(|e| e.downcast_ref::<super::NodeLost>())
    {
        defer_commands(state, s, &commands, lost)?;
    }
    result.map(|()| true)
}

/// Step `s` with its commands, retried while members die and restart.
async fn run_step(state: &mut State, s: u64, commands: &[(Command, Source)]) -> anyhow::Result<()> {
    let started = Instant::now();
    let before = state.args.league.clone();
    state.sites.keep().await.map_err(|e| into_anyhow(e, s))?;
    loop {
        match attempt(state, s, commands).await {
            Ok(outcome) => return commit(state, s, outcome, started).await,
            Err(StepError::Fatal(e)) => return Err(e.context(format!("step {s}"))),
            Err(StepError::NodeLost(lost)) => {
                return Err(into_anyhow(StepError::NodeLost(lost), s));
            }
            Err(StepError::Died(died)) => {
                state.args.league = before.clone();
                state.sites.restore().await.map_err(|e| into_anyhow(e, s))?;
                let now = Instant::now();
                state.restarts.push_back(now);
                while state
                    .restarts
                    .front()
                    .is_some_and(|t| now - *t > RESTART_WINDOW)
                {
                    state.restarts.pop_front();
                }
                let give_up = state.restarts.len() > MAX_RESTARTS;
                let action = if give_up {
                    "stopped"
                } else {
                    "restarted; step retried"
                };
                state.args.journal.append(&Event::Fault {
                    step: s,
                    member: died.member.clone(),
                    message: died.message.clone(),
                    action: action.into(),
                })?;
                eprintln!("step {s}: {}; {action}", died.message);
                if give_up {
                    checkpoint(state).await?;
                    anyhow::bail!(
                        "more than {MAX_RESTARTS} restarts within {}s ({}); stopped after step {} with a checkpoint — `populora resume` continues",
                        RESTART_WINDOW.as_secs(),
                        died.message,
                        s - 1
                    );
                }
            }
        }
    }
}

/// The live commands of step `s`, lost with a node, and those that arrived
/// since (due at `s + 1`): journaled as deferred, so the resume that follows
/// (which reads them back) applies them at their steps.
fn defer_commands(
    state: &mut State,
    s: u64,
    commands: &[(Command, Source)],
    lost: &super::NodeLost,
) -> anyhow::Result<()> {
    let mut deferred: Vec<(u64, Command)> = commands
        .iter()
        .filter(|(_, source)| *source == Source::Ctl)
        .map(|(c, _)| (s, c.clone()))
        .collect();
    while let Ok(c) = state.args.control.try_recv() {
        if c.changes_results() {
            deferred.push((s + 1, c));
        }
    }
    for (step, command) in deferred {
        state.args.journal.append(&Event::Control {
            step,
            command,
            source: Source::Ctl,
            outcome: format!("{DEFERRED}: node {} was lost", lost.node),
        })?;
    }
    Ok(())
}

/// How a deferred command's `outcome` begins (replay and resume read it).
pub const DEFERRED: &str = "deferred";

/// Whether the run has spent its compute budget (`budget_tflop`): it ends
/// at the first step boundary at or past it. The boundary nearest the
/// budget, this one or the one before, is journaled as the budget's
/// compute mark ([`compute_marks`]).
fn budget_spent(state: &State) -> bool {
    let budget = state.args.scenario.budget_tflop;
    budget.is_some_and(|tflop| state.args.league.spent.flops >= tflop * 1e12)
}

/// The run's compute marks in TFLOP: `checkpoint.at_tflop`, smallest first,
/// then `budget_tflop`.
fn mark_targets(scenario: &Scenario) -> Vec<f64> {
    let mut marks = scenario.checkpoint.at_tflop.clone();
    marks.sort_by(f64::total_cmp);
    marks.extend(scenario.budget_tflop);
    marks
}

/// Compute marks are chosen after the fact: a step boundary from which one
/// step like the largest so far could cross a mark's target is checkpointed
/// (`Near`); the boundary at or past the target then journals the mark at
/// whichever of itself and the boundary before it (when that one was
/// checkpointed) is nearer the target (`Crossed`). What step `s`, just
/// committed, is to each pending mark; whether it must be checkpointed.
fn compute_marks(state: &mut State, s: u64) -> anyhow::Result<bool> {
    let league = &mut state.args.league;
    if league.last_spent.flops > league.largest_step.flops {
        league.largest_step = league.last_spent;
    }
    let targets = mark_targets(&state.args.scenario);
    let mut checkpoint = false;
    while let Some(&target) = targets.get(state.args.league.marks_passed) {
        let league = &state.args.league;
        let (spent, reach) = (league.spent.flops, league.largest_step.flops);
        let target_flops = target * 1e12;
        if spent < target_flops {
            checkpoint |= spent + reach >= target_flops;
            break;
        }
        let before = league.spent_before.flops;
        let kept_before = s > 1 && state.args.dir.checkpoint(s - 1).is_dir();
        let (step, at) = match kept_before && target_flops - before < spent - target_flops {
            true => (s - 1, before),
            false => (s, spent),
        };
        state.args.journal.append(&Event::ComputeMark {
            step,
            target_tflop: target,
            spent_tflop: at / 1e12,
        })?;
        state.args.league.marks_passed += 1;
        checkpoint = true;
    }
    Ok(checkpoint)
}

/// Commands for step `s`: the scenario's events, scheduled ones (replay,
/// resume), then live ones in arrival order. Waits here while paused.
async fn gather_commands(state: &mut State, s: u64) -> Vec<(Command, Source)> {
    let mut commands: Vec<(Command, Source)> = state
        .args
        .scenario
        .events
        .iter()
        .filter(|e| e.at == s)
        .map(|e| (scripted(&e.action), Source::Scenario))
        .collect();
    if let Some(scheduled) = state.args.scheduled.remove(&s) {
        commands.extend(scheduled.into_iter().map(|c| (c, Source::Ctl)));
    }
    loop {
        while let Ok(c) = state.args.control.try_recv() {
            route(state, c, &mut commands);
        }
        if !state.paused || state.stop {
            return commands;
        }
        publish(state, "paused");
        match state.args.control.recv().await {
            Some(c) => route(state, c, &mut commands),
            None => state.paused = false,
        }
    }
}

fn scripted(action: &EventAction) -> Command {
    match action {
        EventAction::Kill(member) => Command::Kill {
            member: member.clone(),
        },
        EventAction::Inject(i) => Command::Inject {
            role: i.role,
            from: i.from.clone().unwrap_or_default(),
            op: i.op.clone(),
        },
    }
}

/// Pause, resume and stop act on the loop; kill and inject wait for the step.
fn route(state: &mut State, command: Command, commands: &mut Vec<(Command, Source)>) {
    match command {
        Command::Pause => state.paused = true,
        Command::Resume => state.paused = false,
        Command::Stop => state.stop = true,
        Command::Status => {}
        other => commands.push((other, Source::Ctl)),
    }
}

/// What a successful step attempt produced, written at commit.
struct Outcome {
    events: Vec<Event>,
    metrics: StepMetrics,
}

async fn attempt(state: &mut State, s: u64, commands: &[(Command, Source)]) -> StepResult<Outcome> {
    let engine = state.args.engine.clone();
    let ctx = StepContext {
        seed: state.args.scenario.seed,
        step: s,
        settings: &engine.settings,
        tokenizer: &engine.tokenizer,
        grammars: &engine.grammars,
    };
    let mut events = Vec::new();
    // Evolution before the step's commands: it ranks the population as the
    // last step left it (`league.step` is still s − 1, so fitness is the one
    // that step's metrics line reported), whatever commands arrived, and an
    // injected member is never ranked, or culled, before it has played a
    // step. A kill or inject naming a member culled here is refused and
    // journaled like any command naming a member that is gone. The journal
    // keeps that order: culls and spawns, then the commands, then the step.
    let evolve_ms = if evolves_before(&state.args.scenario, s) {
        publish(state, "evolve");
        let start = Instant::now();
        evolve(state, s, &mut events).await?;
        Some(start.elapsed().as_secs_f64() * 1e3)
    } else {
        None
    };
    state.args.league.step = s;
    for (command, source) in commands {
        apply_command(state, s, command, *source, &mut events).await?;
    }

    let roster = roster(state, s)?;
    let mut buffers = std::mem::take(&mut state.args.league.buffers);
    let played = play_step(
        &ctx,
        &mut Actors { state, step: s },
        &roster,
        &mut buffers,
        &engine.model.config,
    )
    .await;
    state.args.league.buffers = buffers;
    let report = played?;
    let mut metrics = report.metrics;
    let league = &mut state.args.league;
    for (&id, trained) in &report.trained {
        league.checksums.insert(id, trained.checksum.clone());
    }
    league.spent_before = league.spent;
    league.spent.add(metrics.compute);
    league.last_spent = metrics.compute;
    for (&id, &reward) in &metrics.member_reward {
        league.rewards.entry(id).or_default().push((s, reward));
    }
    rate(league, &report.problems, &report.solves)?;
    if let Some(ms) = evolve_ms {
        metrics.phase_ms.insert("evolve".into(), ms);
    }
    // The brokers' own compute time: how much of the step the models were busy.
    let usage = state.sites.usage().await?;
    metrics
        .phase_ms
        .insert("compute".into(), usage.generate_ms + usage.train_ms);
    Ok(Outcome { events, metrics })
}

/// Whether step `s` starts with evolution: every `every` steps, between
/// steps and never after the last one (step 1 has nothing to rank). A run
/// resumed from the checkpoint after step k·every evolves once, here, before
/// step k·every + 1, as the uninterrupted run did.
fn evolves_before(scenario: &Scenario, s: u64) -> bool {
    let evolution = &scenario.evolution;
    evolution.enabled && s > 1 && (s - 1).is_multiple_of(evolution.every)
}

/// The runtime's side of [`play_step`]: the sites' brokers generate and
/// train, the verifier judges, and each member applies its own update.
struct Actors<'a> {
    state: &'a mut State,
    step: u64,
}

impl StepBackend for Actors<'_> {
    type Error = StepError;

    fn enter(&mut self, phase: &'static str) {
        publish(self.state, phase);
    }

    async fn generate(&mut self, requests: Vec<GenRequest>) -> StepResult<Vec<Generation>> {
        self.state.sites.generate(requests).await
    }

    async fn judge_proposals(
        &mut self,
        _ctx: &StepContext<'_>,
        jobs: Vec<ProposalJob>,
        generations: Vec<Generation>,
    ) -> StepResult<Vec<ProposalResult>> {
        let step = self.step;
        Ok(ask(&self.state.verifier, |reply| VerifierMsg::Proposals {
            step,
            jobs,
            generations,
            reply,
        })
        .await??)
    }

    async fn judge_solutions(
        &mut self,
        _ctx: &StepContext<'_>,
        problems: &Arc<Vec<Problem>>,
        jobs: Vec<SolveJob>,
        generations: Vec<Generation>,
    ) -> StepResult<Vec<SolveResult>> {
        let step = self.step;
        Ok(ask(&self.state.verifier, |reply| VerifierMsg::Solutions {
            step,
            problems: problems.clone(),
            jobs,
            generations,
            reply,
        })
        .await??)
    }

    async fn train(
        &mut self,
        _ctx: &StepContext<'_>,
        rows: Vec<TrainRow>,
    ) -> StepResult<BTreeMap<MemberId, Trained>> {
        self.state.sites.train(self.step, rows).await
    }
}

fn trueskill() -> TrueSkillConfig {
    TrueSkillConfig::default()
}

/// Who solves whose problems: the solo member its own; in a population each
/// teacher its near-balanced matched students from other sub-populations.
fn roster(state: &State, s: u64) -> anyhow::Result<Roster> {
    let league = &state.args.league;
    if state.args.scenario.population.mode == Mode::Solo {
        let id = *league
            .members
            .keys()
            .next()
            .context("the solo member is gone")?;
        return Ok(Roster::solo(id));
    }
    let players = |part: Role| -> Vec<Player> {
        league
            .ids(|m| m.role == part)
            .into_iter()
            .map(|id| Player {
                id: league.name(id),
                subpop: league.members[&id].subpop,
                rating: league.ratings[&id],
            })
            .collect()
    };
    let (teachers, students) = (players(Role::Teacher), players(Role::Student));
    let config = MatchConfig {
        trueskill: trueskill(),
        ..MatchConfig::default()
    };
    let mut rng = populora::keyed_stream!(state.args.scenario.seed, "match", s);
    let per_teacher = state.args.scenario.population.students_per_teacher;
    let pairings = match_teachers(&teachers, &students, per_teacher, &config, &mut rng)
        .context("matching teachers with students")?;
    let id_of = |name: &str| league.by_name(name).context("matched member vanished");
    let mut matches = BTreeMap::new();
    for p in pairings {
        let students = p
            .students
            .iter()
            .map(|n| id_of(n))
            .collect::<anyhow::Result<Vec<_>>>()?;
        matches.insert(id_of(&p.teacher)?, students);
    }
    Ok(Roster {
        proposers: league.ids(|m| m.role == Role::Teacher),
        matches,
        solvers: league.ids(|m| m.role == Role::Student),
    })
}

/// TrueSkill: a teacher wins each attempt its matched student fails.
fn rate(
    league: &mut League,
    problems: &[Problem],
    solves: &[selfplay::SolveResult],
) -> anyhow::Result<()> {
    let mut tally: BTreeMap<(MemberId, MemberId), (usize, usize)> = BTreeMap::new();
    for r in solves {
        let Some(teacher) = problems[r.job.problem].author else {
            continue;
        };
        if teacher == r.job.solver {
            continue;
        }
        let t = tally.entry((teacher, r.job.solver)).or_default();
        t.0 += usize::from(r.outcome.is_correct());
        t.1 += 1;
    }
    let cfg = trueskill();
    for ((teacher, student), (solved, attempts)) in tally {
        let (Some(mut t), Some(mut st)) = (
            league.ratings.get(&teacher).copied(),
            league.ratings.get(&student).copied(),
        ) else {
            continue;
        };
        record_problem(&mut t, &mut st, solved, attempts, &cfg)?;
        league.ratings.insert(teacher, t);
        league.ratings.insert(student, st);
    }
    Ok(())
}

/// Snapshots of the members of `part`, with their fitness, for evolution.
async fn contenders(state: &State, part: Role) -> StepResult<Vec<Contender>> {
    let league = &state.args.league;
    let evolution = &state.args.scenario.evolution;
    let mut out = Vec::new();
    for id in league.ids(|m| m.role == part) {
        let name = league.name(id);
        let learner = state.sites.learner(id).await?;
        out.push(Contender {
            id,
            name,
            subpop: league.members[&id].subpop,
            fitness: league.fitness(id, evolution.fitness, evolution.fitness_window),
            learner,
        });
    }
    Ok(out)
}

async fn evolve(state: &mut State, s: u64, events: &mut Vec<Event>) -> StepResult<()> {
    for part in [Role::Teacher, Role::Student] {
        let contenders = contenders(state, part).await?;
        let plan = ask(&state.evolution, |reply| EvolutionMsg::Evolve {
            step: s,
            label: part.as_str().to_string(),
            contenders,
            reply,
        })
        .await??;
        for (id, fitness) in plan.culled {
            events.push(Event::Cull {
                step: s,
                id: state.args.league.name(id),
                fitness,
            });
            remove_member(state, id).await;
        }
        for child in plan.born {
            let event = add_member(state, s, part, child).await?;
            events.push(event);
        }
    }
    Ok(())
}

async fn remove_member(state: &mut State, id: MemberId) {
    state.sites.remove(id).await;
    state.args.league.remove(id);
}

async fn add_member(state: &mut State, s: u64, part: Role, child: Newborn) -> StepResult<Event> {
    let fresh = trueskill();
    let rating = populora::rating::Rating::fresh(&fresh);
    let id = state
        .args
        .league
        .add(part, child.subpop, s, child.parents.clone(), rating);
    let checksum = child
        .learner
        .adapter
        .checksum()
        .map_err(anyhow::Error::from)?;
    state.args.league.checksums.insert(id, checksum);
    spawn_member(state, id, child.learner).await?;
    Ok(Event::Spawn {
        step: s,
        id: state.args.league.name(id),
        role: part.as_str().to_string(),
        subpop: child.subpop,
        parents: child.parents,
        operators: child.operators,
        node: state.sites.node_of(id).map(str::to_string),
        optimizer: Some(child.optimizer),
    })
}

/// Apply a kill or inject at the start of step `s` (refused ones are journaled too).
async fn apply_command(
    state: &mut State,
    s: u64,
    command: &Command,
    source: Source,
    events: &mut Vec<Event>,
) -> StepResult<()> {
    let now = LiveStatus {
        step: s - 1,
        steps: state.args.last_step,
        solo: state.args.scenario.population.mode == Mode::Solo,
        students_per_teacher: state.args.scenario.population.students_per_teacher,
        proposals_per_teacher: state.args.scenario.selfplay.proposals_per_teacher,
        members: state.args.league.entries(),
        ..LiveStatus::default()
    };
    let checked = super::control::check(command, &now);
    let outcome = match &checked {
        Ok(_) => "applied".to_string(),
        Err(why) => format!("refused: {why}"),
    };
    events.push(Event::Control {
        step: s,
        command: command.clone(),
        source,
        outcome,
    });
    if checked.is_err() {
        return Ok(());
    }
    match command {
        Command::Kill { member } => {
            if let Some(id) = state.args.league.by_name(member) {
                remove_member(state, id).await;
                events.push(Event::Kill {
                    step: s,
                    id: member.clone(),
                });
            }
        }
        Command::Inject { role, from, op } => {
            let part = *role;
            let contenders = contenders(state, part).await?;
            let from: Vec<MemberId> = from
                .iter()
                .filter_map(|n| state.args.league.by_name(n))
                .collect();
            let subpop = state
                .args
                .league
                .smallest_subpop(part, state.args.scenario.population.subpopulations);
            let child = ask(&state.evolution, |reply| EvolutionMsg::Inject {
                step: s,
                label: format!("{}-{}", part.as_str(), events.len()),
                contenders,
                from,
                op: op.clone(),
                subpop,
                reply,
            })
            .await??;
            let event = add_member(state, s, part, child).await?;
            events.push(event);
        }
        _ => {}
    }
    Ok(())
}

/// Write the step: journal events and checksums, the metrics line, the
/// checkpoint when due, and the one-line summary.
async fn commit(
    state: &mut State,
    s: u64,
    outcome: Outcome,
    started: Instant,
) -> anyhow::Result<()> {
    for event in &outcome.events {
        state.args.journal.append(event)?;
    }
    state.args.journal.append(&Event::Step {
        step: s,
        checksums: state.args.league.checksums_by_name(),
    })?;
    let wall_ms = started.elapsed().as_secs_f64() * 1e3;
    let wire = wire_bytes(state);
    let line = super::metrics::line(
        &state.args.league,
        &state.args.scenario,
        &outcome.metrics,
        wall_ms,
        wire,
    );
    state.args.metrics.append(&line)?;
    state.step_times.push(wall_ms / 1e3);
    let marked = compute_marks(state, s)?;
    if marked || s.is_multiple_of(state.args.scenario.checkpoint.every) || s == state.args.last_step
    {
        checkpoint(state).await?;
        if s < state.args.last_step {
            rejoin(state, s).await?;
        }
    }
    super::progress::summary(&line, state.args.last_step);
    Ok(())
}

/// A node that was left out and now joins (a full handshake) ends this
/// launch at the checkpoint just written (as a [`super::NodeBack`]); the run
/// resumes from it with the node.
async fn rejoin(state: &mut State, s: u64) -> anyhow::Result<()> {
    match state.sites.rejoined().await {
        Some(node) => Err(anyhow::Error::new(super::NodeBack { node, step: s })),
        None => Ok(()),
    }
}

/// What crossed the wire to nodes since the last metrics line (the last
/// step's checkpoint and this step's retries included); `None` without nodes.
fn wire_bytes(state: &mut State) -> Option<WireBytes> {
    let (sent, received) = state.sites.traffic();
    let (sent0, received0) = std::mem::replace(&mut state.traffic_mark, (sent, received));
    (!state.args.scenario.cluster.is_local()).then_some(WireBytes {
        sent: sent - sent0,
        received: received - received0,
    })
}

/// Save the league and every member under `checkpoints/step-N` (written
/// aside, then renamed into place) and refresh `members/<id>/`. Members are
/// fetched one at a time, so the coordinator never holds them all.
async fn checkpoint(state: &mut State) -> anyhow::Result<()> {
    let s = state.args.league.step;
    let aside = Checkpoint::begin(state)?;
    for id in state
        .args
        .league
        .members
        .keys()
        .copied()
        .collect::<Vec<_>>()
    {
        let learner = state
            .sites
            .learner(id)
            .await
            .map_err(|e| into_anyhow(e, s))?;
        aside.save(state, id, &learner)?;
    }
    aside.finish(state)
}

/// A checkpoint being written: `checkpoints/.tmp-step-N` until it is complete.
struct Checkpoint {
    tmp: std::path::PathBuf,
}

impl Checkpoint {
    fn begin(state: &State) -> anyhow::Result<Checkpoint> {
        let s = state.args.league.step;
        let tmp = state
            .args
            .dir
            .checkpoints()
            .join(format!(".tmp-step-{s:06}"));
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir_all(tmp.join("members"))?;
        let mut league = state.args.league.clone();
        league.journal_lines = state.args.journal.lines + 1;
        league.metrics_lines = state.args.metrics.lines;
        std::fs::write(tmp.join("league.json"), serde_json::to_vec_pretty(&league)?)?;
        Ok(Checkpoint { tmp })
    }

    /// Member `id` into the checkpoint and into `members/<id>/`.
    fn save(&self, state: &State, id: MemberId, learner: &Learner) -> anyhow::Result<()> {
        let name = state.args.league.name(id);
        let live = state.args.dir.members().join(&name);
        for target in [self.tmp.join("members").join(&name), live] {
            let _ = std::fs::remove_dir_all(&target);
            member::save(learner, &target, &state.args.engine.base)?;
        }
        Ok(())
    }

    fn finish(self, state: &mut State) -> anyhow::Result<()> {
        let s = state.args.league.step;
        let dir = &state.args.dir;
        // members/ holds the live population only; the dead stay in older checkpoints.
        for entry in std::fs::read_dir(dir.members())?.flatten() {
            let name = entry.file_name().to_string_lossy().to_string();
            if state.args.league.by_name(&name).is_none() {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
        let final_dir = dir.checkpoint(s);
        let _ = std::fs::remove_dir_all(&final_dir);
        std::fs::rename(&self.tmp, &final_dir)?;
        state.args.journal.append(&Event::Checkpoint { step: s })?;
        Ok(())
    }
}

async fn finish(myself: &ActorRef<CoordinatorMsg>, state: &mut State, result: anyhow::Result<()>) {
    let result = match result {
        Ok(()) => end(state).await,
        Err(e) => Err(e),
    };
    // Before `done`: the next launch in this process must not meet this
    // one's sessions (or their remote actors in the process groups).
    state.sites.shut_down().await;
    publish(state, "finished");
    if let Some(done) = state.done.take() {
        let _ = done.send(result);
    }
    myself.stop(None);
}

async fn end(state: &mut State) -> anyhow::Result<Summary> {
    let s = state.args.league.step;
    let last = state.args.dir.latest_checkpoint()?.map(|(step, _)| step);
    if last != Some(s) {
        checkpoint(state).await?;
    }
    let checksums = state.args.league.checksums_by_name();
    state.args.journal.append(&Event::End {
        step: s,
        checksums: checksums.clone(),
    })?;
    Ok(Summary {
        steps: s,
        stopped_early: s < state.args.last_step,
        budget_reached: budget_spent(state),
        spent: state.args.league.spent,
        checksums,
        wall_s: state.started.elapsed().as_secs_f64(),
    })
}
