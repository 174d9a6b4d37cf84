# The official harnesses' checks, re-implemented to run inside the sandbox.
#
# The zygote runs this file (trusted) in a confined child for a
# `Job::Harness`: it compiles it, then calls `main(program, args)`, where
# `program` is the code under test (untrusted) and `args` says which check
# to make. `main` returns the child's result: a status, a reason and
# optionally `outputs` (strings).
#
# The untrusted code runs in this same process, as it does in the official
# harnesses: a program can tamper with the verdict here, as it could there.
# What contains it is the sandbox around the child, not this file.
#
# Checks:
# - "exec": CRUXEval's (facebookresearch/cruxeval, evaluation/utils_execute.py):
#   execute the program under a time limit; it passes when nothing is raised.
# - "evalplus_expected": EvalPlus's ground truth (evalplus 0.3.1,
#   evaluate.py `get_groundtruth`, gen/util `trusted_exec`): the canonical
#   solution on every input of one part (base or plus), each input deep-copied;
#   what it returns is the time of every call (the time limits come from it).
# - "evalplus": EvalPlus's `unsafe_execute` with `fast_check` (what
#   `evalplus.evaluate` runs): the solution on every input of one part, each
#   under its own time limit, compared with the canonical solution's output;
#   the first failure ends the check.
import builtins
import contextlib
import copy
import io
import json
import math
import signal
import sys
import time


def main(program, args):
    return CHECKS[args["check"]](program, args)


class TimeLimit(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds):
    """SIGALRM after `seconds` of wall time, as both harnesses' `time_limit`."""
    def on_alarm(signum, frame):
        raise TimeLimit("timed out after %.3g s" % seconds)

    signal.setitimer(signal.ITIMER_REAL, seconds)
    signal.signal(signal.SIGALRM, on_alarm)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


class WriteOnly(io.StringIO):
    """What both harnesses' `swallow_io` gives a program: output is kept in
    memory (not counted against the sandbox's output cap), reading fails."""

    def read(self, *args, **kwargs):
        raise OSError

    def readline(self, *args, **kwargs):
        raise OSError

    def readlines(self, *args, **kwargs):
        raise OSError

    def readable(self, *args, **kwargs):
        return False


@contextlib.contextmanager
def swallow_io():
    stream = WriteOnly()
    saved = sys.stdout, sys.stderr, sys.stdin
    sys.stdout = sys.stderr = sys.stdin = stream
    try:
        yield
    finally:
        sys.stdout, sys.stderr, sys.stdin = saved


# What both harnesses' `reliability_guard` switches off before running a
# program (EvalPlus 0.3.1 also `open`). Not for safety (the sandbox is that):
# a program that calls one of them fails there, so it fails here too.
GUARDED_OS = (
    "kill", "system", "putenv", "remove", "removedirs", "rmdir", "fchdir", "setuid",
    "fork", "forkpty", "killpg", "rename", "renames", "truncate", "replace", "unlink",
    "fchmod", "fchown", "chmod", "chown", "chroot", "lchflags", "lchmod", "lchown",
    "getcwd", "chdir",
)
GUARDED_MODULES = ("ipdb", "joblib", "resource", "psutil", "tkinter")


def reliability_guard(no_open):
    import os
    import shutil
    import subprocess

    os.environ["OMP_NUM_THREADS"] = "1"
    for name in GUARDED_OS:
        setattr(os, name, None)
    builtins.exit = None
    builtins.quit = None
    builtins.help = None
    if no_open:
        builtins.open = None
    shutil.rmtree = shutil.move = shutil.chown = None
    subprocess.Popen = None
    for name in GUARDED_MODULES:
        sys.modules[name] = None


def describe(exc):
    try:
        return ("%s: %s" % (type(exc).__name__, exc))[:300]
    except BaseException:
        return type(exc).__name__


# ------------------------------------------------------------------ CRUXEval --

def check_exec(program, args):
    reliability_guard(no_open=False)
    namespace = {}
    try:
        with swallow_io():
            with time_limit(args["seconds"]):
                exec(program, namespace)
    except TimeLimit as exc:
        return {"status": "timeout", "reason": describe(exc)}
    except AssertionError as exc:
        return {"status": "mismatch", "reason": describe(exc) or "AssertionError"}
    except SyntaxError as exc:
        return {"status": "syntax_error", "reason": describe(exc)}
    except BaseException as exc:
        return {"status": "runtime_error", "reason": describe(exc)}
    return {"status": "ok"}


# ------------------------------------------------------------------ EvalPlus --

# EvalPlus's `_special_oracle.py`: MBPP+ tasks whose output cannot be
# compared directly (only whether it is None), and those compared as sets.
MBPP_OUTPUT_NOT_NONE = ("check_str", "text_match_three", "text_starta_endb")
MBPP_OUTPUT_SET_EQ = (
    "similar_elements", "find_char_long", "common_in_nested_lists", "extract_singly",
    "larg_nnum", "intersection_array", "find_dissimilar", "Diff",
)


def inputs_of(args):
    """The inputs of one part of one task, as EvalPlus loads them: JSON, then
    (MBPP+) the task's lists turned back into tuples, sets or complex numbers
    (`mbpp_deserialize_inputs`)."""
    record = json.loads(args["record"])
    inputs = record[args["part"] + "_input"]
    if args["dataset"] == "mbpp":
        inputs = mbpp_inputs(int(record["task_id"].split("/")[-1]), inputs)
    return inputs


def tuples(items):
    return [tuple(x) for x in items]


def all_tuples(value):
    if isinstance(value, list):
        return tuple(all_tuples(x) for x in value)
    return value


# MBPP+ task number -> how its JSON inputs become Python values (EvalPlus
# data/mbpp.py, `mbpp_deserialize_inputs`).
MBPP_INPUT_SHAPES = {
    "args_tuples": (2, 116, 132, 143, 222, 261, 273, 394, 399, 421, 424, 429, 470, 560,
                    579, 596, 616, 630, 726, 740, 744, 809),
    "args_of_tuples": (63, 64, 70, 94, 120, 237, 272, 299, 400, 409, 417, 438, 473,
                       614, 780),
    "first_of_tuples": (75, 413, 444, 753),
    "second_tuple": (106, 750),
    "sets": (115,),
    "float_complex": (124,),
    "first_tuple": (250, 405, 446, 617, 720, 763, 808),
    "args_of_tuples_then_tuples": (259, 401, 445),
    "tuple_items": (278,),
    "first_tuple_of_three": (307,),
    "dict_of_tuples": (722,),
    "complex": (252,),
    "all_tuples": (580, 615, 791),
}


def mbpp_inputs(task, inputs):
    shape = next((s for s, tasks in MBPP_INPUT_SHAPES.items() if task in tasks), None)
    if shape == "args_tuples":
        return [tuples(inp) for inp in inputs]
    if shape == "args_of_tuples":
        return [[tuples(arg) for arg in inp] for inp in inputs]
    if shape == "first_of_tuples":
        return [[tuples(inp[0])] + [inp[1]] for inp in inputs]
    if shape == "second_tuple":
        return [[inp[0]] + [tuple(inp[1])] for inp in inputs]
    if shape == "sets":
        return [[[set(x) if isinstance(x, list) and len(x) else {} for x in inp[0]]]
                for inp in inputs]
    if shape == "float_complex":
        return [(float(inp[0]), complex(inp[1])) for inp in inputs]
    if shape == "first_tuple":
        return [[tuple(inp[0])] + [inp[1]] for inp in inputs]
    if shape == "args_of_tuples_then_tuples":
        return [tuples([tuples(arg) for arg in inp]) for inp in inputs]
    if shape == "tuple_items":
        return [tuples([[tuple(x) if isinstance(x, list) else x for x in inp[0]]])
                for inp in inputs]
    if shape == "first_tuple_of_three":
        return [[tuple(inp[0])] + [inp[1], inp[2]] for inp in inputs]
    if shape == "dict_of_tuples":
        return [[{k: tuple(v) for k, v in inp[0].items()}] + inp[1:] for inp in inputs]
    if shape == "complex":
        return [[complex(inp[0])] for inp in inputs]
    if shape == "all_tuples":
        return [all_tuples(inp) for inp in inputs]
    return inputs


def canonical(program, entry_point):
    namespace = {}
    exec(program, namespace)
    return namespace[entry_point]


def expected_output(fn, inp, not_none):
    """EvalPlus's `trusted_exec` for one input: the canonical solution on a
    deep copy (MBPP+ tasks whose output is only checked for None: that)."""
    out = fn(*copy.deepcopy(inp))
    return out is not None if not_none else out


def check_evalplus_expected(program, args):
    """The canonical solution (`program`) on every input of the part, timed."""
    fn = canonical(program, args["entry_point"])
    seconds = []
    for inp in inputs_of(args):
        start = time.perf_counter()
        expected_output(fn, inp, args["output_not_none"])
        seconds.append(time.perf_counter() - start)
    return {"status": "ok", "outputs": [json.dumps(seconds)]}


def check_evalplus(program, args):
    """`program` against the canonical solution (`args["canonical"]`), whose
    output for each input is computed here, just before `program` meets that
    input: some expected outputs are hundreds of megabytes, too much to
    store or to send. Only `program`'s time counts against the limits: each
    call its own, everything (its definition and every call) together the
    whole check's, min(60 s, the sum of the limits) + 2 s as in EvalPlus."""
    inputs = inputs_of(args)
    limits = args["time_limits"]
    if len(limits) != len(inputs):
        return {"status": "invalid_program", "reason": "time limits do not fit the inputs"}
    entry_point = args["entry_point"]
    reference = canonical(args["canonical"], entry_point)
    reliability_guard(no_open=True)
    budget = Budget(min(60.0, sum(limits)) + 2.0)
    namespace = {}
    try:
        with budget.spend(budget.left()):
            with swallow_io():
                exec(program, namespace)
                fn = namespace[entry_point]
    except TimeLimit as exc:
        return {"status": "timeout", "reason": describe(exc)}
    except BaseException as exc:
        return {"status": "runtime_error", "reason": describe(exc)}
    atol = args["atol"]
    for i, inp in enumerate(inputs):
        try:
            exp = expected_output(reference, inp, args["output_not_none"])
            with budget.spend(min(limits[i], budget.left())):
                with swallow_io():
                    out = fn(*inp)
            exact_match = out == exp
            if args["dataset"] == "mbpp":
                exact_match = mbpp_oracle(entry_point, inp, out, exp, atol, exact_match)
            if args["dataset"] == "humaneval" and entry_point == "find_zero":
                # HumanEval/32: a root within atol is right. EvalPlus 0.3.1
                # then skips the input without counting it as passed, so the
                # task fails whatever the answer (fixed after that release).
                assert abs(poly(*inp, out)) <= atol
                continue
            if atol == 0 and is_floats(exp):
                atol = 1e-6  # EvalPlus: and for every later input of this check
            if not exact_match and atol != 0:
                assert type(out) == type(exp)
                if isinstance(exp, (list, tuple)):
                    assert len(out) == len(exp)
                assert allclose(out, exp, 1e-07, atol)
            else:
                assert exact_match
        except TimeLimit as exc:
            return {"status": "timeout", "reason": "input %d: %s" % (i, describe(exc))}
        except BaseException as exc:
            return {"status": "mismatch", "reason": "input %d: %s" % (i, describe(exc))}
    if args["dataset"] == "humaneval" and entry_point == "find_zero":
        return {"status": "mismatch",
                "reason": "find_zero: every root check held, but EvalPlus 0.3.1 counts none as passed"}
    return {"status": "ok"}


class Budget:
    """Wall time left to the program under test."""

    def __init__(self, seconds):
        self.seconds = seconds

    def left(self):
        return max(self.seconds, 1e-3)

    @contextlib.contextmanager
    def spend(self, limit):
        start = time.perf_counter()
        try:
            with time_limit(limit):
                yield
        finally:
            self.seconds -= time.perf_counter() - start


def mbpp_oracle(entry_point, inp, out, exp, atol, exact_match):
    """EvalPlus's special oracles for MBPP+ (evaluate.py, `unsafe_execute`)."""
    if entry_point == "are_equivalent":  # Mbpp/164
        return True
    if entry_point == "sum_div":  # Mbpp/295
        return exact_match or out == 0
    if entry_point == "surface_Area":  # Mbpp/581
        return exact_match or abs(out - surface_area(*inp)) <= atol
    if entry_point == "digit_distance_nums":  # Mbpp/558
        return exact_match or out == digit_distance(*inp)
    if entry_point in MBPP_OUTPUT_SET_EQ:
        return set(out) == set(exp)
    if entry_point in MBPP_OUTPUT_NOT_NONE:
        if isinstance(out, bool):
            return out == exp
        return exp == (out is not None)
    return exact_match


def surface_area(base_edge, height):
    """Mbpp/581's oracle: the pyramid's height taken as the perpendicular one."""
    slant = math.sqrt((base_edge / 2) ** 2 + height ** 2)
    return round(base_edge ** 2 + 4 * (base_edge * slant) / 2)


def digit_distance(a, b):
    """Mbpp/558's oracle: both numbers padded with zeros to the same length."""
    x, y = str(a), str(b)
    width = max(len(x), len(y))
    return sum(abs(int(p) - int(q)) for p, q in zip(x.zfill(width), y.zfill(width)))


def poly(xs, x):
    """HumanEval/32's oracle: the polynomial with coefficients `xs` at `x`."""
    return sum(coeff * math.pow(x, i) for i, coeff in enumerate(xs))


def is_floats(x):
    """EvalPlus's `is_floats`: a float, or a non-empty list or tuple of floats."""
    if isinstance(x, float):
        return True
    if isinstance(x, (list, tuple)) and x:
        return all(isinstance(i, float) for i in x)
    return False


# ------------------------------------------------- numpy.allclose, in Python --

INT64 = 1 << 63


def as_array(value):
    """(shape, flat elements) as `numpy.asarray` would make a numeric array of
    `value`; TypeError or ValueError where numpy's `isclose` would raise
    (strings, None, ragged nesting, integers outside int64)."""
    if isinstance(value, (list, tuple)):
        parts = [as_array(v) for v in value]
        shapes = {shape for shape, _ in parts}
        if len(shapes) > 1:
            raise ValueError("inhomogeneous shape")
        inner = parts[0][0] if parts else ()
        return (len(value),) + inner, [x for _, flat in parts for x in flat]
    if isinstance(value, int) and not -INT64 <= value < INT64:
        raise TypeError("integer outside int64")
    if isinstance(value, (bool, int, float, complex)):
        return (), [value]
    raise TypeError("not a number: %s" % type(value).__name__)


def broadcast(a, b):
    """numpy's broadcasting of two shapes; ValueError when they do not fit."""
    n = max(len(a), len(b))
    a, b = (1,) * (n - len(a)) + a, (1,) * (n - len(b)) + b
    out = []
    for x, y in zip(a, b):
        if x != y and 1 not in (x, y):
            raise ValueError("shapes do not broadcast")
        out.append(y if x == 1 else x)
    return tuple(out), a, b


def element(flat, shape, index):
    """The element of a C-ordered array at a broadcast index."""
    at = 0
    for size, i in zip(shape, index):
        at = at * size + (0 if size == 1 else i)
    return flat[at]


def indices(shape):
    if not shape:
        yield ()
        return
    for i in range(shape[0]):
        for rest in indices(shape[1:]):
            yield (i,) + rest


def isclose(x, y, rtol, atol):
    finite = all(math.isfinite(v) for v in (complex(x).real, complex(x).imag,
                                             complex(y).real, complex(y).imag))
    if not finite:
        return x == y
    return abs(x - y) <= atol + rtol * abs(y)


def allclose(a, b, rtol, atol):
    """`numpy.allclose(a, b, rtol, atol)` for numbers and nested lists or
    tuples of numbers."""
    (sa, fa), (sb, fb) = as_array(a), as_array(b)
    shape, sa, sb = broadcast(sa, sb)
    return all(isclose(element(fa, sa, i), element(fb, sb, i), rtol, atol)
               for i in indices(shape))


CHECKS = {
    "exec": check_exec,
    "evalplus_expected": check_evalplus_expected,
    "evalplus": check_evalplus,
}
