"""Math answer grading: final-answer extraction and a `math-verify` grader that is safe from any thread.

`math-verify` (`parse` + `verify`) decides whether two answers are mathematically equal (`\\frac{1}{2}` =
`0.5`, `1,000` = `1000`, units and `\\text{}` dropped, sets, intervals, matrices). Its own timeout is a
`signal.alarm`, which raises off the main thread (published trainers catch that and score every answer
0) and, when turned off, leaves a pathological answer such as `9^{9^{9}}` to run for minutes. So
`MathGrader` turns it off and runs `parse` + `verify` in a small pool of worker *processes* under its own
per-answer timeout: a worker that overruns is killed and replaced (a running sympy call cannot be
cancelled any other way) and that answer is graded wrong with `timed_out=True`.

A worker is a plain subprocess running this file as a script (`runpy.run_path`), not importing
`rolerl.tasks.math_grader`: the package import would pull in `rolerl.tasks`' task registry and torch
(~1.4 s and ~170 MB per worker). So this module imports only the standard library at the top;
`math_verify` is imported inside the workers. The timeout needs `select` on pipes (Linux, macOS).

Extraction is separate and explicit: a task says where its final answer is (`final_answer(text, order)`:
`<answer>` tags, the last `\\boxed{}`, or for GSM8K-style data the last number) and grades that string.
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import json
import logging
import os
import queue
import re
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Literal

log = logging.getLogger(__name__)

AnswerSource = Literal["tag", "boxed", "number"]
ANSWER_SOURCES: tuple[AnswerSource, ...] = ("tag", "boxed", "number")

_BOX_START = re.compile(r"\\(?:boxed|fbox)\s*\{")
_BOX_BARE = re.compile(r"\\boxed\s+([^\s${}]+)")  # `\boxed 5`: LaTeX takes one token as the argument
# A number standing alone: thousands groups (`1,234`) or plain digits, an optional decimal part.
_NUMBER = re.compile(r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?![\d,]\d)")


# ---- extraction ------------------------------------------------------------------------------------------


def extract_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`, or `\\boxed 5`) in `text`, nested braces
    kept, stripped; None if there is none. A last box whose braces never close (a truncated reply) gives
    None rather than an earlier box: an earlier box is usually an intermediate result, not the answer."""
    starts = list(_BOX_START.finditer(text))
    bare = list(_BOX_BARE.finditer(text))
    if bare and (not starts or bare[-1].start() > starts[-1].start()):
        return bare[-1].group(1).strip()
    if not starts:
        return None
    depth, i = 1, starts[-1].end()
    while i < len(text):
        ch = text[i]
        if ch == "\\":  # `\{` and `\}` are literal braces (sets), not grouping
            i += 2
            continue
        depth += (ch == "{") - (ch == "}")
        if depth == 0:
            return text[starts[-1].end() : i].strip()
        i += 1
    return None


def extract_tagged(text: str, open_tag: str = "<answer>", close_tag: str = "</answer>") -> str | None:
    """The content of the last `<answer>...</answer>` in `text`, stripped; a `\\boxed{}` inside it is
    unwrapped. None if there is none or the last one is not closed."""
    end = text.rfind(close_tag)
    start = text.rfind(open_tag, 0, end) if end >= 0 else -1
    if start < 0 or text.rfind(open_tag) > end:  # none, or the last one never closes (truncated)
        return None
    body = text[start + len(open_tag) : end].strip()
    boxed = extract_boxed(body)  # `<answer>\\boxed{5}</answer>`
    return body if boxed is None else boxed


def last_number(text: str) -> str | None:
    """The last number in `text` with thousands separators removed (`1,234.5` -> `1234.5`), or None."""
    found = _NUMBER.findall(text)
    return found[-1].replace(",", "") if found else None


def final_answer(
    text: str,
    order: Sequence[AnswerSource] = ("tag", "boxed"),
    tags: tuple[str, str] = ("<answer>", "</answer>"),
) -> str | None:
    """The final answer of a completion: the first of `order`'s sources that finds a non-empty one.

    `tag` = the last answer block between `tags` (rolerl's tag convention), `boxed` = the last `\\boxed{}`,
    `number` = the last number (GSM8K-style replies; off by default because on proof-style text it grades
    whatever number came last). A trailing sentence period is dropped (`5.` would not equal `5`)."""
    bad = [s for s in order if s not in ANSWER_SOURCES]
    if bad or not order:
        raise ValueError(f"order={list(order)!r}; allowed: a non-empty sequence of {list(ANSWER_SOURCES)}")
    for source in order:
        if source == "tag":
            found = extract_tagged(text, *tags)
        else:
            found = extract_boxed(text) if source == "boxed" else last_number(text)
        found = found.strip().rstrip(".").strip() if found else None
        if found:
            return found
    return None


# ---- grading ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Grade:
    correct: bool
    timed_out: bool = False  # the worker overran the timeout and was replaced; graded wrong
    error: str | None = None  # why grading did not run normally (gold unparsable, worker died); else None


@dataclass(frozen=True)
class GraderStats:
    graded: int = 0  # answers graded, cached ones included
    correct: int = 0
    timeouts: int = 0
    errors: int = 0  # grades with an `error`
    restarts: int = 0  # workers replaced after a timeout or a crash
    cache_hits: int = 0


class MathGrader:
    """`grade(gold, answer)` with `math_verify.verify(parse(gold), parse(answer))` (gold first: `verify` is
    not symmetric) in `workers` processes, `timeout_s` per answer. Thread-safe; `grade_async` for asyncio;
    `grade_many` spreads a batch over the pool. Workers start on first use. Both arguments are final-answer
    strings (see `final_answer`), each read as the content of a `\\boxed{}`.

    Results are cached by `(gold, answer)` (a GRPO group often repeats an answer; timeouts are cached too,
    so a repeated pathological answer costs one timeout). `memory_mb` caps each worker's address-space
    growth: what one answer can allocate before its timeout (an allocation past it raises MemoryError)."""

    def __init__(
        self,
        workers: int = min(4, os.cpu_count() or 1),
        timeout_s: float = 5.0,
        *,
        startup_timeout_s: float = 120.0,
        memory_mb: int = 2048,
        cache_size: int = 65536,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers={workers}; allowed: an integer >= 1")
        if not timeout_s > 0 or not startup_timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s}, startup_timeout_s={startup_timeout_s}; allowed: > 0")
        if memory_mb < 256 or cache_size < 0:
            raise ValueError(f"memory_mb={memory_mb}, cache_size={cache_size}; allowed: >= 256 and >= 0")
        self.workers, self.timeout_s, self.startup_timeout_s = workers, timeout_s, startup_timeout_s
        self.memory_mb, self.cache_size = memory_mb, cache_size
        self._lock = threading.Lock()
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._all: list[_Worker] = []
        self._started = self._closed = False
        self._stats = GraderStats()
        self._cache: dict[tuple[str, str], Grade] = {}

    # -- public ------------------------------------------------------------------------------------------

    def grade(self, gold: str, answer: str | None) -> Grade:
        """Whether `answer` equals `gold`. An empty or missing answer is wrong without asking a worker."""
        if answer is None or not answer.strip():
            return self._record(Grade(False))
        key = (gold, answer)
        with self._lock:
            cached = self._cache.get(key)
        if cached is not None:
            return self._record(cached, cache_hit=True)
        grade = self._run(gold, answer)
        if grade.error is None and self.cache_size:
            with self._lock:
                if len(self._cache) >= self.cache_size:
                    self._cache.pop(next(iter(self._cache)))  # oldest first: dicts keep insertion order
                self._cache[key] = grade
        return self._record(grade)

    def grade_many(self, pairs: Iterable[tuple[str, str | None]]) -> list[Grade]:
        """`grade` for each `(gold, answer)`, in order, up to `workers` at a time."""
        pairs = list(pairs)
        with ThreadPoolExecutor(max_workers=max(1, min(self.workers, len(pairs)))) as pool:
            return list(pool.map(lambda p: self.grade(*p), pairs))

    async def grade_async(self, gold: str, answer: str | None) -> Grade:
        """`grade` off the event loop (it blocks on a worker)."""
        return await asyncio.to_thread(self.grade, gold, answer)

    async def grade_many_async(self, pairs: Iterable[tuple[str, str | None]]) -> list[Grade]:
        return await asyncio.to_thread(self.grade_many, pairs)

    @property
    def stats(self) -> GraderStats:
        with self._lock:
            return self._stats

    def close(self) -> None:
        """Stop the workers. Idempotent; grading afterwards raises."""
        with self._lock:
            self._closed, workers, self._all = True, self._all, []
        for w in workers:
            w.stop()

    def __enter__(self) -> MathGrader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the pool ----------------------------------------------------------------------------------------

    def _record(self, grade: Grade, cache_hit: bool = False) -> Grade:
        with self._lock:
            s = self._stats
            self._stats = replace(
                s,
                graded=s.graded + 1,
                correct=s.correct + grade.correct,
                timeouts=s.timeouts + (grade.timed_out and not cache_hit),
                errors=s.errors + (grade.error is not None),
                cache_hits=s.cache_hits + cache_hit,
            )
        return grade

    def _run(self, gold: str, answer: str) -> Grade:
        worker = self._acquire()
        try:
            if not worker.ready and (failure := self._wait_ready(worker)):
                worker = self._restart(worker)  # a later call tries a fresh one; this one says why
                raise RuntimeError(f"a math grading worker did not start: {failure}")
            reply = worker.ask(json.dumps([gold, answer]).encode() + b"\n", self.timeout_s)
            if reply is None:
                log.warning(
                    "math grader: %.1f s timeout, worker replaced; answer %.80r", self.timeout_s, answer
                )
                worker = self._restart(worker)
                return Grade(False, timed_out=True)
            correct, error = json.loads(reply)
            return Grade(bool(correct), error=error)
        except (EOFError, OSError) as e:  # the worker died (a crash in C code, killed by the OOM killer)
            worker = self._restart(worker)
            return Grade(False, error=f"grading worker died ({type(e).__name__}); it was restarted")
        finally:
            self._idle.put(worker)

    def _acquire(self) -> _Worker:
        with self._lock:
            if self._closed:
                raise RuntimeError("MathGrader is closed")
            if not self._started:
                self._started = True
                for _ in range(self.workers):
                    self._idle.put(self._start())
        return self._idle.get()

    def _start(self) -> _Worker:
        worker = _Worker.start(self.memory_mb)
        self._all.append(worker)
        return worker

    def _restart(self, worker: _Worker) -> _Worker:
        worker.stop()
        with self._lock:
            if self._closed:
                return worker  # dead; `_acquire` refuses from now on
            self._all = [w for w in self._all if w is not worker]
            self._stats = replace(self._stats, restarts=self._stats.restarts + 1)
            return self._start()

    def _wait_ready(self, worker: _Worker) -> str | None:
        """Wait for a new worker's first line; None once it is ready, else why it is not."""
        try:
            reply = worker.ask(None, self.startup_timeout_s)
        except (EOFError, OSError):
            return f"it exited with code {worker.proc.wait()} (is math-verify installed? see its stderr)"
        if reply is None:
            return f"no reply within startup_timeout_s={self.startup_timeout_s}"
        status, detail = json.loads(reply)
        worker.ready = status == "ready"
        return None if worker.ready else detail


@dataclass
class _Worker:
    """One grading process: this file run as a script (see the module docstring), one JSON line per request
    on its stdin, one per reply on its stdout. A plain subprocess, not multiprocessing: spawn and
    forkserver children re-import the parent's `__main__`, which breaks (or re-runs) unguarded scripts."""

    proc: subprocess.Popen
    ready: bool = False
    _buffer: bytes = b""

    @classmethod
    def start(cls, memory_mb: int) -> _Worker:
        # `-c` puts the working directory first on sys.path; drop it, so a stray `math.py` there is not read.
        boot = f"import runpy, sys; del sys.path[0]; runpy.run_path(sys.argv[1], run_name={_RUN_NAME!r})"
        cmd = [sys.executable, "-c", boot, __file__, str(memory_mb)]
        return cls(subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0))

    def ask(self, request: bytes | None, timeout_s: float) -> bytes | None:
        """Send `request` (if any) and read one reply line; None if none came within `timeout_s`."""
        if request is not None:
            self.proc.stdin.write(request)
        deadline = time.monotonic() + timeout_s
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise EOFError("the grading worker exited")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)
        for pipe in (self.proc.stdin, self.proc.stdout):
            pipe.close()


_default: MathGrader | None = None
_default_lock = threading.Lock()


def default_grader() -> MathGrader:
    """The process-wide shared grader (default settings), created on first use, closed at exit."""
    global _default
    with _default_lock:
        if _default is None:
            _default = MathGrader()
            atexit.register(_default.close)
        return _default


# ---- the worker process ----------------------------------------------------------------------------------

_RUN_NAME = "__rolerl_math_grader_worker__"


def _limit_memory(extra_mb: int) -> None:
    """Cap the address space at its current size + `extra_mb`, so a huge answer raises MemoryError."""
    try:
        import resource

        with open("/proc/self/statm") as f:
            current = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        resource.setrlimit(resource.RLIMIT_AS, (current + extra_mb * 2**20, resource.RLIM_INFINITY))
    except (ImportError, OSError, ValueError):
        pass  # not Linux: no cap; the timeout still applies


def _judge_factory() -> Callable[[str, str], tuple[bool, str | None]]:
    """`judge(gold, answer) -> (correct, error)`. math-verify's signal timeouts are off
    (`parsing_timeout=None`, `timeout_seconds=None`): the parent enforces its own by killing the process.
    Both sides are read as the content of a `\\boxed{}` with LaTeX extraction only: that reads plain
    numbers and fractions too, and keeps sympy's `parse_expr` (an `eval`) away from model text."""
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # it warns that its timeout is off: we know
    from math_verify import LatexExtractionConfig, parse, verify

    with_units = LatexExtractionConfig()
    norm = replace(with_units.normalization_config, units=False)
    configs = ([with_units], [LatexExtractionConfig(normalization_config=norm)])

    @functools.lru_cache(maxsize=4096)  # for golds: the same one is graded against every sample
    def read(s: str, reading: int) -> list:
        return parse("\\boxed{" + s + "}", extraction_config=configs[reading], parsing_timeout=None)

    def judge(gold: str, answer: str) -> tuple[bool, str | None]:
        if not read(gold, 0):
            return False, f"gold answer {gold!r} does not parse"
        # Two readings. math-verify's unit stripping (`5 \\text{ cm}` -> `5`) also eats a trailing
        # one-letter variable (`a + b + c` -> `a +`), and two such stubs then compare equal as strings
        # (`a + b + d` "equals" `a + b + c`). So: equal without stripping -> correct; otherwise equal with
        # it only if both sides still parsed to sympy objects there.
        if verify(read(gold, 1), read.__wrapped__(answer, 1), timeout_seconds=None):
            return True, None
        g, a = read(gold, 0), read.__wrapped__(answer, 0)
        parsed = all(any(not isinstance(x, str) for x in side) for side in (g, a))
        return parsed and bool(verify(g, a, timeout_seconds=None)), None

    return judge


def _serve(memory_mb: int) -> None:
    # Replies go to a private copy of stdout, and fd 1 becomes stderr: a stray print in a library cannot
    # corrupt the protocol.
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    _limit_memory(memory_mb)
    try:
        judge = _judge_factory()
        judge("1", "1")  # sympy and the LaTeX grammar load on first use: not on the caller's clock
    except Exception as e:
        out.write(json.dumps(["failed", f"{type(e).__name__}: {e}"]) + "\n")
        return
    out.write(json.dumps(["ready", None]) + "\n")
    for line in sys.stdin.buffer:  # ends when the parent closes the pipe or exits
        gold, answer = json.loads(line)
        try:
            reply = judge(gold, answer)
        except Exception as e:  # MemoryError included: report it and keep serving
            reply = (False, f"{type(e).__name__}: {str(e)[:200]}")
        out.write(json.dumps(reply) + "\n")


if __name__ == _RUN_NAME:  # a worker process (`_Worker.start`)
    _serve(int(sys.argv[2]))
