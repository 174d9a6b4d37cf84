# populora sandbox servers. The Rust side starts this file with
# `python3 -S -s -B -c <this file> <config json>` and an empty environment except
# PYTHONHASHSEED=0 (set order must not depend on which worker ran a program, and
# -I would ignore that variable) and LD_BIND_NOW=1 (symbols resolved once here,
# not in every child). It isolates itself once (namespaces, read-only
# mounts, a Landlock ruleset), then serves requests: 4-byte big-endian length +
# UTF-8 JSON on the protocol pipes, one reply per request. It plays one of two
# roles (the config's "role"):
#
# - "checker": everything about a program that does not run it. It parses the
#   program and its inputs with `ast`, applies the checks, computes the
#   features and compiles both to marshalled code; it also compares answers as
#   literals. It confines itself like a child (unprivileged uid, rlimits,
#   Landlock) and serves many jobs, so this work runs warm: in a freshly forked
#   child, parsing and compiling cost ~5x more, nearly all of it copy-on-write
#   faults. It never executes what it is given.
# - "zygote": a trusted fork server. Each job (run prepared code, a
#   HumanEval problem, or a benchmark's own check of a program) runs in a forked child with its own process group,
#   rlimits, temp dir and an unprivileged uid; nothing a program does reaches
#   the zygote except the bytes it writes to its own pipes, which are capped.
import sys

sys.path[:] = [p for p in sys.path if p not in ("", ".")]

import ast
import binascii
import builtins
import ctypes
import fcntl
import gc
import json
import json.encoder
import json.scanner
import marshal
import os
import select
import resource
import signal
import struct
import time
from _string import formatter_field_name_split, formatter_parser

# shutil and tempfile are imported only where needed (a fallback path, a temp
# dir a program wrote into): every module loaded here is one more set of
# mappings that each fork copies and each child's exit tears down.

# Modules a program may import without paying the import in every child (and
# without the unprivileged child needing to read the standard library).
# Not `statistics`: it imports `random`, whose fork hook reseeds the generator
# in every child (a getrandom call and a Python-level seed()); measured ~7 %
# of throughput. A program that imports statistics loads it in its own child
# (~3 ms more for that program; the unprivileged child must then be able to
# read the standard library, as with the system python3).
PRELOAD = (
    "math", "cmath", "collections", "collections.abc", "itertools", "functools",
    "heapq", "bisect", "re", "string", "typing", "fractions", "decimal",
    "operator", "copy", "dataclasses", "enum", "numbers", "array", "textwrap",
    "unicodedata",
)

# AZR's banned imports plus everything that reaches the OS or the interpreter,
# and the modules that run a string as code or import and look up names given
# as strings, which the checks cannot see into: pydoc (locate), pkgutil
# (resolve_name), timeit, profile, cProfile, pdb, bdb, trace and doctest (run
# a string or a docstring), unittest (mock.patch("os.system"), loaders),
# rlcompleter (evaluates dotted names), imp (the old import machinery),
# optparse (Values.read_module imports a module named by a string and copies
# its globals), xmlrpc (resolve_dotted_attribute; the network), test
# (test.support's import helpers), dis (the code object of any function, which
# `.replace()` turns into any code).
BANNED_MODULES = frozenset((
    "logging", "random", "multiprocessing", "pebble", "subprocess", "threading",
    "datetime", "time", "hashlib", "hmac", "bcrypt", "calendar",
    "os", "sys", "socket", "shutil", "ctypes", "importlib", "signal", "resource",
    "pathlib", "builtins", "__builtin__", "io", "tempfile", "glob", "gc",
    "inspect", "pickle", "marshal", "shelve", "code", "codeop", "pty", "fcntl",
    "mmap", "posix", "_thread", "_posixsubprocess", "select", "selectors",
    "asyncio", "concurrent", "urllib", "http", "ftplib", "smtplib", "ssl",
    "webbrowser", "platform", "sysconfig", "site", "runpy", "zipimport",
    "secrets", "uuid", "atexit", "faulthandler", "tracemalloc", "weakref",
    "pydoc", "pkgutil", "timeit", "profile", "cProfile", "pdb", "bdb", "trace",
    "doctest", "unittest", "rlcompleter", "imp", "optparse", "xmlrpc", "test", "dis",
))
# `__annotations__` as a name: a class body that assigns it writes annotation
# strings that are no annotation in the AST, so the checks never parse them.
BANNED_NAMES = frozenset((
    "__import__", "eval", "exec", "open", "globals", "locals", "vars", "compile",
    "getattr", "setattr", "delattr", "breakpoint", "help", "exit", "quit",
    "memoryview", "__builtins__", "__loader__", "__spec__", "__build_class__",
    "__annotations__",
))
# Callables that look up a name given as a string, or run a string as code,
# in allowed modules: the checks read names from the AST, so the string
# escapes them (`operator.attrgetter("sys.modules")(typing)` is
# typing.sys.modules). Refused as an attribute (`operator.attrgetter`,
# `op.attrgetter` after `import operator as op`) or an imported name (`from
# operator import attrgetter`) wherever it appears, and as the name of a
# function (see check_function). The other ways to fetch an attribute by name
# (getattr, vars, dunder attributes such as __dict__) are refused already.
# The value says why, in the reason. Not here: operator.itemgetter, whose keys
# are subscripts (`obj[key]`, no dotted names), as the program could write
# them; str.format and format_map, which return text (their fields are checked
# where the format string is a literal, see check_format_fields).
NAME_RESOLVERS = {
    # operator
    "attrgetter": "looks up attributes named by strings",
    "methodcaller": "calls a method named by a string",
    # string: get_field("0.sys", [typing], {}) returns the module itself; its
    # get_value, vformat and the other methods are reached through the class.
    "Formatter": "looks up fields named by strings and returns the objects",
    # typing: string annotations and forward references are evaluated (eval).
    "get_type_hints": "evaluates string annotations",
    "ForwardRef": "evaluates a string as code",
    "_evaluate": "evaluates a string as code",
    "_eval_type": "evaluates strings as code",
    # inspect.get_annotations(eval_str=True); inspect itself is banned.
    "get_annotations": "evaluates string annotations",
    # register() evaluates annotations through get_type_hints, also those of
    # an object whose __annotations__ is a plain dict of strings.
    "singledispatch": "evaluates annotations in register()",
    "singledispatchmethod": "evaluates annotations in register()",
    # enum: sys.modules[name] for a module named by a string (or the class's
    # __module__), whose globals they read and write.
    "global_enum": "looks up a module by its name",
    "_convert_": "looks up a module by its name",
    "_old_convert_": "looks up a module by its name",
    # pkgutil.resolve_name, should another module hold it (pkgutil is banned).
    "resolve_name": "imports and looks up names given as strings",
    # types.CodeType: a code object from bytes and names, any code at all.
    "CodeType": "makes code from bytes",
    # types.MethodType(sys_named_function, typing): copy.copy of that method
    # returns getattr(typing, "sys") (see check_function).
    "MethodType": "binds a function to any object, where a copy looks up its name",
}
# Attribute walks such as ().__class__.__base__.__subclasses__() reach os
# without naming it; frames and code objects reach globals.
BANNED_ATTRS = frozenset((
    "gi_frame", "gi_code", "cr_frame", "cr_code", "ag_frame", "f_globals",
    "f_locals", "f_builtins", "f_back", "f_code", "tb_frame", "tb_next",
    "co_code", "func_globals", "mro",
))
ALLOWED_DUNDERS = frozenset(("__init__", "__name__", "__doc__", "__len__"))
# The import machinery: from any of these every module is one call away.
IMPORT_MACHINERY = frozenset(("modules", "_gcd_import", "_bootstrap", "_bootstrap_external",
                              "_imp", "_handle_fromlist", "import_module"))
# Attribute names that reach a module a program may not import, however it got
# to the object: the import machinery, and the names under which the
# preloadable modules (and the modules they keep) hold a banned or private
# module, such as typing's `sys` or enum's `bltns` (builtins). Filled in by
# `learn_reaching_names` in the checker at start-up; a banned module's own
# name (with or without leading underscores) is always one.
REACHING_NAMES = set(IMPORT_MACHINERY)
TOP_LEVEL_ALLOWED = (ast.FunctionDef, ast.Import, ast.ImportFrom, ast.Assign,
                     ast.AnnAssign, ast.ClassDef, ast.Expr, ast.Pass)

OUTPUT_CHARS = 400        # AZR: o = repr(f(i))[:400]
REASON_CHARS = 300        # enough to say what went wrong, bounded
RESULT_CAP = 1 << 20      # bytes a child may send back as its result
STDOUT_CHARS = 1000       # of captured stdout returned for debugging

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
libc.mount.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p,
                       ctypes.c_ulong, ctypes.c_char_p)

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x20000, 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND = 32, 1024, 2048, 4096
MS_REC, MS_PRIVATE, MS_RELATIME, MS_STRICTATIME = 16384, 1 << 18, 1 << 21, 1 << 24
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS, PR_SET_CHILD_SUBREAPER = 1, 38, 36
SYS_LANDLOCK_CREATE, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT = 444, 445, 446


# ---------------------------------------------------------------- protocol --

def read_exact(fd, n):
    buf = bytearray()
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


# JSON through the C scanner and encoder, each made once: json.loads and
# json.dumps run Python-level code and build a new decoder or encoder object on
# every call, touching objects all over the shared heap (each touched page is a
# copy-on-write fault after a fork). Only for what we wrote ourselves: a
# child's result, which could be anything, goes through json.loads.
SCAN_JSON = json.scanner.make_scanner(json.JSONDecoder())
ENCODE_JSON = json.encoder.c_make_encoder and json.encoder.c_make_encoder(
    None, json.JSONEncoder().default, json.encoder.encode_basestring_ascii, None,
    ": ", ", ", False, False, True)


def to_json(obj):
    """json.dumps(obj) for a dict of plain values built by us (no circular check)."""
    if ENCODE_JSON is None:  # an interpreter without the C accelerator
        return json.dumps(obj)
    return "".join(ENCODE_JSON(obj, 0))


def read_msg(fd):
    head = read_exact(fd, 4)
    if head is None:
        return None
    body = read_exact(fd, struct.unpack(">I", head)[0])
    return None if body is None else SCAN_JSON(body.decode(), 0)[0]


def write_msg(fd, obj):
    body = to_json(obj).encode()
    data = struct.pack(">I", len(body)) + body
    while data:
        data = data[os.write(fd, data):]


# --------------------------------------------------------------- isolation --

def prctl(option, arg):
    return libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0) == 0


def try_unshare(is_root, pid_namespace):
    """Enter the strongest set of namespaces this process may create. The
    checker never forks, so it needs no pid namespace of its own."""
    user = 0 if is_root else CLONE_NEWUSER
    strongest_first = (CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID, CLONE_NEWNS | CLONE_NEWNET, CLONE_NEWNET)
    for flags in strongest_first[0 if pid_namespace else 1:]:
        if libc.unshare(flags | user) == 0:
            if user and not map_own_ids():
                return 0
            return flags | user
    return 0


def map_own_ids():
    uid, gid = os.getuid(), os.getgid()
    try:
        with open("/proc/self/setgroups", "w") as fh:
            fh.write("deny")
        with open("/proc/self/uid_map", "w") as fh:
            fh.write("0 %d 1" % uid)
        with open("/proc/self/gid_map", "w") as fh:
            fh.write("0 %d 1" % gid)
        return True
    except OSError:
        return False


def mount(source, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()
    return libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)) == 0


def unescape_mountinfo(path):
    return path.encode().decode("unicode_escape") if "\\" in path else path


def remount_all_read_only():
    """Read-only bind remount of every mount point, keeping the flags a user
    namespace would refuse to drop. True when / itself became read-only."""
    keep = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC,
            "noatime": MS_NOATIME, "nodiratime": MS_NODIRATIME,
            "relatime": MS_RELATIME, "strictatime": MS_STRICTATIME}
    if not mount(None, "/", None, MS_REC | MS_PRIVATE):
        return False
    root_ok = False
    with open("/proc/self/mountinfo") as fh:
        lines = fh.read().splitlines()
    for line in lines:
        fields = line.split()
        target = unescape_mountinfo(fields[4])
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        for opt in fields[5].split(","):
            flags |= keep.get(opt, 0)
        ok = mount(None, target, None, flags)
        if target == "/":
            root_ok = ok
    return root_ok


def landlock_ruleset(read_dirs, read_files, rw_dirs, rw_files):
    """A ruleset that denies every filesystem access (and exec) except the paths
    given, every TCP bind/connect, and signals to processes outside the child's
    domain. Returns (fd or None, layer names)."""
    abi = libc.syscall(SYS_LANDLOCK_CREATE, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    if abi < 1:
        return None, []
    fs_all = (1 << 13) - 1
    if abi >= 2:
        fs_all |= 1 << 13  # REFER
    if abi >= 3:
        fs_all |= 1 << 14  # TRUNCATE
    if abi >= 5:
        fs_all |= 1 << 15  # IOCTL_DEV
    net = 3 if abi >= 4 else 0
    scoped = 3 if abi >= 6 else 0
    size = 8 if abi < 4 else (16 if abi < 6 else 24)
    attr = ctypes.create_string_buffer(struct.pack("<QQQ", fs_all, net, scoped)[:size], size)
    fd = libc.syscall(SYS_LANDLOCK_CREATE, attr, ctypes.c_size_t(size), ctypes.c_uint32(0))
    if fd < 0:
        return None, []
    read_file, read_dir, write_file, truncate = 4, 8, 2, 1 << 14
    file_rw = read_file | write_file | (truncate if abi >= 3 else 0)

    def allow(path, access):
        try:
            pfd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            return
        rule = ctypes.create_string_buffer(struct.pack("<Qi", access, pfd), 12)
        libc.syscall(SYS_LANDLOCK_ADD_RULE, ctypes.c_int(fd), ctypes.c_int(1), rule, ctypes.c_uint32(0))
        os.close(pfd)

    for path in read_dirs:
        allow(path, read_file | read_dir)
    for path in read_files:
        allow(path, read_file)
    for path in rw_dirs:
        allow(path, fs_all)
    for path in rw_files:
        allow(path, file_rw)
    layers = ["landlock_fs"]
    if net:
        layers.append("landlock_net")
    if scoped:
        layers.append("landlock_signal")
    return fd, layers


class State:
    pass


def isolate(cfg):
    """Namespaces, read-only mounts and the Landlock ruleset, in this process.
    The checker needs no temp dirs and no reaping: it never runs a program."""
    st = State()
    st.uid = st.gid = None
    st.seq = 0
    st.pidns = False
    st.work_root = None
    zygote = cfg["role"] == "zygote"
    layers = ["process_group", "rlimits", "temp_dir"] if zygote else ["rlimits"]
    is_root = os.geteuid() == 0
    flags = try_unshare(is_root, zygote) if cfg["namespaces"] else 0
    if flags & CLONE_NEWUSER:
        layers.append("user_namespace")
    if flags & CLONE_NEWNET:
        layers.append("net_namespace")
    if flags & CLONE_NEWPID:
        # The next child becomes pid 1 of the new namespace: make it the server.
        pid = os.fork()
        if pid:
            _, status = os.waitpid(pid, 0)
            os._exit(os.waitstatus_to_exitcode(status) & 0xFF)
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        st.pidns = True
        layers.append("pid_namespace")
    if flags & CLONE_NEWNS and remount_all_read_only():
        layers.append("mount_namespace")
        if zygote and not mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV,
                                "size=%dm,mode=0711" % cfg["tmpfs_mb"]):
            raise OSError("cannot mount a tmpfs on /tmp after making / read-only")
        st.work_root = "/tmp" if zygote else None
        if st.pidns:
            mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    elif zygote:
        import tempfile
        st.work_root = tempfile.mkdtemp(prefix="populora-sandbox-")
        os.chmod(st.work_root, 0o711)
    if zygote and not st.pidns:
        prctl(PR_SET_CHILD_SUBREAPER, 1)
        layers.append("subreaper")
    if is_root and cfg["uid"] is not None:
        st.uid, st.gid = cfg["uid"], cfg["gid"]
        layers.append("unprivileged_uid")
    layers.append("no_new_privs")
    prefixes = sorted({sys.base_prefix, sys.prefix, sys.exec_prefix} | {p for p in sys.path if p})
    st.landlock_fd, ll_layers = (None, [])
    if cfg["landlock"]:
        st.landlock_fd, ll_layers = landlock_ruleset(
            read_dirs=prefixes + ["/usr/lib", "/usr/lib64", "/lib", "/lib64"],
            read_files=["/dev/urandom", "/dev/zero"],
            rw_dirs=[st.work_root] if zygote else [],
            rw_files=["/dev/null"])
    layers += ll_layers
    st.layers = layers
    st.cfg = cfg
    inherit_child_settings(st)
    return st


def inherit_child_settings(st):
    """Process attributes that every child needs and that fork copies: set them
    once here instead of in every child (each call a child makes touches pages
    of the shared heap, and copying those pages is what a job mostly costs).
    None of them matters to the zygote itself: it never execs (no_new_privs),
    has no file size limit (SIGXFSZ) and creates files with explicit modes."""
    # Children inherit no_new_privs and can never clear it.
    st.nnp_inherited = prctl(PR_SET_NO_NEW_PRIVS, 1)
    # A write past RLIMIT_FSIZE then fails with EFBIG instead of killing the child.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    os.umask(0o077)


# --------------------------------------------------------------------- jobs --

class Reject(Exception):
    def __init__(self, status, reason):
        super().__init__(reason)
        self.status, self.reason = status, reason


def describe(exc):
    try:
        text = "%s: %s" % (type(exc).__name__, exc)
    except BaseException:
        text = type(exc).__name__
    return clean(text[:REASON_CHARS])


def clean(text):
    """`text` with every lone surrogate replaced by "?". A program can make
    such strings (chr(0xdc80)) and put them in an exception or a repr; JSON
    escapes them, but they are not Unicode, and the Rust side refuses a reply
    holding one: the job failed as a sandbox error instead of a verdict."""
    return text.encode("utf-8", "replace").decode("utf-8")


def check_top_level(tree):
    """The program's shape: one function, no top-level statement with effects.
    Returns the function's name."""
    funcs = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
    if len(funcs) != 1:
        raise Reject("invalid_program", "expected exactly one top-level function, found %d" % len(funcs))
    for node in tree.body:
        if not isinstance(node, TOP_LEVEL_ALLOWED):
            raise Reject("invalid_program", "top-level %s statement (line %d)" % (type(node).__name__, node.lineno))
        if isinstance(node, ast.Expr) and not isinstance(node.value, ast.Constant):
            raise Reject("invalid_program", "top-level expression (line %d)" % node.lineno)
    return funcs[0].name


def check_node(node):
    """AST filter for honest mistakes and for the task policy (the OS layers
    are the boundary): no input(), no banned imports, names or attributes, no
    module reached through an attribute or a format field, no name-resolving
    callable, no string annotation that would fail these checks as code, no
    async code."""
    check = NODE_CHECKS.get(type(node))
    if check is not None:
        check(node)


def check_call(node):
    if isinstance(node.func, ast.Name) and node.func.id == "input":
        raise Reject("uses_input", "calls input() (line %d)" % node.lineno)


def check_import(node):
    for alias in node.names:
        check_module(alias.name, node)


def check_import_from(node):
    if node.level:
        raise Reject("banned_import", "relative import (line %d)" % node.lineno)
    check_module(node.module or "", node)
    for alias in node.names:
        check_imported_name(alias.name, node)


def check_name(node):
    if node.id in BANNED_NAMES:
        raise Reject("banned_name", "uses %s (line %d)" % (node.id, node.lineno))


def check_attribute(node):
    check_attribute_name(node.attr, node.lineno)


def check_attribute_name(attr, lineno):
    """An attribute, in code or in a format field."""
    dunder = attr.startswith("__") and attr.endswith("__") and attr not in ALLOWED_DUNDERS
    if dunder or attr in BANNED_ATTRS:
        raise Reject("banned_name", "uses attribute .%s (line %d)" % (attr, lineno))
    if attr in NAME_RESOLVERS:
        raise Reject("banned_name", "uses %s, which %s (line %d)" % (attr, NAME_RESOLVERS[attr], lineno))
    if reaches_module(attr):
        raise Reject("banned_import", "reaches a module through attribute .%s (line %d)" % (attr, lineno))


def refuse_async(node):
    raise Reject("invalid_program", "async code (line %d)" % node.lineno)


def check_function(node):
    """A function's annotations, and its name: `copy.copy` of a method bound
    to a module (`type(obj.method)(sys, typing)`) returns getattr(module,
    name of the function), so a function named like a module's way to a
    module, or like a name-resolving callable, is that attribute. (A callable
    can get its name elsewhere, from functools.wraps of an object with a
    `__name__` attribute: the layers beneath hold there.)"""
    name = node.name
    if name in NAME_RESOLVERS:
        raise Reject("banned_name", "function named %s, which %s (line %d)"
                     % (name, NAME_RESOLVERS[name], node.lineno))
    if name in REACHING_NAMES:
        raise Reject("banned_import", "function named %s, an attribute that reaches a module (line %d)"
                     % (name, node.lineno))
    if node.returns is not None:
        check_annotation(node.returns)


def check_arg(node):
    if node.annotation is not None:
        check_annotation(node.annotation)


def check_ann_assign(node):
    check_annotation(node.annotation)


def check_string(node):
    text = node.value
    if type(text) is str and "{" in text:
        check_format_fields(text, node.lineno)


def check_annotation(annotation):
    """An annotation is code: its expression is checked with the rest of the
    tree (under `from __future__ import annotations` too, where it becomes a
    string only at run time). A string in it (`x: "T"`, `List["T"]`) is code
    as well, evaluated by whatever evaluates annotations
    (typing.get_type_hints): parsed and checked the same way, strings in it
    too. Not the values of a `Literal[...]`, which typing keeps as values
    (`Literal["open", "closed"]` is no use of open), nor a string that does
    not parse as an expression, which is no code."""
    todo = [annotation]
    while todo:
        node = todo.pop()
        cls = type(node)
        if cls is ast.Constant:
            if type(node.value) is str:
                tree = check_string_annotation(node)
                if tree is not None:
                    todo.append(tree)
        elif cls is not ast.Subscript or not names_literal(node.value):
            todo.extend(ast.iter_child_nodes(node))


def names_literal(node):
    return ((type(node) is ast.Name and node.id == "Literal")
            or (type(node) is ast.Attribute and node.attr == "Literal"))


def check_string_annotation(node):
    """Checks a string annotation as code. Returns its tree, whose strings
    are annotations too, or None when it has none or is no expression."""
    try:
        text = node.value.strip()
        names = text.split(".")
        if text.isascii() and all(name.isidentifier() for name in names):
            # A name or a dotted name, as most are: the same checks without
            # the cost of a parse. (ASCII only: the parser would normalize
            # others, NFKC makes `ｅｖａｌ` eval.)
            check_name(ast.Name(id=names[0], lineno=node.lineno))
            for attr in names[1:]:
                check_attribute_name(attr, node.lineno)
            return None
        tree = parse_annotation(node.value, node.lineno)
        if tree is not None:
            check_names(tree)
        return tree
    except Reject as rej:
        raise Reject(rej.status, "string annotation %r: %s" % (node.value[:60], rej.reason))


def parse_annotation(text, lineno):
    """A string annotation as typing.ForwardRef compiles it (`*Ts` as
    `(*Ts,)[0]`), numbered from the line it is on; None when it is no
    expression."""
    text = text.strip()
    if text.startswith("*"):
        text = "(%s,)[0]" % text
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    return ast.increment_lineno(tree, lineno - 1)


def check_format_fields(text, lineno):
    """A string literal read as a format string: `"{0.sys}".format(typing)`
    (or the same text in a variable, or format_map) looks up the attributes
    its fields name, like code does, so each passes the same checks as an
    attribute in code. Subscripts (`{0[key]}`) are allowed as in code. A
    string that is no format string is text; its fields up to the error are
    checked, as str.format would have looked them up."""
    todo = [text]
    while todo:
        try:
            for _, field, spec, _ in formatter_parser(todo.pop()):
                if field:
                    _, rest = formatter_field_name_split(field)
                    for is_attribute, key in rest:
                        if is_attribute:
                            check_field_attribute(key, field, lineno)
                if spec and "{" in spec:
                    todo.append(spec)
        except ValueError:
            continue


def check_field_attribute(attr, field, lineno):
    try:
        check_attribute_name(attr, lineno)
    except Reject as rej:
        raise Reject(rej.status, "format field {%s}: %s" % (field[:60], rej.reason))


def check_module(name, node):
    """A banned module, with or without leading underscores (`_io`), or a
    private one (`_frozen_importlib`, `_string`): not importable."""
    if name != "__future__" and forbidden_module(name):
        raise Reject("banned_import", "imports %s (line %d)" % (name, node.lineno))


def check_imported_name(name, node):
    """`from m import name`: not everything (the names it binds cannot be
    checked), not a name-resolving callable, not a private name, not a module
    the program may not import."""
    if name == "*":
        raise Reject("banned_import", "star import (line %d)" % node.lineno)
    if name in NAME_RESOLVERS:
        raise Reject("banned_name", "imports %s from %s, which %s (line %d)"
                     % (name, node.module, NAME_RESOLVERS[name], node.lineno))
    if name.startswith("_") or reaches_module(name):
        raise Reject("banned_import", "imports %s from %s (line %d)"
                     % (name, node.module, node.lineno))


# What check_node does for each node type; every other node passes it.
NODE_CHECKS = {
    ast.Call: check_call, ast.Import: check_import, ast.ImportFrom: check_import_from,
    ast.Name: check_name, ast.Attribute: check_attribute, ast.Constant: check_string,
    ast.FunctionDef: check_function, ast.arg: check_arg, ast.AnnAssign: check_ann_assign,
    ast.AsyncFunctionDef: refuse_async, ast.Await: refuse_async,
    ast.AsyncFor: refuse_async, ast.AsyncWith: refuse_async,
}


def reaches_module(name):
    return name in REACHING_NAMES or name.lstrip("_") in BANNED_MODULES


def check_private_attributes(attributes, imported):
    """No private attribute of an imported module (`re._compiler`,
    `collections._sys`): an attribute starting with `_` on a name that an
    import bound, directly or down a chain of attributes."""
    for node in attributes:
        root = node.value
        while isinstance(root, ast.Attribute):
            root = root.value
        if isinstance(root, ast.Name) and root.id in imported:
            raise Reject("banned_name", "uses private attribute .%s of module %s (line %d)"
                         % (node.attr, root.id, node.lineno))


def bound_by_import(node):
    """The names an import statement binds."""
    if isinstance(node, ast.Import):
        return [a.asname or a.name.split(".")[0] for a in node.names]
    return [a.asname or a.name for a in node.names]


def check_names(tree):
    attributes, imported = [], set()
    for node in ast.walk(tree):
        check_node(node)
        note_for_private_check(node, attributes, imported)
    check_private_attributes(attributes, imported)


def note_for_private_check(node, attributes, imported):
    if isinstance(node, ast.Attribute) and node.attr.startswith("_"):
        attributes.append(node)
    elif isinstance(node, (ast.Import, ast.ImportFrom)):
        imported.update(bound_by_import(node))


def learn_reaching_names():
    """Adds to REACHING_NAMES every attribute name under which a preloadable
    module, or a permitted module it keeps, holds a module a program may not
    import (banned, or private such as `_sre`): found in the modules
    themselves, so an alias like enum's `bltns` is caught wherever it is used."""
    for name in PRELOAD:
        __import__(name)
    todo = [sys.modules[name] for name in PRELOAD]
    seen = set()
    while todo:
        module = todo.pop()
        if module.__name__ in seen:
            continue
        seen.add(module.__name__)
        for attr, value in list(vars(module).items()):
            if not isinstance(value, type(sys)):
                continue
            if forbidden_module(getattr(value, "__name__", "")):
                REACHING_NAMES.add(attr)
            else:
                todo.append(value)


def forbidden_module(name):
    parts = name.split(".")
    return parts[0].lstrip("_") in BANNED_MODULES or any(p.startswith("_") for p in parts)


# Node types that note_for_private_check looks at.
NOTED_TYPES = frozenset((ast.Attribute, ast.Import, ast.ImportFrom))
# Decision points for the cyclomatic number: one each, plus the extra ones below.
DECISION_TYPES = frozenset((ast.If, ast.For, ast.While, ast.IfExp, ast.ExceptHandler,
                            ast.Assert, ast.match_case, ast.comprehension, ast.BoolOp))


def scan(tree):
    """One breadth-first pass over the tree: check_node on every node (in
    ast.walk's order, so the first problem reported is the same), and the
    complexity features for the dynamics plots. One pass instead of ast.walk
    plus a second walk: this is a large share of a checker's work."""
    count, depth, kinds, decisions = 0, 0, set(), 0
    attributes, imported = [], set()
    level = [tree]
    while level:
        depth += 1
        count += len(level)
        below = []
        for node in level:
            cls = type(node)
            kinds.add(cls)
            check = NODE_CHECKS.get(cls)
            if check is not None:
                check(node)
                if cls in NOTED_TYPES:
                    note_for_private_check(node, attributes, imported)
            if cls in DECISION_TYPES:
                if cls is ast.comprehension:
                    decisions += 1 + len(node.ifs)
                elif cls is ast.BoolOp:
                    decisions += len(node.values) - 1
                else:
                    decisions += 1
            for field in cls._fields:
                value = getattr(node, field, None)
                if type(value) is list:
                    below.extend(item for item in value if isinstance(item, ast.AST))
                elif isinstance(value, ast.AST):
                    below.append(value)
        level = below
    check_private_attributes(attributes, imported)
    return {"ast_nodes": count, "max_depth": depth, "node_types": len(kinds),
            "cyclomatic": 1 + decisions}


def prepare_call(text):
    """An input, written as the text between the parentheses of a call (`"Hi"`
    is one argument, `[1, 2], 3` two, `(1, 2)` one tuple), as packed text that
    `load_call` turns into fresh (args, kwargs) for every run:
    - "v" + marshalled values, when all are literals. Not code: the compiler
      folds constant tuples into one object shared by both runs, and a tuple
      argument must be new in each, or its id() could pass the determinism check;
    - "c" + marshalled code, for anything else, which must pass the AST checks;
    - "s" + the text itself, compiled again by the child, when a set is
      involved: marshal writes set elements sorted, which can change a set's
      iteration order (and repr) from the one Python gives when it evaluates
      the text. (Constant tuples in such an input are then shared by both
      runs.)"""
    try:
        call = ast.parse("_(\n" + text + "\n)", mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise Reject("bad_input", "input does not parse as arguments: %s" % describe(exc))
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "_"):
        raise Reject("bad_input", "input is not an argument list")
    values = literal_arguments(call)
    if values is None:
        check_names(call)
    try:
        # Literals too: compiling rejects what Python would (a repeated keyword).
        code = compile(ast.Expression(call), "<input>", "eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise Reject("bad_input", "input does not compile: %s" % describe(exc))
    if has_set_constant(code) or (values is not None and has_set(values)):
        return "s" + text
    if values is not None:
        return "v" + to_base64(marshal.dumps(values))
    return "c" + to_base64(marshal.dumps(code))


def literal_arguments(call):
    """(args, kwargs) when every argument is a literal, else None."""
    try:
        args = tuple(ast.literal_eval(arg) for arg in call.args)
        kwargs = {}
        for keyword in call.keywords:
            if keyword.arg is None:
                return None  # **mapping
            kwargs[keyword.arg] = ast.literal_eval(keyword.value)
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError, AttributeError):
        return None
    return args, kwargs


def has_set(value):
    """Whether a literal value holds a set anywhere."""
    if isinstance(value, (set, frozenset)):
        return True
    if isinstance(value, dict):
        return any(has_set(k) or has_set(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return any(has_set(item) for item in value)
    return False


def has_set_constant(code):
    """Whether compiled code holds a frozenset constant (a set display of
    constants, `for x in {...}`), in nested code objects too."""
    return any(isinstance(c, frozenset) or (isinstance(c, type(code)) and has_set_constant(c))
               for c in code.co_consts)


def collect_args(*args, **kwargs):
    return args, kwargs


def load_call(text):
    """The child's side of `prepare_call`: a function giving fresh (args, kwargs)."""
    kind, body = text[:1], text[1:]
    if kind == "s":
        code = compile("_(\n" + body + "\n)", "<input>", "eval")
    elif kind == "v":
        data = binascii.a2b_base64(body)
        return lambda: marshal.loads(data)
    else:
        code = marshal.loads(binascii.a2b_base64(body))
    return lambda: eval(code, {"_": collect_args})


def load_code(text):
    """The child's side of `prepare_code`."""
    if text[:1] == "s":
        return compile(text[1:], "<program>", "exec")
    return marshal.loads(binascii.a2b_base64(text[1:]))


def to_base64(data):
    return binascii.b2a_base64(data, newline=False).decode("ascii")


def run_calls(code, name, calls):
    """Execute the program in a fresh namespace and call its function on every
    input. Returns the truncated reprs."""
    namespace = {"__name__": "__sandbox__", "__builtins__": builtins}
    exec(code, namespace)
    fn = namespace.get(name)
    if not callable(fn):
        raise Reject("invalid_program", "no function named %s" % name)
    namespace["f"] = fn
    outputs = []
    for fresh in calls:
        try:
            args, kwargs = fresh()
        except BaseException as exc:
            raise Reject("bad_input", "input failed to evaluate: %s" % describe(exc))
        outputs.append(clean(repr(fn(*args, **kwargs))[:OUTPUT_CHARS]))
    return outputs


# Packed code and inputs of one prepared program, at most: compiling can fold
# a short expression such as "a" * 4096 into a large constant, and 32 of them
# must fit one checker reply (the Rust side's MAX_REPLY_BYTES).
PREPARED_CHARS = 4 << 20


def prepare_code(source, code):
    """"c" + marshalled code, or "s" + the source, compiled again by the child,
    when the code holds a set constant (see `prepare_call`)."""
    if has_set_constant(code):
        return "s" + source
    return "c" + to_base64(marshal.dumps(code))


def job_prepare(job):
    """Checker: parse, check and compile a program and its inputs, without
    running anything. The reply is what `job_run` needs."""
    try:
        tree = ast.parse(job["program"], mode="exec")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise Reject("syntax_error", describe(exc))
    name = check_top_level(tree)
    features = scan(tree)
    code = prepare_code(job["program"], compile(tree, "<program>", "exec"))
    calls = [prepare_call(text) for text in job["inputs"]]
    size = len(code) + sum(len(call) for call in calls)
    if size > PREPARED_CHARS:
        raise Reject("invalid_program", "compiled program and inputs take %d bytes, limit %d"
                     % (size, PREPARED_CHARS))
    return {"status": "ok", "function": name, "features": features, "code": code, "calls": calls}


def job_run(job):
    """Child: run prepared code on every input, `runs` times; two runs must
    give the same reprs."""
    code = load_code(job["code"])
    calls = [load_call(call) for call in job["calls"]]
    first = run_calls(code, job["function"], calls)
    if job["runs"] > 1:
        # Keep the first run's objects alive and shift the allocator so an
        # address-dependent repr cannot repeat by reusing freed memory.
        padding = [object() for _ in range(97)] + [[] for _ in range(31)]
        second = run_calls(code, job["function"], calls)
        del padding
        for i, (a, b) in enumerate(zip(first, second)):
            if a != b:
                raise Reject("non_deterministic", "input %d: first run %s, second run %s" % (i, a[:120], b[:120]))
    return {"status": "ok", "outputs": first}


def same_value(a, b):
    a, b = a.strip(), b.strip()
    if a == b:
        return True
    try:
        return bool(ast.literal_eval(a) == ast.literal_eval(b))
    except Exception:
        return False


def job_compare(job):
    return {"status": "ok", "equal": [same_value(a, b) for a, b in job["pairs"]]}


def job_humaneval(job):
    namespace = {"__name__": "__sandbox__", "__builtins__": builtins}
    try:
        program = compile(job["program"], "<program>", "exec")
        test = compile(job["test"], "<test>", "exec")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise Reject("syntax_error", describe(exc))
    exec(program, namespace)
    exec(test, namespace)
    candidate = namespace.get(job["entry_point"])
    check = namespace.get("check")
    if candidate is None or check is None:
        raise Reject("invalid_program", "missing %s or check" % job["entry_point"])
    try:
        check(candidate)
    except AssertionError as exc:
        raise Reject("mismatch", describe(exc) or "AssertionError")
    return {"status": "ok"}


def job_harness(job):
    """A benchmark's own check (src/eval/harness.py, trusted) of `program`
    (untrusted), in a child: the harness's `main(program, args)` gives the
    result."""
    namespace = {"__name__": "__harness__", "__builtins__": builtins}
    exec(compile(job["harness"], "<harness>", "exec"), namespace)
    return namespace["main"](job["program"], job["args"])


# The jobs each role serves (the config's "role").
JOBS = {
    "checker": {"prepare": job_prepare, "compare": job_compare},
    "zygote": {"run": job_run, "humaneval": job_humaneval, "harness": job_harness},
}

# Fixed, trusted jobs that a server runs on itself before it starts serving.
WARM_UP_PROGRAM = '''import math
def f(s, k=2):
    counts = {}
    for ch in s:
        counts[ch] = counts.get(ch, 0) + 1
    words = ' '.join(w.capitalize() for w in s.split())
    evens = [x * k for x in range(len(s)) if x % 2 == 0]
    return sorted(counts.items())[::k], words[::-1], evens, math.gcd(len(s), 12)
'''
WARM_UP_PREPARES = (
    ({"kind": "prepare", "program": WARM_UP_PROGRAM, "inputs": ["'hello big world', 3"]}, 2),
    ({"kind": "prepare", "program": WARM_UP_PROGRAM, "inputs": ["'abc'", "'x y', k=1", "'ab' * 2"]}, 1),
)
WARM_UP_CHECKER_JOBS = tuple(job for job, _ in WARM_UP_PREPARES) + (
    {"kind": "compare", "pairs": [["[1, 2]", "[1,2]"], ["'a'", "'b'"]]},
)
# CPython 3.11 specialises a function's bytecode after 8 calls.
WARM_UP_ROUNDS = 10


def warm_up_zygote_jobs():
    """The zygote's warm-up runs code the checker would have prepared."""
    runs = []
    for job, runs_each in WARM_UP_PREPARES:
        prepared = job_prepare(job)
        runs.append({"kind": "run", "code": prepared["code"], "calls": prepared["calls"],
                     "function": prepared["function"], "runs": runs_each})
    humaneval = {"kind": "humaneval", "program": WARM_UP_PROGRAM,
                 "test": "def check(candidate):\n    assert candidate('ab')[3] == 2\n",
                 "entry_point": "f"}
    return runs + [humaneval]


def warm_up(role):
    """Run every job kind of `role` on fixed inputs in this process. What a
    first run does once — filling the type attribute caches, specialising the
    bytecode, creating lazily built objects — is then done before serving; in
    the zygote it lands in the shared heap instead of again in every child,
    where each write to a shared page is a copy-on-write fault: the largest
    part of a job's cost."""
    jobs = warm_up_zygote_jobs() if role == "zygote" else WARM_UP_CHECKER_JOBS
    for _ in range(WARM_UP_ROUNDS):
        for job in jobs:
            to_json(run_job(job, JOBS[role]))


# What fill_free_blocks allocated, alive as long as the zygote.
BLOCK_FILLERS = []


def fill_free_blocks():
    """Occupy every free block of CPython's small-object allocator with an
    object kept forever, just before gc.freeze(). Startup and warm-up leave
    free blocks scattered over many pages of the shared heap, and new objects
    go there first: every page a child allocates into is one more
    copy-on-write fault (and the zygote's own per-job objects land there too).
    With the old pools full, new objects fill fresh pools, a few contiguous
    pages. Kept because it pays: `bench verifier --sandbox-only --programs
    4000`, 8 pairs alternated with POPULORA_NO_POOL_FILL=1 (which turns it
    off, see server.rs), machine F 2026-12-04: 421 against 463 page faults per
    program in every run, CPU of the process tree −6 % and throughput +5 %
    (medians of the pairs; BENCHMARKS.md, "Verifier sandbox")."""
    for size, free in free_small_blocks().items():
        make = block_maker(size)
        if make is not None:
            BLOCK_FILLERS.extend(make() for _ in range(free))


def block_maker(size):
    """A function returning a new object of exactly `size` bytes (on 64-bit
    CPython), or None for a size class left unfilled."""
    if size == 16:
        return object
    if size == 32:
        return lambda big=1 << 30: big + 1  # an int of two 30-bit digits
    if size >= 48:
        return lambda: bytes(size - 33)  # a bytes object has a 33-byte header
    return None


def free_small_blocks():
    """{block size: free blocks} of the small-object allocator, parsed from
    sys._debugmallocstats (CPython), which prints to the C-level stderr: fd 2
    points at a memfd for the call. {} where either is unavailable."""
    stats = getattr(sys, "_debugmallocstats", None)
    if stats is None:
        return {}
    try:
        out = os.memfd_create("mallocstats")
    except OSError:
        return {}
    with os.fdopen(out, "rb") as fh:
        saved = os.dup(2)
        try:
            os.dup2(out, 2)
            stats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        fh.seek(0)
        text = fh.read().decode("ascii", "replace")
    free = {}
    for line in text.splitlines():
        cols = line.split()
        # Rows of the size-class table: class, size, pools, blocks in use, free blocks.
        if len(cols) == 5 and all(c.isdigit() for c in cols):
            free[int(cols[1])] = int(cols[4])
    return free


def run_job(job, jobs):
    try:
        return jobs[job["kind"]](job)
    except Reject as rej:
        return {"status": rej.status, "reason": rej.reason}
    except MemoryError:
        return {"status": "memory_limit", "reason": "MemoryError"}
    except BaseException as exc:
        return {"status": "runtime_error", "reason": describe(exc)}


def close_all_except(keep):
    low = 0
    for fd in sorted(keep) + [1 << 20]:
        if fd > low:
            os.closerange(low, fd)
        low = fd + 1


def child_main(st, job, limits, work, out_w, err_w, res_w):
    """Runs in the forked child: confine this process, run the job, report on
    `res_w`. What the zygote already set is inherited (see
    inherit_child_settings); fd 0 is the zygote's /dev/null (see main)."""
    child_pid = os.getpid()
    os.setpgid(0, 0)
    if not st.pidns:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    os.dup2(out_w, 1)
    os.dup2(err_w, 2)
    keep = {0, 1, 2, res_w}
    if st.landlock_fd is not None:
        keep.add(st.landlock_fd)
    close_all_except(keep)
    os.chdir(work)
    set_rlimits(limits)
    if st.uid is not None:
        os.setgroups([])
        os.setresgid(st.gid, st.gid, st.gid)
        os.setresuid(st.uid, st.uid, st.uid)
    if not st.nnp_inherited:
        prctl(PR_SET_NO_NEW_PRIVS, 1)
    if st.landlock_fd is not None:
        if libc.syscall(SYS_LANDLOCK_RESTRICT, ctypes.c_int(st.landlock_fd), ctypes.c_uint32(0)) != 0:
            os._exit(71)
        os.close(st.landlock_fd)
    result = run_job(job, JOBS["zygote"])
    if os.getpid() != child_pid:
        os._exit(0)  # a process the program forked: only the child itself reports
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        pass
    data = to_json(result).encode()
    if len(data) > RESULT_CAP:
        # The result pipe holds RESULT_CAP bytes and nobody reads it before we exit.
        data = to_json({"status": "output_limit",
                        "reason": "result exceeded %d bytes" % RESULT_CAP}).encode()
    while data:
        data = data[os.write(res_w, data):]
    os._exit(0)


def set_rlimits(limits):
    cpu = max(1, -(-limits["timeout_ms"] // 1000))
    mem = limits["memory_mb"] << 20
    for res, soft, hard in ((resource.RLIMIT_AS, mem, mem),
                            (resource.RLIMIT_CPU, cpu, cpu + 1),
                            (resource.RLIMIT_FSIZE, limits["file_bytes"], limits["file_bytes"]),
                            (resource.RLIMIT_NOFILE, limits["open_files"], limits["open_files"]),
                            (resource.RLIMIT_CORE, 0, 0),
                            (resource.RLIMIT_NPROC, limits["processes"], limits["processes"])):
        resource.setrlimit(res, (soft, hard))


# ------------------------------------------------------------- supervision --

def kill_descendants(st, pid):
    """SIGKILL everything the child left behind and reap it all. Returns the
    child's wait status."""
    status = None
    if st.pidns:
        # pid 1 of the namespace: kill(-1) reaches every other process in it,
        # zombies included; ESRCH means none is left, so nothing to reap.
        while True:
            try:
                os.kill(-1, signal.SIGKILL)
            except ProcessLookupError:
                return status
            except OSError:
                pass
            try:
                p, s = os.waitpid(-1, 0)
            except ChildProcessError:
                return status
            if p == pid:
                status = s
    children_file = "/proc/self/task/%d/children" % os.getpid()
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass
    while True:
        # As a subreaper, orphans that escaped the process group come back to us.
        with open(children_file) as fh:
            pids = [int(p) for p in fh.read().split()]
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
        try:
            p, s = os.waitpid(-1, 0)
        except ChildProcessError:
            return status
        if p == pid:
            status = s


def drain(fd, buf, cap):
    os.set_blocking(fd, False)
    try:
        while len(buf) <= cap:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            buf += chunk
    except BlockingIOError:
        pass


def grow_pipe(fd, size):
    """Make a pipe hold `size` bytes, so the child can write its whole result
    without the zygote reading while it runs. False when the kernel refuses."""
    try:
        return fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, size) >= size
    except OSError:
        return False


def new_work_dir(st):
    st.seq += 1
    work = os.path.join(st.work_root, "j%d" % st.seq)
    os.mkdir(work, 0o700)
    if st.uid is not None:
        os.chown(work, st.uid, st.gid)
    return work


def remove_work_dir(work):
    """Most programs write nothing: one rmdir. Otherwise the fd-based rmtree,
    which does not follow links the program may have planted."""
    try:
        os.rmdir(work)
    except OSError:
        remove_tree(work)


def remove_tree(path):
    import shutil
    shutil.rmtree(path, ignore_errors=True)


def supervise(pid, out_r, err_r, res_r, result_buffered, limits, deadline):
    """Wait for the child to exit, its deadline, or too much output. The result
    pipe is watched only when it cannot hold a whole result: otherwise the
    zygote sleeps until the exit (each wake-up while the child lives costs
    copy-on-write faults on both sides). Returns (verdict or None,
    {fd: bytes read})."""
    pidfd = os.pidfd_open(pid)
    bufs = {out_r: bytearray(), err_r: bytearray(), res_r: bytearray()}
    caps = {out_r: limits["output_bytes"], err_r: limits["output_bytes"], res_r: RESULT_CAP}
    watched = [out_r, err_r, pidfd] if result_buffered else [out_r, err_r, res_r, pidfd]
    verdict, exited = None, False
    try:
        while not exited and verdict is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                verdict = ("timeout", "wall-clock limit of %d ms exceeded" % limits["timeout_ms"])
                break
            ready, _, _ = select.select(watched, [], [], remaining)
            for fd in ready:
                if fd == pidfd:
                    exited = True
                    continue
                chunk = os.read(fd, 65536)
                if not chunk:
                    watched.remove(fd)
                    continue
                bufs[fd] += chunk
                if len(bufs[fd]) > caps[fd]:
                    verdict = ("output_limit", "output exceeded %d bytes" % caps[fd])
    finally:
        os.close(pidfd)
    if exited and verdict is None:
        for fd in (out_r, err_r, res_r):
            drain(fd, bufs[fd], caps[fd])
            if len(bufs[fd]) > caps[fd]:
                verdict = ("output_limit", "output exceeded %d bytes" % caps[fd])
    return verdict, bufs


def job_limits(limits, job):
    """The configured limits, with a job's own wall-clock and memory limits
    where it brings them (a harness job: a benchmark's time limits)."""
    own = {key: job[key] for key in ("timeout_ms", "memory_mb") if job.get(key)}
    return dict(limits, **own) if own else limits


def handle(st, req):
    job = req["job"]
    limits = job_limits(st.cfg["limits"], job)
    work = new_work_dir(st)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    res_r, res_w = os.pipe()
    result_buffered = grow_pipe(res_w, RESULT_CAP)
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        try:
            child_main(st, job, limits, work, out_w, err_w, res_w)
        finally:
            os._exit(70)
    for fd in (out_w, err_w, res_w):
        os.close(fd)
    try:
        os.setpgid(pid, pid)
    except OSError:
        pass
    try:
        verdict, bufs = supervise(pid, out_r, err_r, res_r, result_buffered, limits,
                                  start + limits["timeout_ms"] / 1000.0)
        wall_ms = (time.monotonic() - start) * 1000.0
    finally:
        status = kill_descendants(st, pid)
        for fd in (out_r, err_r, res_r):
            os.close(fd)
        remove_work_dir(work)
    reply = settle(verdict, status, bytes(bufs[res_r]), bufs[err_r])
    reply["wall_ms"] = wall_ms
    reply["stdout"] = bufs[out_r][:STDOUT_CHARS].decode("utf-8", "replace")
    return reply


STATUSES = frozenset((
    "ok", "syntax_error", "invalid_program", "uses_input", "banned_import",
    "banned_name", "bad_input", "runtime_error", "timeout", "memory_limit",
    "output_limit", "non_deterministic", "mismatch", "crashed",
))
# Optional fields of a child's result and their expected types.
RESULT_CHECKS = {
    "reason": lambda v: isinstance(v, str),
    "outputs": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
}


def well_formed(result):
    """The child's result, or None unless every field has the expected type:
    the child runs hostile code and could have written anything."""
    try:
        raw = json.loads(result)
    except (ValueError, RecursionError):  # deeply nested JSON raises RecursionError
        return None
    if not isinstance(raw, dict) or raw.get("status") not in STATUSES:
        return None
    reply = {"status": raw["status"]}
    for key, ok in RESULT_CHECKS.items():
        if key in raw:
            if not ok(raw[key]):
                return None
            value = raw[key]
            reply[key] = clean(value) if isinstance(value, str) else [clean(v) for v in value]
    return reply


def settle(verdict, status, result, stderr):
    """The reply for a finished job; the tail of `stderr` explains a crash."""
    if verdict is not None:
        return {"status": verdict[0], "reason": verdict[1]}
    if result:
        reply = well_formed(result)
        if reply is not None:
            return reply
        return {"status": "crashed", "reason": "malformed result from the child"}
    tail = stderr[-REASON_CHARS:].decode("utf-8", "replace").strip()
    if status is not None and os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig == signal.SIGXCPU:
            return {"status": "timeout", "reason": "CPU time limit exceeded"}
        return {"status": "crashed", "reason": "killed by %s %s" % (signal.Signals(sig).name, tail)}
    code = os.waitstatus_to_exitcode(status) if status is not None else -1
    return {"status": "crashed", "reason": "exited with code %d without a result %s" % (code, tail)}


# ---------------------------------------------------------------- checker --

# A checker whose peak resident set passed this exits after its reply (which
# says so): a huge program or answer may have left a large heap behind. Until
# then that heap counts against the checker's address-space limit, so whether
# parsing a program needing nearly `memory_mb` fails with MemoryError can
# depend on what the same checker parsed before. With the default limits
# (programs of 64 KiB, answers of 8 KiB, run outputs of at most 1 MiB each)
# no parse comes near 512 MiB.
CHECKER_RETIRE_KB = 128 << 10


def confine_checker(st, limits):
    """The checker reads hostile text, so it gets a child's confinement, except
    the CPU limit (it serves many jobs; the Rust side enforces each job's wall
    deadline) and with no processes at all (it never forks)."""
    mem = limits["memory_mb"] << 20
    for res, value in ((resource.RLIMIT_AS, mem), (resource.RLIMIT_FSIZE, 0),
                       (resource.RLIMIT_NOFILE, limits["open_files"]),
                       (resource.RLIMIT_CORE, 0), (resource.RLIMIT_NPROC, 0)):
        resource.setrlimit(res, (value, value))
    if st.uid is not None:
        os.setgroups([])
        os.setresgid(st.gid, st.gid, st.gid)
        os.setresuid(st.uid, st.uid, st.uid)
    if not st.nnp_inherited and not prctl(PR_SET_NO_NEW_PRIVS, 1):
        raise OSError("cannot set no_new_privs")
    if st.landlock_fd is not None:
        if libc.syscall(SYS_LANDLOCK_RESTRICT, ctypes.c_int(st.landlock_fd), ctypes.c_uint32(0)) != 0:
            raise OSError("cannot apply the Landlock ruleset")
        os.close(st.landlock_fd)
        st.landlock_fd = None


def check(st, req):
    """One checker job, or a list of them ("many"): one reply each."""
    job = req["job"]
    if job["kind"] == "many":
        return {"status": "ok", "replies": [check_one(one) for one in job["jobs"]]}
    return check_one(job)


def check_one(job):
    start = time.monotonic()
    reply = run_job(job, JOBS["checker"])
    reply["wall_ms"] = (time.monotonic() - start) * 1000.0
    return reply


def quiet_checker(proto_in, proto_out):
    """Nothing but the protocol pipes stays open, and stderr goes nowhere: a
    program's compile-time warnings must not reach the trainer's terminal or
    fill a pipe nobody reads. Returns a descriptor of /proc/self/status for
    `retiring`, opened while Landlock still allows it (None without /proc)."""
    import warnings
    warnings.simplefilter("ignore")
    devnull = os.open("/dev/null", os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)
    close_all_except({0, 1, 2, proto_in, proto_out})
    try:
        return os.open("/proc/self/status", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None


def retiring(status_fd):
    """Whether this checker's own peak resident set (VmHWM; unlike
    getrusage's ru_maxrss, it does not start from the peak of the process
    that spawned us) passed CHECKER_RETIRE_KB."""
    if status_fd is None:
        return False
    for line in os.pread(status_fd, 8192, 0).splitlines():
        if line.startswith(b"VmHWM:"):
            return int(line.split()[1]) > CHECKER_RETIRE_KB
    return False


def main():
    cfg = json.loads(sys.argv[1])
    # The protocol moves to private descriptors; 0 and 1 become /dev/null so no
    # inherited descriptor of a child can write into the protocol.
    proto_in, proto_out = os.dup(0), os.dup(1)
    devnull = os.open("/dev/null", os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    os.close(devnull)
    os.set_inheritable(proto_in, False)
    os.set_inheritable(proto_out, False)
    role = cfg["role"]
    if role == "zygote":
        for name in PRELOAD:
            __import__(name)
    else:
        status_fd = quiet_checker(proto_in, proto_out)
    # Whatever fails before the hello is said in it: the checker's stderr goes
    # nowhere, and a server that just exits tells the trainer nothing.
    try:
        if role == "checker":
            learn_reaching_names()
        st = isolate(cfg)
        if role == "checker":
            confine_checker(st, cfg["limits"])
        warm_up(role)
    except Exception as exc:
        write_msg(proto_out, {"fatal": describe(exc)})
        return
    if role == "zygote":
        gc.collect()
        if cfg["fill_pools"]:
            fill_free_blocks()
        gc.freeze()
    serve = handle if role == "zygote" else check
    write_msg(proto_out, {"hello": True, "layers": st.layers})
    while True:
        req = read_msg(proto_in)
        if req is None:
            break
        try:
            reply = serve(st, req)
        except Exception as exc:
            reply = {"error": describe(exc)}
        retire = role == "checker" and retiring(status_fd)
        if retire:
            reply["retiring"] = True
        write_msg(proto_out, reply)
        if retire:
            break
    if st.work_root is not None and "mount_namespace" not in st.layers:
        remove_tree(st.work_root)


main()
