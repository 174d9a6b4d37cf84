//! The Python sandbox against honest and hostile programs. Every test takes
//! `SERIAL` because the process-table checks look for any process running as
//! the sandbox uid, which a concurrently running pool would also own.

use populora::verify::{Job, Layer, Limits, Outcome, SandboxConfig, Status, VerifierPool};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// Timeout for tests: long enough for a loaded 2-core machine, short enough
/// that the hostile programs that must time out don't slow the suite.
const TEST_TIMEOUT_MS: u64 = 1500;

/// The uid the pools of these tests drop to: their own, not the default
/// `nobody` of every other pool in this test process (the self-play and
/// eval tests run beside them), so the hostile programs here fill their own
/// per-uid process limit and a check for processes left behind sees only
/// theirs.
const SANDBOX_UID: u32 = 64_998;

fn sandbox_config() -> SandboxConfig {
    SandboxConfig {
        unprivileged_uid: SANDBOX_UID,
        unprivileged_gid: SANDBOX_UID,
        ..SandboxConfig::default()
    }
}

fn pool(workers: usize) -> VerifierPool {
    let config = SandboxConfig {
        workers,
        limits: Limits {
            timeout_ms: TEST_TIMEOUT_MS,
            ..Limits::default()
        },
        ..sandbox_config()
    };
    VerifierPool::new(config).expect("start the sandbox pool")
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// Pids of processes running as the sandbox's unprivileged uid, except the
/// pools' checkers: those are our own children and live as long as their pool
/// (a program's processes descend from a zygote, never from us).
fn sandbox_processes(uid: u32) -> Vec<u32> {
    let me = std::process::id();
    let all: BTreeMap<u32, Process> = processes().map(|p| (p.pid, p)).collect();
    all.values()
        .filter(|p| p.field("Uid:") == Some(uid) && p.field("PPid:") != Some(me))
        .filter(|p| !matches!(owner(p, &all, uid), Some(o) if o != me && o != 1))
        .map(|p| p.pid)
        .collect()
}

/// The nearest ancestor of `p` that does not run as `uid`: this test, init
/// (an escaped process is re-parented there), or another program's sandbox
/// owner (a run on the same machine), whose processes are not this test's.
fn owner(p: &Process, all: &BTreeMap<u32, Process>, uid: u32) -> Option<u32> {
    let mut current = p;
    loop {
        let parent = all.get(&current.field("PPid:")?)?;
        if parent.field("Uid:") != Some(uid) {
            return Some(parent.pid);
        }
        current = parent;
    }
}

/// A process in /proc: its pid and its `status` file.
struct Process {
    pid: u32,
    status: String,
}

impl Process {
    /// The first number of a `status` line such as `Uid:` or `PPid:`.
    fn field(&self, name: &str) -> Option<u32> {
        self.status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|value| value.parse().ok())
    }
}

fn processes() -> impl Iterator<Item = Process> {
    let entries = std::fs::read_dir("/proc").expect("read /proc").flatten();
    entries.filter_map(|entry| {
        let pid = entry.file_name().to_string_lossy().parse().ok()?;
        let status = std::fs::read_to_string(entry.path().join("status")).ok()?;
        Some(Process { pid, status })
    })
}

fn assert_no_sandbox_processes(uid: u32) {
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        let left = sandbox_processes(uid);
        if left.is_empty() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "processes left behind as uid {uid}: {left:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn proposal(program: &str, input: &str) -> Job {
    Job::Proposal {
        program: program.into(),
        input: input.into(),
    }
}

fn humaneval(body: &str, check: &str) -> Job {
    Job::HumanEval {
        program: body.into(),
        test: check.into(),
        entry_point: "candidate_fn".into(),
    }
}

#[test]
fn valid_proposals_give_the_repr_and_features() {
    let _guard = serial();
    let pool = pool(2);
    let cases = [
        (
            "def f(a):\n    return a",
            "\"Hello world\"",
            "'Hello world'",
        ),
        ("def f(s):\n    return s[::-1]", "'abc'", "'cba'"),
        ("def f(a, b):\n    return a + [b]", "[1, 2], 3", "[1, 2, 3]"),
        ("def f(t):\n    return len(t)", "(1, 2, 3)", "3"),
        ("def f(x, k=2):\n    return x * k", "4, k=3", "12"),
        (
            "import math\ndef g(n):\n    return math.factorial(n) if n < 2 else n * g(n - 1)",
            "5",
            "120",
        ),
        (
            "def f(n):\n    return list(range(n))",
            "sum([1, 2])",
            "[0, 1, 2]",
        ),
        (
            "def f(n):\n    return 'x' * n",
            "1000",
            &format!("'{}", "x".repeat(399)),
        ),
    ];
    for (program, input, expected) in cases {
        let v = pool.validate_proposal(program, input).unwrap();
        assert_eq!(v.status, Status::Ok, "{program:?} on {input}: {}", v.reason);
        assert_eq!(
            v.output.as_deref(),
            Some(expected),
            "{program:?} on {input}"
        );
        let features = v.features.expect("features with a valid result");
        assert!(features.ast_nodes >= 5 && features.max_depth >= 3 && features.node_types >= 4);
    }
    let v = pool
        .validate_proposal(
            "def f(xs):\n    out = 0\n    for x in xs:\n        if x > 0 and x % 2:\n            out += x\n    return out",
            "[1, 2, 3]",
        )
        .unwrap();
    assert_eq!(v.output.as_deref(), Some("4"));
    // for + if + `and` = 3 decision points.
    assert_eq!(v.features.unwrap().cyclomatic, 4);
    // Allowed modules reached as the program imported them, and private
    // attributes of its own objects, stay valid.
    for (program, input, expected) in [
        (
            "import collections.abc\ndef f(a):\n    return isinstance(a, collections.abc.Sequence)",
            "[1]",
            "True",
        ),
        (
            "from collections import Counter\ndef f(s):\n    return Counter(s).most_common(1)",
            "'abca'",
            "[('a', 2)]",
        ),
        (
            "class Box:\n    def __init__(self, v):\n        self._v = v\ndef f(a):\n    return Box(a)._v",
            "7",
            "7",
        ),
    ] {
        let v = pool.validate_proposal(program, input).unwrap();
        assert_eq!(v.status, Status::Ok, "{program:?}: {}", v.reason);
        assert_eq!(v.output.as_deref(), Some(expected), "{program:?}");
    }
    let renamed = pool
        .validate_proposal("def double(x):\n    return 2 * x", "21")
        .unwrap();
    assert_eq!(
        (renamed.output.as_deref(), renamed.function.as_deref()),
        (Some("42"), Some("double"))
    );
}

#[test]
fn invalid_proposals_get_typed_reasons() {
    let _guard = serial();
    let pool = pool(2);
    let cases = [
        ("def f(a)\n    return a", "1", Status::SyntaxError),
        (
            "def f(a):\n    return a\ndef g(a):\n    return a",
            "1",
            Status::InvalidProgram,
        ),
        ("x = 1", "1", Status::InvalidProgram),
        (
            "def f(a):\n    return a\nprint(f(1))",
            "1",
            Status::InvalidProgram,
        ),
        ("def f(a):\n    return input()", "1", Status::UsesInput),
        (
            "import random\ndef f(a):\n    return random.random()",
            "1",
            Status::BannedImport,
        ),
        (
            "def f(a):\n    import os\n    return os.getpid()",
            "1",
            Status::BannedImport,
        ),
        (
            "from subprocess import run\ndef f(a):\n    return 1",
            "1",
            Status::BannedImport,
        ),
        (
            "def f(a):\n    import importlib\n    return 1",
            "1",
            Status::BannedImport,
        ),
        (
            "def f(a):\n    return __import__('os').getpid()",
            "1",
            Status::BannedName,
        ),
        ("def f(a):\n    return eval('1+1')", "1", Status::BannedName),
        (
            "def f(a):\n    return open('/etc/passwd').read()",
            "1",
            Status::BannedName,
        ),
        (
            "def f(a):\n    return ().__class__.__base__.__subclasses__()",
            "1",
            Status::BannedName,
        ),
        (
            "def f(a):\n    return getattr(a, 'real')",
            "1",
            Status::BannedName,
        ),
        // Modules reached through attributes of allowed modules.
        (
            "import typing\ndef f(a):\n    return typing.sys.modules['os'].system('true')",
            "1",
            Status::BannedImport,
        ),
        (
            "import typing\ndef f(a):\n    m = typing.sys.modules\n    return m['_frozen_importlib']._gcd_import('random').random()",
            "1",
            Status::BannedImport,
        ),
        (
            "import typing\ndef f(a):\n    t = typing\n    return t.sys.platform",
            "1",
            Status::BannedImport,
        ),
        (
            "import enum\ndef f(a):\n    return enum.bltns.open('/etc/passwd').read()",
            "1",
            Status::BannedImport,
        ),
        (
            "import collections\ndef f(a):\n    return collections._sys.platform",
            "1",
            Status::BannedImport,
        ),
        (
            "import re\ndef f(a):\n    return re._compiler.MAXCODE",
            "1",
            Status::BannedImport,
        ),
        (
            "import string as s\ndef f(a):\n    return s._sentinel_dict",
            "1",
            Status::BannedName,
        ),
        (
            "from typing import sys\ndef f(a):\n    return sys.platform",
            "1",
            Status::BannedImport,
        ),
        // Private modules, banned ones with a leading underscore among them.
        (
            "import _io\ndef f(a):\n    return _io.open('/etc/passwd').read()",
            "1",
            Status::BannedImport,
        ),
        (
            "import _frozen_importlib as b\ndef f(a):\n    return b.BuiltinImporter.load_module('posix').getpid()",
            "1",
            Status::BannedImport,
        ),
        (
            "from math import *\ndef f(a):\n    return floor(a)",
            "1",
            Status::BannedImport,
        ),
        ("def f(a):\n    return a", "1)(2", Status::BadInput),
        (
            "def f(a):\n    return a",
            "1); import os; (2",
            Status::BadInput,
        ),
        (
            "def f(a):\n    return a",
            "undefined_name",
            Status::BadInput,
        ),
        ("def f(a):\n    return 1 // a", "0", Status::RuntimeError),
        ("def f(n):\n    return f(n + 1)", "0", Status::RuntimeError),
        (
            "def f(a):\n    return id(object())",
            "1",
            Status::NonDeterministic,
        ),
        (
            "def f(a):\n    return repr(object())",
            "1",
            Status::NonDeterministic,
        ),
        (
            "def f(a):\n    while True:\n        pass",
            "1",
            Status::Timeout,
        ),
        (
            "def f(a):\n    return bytearray(1 << 31)",
            "1",
            Status::MemoryLimit,
        ),
    ];
    let jobs: Vec<Job> = cases.iter().map(|(p, i, _)| proposal(p, i)).collect();
    for ((program, input, expected), result) in cases.iter().zip(pool.batch(&jobs)) {
        let Outcome::Proposal(v) = result.unwrap() else {
            panic!("proposal outcome")
        };
        assert_eq!(v.status, *expected, "{program:?} on {input}: {}", v.reason);
        assert!(
            v.output.is_none() && !v.reason.is_empty(),
            "{program:?}: {v:?}"
        );
    }
    let huge = "def f(a):\n    return a\n".to_string() + &"# pad\n".repeat(20_000);
    assert_eq!(
        pool.validate_proposal(&huge, "1").unwrap().status,
        Status::InvalidProgram
    );
}

/// The checks read names from the AST, so a name given as a string escapes
/// them. The callables that resolve one, string annotations and the fields
/// of literal format strings are refused instead, each reason naming the
/// call (or field) and the line. The layers contain these programs when the
/// checks are bypassed: see `hostile_programs_are_contained`.
#[test]
fn names_given_as_strings_are_refused_with_the_call_and_line() {
    let _guard = serial();
    let pool = pool(2);
    let cases: Vec<(&str, Status, &[&str])> = vec![
        (
            "import operator\nimport typing\ndef f(x):\n    m = operator.attrgetter(\"sys.modules\")(typing)\n    m['os'].system('true')\n    return x",
            Status::BannedName,
            &["attrgetter", "line 4"],
        ),
        (
            "from operator import attrgetter\nimport typing\ndef f(x):\n    return attrgetter('sys')(typing)",
            Status::BannedName,
            &["attrgetter", "line 1"],
        ),
        (
            "import operator as op\ndef f(x):\n    return op.methodcaller('upper')(x)",
            Status::BannedName,
            &["methodcaller", "line 3"],
        ),
        (
            "import string\nimport typing\ndef f(x):\n    return string.Formatter().get_field('0.sys', [typing], {})[0]",
            Status::BannedName,
            &["Formatter", "line 4"],
        ),
        (
            "from string import Formatter\ndef f(x):\n    return Formatter().vformat('{0}', [x], {})",
            Status::BannedName,
            &["Formatter", "line 1"],
        ),
        (
            "def f(x: \"__import__('os').getpid()\"):\n    return x",
            Status::BannedName,
            &["string annotation", "__import__", "line 1"],
        ),
        (
            "import typing\ndef f(x):\n    y: typing.List[\"typing.sys.modules['os']\"] = []\n    return x",
            Status::BannedImport,
            &["string annotation", "attribute .modules", "line 3"],
        ),
        (
            "from __future__ import annotations\ndef f(x: __import__('os').getpid()) -> int:\n    return x",
            Status::BannedName,
            &["__import__", "line 2"],
        ),
        (
            "import typing\ndef f(x: 'int'):\n    return typing.get_type_hints(f)",
            Status::BannedName,
            &["get_type_hints", "line 3"],
        ),
        (
            "import typing\ndef f(x):\n    return typing.ForwardRef('x')",
            Status::BannedName,
            &["ForwardRef", "line 3"],
        ),
        (
            "import functools\ndef f(x):\n    return functools.singledispatch(len)(x)",
            Status::BannedName,
            &["singledispatch", "line 3"],
        ),
        (
            "import enum\ndef f(x):\n    class E(enum.Enum):\n        A = 1\n    return E._convert_('X', 'os', str.isupper)",
            Status::BannedName,
            &["_convert_", "line 5"],
        ),
        (
            "def f(x):\n    class C:\n        __annotations__ = {'a': \"__import__('os')\"}\n    return x",
            Status::BannedName,
            &["__annotations__", "line 3"],
        ),
        (
            "import pydoc\ndef f(x):\n    return pydoc.locate('os.system')",
            Status::BannedImport,
            &["pydoc", "line 1"],
        ),
        (
            "def f(x):\n    import pkgutil\n    return pkgutil.resolve_name('os:system')",
            Status::BannedImport,
            &["pkgutil", "line 2"],
        ),
        // copy.copy of a method bound to a module returns getattr(module,
        // the function's name).
        (
            "import copy\nimport typing\ndef f(x):\n    def sys():\n        pass\n    class B:\n        def m(self):\n            pass\n    return copy.copy(type(B().m)(sys, typing)).platform",
            Status::BannedImport,
            &["function named sys", "line 4"],
        ),
        (
            "import types\nimport typing\ndef f(x):\n    return types.MethodType(len, typing)",
            Status::BannedName,
            &["MethodType", "line 4"],
        ),
        // Only text, but the same walk as typing.sys in code.
        (
            "import typing\ndef f(x):\n    return '{0.sys}'.format(typing)",
            Status::BannedImport,
            &["{0.sys}", "line 3"],
        ),
        (
            "import typing\ndef f(x):\n    s = 'at {t.sys.modules[os].system}'\n    return s.format_map({'t': typing})",
            Status::BannedImport,
            &["{t.sys.modules[os].system}", "line 3"],
        ),
        (
            "def f(x):\n    return '{0.__class__}'.format(x)",
            Status::BannedName,
            &["{0.__class__}", "line 2"],
        ),
    ];
    let jobs: Vec<Job> = cases.iter().map(|(p, _, _)| proposal(p, "1")).collect();
    for ((program, status, words), result) in cases.iter().zip(pool.batch(&jobs)) {
        let Outcome::Proposal(v) = result.unwrap() else {
            panic!("proposal outcome")
        };
        assert_eq!(v.status, *status, "{program:?}: {}", v.reason);
        for word in *words {
            assert!(
                v.reason.contains(word),
                "{program:?}: {:?} does not say {word:?}",
                v.reason
            );
        }
    }
}

/// What the checks above must not refuse: itemgetter (subscripts, no dotted
/// names), format strings with plain fields, format_map, annotations, string
/// annotations that are plain types, Literal values.
#[test]
fn plain_operator_format_and_annotations_stay_valid() {
    let _guard = serial();
    let pool = pool(2);
    let cases = [
        (
            "import operator\ndef f(xs):\n    return sorted(xs, key=operator.itemgetter(1)), operator.add(1, 2)",
            "[(1, 'b'), (2, 'a')]",
            "([(2, 'a'), (1, 'b')], 3)",
        ),
        (
            "from operator import itemgetter\ndef f(d):\n    return itemgetter('a', 'b')(d)",
            "{'a': 1, 'b': 2}",
            "(1, 2)",
        ),
        (
            "def f(x):\n    return '{0}-{1:>3}-{2[0]}-{y.real}-{0!r}'.format('a', x, [7], y=2.5)",
            "5",
            "\"a-  5-7-2.5-'a'\"",
        ),
        (
            "def f(n):\n    return '{name}:{n:03d}'.format_map({'name': 'id', 'n': n}) + str.format('{}', n)",
            "7",
            "'id:0077'",
        ),
        (
            "class P:\n    def __init__(self, v):\n        self.v = v\n    def __repr__(self):\n        return 'P({0.v})'.format(self)\ndef f(x):\n    return [P(x)]",
            "3",
            "[P(3)]",
        ),
        (
            "import typing\ndef f(xs: 'typing.List[int]', k: typing.Optional[int] = None) -> 'int':\n    total: 'int' = sum(xs)\n    return total * (k or 1)",
            "[1, 2], 3",
            "9",
        ),
        (
            "from __future__ import annotations\nfrom typing import Literal\ndef f(state: Literal['open', 'closed']) -> list[str]:\n    return [state]",
            "'open'",
            "['open']",
        ),
        (
            "from dataclasses import dataclass\n@dataclass\nclass Point:\n    x: int\n    y: int = 0\ndef f(a):\n    return Point(a)",
            "4",
            "Point(x=4, y=0)",
        ),
    ];
    for (program, input, expected) in cases {
        let v = pool.validate_proposal(program, input).unwrap();
        assert_eq!(v.status, Status::Ok, "{program:?}: {}", v.reason);
        assert_eq!(v.output.as_deref(), Some(expected), "{program:?}");
    }
}

#[test]
fn answers_are_checked_in_the_sandbox() {
    let _guard = serial();
    let pool = pool(2);
    // Deduction: literal equality, not string equality.
    assert!(pool.check_output("[1,2]", "[1, 2]").unwrap().passed());
    assert!(pool.check_output("\"a\"", "'a'").unwrap().passed());
    assert!(pool
        .check_output(" {'b': 2, 'a': 1} ", "{'a': 1, 'b': 2}")
        .unwrap()
        .passed());
    assert_eq!(
        pool.check_output("[1, 3]", "[1, 2]").unwrap().status,
        Status::Mismatch
    );
    assert_eq!(
        pool.check_output("__import__('os')", "0").unwrap().status,
        Status::Mismatch
    );
    // Abduction: f(pred) == gold.
    let program = "def f(a, b):\n    return sorted(a)[b]";
    assert!(pool
        .check_input(program, "[3, 1, 2], 0", "1")
        .unwrap()
        .passed());
    assert_eq!(
        pool.check_input(program, "[3, 1, 2], 1", "1")
            .unwrap()
            .status,
        Status::Mismatch
    );
    assert_eq!(
        pool.check_input(program, "[3], 5", "1").unwrap().status,
        Status::RuntimeError
    );
    // Induction: all hidden pairs must pass.
    let pairs: Vec<(String, String)> = [("1", "2"), ("5", "10"), ("'ab'", "'abab'")]
        .iter()
        .map(|(i, o)| (i.to_string(), o.to_string()))
        .collect();
    assert!(pool
        .check_induction("def f(x):\n    return x * 2", &pairs)
        .unwrap()
        .passed());
    let wrong = pool
        .check_induction("def f(x):\n    return x + x if x != 5 else 0", &pairs)
        .unwrap();
    assert_eq!(wrong.status, Status::Mismatch);
    assert!(wrong.reason.contains("pair 1"), "{}", wrong.reason);
    let banned = pool
        .check_induction("import os\ndef f(x):\n    return x * 2", &pairs)
        .unwrap();
    assert_eq!(banned.status, Status::BannedImport);
    // HumanEval.
    let test = "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n";
    let add = "def add(a, b):\n    return a + b";
    assert!(pool.run_humaneval(add, test, "add").unwrap().passed());
    let sub = "def add(a, b):\n    return a - b";
    assert_eq!(
        pool.run_humaneval(sub, test, "add").unwrap().status,
        Status::Mismatch
    );
    let broken = "def add(a, b):\n    return a + None";
    assert_eq!(
        pool.run_humaneval(broken, test, "add").unwrap().status,
        Status::RuntimeError
    );
}

#[test]
fn outputs_do_not_depend_on_the_worker() {
    let _guard = serial();
    let pool = pool(2);
    // Set order depends on the string hash seed; every zygote must share it.
    let program = "def f(a):\n    return list({'apple', 'banana', 'cherry', 'date', a})";
    let jobs: Vec<Job> = (0..40).map(|_| proposal(program, "'elder'")).collect();
    let outputs: Vec<String> = pool
        .batch(&jobs)
        .into_iter()
        .map(|r| match r.unwrap() {
            Outcome::Proposal(v) => v.output.expect("valid"),
            other => panic!("{other:?}"),
        })
        .collect();
    assert!(outputs.iter().all(|o| o == &outputs[0]), "{outputs:?}");
    let fresh = VerifierPool::new(SandboxConfig {
        workers: 1,
        ..sandbox_config()
    })
    .unwrap();
    assert_eq!(
        fresh
            .validate_proposal(program, "'elder'")
            .unwrap()
            .output
            .as_ref(),
        Some(&outputs[0])
    );
}

#[test]
fn isolation_layers_are_active_as_root() {
    let _guard = serial();
    let pool = pool(1);
    let layers = pool.layers();
    for layer in [
        Layer::ProcessGroup,
        Layer::Rlimits,
        Layer::TempDir,
        Layer::NoNewPrivs,
    ] {
        assert!(layers.contains(&layer), "{layer:?} missing from {layers:?}");
    }
    if is_root() {
        // Checked on this kind of machine: all of these work as root.
        for layer in [
            Layer::MountNamespace,
            Layer::NetNamespace,
            Layer::PidNamespace,
            Layer::UnprivilegedUid,
            Layer::LandlockFs,
        ] {
            assert!(layers.contains(&layer), "{layer:?} missing from {layers:?}");
        }
    }
}

/// Hostile programs run concurrently with honest ones; each is contained with
/// the right status, the honest ones keep their correct results, nothing is
/// left in the process table and no file appears outside the temp dirs.
#[test]
fn hostile_programs_are_contained() {
    let _guard = serial();
    let pool = pool(2);
    let uid = pool.config().unprivileged_uid;
    let scratch =
        PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("verify-{}", std::process::id()));
    std::fs::create_dir_all(&scratch).unwrap();
    let secret = scratch.join("secret.txt");
    std::fs::write(&secret, "the secret").unwrap();
    let escapes: Vec<PathBuf> = ('a'..='i')
        .map(|c| scratch.join(format!("escape-{c}")))
        .collect();
    let shm_escape = Path::new("/dev/shm").join(format!("populora-escape-{}", std::process::id()));
    let var_tmp_escape =
        Path::new("/var/tmp").join(format!("populora-escape-{}", std::process::id()));
    let run_it = "def check(candidate):\n    candidate()\n";
    let returns_zero = "def check(candidate):\n    assert candidate() == 0\n";

    let hostile: Vec<(&str, Job, &[Status])> = vec![
        ("infinite loop", proposal("def f(a):\n    while True:\n        a += 1", "1"), &[Status::Timeout]),
        (
            "fork bomb",
            humaneval("import os\ndef candidate_fn():\n    while True:\n        os.fork()", run_it),
            &[Status::RuntimeError, Status::Timeout],
        ),
        (
            "memory bomb",
            humaneval("def candidate_fn():\n    return [bytearray(1 << 30) for _ in range(8)]", run_it),
            &[Status::MemoryLimit],
        ),
        (
            // Touching 512 MiB page by page can outlast the deadline on a loaded machine.
            "gradual memory bomb",
            humaneval("def candidate_fn():\n    x = []\n    while True:\n        x.append(bytearray(1 << 24))", run_it),
            &[Status::MemoryLimit, Status::Timeout],
        ),
        (
            "huge output",
            humaneval("def candidate_fn():\n    while True:\n        print('x' * 10000)", run_it),
            &[Status::OutputLimit],
        ),
        (
            "deep recursion, unlimited",
            humaneval(
                "import sys\nsys.setrecursionlimit(10**8)\ndef candidate_fn(n=0):\n    return candidate_fn(n + 1)",
                run_it,
            ),
            // CPython 3.11 keeps Python frames off the C stack: this may exhaust memory slowly.
            &[Status::Crashed, Status::RuntimeError, Status::MemoryLimit, Status::Timeout],
        ),
        (
            "write outside the temp dir",
            humaneval(
                &format!(
                    "def candidate_fn():\n    open({:?}, 'w').write('x')",
                    escapes[0].display().to_string()
                ),
                run_it,
            ),
            &[Status::RuntimeError],
        ),
        (
            "write to /dev/shm",
            humaneval(
                &format!("def candidate_fn():\n    open({:?}, 'w').write('x')", shm_escape.display().to_string()),
                run_it,
            ),
            &[Status::RuntimeError],
        ),
        (
            "write to /var/tmp",
            humaneval(
                &format!("def candidate_fn():\n    open({:?}, 'w').write('x')", var_tmp_escape.display().to_string()),
                run_it,
            ),
            &[Status::RuntimeError],
        ),
        (
            "read a file outside the temp dir",
            humaneval(
                &format!("def candidate_fn():\n    return open({:?}).read()", secret.display().to_string()),
                run_it,
            ),
            &[Status::RuntimeError],
        ),
        (
            "read /etc/passwd",
            humaneval("def candidate_fn():\n    return open('/etc/passwd').read()", run_it),
            &[Status::RuntimeError],
        ),
        (
            "network connection",
            humaneval(
                "import socket\ndef candidate_fn():\n    socket.create_connection(('1.1.1.1', 53), timeout=0.5)",
                run_it,
            ),
            &[Status::RuntimeError],
        ),
        (
            "os.system through an attribute walk",
            humaneval(
                &format!(
                    "def candidate_fn():\n    w = [c for c in ().__class__.__base__.__subclasses__() if c.__name__ == '_wrap_close'][0]\n    return w.__init__.__globals__['system']('echo pwned > {}')",
                    escapes[1].display()
                ),
                returns_zero,
            ),
            &[Status::Mismatch],
        ),
        (
            "subprocess",
            humaneval("import subprocess\ndef candidate_fn():\n    subprocess.run(['/bin/true'])", run_it),
            &[Status::RuntimeError],
        ),
        (
            // What the AST checks reject in a proposal, run unchecked.
            "os.system through typing.sys.modules",
            humaneval(
                &format!(
                    "import typing\ndef candidate_fn():\n    return typing.sys.modules['os'].system('echo pwned > {}')",
                    escapes[2].display()
                ),
                returns_zero,
            ),
            &[Status::Mismatch, Status::RuntimeError],
        ),
        // Names given as strings, which the checks refuse
        // (names_given_as_strings_are_refused_with_the_call_and_line), run
        // unchecked. A mismatch: the call reached os.system, which failed.
        (
            "os.system through operator.attrgetter",
            humaneval(
                &format!(
                    "import operator\nimport typing\ndef candidate_fn():\n    m = operator.attrgetter('sys.modules')(typing)\n    return m['os'].system('echo pwned > {}')",
                    escapes[3].display()
                ),
                returns_zero,
            ),
            &[Status::Mismatch],
        ),
        (
            "os.system through string.Formatter().get_field",
            humaneval(
                &format!(
                    "import string\nimport typing\ndef candidate_fn():\n    m = string.Formatter().get_field('0.sys.modules', [typing], {{}})[0]\n    return m['os'].system('echo pwned > {}')",
                    escapes[4].display()
                ),
                returns_zero,
            ),
            &[Status::Mismatch],
        ),
        (
            "os.system in a string annotation, through typing.get_type_hints",
            humaneval(
                &format!(
                    "import typing\ndef candidate_fn():\n    def g(x: \"__import__('os').system('echo pwned > {}')\"):\n        pass\n    return typing.get_type_hints(g)['x']",
                    escapes[5].display()
                ),
                returns_zero,
            ),
            &[Status::Mismatch],
        ),
        (
            "os.system through pydoc.locate",
            humaneval(
                &format!(
                    "import pydoc\ndef candidate_fn():\n    return pydoc.locate('os.system')('echo pwned > {}')",
                    escapes[6].display()
                ),
                returns_zero,
            ),
            &[Status::Mismatch],
        ),
        (
            "os.system through pkgutil.resolve_name",
            humaneval(
                &format!(
                    "import pkgutil\ndef candidate_fn():\n    return pkgutil.resolve_name('os:system')('echo pwned > {}')",
                    escapes[7].display()
                ),
                returns_zero,
            ),
            &[Status::Mismatch],
        ),
        (
            "os.system through copy.copy of a method bound to typing",
            humaneval(
                &format!(
                    "import copy\nimport typing\ndef candidate_fn():\n    def sys():\n        pass\n    class B:\n        def m(self):\n            pass\n    m = copy.copy(type(B().m)(sys, typing)).modules\n    return m['os'].system('echo pwned > {}')",
                    escapes[8].display()
                ),
                returns_zero,
            ),
            &[Status::Mismatch],
        ),
        (
            "ignoring SIGTERM",
            humaneval(
                "import signal\ndef candidate_fn():\n    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n    while True:\n        pass",
                run_it,
            ),
            &[Status::Timeout],
        ),
        (
            "sleeping past the deadline",
            humaneval("import time\ndef candidate_fn():\n    time.sleep(30)", run_it),
            &[Status::Timeout],
        ),
        (
            "killing the parent",
            humaneval(
                "import os, signal\ndef candidate_fn():\n    os.kill(os.getppid(), signal.SIGKILL)\n    os.kill(-1, signal.SIGKILL)\n    return 0",
                returns_zero,
            ),
            &[Status::Ok, Status::RuntimeError],
        ),
        (
            "segfault",
            humaneval("import ctypes\ndef candidate_fn():\n    return ctypes.string_at(0)", run_it),
            &[Status::Crashed],
        ),
        (
            "escaped process group",
            humaneval(
                "import os, time\ndef candidate_fn():\n    if os.fork() == 0:\n        os.setsid()\n        time.sleep(60)\n    return 0",
                returns_zero,
            ),
            &[Status::Ok],
        ),
        (
            "non-deterministic output",
            proposal("def f(a):\n    return [id(object()) for _ in range(3)]", "1"),
            &[Status::NonDeterministic],
        ),
    ];

    // Interleave honest proposals whose results must survive their neighbours.
    let honest = |k: usize| {
        proposal(
            "def f(a, k):\n    return sorted(a, reverse=True)[:k]",
            &format!("[3, 9, {k}, 1], 2"),
        )
    };
    let expected_honest = |k: usize| {
        let mut v = [3, 9, k, 1];
        v.sort_unstable_by(|a, b| b.cmp(a));
        format!("[{}, {}]", v[0], v[1])
    };
    let mut jobs = Vec::new();
    for (k, (_, job, _)) in hostile.iter().enumerate() {
        jobs.push(job.clone());
        jobs.push(honest(k));
    }
    let results = pool.batch(&jobs);
    for (k, (name, _, allowed)) in hostile.iter().enumerate() {
        let outcome = results[2 * k]
            .as_ref()
            .unwrap_or_else(|e| panic!("{name}: sandbox error {e}"));
        let reason = outcome.reason();
        assert!(
            allowed.contains(&outcome.status()),
            "{name}: got {:?} ({reason})",
            outcome.status()
        );
        match results[2 * k + 1].as_ref().unwrap() {
            Outcome::Proposal(v) => assert_eq!(
                v.output.as_deref(),
                Some(expected_honest(k).as_str()),
                "after {name}"
            ),
            other => panic!("{other:?}"),
        }
    }
    // The pool keeps serving right after, and nothing is left running.
    let v = pool
        .validate_proposal("def f(a):\n    return a * 3", "'ab'")
        .unwrap();
    assert_eq!(v.output.as_deref(), Some("'ababab'"));
    if is_root() {
        assert_no_sandbox_processes(uid);
    }
    drop(pool);
    if is_root() {
        assert_no_sandbox_processes(uid);
    }
    for path in escapes.iter().chain([&shm_escape, &var_tmp_escape]) {
        assert!(
            !path.exists(),
            "{} appeared outside the sandbox",
            path.display()
        );
    }
    std::fs::remove_dir_all(&scratch).unwrap();
}

#[test]
fn many_concurrent_jobs_return_in_order() {
    let _guard = serial();
    let pool = pool(2);
    let jobs: Vec<Job> = (0..120)
        .map(|i| match i % 3 {
            0 => proposal("def f(n):\n    return sum(range(n))", &i.to_string()),
            1 => Job::Output {
                predicted: format!("[{i}, {}]", i + 1),
                gold: format!("[{i},{}]", i + 1),
            },
            _ => Job::Input {
                program: "def f(x):\n    return x * x".into(),
                predicted_input: i.to_string(),
                gold_output: (i * i).to_string(),
            },
        })
        .collect();
    // Callers on several threads at once share the workers.
    let results = std::thread::scope(|scope| {
        let halves: Vec<_> = jobs
            .chunks(60)
            .map(|chunk| scope.spawn(|| pool.batch(chunk)))
            .collect();
        halves
            .into_iter()
            .flat_map(|h| h.join().unwrap())
            .collect::<Vec<_>>()
    });
    for (i, result) in results.into_iter().enumerate() {
        match result.unwrap() {
            Outcome::Proposal(v) => assert_eq!(v.output, Some((0..i).sum::<usize>().to_string())),
            Outcome::Check(j) => assert!(j.passed(), "job {i}: {}", j.reason),
            Outcome::Harness(h) => panic!("job {i}: a harness result {h:?}"),
        }
    }
}

/// Where namespaces are refused, Landlock, rlimits, the unprivileged uid and
/// the subreaper still contain a program.
#[test]
fn fallback_without_namespaces_still_contains() {
    let _guard = serial();
    let pool = VerifierPool::new(SandboxConfig {
        workers: 1,
        namespaces: false,
        limits: Limits {
            timeout_ms: TEST_TIMEOUT_MS,
            ..Limits::default()
        },
        ..sandbox_config()
    })
    .unwrap();
    let layers = pool.layers();
    assert!(
        layers.contains(&Layer::Subreaper) && !layers.contains(&Layer::MountNamespace),
        "{layers:?}"
    );
    let escape = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("fallback-escape-{}", std::process::id()));
    let run_it = "def check(candidate):\n    candidate()\n";
    let write = format!(
        "def candidate_fn():\n    open({:?}, 'w').write('x')",
        escape.display().to_string()
    );
    let jobs = [
        humaneval(&write, run_it),
        humaneval("def candidate_fn():\n    return open('/etc/passwd').read()", run_it),
        humaneval(
            "import os, time\ndef candidate_fn():\n    if os.fork() == 0:\n        os.setsid()\n        time.sleep(60)\n",
            run_it,
        ),
        proposal("def f(a):\n    return a[::-1]", "'abc'"),
    ];
    let statuses: Vec<Status> = pool
        .batch(&jobs)
        .into_iter()
        .map(|r| r.unwrap().status())
        .collect();
    let expected = [
        Status::RuntimeError,
        Status::RuntimeError,
        Status::Ok,
        Status::Ok,
    ];
    // Landlock is what denies the write and the read here.
    if layers.contains(&Layer::LandlockFs) {
        assert_eq!(statuses, expected);
    } else {
        assert_eq!(statuses[2..], expected[2..]);
    }
    assert!(!escape.exists(), "{} appeared", escape.display());
    if is_root() {
        assert_no_sandbox_processes(pool.config().unprivileged_uid);
    }
}

/// Whatever a job leaves in its temp dir (files, a directory tree, a link out
/// of it), the next job on the same zygote starts in a fresh, empty one.
#[test]
fn every_job_gets_a_fresh_empty_temp_dir() {
    let _guard = serial();
    let pool = pool(1);
    let litter = humaneval(
        "import os\ndef candidate_fn():\n    open('a.txt', 'w').write('x' * 1000)\n    os.makedirs('d/e')\n    open('d/e/b.txt', 'w').write('y')\n    os.symlink('/etc', 'link')\n    return 0",
        "def check(candidate):\n    assert candidate() == 0\n",
    );
    let empty = humaneval(
        "import os\ndef candidate_fn():\n    return os.listdir('.')",
        "def check(candidate):\n    assert candidate() == [], candidate()\n",
    );
    for round in 0..3 {
        for (name, job) in [("litter", &litter), ("empty", &empty)] {
            let outcome = pool.run(job).unwrap();
            assert_eq!(
                outcome.status(),
                Status::Ok,
                "round {round}, {name}: {outcome:?}"
            );
        }
    }
}

/// A result too large for the result pipe (which the zygote does not read
/// while the child runs) is an output limit, not a hang until the timeout.
#[test]
fn an_oversized_result_is_an_output_limit() {
    let _guard = serial();
    let pool = pool(1);
    let pairs: Vec<(String, String)> = (0..3000)
        .map(|i| (i.to_string(), "'x'".to_string()))
        .collect();
    let started = Instant::now();
    let outcome = pool
        .run(&Job::Induction {
            program: "def f(n):\n    return 'x' * 1000".into(),
            pairs,
        })
        .unwrap();
    assert_eq!(outcome.status(), Status::OutputLimit, "{outcome:?}");
    assert!(
        started.elapsed() < Duration::from_millis(TEST_TIMEOUT_MS),
        "took {:?}",
        started.elapsed()
    );
}

/// A child that writes deeply nested JSON to its result pipe makes json.loads
/// raise RecursionError (not ValueError): that is a malformed result, status
/// `Crashed` for this program, not a zygote failure (which would replace the
/// zygote and run the program again); the same zygote serves the next program.
#[test]
fn a_deeply_nested_result_is_malformed_not_a_zygote_failure() {
    let _guard = serial();
    let pool = pool(1);
    // HumanEval jobs have no AST filter: the module body finds the result pipe
    // (the only FIFO above fd 2), fills it and exits before the trusted code reports.
    let nested = humaneval(
        "import os\ndeep = b'[' * 100000 + b']' * 100000\nfor fd in range(3, 64):\n    try:\n        if os.fstat(fd).st_mode & 0o170000 == 0o010000:\n            os.write(fd, deep)\n    except OSError:\n        pass\nos._exit(0)\ndef candidate_fn():\n    return 0",
        "def check(candidate):\n    assert candidate() == 0\n",
    );
    let honest = proposal(
        "def f(a, k):\n    return sorted(a, reverse=True)[:k]",
        "[3, 9, 4, 1], 2",
    );
    for round in 0..3 {
        let outcome = pool.run(&nested).unwrap_or_else(|e| {
            panic!("round {round}: the sandbox failed instead of the program: {e}")
        });
        let Outcome::Check(judgement) = outcome else {
            panic!("round {round}: {outcome:?}")
        };
        assert_eq!(
            judgement.status,
            Status::Crashed,
            "round {round}: {judgement:?}"
        );
        assert!(
            judgement.reason.contains("malformed result"),
            "round {round}: {judgement:?}"
        );
        match pool.run(&honest).unwrap() {
            Outcome::Proposal(v) => {
                assert_eq!(v.status, Status::Ok, "round {round}: {v:?}");
                assert_eq!(v.output.as_deref(), Some("[9, 4]"), "round {round}: {v:?}");
            }
            other => panic!("round {round}: {other:?}"),
        }
    }
    assert_no_sandbox_processes(pool.config().unprivileged_uid);
}

/// Pids of the checkers of pools in this process: our own children, with
/// `"role":"checker"` in their configuration argument.
/// The live checkers of `pool` (other tests' pools run in this process too).
fn checker_pids(pool: &VerifierPool) -> Vec<i32> {
    let me = std::process::id();
    let role = br#""role":"checker""#;
    let own = pool.checker_pids();
    let mut pids: Vec<i32> = processes()
        .filter(|p| p.field("PPid:") == Some(me) && own.contains(&p.pid))
        .filter(|p| {
            let cmdline = std::fs::read(format!("/proc/{}/cmdline", p.pid)).unwrap_or_default();
            cmdline.windows(role.len()).any(|w| w == role)
        })
        .map(|p| p.pid as i32)
        .collect();
    pids.sort_unstable();
    pids
}

/// Jobs of every kind that needs a checker, with their expected statuses.
fn checked_jobs() -> Vec<(Job, Status)> {
    let program = "def f(xs, k):\n    return sorted(xs)[:k]";
    vec![
        (proposal(program, "[5, 1, 4], 2"), Status::Ok),
        (
            proposal("import os\ndef f(a):\n    return a", "1"),
            Status::BannedImport,
        ),
        (
            Job::Output {
                predicted: "[1, 4]".into(),
                gold: "[1,4]".into(),
            },
            Status::Ok,
        ),
        (
            Job::Input {
                program: program.into(),
                predicted_input: "[3, 2, 9], 1".into(),
                gold_output: "[2]".into(),
            },
            Status::Ok,
        ),
        (
            Job::Induction {
                program: program.into(),
                pairs: vec![
                    ("[2, 1], 1".into(), "[1]".into()),
                    ("[7, 8], 2".into(), "[8, 7]".into()),
                ],
            },
            Status::Mismatch,
        ),
    ]
}

fn statuses(pool: &VerifierPool, jobs: &[(Job, Status)]) -> Vec<Status> {
    let batch: Vec<Job> = jobs.iter().map(|(job, _)| job.clone()).collect();
    pool.batch(&batch)
        .into_iter()
        .map(|outcome| outcome.expect("a verdict, not a sandbox error").status())
        .collect()
}

/// Checkers killed between batches are replaced: the next batch gets the
/// same verdicts, and fresh checkers serve it.
#[test]
fn killed_checkers_are_replaced() {
    let _guard = serial();
    let pool = pool(2);
    let jobs = checked_jobs();
    let expected: Vec<Status> = jobs.iter().map(|(_, status)| *status).collect();
    assert_eq!(statuses(&pool, &jobs), expected);
    let killed = checker_pids(&pool);
    assert_eq!(killed.len(), 2, "checkers: {killed:?}");
    for pid in &killed {
        // SAFETY: kill has no memory-safety preconditions; the pid is our child.
        unsafe { libc::kill(*pid, libc::SIGKILL) };
    }
    assert_eq!(statuses(&pool, &jobs), expected);
    // A killed checker that no job happened to draw may still wait in its
    // slot (a zombie, not listed); any checker alive now is a fresh one.
    let fresh = checker_pids(&pool);
    assert!(!fresh.is_empty(), "no fresh checker");
    assert!(
        fresh.iter().all(|pid| !killed.contains(pid)),
        "{killed:?} → {fresh:?}"
    );
}

/// A program whose parse exhausts the checker's memory gets its own verdict
/// inside a batch; the jobs around it in the same message keep theirs, and the
/// checker, its heap grown past the retirement size, is replaced.
#[test]
fn a_program_too_big_to_parse_retires_its_checker() {
    let _guard = serial();
    let pool = VerifierPool::new(SandboxConfig {
        workers: 1,
        limits: Limits {
            // The checker's deadline for the whole message; the parse takes ~1 s.
            timeout_ms: 10_000,
            memory_mb: 256,
            program_bytes: 16 << 20,
            ..Limits::default()
        },
        ..sandbox_config()
    })
    .expect("start the sandbox pool");
    let before = checker_pids(&pool);
    let huge = format!("def f(a):\n    return [{}]", "1,".repeat(1_500_000));
    let mut jobs = checked_jobs();
    let expected: Vec<Status> = jobs.iter().map(|(_, status)| *status).collect();
    jobs.insert(2, (proposal(&huge, "1"), Status::SyntaxError));
    let got = statuses(&pool, &jobs);
    assert!(
        matches!(got[2], Status::SyntaxError | Status::MemoryLimit),
        "{got:?}"
    );
    let mut rest = got.clone();
    rest.remove(2);
    assert_eq!(rest, expected);
    assert_eq!(statuses(&pool, &checked_jobs()), expected);
    let after = checker_pids(&pool);
    assert_eq!(after.len(), 1, "checkers: {after:?}");
    assert_ne!(before, after, "the checker was not replaced");
}

/// Each run gets new argument objects, tuples included (the compiler would
/// share a constant tuple between runs), so an output that depends on an
/// argument's address is caught by the determinism check.
#[test]
fn every_run_gets_new_argument_objects() {
    let _guard = serial();
    let pool = pool(1);
    let program = "def f(t, *rest):\n    return id(t) % 100000";
    for input in ["(1, 2)", "(1, 2), 3", "[1, 2]", "((1, 2), [3])"] {
        let v = pool.validate_proposal(program, input).unwrap();
        assert_eq!(v.status, Status::NonDeterministic, "{input}: {v:?}");
    }
}

/// Compiling can fold a short expression into a large constant; a program
/// whose compiled code is too large is invalid, not a sandbox failure.
#[test]
fn a_program_that_compiles_too_large_is_invalid() {
    let _guard = serial();
    let pool = pool(1);
    let constants: Vec<String> = (0..1000).map(|i| format!("'{i:05}' * 800")).collect();
    let program = format!("def f(a):\n    return [{}]", constants.join(", "));
    let v = pool.validate_proposal(&program, "1").unwrap();
    assert_eq!(v.status, Status::InvalidProgram, "{v:?}");
    assert!(v.reason.contains("compiled program"), "{v:?}");
    let ok = pool
        .validate_proposal("def f(a):\n    return a", "1")
        .unwrap();
    assert_eq!(ok.output.as_deref(), Some("1"));
}

/// Sets keep the iteration order (and so the repr) that running the text in
/// Python gives, in programs and in inputs: marshal, which carries compiled
/// code to the child, writes set elements sorted.
#[test]
fn sets_keep_the_order_python_gives() {
    let _guard = serial();
    let pool = pool(1);
    let cases = [
        ("def f(a):\n    return list({15, 7, 23})", "0"),
        ("def f(a):\n    return [x for x in {15, 7, 23, 31}]", "0"),
        ("def f(s):\n    return s", "{15, 7}"),
        ("def f(s):\n    return list(s)", "{15, 7, 23}"),
        (
            "def f(s, d):\n    return list(s), d",
            "frozenset({15, 7}), {'k': {23, 15}}",
        ),
    ];
    for (program, input) in cases {
        let direct = std::process::Command::new(&pool.config().python)
            .args([
                "-c",
                &format!("{program}\nprint(repr(f({input}))[:400], end='')"),
            ])
            .output()
            .expect("run python3");
        let expected = String::from_utf8(direct.stdout).unwrap();
        let v = pool.validate_proposal(program, input).unwrap();
        assert_eq!(v.status, Status::Ok, "{program} / {input}: {v:?}");
        assert_eq!(
            v.output.as_deref(),
            Some(expected.as_str()),
            "{program} / {input}"
        );
    }
}

/// A program can put lone surrogates (`chr(0xdc80)`) into an exception or a
/// repr. JSON escapes them, but a reply holding one is not Unicode and was
/// refused as malformed: the job ended as a sandbox error (which aborted an
/// evaluation) instead of a verdict. Now they arrive as "?".
#[test]
fn lone_surrogates_in_what_a_program_says_are_verdicts_not_sandbox_errors() {
    let _guard = serial();
    let pool = pool(1);
    let test = "def check(candidate):\n    assert candidate(1) == 1\n";
    let raises = "def ident(x):\n    raise ValueError('bad ' + chr(0xdc80) + chr(0xd800))";
    let judged = pool
        .run_humaneval(raises, test, "ident")
        .expect("a verdict, not a sandbox error");
    assert_eq!(judged.status, Status::RuntimeError);
    assert!(judged.reason.contains("bad ??"), "{}", judged.reason);
    // The same in a proposal's exception and in a repr it returns.
    let v = pool
        .validate_proposal("def f(x):\n    raise KeyError(chr(0xdc80) + x)", "'k'")
        .unwrap();
    assert_eq!(v.status, Status::RuntimeError, "{v:?}");
    let program = "def f(x):\n    class Odd:\n        def __repr__(self):\n            return chr(0xdc80) + x\n    return Odd()";
    let v = pool.validate_proposal(program, "'k'").unwrap();
    if v.status == Status::Ok {
        assert_eq!(v.output.as_deref(), Some("?k"), "{v:?}");
    }
    // A hostile child that writes its own result with an escaped surrogate.
    // (Its result pipe is the one descriptor above 2 it keeps.)
    let forged = r#"import os
def ident(x):
    for fd in range(3, 64):
        try:
            os.write(fd, b'{"status": "ok", "outputs": ["\udc80"]}')
        except OSError:
            pass
    os._exit(0)"#;
    let judged = pool
        .run_humaneval(forged, test, "ident")
        .expect("a verdict, not a sandbox error");
    assert_eq!(judged.status, Status::Ok, "{judged:?}");
}

/// A benchmark harness job: the trusted harness gets the program and its
/// arguments, its outputs come back, and the job's own wall-clock limit
/// (here shorter than the pool's) and memory limit replace the pool's.
#[test]
fn harness_jobs_run_under_their_own_limits() {
    let _serial = serial();
    let pool = pool(1);
    const HARNESS: &str = "def main(program, args):\n    namespace = {}\n    exec(program, namespace)\n    return {'status': 'ok', 'outputs': [repr(namespace['f'](args['x']))]}\n";
    let job = |program: &str, timeout_ms, memory_mb| Job::Harness {
        harness: HARNESS,
        program: program.to_string(),
        args: serde_json::json!({ "x": 20 }),
        timeout_ms,
        memory_mb,
    };
    let ok = pool
        .run(&job("def f(x):\n    return x + 1\n", 1000, 0))
        .unwrap();
    match &ok {
        Outcome::Harness(h) => assert_eq!(
            (h.status, h.outputs.as_slice()),
            (Status::Ok, &["21".to_string()][..])
        ),
        other => panic!("{other:?}"),
    }
    let started = Instant::now();
    let endless = pool
        .run(&job("def f(x):\n    while True:\n        pass\n", 300, 0))
        .unwrap();
    assert_eq!(endless.status(), Status::Timeout, "{}", endless.reason());
    assert!(
        started.elapsed() < Duration::from_millis(TEST_TIMEOUT_MS),
        "{:?}",
        started.elapsed()
    );
    // 600 MiB is past the pool's 512 MB, within a job's own 1024 MB.
    let big = "def f(x):\n    return len(bytearray(600 << x))\n";
    let refused = pool.run(&job(big, 5000, 0)).unwrap();
    assert_eq!(
        refused.status(),
        Status::MemoryLimit,
        "{}",
        refused.reason()
    );
    let allowed = pool.run(&job(big, 5000, 1024)).unwrap();
    assert_eq!(allowed.status(), Status::Ok, "{}", allowed.reason());
}
