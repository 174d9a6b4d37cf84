//! The `Broker`: the only owner of the base model. It holds a handle to every
//! live member's adapter (given when the member starts, dropped when it
//! leaves; updates are made in place by the member, so the handle stays
//! current) and runs each phase's batch — every request or train row of the
//! step, in the step's order — as one pass on a blocking thread, never on the
//! async runtime.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use populora::base::Llama;
use populora::compute::{
    generate_with, train_step, AdapterSet, DecodeOptions, GenRequest, Generation, TrainConfig,
    TrainOutput, TrainRow,
};
use populora::lora::Adapter;
use populora::selfplay::MemberId;
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use serde::Serialize;

#[derive(ractor_cluster::RactorMessage)]
pub enum BrokerMsg {
    /// A member's adapter joins the batch (replacing any earlier one of that id).
    Join { member: MemberId, adapter: Adapter },
    /// A member left the population.
    Leave { member: MemberId },
    Generate {
        requests: Vec<GenRequest>,
        reply: RpcReplyPort<anyhow::Result<Vec<Generation>>>,
    },
    /// Gradients for every adapter with rows, in one train step.
    Train {
        rows: Vec<TrainRow>,
        reply: RpcReplyPort<anyhow::Result<TrainOutput>>,
    },
    /// Compute totals since the start (or the last `Usage`).
    Usage { reply: RpcReplyPort<Usage> },
}

/// What the broker did: batches, rows and compute time.
#[derive(Debug, Clone, Default, Serialize, serde::Deserialize)]
pub struct Usage {
    pub batches: usize,
    pub rows: usize,
    pub largest_batch: usize,
    pub generate_ms: f64,
    pub train_ms: f64,
}

impl Usage {
    fn count(&mut self, rows: usize) {
        self.batches += 1;
        self.rows += rows;
        self.largest_batch = self.largest_batch.max(rows);
    }

    /// Add another broker's usage (the sites of a run).
    pub fn merge(&mut self, other: &Usage) {
        self.batches += other.batches;
        self.rows += other.rows;
        self.largest_batch = self.largest_batch.max(other.largest_batch);
        self.generate_ms += other.generate_ms;
        self.train_ms += other.train_ms;
    }
}

pub struct Broker;

pub struct BrokerState {
    /// The base, on the scenario's `model.device`: every pass runs on it.
    model: Arc<Llama>,
    train: TrainConfig,
    adapters: BTreeMap<MemberId, Adapter>,
    usage: Usage,
}

impl Actor for Broker {
    type Msg = BrokerMsg;
    type State = BrokerState;
    type Arguments = (Arc<Llama>, TrainConfig);

    async fn pre_start(
        &self,
        _myself: ActorRef<BrokerMsg>,
        (model, train): Self::Arguments,
    ) -> Result<BrokerState, ActorProcessingErr> {
        Ok(BrokerState {
            model,
            train,
            adapters: BTreeMap::new(),
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
            BrokerMsg::Join { member, adapter } => {
                state.adapters.insert(member, adapter);
            }
            BrokerMsg::Leave { member } => {
                state.adapters.remove(&member);
            }
            BrokerMsg::Generate { requests, reply } => {
                state.usage.count(requests.len());
                let model = state.model.clone();
                let options = DecodeOptions {
                    share_prefixes: state.train.share_prefixes,
                    ..DecodeOptions::default()
                };
                let (result, ms) = on_adapters(state, move |adapters| {
                    generate_with(&model, adapters, requests, options)
                        .map(|(generations, _)| generations)
                        .map_err(|e| anyhow::anyhow!("generate: {e}"))
                })
                .await;
                state.usage.generate_ms += ms;
                let _ = reply.send(result);
            }
            BrokerMsg::Train { rows, reply } => {
                state.usage.count(rows.len());
                let (model, config) = (state.model.clone(), state.train);
                let (result, ms) = on_adapters(state, move |adapters| {
                    train_step(&model, adapters, &rows, config)
                        .map_err(|e| anyhow::anyhow!("train step: {e}"))
                })
                .await;
                state.usage.train_ms += ms;
                let _ = reply.send(result);
            }
            BrokerMsg::Usage { reply } => {
                let _ = reply.send(std::mem::take(&mut state.usage));
            }
        }
        Ok(())
    }
}

/// Runs `work` on every joined adapter, on a blocking thread; its result and
/// the milliseconds it took.
async fn on_adapters<T: Send + 'static>(
    state: &BrokerState,
    work: impl FnOnce(&AdapterSet) -> anyhow::Result<T> + Send + 'static,
) -> (anyhow::Result<T>, f64) {
    let adapters = state.adapters.clone();
    let start = Instant::now();
    let result = tokio::task::spawn_blocking(move || {
        let set = adapters
            .iter()
            .fold(AdapterSet::new(), |set, (&id, a)| set.with(id, a));
        work(&set)
    })
    .await
    .unwrap_or_else(|e| Err(anyhow::anyhow!("compute thread failed: {e}")));
    (result, start.elapsed().as_secs_f64() * 1e3)
}
