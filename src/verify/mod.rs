//! The Python sandbox: everything a model writes runs here and nowhere else.
//!
//! A [`VerifierPool`] owns warm Python server processes (`server.py`) of two
//! roles. Each isolates itself once: new mount and network namespaces with `/`
//! remounted read-only, a Landlock ruleset.
//! - A *zygote* (also in a new pid namespace, with a fresh tmpfs on `/tmp`)
//!   forks one child per program run. Each child gets its own process group,
//!   rlimits, a fresh temp dir that is removed afterwards, an unprivileged uid
//!   (when we are root) and a wall-clock deadline after which everything it
//!   started is killed.
//! - A *checker* does everything that does not run a program: it parses a
//!   program and its inputs with `ast`, applies the checks, computes the
//!   features and compiles both, and it compares answers. It never executes
//!   what it is given. It drops to the children's uid and Landlock rules, with
//!   their address-space limit, no processes, no file writes and no CPU-time
//!   limit (it serves many jobs: each message has a wall-clock deadline
//!   instead). Serving many jobs, this work runs warm instead of in a freshly
//!   forked child, where copy-on-write faults made it ~5x dearer. A checker
//!   that does not answer in time or dies, twice, gives that job a verdict
//!   (`Timeout`, `Crashed`); a failed checker is replaced.
//!
//!   The trade-off: a checker reads hostile text for many jobs. A memory-safety
//!   bug in CPython's parser or compiler, reached by crafted text, would let
//!   that text tamper with later jobs' checks and comparisons in the same
//!   checker (not escape it: it is confined like a child). Before, each job's
//!   text was parsed in a process of its own.
//!
//! Layers that the kernel or our privileges refuse are skipped;
//! [`VerifierPool::layers`] says which are active for programs,
//! [`VerifierPool::checker_layers`] for checkers.
//!
//! The AST checks (one function, no banned imports or names) are a filter for
//! honest mistakes, not the boundary: the OS layers are.
//!
//! Comparisons never run next to untrusted code: a program's outputs come back
//! as reprs and are compared with gold answers by a checker
//! (`ast.literal_eval` both sides, `==`), so a program cannot forge a match.

mod pool;
mod server;

pub use pool::{parallel_map, Job, Outcome, VerifierPool};

use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// Why a job did not succeed. `Ok` is the only success; every other status is
/// a typed reason, never a substring of a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    Ok,
    SyntaxError,
    /// Not exactly one top-level function, a top-level statement with effects,
    /// async code, a program/answer over the size limit, or compiled code and
    /// inputs over 4 MiB (compiling can fold `"a" * 4096` into a large constant).
    InvalidProgram,
    UsesInput,
    BannedImport,
    BannedName,
    /// The input does not parse, compile or evaluate as an argument list.
    BadInput,
    RuntimeError,
    /// Past the wall-clock or CPU limit; or the checker did not answer in time
    /// on this job's program or answer, twice.
    Timeout,
    MemoryLimit,
    OutputLimit,
    NonDeterministic,
    /// Ran fine but the answer is wrong (or a HumanEval assertion failed).
    Mismatch,
    /// Killed by a signal or exited without reporting; or the checker died on
    /// this job's program or answer, twice.
    Crashed,
}

impl Status {
    /// The snake_case name used in JSON.
    pub fn name(self) -> &'static str {
        match self {
            Status::Ok => "ok",
            Status::SyntaxError => "syntax_error",
            Status::InvalidProgram => "invalid_program",
            Status::UsesInput => "uses_input",
            Status::BannedImport => "banned_import",
            Status::BannedName => "banned_name",
            Status::BadInput => "bad_input",
            Status::RuntimeError => "runtime_error",
            Status::Timeout => "timeout",
            Status::MemoryLimit => "memory_limit",
            Status::OutputLimit => "output_limit",
            Status::NonDeterministic => "non_deterministic",
            Status::Mismatch => "mismatch",
            Status::Crashed => "crashed",
        }
    }
}

/// An isolation layer that a server reports as active.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Layer {
    ProcessGroup,
    Rlimits,
    TempDir,
    /// Empty network namespace: no interface but a downed loopback.
    NetNamespace,
    /// Children live in the zygote's pid namespace; it kills all of them after each job.
    PidNamespace,
    /// `/` and every other mount read-only; a zygote adds a private tmpfs for work dirs.
    MountNamespace,
    /// Namespaces obtained through a user namespace (we are not root).
    UserNamespace,
    /// Children drop to an unprivileged uid/gid (we are root).
    UnprivilegedUid,
    NoNewPrivs,
    /// Landlock: no exec, reads only of the Python install and system libraries, writes only in the work dir.
    LandlockFs,
    /// Landlock: no TCP bind/connect.
    LandlockNet,
    /// Landlock: no signals to processes outside the child's own tree.
    LandlockSignal,
    /// Without a pid namespace: orphans re-parent to the zygote, which kills them.
    Subreaper,
}

/// Complexity features of a valid program, for the dynamics plots.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Features {
    pub ast_nodes: u32,
    pub max_depth: u32,
    /// Number of distinct AST node types.
    pub node_types: u32,
    /// 1 + decision points (if, loops, boolean operators, comprehensions, handlers).
    pub cyclomatic: u32,
}

/// The result of validating a proposal (program + input).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Validation {
    pub status: Status,
    /// `repr(f(*args))` truncated to 400 characters; present when status is `Ok`.
    pub output: Option<String>,
    /// Empty when status is `Ok`.
    pub reason: String,
    pub features: Option<Features>,
    /// Name of the program's single function (called as `f`).
    pub function: Option<String>,
    pub wall_ms: f64,
}

impl Validation {
    pub fn is_valid(&self) -> bool {
        self.status == Status::Ok
    }
}

/// The result of checking an answer: `Ok` means correct.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Judgement {
    pub status: Status,
    pub reason: String,
    /// Sum of the sandbox wall times of the jobs behind this judgement.
    pub wall_ms: f64,
}

impl Judgement {
    pub fn passed(&self) -> bool {
        self.status == Status::Ok
    }
}

/// What a benchmark's own check ([`Job::Harness`]) said about a program.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct HarnessResult {
    /// `Ok`: passed.
    pub status: Status,
    pub reason: String,
    /// What the check returned besides its verdict (strings, at most 1 MiB
    /// in all with the rest of the result).
    pub outputs: Vec<String>,
    pub wall_ms: f64,
}

impl HarnessResult {
    pub fn passed(&self) -> bool {
        self.status == Status::Ok
    }
}

/// Limits applied to every child (and to what we send it). A checker takes
/// `memory_mb` and `open_files` too.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Limits {
    /// Wall-clock limit per job; CPU seconds are limited to this, rounded up. A
    /// checker must answer a message within this plus 5 s. Default 2000.
    pub timeout_ms: u64,
    /// Address space (RLIMIT_AS). Default 512.
    pub memory_mb: u64,
    /// Largest file a child may write in its temp dir (RLIMIT_FSIZE). Default 1 MiB.
    pub file_bytes: u64,
    /// RLIMIT_NOFILE. Default 64.
    pub open_files: u64,
    /// RLIMIT_NPROC (counted per uid, so across concurrent children and the
    /// checkers, which run as the same uid). Default 32.
    pub processes: u64,
    /// Cap on each of stdout and stderr; more is status `OutputLimit`. Default 64 KiB.
    pub output_bytes: u64,
    /// Programs and test code longer than this are rejected before running. Default 64 KiB.
    pub program_bytes: usize,
    /// Inputs and predicted answers longer than this are rejected. Default 8 KiB.
    pub answer_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            timeout_ms: 2000,
            memory_mb: 512,
            file_bytes: 1 << 20,
            open_files: 64,
            processes: 32,
            output_bytes: 64 << 10,
            program_bytes: 64 << 10,
            answer_bytes: 8 << 10,
        }
    }
}

/// How to start the pool.
#[derive(Debug, Clone, PartialEq)]
pub struct SandboxConfig {
    /// The interpreter. Default: `$POPULORA_PYTHON`, else `/usr/bin/python3`
    /// (readable by the unprivileged uid, unlike a per-user install), else `python3`.
    pub python: PathBuf,
    /// Number of zygotes, and of checkers. Default: available parallelism.
    pub workers: usize,
    pub limits: Limits,
    /// Try mount/net/pid namespaces (user namespaces when not root). Default true.
    pub namespaces: bool,
    /// Apply a Landlock ruleset in every child when the kernel has it. Default true.
    pub landlock: bool,
    /// uid/gid children drop to when we are root. Default 65534/65534 (nobody).
    pub unprivileged_uid: u32,
    pub unprivileged_gid: u32,
    /// Size of each zygote's tmpfs for work dirs. Default 256.
    pub tmpfs_mb: u64,
}

impl Default for SandboxConfig {
    fn default() -> Self {
        SandboxConfig {
            python: default_python(),
            workers: std::thread::available_parallelism().map_or(2, |n| n.get()),
            limits: Limits::default(),
            namespaces: true,
            landlock: true,
            unprivileged_uid: 65534,
            unprivileged_gid: 65534,
            tmpfs_mb: 256,
        }
    }
}

/// See [`SandboxConfig::python`].
pub fn default_python() -> PathBuf {
    if let Some(path) = std::env::var_os("POPULORA_PYTHON") {
        return PathBuf::from(path);
    }
    let system = PathBuf::from("/usr/bin/python3");
    if system.exists() {
        system
    } else {
        PathBuf::from("python3")
    }
}

/// Failures of the sandbox itself (never of the program under test).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot start the Python sandbox server {python}: {source}")]
    Spawn {
        python: PathBuf,
        source: std::io::Error,
    },
    #[error("the Python sandbox server refused to start: {0}")]
    Refused(String),
    #[error("I/O with the Python sandbox server failed: {0}")]
    Io(#[from] std::io::Error),
    #[error("the Python sandbox server did not answer within {0} ms")]
    Unresponsive(u64),
    #[error("the Python sandbox server exited ({0})")]
    Exited(String),
    #[error("malformed message from the Python sandbox server: {0}")]
    Protocol(String),
    #[error("the Python sandbox server could not run the job: {0}")]
    Job(String),
    #[error("invalid sandbox configuration: {0}")]
    Config(String),
}
