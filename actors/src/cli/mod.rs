//! One module per subcommand. Errors become `anyhow` here and nowhere deeper.

pub mod adapter;
pub mod bench;
pub mod ctl;
pub mod eval;
pub mod evolve;
pub mod exec;
pub mod experiment;
pub mod export;
pub mod fetch;
pub mod generate;
pub mod import_peft;
pub mod info;
pub mod node;
pub mod replay;
pub mod report;
pub mod resume;
pub mod run;
