"""Code benchmarks: the loaders on the real files (row counts, splits, malformed rows), code extraction,
reference solutions passing in the sandbox, and candidates that are wrong, hang, flood output or try to
fake a pass, each failing promptly with the reason. Grading needs root (as the sandbox does; CI runs as
root); the loader and extraction tests do not."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import types
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from rolerl.tasks import Task, code_grading
from rolerl.tasks.code import (
    CodeDataset,
    CodeTask,
    code_task,
    extract_code,
    humaneval_solution,
    load_humaneval,
    load_mbpp,
)
from rolerl.tasks.code_grading import GradeLimits, run_tests, strict_test
from rolerl.tools import PythonSandbox
from tests.tools.helpers import make_sandbox

ADD_TESTS = ("assert add(1, 2) == 3", "assert add(2, 2) == 4", "assert add(0, 0) == 0")
FAST = GradeLimits(per_test_timeout_s=0.5, total_timeout_s=5.0)
ROOMY = GradeLimits(per_test_timeout_s=10.0, total_timeout_s=40.0)  # references on a busy machine


@pytest.fixture(scope="module")
def sandbox() -> Iterator[PythonSandbox]:
    if os.geteuid() != 0:  # the sandbox drops root to a dedicated uid and refuses to start without root
        pytest.skip("grading runs in the Python sandbox, which needs root (CI runs as root)")
    sb = make_sandbox("full", 65200, pool_size=2)
    yield sb
    sb.close()


@pytest.fixture(scope="module")
def data(shared_data: Path) -> dict[str, CodeDataset]:
    root = shared_data
    return {
        "humaneval": load_humaneval(root / "humaneval" / "HumanEval.jsonl.gz"),
        "mbpp": load_mbpp(root / "mbpp" / "mbpp.jsonl"),
        "mbpp_sanitized": load_mbpp(root / "mbpp" / "sanitized-mbpp.json", sanitized=True),
    }


def grade_add(sandbox: PythonSandbox, solution: str, limits: GradeLimits = FAST):
    return run_tests(sandbox, solution, ADD_TESTS, "", limits)


# --- loading --------------------------------------------------------------------------------------------
def test_row_counts_and_splits(data, shared_data):
    counts = {
        name: (ds.rows, {k: len(v) for k, v in ds.splits.items()}, ds.skipped) for name, ds in data.items()
    }
    assert counts["humaneval"] == (164, {"test": 164}, [])
    assert counts["mbpp"] == (974, {"prompt": 10, "test": 500, "validation": 90, "train": 374}, [])
    assert counts["mbpp_sanitized"] == (427, {"prompt": 7, "test": 257, "validation": 43, "train": 120}, [])
    test_ids = {int(e.id.split("/")[1]) for e in data["mbpp"].splits["test"]}
    assert test_ids == set(range(11, 511))
    # a directory (the benchmark's or the data root) finds the file too
    assert (load_humaneval(shared_data / "humaneval").rows, load_mbpp(shared_data).rows) == (164, 974)


def test_malformed_rows_are_reported_and_skipped(tmp_path, caplog):
    good = {
        "text": "t",
        "code": "c",
        "test_setup_code": "",
        "test_list": ["assert 1"],
        "challenge_test_list": [],
    }
    lines = [
        json.dumps({**good, "task_id": 11}),
        json.dumps({k: v for k, v in good.items() if k != "code"} | {"task_id": 12}),  # no code
        "{not json",
        json.dumps({**good, "task_id": 13, "test_list": "assert 1"}),  # a string, not a list
        json.dumps({**good, "task_id": 2000}),  # outside every split
        json.dumps({**good, "task_id": 601}),
    ]
    path = tmp_path / "mbpp.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with caplog.at_level(logging.WARNING, logger="rolerl.tasks.code"):
        ds = load_mbpp(path)
    assert ds.rows == 6 and {k: [e.id for e in v] for k, v in ds.splits.items()} == {
        "test": ["mbpp/11"],
        "train": ["mbpp/601"],
    }
    assert [s.split(":")[0] for s in ds.skipped] == ["12", "line 3", "13", "2000"]
    assert "'code'" in ds.skipped[0] and "outside 1-974" in ds.skipped[3]
    assert "skipped 4 malformed row(s)" in caplog.text and "12: missing" in caplog.text
    assert CodeTask(ds).skipped == ds.skipped


def test_missing_file_and_hub_errors_are_clear(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="HumanEval.jsonl.gz"):
        load_humaneval(tmp_path)
    monkeypatch.setenv("ROLERL_SHARED_DATA", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="mbpp/sanitized-mbpp.json .*set ROLERL_SHARED_DATA"):
        code_task("mbpp_sanitized")
    with pytest.raises(
        ValueError, match=r"unknown code benchmark 'apps'; allowed: \('humaneval', 'mbpp', 'mbpp_sanitized'\)"
    ):
        code_task("apps")
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed
    with pytest.raises(ImportError, match=r"rolerl\[hub\]"):
        load_humaneval("openai/openai_humaneval")

    def offline(*args, **kwargs):
        raise ConnectionError("no network")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=offline))
    with pytest.raises(RuntimeError, match="Offline"):
        load_mbpp("google-research-datasets/mbpp", sanitized=True)


def test_hub_rows_are_resplit_by_task_id(monkeypatch):
    row = {"task_id": 7, "prompt": "p", "code": "c", "test_imports": [], "test_list": ["assert 1"]}
    splits = {"train": [row | {"task_id": 700}], "test": [row | {"task_id": 20}], "prompt": [row]}
    calls = []

    def load_dataset(dataset_id, config):
        calls.append((dataset_id, config))
        return splits

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    ds = load_mbpp("google-research-datasets/mbpp", sanitized=True)
    assert calls == [("google-research-datasets/mbpp", "sanitized")]
    assert {k: [e.id for e in v] for k, v in ds.splits.items()} == {
        "train": ["mbpp_sanitized/700"],
        "test": ["mbpp_sanitized/20"],
        "prompt": ["mbpp_sanitized/7"],
    }


def test_examples_are_deterministic_and_checked(data):
    task = CodeTask(data["mbpp"])
    assert isinstance(task, Task) and task.size("test") == 500
    a = task.examples("test", 50, seed=3)
    assert a == task.examples("test", 50, seed=3) and task.examples("test", 10, seed=3) == a[:10]
    assert a != task.examples("test", 50, seed=4) and len({e.id for e in a}) == 50
    assert {e.id for e in task.examples("test", 500, 0)} == {e.id for e in data["mbpp"].splits["test"]}
    with pytest.raises(
        ValueError, match=r"no split 'dev'; allowed: \['prompt', 'test', 'train', 'validation'\]"
    ):
        task.examples("dev", 1, 0)
    with pytest.raises(ValueError, match="has 164 examples; asked for n=165"):
        CodeTask(data["humaneval"]).examples("test", 165, 0)


def test_prompts(data):
    he, mb = data["humaneval"].splits["test"][0], data["mbpp"].splits["test"][0]
    system, user = CodeTask(data["humaneval"]).prompt(he)
    assert system["role"] == "system" and "```python" in system["content"]
    assert f"```python\n{he.meta['prompt']}```" in user["content"] and "whole function" in user["content"]
    user = CodeTask(data["mbpp"]).prompt(mb)[1]["content"]
    assert mb.question in user and mb.meta["tests"][0] in user and mb.meta["tests"][1] not in user


# --- extraction -----------------------------------------------------------------------------------------
def test_extract_code():
    assert extract_code("a\n```python\nx = 1\n```\nb\n```python\ny = 2\n```\nc") == "y = 2\n"
    assert extract_code("```python\nx = 1\n```\n```\nplain\n```") == "x = 1\n", "python beats bare"
    assert extract_code("```bash\nls\n```\n```\nz = 3\n```") == "z = 3\n", "other languages are not code"
    assert extract_code("```py\nx = 1\n```\n```python\ny = 2") == "y = 2", "an unclosed block at the end"
    assert extract_code("    return x + 1\n") == "    return x + 1\n", "no fence: the whole text"


def test_humaneval_solution_accepts_a_function_or_a_body():
    prompt = 'import math\n\n\ndef f(x):\n    """Doc."""\n'
    full = "def f(x):\n    return math.sqrt(x)\n"
    assert humaneval_solution(prompt, "f", full) == prompt + "\n\n" + full
    assert humaneval_solution(prompt, "f", "    return x\n") == prompt + "    return x\n"
    assert humaneval_solution(prompt, "f", "return x\n") == prompt + "    return x\n", "a dedented body"
    assert humaneval_solution(prompt, "f", "    return x\n\nprint(f(2)) oops") == prompt + "    return x\n"


def test_strict_test_rewrites_the_equalities_an_assert_tests():
    src = "def check(c):\n    assert c(1) == 2, 'm'\n    y = c(1) == 2\n    assert not a == 1 or (b == 2 and c != 3)"
    out = strict_test(src)
    assert "assert _rolerl_eq(c(1), 2), 'm'" in out and "y = c(1) == 2" in out
    assert "assert not _rolerl_eq(a, 1) or (_rolerl_eq(b, 2) and c != 3)" in out
    for kept in ("assert a == b == c", "assert all((x == 1 for x in xs))", "assert (f(x) == y).all()"):
        assert strict_test(kept) == kept, "chained, or inside a call: left alone"
    assert strict_test("assert (") == "assert (", "unparsable: the sandbox reports it"


# --- references pass --------------------------------------------------------------------------------------
def test_humaneval_references_pass_sample(sandbox, data):
    task = CodeTask(data["humaneval"], sandbox=sandbox, limits=ROOMY)
    sample = task.examples("test", 40, seed=0)
    as_body = [task.grade(e, e.answer) for e in sample[:20]]  # the canonical body continues the prompt
    as_block = [
        task.grade(e, f"Here:\n```python\n{e.meta['prompt']}{e.answer}```\nDone.") for e in sample[20:]
    ]
    assert all(g.passed and (g.tests_passed, g.tests_total) == (1, 1) for g in as_body + as_block)
    assert task.reward(sample[0], sample[0].answer) == 1.0 and task.check(sample[0], sample[0].answer)
    assert task.scores(sample[0], "    return None\n") == {"tests_passed_frac": 0.0}


def test_mbpp_references_pass_sample(sandbox, data):
    for name in ("mbpp", "mbpp_sanitized"):
        task = CodeTask(data[name], sandbox=sandbox, limits=ROOMY)
        grades = [task.grade(e, f"```python\n{e.answer}\n```") for e in task.examples("test", 15, seed=1)]
        assert [(g.passed, g.tests_passed, g.tests_total) for g in grades] == [(True, 3, 3)] * 15


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:invalid escape sequence")  # MBPP's regexes; silenced outside pytest
def test_all_references_pass(sandbox, data):
    """All 164 HumanEval, 500 MBPP test and 257 sanitized test references (mbpp/123's second test takes
    ~3 s on a busy 2-core machine, hence the roomy per-test timeout)."""
    for name, split in (("humaneval", "test"), ("mbpp", "test"), ("mbpp_sanitized", "test")):
        task = CodeTask(data[name], sandbox=sandbox, limits=ROOMY)
        examples = data[name].splits[split]
        with ThreadPoolExecutor(2) as pool:
            grades = list(pool.map(task.grade, examples, [e.answer for e in examples]))
        assert [e.id for e, g in zip(examples, grades, strict=True) if not g.passed] == [], name


# --- broken and cheating candidates fail ----------------------------------------------------------------
def test_wrong_answer_counts_the_tests_that_pass(sandbox):
    g = grade_add(sandbox, "def add(a, b):\n    return a - b\n")  # right only for add(0, 0)
    assert (g.passed, g.tests_passed, g.tests_total, g.timed_out) == (False, 1, 3, False)
    assert g.statuses == ("fail", "fail", "pass")
    assert g.error.startswith("test 1/3 (fail) `assert add(1, 2) == 3`: AssertionError")
    assert grade_add(sandbox, "def add(a, b):\n    return a + b\n").statuses == ("pass",) * 3


def test_syntax_and_name_errors_fail(sandbox):
    g = grade_add(sandbox, "def add(a, b) return a + b")  # caught before the sandbox
    assert (g.passed, g.tests_passed) == (False, 0) and g.error.startswith("solution: SyntaxError")
    g = grade_add(sandbox, "return 3")  # parses, but only the compiler refuses it
    assert g.statuses == ("fail",) * 3 and "'return' outside function" in g.error
    g = grade_add(sandbox, "def plus(a, b):\n    return a + b\n")
    assert g.statuses == ("fail",) * 3 and "NameError: name 'add' is not defined" in g.error


@pytest.mark.parametrize(
    "solution",
    ["def add(a, b):\n    while True:\n        pass\n", "while True:\n    pass\n"],
    ids=["in_the_function", "at_import"],
)
def test_infinite_loop_times_out_per_test_and_returns_promptly(sandbox, solution):
    t0 = time.monotonic()
    g = grade_add(sandbox, solution)
    assert time.monotonic() - t0 < 2.5  # one 0.5 s timeout, then the rest skipped
    assert (g.passed, g.timed_out, g.statuses) == (False, True, ("timeout", "skipped", "skipped"))
    assert "timed out after 0.5 s" in g.error
    t0 = time.monotonic()
    g = grade_add(sandbox, solution, GradeLimits(0.5, 5.0, stop_on_timeout=False))
    assert g.statuses == ("timeout",) * 3 and time.monotonic() - t0 < 4.0


def test_total_timeout_bounds_the_run(sandbox):
    """Budget 1.5 s, of which the harness gives the tests 1.2 s: test 1 uses 1 s, test 2 what is left (or
    is skipped), test 3 is skipped, and the report still comes back."""
    t0 = time.monotonic()
    g = grade_add(sandbox, "def add(a, b):\n    while True:\n        pass\n", GradeLimits(1.0, 1.5, False))
    assert time.monotonic() - t0 < 3.0 and (g.passed, g.timed_out) == (False, True)
    assert g.statuses[0] == "timeout" and g.statuses[2] == "skipped"


@pytest.mark.parametrize(
    "solution",
    [
        "while True:\n    print('x' * 1000)\n",
        "import os, sys\nwhile True:\n    os.write(1, b'x' * 65536)\n    sys.stderr.write('y' * 65536)\n",
        "def add(a, b):\n    while True:\n        print('x')\n",
    ],
    ids=["print", "os_write_both_streams", "in_the_function"],
)
def test_infinite_output_fails_cleanly(sandbox, solution):
    t0 = time.monotonic()
    g = grade_add(sandbox, solution)
    assert time.monotonic() - t0 < 2.5
    assert (g.passed, g.tests_passed, g.timed_out, g.statuses[0]) == (False, 0, True, "timeout")


WRONG = "def add(a, b):\n    return -1\n"  # fails all three
MUL = "def add(a, b):\n    return a * b\n"  # right for add(2, 2) and add(0, 0) only


@pytest.mark.parametrize(
    ("cheat", "status"),
    [
        ("exit(0)", "fail"),
        ("import sys; sys.exit(0)", "fail"),
        ("raise SystemExit(0)", "fail"),
        ("raise KeyboardInterrupt", "fail"),
        ("import os; os._exit(0)", "crash"),
        ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", "crash"),
    ],
)
def test_leaving_early_is_not_passing(sandbox, cheat, status):
    g = grade_add(sandbox, f"{WRONG}{cheat}\n")
    assert (g.passed, g.tests_passed, g.statuses) == (False, 0, (status,) * 3)


def test_killing_the_harness_gives_no_report(sandbox):
    g = grade_add(sandbox, f"{WRONG}import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n")
    assert (g.passed, g.tests_passed, g.statuses) == (False, 0, ()) and "no report" in g.error


def test_printing_a_report_is_not_passing(sandbox, monkeypatch):
    """A look-alike report on stdout (it goes to /dev/null), and one written to the parent's stdout through
    /proc with the nonce read from the parent's stdin: the parent is non-dumpable, so /proc/<parent> is
    closed to its children and the nonce never reaches the solution (its error text would show it)."""
    monkeypatch.setattr(code_grading.secrets, "token_hex", lambda n: "feedface" * 4)
    forge = (
        "import json, os, sys\n"
        "fake = json.dumps([['pass', '']] * 3)\n"
        "print('feedface' * 4 + fake); print(sys.stdin.read() + fake)\n"
        "seen = []\n"
        "for fd, mode in (('0', 'r'), ('1', 'w')):\n"
        "    try:\n"
        "        with open(f'/proc/{os.getppid()}/fd/{fd}', mode) as f:\n"
        "            seen.append(f.read() if mode == 'r' else f.write('feedface' * 4 + fake + '\\n'))\n"
        "    except OSError as e:\n"
        "        seen.append(type(e).__name__)\n"
        "raise RuntimeError(seen)\n"
    )
    g = grade_add(sandbox, WRONG + forge)
    assert (g.passed, g.tests_passed, g.statuses) == (False, 0, ("fail",) * 3)
    assert "RuntimeError: [" in g.error and "feedface" not in g.error


@pytest.mark.parametrize(
    "cheat",
    [
        # the harness's own reporting helpers, replaced before the tests run
        'import json, os, traceback\njson.dumps = lambda *a, **k: \'["pass", ""]\'\n'
        "traceback.format_exception_only = lambda *a: ['ok']\nos.write = lambda fd, b: len(b)\n",
        "_rolerl_eq = lambda a, b: True\n",
        "import builtins\nbuiltins.AssertionError = type('Quiet', (Exception,), {})\n",
        "import builtins\nbuiltins.exec = lambda *a, **k: None\nbuiltins.compile = lambda *a, **k: None\n",
        "import builtins\nbuiltins.bool = builtins.isinstance = lambda *a: True\nbuiltins.type = lambda x: int\n",
        "import __main__, os\n__main__._rolerl_eq = __main__._honest = lambda *a: True\nos._exit = print\n",
    ],
    ids=["reporting_helpers", "eq_helper", "assertion_error", "exec", "bool_type", "harness_globals"],
)
def test_monkeypatching_the_harness_is_not_passing(sandbox, cheat):
    g = grade_add(sandbox, MUL + cheat)
    assert g.statuses == ("fail", "pass", "pass"), g  # the honest verdicts still come through


@pytest.mark.parametrize(
    "solution",
    [
        "class Eq:\n    def __eq__(self, other):\n        return True\n\ndef add(a, b):\n    return Eq()\n",
        "class T(tuple):\n    def __eq__(self, other):\n        return True\n\ndef add(a, b):\n    return T()\n",
        "class I(int):\n    __eq__ = lambda self, other: True\n\ndef add(a, b):\n    return I(0)\n",
    ],
    ids=["object", "tuple_subclass", "int_subclass"],
)
def test_always_equal_objects_fail(sandbox, solution):
    g = grade_add(sandbox, solution)
    assert (g.passed, g.tests_passed) == (False, 0)


def test_always_equal_inside_a_container_fails(sandbox):
    """`[I(1), I(5)] == [1, 2]` is True (list equality asks the elements): the check walks containers."""
    fake = "class I(int):\n    def __eq__(self, other):\n        return True\n\ndef f():\n    return [I(1), {0: I(5)}]\n"
    assert not run_tests(sandbox, fake, ["assert f() == [1, {0: 2}]"], "", FAST).passed
    assert run_tests(
        sandbox, "def f():\n    return [1, {0: 2}]\n", ["assert f() == [1, {0: 2}]"], "", FAST
    ).passed


def test_humaneval_cheats_fail(sandbox, data):
    task = CodeTask(data["humaneval"], sandbox=sandbox, limits=FAST)
    ex = data["humaneval"].splits["test"][0]
    for text in [
        "```python\ndef has_close_elements(numbers, threshold):\n    return True\n\n\n"
        "def check(candidate):\n    pass\n```",  # the test defines check() after the solution
        "```python\nimport sys\nsys.exit(0)\n```",
        "    return True\n",  # wrong for half the asserts
    ]:
        g = task.grade(ex, text)
        assert (g.passed, g.tests_total, task.reward(ex, text)) == (False, 1, 0.0), text


def test_grading_from_threads_matches_serial(sandbox):
    solutions = [
        "def add(a, b):\n    return a + b\n",
        "def add(a, b):\n    return a - b\n",
        "def add(a, b):\n    return a * b\n",  # right for (2, 2) and (0, 0)
        "import os\nos._exit(0)\n",
    ]
    expected = [3, 1, 2, 0]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda s: grade_add(sandbox, s, ROOMY).tests_passed, solutions * 3))
    assert got == expected * 3


def test_task_owns_its_sandbox_and_caches_grades(sandbox, data, monkeypatch):
    ex = data["mbpp"].splits["test"][0]
    with CodeTask(data["mbpp"], limits=ROOMY) as task:
        assert task._sandbox is None, "nothing started before the first grade"
        assert task.reward(ex, ex.answer) == 1.0
        own = task._sandbox
        calls = []
        monkeypatch.setattr(own, "run", lambda *a, **k: calls.append(a) or pytest.fail("not cached"))
        assert task.check(ex, f"```python\n{ex.answer}```") and calls == []
        monkeypatch.undo()
    assert own._closed
    with pytest.raises(RuntimeError, match="is closed"):
        task.grade(ex, ex.answer)
    shared = CodeTask(data["mbpp"], sandbox=sandbox)
    shared.close()
    assert not sandbox._closed, "a given sandbox is left open"


def test_limits_are_validated():
    with pytest.raises(ValueError, match="GradeLimits.per_test_timeout_s must be > 0"):
        GradeLimits(per_test_timeout_s=0)
    with pytest.raises(ValueError, match=r"per_test_timeout_s \(5\) must be <= total_timeout_s \(2\)"):
        GradeLimits(per_test_timeout_s=5, total_timeout_s=2)
