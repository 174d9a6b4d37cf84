//! A frozen weight matrix `[out, in]` and which form the base keeps it in:
//! a tensor (f32, or whatever dtype and device it was moved to), or blocks as
//! the GGUF file holds them ([`super::blocks`]), on the CPU.
//!
//! Which one a load keeps is the scenario's `[model] weights`
//! ([`WeightsSetting`]). Both give the same values: blocks are the exact
//! values of their dequantization, formed in registers by the kernels
//! ([`super::native`]).

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};

use super::blocks::BlockMatrix;
use super::error::Result;

/// How a loaded base keeps its frozen matrices (`[model] weights`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WeightsSetting {
    /// As the file holds them where a kernel reads that format (Q4_1, Q8_0,
    /// F16, BF16); anything else dequantized to f32.
    #[default]
    Native,
    /// Everything dequantized to f32 at load.
    F32,
}

impl WeightsSetting {
    pub fn name(self) -> &'static str {
        match self {
            WeightsSetting::Native => "native",
            WeightsSetting::F32 => "f32",
        }
    }

    /// `"native"` or `"f32"`.
    pub fn parse(name: &str) -> Option<WeightsSetting> {
        match name {
            "native" => Some(WeightsSetting::Native),
            "f32" => Some(WeightsSetting::F32),
            _ => None,
        }
    }
}

/// A frozen `[out, in]` matrix.
#[derive(Debug, Clone)]
pub enum Weight {
    /// A tensor of any dtype on any device.
    Dense(Tensor),
    /// Blocks on the CPU, shared between clones.
    Blocks(Arc<BlockMatrix>),
}

impl From<Tensor> for Weight {
    fn from(t: Tensor) -> Weight {
        Weight::Dense(t)
    }
}

impl From<BlockMatrix> for Weight {
    fn from(b: BlockMatrix) -> Weight {
        Weight::Blocks(Arc::new(b))
    }
}

impl Weight {
    /// `(out, in)`.
    pub fn dims2(&self) -> Result<(usize, usize)> {
        Ok(match self {
            Weight::Dense(t) => t.dims2()?,
            Weight::Blocks(b) => (b.rows(), b.cols()),
        })
    }

    pub fn device(&self) -> Device {
        match self {
            Weight::Dense(t) => t.device().clone(),
            Weight::Blocks(_) => Device::Cpu,
        }
    }

    /// The values as a tensor: the tensor itself, or the blocks decoded to a
    /// fresh f32 tensor (for a copy on another device, an export, a check).
    pub fn dense(&self) -> Result<Tensor> {
        Ok(match self {
            Weight::Dense(t) => t.clone(),
            Weight::Blocks(b) => Tensor::from_vec(b.to_f32(), (b.rows(), b.cols()), &Device::Cpu)?,
        })
    }

    /// Rows `start..start + len`, as a tensor.
    pub fn dense_rows(&self, start: usize, len: usize) -> Result<Tensor> {
        Ok(match self {
            Weight::Dense(t) => t.narrow(0, start, len)?,
            Weight::Blocks(_) => {
                let ids: Vec<u32> = (start..start + len).map(|r| r as u32).collect();
                self.rows(&Tensor::new(ids.as_slice(), &Device::Cpu)?, DType::F32)?
            }
        })
    }

    /// The rows `ids` (u32 `[n]`) name, `[n, in]` in `dtype`: an embedding lookup.
    pub fn rows(&self, ids: &Tensor, dtype: DType) -> Result<Tensor> {
        Ok(match self {
            Weight::Dense(t) => t.index_select(ids, 0)?.to_dtype(dtype)?,
            Weight::Blocks(b) => {
                let ids = ids.to_vec1::<u32>()?;
                let values = b.gather(&ids).map_err(candle_core::Error::Msg)?;
                Tensor::from_vec(values, (ids.len(), b.cols()), &Device::Cpu)?.to_dtype(dtype)?
            }
        })
    }

    /// The same matrix through `f` when it is a tensor; blocks stay as they
    /// are unless `dense_blocks` (a move off the CPU: decoded to f32 first).
    pub fn map(
        &self,
        f: impl Fn(&Tensor) -> candle_core::Result<Tensor>,
        dense_blocks: bool,
    ) -> Result<Weight> {
        Ok(match self {
            Weight::Dense(t) => Weight::Dense(f(t)?),
            Weight::Blocks(_) if dense_blocks => Weight::Dense(f(&self.dense()?)?),
            Weight::Blocks(b) => Weight::Blocks(b.clone()),
        })
    }

    /// Whether `self` and `other` are one matrix (a tied LM head).
    pub fn same(&self, other: &Weight) -> bool {
        match (self, other) {
            (Weight::Dense(a), Weight::Dense(b)) => a.id() == b.id(),
            (Weight::Blocks(a), Weight::Blocks(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }

    /// Bytes the matrix holds.
    pub fn resident_bytes(&self) -> usize {
        match self {
            Weight::Dense(t) => t.elem_count() * t.dtype().size_in_bytes(),
            Weight::Blocks(b) => b.resident_bytes(),
        }
    }

    pub fn blocks(&self) -> Option<&BlockMatrix> {
        match self {
            Weight::Dense(_) => None,
            Weight::Blocks(b) => Some(b),
        }
    }
}
