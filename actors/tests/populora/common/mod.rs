//! Helpers of the tests that drive the `populora` binary as a user would.

use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

pub fn populora(args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_populora"));
    c.args(args);
    c
}

pub fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Its stdout; a failure panics with both streams.
pub fn ok(out: Output) -> String {
    assert!(
        out.status.success(),
        "failed: {}\n{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    text(&out.stdout)
}

/// The run's journal (empty while it does not exist).
pub fn journal(dir: &Path) -> String {
    std::fs::read_to_string(dir.join("journal.jsonl")).unwrap_or_default()
}

pub fn wait_for(what: &str, timeout: Duration, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < timeout, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}
