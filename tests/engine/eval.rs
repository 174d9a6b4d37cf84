//! Tests of the `eval` module. The HumanEval tests fetch the data file into
//! the cache on first use (like the model) and fail loudly if they cannot.

use populora::eval::humaneval::{self, Problem};
use populora::eval::humaneval_io::{self, IoConfig, IoKind};
use populora::eval::math;
use populora::eval::{table, BenchmarkResult, EvalError};
use populora::verify::{SandboxConfig, VerifierPool};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Instant;

fn pool() -> &'static VerifierPool {
    static POOL: OnceLock<VerifierPool> = OnceLock::new();
    POOL.get_or_init(|| VerifierPool::new(SandboxConfig::default()).expect("sandbox starts"))
}

fn humaneval_path() -> PathBuf {
    populora::base::fetch::HUMAN_EVAL
        .ensure(&mut |m| eprintln!("{m}"))
        .unwrap_or_else(|e| panic!("HumanEval data is required for this test: {e}"))
}

fn problems() -> &'static [Problem] {
    static PROBLEMS: OnceLock<Vec<Problem>> = OnceLock::new();
    PROBLEMS.get_or_init(|| humaneval::load(&humaneval_path()).expect("HumanEval loads"))
}

fn scratch_file(name: &str, contents: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("populora-eval-tests-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, contents).unwrap();
    path
}

fn toy_problem() -> Problem {
    Problem {
        task_id: "Toy/0".into(),
        prompt: "def add(a, b):\n    \"\"\"Add two numbers.\n    >>> add(1, 2)\n    3\n    \"\"\"\n".into(),
        canonical_solution: "    return a + b\n".into(),
        test: "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(-1, 1) == 0\n".into(),
        entry_point: "add".into(),
    }
}

// ------------------------------------------------------------- HumanEval --

#[test]
fn humaneval_loads_164_problems() {
    let problems = problems();
    assert_eq!(problems.len(), humaneval::PROBLEMS);
    assert_eq!(problems[0].task_id, "HumanEval/0");
    assert_eq!(problems[0].entry_point, "has_close_elements");
    assert!(problems.iter().all(|p| p.test.contains("def check(")));
}

#[test]
fn humaneval_corrupt_line_names_file_and_line() {
    let good = serde_json::to_string(&toy_problem()).unwrap();
    let path = scratch_file("corrupt.jsonl", &format!("{good}\n\n{{\"task_id\": 3\n"));
    let error = humaneval::load(&path).unwrap_err();
    assert!(
        matches!(error, EvalError::BadRecord { line: 3, .. }),
        "{error}"
    );
    let message = error.to_string();
    assert!(
        message.contains("corrupt.jsonl") && message.contains("line 3"),
        "{message}"
    );

    let missing = humaneval::load(Path::new("/nonexistent/HumanEval.jsonl")).unwrap_err();
    assert!(missing.to_string().contains("/nonexistent/HumanEval.jsonl"));
}

#[test]
fn humaneval_canonical_solutions_pass() {
    let problems = problems();
    let samples: Vec<(&Problem, &str)> = problems
        .iter()
        .map(|p| (p, p.canonical_solution.as_str()))
        .collect();
    let start = Instant::now();
    let results = humaneval::score_batch(pool(), &samples);
    let elapsed = start.elapsed();
    eprintln!(
        "scored {} canonical solutions in {:.2} s on {} workers",
        samples.len(),
        elapsed.as_secs_f64(),
        pool().config().workers
    );
    let failed: Vec<&str> = problems
        .iter()
        .zip(&results)
        .filter(|(_, r)| !matches!(r, Ok(true)))
        .map(|(p, _)| p.task_id.as_str())
        .collect();
    assert!(failed.is_empty(), "canonical solutions failed: {failed:?}");
}

#[test]
fn humaneval_whole_function_responses_pass() {
    let problems = problems();
    // A chat answer: prose, the full function, then an example block.
    let samples: Vec<(&Problem, String)> = problems
        .iter()
        .map(|p| {
            let response = format!(
                "Here is the function:\n```python\n{}{}\nprint({}())\n```\nExample:\n```python\n{}()\n```",
                p.prompt, p.canonical_solution, p.entry_point, p.entry_point
            );
            (p, humaneval::completion_from_response(p, &response))
        })
        .collect();
    let borrowed: Vec<(&Problem, &str)> = samples.iter().map(|(p, c)| (*p, c.as_str())).collect();
    let results = humaneval::score_batch(pool(), &borrowed);
    let failed: Vec<&str> = problems
        .iter()
        .zip(&results)
        .filter(|(_, r)| !matches!(r, Ok(true)))
        .map(|(p, _)| p.task_id.as_str())
        .collect();
    assert!(failed.is_empty(), "failed: {failed:?}");
}

#[test]
fn humaneval_wrong_or_empty_completions_fail() {
    let problem = toy_problem();
    assert!(humaneval::score(pool(), &problem, &problem.canonical_solution).unwrap());
    assert!(!humaneval::score(pool(), &problem, "").unwrap());
    assert!(!humaneval::score(pool(), &problem, "    return a - b\n").unwrap());
    assert!(!humaneval::score(pool(), &problem, "    while True: pass\n").unwrap());
    let judgement = humaneval::judge(pool(), &problem, "    return a - b\n").unwrap();
    assert_eq!(judgement.status.name(), "mismatch");
}

#[test]
fn humaneval_completion_extraction() {
    let problem = toy_problem();
    let program = |response: &str| {
        humaneval::program(
            &problem,
            &humaneval::completion_from_response(&problem, response),
        )
    };

    // Whole function in a block: appended after the stub, example calls dropped.
    let whole = "Sure!\n```python\nimport math\n\ndef add(a, b):\n    return a + b\n\nprint(add(1, 2))\nassert add(1, 1) == 3\n```";
    let completion = humaneval::completion_from_response(&problem, whole);
    assert_eq!(
        completion,
        "\nimport math\n\ndef add(a, b):\n    return a + b\n"
    );
    assert!(humaneval::score(pool(), &problem, &completion).unwrap());

    // Body only, indented, with trailing chatter after the block closes.
    let body = "```python\n    return a + b\n```\nThis adds.";
    assert_eq!(
        humaneval::completion_from_response(&problem, body),
        "    return a + b\n"
    );

    // Body only, unindented: indented by four spaces.
    let flat = "```\nresult = a + b\nreturn result\n```";
    assert_eq!(
        humaneval::completion_from_response(&problem, flat),
        "    result = a + b\n    return result\n"
    );

    // A cut-off generation (unclosed fence) still yields the function.
    let cut = "```python\ndef add(a, b):\n    return a + b";
    assert!(humaneval::score(
        pool(),
        &problem,
        &humaneval::completion_from_response(&problem, cut)
    )
    .unwrap());

    // The block that defines the entry point wins over an earlier one.
    let two = "```python\nadd(1, 2)\n```\n```python\ndef add(a, b):\n    return b + a\n```";
    assert!(program(two).contains("return b + a"));

    // No code at all: an empty completion.
    assert_eq!(humaneval::completion_from_response(&problem, ""), "");
}

#[test]
fn pass_at_k_matches_hand_computed_values() {
    let close = |a: f64, b: f64| (a - b).abs() < 1e-12;
    assert!(close(humaneval::pass_at_k(10, 3, 1), 0.3));
    // 1 - C(7,5)/C(10,5) = 1 - 21/252
    assert!(close(humaneval::pass_at_k(10, 3, 5), 1.0 - 21.0 / 252.0));
    // 1 - C(199,100)/C(200,100) = 1 - 100/200
    assert!(close(humaneval::pass_at_k(200, 1, 100), 0.5));
    // 1 - C(8,2)/C(10,2) = 1 - 28/45
    assert!(close(humaneval::pass_at_k(10, 2, 2), 1.0 - 28.0 / 45.0));
    assert!(close(humaneval::pass_at_k(5, 0, 2), 0.0));
    assert!(close(humaneval::pass_at_k(5, 4, 2), 1.0)); // n - c < k
    assert!(close(humaneval::pass_at_k(1, 1, 1), 1.0));
    // Clamped edges never panic.
    assert!(close(humaneval::pass_at_k(0, 0, 1), 0.0));
    assert!(close(humaneval::pass_at_k(3, 9, 1), 1.0));
    assert!(close(humaneval::pass_at_k(3, 1, 10), 1.0));
    assert!(close(humaneval::pass_at_k(3, 1, 0), 0.0));
}

#[test]
fn samples_jsonl_has_the_standard_format() {
    let path = scratch_file("samples.jsonl", "");
    let samples = [
        ("HumanEval/0", "    return 1\n"),
        ("HumanEval/1", "\"quoted\"\n"),
    ];
    humaneval::write_samples_jsonl(&path, &samples).unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2);
    assert_eq!(lines[1]["task_id"], "HumanEval/1");
    assert_eq!(lines[1]["completion"], "\"quoted\"\n");
    assert_eq!(lines[0].as_object().unwrap().len(), 2);

    let unwritable = humaneval::write_samples_jsonl(Path::new("/nonexistent/s.jsonl"), &samples);
    assert!(unwritable
        .unwrap_err()
        .to_string()
        .contains("/nonexistent/s.jsonl"));
}

// ---------------------------------------------------------- HumanEval-IO --

#[test]
fn asserts_are_split_on_the_top_level_equals() {
    let test = r#"
def check(candidate):
    assert candidate([1, 2], 3) == [3, 4]
    assert candidate("a == b, c") == 'x, y', "message with == and ,"
	assert candidate({'k': (1, 2)}) == {'k': 3}  # a comment == here
    assert candidate(2.0) == 1.5
    assert abs(candidate(1.0) - 0.5) < 1e-6
    assert candidate(1) is True
    assert not candidate(3)
    assert candidate(1) == 2 == 2
    assert candidate(1) <= 2
    assert candidate(1) != 2
    assert candidate(candidate(1)) == 1
    assert candidate(1) == (2 if True else 3)
    assert candidate(1) == 1 or True
    assert candidate([1,
    assert True, "This prints if this assert fails"
    assert candidate('unterminated) == 1
    assert candidate(x) == y
"#;
    let found = humaneval_io::extract_asserts(test);
    let expected = [
        ("[1, 2], 3", "[3, 4]"),
        ("\"a == b, c\"", "'x, y'"),
        ("{'k': (1, 2)}", "{'k': 3}"),
        ("2.0", "1.5"),
        ("x", "y"),
    ];
    let found: Vec<(&str, &str)> = found
        .iter()
        .map(|(a, e)| (a.as_str(), e.as_str()))
        .collect();
    assert_eq!(found, expected);
}

#[test]
fn io_program_is_f_without_docstring() {
    let program = humaneval_io::function_program(&toy_problem()).unwrap();
    assert_eq!(program, "def f(a, b):\n    return a + b");

    let recursive = Problem {
        prompt: "def fib(n: int) -> int:\n    '''Fib.\n    >>> fib(3)\n    2\n    '''\n".into(),
        canonical_solution:
            "    if n < 2:\n        return n  # fib(0) = 0\n    return fib(n - 1) + fib(n - 2)\n"
                .into(),
        entry_point: "fib".into(),
        ..toy_problem()
    };
    let program = humaneval_io::function_program(&recursive).unwrap();
    assert_eq!(
        program,
        "def f(n: int) -> int:\n    if n < 2:\n        return n  # fib(0) = 0\n    return f(n - 1) + f(n - 2)"
    );

    // A docstring after an import goes; strings inside brackets or
    // assignments stay.
    let tricky = Problem {
        prompt: "def g(x):\n    import math\n    \"\"\"Doc.\"\"\"\n".into(),
        canonical_solution:
            "    s = [\n        \"a\"\n    ]\n    t = '''\nkeep\n'''\n    return s, t, g\n".into(),
        entry_point: "g".into(),
        ..toy_problem()
    };
    assert_eq!(
        humaneval_io::function_program(&tricky).unwrap(),
        "def f(x):\n    import math\n    s = [\n        \"a\"\n    ]\n    t = '''\nkeep\n'''\n    return s, t, f"
    );

    let clash = Problem {
        canonical_solution: "    f = a + b\n    return f\n".into(),
        ..toy_problem()
    };
    assert_eq!(humaneval_io::function_program(&clash), None);
}

#[test]
fn io_items_from_humaneval() {
    let problems = problems();
    let start = Instant::now();
    let set = humaneval_io::build(pool(), problems, &IoConfig::default()).unwrap();
    let stats = &set.stats;
    eprintln!(
        "HumanEval-IO built in {:.2} s: {} output items, {} input items from {} problems; stats {:?}",
        start.elapsed().as_secs_f64(),
        stats.output_items,
        stats.input_items,
        stats.problems_used,
        stats
    );
    assert!(stats.output_items > 300, "{stats:?}");
    assert!(stats.input_items > 250, "{stats:?}");
    for item in &set.items {
        assert!(item.program.starts_with("def f(") || item.program.contains("\ndef f("));
        assert!(!item.program.contains(">>>"), "{}", item.task_id);
    }
    // Golds score as correct, wrong answers as wrong (a sample of each kind).
    let outputs: Vec<_> = set
        .items
        .iter()
        .filter(|i| i.kind == IoKind::Output)
        .take(15)
        .collect();
    let inputs: Vec<_> = set
        .items
        .iter()
        .filter(|i| i.kind == IoKind::Input)
        .take(15)
        .collect();
    for item in outputs {
        assert!(
            humaneval_io::score_output(pool(), item, &item.output).unwrap(),
            "{item:?}"
        );
        assert!(!humaneval_io::score_output(pool(), item, "'no such value'").unwrap());
    }
    for item in inputs {
        assert!(
            humaneval_io::score_input(pool(), item, &item.input).unwrap(),
            "{item:?}"
        );
        assert!(humaneval_io::score(pool(), item, &item.input).unwrap());
    }
}

#[test]
fn io_scoring_follows_the_sandbox_rules() {
    let set = humaneval_io::build(pool(), &[toy_problem()], &IoConfig::default()).unwrap();
    let kinds: Vec<(IoKind, &str, &str)> = set
        .items
        .iter()
        .map(|i| (i.kind, i.input.as_str(), i.output.as_str()))
        .collect();
    assert_eq!(
        kinds,
        [
            (IoKind::Output, "1, 2", "3"),
            (IoKind::Output, "-1, 1", "0"),
            (IoKind::Input, "1, 2", "3"),
            (IoKind::Input, "-1, 1", "0"),
        ]
    );
    let input_item = &set.items[2];
    assert!(humaneval_io::score_input(pool(), input_item, "0, 3").unwrap());
    assert!(humaneval_io::score_input(pool(), input_item, "b=2, a=1").unwrap());
    assert!(!humaneval_io::score_input(pool(), input_item, "1, 1").unwrap());
    assert!(!humaneval_io::score_input(pool(), input_item, "not python (").unwrap());
    let output_item = &set.items[0];
    assert!(humaneval_io::score_output(pool(), output_item, " 3 ").unwrap());
    assert!(humaneval_io::score_output(pool(), output_item, "3.0").unwrap());
    assert!(!humaneval_io::score_output(pool(), output_item, "4").unwrap());
}

// ------------------------------------------------------------------ math --

#[test]
fn gsm8k_loads_and_reports_bad_lines() {
    let good = r##"{"question": "Tom has 3 apples and buys 1,000 more. How many?", "answer": "3 + 1000 = 1003\n#### 1,003"}"##;
    let path = scratch_file("gsm.jsonl", &format!("{good}\n{good}\n"));
    let problems = math::load_gsm8k(&path).unwrap();
    assert_eq!(problems.len(), 2);
    assert_eq!(problems[0].answer, "1003");
    for style in [math::MathPrompt::Boxed, math::MathPrompt::AnswerTags] {
        assert!(math::gsm8k_prompt(&problems[0], style)
            .user
            .contains("Tom has 3 apples"));
    }

    let no_hashes = r#"{"question": "q", "answer": "no final line"}"#;
    let path = scratch_file("gsm-bad.jsonl", &format!("{good}\n{no_hashes}\n"));
    let message = math::load_gsm8k(&path).unwrap_err().to_string();
    assert!(
        message.contains("gsm-bad.jsonl") && message.contains("line 2"),
        "{message}"
    );

    let path = scratch_file("gsm-broken.jsonl", "{\"question\": \"q\"}\n");
    let message = math::load_gsm8k(&path).unwrap_err().to_string();
    assert!(
        message.contains("line 1") && message.contains("answer"),
        "{message}"
    );
}

#[test]
fn math_loads_nested_boxed_answers() {
    let lines = [
        r#"{"problem": "p1", "solution": "So $x = \\boxed{\\frac{1}{\\sqrt{2}}}$.", "level": "Level 3", "type": "Algebra"}"#,
        r#"{"problem": "p2", "solution": "...", "answer": "5", "level": 2, "subject": "Geometry"}"#,
    ];
    let path = scratch_file("math.jsonl", &lines.join("\n"));
    let problems = math::load_math(&path).unwrap();
    assert_eq!(problems[0].answer, "\\frac{1}{\\sqrt{2}}");
    assert_eq!(problems[0].subject.as_deref(), Some("Algebra"));
    assert_eq!(problems[1].answer, "5");
    assert_eq!(problems[1].level.as_deref(), Some("2"));
    assert!(
        math::math_prompt(&problems[0], math::MathPrompt::AnswerTags)
            .user
            .contains("\\boxed{...}")
    );
    assert!(math::math_prompt(&problems[0], math::MathPrompt::Boxed)
        .system
        .contains("\\boxed{}"));

    let path = scratch_file(
        "math-bad.jsonl",
        &format!(
            "{}\n{}\n",
            lines[0], r#"{"problem": "p", "solution": "none"}"#
        ),
    );
    let message = math::load_math(&path).unwrap_err().to_string();
    assert!(
        message.contains("math-bad.jsonl") && message.contains("line 2"),
        "{message}"
    );
}

#[test]
fn gsm8k_answer_extraction() {
    let cases = [
        ("<think>3+4=7</think><answer>7</answer>", Some("7")),
        ("<answer>The answer is $1,250.</answer>", Some("1,250")),
        ("He has 5 then 6.\n#### 11\nDone at 12", Some("11")),
        ("So the total is \\boxed{42}.", Some("42")),
        ("First 3, then -4.5, finally 18.", Some("18")),
        ("no numbers here", None),
        ("<answer>x2 and 3</answer>", Some("3")),
    ];
    for (response, want) in cases {
        assert_eq!(
            math::extract_gsm8k_answer(response).as_deref(),
            want,
            "{response}"
        );
    }
}

#[test]
fn gsm8k_comparisons() {
    let cases = [
        ("18", "18", true),
        ("1,250", "1250", true),
        ("$18.00", "18", true),
        ("18.0", "18", true),
        ("18.", "18", true),
        ("-3", "-3", true),
        ("0.5", "1/2", true),
        ("25%", "25", true),
        ("17", "18", false),
        ("18.5", "18", false),
        ("0.3333333", "1/3", true),
        ("0.333", "1/3", false),
        ("1e3", "1000", true),
        ("abc", "18", false),
        ("", "0", false),
        (
            "123456789012345678901234567890",
            "123456789012345678901234567890",
            true,
        ),
        (
            "123456789012345678901234567891",
            "123456789012345678901234567890",
            false,
        ),
    ];
    for (predicted, gold, want) in cases {
        assert_eq!(
            math::gsm8k_equal(predicted, gold),
            want,
            "{predicted} vs {gold}"
        );
    }
    let problem = math::GsmProblem {
        question: "q".into(),
        solution: "#### 72".into(),
        answer: "72".into(),
    };
    let tags = math::MathPrompt::AnswerTags;
    assert!(math::score_gsm8k(&problem, "<answer>72</answer>", tags));
    assert!(!math::score_gsm8k(&problem, "<answer>71</answer>", tags));
    let boxed = math::MathPrompt::Boxed;
    assert!(math::score_gsm8k(&problem, "so \\boxed{\\$72}.", boxed));
    assert!(!math::score_gsm8k(&problem, "<answer>72</answer>", boxed));
}

#[test]
fn math_answer_extraction() {
    assert_eq!(
        math::extract_math_answer("a \\boxed{1} then \\boxed{\\frac{a}{\\sqrt{b^{2}}}}.")
            .as_deref(),
        Some("\\frac{a}{\\sqrt{b^{2}}}")
    );
    assert_eq!(
        math::extract_math_answer("\\boxed 5$").as_deref(),
        Some("5")
    );
    assert_eq!(math::extract_math_answer("\\fbox{7}").as_deref(), Some("7"));
    // An unbalanced last box (cut-off generation) falls back to an earlier one.
    assert_eq!(
        math::extract_math_answer("\\boxed{2} and \\boxed{3").as_deref(),
        Some("2")
    );
    assert_eq!(
        math::extract_math_answer("<answer>$x^2$</answer>").as_deref(),
        Some("x^2")
    );
    assert_eq!(math::extract_math_answer("I don't know"), None);
    assert_eq!(
        math::last_boxed("\\boxed{{1,2},{3}}").as_deref(),
        Some("{1,2},{3}")
    );
}

#[test]
fn math_comparisons() {
    let cases = [
        ("\\frac{1}{2}", "\\dfrac{1}{2}", true),
        ("0.5", "\\frac{1}{2}", true),
        ("\\frac12", "\\frac{1}{2}", true),
        ("1/2", "\\frac{1}{2}", true),
        ("-\\frac{1}{2}", "-0.5", true),
        ("\\left( 3, 4 \\right)", "(3,4)", true),
        ("90^\\circ", "90", true),
        ("90^{\\circ}", "90", true),
        ("10\\%", "10", true),
        ("\\$5.00", "5", true),
        ("5 \\text{ cm}", "5", true),
        ("5\\mbox{ inches}", "5", true),
        ("\\text{(A)}", "(A)", true),
        ("\\text{Evelyn}", "Evelyn", true),
        ("x = 3", "3", true),
        ("1,000", "1000", true),
        ("6.", "6", true),
        ("\\sqrt2", "\\sqrt{2}", true),
        ("2\\sqrt{3}", "2 \\sqrt{3}", true),
        ("1\\!000", "1000", true),
        ("\\tfrac{3}{4}", "0.75", true),
        (".5", "0.5", true),
        ("2\\sqrt{3}", "3\\sqrt{2}", false),
        ("\\frac{1}{3}", "0.333", false),
        ("(1,2)", "12", false),
        ("x^2", "x^3", false),
        ("2x", "2", false),
        ("", "0", false),
    ];
    for (predicted, gold, want) in cases {
        assert_eq!(
            math::math_equal(predicted, gold),
            want,
            "{predicted} vs {gold}"
        );
    }
    let problem = math::MathProblem {
        problem: "p".into(),
        solution: "\\boxed{\\frac{3}{4}}".into(),
        answer: "\\frac{3}{4}".into(),
        level: None,
        subject: None,
        unit: None,
    };
    for style in [math::MathPrompt::Boxed, math::MathPrompt::AnswerTags] {
        assert!(math::score_math(&problem, "so \\boxed{\\dfrac34}", style));
        assert!(!math::score_math(&problem, "so \\boxed{\\frac43}", style));
    }
    assert!(math::score_math(
        &problem,
        "<answer>3/4</answer>",
        math::MathPrompt::AnswerTags
    ));
    assert!(!math::score_math(
        &problem,
        "<answer>3/4</answer>",
        math::MathPrompt::Boxed
    ));
}

// --------------------------------------------------------------- results --

fn results() -> Vec<BenchmarkResult> {
    vec![
        BenchmarkResult::from_counts("humaneval", "m0", &[(2, 1), (2, 0)], Some(2)),
        BenchmarkResult::from_counts("gsm8k", "m0", &[(1, 1), (1, 1), (1, 0), (1, 0)], None),
        BenchmarkResult::from_counts("humaneval", "m1", &[(2, 2), (2, 1)], Some(2)),
        BenchmarkResult::from_counts("gsm8k", "m1", &[(1, 0), (1, 0), (1, 0), (1, 1)], None),
    ]
}

#[test]
fn results_from_counts() {
    let r = &results()[0];
    assert_eq!((r.n, r.correct), (2, 1));
    assert!((r.pass_at_1 - 0.25).abs() < 1e-12);
    assert_eq!(r.pass_at_k, Some((2, 0.5)));
    let r = &results()[3];
    assert_eq!((r.n, r.correct, r.pass_at_k), (4, 1, None));
    assert!((r.pass_at_1 - 0.25).abs() < 1e-12);
    let empty = BenchmarkResult::from_counts("x", "m", &[], Some(5));
    assert_eq!((empty.n, empty.pass_at_1), (0, 0.0));
}

#[test]
fn results_table_and_json() {
    let baseline = [BenchmarkResult::from_counts(
        "humaneval",
        "base",
        &[(2, 0), (2, 1)],
        Some(2),
    )];
    let base = [BenchmarkResult::from_counts(
        "humaneval",
        "base model",
        &[(2, 0), (2, 0)],
        Some(2),
    )];
    let text = table(
        &results(),
        &[("baseline", &baseline), ("base model", &base)],
    );
    eprintln!("{text}");
    let lines: Vec<&str> = text.lines().collect();
    assert!(lines[0].starts_with("member") && lines[0].contains("humaneval pass@1 (n=2)"));
    assert!(lines[0].contains("humaneval pass@2") && lines[0].contains("gsm8k pass@1 (n=4)"));
    assert!(lines[1].starts_with("---"));
    let row = |label: &str| {
        lines
            .iter()
            .find(|l| l.starts_with(label))
            .unwrap_or_else(|| panic!("no {label} row in\n{text}"))
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ")
    };
    assert_eq!(row("m0"), "m0 25.0 50.0 50.0");
    assert_eq!(row("m1"), "m1 75.0 100.0 25.0");
    assert_eq!(row("population mean"), "population mean 50.0 75.0 37.5");
    assert_eq!(row("best"), "best 75.0 (m1) 100.0 (m1) 50.0 (m0)");
    assert_eq!(row("weakest"), "weakest 25.0 (m0) 50.0 (m0) 25.0 (m1)");
    assert_eq!(row("baseline"), "baseline 25.0 50.0 -");
    assert_eq!(row("base model"), "base model 0.0 0.0 -");

    let json = serde_json::to_string(&results()).unwrap();
    let back: Vec<BenchmarkResult> = serde_json::from_str(&json).unwrap();
    assert_eq!(back, results());
    assert!(table(&[], &[]).starts_with("member"));
}
