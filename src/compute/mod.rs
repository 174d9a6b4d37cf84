//! Multi-adapter batched compute: what the broker executes.
//!
//! One pass through the frozen base serves a batch whose rows name different
//! adapters (or none): each row is shrunk to rank r by its adapter's A,
//! expanded by its B and added to the frozen projection's output
//! ([`RowAdapters`]). Rows are ordered by adapter id before anything runs, so
//! results never depend on request order.

mod cost;
#[cfg(all(test, feature = "cuda"))]
mod cuda_tests;
mod generate;
mod generic_tape;
pub mod lora_op;
mod memory;
mod row_adapters;
mod tape;
mod train;

pub use cost::Cost;
pub use generate::{
    generate, generate_with, generate_with_stats, generate_with_top, sample_token, DecodeOptions,
    DecodeStats, GenRequest, Generation, Pick, Sampling, StopReason,
};
pub use memory::TrainMemory;
pub use row_adapters::{AdapterId, AdapterSet, RowAdapters};
pub use train::{
    logprobs, train_step, train_step_with, ScoreRow, TrainConfig, TrainOutput, TrainRow,
    TrainStats, DEFAULT_TOKEN_BUDGET,
};

/// Which backward a train step runs. Both read the activations of the one
/// forward ([`tape::forward`]) and compute the same gradients.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backward {
    /// [`tape`]: our CPU kernels, the fastest on a CPU; refuses another device.
    Tape,
    /// [`generic_tape`]: the same formulas in candle's device-generic ops and
    /// the LoRA kernels of [`lora_op`]; on a CPU, the tape's reference.
    Generic,
}

impl Backward {
    /// The backward for a model on `device`: the tape on the CPU, the
    /// generic one elsewhere.
    pub fn for_device(device: &candle_core::Device) -> Backward {
        if device.is_cpu() {
            Backward::Tape
        } else {
            Backward::Generic
        }
    }
}

/// `f`, run on a thread of rayon's pool (inline when called from one). Every
/// kernel of a pass splits its work over the pool: started from inside it, a
/// parallel loop hands work to the other threads directly; started from
/// outside (the broker's thread, a CLI's main thread), each of the ~250
/// loops of a SmolLM2 decode step wakes the pool and waits on a condvar for
/// it (not measured apart: BENCHMARKS.md's figures include it). Where code
/// runs changes no result.
pub(crate) fn in_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    rayon::scope(|_| f())
}

/// Errors of batched compute.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Base(#[from] crate::base::Error),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    #[error("row {row} names adapter {adapter}, which is not in the adapter set")]
    UnknownAdapter { row: usize, adapter: AdapterId },
    #[error("adapter {adapter} does not fit the base: {reason}")]
    AdapterMismatch { adapter: AdapterId, reason: String },
    #[error("row {row}: {reason}")]
    BadRow { row: usize, reason: String },
    #[error("{0}")]
    Unsupported(&'static str),
}

pub type Result<T> = std::result::Result<T, Error>;
