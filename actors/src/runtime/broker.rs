//! The `Broker`: the only owner of the base model. In each phase the
//! coordinator announces which members take part; the broker waits for all
//! of their requests, orders them by member id, runs one batched pass on a
//! blocking thread (never on the async runtime) and answers each member with
//! its share. Batch composition therefore never depends on arrival order.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use populora::base::Llama;
use populora::compute::{
    generate, train_step, AdapterSet, GenRequest, Generation, TrainConfig, TrainRow, TrainStats,
};
use populora::lora::{Adapter, AdapterGrads};
use populora::selfplay::MemberId;
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use serde::Serialize;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Propose(u64),
    Solve(u64),
    Train(u64),
}

type GenReply = RpcReplyPort<anyhow::Result<Vec<Generation>>>;
type TrainReply = RpcReplyPort<anyhow::Result<(AdapterGrads, TrainStats)>>;

pub enum BrokerMsg {
    /// The members whose requests make up `phase`'s batch.
    Expect {
        phase: Phase,
        members: Vec<MemberId>,
        reply: RpcReplyPort<()>,
    },
    Generate {
        phase: Phase,
        member: MemberId,
        adapter: Adapter,
        requests: Vec<GenRequest>,
        reply: GenReply,
    },
    Train {
        phase: Phase,
        member: MemberId,
        adapter: Adapter,
        rows: Vec<TrainRow>,
        reply: TrainReply,
    },
    /// Drop a phase that will not complete (a member died); waiting members get an error.
    Abort { reply: RpcReplyPort<()> },
    /// Compute totals since the start (or the last `Usage`).
    Usage { reply: RpcReplyPort<Usage> },
}

/// What the broker did: batches, rows and compute time.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Usage {
    pub batches: usize,
    pub rows: usize,
    pub largest_batch: usize,
    pub generate_ms: f64,
    pub train_ms: f64,
}

enum Pending {
    Generate(Adapter, Vec<GenRequest>, GenReply),
    Train(Adapter, Vec<TrainRow>, TrainReply),
}

pub struct Broker;

pub struct BrokerState {
    /// The train step's base (on the CPU).
    model: Arc<Llama>,
    /// Generation's base (the scenario's `model.device`; `model` on the CPU).
    decode_model: Arc<Llama>,
    train: TrainConfig,
    phase: Option<Phase>,
    expected: Vec<MemberId>,
    pending: BTreeMap<MemberId, Pending>,
    usage: Usage,
}

impl Actor for Broker {
    type Msg = BrokerMsg;
    type State = BrokerState;
    type Arguments = (Arc<Llama>, Arc<Llama>, TrainConfig);

    async fn pre_start(
        &self,
        _myself: ActorRef<BrokerMsg>,
        (model, decode_model, train): Self::Arguments,
    ) -> Result<BrokerState, ActorProcessingErr> {
        Ok(BrokerState {
            model,
            decode_model,
            train,
            phase: None,
            expected: Vec::new(),
            pending: BTreeMap::new(),
            usage: Usage::default(),
        })
    }

    async fn handle(
        &self,
        _myself: ActorRef<BrokerMsg>,
        msg: BrokerMsg,
        state: &mut BrokerState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            BrokerMsg::Expect {
                phase,
                members,
                reply,
            } => {
                abort(state);
                state.phase = Some(phase);
                state.expected = members;
                state.expected.sort_unstable();
                let _ = reply.send(());
            }
            BrokerMsg::Generate {
                phase,
                member,
                adapter,
                requests,
                reply,
            } => {
                if let Some(request) = admit(
                    state,
                    phase,
                    member,
                    Pending::Generate(adapter, requests, reply),
                ) {
                    refuse(request, phase, member);
                }
            }
            BrokerMsg::Train {
                phase,
                member,
                adapter,
                rows,
                reply,
            } => {
                if let Some(request) =
                    admit(state, phase, member, Pending::Train(adapter, rows, reply))
                {
                    refuse(request, phase, member);
                }
            }
            BrokerMsg::Abort { reply } => {
                abort(state);
                let _ = reply.send(());
            }
            BrokerMsg::Usage { reply } => {
                let _ = reply.send(std::mem::take(&mut state.usage));
            }
        }
        if state.phase.is_some() && state.pending.len() == state.expected.len() {
            run(state).await;
        }
        Ok(())
    }
}

/// Hold a member's request for the phase; gives it back when it does not belong.
fn admit(
    state: &mut BrokerState,
    phase: Phase,
    member: MemberId,
    request: Pending,
) -> Option<Pending> {
    let expected = state.phase == Some(phase) && state.expected.binary_search(&member).is_ok();
    if !expected || state.pending.contains_key(&member) {
        return Some(request);
    }
    state.pending.insert(member, request);
    None
}

fn refuse(request: Pending, phase: Phase, member: MemberId) {
    let error = anyhow::anyhow!("member {member} is not part of {phase:?}");
    match request {
        Pending::Generate(_, _, reply) => {
            let _ = reply.send(Err(error));
        }
        Pending::Train(_, _, reply) => {
            let _ = reply.send(Err(error));
        }
    }
}

fn abort(state: &mut BrokerState) {
    let phase = state.phase.take();
    for (member, request) in std::mem::take(&mut state.pending) {
        refuse(request, phase.unwrap_or(Phase::Propose(0)), member);
    }
    state.expected.clear();
}

/// Run the phase's batch: every member's rows in member-id order.
async fn run(state: &mut BrokerState) {
    state.phase = None;
    state.expected.clear();
    let pending = std::mem::take(&mut state.pending);
    let model = state.model.clone();
    let decode_model = state.decode_model.clone();
    let train = state.train;
    let mut adapters = Vec::new();
    let mut generate_rows: Vec<(MemberId, usize, GenReply)> = Vec::new();
    let mut train_rows: Vec<(MemberId, TrainReply)> = Vec::new();
    let mut requests = Vec::new();
    let mut rows = Vec::new();
    for (member, p) in pending {
        match p {
            Pending::Generate(adapter, r, reply) => {
                adapters.push((member, adapter));
                generate_rows.push((member, r.len(), reply));
                requests.extend(r);
            }
            Pending::Train(adapter, r, reply) => {
                adapters.push((member, adapter));
                train_rows.push((member, reply));
                rows.extend(r);
            }
        }
    }
    let batch = requests.len() + rows.len();
    state.usage.batches += 1;
    state.usage.rows += batch;
    state.usage.largest_batch = state.usage.largest_batch.max(batch);
    let start = Instant::now();
    let result = tokio::task::spawn_blocking(move || {
        let set = adapters
            .iter()
            .fold(AdapterSet::new(), |s, (id, a)| s.with(*id, a));
        let generated = if requests.is_empty() {
            Ok(Vec::new())
        } else {
            generate(&decode_model, &set, requests)
        };
        let trained = if rows.is_empty() {
            Ok(Default::default())
        } else {
            train_step(&model, &set, &rows, train)
        };
        (generated, trained)
    })
    .await;
    let ms = start.elapsed().as_secs_f64() * 1e3;
    let (generated, trained) = match result {
        Ok(r) => r,
        Err(e) => {
            let message = format!("compute thread failed: {e}");
            for (_, _, reply) in generate_rows {
                let _ = reply.send(Err(anyhow::anyhow!(message.clone())));
            }
            for (_, reply) in train_rows {
                let _ = reply.send(Err(anyhow::anyhow!(message.clone())));
            }
            return;
        }
    };
    if !generate_rows.is_empty() {
        state.usage.generate_ms += ms;
        match generated {
            Ok(mut all) => {
                for (_, n, reply) in generate_rows {
                    let rest = all.split_off(n);
                    let _ = reply.send(Ok(std::mem::replace(&mut all, rest)));
                }
            }
            Err(e) => {
                for (_, _, reply) in generate_rows {
                    let _ = reply.send(Err(anyhow::anyhow!("generate: {e}")));
                }
            }
        }
    }
    if !train_rows.is_empty() {
        state.usage.train_ms += ms;
        match trained {
            Ok(mut out) => {
                for (member, reply) in train_rows {
                    let grads = out.grads.remove(&member).unwrap_or_default();
                    let stats = out.stats.remove(&member).unwrap_or_default();
                    let _ = reply.send(Ok((grads, stats)));
                }
            }
            Err(e) => {
                for (_, reply) in train_rows {
                    let _ = reply.send(Err(anyhow::anyhow!("train step: {e}")));
                }
            }
        }
    }
}
