//! The base model against independent implementations, on tiny random models
//! that the tests write to disk themselves.

use candle_core::quantized::gguf_file;
use candle_core::{DType, Device, IndexOp, Tensor};
use candle_nn::VarBuilder;
use populora::base::blocks::BlockFormat;
use populora::base::tiny::{self, TinySpec};
use populora::base::{
    gguf, hf, Arch, BaseModel, KvCache, Llama, Logits, Message, NoLora, Positions, Target,
    WeightsSetting,
};

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
    let loaded = BaseModel::load(&path, WeightsSetting::F32).unwrap();
    assert_eq!(loaded.config(), &model.config);
    let d = max_abs_diff(&logits(&model, &TOKENS), &logits(&loaded.model, &TOKENS));
    assert!(d < 1e-5, "GGUF round trip changed logits by {d}");
    // The permutation is real: loading without undoing it would give other logits.
    let q = &model.blocks[0].q.weight.dense().unwrap();
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
    hf::write(&dir, &model, &vocab, 2).unwrap();
    let ours = BaseModel::load(&dir, WeightsSetting::F32).unwrap();
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
    let from_gguf = BaseModel::load(&gguf_path, WeightsSetting::F32).unwrap();
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
    hf::write(&dir, &model, &vocab, 1).unwrap();
    let ours = BaseModel::load(&dir, WeightsSetting::F32).unwrap();

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

fn tiny_gguf_contents() -> (Llama, gguf::GgufContents) {
    let (model, vocab) = tiny::build(&TinySpec::default()).unwrap();
    let contents = gguf::GgufContents::of(&model, &vocab).unwrap();
    (model, contents)
}

fn load_error(path: &std::path::Path) -> String {
    match BaseModel::load(path, WeightsSetting::Native) {
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
    falcon.metadata[0].1 = gguf_file::Value::String("falcon".into());
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

/// What the tiny model's own metadata says about chatting: ChatML, `<|im_end|>`.
const TINY_SYSTEM_AND_USER: &str =
    "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n";

fn system_and_user() -> [Message; 2] {
    [Message::new("system", "S"), Message::new("user", "U")]
}

#[test]
fn chat_template_and_stop_tokens_come_from_the_model_files() {
    let (model, vocab) = tiny::build(&TinySpec::default()).unwrap();
    let dir = tmpdir("chat");
    let gguf_path = dir.join("tiny.gguf");
    vocab.write_gguf(&gguf_path, &model).unwrap();
    let hf_dir = dir.join("hf");
    hf::write(&hf_dir, &model, &vocab, 1).unwrap();
    let [end_of_text, _, im_end] = [256, 257, 258];
    assert_eq!(vocab.text(im_end), "<|im_end|>");
    for tokenizer in [
        vocab.tokenizer().unwrap(),
        BaseModel::load(&gguf_path, WeightsSetting::F32)
            .unwrap()
            .tokenizer,
        BaseModel::load(&hf_dir, WeightsSetting::F32)
            .unwrap()
            .tokenizer,
    ] {
        let rendered = tokenizer.chat.render(&system_and_user()).unwrap();
        assert_eq!(rendered, TINY_SYSTEM_AND_USER);
        assert_eq!(tokenizer.stop_ids, [im_end, end_of_text]);
    }

    // Another template in the GGUF metadata is the one rendered, and the
    // file's eos is the first stop token.
    let (_, mut other) = tiny_gguf_contents();
    for (key, value) in &mut other.metadata {
        match key.as_str() {
            "tokenizer.chat_template" => {
                *value = gguf_file::Value::String(
                    "{% for m in messages %}[{{ m.role }}] {{ m.content }} {{ eos_token }}\n{% endfor %}[assistant]".into(),
                )
            }
            "tokenizer.ggml.eos_token_id" => *value = gguf_file::Value::U32(end_of_text),
            _ => {}
        }
    }
    let path = dir.join("other.gguf");
    other.write(&path).unwrap();
    let tokenizer = BaseModel::load(&path, WeightsSetting::F32)
        .unwrap()
        .tokenizer;
    assert_eq!(
        tokenizer.chat.render(&system_and_user()).unwrap(),
        "[system] S <|endoftext|>\n[user] U <|endoftext|>\n[assistant]"
    );
    assert_eq!(tokenizer.stop_ids, [end_of_text]);
}

#[test]
fn a_gguf_without_chat_template_or_eos_is_a_clear_error() {
    let dir = tmpdir("gguf-chat");
    let without = |key: &str| {
        let (_, mut contents) = tiny_gguf_contents();
        contents.metadata.retain(|(k, _)| k != key);
        let path = dir.join(format!("without-{key}.gguf"));
        contents.write(&path).unwrap();
        path
    };
    let e = load_error(&without("tokenizer.chat_template"));
    assert!(
        e.contains("without-tokenizer.chat_template.gguf: the model has no chat template")
            && e.contains("tokenizer.chat_template is missing"),
        "{e}"
    );
    let e = load_error(&without("tokenizer.ggml.eos_token_id"));
    assert!(
        e.contains("missing metadata field \"tokenizer.ggml.eos_token_id\""),
        "{e}"
    );

    let (_, mut broken) = tiny_gguf_contents();
    for (key, value) in &mut broken.metadata {
        if key == "tokenizer.chat_template" {
            *value = gguf_file::Value::String("{% for m in messages %}{{ m.content }".into());
        }
    }
    let path = dir.join("broken.gguf");
    broken.write(&path).unwrap();
    let e = load_error(&path);
    assert!(
        e.contains("broken.gguf (tokenizer.chat_template): the chat template does not compile"),
        "{e}"
    );
}

#[test]
fn hf_chat_template_and_eos_follow_transformers() {
    let (model, vocab) = tiny::build(&TinySpec::default()).unwrap();
    let dir = tmpdir("hf-chat");
    hf::write(&dir, &model, &vocab, 1).unwrap();
    let tok_config = dir.join("tokenizer_config.json");
    let write_tok_config = |json: serde_json::Value| {
        std::fs::write(&tok_config, json.to_string()).unwrap();
    };
    let render = || {
        let base = BaseModel::load(&dir, WeightsSetting::F32).unwrap();
        (
            base.tokenizer.chat.render(&system_and_user()).unwrap(),
            base.tokenizer.stop_ids,
        )
    };

    // A list of named templates: `default` is the one.
    write_tok_config(serde_json::json!({
        "chat_template": [
            {"name": "tool_use", "template": "tools"},
            {"name": "default", "template": "{{ bos_token }}{{ messages[1].content }}{{ eos_token }}"},
        ],
        "bos_token": {"content": "<|im_start|>", "special": true},
        "eos_token": "<|endoftext|>",
    }));
    let (text, stops) = render();
    assert_eq!(text, "<|im_start|>U<|endoftext|>");
    // tokenizer_config's eos first, then config.json's (`<|im_end|>`).
    assert_eq!(stops, [256, 258]);

    // chat_template.jinja wins over tokenizer_config.json.
    std::fs::write(
        dir.join("chat_template.jinja"),
        "jinja: {{ messages[0].content }}",
    )
    .unwrap();
    assert_eq!(render().0, "jinja: S");
    std::fs::remove_file(dir.join("chat_template.jinja")).unwrap();

    write_tok_config(serde_json::json!({ "eos_token": "<|im_end|>" }));
    let e = load_error(&dir);
    assert!(
        e.contains("hf-chat: the model has no chat template")
            && e.contains("chat_template in tokenizer_config.json"),
        "{e}"
    );

    write_tok_config(serde_json::json!({ "chat_template": "x", "eos_token": "<|nope|>" }));
    let e = load_error(&dir);
    assert!(
        e.contains("tokenizer_config.json") && e.contains("\"<|nope|>\" is not in tokenizer.json"),
        "{e}"
    );

    // No eos anywhere: config.json's removed too.
    write_tok_config(serde_json::json!({ "chat_template": "x" }));
    let config_path = dir.join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&config_path).unwrap()).unwrap();
    config.as_object_mut().unwrap().remove("eos_token_id");
    std::fs::write(&config_path, config.to_string()).unwrap();
    let e = load_error(&dir);
    assert!(
        e.contains("hf-chat: the model declares no end-of-sequence token"),
        "{e}"
    );
}

/// A tiny model whose every matrix has rows of whole blocks (input widths
/// multiples of 32), so it can be kept in blocks.
fn blocky_spec() -> TinySpec {
    TinySpec {
        hidden: 64,
        heads: 4,
        kv_heads: 2,
        ffn: 96,
        ..TinySpec::default()
    }
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.flatten_all()
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

/// Under `weights = "native"` each matrix of `native` is in blocks of
/// `linear` / `embedding` with exactly the values `f32` holds (q and k rows
/// un-permuted alike); both give the same logits within f32 summation
/// error, with sequences long enough for each kernel (few rows, row lanes,
/// panels).
fn assert_native_holds_the_f32_values(
    native: &Llama,
    f32: &Llama,
    linear: BlockFormat,
    embedding: BlockFormat,
) {
    for (n, f) in native.blocks.iter().zip(&f32.blocks) {
        for target in Target::ALL {
            let (n, f) = (&n.linear(target).weight, &f.linear(target).weight);
            assert_eq!(n.blocks().map(|b| b.format()), Some(linear), "{target}");
            assert!(f.blocks().is_none());
            assert_eq!(
                bits(&n.dense().unwrap()),
                bits(&f.dense().unwrap()),
                "{target}"
            );
        }
    }
    assert_eq!(native.embed.blocks().map(|b| b.format()), Some(embedding));
    assert_eq!(
        bits(&native.embed.dense().unwrap()),
        bits(&f32.embed.dense().unwrap())
    );
    assert_eq!(
        native.lm_head.same(&native.embed),
        f32.lm_head.same(&f32.embed)
    );
    for len in [7, 20, 40] {
        let tokens: Vec<u32> = (0..len).map(|i| (i * 37 + 5) % 300).collect();
        let (a, b) = (logits(native, &tokens), logits(f32, &tokens));
        let d = max_abs_diff(&a, &b);
        assert!(d < 1e-4, "{len} tokens: logits differ by {d}");
    }
}

/// A GGUF quantized as llama.cpp quantizes (Q4_1 projections, Q8_0
/// embedding; or 16-bit floats) stays in its blocks under `native`, at a
/// fraction of f32's bytes, with the values `f32` loads.
#[test]
fn a_quantized_gguf_keeps_its_blocks_with_the_values_f32_loads() {
    use candle_core::quantized::GgmlDType;
    let (model, vocab) = tiny::build(&blocky_spec()).unwrap();
    let dir = tmpdir("gguf-blocks");
    for (linear, embedding, fraction) in [
        (BlockFormat::Q4_1, BlockFormat::Q8_0, 0.3),
        (BlockFormat::F16, BlockFormat::Bf16, 0.51),
    ] {
        let path = dir.join(format!("{linear:?}.gguf"));
        gguf::GgufContents::of(&model, &vocab)
            .unwrap()
            .write_as(&path, linear.ggml(), embedding.ggml())
            .unwrap();
        let native = BaseModel::load(&path, WeightsSetting::Native).unwrap();
        let f32 = BaseModel::load(&path, WeightsSetting::F32).unwrap();
        assert_native_holds_the_f32_values(&native.model, &f32.model, linear, embedding);
        let (n, f) = (native.model.resident_bytes(), f32.model.resident_bytes());
        assert!(
            (n as f64) < fraction * f as f64,
            "{linear:?}: {n} of {f} bytes"
        );
        // Types without a kernel (here f32) load as before under `native`.
        let plain = dir.join("f32.gguf");
        gguf::GgufContents::of(&model, &vocab)
            .unwrap()
            .write_as(&plain, GgmlDType::F32, GgmlDType::F32)
            .unwrap();
        let loaded = BaseModel::load(&plain, WeightsSetting::Native).unwrap();
        assert!(loaded.model.blocks[0].q.weight.blocks().is_none());
    }
}

/// An HF checkpoint stored in bf16 keeps its matrices in bf16 under
/// `native`, the norms in f32.
#[test]
fn an_hf_checkpoint_in_bf16_stays_16_bit_under_native() {
    let (model, vocab) = tiny::build(&blocky_spec()).unwrap();
    let dir = tmpdir("hf-bf16");
    hf::write(&dir, &model.to_dtype(DType::BF16).unwrap(), &vocab, 1).unwrap();
    let native = BaseModel::load(&dir, WeightsSetting::Native).unwrap().model;
    let f32 = BaseModel::load(&dir, WeightsSetting::F32).unwrap().model;
    assert_eq!(native.final_norm.dtype(), DType::F32);
    assert_native_holds_the_f32_values(&native, &f32, BlockFormat::Bf16, BlockFormat::Bf16);
}
