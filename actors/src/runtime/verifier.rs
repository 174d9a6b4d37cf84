//! The `Verifier` actor: owns the sandbox pool (a warm checker and zygote per
//! worker; the pool replaces a dead one and retries its job once) and judges a
//! phase's proposals or answers as one batch on a blocking thread.

use std::sync::Arc;

use populora::base::Tokenizer;
use populora::compute::Generation;
use populora::selfplay::{
    judge_proposals, judge_solutions, Grammars, Problem, ProposalJob, ProposalResult, Settings,
    SolveJob, SolveResult, StepContext,
};
use populora::verify::{SandboxConfig, VerifierPool};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};

#[derive(ractor_cluster::RactorMessage)]
pub enum VerifierMsg {
    Proposals {
        step: u64,
        jobs: Vec<ProposalJob>,
        generations: Vec<Generation>,
        reply: RpcReplyPort<anyhow::Result<Vec<ProposalResult>>>,
    },
    Solutions {
        step: u64,
        problems: Arc<Vec<Problem>>,
        jobs: Vec<SolveJob>,
        generations: Vec<Generation>,
        reply: RpcReplyPort<anyhow::Result<Vec<SolveResult>>>,
    },
}

pub struct Verifier;

pub struct VerifierArgs {
    pub sandbox: SandboxConfig,
    pub seed: u64,
    pub tokenizer: Arc<Tokenizer>,
    pub settings: Arc<Settings>,
    pub grammars: Arc<Grammars>,
}

pub struct VerifierState {
    pool: Arc<VerifierPool>,
    seed: u64,
    tokenizer: Arc<Tokenizer>,
    settings: Arc<Settings>,
    grammars: Arc<Grammars>,
}

impl Actor for Verifier {
    type Msg = VerifierMsg;
    type State = VerifierState;
    type Arguments = VerifierArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<VerifierMsg>,
        args: VerifierArgs,
    ) -> Result<VerifierState, ActorProcessingErr> {
        let pool = tokio::task::spawn_blocking(move || VerifierPool::new(args.sandbox)).await??;
        Ok(VerifierState {
            pool: Arc::new(pool),
            seed: args.seed,
            tokenizer: args.tokenizer,
            settings: args.settings,
            grammars: args.grammars,
        })
    }

    async fn handle(
        &self,
        _myself: ActorRef<VerifierMsg>,
        msg: VerifierMsg,
        state: &mut VerifierState,
    ) -> Result<(), ActorProcessingErr> {
        let (pool, seed) = (state.pool.clone(), state.seed);
        let (tokenizer, settings) = (state.tokenizer.clone(), state.settings.clone());
        let grammars = state.grammars.clone();
        match msg {
            VerifierMsg::Proposals {
                step,
                jobs,
                generations,
                reply,
            } => {
                let judged = tokio::task::spawn_blocking(move || {
                    let ctx = StepContext {
                        seed,
                        step,
                        settings: &settings,
                        tokenizer: &tokenizer,
                        grammars: &grammars,
                    };
                    judge_proposals(&ctx, jobs, generations, &pool).map_err(anyhow::Error::from)
                })
                .await;
                let _ = reply
                    .send(judged.unwrap_or_else(|e| Err(anyhow::anyhow!("verifier thread: {e}"))));
            }
            VerifierMsg::Solutions {
                step,
                problems,
                jobs,
                generations,
                reply,
            } => {
                let judged = tokio::task::spawn_blocking(move || {
                    let ctx = StepContext {
                        seed,
                        step,
                        settings: &settings,
                        tokenizer: &tokenizer,
                        grammars: &grammars,
                    };
                    judge_solutions(&ctx, &problems, jobs, generations, &pool)
                        .map_err(anyhow::Error::from)
                })
                .await;
                let _ = reply
                    .send(judged.unwrap_or_else(|e| Err(anyhow::anyhow!("verifier thread: {e}"))));
            }
        }
        Ok(())
    }
}
