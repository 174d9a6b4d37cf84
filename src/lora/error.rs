//! `lora::Error`: everything that can go wrong with adapters, their files and
//! the optimizer. Messages name the file, module or value at fault.

use std::path::PathBuf;

use super::ModuleKey;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },

    #[error("{path}: invalid JSON: {source}")]
    Json {
        path: PathBuf,
        source: serde_json::Error,
    },

    #[error("{path}: invalid safetensors file: {message}")]
    Safetensors { path: PathBuf, message: String },

    #[error("{path}: not a {expected} file (found format {found:?}, version {version})")]
    UnsupportedFormat {
        path: PathBuf,
        expected: &'static str,
        found: String,
        version: u32,
    },

    #[error("{path}: checksum mismatch (recorded {recorded}, contents give {actual}): the file is corrupt or was edited")]
    ChecksumMismatch {
        path: PathBuf,
        recorded: String,
        actual: String,
    },

    #[error("{path}: tensor {key} has dtype {dtype}; only F32, F16 and BF16 are accepted")]
    UnsupportedDtype {
        path: PathBuf,
        key: String,
        dtype: String,
    },

    #[error("{path}: unknown tensor key {key:?}")]
    UnknownKey { path: PathBuf, key: String },

    #[error("{path}: unknown target module {name:?} (known: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj)")]
    UnknownTarget { path: PathBuf, name: String },

    #[error("{path}: PEFT option {field} = {value} is not supported")]
    UnsupportedPeftOption {
        path: PathBuf,
        field: &'static str,
        value: String,
    },

    #[error("{path} is not an adapter directory: it holds neither adapter.json (a populora adapter) nor adapter_config.json (a PEFT adapter)")]
    NotAnAdapter { path: PathBuf },

    #[error("invalid LoRA config: {0}")]
    InvalidConfig(String),

    #[error("{module}: {factor} has shape {found:?}, expected {expected:?}")]
    Shape {
        module: ModuleKey,
        factor: &'static str,
        expected: Vec<usize>,
        found: Vec<usize>,
    },

    #[error("{module}: {factor} has shape {found:?}; factors are matrices")]
    NotAMatrix {
        module: ModuleKey,
        factor: &'static str,
        found: Vec<usize>,
    },

    #[error("{module}: rank {found} differs from the adapter's rank {expected}")]
    Rank {
        module: ModuleKey,
        expected: usize,
        found: usize,
    },

    #[error("{module}: {factor} has dtype {dtype:?}; adapters are F32")]
    Dtype {
        module: ModuleKey,
        factor: &'static str,
        dtype: candle_core::DType,
    },

    #[error("adapter has {found} layers, the base model has {expected}")]
    LayerCount { expected: usize, found: usize },

    #[error("module {0} is missing (every layer must carry every configured target)")]
    MissingModule(ModuleKey),

    #[error("module {0} is present but its target is not in the config's targets")]
    UnexpectedModule(ModuleKey),

    #[error("adapter was made for base {found:?} but the base model is {expected}")]
    BaseMismatch { expected: String, found: String },

    #[error("gradients do not match the adapter: {0}")]
    GradMismatch(String),

    #[error("{count} non-finite value(s) in the gradient of {module} {factor}: update skipped, adapter and optimizer unchanged")]
    NonFiniteGradient {
        module: ModuleKey,
        factor: &'static str,
        count: usize,
    },

    #[error("optimizer state does not match the adapter: {0}")]
    OptimizerMismatch(String),

    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

pub type Result<T> = std::result::Result<T, Error>;
