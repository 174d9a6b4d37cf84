//! The files of a run (DESIGN §7): `scenario.toml` (resolved copy),
//! `journal.jsonl`, `metrics.jsonl`, `members/<id>/`, `checkpoints/`,
//! `control.sock`, `report/`.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use populora::run_files::{JOURNAL_FILE, METRICS_FILE};

#[derive(Debug, Clone)]
pub struct RunDir {
    pub root: PathBuf,
}

impl RunDir {
    pub fn new(root: &Path) -> RunDir {
        RunDir {
            root: root.to_path_buf(),
        }
    }

    /// A fresh run directory: it must not exist, or be empty.
    pub fn create(root: &Path) -> anyhow::Result<RunDir> {
        if root.exists() && std::fs::read_dir(root)?.next().is_some() {
            bail!(
                "{} already exists and is not empty; choose another --out, remove it, or `populora resume {}`",
                root.display(),
                root.display()
            );
        }
        std::fs::create_dir_all(root.join("members"))
            .and_then(|_| std::fs::create_dir_all(root.join("checkpoints")))
            .with_context(|| format!("creating {}", root.display()))?;
        Ok(RunDir::new(root))
    }

    pub fn scenario(&self) -> PathBuf {
        self.root.join("scenario.toml")
    }
    pub fn journal(&self) -> PathBuf {
        self.root.join(JOURNAL_FILE)
    }
    pub fn metrics(&self) -> PathBuf {
        self.root.join(METRICS_FILE)
    }
    pub fn socket(&self) -> PathBuf {
        self.root.join("control.sock")
    }
    pub fn members(&self) -> PathBuf {
        self.root.join("members")
    }
    pub fn checkpoints(&self) -> PathBuf {
        self.root.join("checkpoints")
    }
    pub fn checkpoint(&self, step: u64) -> PathBuf {
        self.checkpoints().join(format!("step-{step:06}"))
    }

    /// The newest complete checkpoint (checkpoints are renamed into place
    /// only once fully written).
    pub fn latest_checkpoint(&self) -> anyhow::Result<Option<(u64, PathBuf)>> {
        Ok(self.checkpoints_newest_first()?.into_iter().next())
    }

    /// Every complete checkpoint, newest first.
    pub fn checkpoints_newest_first(&self) -> anyhow::Result<Vec<(u64, PathBuf)>> {
        let dir = self.checkpoints();
        if !dir.exists() {
            return Ok(Vec::new());
        }
        let mut found = Vec::new();
        for entry in
            std::fs::read_dir(&dir).with_context(|| format!("listing {}", dir.display()))?
        {
            let entry = entry?;
            let name = entry.file_name().to_string_lossy().to_string();
            if let Some(step) = name
                .strip_prefix("step-")
                .and_then(|s| s.parse::<u64>().ok())
            {
                found.push((step, entry.path()));
            }
        }
        found.sort_by_key(|&(step, _)| std::cmp::Reverse(step));
        Ok(found)
    }

    /// Where a checkpoint that failed to load is set aside (out of
    /// [`RunDir::checkpoints_newest_first`]'s sight, kept for inspection).
    pub fn skipped_checkpoint(&self, step: u64) -> PathBuf {
        self.checkpoints().join(format!("skipped-step-{step:06}"))
    }
}

/// Member files inside a member directory.
pub fn adapter_dir(member_dir: &Path) -> PathBuf {
    member_dir.join("adapter")
}
pub fn optimizer_dir(member_dir: &Path) -> PathBuf {
    member_dir.join("optimizer")
}
