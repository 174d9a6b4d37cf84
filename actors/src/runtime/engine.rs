//! From a scenario to what the engine needs: the base model, the tokenizer and
//! the self-play, LoRA, optimizer and sandbox settings.

use std::sync::Arc;

use anyhow::Context;
use populora::base::tiny;
use populora::base::{resolve_model, BaseModel, Llama, Tokenizer};
use populora::lora::{AdamWConfig, BaseRef, LoraConfig};
use populora::scenario::{ModelSource, Scenario};
use populora::selfplay::{Grammars, Settings};
use populora::verify::SandboxConfig;

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
        let settings = Settings::from_scenario(scenario);
        let grammars = Grammars::compile(&tokenizer, model.config.vocab_size, &settings)
            .context("compiling the reply grammars")?;
        Ok(Engine {
            base: BaseRef::of(&model.config),
            model,
            decode_model,
            tokenizer: Arc::new(tokenizer),
            settings: Arc::new(settings),
            grammars: Arc::new(grammars),
            lora: scenario.adapter_config(),
            adamw: scenario.adamw_config(),
            sandbox: scenario.sandbox_config(),
        })
    }
}

fn base_model(
    scenario: &Scenario,
    progress: &mut dyn FnMut(&str),
) -> anyhow::Result<(Llama, Tokenizer)> {
    match &scenario.model.source {
        ModelSource::Tiny => {
            let spec = scenario.model.tiny.clone().unwrap_or_default().spec();
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
