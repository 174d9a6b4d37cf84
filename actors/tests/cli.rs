//! The `populora` binary end to end on a tiny GGUF model the test writes.

use std::path::{Path, PathBuf};
use std::process::Command;

use populora::base::tiny::{self, TinySpec};

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
