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
//!
//! Work that is shared is counted once, by one rule whether or not a run
//! shares it (`selfplay.share_prefixes`), so two arms of an experiment are
//! always measured alike: rows of one adapter with the same prompt count
//! that prompt once, in generation ([`Cost::generations`]) and in training
//! ([`Cost::train_rows`]), and a train row whose every advantage is 0 is not
//! counted (it adds nothing to the gradient). A group's trained attention is
//! its packed square, `(prompt + Σ answers)²`. The token counts per rollout
//! (`prompt_tokens`, `trained_tokens`) are kept as before; `computed_*` count
//! what the rule counts.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::{AdapterId, TrainRow};
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
    /// Prompt tokens as computed: each prompt once for the rows sharing it
    /// (0 and not written in runs from before it was counted).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub computed_prompt_tokens: u64,
    /// Trained tokens as computed: each shared prompt once, rows that add
    /// nothing to the gradient left out.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub computed_trained_tokens: u64,
    /// Forward and backward FLOPs, as counted above.
    pub flops: f64,
}

impl Cost {
    /// One generated row: `prompt` tokens, then `generated` new ones (a
    /// logit row for each).
    pub fn generation(config: &ModelConfig, prompt: usize, generated: usize) -> Cost {
        Cost::shared_generation(config, prompt, &[generated])
    }

    /// Rows that share one `prompt`, computed once, then each row's
    /// `generated[i]` new tokens attending to the prompt and their own.
    pub fn shared_generation(config: &ModelConfig, prompt: usize, generated: &[usize]) -> Cost {
        let mut macs = forward_macs(config, prompt, prompt * (prompt + 1) / 2);
        for &g in generated {
            // New token j (1-based) attends to prompt + j keys.
            let keys = g * prompt + g * (g + 1) / 2;
            macs += forward_macs(config, g, keys) + head_macs(config, g);
        }
        let rows = generated.len();
        Cost {
            prompt_tokens: (prompt * rows) as u64,
            computed_prompt_tokens: if rows > 0 { prompt as u64 } else { 0 },
            generated_tokens: generated.iter().sum::<usize>() as u64,
            flops: 2.0 * macs,
            ..Cost::default()
        }
    }

    /// Generated rows `(adapter, prompt, new tokens)`, those of one adapter
    /// with the same prompt counting it once.
    pub fn generations<'a>(
        config: &ModelConfig,
        rows: impl IntoIterator<Item = (Option<AdapterId>, &'a [u32], usize)>,
    ) -> Cost {
        let mut groups: BTreeMap<(Option<AdapterId>, &[u32]), Vec<usize>> = BTreeMap::new();
        for (adapter, prompt, generated) in rows {
            groups.entry((adapter, prompt)).or_default().push(generated);
        }
        groups
            .iter()
            .map(|((_, prompt), generated)| {
                Cost::shared_generation(config, prompt.len(), generated)
            })
            .sum()
    }

    /// One trained row of `tokens` tokens, `scored` of them in the loss.
    pub fn training(config: &ModelConfig, tokens: usize, scored: usize) -> Cost {
        Cost::packed_training(config, 0, &[tokens], scored)
    }

    /// One packed train sequence: a `prompt` shared by answers of
    /// `answers[i]` tokens, `scored` tokens in the loss; the whole masked
    /// square of the packed sequence is counted for attention.
    fn packed_training(
        config: &ModelConfig,
        prompt: usize,
        answers: &[usize],
        scored: usize,
    ) -> Cost {
        let tokens = prompt + answers.iter().sum::<usize>();
        Cost {
            trained_tokens: (prompt * answers.len() + tokens - prompt) as u64,
            computed_trained_tokens: tokens as u64,
            flops: 4.0
                * (forward_macs(config, tokens, tokens * tokens) + head_macs(config, scored)),
            ..Cost::default()
        }
    }

    /// A train step's rows: rows of one adapter with the same prompt count
    /// it once, as one packed sequence, and a row without a prompt counts
    /// alone ([`TrainRow::shared_prompt`], as the train step packs them); a
    /// row that adds nothing to the gradient (every advantage 0) counts its
    /// tokens but no FLOPs.
    pub fn train_rows(config: &ModelConfig, rows: &[TrainRow]) -> Cost {
        // Per (adapter, prompt): the answers' lengths and the tokens scored.
        type Groups<'a> = BTreeMap<(AdapterId, &'a [u32]), (Vec<usize>, usize)>;
        let mut groups: Groups = BTreeMap::new();
        let mut apart = Cost::default();
        for r in rows {
            if r.contributes_nothing() {
                apart.trained_tokens += r.tokens.len() as u64;
                continue;
            }
            let scored_here = r.loss_mask.iter().filter(|&&m| m).count();
            let Some(prompt) = r.shared_prompt() else {
                apart.add(Cost::training(config, r.tokens.len(), scored_here));
                continue;
            };
            let (answers, scored) = groups.entry((r.adapter, prompt)).or_default();
            answers.push(r.tokens.len() - prompt.len());
            *scored += scored_here;
        }
        groups
            .iter()
            .map(|((_, prompt), (answers, scored))| {
                Cost::packed_training(config, prompt.len(), answers, *scored)
            })
            .chain([apart])
            .sum()
    }

    pub fn add(&mut self, other: Cost) {
        self.prompt_tokens += other.prompt_tokens;
        self.generated_tokens += other.generated_tokens;
        self.trained_tokens += other.trained_tokens;
        self.computed_prompt_tokens += other.computed_prompt_tokens;
        self.computed_trained_tokens += other.computed_trained_tokens;
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

fn is_zero(n: &u64) -> bool {
    *n == 0
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

    /// A train row of `tokens` tokens after a `prompt`-token prompt, every
    /// token after the prompt in the loss with advantage `advantage`.
    fn row(adapter: AdapterId, prompt: usize, tokens: usize, advantage: f32) -> TrainRow {
        let n = prompt + tokens;
        TrainRow {
            adapter,
            tokens: (0..prompt as u32).chain(100..100 + tokens as u32).collect(),
            prompt_len: prompt,
            loss_mask: (0..n).map(|t| t >= prompt).collect(),
            advantages: vec![advantage; n],
            old_logprobs: vec![0.0; n],
            allowed: vec![None; n],
            temperature: 1.0,
        }
    }

    #[test]
    fn shared_prompts_count_once_and_rows_that_add_nothing_not_at_all() {
        let (model, _) = crate::base::tiny::build(&TinySpec::default()).unwrap();
        let c = &model.config;
        let prompt = [7u32; 10];
        let g = Cost::generations(
            c,
            [
                (Some(1), &prompt[..], 4),
                (Some(1), &prompt[..], 6),
                (Some(2), &prompt[..], 4),
            ],
        );
        assert_eq!((g.prompt_tokens, g.computed_prompt_tokens), (30, 20));
        assert_eq!(g.generated_tokens, 14);
        // Adapter 1's two rows save one prompt's forward.
        let apart: f64 = [4, 6, 4]
            .map(|n| Cost::generation(c, 10, n).flops)
            .iter()
            .sum();
        let prompt_once = 2.0 * forward_macs(c, 10, 55);
        assert!((apart - prompt_once - g.flops).abs() <= 1e-9 * apart);

        // Two answers (3 and 5 tokens) share a 10-token prompt: one packed
        // sequence of 18 tokens; the zero-advantage row costs nothing.
        let rows = [row(1, 10, 3, 0.5), row(1, 10, 5, -0.5), row(1, 10, 4, 0.0)];
        let t = Cost::train_rows(c, &rows);
        assert_eq!(t.trained_tokens, 13 + 15 + 14);
        assert_eq!(t.computed_trained_tokens, 18);
        let packed = 4.0 * (forward_macs(c, 18, 18 * 18) + head_macs(c, 8));
        assert_eq!(t.flops, packed);
        // A row alone is counted as before.
        let alone = Cost::train_rows(c, &rows[..1]);
        assert_eq!(alone.flops, Cost::training(c, 13, 3).flops);
    }

    /// Rows without a prompt share nothing: the train step runs each alone
    /// (`train_packs`), so each counts as it does alone, not as one packed
    /// sequence of the adapter's prompt-less rows.
    #[test]
    fn rows_without_a_prompt_count_as_they_train_alone() {
        let (model, _) = crate::base::tiny::build(&TinySpec::default()).unwrap();
        let c = &model.config;
        let rows = [row(1, 0, 3, 0.5), row(1, 0, 5, -0.5)];
        let both = Cost::train_rows(c, &rows);
        let apart: Cost = rows
            .iter()
            .map(|r| Cost::train_rows(c, std::slice::from_ref(r)))
            .sum();
        assert_eq!(both, apart);
        let alone: Cost = [Cost::training(c, 3, 3), Cost::training(c, 5, 5)]
            .into_iter()
            .sum();
        assert_eq!(both.flops, alone.flops);
    }
}
