//! The `Adapter` type: factors per (layer, target), their shapes and scale.

use std::collections::BTreeMap;

use candle_core::{DType, Device, Tensor, Var};
use rand::Rng;
use serde::{Deserialize, Serialize};

use crate::base::{ModelConfig, Target};

/// Hyperparameters of an adapter. Defaults follow common LoRA practice.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoraConfig {
    /// Rank r of every factor pair (default 8).
    pub rank: usize,
    /// Scaling numerator (default 16).
    pub alpha: f64,
    /// Projections that carry factors (default: all seven).
    pub targets: Vec<Target>,
    /// rsLoRA scaling `alpha/√r` instead of `alpha/r` (default false).
    pub use_rslora: bool,
}

impl Default for LoraConfig {
    fn default() -> Self {
        LoraConfig {
            rank: 8,
            alpha: 16.0,
            targets: Target::ALL.to_vec(),
            use_rslora: false,
        }
    }
}

impl LoraConfig {
    pub fn scale(&self) -> f64 {
        if self.use_rslora {
            self.alpha / (self.rank as f64).sqrt()
        } else {
            self.alpha / self.rank as f64
        }
    }
}

/// Which projection of which layer a factor pair belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct ModuleKey {
    pub layer: usize,
    pub target: Target,
}

/// One factor pair: A `[r, in]`, B `[out, r]`.
#[derive(Debug, Clone)]
pub struct LoraModule {
    pub a: Var,
    pub b: Var,
}

impl LoraModule {
    /// The dense update `B·A` (without the scale): `[out, in]`. For tests and
    /// small shapes only; evolution never forms it at real sizes.
    pub fn delta_w(&self) -> candle_core::Result<Tensor> {
        self.b.as_tensor().matmul(self.a.as_tensor())
    }

    /// Frobenius norms of A, B and the unscaled update `B·A`, the last without
    /// forming it: `‖B·A‖² = Σ (BᵀB) ⊙ (A·Aᵀ)`, two `[r, r]` products.
    pub fn norms(&self) -> candle_core::Result<ModuleNorms> {
        let (a, b) = (self.a.as_tensor(), self.b.as_tensor());
        let frobenius = |t: &Tensor| -> candle_core::Result<f64> {
            Ok(t.to_dtype(DType::F64)?
                .sqr()?
                .sum_all()?
                .to_scalar::<f64>()?
                .sqrt())
        };
        let (a64, b64) = (a.to_dtype(DType::F64)?, b.to_dtype(DType::F64)?);
        let gram_a = a64.matmul(&a64.t()?)?;
        let gram_b = b64.t()?.matmul(&b64)?;
        let delta_sq = (gram_a * gram_b)?.sum_all()?.to_scalar::<f64>()?;
        Ok(ModuleNorms {
            a: frobenius(a)?,
            b: frobenius(b)?,
            delta: delta_sq.max(0.0).sqrt(),
        })
    }
}

/// Frobenius norms of one module's factors and of its update `B·A`
/// (unscaled: multiply by [`LoraConfig::scale`] for the applied ΔW).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct ModuleNorms {
    pub a: f64,
    pub b: f64,
    pub delta: f64,
}

/// A LoRA adapter for one base model. Modules are kept in a `BTreeMap` so that
/// iteration order (checksums, saving, optimizer steps) is always the same.
#[derive(Debug, Clone)]
pub struct Adapter {
    pub config: LoraConfig,
    pub modules: BTreeMap<ModuleKey, LoraModule>,
}

impl Adapter {
    /// A fresh adapter: A Kaiming-uniform (PyTorch's `kaiming_uniform_(a=√5)`,
    /// i.e. U(-1/√in, 1/√in)) from `rng`, B zero, so it leaves the base unchanged.
    pub fn new(
        config: LoraConfig,
        model: &ModelConfig,
        rng: &mut impl Rng,
        device: &Device,
    ) -> candle_core::Result<Adapter> {
        let mut modules = BTreeMap::new();
        for layer in 0..model.num_layers {
            for &target in &config.targets {
                let (fan_in, fan_out) = target.dims(model);
                let bound = 1.0 / (fan_in as f32).sqrt();
                let a: Vec<f32> = (0..config.rank * fan_in)
                    .map(|_| rng.random_range(-bound..bound))
                    .collect();
                let a = Tensor::from_vec(a, (config.rank, fan_in), device)?;
                let b = Tensor::zeros((fan_out, config.rank), DType::F32, device)?;
                modules.insert(
                    ModuleKey { layer, target },
                    LoraModule {
                        a: Var::from_tensor(&a)?,
                        b: Var::from_tensor(&b)?,
                    },
                );
            }
        }
        Ok(Adapter { config, modules })
    }

    /// The initial adapter of population member `member` in a run seeded
    /// `seed`: [`Adapter::new`] from the stream keyed `(seed, "init",
    /// member)`. Every run starts its members this way, and `populora adapter
    /// new` makes the same adapter.
    pub fn for_member(
        config: LoraConfig,
        model: &ModelConfig,
        seed: u64,
        member: &str,
        device: &Device,
    ) -> candle_core::Result<Adapter> {
        let mut rng = crate::keyed_stream!(seed, "init", member);
        Adapter::new(config, model, &mut rng, device)
    }

    pub fn scale(&self) -> f64 {
        self.config.scale()
    }

    pub fn get(&self, layer: usize, target: Target) -> Option<&LoraModule> {
        self.modules.get(&ModuleKey { layer, target })
    }

    /// Every trainable variable, in a fixed order (A then B per module).
    pub fn vars(&self) -> Vec<&Var> {
        self.modules.values().flat_map(|m| [&m.a, &m.b]).collect()
    }
}
