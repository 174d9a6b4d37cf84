//! Structured decoding (`populora::grammar`) with the reply grammars of
//! `populora::task::grammar`: every reply a grammar allows parses, its
//! literals evaluate in Python, and it ends within its token budget.
//!
//! Replies are drawn by a random walk: each token uniformly from the mask.
//! The tiny model's vocabulary has one token per byte (plus a few longer
//! fillers), the worst case for a budget that bounds parts in bytes.

use std::io::Write;
use std::process::{Command, Stdio};

use populora::base::fetch::DEFAULT_MODEL;
use populora::base::tiny::TinyVocab;
use populora::base::{BaseModel, Tokenizer};
use populora::grammar::{Grammar, Next, TokenMask, Vocabulary};
use populora::keyed_stream;
use populora::task::grammar::{reply_grammar, ReplyShape, MAX_PARAMS};
use populora::task::{
    parse_answer, parse_induction_proposal, parse_proposal, Answer, Role, TaskKind,
};
use rand::Rng;
use rand_chacha::ChaCha12Rng;

fn tiny_tokenizer() -> Tokenizer {
    TinyVocab::new(300).tokenizer().unwrap()
}

/// A reply drawn uniformly from each mask; `None` if it did not end within `limit` tokens.
fn random_reply(grammar: &Grammar, rng: &mut ChaCha12Rng, limit: usize) -> Option<Vec<u32>> {
    let mut constraint = grammar.start();
    let mut tokens = Vec::new();
    while tokens.len() <= limit {
        let step = constraint.advance().expect("the grammar never dead-ends");
        tokens.extend(&step.forced);
        match step.next {
            Next::Finished => return Some(tokens),
            Next::Sample(mask) => {
                let token = uniform(&mask, rng);
                constraint.commit(token).unwrap();
                tokens.push(token);
            }
        }
    }
    None
}

fn uniform(mask: &TokenMask, rng: &mut ChaCha12Rng) -> u32 {
    let allowed: Vec<u32> = (0..mask.size() as u32)
        .filter(|&t| mask.allows(t))
        .collect();
    allowed[rng.random_range(0..allowed.len())]
}

/// The literals of a parsed reply, each as Python would pass them to `f`.
fn literals(kind: TaskKind, role: Role, text: &str, inputs: usize) -> Vec<String> {
    match (role, kind) {
        (Role::Proposer, TaskKind::Induction) => {
            let p =
                parse_induction_proposal(text, inputs).unwrap_or_else(|e| panic!("{e}: {text:?}"));
            assert!(!p.message.is_empty());
            p.inputs.iter().map(|i| format!("({i},)")).collect()
        }
        (Role::Proposer, _) => {
            let p = parse_proposal(text).unwrap_or_else(|e| panic!("{e}: {text:?}"));
            assert!(p.program.starts_with("def f("), "{text:?}");
            vec![format!("({},)", p.input)]
        }
        (Role::Solver, _) => {
            match parse_answer(kind, text).unwrap_or_else(|e| panic!("{e}: {text:?}")) {
                Answer::Output(o) => vec![o],
                Answer::Input(i) => vec![format!("({i},)")],
                Answer::Program(p) => {
                    assert!(p.starts_with("def f("), "{text:?}");
                    vec![]
                }
            }
        }
    }
}

/// Asserts that Python's `ast.literal_eval` reads every text.
fn assert_literal_eval(texts: &[String]) {
    let mut child = Command::new("python3")
        .args(["-I", "-S", "-c", "import ast, json, sys\nfor line in sys.stdin:\n    ast.literal_eval(json.loads(line))\n"])
        .stdin(Stdio::piped())
        .spawn()
        .expect("python3");
    let mut stdin = child.stdin.take().unwrap();
    for t in texts {
        writeln!(stdin, "{}", serde_json::to_string(t).unwrap()).unwrap();
    }
    drop(stdin);
    assert!(
        child.wait().unwrap().success(),
        "a literal did not evaluate"
    );
}

fn decode(tokenizer: &Tokenizer, tokens: &[u32]) -> String {
    let body = match tokens.last() {
        Some(t) if tokenizer.stop_ids.contains(t) => &tokens[..tokens.len() - 1],
        _ => tokens,
    };
    tokenizer.decode(body).unwrap()
}

/// Random walks through every reply grammar at each budget: each reply ends
/// with the stop token within its grammar's worst case (itself within the
/// budget), parses, and its literals evaluate in Python.
fn random_replies_hold(tokenizer: &Tokenizer, vocab_size: usize, budgets: &[usize], walks: usize) {
    let vocab = Vocabulary::new(tokenizer, vocab_size).unwrap();
    let mut rng = keyed_stream!(1, "grammar-walk");
    let mut literal_texts = Vec::new();
    for (kind, role, arity) in [
        (TaskKind::Deduction, Role::Proposer, None),
        (TaskKind::Induction, Role::Proposer, Some(2)),
        (TaskKind::Induction, Role::Proposer, None),
        (TaskKind::Deduction, Role::Solver, None),
        (TaskKind::Abduction, Role::Solver, Some(1)),
        (TaskKind::Abduction, Role::Solver, None),
        (TaskKind::Induction, Role::Solver, None),
    ] {
        for &max_new_tokens in budgets {
            let shape = ReplyShape {
                max_new_tokens,
                arity,
                inputs: 3,
            };
            let Ok(built) = reply_grammar(kind, role, &shape) else {
                continue;
            };
            assert!(built.worst_case_tokens <= max_new_tokens);
            let grammar = vocab.compile(&built.lark).unwrap();
            for _ in 0..walks {
                let tokens = random_reply(&grammar, &mut rng, max_new_tokens)
                    .unwrap_or_else(|| panic!("{kind:?} {role:?} {max_new_tokens}: no end"));
                let text = decode(tokenizer, &tokens);
                assert!(
                    tokens.len() <= built.worst_case_tokens,
                    "{kind:?} {role:?} {max_new_tokens}: {} tokens, worst case {}: {text:?}",
                    tokens.len(),
                    built.worst_case_tokens
                );
                assert_eq!(tokens.last(), Some(&tokenizer.stop_ids[0]));
                literal_texts.extend(literals(kind, role, &text, shape.inputs));
            }
        }
    }
    assert!(literal_texts.len() > 4 * walks);
    assert_literal_eval(&literal_texts);
}

#[test]
fn every_random_reply_parses_evaluates_and_fits_its_budget() {
    let tokenizer = tiny_tokenizer();
    random_replies_hold(&tokenizer, tokenizer.vocab_size(), &[96, 160], 12);
}

/// The same on SmolLM2's vocabulary of multi-byte tokens (fetched on first
/// use; the test fails if it cannot be).
#[test]
fn every_random_reply_holds_on_the_smollm2_vocabulary() {
    let path = DEFAULT_MODEL
        .ensure(&mut |m| eprintln!("{m}"))
        .unwrap_or_else(|e| panic!("the real SmolLM2 model is required for this test: {e}"));
    let base = BaseModel::load(&path, populora::base::WeightsSetting::F32).unwrap();
    random_replies_hold(&base.tokenizer, base.config().vocab_size, &[192, 512], 4);
}

#[test]
fn arity_is_fixed_when_known() {
    let tokenizer = tiny_tokenizer();
    let vocab = Vocabulary::new(&tokenizer, tokenizer.vocab_size()).unwrap();
    let mut rng = keyed_stream!(2, "grammar-arity");
    for arity in 1..=MAX_PARAMS {
        let shape = ReplyShape {
            max_new_tokens: 160,
            arity: Some(arity),
            inputs: 1,
        };
        let built = reply_grammar(TaskKind::Abduction, Role::Solver, &shape).unwrap();
        let grammar = vocab.compile(&built.lark).unwrap();
        for _ in 0..5 {
            let tokens = random_reply(&grammar, &mut rng, 160).unwrap();
            let text = decode(&tokenizer, &tokens);
            let Answer::Input(args) = parse_answer(TaskKind::Abduction, &text).unwrap() else {
                panic!("not an input answer")
            };
            let count = python_argument_count(&args);
            assert_eq!(count, arity, "{args:?}");
        }
    }
}

fn python_argument_count(args: &str) -> usize {
    let program =
        "import ast, sys\nprint(len(ast.parse('f(' + sys.argv[1] + ')', mode='eval').body.args))";
    let out = Command::new("python3")
        .args(["-I", "-S", "-c", program, args])
        .output()
        .unwrap();
    let stdout = String::from_utf8(out.stdout).unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    stdout
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("{args:?}: {stderr}"))
}

#[test]
fn a_grammar_that_does_not_compile_is_an_error() {
    let tokenizer = tiny_tokenizer();
    let vocab = Vocabulary::new(&tokenizer, tokenizer.vocab_size()).unwrap();
    let err = vocab.compile("start: undefined_rule").unwrap_err();
    assert!(err.to_string().contains("does not compile"), "{err}");
}

/// Whether `text` (then the stop token) is a reply the grammar allows, token
/// by token with the tiny model's one-byte tokens: forced tokens must be the
/// text's own, every other token must be in its mask.
fn allows(grammar: &Grammar, tokenizer: &Tokenizer, text: &str) -> bool {
    let mut tokens = tokenizer.encode(text).unwrap();
    tokens.push(tokenizer.stop_ids[0]);
    let mut constraint = grammar.start();
    let mut at = 0;
    loop {
        let Ok(step) = constraint.advance() else {
            return false;
        };
        for forced in step.forced {
            if tokens.get(at) != Some(&forced) {
                return false;
            }
            at += 1;
        }
        match step.next {
            Next::Finished => return at == tokens.len(),
            Next::Sample(mask) => {
                let Some(&token) = tokens.get(at) else {
                    return false;
                };
                if !mask.allows(token) || constraint.commit(token).is_err() {
                    return false;
                }
                at += 1;
            }
        }
    }
}

#[test]
fn replies_close_where_the_model_closes_them() {
    let tokenizer = tiny_tokenizer();
    let vocab = Vocabulary::new(&tokenizer, tokenizer.vocab_size()).unwrap();
    let shape = ReplyShape {
        max_new_tokens: 256,
        arity: None,
        inputs: 2,
    };
    let grammar = |kind, role| {
        let built = reply_grammar(kind, role, &shape).unwrap();
        vocab.compile(&built.lark).unwrap()
    };
    let proposer = grammar(TaskKind::Deduction, Role::Proposer);
    let cases = [
        ("```python\ndef f(a):\n    return a\n```\n```input\n1\n```", true),
        // A blank line, and a nested block, before the fence.
        ("```python\ndef f(a, b):\n    if a:\n        return b\n\n    return a\n```\n```input\n[1, (2,)], {'k': None}\n```", true),
        // Another name, a missing argument, a top-level line, a bare newline in a string.
        ("```python\ndef g(a):\n    return a\n```\n```input\n1\n```", false),
        ("```python\ndef f(a, b):\n    return a\n```\n```input\n1\n```", false),
        ("```python\ndef f(a):\n    return a\nprint(1)\n```\n```input\n1\n```", false),
        ("```python\ndef f(a):\n    return a\n```\n```input\n'a\nb'\n```", false),
        // A tag the parsers look for, inside the code.
        ("```python\ndef f(a):\n    return '<answer>' + a\n```\n```input\n'x'\n```", false),
        ("```python\ndef f(a):\n    return a  # </think>\n```\n```input\n'x'\n```", false),
        ("```python\ndef f(a):\n    return a < 3 and a > 1\n```\n```input\n2\n```", true),
    ];
    for (text, ok) in cases {
        assert_eq!(allows(&proposer, &tokenizer, text), ok, "{text:?}");
    }
    let solver = grammar(TaskKind::Deduction, Role::Solver);
    for (text, ok) in [
        ("<answer>\n```output\n'cba'\n```\n</answer>", true),
        (
            "<think>reverse it</think>\n<answer>\n```output\n[3, 2]\n```\n</answer>",
            true,
        ),
        ("<answer>\n```output\ncba\n```\n</answer>", false),
    ] {
        assert_eq!(allows(&solver, &tokenizer, text), ok, "{text:?}");
    }
    let induction = grammar(TaskKind::Induction, Role::Proposer);
    let text = "```input\n1\n```\n```input\n'x', 2\n```\n```message\nDoubles it.\n```";
    assert!(allows(&induction, &tokenizer, text));
}
