//! Scenario schema: malformed files, defaults, the resolved copy, the shipped files.

use populora::base::{Target, WeightsSetting};
use populora::scenario::experiment::{Experiment, Matching};
use populora::scenario::{
    parse_member_id, AdvantageGroups, ErrorKind, EventAction, Fitness, Injection, Mode,
    ModelSource, Role, Scenario, ScenarioError, TaskKind, TinyModelSection, WeightedOperator,
};
use std::path::Path;

const ORIGIN: &str = "scenarios/x.toml";

/// Stands in for the operator registry.
fn check_operator(op: &str) -> Result<(), String> {
    let name = op.split(':').next().unwrap_or("");
    match name {
        "ties" | "dare" | "svd_noise" | "average" | "clone" => Ok(()),
        _ => Err(format!(
            "unknown operator `{name}` (known: ties, dare, svd_noise, average, clone)"
        )),
    }
}

fn parse(text: &str) -> Result<Scenario, ScenarioError> {
    Scenario::parse(text, ORIGIN, check_operator)
}

fn shipped(file: &str) -> Scenario {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("scenarios")
        .join(file);
    Scenario::from_file(&path, populora::scenario::check_operator).unwrap_or_else(|e| panic!("{e}"))
}

/// (what, text, key the message must name (None: syntax errors), line, message fragment)
type Case = (
    &'static str,
    &'static str,
    Option<&'static str>,
    usize,
    &'static str,
);

#[rustfmt::skip]
const CASES: &[Case] = &[
    // ---- not TOML
    ("syntax: missing value", "seed = 1\nsteps =\n", None, 2, ""),
    ("syntax: duplicate key", "seed = 1\nsteps = 2\nseed = 3\n", None, 3, "duplicate key"),
    ("syntax: unclosed header", "seed = 1\nsteps = 2\n\n[lora\nrank = 2\n", None, 4, ""),
    ("syntax: unterminated string", "seed = 1\nsteps = 2\nname = \"abc\n", None, 3, ""),
    // ---- schema: unknown keys, types, missing keys, variants
    ("unknown top-level key", "seed = 1\nsteps = 2\nseleplay = 3\n", Some("seleplay"), 3,
     "unknown key `seleplay` (expected one of: name, seed, steps, budget_tflop, model, lora"),
    ("unknown table", "seed = 1\nsteps = 2\n\n[seleplay]\nreferences = 2\n", Some("seleplay"), 4,
     "unknown key `seleplay`"),
    ("unknown nested key", "seed = 1\nsteps = 2\n[lora]\nrank = 8\nrnak = 3\n", Some("lora.rnak"), 5,
     "unknown key `lora.rnak` (expected one of: rank, alpha, rslora, targets)"),
    ("unknown dotted key", "seed = 1\nsteps = 2\nlora.rank = 8\nlora.rnak = 3\n", Some("lora.rnak"), 4,
     "unknown key `lora.rnak`"),
    ("unknown key in nested table", "seed = 1\nsteps = 2\n[model]\nsource = \"tiny\"\n[model.tiny]\nlayer = 2\n",
     Some("model.tiny.layer"), 6, "unknown key `model.tiny.layer`"),
    ("unknown key in inline table in array",
     "seed = 1\nsteps = 2\n[evolution]\ncrossover = [\n  { op = \"ties\" },\n  { op = \"dare\", wieght = 1.0 },\n]\n",
     Some("evolution.crossover[1].wieght"), 6, "unknown key"),
    ("unknown key in event", "seed = 1\nsteps = 4\n[[events]]\nat = 1\nkil = \"student-0\"\n",
     Some("events[0].kil"), 5, "unknown key `events[0].kil`"),
    ("wrong type", "seed = 1\nsteps = 2\n[lora]\nrank = \"eight\"\n", Some("lora.rank"), 4,
     "lora.rank: invalid type: string \"eight\", expected a non-negative integer"),
    ("wrong type: negative count", "seed = 1\nsteps = 2\n\n[population]\nteachers = -1\n",
     Some("population.teachers"), 5, "-1"),
    ("wrong type: table for scalar", "seed = 1\nsteps = 2\n[lora]\nrslora = { on = true }\n",
     Some("lora.rslora"), 4, "invalid type"),
    ("wrong type: events as a table", "seed = 1\nsteps = 2\n[events]\nat = 1\n", Some("events"), 3, "invalid type"),
    ("unknown variant in list", "seed = 1\nsteps = 2\n[lora]\ntargets = [\"q\",\n  \"qq\"]\n",
     Some("lora.targets[1]"), 5, "lora.targets[1] = \"qq\" is not allowed (allowed: q, k, v, o, gate, up, down)"),
    ("unknown mode", "seed = 1\nsteps = 2\n[population]\n\nmode = \"duo\"\n", Some("population.mode"), 5,
     "population.mode = \"duo\" is not allowed (allowed: population, solo)"),
    ("unknown fitness", "seed = 1\nsteps = 2\n[evolution]\nfitness = \"elo\"\n", Some("evolution.fitness"), 4,
     "allowed: recent_reward, trueskill"),
    ("empty model source", "seed = 1\nsteps = 2\n[model]\nsource = \"\"\n", Some("model.source"), 4,
     "model.source: empty string is not allowed"),
    ("missing seed", "steps = 2\n[lora]\nrank = 4\n", Some("seed"), 1, "missing required key `seed`"),
    ("missing steps", "# comment\nseed = 2\n", Some("steps"), 1, "missing required key `steps`"),
    ("event without at", "seed = 1\nsteps = 4\n\n[[events]]\nkill = \"student-0\"\n", Some("events[0].at"), 4,
     "missing required key `events[0].at`"),
    ("second event without at",
     "seed = 1\nsteps = 4\n[[events]]\nat = 1\nkill = \"student-0\"\n[[events]]\nkill = \"student-1\"\n",
     Some("events[1].at"), 6, "missing required key `events[1].at`"),
    ("inject without role", "seed = 1\nsteps = 4\n[[events]]\nat = 1\ninject = { from = [\"student-0\"] }\n",
     Some("events[0].inject.role"), 5, "missing required key `events[0].inject.role`"),
    ("operator without op", "seed = 1\nsteps = 2\n[evolution]\nmutation = [{ weight = 2.0 }]\n",
     Some("evolution.mutation[0].op"), 4, "missing required key `evolution.mutation[0].op`"),
    ("event with kill and inject",
     "seed = 1\nsteps = 4\n[[events]]\nat = 1\nkill = \"student-0\"\n\n[[events]]\nat = 2\nkill = \"student-1\"\ninject = { role = \"student\" }\n",
     Some("events[1]"), 7, "exactly one of `kill` or `inject`, not both"),
    ("event with neither", "seed = 1\nsteps = 4\n[[events]]\nat = 1\n", Some("events[0]"), 3,
     "needs exactly one of `kill` or `inject`"),
    // ---- ranges
    ("steps 0", "seed = 1\nsteps = 0\n", Some("steps"), 2, "steps = 0 is out of range (allowed 1..)"),
    ("rank 0", "seed = 1\nsteps = 2\n\n[lora]\nrank = 0\n", Some("lora.rank"), 5,
     "lora.rank = 0 is out of range (allowed 1..=256)"),
    ("rank 300", "seed = 1\nsteps = 2\nlora.rank = 300\n", Some("lora.rank"), 3, "(allowed 1..=256)"),
    ("alpha negative", "seed = 1\nsteps = 2\n[lora]\nalpha = -1.0\n", Some("lora.alpha"), 4, "lora.alpha = -1"),
    ("top_p 0", "seed = 1\nsteps = 2\n[selfplay]\ntop_p = 0.0\n", Some("selfplay.top_p"), 4, "0 < top_p <= 1"),
    ("temperature 2.5", "seed = 1\nsteps = 2\n[selfplay]\ntemperature = 2.5\n", Some("selfplay.temperature"), 4,
     "selfplay.temperature = 2.5 is out of range"),
    ("references 33", "seed = 1\nsteps = 2\n[selfplay]\nreferences = 33\n", Some("selfplay.references"), 4, "0..=32"),
    ("buffer_problems 33", "seed = 1\nsteps = 2\n[selfplay]\nbuffer_problems = 33\n", Some("selfplay.buffer_problems"), 4,
     "selfplay.buffer_problems = 33 is out of range (allowed 0..=32)"),
    ("max_new_tokens 4", "seed = 1\nsteps = 2\n[selfplay]\nmax_new_tokens = 4\n", Some("selfplay.max_new_tokens"), 4,
     "8..=4096"),
    ("lr 2", "seed = 1\nsteps = 2\n[training]\nlr = 2.0\n", Some("training.lr"), 4, "0 < lr <= 1"),
    ("beta2 1", "seed = 1\nsteps = 2\n[training]\nbeta2 = 1.0\n", Some("training.beta2"), 4, "0 <= beta < 1"),
    ("clip 1", "seed = 1\nsteps = 2\n[training]\nclip = 1.0\n", Some("training.clip"), 4, "0 < clip < 1"),
    ("reward nan", "seed = 1\nsteps = 2\n[rewards]\ncorrect = nan\n", Some("rewards.correct"), 4, "finite"),
    ("workers 0", "seed = 1\nsteps = 2\n[verifier]\nworkers = 0\n", Some("verifier.workers"), 4, "1..=64"),
    ("timeout 5", "seed = 1\nsteps = 2\n[verifier]\nworkers = 2\ntimeout_ms = 5\n", Some("verifier.timeout_ms"), 5,
     "10..=60000"),
    ("same key name in two tables",
     "seed = 1\nsteps = 2\n[evolution]\nevery = 5\n[checkpoint]\nevery = 0\n", Some("checkpoint.every"), 6,
     "checkpoint.every = 0 is out of range"),
    ("evolution.every 0 (not checkpoint.every)",
     "seed = 1\nsteps = 2\n[checkpoint]\nevery = 3\n[evolution]\nevery = 0\n", Some("evolution.every"), 6,
     "evolution.every = 0"),
    ("cull fraction 1", "seed = 1\nsteps = 2\n[evolution]\ncull_fraction = 1.0\n", Some("evolution.cull_fraction"), 4,
     "0 < f < 1"),
    ("induction_shown >= induction_inputs",
     "seed = 1\nsteps = 2\n[selfplay]\ninduction_inputs = 6\ninduction_shown = 6\n", Some("selfplay.induction_shown"), 5,
     "(allowed 1..=5"),
    ("name with slash", "name = \"a/b\"\nseed = 1\nsteps = 2\n", Some("name"), 1, "name = \"a/b\" is not a usable run name"),
    // ---- lists
    ("duplicate targets", "seed = 1\nsteps = 2\n[lora]\ntargets = [\"q\", \"v\", \"q\"]\n", Some("lora.targets[2]"), 4,
     "lora.targets[2] = \"q\" is a duplicate"),
    ("empty targets", "seed = 1\nsteps = 2\n[lora]\ntargets = []\n", Some("lora.targets"), 4, "is empty"),
    ("empty task_kinds", "seed = 1\nsteps = 2\n[selfplay]\nreferences = 1\ntask_kinds = []\n",
     Some("selfplay.task_kinds"), 5, "selfplay.task_kinds = [] is empty"),
    ("duplicate task kinds", "seed = 1\nsteps = 2\n[selfplay]\ntask_kinds = [\"deduction\", \"deduction\"]\n",
     Some("selfplay.task_kinds[1]"), 4, "duplicate"),
    // ---- population
    ("solo with teachers", "seed = 1\nsteps = 2\n[population]\nmode = \"solo\"\nteachers = 2\n",
     Some("population.teachers"), 5, "population.teachers must not be given in solo mode"),
    ("solo with students_per_teacher",
     "seed = 1\nsteps = 2\n[population]\nmode = \"solo\"\n\nstudents_per_teacher = 1\n",
     Some("population.students_per_teacher"), 6, "solo mode"),
    ("evolution on in solo", "seed = 1\nsteps = 2\n[population]\nmode = \"solo\"\n[evolution]\nenabled = true\n",
     Some("evolution.enabled"), 6, "evolution.enabled = true is not allowed in solo mode"),
    ("events in solo",
     "seed = 1\nsteps = 2\npopulation.mode = \"solo\"\n[[events]]\nat = 1\nkill = \"solo-0\"\n",
     Some("events[0]"), 4, "not allowed in solo mode"),
    ("solo with one proposal per kind",
     "seed = 1\nsteps = 2\n[population]\nmode = \"solo\"\n[selfplay]\nproposals_per_teacher = 1\n",
     Some("selfplay.proposals_per_teacher"), 6,
     "selfplay.proposals_per_teacher = 1 with population.mode = \"solo\" leaves each proposer advantage group"),
    ("solo with the default proposals per kind",
     "seed = 1\nsteps = 2\n[population]\nmode = \"solo\"\n",
     Some("population.mode"), 4,
     "selfplay.proposals_per_teacher = 1 with population.mode = \"solo\""),
    ("per-member groups with one proposal per kind",
     "seed = 1\nsteps = 2\n[selfplay]\nadvantage_groups = \"per_member\"\nproposals_per_teacher = 1\n",
     Some("selfplay.advantage_groups"), 4,
     "selfplay.advantage_groups = \"per_member\" with selfplay.proposals_per_teacher = 1 leaves each teacher's advantage group (member × task kind × proposer) one rollout per step"),
    ("per-member groups with the default proposals per kind",
     "seed = 1\nsteps = 2\n[selfplay]\nadvantage_groups = \"per_member\"\n",
     Some("selfplay.advantage_groups"), 4,
     "(allowed: selfplay.proposals_per_teacher = 2.. with selfplay.advantage_groups = \"per_member\", or selfplay.advantage_groups = \"pooled\")"),
    ("per-member groups with one solver sample",
     "seed = 1\nsteps = 2\n[selfplay]\nproposals_per_teacher = 2\nsolver_samples = 1\nadvantage_groups = \"per_member\"\n",
     Some("selfplay.advantage_groups"), 6,
     "selfplay.advantage_groups = \"per_member\" with selfplay.solver_samples = 1 leaves a student's advantage group"),
    ("one subpopulation", "seed = 1\nsteps = 2\n[population]\nsubpopulations = 1\n",
     Some("population.subpopulations"), 4, "population.subpopulations = 1 is out of range (allowed 2.."),
    ("fewer teachers than subpopulations",
     "seed = 1\nsteps = 2\n[population]\nteachers = 2\nstudents = 3\nsubpopulations = 3\n",
     Some("population.teachers"), 4, "population.teachers = 2 is out of range (allowed 3..: each of the 3"),
    ("fewer students than subpopulations (students not given)",
     "seed = 1\nsteps = 2\n[population]\nteachers = 3\nsubpopulations = 3\n",
     Some("population.students"), 3, "population.students = 2"),
    ("too many students per teacher",
     "seed = 1\nsteps = 2\n[population]\nstudents = 4\nstudents_per_teacher = 3\n",
     Some("population.students_per_teacher"), 5, "(allowed 1..=2"),
    // ---- model
    ("tiny section with default source", "seed = 1\nsteps = 2\n[model]\nsource = \"default\"\n\n[model.tiny]\nlayers = 2\n",
     Some("model.tiny"), 6, "model.tiny is only allowed with model.source = \"tiny\""),
    ("tiny section without source", "seed = 1\nsteps = 2\n[model.tiny]\nlayers = 2\n", Some("model.tiny"), 3,
     "only allowed"),
    ("tiny heads do not divide hidden", "seed = 1\nsteps = 2\n[model]\nsource = \"tiny\"\ntiny = { hidden = 30, heads = 4 }\n",
     Some("model.tiny.heads"), 5, "does not divide"),
    ("tiny odd head size", "seed = 1\nsteps = 2\n[model]\nsource = \"tiny\"\n[model.tiny]\nhidden = 36\nheads = 4\nkv_heads = 4\n",
     Some("model.tiny.hidden"), 6, "odd head size 9"),
    ("unknown device", "seed = 1\nsteps = 2\n[model]\ndevice = \"gpu\"\n",
     Some("model.device"), 4, "model.device = \"gpu\" is not a device (write \"cpu\", \"cuda\" or \"cuda:N\")"),
    ("compute budget not positive", "seed = 1\nsteps = 2\nbudget_tflop = -1.5\n",
     Some("budget_tflop"), 3, "budget_tflop = -1.5 is out of range (allowed > 0)"),
    ("tiny too short for the token budget",
     "seed = 1\nsteps = 2\n[model]\nsource = \"tiny\"\n[model.tiny]\nmax_positions = 512\n",
     Some("model.tiny.max_positions"), 6, "1536.."),
    // ---- operators
    ("unknown crossover operator (registry check)",
     "seed = 1\nsteps = 2\n[evolution]\ncrossover = [\n  { op = \"ties\", weight = 1.0 },\n  { op = \"tise\", weight = 1.0 },\n]\n",
     Some("evolution.crossover[1].op"), 6, "evolution.crossover[1].op = \"tise\" is not a usable operator: unknown operator `tise`"),
    ("malformed operator string", "seed = 1\nsteps = 2\n[evolution]\nmutation = [{ op = \"svd_noise:scale\" }]\n",
     Some("evolution.mutation[0].op"), 4, "is malformed"),
    ("operator weight 0",
     "seed = 1\nsteps = 2\n[[evolution.mutation]]\nop = \"svd_noise\"\nweight = 0.0\n",
     Some("evolution.mutation[0].weight"), 5, "> 0"),
    ("no operators at all", "seed = 1\nsteps = 2\n[evolution]\ncrossover = []\nmutation = []\n",
     Some("evolution.mutation"), 5, "both empty"),
    // ---- events
    ("event at 0", "seed = 1\nsteps = 4\n[[events]]\nat = 0\nkill = \"student-0\"\n", Some("events[0].at"), 4,
     "events[0].at = 0 is out of range (allowed 1..=4 (steps))"),
    ("event after the last step",
     "seed = 1\nsteps = 4\n[[events]]\nat = 4\nkill = \"student-0\"\n[[events]]\nat = 5\nkill = \"student-1\"\n",
     Some("events[1].at"), 7, "events[1].at = 5 is out of range"),
    ("kill of a malformed id", "seed = 1\nsteps = 4\n[[events]]\nat = 1\nkill = \"student-x\"\n",
     Some("events[0].kill"), 5, "events[0].kill = \"student-x\" is not a member id"),
    ("kill with a leading zero", "seed = 1\nsteps = 4\nevents = [{ at = 1, kill = \"teacher-01\" }]\n",
     Some("events[0].kill"), 3, "not a member id"),
    ("kill of solo-0 in population mode", "seed = 1\nsteps = 4\n[[events]]\nat = 1\nkill = \"solo-0\"\n",
     Some("events[0].kill"), 5, "not a member id"),
    ("inject parent of the other role",
     "seed = 1\nsteps = 4\n[[events]]\nat = 1\ninject = { role = \"teacher\", from = [\"teacher-0\", \"student-0\"] }\n",
     Some("events[0].inject.from[1]"), 5, "is not a teacher id"),
    ("inject a solo member",
     "seed = 1\nsteps = 4\n[[events]]\nat = 1\ninject = { role = \"solo\" }\n",
     Some("events[0].inject.role"), 5, "cannot be injected"),
    ("inject with unknown operator", "seed = 1\nsteps = 4\n[[events]]\nat = 1\n[events.inject]\nrole = \"student\"\nop = \"bogus\"\n",
     Some("events[0].inject.op"), 7, "unknown operator `bogus`"),
    ("unknown weights", "seed = 1\nsteps = 2\n[model]\nweights = \"q4\"\n",
     Some("model.weights"), 4, "native"),
    ("inject unknown role", "seed = 1\nsteps = 4\n[[events]]\nat = 1\ninject = { role = \"coach\" }\n",
     Some("events[0].inject.role"), 5, "allowed: teacher, student"),
];

#[test]
fn malformed_scenarios_name_key_and_line() {
    assert!(CASES.len() >= 20);
    let mut failures = Vec::new();
    for &(what, text, key, line, fragment) in CASES {
        let error = match parse(text) {
            Ok(_) => {
                failures.push(format!("{what}: parsed fine"));
                continue;
            }
            Err(error) => error,
        };
        let rendered = error.to_string();
        let prefix = format!("{ORIGIN}:{line}: ");
        let mut ok = rendered.starts_with(&prefix) && error.line == Some(line);
        ok &= rendered.contains(fragment);
        match key {
            Some(key) => {
                ok &= rendered.contains(key) && error.key.as_deref() == Some(key);
                ok &= error.kind != ErrorKind::Syntax;
            }
            None => ok &= error.kind == ErrorKind::Syntax,
        }
        if !ok {
            failures.push(format!(
                "{what}: want line {line}, key {key:?}, fragment {fragment:?}\n    got {rendered:?} (key {:?}, {:?})",
                error.key, error.kind
            ));
        }
    }
    assert!(failures.is_empty(), "\n{}", failures.join("\n"));
}

/// TRR++ normalises within (task kind × role) groups: a solo member with one
/// proposal per kind has proposer groups of one rollout, whose advantage is
/// always 0. Validation refuses that, naming both keys, and accepts two.
#[test]
fn solo_mode_needs_two_proposals_per_kind() {
    let solo = |proposals: usize| {
        parse(&format!(
            "seed = 1\nsteps = 2\n[population]\nmode = \"solo\"\n[selfplay]\nproposals_per_teacher = {proposals}\n"
        ))
    };
    let error = solo(1).unwrap_err();
    let rendered = error.to_string();
    assert_eq!(error.kind, ErrorKind::Invalid);
    assert_eq!(error.line, Some(6), "{rendered}");
    for needed in [
        "selfplay.proposals_per_teacher = 1",
        "population.mode = \"solo\"",
        "advantage",
        "(allowed: selfplay.proposals_per_teacher = 2.. in solo mode)",
    ] {
        assert!(rendered.contains(needed), "{needed:?} missing: {rendered}");
    }
    assert_eq!(solo(2).unwrap().selfplay.proposals_per_teacher, 2);
    // In population mode the teachers share the groups: two teachers with
    // one proposal each are enough.
    let population = parse("seed = 1\nsteps = 2\n[selfplay]\nproposals_per_teacher = 1\n").unwrap();
    assert_eq!(population.population.teachers, 2);
}

#[test]
fn unreadable_file_names_the_path() {
    let error = Scenario::from_file("no/such/file.toml", check_operator).unwrap_err();
    assert_eq!(error.kind, ErrorKind::Read);
    assert!(error
        .to_string()
        .starts_with("no/such/file.toml: cannot read scenario file"));
}

#[test]
fn defaults() {
    let s = parse("seed = 3\nsteps = 10\n").unwrap();
    assert_eq!(s.name, "x", "name defaults to the file stem");
    assert_eq!((s.seed, s.steps), (3, 10));
    assert_eq!(s.model.source, ModelSource::Default);
    assert_eq!(s.model.tiny, None);
    assert_eq!(s.model.weights, WeightsSetting::Native);
    assert_eq!((s.lora.rank, s.lora.alpha, s.lora.rslora), (8, 16.0, false));
    assert_eq!(s.lora.targets, Target::ALL.to_vec());
    let p = &s.population;
    assert_eq!(p.mode, Mode::Population);
    assert_eq!(
        (
            p.teachers,
            p.students,
            p.subpopulations,
            p.students_per_teacher
        ),
        (2, 2, 2, 1)
    );
    let sp = &s.selfplay;
    assert_eq!(sp.task_kinds, TaskKind::ALL.to_vec());
    assert_eq!(
        (sp.references, sp.proposals_per_teacher, sp.solver_samples),
        (6, 1, 8)
    );
    assert_eq!((sp.max_prompt_tokens, sp.max_new_tokens), (1024, 512));
    assert!(sp.constrained && !sp.prefill_answer);
    assert_eq!((sp.temperature, sp.top_p), (1.0, 1.0));
    assert_eq!((sp.induction_inputs, sp.induction_shown), (10, 5));
    assert_eq!(
        (sp.buffer_problems, sp.advantage_groups),
        (1, AdvantageGroups::Pooled)
    );
    assert_eq!(
        (s.rewards.correct, s.rewards.malformed, s.rewards.wrong),
        (1.0, -1.0, -0.5)
    );
    let t = &s.training;
    assert_eq!(
        (t.lr, t.weight_decay, t.beta1, t.beta2, t.eps),
        (1e-4, 0.0, 0.9, 0.999, 1e-8)
    );
    assert_eq!(
        (t.clip, t.grad_clip, t.micro_batch_tokens),
        (0.2, 1.0, 2048)
    );
    let e = &s.evolution;
    assert!(e.enabled);
    assert_eq!(
        (e.every, e.cull_fraction, e.fitness_window, e.tournament),
        (5, 0.25, 3, 2)
    );
    assert_eq!(e.fitness, Fitness::RecentReward);
    assert_eq!(
        e.crossover,
        vec![
            WeightedOperator::new("ties", 1.0),
            WeightedOperator::new("dare:drop=0.5", 1.0)
        ]
    );
    assert_eq!(e.mutation, vec![WeightedOperator::new("svd_noise", 1.0)]);
    let v = &s.verifier;
    assert_eq!((v.workers, v.timeout_ms, v.memory_mb), (2, 2000, 512));
    assert_eq!(s.checkpoint.every, 5);
    assert!(s.events.is_empty());
    assert_eq!(
        s.member_ids(),
        ["teacher-0", "teacher-1", "student-0", "student-1"]
    );
}

#[test]
fn resolved_defaults_depend_on_other_keys() {
    let tiny =
        parse("seed = 1\nsteps = 2\nmodel.source = \"tiny\"\nselfplay.max_prompt_tokens = 128\nselfplay.max_new_tokens = 384\n")
            .unwrap();
    assert_eq!(tiny.model.tiny, Some(TinyModelSection::default()));

    let solo = parse(
        "name = \"b\"\nseed = 1\nsteps = 2\n[population]\nmode = \"solo\"\n[selfplay]\nproposals_per_teacher = 2\n",
    )
    .unwrap();
    assert_eq!(solo.name, "b");
    assert!(
        !solo.evolution.enabled,
        "evolution defaults to off in solo mode"
    );
    assert_eq!(solo.member_ids(), ["solo-0"]);
    assert_eq!((solo.population.teachers, solo.population.students), (1, 1));
    assert_eq!(solo.subpopulation_of(0), 0);

    let path = parse("seed = 1\nsteps = 2\nmodel.source = \"models/smollm2.gguf\"\n").unwrap();
    assert_eq!(
        path.model.source,
        ModelSource::Path("models/smollm2.gguf".into())
    );
}

#[test]
fn buffer_problems_and_advantage_groups_reach_the_step() {
    let s = parse(
        "seed = 1\nsteps = 2\n[selfplay]\nbuffer_problems = 0\nadvantage_groups = \"per_member\"\nproposals_per_teacher = 2\n",
    )
    .unwrap();
    let settings = populora::selfplay::Settings::from_scenario(&s);
    assert_eq!(settings.buffer_problems, 0);
    assert_eq!(settings.advantage_groups, AdvantageGroups::PerMember);
    let err =
        parse("seed = 1\nsteps = 2\n[selfplay]\nadvantage_groups = \"members\"\n").unwrap_err();
    assert!(err.to_string().contains("advantage_groups"), "{err}");
}

#[test]
fn members_and_subpopulations() {
    let s = parse(
        "seed = 1\nsteps = 2\n[population]\nteachers = 3\nstudents = 5\nsubpopulations = 3\n",
    )
    .unwrap();
    assert_eq!(
        s.member_ids(),
        [
            "teacher-0",
            "teacher-1",
            "teacher-2",
            "student-0",
            "student-1",
            "student-2",
            "student-3",
            "student-4"
        ]
    );
    let groups: Vec<usize> = (0..5).map(|j| s.subpopulation_of(j)).collect();
    assert_eq!(groups, [0, 1, 2, 0, 1]);
    assert_eq!(parse_member_id("student-12"), Some(("student", 12)));
    assert_eq!(parse_member_id("teacher-0"), Some(("teacher", 0)));
    for bad in [
        "teacher-",
        "teacher-01",
        "coach-1",
        "student-+1",
        "student1",
        "",
    ] {
        assert_eq!(parse_member_id(bad), None, "{bad}");
    }
}

#[test]
fn events_parse_into_actions() {
    let s = shipped("tiny.toml");
    assert_eq!(s.events.len(), 2);
    assert_eq!(
        s.events[0].action,
        EventAction::Inject(Injection {
            role: Role::Student,
            from: Some(vec!["student-0".into()]),
            op: Some("svd_noise".into()),
        })
    );
    assert_eq!(
        (s.events[1].at, &s.events[1].action),
        (3, &EventAction::Kill("student-0".into()))
    );
}

#[test]
fn to_toml_round_trips() {
    let mut scenarios: Vec<Scenario> = [
        "tiny.toml",
        "quickstart.toml",
        "populora-4t4s.toml",
        "baseline-solo.toml",
    ]
    .into_iter()
    .map(shipped)
    .collect();
    scenarios.push(parse("seed = 1\nsteps = 2\n").unwrap());
    scenarios.push(
        parse("seed = 1\nsteps = 9\n[[events]]\nat = 2\ninject = { role = \"teacher\" }\n[[events]]\nat = 2\nkill = \"teacher-0\"\n")
            .unwrap(),
    );
    for scenario in scenarios {
        let text = scenario.to_toml();
        for key in [
            "weights = \"native\"",
            "micro_batch_tokens",
            "induction_shown",
            "memory_mb",
            "cull_fraction",
            "[checkpoint]",
        ] {
            assert!(text.contains(key), "{key} missing from\n{text}");
        }
        // A different origin: the name is written out, so the stem must not matter.
        let again = Scenario::parse(&text, "runs/abc/scenario.toml", check_operator)
            .unwrap_or_else(|e| panic!("{e}\n{text}"));
        assert_eq!(again, scenario, "\n{text}");
        assert_eq!(again.to_toml(), text);
    }
}

#[test]
fn shipped_scenarios_parse() {
    let tiny = shipped("tiny.toml");
    assert_eq!(tiny.model.source, ModelSource::Tiny);
    assert_eq!(
        (tiny.steps, tiny.evolution.every, tiny.checkpoint.every),
        (4, 2, 2)
    );
    assert_eq!(
        (tiny.selfplay.max_new_tokens, tiny.selfplay.solver_samples),
        (128, 2)
    );

    let solo_quick = shipped("solo-quick.toml");
    assert_eq!(solo_quick.member_ids(), ["solo-0"]);

    let quick = shipped("quickstart.toml");
    assert_eq!(quick.name, "quickstart");
    assert_eq!(quick.model.source, ModelSource::Default);
    assert_eq!(quick.lora.targets, [Target::Q, Target::V]);
    assert_eq!(quick.training.lr, 5e-5);
    assert_eq!(quick.member_ids().len(), 4);

    let paper = shipped("populora-4t4s.toml");
    assert_eq!(
        (paper.population.teachers, paper.population.students),
        (4, 4)
    );
    assert_eq!(
        (
            paper.steps,
            paper.evolution.every,
            paper.selfplay.max_new_tokens
        ),
        (200, 10, 512)
    );

    let solo = shipped("baseline-solo.toml");
    assert_eq!(solo.population.mode, Mode::Solo);
    assert!(!solo.evolution.enabled);
    // The same token settings as 4t4s; its steps only bound it, as
    // experiments/paper-4t4s.toml matches the two runs' compute.
    assert!(solo.steps >= 4 * paper.steps);
    // ... but two proposals per task kind: the solo proposer's advantage
    // groups need two rollouts per step.
    let mut selfplay = paper.selfplay.clone();
    selfplay.proposals_per_teacher = 2;
    assert_eq!(solo.selfplay, selfplay);
    assert_eq!(solo.lora, paper.lora);
}

#[test]
fn shipped_experiments_load() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("experiments");
    for file in [
        "quick.toml",
        "paper-4t4s.toml",
        "small-4t4s.toml",
        "confirm-4t4s.toml",
    ] {
        let loaded = Experiment::from_file(&root.join(file), check_operator)
            .unwrap_or_else(|e| panic!("{e}"));
        let (p, b) = (&loaded.population, &loaded.baseline);
        assert_eq!(p.population.mode, Mode::Population, "{file}");
        assert_eq!(b.population.mode, Mode::Solo, "{file}");
        // The same self-play settings, but for the solo proposer's two
        // proposals per task kind (its advantage groups need two rollouts).
        let mut selfplay = p.selfplay.clone();
        selfplay.proposals_per_teacher = 2;
        assert_eq!(selfplay, b.selfplay, "{file}: the same self-play settings");
        assert_eq!(p.lora, b.lora, "{file}: the same adapter shape");
        assert_eq!(
            b.budget_tflop, None,
            "{file}: the experiment sets the budget"
        );
    }
    // Issue 56's pre-registered experiment: small-4t4s's arms on fresh
    // seeds, on the native weights, matched per adapter alone.
    let load = |file: &str| Experiment::from_file(&root.join(file), check_operator).unwrap();
    let (small, confirm) = (load("small-4t4s.toml"), load("confirm-4t4s.toml"));
    assert_eq!(confirm.experiment.matching, vec![Matching::PerAdapter]);
    assert_eq!(confirm.seeds(), vec![4, 5, 6, 7, 8]);
    for (a, b) in [
        (&small.population, &confirm.population),
        (&small.baseline, &confirm.baseline),
    ] {
        let mut keys = a.differing_keys(b);
        keys.retain(|k| k != "name");
        assert_eq!(keys, vec!["model.weights".to_string()]);
        assert_eq!(b.model.weights, WeightsSetting::Native);
    }
}

/// The two arms may differ only in what defines an arm (population,
/// evolution, steps, proposals per teacher, events, checkpoints) and what
/// the experiment sets (name, seed, budget); any other key is refused, each
/// differing key named, `[training]`, `[lora]`, the rewards and the rest of
/// `[selfplay]` included.
#[test]
fn an_experiments_arms_differ_only_in_what_defines_an_arm() {
    let dir = std::env::temp_dir().join(format!("populora-arms-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("experiments");
    let population = std::fs::read_to_string(root.join("quick-population.toml")).unwrap();
    let baseline = std::fs::read_to_string(root.join("quick-baseline.toml")).unwrap();
    std::fs::write(dir.join("p.toml"), &population).unwrap();
    let experiment = dir.join("e.toml");
    std::fs::write(
        &experiment,
        "population = \"p.toml\"\nbaseline = \"b.toml\"\n",
    )
    .unwrap();
    let load = |baseline_text: &str| {
        std::fs::write(dir.join("b.toml"), baseline_text).unwrap();
        Experiment::from_file(&experiment, check_operator)
    };
    let loaded = load(&baseline).unwrap_or_else(|e| panic!("{e}"));
    assert!(
        loaded.population.checkpoint != loaded.baseline.checkpoint
            || loaded.population.steps != loaded.baseline.steps
    );
    let edited = format!(
        "{}\n[rewards]\nwrong = -0.25\n",
        baseline.replace("lr = 5e-5", "lr = 0.5").replace(
            "[selfplay]\n",
            "[selfplay]\nshare_prefixes = false\nadvantage_groups = \"pooled\"\n"
        )
    );
    let err = load(&edited).unwrap_err().to_string();
    for key in ["training.lr", "rewards.wrong", "selfplay.share_prefixes"] {
        assert!(err.contains(key), "{key}: {err}");
    }
    // advantage_groups = "pooled" is the default: not a difference.
    assert!(!err.contains("advantage_groups"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn malformed_experiments_name_the_key() {
    let dir = std::env::temp_dir().join(format!("populora-experiments-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let scenarios = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios");
    let (pop, solo) = (
        scenarios.join("tiny.toml"),
        scenarios.join("baseline-solo.toml"),
    );
    let cases = [
        (
            format!("population = {pop:?}\nbaseline = {pop:?}\n"),
            "baseline",
            "solo",
        ),
        (
            format!("population = {solo:?}\nbaseline = {solo:?}\n"),
            "population",
            "population",
        ),
        (
            format!("population = {pop:?}\nbaseline = {solo:?}\n"),
            "baseline",
            "model.source",
        ),
        (
            format!("population = {pop:?}\nbaseline = {solo:?}\n[eval]\nbootstrap = 5\n"),
            "eval.bootstrap",
            "100..",
        ),
        (
            format!("population = {pop:?}\nbaseline = {solo:?}\n[eval]\nbenchmarks = [\"mmlu\"]\n"),
            "eval.benchmarks",
            "mmlu",
        ),
        (
            format!("population = {pop:?}\nbaseline = {solo:?}\nrepeats = 3\n"),
            "repeats",
            "unknown",
        ),
        (
            format!("population = {pop:?}\nbaseline = {solo:?}\nseeds = [1, 2, 1]\n"),
            "seeds",
            "each seed once",
        ),
        (
            format!("population = {pop:?}\nbaseline = {solo:?}\nmatching = []\n"),
            "matching",
            "each once",
        ),
        (
            format!(
                "population = {pop:?}\nbaseline = {solo:?}\nmatching = [\"total\", \"total\"]\n"
            ),
            "matching",
            "each once",
        ),
        (
            format!("population = {pop:?}\nbaseline = {solo:?}\nmatching = [\"strict\"]\n"),
            "matching",
            "strict",
        ),
        (
            format!("population = {pop:?}\nbaseline = {solo:?}\n[eval]\nselection = 1.0\n"),
            "eval.selection",
            "0 < selection < 1",
        ),
    ];
    for (i, (text, key, fragment)) in cases.iter().enumerate() {
        let file = dir.join(format!("e{i}.toml"));
        std::fs::write(&file, text).unwrap();
        let err = Experiment::from_file(&file, check_operator).unwrap_err();
        assert!(
            err.to_string().contains(fragment) && err.key.as_deref().unwrap_or("").contains(key),
            "{text}: {err} ({:?})",
            err.key
        );
    }
    let missing = Experiment::from_file(&dir.join("absent.toml"), check_operator).unwrap_err();
    assert_eq!(missing.kind, ErrorKind::Read);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn validate_scenarios_built_in_code() {
    let mut s = shipped("quickstart.toml");
    assert!(s.validate(check_operator).is_ok());
    s.lora.rank = 0;
    let error = s.validate(check_operator).unwrap_err();
    assert_eq!(
        error.to_string(),
        "quickstart: lora.rank = 0 is out of range (allowed 1..=256)"
    );
}

/// xorshift64*: a fixed-seed stream for the fuzz test (no rand dependency).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

#[test]
fn never_panics_on_mutated_input() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios");
    let mut corpus: Vec<String> = [
        "tiny.toml",
        "quickstart.toml",
        "populora-4t4s.toml",
        "baseline-solo.toml",
    ]
    .iter()
    .map(|f| std::fs::read_to_string(dir.join(f)).unwrap())
    .collect();
    corpus.push("seed = 1\nsteps = 3\n".to_string());
    corpus.push(
        "seed = 1\nsteps = 3\n[population]\nmode = \"solo\"\n[selfplay]\nproposals_per_teacher = 2\n"
            .to_string(),
    );
    let tokens = [
        "0",
        "-1",
        "1",
        "2",
        "3",
        "999999999999999999999",
        "9223372036854775807",
        "-9223372036854775808",
        "1e308",
        "-0.0",
        "nan",
        "inf",
        "\"\"",
        "\"solo\"",
        "\"tiny\"",
        "\"teacher-0\"",
        "\"student-99\"",
        "[]",
        "{}",
        "[[events]]",
        "[model.tiny]",
        "[population]",
        "=",
        "\n",
        "\"",
        "[",
        "]",
        "{",
        ",",
        "at = 1",
        "kill = \"x\"",
        "mode = \"solo\"",
        "source = \"tiny\"",
        "\u{0}",
        "é",
        "#",
    ];
    let mut rng = Rng(0x5eed_1234_abcd_0001);
    let mut parsed = 0;
    for _ in 0..2000 {
        let mut text: Vec<u8> = corpus[rng.below(corpus.len())].clone().into_bytes();
        let mutations = if rng.below(2) == 0 {
            1
        } else {
            1 + rng.below(4)
        };
        for _ in 0..mutations {
            match rng.below(8) {
                // Replace the value of a random `key = value` line.
                0..=2 => {
                    let mut lines: Vec<Vec<u8>> =
                        text.split(|&b| b == b'\n').map(|l| l.to_vec()).collect();
                    let at = rng.below(lines.len());
                    if let Some(eq) = lines[at].iter().position(|&b| b == b'=') {
                        let token = tokens[rng.below(tokens.len())].as_bytes();
                        lines[at].truncate(eq + 1);
                        lines[at].push(b' ');
                        lines[at].extend_from_slice(token);
                    }
                    text = lines.join(&b'\n');
                }
                // Splice a random token in.
                3 => {
                    let at = rng.below(text.len() + 1);
                    let end = (at + rng.below(4)).min(text.len());
                    let token = tokens[rng.below(tokens.len())].as_bytes();
                    text.splice(at..end, token.iter().copied());
                }
                // Flip a byte.
                4 => {
                    if !text.is_empty() {
                        let at = rng.below(text.len());
                        text[at] = (rng.next() & 0x7f) as u8;
                    }
                }
                // Delete a line.
                5 => {
                    let lines: Vec<&[u8]> = text.split(|&b| b == b'\n').collect();
                    let skip = rng.below(lines.len());
                    let kept: Vec<&[u8]> = lines
                        .iter()
                        .enumerate()
                        .filter(|(i, _)| *i != skip)
                        .map(|(_, l)| *l)
                        .collect();
                    text = kept.join(&b'\n');
                }
                // Duplicate a line.
                6 => {
                    let lines: Vec<Vec<u8>> =
                        text.split(|&b| b == b'\n').map(|l| l.to_vec()).collect();
                    let copy = rng.below(lines.len());
                    let mut out = lines.clone();
                    out.insert(rng.below(lines.len() + 1), lines[copy].clone());
                    text = out.join(&b'\n');
                }
                // Random bytes.
                _ => {
                    let at = rng.below(text.len() + 1);
                    let junk: Vec<u8> = (0..rng.below(8))
                        .map(|_| (rng.next() & 0xff) as u8)
                        .collect();
                    text.splice(at..at, junk);
                }
            }
        }
        let text = String::from_utf8_lossy(&text);
        match parse(&text) {
            Ok(scenario) => {
                parsed += 1;
                let again = parse(&scenario.to_toml()).expect("resolved copy parses");
                assert_eq!(again, scenario);
            }
            Err(error) => {
                let rendered = error.to_string();
                assert!(rendered.starts_with(ORIGIN), "{rendered}");
            }
        }
    }
    eprintln!("fuzz: {parsed} of 2000 mutants parsed");
    assert!(
        parsed > 100,
        "too few mutants parsed ({parsed}); the fuzz is not reaching validation"
    );
}

/// A recorded scenario.toml keeps the run's `[model] weights`; one written
/// before the key existed means f32 (so `replay` and `resume` of older runs
/// stay bit-identical), while a new scenario without it means native.
#[test]
fn recorded_scenarios_without_weights_mean_f32() {
    let dir = std::env::temp_dir().join(format!("populora-weights-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let recorded = dir.join("scenario.toml");
    let new = parse("seed = 1\nsteps = 2\n").unwrap();
    assert_eq!(new.model.weights, WeightsSetting::Native);
    let text = new.to_toml();
    std::fs::write(&recorded, &text).unwrap();
    let again = Scenario::from_recorded_file(&recorded, check_operator).unwrap();
    assert_eq!(again.model.weights, WeightsSetting::Native);
    let older: String = text
        .lines()
        .filter(|l| !l.starts_with("weights ="))
        .map(|l| format!("{l}\n"))
        .collect();
    assert_ne!(older, text);
    std::fs::write(&recorded, &older).unwrap();
    let old = Scenario::from_recorded_file(&recorded, check_operator).unwrap();
    assert_eq!(old.model.weights, WeightsSetting::F32);
    assert_eq!(
        Scenario::from_file(&recorded, check_operator)
            .unwrap()
            .model
            .weights,
        WeightsSetting::Native
    );
    let _ = std::fs::remove_dir_all(&dir);
}
