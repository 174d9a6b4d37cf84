//! Tests of the shipped benchmarks (`data/`): their checksums, and each
//! scorer on a handful of the sets' own records, passing and failing, in
//! the sandbox where the official harness executes code.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use populora::eval::cruxeval;
use populora::eval::data::{self, DataFile};
use populora::eval::evalplus::{self, Dataset, ReferenceTimes, Task};
use populora::eval::humaneval_io::IoKind;
use populora::eval::math::{self, MathPrompt};
use populora::eval::EvalError;
use populora::verify::{SandboxConfig, VerifierPool};

fn pool() -> &'static VerifierPool {
    static POOL: OnceLock<VerifierPool> = OnceLock::new();
    POOL.get_or_init(|| VerifierPool::new(SandboxConfig::default()).expect("sandbox starts"))
}

fn scratch_dir(name: &str) -> PathBuf {
    let dir =
        std::env::temp_dir().join(format!("populora-benchmarks-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn shipped(file: DataFile) -> PathBuf {
    file.checked()
        .unwrap_or_else(|e| panic!("the shipped benchmark data is required: {e}"))
}

// ------------------------------------------------------------------- data --

#[test]
fn every_shipped_file_has_its_recorded_checksum() {
    let sums = std::fs::read_to_string(data::data_dir().join("SHA256SUMS")).unwrap();
    let listed: BTreeMap<&str, &str> = sums
        .lines()
        .filter_map(|line| line.split_once("  "))
        .map(|(sum, path)| (path, sum))
        .collect();
    assert_eq!(listed.len(), data::ALL.len());
    for file in data::ALL {
        assert_eq!(listed.get(file.path), Some(&file.sha256), "{}", file.path);
        shipped(file);
        let licence = Path::new(file.path).parent().unwrap().join("LICENSE");
        assert!(
            data::data_dir().join(&licence).exists(),
            "{}",
            licence.display()
        );
    }
}

#[test]
fn a_changed_copy_is_refused_by_name() {
    let dir = scratch_dir("changed");
    let file = data::CRUXEVAL;
    let copy = dir.join(file.path);
    std::fs::create_dir_all(copy.parent().unwrap()).unwrap();
    let mut text = std::fs::read_to_string(shipped(file)).unwrap();
    text.push('\n');
    std::fs::write(&copy, text).unwrap();
    let err = file.checked_in(&dir).unwrap_err();
    assert!(matches!(err, EvalError::Checksum { .. }), "{err}");
    let message = err.to_string();
    assert!(
        message.contains("cruxeval/cruxeval.jsonl") && message.contains(file.sha256),
        "{message}"
    );
    std::fs::remove_file(&copy).unwrap();
    assert!(matches!(file.checked_in(&dir), Err(EvalError::Read { .. })));
}

// --------------------------------------------------------------- CRUXEval --

fn cruxeval_problems() -> &'static [cruxeval::Problem] {
    static PROBLEMS: OnceLock<Vec<cruxeval::Problem>> = OnceLock::new();
    PROBLEMS.get_or_init(|| cruxeval::load(&shipped(data::CRUXEVAL)).unwrap())
}

#[test]
fn cruxeval_loads_800_functions_keyed_by_line() {
    let problems = cruxeval_problems();
    assert_eq!(problems.len(), cruxeval::PROBLEMS);
    assert_eq!(problems[0].id, "sample_0");
    assert_eq!(problems[799].id, "sample_799");
    assert_eq!(problems[3].input, "'bcksrut', 'q'");
    // Functions the solver grammar (1 to 3 arguments) cannot call.
    assert_eq!(
        cruxeval::unanswerable_inputs(problems),
        [
            "sample_82",
            "sample_135",
            "sample_258",
            "sample_510",
            "sample_526"
        ]
    );
    let lines: Vec<String> = std::fs::read_to_string(shipped(data::CRUXEVAL))
        .unwrap()
        .lines()
        .take(2)
        .map(|l| l.replace("\"sample_1\"", "\"sample_7\""))
        .collect();
    let dir = scratch_dir("cruxeval-ids");
    let path = dir.join("cruxeval.jsonl");
    std::fs::write(&path, lines.join("\n")).unwrap();
    let message = cruxeval::load(&path).unwrap_err().to_string();
    assert!(
        message.contains("line 2") && message.contains("sample_7"),
        "{message}"
    );
}

#[test]
fn cruxeval_scores_as_its_harness_does() {
    let p = cruxeval_problems();
    let output = |i: usize, answer: &str| {
        let generation = cruxeval::generation(IoKind::Output, answer);
        cruxeval::score(pool(), &p[i], IoKind::Output, &generation).unwrap()
    };
    let input = |i: usize, answer: &str| {
        let generation = cruxeval::generation(IoKind::Input, answer);
        cruxeval::score(pool(), &p[i], IoKind::Input, &generation).unwrap()
    };
    // Output prediction: the value, however written; an expression is
    // executed as the harness executes it; a call of f on the input fails.
    assert!(output(
        0,
        "[(4, 1), (4, 1), (4, 1), (4, 1), (2, 3), (2, 3)]"
    ));
    assert!(output(0, "[(4,1)]*4 + [(2,3)]*2"));
    assert!(!output(0, "[(4, 1), (2, 3)]"));
    assert!(!output(0, "f([1, 1, 3, 1, 3, 1])"));
    assert!(output(1, "{1: None, 2: None}"));
    assert!(output(1, "{2: None, 1: None}"));
    assert!(!output(1, "{1: None}"));
    assert!(output(3, "'bcksrutq'"));
    assert!(!output(3, "bcksrutq"));
    assert!(!output(3, "'bcksrutq"));
    // Input prediction: any arguments f maps to the output.
    assert!(input(0, "[1, 1, 3, 1, 3, 1]"));
    assert!(input(0, "[3, 1, 1, 3, 1, 1]"));
    assert!(!input(0, "[1, 3]"));
    assert!(input(3, "'bcksrut', 'q'"));
    assert!(input(3, "'bcksru', 'tq'"));
    assert!(!input(3, "'bcksrut'"));
    assert!(!input(3, "not python ("));
    // The harness's own rule: an input prediction is a call of f.
    assert_eq!(
        cruxeval::check_program(&p[3], IoKind::Input, "'bcksrut', 'q'"),
        None
    );
    assert!(cruxeval::check_program(&p[3], IoKind::Input, "f('a', 'b')")
        .unwrap()
        .ends_with("\nassert 'bcksrutq' == f('a', 'b')"));
}

#[test]
fn cruxeval_generations_file_has_every_key() {
    let problems = cruxeval_problems();
    let dir = scratch_dir("cruxeval-generations");
    let name = cruxeval::generations_file_name(IoKind::Input, "base-model");
    assert_eq!(name, "cruxeval-generations-base-model-input.json");
    assert!(!cruxeval::generations_file_name(IoKind::Output, "m").contains("input"));
    let path = dir.join(name);
    let generation = cruxeval::generation(IoKind::Input, "'bcksrut', 'q'");
    let answers = BTreeMap::from([("sample_3", generation.as_str())]);
    cruxeval::write_generations(&path, problems, &answers).unwrap();
    let written: BTreeMap<String, Vec<String>> =
        serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    assert_eq!(written.len(), 800);
    assert_eq!(written["sample_3"], ["f('bcksrut', 'q')"]);
    assert_eq!(written["sample_0"], [""]);
}

// --------------------------------------------------------------- EvalPlus --

fn tasks(dataset: Dataset) -> &'static [Task] {
    static HUMANEVAL: OnceLock<Vec<Task>> = OnceLock::new();
    static MBPP: OnceLock<Vec<Task>> = OnceLock::new();
    let (cell, file) = match dataset {
        Dataset::HumanEval => (&HUMANEVAL, data::HUMANEVAL_PLUS),
        Dataset::Mbpp => (&MBPP, data::MBPP_PLUS),
    };
    cell.get_or_init(|| evalplus::load(&shipped(file), dataset).unwrap())
}

fn task(dataset: Dataset, id: &str) -> &'static Task {
    tasks(dataset).iter().find(|t| t.task_id == id).unwrap()
}

/// The reference times of a few tasks, measured in the sandbox into a
/// scratch cache (the real cache holds every task of a file).
fn reference(ids: &[&str]) -> BTreeMap<String, ReferenceTimes> {
    let chosen: Vec<Task> = ids
        .iter()
        .map(|id| {
            let dataset = if id.starts_with("Mbpp") {
                Dataset::Mbpp
            } else {
                Dataset::HumanEval
            };
            task(dataset, id).clone()
        })
        .collect();
    let mut times = BTreeMap::new();
    for dataset in [Dataset::HumanEval, Dataset::Mbpp] {
        let some: Vec<Task> = chosen
            .iter()
            .filter(|t| t.dataset == dataset)
            .cloned()
            .collect();
        let cache = scratch_dir("evalplus-times").join(format!("{}.json", dataset.name()));
        times.extend(evalplus::reference_times(pool(), &some, &cache, &mut |_| {}).unwrap());
        // A second call reads the cache.
        assert!(cache.exists());
    }
    times
}

#[test]
fn evalplus_loads_both_sets_with_their_inputs() {
    let humaneval = tasks(Dataset::HumanEval);
    let mbpp = tasks(Dataset::Mbpp);
    assert_eq!((humaneval.len(), mbpp.len()), (164, 378));
    let t = task(Dataset::HumanEval, "HumanEval/1");
    assert_eq!(
        (t.entry_point.as_str(), t.base_inputs),
        ("separate_paren_groups", 4)
    );
    assert_eq!(task(Dataset::Mbpp, "Mbpp/3").base_inputs, 5);
    // Inputs JSON parsers disagree on stay as released.
    let infinite = mbpp.iter().find(|t| t.record.contains("Infinity")).unwrap();
    assert!(infinite.plus_inputs > 0);
    assert_eq!(task(Dataset::HumanEval, "HumanEval/32").atol, 1e-4);
    let limits = evalplus::time_limits(&[0.0001, 0.5]);
    assert_eq!(limits, [1.0, 2.0]);
}

#[test]
fn evalplus_scores_as_evalplus_does() {
    let ids = ["HumanEval/2", "HumanEval/32", "Mbpp/2", "Mbpp/3"];
    let times = reference(&ids);
    let check = |dataset, id: &str, solution: &str| {
        evalplus::score(pool(), task(dataset, id), &times[id], solution).unwrap()
    };
    let both = evalplus::Verdict {
        base: true,
        plus: true,
    };
    let base_only = evalplus::Verdict {
        base: true,
        plus: false,
    };
    let neither = evalplus::Verdict {
        base: false,
        plus: false,
    };

    // A float result within the task's atol (1e-6) passes; outside it fails.
    let he2 = task(Dataset::HumanEval, "HumanEval/2");
    let canonical = format!("{}{}", he2.prompt, he2.canonical_solution);
    assert_eq!(check(Dataset::HumanEval, "HumanEval/2", &canonical), both);
    let close = "def truncate_number(number: float) -> float:\n    return number % 1.0 + 1e-9\n";
    assert_eq!(check(Dataset::HumanEval, "HumanEval/2", close), both);
    let far = "def truncate_number(number: float) -> float:\n    return number % 1.0 + 1e-3\n";
    assert_eq!(check(Dataset::HumanEval, "HumanEval/2", far), neither);
    let int = "def truncate_number(number: float) -> float:\n    return int(number)\n";
    assert_eq!(check(Dataset::HumanEval, "HumanEval/2", int), neither);

    // The special oracle of HumanEval/32 (a root within atol): EvalPlus
    // 0.3.1 fails the task whatever the answer, the canonical one included.
    let he32 = task(Dataset::HumanEval, "HumanEval/32");
    let canonical = format!("{}{}", he32.prompt, he32.canonical_solution);
    assert_eq!(
        check(Dataset::HumanEval, "HumanEval/32", &canonical),
        neither
    );

    // MBPP+'s set-equality oracle: the shared elements in any order.
    let reversed =
        "def similar_elements(a, b):\n    return tuple(sorted(set(a) & set(b), reverse=True))\n";
    assert_eq!(check(Dataset::Mbpp, "Mbpp/2", reversed), both);
    let first_only = "def similar_elements(a, b):\n    return tuple(sorted(set(a) & set(b)))[:1]\n";
    assert_eq!(check(Dataset::Mbpp, "Mbpp/2", first_only), neither);

    // An MBPP+ task with a contract: a solution that asserts it holds on every input;
    // one right only on the original tests passes base and fails plus.
    let mbpp3 = task(Dataset::Mbpp, "Mbpp/3");
    assert!(mbpp3.record.contains("$_CONTRACT_$"));
    let with_contract = "import math\ndef is_not_prime(n):\n    assert isinstance(n, int), \"invalid inputs\"\n    assert n > 0, \"invalid inputs\"\n    if n == 1:\n        return True\n    return any(n % i == 0 for i in range(2, math.isqrt(n) + 1))\n";
    assert_eq!(check(Dataset::Mbpp, "Mbpp/3", with_contract), both);
    let memorised = "def is_not_prime(n):\n    return n in (1, 10, 35)\n";
    assert_eq!(check(Dataset::Mbpp, "Mbpp/3", memorised), base_only);

    // Past an input's time limit, or not Python at all: fails.
    let endless = "def is_not_prime(n):\n    while True:\n        pass\n";
    assert_eq!(check(Dataset::Mbpp, "Mbpp/3", endless), neither);
    assert_eq!(
        check(Dataset::Mbpp, "Mbpp/3", "def is_not_prime(n) return"),
        neither
    );
}

#[test]
fn evalplus_solutions_and_samples_file() {
    let t = task(Dataset::Mbpp, "Mbpp/3");
    let response = "Here it is:\n```python\ndef is_not_prime(n):\n    return n > 1\n\nprint(is_not_prime(4))\n```";
    let solution = evalplus::solution_from_response(t, response);
    assert_eq!(solution, "def is_not_prime(n):\n    return n > 1\n");
    assert!(evalplus::prompt(t)
        .user
        .contains("assert is_not_prime(2) == False"));
    let h = task(Dataset::HumanEval, "HumanEval/2");
    let solution = evalplus::solution_from_response(h, "    return number % 1.0\n");
    assert!(solution.starts_with(&h.prompt) && solution.ends_with("return number % 1.0\n"));
    let path = scratch_dir("evalplus-samples").join("samples.jsonl");
    evalplus::write_samples(&path, &[("Mbpp/3", "def f(): pass\n")]).unwrap();
    let line: serde_json::Value =
        serde_json::from_str(std::fs::read_to_string(&path).unwrap().trim()).unwrap();
    assert_eq!(
        line,
        serde_json::json!({"task_id": "Mbpp/3", "solution": "def f(): pass\n"})
    );
}

// ------------------------------------------------------------------- math --

fn math_set(file: DataFile) -> Vec<math::MathProblem> {
    math::load_math(&shipped(file)).unwrap()
}

#[test]
fn each_math_set_gives_its_reference_answers() {
    let gsm8k = math::load_gsm8k(&shipped(data::GSM8K)).unwrap();
    assert_eq!((gsm8k.len(), gsm8k[0].answer.as_str()), (1319, "18"));
    let cases = [
        (data::MATH500, 500, "\\left( 3, \\frac{\\pi}{2} \\right)"),
        (data::MINERVA, 272, "1.6"),
        (data::OLYMPIADBENCH, 675, "2"),
        (data::AIME24, 30, "204"),
        (data::AIME25, 30, "70"),
        (data::AMC23, 40, "27.0"),
    ];
    for (file, n, first) in cases {
        let problems = math_set(file);
        assert_eq!(
            (problems.len(), problems[0].answer.as_str()),
            (n, first),
            "{}",
            file.path
        );
        assert!(!problems[0].problem.is_empty(), "{}", file.path);
    }
    // Minerva: the reference solution's last \boxed{}.
    let minerva = math_set(data::MINERVA);
    assert_eq!(minerva[1].answer, "4.5e33");
    // OlympiadBench: final_answer[0] without its `$`, and its unit.
    let olympiad = math_set(data::OLYMPIADBENCH);
    let with_unit = olympiad
        .iter()
        .find(|p| p.unit.as_deref() == Some("km"))
        .unwrap();
    assert_eq!(with_unit.answer, "\\frac{41}{12}");
}

#[test]
fn each_math_set_extracts_and_compares_its_answers() {
    let boxed = MathPrompt::Boxed;
    let gsm8k = math::load_gsm8k(&shipped(data::GSM8K)).unwrap();
    assert!(math::score_gsm8k(
        &gsm8k[0],
        "She makes \\boxed{\\$18} a day.",
        boxed
    ));
    assert!(!math::score_gsm8k(
        &gsm8k[0],
        "She makes 18 dollars a day.",
        boxed
    ));
    let score = |p: &math::MathProblem, response: &str| math::score_math(p, response, boxed);
    // AMC's answers are numbers written as floats.
    let amc = math_set(data::AMC23);
    assert!(score(&amc[0], "They meet after \\boxed{27} miles."));
    assert!(!score(&amc[0], "\\boxed{27.5}"));
    // AIME's answers may carry leading zeros.
    let aime = math_set(data::AIME24);
    let padded = aime.iter().find(|p| p.answer == "025").unwrap();
    assert!(score(padded, "\\boxed{25}"));
    // MATH-500: a tuple, part by part.
    let math500 = math_set(data::MATH500);
    assert!(score(
        &math500[0],
        "$(r,\\theta) = \\boxed{(3, \\frac{\\pi}{2})}$"
    ));
    assert!(!score(&math500[0], "\\boxed{(\\frac{\\pi}{2}, 3)}"));
    // Minerva: scientific notation.
    let minerva = math_set(data::MINERVA);
    assert!(score(&minerva[1], "\\boxed{4.5 \\times 10^{33}}"));
    assert!(!score(&minerva[1], "\\boxed{4.5 \\times 10^{32}}"));
    // OlympiadBench: an interval, several answers in any order, a unit.
    let olympiad = math_set(data::OLYMPIADBENCH);
    let find = |answer: &str| olympiad.iter().find(|p| p.answer == answer).unwrap();
    let interval = find("[\\frac{1}{2}, 8]");
    assert!(score(interval, "\\boxed{[0.5, 8]}"));
    assert!(!score(interval, "\\boxed{(0.5, 8)}"));
    let several = find("-2,0,2");
    assert!(score(several, "\\boxed{2, -2, 0}"));
    assert!(!score(several, "\\boxed{2, -2}"));
    let with_unit = olympiad
        .iter()
        .find(|p| p.unit.as_deref() == Some("km"))
        .unwrap();
    assert!(score(with_unit, "\\boxed{\\frac{41}{12} km}"));
    assert!(score(with_unit, "\\boxed{\\frac{41}{12}\\text{ km}}"));
    // The last \boxed{} is the answer, under the boxed prompt only.
    assert!(!score(&amc[0], "\\boxed{27} no wait \\boxed{26}"));
    assert!(!score(&amc[0], "<answer>27</answer>"));
    assert!(math::score_math(
        &amc[0],
        "<answer>27</answer>",
        MathPrompt::AnswerTags
    ));
}

#[test]
fn an_experiment_may_name_every_benchmark() {
    use populora::scenario::check_operator;
    use populora::scenario::experiment::Experiment;
    let experiments = Path::new(env!("CARGO_MANIFEST_DIR")).join("experiments");
    let names: Vec<String> = populora::eval::BENCHMARKS
        .iter()
        .map(|b| format!("{b:?}"))
        .collect();
    let text = format!(
        "population = {:?}\nbaseline = {:?}\n[eval]\nbenchmarks = [{}]\nproblems = 20\n",
        experiments.join("quick-population.toml"),
        experiments.join("quick-baseline.toml"),
        names.join(", ")
    );
    let path = scratch_dir("experiment").join("every-benchmark.toml");
    std::fs::write(&path, text).unwrap();
    let loaded = Experiment::from_file(&path, check_operator).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(loaded.experiment.eval.benchmarks.len(), 13);
}
