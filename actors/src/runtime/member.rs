//! A `Member` actor: one adapter, its optimizer state and its place in the
//! population. It builds its own prompts and requests (from streams keyed by
//! its id), sends its compute to the broker, and applies its own update from
//! the gradients the broker returns.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use populora::base::Tokenizer;
use populora::compute::{Generation, TrainRow, TrainStats};
use populora::lora::{AdamW, Adapter, BaseRef};
use populora::selfplay::{
    apply_update, proposal_jobs, solve_jobs, Grammars, Learner, MemberId, Problem, ProposalJob,
    Roster, Settings, SolveJob, StepContext,
};
use populora::task::TaskBuffers;
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};

use super::broker::{BrokerMsg, Phase};
use super::{ask, rundir};

/// What a member needs to start (or restart from a snapshot).
pub struct MemberArgs {
    pub id: MemberId,
    pub name: String,
    pub learner: Learner,
    pub seed: u64,
    pub tokenizer: Arc<Tokenizer>,
    pub settings: Arc<Settings>,
    pub grammars: Arc<Grammars>,
    pub broker: ActorRef<BrokerMsg>,
}

pub struct TrainReport {
    pub stats: Option<TrainStats>,
    pub grad_norm: Option<f64>,
    pub checksum: String,
}

pub type Reply<T> = RpcReplyPort<anyhow::Result<T>>;

pub enum MemberMsg {
    Propose {
        step: u64,
        buffers: Arc<TaskBuffers>,
        reply: Reply<Vec<(ProposalJob, Generation)>>,
    },
    Solve {
        step: u64,
        problems: Arc<Vec<Problem>>,
        reply: Reply<Vec<(SolveJob, Generation)>>,
    },
    Train {
        step: u64,
        rows: Vec<TrainRow>,
        reply: Reply<TrainReport>,
    },
    /// A deep copy of the adapter and optimizer, for rollback and breeding.
    Snapshot { reply: Reply<Learner> },
    Save {
        dir: PathBuf,
        base: BaseRef,
        reply: Reply<()>,
    },
}

pub struct Member;

pub struct MemberState {
    args: MemberArgs,
}

impl MemberState {
    fn ctx(&self, step: u64) -> StepContext<'_> {
        StepContext {
            seed: self.args.seed,
            step,
            settings: &self.args.settings,
            tokenizer: &self.args.tokenizer,
            grammars: &self.args.grammars,
        }
    }

    fn adapter(&self) -> Adapter {
        self.args.learner.adapter.clone()
    }
}

impl Actor for Member {
    type Msg = MemberMsg;
    type State = MemberState;
    type Arguments = MemberArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<MemberMsg>,
        args: MemberArgs,
    ) -> Result<MemberState, ActorProcessingErr> {
        Ok(MemberState { args })
    }

    async fn handle(
        &self,
        _myself: ActorRef<MemberMsg>,
        msg: MemberMsg,
        state: &mut MemberState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            MemberMsg::Propose {
                step,
                buffers,
                reply,
            } => {
                fault_hook(&state.args.name, step, "propose");
                let _ = reply.send(propose(state, step, &buffers).await);
            }
            MemberMsg::Solve {
                step,
                problems,
                reply,
            } => {
                fault_hook(&state.args.name, step, "solve");
                let _ = reply.send(solve(state, step, &problems).await);
            }
            MemberMsg::Train { step, rows, reply } => {
                fault_hook(&state.args.name, step, "train");
                let _ = reply.send(train(state, step, rows).await);
            }
            MemberMsg::Snapshot { reply } => {
                let _ = reply.send(snapshot(&state.args.learner));
            }
            MemberMsg::Save { dir, base, reply } => {
                let _ = reply.send(save(&state.args.learner, &dir, &base));
            }
        }
        Ok(())
    }
}

async fn propose(
    state: &MemberState,
    step: u64,
    buffers: &TaskBuffers,
) -> anyhow::Result<Vec<(ProposalJob, Generation)>> {
    let ctx = state.ctx(step);
    let me = state.args.id;
    let roster = Roster {
        proposers: vec![me],
        ..Roster::default()
    };
    let jobs = proposal_jobs(&ctx, &roster, buffers)?;
    let requests = jobs.iter().map(|j| j.request(&ctx)).collect();
    let generations = generate_on_broker(state, Phase::Propose(step), requests).await?;
    Ok(jobs.into_iter().zip(generations).collect())
}

async fn solve(
    state: &MemberState,
    step: u64,
    problems: &[Problem],
) -> anyhow::Result<Vec<(SolveJob, Generation)>> {
    let ctx = state.ctx(step);
    let me = state.args.id;
    let jobs: Vec<SolveJob> = solve_jobs(&ctx, problems)
        .into_iter()
        .filter(|j| j.solver == me)
        .collect();
    let requests = jobs.iter().map(|j| j.request(&ctx, problems)).collect();
    let generations = generate_on_broker(state, Phase::Solve(step), requests).await?;
    Ok(jobs.into_iter().zip(generations).collect())
}

/// This member's rows of the phase's batch, generated with its adapter.
async fn generate_on_broker(
    state: &MemberState,
    phase: Phase,
    requests: Vec<populora::compute::GenRequest>,
) -> anyhow::Result<Vec<Generation>> {
    let adapter = state.adapter();
    ask(&state.args.broker, |reply| BrokerMsg::Generate {
        phase,
        member: state.args.id,
        adapter,
        requests,
        reply,
    })
    .await
    .map_err(|d| anyhow::anyhow!("broker: {}", d.message))?
}

async fn train(
    state: &mut MemberState,
    step: u64,
    rows: Vec<TrainRow>,
) -> anyhow::Result<TrainReport> {
    let me = state.args.id;
    let adapter = state.adapter();
    let (grads, stats) = ask(&state.args.broker, |reply| BrokerMsg::Train {
        phase: Phase::Train(step),
        member: me,
        adapter,
        rows,
        reply,
    })
    .await
    .map_err(|d| anyhow::anyhow!("broker: {}", d.message))??;
    let learner = &mut state.args.learner;
    let report = apply_update(
        &learner.adapter,
        &mut learner.optimizer,
        grads,
        state.args.settings.grad_clip,
    )?;
    Ok(TrainReport {
        stats: Some(stats),
        grad_norm: Some(report.grad_norm),
        checksum: learner.adapter.checksum()?,
    })
}

pub fn snapshot(learner: &Learner) -> anyhow::Result<Learner> {
    Ok(Learner {
        adapter: learner.adapter.deep_copy()?,
        optimizer: learner.optimizer.clone(),
    })
}

fn save(learner: &Learner, dir: &std::path::Path, base: &BaseRef) -> anyhow::Result<()> {
    learner.adapter.save(&rundir::adapter_dir(dir), base)?;
    learner.optimizer.save(&rundir::optimizer_dir(dir))?;
    Ok(())
}

/// Load a member's saved adapter and optimizer.
pub fn load(dir: &std::path::Path) -> anyhow::Result<Learner> {
    let device = candle_core::Device::Cpu;
    let (adapter, _) = Adapter::load(&rundir::adapter_dir(dir), &device)?;
    let optimizer = AdamW::load(&rundir::optimizer_dir(dir), &device)?;
    Ok(Learner { adapter, optimizer })
}

/// Test hook: `POPULORA_FAULT=<member>@<step>:<phase>` panics that member once
/// in that phase, so tests can check supervision (restart and retry).
fn fault_hook(name: &str, step: u64, phase: &str) {
    static FIRED: AtomicBool = AtomicBool::new(false);
    let Ok(spec) = std::env::var("POPULORA_FAULT") else {
        return;
    };
    if spec == format!("{name}@{step}:{phase}") && !FIRED.swap(true, Ordering::SeqCst) {
        panic!("injected fault (POPULORA_FAULT={spec})");
    }
}
