"""Grading a code candidate by unit tests in the Python sandbox, in a harness the candidate cannot fool
by exiting early, printing a look-alike report or always-equal objects (`rolerl.tasks.code` says how)."""

from __future__ import annotations

import ast
import json
import re
import secrets
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

from rolerl.tools import PythonSandbox
from rolerl.tools.base import ToolResult

STATUSES = ("pass", "fail", "timeout", "crash", "skipped")  # per test, as the harness reports them
# Model code parsed here (never run here) warns about e.g. invalid escapes: noise in a training log. A
# filter by file name, set once, because catch_warnings() is not thread-safe and grading is threaded.
_CANDIDATE = "<candidate>"
for _category in (SyntaxWarning, DeprecationWarning):
    warnings.filterwarnings("ignore", category=_category, module=re.escape(_CANDIDATE) + "$")


# --- grading ----------------------------------------------------------------------------------------------
@dataclass
class GradeLimits:
    per_test_timeout_s: float = 3.0  # wall clock of one test (an MBPP assert, HumanEval's check())
    total_timeout_s: float = 15.0  # wall clock of one candidate's whole run; the sandbox kills it there
    stop_on_timeout: bool = True  # after a test times out skip the rest: each would likely cost as much
    error_chars: int = 300  # kept of a failure's text

    def __post_init__(self) -> None:
        for name in ("per_test_timeout_s", "total_timeout_s", "error_chars"):
            if not getattr(self, name) > 0:
                raise ValueError(f"GradeLimits.{name} must be > 0, got {getattr(self, name)!r}")
        if self.per_test_timeout_s > self.total_timeout_s:
            raise ValueError(
                f"GradeLimits.per_test_timeout_s ({self.per_test_timeout_s}) must be <= total_timeout_s "
                f"({self.total_timeout_s})"
            )


@dataclass(frozen=True)
class CodeGrade:
    """One candidate's test run. `passed` only if every test passed."""

    passed: bool
    tests_passed: int
    tests_total: int
    timed_out: bool  # a test hit its timeout, or the whole run hit the total one
    error: str = ""  # the head of the first failure: which test and why
    statuses: tuple[str, ...] = ()  # per test, one of STATUSES (empty when the harness gave no report)


# The program run in the sandbox (stdlib only). `_main(payload)` is appended per candidate; the nonce
# arrives on stdin and is read after the last child is reaped, so no process running the candidate had it.
_HARNESS = r'''
import builtins, json, os, select, signal, sys, time, traceback

# Builtins are bound as defaults and names as locals before the solution runs: it may rebind them
# (builtins.exec, builtins.bool, __main__._rolerl_eq ...), which must not change the verdict.
_SEQ = (list, tuple, set, frozenset)

def _honest(x, _type=type, _str=str, _isinstance=isinstance, _id=id, _dict=dict, _seq=_SEQ,
            _plain=frozenset(map(id, (int, float, complex, str, bytes, bool, type(None))))):
    """No object in x (walked through containers) takes its __eq__ from a class the solution defined."""
    stack, budget = [x], 100000
    while stack and budget > 0:
        v, budget = stack.pop(), budget - 1
        t = _type(v)
        if _id(t) in _plain:
            continue
        for c in t.__mro__:
            if "__eq__" in c.__dict__:
                m = c.__module__
                if _type(m) is not _str or m == "__main__":
                    return False
                break
        if _isinstance(v, _dict):  # the C methods: a subclass cannot hide items from the walk
            stack.extend(_dict.keys(v)), stack.extend(_dict.values(v))
        for base in _seq:
            if _isinstance(v, base):
                stack.extend(base.__iter__(v))
                break
    return True

def _rolerl_eq(a, b, _honest=_honest):
    if a == b:
        return _honest(a) and _honest(b)
    return False

def _child(cfg, test, w):
    write, exc_text, run, eq, exit_, type_ = (
        os.write, traceback.format_exception_only, exec, _rolerl_eq, os._exit, type)
    try:
        os.setpgid(0, 0)
    except OSError:
        pass
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.closerange(3, w)
    os.closerange(w + 1, 1 << 16)
    try:
        codes = [compile(src, name, "exec", dont_inherit=True, optimize=0)
                 for name, src in (("<solution>", cfg["solution"]), ("<setup>", cfg["setup"]), ("<test>", test))]
        ns = {"__name__": "__main__", "__builtins__": builtins}
        run(codes[0], ns)
        run(codes[1], ns)
        ns["_rolerl_eq"] = eq
        run(codes[2], ns)
        msg = b"P"
    except BaseException as exc:  # SystemExit and KeyboardInterrupt too: leaving early is not passing
        try:
            text = "".join(exc_text(type_(exc), exc)).strip()[: cfg["error_chars"]]
        except BaseException:
            text = "the error could not be described"
        msg = b"F" + text.replace("\n", " | ").encode("utf-8", "replace")
    write(w, msg[:4000] + b"\n")  # only str and bytes methods from here: the solution cannot rebind them
    exit_(0)

def _read_line(r, timeout):
    data, end = b"", time.monotonic() + timeout
    while b"\n" not in data and len(data) < 4096:
        left = end - time.monotonic()
        if left <= 0 or not select.select([r], [], [], left)[0]:
            return None
        chunk = os.read(r, 4096)
        if not chunk:
            break
        data += chunk
    return data

def _one(cfg, test, timeout):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        exit_ = os._exit
        try:
            os.close(r)
            _child(cfg, test, w)
        finally:
            exit_(70)
    os.close(w)
    try:
        os.setpgid(pid, pid)
    except OSError:
        pass
    data = _read_line(r, timeout)
    os.close(r)
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    if data is None:
        return ["timeout", "timed out after %.1f s" % timeout]
    line = data.split(b"\n")[0] if b"\n" in data else b""
    if line == b"P":
        return ["pass", ""]
    if line.startswith(b"F"):
        return ["fail", line[1:].decode("utf-8", "replace")[: cfg["error_chars"]]]
    how = "exit code %d" % code if code >= 0 else "signal %d" % -code
    return ["crash", "ended (%s) before the test finished" % how]

def _main(payload):
    cfg = json.loads(payload)
    try:  # non-dumpable: the children cannot open /proc/<parent>/fd/{0,1} (stdin holds the nonce)
        import ctypes
        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE
    except Exception:
        pass
    deadline = time.monotonic() + cfg["budget_s"]
    results, stop = [], False
    for test in cfg["tests"]:
        left = deadline - time.monotonic()
        if stop or left <= 0.01:
            results.append(["skipped", "not run: " + ("an earlier test timed out" if stop else "no time left")])
            continue
        results.append(_one(cfg, test, min(cfg["per_test_s"], left)))
        stop = results[-1][0] == "timeout" and cfg["stop_on_timeout"]
    for row in [r for r in results if r[0] != "pass"][1:]:
        row[1] = ""  # the host shows the first failure only: keeps the report small for many tests
    nonce = os.read(0, 64).decode()
    sys.stdout.write(nonce + json.dumps(results) + "\n")
    sys.stdout.flush()
'''


def _strict(node: ast.expr) -> ast.expr:
    """`a == b` where the assert tests truth (itself, or under and/or/not) -> `_rolerl_eq(a, b)`; an
    `==` inside a call or comprehension is left alone (its value may be used as more than a bool)."""
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], ast.Eq):
        return ast.Call(ast.Name("_rolerl_eq", ast.Load()), [node.left, node.comparators[0]], [])
    if isinstance(node, ast.BoolOp):
        node.values = [_strict(v) for v in node.values]
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        node.operand = _strict(node.operand)
    return node


def strict_test(source: str) -> str:
    """The test with every assert's `==` checked against solution-defined `__eq__` (unchanged if the
    source does not parse: the sandbox then reports its SyntaxError)."""
    try:
        tree = ast.parse(source, _CANDIDATE)
        for node in ast.walk(tree):
            if isinstance(node, ast.Assert):
                node.test = _strict(node.test)
        return ast.unparse(ast.fix_missing_locations(tree))
    except (SyntaxError, ValueError, RecursionError):
        return source


def run_tests(
    sandbox: PythonSandbox,
    solution: str,
    tests: Sequence[str],
    setup: str = "",
    limits: GradeLimits | None = None,
) -> CodeGrade:
    """Run `solution`, then `setup`, then each test in its own process; thread-safe (one sandbox call)."""
    limits = limits or GradeLimits()
    n = len(tests)
    if not n:
        raise ValueError("run_tests needs at least one test; a candidate with none would pass vacuously")
    if (syntax := _syntax_error(solution)) is not None:  # the common broken case, without a sandbox call
        return CodeGrade(False, 0, n, False, f"solution: {syntax}"[: limits.error_chars], ("fail",) * n)
    total = limits.total_timeout_s
    payload = {
        "solution": solution,
        "setup": setup,
        "tests": [strict_test(t) for t in tests],
        "per_test_s": limits.per_test_timeout_s,
        "budget_s": total - min(1.0, 0.2 * total),  # leaves the parent time to kill, reap and report
        "stop_on_timeout": limits.stop_on_timeout,
        "error_chars": limits.error_chars,
    }
    nonce = secrets.token_hex(16)
    result = sandbox.run(f"{_HARNESS}\n_main({json.dumps(payload)!r})\n", stdin=nonce, timeout_s=total)
    return _grade_of(result, nonce, tests, limits.error_chars)


def _grade_of(result: ToolResult, nonce: str, tests: Sequence[str], error_chars: int) -> CodeGrade:
    n = len(tests)
    statuses = _report(result.stdout, nonce, n)
    if statuses is None:
        why = "timed out" if result.timed_out else f"exit code {result.exit_code}"
        error = f"the test harness gave no report ({why}): {result.stderr.strip()[:200]}"
        return CodeGrade(False, 0, n, result.timed_out, error[:error_chars])
    passed = sum(s == "pass" for s, _ in statuses)
    first = next(((i, s, d) for i, (s, d) in enumerate(statuses) if s != "pass"), None)
    error = ""
    if first is not None:
        i, status, detail = first
        test = tests[i].strip()
        label = f" `{test[:80]}`" if "\n" not in test else ""  # a one-line assert; not HumanEval's check()
        error = f"test {i + 1}/{n} ({status}){label}: {detail}"[:error_chars]
    timed_out = result.timed_out or any(s == "timeout" for s, _ in statuses)
    return CodeGrade(passed == n, passed, n, timed_out, error, tuple(s for s, _ in statuses))


def _report(stdout: str, nonce: str, n: int) -> list[tuple[str, str]] | None:
    """The harness's verdicts: the one line behind the nonce, well formed, one per test; else None."""
    lines = [line[len(nonce) :] for line in stdout.splitlines() if line.startswith(nonce)]
    if len(lines) != 1:
        return None
    try:
        rows = json.loads(lines[0])
    except ValueError:
        return None
    ok = isinstance(rows, list) and len(rows) == n
    ok = ok and all(
        isinstance(r, list) and len(r) == 2 and r[0] in STATUSES and isinstance(r[1], str) for r in rows
    )
    return [(r[0], r[1]) for r in rows] if ok else None


def _syntax_error(source: str) -> str | None:
    try:
        ast.parse(source, _CANDIDATE)
        return None
    except SyntaxError as exc:
        return f"{type(exc).__name__}: {exc.msg} (line {exc.lineno})"
    except (ValueError, RecursionError, MemoryError) as exc:  # null bytes, nesting too deep
        return f"{type(exc).__name__}: {exc}"
