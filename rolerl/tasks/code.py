"""Code benchmarks graded by unit tests in the Python sandbox: HumanEval, MBPP and sanitized MBPP.

    task = code_task("humaneval")                 # ../shared/data/humaneval/HumanEval.jsonl.gz
    ex = task.examples("test", 1, seed=0)[0]
    task.grade(ex, "```python\\ndef f(x): ...\\n```")   # CodeGrade(passed=False, tests_passed=0, ...)
    task.close()                                   # the sandbox it started

One candidate is one sandbox call running `_HARNESS`: a parent that never executes the candidate forks one
child per test (each MBPP assert, or HumanEval's `check(candidate)`), which runs solution + setup + test
with stdin/stdout/stderr on /dev/null (so endless output costs nothing) and sends its verdict on a pipe.
The parent kills a child at the per-test timeout and, only after the last child is gone, reads a random
nonce from stdin and prints the per-test verdicts behind it; the sandbox's wall clock bounds the whole
run. The host counts passes from that report alone, so `exit(0)`, `os._exit(0)`, `SystemExit`, killing
the parent or printing a look-alike report all fail. The parent is non-dumpable, so a child cannot read
its stdin or write to its stdout through /proc. An `==` in a test's assert also rejects a side whose
class defines `__eq__` in the solution (the "always equal" object). What is left: code that studies this
harness and tampers with it in its own process (frames, the verdict pipe) can still forge a pass.
"""

from __future__ import annotations

import ast
import gzip
import hashlib
import json
import logging
import math
import random
import re
import textwrap
import threading
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rolerl.tasks.base import Example, Messages, default_data_dir
from rolerl.tasks.code_grading import _CANDIDATE, CodeGrade, GradeLimits, _syntax_error, run_tests
from rolerl.tools import PythonSandbox, python_tool

log = logging.getLogger(__name__)

SYSTEM = "You are an expert Python programmer. Give your solution in one ```python code block."
MBPP_SPLITS = {"prompt": (1, 10), "test": (11, 510), "validation": (511, 600), "train": (601, 974)}


# --- extracting the solution from a completion ------------------------------------------------------------
_FENCE = re.compile(r"```([^\n`]*)\n(.*?)(?:```|\Z)", re.DOTALL)
_STOPS = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\n```")  # HumanEval's stop sequences


def extract_code(text: str) -> str:
    """The last ```python block (an unclosed one at the end counts), else the last bare ``` block, else
    the whole text."""
    blocks = [(m.group(1).strip().lower(), m.group(2)) for m in _FENCE.finditer(text)]
    for langs in (("python", "py", "python3"), ("",)):
        found = [code for lang, code in blocks if lang in langs]
        if found:
            return found[-1]
    return text


def humaneval_solution(prompt: str, entry_point: str, code: str) -> str:
    """The program for a HumanEval completion: a whole function (defines `entry_point`) after the prompt,
    whose imports and helpers it may use; else a body continuing the prompt (indented if its first line is
    not; cut at the first stop sequence if it does not parse)."""
    try:
        defined = {
            n.name
            for n in ast.parse(code, _CANDIDATE).body
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
        }
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        defined = set()
    if entry_point in defined:
        return f"{prompt}\n\n{code}"
    first = next((line for line in code.splitlines() if line.strip()), "")
    body = code if first[:1] in (" ", "\t") else textwrap.indent(code, "    ")
    if _syntax_error(prompt + body) is not None:
        cut = min((i for i in (body.find(s) for s in _STOPS) if i > 0), default=len(body))
        body = body[:cut] if _syntax_error(prompt + body[:cut]) is None else body
    return prompt + body


# --- loading ----------------------------------------------------------------------------------------------
@dataclass
class CodeDataset:
    """A benchmark's examples by split, and the rows that were skipped as malformed."""

    name: str
    splits: dict[str, list[Example]]
    source: str  # the file or hub id read
    rows: int  # rows read, skipped ones included
    skipped: list[str] = field(default_factory=list)  # "task_id: why" (or "line N: why") per skipped row


def load_humaneval(data: str | Path | None = None) -> CodeDataset:
    """HumanEval (164 problems, split "test") from a .jsonl(.gz) file, a directory holding one, or a hub id
    (`openai/openai_humaneval`)."""
    rows, source = _rows(data, "humaneval/HumanEval.jsonl.gz", None)
    need = {"task_id": str, "prompt": str, "entry_point": str, "canonical_solution": str, "test": str}

    def make(r: dict[str, Any]) -> tuple[str, Example]:
        test = f"{r['test']}\n\ncheck({r['entry_point']})\n"
        meta = {"tests": (test,), "setup": "", "entry_point": r["entry_point"], "prompt": r["prompt"]}
        return "test", Example(r["task_id"], r["prompt"], r["canonical_solution"], meta)

    return _build("humaneval", rows, source, need, make)


def load_mbpp(data: str | Path | None = None, *, sanitized: bool = False) -> CodeDataset:
    """MBPP (974 rows) or sanitized MBPP (427), split by task id as upstream: 1-10 prompt, 11-510 test,
    511-600 validation, 601-974 train. Each assert of `test_list` is one test. Hub id:
    `google-research-datasets/mbpp` (config "full" or "sanitized", chosen by `sanitized`)."""
    name = "mbpp_sanitized" if sanitized else "mbpp"
    default = "mbpp/sanitized-mbpp.json" if sanitized else "mbpp/mbpp.jsonl"
    rows, source = _rows(data, default, "sanitized" if sanitized else "full")
    text, setup = ("prompt", "test_imports") if sanitized else ("text", "test_setup_code")
    need = {"task_id": int, text: str, "code": str, "test_list": list, setup: (list if sanitized else str)}

    def make(r: dict[str, Any]) -> tuple[str, Example]:
        split = next((s for s, (lo, hi) in MBPP_SPLITS.items() if lo <= r["task_id"] <= hi), None)
        if split is None or not r["test_list"] or not all(isinstance(t, str) for t in r["test_list"]):
            raise ValueError(
                "task_id outside 1-974" if split is None else "test_list is not a list of strings"
            )
        pre = "\n".join(r[setup]) if sanitized else r[setup]
        meta = {"tests": tuple(r["test_list"]), "setup": pre, "entry_point": None, "prompt": r[text]}
        return split, Example(f"{name}/{r['task_id']}", r[text], r["code"], meta)

    return _build(name, rows, source, need, make)


def _rows(data: str | Path | None, default: str, config: str | None) -> tuple[list[Any], str]:
    """The rows of a local file (`data` a file, a directory holding `default`'s file, the data root, or
    None for the default data directory), else of the hub dataset `data` (with `config`)."""
    path = default_data_dir() / default if data is None else Path(data)
    if path.is_dir():
        path = path / Path(default).name if (path / Path(default).name).is_file() else path / default
    if path.is_file():
        opener: Callable[..., Any] = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8") as f:
            if path.name.removesuffix(".gz").endswith(".json"):
                try:
                    return json.load(f), str(path)
                except ValueError as exc:
                    raise ValueError(f"{path}: not a JSON file ({exc})") from None
            return [_json_line(line, i + 1) for i, line in enumerate(f) if line.strip()], str(path)
    if data is None or path.suffix in (".json", ".jsonl", ".gz") or str(data).startswith((".", "/", "~")):
        hint = "; set ROLERL_SHARED_DATA to the data directory" if data is None else ""
        raise FileNotFoundError(
            f"benchmark file {path} not found (expected {default} under the data directory{hint})"
        )
    return _hub_rows(str(data), config), str(data)


def _json_line(line: str, number: int) -> Any:
    try:
        return json.loads(line)
    except ValueError:
        return (f"line {number}",)  # JSON never gives a tuple: `_build` reports it


def _hub_rows(dataset_id: str, config: str | None) -> list[dict[str, Any]]:
    """Every split of a Hugging Face dataset, concatenated (the task re-splits by its own rule)."""
    try:
        import datasets
    except ImportError:
        raise ImportError(
            f"loading {dataset_id!r} from the Hugging Face Hub needs `datasets`: pip install 'rolerl[hub]' "
            "(or pass a local file)"
        ) from None
    try:
        loaded = datasets.load_dataset(dataset_id, config)
    except Exception as exc:  # offline, unknown id, wrong config: all the same to the caller
        raise RuntimeError(
            f"could not load {dataset_id!r} (config {config!r}) from the Hugging Face Hub: {exc}. "
            "Offline? Pass a local file or directory instead."
        ) from exc
    return [dict(row) for split in loaded.values() for row in split]


def _build(
    name: str,
    rows: Iterable[Any],
    source: str,
    need: dict[str, Any],
    make: Callable[[dict[str, Any]], tuple[str, Example]],
) -> CodeDataset:
    ds = CodeDataset(name, {}, source, 0)
    for i, row in enumerate(rows):
        ds.rows += 1
        where = row[0] if isinstance(row, tuple) else f"row {i + 1}"  # a tuple: a line that is not JSON
        try:
            if not isinstance(row, dict):
                raise ValueError("not JSON" if isinstance(row, tuple) else "not an object")
            where = str(row.get("task_id", where))
            if missing := [k for k, t in need.items() if not isinstance(row.get(k), t)]:
                raise ValueError(f"missing or mistyped field(s) {missing}")
            split, example = make(row)
        except ValueError as exc:
            ds.skipped.append(f"{where}: {exc}")
            continue
        ds.splits.setdefault(split, []).append(example)
    if ds.skipped:
        log.warning(
            "%s: skipped %d malformed row(s) of %s, first: %s", name, len(ds.skipped), source, ds.skipped[:3]
        )
    return ds


# --- the task ---------------------------------------------------------------------------------------------
class CodeTask:
    """A code benchmark as a `Task`: reward 1.0 iff the completion's code passes every test in the sandbox.

    Give a `sandbox` to share one (it is left open), or let the task start its own on the first grade
    (closed by `close()`). Grades are cached by (example id, code), so `reward`, `check` and `scores` on
    the same completion run the tests once. Thread-safe."""

    def __init__(
        self, dataset: CodeDataset, *, sandbox: PythonSandbox | None = None, limits: GradeLimits | None = None
    ) -> None:
        self.dataset, self.name = dataset, dataset.name
        self.limits = limits or GradeLimits()
        self._sandbox, self._owned, self._closed = sandbox, sandbox is None, False
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], CodeGrade] = OrderedDict()

    @property
    def skipped(self) -> list[str]:
        return self.dataset.skipped

    def size(self, split: str) -> int:
        return len(self._split(split))

    def examples(self, split: str, n: int, seed: int) -> list[Example]:
        rows = self._split(split)
        if not 0 <= n <= len(rows):
            raise ValueError(f"{self.name} {split!r} has {len(rows)} examples; asked for n={n}")
        order = list(range(len(rows)))
        random.Random(zlib.crc32(f"{self.name}/{split}/{seed}".encode())).shuffle(order)
        return [rows[i] for i in order[:n]]

    def prompt(self, example: Example) -> Messages:
        if example.meta["entry_point"]:  # HumanEval: the signature and docstring to complete
            user = (
                "Complete this Python function. Reply with the whole function, including the imports it "
                f"needs, in a ```python code block.\n\n```python\n{example.meta['prompt']}```"
            )
        else:  # MBPP: the problem and one of its tests, which names the function and shows its use
            test = "\n".join(filter(None, (example.meta["setup"], example.meta["tests"][0])))
            user = (
                f"{example.question}\nYour code should pass this test:\n\n{test}\n\nReply with the code in a "
                "```python code block."
            )
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]

    def solution(self, example: Example, text: str) -> str:
        """The program graded for a completion `text`."""
        code = extract_code(text)
        if example.meta["entry_point"]:
            return humaneval_solution(example.meta["prompt"], example.meta["entry_point"], code)
        return code

    def grade(self, example: Example, text: str) -> CodeGrade:
        program = self.solution(example, text)
        key = (example.id, hashlib.sha256(program.encode("utf-8", "replace")).hexdigest())
        with self._lock:
            if self._closed:
                raise RuntimeError(f"task {self.name!r} is closed")
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        grade = run_tests(
            self._sandbox_now(), program, example.meta["tests"], example.meta["setup"], self.limits
        )
        with self._lock:
            self._cache[key] = grade
            while len(self._cache) > 4096:
                self._cache.popitem(last=False)
        return grade

    def check(self, example: Example, text: str) -> bool:
        return self.grade(example, text).passed

    def reward(self, example: Example, text: str) -> float:
        return 1.0 if self.check(example, text) else 0.0

    def scores(self, example: Example, text: str) -> dict[str, float]:
        """Per-sample numbers for evaluation: the fraction of tests passed."""
        grade = self.grade(example, text)
        return {"tests_passed_frac": grade.tests_passed / grade.tests_total}

    def close(self) -> None:
        """Close the sandbox if this task started it; later grades raise."""
        with self._lock:
            self._closed = True
            sandbox, self._sandbox = self._sandbox, None
        if sandbox is not None and self._owned:
            sandbox.close()

    def __enter__(self) -> CodeTask:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _split(self, split: str) -> list[Example]:
        if split not in self.dataset.splits:
            raise ValueError(f"{self.name} has no split {split!r}; allowed: {sorted(self.dataset.splits)}")
        return self.dataset.splits[split]

    def _sandbox_now(self) -> PythonSandbox:
        with self._lock:
            if self._closed:
                raise RuntimeError(f"task {self.name!r} is closed")
            if self._sandbox is None:  # started on first use: building a task must not need root
                total = self.limits.total_timeout_s  # python_tool: the CLI's privilege choice applies
                self._sandbox = python_tool(timeout_s=total, cpu_s=max(10, math.ceil(total)))
            return self._sandbox


BENCHMARKS = ("humaneval", "mbpp", "mbpp_sanitized")


def code_task(name: str, data: str | None = None) -> CodeTask:
    """The benchmark `name` read from `data` (a file, a directory, a hub id; None: the default data dir)."""
    if name not in BENCHMARKS:
        raise ValueError(f"unknown code benchmark {name!r}; allowed: {BENCHMARKS}")
    return CodeTask(
        load_humaneval(data) if name == "humaneval" else load_mbpp(data, sanitized=name != "mbpp")
    )
