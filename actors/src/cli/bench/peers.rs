//! The peers of `bench generate` at batch 1: candle-transformers' `llama` on
//! the very f32 tensors ours runs, and its `quantized_llama` on the GGUF's
//! own Q4_1 weights. candle-transformers is a large crate that nothing else
//! needs, so they are built only with the `peer` feature
//! (`cargo build --release --features peer`); without it no peer runs and
//! the bench says so.

use std::time::Instant;

use candle_core::Tensor;
use populora::base::BaseModel;

/// Whether this build has the peers.
pub const BUILT: bool = cfg!(feature = "peer");

/// The peers that can run on this model and device.
pub struct Peers {
    #[cfg(feature = "peer")]
    f32: Option<populora::base::peer::CandleLlama>,
    #[cfg(feature = "peer")]
    quantized: Option<QuantizedLlama>,
}

#[cfg(feature = "peer")]
type QuantizedLlama = candle_transformers::models::quantized_llama::ModelWeights;

impl Peers {
    /// Both peers run on the CPU only; the f32 one needs a Llama, the
    /// quantized one a GGUF file.
    #[cfg(feature = "peer")]
    pub fn load(base: &BaseModel) -> anyhow::Result<Peers> {
        use candle_core::quantized::gguf_file;
        use populora::base::{self, peer::CandleLlama};

        let on_cpu = base.model.device().is_cpu();
        let f32 = if on_cpu && base.config().arch == base::Arch::Llama {
            Some(CandleLlama::new(&base.model)?)
        } else {
            None
        };
        let quantized = if on_cpu && base.source == base::Source::Gguf {
            let mut file = std::fs::File::open(&base.path)?;
            let content = gguf_file::Content::read(&mut file)?;
            let device = candle_core::Device::Cpu;
            Some(QuantizedLlama::from_gguf(content, &mut file, &device)?)
        } else {
            None
        };
        Ok(Peers { f32, quantized })
    }

    #[cfg(not(feature = "peer"))]
    pub fn load(_: &BaseModel) -> anyhow::Result<Peers> {
        Ok(Peers {})
    }

    /// candle-transformers' llama, from an empty KV cache: tokens/s and the
    /// tokens (`None`: this peer cannot run here).
    pub fn greedy_f32(
        &self,
        prompt: &[u32],
        tokens: usize,
    ) -> Option<anyhow::Result<(f64, Vec<u32>)>> {
        #[cfg(feature = "peer")]
        if let Some(peer) = &self.f32 {
            let run = || {
                let mut cache = peer.cache()?;
                greedy(
                    |t, pos| peer.model.forward(&row(t)?, pos, &mut cache),
                    prompt,
                    tokens,
                )
            };
            return Some(run());
        }
        let _ = (prompt, tokens);
        None
    }

    /// quantized_llama (a forward at position 0 starts its KV cache afresh).
    pub fn greedy_quantized(
        &mut self,
        prompt: &[u32],
        tokens: usize,
    ) -> Option<anyhow::Result<(f64, Vec<u32>)>> {
        #[cfg(feature = "peer")]
        if let Some(peer) = &mut self.quantized {
            return Some(greedy(|t, pos| peer.forward(&row(t)?, pos), prompt, tokens));
        }
        let _ = (prompt, tokens);
        None
    }
}

#[cfg(feature = "peer")]
fn row(tokens: &[u32]) -> candle_core::Result<Tensor> {
    Tensor::new(tokens, &candle_core::Device::Cpu)?.unsqueeze(0)
}

/// Greedy batch-1 decode through a peer, timed as ours is (prefill, then one
/// step per new token after the first): `forward(tokens, position)` returns
/// the last position's logits, `[1, vocab]`. Tokens/s and the tokens.
#[cfg_attr(not(feature = "peer"), allow(dead_code))]
fn greedy(
    mut forward: impl FnMut(&[u32], usize) -> candle_core::Result<Tensor>,
    prompt: &[u32],
    tokens: usize,
) -> anyhow::Result<(f64, Vec<u32>)> {
    let start = Instant::now();
    let mut out = Vec::with_capacity(tokens);
    let mut logits = forward(prompt, 0)?;
    loop {
        out.push(logits.squeeze(0)?.argmax(0)?.to_scalar::<u32>()?);
        if out.len() >= tokens {
            break;
        }
        logits = forward(&out[out.len() - 1..], prompt.len() + out.len() - 1)?;
    }
    Ok((out.len() as f64 / start.elapsed().as_secs_f64(), out))
}
