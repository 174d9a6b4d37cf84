//! The benchmark data that ships with the project (`data/` at the
//! repository root, each folder with its licence; `data/README.md` says
//! where every file comes from). Every file's SHA-256 is recorded here and
//! checked on load, so an edited or truncated copy is refused by name.
//!
//! The folder is found at `$POPULORA_DATA` when that is set, else where the
//! crate was built from (a fresh clone: its own `data/`).

use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use super::EvalError;

/// One shipped file: its path under the data folder and its SHA-256.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DataFile {
    pub path: &'static str,
    pub sha256: &'static str,
}

pub const HUMANEVAL_PLUS: DataFile = DataFile {
    path: "evalplus/HumanEvalPlus-v0.1.10.jsonl.gz",
    sha256: "272720b90ac375502c8ed23cd791c2a93dfb22a911641a494da74a426c09f101",
};
pub const MBPP_PLUS: DataFile = DataFile {
    path: "evalplus/MbppPlus-v0.2.0.jsonl.gz",
    sha256: "af43697e8791c4c149bdfd6b489d8b5412507551ac20e28a439f650b8225db63",
};
pub const CRUXEVAL: DataFile = DataFile {
    path: "cruxeval/cruxeval.jsonl",
    sha256: "8368b81047dc5014e4caf5a2f97604eff7644e0ecd7415e3ceeb184bbc2e0c96",
};
pub const AIME24: DataFile = DataFile {
    path: "azr-math/aime24.jsonl",
    sha256: "af2b8bd2aa911b6333ad0df32f3ca05c7ae8ed10f1731f4372c8ae26990bf7ac",
};
pub const AIME25: DataFile = DataFile {
    path: "azr-math/aime25.jsonl",
    sha256: "20c1ca392758d96bd1e28af15d9f30df5660257927cacc9eac7301c29f677d1a",
};
pub const AMC23: DataFile = DataFile {
    path: "azr-math/amc23.jsonl",
    sha256: "43707e1ca784602d8479de24ee8ce36609dbebc46dd152b0b12a46611aa898a4",
};
pub const GSM8K: DataFile = DataFile {
    path: "azr-math/gsm8k.jsonl",
    sha256: "9f098df7ff4522078d6ccec27a5c38a454790fdb51131bedfaa0e490070d5394",
};
pub const MATH500: DataFile = DataFile {
    path: "azr-math/math500.jsonl",
    sha256: "35dc41080a3680858b27fa7e0533d2d547825316fc5dafe5d316f4ccc5a06132",
};
pub const MINERVA: DataFile = DataFile {
    path: "azr-math/minerva_math.jsonl",
    sha256: "0e656b430d3a0a1dab6aa853f453ba3805e28e2cabe4fc72486a897cc09d8ba2",
};
pub const OLYMPIADBENCH: DataFile = DataFile {
    path: "azr-math/olympiadbench.jsonl",
    sha256: "bb8c1e38a16ea9eacb77530315a674d883f267fbff79183effc53681b4fcc416",
};

/// Every shipped file (`data/SHA256SUMS` lists the same).
pub const ALL: [DataFile; 10] = [
    HUMANEVAL_PLUS,
    MBPP_PLUS,
    CRUXEVAL,
    AIME24,
    AIME25,
    AMC23,
    GSM8K,
    MATH500,
    MINERVA,
    OLYMPIADBENCH,
];

/// `$POPULORA_DATA`, or the `data/` folder of the source tree this was built from.
pub fn data_dir() -> PathBuf {
    match std::env::var_os("POPULORA_DATA").filter(|d| !d.is_empty()) {
        Some(dir) => PathBuf::from(dir),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("data"),
    }
}

impl DataFile {
    /// The file's path once its SHA-256 is the recorded one.
    pub fn checked(&self) -> Result<PathBuf, EvalError> {
        self.checked_in(&data_dir())
    }

    /// [`DataFile::checked`] for a copy of the data folder at `dir`.
    pub fn checked_in(&self, dir: &Path) -> Result<PathBuf, EvalError> {
        let path = dir.join(self.path);
        let bytes = std::fs::read(&path).map_err(|source| EvalError::Read {
            path: path.clone(),
            source,
        })?;
        let found = crate::base::fetch::hex(&Sha256::digest(&bytes));
        if found != self.sha256 {
            return Err(EvalError::Checksum {
                path,
                expected: self.sha256,
                found,
            });
        }
        Ok(path)
    }
}
