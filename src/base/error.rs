//! Errors of the base-model layer. Each names the file or value at fault.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: not a valid model file: {reason}")]
    BadFile { path: PathBuf, reason: String },
    #[error("{path}: unsupported architecture {arch:?} (supported: {supported})")]
    UnsupportedArch {
        path: PathBuf,
        arch: String,
        supported: &'static str,
    },
    #[error("{path}: missing metadata field {field:?}")]
    MissingField { path: PathBuf, field: String },
    #[error("{path}: tensor {name:?}: {reason}")]
    BadTensor {
        path: PathBuf,
        name: String,
        reason: String,
    },
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error(
        "{path}: the model has no chat template ({key} is missing); populora writes \
         prompts in the model's own chat format, so it needs a model that ships one"
    )]
    NoChatTemplate { path: PathBuf, key: &'static str },
    #[error("{origin}: the chat template does not compile: {reason}")]
    BadChatTemplate { origin: String, reason: String },
    #[error("{origin}: rendering the chat template failed: {reason}")]
    ChatRender { origin: String, reason: String },
    #[error("{path}: the model declares no end-of-sequence token (looked for {looked})")]
    NoEosToken { path: PathBuf, looked: &'static str },
    #[error("prompt of {tokens} tokens does not fit the context of {context} tokens")]
    TooLong { tokens: usize, context: usize },
    #[error("fetching the model failed: {reason}\nto fix: {fix}")]
    Fetch { reason: String, fix: String },
    #[error("tiny model: {0}")]
    BadTinySpec(String),
    #[error("candle-transformers peer: {0}")]
    Peer(String),
    #[error("device {0}")]
    Device(String),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

impl Error {
    pub(crate) fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Error {
        let path = path.into();
        move |source| Error::Io { path, source }
    }

    pub(crate) fn bad_file(path: impl Into<PathBuf>, reason: impl std::fmt::Display) -> Error {
        Error::BadFile {
            path: path.into(),
            reason: reason.to_string(),
        }
    }
}

pub type Result<T> = std::result::Result<T, Error>;
