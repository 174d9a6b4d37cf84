//! From a scenario to what the engine needs: the base model, the tokenizer and
//! the self-play, LoRA, optimizer and sandbox settings.

use std::sync::Arc;

use anyhow::Context;
use populora::base::tiny;
use populora::base::{resolve_model, BaseModel, Llama, Tokenizer, WeightsSetting};
use populora::lora::{AdamWConfig, BaseRef, LoraConfig};
use populora::scenario::{ModelSource, Scenario};
use populora::selfplay::{Grammars, Settings};
use populora::verify::SandboxConfig;

/// The frozen base and every setting derived from the scenario.
pub struct Engine {
    /// The base, on the scenario's `model.device`: the one copy that
    /// generation, scoring and the train step all run on (on a GPU, the
    /// train step's generic backward; the tokenizer and grammars stay on the
    /// CPU).
    pub model: Arc<Llama>,
    pub tokenizer: Arc<Tokenizer>,
    pub base: BaseRef,
    pub settings: Arc<Settings>,
    /// The reply grammars (none when `selfplay.constrained` is off).
    pub grammars: Arc<Grammars>,
    pub lora: LoraConfig,
    pub adamw: AdamWConfig,
    pub sandbox: SandboxConfig,
    /// [`fingerprint`] of `model`, computed on first use (cluster runs only)
    /// and shared by engines on the same weights.
    fingerprint: Arc<std::sync::OnceLock<String>>,
}

impl Engine {
    /// The base model of `scenario`, loaded; `progress` hears where it came
    /// from and how its weights are held (`base weights: native, 96.6 MB
    /// resident (96576768 bytes)`), so a run's log says which setting it
    /// ran under.
    pub fn load(scenario: &Scenario, progress: &mut dyn FnMut(&str)) -> anyhow::Result<Engine> {
        let (model, tokenizer) = base_model(scenario, progress)?;
        let held = match scenario.model.source {
            ModelSource::Tiny => "f32 (the tiny model is built in f32)",
            _ => scenario.model.weights.name(),
        };
        let bytes = model.resident_bytes();
        progress(&format!(
            "base weights: {held}, {:.1} MB resident ({bytes} bytes)",
            bytes as f64 / 1e6
        ));
        let device = populora::base::device::open(&scenario.model.device)?;
        // Loaded on the CPU, then moved: the CPU copy is dropped here.
        let model = if device.is_cpu() {
            model
        } else {
            let on_device = model.to_device(&device)?;
            drop(model);
            on_device
        };
        Engine::on(scenario, Arc::new(model), Arc::new(tokenizer))
    }

    /// `scenario`'s engine on the base `self` loaded (for a scenario with the
    /// same `[model]`): every setting is `scenario`'s, the weights are shared.
    pub fn reuse_base(&self, scenario: &Scenario) -> anyhow::Result<Engine> {
        let engine = Engine::on(scenario, self.model.clone(), self.tokenizer.clone())?;
        Ok(Engine {
            fingerprint: self.fingerprint.clone(),
            ..engine
        })
    }

    /// The base's [`fingerprint`], hashed once per loaded base.
    pub fn fingerprint(&self) -> anyhow::Result<String> {
        if let Some(done) = self.fingerprint.get() {
            return Ok(done.clone());
        }
        let computed = fingerprint(&self.model)?;
        Ok(self.fingerprint.get_or_init(|| computed).clone())
    }

    fn on(
        scenario: &Scenario,
        model: Arc<Llama>,
        tokenizer: Arc<Tokenizer>,
    ) -> anyhow::Result<Engine> {
        let settings = Settings::from_scenario(scenario);
        let grammars = Grammars::compile(&tokenizer, model.config.vocab_size, &settings)
            .context("compiling the reply grammars")?;
        Ok(Engine {
            base: BaseRef::of(&model.config),
            model,
            tokenizer,
            settings: Arc::new(settings),
            grammars: Arc::new(grammars),
            lora: scenario.adapter_config(),
            adamw: scenario.adamw_config(),
            sandbox: scenario.sandbox_config(),
            fingerprint: Arc::default(),
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
        ModelSource::Default => load(&resolve_model(None, progress)?, scenario.model.weights),
        ModelSource::Path(path) => load(path, scenario.model.weights),
    }
}

fn load(path: &std::path::Path, weights: WeightsSetting) -> anyhow::Result<(Llama, Tokenizer)> {
    let base =
        BaseModel::load(path, weights).with_context(|| format!("loading {}", path.display()))?;
    Ok((base.model, base.tokenizer))
}

/// The base's identity for a cluster handshake: SHA-256 (first 16 hex
/// digits) of its shape fingerprint, its token embeddings and its final
/// norm. Two bases with the same fingerprint have the same shape and the
/// same input and output layers; a different model, or the same one
/// fine-tuned, differs.
fn fingerprint(model: &Llama) -> anyhow::Result<String> {
    use sha2::{Digest, Sha256};
    /// Rows hashed at a time (bounds the copy for a large vocabulary).
    const ROWS: usize = 4096;
    let mut hash = Sha256::new();
    hash.update(populora::lora::shape_fingerprint(&model.config).as_bytes());
    // The same bytes whichever form the weights are kept in: their values.
    let vocab = model.embed.dims2()?.0;
    let embed_chunks = (0..vocab)
        .step_by(ROWS)
        .map(|start| model.embed.dense_rows(start, ROWS.min(vocab - start)));
    for chunk in embed_chunks.chain([Ok(model.final_norm.unsqueeze(0)?)]) {
        let values = chunk?
            .to_dtype(candle_core::DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        hash.update(&bytes);
    }
    let digest = hash.finalize();
    Ok(digest[..8].iter().map(|b| format!("{b:02x}")).collect())
}
