//! Adapters as files on the default model (SmolLM2-135M-Instruct, fetched
//! into the cache on first use; these tests fail loudly without it): a
//! member exported for PEFT and read back as PEFT reads it, and a PEFT
//! directory exactly as PEFT writes it for SmolLM2 imported and generated
//! with, without any override flag.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::process::Command;

use populora::base::fetch::DEFAULT_MODEL;
use rand::{Rng, SeedableRng};
use safetensors::{Dtype, SafeTensors};

const REPO_ID: &str = "HuggingFaceTB/SmolLM2-135M-Instruct";
const LAYERS: usize = 30;

/// The default model, fetched if missing (a failure is a test failure).
fn ensure_model() {
    DEFAULT_MODEL
        .ensure(&mut |m| eprintln!("{m}"))
        .unwrap_or_else(|e| panic!("the real SmolLM2 model is required for this test: {e}"));
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("populora-adapters-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Run `populora`; stdout on success, a panic with both streams otherwise.
fn populora(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_populora"))
        .args(args)
        .output()
        .unwrap();
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    assert!(
        out.status.success(),
        "populora {args:?} failed:\n{}\n{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    text(&out.stdout)
}

fn path(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// `(in, out)` of each SmolLM2 projection.
fn dims(target: &str) -> (usize, usize) {
    match target {
        "q_proj" | "o_proj" => (576, 576),
        "k_proj" | "v_proj" => (576, 192),
        "gate_proj" | "up_proj" => (576, 1536),
        "down_proj" => (1536, 576),
        other => panic!("{other}"),
    }
}

fn parent(target: &str) -> &'static str {
    if ["gate_proj", "up_proj", "down_proj"].contains(&target) {
        "mlp"
    } else {
        "self_attn"
    }
}

/// Every key PEFT expects for `targets` and rank `r`, with its shape.
fn peft_keys(targets: &[&str], r: usize) -> BTreeMap<String, Vec<usize>> {
    let mut keys = BTreeMap::new();
    for layer in 0..LAYERS {
        for &t in targets {
            let (fan_in, fan_out) = dims(t);
            let stem = format!("base_model.model.model.layers.{layer}.{}.{t}", parent(t));
            keys.insert(format!("{stem}.lora_A.weight"), vec![r, fan_in]);
            keys.insert(format!("{stem}.lora_B.weight"), vec![fan_out, r]);
        }
    }
    keys
}

/// Every key of a safetensors file with its dtype and shape.
type Shapes = BTreeMap<String, (Dtype, Vec<usize>)>;

/// The safetensors file as PEFT's loader sees it: metadata, then every key
/// with its dtype and shape.
fn read_back(file: &Path) -> (HashMap<String, String>, Shapes) {
    let bytes = std::fs::read(file).unwrap();
    let (_, header) = SafeTensors::read_metadata(&bytes).unwrap();
    let metadata = header.metadata().clone().unwrap_or_default();
    let tensors = SafeTensors::deserialize(&bytes).unwrap();
    let shapes = tensors
        .tensors()
        .into_iter()
        .map(|(key, view)| (key, (view.dtype(), view.shape().to_vec())))
        .collect();
    (metadata, shapes)
}

#[test]
fn an_exported_member_is_a_peft_lora_for_the_hf_repo_id() {
    ensure_model();
    let dir = scratch("export");
    let member = dir.join("members/teacher-0/adapter");
    // Exactly the adapter member teacher-0 of a run seeded 42 starts with.
    populora(&[
        "adapter",
        "new",
        "--seed",
        "42",
        "--member",
        "teacher-0",
        "--rank",
        "8",
        "--alpha",
        "16",
        "--targets",
        "q,v",
        "--out",
        path(&member),
    ]);
    let peft = dir.join("peft");
    let said = populora(&["export", "--adapter", path(&member), "--peft", path(&peft)]);
    assert!(said.contains(REPO_ID), "{said}");

    let (metadata, shapes) = read_back(&peft.join("adapter_model.safetensors"));
    assert_eq!(metadata.get("format").map(String::as_str), Some("pt"));
    let expected = peft_keys(&["q_proj", "v_proj"], 8);
    assert_eq!(shapes.len(), expected.len());
    for (key, shape) in &expected {
        let (dtype, found) = &shapes[key];
        assert_eq!((dtype, found), (&Dtype::F32, shape), "{key}");
    }

    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(peft.join("adapter_config.json")).unwrap()).unwrap();
    assert_eq!(
        config,
        serde_json::json!({
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": REPO_ID,
            "r": 8,
            "lora_alpha": 16,
            "use_rslora": false,
            "target_modules": ["q_proj", "v_proj"],
            "lora_dropout": 0.0,
            "bias": "none",
            "fan_in_fan_out": false,
            "inference_mode": true,
            "modules_to_save": null,
            "init_lora_weights": true,
            "layers_to_transform": null,
            "layers_pattern": null,
            "rank_pattern": {},
            "alpha_pattern": {},
            "use_dora": false,
            "revision": null,
        })
    );
    // --base-name still overrides.
    let renamed = dir.join("renamed");
    populora(&[
        "export",
        "--adapter",
        path(&member),
        "--peft",
        path(&renamed),
        "--base-name",
        "me/mine",
    ]);
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(renamed.join("adapter_config.json")).unwrap())
            .unwrap();
    assert_eq!(config["base_model_name_or_path"], "me/mine");

    // And it comes back without --allow-other-base, bit for bit.
    let back = dir.join("back");
    populora(&["import-peft", path(&peft), "--out", path(&back)]);
    let checksum = |dir: &Path| {
        let info: serde_json::Value =
            serde_json::from_str(&populora(&["adapter", "info", path(dir), "--json"])).unwrap();
        info["checksum"].as_str().unwrap().to_string()
    };
    assert_eq!(checksum(&back), checksum(&member));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `adapter_config.json` byte for byte as PEFT 0.13.2's `save_pretrained`
/// writes it for a q/v LoRA on SmolLM2-135M-Instruct
/// (`json.dumps(config, indent=2, sort_keys=True)`, no final newline;
/// `target_modules` in set order).
const PEFT_0_13_CONFIG: &str = r#"{
  "alpha_pattern": {},
  "auto_mapping": null,
  "base_model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct",
  "bias": "none",
  "fan_in_fan_out": false,
  "inference_mode": true,
  "init_lora_weights": true,
  "layer_replication": null,
  "layers_pattern": null,
  "layers_to_transform": null,
  "loftq_config": {},
  "lora_alpha": 32,
  "lora_dropout": 0.05,
  "megatron_config": null,
  "megatron_core": "megatron.core",
  "modules_to_save": null,
  "peft_type": "LORA",
  "r": 16,
  "rank_pattern": {},
  "revision": null,
  "target_modules": [
    "v_proj",
    "q_proj"
  ],
  "task_type": "CAUSAL_LM",
  "use_dora": false,
  "use_rslora": false
}"#;

/// A trained-looking PEFT LoRA for SmolLM2: random A and B (F32, as PEFT
/// keeps adapter weights), keys in PEFT's naming, metadata `format: pt`.
fn write_peft_weights(file: &Path) -> BTreeMap<String, Vec<u8>> {
    let mut rng = rand_chacha::ChaCha12Rng::seed_from_u64(13);
    let mut data = BTreeMap::new();
    let shapes = peft_keys(&["q_proj", "v_proj"], 16);
    for (key, shape) in &shapes {
        let bytes: Vec<u8> = (0..shape.iter().product::<usize>())
            .flat_map(|_| rng.random_range(-0.02f32..0.02).to_le_bytes())
            .collect();
        data.insert(key.clone(), bytes);
    }
    let views: Vec<(String, safetensors::tensor::TensorView)> = shapes
        .iter()
        .map(|(key, shape)| {
            let view = safetensors::tensor::TensorView::new(Dtype::F32, shape.clone(), &data[key])
                .unwrap();
            (key.clone(), view)
        })
        .collect();
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    std::fs::write(file, safetensors::serialize(views, Some(metadata)).unwrap()).unwrap();
    data
}

#[test]
fn a_peft_lora_for_smollm2_imports_and_generates_without_overrides() {
    ensure_model();
    let dir = scratch("import");
    let peft = dir.join("peft");
    std::fs::create_dir_all(&peft).unwrap();
    std::fs::write(peft.join("adapter_config.json"), PEFT_0_13_CONFIG).unwrap();
    let written = write_peft_weights(&peft.join("adapter_model.safetensors"));

    let ours = dir.join("ours");
    populora(&["import-peft", path(&peft), "--out", path(&ours)]);
    // The factors are copied unchanged (keys ours: layers.N.q_proj.lora_A).
    let bytes = std::fs::read(ours.join("adapter.safetensors")).unwrap();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    for (key, data) in &written {
        let short = key
            .trim_start_matches("base_model.model.model.")
            .replace(".self_attn", "")
            .trim_end_matches(".weight")
            .to_string();
        assert_eq!(file.tensor(&short).unwrap().data(), &data[..], "{short}");
    }
    let info: serde_json::Value =
        serde_json::from_str(&populora(&["adapter", "info", path(&ours), "--json"])).unwrap();
    assert_eq!(info["rank"], 16);
    assert_eq!(info["scale"], 2.0);
    assert_eq!(info["targets"], serde_json::json!(["q_proj", "v_proj"]));
    assert_eq!(info["base"]["hf_name"], REPO_ID);

    // The PEFT directory itself is an adapter for generate, equal to its import.
    let generate = |adapter: &Path| {
        let out = populora(&[
            "generate",
            "Name a prime number.",
            "--max-new-tokens",
            "6",
            "--json",
            "--logits-top",
            "3",
            "--adapter",
            path(adapter),
        ]);
        let mut value: serde_json::Value = serde_json::from_str(&out).unwrap();
        value[0]["adapter"] = serde_json::Value::Null;
        value
    };
    let from_peft = generate(&peft);
    assert_eq!(from_peft, generate(&ours));
    assert_eq!(
        from_peft[0]["tokens"][0]["top"].as_array().unwrap().len(),
        3
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
