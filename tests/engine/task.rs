//! Integration tests of the self-play task pieces (`populora::task`) and the
//! rewards/advantages built on them (`populora::rl`): parsers (including a
//! seeded fuzz loop), buffers, prompt builders.

use populora::keyed_stream;
use populora::rl::advantage::group_stats;
use populora::rl::{trr_plus_plus, AdvantageConfig, Rollout};
use populora::task::buffer::solver_task_from_induction;
use populora::task::{
    parse_answer, parse_induction_proposal, parse_proposal, proposer_prompt, solver_prompt, Answer,
    ChatPrompt, Error, FormatError, InductionTask, IoPair, PromptConfig, Role, SolverTask,
    TaskBuffers, TaskKind, Triplet,
};
use rand::Rng;

/// The ChatML rendering of SmolLM2-Instruct, so lengths are what the model sees.
fn chatml(p: &ChatPrompt) -> String {
    format!(
        "<|im_start|>system\n{}<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n",
        p.system, p.user
    )
}

/// Stand-in tokenizer for budget tests: rendered characters.
fn chars(p: &ChatPrompt) -> usize {
    chatml(p).chars().count()
}

fn triplet(program: &str, input: &str, output: &str, step: u64) -> Triplet {
    Triplet {
        program: program.to_string(),
        input: input.to_string(),
        output: output.to_string(),
        step,
        author: Some(7),
    }
}

// ---------------------------------------------------------------- parsers

#[test]
fn proposal_is_read_from_first_python_and_input_blocks() {
    let response = "<think>maybe ```python\ndef g(x): pass\n``` no</think>\n\
        Here:\n```python\ndef f(s):\n    return s[::-1]\n```\n```input\n'abc'\n```\n```input\n'zzz'\n```";
    let p = parse_proposal(response).unwrap();
    assert_eq!(p.program, "def f(s):\n    return s[::-1]");
    assert_eq!(p.input, "'abc'");
}

#[test]
fn proposal_in_answer_tags_wins_and_functions_are_renamed_to_f() {
    let response = "```python\ndef f(a): return 1\n```\n```input\n1\n```\n<answer>\n```Python\n\
        def fact(n):\n    return 1 if n < 2 else n * fact(n - 1)\n```\n```input\n5\n```\n</answer>";
    let p = parse_proposal(response).unwrap();
    assert_eq!(
        p.program,
        "def f(n):\n    return 1 if n < 2 else n * f(n - 1)"
    );
    assert_eq!(p.input, "5");
}

#[test]
fn a_nested_helper_is_part_of_the_one_function() {
    let program = "def double_all(xs):\n    def double(x):\n        return 2 * x\n    return [double(x) for x in xs]";
    let p = parse_proposal(&format!("```python\n{program}\n```\n```input\n[1]\n```")).unwrap();
    assert_eq!(
        p.program,
        "def f(xs):\n    def double(x):\n        return 2 * x\n    return [double(x) for x in xs]"
    );
}

#[test]
fn proposal_format_errors_are_typed() {
    let cases: [(&str, FormatError); 5] = [
        ("def f(a): return a", FormatError::NoProgramBlock),
        (
            "```python\nx = 1\n```\n```input\n1\n```",
            FormatError::NoFunction,
        ),
        (
            "```python\ndef f(a):\n    return a\ndef g(b):\n    return b\n```\n```input\n1\n```",
            FormatError::MultipleFunctions { count: 2 },
        ),
        (
            "```python\ndef f(a): return a\n```",
            FormatError::NoInputBlock,
        ),
        (
            "```python\ndef f(a): return a\n```\n```input\n  \n```",
            FormatError::EmptyInput,
        ),
    ];
    for (response, expected) in cases {
        assert_eq!(parse_proposal(response), Err(expected), "{response:?}");
    }
}

#[test]
fn induction_proposal_takes_last_inputs_and_the_message() {
    let mut response = String::from("<think>plan</think>");
    for i in 0..12 {
        response.push_str(&format!("```input\n{i}\n```\n"));
    }
    response.push_str("```message\nDoubles a number.\n```");
    let p = parse_induction_proposal(&response, 10).unwrap();
    assert_eq!(p.inputs, (2..12).map(|i| i.to_string()).collect::<Vec<_>>());
    assert_eq!(p.message, "Doubles a number.");

    let tagged = "```input\n1\n```\n```input\n2\n```\n<message> adds one </message>";
    assert_eq!(
        parse_induction_proposal(tagged, 2).unwrap().message,
        "adds one"
    );
    assert_eq!(
        parse_induction_proposal(tagged, 3),
        Err(FormatError::TooFewInputs {
            found: 2,
            needed: 3
        })
    );
    assert_eq!(
        parse_induction_proposal("```input\n1\n```", 1),
        Err(FormatError::NoMessage)
    );
    assert_eq!(
        parse_induction_proposal("```input\n1\n```\n```message\n\n```", 1),
        Err(FormatError::EmptyMessage)
    );
}

#[test]
fn answer_is_last_matching_block_of_last_answer() {
    let response = "<think>```output\n1\n```</think><answer>```output\n2\n```</answer> \
        <answer>\n```output\n3\n```\nor\n```output\n[4, 5]\n```\n</answer>";
    assert_eq!(
        parse_answer(TaskKind::Deduction, response),
        Ok(Answer::Output("[4, 5]".into()))
    );
    // An unlabelled fence counts as the expected label.
    let response = "<answer>```\n'x', 2\n```</answer>";
    assert_eq!(
        parse_answer(TaskKind::Abduction, response),
        Ok(Answer::Input("'x', 2".into()))
    );
    // A bare answer is taken as is.
    let response = "<think>so</think> <answer>  'Hello world' </answer>";
    assert_eq!(
        parse_answer(TaskKind::Deduction, response),
        Ok(Answer::Output("'Hello world'".into()))
    );
    let response = "<answer>```python\ndef solve(x):\n    return x\n```</answer>";
    assert_eq!(
        parse_answer(TaskKind::Induction, response),
        Ok(Answer::Program("def f(x):\n    return x".into()))
    );
}

#[test]
fn answer_format_errors_are_typed() {
    let cases: [(TaskKind, &str, FormatError); 6] = [
        (
            TaskKind::Deduction,
            "the output is 3",
            FormatError::NoAnswerTag,
        ),
        (
            TaskKind::Deduction,
            "<answer>3",
            FormatError::UnclosedAnswer,
        ),
        (TaskKind::Deduction, "3</answer>", FormatError::NoAnswerTag),
        (
            TaskKind::Deduction,
            "<answer> \n </answer>",
            FormatError::EmptyAnswer,
        ),
        (
            TaskKind::Abduction,
            "<answer>```output\n3\n```</answer>",
            FormatError::NoAnswerBlock(TaskKind::Abduction),
        ),
        (
            TaskKind::Induction,
            "<answer>return 3</answer>",
            FormatError::NoFunction,
        ),
    ];
    for (kind, response, expected) in cases {
        assert_eq!(parse_answer(kind, response), Err(expected), "{response:?}");
    }
}

/// Pieces the fuzz strings are made of: structure the parsers look for, near
/// misses, and awkward text.
const FRAGMENTS: [&str; 30] = [
    "```",
    "```python\n",
    "```input\n",
    "```output\n",
    "```message\n",
    "```py",
    "``",
    "`",
    "<answer>",
    "</answer>",
    "<answer",
    "</think>",
    "<think>",
    "<message>",
    "</message>",
    "def f(",
    "def ",
    "def g(x):",
    "fact(",
    "(",
    ")",
    ".",
    "\n",
    "    ",
    " ",
    "é",
    "🦀",
    "\u{0}",
    "\u{feff}",
    "'Hello world'",
];

fn fuzz_string(rng: &mut impl Rng) -> String {
    let mut s = String::new();
    for _ in 0..rng.random_range(0..40) {
        if rng.random_bool(0.8) {
            s.push_str(FRAGMENTS[rng.random_range(0..FRAGMENTS.len())]);
        } else {
            // Any scalar value, surrogates excluded by char::from_u32.
            if let Some(c) = char::from_u32(rng.random_range(0..0x11_0000)) {
                s.push(c);
            }
        }
    }
    s
}

/// Checks what the parsers return for `text`; counts the successful parses.
fn assert_parsers_hold(text: &str, parsed: &mut usize) {
    if let Ok(p) = parse_proposal(text) {
        assert!(p.program.contains("def f"), "{text:?} -> {p:?}");
        assert!(!p.input.is_empty() && text.contains(&p.input));
        *parsed += 1;
    }
    if let Ok(p) = parse_induction_proposal(text, 3) {
        assert_eq!(p.inputs.len(), 3);
        assert!(!p.message.is_empty() && text.contains(&p.message));
        *parsed += 1;
    }
    for kind in TaskKind::ALL {
        if let Ok(a) = parse_answer(kind, text) {
            assert!(!a.text().is_empty());
            match a {
                Answer::Program(p) => assert!(p.contains("def f")),
                other => assert!(text.contains(other.text())),
            }
            *parsed += 1;
        }
    }
}

#[test]
fn fuzz_parsers_never_panic() {
    let mut rng = keyed_stream!(20_261_202, "parser-fuzz");
    let mut parsed = 0;
    for _ in 0..20_000 {
        assert_parsers_hold(&fuzz_string(&mut rng), &mut parsed);
    }
    // The fragments are chosen so that some strings parse: the checks on
    // successful parses above must actually run.
    assert!(parsed > 100, "only {parsed} successful parses");
    // Huge inputs: parsing must stay linear and panic-free.
    let huge_blocks = "```input\n1\n```\n".repeat(100_000);
    let huge_fences = "```".repeat(300_000);
    let huge_tags = "<answer>".repeat(100_000) + &"</answer>".repeat(100_000);
    let huge_program = format!(
        "<answer>```python\ndef fn_(x):\n{}```</answer>",
        "    x = fn_(x)\n".repeat(50_000)
    );
    for text in [huge_blocks, huge_fences, huge_tags, huge_program] {
        assert_parsers_hold(&text, &mut parsed);
    }
}

#[test]
fn well_formed_proposals_round_trip() {
    let mut rng = keyed_stream!(1, "proposal-round-trip");
    for _ in 0..500 {
        let name: String = (0..rng.random_range(1..8))
            .map(|_| (b'a' + rng.random_range(0..26u8)) as char)
            .collect();
        let input = format!("[{}, '{}']", rng.random_range(-99..99), name);
        let body = format!("def {name}(xs):\n    return {name}(xs[1:]) if xs else 0");
        let text = format!("<think>hm</think>\n```python\n{body}\n```\n```input\n{input}\n```\n");
        let p = parse_proposal(&text).unwrap();
        assert_eq!(p.program, "def f(xs):\n    return f(xs[1:]) if xs else 0");
        assert_eq!(p.input, input);
    }
}

// ---------------------------------------------------------------- buffers

#[test]
fn buffers_start_from_identity_and_append_with_step_and_author() {
    let mut buffers = TaskBuffers::seeded();
    for kind in TaskKind::ALL {
        assert_eq!(buffers.len(kind), 1);
    }
    let seed = &buffers.triplets(TaskKind::Deduction).unwrap()[0];
    assert_eq!(seed.program, "def f(a):\n    return a");
    assert_eq!(
        (seed.input.as_str(), seed.output.as_str()),
        ("\"Hello world\"", "'Hello world'")
    );
    assert_eq!(buffers.induction_tasks()[0].pairs.len(), 10);

    buffers
        .push_triplet(
            TaskKind::Abduction,
            triplet("def f(x):\n    return x * 2", "3", "6", 4),
        )
        .unwrap();
    let added = &buffers.triplets(TaskKind::Abduction).unwrap()[1];
    assert_eq!((added.step, added.author), (4, Some(7)));
    assert_eq!(buffers.len(TaskKind::Deduction), 1);
    assert!(matches!(
        buffers.push_triplet(TaskKind::Induction, Triplet::identity()),
        Err(Error::NotATripletBuffer(TaskKind::Induction))
    ));
}

#[test]
fn buffers_round_trip_through_json() {
    let mut buffers = TaskBuffers::seeded();
    buffers
        .push_triplet(
            TaskKind::Deduction,
            triplet("def f(d):\n    return {'k': d}", "1", "{'k': 1}", 2),
        )
        .unwrap();
    buffers.push_induction(InductionTask {
        program: "def f(x):\n    return -x".into(),
        message: "négation 🦀".into(),
        pairs: vec![IoPair {
            input: "1".into(),
            output: "-1".into(),
        }],
        step: 3,
        author: Some(1),
    });
    let json = serde_json::to_string(&buffers).unwrap();
    let back: TaskBuffers = serde_json::from_str(&json).unwrap();
    assert_eq!(back, buffers);
}

#[test]
fn sampling_is_deterministic_and_without_replacement() {
    let mut buffers = TaskBuffers::seeded();
    for i in 0..20u64 {
        let program = format!("def f(x):\n    return x + {i}");
        buffers
            .push_triplet(
                TaskKind::Deduction,
                triplet(&program, "1", &(i + 1).to_string(), i + 1),
            )
            .unwrap();
    }
    let draw = |seed: u64| -> Vec<String> {
        let mut rng = keyed_stream!(seed, 3u64, "references");
        let refs = buffers
            .sample_triplets(TaskKind::Deduction, 6, &mut rng)
            .unwrap();
        refs.iter().map(|t| t.program.clone()).collect()
    };
    let a = draw(1);
    assert_eq!(a, draw(1));
    assert_ne!(a, draw(2));
    let mut unique = a.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(unique.len(), 6);
    // Fewer entries than asked: all of them.
    let mut rng = keyed_stream!(1, "references");
    assert_eq!(
        buffers
            .sample_triplets(TaskKind::Abduction, 6, &mut rng)
            .unwrap()
            .len(),
        1
    );

    let mut rng = keyed_stream!(9, "solver");
    let tasks = buffers
        .sample_solver_tasks(TaskKind::Induction, 3, 5, &mut rng)
        .unwrap();
    assert_eq!(tasks.len(), 3);
    for task in &tasks {
        let SolverTask::Induction { shown, hidden, .. } = task else {
            panic!("not induction: {task:?}")
        };
        assert_eq!((shown.len(), hidden.len()), (5, 5));
    }
}

// ---------------------------------------------------------------- prompts

fn buffers_with_long_programs() -> TaskBuffers {
    let mut buffers = TaskBuffers::seeded();
    for i in 0..10u64 {
        let body = format!("    y = x * {i}\n").repeat(10);
        let program = format!("def f(x):\n{body}    return y");
        buffers
            .push_triplet(
                TaskKind::Deduction,
                triplet(&program, "2", &(2 * i).to_string(), 1),
            )
            .unwrap();
    }
    buffers
}

#[test]
fn proposer_prompt_shows_k_references_in_budget() {
    let buffers = buffers_with_long_programs();
    let cfg = PromptConfig {
        max_prompt_tokens: 100_000,
        ..PromptConfig::default()
    };
    let mut rng = keyed_stream!(5, "proposer");
    let p = proposer_prompt(TaskKind::Deduction, &buffers, &cfg, &mut rng, &chars).unwrap();
    assert_eq!(p.references, 6);
    assert_eq!(p.prompt.tokens, chars(&p.prompt.chat));
    assert_eq!(p.prompt.chat.user.matches("```input").count(), 6 + 1); // references + reply format
    assert!(p.prompt.chat.user.contains("predict the output"));
    assert!(p
        .prompt
        .chat
        .user
        .trim_end()
        .ends_with("```input\n...\n```"));

    // A tight budget drops references, keeping the prompt under it.
    let tight = PromptConfig {
        max_prompt_tokens: 1100,
        ..cfg.clone()
    };
    let mut rng = keyed_stream!(5, "proposer");
    let p = proposer_prompt(TaskKind::Deduction, &buffers, &tight, &mut rng, &chars).unwrap();
    assert!(p.references < 6 && p.references > 0, "{}", p.references);
    assert!(p.prompt.tokens <= 1100);

    let impossible = PromptConfig {
        max_prompt_tokens: 50,
        ..cfg
    };
    let mut rng = keyed_stream!(5, "proposer");
    assert!(matches!(
        proposer_prompt(TaskKind::Abduction, &buffers, &impossible, &mut rng, &chars),
        Err(Error::PromptTooLong {
            kind: TaskKind::Abduction,
            role: Role::Proposer,
            limit: 50,
            ..
        })
    ));
}

#[test]
fn induction_proposer_gets_a_program_from_the_triplet_buffers() {
    let buffers = buffers_with_long_programs();
    let mut rng = keyed_stream!(8, "proposer");
    let p = proposer_prompt(
        TaskKind::Induction,
        &buffers,
        &PromptConfig::default(),
        &mut rng,
        &chars,
    )
    .unwrap();
    let program = p.program.unwrap();
    assert!(buffers
        .triplets(TaskKind::Deduction)
        .unwrap()
        .iter()
        .any(|t| t.program == program));
    assert!(p.prompt.chat.user.contains(&program));
    assert!(p.prompt.chat.user.contains("Write 10 different inputs"));
}

#[test]
fn solver_prompts_show_what_the_kind_allows_and_hide_the_rest() {
    let t = triplet("def f(x):\n    return x[::-1]", "'abc'", "'cba'", 1);
    let cfg = PromptConfig::default();
    let d = solver_prompt(&SolverTask::Deduction(t.clone()), &cfg, &chars).unwrap();
    assert!(d.chat.user.contains(&t.program) && d.chat.user.contains("'abc'"));
    assert!(!d.chat.user.contains("'cba'"));
    let a = solver_prompt(&SolverTask::Abduction(t.clone()), &cfg, &chars).unwrap();
    assert!(a.chat.user.contains("'cba'") && !a.chat.user.contains("'abc'"));

    let mut rng = keyed_stream!(2, "split");
    let task = solver_task_from_induction(&InductionTask::identity(), 5, &mut rng);
    let i = solver_prompt(&task, &cfg, &chars).unwrap();
    let SolverTask::Induction { shown, hidden, .. } = &task else {
        panic!("not induction")
    };
    for pair in shown {
        assert!(i
            .chat
            .user
            .contains(&format!("f({}) == {}", pair.input, pair.output)));
    }
    for pair in hidden {
        assert!(
            !i.chat.user.contains(&format!("f({})", pair.input)),
            "hidden {pair:?} shown"
        );
    }
    assert!(!i.chat.user.contains("return a"), "program leaked");
}

/// Prints the rendered lengths of the prompts a fresh run starts with (run with
/// `--nocapture`); asserts they stay short.
#[test]
fn seed_prompts_are_short() {
    let buffers = TaskBuffers::seeded();
    let cfg = PromptConfig::default();
    let mut lengths = Vec::new();
    for kind in TaskKind::ALL {
        let mut rng = keyed_stream!(0, "lengths");
        let p = proposer_prompt(kind, &buffers, &cfg, &mut rng, &chars).unwrap();
        lengths.push((kind, Role::Proposer, p.prompt.tokens));
        let mut rng = keyed_stream!(0, "lengths");
        let task = &buffers
            .sample_solver_tasks(kind, 1, cfg.induction_shown, &mut rng)
            .unwrap()[0];
        lengths.push((
            kind,
            Role::Solver,
            solver_prompt(task, &cfg, &chars).unwrap().tokens,
        ));
    }
    for (kind, role, n) in &lengths {
        println!("{:>9} {:>8}: {n} chars rendered", kind.name(), role.name());
        assert!(*n < 1200, "{kind:?} {role:?} prompt is {n} chars");
    }
}

// ---------------------------------------------------------------- rl

#[test]
fn fuzz_advantages_are_finite_and_normalised_per_group() {
    let mut rng = keyed_stream!(3, "advantage-fuzz");
    let kinds = TaskKind::ALL;
    for _ in 0..200 {
        let rollouts: Vec<Rollout> = (0..rng.random_range(1..60))
            .map(|_| Rollout {
                kind: kinds[rng.random_range(0..3)],
                role: if rng.random_bool(0.5) {
                    Role::Proposer
                } else {
                    Role::Solver
                },
                reward: [-1.0, -0.5, 0.0, 0.25, 1.0][rng.random_range(0..5)],
                tokens: rng.random_range(0..300),
                group: rng.random_range(0..3),
            })
            .collect();
        let adv = trr_plus_plus(&rollouts, &AdvantageConfig::default()).unwrap();
        assert!(adv.iter().all(|a| a.is_finite()));
        for g in group_stats(&rollouts).unwrap() {
            let members: Vec<usize> = (0..rollouts.len())
                .filter(|&i| {
                    let r = &rollouts[i];
                    (r.group, r.kind, r.role) == (g.group, g.kind, g.role)
                })
                .collect();
            let w: f64 = members.iter().map(|&i| rollouts[i].tokens as f64).sum();
            let mean: f64 = members
                .iter()
                .map(|&i| rollouts[i].tokens as f64 * adv[i])
                .sum::<f64>();
            let var: f64 = members
                .iter()
                .map(|&i| rollouts[i].tokens as f64 * adv[i] * adv[i])
                .sum::<f64>();
            if g.std <= 1e-6 || w == 0.0 {
                assert!(members.iter().all(|&i| adv[i] == 0.0));
            } else {
                assert!(
                    (mean / w).abs() < 1e-9 && (var / w - 1.0).abs() < 1e-9,
                    "{g:?}"
                );
            }
        }
    }
}
