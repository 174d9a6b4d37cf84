//! A `Member` actor: one adapter and its optimizer state. The broker holds a
//! handle to the adapter for the batches; the member applies its own update
//! from the gradients of each train step, and gives snapshots (for rollback
//! and breeding).

use std::sync::atomic::{AtomicBool, Ordering};

use populora::lora::{AdamW, Adapter, AdapterGrads, BaseRef};
use populora::selfplay::{apply_update, Learner};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};

use super::rundir;

/// What a member needs to start (or restart from a snapshot).
pub struct MemberArgs {
    pub name: String,
    pub learner: Learner,
    /// Global gradient-norm clip of every update.
    pub grad_clip: f64,
}

/// What an update did: the gradient norm before clipping and the adapter's new checksum.
pub struct Updated {
    pub grad_norm: f64,
    pub checksum: String,
}

pub type Reply<T> = RpcReplyPort<anyhow::Result<T>>;

#[derive(ractor_cluster::RactorMessage)]
pub enum MemberMsg {
    /// Apply this step's gradients (clipped, then AdamW).
    Update {
        step: u64,
        grads: AdapterGrads,
        reply: Reply<Updated>,
    },
    /// A deep copy of the adapter and optimizer, for rollback and breeding.
    Snapshot { reply: Reply<Learner> },
}

pub struct Member;

impl Actor for Member {
    type Msg = MemberMsg;
    type State = MemberArgs;
    type Arguments = MemberArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<MemberMsg>,
        args: MemberArgs,
    ) -> Result<MemberArgs, ActorProcessingErr> {
        Ok(args)
    }

    async fn handle(
        &self,
        _myself: ActorRef<MemberMsg>,
        msg: MemberMsg,
        state: &mut MemberArgs,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            MemberMsg::Update { step, grads, reply } => {
                fault_hook(&state.name, step, "train");
                let _ = reply.send(update(state, grads));
            }
            MemberMsg::Snapshot { reply } => {
                let _ = reply.send(snapshot(&state.learner));
            }
        }
        Ok(())
    }
}

fn update(state: &mut MemberArgs, grads: AdapterGrads) -> anyhow::Result<Updated> {
    let learner = &mut state.learner;
    let report = apply_update(
        &learner.adapter,
        &mut learner.optimizer,
        grads,
        state.grad_clip,
    )?;
    Ok(Updated {
        grad_norm: report.grad_norm,
        checksum: learner.adapter.checksum()?,
    })
}

pub fn snapshot(learner: &Learner) -> anyhow::Result<Learner> {
    Ok(Learner {
        adapter: learner.adapter.deep_copy()?,
        optimizer: learner.optimizer.clone(),
    })
}

/// Write a learner's adapter and optimizer under `dir` (a checkpoint's member directory).
pub fn save(learner: &Learner, dir: &std::path::Path, base: &BaseRef) -> anyhow::Result<()> {
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

/// Test hook: `POPULORA_FAULT=<member>@<step>:train` panics that member once
/// as it applies that step's update, so tests can check supervision (restart and retry).
fn fault_hook(name: &str, step: u64, phase: &str) {
    static FIRED: AtomicBool = AtomicBool::new(false);
    let Ok(spec) = std::env::var("POPULORA_FAULT") else {
        return;
    };
    if spec == format!("{name}@{step}:{phase}") && !FIRED.swap(true, Ordering::SeqCst) {
        panic!("injected fault (POPULORA_FAULT={spec})");
    }
}
