//! The base model against independent implementations, on tiny random models
//! that the tests write to disk themselves.

use candle_core::{DType, Device, IndexOp, Tensor, Var};
use candle_nn::VarBuilder;
use populora::base::tiny::{self, TinySpec, TINY_CHAT_TEMPLATE};
use populora::base::{gguf, hf, Arch, BaseModel, KvCache, Llama, Logits, NoLora, Positions};

fn tmpdir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("populora-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Logits of every position of one unpadded row.
fn logits(model: &Llama, tokens: &[u32]) -> Tensor {
    let t = Tensor::new(tokens, &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let at = Positions::left_padded(&[0], 0, tokens.len(), &Device::Cpu).unwrap();
    model
        .forward(&t, &at, None, &NoLora, Logits::All)
        .unwrap()
        .squeeze(0)
        .unwrap()
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

const TOKENS: [u32; 7] = [5, 17, 120, 33, 260, 8, 99];

#[test]
fn gguf_round_trip_undoes_the_qk_permutation() {
    let (model, vocab) = tiny::build(&TinySpec::default()).unwrap();
    let dir = tmpdir("gguf-rt");
    let path = dir.join("tiny.gguf");
    vocab.write_gguf(&path, &model).unwrap();
    let loaded = BaseModel::load(&path).unwrap();
    assert_eq!(loaded.config(), &model.config);
    let d = max_abs_diff(&logits(&model, &TOKENS), &logits(&loaded.model, &TOKENS));
    assert!(d < 1e-5, "GGUF round trip changed logits by {d}");
    // The permutation is real: loading without undoing it would give other logits.
    let q = &model.blocks[0].q.weight;
    let permuted = gguf::permute_rows(q, model.config.num_heads).unwrap();
    assert!(max_abs_diff(q, &permuted) > 1e-3);
    assert!(
        max_abs_diff(
            q,
            &gguf::unpermute_rows(&permuted, model.config.num_heads).unwrap()
        ) == 0.0
    );
}

#[test]
fn hf_llama_matches_candle_transformers_and_the_same_weights_as_gguf() {
    use populora::base::peer::CandleLlama;
    let spec = TinySpec {
        tied: false,
        seed: 3,
        ..TinySpec::default()
    };
    let (model, vocab) = tiny::build(&spec).unwrap();
    let dir = tmpdir("hf-llama");
    hf::write(&dir, &model, vocab.tokenizer().unwrap().inner(), 2).unwrap();
    let ours = BaseModel::load(&dir).unwrap();
    assert!(
        dir.join("model.safetensors.index.json").exists(),
        "sharded checkpoint"
    );

    // The peer holds the weights that were written; ours read them back.
    let peer = CandleLlama::new(&model).unwrap();
    let mut cache = peer.cache().unwrap();
    let input = Tensor::new(&TOKENS, &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let peer_last = peer
        .model
        .forward(&input, 0, &mut cache)
        .unwrap()
        .squeeze(0)
        .unwrap();
    let our_last = logits(&ours.model, &TOKENS).i(TOKENS.len() - 1).unwrap();
    let d = max_abs_diff(&peer_last, &our_last);
    assert!(d < 1e-4, "ours vs candle-transformers llama: {d}");

    let gguf_path = dir.join("same.gguf");
    vocab.write_gguf(&gguf_path, &model).unwrap();
    let from_gguf = BaseModel::load(&gguf_path).unwrap();
    let d = max_abs_diff(
        &logits(&from_gguf.model, &TOKENS),
        &logits(&ours.model, &TOKENS),
    );
    assert!(d < 1e-5, "GGUF vs HF loader on the same weights: {d}");
}

#[test]
fn hf_qwen2_with_biases_matches_candle_transformers() {
    use candle_transformers::models::qwen2 as peer;
    let spec = TinySpec {
        arch: Arch::Qwen2,
        seed: 4,
        ..TinySpec::default()
    };
    let (model, vocab) = tiny::build(&spec).unwrap();
    assert!(model.blocks[0].q.bias.is_some());
    let dir = tmpdir("hf-qwen2");
    hf::write(&dir, &model, vocab.tokenizer().unwrap().inner(), 1).unwrap();
    let ours = BaseModel::load(&dir).unwrap();

    let cfg: peer::Config =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let files = [dir.join("model.safetensors")];
    let vb =
        unsafe { VarBuilder::from_mmaped_safetensors(&files, DType::F32, &Device::Cpu).unwrap() };
    let mut peer_model = peer::ModelForCausalLM::new(&cfg, vb).unwrap();
    let input = Tensor::new(&TOKENS, &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let peer_last = peer_model
        .forward(&input, 0)
        .unwrap()
        .squeeze(0)
        .unwrap()
        .squeeze(0)
        .unwrap();
    let our_last = logits(&ours.model, &TOKENS).i(TOKENS.len() - 1).unwrap();
    let d = max_abs_diff(&peer_last, &our_last);
    assert!(d < 1e-4, "ours vs candle-transformers qwen2: {d}");
}

#[test]
fn padded_batch_rows_equal_single_rows_and_cache_equals_full_forward() {
    let (model, _) = tiny::build(&TinySpec::default()).unwrap();
    let rows: [&[u32]; 3] = [&[1, 2, 3, 4, 5, 6], &[7, 8], &[9, 10, 11, 12]];
    let width = 6;
    let pads: Vec<usize> = rows.iter().map(|r| width - r.len()).collect();
    let mut flat = Vec::new();
    for r in rows {
        flat.extend(std::iter::repeat_n(0u32, width - r.len()));
        flat.extend_from_slice(r);
    }
    let batch = Tensor::from_vec(flat, (3, width), &Device::Cpu).unwrap();
    let at = Positions::left_padded(&pads, 0, width, &Device::Cpu).unwrap();
    let mut cache = KvCache::new(model.config.num_layers);
    let out = model
        .forward(&batch, &at, Some(&mut cache), &NoLora, Logits::Last)
        .unwrap();
    for (i, r) in rows.iter().enumerate() {
        let alone = logits(&model, r).i(r.len() - 1).unwrap();
        let d = max_abs_diff(&out.i((i, 0)).unwrap(), &alone);
        assert!(d < 1e-5, "row {i} differs in a padded batch by {d}");
    }
    // One more token per row through the cache == the full forward of the longer row.
    let next = Tensor::new(&[[42u32], [43], [44]], &Device::Cpu).unwrap();
    let at = Positions::left_padded(&pads, width, 1, &Device::Cpu).unwrap();
    let out = model
        .forward(&next, &at, Some(&mut cache), &NoLora, Logits::Last)
        .unwrap();
    for (i, r) in rows.iter().enumerate() {
        let mut longer = r.to_vec();
        longer.push(42 + i as u32);
        let full = logits(&model, &longer).i(longer.len() - 1).unwrap();
        let d = max_abs_diff(&out.i((i, 0)).unwrap(), &full);
        assert!(
            d < 1e-5,
            "row {i}: cached decode differs from full forward by {d}"
        );
    }
}

/// Finite differences in f64 of one logit w.r.t. every input embedding entry:
/// proves every op of the forward carries gradients.
#[test]
fn gradient_of_logits_wrt_input_embeddings_matches_finite_differences() {
    let spec = TinySpec {
        hidden: 16,
        heads: 4,
        kv_heads: 2,
        ffn: 24,
        vocab: 260,
        ..TinySpec::default()
    };
    let (model, _) = tiny::build(&spec).unwrap();
    let model = model.to_dtype(DType::F64).unwrap();
    let tokens = Tensor::new(&[[3u32, 9, 27, 81], [0, 0, 5, 25]], &Device::Cpu).unwrap();
    let at = Positions::left_padded(&[0, 2], 0, 4, &Device::Cpu).unwrap();
    let embeds = Var::from_tensor(&model.embed(&tokens).unwrap()).unwrap();
    // A scalar that mixes every output position and many vocabulary entries.
    let weights = Tensor::randn(0f64, 1.0, (2, 4, model.config.vocab_size), &Device::Cpu).unwrap();
    let objective = |e: &Tensor| -> Tensor {
        let l = model
            .forward_embeds(e, &at, None, &NoLora, Logits::All)
            .unwrap();
        // Padding positions (row 1, slots 0-1) do not count.
        let keep = Tensor::new(&[[1f64, 1., 1., 1.], [0., 0., 1., 1.]], &Device::Cpu).unwrap();
        (l * &weights)
            .unwrap()
            .sum(2)
            .unwrap()
            .mul(&keep)
            .unwrap()
            .sum_all()
            .unwrap()
    };
    let grads = objective(embeds.as_tensor()).backward().unwrap();
    let analytic = grads
        .get(&embeds)
        .expect("gradient reaches the input embeddings");
    let analytic = analytic.flatten_all().unwrap().to_vec1::<f64>().unwrap();
    let base = embeds
        .as_tensor()
        .flatten_all()
        .unwrap()
        .to_vec1::<f64>()
        .unwrap();
    let shape = embeds.dims().to_vec();
    let eps = 1e-5;
    let mut checked = 0;
    for i in (0..base.len()).step_by(2) {
        let at_shift = |delta: f64| {
            let mut v = base.clone();
            v[i] += delta;
            let t = Tensor::from_vec(v, shape.as_slice(), &Device::Cpu).unwrap();
            objective(&t).to_scalar::<f64>().unwrap()
        };
        let numeric = (at_shift(eps) - at_shift(-eps)) / (2.0 * eps);
        let err = (numeric - analytic[i]).abs() / (1e-6 + numeric.abs().max(analytic[i].abs()));
        assert!(
            err < 1e-5,
            "entry {i}: numeric {numeric}, analytic {}",
            analytic[i]
        );
        checked += 1;
    }
    assert!(checked > 50);
    // Padding embeddings must get exactly zero gradient (they are masked out).
    let pad_grad: f64 = analytic[4 * 16..4 * 16 + 2 * 16]
        .iter()
        .map(|g| g.abs())
        .sum();
    assert_eq!(pad_grad, 0.0);
}

fn tiny_gguf_contents() -> (Llama, gguf::GgufContents) {
    let (model, vocab) = tiny::build(&TinySpec::default()).unwrap();
    let contents = gguf::GgufContents::of(
        &model,
        &vocab.tokens,
        &vocab.merges,
        &vocab.special,
        TINY_CHAT_TEMPLATE,
    )
    .unwrap();
    (model, contents)
}

fn load_error(path: &std::path::Path) -> String {
    match BaseModel::load(path) {
        Ok(_) => panic!("{} loaded but should not", path.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn bad_model_files_are_clear_errors() {
    let dir = tmpdir("bad");
    let (_, contents) = tiny_gguf_contents();
    let good = dir.join("good.gguf");
    contents.write(&good).unwrap();
    let bytes = std::fs::read(&good).unwrap();

    let truncated = dir.join("truncated.gguf");
    std::fs::write(&truncated, &bytes[..bytes.len() / 2]).unwrap();
    let e = load_error(&truncated);
    assert!(e.contains("truncated.gguf"), "{e}");

    let header_only = dir.join("header.gguf");
    std::fs::write(&header_only, &bytes[..40]).unwrap();
    let e = load_error(&header_only);
    assert!(
        e.contains("header.gguf") && e.contains("not a valid model file"),
        "{e}"
    );

    let not_gguf = dir.join("text.gguf");
    std::fs::write(&not_gguf, b"hello, I am not a model").unwrap();
    assert!(load_error(&not_gguf).contains("no GGUF magic"));

    let (_, mut falcon) = tiny_gguf_contents();
    falcon.metadata[0].1 = candle_core::quantized::gguf_file::Value::String("falcon".into());
    let path = dir.join("falcon.gguf");
    falcon.write(&path).unwrap();
    let e = load_error(&path);
    assert!(e.contains("unsupported architecture \"falcon\""), "{e}");

    let (_, mut no_tokens) = tiny_gguf_contents();
    no_tokens
        .metadata
        .retain(|(k, _)| k != "tokenizer.ggml.tokens");
    let path = dir.join("notokens.gguf");
    no_tokens.write(&path).unwrap();
    let e = load_error(&path);
    assert!(
        e.contains("missing metadata field \"tokenizer.ggml.tokens\""),
        "{e}"
    );

    let (_, mut no_tensor) = tiny_gguf_contents();
    no_tensor
        .tensors
        .retain(|(k, _)| k != "blk.1.ffn_up.weight");
    let path = dir.join("notensor.gguf");
    no_tensor.write(&path).unwrap();
    let e = load_error(&path);
    assert!(
        e.contains("blk.1.ffn_up.weight") && e.contains("missing"),
        "{e}"
    );

    let e = load_error(&dir.join("does-not-exist.gguf"));
    assert!(e.contains("does-not-exist.gguf"), "{e}");

    let hf_dir = dir.join("hf-missing-config");
    std::fs::create_dir_all(&hf_dir).unwrap();
    let e = load_error(&hf_dir);
    assert!(e.contains("config.json"), "{e}");
}

#[test]
fn tiny_tokenizer_round_trips_and_keeps_special_tokens_whole() {
    let (_, vocab) = tiny::build(&TinySpec::default()).unwrap();
    let tok = vocab.tokenizer().unwrap();
    let text = "<|im_start|>user\nrévérence 123 ünïcode<|im_end|>\n";
    let ids = tok.encode(text).unwrap();
    assert_eq!(ids[0], tok.token_to_id("<|im_start|>").unwrap());
    assert_eq!(tok.decode(&ids).unwrap(), text);
    assert!(tok
        .stop_ids
        .contains(&tok.token_to_id("<|im_end|>").unwrap()));
}
