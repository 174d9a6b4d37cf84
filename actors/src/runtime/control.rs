//! Live control: `populora ctl DIR ...` talks newline-delimited JSON over the
//! Unix socket `DIR/control.sock` (mode 0600, and only our own uid may talk).
//! The socket task answers at once: `status` from the coordinator's last
//! published state, other commands after checking them against it; accepted
//! commands queue for the coordinator, which applies them at the next step
//! boundary and journals them.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use anyhow::Context;
use populora::scenario::{check_operator, parse_member_id};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader as AsyncBufReader};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::mpsc;

use super::journal::MemberEntry;
/// The socket's command line is the journal's: the engine's schema.
pub use populora::run_files::Command;

/// Longest accepted command line.
const MAX_LINE: usize = 64 << 10;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Reply {
    pub ok: bool,
    pub message: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<LiveStatus>,
}

/// What the coordinator publishes for `status` and for checking commands.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LiveStatus {
    /// Last completed step.
    pub step: u64,
    pub steps: u64,
    pub phase: String,
    pub paused: bool,
    pub solo: bool,
    /// Students each teacher must be matched with (cross-evaluation).
    pub students_per_teacher: usize,
    /// `selfplay.proposals_per_teacher`: times the teachers, the rollouts of
    /// each pooled proposer advantage group.
    #[serde(default)]
    pub proposals_per_teacher: usize,
    pub members: Vec<MemberEntry>,
    /// Worker nodes (empty when every member runs in the `run` process).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub nodes: Vec<NodeStatus>,
}

/// One worker node as `status` shows it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct NodeStatus {
    pub address: String,
    /// `up`, or `down: why`.
    pub health: String,
    /// The members that run there.
    pub members: Vec<String>,
    /// The coordinator's calls to it not yet answered.
    pub queue: u64,
    /// Its brokers' compute time so far, and its share of every node's.
    pub compute_s: f64,
    pub compute_share: f64,
    pub sent_bytes: u64,
    pub received_bytes: u64,
}

pub type Shared = Arc<Mutex<LiveStatus>>;

fn snapshot(shared: &Shared) -> LiveStatus {
    shared.lock().unwrap_or_else(|p| p.into_inner()).clone()
}

/// Check a command against the current population; the answer says what
/// will happen. Live commands and scripted `[[events]]` both pass here.
pub fn check(command: &Command, status: &LiveStatus) -> Result<String, String> {
    let next = status.step + 1;
    let alive = |id: &str| status.members.iter().find(|m| m.id == id);
    match command {
        Command::Status => Ok("status".into()),
        Command::Pause => Ok(format!("will pause before step {next}")),
        Command::Resume => Ok("will resume".into()),
        Command::Stop => Ok(format!("will stop with a checkpoint before step {next}")),
        _ if status.solo => {
            Err("the solo baseline has one member: kill and inject do not apply".into())
        }
        Command::Kill { member } => {
            let m = alive(member).ok_or_else(|| format!("no live member `{member}`"))?;
            let same_role = status.members.iter().filter(|o| o.role == m.role).count();
            if same_role < 2 {
                return Err(format!(
                    "`{member}` is the last {}; refusing to kill it",
                    m.role
                ));
            }
            let left: Vec<&MemberEntry> =
                status.members.iter().filter(|o| o.id != *member).collect();
            for teacher in left.iter().filter(|t| t.role == "teacher") {
                let eligible = left
                    .iter()
                    .filter(|s| s.role == "student" && s.subpop != teacher.subpop)
                    .count();
                if eligible < status.students_per_teacher {
                    return Err(format!(
                        "killing `{member}` would leave {} with {eligible} students outside its sub-population ({} needed)",
                        teacher.id, status.students_per_teacher
                    ));
                }
            }
            // A pooled proposer advantage group (task kind × proposer) holds
            // teachers × proposals_per_teacher rollouts; one alone has advantage
            // 0 at every step. (Per-member groups hold proposals_per_teacher
            // whatever the teachers, and validation requires 2 or more there.)
            let teachers = left.iter().filter(|t| t.role == "teacher").count();
            let per_teacher = status.proposals_per_teacher;
            if m.role == "teacher" && teachers * per_teacher < 2 {
                return Err(format!(
                    "killing `{member}` would leave {teachers} teacher with selfplay.proposals_per_teacher = {per_teacher}: each proposer advantage group (task kind × proposer) would hold one rollout per step, so its TRR++ advantage would always be 0 and the teacher would never learn (inject a teacher first)"
                ));
            }
            Ok(format!("will kill {member} at the start of step {next}"))
        }
        Command::Inject { role, from, op } => {
            for parent in from {
                let m = alive(parent).ok_or_else(|| format!("no live member `{parent}`"))?;
                if m.role != role.as_str() {
                    return Err(format!(
                        "`{parent}` is a {}, not a {}",
                        m.role,
                        role.as_str()
                    ));
                }
            }
            if let Some(op) = op {
                check_operator(op)?;
            }
            Ok(format!(
                "will inject a new {} at the start of step {next}",
                role.as_str()
            ))
        }
    }
}

/// Parse one request line (a bad line is answered, never fatal).
fn parse(line: &str) -> Result<Command, String> {
    let command: Command =
        serde_json::from_str(line).map_err(|e| format!("malformed command: {e}"))?;
    if let Command::Kill { member } = &command {
        if parse_member_id(member).is_none() {
            return Err(format!(
                "`{member}` is not a member id (teacher-N or student-N)"
            ));
        }
    }
    Ok(command)
}

/// Bind the socket and serve it until the runtime stops.
pub fn serve(
    path: &Path,
    status: Shared,
    queue: mpsc::UnboundedSender<Command>,
) -> anyhow::Result<()> {
    let _ = std::fs::remove_file(path);
    let listener =
        UnixListener::bind(path).with_context(|| format!("binding {}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            tokio::spawn(connection(stream, status.clone(), queue.clone()));
        }
    });
    Ok(())
}

async fn connection(stream: UnixStream, status: Shared, queue: mpsc::UnboundedSender<Command>) {
    let own_uid = unsafe { libc::geteuid() };
    let authorised = stream.peer_cred().is_ok_and(|c| c.uid() == own_uid);
    let (read, mut write) = stream.into_split();
    let mut lines = AsyncBufReader::new(read.take(MAX_LINE as u64 * 64)).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        let reply = if !authorised {
            Reply {
                ok: false,
                message: "not authorised: only the run's own user may control it".into(),
                status: None,
            }
        } else {
            answer(&line, &status, &queue)
        };
        let mut text = serde_json::to_string(&reply).unwrap_or_default();
        text.push('\n');
        if write.write_all(text.as_bytes()).await.is_err() || !authorised {
            break;
        }
    }
}

use tokio::io::AsyncReadExt;

fn answer(line: &str, status: &Shared, queue: &mpsc::UnboundedSender<Command>) -> Reply {
    let refuse = |message: String| Reply {
        ok: false,
        message,
        status: None,
    };
    if line.len() > MAX_LINE {
        return refuse(format!("command longer than {MAX_LINE} bytes"));
    }
    let command = match parse(line) {
        Ok(c) => c,
        Err(e) => return refuse(e),
    };
    let now = snapshot(status);
    match check(&command, &now) {
        Err(e) => refuse(e),
        Ok(_) if command == Command::Status => Reply {
            ok: true,
            message: format!("step {}/{} ({})", now.step, now.steps, now.phase),
            status: Some(now),
        },
        Ok(message) => match queue.send(command) {
            Ok(()) => Reply {
                ok: true,
                message,
                status: None,
            },
            Err(_) => refuse("the run is finishing; command not taken".into()),
        },
    }
}

/// The client side of `populora ctl`: send one command, return the reply.
pub fn send(socket: &Path, command: &Command) -> anyhow::Result<Reply> {
    let mut stream = std::os::unix::net::UnixStream::connect(socket).with_context(|| {
        format!(
            "connecting to {} (is the run still going?)",
            socket.display()
        )
    })?;
    let mut line = serde_json::to_string(command)?;
    line.push('\n');
    stream.write_all(line.as_bytes())?;
    let mut reply = String::new();
    BufReader::new(&stream).read_line(&mut reply)?;
    serde_json::from_str(&reply).with_context(|| format!("unreadable reply: {reply:?}"))
}

/// The socket of a run directory.
pub fn socket_of(dir: &Path) -> PathBuf {
    dir.join("control.sock")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two teachers and four students in two sub-populations, one student
    /// per teacher, `proposals_per_teacher` as given.
    fn population(proposals_per_teacher: usize) -> LiveStatus {
        let member = |id: &str, subpop| MemberEntry {
            id: id.into(),
            role: id.split('-').next().unwrap().into(),
            subpop,
        };
        LiveStatus {
            step: 2,
            students_per_teacher: 1,
            proposals_per_teacher,
            members: vec![
                member("teacher-0", 0),
                member("teacher-1", 1),
                member("student-0", 0),
                member("student-1", 1),
                member("student-2", 0),
                member("student-3", 1),
            ],
            ..LiveStatus::default()
        }
    }

    fn kill(member: &str) -> Command {
        Command::Kill {
            member: member.into(),
        }
    }

    #[test]
    fn a_kill_leaving_one_teacher_with_one_proposal_per_kind_is_refused() {
        let one = population(1);
        let why = check(&kill("teacher-0"), &one).unwrap_err();
        assert!(
            why.contains("would leave 1 teacher with selfplay.proposals_per_teacher = 1")
                && why.contains("advantage would always be 0"),
            "{why}"
        );
        // A student may go; with two proposals per kind, or a third teacher,
        // the teacher may too.
        assert!(check(&kill("student-3"), &one).is_ok());
        assert_eq!(
            check(&kill("teacher-0"), &population(2)),
            Ok("will kill teacher-0 at the start of step 3".into())
        );
        let mut three = population(1);
        three.members.push(MemberEntry {
            id: "teacher-2".into(),
            role: "teacher".into(),
            subpop: 0,
        });
        assert!(check(&kill("teacher-0"), &three).is_ok());
    }

    #[test]
    fn a_kill_of_the_last_of_a_role_or_of_a_teacher_s_students_is_refused() {
        let mut status = population(2);
        status.members.retain(|m| m.id != "student-2");
        let why = check(&kill("student-0"), &status).unwrap_err();
        assert!(
            why.contains("would leave teacher-1 with 0 students"),
            "{why}"
        );
        status.members.retain(|m| m.id != "teacher-1");
        let why = check(&kill("teacher-0"), &status).unwrap_err();
        assert!(why.contains("is the last teacher"), "{why}");
    }
}
