//! The engine's integration tests, one binary: each file is one area of the
//! engine (a module here), and linking the engine once instead of once per
//! area keeps the build and `target/` small.

mod base;
mod benchmarks;
mod compute;
mod eval;
mod evolve;
mod grammar;
mod lora;
mod rating;
mod real_model;
mod report;
mod run_files;
mod scenario;
mod selfplay;
mod task;
mod verify;
