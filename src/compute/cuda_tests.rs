//! Tests that need an NVIDIA GPU. They are built only with `--features cuda`
//! (CI builds without it) and run on a GPU machine by `scripts/gpu-check.sh`;
//! without a GPU they fail, they never skip.

use candle_core::{DType, Device, Tensor, Var};

use super::lora_op::{lora_delta, TokenSlots, NO_SLOT};
use super::{
    generate, train_step, AdapterSet, GenRequest, RowAdapters, Sampling, TrainConfig, TrainRow,
};
use crate::base::tiny::{self, TinySpec};
use crate::base::{KvCache, Llama, Logits, Positions};
use crate::grammar::TokenMask;
use crate::lora::{Adapter, LoraConfig};
use crate::test_util::max_abs_diff;

fn gpu() -> Device {
    Device::new_cuda(0).expect("these tests need a CUDA GPU (device 0)")
}

/// 3 adapters of rank 8 at the default model's MLP sizes (576 → 1536) over 37
/// token rows, some without an adapter.
fn sized_case() -> (Tensor, Tensor, Tensor, Vec<u32>) {
    let slots: Vec<u32> = (0..37u32)
        .map(|t| if t % 11 == 5 { NO_SLOT } else { t / 13 })
        .collect();
    let cpu = &Device::Cpu;
    let x = Tensor::randn(0f64, 1.0, (37, 576), cpu).unwrap();
    let a = Tensor::randn(0f64, 0.05, (24, 576), cpu).unwrap();
    let b = Tensor::randn(0f64, 0.05, (24, 1536), cpu).unwrap();
    (x, a, b, slots)
}

/// Delta and the three input gradients of `Σ w ⊙ Δ`, as f64 on the host.
fn delta_and_grads(x: &Tensor, a: &Tensor, b: &Tensor, slots: &TokenSlots) -> Vec<Vec<f64>> {
    let (x, a, b) = (
        Var::from_tensor(x).unwrap(),
        Var::from_tensor(a).unwrap(),
        Var::from_tensor(b).unwrap(),
    );
    let delta = lora_delta(&x, &a, &b, slots, 8).unwrap();
    let w = Tensor::arange(0u32, delta.elem_count() as u32, x.device())
        .unwrap()
        .to_dtype(delta.dtype())
        .unwrap()
        .reshape(delta.shape())
        .unwrap()
        .affine(1e-4, -1.0)
        .unwrap();
    let grads = (&delta * &w)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let host = |t: &Tensor| {
        t.flatten_all()
            .unwrap()
            .to_dtype(DType::F64)
            .unwrap()
            .to_vec1::<f64>()
            .unwrap()
    };
    let mut out = vec![host(&delta)];
    for v in [&x, &a, &b] {
        out.push(host(grads.get(v.as_tensor()).unwrap()));
    }
    out
}

#[test]
fn cuda_lora_matches_the_cpu_reference() {
    let (x, a, b, slots) = sized_case();
    let reference = delta_and_grads(
        &x,
        &a,
        &b,
        &TokenSlots::new(slots.clone(), 3, &Device::Cpu).unwrap(),
    );
    let dev = gpu();
    let on = |t: &Tensor| t.to_dtype(DType::F32).unwrap().to_device(&dev).unwrap();
    let cuda = delta_and_grads(
        &on(&x),
        &on(&a),
        &on(&b),
        &TokenSlots::new(slots, 3, &dev).unwrap(),
    );
    for (what, (r, c)) in ["delta", "dx", "dA", "dBᵀ"]
        .iter()
        .zip(reference.iter().zip(&cuda))
    {
        let scale = r.iter().fold(0f64, |m, v| m.max(v.abs()));
        let err = r.iter().zip(c).fold(0f64, |m, (r, c)| m.max((r - c).abs()));
        assert!(
            err <= 1e-5 * scale,
            "{what}: max error {err} at scale {scale}"
        );
    }
}

#[test]
fn cuda_lora_gradients_match_finite_differences() {
    super::lora_op::tests::check_gradients(&gpu());
}

#[test]
fn cuda_lora_is_deterministic() {
    let (x, a, b, slots) = sized_case();
    let dev = gpu();
    let on = |t: &Tensor| t.to_dtype(DType::F32).unwrap().to_device(&dev).unwrap();
    let slots = TokenSlots::new(slots, 3, &dev).unwrap();
    let first = delta_and_grads(&on(&x), &on(&a), &on(&b), &slots);
    for _ in 0..3 {
        let again = delta_and_grads(&on(&x), &on(&a), &on(&b), &slots);
        for (f, g) in first.iter().zip(&again) {
            let same = f.iter().zip(g).all(|(f, g)| f.to_bits() == g.to_bits());
            assert!(same, "a rerun changed bits");
        }
    }
}

fn tiny_model() -> Llama {
    let spec = TinySpec {
        hidden: 64,
        heads: 4,
        kv_heads: 2,
        ffn: 96,
        layers: 3,
        ..TinySpec::default()
    };
    tiny::build(&spec).unwrap().0
}

fn adapters(model: &Llama) -> Vec<Adapter> {
    (0..2)
        .map(|seed| {
            let mut rng = crate::rng::stream(seed, &["cuda".into()]);
            let a =
                Adapter::new(LoraConfig::default(), &model.config, &mut rng, &Device::Cpu).unwrap();
            for m in a.modules.values() {
                m.b.set(&Tensor::randn(0f32, 0.05, m.b.dims(), &Device::Cpu).unwrap())
                    .unwrap();
            }
            a
        })
        .collect()
}

/// A left-padded prefill, then three cached decode steps, with rows on two
/// adapters and one on none: the GPU's logits match the CPU's.
#[test]
fn cuda_model_logits_match_the_cpu() {
    let cpu_model = tiny_model();
    let gpu_model = cpu_model.to_device(&gpu()).unwrap();
    let adapters = adapters(&cpu_model);
    let set = AdapterSet::new()
        .with(1, &adapters[0])
        .with(2, &adapters[1]);
    let rows = [Some(1), Some(1), None, Some(2)];
    let pads = [0usize, 3, 1, 2];
    let run = |model: &Llama| -> Vec<Tensor> {
        let dev = model.device();
        let hook = RowAdapters::new(&set, &rows, dev).unwrap();
        let mut cache = KvCache::new(model.config.num_layers);
        let prompt: Vec<u32> = (0..4 * 9).map(|i| (i * 7 % 250) as u32).collect();
        let tokens = Tensor::from_vec(prompt, (4, 9), dev).unwrap();
        let at = Positions::left_padded(&pads, 0, 9, dev).unwrap();
        let mut out = vec![model
            .forward(&tokens, &at, Some(&mut cache), &hook, Logits::All)
            .unwrap()];
        for step in 0..3u32 {
            let tokens = Tensor::from_vec(
                vec![step + 3, step + 40, step + 77, step + 200],
                (4, 1),
                dev,
            )
            .unwrap();
            let at = Positions::left_padded(&pads, cache.len(), 1, dev).unwrap();
            out.push(
                model
                    .forward(&tokens, &at, Some(&mut cache), &hook, Logits::Last)
                    .unwrap(),
            );
        }
        out.into_iter()
            .map(|t| t.to_device(&Device::Cpu).unwrap())
            .collect()
    };
    let (on_cpu, on_gpu) = (run(&cpu_model), run(&gpu_model));
    for (pass, (c, g)) in on_cpu.iter().zip(&on_gpu).enumerate() {
        let scale = max_abs_diff(c, &c.zeros_like().unwrap());
        let err = max_abs_diff(c, g);
        assert!(
            err <= 1e-4 * scale.max(1.0),
            "pass {pass}: logits differ by {err} (scale {scale})"
        );
    }
}

fn sampled_generation(model: &Llama, set: &AdapterSet) -> Vec<(Vec<u32>, Vec<u32>)> {
    let requests = (0..6u32)
        .map(|i| GenRequest {
            adapter: [Some(1), Some(2), None][i as usize % 3],
            prompt: (0..3 + i).map(|t| (t * 13 + i) % 250).collect(),
            max_new_tokens: 12,
            stop: vec![],
            sampling: Sampling::default(),
            rng: crate::keyed_stream!(7, "cuda-generate", i as u64),
            grammar: None,
        })
        .collect();
    generate(model, set, requests)
        .unwrap()
        .into_iter()
        .map(|g| (g.tokens, g.logprobs.iter().map(|l| l.to_bits()).collect()))
        .collect()
}

#[test]
fn cuda_generation_is_deterministic() {
    let model = tiny_model().to_device(&gpu()).unwrap();
    let adapters = adapters(&model);
    let set = AdapterSet::new()
        .with(1, &adapters[0])
        .with(2, &adapters[1]);
    let first = sampled_generation(&model, &set);
    assert_eq!(first, sampled_generation(&model, &set));
    assert!(first.iter().all(|(tokens, _)| tokens.len() == 12));
}

/// Rollouts of two adapters in groups sharing a prompt (packed when
/// shared), one row under a grammar mask, one at another temperature.
fn train_rows(vocab: usize) -> Vec<TrainRow> {
    let mut rows = Vec::new();
    for (i, adapter) in [1u64, 1, 1, 2, 2, 2].into_iter().enumerate() {
        let prompt: Vec<u32> = (0..6u32)
            .map(|t| (t * 17 + adapter as u32 * 5) % 250)
            .collect();
        let answer: Vec<u32> = (0..5u32).map(|t| (t * 29 + i as u32 * 11) % 250).collect();
        let tokens = [prompt, answer].concat();
        let n = tokens.len();
        let mut allowed = vec![None; n];
        if i == 0 {
            allowed[8] = Some(TokenMask::from_tokens(&[tokens[8], 3, 4, 5], vocab));
        }
        rows.push(TrainRow {
            adapter,
            prompt_len: 6,
            loss_mask: (0..n).map(|t| t >= 6).collect(),
            advantages: (0..n).map(|_| 0.5 - i as f32 * 0.2).collect(),
            old_logprobs: vec![-3.0; n],
            allowed,
            temperature: if adapter == 2 { 0.8 } else { 1.0 },
            tokens,
        });
    }
    rows
}

/// The train step on the GPU (the generic backward, start to finish on the
/// device) gives the CPU tape's loss and gradients, and the same bits on
/// every rerun.
#[test]
fn cuda_train_step_matches_the_cpu_tape_and_reruns_bit_for_bit() {
    let cpu_model = tiny_model();
    let gpu_model = cpu_model.to_device(&gpu()).unwrap();
    let adapters = adapters(&cpu_model);
    let set = AdapterSet::new()
        .with(1, &adapters[0])
        .with(2, &adapters[1]);
    let config = TrainConfig::default();
    let rows = train_rows(cpu_model.config.vocab_size);
    // Old log-probs just above the current ones: every ratio inside the clip
    // range, so every token (masked, tempered) carries a gradient.
    let current = train_step(&cpu_model, &set, &rows, config)
        .unwrap()
        .logprobs;
    let rows: Vec<TrainRow> = rows
        .into_iter()
        .zip(current)
        .map(|(mut row, logprobs)| {
            let scored: Vec<usize> = (0..row.tokens.len())
                .filter(|&t| row.loss_mask[t])
                .collect();
            for (t, lp) in scored.into_iter().zip(logprobs.unwrap()) {
                row.old_logprobs[t] = (lp + 0.05) as f32;
            }
            row
        })
        .collect();
    let on_cpu = train_step(&cpu_model, &set, &rows, config).unwrap();
    let on_gpu = train_step(&gpu_model, &set, &rows, config).unwrap();
    let again = train_step(&gpu_model, &set, &rows, config).unwrap();
    for (id, stats) in &on_cpu.stats {
        let loss = on_gpu.stats[id].loss;
        assert!(
            (stats.loss - loss).abs() <= 1e-4 * stats.loss.abs().max(1e-3),
            "{stats:?} vs {loss}"
        );
        assert_eq!(loss.to_bits(), again.stats[id].loss.to_bits());
    }
    for (row, (c, g)) in on_cpu.logprobs.iter().zip(&on_gpu.logprobs).enumerate() {
        for (c, g) in c.as_ref().unwrap().iter().zip(g.as_ref().unwrap()) {
            assert!(
                (c - g).abs() <= 1e-4 * c.abs().max(1.0),
                "row {row}: {c} vs {g}"
            );
        }
    }
    for stats in on_gpu.stats.values() {
        assert!(
            (stats.mean_ratio - (-0.05f64).exp()).abs() < 1e-3,
            "{stats:?}"
        );
    }
    for (id, grads) in &on_cpu.grads {
        for (key, (a, b)) in grads {
            let (ga, gb) = &on_gpu.grads[id][key];
            let (ra, rb) = &again.grads[id][key];
            for (c, g, r) in [(a, ga, ra), (b, gb, rb)] {
                assert!(
                    g.device().is_cpu(),
                    "gradients come back where the adapter lives"
                );
                let scale = max_abs_diff(c, &c.zeros_like().unwrap());
                let err = max_abs_diff(c, g);
                assert!(
                    err <= 1e-4 * scale.max(1e-6),
                    "{id} {key}: {err} of {scale}"
                );
                assert_eq!(max_abs_diff(g, r), 0.0, "{id} {key}: a rerun changed bits");
            }
        }
    }
}
