//! The `populora` binary driven as a user drives it, one test binary: each
//! file is one area (a module here), sharing the helpers in `common`.

mod adapters;
mod cli;
mod cluster;
mod common;
mod runtime;
