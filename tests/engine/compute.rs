//! The multi-adapter engine: rows in a mixed batch equal single-adapter passes,
//! generation does not depend on batch neighbours (within the limit stated in
//! `compute::generate`'s doc), and gradients of the PPO
//! loss reach every LoRA factor of every adapter (finite differences in f64).

use candle_core::{DType, Device, Tensor, Var};
use populora::base::blocks::BlockFormat;
use populora::base::tiny::{self, TinySpec};
use populora::base::Target;
use populora::base::{Llama, Positions};
use populora::compute::{
    self, AdapterSet, Backward, GenRequest, Pick, RowAdapters, Sampling, ScoreRow, StopReason,
    TrainConfig, TrainRow,
};
use populora::grammar::{TokenMask, Vocabulary};
use populora::keyed_stream;
use populora::lora::{Adapter, LoraConfig, LoraModule};
use rand::Rng;

fn tiny_model() -> Llama {
    tiny::build(&TinySpec::default()).unwrap().0
}

/// A tiny model kept in blocks as the default GGUF is (Q4_1 projections,
/// Q8_0 embedding and tied head): every input width a multiple of 32.
fn native_tiny_model() -> Llama {
    let spec = TinySpec {
        hidden: 64,
        heads: 4,
        kv_heads: 2,
        ffn: 96,
        ..TinySpec::default()
    };
    tiny::build(&spec)
        .unwrap()
        .0
        .quantized(BlockFormat::Q4_1, BlockFormat::Q8_0)
        .unwrap()
}

/// An adapter with random (non-zero) A and B, in `dtype`.
pub fn random_adapter(model: &Llama, seed: u64, dtype: DType) -> Adapter {
    let config = LoraConfig {
        rank: 2,
        alpha: 4.0,
        ..LoraConfig::default()
    };
    random_adapter_with(config, model, seed, dtype)
}

fn random_adapter_with(config: LoraConfig, model: &Llama, seed: u64, dtype: DType) -> Adapter {
    random_adapter_sized(config, model, seed, dtype, (0.3, 0.3))
}

/// An adapter whose A and B entries are uniform in ±`bounds.0` and
/// ±`bounds.1`.
pub fn random_adapter_sized(
    config: LoraConfig,
    model: &Llama,
    seed: u64,
    dtype: DType,
    bounds: (f32, f32),
) -> Adapter {
    let mut rng = keyed_stream!(seed, "adapter");
    let mut adapter = Adapter::new(config, &model.config, &mut rng, &Device::Cpu).unwrap();
    for m in adapter.modules.values_mut() {
        let random = |t: &Tensor, bound: f32, rng: &mut rand_chacha::ChaCha12Rng| {
            let v: Vec<f32> = (0..t.elem_count())
                .map(|_| rng.random_range(-bound..bound))
                .collect();
            Tensor::from_vec(v, t.dims(), &Device::Cpu)
                .unwrap()
                .to_dtype(dtype)
                .unwrap()
        };
        let (a, b) = (
            random(m.a.as_tensor(), bounds.0, &mut rng),
            random(m.b.as_tensor(), bounds.1, &mut rng),
        );
        *m = LoraModule {
            a: Var::from_tensor(&a).unwrap(),
            b: Var::from_tensor(&b).unwrap(),
        };
    }
    adapter
}

/// Last-position logits of an inference pass (what generation runs).
fn last_logits(model: &Llama, set: &AdapterSet, rows: &[(Option<u64>, Vec<u32>)]) -> Vec<Vec<f32>> {
    logits_of_pass(model, set, rows, false)
}

/// Last-position logits of one forward pass; with `save`, the train step's
/// (activations saved, every LoRA segment on its own).
fn logits_of_pass(
    model: &Llama,
    set: &AdapterSet,
    rows: &[(Option<u64>, Vec<u32>)],
    save: bool,
) -> Vec<Vec<f32>> {
    let width = rows.iter().map(|r| r.1.len()).max().unwrap();
    let pads: Vec<usize> = rows.iter().map(|r| width - r.1.len()).collect();
    let flat: Vec<u32> = rows
        .iter()
        .flat_map(|r| std::iter::repeat_n(0, width - r.1.len()).chain(r.1.iter().copied()))
        .collect();
    let tokens = Tensor::from_vec(flat, (rows.len(), width), &Device::Cpu).unwrap();
    let at = Positions::left_padded(&pads, 0, width, &Device::Cpu).unwrap();
    let ids: Vec<_> = rows.iter().map(|r| r.0).collect();
    let hook = RowAdapters::new(set, &ids, &Device::Cpu).unwrap();
    let mut saved = Vec::new();
    let embeds = model.embed(&tokens).unwrap();
    let h = model
        .hidden_states(&embeds, &at, None, &hook, save.then_some(&mut saved))
        .unwrap();
    assert_eq!(saved.len(), if save { model.config.num_layers } else { 0 });
    let last = h.narrow(1, width - 1, 1).unwrap();
    let out = model.head(&last).unwrap();
    out.squeeze(1).unwrap().to_vec2::<f32>().unwrap()
}

fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    let diff: f32 = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max);
    let scale: f32 = b.iter().map(|x| x.abs()).fold(0.0, f32::max);
    diff / scale.max(1e-12)
}

#[test]
fn the_train_steps_forward_equals_the_inference_forward() {
    // Saving activations sends every LoRA projection through its segments
    // one by one (keeping `x·Aᵀ`); inference takes the masked concatenated
    // GEMMs. Both must compute the same function, with weights in f32 and
    // in blocks.
    for model in [tiny_model(), native_tiny_model()] {
        train_forward_equals_inference_forward(&model);
    }
}

fn train_forward_equals_inference_forward(model: &Llama) {
    let (a, b) = (
        random_adapter(model, 1, DType::F32),
        random_adapter(model, 2, DType::F32),
    );
    let set = AdapterSet::new().with(1, &a).with(2, &b);
    let rows = vec![
        (Some(1), vec![3, 4, 5, 6, 7]),
        (Some(2), vec![9, 8]),
        (None, vec![1, 2, 3]),
    ];
    let inference = logits_of_pass(model, &set, &rows, false);
    let saving = logits_of_pass(model, &set, &rows, true);
    for (i, s) in inference.iter().zip(&saving) {
        assert!(
            rel_err(i, s) <= 1e-5,
            "inference vs saving: {}",
            rel_err(i, s)
        );
    }
}

#[test]
fn a_fresh_adapter_leaves_the_base_unchanged() {
    let model = tiny_model();
    let fresh = Adapter::new(
        LoraConfig::default(),
        &model.config,
        &mut keyed_stream!(1, "a"),
        &Device::Cpu,
    )
    .unwrap();
    let set = AdapterSet::new().with(1, &fresh);
    let rows = vec![(Some(1), vec![3, 4, 5, 6])];
    let base_rows = vec![(None, vec![3, 4, 5, 6])];
    assert_eq!(
        last_logits(&model, &set, &rows),
        last_logits(&model, &set, &base_rows)
    );
}

#[test]
fn mixed_adapter_batch_rows_equal_single_adapter_passes() {
    let model = tiny_model();
    let adapters: Vec<Adapter> = (0..3)
        .map(|s| random_adapter(&model, s, DType::F32))
        .collect();
    let mut set = AdapterSet::new();
    for (i, a) in adapters.iter().enumerate() {
        set = set.with(i as u64, a);
    }
    let rows = vec![
        (Some(0), vec![1, 2, 3, 4, 5]),
        (Some(0), vec![9, 8]),
        (None, vec![7, 7, 7]),
        (Some(1), vec![4, 5, 6, 7, 8, 9]),
        (Some(2), vec![11, 12, 13]),
        (Some(2), vec![14]),
    ];
    let mixed = last_logits(&model, &set, &rows);
    for (i, row) in rows.iter().enumerate() {
        let alone = last_logits(&model, &set, std::slice::from_ref(row));
        let e = rel_err(&mixed[i], &alone[0]);
        assert!(e <= 1e-5, "row {i}: relative error {e}");
    }
    // The adapters really change the output.
    let plain = last_logits(&model, &set, &[(None, rows[0].1.clone())]);
    assert!(rel_err(&mixed[0], &plain[0]) > 1e-3);
}

fn request(adapter: Option<u64>, prompt: Vec<u32>, sampling: Sampling, seed: u64) -> GenRequest {
    GenRequest {
        adapter,
        prompt,
        max_new_tokens: 12,
        stop: vec![],
        sampling,
        rng: keyed_stream!(seed, "row"),
        grammar: None,
    }
}

#[test]
fn generation_of_a_row_does_not_depend_on_its_batch() {
    row_generation_does_not_depend_on_its_batch(&tiny_model());
}

/// The same under `weights = "native"`: a row gets the same bits alone and
/// in a batch from the native kernels too.
#[test]
fn generation_of_a_row_does_not_depend_on_its_batch_with_weights_in_blocks() {
    row_generation_does_not_depend_on_its_batch(&native_tiny_model());
}

fn row_generation_does_not_depend_on_its_batch(model: &Llama) {
    let adapters: Vec<Adapter> = (0..2)
        .map(|s| random_adapter(model, 10 + s, DType::F32))
        .collect();
    let set = AdapterSet::new()
        .with(0, &adapters[0])
        .with(1, &adapters[1]);
    let hot = Sampling {
        temperature: 1.0,
        top_p: 0.9,
    };
    // Prompts of at most 2 tokens keep every pass (prefill: 4 rows × 2) at 8
    // token rows or fewer, inside one kernel's range (compute::generate's doc).
    for sampling in [Sampling::GREEDY, hot] {
        let probe = request(Some(1), vec![5, 6], sampling, 99);
        let alone = compute::generate(model, &set, vec![probe.clone()]).unwrap();
        let mut batch = vec![
            request(Some(0), vec![1, 8], sampling, 1),
            request(None, vec![9], sampling, 2),
            probe,
            request(Some(1), vec![3, 3], sampling, 3),
        ];
        batch[1].max_new_tokens = 3; // leaves the batch early
        let mixed = compute::generate(model, &set, batch).unwrap();
        assert_eq!(alone[0].tokens, mixed[2].tokens, "{sampling:?}");
        assert_eq!(alone[0].tokens.len(), 12);
        assert_eq!(mixed[1].tokens.len(), 3);
    }
}

/// Rows with the same adapter and prompt run one prefill and start from its
/// cache; each still samples from its own stream, and every row gets the
/// tokens and log-probs it gets when every prefill runs (short prompts,
/// where each pass's rows pick the small-matrix kernels, and long ones).
#[test]
fn rows_sharing_a_prompt_sample_what_they_sample_alone() {
    let model = tiny_model();
    let (a, b) = (
        random_adapter(&model, 60, DType::F32),
        random_adapter(&model, 61, DType::F32),
    );
    let set = AdapterSet::new().with(1, &a).with(2, &b);
    for prompt_len in [3, 40] {
        let prompt: Vec<u32> = (0..prompt_len).map(|i| (7 * i + 3) % 250).collect();
        let other: Vec<u32> = prompt.iter().map(|t| (t + 1) % 250).collect();
        let requests: Vec<GenRequest> = [
            (Some(1), &prompt, 0),
            (Some(2), &prompt, 1),
            (Some(1), &prompt, 2),
            (None, &prompt, 3),
            (Some(1), &other, 4),
            (Some(1), &prompt, 5),
            (Some(2), &prompt, 6),
        ]
        .into_iter()
        .map(|(adapter, p, seed)| request(adapter, p.clone(), Sampling::default(), seed))
        .collect();
        let run = |share_prefixes| {
            let options = compute::DecodeOptions {
                share_prefixes,
                top: 0,
            };
            compute::generate_with(&model, &set, requests.clone(), options)
                .unwrap()
                .0
        };
        let (alone, shared) = (run(false), run(true));
        for (i, (x, y)) in alone.iter().zip(&shared).enumerate() {
            assert_eq!(x.tokens, y.tokens, "prompt {prompt_len}, row {i}");
            assert_eq!(x.logprobs, y.logprobs, "prompt {prompt_len}, row {i}");
        }
        assert_ne!(
            shared[0].tokens, shared[2].tokens,
            "each row has its own stream"
        );
    }
}

/// A prompt whose first real token is the pad id 0 and the same prompt
/// without it pad to equal token rows, but they are different prompts (pad
/// 0 against 1): each row generates what it generates alone, and sharing
/// prefixes changes neither its tokens nor its log-probs.
#[test]
fn a_leading_pad_id_token_is_not_a_shared_prefix() {
    let model = tiny_model();
    let adapter = random_adapter(&model, 62, DType::F32);
    let set = AdapterSet::new().with(1, &adapter);
    let requests = vec![
        request(Some(1), vec![0, 17, 42], Sampling::GREEDY, 0),
        request(Some(1), vec![17, 42], Sampling::GREEDY, 1),
    ];
    let run = |requests: Vec<GenRequest>, share_prefixes| {
        let options = compute::DecodeOptions {
            share_prefixes,
            top: 0,
        };
        compute::generate_with(&model, &set, requests, options)
            .unwrap()
            .0
    };
    let (plain, shared) = (run(requests.clone(), false), run(requests.clone(), true));
    assert_ne!(plain[0].logprobs, plain[1].logprobs, "the prompts differ");
    for (i, request) in requests.into_iter().enumerate() {
        let alone = run(vec![request], true);
        assert_eq!(shared[i].tokens, alone[0].tokens, "row {i}");
        assert_eq!(shared[i].tokens, plain[i].tokens, "row {i}");
        assert_eq!(shared[i].logprobs, plain[i].logprobs, "row {i}");
    }
}

#[test]
fn same_seed_same_sample_different_seed_different_sample() {
    let model = tiny_model();
    let set = AdapterSet::new();
    let hot = Sampling {
        temperature: 1.5,
        top_p: 1.0,
    };
    let run = |seed| {
        compute::generate(&model, &set, vec![request(None, vec![1, 2], hot, seed)]).unwrap()[0]
            .tokens
            .clone()
    };
    assert_eq!(run(5), run(5));
    assert_ne!(run(5), run(6));
}

#[test]
fn logprobs_match_generation_logprobs_and_respect_micro_batching() {
    let model = tiny_model();
    let adapter = random_adapter(&model, 20, DType::F32);
    let set = AdapterSet::new().with(7, &adapter);
    let gen = compute::generate(
        &model,
        &set,
        vec![request(Some(7), vec![4, 2], Sampling::default(), 1)],
    )
    .unwrap();
    let mut tokens = vec![4, 2];
    tokens.extend(&gen[0].tokens);
    let row = ScoreRow {
        adapter: Some(7),
        tokens: tokens.clone(),
        score_from: 2,
    };
    let many = vec![
        row.clone(),
        ScoreRow {
            adapter: None,
            tokens: tokens.clone(),
            score_from: 1,
        },
        row,
    ];
    let big = compute::logprobs(&model, &set, &many, 4096).unwrap();
    let small = compute::logprobs(&model, &set, &many, 8).unwrap();
    for (a, b) in big[0].iter().zip(&gen[0].logprobs) {
        assert!((a - b).abs() < 1e-4, "{a} vs {b}");
    }
    assert_eq!(big.len(), 3);
    assert_eq!(big[1].len(), tokens.len() - 1);
    for (x, y) in big.iter().flatten().zip(small.iter().flatten()) {
        assert!((x - y).abs() < 1e-5);
    }
}

/// The log-prob of each masked token of `row` under the softmax at the row's
/// temperature renormalised over its mask, from plain scoring of every
/// allowed token in its place: `lp(t)/T − log Σ_{a allowed} exp(lp(a)/T)`
/// (the log-partition of the full softmax cancels).
fn masked_logprobs(model: &Llama, set: &AdapterSet, row: &TrainRow) -> Vec<Option<f32>> {
    let vocab = model.config.vocab_size as u32;
    (0..row.tokens.len())
        .map(|t| {
            let mask = row.allowed[t].as_ref()?;
            let allowed: Vec<u32> = (0..vocab).filter(|&a| mask.allows(a)).collect();
            let scores: Vec<ScoreRow> = allowed
                .iter()
                .map(|&a| ScoreRow {
                    adapter: Some(row.adapter),
                    tokens: [&row.tokens[..t], &[a]].concat(),
                    score_from: t,
                })
                .collect();
            let lps = compute::logprobs(model, set, &scores, 4096).unwrap();
            let temperature = row.temperature as f64;
            let lps: Vec<f64> = lps.iter().map(|l| l[0] as f64 / temperature).collect();
            let own = lps[allowed.iter().position(|&a| a == row.tokens[t]).unwrap()];
            let max = lps.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let total: f64 = lps.iter().map(|l| (l - max).exp()).sum();
            Some((own - max - total.ln()) as f32)
        })
        .collect()
}

/// d(PPO loss)/d(A, B) of every target module of two adapters sharing one
/// batch, analytic vs central finite differences in f64. The adapters differ
/// in rank and targets; the first micro-batch holds both (two segments), the
/// second only one (accumulation across micro-batches). One row of each
/// adapter is trained under grammar masks (the masked, renormalised policy).
/// The rows of each adapter share a two-token prompt, and one row's
/// advantages are all 0: with `share`, each prompt is encoded once for its
/// rows (packed) and that row is skipped.
fn check_train_step_against_finite_differences(
    share: bool,
    micro_batch_tokens: usize,
    backward: Backward,
) {
    let spec = TinySpec {
        hidden: 16,
        heads: 4,
        kv_heads: 2,
        ffn: 24,
        vocab: 260,
        layers: 2,
        ..TinySpec::default()
    };
    let model = tiny::build(&spec).unwrap().0.to_dtype(DType::F64).unwrap();
    check_finite_differences_on(&model, share, micro_batch_tokens, backward);
}

/// The check above on `model` (in f64).
fn check_finite_differences_on(
    model: &Llama,
    share: bool,
    micro_batch_tokens: usize,
    backward: Backward,
) {
    let partial = LoraConfig {
        rank: 3,
        alpha: 4.0,
        targets: vec![Target::Q, Target::V, Target::Gate, Target::Down],
        ..LoraConfig::default()
    };
    let adapters = [
        random_adapter(model, 30, DType::F64),
        random_adapter_with(partial, model, 31, DType::F64),
    ];
    let set = AdapterSet::new()
        .with(0, &adapters[0])
        .with(1, &adapters[1]);
    let mut rng = keyed_stream!(1, "rows");
    let prompts: [Vec<u32>; 2] = [0, 1].map(|_| (0..2).map(|_| rng.random_range(0..256)).collect());
    // (adapter, length, prompt_len, advantages all 0)
    let shapes = [
        (0u64, 7usize, 2usize, false),
        (1, 5, 2, false),
        (0, 4, 2, false),
        (1, 6, 2, false),
        (0, 5, 2, true),
        (1, 6, 0, false),
    ];
    let rows: Vec<TrainRow> = shapes
        .into_iter()
        .map(|(adapter, len, prompt_len, zero)| {
            let tokens: Vec<u32> = prompts[adapter as usize]
                .iter()
                .copied()
                .chain((2..len).map(|_| rng.random_range(0..256)))
                .collect();
            let loss_mask = (0..len).map(|t| t >= 2).collect();
            let advantages = (0..len)
                .map(|_| rng.random_range(-1.0f32..1.0))
                .map(|a| if zero { 0.0 } else { a })
                .collect();
            TrainRow {
                adapter,
                prompt_len,
                tokens,
                loss_mask,
                advantages,
                old_logprobs: vec![0.0; len],
                allowed: vec![None; len],
                temperature: 1.0,
            }
        })
        .collect();
    // The first row of each adapter is trained under grammar masks: at every
    // scored position, four tokens allowed (the target and three others); the
    // first at temperature 0.7.
    let mut rows = rows;
    rows[0].temperature = 0.7;
    mask_rows(&mut rows, |i| i < 2, model.config.vocab_size, 1);
    // Old log-probs near the current ones, so ratios sit inside the clip range
    // (away from the kinks of min/clip where finite differences are undefined).
    let scores: Vec<ScoreRow> = rows
        .iter()
        .map(|r| ScoreRow {
            adapter: Some(r.adapter),
            tokens: r.tokens.clone(),
            score_from: 1,
        })
        .collect();
    let current = compute::logprobs(model, &set, &scores, 4096).unwrap();
    let rows: Vec<TrainRow> = rows
        .into_iter()
        .zip(current)
        .map(|(mut r, lp)| {
            let masked = masked_logprobs(model, &set, &r);
            r.old_logprobs = std::iter::once(0.0)
                .chain(lp.iter().map(|l| l + 0.05))
                .zip(&masked)
                .map(|(free, masked)| masked.map_or(free, |m| m + 0.05))
                .collect();
            r
        })
        .collect();
    let config = TrainConfig {
        clip: 0.2,
        micro_batch_tokens,
        share_prefixes: share,
    };
    let out = compute::train_step_with(model, &set, &rows, config, backward).unwrap();
    // The train step's own forward agrees with scoring: every ratio is
    // exp(-0.05), up to the f32 rounding of the stored old log-probs (≈ 5e-7).
    for stats in out.stats.values() {
        assert!(
            (stats.mean_ratio - (-0.05f64).exp()).abs() < 2e-6,
            "{stats:?}"
        );
    }
    assert!(
        out.micro_batches >= 2,
        "the check must cover gradient accumulation"
    );
    let loss = |set: &AdapterSet| -> f64 {
        let o = compute::train_step_with(model, set, &rows, config, backward).unwrap();
        o.stats.values().map(|s| s.loss).sum()
    };
    let eps = 1e-6;
    for (id, adapter) in adapters.iter().enumerate() {
        let grads = &out.grads[&(id as u64)];
        for (key, module) in &adapter.modules {
            let (ga, gb) = &grads[key];
            for (var, grad) in [(&module.a, ga), (&module.b, gb)] {
                let analytic = grad.flatten_all().unwrap().to_vec1::<f64>().unwrap();
                let original = var
                    .as_tensor()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f64>()
                    .unwrap();
                // Two entries per factor keep the test fast; every factor is covered.
                for i in [0, original.len() - 1] {
                    let shifted = |d: f64| {
                        let mut v = original.clone();
                        v[i] += d;
                        var.set(&Tensor::from_vec(v, var.dims(), &Device::Cpu).unwrap())
                            .unwrap();
                        let l = loss(&set);
                        var.set(
                            &Tensor::from_vec(original.clone(), var.dims(), &Device::Cpu).unwrap(),
                        )
                        .unwrap();
                        l
                    };
                    let numeric = (shifted(eps) - shifted(-eps)) / (2.0 * eps);
                    let err = (numeric - analytic[i]).abs();
                    assert!(
                        err <= 1e-6 + 1e-4 * numeric.abs(),
                        "adapter {id} layer {} {} entry {i}: numeric {numeric}, analytic {}",
                        key.layer,
                        key.target,
                        analytic[i]
                    );
                    assert!(analytic[i] != 0.0, "adapter {id} {key:?}: zero gradient");
                }
            }
        }
    }
}

#[test]
fn train_step_gradients_match_finite_differences_for_every_factor() {
    // Rows by adapter: lengths [7, 4, 5 | 5, 6, 6] → micro-batches
    // [7, 4, 5 | 5] (two segments) and [6, 6].
    check_train_step_against_finite_differences(false, 28, Backward::Tape);
}

#[test]
fn packed_train_step_gradients_match_finite_differences_for_every_factor() {
    // Packs: adapter 0's prompt with its two live rows (9 tokens), adapter
    // 1's with its two (9), adapter 1's ungrouped row (6) → micro-batches
    // [9 | 9] (two segments) and [6].
    check_train_step_against_finite_differences(true, 18, Backward::Tape);
}

/// The tape through weights kept in blocks (Q4_1 projections, Q8_0 embedding
/// and head; unpacked in slices of rows, activations in f64): the forward, the
/// LM head and the products back through the frozen weights.
#[test]
fn native_train_step_gradients_match_finite_differences_for_every_factor() {
    let spec = TinySpec {
        hidden: 32,
        heads: 4,
        kv_heads: 2,
        ffn: 32,
        vocab: 260,
        layers: 2,
        ..TinySpec::default()
    };
    let model = tiny::build(&spec)
        .unwrap()
        .0
        .quantized(BlockFormat::Q4_1, BlockFormat::Q8_0)
        .unwrap()
        .to_dtype(DType::F64)
        .unwrap();
    assert!(model.blocks[0].down.weight.blocks().is_some());
    check_finite_differences_on(&model, true, 18, Backward::Tape);
}

#[test]
fn generic_backward_gradients_match_finite_differences_for_every_factor() {
    // The packed layout of the test above, through the backward that runs
    // off the CPU.
    check_train_step_against_finite_differences(true, 18, Backward::Generic);
}

/// Random rollouts in groups that share prompts, as a self-play step makes
/// them: for each adapter, prompts of 4–9 tokens with 1–5 answers of 2–8
/// tokens each (a few answers begin alike, one is a prefix of another,
/// some tokens forced), a quarter of the rows with every advantage 0, and
/// adapter 2's rows all so.
pub fn grouped_rollouts(vocab: u32, seed: u64) -> Vec<TrainRow> {
    let mut rng = keyed_stream!(seed, "grouped-rollouts");
    let mut rows = Vec::new();
    for adapter in 0..3u64 {
        for _ in 0..3 {
            let prompt: Vec<u32> = (0..rng.random_range(4..10))
                .map(|_| rng.random_range(0..vocab))
                .collect();
            let opening = rng.random_range(0..vocab);
            let answers = rng.random_range(1..6);
            for g in 0..answers {
                let len = rng.random_range(2..9);
                let mut answer: Vec<u32> = (0..len).map(|_| rng.random_range(0..vocab)).collect();
                if g % 2 == 1 {
                    answer[0] = opening;
                }
                let tokens = [prompt.as_slice(), &answer].concat();
                let n = tokens.len();
                let p = prompt.len();
                let zero = adapter == 2 || rng.random_range(0..4) == 0;
                let advantage = rng.random_range(-1.0f32..1.0);
                rows.push(TrainRow {
                    adapter,
                    prompt_len: p,
                    loss_mask: (0..n)
                        .map(|t| t >= p && rng.random_range(0..5) > 0)
                        .collect(),
                    advantages: (0..n)
                        .map(|t| if t >= p && !zero { advantage } else { 0.0 })
                        .collect(),
                    old_logprobs: (0..n).map(|_| rng.random_range(-4.0f32..-1.0)).collect(),
                    allowed: vec![None; n],
                    temperature: if adapter == 1 { 0.8 } else { 1.0 },
                    tokens,
                });
            }
        }
    }
    // One answer that is the start of its neighbour's (same prompt).
    let (a, b) = (rows[1].clone(), &mut rows[2]);
    if a.prompt_len == b.prompt_len && a.tokens[..a.prompt_len] == b.tokens[..b.prompt_len] {
        b.tokens = a.tokens[..a.tokens.len() - 1].to_vec();
        let n = b.tokens.len();
        // Its own values where it has them, its neighbour's past its end.
        fn fit<T: Clone>(v: &mut Vec<T>, from: &[T], n: usize) {
            v.truncate(n);
            v.extend_from_slice(&from[v.len()..n]);
        }
        fit(&mut b.loss_mask, &a.loss_mask, n);
        fit(&mut b.advantages, &a.advantages, n);
        fit(&mut b.old_logprobs, &a.old_logprobs, n);
        fit(&mut b.allowed, &a.allowed, n);
    }
    rows
}

/// The same rows trained plain (one sequence each), packed by prompt with
/// zero-advantage rows skipped, and packed with packs split by a small
/// token budget give the same loss, factor gradients (in the Frobenius
/// norm) and log-probs, within `tolerance` relative. Returns the token
/// slots each layout ran.
pub fn assert_layouts_agree(
    model: &Llama,
    set: &AdapterSet,
    rows: &[TrainRow],
    split_budget: usize,
    tolerance: f64,
) -> [usize; 3] {
    let step = |share_prefixes, micro_batch_tokens| {
        let config = TrainConfig {
            clip: 0.2,
            micro_batch_tokens,
            share_prefixes,
        };
        compute::train_step(model, set, rows, config).unwrap()
    };
    let plain = step(false, 4096);
    let outputs = [step(true, 4096), step(true, split_budget)];
    for out in &outputs {
        assert_outputs_agree(&plain, out, rows, tolerance);
        for (i, row) in rows.iter().enumerate() {
            let skipped = out.logprobs[i].is_none();
            assert_eq!(skipped, row.contributes_nothing(), "row {i}");
        }
    }
    [
        plain.tokens_run,
        outputs[0].tokens_run,
        outputs[1].tokens_run,
    ]
}

/// Two train steps of `rows` give the same loss per adapter, factor
/// gradients (relative error in the Frobenius norm) and log-probs, within
/// `tolerance` relative; a row that did not run in `out` adds nothing.
pub fn assert_outputs_agree(
    plain: &compute::TrainOutput,
    out: &compute::TrainOutput,
    rows: &[TrainRow],
    tolerance: f64,
) {
    let close = |a: f64, b: f64, scale: f64| (a - b).abs() <= tolerance * scale.max(1e-30);
    assert!(plain.stats.keys().eq(out.stats.keys()));
    for (id, s) in &plain.stats {
        let o = &out.stats[id];
        assert_eq!(s.tokens, o.tokens, "adapter {id}");
        assert!(
            close(s.loss, o.loss, s.loss.abs()),
            "adapter {id}: {s:?} vs {o:?}"
        );
    }
    assert!(plain.grads.keys().eq(out.grads.keys()));
    for (id, grads) in &plain.grads {
        for (key, (ga, gb)) in grads {
            let (oa, ob) = &out.grads[id][key];
            for (g, o) in [(ga, oa), (gb, ob)] {
                let g = g.flatten_all().unwrap().to_dtype(DType::F64).unwrap();
                let o = o.flatten_all().unwrap().to_dtype(DType::F64).unwrap();
                let (g, o) = (g.to_vec1::<f64>().unwrap(), o.to_vec1::<f64>().unwrap());
                // Relative error in the Frobenius norm.
                let norm = g.iter().map(|x| x * x).sum::<f64>().sqrt();
                let diff = g
                    .iter()
                    .zip(&o)
                    .map(|(x, y)| (x - y) * (x - y))
                    .sum::<f64>();
                assert!(
                    close(0.0, diff.sqrt(), norm),
                    "adapter {id} {key:?}: |Δ| {} of |g| {norm}",
                    diff.sqrt()
                );
            }
        }
    }
    for (i, (p, o)) in plain.logprobs.iter().zip(&out.logprobs).enumerate() {
        let (Some(p), Some(o)) = (p, o) else {
            assert!(o.is_none() && rows[i].contributes_nothing(), "row {i}");
            continue;
        };
        assert_eq!(p.len(), o.len());
        for (x, y) in p.iter().zip(o) {
            assert!(close(*x, *y, x.abs()), "row {i}: {x} vs {y}");
        }
    }
}

/// The generic backward (candle's ops and the LoRA kernels' CPU reference)
/// gives the tape's loss, factor gradients and log-probs, within `tolerance`
/// relative, with prompts shared and not, in one micro-batch and in several.
pub fn assert_backwards_agree(model: &Llama, set: &AdapterSet, rows: &[TrainRow], tolerance: f64) {
    for (share_prefixes, micro_batch_tokens) in [(false, 4096), (true, 4096), (true, 24)] {
        let config = TrainConfig {
            clip: 0.2,
            micro_batch_tokens,
            share_prefixes,
        };
        let step = |backward| compute::train_step_with(model, set, rows, config, backward).unwrap();
        let (tape, generic) = (step(Backward::Tape), step(Backward::Generic));
        assert_outputs_agree(&tape, &generic, rows, tolerance);
    }
}

/// Grammar masks on the rows whose index `which` picks: at every position
/// in the loss, the target and three other tokens allowed.
pub fn mask_rows(rows: &mut [TrainRow], which: impl Fn(usize) -> bool, vocab: usize, seed: u64) {
    let mut rng = keyed_stream!(seed, "masks");
    for (_, row) in rows.iter_mut().enumerate().filter(|(i, _)| which(*i)) {
        for t in (0..row.tokens.len()).filter(|&t| row.loss_mask[t]) {
            let mut allowed = vec![row.tokens[t]];
            while allowed.len() < 4 {
                let other = rng.random_range(0..vocab as u32);
                if !allowed.contains(&other) {
                    allowed.push(other);
                }
            }
            row.allowed[t] = Some(TokenMask::from_tokens(&allowed, vocab));
        }
    }
}

#[test]
fn the_generic_backward_gives_the_tapes_loss_gradients_and_logprobs() {
    let model = tiny_model().to_dtype(DType::F64).unwrap();
    let partial = LoraConfig {
        rank: 3,
        alpha: 4.0,
        targets: vec![Target::Q, Target::K, Target::Up, Target::Down],
        ..LoraConfig::default()
    };
    let adapters = [
        random_adapter(&model, 60, DType::F64),
        random_adapter_with(partial, &model, 61, DType::F64),
        random_adapter(&model, 62, DType::F64),
    ];
    let set = AdapterSet::new()
        .with(0, &adapters[0])
        .with(1, &adapters[1])
        .with(2, &adapters[2]);
    let mut rows = grouped_rollouts(model.config.vocab_size as u32, 4);
    // Every adapter has masked rows, adapter 1's at temperature 0.8.
    mask_rows(&mut rows, |i| i % 3 == 0, model.config.vocab_size, 4);
    assert_backwards_agree(&model, &set, &rows, 1e-9);
}

#[test]
fn packed_and_skipped_rows_give_the_plain_loss_gradients_and_logprobs() {
    let model = tiny_model().to_dtype(DType::F64).unwrap();
    let partial = LoraConfig {
        rank: 3,
        alpha: 4.0,
        targets: vec![Target::Q, Target::K, Target::Up],
        ..LoraConfig::default()
    };
    let adapters = [
        random_adapter(&model, 50, DType::F64),
        random_adapter_with(partial, &model, 51, DType::F64),
        random_adapter(&model, 52, DType::F64),
    ];
    let set = AdapterSet::new()
        .with(0, &adapters[0])
        .with(1, &adapters[1])
        .with(2, &adapters[2]);
    let rows = grouped_rollouts(model.config.vocab_size as u32, 3);
    assert!(rows.iter().any(|r| r.contributes_nothing()));
    let [plain, packed, split] = assert_layouts_agree(&model, &set, &rows, 24, 1e-9);
    assert!(
        packed < plain && packed <= split,
        "{plain} {packed} {split}"
    );
    // Adapter 2's rows all sit out, yet it gets its (zero) gradients, so
    // its optimizer steps as it would have.
    let config = TrainConfig::default();
    let out = compute::train_step(&model, &set, &rows, config).unwrap();
    for (a, b) in out.grads[&2].values() {
        for g in [a, b] {
            let max = g
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f64>()
                .unwrap();
            assert_eq!(max, 0.0);
        }
    }
}

/// The LM head forms its logits in chunks of 512 scored positions, in one
/// buffer reused from chunk to chunk: a step whose one micro-batch scores more
/// than 1,024 positions (three chunks, the last one short) must give the same
/// log-probs and gradients as the same rows split into micro-batches of one
/// chunk each.
#[test]
fn train_step_does_not_depend_on_head_chunks_or_micro_batches() {
    let model = tiny_model().to_dtype(DType::F64).unwrap();
    let adapters = [
        random_adapter(&model, 40, DType::F64),
        random_adapter(&model, 41, DType::F64),
    ];
    let set = AdapterSet::new()
        .with(0, &adapters[0])
        .with(1, &adapters[1]);
    let mut rng = keyed_stream!(2, "rows");
    let rows: Vec<TrainRow> = (0..6u64)
        .map(|i| {
            let len = 190 + 7 * i as usize;
            TrainRow {
                adapter: i % 2,
                prompt_len: 0,
                tokens: (0..len).map(|_| rng.random_range(0..256)).collect(),
                loss_mask: (0..len).map(|t| t >= 3).collect(),
                advantages: (0..len).map(|_| rng.random_range(-1.0f32..1.0)).collect(),
                old_logprobs: (0..len).map(|_| rng.random_range(-6.0f32..-4.0)).collect(),
                allowed: vec![None; len],
                temperature: 1.0,
            }
        })
        .collect();
    let step = |micro_batch_tokens| {
        let config = TrainConfig {
            clip: 0.2,
            micro_batch_tokens,
            share_prefixes: false,
        };
        compute::train_step(&model, &set, &rows, config).unwrap()
    };
    // More than two of tape.rs's 512-row head chunks in the one micro-batch.
    let scored: usize = rows.iter().map(|r| r.tokens.len() - 3).sum();
    assert!(scored > 2 * 512, "{scored} scored positions");
    let (whole, split) = (step(4096), step(256));
    assert_eq!((whole.micro_batches, split.micro_batches), (1, 6));
    assert_eq!(whole.stats.len(), 2);
    assert!(whole.stats.keys().eq(split.stats.keys()));
    assert!(whole.grads.keys().eq(split.grads.keys()));
    for (id, stats) in &whole.stats {
        let other = &split.stats[id];
        assert!(
            (stats.loss - other.loss).abs() < 1e-12,
            "{stats:?} {other:?}"
        );
        assert!((stats.mean_ratio - other.mean_ratio).abs() < 1e-12);
        assert_eq!(stats.tokens, other.tokens);
    }
    for (id, grads) in &whole.grads {
        for (key, (ga, gb)) in grads {
            let (sa, sb) = &split.grads[id][key];
            for (g, s) in [(ga, sa), (gb, sb)] {
                let diff = (g - s).unwrap().abs().unwrap().max_all().unwrap();
                let scale = g.abs().unwrap().max_all().unwrap();
                let (diff, scale) = (
                    diff.to_scalar::<f64>().unwrap(),
                    scale.to_scalar::<f64>().unwrap(),
                );
                assert!(
                    diff <= 1e-10 * scale.max(1e-3),
                    "adapter {id} {key:?}: {diff} of {scale}"
                );
            }
        }
    }
}

#[test]
fn bad_rows_are_errors_not_panics() {
    let model = tiny_model();
    let set = AdapterSet::new();
    let too_long = vec![1u32; model.config.max_position_embeddings];
    assert!(compute::generate(
        &model,
        &set,
        vec![request(None, too_long, Sampling::GREEDY, 0)]
    )
    .is_err());
    assert!(compute::generate(
        &model,
        &set,
        vec![request(None, vec![], Sampling::GREEDY, 0)]
    )
    .is_err());
    assert!(compute::generate(
        &model,
        &set,
        vec![request(None, vec![100_000], Sampling::GREEDY, 0)]
    )
    .is_err());
    assert!(compute::generate(
        &model,
        &set,
        vec![request(Some(3), vec![1], Sampling::GREEDY, 0)]
    )
    .is_err());
    let row = TrainRow {
        adapter: 0,
        prompt_len: 0,
        tokens: vec![1, 2],
        loss_mask: vec![true, true],
        advantages: vec![0.0; 2],
        old_logprobs: vec![0.0; 2],
        allowed: vec![None; 2],
        temperature: 1.0,
    };
    assert!(compute::train_step(&model, &set, &[row], TrainConfig::default()).is_err());
    // A trained token outside its own mask.
    let vocab = model.config.vocab_size;
    let row = TrainRow {
        adapter: 0,
        prompt_len: 0,
        tokens: vec![1, 2],
        loss_mask: vec![false, true],
        advantages: vec![0.0; 2],
        old_logprobs: vec![0.0; 2],
        allowed: vec![None, Some(TokenMask::from_tokens(&[3, 4], vocab))],
        temperature: 1.0,
    };
    let adapter = random_adapter(&model, 1, DType::F32);
    let set = AdapterSet::new().with(0, &adapter);
    let err = compute::train_step(&model, &set, &[row], TrainConfig::default()).unwrap_err();
    assert!(err.to_string().contains("mask"), "{err}");
}

/// Structured decoding: forced text is appended without sampling (the first
/// run of it joins the prefill), every sampled token is in its mask, its
/// log-prob is of the masked softmax at the sampling temperature, and the
/// reply ends with the stop token when the grammar is complete.
#[test]
fn constrained_rows_follow_their_grammar_and_record_the_masked_policy() {
    let (model, vocab) = tiny::build(&TinySpec::default()).unwrap();
    let tokenizer = vocab.tokenizer().unwrap();
    let adapter = random_adapter(&model, 5, DType::F32);
    let set = AdapterSet::new().with(0, &adapter);
    let vocabulary = Vocabulary::new(&tokenizer, model.config.vocab_size).unwrap();
    let grammar = std::sync::Arc::new(
        vocabulary
            .compile("start: \"The answer is \" /[0-9]{1,3}/ \".\"")
            .unwrap(),
    );
    let sampling = Sampling {
        temperature: 0.8,
        top_p: 1.0,
    };
    let constrained = |seed| GenRequest {
        max_new_tokens: 40,
        stop: tokenizer.stop_ids.clone(),
        grammar: Some(grammar.clone()),
        ..request(
            Some(0),
            tokenizer.encode("Q: 2+2?").unwrap(),
            sampling,
            seed,
        )
    };
    let (out, stats) =
        compute::generate_with_stats(&model, &set, vec![constrained(1), constrained(2)]).unwrap();
    for g in &out {
        let text = tokenizer.decode(&g.tokens[..g.tokens.len() - 1]).unwrap();
        assert!(
            text.starts_with("The answer is ") && text.ends_with('.'),
            "{text:?}"
        );
        assert_eq!(g.stop, StopReason::StopToken);
        assert_eq!(g.tokens.last(), Some(&tokenizer.stop_ids[0]));
        let prefix = "The answer is ".len();
        assert!(g.picks[..prefix].iter().all(|p| *p == Pick::Forced));
        assert!(g.logprobs[..prefix].iter().all(|&l| l == 0.0));
        assert_eq!(
            g.picks.last(),
            Some(&Pick::Forced),
            "the stop token is forced"
        );
        // Every sampled token lies in its mask, and its log-prob is of the
        // masked softmax at temperature 0.8.
        let prompt = tokenizer.encode("Q: 2+2?").unwrap();
        let row = TrainRow {
            adapter: 0,
            prompt_len: 0,
            tokens: [prompt.as_slice(), &g.tokens].concat(),
            loss_mask: vec![false; prompt.len() + g.tokens.len()],
            advantages: vec![0.0; prompt.len() + g.tokens.len()],
            old_logprobs: vec![0.0; prompt.len() + g.tokens.len()],
            allowed: std::iter::repeat_n(None, prompt.len())
                .chain(g.picks.iter().map(Pick::mask))
                .collect(),
            temperature: 0.8,
        };
        let expected = masked_logprobs(&model, &set, &row);
        let sampled: Vec<usize> = (0..g.tokens.len())
            .filter(|&i| matches!(g.picks[i], Pick::Masked(_)))
            .collect();
        assert!(!sampled.is_empty());
        for i in sampled {
            let Pick::Masked(mask) = &g.picks[i] else {
                unreachable!()
            };
            assert!(mask.allows(g.tokens[i]));
            let want = expected[prompt.len() + i].unwrap();
            assert!(
                (g.logprobs[i] - want).abs() < 1e-4,
                "{} vs {want}",
                g.logprobs[i]
            );
        }
    }
    // The forced prefix rode along with the prompt: one pass per sampled
    // token, plus the prefill.
    let longest_sampled = out
        .iter()
        .map(|g| g.picks.iter().filter(|p| **p != Pick::Forced).count())
        .max()
        .unwrap();
    assert!(stats.passes <= longest_sampled + 2, "{stats:?}");
    assert!(stats.forced_tokens >= 2 * 15);
    // Same seed, same reply.
    let again = compute::generate(&model, &set, vec![constrained(1)]).unwrap();
    assert_eq!(again[0].tokens, out[0].tokens);
}

/// A grammar compiled for another vocabulary size is refused, not indexed out of range.
#[test]
fn a_grammar_for_another_vocabulary_is_an_error() {
    let (model, vocab) = tiny::build(&TinySpec::default()).unwrap();
    let tokenizer = vocab.tokenizer().unwrap();
    let vocabulary = Vocabulary::new(&tokenizer, model.config.vocab_size + 32).unwrap();
    let grammar = std::sync::Arc::new(vocabulary.compile("start: \"x\"").unwrap());
    let row = GenRequest {
        grammar: Some(grammar),
        ..request(None, vec![1, 2], Sampling::GREEDY, 0)
    };
    let err = compute::generate(&model, &AdapterSet::new(), vec![row]).unwrap_err();
    assert!(err.to_string().contains("grammar"), "{err}");
}

/// `generate_with_top` picks the tokens `generate` picks and records, per
/// picked token, the best log-probs of the distribution it came from: best
/// first, the greedy pick first, its entry bit-equal to the recorded
/// log-prob, the whole distribution summing to 1. Under a grammar, only
/// tokens of the mask appear, and forced tokens have none.
#[test]
fn top_logprobs_are_those_of_the_distribution_each_token_came_from() {
    let (model, vocab) = tiny::build(&TinySpec::default()).unwrap();
    let tokenizer = vocab.tokenizer().unwrap();
    let adapter = random_adapter(&model, 21, DType::F32);
    let set = AdapterSet::new().with(3, &adapter);
    let rows = || {
        vec![
            request(Some(3), vec![4, 2], Sampling::GREEDY, 1),
            request(None, vec![7], Sampling::default(), 2),
        ]
    };
    let plain = compute::generate(&model, &set, rows()).unwrap();
    let all = model.config.vocab_size;
    let topped = compute::generate_with_top(&model, &set, rows(), all).unwrap();
    for (p, t) in plain.iter().zip(&topped) {
        assert_eq!(p.tokens, t.tokens);
        assert_eq!(p.logprobs, t.logprobs);
        assert!(p.top.is_empty());
        assert_eq!(t.top.len(), t.tokens.len());
        for (i, top) in t.top.iter().enumerate() {
            assert_eq!(top.len(), all);
            assert!(top.windows(2).all(|w| w[0].1 >= w[1].1), "best first");
            let mass: f64 = top.iter().map(|&(_, l)| (l as f64).exp()).sum();
            assert!((mass - 1.0).abs() < 1e-4, "{mass}");
            let picked = top.iter().find(|&&(tok, _)| tok == t.tokens[i]).unwrap();
            assert_eq!(picked.1, t.logprobs[i]);
        }
    }
    // Greedy: the pick is the best token.
    assert!(topped[0]
        .top
        .iter()
        .zip(&topped[0].tokens)
        .all(|(top, &tok)| top[0].0 == tok));
    let three = compute::generate_with_top(&model, &set, rows(), 3).unwrap();
    assert!(three[0]
        .top
        .iter()
        .zip(&topped[0].top)
        .all(|(a, b)| a[..] == b[..3]));

    let vocabulary = Vocabulary::new(&tokenizer, model.config.vocab_size).unwrap();
    let grammar = std::sync::Arc::new(vocabulary.compile("start: \"x = \" /[0-9]{1,2}/").unwrap());
    let constrained = GenRequest {
        stop: tokenizer.stop_ids.clone(),
        grammar: Some(grammar),
        ..request(Some(3), vec![4, 2], Sampling::default(), 4)
    };
    let out = compute::generate_with_top(&model, &set, vec![constrained], 5).unwrap();
    let g = &out[0];
    assert_eq!(g.top.len(), g.tokens.len());
    for (i, pick) in g.picks.iter().enumerate() {
        match pick {
            Pick::Forced => assert!(g.top[i].is_empty()),
            Pick::Masked(mask) => {
                assert!(!g.top[i].is_empty() && g.top[i].len() <= 5);
                assert!(g.top[i].iter().all(|&(tok, _)| mask.allows(tok)));
            }
            Pick::Free => panic!("a constrained row samples under its mask"),
        }
    }
}
