//! What a train step holds where the model runs, counted from the shapes:
//! the frozen weights, the factors of the batch's adapters and their
//! gradients, one micro-batch's saved activations ([`super::tape`]), and the
//! largest transients of the backward (a packed row's attention square, a
//! chunk of the LM head's logits). The optimizer's moments live with the
//! members, on the host, and are not counted.

use crate::base::{ModelConfig, Target};
use crate::lora::LoraConfig;

/// Values (not bytes) a train step holds on its device.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TrainMemory {
    /// The frozen base: every projection, the embeddings, the LM head
    /// (once when tied), the norms.
    pub weights: usize,
    /// The batch's concatenated factors and their gradients.
    pub adapters: usize,
    /// The forward's saved activations, every block, for the micro-batch.
    pub activations: usize,
    /// The largest transients of the backward: four attention squares of a
    /// row as wide as the micro-batch (P, ∂P, and ∂P − Σ∂P⊙P with its
    /// product by P); three 512-row chunks of the LM head's logits (two at
    /// a time, the grammar's u8 mask, rounded up).
    pub transients: usize,
}

impl TrainMemory {
    /// A train step of `adapters` adapters of `lora`'s shape on `cfg`, in
    /// micro-batches of `tokens` tokens.
    pub fn estimate(cfg: &ModelConfig, lora: &LoraConfig, adapters: usize, tokens: usize) -> Self {
        let (h, layers) = (cfg.hidden_size, cfg.num_layers);
        let projections: usize = Target::ALL
            .iter()
            .map(|t| {
                let (inp, out) = t.dims(cfg);
                inp * out
            })
            .sum();
        let head = if cfg.tie_word_embeddings { 1 } else { 2 };
        let weights = layers * (projections + 2 * h) + head * cfg.vocab_size * h + h;
        let factors: usize = lora
            .targets
            .iter()
            .map(|t| {
                let (inp, out) = t.dims(cfg);
                lora.rank * (inp + out)
            })
            .sum();
        let adapters = 2 * adapters * layers * factors;
        let activations = tokens * layers * Self::saved_per_token_and_block(cfg, lora);
        let attention = 4 * cfg.num_heads * tokens * tokens;
        let logits = 3 * super::tape::HEAD_CHUNK_ROWS.min(tokens) * cfg.vocab_size;
        TrainMemory {
            weights,
            adapters,
            activations,
            transients: attention + logits,
        }
    }

    /// What one block's forward saves per token: its input, the attention
    /// output and the residual (3 × hidden; the norms are recomputed), q, k and
    /// v, gate and up, and each adapted projection's shrink (rank values).
    pub fn saved_per_token_and_block(cfg: &ModelConfig, lora: &LoraConfig) -> usize {
        3 * cfg.hidden_size
            + cfg.q_dim()
            + 2 * cfg.kv_dim()
            + 2 * cfg.intermediate_size
            + lora.targets.len() * lora.rank
    }

    /// Every value, at `weight_bytes` per frozen weight (4 in f32, 2 in
    /// bf16; a weight kept in its GGUF block takes the block's share,
    /// [`BlockFormat::bytes_per_value`]: 0.625 in Q4_1) and `bytes` per other
    /// value. Weights in blocks add almost nothing of their own: the kernels
    /// unpack them in registers, or a slice of rows at a time into buffers
    /// kept for the process's life (4 MB of f32 each, one per product that
    /// ever ran at the same time as others, [`crate::base::native`]).
    ///
    /// [`BlockFormat::bytes_per_value`]: crate::base::blocks::BlockFormat::bytes_per_value
    pub fn bytes(&self, weight_bytes: f64, bytes: usize) -> usize {
        (self.weights as f64 * weight_bytes).ceil() as usize
            + (self.adapters + self.activations + self.transients) * bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::base::Arch;

    /// Qwen2.5-Coder-7B's `config.json`.
    fn qwen_coder_7b() -> ModelConfig {
        ModelConfig {
            arch: Arch::Qwen2,
            name: "Qwen2.5-Coder-7B".into(),
            vocab_size: 152_064,
            hidden_size: 3584,
            intermediate_size: 18_944,
            num_layers: 28,
            num_heads: 28,
            num_kv_heads: 4,
            head_dim: 128,
            rope_theta: 1e6,
            rms_norm_eps: 1e-6,
            max_position_embeddings: 32_768,
            tie_word_embeddings: false,
        }
    }

    const GB: f64 = 1e9;

    /// SmolLM2's 5.8k values per token and block (23 KB in f32, the tape's
    /// figure), and the paper's setting: a 7B base with 4 + 4 adapters of
    /// rank 32 on every projection, micro-batches of 2048 tokens.
    #[test]
    fn a_7b_base_with_eight_rank_32_adapters_fits_an_80_gb_gpu_in_f32() {
        let smol = crate::base::tiny::TinySpec::default_model_shape();
        let smol = crate::base::tiny::build(&crate::base::tiny::TinySpec {
            layers: 1,
            vocab: 300,
            ..smol
        })
        .unwrap()
        .0
        .config;
        let rank8 = LoraConfig::default();
        assert_eq!(TrainMemory::saved_per_token_and_block(&smol, &rank8), 5816);

        let cfg = qwen_coder_7b();
        let lora = LoraConfig {
            rank: 32,
            ..LoraConfig::default()
        };
        let m = TrainMemory::estimate(&cfg, &lora, 8, 2048);
        // 7.6 B frozen weights (bias and norms aside).
        assert!((7.6e9..7.7e9).contains(&(m.weights as f64)), "{m:?}");
        let f32_total = m.bytes(4.0, 4) as f64 / GB;
        let bf16_weights = m.bytes(2.0, 4) as f64 / GB;
        let bf16_total = m.bytes(2.0, 2) as f64 / GB;
        eprintln!(
            "7B, 4 + 4 adapters of rank 32, 2048-token micro-batches: weights {:.1} GB f32, \
             adapters and gradients {:.1} GB, activations {:.1} GB, transients {:.1} GB (f32); \
             total {f32_total:.1} GB in f32, {bf16_weights:.1} GB with bf16 weights, \
             {bf16_total:.1} GB all bf16",
            m.weights as f64 * 4.0 / GB,
            m.adapters as f64 * 4.0 / GB,
            m.activations as f64 * 4.0 / GB,
            m.transients as f64 * 4.0 / GB,
        );
        assert!((45.0..60.0).contains(&f32_total), "{f32_total}");
        assert!(bf16_weights < f32_total - 15.0 && bf16_total < 30.0);
    }

    /// The same shape with its frozen weights kept in Q4_1 blocks (20 bytes
    /// per 32 weights), against this machine's 23 GiB: the weights take
    /// 4.8 GB instead of 30 in f32; the paper's setting (8 adapters of rank
    /// 32, 2048-token micro-batches) is then bound by its f32 activations,
    /// while 2 + 2 adapters of rank 16 in 512-token micro-batches fit.
    #[test]
    fn a_7b_base_in_q4_1_against_this_machines_memory() {
        use crate::base::blocks::BlockFormat;
        let cfg = qwen_coder_7b();
        let q4_1 = BlockFormat::Q4_1.bytes_per_value();
        let machine = 23.0 * (1u64 << 30) as f64 / GB;
        let mut fits = Vec::new();
        for (adapters, rank, tokens) in [(8, 32, 2048), (4, 16, 1024), (4, 16, 512)] {
            let lora = LoraConfig {
                rank,
                ..LoraConfig::default()
            };
            let m = TrainMemory::estimate(&cfg, &lora, adapters, tokens);
            let total = m.bytes(q4_1, 4) as f64 / GB;
            eprintln!(
                "7B in Q4_1, {adapters} adapters of rank {rank}, {tokens}-token micro-batches: \
                 weights {:.1} GB, adapters and gradients {:.1} GB, activations {:.1} GB, \
                 transients {:.1} GB: {total:.1} GB of this machine's {machine:.1}",
                m.weights as f64 * q4_1 / GB,
                m.adapters as f64 * 4.0 / GB,
                m.activations as f64 * 4.0 / GB,
                m.transients as f64 * 4.0 / GB,
            );
            assert!((4.7..4.9).contains(&(m.weights as f64 * q4_1 / GB)));
            fits.push(total < machine);
        }
        assert_eq!(fits, [false, true, true]);
    }
}
