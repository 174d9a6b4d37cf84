//! LoRA adapters: initialisation, our file format, PEFT interchange, AdamW.

use std::collections::BTreeMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use populora::base::fetch;
use populora::base::tiny::{self, TinySpec};
use populora::base::{self, Arch, ModelConfig, Target};
use populora::keyed_stream;
use populora::lora::{
    clip_grad_norm, export_peft, grad_norm, import_peft, names_model, peft_key, read_peft,
    shape_fingerprint, AdamW, AdamWConfig, Adapter, AdapterDir, AdapterFormat, AdapterGrads,
    BaseRef, Error, LoraConfig, ModuleKey, ADAPTER_TENSORS, PEFT_CONFIG, PEFT_TENSORS,
};
use rand::Rng;

const SEED: u64 = 20261202;

fn tiny_model() -> ModelConfig {
    ModelConfig {
        arch: Arch::Llama,
        name: "HuggingFaceTB/Tiny-Llama-Test".into(),
        vocab_size: 300,
        hidden_size: 16,
        intermediate_size: 24,
        num_layers: 2,
        num_heads: 4,
        num_kv_heads: 2,
        head_dim: 4,
        rope_theta: 10000.0,
        rms_norm_eps: 1e-5,
        max_position_embeddings: 64,
        tie_word_embeddings: true,
    }
}

fn lora_config() -> LoraConfig {
    LoraConfig {
        rank: 4,
        alpha: 8.0,
        targets: Target::ALL.to_vec(),
        use_rslora: false,
    }
}

fn random_tensor(shape: &[usize], rng: &mut impl Rng) -> Tensor {
    let n = shape.iter().product();
    let values: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    Tensor::from_vec(values, shape, &Device::Cpu).unwrap()
}

/// A fresh adapter whose B factors are then made random, so ΔW ≠ 0.
fn trained_adapter(model: &ModelConfig, config: LoraConfig, seed: u64) -> Adapter {
    let mut rng = keyed_stream!(seed, "init");
    let adapter = Adapter::new(config, model, &mut rng, &Device::Cpu).unwrap();
    let mut rng = keyed_stream!(seed, "b");
    for module in adapter.modules.values() {
        module
            .b
            .set(&random_tensor(module.b.dims(), &mut rng))
            .unwrap();
    }
    adapter
}

fn random_grads(adapter: &Adapter, seed: u64) -> AdapterGrads {
    let mut rng = keyed_stream!(seed, "grads");
    adapter
        .modules
        .iter()
        .map(|(&key, m)| {
            let d_a = random_tensor(m.a.dims(), &mut rng);
            let d_b = random_tensor(m.b.dims(), &mut rng);
            (key, (d_a, d_b))
        })
        .collect()
}

fn values(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

fn delta_ws(adapter: &Adapter) -> BTreeMap<ModuleKey, Vec<f32>> {
    adapter
        .modules
        .iter()
        .map(|(&k, m)| (k, values(&m.delta_w().unwrap())))
        .collect()
}

fn file_bytes(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (
                e.file_name().to_string_lossy().into_owned(),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect()
}

fn temp_dir(name: &str) -> std::path::PathBuf {
    let dir =
        std::env::temp_dir().join(format!("populora-lora-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

// ---------------------------------------------------------------- init

#[test]
fn fresh_adapter_has_zero_delta_and_bounded_seeded_a() {
    let model = tiny_model();
    let make = |seed| {
        Adapter::new(
            lora_config(),
            &model,
            &mut keyed_stream!(seed, "init"),
            &Device::Cpu,
        )
        .unwrap()
    };
    let adapter = make(SEED);
    assert_eq!(adapter.modules.len(), model.num_layers * Target::ALL.len());
    adapter.check_against(&model).unwrap();
    for (key, module) in &adapter.modules {
        let (fan_in, fan_out) = key.target.dims(&model);
        assert_eq!(module.a.dims(), [4, fan_in]);
        assert_eq!(module.b.dims(), [fan_out, 4]);
        assert!(values(module.b.as_tensor()).iter().all(|&x| x == 0.0));
        assert!(values(&module.delta_w().unwrap()).iter().all(|&x| x == 0.0));
        let bound = 1.0 / (fan_in as f32).sqrt();
        let a = values(module.a.as_tensor());
        assert!(
            a.iter().all(|x| x.abs() <= bound),
            "{key}: A outside ±{bound}"
        );
        // Uniform over the whole interval, not a constant or a narrow band.
        let spread =
            a.iter().cloned().fold(f32::MIN, f32::max) - a.iter().cloned().fold(f32::MAX, f32::min);
        assert!(
            spread > bound,
            "{key}: A spread {spread} too small for ±{bound}"
        );
    }
    assert_eq!(adapter.checksum().unwrap(), make(SEED).checksum().unwrap());
    assert_ne!(
        adapter.checksum().unwrap(),
        make(SEED + 1).checksum().unwrap()
    );
}

#[test]
fn shape_checks_name_the_problem() {
    let model = tiny_model();
    let adapter = trained_adapter(&model, lora_config(), SEED);
    let wider = ModelConfig {
        intermediate_size: 32,
        ..tiny_model()
    };
    assert!(matches!(
        adapter.check_against(&wider),
        Err(Error::Shape {
            module: ModuleKey {
                target: Target::Gate,
                ..
            },
            ..
        })
    ));
    let deeper = ModelConfig {
        num_layers: 3,
        ..tiny_model()
    };
    assert!(matches!(
        adapter.check_against(&deeper),
        Err(Error::LayerCount {
            expected: 3,
            found: 2
        })
    ));

    let mut missing = adapter.deep_copy().unwrap();
    missing.modules.remove(&ModuleKey {
        layer: 1,
        target: Target::V,
    });
    assert!(matches!(
        missing.check_consistent(),
        Err(Error::MissingModule(_))
    ));

    let mut wrong_rank = adapter.deep_copy().unwrap();
    let other = trained_adapter(
        &model,
        LoraConfig {
            rank: 2,
            ..lora_config()
        },
        SEED,
    );
    let key = ModuleKey {
        layer: 0,
        target: Target::Q,
    };
    wrong_rank.modules.insert(key, other.modules[&key].clone());
    assert!(matches!(
        wrong_rank.check_consistent(),
        Err(Error::Rank {
            expected: 4,
            found: 2,
            ..
        })
    ));
}

#[test]
fn deep_copy_is_independent() {
    let model = tiny_model();
    let adapter = trained_adapter(&model, lora_config(), SEED);
    let before = adapter.checksum().unwrap();
    let copy = adapter.deep_copy().unwrap();
    assert_eq!(copy.checksum().unwrap(), before);
    AdamW::new(AdamWConfig::default())
        .step(&copy, &random_grads(&copy, 1))
        .unwrap();
    assert_ne!(copy.checksum().unwrap(), before);
    assert_eq!(adapter.checksum().unwrap(), before);
}

// ---------------------------------------------------------------- our format

#[test]
fn save_load_round_trip_is_exact() {
    let model = tiny_model();
    let adapter = trained_adapter(
        &model,
        LoraConfig {
            use_rslora: true,
            ..lora_config()
        },
        SEED,
    );
    let dir = temp_dir("roundtrip");
    adapter.save(&dir, &BaseRef::of(&model)).unwrap();
    let (loaded, base) = Adapter::load(&dir, &Device::Cpu).unwrap();
    assert_eq!(base, BaseRef::of(&model));
    assert_eq!(loaded.config, adapter.config);
    assert_eq!(loaded.checksum().unwrap(), adapter.checksum().unwrap());
    for (key, module) in &adapter.modules {
        assert_eq!(
            values(loaded.modules[key].a.as_tensor()),
            values(module.a.as_tensor())
        );
        assert_eq!(
            values(loaded.modules[key].b.as_tensor()),
            values(module.b.as_tensor())
        );
    }
    Adapter::load_for(&dir, &model, &Device::Cpu).unwrap();
    let other_base = ModelConfig {
        name: "SomeOther-Model".into(),
        ..tiny_model()
    };
    assert!(matches!(
        Adapter::load_for(&dir, &other_base, &Device::Cpu),
        Err(Error::BaseMismatch { .. })
    ));
    // No temporary files are left behind.
    let names: Vec<String> = file_bytes(&dir).into_keys().collect();
    assert_eq!(names, ["adapter.json", "adapter.safetensors"]);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn corrupt_tensor_file_fails_its_checksum() {
    let model = tiny_model();
    let adapter = trained_adapter(&model, lora_config(), SEED);
    let dir = temp_dir("corrupt");
    adapter.save(&dir, &BaseRef::of(&model)).unwrap();
    let path = dir.join(ADAPTER_TENSORS);
    let mut bytes = std::fs::read(&path).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x40;
    std::fs::write(&path, bytes).unwrap();
    match Adapter::load(&dir, &Device::Cpu) {
        Err(err @ Error::ChecksumMismatch { .. }) => {
            assert!(
                err.to_string().contains(&path.display().to_string()),
                "{err}"
            );
        }
        other => panic!("expected a checksum mismatch, got {other:?}"),
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn failed_save_keeps_the_previous_adapter() {
    let model = tiny_model();
    let adapter = trained_adapter(&model, lora_config(), SEED);
    let dir = temp_dir("keep");
    adapter.save(&dir, &BaseRef::of(&model)).unwrap();
    let before = file_bytes(&dir);

    let mut broken = trained_adapter(&model, lora_config(), SEED + 1);
    broken.config.rank = 3;
    assert!(matches!(
        broken.save(&dir, &BaseRef::of(&model)),
        Err(Error::Rank {
            expected: 3,
            found: 4,
            ..
        })
    ));
    assert_eq!(file_bytes(&dir), before);
    let (loaded, _) = Adapter::load(&dir, &Device::Cpu).unwrap();
    assert_eq!(loaded.checksum().unwrap(), adapter.checksum().unwrap());
    std::fs::remove_dir_all(&dir).unwrap();
}

// ---------------------------------------------------------------- PEFT

#[test]
fn peft_export_import_gives_identical_delta_w() {
    let model = tiny_model();
    let config = LoraConfig {
        targets: vec![Target::V, Target::Q, Target::Down],
        ..lora_config()
    };
    let adapter = trained_adapter(&model, config, SEED);
    let dir = temp_dir("peft");
    export_peft(&adapter, &model.name, &dir).unwrap();

    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join(PEFT_CONFIG)).unwrap()).unwrap();
    assert_eq!(json["peft_type"], "LORA");
    assert_eq!(json["task_type"], "CAUSAL_LM");
    assert_eq!(json["r"], 4);
    assert_eq!(json["lora_alpha"], 8);
    assert_eq!(json["use_rslora"], false);
    assert_eq!(json["bias"], "none");
    assert_eq!(json["base_model_name_or_path"], model.name.as_str());
    assert_eq!(
        json["target_modules"],
        serde_json::json!(["q_proj", "v_proj", "down_proj"])
    );

    let bytes = std::fs::read(dir.join(PEFT_TENSORS)).unwrap();
    let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    assert_eq!(header.metadata().as_ref().unwrap()["format"], "pt");
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(file.len(), 2 * 3 * 2);
    let q_a = file
        .tensor("base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight")
        .unwrap();
    assert_eq!(q_a.shape(), [4, 16]);
    assert_eq!(q_a.dtype(), safetensors::Dtype::F32);
    let down_b = file
        .tensor("base_model.model.model.layers.0.mlp.down_proj.lora_B.weight")
        .unwrap();
    assert_eq!(down_b.shape(), [16, 4]);

    let imported = import_peft(&dir, &model, false, &Device::Cpu).unwrap();
    assert_eq!(imported.base_model, model.name);
    // Targets come back in canonical order; the set is what matters.
    let mut config = adapter.config.clone();
    config.targets.sort();
    assert_eq!(imported.adapter.config, config);
    assert_eq!(delta_ws(&imported.adapter), delta_ws(&adapter));
    assert_eq!(
        imported.adapter.checksum().unwrap(),
        adapter.checksum().unwrap()
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn peft_import_accepts_half_precision() {
    let model = tiny_model();
    let adapter = trained_adapter(&model, lora_config(), SEED);
    let dir = temp_dir("peft-bf16");
    export_peft(&adapter, &model.name, &dir).unwrap();
    let path = dir.join(PEFT_TENSORS);
    let halved: std::collections::HashMap<String, Tensor> =
        candle_core::safetensors::load(&path, &Device::Cpu)
            .unwrap()
            .into_iter()
            .map(|(k, t)| (k, t.to_dtype(DType::BF16).unwrap()))
            .collect();
    candle_core::safetensors::save(&halved, &path).unwrap();

    let imported = read_peft(&dir, &Device::Cpu).unwrap().adapter;
    let ours = delta_ws(&adapter);
    for (key, theirs) in delta_ws(&imported) {
        let max_err = ours[&key]
            .iter()
            .zip(&theirs)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0f32, f32::max);
        // bf16 keeps 8 bits of mantissa; |A|,|B| < 1 and rank 4 bound the error.
        assert!(max_err < 0.05, "{key}: bf16 ΔW error {max_err}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Exports a valid adapter, lets `edit` change the config JSON, and imports.
fn import_edited(name: &str, edit: impl FnOnce(&mut serde_json::Value)) -> Result<(), Error> {
    let model = tiny_model();
    let adapter = trained_adapter(&model, lora_config(), SEED);
    let dir = temp_dir(name);
    export_peft(&adapter, &model.name, &dir).unwrap();
    let path = dir.join(PEFT_CONFIG);
    let mut json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    edit(&mut json);
    std::fs::write(&path, serde_json::to_vec(&json).unwrap()).unwrap();
    let result = import_peft(&dir, &model, false, &Device::Cpu).map(|_| ());
    std::fs::remove_dir_all(&dir).unwrap();
    result
}

#[test]
fn peft_import_rejects_unknown_targets_wrong_rank_and_variants() {
    let err = import_edited("foo", |j| {
        j["target_modules"]
            .as_array_mut()
            .unwrap()
            .push("foo_proj".into())
    })
    .unwrap_err();
    assert!(
        matches!(&err, Error::UnknownTarget { name, .. } if name == "foo_proj"),
        "{err}"
    );

    let err = import_edited("rank", |j| j["r"] = 2.into()).unwrap_err();
    assert!(
        matches!(
            err,
            Error::Rank {
                expected: 2,
                found: 4,
                ..
            }
        ),
        "{err}"
    );

    let err = import_edited("dora", |j| j["use_dora"] = true.into()).unwrap_err();
    assert!(
        matches!(
            err,
            Error::UnsupportedPeftOption {
                field: "use_dora",
                ..
            }
        ),
        "{err}"
    );

    let err = import_edited("base", |j| {
        j["base_model_name_or_path"] = "Qwen/Qwen2.5-7B".into()
    })
    .unwrap_err();
    assert!(matches!(err, Error::BaseMismatch { .. }), "{err}");

    let err = import_edited("fewer", |j| {
        j["target_modules"] = serde_json::json!(["q_proj"])
    })
    .unwrap_err();
    assert!(matches!(err, Error::UnexpectedModule(_)), "{err}");
}

#[test]
fn peft_import_rejects_unknown_keys_and_other_shapes() {
    let model = tiny_model();
    let adapter = trained_adapter(&model, lora_config(), SEED);
    let dir = temp_dir("peft-keys");
    export_peft(&adapter, &model.name, &dir).unwrap();
    let path = dir.join(PEFT_TENSORS);
    let mut tensors = candle_core::safetensors::load(&path, &Device::Cpu).unwrap();
    tensors.insert(
        "base_model.model.model.layers.0.self_attn.foo_proj.lora_A.weight".into(),
        Tensor::zeros((4, 16), DType::F32, &Device::Cpu).unwrap(),
    );
    candle_core::safetensors::save(&tensors, &path).unwrap();
    let err = read_peft(&dir, &Device::Cpu).unwrap_err();
    assert!(
        matches!(&err, Error::UnknownTarget { name, .. } if name == "foo_proj"),
        "{err}"
    );

    export_peft(&adapter, &model.name, &dir).unwrap();
    let wider = ModelConfig {
        hidden_size: 32,
        head_dim: 8,
        ..tiny_model()
    };
    let err = import_peft(&dir, &wider, false, &Device::Cpu).unwrap_err();
    assert!(matches!(err, Error::Shape { .. }), "{err}");
    // The base-name check can be overridden; the shape check cannot.
    let renamed = ModelConfig {
        name: "other".into(),
        ..tiny_model()
    };
    assert!(import_peft(&dir, &renamed, false, &Device::Cpu).is_err());
    import_peft(&dir, &renamed, true, &Device::Cpu).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The CLI's path for a GGUF base: the config read from the file drives the
/// checks, and no q/k permutation is involved (the loader un-permutes the base).
#[test]
fn peft_round_trip_against_a_gguf_base() {
    let (tiny_llama, vocab) = tiny::build(&TinySpec::default()).unwrap();
    let dir = temp_dir("peft-gguf");
    let gguf_path = dir.join("tiny.gguf");
    std::fs::create_dir_all(&dir).unwrap();
    vocab.write_gguf(&gguf_path, &tiny_llama).unwrap();
    let cfg = base::read_config(&gguf_path).unwrap();
    let adapter = trained_adapter(&cfg, lora_config(), SEED);
    let peft_dir = dir.join("peft");
    export_peft(&adapter, &cfg.name, &peft_dir).unwrap();
    let imported = import_peft(&peft_dir, &cfg, false, &Device::Cpu).unwrap();
    assert_eq!(delta_ws(&imported.adapter), delta_ws(&adapter));

    let foreign = trained_adapter(&tiny_model(), lora_config(), SEED);
    export_peft(&foreign, &cfg.name, &peft_dir).unwrap();
    let err = import_peft(&peft_dir, &cfg, false, &Device::Cpu).unwrap_err();
    assert!(matches!(err, Error::Shape { .. }), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn failed_export_keeps_the_previous_files() {
    let model = tiny_model();
    let adapter = trained_adapter(&model, lora_config(), SEED);
    let dir = temp_dir("peft-keep");
    export_peft(&adapter, &model.name, &dir).unwrap();
    let before = file_bytes(&dir);
    let mut broken = trained_adapter(&model, lora_config(), SEED + 1);
    broken.modules.remove(&ModuleKey {
        layer: 0,
        target: Target::Up,
    });
    assert!(matches!(
        export_peft(&broken, &model.name, &dir),
        Err(Error::MissingModule(_))
    ));
    assert_eq!(file_bytes(&dir), before);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn peft_keys_follow_the_hf_module_tree() {
    let key = ModuleKey {
        layer: 7,
        target: Target::Gate,
    };
    assert_eq!(
        peft_key(key, "lora_B"),
        "base_model.model.model.layers.7.mlp.gate_proj.lora_B.weight"
    );
}

/// SmolLM2-135M's shape under the name its GGUF gives it.
fn smollm2_gguf_config() -> ModelConfig {
    ModelConfig {
        arch: Arch::Llama,
        name: "Smollm2 135M 8k Lc100K Mix1 Ep2".into(),
        vocab_size: 49152,
        hidden_size: 576,
        intermediate_size: 1536,
        num_layers: 30,
        num_heads: 9,
        num_kv_heads: 3,
        head_dim: 64,
        rope_theta: 100000.0,
        rms_norm_eps: 1e-5,
        max_position_embeddings: 8192,
        tie_word_embeddings: true,
    }
}

#[test]
fn the_default_model_is_known_by_its_hf_repo_id_and_its_shape() {
    let gguf = smollm2_gguf_config();
    assert_eq!(
        shape_fingerprint(&gguf),
        fetch::DEFAULT_MODEL_IDENTITY.fingerprint
    );
    let repo = "HuggingFaceTB/SmolLM2-135M-Instruct";
    assert!(names_model(repo, &gguf));
    assert!(names_model("/models/SmolLM2-135M-Instruct/", &gguf));
    assert!(names_model(&gguf.name, &gguf));
    // The base model (not Instruct) has the same shape but other weights.
    assert!(!names_model("HuggingFaceTB/SmolLM2-135M", &gguf));
    // An alias only counts for a model of the identity's shape.
    let other_shape = ModelConfig {
        num_layers: 2,
        ..smollm2_gguf_config()
    };
    assert!(!names_model(repo, &other_shape));
    // Loaded from an HF directory, the model names itself by the repo id.
    let hf = ModelConfig {
        name: repo.into(),
        ..smollm2_gguf_config()
    };
    assert!(names_model(&gguf.name, &hf));

    assert_eq!(BaseRef::of(&gguf).hf_name(), repo);
    assert_eq!(BaseRef::of(&hf).hf_name(), repo);
    assert_eq!(BaseRef::of(&other_shape).hf_name(), gguf.name);
    assert_eq!(BaseRef::of(&tiny_model()).hf_name(), tiny_model().name);
    BaseRef::named(repo).check(&gguf).unwrap();
    let err = BaseRef::named("HuggingFaceTB/SmolLM2-360M-Instruct")
        .check(&gguf)
        .unwrap_err();
    assert!(
        err.to_string().contains(repo) && err.to_string().contains("360M"),
        "{err}"
    );
}

/// `adapter_config.json` as PEFT 0.19 writes it (every field of 0.13 and
/// those added since), for the tiny model.
fn peft_019_config(model: &ModelConfig, targets: &[&str]) -> serde_json::Value {
    serde_json::json!({
        "alora_invocation_tokens": null,
        "alpha_pattern": {},
        "arrow_config": null,
        "auto_mapping": null,
        "base_model_name_or_path": model.name,
        "bias": "none",
        "corda_config": null,
        "ensure_weight_tying": false,
        "eva_config": null,
        "exclude_modules": null,
        "fan_in_fan_out": false,
        "inference_mode": true,
        "init_lora_weights": true,
        "layer_replication": null,
        "layers_pattern": null,
        "layers_to_transform": null,
        "loftq_config": {},
        "lora_alpha": 8,
        "lora_bias": false,
        "lora_dropout": 0.05,
        "lora_ga_config": null,
        "megatron_config": null,
        "megatron_core": "megatron.core",
        "modules_to_save": null,
        "peft_type": "LORA",
        "peft_version": "0.19.1",
        "qalora_group_size": 16,
        "r": 4,
        "rank_pattern": {},
        "revision": null,
        "target_modules": targets,
        "target_parameters": null,
        "task_type": "CAUSAL_LM",
        "trainable_token_indices": null,
        "use_bdlora": null,
        "use_dora": false,
        "use_qalora": false,
        "use_rslora": false
    })
}

#[test]
fn peft_import_reads_every_field_newer_peft_writes_and_refuses_variants() {
    let model = tiny_model();
    let adapter = trained_adapter(&model, lora_config(), SEED);
    let dir = temp_dir("peft-019");
    export_peft(&adapter, &model.name, &dir).unwrap();
    // PEFT lists the targets in set order.
    let targets = [
        "up_proj",
        "q_proj",
        "down_proj",
        "o_proj",
        "k_proj",
        "gate_proj",
        "v_proj",
    ];
    let write = |config: &serde_json::Value| {
        std::fs::write(
            dir.join(PEFT_CONFIG),
            serde_json::to_vec_pretty(config).unwrap(),
        )
        .unwrap()
    };
    write(&peft_019_config(&model, &targets));
    let imported = import_peft(&dir, &model, false, &Device::Cpu).unwrap();
    assert_eq!(delta_ws(&imported.adapter), delta_ws(&adapter));
    let read = AdapterDir::read(&dir, &Device::Cpu).unwrap();
    assert_eq!(read.format, AdapterFormat::Peft);
    assert_eq!(read.base, BaseRef::named(&model.name));

    let variants: [(&str, serde_json::Value); 9] = [
        ("lora_bias", true.into()),
        ("layer_replication", serde_json::json!([[0, 1], [0, 1]])),
        ("init_lora_weights", "pissa_niter_4".into()),
        ("init_lora_weights", "olora".into()),
        ("trainable_token_indices", serde_json::json!([1, 2])),
        (
            "exclude_modules",
            serde_json::json!(["layers.0.self_attn.q_proj"]),
        ),
        ("use_qalora", true.into()),
        ("alora_invocation_tokens", serde_json::json!([5])),
        ("arrow_config", serde_json::json!({ "top_k": 3 })),
    ];
    for (field, value) in variants {
        let mut config = peft_019_config(&model, &targets);
        config[field] = value.clone();
        write(&config);
        let err = import_peft(&dir, &model, false, &Device::Cpu).unwrap_err();
        assert!(
            matches!(&err, Error::UnsupportedPeftOption { field: f, .. } if *f == field),
            "{field} = {value}: {err}"
        );
    }
    // Initialisations that leave the base alone are fine once trained.
    for init in ["gaussian", "eva", "orthogonal"] {
        let mut config = peft_019_config(&model, &targets);
        config["init_lora_weights"] = init.into();
        write(&config);
        import_peft(&dir, &model, false, &Device::Cpu).unwrap();
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn an_adapter_directory_of_either_format_loads_for_its_base() {
    let model = tiny_model();
    let adapter = trained_adapter(&model, lora_config(), SEED);
    let ours = temp_dir("either-ours");
    adapter.save(&ours, &BaseRef::of(&model)).unwrap();
    let peft = temp_dir("either-peft");
    export_peft(&adapter, &model.name, &peft).unwrap();
    for (dir, format) in [
        (&ours, AdapterFormat::Populora),
        (&peft, AdapterFormat::Peft),
    ] {
        let loaded = AdapterDir::load_for(dir, &model, &Device::Cpu).unwrap();
        assert_eq!(loaded.format, format);
        assert_eq!(
            loaded.adapter.checksum().unwrap(),
            adapter.checksum().unwrap()
        );
        let renamed = ModelConfig {
            name: "another-model".into(),
            ..tiny_model()
        };
        let err = AdapterDir::load_for(dir, &renamed, &Device::Cpu).unwrap_err();
        assert!(matches!(err, Error::BaseMismatch { .. }), "{err}");
    }
    let empty = temp_dir("either-empty");
    std::fs::create_dir_all(&empty).unwrap();
    let err = AdapterDir::read(&empty, &Device::Cpu).unwrap_err();
    assert!(
        matches!(err, Error::NotAnAdapter { .. })
            && err.to_string().contains("adapter_config.json"),
        "{err}"
    );
    for dir in [ours, peft, empty] {
        std::fs::remove_dir_all(dir).unwrap();
    }
}

#[test]
fn a_members_first_adapter_and_module_norms() {
    let model = tiny_model();
    let make = |seed, member: &str| {
        Adapter::for_member(lora_config(), &model, seed, member, &Device::Cpu).unwrap()
    };
    let first = make(SEED, "teacher-0");
    let mut rng = keyed_stream!(SEED, "init", "teacher-0");
    let by_hand = Adapter::new(lora_config(), &model, &mut rng, &Device::Cpu).unwrap();
    assert_eq!(first.checksum().unwrap(), by_hand.checksum().unwrap());
    assert_ne!(
        first.checksum().unwrap(),
        make(SEED, "teacher-1").checksum().unwrap()
    );
    for module in first.modules.values() {
        let norms = module.norms().unwrap();
        assert!(
            norms.a > 0.0 && norms.b == 0.0 && norms.delta == 0.0,
            "{norms:?}"
        );
    }
    // On random factors the norms are those of the dense matrices.
    let frobenius = |t: &Tensor| {
        values(t)
            .iter()
            .map(|&x| (x as f64).powi(2))
            .sum::<f64>()
            .sqrt()
    };
    let trained = trained_adapter(&model, lora_config(), SEED);
    for (key, module) in &trained.modules {
        let norms = module.norms().unwrap();
        let dense = frobenius(&module.delta_w().unwrap());
        assert!(
            (norms.delta - dense).abs() <= 1e-5 * dense,
            "{key}: {norms:?} vs {dense}"
        );
        assert!((norms.a - frobenius(module.a.as_tensor())).abs() < 1e-9);
        assert!((norms.b - frobenius(module.b.as_tensor())).abs() < 1e-9);
    }
}

// ---------------------------------------------------------------- AdamW

/// PyTorch's AdamW on one scalar, in f64, for `grads.len()` steps.
fn reference_adamw(mut p: f64, grads: &[f64], c: &AdamWConfig) -> f64 {
    let (mut m, mut v) = (0.0, 0.0);
    for (i, &g) in grads.iter().enumerate() {
        let t = (i + 1) as i32;
        p -= c.lr * c.weight_decay * p;
        m = c.beta1 * m + (1.0 - c.beta1) * g;
        v = c.beta2 * v + (1.0 - c.beta2) * g * g;
        let m_hat = m / (1.0 - c.beta1.powi(t));
        let v_hat = v / (1.0 - c.beta2.powi(t));
        p -= c.lr * m_hat / (v_hat.sqrt() + c.eps);
    }
    p
}

#[test]
fn adamw_matches_a_hand_computed_reference() {
    let model = tiny_model();
    let adapter = trained_adapter(&model, lora_config(), SEED);
    let config = AdamWConfig {
        lr: 1e-2,
        weight_decay: 0.1,
        ..AdamWConfig::default()
    };
    let mut opt = AdamW::new(config);
    let key = ModuleKey {
        layer: 1,
        target: Target::K,
    };
    let a0 = values(adapter.modules[&key].a.as_tensor());
    let b0 = values(adapter.modules[&key].b.as_tensor());
    let g1 = random_grads(&adapter, 1);
    let g2 = random_grads(&adapter, 2);
    assert_eq!(opt.step(&adapter, &g1).unwrap().step, 1);
    let report = opt.step(&adapter, &g2).unwrap();
    assert_eq!(report.step, 2);
    let expected_norm = {
        let sum: f64 = g2
            .values()
            .flat_map(|(a, b)| values(a).into_iter().chain(values(b)))
            .map(|x| f64::from(x).powi(2))
            .sum();
        sum.sqrt()
    };
    assert!((report.grad_norm - expected_norm).abs() < 1e-9 * expected_norm);

    let a = values(adapter.modules[&key].a.as_tensor());
    let b = values(adapter.modules[&key].b.as_tensor());
    let (ga1, gb1) = (values(&g1[&key].0), values(&g1[&key].1));
    let (ga2, gb2) = (values(&g2[&key].0), values(&g2[&key].1));
    for i in [0, 5, 17, a.len() - 1] {
        let want = reference_adamw(a0[i].into(), &[ga1[i].into(), ga2[i].into()], &config);
        assert!(
            (f64::from(a[i]) - want).abs() < 1e-6,
            "A[{i}] {} vs {want}",
            a[i]
        );
    }
    for i in [0, 3, b.len() - 1] {
        let want = reference_adamw(b0[i].into(), &[gb1[i].into(), gb2[i].into()], &config);
        assert!(
            (f64::from(b[i]) - want).abs() < 1e-6,
            "B[{i}] {} vs {want}",
            b[i]
        );
    }
    // The update moved every factor.
    assert_ne!(a, a0);
    assert_ne!(b, b0);
}

#[test]
fn adamw_state_survives_save_load_and_clone() {
    let model = tiny_model();
    let adapter = trained_adapter(&model, lora_config(), SEED);
    let mut opt = AdamW::new(AdamWConfig::default());
    opt.step(&adapter, &random_grads(&adapter, 1)).unwrap();
    let dir = temp_dir("adamw");
    adapter.save(&dir, &BaseRef::of(&model)).unwrap();
    opt.save(&dir).unwrap();

    let (reloaded_adapter, _) = Adapter::load(&dir, &Device::Cpu).unwrap();
    let mut reloaded = AdamW::load(&dir, &Device::Cpu).unwrap();
    assert_eq!(reloaded.checksum().unwrap(), opt.checksum().unwrap());
    assert_eq!(reloaded.steps_taken, 1);
    let copied_adapter = adapter.deep_copy().unwrap();
    let mut copied = opt.clone();

    let next = random_grads(&adapter, 2);
    opt.step(&adapter, &next).unwrap();
    copied.step(&copied_adapter, &next).unwrap();
    reloaded.step(&reloaded_adapter, &next).unwrap();
    let want = adapter.checksum().unwrap();
    assert_eq!(copied_adapter.checksum().unwrap(), want);
    assert_eq!(reloaded_adapter.checksum().unwrap(), want);
    assert_eq!(reloaded.checksum().unwrap(), opt.checksum().unwrap());
    assert_eq!(copied.checksum().unwrap(), opt.checksum().unwrap());

    // A corrupted optimizer file is refused.
    let path = dir.join(populora::lora::OPTIMIZER_TENSORS);
    let mut bytes = std::fs::read(&path).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x01;
    std::fs::write(&path, bytes).unwrap();
    assert!(matches!(
        AdamW::load(&dir, &Device::Cpu),
        Err(Error::ChecksumMismatch { .. })
    ));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn non_finite_gradients_change_nothing() {
    let model = tiny_model();
    let adapter = trained_adapter(&model, lora_config(), SEED);
    let mut opt = AdamW::new(AdamWConfig::default());
    opt.step(&adapter, &random_grads(&adapter, 1)).unwrap();
    let (adapter_before, opt_before) = (adapter.checksum().unwrap(), opt.checksum().unwrap());

    for bad in [f32::NAN, f32::INFINITY] {
        let mut grads = random_grads(&adapter, 2);
        let key = ModuleKey {
            layer: 1,
            target: Target::Up,
        };
        let (d_a, d_b) = grads.remove(&key).unwrap();
        let mut b = values(&d_b);
        b[3] = bad;
        let d_b = Tensor::from_vec(b, d_b.dims(), &Device::Cpu).unwrap();
        grads.insert(key, (d_a, d_b));
        let err = opt.step(&adapter, &grads).unwrap_err();
        assert!(
            matches!(err, Error::NonFiniteGradient { module, factor: "lora_B", count: 1 } if module == key),
            "{err}"
        );
        let clipped_before: Vec<Vec<f32>> = grads.values().map(|(a, _)| values(a)).collect();
        assert!(matches!(
            clip_grad_norm(&mut grads, 1.0),
            Err(Error::NonFiniteGradient { .. })
        ));
        let clipped_after: Vec<Vec<f32>> = grads.values().map(|(a, _)| values(a)).collect();
        assert_eq!(clipped_before, clipped_after);
    }
    assert_eq!(adapter.checksum().unwrap(), adapter_before);
    assert_eq!(opt.checksum().unwrap(), opt_before);
    assert_eq!(opt.steps_taken, 1);
}

#[test]
fn gradients_must_cover_the_adapter() {
    let model = tiny_model();
    let adapter = trained_adapter(&model, lora_config(), SEED);
    let mut grads = random_grads(&adapter, 1);
    grads.remove(&ModuleKey {
        layer: 0,
        target: Target::O,
    });
    let mut opt = AdamW::new(AdamWConfig::default());
    assert!(matches!(
        opt.step(&adapter, &grads),
        Err(Error::GradMismatch(_))
    ));
    assert_eq!(opt.steps_taken, 0);

    // State built for one adapter is refused for an adapter of another rank.
    opt.step(&adapter, &random_grads(&adapter, 1)).unwrap();
    let narrow = trained_adapter(
        &model,
        LoraConfig {
            rank: 2,
            ..lora_config()
        },
        SEED,
    );
    assert!(matches!(
        opt.step(&narrow, &random_grads(&narrow, 1)),
        Err(Error::OptimizerMismatch(_))
    ));
}

#[test]
fn clipping_scales_to_the_max_norm() {
    let model = tiny_model();
    let adapter = trained_adapter(&model, lora_config(), SEED);
    let mut grads = random_grads(&adapter, 1);
    let norm = grad_norm(&grads).unwrap();
    assert!(norm > 1.0);
    let reported = clip_grad_norm(&mut grads, 1.0).unwrap();
    assert_eq!(reported, norm);
    let clipped = grad_norm(&grads).unwrap();
    assert!((clipped - 1.0).abs() < 1e-5, "clipped norm {clipped}");

    let before = grad_norm(&grads).unwrap();
    clip_grad_norm(&mut grads, 10.0).unwrap();
    assert_eq!(grad_norm(&grads).unwrap(), before);
}
