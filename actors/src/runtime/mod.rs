//! The population runtime: actors on ractor + tokio around the synchronous
//! engine.
//!
//! | actor | owns |
//! |---|---|
//! | [`coordinator`] | the step loop and its barriers, matching, ratings, buffers, journal, checkpoints, live commands, supervision of members |
//! | [`member`] | one adapter, its optimizer state and stream; builds its prompts, applies its own updates |
//! | [`broker`] | the base model: batches its site's members' compute of a phase into one pass, on a blocking thread |
//! | [`verifier`] | the sandbox pool (checker and zygote processes; a dead one is replaced and its job retried once) |
//! | [`evolution`] | fitness ranking, culls, offspring by crossover + mutation |
//! | [`node`] | a worker node (`populora node`): its broker and members, for a remote coordinator |
//!
//! Plain modules: [`site`] (where members live: this process or a node;
//! each phase's batch split by site), [`cluster`] (the coordinator's links
//! to worker nodes over ractor_cluster), [`wire`] (what crosses between
//! them), [`rundir`] (files of a run), [`journal`] (the event log),
//! [`control`] (the control socket), [`engine`] (scenario → engine settings
//! and model), [`replay`] (replay, resume, and resuming after a node is
//! lost or back).
//!
//! Determinism: phases are barriers; the broker orders requests by member id
//! before batching; every random draw comes from a stream keyed by the seed,
//! the step and a purpose; live commands take effect at step boundaries and
//! are journaled with the step, so a replay applies them at the same point.
//! On nodes, placement is a pure function of the scenario and the nodes up,
//! and each site's results go back to their place in the batch; which rows
//! share a batch depends on the layout, so bits match under the same layout.

pub mod broker;
pub mod cluster;
pub mod control;
pub mod coordinator;
pub mod engine;
pub mod evolution;
pub mod journal;
pub mod league;
pub mod member;
pub mod metrics;
pub mod node;
pub mod progress;
pub mod replay;
pub mod rundir;
pub mod seeding;
pub mod site;
pub mod verifier;
pub mod wire;

use ractor::{ActorRef, Message, MessagingErr, RpcReplyPort};

/// An actor died (or stopped) before answering: the supervisor's business.
#[derive(Debug)]
pub struct Died {
    /// What happened, naming the actor.
    pub message: String,
    /// The member that died (journaled with the fault); `None` for another actor.
    pub member: Option<String>,
}

impl Died {
    pub fn actor(message: String) -> Died {
        Died {
            message,
            member: None,
        }
    }

    /// Member `name` died; `message` names it.
    pub fn member(name: &str, message: String) -> Died {
        Died {
            message,
            member: Some(name.to_string()),
        }
    }

    /// The actor [`ask`] lost was member `name` (ask knows only the actor).
    pub fn of_member(self, name: &str) -> Died {
        Died::member(name, format!("{name}: {}", self.message))
    }
}

/// Why a step attempt failed.
pub enum StepError {
    /// A member (or another actor) died: restart it and retry the step.
    Died(Died),
    /// A worker node stopped answering: the run goes back to its last
    /// checkpoint on the nodes still up.
    NodeLost(NodeLost),
    /// Anything else stops the run.
    Fatal(anyhow::Error),
}

impl From<Died> for StepError {
    fn from(d: Died) -> Self {
        StepError::Died(d)
    }
}

impl From<populora::selfplay::Error> for StepError {
    fn from(e: populora::selfplay::Error) -> Self {
        StepError::Fatal(e.into())
    }
}

impl From<anyhow::Error> for StepError {
    fn from(e: anyhow::Error) -> Self {
        StepError::Fatal(e)
    }
}

/// A worker node was lost; how it was noticed.
#[derive(Debug, Clone)]
pub struct NodeLost {
    pub node: String,
    pub message: String,
    /// The step in progress when it was noticed (0 before the first).
    pub step: u64,
}

impl std::fmt::Display for NodeLost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "node {} was lost in step {}: {}",
            self.node, self.step, self.message
        )
    }
}

impl std::error::Error for NodeLost {}

/// A node that was down answers again: the run continues from the
/// checkpoint of `step` with it in the layout.
#[derive(Debug, Clone)]
pub struct NodeBack {
    pub node: String,
    pub step: u64,
}

impl std::fmt::Display for NodeBack {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "node {} is back after step {}", self.node, self.step)
    }
}

impl std::error::Error for NodeBack {}

/// `call` an actor and wait for its answer without a timeout; a dead actor
/// becomes [`Died`] rather than a panic.
pub async fn ask<M: Message, T: Send + 'static>(
    actor: &ActorRef<M>,
    msg: impl FnOnce(RpcReplyPort<T>) -> M,
) -> Result<T, Died> {
    use ractor::rpc::CallResult;
    match actor.call(msg, None).await {
        Ok(CallResult::Success(v)) => Ok(v),
        Ok(CallResult::Timeout) => Err(Died::actor(format!("{} timed out", name_of(actor)))),
        Ok(CallResult::SenderError) => {
            Err(Died::actor(format!("{} dropped the reply", name_of(actor))))
        }
        Err(MessagingErr::SendErr(_)) | Err(MessagingErr::ChannelClosed) => {
            Err(Died::actor(format!("{} is not running", name_of(actor))))
        }
        Err(e) => Err(Died::actor(format!("{}: {e}", name_of(actor)))),
    }
}

fn name_of<M: Message>(actor: &ActorRef<M>) -> String {
    actor.get_name().unwrap_or_else(|| "an actor".into())
}
