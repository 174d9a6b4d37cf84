//! Activation checkpointing: the train step's backward pass, one block at a time.
//!
//! candle's autograd keeps every intermediate of the forward pass, and every
//! gradient of the backward pass, until `backward` returns. For SmolLM2-135M
//! that was 13.4 GB for one 2048-token micro-batch, and the kernel zeroing
//! fresh pages took more of the step than the GEMMs did. Here the forward pass
//! records no graph and keeps only each block's input. The loss is
//! backpropagated to the last block's output; then, from the top down, each
//! block is recomputed from its saved input with a graph and `Σ block(x) ⊙ g`
//! is backpropagated through that block alone, which yields the block's LoRA
//! factor gradients and `g` for the block below. Peak memory is one block's
//! activations and gradients; the price is one extra forward pass.

use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};

use super::row_adapters::RowAdapters;
use super::Result;
use crate::base::{BlockContext, Llama, Positions};

/// The block inputs of one forward pass, kept for recomputing the blocks.
pub struct Checkpoints {
    inputs: Vec<Tensor>,
    shared: BlockContext,
}

/// The last block's output for `embeds` (`[rows, tokens, hidden]`), computed
/// without a graph (`detached` must be cut loose from the adapters' `Var`s),
/// and every block's input.
pub fn forward(
    model: &Llama,
    detached: &RowAdapters,
    embeds: Tensor,
    at: &Positions,
) -> Result<(Checkpoints, Tensor)> {
    let shared = model.block_context(at, embeds.dtype())?;
    let mut inputs = Vec::with_capacity(model.blocks.len());
    let mut h = embeds;
    for layer in 0..model.blocks.len() {
        let next = model.block(layer, &h, &shared, detached)?;
        inputs.push(h);
        h = next;
    }
    Ok((Checkpoints { inputs, shared }, h))
}

/// Backpropagates `grad` (∂loss/∂ last block's output) from the top block
/// down. `visit(layer, grads)` sees each block's gradients, factors included,
/// before they are dropped.
pub fn backward(
    model: &Llama,
    hook: &RowAdapters,
    checkpoints: Checkpoints,
    mut grad: Tensor,
    mut visit: impl FnMut(usize, &GradStore) -> Result<()>,
) -> Result<()> {
    let Checkpoints { mut inputs, shared } = checkpoints;
    while let Some(input) = inputs.pop() {
        let layer = inputs.len();
        // The embeddings need no gradient, so the first block's input stays a constant.
        let x = match layer {
            0 => input,
            _ => Var::from_tensor(&input)?.as_tensor().clone(),
        };
        let y = model.block(layer, &x, &shared, hook)?;
        let grads = (y * &grad)?.sum_all()?.backward()?;
        visit(layer, &grads)?;
        if layer > 0 {
            grad = grads.get(&x).cloned().ok_or_else(|| {
                candle_core::Error::Msg(format!("block {layer}: no gradient reached its input"))
            })?;
        }
    }
    Ok(())
}
