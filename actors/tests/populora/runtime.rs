//! The runtime end to end on `scenarios/tiny.toml` (a random tiny model, no
//! download): determinism, replay with live commands, kill -9 + resume,
//! supervision of a panicking member, and malformed scenarios.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

use populora::run_files::Event;

use crate::common::{journal, ok, populora, wait_for};

fn scenario(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../scenarios")
        .join(name)
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("populora-runtime-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn run_to(dir: &Path, file: &Path) -> String {
    ok(populora(&[
        "run",
        file.to_str().unwrap(),
        "--out",
        dir.to_str().unwrap(),
    ])
    .output()
    .unwrap())
}

/// The `end` event's line (it holds every member's final checksum).
fn end_line(dir: &Path) -> String {
    journal(dir)
        .lines()
        .find(|l| l.contains(r#""event":"end""#))
        .unwrap_or_else(|| panic!("no end event in {}", dir.display()))
        .to_string()
}

/// One uninterrupted run of tiny.toml, shared by the tests that compare with it.
fn baseline() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = scratch("baseline");
        run_to(&dir, &scenario("tiny.toml"));
        dir
    })
}

fn ctl(dir: &Path, args: &[&str]) -> String {
    let mut all = vec!["ctl", dir.to_str().unwrap()];
    all.extend_from_slice(args);
    ok(populora(&all).output().unwrap())
}

#[test]
fn same_seed_gives_the_same_journal_and_replay_verifies_it() {
    let again = scratch("again");
    let out = run_to(&again, &scenario("tiny.toml"));
    assert!(out.contains("step 4/4"), "{out}");
    assert_eq!(journal(baseline()), journal(&again));
    for file in [
        "scenario.toml",
        "metrics.jsonl",
        "members/student-0/adapter/adapter.json",
    ] {
        assert!(again.join(file).exists(), "{file} missing");
    }
    // members/ holds exactly the final population (the end event's members).
    let mut saved: Vec<String> = std::fs::read_dir(again.join("members"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
        .collect();
    saved.sort();
    let end: serde_json::Value = serde_json::from_str(&end_line(&again)).unwrap();
    let mut alive: Vec<String> = end["checksums"]
        .as_object()
        .unwrap()
        .keys()
        .cloned()
        .collect();
    alive.sort();
    assert_eq!(saved, alive);
    let replayed = ok(populora(&["replay", again.to_str().unwrap()])
        .output()
        .unwrap());
    assert!(replayed.contains("replay matches"), "{replayed}");
    // A tampered journal is caught and the divergence named.
    let text = journal(&again);
    let first = text.find(r#""student-0":""#).unwrap() + r#""student-0":""#.len();
    let mut tampered = text.clone();
    tampered.replace_range(first..first + 4, "0000");
    std::fs::write(again.join("journal.jsonl"), tampered).unwrap();
    let out = populora(&["replay", again.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("student-0 diverged"), "{err}");
    // Evaluation of every member (HumanEval, a few tokens: plumbing, not scores).
    let table = ok(populora(&[
        "eval",
        again.to_str().unwrap(),
        "--benchmarks",
        "humaneval",
        "--limit",
        "1",
        "--max-new-tokens",
        "4",
    ])
    .output()
    .unwrap());
    assert!(
        table.contains("population mean") && table.contains("student-0"),
        "{table}"
    );
    assert!(
        again.join("eval.json").exists() && again.join("eval/samples-student-0.jsonl").exists()
    );
    // And the report renders from the run directory.
    let index = ok(populora(&["report", again.to_str().unwrap()])
        .output()
        .unwrap());
    assert!(Path::new(index.trim()).exists(), "{index}");
}

/// Evolution opens steps every + 1, 2·every + 1, ... and never follows the
/// last step, so a run ends with every member trained. tiny.toml (4 steps,
/// evolution every 2) evolves once: at the start of step 3, before that
/// step's scripted kill and inject; nothing is culled or born after step 4.
#[test]
fn evolution_opens_the_step_after_every_and_never_follows_the_last() {
    let dir = baseline();
    let events: Vec<Event> = journal(dir)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    // Culls, spawns and commands by step, in journal order.
    let kinds: Vec<(u64, &str)> = events
        .iter()
        .filter_map(|e| match e {
            Event::Cull { step, .. } => Some((*step, "cull")),
            Event::Spawn { step, .. } => Some((*step, "spawn")),
            Event::Control { step, .. } => Some((*step, "control")),
            Event::Kill { step, .. } => Some((*step, "kill")),
            _ => None,
        })
        .collect();
    let culls: Vec<u64> = kinds
        .iter()
        .filter(|(_, k)| *k == "cull")
        .map(|(s, _)| *s)
        .collect();
    assert_eq!(
        culls,
        [3, 3],
        "one teacher, one student, at step 3: {kinds:?}"
    );
    assert!(
        kinds.iter().all(|(s, _)| *s == 3),
        "evolution and the scripted events all at step 3: {kinds:?}"
    );
    // Evolution (teachers, then students), then the step's commands.
    let order: Vec<&str> = kinds.iter().map(|(_, k)| *k).collect();
    assert_eq!(
        order[..5],
        ["cull", "spawn", "cull", "spawn", "control"],
        "{kinds:?}"
    );
    // Its time counts in the step it opens.
    let metrics: Vec<serde_json::Value> = std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let evolved: Vec<u64> = metrics
        .iter()
        .filter(|m| m["phase_ms"].get("evolve").is_some())
        .map(|m| m["step"].as_u64().unwrap())
        .collect();
    assert_eq!(evolved, [3]);
    // Every member alive at the end played the last step.
    let end: serde_json::Value = serde_json::from_str(&end_line(dir)).unwrap();
    let last = metrics.iter().find(|m| m["step"] == 4).unwrap();
    let played: std::collections::BTreeSet<&str> = last["members"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["reward_mean"].is_number())
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    let alive: std::collections::BTreeSet<&str> = end["checksums"]
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    assert_eq!(played, alive, "{last}");
}

#[test]
fn live_kill_and_inject_over_the_socket_replay_bit_identically() {
    // Four students in two sub-populations, so a kill keeps cross-evaluation possible.
    let text = std::fs::read_to_string(scenario("tiny.toml"))
        .unwrap()
        .replace("students = 2 ", "students = 4 ");
    let dir = scratch("live");
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.with_extension("toml");
    std::fs::write(&file, text).unwrap();
    let mut child = populora(&[
        "run",
        file.to_str().unwrap(),
        "--out",
        dir.to_str().unwrap(),
    ])
    .stdout(Stdio::null())
    .stderr(Stdio::null())
    .spawn()
    .unwrap();
    wait_for("the control socket", Duration::from_secs(60), || {
        dir.join("control.sock").exists()
    });
    assert!(ctl(&dir, &["pause"]).contains("will pause"));
    wait_for("the pause", Duration::from_secs(120), || {
        ctl(&dir, &["status"]).contains(r#""paused": true"#)
    });
    assert!(ctl(&dir, &["kill", "student-3"]).contains("will kill student-3"));
    assert!(ctl(&dir, &["inject", "teacher", "--op", "gaussian"]).contains("will inject"));
    // Bad commands are answered with an error and change nothing.
    for bad in [
        vec!["kill", "student-99"],
        vec!["inject", "teacher", "--op", "nonsense"],
    ] {
        let mut all = vec!["ctl", dir.to_str().unwrap()];
        all.extend(bad);
        assert!(!populora(&all).output().unwrap().status.success());
    }
    ctl(&dir, &["resume"]);
    assert!(child.wait().unwrap().success());
    let text = journal(&dir);
    assert!(
        text.contains(r#""cmd":"kill","member":"student-3"},"source":"ctl","outcome":"applied""#),
        "{text}"
    );
    assert!(text.contains(
        r#""cmd":"inject","role":"teacher","op":"gaussian"},"source":"ctl","outcome":"applied""#
    ));
    let replayed = ok(populora(&["replay", dir.to_str().unwrap()])
        .output()
        .unwrap());
    assert!(replayed.contains("replay matches"), "{replayed}");
}

#[test]
fn kill_9_then_resume_ends_like_an_uninterrupted_run() {
    let dir = scratch("crash");
    let mut child: Child = populora(&[
        "run",
        scenario("tiny.toml").to_str().unwrap(),
        "--out",
        dir.to_str().unwrap(),
    ])
    .stdout(Stdio::null())
    .stderr(Stdio::null())
    .spawn()
    .unwrap();
    wait_for("the first checkpoint", Duration::from_secs(300), || {
        std::fs::read_to_string(dir.join("journal.jsonl"))
            .is_ok_and(|j| j.contains(r#""event":"checkpoint""#))
    });
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    let out = ok(populora(&["resume", dir.to_str().unwrap()])
        .output()
        .unwrap());
    assert!(out.contains("finished after 4 steps"), "{out}");
    assert_eq!(end_line(&dir), end_line(baseline()));
    // A finished run has nothing left to resume.
    let again = populora(&["resume", dir.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("nothing to resume"));
}

#[test]
fn a_member_that_panics_is_restarted_and_the_run_ends_the_same() {
    let dir = scratch("fault");
    let out = populora(&[
        "run",
        scenario("tiny.toml").to_str().unwrap(),
        "--out",
        dir.to_str().unwrap(),
    ])
    .env("POPULORA_FAULT", "student-0@2:train")
    .output()
    .unwrap();
    ok(out);
    let text = journal(&dir);
    let faults: Vec<(u64, Option<String>, String)> = text
        .lines()
        .filter_map(|line| match serde_json::from_str(line) {
            Ok(Event::Fault {
                step,
                member,
                action,
                ..
            }) => Some((step, member, action)),
            Ok(_) => None,
            Err(e) => panic!("{e}: {line}"),
        })
        .collect();
    assert_eq!(
        faults,
        [(
            2,
            Some("student-0".to_string()),
            "restarted; step retried".to_string()
        )],
        "{text}"
    );
    assert_eq!(end_line(&dir), end_line(baseline()));
}

#[test]
fn malformed_scenarios_are_refused_with_file_and_line() {
    let dir = scratch("bad");
    std::fs::create_dir_all(&dir).unwrap();
    let cases = [
        (
            "seed = 1\nsteps = 2\n[lora]\nrank = 0\n",
            "x.toml:4",
            "lora.rank",
        ),
        (
            "seed = 1\nsteps = 2\n[selfplay]\nmax_new_token = 5\n",
            "x.toml:4",
            "max_new_token",
        ),
        ("seed = \"one\"\nsteps = 2\n", "x.toml:1", "seed"),
        ("steps = 2\n", "x.toml", "seed"),
    ];
    for (text, place, key) in cases {
        let file = dir.join("x.toml");
        std::fs::write(&file, text).unwrap();
        let out = populora(&[
            "run",
            file.to_str().unwrap(),
            "--out",
            dir.join("out").to_str().unwrap(),
        ])
        .output()
        .unwrap();
        assert!(!out.status.success(), "{text}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(place) && err.contains(key), "{text}: {err}");
        assert!(
            !dir.join("out").exists(),
            "nothing is created for a bad scenario"
        );
    }
}

/// The compute a finished run had spent after `step`, from its metrics (TFLOP).
fn spent_after(dir: &Path, step: u64) -> f64 {
    let text = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
    let line: serde_json::Value = text
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .find(|l| l["step"] == step)
        .unwrap();
    line["compute_total"]["flops"].as_f64().unwrap() / 1e12
}

#[test]
fn a_compute_budget_ends_the_run_where_it_is_spent_and_replays() {
    // tiny.toml's spending after step 2 as the budget: the run ends there,
    // the boundary nearest it (after step 1, another step like the first
    // still falls short of it by more than half a step).
    let (one, two) = (spent_after(baseline(), 1), spent_after(baseline(), 2));
    assert!(one > 0.0 && 1.5 * one < two, "{one} {two}");
    let budget = two;
    let text = std::fs::read_to_string(scenario("tiny.toml"))
        .unwrap()
        .replace(
            "steps = 4 ",
            &format!("budget_tflop = {budget:e}\nsteps = 4 "),
        );
    let file = scratch("budget.toml");
    std::fs::write(&file, text).unwrap();
    let dir = scratch("budget");
    let out = run_to(&dir, &file);
    assert!(
        out.contains("finished (compute budget spent) after 2 steps"),
        "{out}"
    );
    assert!(end_line(&dir).contains(r#""step":2"#));
    ok(populora(&["replay", dir.to_str().unwrap()])
        .output()
        .unwrap());
}

#[test]
fn an_experiment_runs_matches_compute_evaluates_and_resumes() {
    let dir = scratch("experiment");
    std::fs::create_dir_all(&dir).unwrap();
    let solo = std::fs::read_to_string(scenario("tiny.toml"))
        .unwrap()
        .replace("steps = 4 ", "steps = 80 ")
        .replace(
            "mode = \"population\"\nteachers = 2                  # teacher-0 → sub-population 0, teacher-1 → 1\nstudents = 2                  # student-0 → sub-population 0, student-1 → 1\nsubpopulations = 2            # teachers are solved by students of the other sub-population\nstudents_per_teacher = 1",
            "mode = \"solo\"",
        )
        // One proposal per kind would leave the solo proposer's advantage
        // groups one rollout each (refused in solo mode).
        .replace(
            "proposals_per_teacher = 1 ",
            "proposals_per_teacher = 2 ",
        )
        .replace("enabled = true\n", "enabled = false\n");
    let solo = solo[..solo.find("[[events]]").unwrap()].to_string();
    std::fs::write(dir.join("solo.toml"), solo).unwrap();
    // Eight population steps, so that one baseline step is a small share of the budget.
    let population = std::fs::read_to_string(scenario("tiny.toml"))
        .unwrap()
        .replace("steps = 4 ", "steps = 8 ");
    std::fs::write(dir.join("population.toml"), population).unwrap();
    let file = dir.join("e.toml");
    std::fs::write(
        &file,
        "population = \"population.toml\"\nbaseline = \"solo.toml\"\n[eval]\nlimit = 2\nmax_new_tokens = 24\nbatch = 4\nbootstrap = 200\n",
    )
    .unwrap();
    let out = dir.join("out");
    let run = || {
        ok(populora(&[
            "experiment",
            file.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ])
        .output()
        .unwrap())
    };
    let first = run();
    assert!(first.contains("compute: population"), "{first}");
    let summary: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("experiment.json")).unwrap()).unwrap();
    let (p, b) = (
        summary["population"]["compute"]["flops"].as_f64().unwrap(),
        summary["baseline"]["compute"]["flops"].as_f64().unwrap(),
    );
    assert!((b - p).abs() <= 0.05 * p, "population {p}, baseline {b}");
    let benchmarks = summary["benchmarks"].as_array().unwrap();
    let names: Vec<&str> = benchmarks
        .iter()
        .map(|b| b["benchmark"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        ["humaneval", "humaneval-io-output", "humaneval-io-input"]
    );
    for b in benchmarks {
        assert_eq!(b["members"].as_array().unwrap().len(), 4, "{b}");
        assert!(
            b["mean_minus_baseline"]["resamples"].as_u64() == Some(200),
            "{b}"
        );
        assert!(b["base_model"].is_number(), "{b}");
    }
    let page = std::fs::read_to_string(out.join("report/index.html")).unwrap();
    assert!(
        page.contains("mean − baseline") && page.contains("../population/report/solve_rate.svg")
    );
    assert!(out.join("population/report/index.html").exists());
    // Every answer is on record, for every row.
    let items = std::fs::read_to_string(out.join("eval/items.jsonl")).unwrap();
    assert_eq!(items.lines().count(), 3 * 2 * (4 + 1 + 1));
    assert!(
        items.contains(r#""member":"base model""#)
            && items.contains(r#""member":"baseline/solo-0""#)
    );
    // Run again: every stage is done, nothing is redone, the result is the same.
    let before = std::fs::read(out.join("experiment.json")).unwrap();
    let journal_before = journal(&out.join("baseline"));
    run();
    assert_eq!(std::fs::read(out.join("experiment.json")).unwrap(), before);
    assert_eq!(journal(&out.join("baseline")), journal_before);
    // An interrupted evaluation is redone; the comparison comes out the same.
    std::fs::remove_file(out.join("eval/items.jsonl")).unwrap();
    run();
    assert_eq!(std::fs::read(out.join("experiment.json")).unwrap(), before);
    // One interrupted in HumanEval's third batch of four answers keeps the
    // first two (marked here) and answers the rest as before.
    std::fs::remove_file(out.join("eval/items.jsonl")).unwrap();
    let humaneval: Vec<&str> = items
        .lines()
        .filter(|l| l.contains(r#""benchmark":"humaneval""#))
        .collect();
    let marked = humaneval[0].replacen(r#""response":""#, r#""response":"KEPT "#, 1);
    let progress = [marked.as_str()]
        .into_iter()
        .chain(humaneval[1..10].iter().copied())
        .collect::<Vec<_>>()
        .join("\n")
        + "\n{\"benchmark\":\"hum";
    std::fs::write(out.join("eval/progress-humaneval.jsonl"), progress).unwrap();
    run();
    assert_eq!(std::fs::read(out.join("experiment.json")).unwrap(), before);
    let resumed = std::fs::read_to_string(out.join("eval/items.jsonl")).unwrap();
    assert_eq!(resumed, items.replacen(humaneval[0], &marked, 1));
    assert!(!out.join("eval/progress-humaneval.jsonl").exists());
    // A file that differs in its comments only continues the experiment;
    // one with other settings is refused in the same directory.
    let text = std::fs::read_to_string(&file).unwrap();
    std::fs::write(&file, format!("# commented\n{text}")).unwrap();
    run();
    assert_eq!(std::fs::read(out.join("experiment.json")).unwrap(), before);
    let other = dir.join("other.toml");
    std::fs::write(&other, text.replace("bootstrap = 200", "bootstrap = 300")).unwrap();
    let refused = populora(&[
        "experiment",
        other.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ])
    .output()
    .unwrap();
    assert!(!refused.status.success());
    assert!(String::from_utf8_lossy(&refused.stderr).contains("holds another experiment"));
}

/// A copy of the baseline run as if it had crashed just after its last
/// checkpoint: its journal up to the step-4 checkpoint event, no end event.
fn crashed_copy(name: &str) -> PathBuf {
    let dir = scratch(name);
    let copied = Command::new("cp")
        .args(["-a", baseline().to_str().unwrap(), dir.to_str().unwrap()])
        .status()
        .unwrap();
    assert!(copied.success());
    let text = journal(&dir);
    let kept: Vec<&str> = text
        .lines()
        .filter(|l| !l.contains(r#""event":"end""#))
        .collect();
    std::fs::write(dir.join("journal.jsonl"), kept.join("\n") + "\n").unwrap();
    dir
}

/// A run that crashed just after its last checkpoint (step 4) whose newest
/// checkpoint then lost a byte of an optimizer file: resume skips it (moved
/// aside, journaled with the reason), resumes from step 2, runs steps 3 and 4
/// again and ends exactly as the uninterrupted run.
#[test]
fn a_corrupt_newest_checkpoint_is_skipped_and_the_run_resumes_from_the_previous_one() {
    let dir = crashed_copy("corrupt");
    let newest = dir.join("checkpoints/step-000004");
    let member = std::fs::read_dir(newest.join("members"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .min()
        .unwrap();
    let optimizer = member.join("optimizer/optimizer.safetensors");
    let mut bytes = std::fs::read(&optimizer).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x40;
    std::fs::write(&optimizer, bytes).unwrap();

    let out = populora(&["resume", dir.to_str().unwrap()])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let stdout = ok(out);
    assert!(stdout.contains("finished after 4 steps"), "{stdout}");
    assert!(
        stderr.contains("checkpoint of step 4 skipped") && stderr.contains("from step 2"),
        "{stderr}"
    );
    let skipped = journal(&dir)
        .lines()
        .find(|l| l.contains(r#""event":"checkpoint_skipped""#))
        .unwrap_or_else(|| panic!("no checkpoint_skipped event:\n{}", journal(&dir)))
        .to_string();
    assert!(
        skipped.contains(r#""step":4"#)
            && skipped.contains("optimizer.safetensors")
            && skipped.contains("checksum mismatch")
            && skipped.contains("checkpoints/skipped-step-000004"),
        "{skipped}"
    );
    assert!(dir.join("checkpoints/skipped-step-000004").is_dir());
    assert!(
        newest.join("league.json").is_file(),
        "step 4 is checkpointed again"
    );
    assert_eq!(end_line(&dir), end_line(baseline()));
    // The skip sits where the step-2 checkpoint left the journal, before the rerun steps.
    let text = journal(&dir);
    let events: Vec<&str> = text.lines().collect();
    let at = |what: &str| events.iter().position(|l| l.contains(what)).unwrap();
    assert!(at("checkpoint_skipped") < at(r#""event":"step","step":3"#));
}

/// When no checkpoint loads, resume refuses and lists why for each.
#[test]
fn resume_without_a_loadable_checkpoint_names_every_reason() {
    let dir = crashed_copy("all-corrupt");
    for step in ["step-000002", "step-000004"] {
        std::fs::write(dir.join("checkpoints").join(step).join("league.json"), "{").unwrap();
    }
    let out = populora(&["resume", dir.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("no checkpoint") && err.contains("step 4:") && err.contains("step 2:"),
        "{err}"
    );
    assert!(
        dir.join("checkpoints/step-000004").is_dir(),
        "nothing is moved when the run cannot resume"
    );
}

/// tiny.toml without evolution and scripted events: the members and the
/// matching stay fixed, so the same steps can be run in-process.
fn fixed_population_scenario(dir: &Path) -> (PathBuf, String) {
    let text = std::fs::read_to_string(scenario("tiny.toml")).unwrap();
    let text = text.split("[[events]]").next().unwrap();
    assert!(text.contains("enabled = true"));
    let text = text.replace("enabled = true", "enabled = false");
    std::fs::create_dir_all(dir).unwrap();
    let file = dir.join("fixed.toml");
    std::fs::write(&file, &text).unwrap();
    (file, text)
}

#[test]
fn the_runtime_and_the_in_process_step_give_the_same_checksums() {
    use populora::base::tiny;
    use populora::lora::{AdamW, Adapter};
    use populora::scenario::{check_operator, Scenario};
    use populora::selfplay::{
        run_step, Grammars, Learner, MemberId, Roster, Settings, StepContext,
    };
    use populora::task::TaskBuffers;
    use populora::verify::VerifierPool;
    use std::collections::BTreeMap;

    let dir = scratch("two-ways");
    let (file, text) = fixed_population_scenario(&dir);
    let out = dir.join("run");
    run_to(&out, &file);
    let from_runtime: Vec<serde_json::Value> = journal(&out)
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|e| e["event"] == "step")
        .map(|e| e["checksums"].clone())
        .collect();

    let s = Scenario::parse(&text, "fixed.toml", check_operator).unwrap();
    let (model, vocab) = tiny::build(&s.model.tiny.clone().unwrap().spec()).unwrap();
    let tokenizer = vocab.tokenizer().unwrap();
    let settings = Settings::from_scenario(&s);
    let grammars = Grammars::compile(&tokenizer, model.config.vocab_size, &settings).unwrap();
    let pool = VerifierPool::new(s.sandbox_config()).unwrap();
    let names = s.member_ids();
    assert_eq!(names, ["teacher-0", "teacher-1", "student-0", "student-1"]);
    let mut learners: BTreeMap<MemberId, Learner> = BTreeMap::new();
    for (id, name) in names.iter().enumerate() {
        let adapter = Adapter::for_member(
            s.adapter_config(),
            &model.config,
            s.seed,
            name,
            &candle_core::Device::Cpu,
        )
        .unwrap();
        let optimizer = AdamW::new(s.adamw_config());
        learners.insert(id as MemberId, Learner { adapter, optimizer });
    }
    // One student per sub-population, one per teacher, from the other one.
    let roster = Roster {
        proposers: vec![0, 1],
        matches: BTreeMap::from([(0, vec![3]), (1, vec![2])]),
        solvers: vec![2, 3],
    };
    let mut buffers = TaskBuffers::seeded();
    let mut in_process = Vec::new();
    for step in 1..=s.steps {
        let ctx = StepContext {
            seed: s.seed,
            step,
            settings: &settings,
            tokenizer: &tokenizer,
            grammars: &grammars,
        };
        run_step(&ctx, &model, &pool, &mut learners, &roster, &mut buffers).unwrap();
        let sums: BTreeMap<&str, String> = learners
            .iter()
            .map(|(&id, l)| (names[id as usize].as_str(), l.adapter.checksum().unwrap()))
            .collect();
        in_process.push(serde_json::to_value(sums).unwrap());
    }
    assert_eq!(from_runtime.len(), s.steps as usize);
    assert_eq!(in_process, from_runtime);
}
