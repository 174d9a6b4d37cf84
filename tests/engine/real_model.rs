//! End-to-end checks on the real SmolLM2-135M-Instruct GGUF. The model is
//! fetched into the cache on first use; if that fails these tests fail loudly
//! (they never skip).

use candle_core::quantized::gguf_file;
use candle_core::{Device, IndexOp, Tensor};
use candle_transformers::models::quantized_llama::ModelWeights;
use populora::base::fetch::{DEFAULT_MODEL, HUMAN_EVAL};
use populora::base::{BaseModel, Logits, Message, NoLora, Positions, WeightsSetting};
use populora::compute::{self, AdapterSet, GenRequest, Sampling};
use populora::eval::humaneval;
use populora::keyed_stream;
use populora::task;

fn model_path() -> std::path::PathBuf {
    DEFAULT_MODEL
        .ensure(&mut |m| eprintln!("{m}"))
        .unwrap_or_else(|e| panic!("the real SmolLM2 model is required for this test: {e}"))
}

/// candle-transformers' quantized_llama with every weight dequantized to f32.
fn peer(path: &std::path::Path) -> ModelWeights {
    // Read once per thread by candle, before the first QMatMul is built.
    std::env::set_var("CANDLE_DEQUANTIZE_ALL", "1");
    let mut file = std::fs::File::open(path).unwrap();
    let content = gguf_file::Content::read(&mut file).unwrap();
    ModelWeights::from_gguf(content, &mut file, &Device::Cpu).unwrap()
}

#[test]
fn smollm2_matches_quantized_llama_logits_and_greedy_continuation() {
    let path = model_path();
    let base = BaseModel::load(&path, WeightsSetting::F32).unwrap();
    let cfg = base.config();
    assert_eq!(
        (
            cfg.num_layers,
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.intermediate_size,
            cfg.vocab_size
        ),
        (30, 576, 9, 3, 1536, 49152)
    );
    assert!(cfg.tie_word_embeddings);
    assert_eq!(cfg.rope_theta, 100_000.0);

    let prompt = base
        .tokenizer
        .encode_chat(&[Message::new(
            "user",
            "Write a Python function that returns the square of x.",
        )])
        .unwrap();
    let mut peer = peer(&path);
    let input = Tensor::new(prompt.as_slice(), &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let peer_logits = peer.forward(&input, 0).unwrap().squeeze(0).unwrap();

    let at = Positions::left_padded(&[0], 0, prompt.len(), &Device::Cpu).unwrap();
    let ours = base
        .model
        .forward(&input, &at, None, &NoLora, Logits::Last)
        .unwrap()
        .i((0, 0))
        .unwrap();
    let diff = (&ours - &peer_logits)
        .unwrap()
        .abs()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    assert!(diff < 1e-3, "max |logit difference| {diff}");

    // 32 greedy tokens, peer vs ours, with no stop tokens.
    let mut peer_tokens = Vec::new();
    let mut logits = peer_logits;
    for pos in prompt.len()..prompt.len() + 32 {
        let next = logits.argmax(0).unwrap().to_scalar::<u32>().unwrap();
        peer_tokens.push(next);
        let x = Tensor::new(&[next], &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        logits = peer.forward(&x, pos).unwrap().squeeze(0).unwrap();
    }
    let request = GenRequest {
        adapter: None,
        prompt: prompt.clone(),
        max_new_tokens: 32,
        stop: vec![],
        sampling: Sampling::GREEDY,
        rng: keyed_stream!(0, "test"),
        grammar: None,
    };
    let ours = compute::generate(&base.model, &AdapterSet::new(), vec![request]).unwrap();
    assert_eq!(ours[0].tokens, peer_tokens);
    let text = base.tokenizer.decode(&ours[0].tokens).unwrap();
    assert!(text.contains("def"), "a sensible continuation: {text:?}");
}

#[test]
fn smollm2_tokenizer_and_chat_format() {
    let base = BaseModel::load(&model_path(), WeightsSetting::F32).unwrap();
    let tok = &base.tokenizer;
    assert_eq!(tok.token_to_id("<|im_start|>"), Some(1));
    assert_eq!(tok.token_to_id("<|im_end|>"), Some(2));
    assert!(tok.stop_ids.contains(&2));
    let text = "def f(a):\n    return a + 12345  # ünïcode";
    let ids = tok.encode(text).unwrap();
    assert_eq!(tok.decode(&ids).unwrap(), text);
    // SmolLM2 splits numbers into single digits.
    let digits = tok.encode("12345").unwrap();
    assert_eq!(digits.len(), 5);
    let chat = tok.chat.render(&[Message::new("user", "hi")]).unwrap();
    assert!(
        chat.starts_with("<|im_start|>system\nYou are a helpful AI assistant named SmolLM"),
        "{chat}"
    );
    assert!(chat.ends_with("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"));
    let ids = tok.encode(&chat).unwrap();
    assert_eq!(ids[0], 1, "<|im_start|> is one special token");
}

/// What populora rendered before it read the model's template: ChatML with
/// SmolLM2's default system prompt when the conversation has none.
fn hard_coded_chatml(messages: &[Message]) -> String {
    let mut out = String::new();
    let mut turn = |role: &str, content: &str| {
        out.push_str(&format!("<|im_start|>{role}\n{content}<|im_end|>\n"));
    };
    if messages.first().is_none_or(|m| m.role != "system") {
        turn(
            "system",
            "You are a helpful AI assistant named SmolLM, trained by Hugging Face",
        );
    }
    for m in messages {
        turn(&m.role, &m.content);
    }
    out.push_str("<|im_start|>assistant\n");
    out
}

/// The default model's own template renders every prompt byte for byte as
/// the hard-coded ChatML did, and it stops at the same tokens, so the
/// quickstart and every recorded eval are unchanged.
#[test]
fn smollm2_template_renders_exactly_the_former_chatml() {
    let base = BaseModel::load(&model_path(), WeightsSetting::F32).unwrap();
    let tok = &base.tokenizer;
    assert_eq!(tok.stop_ids, [2, 0], "<|im_end|>, then <|endoftext|>");
    let mut conversations: Vec<Vec<Message>> = vec![
        vec![Message::new("user", "hi")],
        vec![Message::new("system", "S"), Message::new("user", "hi")],
        vec![Message::new("user", "  surrounding whitespace \n\n")],
        vec![Message::new(
            "user",
            "{{ not jinja }} {% raw %} <|im_end|> ünï",
        )],
        vec![Message::new("user", "")],
        vec![
            Message::new("user", "1"),
            Message::new("assistant", "2"),
            Message::new("user", "3"),
        ],
    ];
    // Every HumanEval prompt `eval` records, and a self-play solver prompt.
    let human_eval = HUMAN_EVAL
        .ensure(&mut |m| eprintln!("{m}"))
        .unwrap_or_else(|e| panic!("HumanEval is required for this test: {e}"));
    let mut prompts: Vec<_> = humaneval::load(&human_eval)
        .unwrap()
        .iter()
        .map(humaneval::prompt)
        .collect();
    let solver = task::SolverTask::Deduction(task::Triplet::identity());
    prompts.push(
        task::solver_prompt(&solver, &task::PromptConfig::default(), &|_| 0)
            .unwrap()
            .chat,
    );
    assert_eq!(prompts.len(), 165);
    conversations.extend(prompts.into_iter().map(|p| {
        vec![
            Message::new("system", p.system),
            Message::new("user", p.user),
        ]
    }));
    for messages in &conversations {
        let rendered = tok.chat.render(messages).unwrap();
        assert_eq!(rendered, hard_coded_chatml(messages), "{messages:?}");
        assert_eq!(
            tok.encode_chat(messages).unwrap(),
            tok.encode(&hard_coded_chatml(messages)).unwrap()
        );
    }
}

/// Issue 6's end-to-end step on the real model: one solo self-play step with
/// small settings, every phase exercised, metrics consistent; with structured
/// decoding on, every reply parses.
#[test]
fn one_selfplay_step_on_smollm2() {
    use populora::base::Target;
    use populora::lora::{AdamW, AdamWConfig, Adapter, LoraConfig};
    use populora::selfplay::{self, Grammars, Learner, Roster, Settings, StepContext};
    use populora::task::{PromptConfig, TaskBuffers, TaskKind};
    use populora::verify::{SandboxConfig, VerifierPool};
    use std::collections::BTreeMap;

    let base = BaseModel::load(&model_path(), WeightsSetting::F32).unwrap();
    let settings = Settings {
        task_kinds: vec![TaskKind::Deduction, TaskKind::Abduction],
        prompt: PromptConfig {
            references: 1,
            ..PromptConfig::default()
        },
        proposals_per_teacher: 2,
        solver_samples: 2,
        max_new_tokens: 128,
        ..Settings::default()
    };
    assert!(settings.constrained);
    let grammars = Grammars::compile(&base.tokenizer, base.config().vocab_size, &settings).unwrap();
    let lora = LoraConfig {
        rank: 4,
        targets: vec![Target::Q, Target::V],
        ..LoraConfig::default()
    };
    let mut rng = keyed_stream!(3, "init");
    let adapter = Adapter::new(lora, base.config(), &mut rng, &Device::Cpu).unwrap();
    let mut learners = BTreeMap::from([(
        0,
        Learner {
            adapter,
            optimizer: AdamW::new(AdamWConfig::default()),
        },
    )]);
    let pool = VerifierPool::new(SandboxConfig::default()).unwrap();
    let mut buffers = TaskBuffers::seeded();
    let ctx = StepContext {
        seed: 3,
        step: 1,
        settings: &settings,
        tokenizer: &base.tokenizer,
        grammars: &grammars,
    };
    let report = selfplay::run_step(
        &ctx,
        &base.model,
        &pool,
        &mut learners,
        &Roster::solo(0),
        &mut buffers,
    )
    .unwrap();
    let m = &report.metrics;
    eprintln!("{m:?}");
    assert_eq!(m.proposals.total, 4);
    let rejected: usize = m.proposals.rejected.values().sum();
    assert_eq!(m.proposals.valid + rejected, 4);
    assert_eq!(
        buffers.len(TaskKind::Deduction) + buffers.len(TaskKind::Abduction),
        2 + m.proposals.valid
    );
    assert!(m.tokens.prompt_mean > 50.0 && m.tokens.response_mean > 0.0);
    assert!(
        !report.solves.is_empty(),
        "the solver always has problems (buffer fallback)"
    );
    assert!(m.train_tokens[&0] > 0);
    assert!(
        !m.proposals
            .rejected
            .keys()
            .any(|k| k.starts_with("format.")),
        "every constrained proposal parses: {:?}",
        m.proposals.rejected
    );
    for (kind, rate) in &m.solver_format_errors {
        assert!(rate.is_none_or(|r| r == 0.0), "{kind:?}: {rate:?}");
    }
    for s in &report.solves {
        assert_eq!(
            s.generation.stop,
            compute::StopReason::StopToken,
            "{:?}",
            s.text
        );
    }
    for phase in ["propose", "validate", "solve", "score", "train"] {
        assert!(m.phase_ms.contains_key(phase), "{phase}");
    }
}

/// On the real model in f32: rows packed by prompt, with zero-advantage
/// rows skipped, train as the plain rows do (loss, every factor gradient,
/// log-probs within 1e-4 relative), and rows sharing a chat prompt sample what they
/// sample with a prefill each (same tokens, same log-probs, bit for bit).
#[test]
fn smollm2_shares_prompts_without_changing_results() {
    use crate::compute::{assert_layouts_agree, grouped_rollouts, random_adapter_sized};
    use candle_core::DType;

    let base = BaseModel::load(&model_path(), WeightsSetting::F32).unwrap();
    let model = &base.model;
    // The size of a young trained adapter: the model stays itself, so f32's
    // rounding stays small (with ±0.3 factors on every projection the
    // gradients of the plain layout alone differ by 2e-3 between two
    // micro-batch budgets).
    let adapters: Vec<_> = (0..3)
        .map(|i| random_adapter_sized(Default::default(), model, 70 + i, DType::F32, (0.05, 0.005)))
        .collect();
    let set = (0..3).fold(AdapterSet::new(), |set, i| {
        set.with(i, &adapters[i as usize])
    });
    let rows = grouped_rollouts(model.config.vocab_size as u32, 9);
    assert_layouts_agree(model, &set, &rows, 48, 1e-4);

    let chat = base
        .tokenizer
        .chat
        .render(&[Message::new(
            "user",
            "What does f(3) return for def f(a): return [a * i for i in range(a)]?",
        )])
        .unwrap();
    let prompt = base.tokenizer.encode(&chat).unwrap();
    assert!(prompt.len() > 40, "{} tokens", prompt.len());
    let requests: Vec<GenRequest> = (0..6u64)
        .map(|i| GenRequest {
            adapter: (i < 4).then_some(i % 2),
            prompt: prompt.clone(),
            max_new_tokens: 12,
            stop: vec![],
            sampling: Sampling::default(),
            rng: keyed_stream!(i, "shared-prompt"),
            grammar: None,
        })
        .collect();
    let run = |share_prefixes| {
        let options = compute::DecodeOptions {
            share_prefixes,
            top: 0,
        };
        compute::generate_with(model, &set, requests.clone(), options)
            .unwrap()
            .0
    };
    let (alone, shared) = (run(false), run(true));
    for (i, (x, y)) in alone.iter().zip(&shared).enumerate() {
        assert_eq!(x.tokens, y.tokens, "row {i}");
        assert_eq!(x.logprobs, y.logprobs, "row {i}");
    }
}

/// On the real model in f32, the backward that runs off the CPU (candle's
/// ops, the LoRA kernels' CPU reference) gives the tape's loss, every factor
/// gradient and the log-probs within 1e-4 relative, rows under grammar
/// masks included.
#[test]
fn smollm2_generic_backward_matches_the_tape() {
    use crate::compute::{
        assert_backwards_agree, grouped_rollouts, mask_rows, random_adapter_sized,
    };
    use candle_core::DType;

    let base = BaseModel::load(&model_path(), WeightsSetting::F32).unwrap();
    let model = &base.model;
    let config = populora::lora::LoraConfig {
        targets: populora::base::Target::ALL.to_vec(),
        ..Default::default()
    };
    let adapters: Vec<_> = (0..3)
        .map(|i| random_adapter_sized(config.clone(), model, 80 + i, DType::F32, (0.05, 0.005)))
        .collect();
    let set = (0..3).fold(AdapterSet::new(), |set, i| {
        set.with(i, &adapters[i as usize])
    });
    let vocab = model.config.vocab_size;
    let mut rows = grouped_rollouts(vocab as u32, 10);
    mask_rows(&mut rows, |i| i % 3 == 0, vocab, 10);
    assert_backwards_agree(model, &set, &rows, 1e-4);
}

/// The cached GGUF is the model `fetch::DEFAULT_MODEL_IDENTITY` describes:
/// its shape fingerprint, and the name its metadata gives it is an alias, so
/// adapters naming the Hugging Face repo id match it.
#[test]
fn the_default_model_is_its_known_identity() {
    use populora::base::fetch::DEFAULT_MODEL_IDENTITY;
    use populora::lora::{names_model, shape_fingerprint, BaseRef};
    let cfg = populora::base::read_config(&model_path()).unwrap();
    assert_eq!(shape_fingerprint(&cfg), DEFAULT_MODEL_IDENTITY.fingerprint);
    assert!(
        DEFAULT_MODEL_IDENTITY.aliases.contains(&cfg.name.as_str()),
        "{}",
        cfg.name
    );
    assert!(names_model(DEFAULT_MODEL_IDENTITY.hf_repo, &cfg));
    assert_eq!(BaseRef::of(&cfg).hf_name(), DEFAULT_MODEL_IDENTITY.hf_repo);
}

/// Each native kernel (few rows, row lanes, panels) on SmolLM2's own Q4_1
/// and Q8_0 tensors agrees with f64 sums over their dequantized values
/// within what summing in another order explains: `|y − Σx·w| ≤ k·u·Σ|x·w|`
/// (u = 2⁻²⁴, recursive summation of `k` products; the f32 path's sums obey
/// the same bound). The base kept in blocks holds at most the GGUF's size
/// plus 10 %.
#[test]
fn smollm2_native_kernels_match_its_dequantized_tensors() {
    use populora::base::native;
    use rand::Rng;
    let path = model_path();
    let model = BaseModel::load(&path, WeightsSetting::Native)
        .unwrap()
        .model;
    let file = std::fs::metadata(&path).unwrap().len() as f64;
    let resident = model.resident_bytes() as f64;
    assert!(
        resident <= 1.1 * file,
        "{resident} bytes for a {file}-byte GGUF"
    );
    let mut rng = keyed_stream!(0, "native-kernels");
    let matrices = [
        ("blk.0.attn_q", &model.blocks[0].q.weight, 1),
        ("blk.29.ffn_down", &model.blocks[29].down.weight, 1),
        ("token_embd", &model.embed, 61),
    ];
    for (name, weight, stride) in matrices {
        let w = weight.blocks().unwrap();
        let (n, k) = (w.rows(), w.cols());
        let dense = w.to_f32();
        for m in [1, 5, 16, 40] {
            let x: Vec<f32> = (0..m * k).map(|_| rng.random_range(-2.0f32..2.0)).collect();
            let y = native::matmul_t(&x, w, m).unwrap();
            for r in 0..m {
                let x = &x[r * k..(r + 1) * k];
                for j in (0..n).step_by(stride) {
                    let w = &dense[j * k..(j + 1) * k];
                    let products = x.iter().zip(w).map(|(&a, &b)| a as f64 * b as f64);
                    let exact: f64 = products.clone().sum();
                    let magnitude: f64 = products.map(f64::abs).sum();
                    let bound = k as f64 * f64::from(f32::EPSILON) / 2.0 * magnitude;
                    let err = (y[r * n + j] as f64 - exact).abs();
                    assert!(err <= bound, "{name} {m} rows [{r}, {j}]: {err} > {bound}");
                }
            }
        }
    }
}

/// Greedy continuations with the weights in blocks equal those of f32 on
/// `bench generate`'s prompts, at batch 1 (the few-row kernels) and 32 (row
/// lanes), or part where f32's two most likely tokens are within 1e-4 in
/// log-probability (a near-tie that the last bits of a sum may flip).
#[test]
fn smollm2_native_greedy_continuations_match_f32() {
    let path = model_path();
    let native = BaseModel::load(&path, WeightsSetting::Native).unwrap();
    let f32 = BaseModel::load(&path, WeightsSetting::F32).unwrap();
    let prompts: Vec<Vec<u32>> = (0..32)
        .map(|i| {
            let text = format!(
                "Write a Python function number {i} that adds {i} to each element of a list."
            );
            native
                .tokenizer
                .encode_chat(&[Message::new("user", text)])
                .unwrap()
        })
        .collect();
    let greedy = |base: &BaseModel, prompts: &[Vec<u32>], tokens: usize| {
        let requests = prompts
            .iter()
            .map(|p| GenRequest {
                adapter: None,
                prompt: p.clone(),
                max_new_tokens: tokens,
                stop: vec![],
                sampling: Sampling::GREEDY,
                rng: keyed_stream!(0, "test"),
                grammar: None,
            })
            .collect();
        compute::generate_with_top(&base.model, &AdapterSet::new(), requests, 2).unwrap()
    };
    let mut differing = 0;
    for (rows, tokens) in [(1, 64), (32, 24)] {
        let (ours, theirs) = (
            greedy(&native, &prompts[..rows], tokens),
            greedy(&f32, &prompts[..rows], tokens),
        );
        for (row, (a, b)) in ours.iter().zip(&theirs).enumerate() {
            let Some(t) = a.tokens.iter().zip(&b.tokens).position(|(x, y)| x != y) else {
                continue;
            };
            differing += 1;
            let gap = b.top[t][0].1 - b.top[t][1].1;
            assert!(
                gap < 1e-4,
                "batch {rows} row {row} token {t}: {} against {}, f32's top two {gap} apart",
                a.tokens[t],
                b.tokens[t]
            );
        }
    }
    eprintln!("{differing} of 33 continuations part at a near-tie");
}

/// A train step through the weights in blocks gives f32's loss, LoRA
/// gradients and log-probs within 1e-4 relative.
#[test]
fn smollm2_native_train_step_matches_f32() {
    use crate::compute::{assert_outputs_agree, grouped_rollouts, random_adapter_sized};
    use candle_core::DType;
    use populora::compute::TrainConfig;
    let path = model_path();
    let native = BaseModel::load(&path, WeightsSetting::Native)
        .unwrap()
        .model;
    let f32 = BaseModel::load(&path, WeightsSetting::F32).unwrap().model;
    let config = populora::lora::LoraConfig {
        targets: populora::base::Target::ALL.to_vec(),
        ..Default::default()
    };
    let adapters: Vec<_> = (0..3)
        .map(|i| random_adapter_sized(config.clone(), &f32, 90 + i, DType::F32, (0.05, 0.005)))
        .collect();
    let set = (0..3).fold(AdapterSet::new(), |set, i| {
        set.with(i, &adapters[i as usize])
    });
    let rows = grouped_rollouts(f32.config.vocab_size as u32, 11);
    let step = |model| compute::train_step(model, &set, &rows, TrainConfig::default()).unwrap();
    assert_outputs_agree(&step(&f32), &step(&native), &rows, 1e-4);
}
