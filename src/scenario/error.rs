//! `ScenarioError`: every problem with a scenario file, located as `file:line`.

use std::fmt;

/// What went wrong, coarsely. The message says exactly what.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// The file could not be read.
    Read,
    /// The text is not valid TOML.
    Syntax,
    /// Valid TOML that does not fit the schema: unknown key, wrong type, missing required key.
    Schema,
    /// Fits the schema, but a value is out of range or contradicts another value.
    Invalid,
}

/// A scenario that cannot be used, rendered as `file:line: message`
/// (or `file: message` when no line applies), e.g.
/// `scenarios/x.toml:14: lora.rank = 0 is out of range (allowed 1..=256)`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct ScenarioError {
    /// The file path (or the origin string given to `Scenario::parse`).
    pub origin: String,
    /// 1-based line of the offending key (or of the nearest enclosing table when the key is absent).
    pub line: Option<usize>,
    /// Dotted key path, e.g. `evolution.crossover[1].op`; `None` for read and syntax errors.
    pub key: Option<String>,
    /// Coarse category.
    pub kind: ErrorKind,
    /// The complete message without the `file:line: ` prefix; it names the key itself.
    pub message: String,
}

impl fmt::Display for ScenarioError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.line {
            Some(line) => write!(f, "{}:{}: {}", self.origin, line, self.message),
            None => write!(f, "{}: {}", self.origin, self.message),
        }
    }
}
