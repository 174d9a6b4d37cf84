//! The journal: one JSON event per line, appended and flushed as it happens.
//! Step, control, evolution and fault events; `step` events carry every
//! member's adapter checksum, which replay and resume compare bit for bit.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};

use super::control::Command;

/// A member as the journal names it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MemberEntry {
    pub id: String,
    pub role: String,
    pub subpop: usize,
}

/// Where a control command came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Source {
    /// The scenario's `[[events]]`.
    Scenario,
    /// `populora ctl` over the control socket.
    Ctl,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Event {
    Start {
        seed: u64,
        scenario: String,
        members: Vec<MemberEntry>,
    },
    /// A command applied (or refused) at the start of `step`.
    Control {
        step: u64,
        command: Command,
        source: Source,
        outcome: String,
    },
    Kill {
        step: u64,
        id: String,
    },
    Spawn {
        step: u64,
        id: String,
        role: String,
        subpop: usize,
        parents: Vec<String>,
        operators: Vec<String>,
    },
    Cull {
        step: u64,
        id: String,
        fitness: f64,
    },
    Fault {
        step: u64,
        member: String,
        message: String,
        action: String,
    },
    Step {
        step: u64,
        checksums: BTreeMap<String, String>,
    },
    Checkpoint {
        step: u64,
    },
    /// On resume: the checkpoint of `step` did not load (`reason`), so it was
    /// moved to `moved_to` and the run resumed from an older one.
    CheckpointSkipped {
        step: u64,
        reason: String,
        moved_to: String,
    },
    End {
        step: u64,
        checksums: BTreeMap<String, String>,
    },
}

/// An append-only JSON-lines file (the journal and the metrics).
pub struct Log {
    file: File,
    path: PathBuf,
    pub lines: usize,
}

impl Log {
    /// Open for appending, keeping only the first `keep` lines (resume drops
    /// what a crashed run wrote after its last checkpoint).
    pub fn open(path: &Path, keep: Option<usize>) -> anyhow::Result<Log> {
        let lines = match keep {
            Some(keep) => truncate_lines(path, keep)?,
            None => 0,
        };
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .with_context(|| format!("opening {}", path.display()))?;
        Ok(Log {
            file,
            path: path.to_path_buf(),
            lines,
        })
    }

    pub fn append(&mut self, value: &impl Serialize) -> anyhow::Result<()> {
        let mut line = serde_json::to_string(value)?;
        line.push('\n');
        self.file
            .write_all(line.as_bytes())
            .and_then(|_| self.file.sync_data())
            .with_context(|| format!("writing {}", self.path.display()))?;
        self.lines += 1;
        Ok(())
    }
}

/// Keep the first `keep` lines of `path`; returns how many it has now.
fn truncate_lines(path: &Path, keep: usize) -> anyhow::Result<usize> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let kept: Vec<&str> = text.lines().take(keep).collect();
    let mut out = kept.join("\n");
    if !kept.is_empty() {
        out.push('\n');
    }
    std::fs::write(path, out).with_context(|| format!("rewriting {}", path.display()))?;
    Ok(kept.len())
}

/// Every event of a journal. A truncated last line (what `kill -9` can leave)
/// is dropped; any other bad line is an error naming the file and line.
pub fn read(path: &Path) -> anyhow::Result<Vec<Event>> {
    let file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let lines: Vec<String> = BufReader::new(file)
        .lines()
        .collect::<Result<_, _>>()
        .with_context(|| format!("reading {}", path.display()))?;
    let mut events = Vec::with_capacity(lines.len());
    for (i, line) in lines.iter().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        match serde_json::from_str(line) {
            Ok(event) => events.push(event),
            Err(_) if i + 1 == lines.len() => break,
            Err(e) => bail!("{}:{}: not a journal event: {e}", path.display(), i + 1),
        }
    }
    Ok(events)
}
