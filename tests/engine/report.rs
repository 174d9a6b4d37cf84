//! Integration tests of `populora::report`: a synthetic 20-step run (in the
//! runtime's line format, `populora::run_files`) with spawns, culls, a kill
//! and a fault; incomplete runs; corrupt and truncated lines; empty inputs.
//!
//! Set `POPULORA_REPORT_DEMO=DIR` to keep the synthetic run (and its report)
//! in DIR, e.g. for `scripts/check-report.sh`.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};

use populora::report::{self, ReportError, INDEX, PLOTS};
use serde_json::{json, Value};

const STEPS: u64 = 20;

/// A fresh, empty directory under the system temp dir.
fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("populora-report-{name}-{}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).expect("create temp dir");
    dir
}

fn jsonl(values: &[Value]) -> String {
    values.iter().map(|v| format!("{v}\n")).collect()
}

/// (step, member that leaves, member that is born) after that step.
type Change = (u64, &'static str, Option<(&'static str, &'static str)>);

/// Members alive at the start of `step`, given the synthetic run's events.
fn alive_at(step: u64) -> Vec<(&'static str, &'static str)> {
    let mut alive = vec![
        ("teacher-0", "teacher"),
        ("teacher-1", "teacher"),
        ("student-0", "student"),
        ("student-1", "student"),
        ("student-2", "student"),
        ("student-3", "student"),
    ];
    let changes: [Change; 5] = [
        (3, "student-1", None),                            // killed by control
        (5, "student-3", Some(("student-4", "student"))),  // cull + spawn
        (10, "teacher-1", Some(("teacher-2", "teacher"))), // cull + spawn
        (10, "student-2", Some(("student-5", "student"))), // cull + spawn
        (15, "student-4", Some(("student-6", "student"))), // cull + spawn
    ];
    for (at, gone, born) in changes {
        if step > at {
            alive.retain(|(id, _)| *id != gone);
            alive.extend(born);
        }
    }
    alive
}

fn step_metrics(step: u64) -> Value {
    let s = step as f64;
    let members: Vec<Value> = alive_at(step)
        .iter()
        .enumerate()
        .map(|(i, (id, role))| {
            let fitness = (s / 3.0 + i as f64).sin() * 0.4 + i as f64 * 0.05;
            let mut line = json!({"id": id, "role": role, "subpop": i % 2, "reward_mean": fitness.abs(),
                   "fitness": fitness, "rating": {"mu": 25.0 + fitness, "sigma": 8.0 - s * 0.1}});
            // Runs before step 4 are from before the learning signal was measured.
            if step >= 4 {
                line["groups"] = member_groups(step, i, role);
            }
            line
        })
        .collect();
    let kinds = ["deduction", "abduction", "induction"];
    let groups: Vec<Value> = kinds
        .iter()
        .enumerate()
        .flat_map(|(k, kind)| {
            let phase = s / 2.5 + k as f64;
            [
                json!({"kind": kind, "role": "proposer", "count": 8, "reward_mean": 0.3 + 0.25 * phase.sin(), "reward_std": 0.2}),
                json!({"kind": kind, "role": "solver", "count": 8, "reward_mean": 0.5 - 0.3 * phase.sin(), "reward_std": 0.3}),
            ]
        })
        .collect();
    let teachers: Vec<&str> = alive_at(step)
        .into_iter()
        .filter(|(_, r)| *r == "teacher")
        .map(|(id, _)| id)
        .collect();
    let programs: Vec<Value> = teachers
        .iter()
        .enumerate()
        .flat_map(|(t, author)| {
            (0..(1 + (step + t as u64) % 3)).map(move |j| {
                json!({"author": author, "kind": kinds[((step + j) % 3) as usize],
                       "ast_nodes": 10 + step + 3 * j + t as u64, "max_depth": 3 + (step + j) % 4,
                       "node_types": 6 + j, "cyclomatic": 1 + (step / 4) + j % 2})
            })
        })
        .collect();
    let abduction = if step.is_multiple_of(4) {
        Value::Null
    } else {
        json!(0.4 + 0.35 * (s / 2.0).cos())
    };
    json!({
        "step": step, "wall_ms": 900.0 + s * 10.0,
        "phase_ms": {"propose": 300.0, "validate": 40.0, "solve": 350.0, "score": 30.0, "train": 160.0 + s,
                     "evolve": if step.is_multiple_of(5) { 25.0 } else { 0.0 }, "checkpoint": if step.is_multiple_of(10) { 80.0 } else { 0.0 }},
        "members": members,
        "groups": groups,
        "proposals": {"total": 8, "valid": programs.len(), "learnable": programs.len() / 2, "rejected": {"format": 2, "timeout": 1}},
        "solve_rate": {"deduction": 0.5 + 0.4 * (s / 2.0).sin(), "abduction": abduction, "induction": 0.2 + s * 0.02},
        "solver_format_errors": {"deduction": 0.0, "abduction": null, "induction": 0.1},
        "programs": programs,
        "tokens": {"prompt_mean": 300.0, "prompt_max": 420, "response_mean": 80.0, "truncated": 0.05},
        "future_field": {"ignored": true}
    })
}

/// A member's rollouts per task kind in its role, some with a non-zero advantage.
fn member_groups(step: u64, i: usize, role: &str) -> Value {
    let (role, rollouts) = if role == "teacher" {
        ("proposer", 1)
    } else {
        ("solver", 8)
    };
    let groups: Vec<Value> = ["deduction", "abduction", "induction"]
        .iter()
        .enumerate()
        .map(|(k, kind)| {
            let nonzero = (step as usize + i + k) % (rollouts + 1);
            json!({"kind": kind, "role": role, "rollouts": rollouts, "reward_mean": -0.5,
                   "nonzero_advantage": nonzero, "nonzero_share": nonzero as f64 / rollouts as f64})
        })
        .collect();
    json!(groups)
}

fn journal(last_step: u64, with_end: bool) -> Vec<Value> {
    let mut events = vec![
        json!({"event": "start", "seed": 42, "scenario": "quickstart",
        "members": alive_at(1).iter().enumerate().map(|(i, (id, role))| json!({"id": id, "role": role, "subpop": i % 2})).collect::<Vec<_>>()}),
    ];
    for step in 1..=last_step {
        let checksums: serde_json::Map<String, Value> = alive_at(step)
            .iter()
            .map(|(id, _)| (id.to_string(), json!(format!("{step:04x}"))))
            .collect();
        events.push(json!({"event": "step", "step": step, "checksums": checksums}));
        match step {
            3 => {
                events.push(json!({"event": "control", "step": 3, "command": {"cmd": "kill", "member": "student-1"}, "source": "ctl", "outcome": "applied"}));
                events.push(json!({"event": "kill", "step": 3, "id": "student-1"}));
            }
            5 => spawn_cull(&mut events, 5, "student-3", "student-4", &["student-0", "student-2"], &["ties", "svd_noise"]),
            7 => events.push(json!({"event": "fault", "step": 7, "member": "student-0", "message": "student-0 died in Solve(7)", "action": "restarted; step retried"})),
            10 => {
                spawn_cull(&mut events, 10, "teacher-1", "teacher-2", &["teacher-0"], &["clone", "gaussian"]);
                spawn_cull(&mut events, 10, "student-2", "student-5", &["student-4", "student-0"], &["dare", "layer_gauss"]);
                events.push(json!({"event": "checkpoint", "step": 10}));
            }
            15 => spawn_cull(&mut events, 15, "student-4", "student-6", &["student-5"], &["xes", "svd_rotate"]),
            _ => {}
        }
    }
    events.push(json!({"event": "brand_new_event", "step": 1}));
    if with_end {
        events.push(json!({"event": "end", "step": last_step, "checksums": {}}));
    }
    events
}

fn spawn_cull(
    events: &mut Vec<Value>,
    step: u64,
    culled: &str,
    child: &str,
    parents: &[&str],
    ops: &[&str],
) {
    let role = child.split('-').next().unwrap_or("student");
    events.push(json!({"event": "cull", "step": step, "id": culled, "fitness": -0.2}));
    events.push(json!({"event": "spawn", "step": step, "id": child, "role": role, "subpop": 1, "parents": parents, "operators": ops}));
}

/// Writes the synthetic run into `dir`.
fn synthesise(dir: &Path, last_step: u64, with_end: bool) {
    let metrics: Vec<Value> = (1..=last_step).map(step_metrics).collect();
    fs::write(dir.join("metrics.jsonl"), jsonl(&metrics)).expect("write metrics");
    fs::write(
        dir.join("journal.jsonl"),
        jsonl(&journal(last_step, with_end)),
    )
    .expect("write journal");
}

// ---------------------------------------------------------------- checks --

/// A minimal XML well-formedness check: tags balance, attributes are quoted.
fn assert_xmlish(text: &str, file: &str) {
    let mut stack: Vec<String> = Vec::new();
    let mut rest = text;
    while let Some(open) = rest.find('<') {
        let close = rest[open..]
            .find('>')
            .unwrap_or_else(|| panic!("{file}: unclosed tag"))
            + open;
        let tag = &rest[open + 1..close];
        rest = &rest[close + 1..];
        if tag.starts_with('?') || tag.starts_with('!') {
            continue;
        }
        assert_eq!(
            tag.matches('"').count() % 2,
            0,
            "{file}: unbalanced quotes in <{tag}>"
        );
        if let Some(name) = tag.strip_prefix('/') {
            assert_eq!(
                stack.pop().as_deref(),
                Some(name.trim()),
                "{file}: mismatched </{name}>"
            );
        } else if !tag.ends_with('/') {
            let name = tag.split_whitespace().next().unwrap_or_default();
            stack.push(name.to_string());
        }
    }
    assert!(stack.is_empty(), "{file}: unclosed elements {stack:?}");
}

/// Distinct `data-name`s of elements with `class="CLASS"`, and how many there are.
fn named(svg: &str, class: &str) -> (BTreeSet<String>, usize) {
    let marker = format!("class=\"{class}\" data-name=\"");
    let mut names = BTreeSet::new();
    let mut count = 0;
    for part in svg.split(&marker).skip(1) {
        count += 1;
        names.insert(part.split('"').next().unwrap_or_default().to_string());
    }
    (names, count)
}

fn png_size(bytes: &[u8]) -> (u32, u32) {
    assert!(bytes.starts_with(b"\x89PNG\r\n\x1a\n"), "not a PNG");
    assert_eq!(&bytes[12..16], b"IHDR");
    let be = |b: &[u8]| u32::from_be_bytes([b[0], b[1], b[2], b[3]]);
    (be(&bytes[16..20]), be(&bytes[20..24]))
}

fn read(dir: &Path, name: &str) -> String {
    fs::read_to_string(dir.join(name)).unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// Every file exists and is well-formed; returns the SVG texts by plot.
fn check_outputs(out: &Path) -> Vec<(String, String)> {
    let mut svgs = Vec::new();
    for plot in PLOTS {
        let svg = read(out, &format!("{plot}.svg"));
        assert!(svg.starts_with("<svg"), "{plot}.svg");
        assert_xmlish(&svg, plot);
        for bad in ["NaN", "inf"] {
            assert!(!svg.contains(bad), "{plot}.svg contains {bad}");
        }
        let png = fs::read(out.join(format!("{plot}.png"))).expect("png");
        let (w, h) = png_size(&png);
        assert!(
            (800..=4000).contains(&w) && (300..=8000).contains(&h),
            "{plot}.png is {w}×{h}"
        );
        svgs.push((plot.to_string(), svg));
    }
    let html = read(out, INDEX);
    assert_xmlish(&html, INDEX);
    for plot in PLOTS {
        assert!(
            html.contains(&format!("src=\"{plot}.svg\"")),
            "index links {plot}.svg"
        );
    }
    svgs
}

fn svg_of<'a>(svgs: &'a [(String, String)], plot: &str) -> &'a str {
    &svgs.iter().find(|(p, _)| p == plot).expect("plot").1
}

// ----------------------------------------------------------------- tests --

#[test]
fn full_run_writes_every_plot_and_the_page() {
    let run = match std::env::var_os("POPULORA_REPORT_DEMO") {
        Some(dir) => {
            let dir = PathBuf::from(dir);
            fs::create_dir_all(&dir).expect("demo dir");
            dir
        }
        None => temp_dir("full"),
    };
    synthesise(&run, STEPS, true);
    let out = run.join("report");
    let summary = report::write(&run, &out).expect("report");
    assert!(summary.complete);
    assert_eq!(summary.steps, STEPS as usize);
    assert_eq!(summary.last_step, Some(STEPS));
    assert!(summary.warnings.is_empty(), "{:?}", summary.warnings);
    assert_eq!(summary.files.len(), PLOTS.len() * 2 + 1);
    assert_eq!(summary.index, out.join(INDEX));

    let svgs = check_outputs(&out);
    let kinds: BTreeSet<String> = ["deduction", "abduction", "induction"]
        .map(String::from)
        .into();
    assert_eq!(named(svg_of(&svgs, "solve_rate"), "series").0, kinds);
    let (rewards, lines) = named(svg_of(&svgs, "rewards"), "series");
    assert_eq!(rewards, kinds);
    assert!(lines >= 6, "two panels × three kinds, got {lines}");
    let (complexity, _) = named(svg_of(&svgs, "complexity"), "series");
    assert_eq!(complexity.len(), 4, "mean + three teachers: {complexity:?}");
    assert_eq!(
        named(svg_of(&svgs, "coverage"), "series").0.len(),
        4,
        "all + three kinds"
    );
    let (signal, lines) = named(svg_of(&svgs, "signal"), "series");
    assert!(signal.contains("all members"), "{signal:?}");
    assert!(
        !signal.contains("student-1"),
        "killed before the signal was measured: {signal:?}"
    );
    assert_eq!(signal.len(), 10, "all + nine members: {signal:?}");
    assert_eq!(lines, 3 * 10, "one panel per kind");
    let (fitness, _) = named(svg_of(&svgs, "fitness"), "series");
    assert_eq!(fitness.len(), 10, "every member ever: {fitness:?}");
    assert!(fitness.contains("student-1 (killed 3)") && fitness.contains("student-3 (culled 5)"));

    let lineage = svg_of(&svgs, "lineage");
    assert_eq!(named(lineage, "member").1, 10);
    assert_eq!(named(lineage, "edge").1, 6, "one edge per parent");
    assert_eq!(named(lineage, "fault").1, 1);
    for op in ["ties + svd_noise", "clone + gaussian", "xes + svd_rotate"] {
        assert!(lineage.contains(op), "operators {op}");
    }

    let html = read(&out, INDEX);
    for text in [
        "quickstart",
        "42",
        "4 spawned, 4 culled, 1 killed",
        "populora eval",
        "propose",
        "student-0 died in Solve(7) → restarted; step retried",
        "kill student-1 (from ctl) → applied",
    ] {
        assert!(html.contains(text), "index.html lacks {text:?}");
    }
    assert!(!html.contains("What is missing"));
    if std::env::var_os("POPULORA_REPORT_DEMO").is_none() {
        let _ = fs::remove_dir_all(&run);
    }
}

#[test]
fn eval_json_becomes_a_table() {
    let run = temp_dir("eval");
    synthesise(&run, 6, true);
    let eval = json!([
        {"benchmark": "humaneval", "member": "student-0", "n": 164, "correct": 10, "pass_at_1": 0.061, "pass_at_k": [10, 0.2]},
        {"benchmark": "humaneval", "member": "student-10", "n": 164, "correct": 12, "pass_at_1": 0.073, "pass_at_k": null},
        {"benchmark": "gsm8k", "member": "student-0", "n": 50, "correct": 5, "pass_at_1": 0.1}
    ]);
    fs::write(run.join("eval.json"), eval.to_string()).expect("eval");
    report::write(&run, run.join("report")).expect("report");
    let html = read(&run.join("report"), INDEX);
    assert!(html.contains("<th>gsm8k</th><th>humaneval</th>"));
    assert!(html.contains("6.1%") && html.contains("10/164") && html.contains("pass@10 20.0%"));
    assert!(
        html.contains("7.3%") && html.contains("–"),
        "missing cell shown as a dash"
    );
    assert!(!html.contains("populora eval"));
    let _ = fs::remove_dir_all(&run);
}

#[test]
fn incomplete_run_reports_what_exists_and_what_is_missing() {
    let run = temp_dir("incomplete");
    synthesise(&run, 12, false);
    // Metrics stop at step 9 although the journal reached 12.
    let metrics: Vec<Value> = (1..=9).map(step_metrics).collect();
    fs::write(run.join("metrics.jsonl"), jsonl(&metrics)).expect("metrics");
    let summary = report::write(&run, run.join("report")).expect("report");
    assert!(!summary.complete);
    assert_eq!(summary.steps, 9);
    assert_eq!(summary.last_step, Some(12));
    let all = summary.warnings.join("\n");
    assert!(all.contains("no `end` event"), "{all}");
    assert!(
        all.contains("lacks steps") && all.contains("10, 11, 12"),
        "{all}"
    );
    check_outputs(&run.join("report"));
    let html = read(&run.join("report"), INDEX);
    assert!(html.contains("What is missing") && html.contains("incomplete"));
    let _ = fs::remove_dir_all(&run);
}

#[test]
fn truncated_last_line_is_skipped_with_a_warning() {
    let run = temp_dir("truncated");
    synthesise(&run, 5, true);
    let mut text = read(&run, "metrics.jsonl");
    let cut = step_metrics(6).to_string();
    text.push_str(&cut[..cut.len() / 2]); // no trailing newline: a kill -9 mid-write
    fs::write(run.join("metrics.jsonl"), text).expect("metrics");
    let summary = report::write(&run, run.join("report")).expect("report");
    assert_eq!(summary.steps, 5);
    let all = summary.warnings.join("\n");
    assert!(
        all.contains("metrics.jsonl") && all.contains("line (6)") && all.contains("skipped"),
        "{all}"
    );
    let _ = fs::remove_dir_all(&run);
}

#[test]
fn corrupt_line_is_an_error_naming_file_and_line() {
    let run = temp_dir("corrupt");
    synthesise(&run, 6, true);
    let mut lines: Vec<String> = read(&run, "journal.jsonl")
        .lines()
        .map(String::from)
        .collect();
    lines[3] = "{\"event\": \"step\", \"step\": \"three\"}".to_string();
    fs::write(run.join("journal.jsonl"), lines.join("\n") + "\n").expect("journal");
    let err = report::write(&run, run.join("report")).expect_err("corrupt line");
    match &err {
        ReportError::Parse { path, line, .. } => {
            assert!(path.ends_with("journal.jsonl"));
            assert_eq!(*line, 4);
        }
        other => panic!("unexpected error {other:?}"),
    }
    assert!(err.to_string().contains("journal.jsonl:4:"), "{err}");

    // A broken last line that *is* newline-terminated was written whole: an error too.
    synthesise(&run, 6, true);
    let mut text = read(&run, "metrics.jsonl");
    text.push_str("{not json}\n");
    fs::write(run.join("metrics.jsonl"), text).expect("metrics");
    let err = report::write(&run, run.join("report")).expect_err("corrupt last line");
    assert!(err.to_string().contains("metrics.jsonl:7:"), "{err}");
    let _ = fs::remove_dir_all(&run);
}

#[test]
fn empty_inputs_do_not_panic() {
    // No files at all.
    let run = temp_dir("empty");
    let summary = report::write(&run, run.join("report")).expect("report of nothing");
    assert_eq!(summary.steps, 0);
    assert_eq!(summary.last_step, None);
    assert!(summary
        .warnings
        .iter()
        .any(|w| w.contains("metrics.jsonl is missing")));
    assert!(summary
        .warnings
        .iter()
        .any(|w| w.contains("journal.jsonl is missing")));
    let svgs = check_outputs(&run.join("report"));
    assert!(svg_of(&svgs, "solve_rate").contains("no data"));

    // Empty files, and a journal with only a start event (and a blank line).
    fs::write(run.join("metrics.jsonl"), "").expect("metrics");
    let start = json!({"event": "start", "seed": 1, "scenario": "solo", "members": []});
    fs::write(run.join("journal.jsonl"), format!("{start}\n\n")).expect("journal");
    let summary = report::write(&run, run.join("report")).expect("report of empty files");
    assert!(summary.warnings.iter().any(|w| w.contains("no records")));
    check_outputs(&run.join("report"));

    // One step with nothing in it: no groups, no programs, no solve rate.
    let one = json!({"step": 1, "wall_ms": 5.0, "phase_ms": {},
        "members": [{"id": "solo-0", "role": "solo", "subpop": 0, "reward_mean": null,
                     "fitness": 0.0, "rating": {"mu": 25.0, "sigma": 8.3}}],
        "groups": [], "proposals": {"total": 0, "valid": 0, "rejected": {}},
        "solve_rate": {"deduction": null}, "solver_format_errors": {}, "programs": [],
        "tokens": {"prompt_mean": 0.0, "prompt_max": 0, "response_mean": 0.0, "truncated": 0.0}});
    fs::write(run.join("metrics.jsonl"), format!("{one}\n")).expect("metrics");
    let summary = report::write(&run, run.join("report")).expect("report of one step");
    assert_eq!(summary.steps, 1);
    check_outputs(&run.join("report"));
    let _ = fs::remove_dir_all(&run);
}

#[test]
fn missing_run_dir_is_an_error() {
    let run = temp_dir("missing").join("nope");
    let err = report::write(&run, run.join("report")).expect_err("no such dir");
    assert!(matches!(err, ReportError::NotADirectory { .. }));
    assert!(err.to_string().contains("nope"));
}

#[test]
fn metrics_only_run_still_has_a_lineage() {
    let run = temp_dir("metrics-only");
    let metrics: Vec<Value> = (1..=4).map(step_metrics).collect();
    fs::write(run.join("metrics.jsonl"), jsonl(&metrics)).expect("metrics");
    let summary = report::write(&run, run.join("report")).expect("report");
    assert_eq!(summary.last_step, Some(4));
    let svgs = check_outputs(&run.join("report"));
    assert_eq!(
        named(svg_of(&svgs, "lineage"), "member").1,
        6,
        "members seen in the metrics"
    );
    let _ = fs::remove_dir_all(&run);
}
