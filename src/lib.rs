//! populora engine: pure, synchronous and deterministic. It knows nothing of
//! actors; the runtime (`populora-actors`) distributes its pieces.
//!
//! | module | owns |
//! |---|---|
//! | [`base`] | the frozen base model: loading (GGUF, HF), tokenizer, forward, fetch |
//! | [`lora`] | LoRA adapters, their files (ours and PEFT), AdamW |
//! | [`compute`] | multi-adapter batched generate / logprobs / train step |
//! | [`evolve`] | rank-preserving weight-space operators |
//! | [`verify`] | the Python sandbox and program checks |
//! | [`task`] | AZR triplets, task kinds, prompts, answer parsing, buffers |
//! | [`rl`] | rewards, TRR++ advantages, PPO-clip token loss |
//! | [`rng`] | seeded ChaCha streams |

pub mod base;
pub mod compute;
pub mod evolve;
pub mod lora;
pub mod rl;
pub mod rng;
pub mod task;
pub mod verify;
