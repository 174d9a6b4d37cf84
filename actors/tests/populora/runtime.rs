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
        "members/student-2/adapter/adapter.json",
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
        table.contains("population mean") && table.contains("student-2"),
        "{table}"
    );
    assert!(
        again.join("eval.json").exists() && again.join("eval/samples-student-2.jsonl").exists()
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

/// A compute mark is chosen after the fact: where a step costs more than
/// the one before, a target just short of halfway into it is nearer the
/// boundary before it, which a guess from the last step's cost passed by
/// (issue 39's seed 2 marked step 41 at +2.5 % instead of step 40 at
/// −1.5 %). The mark lands on that boundary, with its checkpoint, and a
/// budget at the same place ends the run at the boundary past it, its mark
/// again on the nearer one.
#[test]
fn a_compute_mark_is_the_step_boundary_nearest_its_target() {
    let spent: Vec<f64> = (1..=4).map(|s| spent_after(baseline(), s)).collect();
    let cost = |s: usize| spent[s - 1] - if s > 1 { spent[s - 2] } else { 0.0 };
    // A step s whose successor costs more, so that spent(s) + cost(s)/2
    // falls short of a target 0.49 of the way into step s + 1.
    let s = (1..4)
        .find(|&s| 0.49 * cost(s + 1) > cost(s) / 2.0)
        .unwrap_or_else(|| panic!("no step followed by a costlier one: {spent:?}"));
    let target = spent[s - 1] + 0.49 * cost(s + 1);
    let text = std::fs::read_to_string(scenario("tiny.toml")).unwrap();
    for (name, setting) in [
        ("mark", format!("at_tflop = [{target:e}]\n")),
        ("markbudget", String::new()),
    ] {
        let mut scenario_text = text.replace("[checkpoint]\n", &format!("[checkpoint]\n{setting}"));
        if setting.is_empty() {
            scenario_text = scenario_text.replace(
                "steps = 4 ",
                &format!("budget_tflop = {target:e}\nsteps = 4 "),
            );
        }
        let file = scratch(&format!("{name}.toml"));
        std::fs::write(&file, scenario_text).unwrap();
        let dir = scratch(name);
        run_to(&dir, &file);
        let events = journal(&dir);
        let mark = events
            .lines()
            .find(|l| l.contains(r#""event":"compute_mark""#))
            .unwrap_or_else(|| panic!("{name}: no compute mark:\n{events}"));
        assert!(mark.contains(&format!(r#""step":{s},"#)), "{name}: {mark}");
        assert!(
            dir.join(format!("checkpoints/step-{s:06}/members"))
                .is_dir(),
            "{name}: no checkpoint at the mark"
        );
        if setting.is_empty() {
            // The budget ends the run at the first boundary past it.
            assert!(
                end_line(&dir).contains(&format!(r#""step":{}"#, s + 1)),
                "{name}"
            );
        }
    }
}

/// The experiment's files on tiny.toml: a solo copy (two proposals per
/// kind, so its proposer's advantage groups hold two rollouts) and a
/// forty-two-step population, both with a seeding stage; two seeds.
fn experiment_files(dir: &Path) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let seeding = "[seeding]\nentries = 3\nbatch = 6\n\n[verifier]";
    // No buffer problems beside the matched ones: with them a solo step
    // costs about two population steps of this tiny scenario, and the
    // per-adapter mark (ten population steps' worth) would fall between
    // baseline steps further than 5 %.
    let tiny = std::fs::read_to_string(scenario("tiny.toml"))
        .unwrap()
        .replace("[verifier]", seeding)
        .replace(
            "induction_shown = 1\n",
            "induction_shown = 1\nbuffer_problems = 0\n",
        );
    let solo = tiny
        .replace("steps = 4 ", "steps = 400 ")
        .replace(
            "mode = \"population\"\nteachers = 2                  # teacher-0 → sub-population 0, teacher-1 → 1\nstudents = 2                  # student-0 → sub-population 0, student-1 → 1\nsubpopulations = 2            # teachers are solved by students of the other sub-population\nstudents_per_teacher = 1",
            "mode = \"solo\"",
        )
        // One proposal per kind would leave the solo proposer's advantage
        // groups one rollout each (refused in solo mode).
        .replace("proposals_per_teacher = 1 ", "proposals_per_teacher = 2 ")
        .replace("enabled = true\n", "enabled = false\n");
    let solo = solo[..solo.find("[[events]]").unwrap()].to_string();
    std::fs::write(dir.join("solo.toml"), solo).unwrap();
    // Forty-two population steps: one member's share of them is about nine
    // baseline steps (a baseline step costs about what a population step
    // does), where the compute mark lands within 5 % of it in both seeds
    // (+0.9 % and -3.4 %; at forty steps seed 7's lands +8.2 % past it).
    let population = tiny.replace("steps = 4 ", "steps = 42 ");
    std::fs::write(dir.join("population.toml"), population).unwrap();
    let file = dir.join("e.toml");
    std::fs::write(
        &file,
        "population = \"population.toml\"\nbaseline = \"solo.toml\"\nseeds = [7, 8]\n[eval]\nproblems = 4\nmax_new_tokens = 24\nbatch = 4\nbootstrap = 200\nselection = 0.5\n",
    )
    .unwrap();
    file
}

/// `experiment.json` without its wall times (a run or evaluation done again
/// takes another time, with the same results).
fn results(out: &Path) -> serde_json::Value {
    fn strip(v: &mut serde_json::Value) {
        match v {
            serde_json::Value::Object(map) => {
                map.remove("wall_s");
                map.values_mut().for_each(strip);
            }
            serde_json::Value::Array(items) => items.iter_mut().for_each(strip),
            _ => {}
        }
    }
    let text = std::fs::read_to_string(out.join("experiment.json")).unwrap();
    let mut value = serde_json::from_str(&text).unwrap();
    strip(&mut value);
    value
}

/// The whole protocol at small size: a seeding stage per seed shared by both
/// arms, the baseline matched two ways (its end on the population's total,
/// its compute mark on one member's share), two seeds pooled with the
/// seeds × problems bootstrap, and every stage continued after an
/// interruption with the same result.
#[test]
fn an_experiment_seeds_runs_matches_evaluates_pools_and_resumes() {
    let dir = scratch("experiment");
    let file = experiment_files(&dir);
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
    assert!(first.contains("seed 7: compute: population"), "{first}");
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("experiment.json")).unwrap())
            .unwrap();
    // Seeding: one stage per seed, both arms started from it.
    for seed in [7, 8] {
        let seed_dir = out.join(format!("seed-{seed}"));
        let stage = std::fs::read(seed_dir.join("seeding.json")).unwrap();
        for arm in ["population", "baseline"] {
            assert_eq!(
                std::fs::read(seed_dir.join(arm).join("seeding.json")).unwrap(),
                stage,
                "seed {seed} {arm}"
            );
            assert!(journal(&seed_dir.join(arm)).contains(r#""event":"seeding""#));
        }
    }
    // Matching: the baseline's end on the whole population's compute, its
    // mark on one member's share, both within 5 %.
    let seeds = summary["seeds"].as_array().unwrap();
    assert_eq!(seeds.len(), 2);
    for s in seeds {
        let p = s["population"]["compute"]["flops"].as_f64().unwrap();
        // The whole-population row: the nearer of the baseline's last step
        // (the first past the budget) and the one before it.
        let total = &s["total_mark"];
        let (total_step, end) = (
            total["step"].as_u64().unwrap(),
            s["baseline"]["steps"].as_u64().unwrap(),
        );
        assert!(total_step == end || total_step + 1 == end, "{total} {end}");
        assert!((total["target_tflop"].as_f64().unwrap() * 1e12 - p).abs() <= 1e-6 * p);
        assert!(s["baseline"]["compute"]["flops"].as_f64().unwrap() >= p);
        for mark in [&s["mark"], total] {
            let target = mark["target_tflop"].as_f64().unwrap();
            let spent = mark["spent_tflop"].as_f64().unwrap();
            assert!((spent - target).abs() <= 0.05 * target, "{mark}");
        }
        let target = s["mark"]["target_tflop"].as_f64().unwrap();
        assert!((target * 4.0 * 1e12 - p).abs() <= 1e-6 * p, "{}", s["mark"]);
        assert!(s["seeding"]["compute"]["flops"].as_f64().unwrap() > 0.0);
        // What each arm trained on, up to its evaluated step.
        let trained = &s["trained"];
        assert_eq!(trained["population"]["steps"], 42);
        assert!(trained["population"]["adapters"].as_u64().unwrap() >= 4);
        assert_eq!(trained["baseline_per_adapter"]["steps"], s["mark"]["step"]);
        assert_eq!(trained["baseline_total"]["steps"], total["step"]);
        for arm in ["population", "baseline_per_adapter", "baseline_total"] {
            let t = &trained[arm];
            let (all, nonzero) = (
                t["rollouts"].as_u64().unwrap(),
                t["nonzero_rollouts"].as_u64().unwrap(),
            );
            assert!(all > 0 && nonzero <= all, "{arm}: {t}");
            assert!(t["optimizer_steps"].as_u64().unwrap() > 0, "{arm}: {t}");
            assert!(
                t["buffer_rollouts"].as_u64().unwrap() <= t["solver_rollouts"].as_u64().unwrap()
            );
        }
    }
    // The arms' settings as the experiment started, recorded.
    for arm in ["population", "baseline"] {
        assert_eq!(summary["scenarios"][arm].as_str().unwrap().len(), 64);
    }
    // Statistics: every benchmark under both matchings, a row per seed,
    // five pooled differences with the seeds × problems bootstrap.
    let comparisons = summary["comparisons"].as_array().unwrap();
    let keys: Vec<(String, String)> = comparisons
        .iter()
        .map(|c| (c["benchmark"].to_string(), c["matching"].to_string()))
        .collect();
    assert_eq!(keys.len(), 6, "{keys:?}");
    for c in comparisons {
        assert_eq!(c["per_seed"].as_array().unwrap().len(), 2, "{c}");
        assert_eq!(c["distinct_seed_draws"], 3);
        let differences = c["differences"].as_array().unwrap();
        assert_eq!(differences.len(), 5, "{c}");
        assert!(differences
            .iter()
            .all(|d| d["difference"]["resamples"].as_u64() == Some(200)));
    }
    let mut problems: Vec<&str> = Vec::new();
    let items = std::fs::read_to_string(out.join("eval/items.jsonl")).unwrap();
    for line in items.lines() {
        let id = line.split(r#""task_id":""#).nth(1).unwrap();
        let id = &id[..id.find('"').unwrap()];
        if !problems.contains(&id) {
            problems.push(id);
        }
    }
    let selected = summary["selection"].as_array().unwrap().len();
    let reported = summary["report_problems"].as_u64().unwrap() as usize;
    assert!(selected >= 1 && reported >= 1 && selected + reported == problems.len());
    let page = std::fs::read_to_string(out.join("report/index.html")).unwrap();
    assert!(
        page.contains("Baseline matched per adapter")
            && page.contains("../seed-7/population/report/solve_rate.svg"),
    );
    // Every answer is on record, for every row: 2 seeds × (4 members, the
    // baseline at its mark and at its end), and the base model once.
    let rows = 2 * (4 + 1 + 1) + 1;
    assert_eq!(items.lines().count() % rows, 0);
    let humaneval = items
        .lines()
        .filter(|l| l.contains(r#""benchmark":"humaneval""#));
    assert_eq!(humaneval.count(), 4 * rows);
    assert_eq!(summary["subset"].as_array().unwrap().len(), 4);
    for row in [
        "base model",
        "seed-8/baseline/solo-0",
        "seed-8/baseline-per-adapter/solo-0",
    ] {
        assert!(items.contains(&format!(r#""member":"{row}""#)), "{row}");
    }
    for seed in [7, 8] {
        let mut members: Vec<&str> = items
            .lines()
            .filter_map(|l| l.split(r#""member":""#).nth(1))
            .map(|m| &m[..m.find('"').unwrap()])
            .filter(|m| m.starts_with(&format!("seed-{seed}/")) && !m.contains("baseline"))
            .collect();
        members.sort_unstable();
        members.dedup();
        assert_eq!(members.len(), 4, "{members:?}");
    }
    // Run again: every stage is done, nothing is redone, the result is the same.
    let before = results(&out);
    let journal_before = journal(&out.join("seed-8/baseline"));
    run();
    assert_eq!(results(&out), before);
    assert_eq!(journal(&out.join("seed-8/baseline")), journal_before);
    // A baseline that crashed just after its mark's checkpoint resumes and
    // ends as it did; an evaluation cut short is redone with the same answers.
    let lines: Vec<&str> = journal_before.lines().collect();
    let mark_at = lines
        .iter()
        .position(|l| l.contains(r#""event":"compute_mark""#))
        .expect("a compute mark");
    assert!(lines[mark_at + 1].contains(r#""event":"checkpoint""#));
    let crashed = lines[..mark_at + 2].join("\n") + "\n";
    std::fs::write(out.join("seed-8/baseline/journal.jsonl"), crashed).unwrap();
    // The checkpoint of the step that crossed the mark (the mark itself may
    // name the boundary before it, checkpointed then).
    let mark_step: u64 = lines[mark_at + 1]
        .split(r#""step":"#)
        .nth(1)
        .unwrap()
        .split(|c: char| !c.is_ascii_digit())
        .next()
        .unwrap()
        .parse()
        .unwrap();
    for entry in std::fs::read_dir(out.join("seed-8/baseline/checkpoints")).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        let step: u64 = name.trim_start_matches("step-").parse().unwrap();
        if step > mark_step {
            std::fs::remove_dir_all(&path).unwrap();
        }
    }
    std::fs::remove_file(out.join("eval/items.jsonl")).unwrap();
    run();
    let end = |text: &str| text.lines().last().unwrap().to_string();
    assert_eq!(
        end(&journal(&out.join("seed-8/baseline"))),
        end(&journal_before)
    );
    assert_eq!(results(&out), before);
    // A file that differs in its comments only continues the experiment;
    // one with other settings is refused in the same directory.
    let text = std::fs::read_to_string(&file).unwrap();
    std::fs::write(&file, format!("# commented\n{text}")).unwrap();
    run();
    assert_eq!(results(&out), before);
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
    // A scenario edited between pieces is refused, naming what changed.
    let refused_with = |out: &Path| {
        let refused = populora(&[
            "experiment",
            file.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ])
        .output()
        .unwrap();
        assert!(!refused.status.success());
        String::from_utf8_lossy(&refused.stderr).into_owned()
    };
    for arm in ["population.toml", "solo.toml"] {
        let original = std::fs::read_to_string(dir.join(arm)).unwrap();
        let edited = original.replace("[verifier]\n", "[verifier]\nmemory_mb = 384\n");
        assert_ne!(edited, original, "{arm}");
        std::fs::write(dir.join(arm), &edited).unwrap();
    }
    let err = refused_with(&out);
    assert!(
        err.contains("not the one this experiment started with")
            && err.contains("verifier.memory_mb"),
        "{err}"
    );
    for arm in ["population.toml", "solo.toml"] {
        let edited = std::fs::read_to_string(dir.join(arm)).unwrap();
        std::fs::write(dir.join(arm), edited.replace("memory_mb = 384\n", "")).unwrap();
    }
    assert_eq!(results(&out), before);
    // A population that ended before its steps (a `ctl stop`) is no
    // finished run: refused, naming it.
    let pop_journal = out.join("seed-7/population/journal.jsonl");
    let text = std::fs::read_to_string(&pop_journal).unwrap();
    std::fs::write(
        &pop_journal,
        text.replace(r#"{"event":"end","step":42"#, r#"{"event":"end","step":41"#),
    )
    .unwrap();
    let err = refused_with(&out);
    assert!(err.contains("ended at step 41 of its 42 steps"), "{err}");
    std::fs::write(&pop_journal, text).unwrap();
}

/// `matching = ["per_adapter"]`: the baseline's budget is one member's share,
/// so it stops at that mark (not at the whole population's compute), and
/// only the per-adapter row is evaluated and compared.
#[test]
fn a_per_adapter_experiment_stops_the_baseline_at_its_mark() {
    let dir = scratch("experiment-per-adapter");
    let file = experiment_files(&dir);
    let text = std::fs::read_to_string(&file).unwrap().replace(
        "seeds = [7, 8]\n",
        "seeds = [7]\nmatching = [\"per_adapter\"]\n",
    );
    std::fs::write(&file, text).unwrap();
    let out = dir.join("out");
    let printed = ok(populora(&[
        "experiment",
        file.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ])
    .output()
    .unwrap());
    assert!(
        printed.contains("baseline matched per adapter"),
        "{printed}"
    );
    assert!(!printed.contains("whole population"), "{printed}");
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("experiment.json")).unwrap())
            .unwrap();
    let s = &summary["seeds"][0];
    let p = s["population"]["compute"]["flops"].as_f64().unwrap();
    let (mark, end) = (&s["mark"], s["baseline"]["steps"].as_u64().unwrap());
    let mark_step = mark["step"].as_u64().unwrap();
    assert!(mark_step == end || mark_step + 1 == end, "{mark} {end}");
    let spent = s["baseline"]["compute"]["flops"].as_f64().unwrap();
    assert!(
        spent < p / 2.0,
        "the baseline ran past its mark: {spent} of {p}"
    );
    let (target, at) = (
        mark["target_tflop"].as_f64().unwrap(),
        mark["spent_tflop"].as_f64().unwrap(),
    );
    assert!((target * 4.0 * 1e12 - p).abs() <= 1e-6 * p, "{mark}");
    assert!((at - target).abs() <= 0.05 * target, "{mark}");
    assert!(s["total_mark"].is_null() && s["trained"]["baseline_total"].is_null());
    assert_eq!(s["trained"]["baseline_per_adapter"]["steps"], mark["step"]);
    let comparisons = summary["comparisons"].as_array().unwrap();
    // HumanEval, HumanEval-IO's output and input items: one matching each.
    assert_eq!(comparisons.len(), 3, "{comparisons:?}");
    assert!(comparisons.iter().all(|c| c["matching"] == "per_adapter"));
    let items = std::fs::read_to_string(out.join("eval/items.jsonl")).unwrap();
    assert!(items.contains(r#""member":"seed-7/baseline-per-adapter/solo-0""#));
    assert!(!items.contains(r#""member":"seed-7/baseline/solo-0""#));
    std::fs::remove_dir_all(&dir).unwrap();
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

/// A scripted kill passes the live command's checks: killing one of two
/// teachers that propose once per kind would leave each pooled proposer
/// advantage group one rollout, so it is journaled as refused and the
/// teacher lives on.
#[test]
fn a_scripted_kill_leaving_one_teacher_with_one_proposal_per_kind_is_refused() {
    let dir = scratch("scripted-kill");
    let (_, text) = fixed_population_scenario(&dir);
    assert!(text.contains("proposals_per_teacher = 1 "));
    let text =
        text.replace("steps = 4 ", "steps = 1 ") + "[[events]]\nat = 1\nkill = \"teacher-0\"\n";
    let file = dir.join("kill.toml");
    std::fs::write(&file, text).unwrap();
    let out = dir.join("run");
    run_to(&out, &file);
    let journal = journal(&out);
    assert!(
        journal.contains(
            r#""source":"scenario","outcome":"refused: killing `teacher-0` would leave 1 teacher with selfplay.proposals_per_teacher = 1"#
        ),
        "{journal}"
    );
    assert!(!journal.contains(r#""event":"kill""#), "{journal}");
    assert!(end_line(&out).contains(r#""teacher-0":"#));
}

/// `[model] weights`: a run on a GGUF kept in its blocks (a tiny model
/// quantized as the default GGUF is: Q4_1 projections, Q8_0 embedding)
/// records `weights = "native"` and replays bit for bit; and a recorded
/// scenario without the key, as runs older than it have, replays as f32.
/// (The two runs' bits are not compared: on rows this short both settings
/// may sum in the same order.)
#[test]
fn native_weights_replay_and_older_scenarios_replay_in_f32() {
    use populora::base::blocks::BlockFormat;
    use populora::base::{gguf, tiny};
    let models = scratch("native-gguf");
    std::fs::create_dir_all(&models).unwrap();
    let spec = tiny::TinySpec {
        hidden: 64,
        heads: 4,
        kv_heads: 2,
        ffn: 96,
        max_positions: 1536,
        ..tiny::TinySpec::default()
    };
    let (model, vocab) = tiny::build(&spec).unwrap();
    let path = models.join("tiny-q4_1.gguf");
    gguf::GgufContents::of(&model, &vocab)
        .unwrap()
        .write_as(&path, BlockFormat::Q4_1.ggml(), BlockFormat::Q8_0.ggml())
        .unwrap();
    let text = std::fs::read_to_string(scenario("tiny.toml")).unwrap();
    let (head, rest) = text.split_once("[model]").unwrap();
    let (_, tail) = rest.split_once("[lora]").unwrap();
    let run = |weights: &str| {
        let file = models.join(format!("{weights}.toml"));
        let model = format!(
            "[model]\nsource = {:?}\nweights = {weights:?}\n\n",
            path.display().to_string()
        );
        std::fs::write(&file, format!("{head}{model}[lora]{tail}")).unwrap();
        let dir = scratch(&format!("weights-{weights}"));
        let out = populora(&[
            "run",
            file.to_str().unwrap(),
            "--out",
            dir.to_str().unwrap(),
        ])
        .output()
        .unwrap();
        let log = crate::common::text(&out.stderr);
        ok(out);
        // The load says how the weights are held: the two settings differ
        // there even where the tiny model's bits come out the same.
        let line = log
            .lines()
            .find(|l| l.starts_with(&format!("base weights: {weights}, ")))
            .unwrap_or_else(|| panic!("{weights}: no load line in\n{log}"));
        let bytes = line.rsplit('(').next().unwrap().trim_end_matches(" bytes)");
        (dir, bytes.parse::<usize>().unwrap())
    };
    let ((native, native_bytes), (f32, f32_bytes)) = (run("native"), run("f32"));
    assert!(
        native_bytes < f32_bytes / 2,
        "{native_bytes} against {f32_bytes} bytes"
    );
    let recorded = std::fs::read_to_string(native.join("scenario.toml")).unwrap();
    assert!(recorded.contains("weights = \"native\""), "{recorded}");
    let replay = |dir: &Path| {
        ok(populora(&["replay", dir.to_str().unwrap()])
            .output()
            .unwrap())
    };
    assert!(replay(&native).contains("replay matches"));
    // Without the key, as a run recorded before it existed.
    let scenario_file = f32.join("scenario.toml");
    let older: String = std::fs::read_to_string(&scenario_file)
        .unwrap()
        .lines()
        .filter(|l| !l.starts_with("weights ="))
        .map(|l| format!("{l}\n"))
        .collect();
    std::fs::write(&scenario_file, older).unwrap();
    assert!(replay(&f32).contains("replay matches"));
}
