//! Ranges and cross-key rules, and the conversion of toml's errors into `ScenarioError`s.

use super::source_map::SourceMap;
use super::{
    parse_member_id, AdvantageGroups, ErrorKind, EventAction, Mode, ModelSource, Scenario,
    ScenarioError, SelfPlaySection, WeightedOperator,
};
use crate::task::grammar::{reply_grammar, ReplyShape};
use crate::task::Role;
use std::collections::BTreeSet;
use std::fmt::Display;

type OperatorCheck<'a> = &'a dyn Fn(&str) -> Result<(), String>;

// ---------------------------------------------------------------- toml's errors

/// Bad TOML: toml's message at toml's line.
pub(super) fn syntax_error(
    error: &toml::de::Error,
    map: &SourceMap,
    origin: &str,
) -> ScenarioError {
    ScenarioError {
        origin: origin.to_string(),
        line: error.span().map(|span| map.line_of_offset(span.start)),
        key: None,
        kind: ErrorKind::Syntax,
        message: one_line(error.message()),
    }
}

/// Valid TOML that serde rejected (unknown key, wrong type, missing key, bad variant):
/// toml's message, rephrased where it helps, with the dotted key its span points at.
pub(super) fn schema_error(
    error: &toml::de::Error,
    map: &SourceMap,
    origin: &str,
) -> ScenarioError {
    let message = one_line(error.message());
    let span = error.span().unwrap_or(0..0);
    let line = error.span().map(|span| map.line_of_offset(span.start));
    let located = map.path_at(&span);

    let (key, message) = if let Some(rest) = message.strip_prefix("unknown field `") {
        let (field, expected) = split_name(rest);
        // The span is the unknown key itself, so `located` normally ends with it.
        let key = if last_segment(&located) == field {
            located
        } else {
            join(&located, field)
        };
        let expected = backticked(expected);
        let expected = if expected.is_empty() {
            "this table takes no keys".to_string()
        } else {
            format!("expected one of: {}", expected.join(", "))
        };
        let message = format!("unknown key `{key}` ({expected})");
        (key, message)
    } else if let Some(rest) = message.strip_prefix("missing field `") {
        let (field, _) = split_name(rest);
        // The root table's span is the whole document, which `path_at` cannot tell
        // from its first key; only the root has required `seed` and `steps`.
        let at_root = matches!(field, "seed" | "steps") && !map.contains(field);
        let key = if at_root {
            field.to_string()
        } else {
            join(&located, field)
        };
        let message = format!("missing required key `{key}`");
        (key, message)
    } else if let Some(rest) = message.strip_prefix("unknown variant `") {
        let (value, expected) = split_name(rest);
        let message = format!(
            "{} = {value:?} is not allowed (allowed: {})",
            display_key(&located),
            backticked(expected).join(", ")
        );
        (located, message)
    } else if located.is_empty() {
        (located, message)
    } else {
        let message = format!("{located}: {message}");
        (located, message)
    };
    ScenarioError {
        origin: origin.to_string(),
        line,
        key: Some(display_key(&key).to_string()),
        kind: ErrorKind::Schema,
        message,
    }
}

/// toml's message on one line, with Rust type names said in TOML words.
fn one_line(message: &str) -> String {
    message
        .trim()
        .replace('\n', "; ")
        .replace("expected usize", "expected a non-negative integer")
        .replace("expected u64", "expected a non-negative integer")
        .replace("expected f64", "expected a number")
}

/// "name`, rest" → ("name", ", rest") (serde quotes names in backticks).
fn split_name(rest: &str) -> (&str, &str) {
    match rest.find("`, ") {
        Some(at) => (&rest[..at], &rest[at + 1..]),
        None => (rest.strip_suffix('`').unwrap_or(rest), ""),
    }
}

/// Every `quoted` word in serde's "expected one of `a`, `b`" lists.
fn backticked(text: &str) -> Vec<&str> {
    text.split('`').skip(1).step_by(2).collect()
}

fn last_segment(path: &str) -> &str {
    path.rsplit('.').next().unwrap_or(path)
}

fn join(table: &str, key: &str) -> String {
    if table.is_empty() {
        key.to_string()
    } else {
        format!("{table}.{key}")
    }
}

fn display_key(key: &str) -> &str {
    if key.is_empty() {
        "(document root)"
    } else {
        key
    }
}

// ---------------------------------------------------------------- semantic checks

/// Builds located errors for semantic checks.
struct Validator<'a> {
    map: Option<&'a SourceMap>,
    origin: &'a str,
}

impl Validator<'_> {
    fn fail(&self, key: &str, message: String) -> ScenarioError {
        ScenarioError {
            origin: self.origin.to_string(),
            line: self.map.and_then(|map| map.line_of_key(key)),
            key: Some(key.to_string()),
            kind: ErrorKind::Invalid,
            message,
        }
    }

    /// `key = value is out of range (allowed ...)` unless `ok`.
    fn range(
        &self,
        ok: bool,
        key: &str,
        value: impl Display,
        allowed: impl Display,
    ) -> Result<(), ScenarioError> {
        if ok {
            Ok(())
        } else {
            Err(self.fail(
                key,
                format!("{key} = {value} is out of range (allowed {allowed})"),
            ))
        }
    }

    fn given(&self, key: &str) -> bool {
        self.map.is_some_and(|map| map.contains(key))
    }

    /// A list of enum values: non-empty, each at most once.
    fn unique_list<T: Ord + Copy + std::fmt::Debug>(
        &self,
        key: &str,
        items: &[T],
        allowed: &str,
    ) -> Result<(), ScenarioError> {
        if items.is_empty() {
            return Err(self.fail(
                key,
                format!("{key} = [] is empty (allowed: a non-empty list of {allowed})"),
            ));
        }
        let mut seen = BTreeSet::new();
        for (index, item) in items.iter().enumerate() {
            if !seen.insert(*item) {
                let item_key = format!("{key}[{index}]");
                return Err(self.fail(
                    &item_key,
                    format!(
                        "{item_key} = \"{}\" is a duplicate (each of {allowed} at most once)",
                        format!("{item:?}").to_lowercase()
                    ),
                ));
            }
        }
        Ok(())
    }

    /// An operator string: well-formed, then accepted by the registry.
    fn operator(&self, key: &str, op: &str, check: OperatorCheck) -> Result<(), ScenarioError> {
        if let Err(why) = crate::evolve::OperatorSpec::parse(op) {
            return Err(self.fail(
                key,
                format!("{key} = {op:?} is malformed: {why} (allowed: \"name\" or \"name:param=value,...\")"),
            ));
        }
        check(op).map_err(|why| {
            self.fail(
                key,
                format!("{key} = {op:?} is not a usable operator: {why}"),
            )
        })
    }
}

fn finite_in(value: f64, low: f64, high: f64) -> bool {
    value.is_finite() && value >= low && value <= high
}

pub(super) fn validate(
    scenario: &Scenario,
    map: Option<&SourceMap>,
    origin: &str,
    check: OperatorCheck,
) -> Result<(), ScenarioError> {
    let v = Validator { map, origin };
    let name_ok = !scenario.name.is_empty()
        && scenario.name != "."
        && scenario.name != ".."
        && !scenario
            .name
            .chars()
            .any(|c| c == '/' || c == '\\' || c.is_control());
    if !name_ok {
        return Err(v.fail(
            "name",
            format!(
                "name = {:?} is not a usable run name (allowed: non-empty, no `/`, `\\` or control characters, not `.` or `..`)",
                scenario.name
            ),
        ));
    }
    v.range(scenario.steps >= 1, "steps", scenario.steps, "1..")?;
    if let Some(budget) = scenario.budget_tflop {
        v.range(
            budget.is_finite() && budget > 0.0,
            "budget_tflop",
            budget,
            "> 0",
        )?;
    }
    model(&v, scenario)?;
    lora(&v, scenario)?;
    population(&v, scenario)?;
    selfplay(&v, scenario)?;
    advantage_groups(&v, scenario)?;
    rewards_and_training(&v, scenario)?;
    evolution(&v, scenario, check)?;
    let verifier = &scenario.verifier;
    let workers = verifier.workers;
    v.range(
        (1..=64).contains(&workers),
        "verifier.workers",
        workers,
        "1..=64",
    )?;
    let timeout = verifier.timeout_ms;
    v.range(
        (10..=60000).contains(&timeout),
        "verifier.timeout_ms",
        timeout,
        "10..=60000",
    )?;
    let memory = verifier.memory_mb;
    v.range(
        (64..=16384).contains(&memory),
        "verifier.memory_mb",
        memory,
        "64..=16384",
    )?;
    let every = scenario.checkpoint.every;
    v.range(every >= 1, "checkpoint.every", every, "1..")?;
    for (i, &mark) in scenario.checkpoint.at_tflop.iter().enumerate() {
        let key = format!("checkpoint.at_tflop[{i}]");
        v.range(mark.is_finite() && mark > 0.0, &key, mark, "> 0")?;
    }
    seeding(&v, &scenario.seeding)?;
    cluster(&v, scenario)?;
    events(&v, scenario, check)
}

fn seeding(v: &Validator, s: &super::SeedingSection) -> Result<(), ScenarioError> {
    v.range(s.entries <= 4096, "seeding.entries", s.entries, "0..=4096")?;
    v.range(
        (1..=512).contains(&s.batch),
        "seeding.batch",
        s.batch,
        "1..=512",
    )?;
    v.range(s.max_rounds >= 1, "seeding.max_rounds", s.max_rounds, "1..")
}

fn cluster(v: &Validator, s: &Scenario) -> Result<(), ScenarioError> {
    let c = &s.cluster;
    for (i, node) in c.nodes.iter().enumerate() {
        let key = format!("cluster.nodes[{i}]");
        if let Err(why) = super::cluster::check_address(node) {
            return Err(v.fail(&key, format!("{key} = {why}")));
        }
        if c.nodes[..i].contains(node) {
            return Err(v.fail(&key, format!("{key} = {node:?} is listed twice")));
        }
    }
    for (member, node) in &c.pins {
        let key = format!("cluster.pins.{member}");
        if super::parse_member_id(member).is_none() {
            return Err(v.fail(
                &key,
                format!("{key}: {member:?} is not a member id (teacher-N, student-N, solo-N)"),
            ));
        }
        if !c.nodes.contains(node) {
            return Err(v.fail(&key, format!("{key} = {node:?} is not in cluster.nodes")));
        }
    }
    Ok(())
}

fn model(v: &Validator, s: &Scenario) -> Result<(), ScenarioError> {
    if let Err(why) = crate::base::device::parse(&s.model.device) {
        return Err(v.fail("model.device", format!("model.device = {why}")));
    }
    let Some(tiny) = &s.model.tiny else {
        return Ok(());
    };
    if s.model.source != ModelSource::Tiny {
        let source = String::from(s.model.source.clone());
        return Err(v.fail(
            "model.tiny",
            format!("model.tiny is only allowed with model.source = \"tiny\" (model.source = {source:?})"),
        ));
    }
    for (key, value) in [
        ("model.tiny.layers", tiny.layers),
        ("model.tiny.hidden", tiny.hidden),
        ("model.tiny.heads", tiny.heads),
        ("model.tiny.kv_heads", tiny.kv_heads),
        ("model.tiny.ffn", tiny.ffn),
        ("model.tiny.max_positions", tiny.max_positions),
    ] {
        v.range(value >= 1, key, value, "1..")?;
    }
    let vocab = tiny.vocab;
    v.range(
        (259..=262_144).contains(&vocab),
        "model.tiny.vocab",
        vocab,
        "259..=262144",
    )?;
    if tiny.hidden % tiny.heads != 0 {
        return Err(v.fail(
            "model.tiny.heads",
            format!(
                "model.tiny.heads = {} does not divide model.tiny.hidden = {} (allowed: a divisor of hidden)",
                tiny.heads, tiny.hidden
            ),
        ));
    }
    if tiny.heads % tiny.kv_heads != 0 {
        return Err(v.fail(
            "model.tiny.kv_heads",
            format!(
                "model.tiny.kv_heads = {} does not divide model.tiny.heads = {} (allowed: a divisor of heads)",
                tiny.kv_heads, tiny.heads
            ),
        ));
    }
    let head_size = tiny.hidden / tiny.heads;
    if head_size % 2 != 0 {
        return Err(v.fail(
            "model.tiny.hidden",
            format!(
                "model.tiny.hidden = {} gives an odd head size {head_size} with {} heads (allowed: hidden / heads even, for RoPE)",
                tiny.hidden, tiny.heads
            ),
        ));
    }
    Ok(())
}

fn lora(v: &Validator, s: &Scenario) -> Result<(), ScenarioError> {
    let lora = &s.lora;
    v.range(
        (1..=256).contains(&lora.rank),
        "lora.rank",
        lora.rank,
        "1..=256",
    )?;
    let alpha_ok = lora.alpha.is_finite() && lora.alpha > 0.0;
    v.range(alpha_ok, "lora.alpha", lora.alpha, "> 0")?;
    v.unique_list("lora.targets", &lora.targets, "q, k, v, o, gate, up, down")
}

fn population(v: &Validator, s: &Scenario) -> Result<(), ScenarioError> {
    let p = &s.population;
    if p.mode == Mode::Solo {
        for key in [
            "teachers",
            "students",
            "subpopulations",
            "students_per_teacher",
        ] {
            let key = format!("population.{key}");
            if v.given(&key) {
                return Err(v.fail(
                    &key,
                    format!("{key} must not be given in solo mode (one member, solo-0, plays both roles)"),
                ));
            }
        }
        if s.evolution.enabled {
            return Err(v.fail(
                "evolution.enabled",
                "evolution.enabled = true is not allowed in solo mode (allowed: false; one member has nobody to be selected against)".into(),
            ));
        }
        if !s.events.is_empty() {
            return Err(v.fail(
                "events[0]",
                "events[0] is not allowed in solo mode (scripted events need population mode; solo mode has one member, solo-0)".into(),
            ));
        }
        return Ok(());
    }
    let groups = p.subpopulations;
    v.range(p.teachers >= 1, "population.teachers", p.teachers, "1..")?;
    v.range(p.students >= 1, "population.students", p.students, "1..")?;
    v.range(
        groups >= 2,
        "population.subpopulations",
        groups,
        "2.. in population mode: cross-evaluation needs a second sub-population",
    )?;
    for (key, count, role) in [
        ("population.teachers", p.teachers, "teacher"),
        ("population.students", p.students, "student"),
    ] {
        v.range(
            count >= groups,
            key,
            count,
            format_args!("{groups}..: each of the {groups} sub-populations needs a {role}"),
        )?;
    }
    // Round-robin assignment: the largest sub-population holds ceil(S / G) students,
    // so a teacher there sees S - ceil(S / G) students from elsewhere.
    let outside = p.students - p.students.div_ceil(groups);
    v.range(
        (1..=outside).contains(&p.students_per_teacher),
        "population.students_per_teacher",
        p.students_per_teacher,
        format_args!(
            "1..={outside}: students outside a teacher's sub-population, with {} students in {groups} sub-populations",
            p.students
        ),
    )
}

fn selfplay(v: &Validator, s: &Scenario) -> Result<(), ScenarioError> {
    let sp = &s.selfplay;
    v.unique_list(
        "selfplay.task_kinds",
        &sp.task_kinds,
        "deduction, abduction, induction",
    )?;
    v.range(
        sp.references <= 32,
        "selfplay.references",
        sp.references,
        "0..=32",
    )?;
    let proposals = sp.proposals_per_teacher;
    v.range(
        proposals >= 1,
        "selfplay.proposals_per_teacher",
        proposals,
        "1..",
    )?;
    v.range(
        sp.solver_samples >= 1,
        "selfplay.solver_samples",
        sp.solver_samples,
        "1..",
    )?;
    v.range(
        sp.buffer_problems <= 32,
        "selfplay.buffer_problems",
        sp.buffer_problems,
        "0..=32",
    )?;
    let prompt = sp.max_prompt_tokens;
    v.range(
        (64..=8192).contains(&prompt),
        "selfplay.max_prompt_tokens",
        prompt,
        "64..=8192",
    )?;
    let new = sp.max_new_tokens;
    v.range(
        (8..=4096).contains(&new),
        "selfplay.max_new_tokens",
        new,
        "8..=4096",
    )?;
    let temperature = sp.temperature;
    let temperature_ok = finite_in(temperature, 0.0, 2.0);
    v.range(
        temperature_ok,
        "selfplay.temperature",
        temperature,
        "0.0..=2.0; 0 = greedy",
    )?;
    let top_p_ok = sp.top_p.is_finite() && sp.top_p > 0.0 && sp.top_p <= 1.0;
    v.range(top_p_ok, "selfplay.top_p", sp.top_p, "0 < top_p <= 1")?;
    let inputs = sp.induction_inputs;
    v.range(inputs >= 2, "selfplay.induction_inputs", inputs, "2..")?;
    v.range(
        sp.induction_shown >= 1 && sp.induction_shown < inputs,
        "selfplay.induction_shown",
        sp.induction_shown,
        format_args!(
            "1..={}: fewer than selfplay.induction_inputs = {inputs}, the rest score the answer",
            inputs - 1
        ),
    )?;
    if sp.constrained {
        v.range(
            !sp.prefill_answer,
            "selfplay.prefill_answer",
            sp.prefill_answer,
            "false while selfplay.constrained = true: the grammar writes every reply's fixed text",
        )?;
        reply_budget(v, sp)?;
    }
    if let (ModelSource::Tiny, Some(tiny)) = (&s.model.source, &s.model.tiny) {
        let needed = prompt + new;
        v.range(
            tiny.max_positions >= needed,
            "model.tiny.max_positions",
            tiny.max_positions,
            format_args!(
                "{needed}..: room for selfplay.max_prompt_tokens + selfplay.max_new_tokens = {prompt} + {new}"
            ),
        )?;
    }
    Ok(())
}

/// TRR++ normalises rewards within each (task kind × role) group of a step's
/// batch, so a group that can only ever hold one rollout has advantage 0 at
/// every step: that role never learns on that kind. Per step and task kind,
/// the proposer group holds exactly proposers × `proposals_per_teacher`
/// rollouts (proposers: the teachers, or the solo member); the solver group
/// holds up to as many problems × solvers per problem × `solver_samples`,
/// never fewer than the proposer group can, so one rule covers both. (In
/// population mode the earlier checks give at least two teachers; a kill
/// that would leave one is refused at run time.)
///
/// With `per_member` groups, each member's own rollouts form its groups: a
/// teacher's proposer group holds `proposals_per_teacher` rollouts, and a
/// student's solver group holds `solver_samples` per problem of that kind,
/// where a step can give a student a single problem of a kind (one buffer
/// problem, or one valid proposal from its matched teachers). So both must
/// be 2 or more.
fn advantage_groups(v: &Validator, s: &Scenario) -> Result<(), ScenarioError> {
    pooled_proposer_groups(v, s)?;
    if s.selfplay.advantage_groups != AdvantageGroups::PerMember {
        return Ok(());
    }
    let groups = "selfplay.advantage_groups";
    let why = "so its TRR++ advantage is always 0 and the member never learns from it";
    let allowed = format!("2.. with {groups} = \"per_member\", or {groups} = \"pooled\"");
    let checks = [
        (
            "selfplay.proposals_per_teacher",
            s.selfplay.proposals_per_teacher,
            "each teacher's advantage group (member × task kind × proposer) one rollout per step",
        ),
        (
            "selfplay.solver_samples",
            s.selfplay.solver_samples,
            "a student's advantage group (member × task kind × solver) one rollout in a step that gives it one problem of that kind",
        ),
    ];
    if let Some((key, value, group)) = checks.into_iter().find(|(_, value, _)| *value < 2) {
        return Err(v.fail(
            groups,
            format!(
                "{groups} = \"per_member\" with {key} = {value} leaves {group}, {why} (allowed: {key} = {allowed})"
            ),
        ));
    }
    Ok(())
}

/// Pooled groups (and solo mode, where the two kinds agree): teachers ×
/// `proposals_per_teacher` proposer rollouts per kind.
fn pooled_proposer_groups(v: &Validator, s: &Scenario) -> Result<(), ScenarioError> {
    let key = "selfplay.proposals_per_teacher";
    let per_teacher = s.selfplay.proposals_per_teacher;
    let (proposers, setting, allowed) = match s.population.mode {
        Mode::Solo => (
            1,
            ("population.mode", "\"solo\"".to_string()),
            format!("{key} = 2.. in solo mode"),
        ),
        Mode::Population => {
            let teachers = s.population.teachers;
            (
                teachers,
                ("population.teachers", teachers.to_string()),
                format!("population.teachers × {key} >= 2"),
            )
        }
    };
    if proposers * per_teacher >= 2 {
        return Ok(());
    }
    let (other, value) = setting;
    // Point at the line to change: the key, or where the mode is set when
    // the key is left at its default.
    let at = if v.given(key) { key } else { other };
    Err(v.fail(
        at,
        format!(
            "{key} = {per_teacher} with {other} = {value} leaves each proposer advantage group (task kind × proposer) one rollout per step, so its TRR++ advantage is always 0 and the proposer never learns (allowed: {allowed})"
        ),
    ))
}

/// With structured decoding, every reply's grammar must close within
/// `max_new_tokens` (the grammar of each task kind and role says how much it needs).
fn reply_budget(v: &Validator, sp: &SelfPlaySection) -> Result<(), ScenarioError> {
    let shape = ReplyShape {
        max_new_tokens: sp.max_new_tokens,
        arity: None,
        inputs: sp.induction_inputs,
    };
    for &kind in &sp.task_kinds {
        for role in Role::ALL {
            if let Err(why) = reply_grammar(kind, role, &shape) {
                let key = "selfplay.max_new_tokens";
                return Err(v.fail(key, format!("selfplay.{why} (selfplay.constrained = true)")));
            }
        }
    }
    Ok(())
}

fn rewards_and_training(v: &Validator, s: &Scenario) -> Result<(), ScenarioError> {
    let r = &s.rewards;
    for (key, value) in [
        ("rewards.correct", r.correct),
        ("rewards.malformed", r.malformed),
        ("rewards.wrong", r.wrong),
    ] {
        v.range(value.is_finite(), key, value, "a finite number")?;
    }
    let t = &s.training;
    let lr_ok = t.lr.is_finite() && t.lr > 0.0 && t.lr <= 1.0;
    v.range(lr_ok, "training.lr", t.lr, "0 < lr <= 1")?;
    let decay_ok = t.weight_decay.is_finite() && t.weight_decay >= 0.0;
    v.range(decay_ok, "training.weight_decay", t.weight_decay, ">= 0")?;
    for (key, value) in [("training.beta1", t.beta1), ("training.beta2", t.beta2)] {
        v.range((0.0..1.0).contains(&value), key, value, "0 <= beta < 1")?;
    }
    let eps_ok = t.eps.is_finite() && t.eps > 0.0;
    v.range(eps_ok, "training.eps", t.eps, "> 0")?;
    v.range(
        t.clip > 0.0 && t.clip < 1.0,
        "training.clip",
        t.clip,
        "0 < clip < 1",
    )?;
    let grad_clip_ok = t.grad_clip.is_finite() && t.grad_clip > 0.0;
    v.range(grad_clip_ok, "training.grad_clip", t.grad_clip, "> 0")?;
    let micro = t.micro_batch_tokens;
    v.range(micro >= 64, "training.micro_batch_tokens", micro, "64..")
}

fn evolution(v: &Validator, s: &Scenario, check: OperatorCheck) -> Result<(), ScenarioError> {
    let e = &s.evolution;
    v.range(e.every >= 1, "evolution.every", e.every, "1..")?;
    let cull_ok = e.cull_fraction > 0.0 && e.cull_fraction < 1.0;
    v.range(
        cull_ok,
        "evolution.cull_fraction",
        e.cull_fraction,
        "0 < f < 1",
    )?;
    let window = e.fitness_window;
    v.range(window >= 1, "evolution.fitness_window", window, "1..")?;
    v.range(
        e.tournament >= 1,
        "evolution.tournament",
        e.tournament,
        "1..",
    )?;
    operator_list(v, "evolution.crossover", &e.crossover, check)?;
    operator_list(v, "evolution.mutation", &e.mutation, check)?;
    if e.enabled && e.crossover.is_empty() && e.mutation.is_empty() {
        return Err(v.fail(
            "evolution.mutation",
            "evolution.crossover and evolution.mutation are both empty (allowed: at least one operator while evolution.enabled = true)".into(),
        ));
    }
    Ok(())
}

fn operator_list(
    v: &Validator,
    key: &str,
    operators: &[WeightedOperator],
    check: OperatorCheck,
) -> Result<(), ScenarioError> {
    for (index, operator) in operators.iter().enumerate() {
        v.operator(&format!("{key}[{index}].op"), &operator.op, check)?;
        let weight = operator.weight;
        let weight_key = format!("{key}[{index}].weight");
        v.range(
            weight.is_finite() && weight > 0.0,
            &weight_key,
            weight,
            "> 0",
        )?;
    }
    Ok(())
}

fn events(v: &Validator, s: &Scenario, check: OperatorCheck) -> Result<(), ScenarioError> {
    for (index, event) in s.events.iter().enumerate() {
        let key = format!("events[{index}]");
        v.range(
            (1..=s.steps).contains(&event.at),
            &format!("{key}.at"),
            event.at,
            format_args!("1..={} (steps)", s.steps),
        )?;
        match &event.action {
            EventAction::Kill(id) => {
                let ok = matches!(parse_member_id(id), Some(("teacher" | "student", _)));
                if !ok {
                    let key = format!("{key}.kill");
                    return Err(v.fail(
                        &key,
                        format!("{key} = {id:?} is not a member id (allowed: teacher-N or student-N, N = 0, 1, 2, ...)"),
                    ));
                }
            }
            EventAction::Inject(injection) => {
                let role = injection.role.as_str();
                if injection.role == super::Role::Solo {
                    let role_key = format!("{key}.inject.role");
                    return Err(v.fail(
                        &role_key,
                        format!("{role_key} = \"solo\" cannot be injected (allowed: \"teacher\", \"student\")"),
                    ));
                }
                if let Some(parents) = &injection.from {
                    let from_key = format!("{key}.inject.from");
                    if parents.is_empty() {
                        return Err(v.fail(
                            &from_key,
                            format!("{from_key} = [] is empty (allowed: {role} ids; omit `from` to let evolution's selection choose)"),
                        ));
                    }
                    for (j, id) in parents.iter().enumerate() {
                        let parent_key = format!("{from_key}[{j}]");
                        let ok = matches!(parse_member_id(id), Some((prefix, _)) if prefix == role);
                        if !ok {
                            return Err(v.fail(
                                &parent_key,
                                format!("{parent_key} = {id:?} is not a {role} id (allowed: {role}-N, N = 0, 1, 2, ...; parents share the injected role)"),
                            ));
                        }
                        if parents[..j].contains(id) {
                            return Err(v.fail(
                                &parent_key,
                                format!("{parent_key} = {id:?} is a duplicate (each parent at most once)"),
                            ));
                        }
                    }
                }
                if let Some(op) = &injection.op {
                    v.operator(&format!("{key}.inject.op"), op, check)?;
                }
            }
        }
    }
    Ok(())
}
