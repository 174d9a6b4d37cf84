//! One line of `journal.jsonl`: an event of the run, appended as it
//! happens. `step` and `end` events carry every member's adapter checksum,
//! which replay and resume compare bit for bit.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::compute::Cost;
use crate::scenario::Role;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Event {
    /// The run began (a resumed run does not write it again).
    Start {
        seed: u64,
        scenario: String,
        members: Vec<MemberEntry>,
    },
    /// The seeding stage's buffers, which training starts from
    /// (`seeding.json` in the run directory; `checksum`: its SHA-256): the
    /// entries each kind's buffer holds, the proposals it took and their
    /// compute, which is not part of the run's `compute_total`.
    Seeding {
        checksum: String,
        entries: BTreeMap<String, usize>,
        rounds: usize,
        proposals: usize,
        valid: usize,
        compute: Cost,
    },
    /// The run's compute crossed `target_tflop` (`checkpoint.at_tflop`) at
    /// the end of `step`, whose checkpoint holds the members as they were.
    ComputeMark {
        step: u64,
        target_tflop: f64,
        spent_tflop: f64,
    },
    /// A command applied (or refused: `outcome` says why) at the start of `step`.
    Control {
        step: u64,
        command: Command,
        source: Source,
        outcome: String,
    },
    /// A member removed by a `kill` command.
    Kill { step: u64, id: String },
    /// A member born by evolution or an `inject` command.
    Spawn {
        step: u64,
        id: String,
        role: String,
        subpop: usize,
        parents: Vec<String>,
        operators: Vec<String>,
        /// The worker node it runs on (absent when members run in the `run` process).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        node: Option<String>,
        /// Where its AdamW state came from: `reset`, or `inherited from
        /// <parent>` (`evolution.optimizer = "inherit"` and a child whose
        /// factors are that parent's). Absent in runs recorded before it was.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        optimizer: Option<String>,
    },
    /// A member removed by evolution.
    Cull { step: u64, id: String, fitness: f64 },
    /// An actor died during `step`; `action` says what the run did about it.
    Fault {
        step: u64,
        /// The member that died; `None` when another actor did (`message`
        /// names it). Older runs wrote `"member"` for every fault.
        member: Option<String>,
        message: String,
        action: String,
    },
    /// A step committed, with every live member's checksum after it.
    Step {
        step: u64,
        checksums: BTreeMap<String, String>,
    },
    /// `checkpoints/step-N` was written.
    Checkpoint { step: u64 },
    /// On resume: the checkpoint of `step` did not load (`reason`), so it was
    /// moved to `moved_to` and the run resumed from an older one.
    CheckpointSkipped {
        step: u64,
        reason: String,
        moved_to: String,
    },
    /// Where members run from `step` on (journaled whenever a run with
    /// `[cluster]` nodes starts, resumes or changes layout): each member's
    /// node, and the scenario's nodes that did not answer (`down`, why).
    Layout {
        step: u64,
        members: BTreeMap<String, String>,
        down: BTreeMap<String, String>,
    },
    /// A worker node was lost during `step` (`message`: how it was noticed);
    /// the run went back to the checkpoint of `resumed_from` and its members
    /// moved to the nodes still up (the next `layout` event).
    NodeLost {
        step: u64,
        node: String,
        message: String,
        resumed_from: u64,
    },
    /// A node that was down answered again at the checkpoint of `step`; the
    /// run continues from that checkpoint with it in the layout.
    NodeBack { step: u64, node: String },
    /// The run finished (or stopped) after `step`, with the final checksums.
    End {
        step: u64,
        checksums: BTreeMap<String, String>,
    },
    /// An event this version does not know (a newer runtime's): readers
    /// decide whether to skip it. Never written.
    #[serde(other, skip_serializing)]
    Unknown,
}

/// A member as the journal and `populora ctl status` name it.
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

impl Source {
    pub fn name(self) -> &'static str {
        match self {
            Source::Scenario => "scenario",
            Source::Ctl => "ctl",
        }
    }
}

/// A control command: a line on the control socket, and as the journal
/// records it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "cmd", rename_all = "snake_case", deny_unknown_fields)]
pub enum Command {
    Status,
    Kill {
        member: String,
    },
    Inject {
        role: Role,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        from: Vec<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        op: Option<String>,
    },
    Pause,
    Resume,
    Stop,
}

impl Command {
    /// Kill and inject change results: replay and resume re-apply them.
    pub fn changes_results(&self) -> bool {
        matches!(self, Command::Kill { .. } | Command::Inject { .. })
    }
}

/// As `populora ctl` takes it: `kill student-1`,
/// `inject student --from student-0 --op svd_noise`.
impl fmt::Display for Command {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Command::Status => f.write_str("status"),
            Command::Kill { member } => write!(f, "kill {member}"),
            Command::Inject { role, from, op } => {
                write!(f, "inject {}", role.as_str())?;
                if !from.is_empty() {
                    write!(f, " --from {}", from.join(" "))?;
                }
                match op {
                    Some(op) => write!(f, " --op {op}"),
                    None => Ok(()),
                }
            }
            Command::Pause => f.write_str("pause"),
            Command::Resume => f.write_str("resume"),
            Command::Stop => f.write_str("stop"),
        }
    }
}
