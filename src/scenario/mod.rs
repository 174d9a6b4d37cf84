//! The scenario file: one TOML file that fully describes a run.
//!
//! Every hyperparameter is a named field with its default next to it (in the doc
//! comment and in the section's `Default` impl). Only `seed` and `steps` are required.
//! Loading is three steps: the typed parse (serde, `deny_unknown_fields` everywhere),
//! resolving defaults that depend on other keys (`name`, solo mode), and validation
//! (ranges and cross-key rules). Every error names the file, the line, the dotted key,
//! the offending value and what is allowed; see [`ScenarioError`].
//!
//! `Scenario::to_toml` writes the resolved scenario back out with every default
//! spelled out; the run directory keeps that copy, and parsing it gives an equal
//! `Scenario`.

#![warn(missing_docs)]

pub mod cluster;
mod engine_parts;
mod error;
pub mod experiment;
mod source_map;
mod validate;

pub use cluster::ClusterSection;
pub use error::{ErrorKind, ScenarioError};

use serde::{Deserialize, Serialize, Serializer};
use source_map::SourceMap;

pub use crate::base::{Target, WeightsSetting};
pub use crate::task::TaskKind;
use std::path::{Path, PathBuf};

/// A fully resolved scenario.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    /// Run name (empty = default). Default: the scenario file's stem (`scenarios/quickstart.toml` → "quickstart").
    #[serde(default)]
    pub name: String,
    /// Root of all randomness in the run. Required.
    pub seed: u64,
    /// Total self-play steps, >= 1. Required.
    pub steps: u64,
    /// Compute budget in TFLOP (forward and backward, as `metrics.jsonl`'s
    /// `compute` counts it): the run ends at the first step boundary at or
    /// past it, or after `steps`, whichever comes first. The boundary
    /// nearest the budget (that last one or the one before it, kept as a
    /// checkpoint) is journaled as a `compute_mark`, as `checkpoint.at_tflop`'s
    /// are. Default: none. `populora experiment` sets a baseline's budget to
    /// its population's spending.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget_tflop: Option<f64>,
    /// The frozen base model.
    #[serde(default)]
    pub model: ModelSection,
    /// Shape of every member's LoRA adapter.
    #[serde(default)]
    pub lora: LoraSection,
    /// Who plays: a population of teachers and students, or one solo member.
    #[serde(default, serialize_with = "serialize_population")]
    pub population: PopulationSection,
    /// Problem proposal and solving (AZR).
    #[serde(default)]
    pub selfplay: SelfPlaySection,
    /// Format rewards (AZR's composite).
    #[serde(default)]
    pub rewards: RewardsSection,
    /// AdamW and PPO-clip settings.
    #[serde(default)]
    pub training: TrainingSection,
    /// Population-based training: cull and spawn.
    #[serde(default)]
    pub evolution: EvolutionSection,
    /// The Python sandbox.
    #[serde(default)]
    pub verifier: VerifierSection,
    /// Checkpoint cadence.
    #[serde(default)]
    pub checkpoint: CheckpointSection,
    /// AZR's seeding stage before step 1 (off by default).
    #[serde(default)]
    pub seeding: SeedingSection,
    /// Scripted live events, in file order. Default: none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub events: Vec<ScriptedEvent>,
    /// Worker nodes and placement. Default: none (one process).
    #[serde(default, skip_serializing_if = "ClusterSection::is_local")]
    pub cluster: ClusterSection,
}

// ---------------------------------------------------------------- [model]

/// `[model]`
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelSection {
    /// Which base model. Default: `"default"` (the fetched SmolLM2-135M-Instruct GGUF).
    pub source: ModelSource,
    /// The random tiny model's shape; only allowed with `source = "tiny"`, where it
    /// resolves to `Some` (defaults filled in). Default: None.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tiny: Option<TinyModelSection>,
    /// Where the base runs, generation, scoring and the train step alike:
    /// `"cpu"`, `"cuda"` or `"cuda:N"` (a build with the `cuda` feature; the
    /// train step then runs its generic backward on the device). Default: `"cpu"`.
    pub device: String,
    /// How the base keeps its frozen matrices. `"native"`: as the GGUF file
    /// holds them (Q4_1, Q8_0, F16 and BF16 in their blocks, about a fifth of
    /// f32's bytes for SmolLM2), unpacked in registers by the kernels; other
    /// types (K-quants and the rest) dequantized to f32 at load. `"f32"`:
    /// everything dequantized to f32 at load. Both use the same weight values;
    /// only the order of the sums differs, so logits can differ in their last
    /// bits and a near-tie can decode differently. With `source = "tiny"`
    /// (built in f32) both mean f32; an HF directory's F16/BF16 matrices stay
    /// 16-bit under `"native"` (F32 ones stay f32); with `device = "cuda"`
    /// the base is f32 on the device either way. A recorded `scenario.toml`
    /// without this key (a run older than it) means `"f32"`, so `replay` and
    /// `resume` reproduce it. Default: `"native"` (about 3× f32's decode at
    /// batch 1, BENCHMARKS.md).
    pub weights: WeightsSetting,
}

impl Default for ModelSection {
    fn default() -> Self {
        ModelSection {
            source: ModelSource::Default,
            tiny: None,
            device: "cpu".into(),
            weights: WeightsSetting::Native,
        }
    }
}

/// `model.source`: `"default"`, `"tiny"`, or any other string, taken as a path to a
/// `.gguf` file or a Hugging Face model directory (existence is checked when loading;
/// write `./tiny` for a directory literally named `tiny`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum ModelSource {
    /// The fetched SmolLM2-135M-Instruct GGUF.
    Default,
    /// A random tiny model built in memory (tests, smoke runs).
    Tiny,
    /// A `.gguf` file or an HF model directory.
    Path(PathBuf),
}

impl TryFrom<String> for ModelSource {
    type Error = String;
    fn try_from(source: String) -> Result<Self, String> {
        match source.as_str() {
            "default" => Ok(ModelSource::Default),
            "tiny" => Ok(ModelSource::Tiny),
            "" => {
                Err("empty string is not allowed (allowed: \"default\", \"tiny\" or a path)".into())
            }
            _ => Ok(ModelSource::Path(PathBuf::from(source))),
        }
    }
}

impl From<ModelSource> for String {
    fn from(source: ModelSource) -> String {
        match source {
            ModelSource::Default => "default".into(),
            ModelSource::Tiny => "tiny".into(),
            ModelSource::Path(path) => path.to_string_lossy().into_owned(),
        }
    }
}

/// `[model.tiny]`: a random Llama-family model built in memory.
/// Rules: `hidden % heads == 0`, `heads % kv_heads == 0`, `hidden / heads` even (RoPE).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TinyModelSection {
    /// Transformer blocks. Default: 2.
    pub layers: usize,
    /// Hidden size. Default: 32.
    pub hidden: usize,
    /// Attention heads. Default: 4.
    pub heads: usize,
    /// Key/value heads (grouped-query attention). Default: 2.
    pub kv_heads: usize,
    /// MLP intermediate size. Default: 48.
    pub ffn: usize,
    /// Tokens: the 256 bytes, 3 specials and filler tokens, 259..=262144
    /// (49152 with the sizes above set to SmolLM2's: its shape with random
    /// weights). Default: 300.
    pub vocab: usize,
    /// Longest sequence (prompt + generation). Default: 512.
    pub max_positions: usize,
    /// Seed of the random weights (independent of the scenario seed). Default: 0.
    pub seed: u64,
}

impl Default for TinyModelSection {
    fn default() -> Self {
        TinyModelSection {
            layers: 2,
            hidden: 32,
            heads: 4,
            kv_heads: 2,
            ffn: 48,
            vocab: 300,
            max_positions: 512,
            seed: 0,
        }
    }
}

// ---------------------------------------------------------------- [lora]

/// `[lora]`
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LoraSection {
    /// Adapter rank r, 1..=256. Default: 8.
    pub rank: usize,
    /// Scale numerator: ΔW = (alpha / r) · B·A (or alpha / √r with rslora), > 0. Default: 16.0.
    pub alpha: f64,
    /// Rank-stabilised scaling alpha / √r. Default: false.
    pub rslora: bool,
    /// Projections that get an adapter; non-empty, no duplicates. Default: all seven.
    pub targets: Vec<Target>,
}

impl Default for LoraSection {
    fn default() -> Self {
        LoraSection {
            rank: 8,
            alpha: 16.0,
            rslora: false,
            targets: Target::ALL.to_vec(),
        }
    }
}

// ---------------------------------------------------------------- [population]

/// `[population]`. In solo mode only `mode` may be given; the counts then resolve to 1
/// (one member, `solo-0`, that is the one teacher and the one student).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PopulationSection {
    /// `"population"` or `"solo"` (single-agent baseline). Default: "population".
    pub mode: Mode,
    /// Teachers (proposers), >= subpopulations. Default: 2.
    pub teachers: usize,
    /// Students (solvers), >= subpopulations. Default: 2.
    pub students: usize,
    /// Sub-populations G, >= 2 (cross-evaluation); teacher i and student j belong to
    /// sub-population i % G and j % G. Default: 2.
    pub subpopulations: usize,
    /// Students matched to each teacher per step, from other sub-populations,
    /// 1..=(students outside the teacher's sub-population). Default: 1.
    pub students_per_teacher: usize,
}

impl Default for PopulationSection {
    fn default() -> Self {
        PopulationSection {
            mode: Mode::Population,
            teachers: 2,
            students: 2,
            subpopulations: 2,
            students_per_teacher: 1,
        }
    }
}

/// `population.mode`
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Teachers and students in cross-evaluating sub-populations (PopuLoRA).
    Population,
    /// One adapter plays both roles (AZR-style baseline).
    Solo,
}

/// In solo mode the population keys must not be given, so the resolved copy omits them.
fn serialize_population<S: Serializer>(
    population: &PopulationSection,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    #[derive(Serialize)]
    struct ModeOnly {
        mode: Mode,
    }
    match population.mode {
        Mode::Solo => ModeOnly { mode: Mode::Solo }.serialize(serializer),
        Mode::Population => population.serialize(serializer),
    }
}

// ---------------------------------------------------------------- [selfplay]

/// `[selfplay]`
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SelfPlaySection {
    /// Task kinds played each step; non-empty, no duplicates. Default: all three.
    pub task_kinds: Vec<TaskKind>,
    /// K reference triplets from the task buffer in each proposer prompt, 0..=32. Default: 6.
    pub references: usize,
    /// Proposals per teacher per task kind per step, >= 1. Default: 1.
    pub proposals_per_teacher: usize,
    /// Solver rollouts n per valid problem, >= 1 (learnability needs n >= 2 to be nonzero). Default: 8.
    pub solver_samples: usize,
    /// Prompt token budget, 64..=8192. Default: 1024.
    pub max_prompt_tokens: usize,
    /// Generation token budget, 8..=4096; with `constrained`, every reply's
    /// grammar must fit it (AZR's induction proposal of 10 inputs needs 315).
    /// Default: 512.
    pub max_new_tokens: usize,
    /// Sampling temperature, 0.0..=2.0 (0 = greedy). Default: 1.0.
    pub temperature: f64,
    /// Nucleus sampling mass, 0 < p <= 1. Default: 1.0.
    pub top_p: f64,
    /// Decode every reply under the grammar of its task kind and role
    /// (structured decoding, `src/task/grammar.rs`): every reply parses and
    /// closes within max_new_tokens, and PPO trains the masked policy. Off:
    /// free decoding, as AZR. Default: true.
    pub constrained: bool,
    /// Free decoding only (`constrained = false`): write the start of every
    /// reply for the model (`<answer>` and the block opener for solvers,
    /// "```python\ndef f(" for proposers). Not AZR. Default: false.
    pub prefill_answer: bool,
    /// Compute each prompt once for all the rollouts that share it (one
    /// prefill in generation, one packed sequence in the train step), and
    /// leave rollouts whose advantage is 0 out of the train step's forward
    /// and backward. Results are the same up to the order of floating-point
    /// sums; off only for side-by-side measurement. Default: true.
    pub share_prefixes: bool,
    /// Buffer problems every solver gets per task kind per step, 0..=32, on
    /// top of its matched teachers' problems (AZR's solver trains on buffer
    /// tasks). They train the solver; no teacher's learnability counts them.
    /// 0: a solver sees buffer problems only when no matched teacher made a
    /// valid one (then one per kind). Default: 1.
    pub buffer_problems: usize,
    /// How TRR++ forms its advantage groups: `pooled`, one per (task kind ×
    /// role) over the whole step, every member sharing its baseline (AZR's
    /// six groups); or `per_member`, one per (member × kind × role). See
    /// `selfplay::train_rows`. Default: pooled.
    pub advantage_groups: AdvantageGroups,
    /// Inputs an induction proposer writes, >= 2. Default: 10.
    pub induction_inputs: usize,
    /// Of those, input/output pairs shown to the solver, 1..induction_inputs; the rest
    /// are hidden and score the answer. Default: 5.
    pub induction_shown: usize,
}

impl Default for SelfPlaySection {
    fn default() -> Self {
        SelfPlaySection {
            task_kinds: TaskKind::ALL.to_vec(),
            references: 6,
            proposals_per_teacher: 1,
            solver_samples: 8,
            max_prompt_tokens: 1024,
            max_new_tokens: 512,
            temperature: 1.0,
            top_p: 1.0,
            constrained: true,
            prefill_answer: false,
            share_prefixes: true,
            buffer_problems: 1,
            advantage_groups: AdvantageGroups::Pooled,
            induction_inputs: 10,
            induction_shown: 5,
        }
    }
}

/// `selfplay.advantage_groups`: the rollouts that share one TRR++ baseline.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AdvantageGroups {
    /// One group per (task kind × role) over every member's rollouts.
    Pooled,
    /// One group per (member × task kind × role).
    PerMember,
}

// ---------------------------------------------------------------- [rewards]

/// `[rewards]`: AZR's composite format reward (finite values).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RewardsSection {
    /// Solver reward for a correct answer. Default: 1.0.
    pub correct: f64,
    /// Reward for a malformed answer (no parseable `<answer>`). Default: -1.0.
    pub malformed: f64,
    /// Reward for a well-formed answer that earns zero. Default: -0.5.
    pub wrong: f64,
}

impl Default for RewardsSection {
    fn default() -> Self {
        RewardsSection {
            correct: 1.0,
            malformed: -1.0,
            wrong: -0.5,
        }
    }
}

// ---------------------------------------------------------------- [training]

/// `[training]`: AdamW + one PPO-clip update per step (TRR++ advantages).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TrainingSection {
    /// Learning rate, 0 < lr <= 1. Default: 1e-4.
    pub lr: f64,
    /// AdamW decoupled weight decay, >= 0. Default: 0.0.
    pub weight_decay: f64,
    /// Adam β1, in [0, 1). Default: 0.9.
    pub beta1: f64,
    /// Adam β2, in [0, 1). Default: 0.999.
    pub beta2: f64,
    /// Adam ε, > 0. Default: 1e-8.
    pub eps: f64,
    /// PPO ratio clip ε, in (0, 1). Default: 0.2.
    pub clip: f64,
    /// Gradient-norm clip, > 0. Default: 1.0.
    pub grad_clip: f64,
    /// Tokens per micro-batch (gradient accumulation), >= 64. Default: 2048.
    pub micro_batch_tokens: usize,
}

impl Default for TrainingSection {
    fn default() -> Self {
        TrainingSection {
            lr: 1e-4,
            weight_decay: 0.0,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            clip: crate::rl::ppo::AZR_PPO_CLIP,
            grad_clip: crate::rl::ppo::AZR_GRAD_CLIP_NORM,
            micro_batch_tokens: crate::compute::DEFAULT_TOKEN_BUDGET,
        }
    }
}

// ---------------------------------------------------------------- [evolution]

/// `[evolution]`: every `every` steps, per role: rank by fitness, cull the bottom
/// `cull_fraction` (at least one), spawn replacements from tournament-selected parents
/// by one crossover then one mutation, each drawn by weight.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EvolutionSection {
    /// Run evolution at all; must be false in solo mode (where it defaults to false). Default: true.
    pub enabled: bool,
    /// Evolve every E steps, >= 1. Default: 5.
    pub every: u64,
    /// Fraction of each role culled, 0 < f < 1. Default: 0.25.
    pub cull_fraction: f64,
    /// Ranking criterion. Default: "recent_reward".
    pub fitness: Fitness,
    /// Steps averaged by `recent_reward`, >= 1. Default: 3.
    pub fitness_window: u64,
    /// Tournament size for parent selection, >= 1. Default: 2.
    pub tournament: usize,
    /// Offspring optimizer state. Default: "reset".
    pub optimizer: OptimizerInit,
    /// Crossover operators and their draw weights.
    /// Default: `[{ op = "ties", weight = 1.0 }, { op = "dare:drop=0.5", weight = 1.0 }]`.
    pub crossover: Vec<WeightedOperator>,
    /// Mutation operators and their draw weights. Default: `[{ op = "svd_noise", weight = 1.0 }]`.
    pub mutation: Vec<WeightedOperator>,
}

impl Default for EvolutionSection {
    fn default() -> Self {
        EvolutionSection {
            enabled: true,
            every: 5,
            cull_fraction: 0.25,
            fitness: Fitness::RecentReward,
            fitness_window: 3,
            tournament: 2,
            optimizer: OptimizerInit::Reset,
            crossover: vec![
                WeightedOperator::new("ties", 1.0),
                WeightedOperator::new("dare:drop=0.5", 1.0),
            ],
            mutation: vec![WeightedOperator::new("svd_noise", 1.0)],
        }
    }
}

/// `evolution.fitness`
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Fitness {
    /// Mean reward over the last `fitness_window` steps.
    #[serde(rename = "recent_reward")]
    RecentReward,
    /// Conservative TrueSkill rating (μ − 3σ).
    #[serde(rename = "trueskill")]
    TrueSkill,
}

/// `evolution.optimizer`: what an offspring's AdamW state starts from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OptimizerInit {
    /// Fresh zero moments.
    Reset,
    /// Copied from the (first) parent.
    Inherit,
}

/// One entry of `evolution.crossover` / `evolution.mutation`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WeightedOperator {
    /// Operator string: `"name"` or `"name:param=value,..."` (see [`crate::evolve::OperatorSpec`]). Required.
    pub op: String,
    /// Relative draw weight, > 0. Default: 1.0.
    #[serde(default = "one")]
    pub weight: f64,
}

fn one() -> f64 {
    1.0
}

impl WeightedOperator {
    /// `{ op, weight }`.
    pub fn new(op: &str, weight: f64) -> Self {
        WeightedOperator {
            op: op.to_string(),
            weight,
        }
    }
}

// ---------------------------------------------------------------- [verifier], [checkpoint]

/// `[verifier]`: the Python sandbox pool.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct VerifierSection {
    /// Sandbox worker processes, 1..=64. Default: 2.
    pub workers: usize,
    /// Wall-clock limit per program run in milliseconds, 10..=60000. Default: 2000.
    pub timeout_ms: u64,
    /// Address-space limit per program run in MiB, 64..=16384. Default: 512.
    pub memory_mb: u64,
}

impl Default for VerifierSection {
    fn default() -> Self {
        VerifierSection {
            workers: 2,
            timeout_ms: 2000,
            memory_mb: 512,
        }
    }
}

/// `[checkpoint]`
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CheckpointSection {
    /// Steps between checkpoints, >= 1. Default: 5.
    pub every: u64,
    /// Compute marks in TFLOP, each > 0, chosen after the fact: every step
    /// boundary from which a step as large as the largest so far could
    /// cross a mark is checkpointed, and at the boundary that crosses it,
    /// the nearer of that boundary and the one before it is journaled as a
    /// `compute_mark` (with its checkpoint). `populora experiment` marks a
    /// baseline where it has spent what one population member spent.
    /// Default: none.
    pub at_tflop: Vec<f64>,
}

impl Default for CheckpointSection {
    fn default() -> Self {
        CheckpointSection {
            every: 5,
            at_tflop: Vec::new(),
        }
    }
}

// ---------------------------------------------------------------- [seeding]

/// `[seeding]`: AZR's seeding stage. Before step 1 the base model, with no
/// adapter, proposes (with the run's prompts, sampling and grammars) until
/// each task kind's buffer holds `entries` valid, distinct tasks; training
/// starts from those buffers. Its compute is reported apart and never
/// counts toward `budget_tflop`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SeedingSection {
    /// Valid, distinct tasks per kind, the identity task included,
    /// 0..=4096 (0 = no stage: start from the identity task; AZR: 256).
    /// Default: 0.
    pub entries: usize,
    /// Proposals per kind per round (one generation batch), 1..=512. Default: 32.
    pub batch: usize,
    /// Rounds before the stage gives up naming the kinds still short, >= 1.
    /// Default: 100.
    pub max_rounds: usize,
}

impl Default for SeedingSection {
    fn default() -> Self {
        SeedingSection {
            entries: 0,
            batch: 32,
            max_rounds: 100,
        }
    }
}

// ---------------------------------------------------------------- [[events]]

/// `[[events]]`: a live event scripted into the run, applied at the start of step `at`
/// (before anything else that step; several events at one step apply in file order).
/// Not allowed in solo mode.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(into = "EventToml")]
pub struct ScriptedEvent {
    /// Step at whose start the event applies, 1..=steps. Required.
    pub at: u64,
    /// What happens: exactly one of `kill = "<id>"` or `inject = { ... }`.
    pub action: EventAction,
}

/// What a scripted event does.
#[derive(Debug, Clone, PartialEq)]
pub enum EventAction {
    /// `kill = "student-1"`: remove that member (an id of the form `teacher-N` / `student-N`;
    /// it may be one injected earlier, so existence is not checked at parse time).
    Kill(String),
    /// `inject = { role = "student", from = [...], op = "..." }`: spawn a new member.
    Inject(Injection),
}

/// `inject = { ... }`
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Injection {
    /// Role of the new member: "teacher" or "student". Required.
    pub role: Role,
    /// Parent ids, all of `role` (e.g. `["student-0"]`); None = chosen by evolution's
    /// selection. Default: None.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from: Option<Vec<String>>,
    /// Operator string applied to the parents; None = evolution's usual crossover +
    /// mutation draw. Default: None.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub op: Option<String>,
}

/// A member's role. Teachers and students make a population; the solo
/// member of the single-agent baseline plays both and is never injected.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Proposes problems.
    Teacher,
    /// Solves problems.
    Student,
    /// Proposes problems and solves its own.
    Solo,
}

impl Role {
    /// The member-id prefix: `teacher` / `student` / `solo`.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Teacher => "teacher",
            Role::Student => "student",
            Role::Solo => "solo",
        }
    }
}

/// The on-disk shape of an event.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct EventToml {
    at: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    kill: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    inject: Option<Injection>,
}

impl<'de> Deserialize<'de> for ScriptedEvent {
    /// Through `EventToml`, inside the map visitor so that toml attaches the span of
    /// this very event to a "kill or inject" error (after the visitor returns, only
    /// the span of the whole `events` array is known).
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct EventVisitor;
        impl<'de> serde::de::Visitor<'de> for EventVisitor {
            type Value = ScriptedEvent;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("an event table")
            }
            fn visit_map<M: serde::de::MapAccess<'de>>(
                self,
                map: M,
            ) -> Result<ScriptedEvent, M::Error> {
                let event =
                    EventToml::deserialize(serde::de::value::MapAccessDeserializer::new(map))?;
                ScriptedEvent::try_from(event).map_err(serde::de::Error::custom)
            }
        }
        deserializer.deserialize_map(EventVisitor)
    }
}

impl TryFrom<EventToml> for ScriptedEvent {
    type Error = String;
    fn try_from(event: EventToml) -> Result<Self, String> {
        let action = match (event.kill, event.inject) {
            (Some(id), None) => EventAction::Kill(id),
            (None, Some(injection)) => EventAction::Inject(injection),
            (Some(_), Some(_)) => {
                return Err("an event takes exactly one of `kill` or `inject`, not both".into())
            }
            (None, None) => return Err("an event needs exactly one of `kill` or `inject`".into()),
        };
        Ok(ScriptedEvent {
            at: event.at,
            action,
        })
    }
}

impl From<ScriptedEvent> for EventToml {
    fn from(event: ScriptedEvent) -> EventToml {
        let (kill, inject) = match event.action {
            EventAction::Kill(id) => (Some(id), None),
            EventAction::Inject(injection) => (None, Some(injection)),
        };
        EventToml {
            at: event.at,
            kill,
            inject,
        }
    }
}

// ---------------------------------------------------------------- loading

/// The text of a `what` file (scenario, experiment), or a read error naming it.
fn read_file(path: &Path, what: &str) -> Result<String, ScenarioError> {
    std::fs::read_to_string(path).map_err(|error| ScenarioError {
        origin: path.display().to_string(),
        line: None,
        key: None,
        kind: ErrorKind::Read,
        message: format!("cannot read {what} file: {error}"),
    })
}

impl Scenario {
    /// Reads and validates a scenario file. `check_operator` is the operator registry's
    /// verdict on an operator string (`Err` carries the reason); it sees every
    /// `evolution.crossover[i].op`, `evolution.mutation[i].op` and `events[i].inject.op`.
    pub fn from_file(
        path: impl AsRef<Path>,
        check_operator: impl Fn(&str) -> Result<(), String>,
    ) -> Result<Scenario, ScenarioError> {
        let path = path.as_ref();
        let text = read_file(path, "scenario")?;
        Scenario::parse(&text, &path.display().to_string(), check_operator)
    }

    /// Reads a run's recorded (resolved) `scenario.toml`, as
    /// [`Scenario::from_file`] does, except that a key added after the run was
    /// recorded takes the value that reproduces the run rather than today's
    /// default: `model.weights` absent means `"f32"`.
    pub fn from_recorded_file(
        path: impl AsRef<Path>,
        check_operator: impl Fn(&str) -> Result<(), String>,
    ) -> Result<Scenario, ScenarioError> {
        let path = path.as_ref();
        let text = read_file(path, "scenario")?;
        let mut scenario = Scenario::parse(&text, &path.display().to_string(), check_operator)?;
        let table = text.parse::<toml::Table>().ok();
        let weights_given = table
            .as_ref()
            .and_then(|t| t.get("model"))
            .and_then(|m| m.get("weights"))
            .is_some();
        if !weights_given {
            scenario.model.weights = WeightsSetting::F32;
        }
        Ok(scenario)
    }

    /// Parses and validates scenario text. `origin` names the text in errors (normally
    /// the file path) and its file stem is the default `name`.
    pub fn parse(
        text: &str,
        origin: &str,
        check_operator: impl Fn(&str) -> Result<(), String>,
    ) -> Result<Scenario, ScenarioError> {
        let map = SourceMap::build(text);
        let typed = toml::from_str::<Scenario>(text);
        let (map, mut scenario) = match (map, typed) {
            (Ok(map), Ok(scenario)) => (map, scenario),
            (Ok(map), Err(error)) => return Err(validate::schema_error(&error, &map, origin)),
            // The bare-tree parse fails on syntax errors, and (in principle) on a value
            // it cannot walk; only then is the file used without key positions.
            (Err(_), Ok(scenario)) => (SourceMap::lines_only(text), scenario),
            (Err(_), Err(error)) => {
                let lines = SourceMap::lines_only(text);
                return Err(match text.parse::<toml::Table>() {
                    Err(syntax) => validate::syntax_error(&syntax, &lines, origin),
                    Ok(_) => validate::schema_error(&error, &lines, origin),
                });
            }
        };
        scenario.resolve(&map, origin);
        validate::validate(&scenario, Some(&map), origin, &check_operator)?;
        Ok(scenario)
    }

    /// Validates a scenario built in code (errors carry no line numbers; the
    /// solo-mode "key must not be given" rules need the text and are skipped).
    pub fn validate(
        &self,
        check_operator: impl Fn(&str) -> Result<(), String>,
    ) -> Result<(), ScenarioError> {
        validate::validate(self, None, &self.name, &check_operator)
    }

    /// Fills in defaults that depend on the file or on other keys.
    fn resolve(&mut self, map: &SourceMap, origin: &str) {
        if self.name.is_empty() {
            self.name = Path::new(origin)
                .file_stem()
                .map(|stem| stem.to_string_lossy().into_owned())
                .filter(|stem| !stem.is_empty())
                .unwrap_or_else(|| "scenario".to_string());
        }
        if self.model.source == ModelSource::Tiny && self.model.tiny.is_none() {
            self.model.tiny = Some(TinyModelSection::default());
        }
        if self.population.mode == Mode::Solo {
            // Counts are forbidden in the file (validation reports any given); resolve
            // them to what solo means: one teacher role, one student role, one member.
            let population = &mut self.population;
            population.teachers = 1;
            population.students = 1;
            population.subpopulations = 1;
            population.students_per_teacher = 1;
            if !map.contains("evolution.enabled") {
                self.evolution.enabled = false;
            }
        }
    }

    /// The resolved scenario as TOML, every default written out; `Scenario::parse` of
    /// it gives an equal scenario.
    ///
    /// # Panics
    /// Only for scenarios built in code with values TOML cannot hold (a `u64` above
    /// `i64::MAX`); parsed scenarios never have them.
    pub fn to_toml(&self) -> String {
        let body = toml::to_string(self).expect("scenario values fit in TOML");
        format!("# Resolved scenario: every default written out.\n\n{body}")
    }

    /// The dotted keys whose resolved values differ between two scenarios
    /// (a table's keys one by one, a list as a whole), sorted.
    pub fn differing_keys(&self, other: &Scenario) -> Vec<String> {
        let value = |s: &Scenario| toml::Value::try_from(s).expect("scenario values fit in TOML");
        let mut keys = Vec::new();
        differing(&value(self), &value(other), "", &mut keys);
        keys
    }

    /// A SHA-256 of the resolved scenario: equal for files that differ in
    /// comments and layout only.
    pub fn settings_hash(&self) -> String {
        use sha2::Digest;
        crate::base::fetch::hex(&sha2::Sha256::digest(self.to_toml().as_bytes()))
    }

    // ------------------------------------------------------------ members

    /// Initial member ids in a fixed order: `teacher-0..T`, then `student-0..S`;
    /// `["solo-0"]` in solo mode.
    pub fn member_ids(&self) -> Vec<String> {
        match self.population.mode {
            Mode::Solo => vec!["solo-0".to_string()],
            Mode::Population => {
                let teachers = (0..self.population.teachers).map(|i| format!("teacher-{i}"));
                let students = (0..self.population.students).map(|j| format!("student-{j}"));
                teachers.chain(students).collect()
            }
        }
    }

    /// Initial sub-population of the `index`-th teacher or student (round-robin:
    /// teacher i → i % G, student j → j % G). Always 0 in solo mode.
    pub fn subpopulation_of(&self, index: usize) -> usize {
        match self.population.mode {
            Mode::Solo => 0,
            Mode::Population => index % self.population.subpopulations.max(1),
        }
    }
}

fn differing(a: &toml::Value, b: &toml::Value, at: &str, keys: &mut Vec<String>) {
    let (toml::Value::Table(a), toml::Value::Table(b)) = (a, b) else {
        if a != b {
            keys.push(at.to_string());
        }
        return;
    };
    let names: std::collections::BTreeSet<&String> = a.keys().chain(b.keys()).collect();
    for name in names {
        let key = match at {
            "" => name.clone(),
            _ => format!("{at}.{name}"),
        };
        match (a.get(name), b.get(name)) {
            (Some(x), Some(y)) => differing(x, y, &key, keys),
            _ => keys.push(key),
        }
    }
}

/// Splits a member id `teacher-N` / `student-N` / `solo-N` (N decimal, no leading
/// zeros) into its prefix and number.
pub fn parse_member_id(id: &str) -> Option<(&str, usize)> {
    let (prefix, number) = id.rsplit_once('-')?;
    if !matches!(prefix, "teacher" | "student" | "solo") {
        return None;
    }
    let canonical = !number.is_empty()
        && number.bytes().all(|b| b.is_ascii_digit())
        && (number == "0" || !number.starts_with('0'));
    if !canonical {
        return None;
    }
    Some((prefix, number.parse().ok()?))
}

/// The standard operator check for [`Scenario::parse`]: the name is in the
/// evolution registry and its parameters are known and in range.
pub fn check_operator(op: &str) -> Result<(), String> {
    use crate::evolve::{operators, resolve};
    let spec = crate::evolve::OperatorSpec::parse(op).map_err(|e| e.to_string())?;
    let kind = operators()
        .iter()
        .find(|o| o.name == spec.name)
        .map(|o| o.kind)
        .ok_or_else(|| {
            let known: Vec<_> = operators().iter().map(|o| o.name).collect();
            format!(
                "unknown operator `{}` (known: {})",
                spec.name,
                known.join(", ")
            )
        })?;
    resolve(&spec, kind).map(|_| ()).map_err(|e| e.to_string())
}
