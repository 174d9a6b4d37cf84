//! The `populora` binary end to end on a tiny GGUF model the test writes:
//! generate (with adapters of both formats), eval's task selection and its
//! agreement with generate, and adapter new/info.

use std::path::{Path, PathBuf};
use std::process::Command;

use populora::base::fetch;
use populora::base::tiny::{self, TinySpec};
use populora::base::Target;
use populora::eval::humaneval;
use populora::lora::{shape_fingerprint, Adapter, LoraConfig};
use rand::{Rng, SeedableRng};

fn tiny_gguf(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("populora-cli-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("tiny.gguf");
    let (model, vocab) = tiny::build(&TinySpec::default()).unwrap();
    vocab.write_gguf(&path, &model).unwrap();
    path
}

fn populora(args: &[&str], model: &Path) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_populora"))
        .args(args)
        .arg("--model")
        .arg(model)
        .output()
        .unwrap();
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (out.status.success(), text(&out.stdout), text(&out.stderr))
}

#[test]
fn generate_is_reproducible_from_its_seed() {
    let model = tiny_gguf("seed");
    let run = |seed: &str| {
        let (ok, out, err) = populora(
            &[
                "generate",
                "hello",
                "--temperature",
                "1.0",
                "--seed",
                seed,
                "--max-new-tokens",
                "24",
            ],
            &model,
        );
        assert!(ok, "{err}");
        out
    };
    assert_eq!(run("7"), run("7"));
    assert_ne!(run("7"), run("8"));
    let (ok, greedy_a, _) = populora(
        &["generate", "--raw", "abc", "--max-new-tokens", "8"],
        &model,
    );
    let (_, greedy_b, _) = populora(
        &[
            "generate",
            "--raw",
            "abc",
            "--greedy",
            "--max-new-tokens",
            "8",
        ],
        &model,
    );
    assert!(ok);
    assert_eq!(greedy_a, greedy_b, "greedy is the default");
}

#[test]
fn info_prints_the_config_and_bad_models_are_clear_errors() {
    let model = tiny_gguf("info");
    let (ok, out, err) = populora(&["info"], &model);
    assert!(ok, "{err}");
    assert!(
        out.contains("\"hidden_size\": 32") && out.contains("cache:"),
        "{out}"
    );

    let broken = model.with_file_name("broken.gguf");
    std::fs::write(&broken, b"GGUF\x03\x00\x00\x00garbage").unwrap();
    let (ok, _, err) = populora(&["generate", "hi"], &broken);
    assert!(!ok);
    assert!(
        err.contains("broken.gguf") && err.starts_with("error:"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
}

/// A bench on a GPU in a build without CUDA, or on a device that is no
/// device, stops at once with an error that says so (no model is loaded).
#[test]
fn bench_devices_are_checked_before_anything_loads() {
    for (device, says) in [
        ("cuda", "this build has no CUDA support"),
        ("gpu0", "\"gpu0\" is not a device"),
    ] {
        if cfg!(feature = "cuda") && device == "cuda" {
            continue;
        }
        for bench in ["generate", "broker"] {
            let (ok, _, err) =
                populora_raw(&["bench", bench, "--random-weights", "--device", device]);
            assert!(
                !ok && err.contains(says) && err.starts_with("error:"),
                "{bench} {device}: {err}"
            );
        }
    }
}

/// `bench verifier` on a few programs: the sandbox and both fresh-interpreter
/// baselines (`python3 -I -S -c`, `python3 -c`) compute the same outputs;
/// `--sandbox-only` leaves the baselines out.
#[test]
fn bench_verifier_measures_the_sandbox_against_both_spawn_baselines() {
    let measure = |extra: &[&str]| -> serde_json::Value {
        let mut args = vec!["bench", "verifier", "--programs", "16", "--json"];
        args.extend_from_slice(extra);
        serde_json::from_str(ok(&args).trim()).unwrap()
    };
    let value = measure(&[]);
    assert_eq!(value["outputs_agree"], true, "{value}");
    for key in [
        "sandboxed_per_s",
        "spawn_bare_per_s",
        "spawn_plain_per_s",
        "over_spawn_bare",
        "over_spawn_plain",
    ] {
        assert!(
            value[key].as_f64().is_some_and(|v| v > 0.0),
            "{key}: {value}"
        );
    }
    assert_eq!(value["spawn_bare"], "python3 -I -S -c RUNNER", "{value}");
    let alone = measure(&["--sandbox-only"]);
    assert!(alone["sandboxed_per_s"].as_f64().is_some_and(|v| v > 0.0));
    assert!(alone.get("spawn_bare_per_s").is_none(), "{alone}");
}

/// Run `populora` with `args` as given (no --model appended).
fn populora_raw(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_populora"))
        .args(args)
        .output()
        .unwrap();
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (out.status.success(), text(&out.stdout), text(&out.stderr))
}

fn ok(args: &[&str]) -> String {
    let (ok, out, err) = populora_raw(args);
    assert!(ok, "populora {args:?} failed:\n{out}\n{err}");
    out
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// A two-step population run on a tiny GGUF (room for HumanEval prompts),
/// shared by the tests that evaluate it: (run dir, model file).
fn tiny_run() -> &'static (PathBuf, PathBuf) {
    static RUN: std::sync::OnceLock<(PathBuf, PathBuf)> = std::sync::OnceLock::new();
    RUN.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("populora-cli-{}-run", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let model = dir.join("tiny.gguf");
        let spec = TinySpec {
            max_positions: 2048,
            ..TinySpec::default()
        };
        let (weights, vocab) = tiny::build(&spec).unwrap();
        vocab.write_gguf(&model, &weights).unwrap();
        let tiny = std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../scenarios/tiny.toml"),
        )
        .unwrap();
        let start = tiny.find("[model.tiny]").unwrap();
        let end = tiny.find("[lora]").unwrap();
        let mut scenario = format!("{}{}", &tiny[..start], &tiny[end..]);
        scenario = scenario[..scenario.find("[[events]]").unwrap()].to_string();
        scenario = scenario
            .replace("source = \"tiny\"", &format!("source = {:?}", s(&model)))
            .replace("steps = 4 ", "steps = 2 ")
            .replace("enabled = true", "enabled = false");
        let file = dir.join("scenario.toml");
        std::fs::write(&file, scenario).unwrap();
        let run = dir.join("run");
        ok(&["run", s(&file), "--out", s(&run)]);
        (run, model)
    })
}

/// A copy of the shared run for one test (eval writes into the run directory).
fn own_run(name: &str) -> (PathBuf, PathBuf) {
    let (run, model) = tiny_run();
    let copy = run.with_file_name(format!("run-{name}"));
    let _ = std::fs::remove_dir_all(&copy);
    let status = Command::new("cp")
        .args(["-a", s(run), s(&copy)])
        .status()
        .unwrap();
    assert!(status.success());
    (copy, model.clone())
}

/// The run's members, sorted (the order `eval` gives them).
fn members(run: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(run.join("members"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

fn items(run: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(run.join("eval/items.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// Give the adapter in `dir` seeded random B factors, so that it surely
/// moves the model: two steps on the tiny model can leave every B at zero.
fn perturb(dir: &Path) {
    let (adapter, base) = Adapter::load(dir, &candle_core::Device::Cpu).unwrap();
    let mut rng = rand_chacha::ChaCha12Rng::seed_from_u64(5);
    for module in adapter.modules.values() {
        let b = module.b.as_tensor();
        let values: Vec<f32> = (0..b.elem_count())
            .map(|_| rng.random_range(-0.5f32..0.5))
            .collect();
        let random = candle_core::Tensor::from_vec(values, b.dims(), b.device()).unwrap();
        module.b.set(&random).unwrap();
    }
    adapter.save(dir, &base).unwrap();
}

/// The acceptance check: `generate --adapter` with every member, on the
/// prompt `eval` gives HumanEval/0, answers what `eval` recorded for each
/// (greedy; one batch of the same rows in both).
#[test]
fn generate_with_members_answers_what_eval_recorded() {
    let (run, model) = &own_run("generate");
    let first = members(run)[0].clone();
    perturb(&run.join("members").join(&first).join("adapter"));
    ok(&[
        "eval",
        s(run),
        "--benchmarks",
        "humaneval",
        "--limit",
        "1",
        "--max-new-tokens",
        "16",
    ]);
    let recorded = items(run);
    let names = members(run);
    assert_eq!(recorded.len(), names.len());
    let problems = humaneval::load(&fetch::HUMAN_EVAL.ensure(&mut |_| {}).unwrap()).unwrap();
    let prompt = humaneval::prompt(&problems[0]);
    let adapters: Vec<PathBuf> = names
        .iter()
        .map(|n| run.join("members").join(n).join("adapter"))
        .collect();
    let mut args = vec![
        "generate",
        &prompt.user,
        "--system",
        &prompt.system,
        "--model",
        s(model),
        "--max-new-tokens",
        "16",
        "--json",
        "--logits-top",
        "2",
    ];
    for a in &adapters {
        args.extend(["--adapter", s(a)]);
    }
    let outputs: serde_json::Value = serde_json::from_str(&ok(&args)).unwrap();
    for (i, name) in names.iter().enumerate() {
        let record = recorded
            .iter()
            .find(|r| r["member"] == name.as_str())
            .unwrap();
        assert_eq!(record["task_id"], "HumanEval/0");
        let out = &outputs[i];
        assert_eq!(out["adapter"], s(&adapters[i]));
        assert_eq!(out["text"], record["response"], "{name}");
        // Greedy: every token is the best of its top two.
        for token in out["tokens"].as_array().unwrap() {
            assert_eq!(token["top"][0]["id"], token["id"], "{token}");
            assert_eq!(token["top"][0]["logprob"], token["logprob"], "{token}");
        }
    }
    // The adapters are applied: the base model's log-probs differ from those
    // of the perturbed first member.
    let base: serde_json::Value =
        serde_json::from_str(&ok(&args[..args.len() - 2 * adapters.len()])).unwrap();
    assert_eq!(base[0]["adapter"], serde_json::Value::Null);
    assert_ne!(
        base[0]["tokens"][0]["top"], outputs[0]["tokens"][0]["top"],
        "the perturbed member should move the log-probs"
    );
    // One member alone answers as it did in the batch (and in eval).
    let alone: serde_json::Value = serde_json::from_str(&ok(&[
        "generate",
        &prompt.user,
        "--system",
        &prompt.system,
        "--model",
        s(model),
        "--max-new-tokens",
        "16",
        "--json",
        "--adapter",
        s(&adapters[0]),
    ]))
    .unwrap();
    assert_eq!(alone[0]["text"], outputs[0]["text"]);
}

#[test]
fn eval_selects_tasks_by_id_and_names_unknown_ones() {
    let (run, _) = &own_run("tasks");
    let eval = |extra: &[&str]| {
        let mut args = vec![
            "eval",
            s(run),
            "--benchmarks",
            "humaneval",
            "--max-new-tokens",
            "2",
        ];
        args.extend_from_slice(extra);
        populora_raw(&args)
    };
    let (good, _, err) = eval(&["--tasks", "HumanEval/7,HumanEval/3"]);
    assert!(good, "{err}");
    let selected: Vec<(String, u64)> = items(run)
        .iter()
        .map(|r| {
            (
                r["task_id"].as_str().unwrap().to_string(),
                r["item"].as_u64().unwrap(),
            )
        })
        .collect();
    let n = members(run).len();
    assert_eq!(selected.len(), 2 * n);
    assert!(selected
        .iter()
        .all(|t| *t == ("HumanEval/3".into(), 3) || *t == ("HumanEval/7".into(), 7)));

    let list = run.join("tasks.txt");
    std::fs::write(&list, "# the first two\nHumanEval/0\n\nHumanEval/1\n").unwrap();
    let (good, _, err) = eval(&["--tasks-from", s(&list), "--limit", "1"]);
    assert!(good, "{err}");
    let ids: Vec<String> = items(run)
        .iter()
        .map(|r| r["task_id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(
        ids,
        vec!["HumanEval/0".to_string(); n],
        "--limit after --tasks-from"
    );

    let (good, _, err) = eval(&["--tasks", "HumanEval/3,HumanEval/999,nope"]);
    assert!(!good);
    assert!(
        err.contains("unknown task id") && err.contains("HumanEval/999") && err.contains("nope"),
        "{err}"
    );
    assert!(
        !err.contains("HumanEval/3,") && !err.contains("panicked"),
        "{err}"
    );
}

#[test]
fn adapter_new_is_a_members_first_adapter_and_info_describes_it() {
    let (run, model) = tiny_run();
    let dir = run.parent().unwrap().join("new");
    let _ = std::fs::remove_dir_all(&dir);
    let fresh = dir.join("teacher-0");
    let said = ok(&[
        "adapter",
        "new",
        "--seed",
        "7",
        "--member",
        "teacher-0",
        "--rank",
        "4",
        "--alpha",
        "8",
        "--model",
        s(model),
        "--out",
        s(&fresh),
    ]);
    let cfg = populora::base::read_config(model).unwrap();
    let config = LoraConfig {
        rank: 4,
        alpha: 8.0,
        targets: Target::ALL.to_vec(),
        use_rslora: false,
    };
    let expected = Adapter::for_member(config, &cfg, 7, "teacher-0", &candle_core::Device::Cpu)
        .unwrap()
        .checksum()
        .unwrap();
    assert!(said.contains(&expected), "{said}");

    let info: serde_json::Value =
        serde_json::from_str(&ok(&["adapter", "info", s(&fresh), "--json"])).unwrap();
    assert_eq!(info["format"], "populora");
    assert_eq!(info["checksum"], expected.as_str());
    assert_eq!(
        (info["rank"].as_u64(), info["alpha"].as_f64()),
        (Some(4), Some(8.0))
    );
    assert_eq!(info["layers"], 2);
    assert_eq!(info["base"]["name"], cfg.name.as_str());
    assert_eq!(
        info["base"]["fingerprint"],
        shape_fingerprint(&cfg).as_str()
    );
    let modules = info["modules"].as_array().unwrap();
    assert_eq!(modules.len(), 2 * 7);
    assert!(modules
        .iter()
        .all(|m| m["b"] == 0.0 && m["a"].as_f64().unwrap() > 0.0));
    let text = ok(&["adapter", "info", s(&fresh)]);
    assert!(
        text.contains("layers.1.down_proj") && text.contains(&expected),
        "{text}"
    );

    // B is zero: the fresh adapter generates exactly what the base does.
    let generate = |adapter: Option<&Path>| {
        let mut args = vec![
            "generate",
            "hi",
            "--model",
            s(model),
            "--max-new-tokens",
            "8",
            "--json",
        ];
        if let Some(a) = adapter {
            args.extend(["--adapter", s(a)]);
        }
        let mut v: serde_json::Value = serde_json::from_str(&ok(&args)).unwrap();
        v[0]["adapter"] = serde_json::Value::Null;
        v
    };
    assert_eq!(generate(Some(&fresh)), generate(None));

    // Mistakes are errors that say what is wrong.
    let (good, _, err) = populora_raw(&[
        "adapter",
        "new",
        "--seed",
        "1",
        "--targets",
        "q,nope",
        "--model",
        s(model),
        "--out",
        s(&dir.join("x")),
    ]);
    assert!(!good && err.contains("unknown target `nope`"), "{err}");
    let (good, _, err) = populora_raw(&[
        "adapter",
        "new",
        "--seed",
        "1",
        "--rank",
        "0",
        "--model",
        s(model),
        "--out",
        s(&dir.join("x")),
    ]);
    assert!(!good && err.contains("rank must be at least 1"), "{err}");
    let (good, _, err) = populora_raw(&[
        "adapter",
        "new",
        "--seed",
        "7",
        "--model",
        s(model),
        "--out",
        s(&fresh),
    ]);
    assert!(!good && err.contains("--force"), "{err}");
    let (good, _, err) = populora_raw(&["adapter", "info", s(&dir)]);
    assert!(!good && err.contains("adapter_config.json"), "{err}");
}

#[test]
fn generate_takes_peft_directories_and_labels_several_adapters() {
    let (run, model) = tiny_run();
    let names = members(run);
    let member = run.join("members").join(&names[0]).join("adapter");
    let peft = run.parent().unwrap().join("peft-0");
    let _ = std::fs::remove_dir_all(&peft);
    ok(&["export", "--adapter", s(&member), "--peft", s(&peft)]);
    let generate = |adapters: &[&Path]| {
        let mut args = vec![
            "generate",
            "hello",
            "--model",
            s(model),
            "--max-new-tokens",
            "12",
        ];
        for a in adapters {
            args.extend(["--adapter", s(a)]);
        }
        ok(&args)
    };
    // Alone, each is one unlabelled reply; the PEFT copy answers the same.
    let ours = generate(&[&member]);
    assert_eq!(generate(&[&peft]), ours);
    assert!(!ours.contains("==="));
    let both = generate(&[&member, &peft]);
    assert!(
        both.starts_with(&format!("=== {} ===\n", s(&member)))
            && both.contains(&format!("\n=== {} ===\n", s(&peft))),
        "{both}"
    );
    // An adapter for another base is refused, naming both.
    let other = run.parent().unwrap().join("other.gguf");
    let (weights, vocab) = tiny::build(&TinySpec {
        hidden: 64,
        ..TinySpec::default()
    })
    .unwrap();
    vocab.write_gguf(&other, &weights).unwrap();
    let (good, _, err) = populora_raw(&[
        "generate",
        "hi",
        "--model",
        s(&other),
        "--adapter",
        s(&member),
    ]);
    assert!(!good && err.contains(s(&member)), "{err}");
    let (good, _, err) =
        populora_raw(&["generate", "hi", "--model", s(model), "--logits-top", "3"]);
    assert!(!good && err.contains("--json"), "{err}");
}
