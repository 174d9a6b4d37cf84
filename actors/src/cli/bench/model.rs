//! Which model the model benchmarks (`bench generate`, `bench broker`) run,
//! and where.

use std::path::PathBuf;

use populora::base::blocks::BlockFormat;
use populora::base::{self, BaseModel, WeightsSetting};

#[derive(clap::Args)]
pub struct BenchModel {
    /// A GGUF file or HF model directory (default: the default model, fetched on first use).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// `cpu`, `cuda` or `cuda:N` (`cuda` needs a build with `--features cuda`).
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Random weights in the default model's shape, built in memory: for speed
    /// only, on a machine that cannot fetch the model (replies are not text).
    #[arg(long, conflicts_with = "model")]
    pub random_weights: bool,
    /// With `--random-weights`, another shape: `KEY=N,...` over `hidden`,
    /// `layers`, `heads`, `kv_heads`, `ffn`, `vocab` (the others stay
    /// SmolLM2's), e.g. `hidden=2048,heads=32,kv_heads=8,ffn=5632,layers=8`.
    #[arg(long, requires = "random_weights")]
    pub random_shape: Option<String>,
    /// How the base keeps its weights (`[model] weights`): `native`, `f32`,
    /// or both (`native,f32`), each measured side by side in this one run.
    /// Random weights under `native` are quantized as the default GGUF is
    /// (Q4_1 projections, Q8_0 embedding).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "native",
        value_parser = crate::cli::generate::parse_weights
    )]
    pub weights: Vec<WeightsSetting>,
}

/// The default model's shape with the sizes `spec` (`KEY=N,...`) names
/// (checked when it is built).
fn random_shape(spec: Option<&str>) -> anyhow::Result<base::tiny::TinySpec> {
    let mut shape = base::tiny::TinySpec::default_model_shape();
    for part in spec.into_iter().flat_map(|s| s.split(',')) {
        let (key, value) = part
            .split_once('=')
            .ok_or_else(|| anyhow::anyhow!("--random-shape: {part:?} is not KEY=N"))?;
        let value: usize = value
            .trim()
            .parse()
            .map_err(|_| anyhow::anyhow!("--random-shape: {key} = {value:?} is not a size"))?;
        let field = match key.trim() {
            "hidden" => &mut shape.hidden,
            "layers" => &mut shape.layers,
            "heads" => &mut shape.heads,
            "kv_heads" => &mut shape.kv_heads,
            "ffn" => &mut shape.ffn,
            "vocab" => &mut shape.vocab,
            other => anyhow::bail!(
                "--random-shape: unknown size {other:?} (known: hidden, layers, heads, kv_heads, ffn, vocab)"
            ),
        };
        *field = value;
    }
    Ok(shape)
}

impl BenchModel {
    /// The model once per `--weights` setting (each named), on its device.
    /// The device is checked first, so a bad one fails before anything loads.
    pub fn load_each(&self) -> anyhow::Result<Vec<(&'static str, BaseModel)>> {
        let device = base::device::open(&self.device)?;
        let mut settings = self.weights.clone();
        settings.dedup();
        if settings.is_empty() {
            anyhow::bail!("--weights names no setting");
        }
        settings
            .into_iter()
            .map(|weights| {
                let base = self.load_as(weights)?.to_device(&device)?;
                Ok((weights.name(), base))
            })
            .collect()
    }

    fn load_as(&self, weights: WeightsSetting) -> anyhow::Result<BaseModel> {
        if !self.random_weights {
            return crate::cli::generate::load_model(self.model.as_deref(), weights);
        }
        let (model, vocab) = base::tiny::build(&random_shape(self.random_shape.as_deref())?)?;
        let model = match weights {
            WeightsSetting::F32 => model,
            WeightsSetting::Native => model.quantized(BlockFormat::Q4_1, BlockFormat::Q8_0)?,
        };
        Ok(BaseModel {
            model,
            tokenizer: vocab.tokenizer()?,
            source: base::Source::Random,
            path: PathBuf::from("random-weights"),
        })
    }
}
