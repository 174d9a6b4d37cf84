//! LoRA adapters: the trainable part of every population member.
//!
//! An adapter holds, for each layer and each target projection, the factors
//! A `[r, in]` and B `[out, r]`; the projection's weight becomes
//! `W + scale · B·A` with `scale = alpha / r` (or `alpha / √r` with rsLoRA).

mod adamw;
mod adapter;
mod error;
mod files;
mod formats;
mod peft;
mod shape;
mod store;

pub use adamw::{
    clip_grad_norm, grad_norm, AdamW, AdamWConfig, AdapterGrads, Moments, StepReport,
    OPTIMIZER_META, OPTIMIZER_TENSORS,
};
pub use adapter::{Adapter, LoraConfig, LoraModule, ModuleKey, ModuleNorms};
pub use error::{Error, Result};
pub use formats::{AdapterDir, AdapterFormat};
pub use peft::{
    export_peft, import_peft, peft_key, read_peft, PeftAdapter, PEFT_CONFIG, PEFT_TENSORS,
};
pub use store::{
    known_model, model_label, names_model, same_model_name, shape_fingerprint, BaseRef,
    ADAPTER_META, ADAPTER_TENSORS,
};
