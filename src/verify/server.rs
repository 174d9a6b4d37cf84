//! One warm Python server process (`server.py`) in one of its two roles, and
//! its length-prefixed JSON protocol.

use super::{Error, Features, Layer, Limits, SandboxConfig, Status};
use serde::{Deserialize, Serialize};
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

/// The server's source, passed with `-c`.
const SERVER_PY: &str = include_str!("server.py");
/// Time a server may take to import, isolate itself and say hello.
const STARTUP_MS: u64 = 20_000;
/// Slack on top of a job's own timeout for forking, reaping and replying.
const REPLY_SLACK_MS: u64 = 5_000;
/// Largest reply we accept from a server: a checker's reply to a `Many` of 32
/// prepared programs of up to 4 MiB each (`PREPARED_CHARS` in server.py).
const MAX_REPLY_BYTES: usize = 136 << 20;
/// How long a server may take to exit after its pipe closes before it is killed.
const EXIT_GRACE_MS: u64 = 500;

/// What a server process does with the jobs it is sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Role {
    /// Parses, checks and compiles programs and compares answers, never
    /// running anything; confined like a child and serving many jobs.
    Checker,
    /// A fork server: every job runs in a fresh child.
    Zygote,
}

/// A job as a server understands it.
#[derive(Debug, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub(crate) enum Request<'a> {
    /// Checker: parse a program and its inputs, apply the AST filter,
    /// compute the features, compile both.
    Prepare {
        program: &'a str,
        inputs: Vec<&'a str>,
    },
    /// Checker: literal equality of (a, b) reprs.
    Compare { pairs: Vec<[&'a str; 2]> },
    /// Zygote: run prepared code on every prepared input in a child;
    /// `runs: 2` checks determinism.
    Run {
        function: &'a str,
        code: &'a str,
        calls: &'a [String],
        runs: u32,
    },
    /// Checker: several checker requests in one message; one reply each.
    Many { jobs: Vec<&'a Request<'a>> },
    /// Zygote: a HumanEval problem, in a child.
    Humaneval {
        program: &'a str,
        test: &'a str,
        entry_point: &'a str,
    },
    /// Zygote: a benchmark's own check of `program`, in a child, under the
    /// job's own wall-clock and memory limits.
    Harness {
        harness: &'a str,
        program: &'a str,
        args: &'a serde_json::Value,
        timeout_ms: u64,
        memory_mb: u64,
    },
}

impl Request<'_> {
    /// The job's wall-clock limit: its own, or the configured one.
    fn timeout_ms(&self, limits: &Limits) -> u64 {
        match self {
            Request::Harness { timeout_ms, .. } => *timeout_ms,
            _ => limits.timeout_ms,
        }
    }
}

/// What a server answers for one job.
#[derive(Debug, Deserialize)]
pub(crate) struct Reply {
    pub status: Status,
    #[serde(default)]
    pub reason: String,
    #[serde(default)]
    pub outputs: Vec<String>,
    #[serde(default)]
    pub equal: Vec<bool>,
    pub features: Option<Features>,
    pub function: Option<String>,
    /// A prepared program and one call per input, each packed as server.py's
    /// `prepare_code` and `prepare_call` describe.
    pub code: Option<String>,
    #[serde(default)]
    pub calls: Vec<String>,
    /// The replies to a `Many`, in order.
    #[serde(default)]
    pub replies: Vec<Reply>,
    /// A checker's last reply: it exits after sending it.
    #[serde(default)]
    pub retiring: bool,
    #[serde(default)]
    pub wall_ms: f64,
}

impl Reply {
    /// A reply that only carries a verdict.
    pub fn verdict(status: Status, reason: String, wall_ms: f64) -> Reply {
        Reply {
            status,
            reason,
            outputs: Vec::new(),
            equal: Vec::new(),
            features: None,
            function: None,
            code: None,
            calls: Vec::new(),
            replies: Vec::new(),
            retiring: false,
            wall_ms,
        }
    }
}

#[derive(Serialize)]
struct Envelope<'a> {
    job: &'a Request<'a>,
}

#[derive(Serialize)]
struct ServerConfig<'a> {
    role: Role,
    /// The checker confines itself with these; the zygote applies them to every child.
    limits: &'a Limits,
    namespaces: bool,
    landlock: bool,
    uid: Option<u32>,
    gid: Option<u32>,
    tmpfs_mb: u64,
    /// Whether the zygote fills CPython's free small-object blocks before
    /// `gc.freeze()` (server.py, `fill_free_blocks`, which says what it is
    /// worth). On unless `POPULORA_NO_POOL_FILL=1`, read here and nowhere
    /// else: the switch exists for A/B measurements of the sandbox.
    fill_pools: bool,
}

pub(crate) struct Server {
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: ChildStdout,
    pub layers: Vec<Layer>,
}

impl Server {
    /// The server process's id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn start(config: &SandboxConfig, role: Role) -> Result<Server, Error> {
        let server_config = ServerConfig {
            role,
            limits: &config.limits,
            namespaces: config.namespaces,
            landlock: config.landlock,
            uid: Some(config.unprivileged_uid),
            gid: Some(config.unprivileged_gid),
            tmpfs_mb: config.tmpfs_mb,
            fill_pools: std::env::var_os("POPULORA_NO_POOL_FILL").is_none_or(|v| v != "1"),
        };
        let config_json = serde_json::to_string(&server_config)
            .map_err(|e| Error::Config(format!("cannot encode the server configuration: {e}")))?;
        // No -I: it would ignore PYTHONHASHSEED, and a fixed hash seed keeps set
        // order (and so outputs) independent of which worker ran a program. The
        // empty environment plus -S -s gives the same isolation. LD_BIND_NOW
        // resolves every symbol of the interpreter once, in the server: lazily
        // bound, each child would redo it for the calls only children make
        // (setrlimit, setresuid, ...) and copy the pages it writes.
        let mut child = Command::new(&config.python)
            .args(["-S", "-s", "-B", "-c", SERVER_PY, &config_json])
            .env_clear()
            .env("PYTHONHASHSEED", "0")
            .env("LD_BIND_NOW", "1")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|source| Error::Spawn {
                python: config.python.clone(),
                source,
            })?;
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            return Err(Error::Protocol("server pipes missing".into()));
        };
        let mut server = Server {
            child,
            stdin: Some(stdin),
            stdout,
            layers: Vec::new(),
        };
        let hello = server
            .receive(
                Instant::now() + Duration::from_millis(STARTUP_MS),
                STARTUP_MS,
            )
            .map_err(|e| match e {
                Error::Unresponsive(ms) => {
                    Error::Refused(format!("the {role:?} sent no hello within {ms} ms"))
                }
                other => other,
            })?;
        if let Some(fatal) = hello.get("fatal").and_then(|v| v.as_str()) {
            return Err(Error::Refused(fatal.to_string()));
        }
        let layers = hello
            .get("layers")
            .cloned()
            .ok_or_else(|| Error::Protocol(format!("hello without layers: {hello}")))?;
        server.layers = serde_json::from_value(layers)
            .map_err(|e| Error::Protocol(format!("unknown layer in hello: {e}")))?;
        Ok(server)
    }

    /// Run one job; its wall-clock limit (`limits.timeout_ms` unless the job
    /// has its own) plus slack is the deadline for the reply (the server has
    /// the limits from its configuration). An `Err` means the server itself
    /// failed and must be replaced.
    pub fn call(&mut self, job: &Request, limits: &Limits) -> Result<Reply, Error> {
        let body = serde_json::to_vec(&Envelope { job })
            .map_err(|e| Error::Protocol(format!("cannot encode a request: {e}")))?;
        let len = u32::try_from(body.len())
            .map_err(|_| Error::Protocol(format!("request of {} bytes", body.len())))?;
        let stdin = self
            .stdin
            .as_mut()
            .ok_or_else(|| Error::Exited("stdin closed".into()))?;
        let mut frame = Vec::with_capacity(body.len() + 4);
        frame.extend_from_slice(&len.to_be_bytes());
        frame.extend_from_slice(&body);
        if let Err(e) = stdin.write_all(&frame).and_then(|_| stdin.flush()) {
            return Err(self.exit_error().unwrap_or(Error::Io(e)));
        }
        let budget_ms = job.timeout_ms(limits) + REPLY_SLACK_MS;
        let value = self.receive(Instant::now() + Duration::from_millis(budget_ms), budget_ms)?;
        if let Some(message) = value.get("error").and_then(|v| v.as_str()) {
            return Err(Error::Job(message.to_string()));
        }
        serde_json::from_value(value).map_err(|e| Error::Protocol(format!("bad reply: {e}")))
    }

    fn receive(&mut self, deadline: Instant, budget_ms: u64) -> Result<serde_json::Value, Error> {
        let mut head = [0u8; 4];
        self.read_exact_by(&mut head, deadline, budget_ms)?;
        let len = u32::from_be_bytes(head) as usize;
        if len > MAX_REPLY_BYTES {
            return Err(Error::Protocol(format!(
                "reply of {len} bytes exceeds {MAX_REPLY_BYTES}"
            )));
        }
        let mut body = vec![0u8; len];
        self.read_exact_by(&mut body, deadline, budget_ms)?;
        serde_json::from_slice(&body)
            .map_err(|e| Error::Protocol(format!("reply is not JSON: {e}")))
    }

    fn read_exact_by(
        &mut self,
        buf: &mut [u8],
        deadline: Instant,
        budget_ms: u64,
    ) -> Result<(), Error> {
        let mut filled = 0;
        while filled < buf.len() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || !wait_readable(&self.stdout, left)? {
                return Err(Error::Unresponsive(budget_ms));
            }
            match self.stdout.read(&mut buf[filled..]) {
                Ok(0) => {
                    return Err(self
                        .exit_error()
                        .unwrap_or(Error::Exited("end of output".into())))
                }
                Ok(n) => filled += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(Error::Io(e)),
            }
        }
        Ok(())
    }

    fn exit_error(&mut self) -> Option<Error> {
        std::thread::sleep(Duration::from_millis(10));
        match self.child.try_wait() {
            Ok(Some(status)) => Some(Error::Exited(status.to_string())),
            _ => None,
        }
    }
}

/// poll(2) for readability; false on timeout.
fn wait_readable(stdout: &ChildStdout, timeout: Duration) -> Result<bool, Error> {
    let mut fds = libc::pollfd {
        fd: stdout.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    let ms = timeout.as_millis().clamp(1, i32::MAX as u128) as i32;
    loop {
        // SAFETY: one valid pollfd that lives across the call.
        let rc = unsafe { libc::poll(&mut fds, 1, ms) };
        if rc >= 0 {
            return Ok(rc > 0);
        }
        let err = std::io::Error::last_os_error();
        if err.kind() != std::io::ErrorKind::Interrupted {
            return Err(Error::Io(err));
        }
    }
}

impl Drop for Server {
    /// Closing stdin lets the server exit cleanly (the zygote removes its work dir);
    /// SIGKILL after a grace period. Its pid-namespace init dies with it, which
    /// kills every process left in the namespace.
    fn drop(&mut self) {
        drop(self.stdin.take());
        let deadline = Instant::now() + Duration::from_millis(EXIT_GRACE_MS);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
