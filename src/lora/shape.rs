//! Shape checks for adapters: internal consistency (every layer carries every
//! target, one rank, one shape per target) and agreement with a base model.
//! Every file reader runs these before handing an adapter out.

use std::collections::BTreeMap;

use candle_core::{DType, Var};

use super::error::{Error, Result};
use super::{Adapter, LoraConfig, ModuleKey};
use crate::base::ModelConfig;
use crate::base::Target;

pub(crate) const FACTOR_A: &str = "lora_A";
pub(crate) const FACTOR_B: &str = "lora_B";

impl std::fmt::Display for ModuleKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "layers.{}.{}", self.layer, self.target)
    }
}

impl LoraConfig {
    /// A rank of at least 1, a finite positive alpha, and targets listed once.
    pub fn check(&self) -> Result<()> {
        if self.rank == 0 {
            return Err(Error::InvalidConfig("rank must be at least 1".into()));
        }
        if !(self.alpha.is_finite() && self.alpha > 0.0) {
            return Err(Error::InvalidConfig(format!(
                "alpha must be finite and positive, got {}",
                self.alpha
            )));
        }
        if self.targets.is_empty() {
            return Err(Error::InvalidConfig("no target modules".into()));
        }
        for (i, target) in self.targets.iter().enumerate() {
            if self.targets[..i].contains(target) {
                return Err(Error::InvalidConfig(format!(
                    "target {target} listed twice"
                )));
            }
        }
        Ok(())
    }
}

impl Adapter {
    /// Number of layers the adapter covers (one past the highest layer index).
    pub fn num_layers(&self) -> usize {
        self.modules.keys().map(|k| k.layer + 1).max().unwrap_or(0)
    }

    /// `(in_features, out_features)` of `target`, read from layer 0's factors.
    pub fn target_dims(&self, target: Target) -> Option<(usize, usize)> {
        let module = self.get(0, target)?;
        Some((*module.a.dims().get(1)?, *module.b.dims().first()?))
    }

    /// Checks what can be checked without a base model: a sane config, every
    /// layer `0..num_layers` carrying exactly the configured targets, F32
    /// factors of rank `config.rank`, and one shape per target across layers.
    pub fn check_consistent(&self) -> Result<()> {
        self.check_config()?;
        let layers = self.num_layers();
        for layer in 0..layers {
            for &target in &self.config.targets {
                let key = ModuleKey { layer, target };
                if !self.modules.contains_key(&key) {
                    return Err(Error::MissingModule(key));
                }
            }
        }
        let mut dims_of_target: BTreeMap<Target, (usize, usize)> = BTreeMap::new();
        for (&key, module) in &self.modules {
            if !self.config.targets.contains(&key.target) {
                return Err(Error::UnexpectedModule(key));
            }
            let (fan_in, fan_out) = self.factor_dims(key, &module.a, &module.b)?;
            let expected = *dims_of_target
                .entry(key.target)
                .or_insert((fan_in, fan_out));
            self.check_factor_shapes(key, &module.a, &module.b, expected)?;
        }
        Ok(())
    }

    /// Checks the adapter against the base it will be applied to: the number of
    /// layers and every factor's shape must match `cfg`.
    pub fn check_against(&self, cfg: &ModelConfig) -> Result<()> {
        self.check_consistent()?;
        if self.num_layers() != cfg.num_layers {
            return Err(Error::LayerCount {
                expected: cfg.num_layers,
                found: self.num_layers(),
            });
        }
        for (&key, module) in &self.modules {
            self.check_factor_shapes(key, &module.a, &module.b, key.target.dims(cfg))?;
        }
        Ok(())
    }

    fn check_config(&self) -> Result<()> {
        self.config.check()?;
        if self.modules.is_empty() {
            return Err(Error::InvalidConfig("adapter has no modules".into()));
        }
        Ok(())
    }

    /// `(in, out)` from a pair of rank-2 F32 factors, checking the rank.
    fn factor_dims(&self, key: ModuleKey, a: &Var, b: &Var) -> Result<(usize, usize)> {
        for (factor, var) in [(FACTOR_A, a), (FACTOR_B, b)] {
            if var.dtype() != DType::F32 {
                return Err(Error::Dtype {
                    module: key,
                    factor,
                    dtype: var.dtype(),
                });
            }
            if var.rank() != 2 {
                return Err(Error::NotAMatrix {
                    module: key,
                    factor,
                    found: var.dims().to_vec(),
                });
            }
        }
        let rank = self.config.rank;
        for found in [a.dims()[0], b.dims()[1]] {
            if found != rank {
                return Err(Error::Rank {
                    module: key,
                    expected: rank,
                    found,
                });
            }
        }
        Ok((a.dims()[1], b.dims()[0]))
    }

    fn check_factor_shapes(
        &self,
        key: ModuleKey,
        a: &Var,
        b: &Var,
        (fan_in, fan_out): (usize, usize),
    ) -> Result<()> {
        self.factor_dims(key, a, b)?;
        let rank = self.config.rank;
        for (factor, var, expected) in [
            (FACTOR_A, a, [rank, fan_in]),
            (FACTOR_B, b, [fan_out, rank]),
        ] {
            if var.dims() != expected {
                return Err(Error::Shape {
                    module: key,
                    factor,
                    expected: expected.to_vec(),
                    found: var.dims().to_vec(),
                });
            }
        }
        Ok(())
    }
}
