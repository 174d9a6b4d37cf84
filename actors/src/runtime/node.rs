//! A worker node (`populora node`): a [`LocalSite`] — its own broker on its
//! own copy of the base, and the members placed on it — serving one
//! coordinator at a time over ractor_cluster.
//!
//! The node's one remote actor, the [`NodeAgent`], joins the process group
//! [`NODE_GROUP`]; a coordinator that connected (with the same cookie) finds
//! it there. Every request is one RPC of checksummed bytes ([`super::wire`]).
//! A `hello` names the coordinator's populora version and base fingerprint,
//! and carries the scenario: a node with another version or another base
//! refuses, saying why on both sides.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use anyhow::Context;
use populora::scenario::{check_operator, ModelSource, Scenario};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort, SupervisionEvent};

use super::engine::Engine;
use super::site::LocalSite;
use super::wire::{self, Answer, Failure, PackedLearner, Reply, Request, WireGeneration};
use super::StepError;

/// The process group every node's agent joins ...
pub const NODE_GROUP: &str = "populora-node";
/// ... and its heartbeat.
pub const HEARTBEAT_GROUP: &str = "populora-node-heartbeat";

/// This build's version, compared in every handshake.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

#[derive(ractor_cluster::RactorClusterMessage)]
pub enum NodeMsg {
    /// A [`wire::Request`] in, a [`wire::Answer`] out.
    #[rpc]
    Call(Vec<u8>, RpcReplyPort<Vec<u8>>),
}

/// Answers the coordinator's pings while the agent computes.
#[derive(ractor_cluster::RactorClusterMessage)]
pub enum HeartbeatMsg {
    #[rpc]
    Ping(RpcReplyPort<u64>),
}

pub struct Heartbeat;

impl Actor for Heartbeat {
    type Msg = HeartbeatMsg;
    type State = ();
    type Arguments = ();

    async fn pre_start(&self, _: ActorRef<HeartbeatMsg>, _: ()) -> Result<(), ActorProcessingErr> {
        Ok(())
    }

    async fn handle(
        &self,
        _: ActorRef<HeartbeatMsg>,
        HeartbeatMsg::Ping(reply): HeartbeatMsg,
        _: &mut (),
    ) -> Result<(), ActorProcessingErr> {
        let _ = reply.send(0);
        Ok(())
    }
}

pub struct NodeAgent;

pub struct NodeArgs {
    /// `--model`: load this base instead of the scenario's.
    pub model: Option<PathBuf>,
    /// The coordinators connected now, by name, with their session counts
    /// (from the node server's events).
    pub connected: Arc<Mutex<BTreeMap<String, usize>>>,
}

pub struct NodeState {
    args: NodeArgs,
    /// The run's scenario and its engine (the base is kept for the next
    /// run with the same `[model]`).
    engine: Option<(Scenario, Arc<Engine>)>,
    site: Option<LocalSite>,
    /// The coordinator served now.
    serving: Option<String>,
}

impl Actor for NodeAgent {
    type Msg = NodeMsg;
    type State = NodeState;
    type Arguments = NodeArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<NodeMsg>,
        args: NodeArgs,
    ) -> Result<NodeState, ActorProcessingErr> {
        Ok(NodeState {
            args,
            engine: None,
            site: None,
            serving: None,
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<NodeMsg>,
        NodeMsg::Call(bytes, reply): NodeMsg,
        state: &mut NodeState,
    ) -> Result<(), ActorProcessingErr> {
        let answer = match wire::decode::<Request>(&bytes) {
            Ok(request) => serve(&myself, state, request).await,
            Err(e) => Err(failure(e)),
        };
        if let Err(f) = &answer {
            eprintln!("node: {}", f.message);
        }
        let _ = reply.send(wire::encode(&answer));
        Ok(())
    }

    /// A member that dies is the coordinator's to restart (it retries the
    /// step); never stop the node because a child stopped.
    async fn handle_supervisor_evt(
        &self,
        _myself: ActorRef<NodeMsg>,
        event: SupervisionEvent,
        _state: &mut NodeState,
    ) -> Result<(), ActorProcessingErr> {
        if let SupervisionEvent::ActorFailed(who, why) = event {
            eprintln!("node: actor {} failed: {why}", who.get_id());
        }
        Ok(())
    }
}

fn failure(e: anyhow::Error) -> Failure {
    Failure {
        message: format!("{e:#}"),
        member: None,
    }
}

fn step_failure(e: StepError) -> Failure {
    match e {
        StepError::Died(d) => Failure {
            message: d.message,
            member: d.member,
        },
        StepError::NodeLost(n) => failure(anyhow::anyhow!(n)),
        StepError::Fatal(e) => failure(e),
    }
}

async fn serve(myself: &ActorRef<NodeMsg>, state: &mut NodeState, request: Request) -> Answer {
    if let Request::Hello {
        version,
        fingerprint,
        scenario,
        coordinator,
    } = request
    {
        return hello(
            myself,
            state,
            &version,
            &fingerprint,
            &scenario,
            coordinator,
        )
        .await
        .map_err(failure);
    }
    let (Some(site), Some((_, engine))) = (state.site.as_mut(), state.engine.as_ref()) else {
        return Err(failure(anyhow::anyhow!(
            "this node has not been greeted by a coordinator"
        )));
    };
    let result: Result<Reply, StepError> = async {
        Ok(match request {
            Request::Hello { .. } => unreachable!("answered above"),
            Request::Place {
                member,
                name,
                learner,
            } => {
                site.place(member, &name, learner.unpack()?).await?;
                Reply::Done
            }
            Request::Remove { member } => {
                site.remove(member);
                Reply::Done
            }
            Request::Generate { requests } => {
                let requests = requests
                    .into_iter()
                    .map(|r| r.request(&engine.grammars))
                    .collect::<anyhow::Result<Vec<_>>>()?;
                let out = site.generate(requests).await?;
                Reply::Generations(out.into_iter().map(WireGeneration::from).collect())
            }
            Request::Train { step, rows } => {
                let rows = rows.into_iter().map(Into::into).collect();
                Reply::Trained(site.train(step, rows).await?)
            }
            Request::Keep => {
                site.keep().await?;
                Reply::Done
            }
            Request::Restore => {
                site.restore().await?;
                Reply::Done
            }
            Request::Learner { member } => {
                let learner = site.learner(member).await?;
                Reply::Learner(PackedLearner::pack(&learner, &engine.base)?)
            }
            Request::Usage => Reply::Usage(site.usage().await?),
        })
    }
    .await;
    result.map_err(step_failure)
}

/// Check the coordinator's version and base, load the scenario's engine
/// (on the loaded base when `[model]` is the same), and start afresh: a new
/// broker, no members. A node busy with another connected coordinator refuses.
async fn hello(
    myself: &ActorRef<NodeMsg>,
    state: &mut NodeState,
    version: &str,
    fingerprint: &str,
    scenario: &str,
    coordinator: String,
) -> anyhow::Result<Reply> {
    anyhow::ensure!(
        version == VERSION,
        "refused: the coordinator runs populora {version}, this node {VERSION}; run the same version on every machine"
    );
    if let Some(other) = state.serving.as_ref().filter(|c| **c != coordinator) {
        let connected = state
            .args
            .connected
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        anyhow::ensure!(
            !connected.contains_key(other),
            "refused: this node serves another run's coordinator ({other}), which is still connected"
        );
    }
    let mut scenario = Scenario::parse(scenario, "the coordinator's scenario", check_operator)
        .context("the coordinator's scenario does not load here")?;
    if let Some(path) = &state.args.model {
        scenario.model.source = ModelSource::Path(path.clone());
    }
    let engine = match state
        .engine
        .as_ref()
        .filter(|(s, _)| s.model == scenario.model)
    {
        Some((_, loaded)) => Arc::new(loaded.reuse_base(&scenario)?),
        None => {
            eprintln!("node: loading the base model");
            let s = scenario.clone();
            let engine = tokio::task::spawn_blocking(move || {
                Engine::load(&s, &mut |m| eprintln!("node: {m}"))
            })
            .await??;
            Arc::new(engine)
        }
    };
    let ours = engine.fingerprint()?;
    anyhow::ensure!(
        ours == fingerprint,
        "refused: the coordinator's base model has fingerprint {fingerprint}, this node's {ours} ({}); start the node with the run's model (--model PATH)",
        populora::lora::model_label(&engine.model.config)
    );
    if let Some(old) = state.site.take() {
        old.stop();
    }
    state.site = Some(LocalSite::start(&engine, myself.get_cell()).await?);
    eprintln!(
        "node: serving run {:?} (seed {}) for {coordinator}",
        scenario.name, scenario.seed
    );
    state.engine = Some((scenario, engine));
    state.serving = Some(coordinator);
    Ok(Reply::Hello {
        node: format!("populora {VERSION}"),
    })
}
