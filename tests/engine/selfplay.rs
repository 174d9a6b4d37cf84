//! One self-play step, end to end, on a tiny random model: a scripted step
//! whose rewards are known exactly, and a generated step that must be
//! reproducible from its seed.

use std::collections::BTreeMap;

use candle_core::Device;
use populora::base::tiny::{self, TinySpec};
use populora::base::{Llama, Tokenizer};
use populora::compute::{self, AdapterSet, Generation, Pick, ScoreRow, StopReason, TrainConfig};
use populora::keyed_stream;
use populora::lora::{AdamW, AdamWConfig, Adapter, LoraConfig};
use populora::rl::ppo_clip_token_loss;
use populora::selfplay::{
    self, AdvantageGroups, Episode, Grammars, Learner, Problem, Roster, Settings, StepContext,
    StepMetrics, Verdict,
};
use populora::task::{PromptConfig, Role, TaskBuffers, TaskKind};
use populora::verify::{SandboxConfig, VerifierPool};

fn tiny() -> (Llama, Tokenizer) {
    let spec = TinySpec {
        max_positions: 2048,
        ..TinySpec::default()
    };
    let (model, vocab) = tiny::build(&spec).unwrap();
    (model, vocab.tokenizer().unwrap())
}

fn learner(model: &Llama, seed: u64, id: u64) -> Learner {
    let config = LoraConfig {
        rank: 2,
        alpha: 4.0,
        ..LoraConfig::default()
    };
    let mut rng = keyed_stream!(seed, "init", id);
    Learner {
        adapter: Adapter::new(config, &model.config, &mut rng, &Device::Cpu).unwrap(),
        optimizer: AdamW::new(AdamWConfig {
            lr: 1e-2,
            ..AdamWConfig::default()
        }),
    }
}

fn settings(kinds: &[TaskKind]) -> Settings {
    Settings {
        task_kinds: kinds.to_vec(),
        prompt: PromptConfig {
            references: 2,
            ..PromptConfig::default()
        },
        proposals_per_teacher: 2,
        solver_samples: 3,
        max_new_tokens: 12,
        constrained: false,
        ..Settings::default()
    }
}

fn pool() -> VerifierPool {
    VerifierPool::new(SandboxConfig {
        workers: 2,
        ..SandboxConfig::default()
    })
    .unwrap()
}

/// A "generation" of `text`, with the model's own log-probs so PPO is on-policy.
fn scripted(
    model: &Llama,
    tok: &Tokenizer,
    set: &AdapterSet,
    adapter: u64,
    prompt: &[u32],
    text: &str,
) -> Generation {
    let mut tokens = tok.encode(text).unwrap();
    tokens.push(tok.stop_ids[0]);
    let row = ScoreRow {
        adapter: Some(adapter),
        tokens: [prompt, tokens.as_slice()].concat(),
        score_from: prompt.len(),
    };
    let logprobs = compute::logprobs(model, set, &[row], 4096)
        .unwrap()
        .remove(0);
    Generation {
        picks: vec![Pick::Free; tokens.len()],
        tokens,
        logprobs,
        top: Vec::new(),
        stop: StopReason::StopToken,
    }
}

/// The proposers' jobs of the step, answered with `texts` in job order, judged.
fn propose_scripted(
    ctx: &StepContext,
    model: &Llama,
    set: &AdapterSet,
    roster: &Roster,
    buffers: &TaskBuffers,
    pool: &VerifierPool,
    texts: &[&str],
) -> Vec<selfplay::ProposalResult> {
    let jobs = selfplay::proposal_jobs(ctx, roster, buffers).unwrap();
    assert_eq!(jobs.len(), texts.len());
    let generations = jobs
        .iter()
        .zip(texts)
        .map(|(j, text)| scripted(model, ctx.tokenizer, set, j.author, &j.tokens, text))
        .collect();
    selfplay::judge_proposals(ctx, jobs, generations, pool).unwrap()
}

const PROPOSALS: [&str; 4] = [
    // deduction 0: valid
    "```python\ndef f(x):\n    return x * 2\n```\n```input\n3\n```",
    // deduction 1: no program
    "I would rather not.",
    // abduction 0: parses, but raises
    "```python\ndef f(x):\n    return x / 0\n```\n```input\n1\n```",
    // abduction 1: valid
    "```python\ndef f(s):\n    return s[::-1]\n```\n```input\n'abc'\n```",
];

/// Three answers per problem: deduction (f(3) = 6), abduction (f(?) = 'cba').
const ANSWERS: [[&str; 3]; 2] = [
    [
        "<answer>\n```output\n6\n```\n</answer>",
        "<answer>\n```output\n7\n```\n</answer>",
        "no idea",
    ],
    [
        "<answer>\n```input\n'abc'\n```\n</answer>",
        "<answer>\n```input\n'xyz'\n```\n</answer>",
        "<think>reverse</think><answer>\n```input\n\"abc\"\n```\n</answer>",
    ],
];

#[test]
fn scripted_step_gives_azr_rewards_and_updates_both_members() {
    let (model, tok) = tiny();
    let settings = Settings {
        buffer_problems: 0,
        ..settings(&[TaskKind::Deduction, TaskKind::Abduction])
    };
    let ctx = StepContext {
        seed: 5,
        step: 1,
        settings: &settings,
        tokenizer: &tok,
        grammars: &Grammars::off(),
    };
    let (teacher, student) = (0u64, 1u64);
    let mut learners = BTreeMap::from([
        (teacher, learner(&model, 5, 0)),
        (student, learner(&model, 5, 1)),
    ]);
    let roster = Roster {
        proposers: vec![teacher],
        matches: BTreeMap::from([(teacher, vec![student])]),
        solvers: vec![student],
    };
    let pool = pool();
    let mut buffers = TaskBuffers::seeded();
    let before: Vec<String> = learners
        .values()
        .map(|l| l.adapter.checksum().unwrap())
        .collect();

    let set = learners
        .iter()
        .fold(AdapterSet::new(), |s, (&id, l)| s.with(id, &l.adapter));
    let proposals = propose_scripted(&ctx, &model, &set, &roster, &buffers, &pool, &PROPOSALS);
    let rejections: Vec<_> = proposals.iter().map(|p| p.verdict.rejection()).collect();
    assert_eq!(
        rejections,
        [
            None,
            Some("format.no_program_block".into()),
            Some("runtime_error".into()),
            None
        ]
    );
    selfplay::accept(&mut buffers, &proposals).unwrap();
    assert_eq!(buffers.len(TaskKind::Deduction), 2);
    assert_eq!(buffers.len(TaskKind::Abduction), 2);
    let Verdict::Valid { task, .. } = &proposals[3].verdict else {
        panic!()
    };
    assert!(format!("{task:?}").contains("'cba'"), "{task:?}");

    let problems = selfplay::problems(&ctx, &roster, &proposals, &buffers).unwrap();
    assert_eq!(problems.len(), 2, "one problem per valid proposal");
    let jobs = selfplay::solve_jobs(&ctx, &problems);
    assert_eq!(jobs.len(), 6);
    let generations = jobs
        .iter()
        .map(|j| {
            let text = ANSWERS[j.problem][j.sample];
            scripted(
                &model,
                &tok,
                &set,
                j.solver,
                &problems[j.problem].tokens,
                text,
            )
        })
        .collect();
    let solves = selfplay::judge_solutions(&ctx, &problems, jobs, generations, &pool).unwrap();

    let episodes = selfplay::episodes(&settings, &proposals, &problems, &solves);
    let rewards: Vec<f64> = episodes.iter().map(|e| e.reward).collect();
    let expected = [
        2.0 / 3.0, // deduction solved 1 of 3: learnability 1 - 1/3
        -1.0,      // malformed proposal
        -0.5,      // invalid proposal
        1.0 / 3.0, // abduction solved 2 of 3
        1.0,
        -0.5,
        -1.0, // deduction answers
        1.0,
        -0.5,
        1.0, // abduction answers ("abc" == 'abc')
    ];
    for (got, want) in rewards.iter().zip(expected) {
        assert!((got - want).abs() < 1e-12, "{rewards:?}");
    }
    let batch = selfplay::train_rows(&settings, &episodes).unwrap();
    assert_eq!(batch.rows.len(), 10);
    let train = compute::train_step(&model, &set, &batch.rows, settings.train).unwrap();
    drop(set);
    for (id, grads) in train.grads {
        let l = learners.get_mut(&id).unwrap();
        let report = selfplay::apply_update(&l.adapter, &mut l.optimizer, grads, 1.0).unwrap();
        assert!(report.grad_norm > 0.0, "member {id} got no gradient");
    }
    let after: Vec<String> = learners
        .values()
        .map(|l| l.adapter.checksum().unwrap())
        .collect();
    assert_ne!(before[0], after[0], "the teacher learned");
    assert_ne!(before[1], after[1], "the student learned");

    // After the update the candle PPO loss must equal the f64 reference on
    // the new log-probs (ratios now differ from 1, some clip).
    let set = learners
        .iter()
        .fold(AdapterSet::new(), |s, (&id, l)| s.with(id, &l.adapter));
    let retrain = compute::train_step(&model, &set, &batch.rows, TrainConfig::default()).unwrap();
    for (&id, stats) in &retrain.stats {
        let rows: Vec<_> = batch.rows.iter().filter(|r| r.adapter == id).collect();
        let scores: Vec<ScoreRow> = rows
            .iter()
            .map(|r| ScoreRow {
                adapter: Some(id),
                tokens: r.tokens.clone(),
                score_from: 1,
            })
            .collect();
        let new = compute::logprobs(&model, &set, &scores, 4096).unwrap();
        let (mut lp_new, mut lp_old, mut adv, mut mask) = (vec![], vec![], vec![], vec![]);
        for (r, n) in rows.iter().zip(&new) {
            for t in 1..r.tokens.len() {
                lp_new.push(f64::from(n[t - 1]));
                lp_old.push(f64::from(r.old_logprobs[t]));
                adv.push(f64::from(r.advantages[t]));
                mask.push(if r.loss_mask[t] { 1.0 } else { 0.0 });
            }
        }
        let reference = ppo_clip_token_loss(&lp_new, &lp_old, &adv, &mask, 0.2).unwrap();
        assert!(
            (stats.loss - reference).abs() < 1e-4 * (1.0 + reference.abs()),
            "member {id}: candle {} vs reference {reference}",
            stats.loss
        );
    }
}

/// Steps of every task kind with structured decoding on: seeded, so
/// reproducible, and every reply parses.
fn generated_run(steps: u64) -> (Vec<StepMetrics>, Vec<String>) {
    let (model, tok) = tiny();
    let base = settings(&TaskKind::ALL);
    let settings = Settings {
        sampling: compute::Sampling {
            temperature: 1.0,
            top_p: 0.9,
        },
        proposals_per_teacher: 1,
        solver_samples: 2,
        max_new_tokens: 160,
        constrained: true,
        prompt: PromptConfig {
            induction_inputs: 3,
            induction_shown: 2,
            ..base.prompt.clone()
        },
        ..base
    };
    let grammars = Grammars::compile(&tok, model.config.vocab_size, &settings).unwrap();
    let mut learners = BTreeMap::from([(0, learner(&model, 9, 0)), (1, learner(&model, 9, 1))]);
    let roster = Roster {
        proposers: vec![0, 1],
        matches: BTreeMap::from([(0, vec![1]), (1, vec![0])]),
        solvers: vec![0, 1],
    };
    let pool = pool();
    let mut buffers = TaskBuffers::seeded();
    let mut measured = Vec::new();
    for step in 1..=steps {
        let ctx = StepContext {
            seed: 9,
            step,
            settings: &settings,
            tokenizer: &tok,
            grammars: &grammars,
        };
        let report =
            selfplay::run_step(&ctx, &model, &pool, &mut learners, &roster, &mut buffers).unwrap();
        let m = &report.metrics;
        assert_eq!(m.proposals.total, 2 * 3);
        assert_eq!(
            m.phase_ms.keys().collect::<Vec<_>>(),
            ["propose", "score", "solve", "train", "validate"]
        );
        assert!(m.tokens.prompt_mean > 0.0 && m.tokens.response_mean > 0.0);
        let malformed: Vec<_> = m
            .proposals
            .rejected
            .keys()
            .filter(|k| k.starts_with("format."))
            .collect();
        assert!(malformed.is_empty(), "step {step}: {malformed:?}");
        for (kind, rate) in &m.solver_format_errors {
            assert!(
                rate.is_none_or(|r| r == 0.0),
                "step {step}: {kind:?} {rate:?}"
            );
        }
        let mut m = m.clone();
        m.phase_ms.clear();
        measured.push(m);
    }
    let sums = learners
        .values()
        .map(|l| l.adapter.checksum().unwrap())
        .collect();
    (measured, sums)
}

#[test]
fn generated_steps_on_a_tiny_model_are_reproducible() {
    let first = generated_run(2);
    let second = generated_run(2);
    assert_eq!(first, second);
}

#[test]
fn a_proposal_whose_solver_prompt_cannot_fit_is_rejected_not_fatal() {
    let (model, tok) = tiny();
    let mut settings = settings(&[TaskKind::Deduction, TaskKind::Abduction]);
    settings.buffer_problems = 0;
    // Proposer and deduction prompts fit (≈ 350-540 tokens of the tiny
    // vocabulary); this abduction prompt is ≈ 760.
    let limit = 600;
    settings.prompt.max_prompt_tokens = limit;
    let ctx = StepContext {
        seed: 5,
        step: 1,
        settings: &settings,
        tokenizer: &tok,
        grammars: &Grammars::off(),
    };
    let learners = BTreeMap::from([(0u64, learner(&model, 5, 0)), (1u64, learner(&model, 5, 1))]);
    let roster = Roster {
        proposers: vec![0],
        matches: BTreeMap::from([(0, vec![1])]),
        solvers: vec![1],
    };
    let pool = pool();
    let mut buffers = TaskBuffers::seeded();
    let set = learners
        .iter()
        .fold(AdapterSet::new(), |s, (&id, l)| s.with(id, &l.adapter));
    // A short program with an 11,000-character output: a deduction prompt
    // shows only program and input, an abduction prompt shows the output too.
    let long = "```python\ndef f(x):\n    return list(range(x))\n```\n```input\n2000\n```";
    let texts = [PROPOSALS[0], long, long, PROPOSALS[3]];
    let proposals = propose_scripted(&ctx, &model, &set, &roster, &buffers, &pool, &texts);
    let rejections: Vec<_> = proposals.iter().map(|p| p.verdict.rejection()).collect();
    assert_eq!(
        rejections,
        [None, None, Some("prompt_too_long".into()), None]
    );
    let Verdict::TooLong { tokens } = proposals[2].verdict else {
        panic!()
    };
    assert!(tokens > limit, "{tokens}");
    selfplay::accept(&mut buffers, &proposals).unwrap();
    assert_eq!(
        buffers.len(TaskKind::Abduction),
        2,
        "the long one is not kept"
    );
    let problems = selfplay::problems(&ctx, &roster, &proposals, &buffers).unwrap();
    assert_eq!(problems.len(), 3);

    // A task over the budget that reaches the solvers anyway (from a buffer
    // written before the check) is left out rather than failing the step.
    let mut sneaked = proposals[1].clone();
    sneaked.job.kind = TaskKind::Abduction;
    let problems = selfplay::problems(&ctx, &roster, &[sneaked], &buffers).unwrap();
    assert!(problems.is_empty(), "{} problems", problems.len());
}

/// Step 1 of seed 5.
fn context<'a>(
    settings: &'a Settings,
    tokenizer: &'a Tokenizer,
    grammars: &'a Grammars,
) -> StepContext<'a> {
    StepContext {
        seed: 5,
        step: 1,
        settings,
        tokenizer,
        grammars,
    }
}

/// (proposal, author, kind, solvers) of each problem, in order.
type Shape = (Option<usize>, Option<u64>, TaskKind, Vec<u64>);

fn shape(problems: &[Problem]) -> Vec<Shape> {
    problems
        .iter()
        .map(|p| (p.proposal, p.author, p.task.kind(), p.solvers.clone()))
        .collect()
}

#[test]
fn every_student_also_solves_buffer_problems_that_no_teacher_is_rewarded_for() {
    use TaskKind::{Abduction, Deduction};
    let (model, tok) = tiny();
    let base = settings(&[Deduction, Abduction]);
    let (teacher, student, idle) = (0u64, 1u64, 2u64);
    let learners: BTreeMap<u64, Learner> = [teacher, student, idle]
        .into_iter()
        .map(|id| (id, learner(&model, 5, id)))
        .collect();
    let set = learners
        .iter()
        .fold(AdapterSet::new(), |s, (&id, l)| s.with(id, &l.adapter));
    // `idle` is matched to no teacher.
    let roster = Roster {
        proposers: vec![teacher],
        matches: BTreeMap::from([(teacher, vec![student])]),
        solvers: vec![student, idle],
    };
    let pool = pool();
    let mut buffers = TaskBuffers::seeded();
    let with = |n: usize| Settings {
        buffer_problems: n,
        ..base.clone()
    };
    let grammars = Grammars::off();
    let proposals = propose_scripted(
        &context(&base, &tok, &grammars),
        &model,
        &set,
        &roster,
        &buffers,
        &pool,
        &PROPOSALS,
    );
    selfplay::accept(&mut buffers, &proposals).unwrap();
    let problems = |n: usize| {
        let settings = with(n);
        selfplay::problems(
            &context(&settings, &tok, &grammars),
            &roster,
            &proposals,
            &buffers,
        )
        .unwrap()
    };
    let proposed: Vec<Shape> = vec![
        (Some(0), Some(teacher), Deduction, vec![student]),
        (Some(3), Some(teacher), Abduction, vec![student]),
    ];
    let buffer = |solver: u64| -> Vec<Shape> {
        vec![
            (None, None, Deduction, vec![solver]),
            (None, None, Abduction, vec![solver]),
        ]
    };

    // 0: only the solver without a problem gets buffer problems.
    let none = problems(0);
    assert_eq!(shape(&none), [proposed.clone(), buffer(idle)].concat());
    // 1: the matched student too, one per kind.
    let one = problems(1);
    assert_eq!(
        shape(&one),
        [proposed.clone(), buffer(student), buffer(idle)].concat()
    );
    // Drawn from each solver's own stream: the idle one's are the fallback's.
    assert_eq!(one[4].task, none[2].task);
    assert_eq!(one[5].task, none[3].task);
    let two = problems(2);
    assert_eq!(two.len(), 2 + 2 * 2 * 2, "two per kind per solver");

    // Scored: the teacher's learnability comes from its own problems' rollouts
    // alone; the buffer rollouts ("no idea": malformed, −1) train the students.
    let settings = with(1);
    let jobs = selfplay::solve_jobs(&context(&settings, &tok, &grammars), &one);
    assert_eq!(jobs.len(), 6 * settings.solver_samples);
    let generations = jobs
        .iter()
        .map(|j| {
            let text = match one[j.problem].proposal {
                Some(0) => ANSWERS[0][j.sample],
                Some(_) => ANSWERS[1][j.sample],
                None => "no idea",
            };
            scripted(&model, &tok, &set, j.solver, &one[j.problem].tokens, text)
        })
        .collect();
    let solves = selfplay::judge_solutions(
        &context(&settings, &tok, &grammars),
        &one,
        jobs,
        generations,
        &pool,
    )
    .unwrap();
    let episodes = selfplay::episodes(&settings, &proposals, &one, &solves);
    let proposer: Vec<f64> = episodes
        .iter()
        .filter(|e| e.role == Role::Proposer)
        .map(|e| e.reward)
        .collect();
    let want = [2.0 / 3.0, -1.0, -0.5, 1.0 / 3.0];
    for (got, want) in proposer.iter().zip(want) {
        assert!((got - want).abs() < 1e-12, "{proposer:?}");
    }
    let solver_rewards = |member: u64| -> Vec<f64> {
        episodes
            .iter()
            .filter(|e| e.role == Role::Solver && e.member == member)
            .map(|e| e.reward)
            .collect()
    };
    let mine = solver_rewards(student);
    assert_eq!(mine.len(), 4 * 3);
    assert_eq!(mine[6..], [-1.0; 6], "buffer rollouts: {mine:?}");
    assert_eq!(solver_rewards(idle), [-1.0; 6]);
}

/// A solver episode of `member` with `reward` and `tokens` chosen tokens.
fn episode(member: u64, kind: TaskKind, reward: f64, tokens: usize) -> Episode {
    let picks = if tokens == 0 {
        vec![Pick::Forced; 3]
    } else {
        vec![Pick::Free; tokens]
    };
    Episode {
        member,
        kind,
        role: Role::Solver,
        prompt: vec![1, 2],
        response: vec![5; picks.len()],
        logprobs: vec![-1.0; picks.len()],
        picks,
        reward,
    }
}

#[test]
fn advantage_groups_pooled_or_per_member_and_the_nonzero_share() {
    use TaskKind::{Abduction, Deduction};
    // Member 1 solved every deduction, member 2 half of them; in abduction
    // member 1 failed and member 2 solved, and member 1's second abduction
    // reply was all forced (no token to train, weight 0 in the statistics).
    let episodes = [
        episode(1, Deduction, 1.0, 4),
        episode(1, Deduction, 1.0, 4),
        episode(2, Deduction, 1.0, 4),
        episode(2, Deduction, -0.5, 4),
        episode(2, Deduction, 1.0, 4),
        episode(2, Deduction, -0.5, 4),
        episode(1, Abduction, -0.5, 4),
        episode(2, Abduction, 1.0, 4),
        episode(1, Abduction, 1.0, 0),
    ];
    let settings = |groups| Settings {
        advantage_groups: groups,
        ..Settings::default()
    };
    let shares = |groups| {
        let settings = settings(groups);
        let batch = selfplay::train_rows(&settings, &episodes).unwrap();
        let m = StepMetrics::measure(1, &settings, &[], &[], &[], &episodes, &batch);
        let shares: Vec<(u64, TaskKind, usize, usize)> = m
            .member_groups
            .iter()
            .flat_map(|(&id, groups)| {
                groups
                    .iter()
                    .map(move |g| (id, g.kind, g.rollouts, g.nonzero_advantage))
            })
            .collect();
        (batch.advantages, shares)
    };

    // Pooled: member 1's deductions sit above the shared mean of 0.5;
    // abduction is −0.5 against 1.0 (mean 0.25, std 0.75).
    let (pooled, pooled_shares) = shares(AdvantageGroups::Pooled);
    assert!(pooled[..2].iter().all(|&a| a > 0.0), "{pooled:?}");
    assert_eq!(pooled[6..], [-1.0, 1.0, 1.0]);
    // Per member: member 1's all-equal deductions carry nothing, member 2's
    // are normalised within member 2 alone (mean 0.25, std 0.75).
    let (own, own_shares) = shares(AdvantageGroups::PerMember);
    assert_eq!(own[..2], [0.0, 0.0]);
    assert_eq!(own[2..6], [1.0, -1.0, 1.0, -1.0]);
    // Member 1's abductions: −0.5 and a 1.0 of weight 0, so std 0 and
    // zeros; member 2's single abduction has nothing to differ from.
    assert_eq!(own[6..], [0.0, 0.0, 0.0]);

    // The share counts rollouts with a non-zero advantage and a token to
    // train: member 1's all-forced abduction never counts.
    assert_eq!(
        pooled_shares,
        [
            (1, Deduction, 2, 2),
            (1, Abduction, 2, 1),
            (2, Deduction, 4, 4),
            (2, Abduction, 1, 1),
        ]
    );
    assert_eq!(
        own_shares,
        [
            (1, Deduction, 2, 0),
            (1, Abduction, 2, 0),
            (2, Deduction, 4, 4),
            (2, Abduction, 1, 0),
        ]
    );
    let share = StepMetrics::measure(
        1,
        &settings(AdvantageGroups::Pooled),
        &[],
        &[],
        &[],
        &episodes,
        &selfplay::train_rows(&settings(AdvantageGroups::Pooled), &episodes).unwrap(),
    )
    .member_groups[&1][1]
        .nonzero_share;
    assert_eq!(share, 0.5);
}
