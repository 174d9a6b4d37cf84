//! What compute costs, counted from the work itself: tokens and FLOPs of
//! generation and training. A pure function of the rows run (padding and
//! kernel choices are not counted), so a run's total is the same in every
//! replay, and a baseline can be given the same budget as a population.
//!
//! FLOPs count the frozen base's multiply-adds (2 FLOPs each): the linear
//! projections of every token processed, attention's `q·kᵀ` and `p·v` over
//! the keys each token is scored against (generation, with its KV cache:
//! the keys so far; training: the whole masked square), and the LM head
//! where logits are formed (each generated token; each scored token in
//! training). A trained token counts its forward and an input-gradient
//! backward of the same size (the base is frozen: no weight gradients), so
//! twice the forward's FLOPs. Attention's backward really costs about twice
//! its forward (dQ, dK, dP, dV); counting it like the forward leaves out
//! roughly 5 % of a SmolLM2 training step at a few hundred tokens. LoRA's own
//! multiply-adds are a few percent and are not counted either. Both sides of
//! an experiment are counted by the same rule, so the match holds.

use serde::{Deserialize, Serialize};

use crate::base::ModelConfig;

/// Compute spent, accumulated over batches, steps or a whole run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Cost {
    /// Prompt tokens fed to the model before generating.
    pub prompt_tokens: u64,
    /// Tokens generated (sampled or forced by a grammar).
    pub generated_tokens: u64,
    /// Tokens of the rows trained on (forward and backward).
    pub trained_tokens: u64,
    /// Forward and backward FLOPs, as counted above.
    pub flops: f64,
}

impl Cost {
    /// One generated row: `prompt` tokens, then `generated` new ones (a
    /// logit row for each).
    pub fn generation(config: &ModelConfig, prompt: usize, generated: usize) -> Cost {
        let tokens = prompt + generated;
        Cost {
            prompt_tokens: prompt as u64,
            generated_tokens: generated as u64,
            trained_tokens: 0,
            flops: 2.0
                * (forward_macs(config, tokens, tokens * (tokens + 1) / 2)
                    + head_macs(config, generated)),
        }
    }

    /// One trained row of `tokens` tokens, `scored` of them in the loss.
    pub fn training(config: &ModelConfig, tokens: usize, scored: usize) -> Cost {
        Cost {
            trained_tokens: tokens as u64,
            flops: 4.0
                * (forward_macs(config, tokens, tokens * tokens) + head_macs(config, scored)),
            ..Cost::default()
        }
    }

    pub fn add(&mut self, other: Cost) {
        self.prompt_tokens += other.prompt_tokens;
        self.generated_tokens += other.generated_tokens;
        self.trained_tokens += other.trained_tokens;
        self.flops += other.flops;
    }
}

impl std::iter::Sum for Cost {
    fn sum<I: Iterator<Item = Cost>>(iter: I) -> Cost {
        iter.fold(Cost::default(), |mut total, c| {
            total.add(c);
            total
        })
    }
}

/// Multiply-adds of the blocks for a sequence of `tokens` tokens: every
/// token through the linear projections, and `scores` query–key pairs in
/// every layer and head.
fn forward_macs(config: &ModelConfig, tokens: usize, scores: usize) -> f64 {
    let head = config.hidden_size * config.vocab_size;
    let linears = (config.linear_params() - head) as f64;
    let attention = 2.0 * config.num_layers as f64 * config.q_dim() as f64 * scores as f64;
    tokens as f64 * linears + attention
}

/// Multiply-adds of the LM head for `rows` logit rows.
fn head_macs(config: &ModelConfig, rows: usize) -> f64 {
    (rows * config.hidden_size * config.vocab_size) as f64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::base::tiny::TinySpec;

    #[test]
    fn costs_count_linears_attention_and_head() {
        let (model, _) = crate::base::tiny::build(&TinySpec::default()).unwrap();
        let c = &model.config;
        let head = (c.hidden_size * c.vocab_size) as f64;
        let linears = c.linear_params() as f64 - head;
        let per_score = 2.0 * (c.num_layers * c.q_dim()) as f64;
        let generated = Cost::generation(c, 3, 2);
        let keys = (1 + 2 + 3 + 4 + 5) as f64;
        let expected = 2.0 * (5.0 * linears + per_score * keys + 2.0 * head);
        assert_eq!(generated.flops, expected);
        assert_eq!(
            (generated.prompt_tokens, generated.generated_tokens),
            (3, 2)
        );
        let trained = Cost::training(c, 5, 2);
        let expected = 4.0 * (5.0 * linears + per_score * 25.0 + 2.0 * head);
        assert_eq!(trained.flops, expected);
        assert_eq!(trained.trained_tokens, 5);
        let total: Cost = [generated, trained].into_iter().sum();
        assert_eq!(total.flops, generated.flops + trained.flops);
    }
}
