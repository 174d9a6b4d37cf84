//! Writing and reading the run's JSON-lines logs: the journal (one event per
//! line, appended and flushed as it happens) and the metrics. Their line
//! types are the engine's [`populora::run_files`]; the journal's are
//! re-exported here.

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use serde::Serialize;

pub use populora::run_files::{Event, MemberEntry, Source};

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
/// is dropped; any other bad line, and an event this version does not know
/// (replay and resume would misread the run), is an error naming the file
/// and line.
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
            Ok(Event::Unknown) => bail!(
                "{}:{}: an event this version of populora does not know",
                path.display(),
                i + 1
            ),
            Ok(event) => events.push(event),
            Err(_) if i + 1 == lines.len() => break,
            Err(e) => bail!("{}:{}: not a journal event: {e}", path.display(), i + 1),
        }
    }
    Ok(events)
}
