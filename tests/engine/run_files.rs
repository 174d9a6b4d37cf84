//! The on-disk schema of run files (`populora::run_files`): lines exactly as
//! a run writes them (taken from runs of `scenarios/tiny.toml`: plain, with
//! `POPULORA_FAULT`, with `populora ctl` and a resume past a corrupt
//! checkpoint) parse and are written back the same, lines built with the
//! types round-trip, older runs' lines still read, and broken ones do not.

use std::collections::BTreeMap;

use populora::compute::Cost;
use populora::rating::Rating;
use populora::run_files::{
    Command, Event, GroupMetrics, MemberEntry, MemberGroup, MemberLine, MetricsLine, ProgramLine,
    ProposalCounts, Source, TokenMetrics,
};
use populora::scenario;
use populora::task::{Role, TaskKind};
use populora::verify::Features;
use serde::de::DeserializeOwned;
use serde::Serialize;

/// Step 1 of tiny.toml: no deduction or abduction rollouts (null rates).
const METRICS_STEP_1: &str = r#"{"step":1,"wall_ms":1769.8678779999998,"phase_ms":{"compute":1646.696644,"propose":633.805993,"score":36.18026,"solve":390.20844900000003,"train":645.629863,"validate":59.625343},"members":[{"id":"teacher-0","role":"teacher","subpop":0,"reward_mean":-0.3333333333333333,"fitness":-0.3333333333333333,"rating":{"mu":30.988215205628013,"sigma":6.55537037440068},"grad_norm":0.0,"train_tokens":205},{"id":"teacher-1","role":"teacher","subpop":1,"reward_mean":-0.3333333333333333,"fitness":-0.3333333333333333,"rating":{"mu":30.988215205628013,"sigma":6.55537037440068},"grad_norm":0.0,"train_tokens":207},{"id":"student-0","role":"student","subpop":0,"reward_mean":-0.5,"fitness":-0.5,"rating":{"mu":19.011784794371987,"sigma":6.55537037440068},"grad_norm":0.0,"train_tokens":109},{"id":"student-1","role":"student","subpop":1,"reward_mean":-0.5,"fitness":-0.5,"rating":{"mu":19.011784794371987,"sigma":6.55537037440068},"grad_norm":0.0,"train_tokens":100}],"groups":[{"kind":"deduction","role":"proposer","count":2,"reward_mean":-0.5,"reward_std":0.0},{"kind":"abduction","role":"proposer","count":2,"reward_mean":-0.5,"reward_std":0.0},{"kind":"induction","role":"proposer","count":2,"reward_mean":0.0,"reward_std":0.0},{"kind":"induction","role":"solver","count":4,"reward_mean":-0.5,"reward_std":0.0}],"proposals":{"total":6,"valid":2,"learnable":0,"rejected":{"runtime_error":1,"syntax_error":3}},"solve_rate":{"deduction":null,"abduction":null,"induction":0.0},"solver_format_errors":{"deduction":null,"abduction":null,"induction":0.0},"programs":[{"author":"teacher-0","kind":"induction","ast_nodes":7,"max_depth":5,"node_types":7,"cyclomatic":1},{"author":"teacher-1","kind":"induction","ast_nodes":7,"max_depth":5,"node_types":7,"cyclomatic":1}],"tokens":{"prompt_mean":496.0,"prompt_max":620,"response_mean":114.2,"truncated":0.0},"compute":{"prompt_tokens":4960,"generated_tokens":1142,"trained_tokens":6102,"flops":3061968896.0},"compute_total":{"prompt_tokens":4960,"generated_tokens":1142,"trained_tokens":6102,"flops":3061968896.0}}"#;

/// Step 3 of tiny.toml: after a kill, an inject and an evolution.
const METRICS_STEP_3: &str = r#"{"step":3,"wall_ms":2067.5296080000003,"phase_ms":{"compute":1965.9901960000002,"propose":236.856248,"score":25.755688999999997,"solve":481.62794399999996,"train":1250.810528,"validate":43.221725},"members":[{"id":"student-0","role":"student","subpop":0,"reward_mean":-0.5,"fitness":-0.5,"rating":{"mu":17.36216348458826,"sigma":5.846724942261079},"grad_norm":0.0,"train_tokens":330},{"id":"teacher-2","role":"teacher","subpop":1,"reward_mean":-0.3333333333333333,"fitness":-0.3333333333333333,"rating":{"mu":30.988215205628013,"sigma":6.55537037440068},"grad_norm":0.0,"train_tokens":207},{"id":"student-2","role":"student","subpop":1,"reward_mean":-0.5,"fitness":-0.5,"rating":{"mu":25.0,"sigma":8.333333333333334},"grad_norm":0.0,"train_tokens":303},{"id":"student-3","role":"student","subpop":0,"reward_mean":-0.5,"fitness":-0.5,"rating":{"mu":19.011784794371987,"sigma":6.55537037440068},"grad_norm":0.0,"train_tokens":93}],"groups":[{"kind":"deduction","role":"proposer","count":1,"reward_mean":-0.5,"reward_std":0.0},{"kind":"deduction","role":"solver","count":4,"reward_mean":-0.5,"reward_std":0.0},{"kind":"abduction","role":"proposer","count":1,"reward_mean":-0.5,"reward_std":0.0},{"kind":"abduction","role":"solver","count":4,"reward_mean":-0.5,"reward_std":0.0},{"kind":"induction","role":"proposer","count":1,"reward_mean":0.0,"reward_std":0.0},{"kind":"induction","role":"solver","count":6,"reward_mean":-0.4999999999999999,"reward_std":1.1102230246251564e-16}],"proposals":{"total":3,"valid":1,"learnable":0,"rejected":{"runtime_error":1,"syntax_error":1}},"solve_rate":{"deduction":0.0,"abduction":0.0,"induction":0.0},"solver_format_errors":{"deduction":0.0,"abduction":0.0,"induction":0.0},"programs":[{"author":"teacher-2","kind":"induction","ast_nodes":7,"max_depth":5,"node_types":7,"cyclomatic":1}],"tokens":{"prompt_mean":398.2352941176471,"prompt_max":620,"response_mean":107.70588235294117,"truncated":0.17647058823529413},"compute":{"prompt_tokens":6770,"generated_tokens":1831,"trained_tokens":8601,"flops":3731915008.0},"compute_total":{"prompt_tokens":16690,"generated_tokens":4143,"trained_tokens":20833,"flops":9887128064.0}}"#;
/// A member of a run's step 1 since each member's rollouts per (task kind ×
/// role) are measured (quickstart, seed 42).
const MEMBER_WITH_GROUPS: &str = r#"{"id":"student-0","role":"student","subpop":0,"reward_mean":-0.125,"fitness":-0.125,"rating":{"mu":24.142625686523083,"sigma":2.7028351662913637},"grad_norm":0.22123950224354977,"train_tokens":326,"groups":[{"kind":"deduction","role":"solver","rollouts":8,"reward_mean":-0.3125,"nonzero_advantage":8,"nonzero_share":1.0},{"kind":"abduction","role":"solver","rollouts":8,"reward_mean":0.25,"nonzero_advantage":8,"nonzero_share":1.0},{"kind":"induction","role":"solver","rollouts":8,"reward_mean":-0.3125,"nonzero_advantage":8,"nonzero_share":1.0}]}"#;

/// One line of each journal event kind (and both command sources).
const EVENTS: [&str; 17] = [
    r#"{"event":"start","seed":7,"scenario":"tiny","members":[{"id":"teacher-0","role":"teacher","subpop":0},{"id":"teacher-1","role":"teacher","subpop":1},{"id":"student-0","role":"student","subpop":0},{"id":"student-1","role":"student","subpop":1}]}"#,
    r#"{"event":"step","step":1,"checksums":{"student-0":"52d2b9746515aff1fd32050e66f0926a2b83ba6e72a4f12c764b62dc1c7ff5dd","student-1":"2b3f70aca0f5f6e800614a7fb901080664d35668beabc51ed45727b6cb31b53f","teacher-0":"e49cbe81e63e0b0a9a3e7a10dd0b3ea16431c55469ce56e04b10527e71b0b49d","teacher-1":"da9a49abff753724429865b9b078d7624d10ca343bebcaf72970370c0e3c2109"}}"#,
    r#"{"event":"control","step":3,"command":{"cmd":"kill","member":"teacher-0"},"source":"scenario","outcome":"applied"}"#,
    r#"{"event":"kill","step":3,"id":"teacher-0"}"#,
    r#"{"event":"spawn","step":2,"id":"teacher-2","role":"teacher","subpop":1,"parents":["teacher-0"],"operators":["svd_noise:angle=0.05,sigma=0.1"]}"#,
    r#"{"event":"cull","step":2,"id":"teacher-1","fitness":-0.3333333333333333}"#,
    r#"{"event":"checkpoint","step":2}"#,
    r#"{"event":"end","step":4,"checksums":{"student-0":"52d2b9746515aff1fd32050e66f0926a2b83ba6e72a4f12c764b62dc1c7ff5dd","student-2":"97fb57fadbd9c8d08841591ee63ed3f38e1e37bdfe98b0b692ff93862bfdd654","student-4":"1d0be1d6948a151de16d5201228808482b0ee4bae8d7d994b52eecd8b44fa0d0","teacher-2":"d2eabe08cae81298347cf55470a87e25c95e1f1e875503bc660918670faf14b2"}}"#,
    r#"{"event":"control","step":1,"command":{"cmd":"inject","role":"teacher","from":["teacher-1"],"op":"svd_noise"},"source":"ctl","outcome":"applied"}"#,
    r#"{"event":"fault","step":2,"member":"member","message":"student-0 died in Solve(2)","action":"restarted; step retried"}"#,
    r#"{"event":"checkpoint_skipped","step":4,"reason":"loading /tmp/schema-resume/checkpoints/step-000004/members/student-0: /tmp/schema-resume/checkpoints/step-000004/members/student-0/adapter/adapter.safetensors: invalid safetensors file: incomplete metadata, file not fully covered","moved_to":"checkpoints/skipped-step-000004"}"#,
    r#"{"event":"node_lost","step":4,"node":"127.0.0.1:7102","message":"its connection closed with a request in flight (an actor dropped the reply)","resumed_from":2}"#,
    r#"{"event":"node_back","step":4,"node":"127.0.0.1:7102"}"#,
    r#"{"event":"layout","step":2,"members":{"student-0":"127.0.0.1:7101","student-2":"127.0.0.1:7101","teacher-0":"127.0.0.1:7101","teacher-2":"127.0.0.1:7101"},"down":{"127.0.0.1:7102":"down: Connection refused (os error 111)"}}"#,
    r#"{"event":"spawn","step":8,"id":"student-6","role":"student","subpop":0,"parents":["student-0","student-2"],"operators":["ties:density=0.2","svd_noise:angle=0.05,sigma=0.1"],"node":"127.0.0.1:7102"}"#,
    r#"{"event":"seeding","checksum":"305a1b95b32ce9d20ac6031b88dce33eb8423c57dad27fcfabfd2e331283c027","entries":{"abduction":4,"deduction":4,"induction":4},"rounds":29,"proposals":330,"valid":12,"compute":{"prompt_tokens":216108,"generated_tokens":37086,"trained_tokens":0,"computed_prompt_tokens":59964,"flops":15805606400.0}}"#,
    r#"{"event":"compute_mark","step":10,"target_tflop":0.010365313536,"spent_tflop":0.01015575424}"#,
];

fn parse<T: DeserializeOwned>(line: &str) -> T {
    serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"))
}

fn write(value: &impl Serialize) -> String {
    serde_json::to_string(value).expect("serialise")
}

/// Parsed and written back, `line` is the same JSON: no field renamed,
/// dropped, added or retyped (`0.0` is not `0`, `null` is not absent). As
/// JSON values, not text: serde_json's float parsing may move the last
/// digit of a number.
fn assert_same_json<T: DeserializeOwned + Serialize>(line: &str) -> T {
    let value: T = parse(line);
    let written = serde_json::to_value(&value).expect("serialise");
    assert_eq!(written, parse::<serde_json::Value>(line), "{line}");
    value
}

#[test]
fn metrics_lines_as_runs_write_them() {
    let one: MetricsLine = assert_same_json(METRICS_STEP_1);
    assert_eq!(one.step, 1);
    assert_eq!(one.solve_rate[&TaskKind::Deduction], None);
    assert_eq!(one.solve_rate[&TaskKind::Induction], Some(0.0));
    assert_eq!(one.programs.len(), 2);

    let student: MemberLine = assert_same_json(MEMBER_WITH_GROUPS);
    let shares: Vec<_> = student
        .groups
        .iter()
        .map(|g| (g.kind, g.role, g.rollouts, g.nonzero_advantage))
        .collect();
    assert_eq!(
        shares,
        [
            (TaskKind::Deduction, Role::Solver, 8, 8),
            (TaskKind::Abduction, Role::Solver, 8, 8),
            (TaskKind::Induction, Role::Solver, 8, 8)
        ]
    );

    let three: MetricsLine = assert_same_json(METRICS_STEP_3);
    assert!(three.members.iter().all(|m| m.groups.is_empty()));
    assert_eq!(three.step, 3);
    let ids: Vec<&str> = three.members.iter().map(|m| m.id.as_str()).collect();
    assert_eq!(ids, ["student-0", "teacher-2", "student-2", "student-3"]);
    let teacher = &three.members[1];
    assert_eq!((teacher.role.as_str(), teacher.subpop), ("teacher", 1));
    assert_eq!(teacher.train_tokens, Some(207));
    assert_eq!(teacher.rating.sigma, 6.55537037440068);
    assert_eq!(three.groups[1].kind, TaskKind::Deduction);
    assert_eq!(three.groups[1].role, Role::Solver);
    assert_eq!(three.proposals.learnable, Some(0));
    assert_eq!(three.proposals.rejected["syntax_error"], 1);
    assert_eq!(
        three.programs[0],
        ProgramLine {
            author: "teacher-2".into(),
            kind: TaskKind::Induction,
            features: Features {
                ast_nodes: 7,
                max_depth: 5,
                node_types: 7,
                cyclomatic: 1
            },
        }
    );
    assert_eq!(three.tokens.prompt_max, 620);
    assert_eq!(three.compute.map(|c| c.trained_tokens), Some(8601));
    assert_eq!(three.compute_total.map(|c| c.flops), Some(9887128064.0));
}

/// The journal's name for each event; no wildcard, so a new event kind
/// does not compile until it is named here and has a line in [`EVENTS`].
fn kind(event: &Event) -> &'static str {
    match event {
        Event::Start { .. } => "start",
        Event::Control { .. } => "control",
        Event::Kill { .. } => "kill",
        Event::Spawn { .. } => "spawn",
        Event::Cull { .. } => "cull",
        Event::Fault { .. } => "fault",
        Event::Step { .. } => "step",
        Event::Checkpoint { .. } => "checkpoint",
        Event::CheckpointSkipped { .. } => "checkpoint_skipped",
        Event::Layout { .. } => "layout",
        Event::NodeLost { .. } => "node_lost",
        Event::NodeBack { .. } => "node_back",
        Event::End { .. } => "end",
        Event::Seeding { .. } => "seeding",
        Event::ComputeMark { .. } => "compute_mark",
        Event::Unknown => "unknown",
    }
}

#[test]
fn journal_events_as_runs_write_them() {
    let events: Vec<Event> = EVENTS.iter().map(|l| assert_same_json(l)).collect();
    let mut kinds: Vec<&str> = events.iter().map(kind).collect();
    kinds.sort_unstable();
    kinds.dedup();
    assert_eq!(
        kinds,
        [
            "checkpoint",
            "checkpoint_skipped",
            "compute_mark",
            "control",
            "cull",
            "end",
            "fault",
            "kill",
            "layout",
            "node_back",
            "node_lost",
            "seeding",
            "spawn",
            "start",
            "step"
        ],
        "every kind the runtime writes"
    );
    let Event::Start { seed, members, .. } = &events[0] else {
        panic!("{:?}", events[0]);
    };
    assert_eq!(*seed, 7);
    assert_eq!(
        members[3],
        MemberEntry {
            id: "student-1".into(),
            role: "student".into(),
            subpop: 1
        }
    );
    assert!(matches!(&events[1], Event::Step { step: 1, checksums } if checksums.len() == 4));
    assert_eq!(
        events[8],
        Event::Control {
            step: 1,
            command: Command::Inject {
                role: scenario::Role::Teacher,
                from: vec!["teacher-1".into()],
                op: Some("svd_noise".into()),
            },
            source: Source::Ctl,
            outcome: "applied".into(),
        }
    );
    // Written before faults named their member.
    assert!(matches!(&events[9], Event::Fault { member: Some(m), .. } if m == "member"));
}

fn sample_line() -> MetricsLine {
    let cost = |n: u64| Cost {
        prompt_tokens: n,
        generated_tokens: n / 2,
        trained_tokens: n * 2,
        computed_prompt_tokens: n / 4,
        computed_trained_tokens: n,
        flops: n as f64 * 1.5e6,
    };
    MetricsLine {
        step: 12,
        wall_ms: 1234.5,
        phase_ms: BTreeMap::from([("propose".into(), 10.25), ("train".into(), 99.0)]),
        members: vec![
            MemberLine {
                id: "teacher-0".into(),
                role: "teacher".into(),
                subpop: 0,
                reward_mean: Some(0.25),
                fitness: -0.125,
                rating: Rating::new(26.5, 7.25),
                grad_norm: Some(0.5),
                train_tokens: Some(300),
                train_tokens_run: Some(210),
                groups: vec![MemberGroup {
                    kind: TaskKind::Abduction,
                    role: Role::Proposer,
                    rollouts: 4,
                    reward_mean: 0.25,
                    nonzero_advantage: 3,
                    nonzero_share: 0.75,
                }],
            },
            MemberLine {
                id: "student-3".into(),
                role: "student".into(),
                subpop: 1,
                reward_mean: None,
                fitness: 0.0,
                rating: Rating::new(25.0, 8.0),
                grad_norm: None,
                train_tokens: None,
                train_tokens_run: None,
                groups: Vec::new(),
            },
        ],
        groups: vec![GroupMetrics {
            kind: TaskKind::Abduction,
            role: Role::Proposer,
            count: 4,
            reward_mean: 0.5,
            reward_std: 0.125,
        }],
        proposals: ProposalCounts {
            total: 6,
            valid: 4,
            learnable: Some(2),
            rejected: BTreeMap::from([("format.no_input".into(), 1), ("timeout".into(), 1)]),
        },
        solve_rate: BTreeMap::from([
            (TaskKind::Deduction, Some(0.75)),
            (TaskKind::Induction, None),
        ]),
        solver_format_errors: BTreeMap::from([(TaskKind::Deduction, Some(0.0))]),
        programs: vec![ProgramLine {
            author: "teacher-0".into(),
            kind: TaskKind::Abduction,
            features: Features {
                ast_nodes: 31,
                max_depth: 6,
                node_types: 12,
                cyclomatic: 3,
            },
        }],
        tokens: TokenMetrics {
            prompt_mean: 410.5,
            prompt_max: 620,
            response_mean: 88.0,
            truncated: 0.125,
        },
        compute: Some(cost(1000)),
        compute_total: Some(cost(12000)),
        wire_bytes: None,
        solver_rollouts: Some(16),
        buffer_rollouts: Some(8),
    }
}

fn sample_events() -> Vec<Event> {
    let checksums = BTreeMap::from([("student-3".into(), "ab".repeat(32))]);
    let control = |command: Command| Event::Control {
        step: 3,
        command,
        source: Source::Scenario,
        outcome: "refused: no live member `x`".into(),
    };
    vec![
        Event::Start {
            seed: 1,
            scenario: "s".into(),
            members: vec![MemberEntry {
                id: "solo-0".into(),
                role: "solo".into(),
                subpop: 0,
            }],
        },
        control(Command::Status),
        control(Command::Kill {
            member: "student-3".into(),
        }),
        control(Command::Inject {
            role: scenario::Role::Student,
            from: Vec::new(),
            op: None,
        }),
        control(Command::Pause),
        control(Command::Resume),
        control(Command::Stop),
        Event::Kill {
            step: 3,
            id: "student-3".into(),
        },
        Event::Spawn {
            step: 4,
            id: "student-4".into(),
            role: "student".into(),
            subpop: 1,
            parents: vec!["student-0".into(), "student-2".into()],
            operators: vec!["ties".into(), "svd_noise".into()],
            node: None,
            optimizer: Some("reset".into()),
        },
        Event::Cull {
            step: 4,
            id: "student-1".into(),
            fitness: -0.5,
        },
        Event::Fault {
            step: 2,
            member: Some("student-0".into()),
            message: "student-0 died in Solve(2)".into(),
            action: "restarted; step retried".into(),
        },
        Event::Fault {
            step: 2,
            member: None,
            message: "broker is not running".into(),
            action: "stopped".into(),
        },
        Event::Step {
            step: 4,
            checksums: checksums.clone(),
        },
        Event::Checkpoint { step: 4 },
        Event::CheckpointSkipped {
            step: 6,
            reason: "corrupt".into(),
            moved_to: "checkpoints/skipped-step-000006".into(),
        },
        Event::End { step: 6, checksums },
    ]
}

#[test]
fn lines_built_with_the_types_round_trip() {
    let line = sample_line();
    assert_eq!(parse::<MetricsLine>(&write(&line)), line);
    for event in sample_events() {
        assert_eq!(parse::<Event>(&write(&event)), event);
    }
    // The shapes a reader sees: null for an absent rate, the features
    // inline in the program, optional inject fields left out.
    let text = write(&line);
    assert!(text.contains(r#""induction":null"#), "{text}");
    assert!(
        text.contains(r#""kind":"abduction","ast_nodes":31"#),
        "{text}"
    );
    let inject = write(&sample_events()[3]);
    assert!(
        inject.contains(r#""command":{"cmd":"inject","role":"student"},"#),
        "{inject}"
    );
    let fault = write(&sample_events()[10]);
    assert!(fault.contains(r#""member":"student-0""#), "{fault}");
}

#[test]
fn lines_of_older_runs_still_read() {
    // Before the learnable count and the compute were recorded.
    let mut old: serde_json::Value = parse(METRICS_STEP_3);
    let fields = old.as_object_mut().expect("an object");
    fields.remove("compute");
    fields.remove("compute_total");
    fields["proposals"]
        .as_object_mut()
        .expect("an object")
        .remove("learnable");
    let line: MetricsLine = parse(&old.to_string());
    assert_eq!(line.compute, None);
    assert_eq!(line.compute_total, None);
    assert_eq!(line.proposals.learnable, None);
    assert_eq!(line.members.len(), 4);
}

#[test]
fn newer_runs_fields_and_events_are_tolerated() {
    let newer = METRICS_STEP_1.replacen('{', r#"{"future_field":{"x":1},"#, 1);
    assert_eq!(parse::<MetricsLine>(&newer), parse(METRICS_STEP_1));
    let event: Event = parse(r#"{"event":"brand_new_event","step":1}"#);
    assert_eq!(event, Event::Unknown);
    assert!(
        serde_json::to_string(&Event::Unknown).is_err(),
        "never written"
    );
}

#[test]
fn broken_lines_are_refused_naming_the_field() {
    let mut line: serde_json::Value = parse(METRICS_STEP_3);
    line.as_object_mut().expect("an object").remove("members");
    let err = serde_json::from_str::<MetricsLine>(&line.to_string()).expect_err("no members");
    assert!(err.to_string().contains("members"), "{err}");
    let err = serde_json::from_str::<Event>(r#"{"event":"step","step":"three","checksums":{}}"#)
        .expect_err("a step that is not a number");
    assert!(err.to_string().contains("three"), "{err}");
    let err = serde_json::from_str::<Event>(
        r#"{"event":"control","step":1,"command":{"cmd":"explode"},"source":"ctl","outcome":"applied"}"#,
    )
    .expect_err("an unknown command");
    assert!(err.to_string().contains("explode"), "{err}");
}

#[test]
fn commands_read_as_ctl_takes_them() {
    let text: Vec<String> = sample_events()[1..7]
        .iter()
        .map(|e| match e {
            Event::Control { command, .. } => command.to_string(),
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(
        text,
        [
            "status",
            "kill student-3",
            "inject student",
            "pause",
            "resume",
            "stop"
        ]
    );
    let inject = Command::Inject {
        role: scenario::Role::Teacher,
        from: vec!["teacher-0".into(), "teacher-1".into()],
        op: Some("dare:drop=0.5".into()),
    };
    assert_eq!(
        inject.to_string(),
        "inject teacher --from teacher-0 teacher-1 --op dare:drop=0.5"
    );
}
