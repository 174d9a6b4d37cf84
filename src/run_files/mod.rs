//! The on-disk schema of a run directory's two logs: `metrics.jsonl`, one
//! [`MetricsLine`] per step, and `journal.jsonl`, one [`Event`] per line.
//! The runtime writes these types and every reader (the report, replay,
//! resume, experiments) reads them, so writer and readers cannot drift apart.
//!
//! Compatibility: the JSON (field names, enum tags) is the format every run
//! has had. A field that older runtimes did not write is an `Option` (`None`
//! when absent) or a list (empty when absent); unknown fields are ignored and an unknown journal event
//! reads as [`Event::Unknown`], so a newer runtime's files stay readable.
//! `tests/run_files.rs` holds lines exactly as a run writes them.

mod journal;
mod metrics;

pub use journal::{Command, Event, MemberEntry, Source};
pub use metrics::{
    GroupMetrics, MemberGroup, MemberLine, MetricsLine, ProgramLine, ProposalCounts, TokenMetrics,
    WireBytes,
};

/// The metrics log's name inside a run directory.
pub const METRICS_FILE: &str = "metrics.jsonl";
/// The journal's name inside a run directory.
pub const JOURNAL_FILE: &str = "journal.jsonl";
