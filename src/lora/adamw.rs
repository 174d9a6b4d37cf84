//! AdamW over an adapter's factors, with state that can be inspected, saved,
//! loaded and copied (PBT clones a member's optimizer with its adapter;
//! `candle_nn::AdamW` hides its moments, hence this one).
//!
//! The update is PyTorch's `torch.optim.AdamW`: decoupled weight decay
//! `p ← p − lr·wd·p`, then `p ← p − lr·m̂/(√v̂ + eps)` with bias-corrected
//! moments `m̂ = m/(1−β₁ᵗ)`, `v̂ = v/(1−β₂ᵗ)`.
//!
//! Gradients with a NaN or infinity never reach the adapter: `step` and
//! `clip_grad_norm` return [`Error::NonFiniteGradient`] and change nothing.

use std::collections::BTreeMap;
use std::path::Path;

use candle_core::{Device, Tensor};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::error::{Error, Result};
use super::files::{
    encode_safetensors, read_json, read_safetensors, to_json_bytes, write_atomically,
};
use super::shape::{FACTOR_A, FACTOR_B};
use super::store::{hash_str, hash_tensor, tensor_key};
use super::{Adapter, ModuleKey};
use crate::base::fetch::hex;

/// Gradients of one adapter: `(dA, dB)` per module, shaped like `(A, B)`.
pub type AdapterGrads = BTreeMap<ModuleKey, (Tensor, Tensor)>;

pub const OPTIMIZER_TENSORS: &str = "optimizer.safetensors";
pub const OPTIMIZER_META: &str = "optimizer.json";
const FORMAT: &str = "populora-adamw";
const FORMAT_VERSION: u32 = 1;
/// Added to the norm before dividing, as PyTorch's `clip_grad_norm_` does.
const CLIP_EPS: f64 = 1e-6;

/// AdamW hyperparameters.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct AdamWConfig {
    /// Learning rate (default 1e-4, a common LoRA rate).
    pub lr: f64,
    /// First-moment decay β₁ (default 0.9).
    pub beta1: f64,
    /// Second-moment decay β₂ (default 0.999).
    pub beta2: f64,
    /// Denominator guard (default 1e-8).
    pub eps: f64,
    /// Decoupled weight decay (default 0.0: LoRA factors are usually not decayed).
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        AdamWConfig {
            lr: 1e-4,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        }
    }
}

/// First and second moments of one module's factors.
#[derive(Debug, Clone)]
pub struct Moments {
    pub m_a: Tensor,
    pub v_a: Tensor,
    pub m_b: Tensor,
    pub v_b: Tensor,
}

/// AdamW state. Moments are created (zero) at the first step; tensors are
/// replaced, never written in place, so `clone` is an independent copy.
#[derive(Debug, Clone)]
pub struct AdamW {
    pub config: AdamWConfig,
    /// Updates applied so far (t in the bias correction).
    pub steps_taken: u64,
    pub moments: BTreeMap<ModuleKey, Moments>,
}

/// What one call to [`AdamW::step`] did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepReport {
    /// `steps_taken` after the update.
    pub step: u64,
    /// Global L2 norm of the gradients that were applied.
    pub grad_norm: f64,
}

#[derive(Debug, Serialize, Deserialize)]
struct OptimizerMeta {
    format: String,
    version: u32,
    config: AdamWConfig,
    steps_taken: u64,
    checksum: String,
}

impl AdamW {
    pub fn new(config: AdamWConfig) -> AdamW {
        AdamW {
            config,
            steps_taken: 0,
            moments: BTreeMap::new(),
        }
    }

    /// Forget the moments and the step count, keeping the hyperparameters.
    pub fn reset(&mut self) {
        self.steps_taken = 0;
        self.moments.clear();
    }

    /// Applies one AdamW update to `adapter`. Gradients must cover exactly the
    /// adapter's modules with matching shapes; if any is non-finite, nothing
    /// changes and [`Error::NonFiniteGradient`] says where.
    pub fn step(&mut self, adapter: &Adapter, grads: &AdapterGrads) -> Result<StepReport> {
        check_grads_match(adapter, grads)?;
        self.check_moments_match(adapter)?;
        let grad_norm = grad_norm(grads)?;
        let t = self.steps_taken + 1;
        let mut updated = Vec::with_capacity(adapter.modules.len());
        for (key, module) in &adapter.modules {
            let (d_a, d_b) = &grads[key];
            let old = match self.moments.get(key) {
                Some(moments) => moments.clone(),
                None => Moments {
                    m_a: d_a.zeros_like()?,
                    v_a: d_a.zeros_like()?,
                    m_b: d_b.zeros_like()?,
                    v_b: d_b.zeros_like()?,
                },
            };
            let (a, m_a, v_a) = self.update(module.a.as_tensor(), d_a, &old.m_a, &old.v_a, t)?;
            let (b, m_b, v_b) = self.update(module.b.as_tensor(), d_b, &old.m_b, &old.v_b, t)?;
            updated.push((*key, a, b, Moments { m_a, v_a, m_b, v_b }));
        }
        // Every new value is computed before anything is written, so an error
        // above leaves adapter and state as they were.
        for (key, a, b, moments) in updated {
            let module = &adapter.modules[&key];
            module.a.set(&a)?;
            module.b.set(&b)?;
            self.moments.insert(key, moments);
        }
        self.steps_taken = t;
        Ok(StepReport { step: t, grad_norm })
    }

    /// One parameter's new value and moments at step `t`.
    fn update(
        &self,
        param: &Tensor,
        grad: &Tensor,
        m: &Tensor,
        v: &Tensor,
        t: u64,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let c = &self.config;
        // Detached so that stored moments never hold a backprop graph that
        // would chain every earlier step's tensors together.
        let (param, grad) = (param.detach(), grad.detach());
        let m = ((m * c.beta1)? + (&grad * (1.0 - c.beta1))?)?.detach();
        let v = ((v * c.beta2)? + (grad.sqr()? * (1.0 - c.beta2))?)?.detach();
        let t = i32::try_from(t).unwrap_or(i32::MAX);
        let m_hat = (&m / (1.0 - c.beta1.powi(t)))?;
        let v_hat = (&v / (1.0 - c.beta2.powi(t)))?;
        let direction = (m_hat / (v_hat.sqrt()? + c.eps)?)?;
        let decayed = (&param * (1.0 - c.lr * c.weight_decay))?;
        let param = (decayed - (direction * c.lr)?)?;
        Ok((param, m, v))
    }

    fn check_moments_match(&self, adapter: &Adapter) -> Result<()> {
        for (key, moments) in &self.moments {
            let module = adapter.modules.get(key).ok_or_else(|| {
                Error::OptimizerMismatch(format!("state for {key}, which the adapter lacks"))
            })?;
            let same = moments.m_a.dims() == module.a.dims()
                && moments.v_a.dims() == module.a.dims()
                && moments.m_b.dims() == module.b.dims()
                && moments.v_b.dims() == module.b.dims();
            if !same {
                return Err(Error::OptimizerMismatch(format!(
                    "moments of {key} have shapes {:?}/{:?}, factors {:?}/{:?}",
                    moments.m_a.dims(),
                    moments.m_b.dims(),
                    module.a.dims(),
                    module.b.dims()
                )));
            }
        }
        Ok(())
    }

    /// SHA-256 (hex) over hyperparameters, step count and every moment.
    pub fn checksum(&self) -> Result<String> {
        let mut h = Sha256::new();
        h.update(b"populora-adamw-v1");
        let c = &self.config;
        for x in [c.lr, c.beta1, c.beta2, c.eps, c.weight_decay] {
            h.update(x.to_bits().to_le_bytes());
        }
        h.update(self.steps_taken.to_le_bytes());
        for (key, moments) in &self.moments {
            h.update((key.layer as u64).to_le_bytes());
            hash_str(&mut h, key.target.hf_name());
            for tensor in [&moments.m_a, &moments.v_a, &moments.m_b, &moments.v_b] {
                hash_tensor(&mut h, tensor)?;
            }
        }
        Ok(hex(&h.finalize()))
    }

    /// Writes `optimizer.safetensors` + `optimizer.json` into `dir` atomically
    /// (it may be the adapter's directory: the names do not clash).
    pub fn save(&self, dir: &Path) -> Result<()> {
        let mut tensors = BTreeMap::new();
        for (&key, moments) in &self.moments {
            for (name, tensor) in moment_tensors(key, moments) {
                tensors.insert(name, tensor.clone());
            }
        }
        let meta = OptimizerMeta {
            format: FORMAT.into(),
            version: FORMAT_VERSION,
            config: self.config,
            steps_taken: self.steps_taken,
            checksum: self.checksum()?,
        };
        write_atomically(
            dir,
            &[
                (OPTIMIZER_TENSORS, encode_safetensors(&tensors, None)?),
                (OPTIMIZER_META, to_json_bytes(&meta)?),
            ],
        )
    }

    /// Reads state written by [`AdamW::save`], verifying its checksum.
    pub fn load(dir: &Path, device: &Device) -> Result<AdamW> {
        let meta_path = dir.join(OPTIMIZER_META);
        let meta: OptimizerMeta = read_json(&meta_path)?;
        if meta.format != FORMAT || meta.version != FORMAT_VERSION {
            return Err(Error::UnsupportedFormat {
                path: meta_path,
                expected: FORMAT,
                found: meta.format,
                version: meta.version,
            });
        }
        let tensors_path = dir.join(OPTIMIZER_TENSORS);
        let mut tensors = read_safetensors(&tensors_path, device)?;
        let mut moments = BTreeMap::new();
        // Each module's four moments are taken together, at its first key.
        let names: Vec<String> = tensors.keys().cloned().collect();
        for name in names {
            let Some(key) = parse_moment_key(&name) else {
                return Err(Error::UnknownKey {
                    path: tensors_path,
                    key: name,
                });
            };
            if moments.contains_key(&key) {
                continue;
            }
            moments.insert(key, take_moments(key, &mut tensors, &tensors_path)?);
        }
        let optimizer = AdamW {
            config: meta.config,
            steps_taken: meta.steps_taken,
            moments,
        };
        let actual = optimizer.checksum()?;
        if actual != meta.checksum {
            return Err(Error::ChecksumMismatch {
                path: tensors_path,
                recorded: meta.checksum,
                actual,
            });
        }
        Ok(optimizer)
    }
}

const MOMENT_NAMES: [(&str, &str); 4] = [
    (FACTOR_A, "exp_avg"),
    (FACTOR_A, "exp_avg_sq"),
    (FACTOR_B, "exp_avg"),
    (FACTOR_B, "exp_avg_sq"),
];

/// `layers.{N}.{q_proj}.lora_A.exp_avg` etc., in `MOMENT_NAMES` order.
fn moment_tensors(key: ModuleKey, moments: &Moments) -> [(String, &Tensor); 4] {
    let tensors = [&moments.m_a, &moments.v_a, &moments.m_b, &moments.v_b];
    std::array::from_fn(|i| {
        let (factor, moment) = MOMENT_NAMES[i];
        (format!("{}.{moment}", tensor_key(key, factor)), tensors[i])
    })
}

fn parse_moment_key(name: &str) -> Option<ModuleKey> {
    let parts: Vec<&str> = name.split('.').collect();
    let ["layers", layer, target, factor, moment] = parts[..] else {
        return None;
    };
    let key = ModuleKey {
        layer: layer.parse().ok()?,
        target: crate::base::Target::ALL
            .into_iter()
            .find(|t| t.hf_name() == target)?,
    };
    MOMENT_NAMES.contains(&(factor, moment)).then_some(key)
}

fn take_moments(
    key: ModuleKey,
    tensors: &mut BTreeMap<String, Tensor>,
    path: &Path,
) -> Result<Moments> {
    let mut take = |(factor, moment): (&str, &str)| {
        let name = format!("{}.{moment}", tensor_key(key, factor));
        tensors.remove(&name).ok_or_else(|| {
            Error::OptimizerMismatch(format!("{}: {name} is missing", path.display()))
        })
    };
    Ok(Moments {
        m_a: take(MOMENT_NAMES[0])?,
        v_a: take(MOMENT_NAMES[1])?,
        m_b: take(MOMENT_NAMES[2])?,
        v_b: take(MOMENT_NAMES[3])?,
    })
}

/// Exactly the adapter's modules, each `(dA, dB)` shaped like `(A, B)`.
fn check_grads_match(adapter: &Adapter, grads: &AdapterGrads) -> Result<()> {
    if let Some(key) = grads.keys().find(|k| !adapter.modules.contains_key(k)) {
        return Err(Error::GradMismatch(format!(
            "gradient for {key}, which the adapter lacks"
        )));
    }
    for (key, module) in &adapter.modules {
        let (d_a, d_b) = grads
            .get(key)
            .ok_or_else(|| Error::GradMismatch(format!("no gradient for {key}")))?;
        for (factor, grad, var) in [(FACTOR_A, d_a, &module.a), (FACTOR_B, d_b, &module.b)] {
            if grad.dims() != var.dims() || grad.dtype() != var.dtype() {
                return Err(Error::GradMismatch(format!(
                    "{key} {factor}: gradient {:?} {:?}, factor {:?} {:?}",
                    grad.dims(),
                    grad.dtype(),
                    var.dims(),
                    var.dtype()
                )));
            }
        }
    }
    Ok(())
}

/// Global L2 norm of all gradients, computed in f64. Fails with
/// [`Error::NonFiniteGradient`] naming the first module holding a NaN or ±inf.
pub fn grad_norm(grads: &AdapterGrads) -> Result<f64> {
    let mut sum_sq = 0.0f64;
    for (&key, (d_a, d_b)) in grads {
        for (factor, grad) in [(FACTOR_A, d_a), (FACTOR_B, d_b)] {
            let values = grad.flatten_all()?.to_vec1::<f32>()?;
            let count = values.iter().filter(|x| !x.is_finite()).count();
            if count > 0 {
                return Err(Error::NonFiniteGradient {
                    module: key,
                    factor,
                    count,
                });
            }
            sum_sq += values
                .iter()
                .map(|&x| f64::from(x) * f64::from(x))
                .sum::<f64>();
        }
    }
    Ok(sum_sq.sqrt())
}

/// Scales `grads` in place so that their global L2 norm is at most `max_norm`
/// (PyTorch's `clip_grad_norm_`). Returns the norm before clipping. Non-finite
/// gradients are an error and are left untouched.
pub fn clip_grad_norm(grads: &mut AdapterGrads, max_norm: f64) -> Result<f64> {
    let total = grad_norm(grads)?;
    let coef = max_norm / (total + CLIP_EPS);
    if coef < 1.0 {
        for (d_a, d_b) in grads.values_mut() {
            *d_a = (&*d_a * coef)?;
            *d_b = (&*d_b * coef)?;
        }
    }
    Ok(total)
}
