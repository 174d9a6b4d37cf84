//! From a scenario to what the engine needs: the base model, the tokenizer and
//! the self-play, LoRA, optimizer and sandbox settings.

use std::sync::Arc;

use anyhow::Context;
use populora::base::tiny::{self, TinySpec};
use populora::base::{resolve_model, Arch, BaseModel, Llama, Tokenizer};
use populora::compute::{Sampling, TrainConfig};
use populora::lora::{AdamWConfig, BaseRef, LoraConfig};
use populora::rl::{AdvantageConfig, RewardConfig};
use populora::scenario::{ModelSource, Scenario};
use populora::selfplay::{Grammars, Settings};
use populora::task::PromptConfig;
use populora::verify::{Limits, SandboxConfig};

/// The frozen base and every setting derived from the scenario.
pub struct Engine {
    /// The base on the CPU: the train step's (and the cost count's).
    pub model: Arc<Llama>,
    /// The base where generation and scoring run (`model.device`): the same
    /// `Arc` as `model` on the CPU, a GPU copy otherwise.
    pub decode_model: Arc<Llama>,
    pub tokenizer: Arc<Tokenizer>,
    pub base: BaseRef,
    pub settings: Arc<Settings>,
    /// The reply grammars (none when `selfplay.constrained` is off).
    pub grammars: Arc<Grammars>,
    pub lora: LoraConfig,
    pub adamw: AdamWConfig,
    pub sandbox: SandboxConfig,
}

impl Engine {
    pub fn load(scenario: &Scenario, progress: &mut dyn FnMut(&str)) -> anyhow::Result<Engine> {
        let (model, tokenizer) = base_model(scenario, progress)?;
        let device = populora::base::device::open(&scenario.model.device)?;
        let model = Arc::new(model);
        let decode_model = if device.is_cpu() {
            model.clone()
        } else {
            Arc::new(model.to_device(&device)?)
        };
        let settings = settings(scenario);
        let grammars = Grammars::compile(&tokenizer, model.config.vocab_size, &settings)
            .context("compiling the reply grammars")?;
        Ok(Engine {
            base: BaseRef::of(&model.config),
            model,
            decode_model,
            tokenizer: Arc::new(tokenizer),
            settings: Arc::new(settings),
            grammars: Arc::new(grammars),
            lora: LoraConfig {
                rank: scenario.lora.rank,
                alpha: scenario.lora.alpha,
                targets: scenario.lora.targets.clone(),
                use_rslora: scenario.lora.rslora,
            },
            adamw: AdamWConfig {
                lr: scenario.training.lr,
                beta1: scenario.training.beta1,
                beta2: scenario.training.beta2,
                eps: scenario.training.eps,
                weight_decay: scenario.training.weight_decay,
            },
            sandbox: SandboxConfig {
                workers: scenario.verifier.workers,
                limits: Limits {
                    timeout_ms: scenario.verifier.timeout_ms,
                    memory_mb: scenario.verifier.memory_mb,
                    ..Limits::default()
                },
                ..SandboxConfig::default()
            },
        })
    }
}

fn base_model(
    scenario: &Scenario,
    progress: &mut dyn FnMut(&str),
) -> anyhow::Result<(Llama, Tokenizer)> {
    match &scenario.model.source {
        ModelSource::Tiny => {
            let t = scenario.model.tiny.clone().unwrap_or_default();
            let spec = TinySpec {
                arch: Arch::Llama,
                layers: t.layers,
                hidden: t.hidden,
                heads: t.heads,
                kv_heads: t.kv_heads,
                ffn: t.ffn,
                max_positions: t.max_positions,
                seed: t.seed,
                ..TinySpec::default()
            };
            let (model, vocab) = tiny::build(&spec)?;
            Ok((model, vocab.tokenizer()?))
        }
        ModelSource::Default => load(&resolve_model(None, progress)?),
        ModelSource::Path(path) => load(path),
    }
}

fn load(path: &std::path::Path) -> anyhow::Result<(Llama, Tokenizer)> {
    let base = BaseModel::load(path).with_context(|| format!("loading {}", path.display()))?;
    Ok((base.model, base.tokenizer))
}

/// The engine's self-play settings from the scenario's sections.
pub fn settings(s: &Scenario) -> Settings {
    let p = &s.selfplay;
    Settings {
        task_kinds: p.task_kinds.clone(),
        prompt: PromptConfig {
            references: p.references,
            max_prompt_tokens: p.max_prompt_tokens,
            induction_inputs: p.induction_inputs,
            induction_shown: p.induction_shown,
        },
        proposals_per_kind: p.proposals_per_teacher,
        solver_samples: p.solver_samples,
        max_new_tokens: p.max_new_tokens,
        sampling: Sampling {
            temperature: p.temperature as f32,
            top_p: p.top_p as f32,
        },
        constrained: p.constrained,
        prefill: p.prefill_answer,
        rewards: RewardConfig {
            correct_reward: s.rewards.correct,
            malformed_penalty: s.rewards.malformed,
            wrong_penalty: s.rewards.wrong,
            solver_rollouts: p.solver_samples,
        },
        advantage: AdvantageConfig::default(),
        train: TrainConfig {
            clip: s.training.clip,
            token_budget: s.training.micro_batch_tokens,
        },
        grad_clip: s.training.grad_clip,
    }
}
