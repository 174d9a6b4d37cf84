//! populora engine: pure, synchronous and deterministic. It knows nothing of
//! actors; the runtime (`populora-actors`) distributes its pieces.
//!
//! | module | owns |
//! |---|---|
//! | [`base`] | the frozen base model: loading (GGUF, HF), tokenizer, forward, fetch |
//! | [`lora`] | LoRA adapters, their files (ours and PEFT), AdamW |
//! | [`compute`] | multi-adapter batched generate / logprobs / train step |
//! | [`evolve`] | rank-preserving weight-space operators |
//! | [`grammar`] | structured decoding: grammars compiled against the vocabulary, token masks |
//! | [`verify`] | the Python sandbox and program checks |
//! | [`task`] | AZR triplets, task kinds, prompts, answer parsing, buffers |
//! | [`eval`] | held-out benchmarks: HumanEval, HumanEval-IO, GSM8K/MATH sets, result tables |
//! | [`rating`] | TrueSkill ratings and near-balanced (PFSP) matchmaking |
//! | [`report`] | the run report: plots (SVG, PNG) and index.html from journal and metrics |
//! | [`run_files`] | the on-disk schema of a run's `metrics.jsonl` and `journal.jsonl` |
//! | [`rl`] | rewards, TRR++ advantages, PPO-clip token loss |
//! | [`scenario`] | the scenario schema, defaults, validation |
//! | [`selfplay`] | one self-play step as plain function calls (phases, rewards, update) |
//! | [`rng`] | seeded ChaCha streams |

pub mod base;
pub mod compute;
pub mod eval;
pub mod evolve;
pub mod grammar;
pub mod lora;
pub mod rating;
pub mod report;
pub mod rl;
pub mod rng;
pub mod run_files;
pub mod scenario;
pub mod selfplay;
pub mod task;
pub mod verify;

#[cfg(test)]
mod test_util;
