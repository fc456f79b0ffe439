"""Tool-integrated demonstrations from GSM8K's own training solutions, for `rolerl sft` (`rolerl demos`).

GSM8K's solutions mark each computation with a calculator annotation, `48/2 = <<48/2=24>>24`. Each
annotation becomes one Python call, `print(48/2)`, run in the real sandbox at the point of the solution
where the computation happens; its output is spliced in exactly as the engine splices it, and the
solution's own text (the reasoning) goes on from there:

    Natalia sold 48/2 =
    <code>
    print(48/2)
    </code>
    <output>
    24.0
    </output>
    24 clips in May.
    ...
    The answer is <answer>72</answer>.

One call per annotation, not one program per solution: it is GSM8K's own calculator format (the
reasoning stays in words, every arithmetic step goes to the tool at the point of use, and each call's
output is checked against its annotation), it needs no guess at which numbers of a later annotation are
earlier results (a whole-solution program would have to turn them into variables), and it gives MSARL's
split its natural unit: v1 rewards the code agent for matching *intermediate* ground truth, one result
per request. The price is the number of calls: 1 to 9 per solution (median 3), so a recipe sets
`rollout.max_tool_calls` (TIR) or `max_tool_requests` (MSARL) to cover them, or `max_calls` drops the
longer solutions.

Formats (`FORMATS`):
- `tir`: one `policy` row per solution for the `tir` workflow, its prompt `MathTask.tool_prompt`.
- `msarl`: for the `reasoner_tools` workflow, one `reasoner` row per solution (each annotation is a
  `<request>compute EXPR</request>` answered by a user message `Result: OUTPUT`, as the workflow
  replies) and one `coder` row per request (the workflow's coder prompt, then the call and its output).

Every demonstration is checked before it is kept: each call's code must run in the sandbox, its printed
value must equal the annotation's result, and the final answer (the last annotation's result) must equal
the gold answer under the task's grader. A dropped row is counted by its reason (`REASONS`). Only the
train split is ever read: the builder refuses any other.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from rolerl.roles import Tags
from rolerl.tasks.base import Example
from rolerl.tasks.math import MathTask
from rolerl.tasks.synthetic import answer_text, tool_call_text, write_jsonl
from rolerl.tools.base import ToolResult
from rolerl.workflows.reasoner_tools import CODER_SYSTEM, REASONER_SYSTEM, REASONER_TAGS

Format = Literal["tir", "msarl"]
FORMATS: tuple[Format, ...] = ("tir", "msarl")
SPLIT = "train"  # the only split demonstrations may come from
# Why a row is dropped, in the order the checks run.
REASONS: tuple[str, ...] = (
    "unreadable_row",  # the loader skipped it (no `#### <number>`, not JSON ...)
    "no_annotation",  # the solution has no <<expr=result>>
    "annotation_unreadable",  # an annotation's result is not a number
    "too_many_calls",  # more annotations than `max_calls`
    "code_error",  # an annotation's expression does not run (exit status, timeout)
    "output_differs",  # the printed value is not the annotation's result
    "answer_differs",  # the last computed result is not the gold answer (the task's grader)
)
_ANNOTATION = re.compile(r"<<([^<>=]*)=([^<>]*)>>")
# equal printed and written results: the same number up to float rounding (a float's repr has ~16 digits)
_REL_TOL = 1e-9


class Runner(Protocol):
    def run(self, args: str) -> ToolResult: ...


@dataclass(frozen=True)
class Step:
    """One annotation: the text before it (since the last one), its code and the sandbox's output."""

    before: str
    expr: str
    written: str  # the annotation's result as written, e.g. "24"
    output: str  # what the engine splices: `ToolResult.text()`

    @property
    def code(self) -> str:
        return f"print({self.expr.strip()})"


@dataclass(frozen=True)
class Solution:
    """A checked solution: its steps and the text after the last one (the final answer line removed)."""

    example: Example
    steps: tuple[Step, ...]
    tail: str

    @property
    def answer(self) -> str:
        return _number(self.steps[-1].written)


@dataclass
class Report:
    """What a build kept and dropped; `dropped` by reason (`REASONS`)."""

    rows: int = 0
    kept: int = 0
    calls: int = 0  # tool calls in the kept demonstrations
    dropped: Counter[str] = field(default_factory=Counter)
    first: dict[str, str] = field(default_factory=dict)  # reason -> the first example id dropped for it

    def summary(self) -> dict[str, Any]:
        return {"rows": self.rows, "kept": self.kept, "calls": self.calls,
                "dropped": {r: self.dropped[r] for r in REASONS if self.dropped[r]}}  # fmt: skip


class Dropped(ValueError):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _number(text: str) -> str:
    """A written result as a plain number string: `$1,200` -> `1200`, `24.00` -> `24.00`."""
    return text.strip().lstrip("$").replace(",", "").rstrip(".")


def _value(text: str) -> float | None:
    try:
        value = float(_number(text))
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def parse(solution: str) -> tuple[list[tuple[str, str, str]], str]:
    """`([(text before, expr, written result), ...], tail)` of a GSM8K solution (without `#### N`)."""
    out, pos = [], 0
    for m in _ANNOTATION.finditer(solution):
        out.append((solution[pos : m.start()], m.group(1), m.group(2)))
        pos = m.end()
    return out, solution[pos:]


def check(example: Example, task: MathTask, runner: Runner, max_calls: int | None = None) -> Solution:
    """`example`'s solution with each annotation run in `runner` (the sandbox) and checked; raises
    `Dropped` with the reason otherwise."""
    parts, tail = parse(example.meta["solution"])
    if not parts:
        raise Dropped("no_annotation")
    if any(_value(written) is None for _, _, written in parts):
        raise Dropped("annotation_unreadable")
    if max_calls is not None and len(parts) > max_calls:
        raise Dropped("too_many_calls")
    steps = []
    for before, expr, written in parts:
        step = Step(before, expr, written, "")
        result = runner.run(step.code)
        if not result.ok or result.stderr:
            raise Dropped("code_error")
        printed, want = _value(result.stdout), _value(written)
        if printed is None or not math.isclose(printed, want or 0.0, rel_tol=_REL_TOL, abs_tol=1e-12):
            raise Dropped("output_differs")
        steps.append(Step(before, expr, written, result.text()))
    solution = Solution(example, tuple(steps), tail)
    if not task.grader.grade(example.answer, solution.answer).correct:
        raise Dropped("answer_differs")
    return solution


def prose(solution: Solution) -> list[str]:
    """The solution's text around the calls: one chunk before each call, then the tail. Spaces at a
    chunk's ends are dropped (a call starts on its own line; the text after it starts right after the
    output block's newline), and a currency sign written just before an annotation (`5*7=$<<5*7=35>>35`)
    moves after the call, onto its result (`$35`), instead of dangling before the code."""
    chunks, carry = [], ""
    for text in [*(step.before for step in solution.steps), solution.tail]:
        own = text.strip(" ").rstrip()
        chunks.append(carry + own.removesuffix("$").rstrip())
        carry = "$" if own.endswith("$") else ""
    return chunks


def tir_text(solution: Solution, tags: Tags) -> str:
    """The TIR assistant message: the solution's text with each annotation a call and its output."""
    *befores, tail = prose(solution)
    out = [
        (before + "\n" if before else "") + tool_call_text(step.code, step.output, tags)
        for before, step in zip(befores, solution.steps, strict=True)
    ]
    return "".join(out) + (tail.strip() + "\n" if tail.strip() else "") + answer_text(solution.answer, tags)


def tir_demonstration(solution: Solution, task: MathTask) -> dict[str, Any]:
    """One `rolerl sft` row for the `tir` workflow: its prompt and the assistant message."""
    text = tir_text(solution, task.tags)
    prompt = task.tool_prompt(solution.example)
    return {"role": "policy", "messages": [*prompt, {"role": "assistant", "content": text}]}


def request_of(step: Step) -> str:
    """The reasoner's request for one computation, in the words of the workflow's own example."""
    return f"compute {step.expr.strip()}"


def msarl_demonstrations(solution: Solution, task: MathTask) -> list[dict[str, Any]]:
    """The `reasoner_tools` rows: the reasoner's conversation (a request per annotation, the result as
    the workflow replies it) and one coder row per request (its prompt, the call and its output)."""
    ex = solution.example
    question = [m for m in task.prompt(ex) if m["role"] != "system"]  # what the workflow sends
    messages: list[dict[str, str]] = [{"role": "system", "content": REASONER_SYSTEM}, *question]
    coders = []
    *befores, tail = prose(solution)
    for before, step in zip(befores, solution.steps, strict=True):
        before, request = before.strip(), request_of(step)
        call = f"{REASONER_TAGS.tool_open}{request}{REASONER_TAGS.tool_close}"
        messages.append({"role": "assistant", "content": (before + "\n" if before else "") + call})
        # the workflow's reply: the stripped output of the coder's last call (`_tool_work`)
        messages.append({"role": "user", "content": f"Result: {step.output.strip()}"})
        coders.append({"role": "coder", "messages": [
            {"role": "system", "content": CODER_SYSTEM},
            {"role": "user", "content": f"Problem: {ex.question}\n\nRequest: {request}"},
            {"role": "assistant", "content": tool_call_text(step.code, step.output, Tags())},
        ]})  # fmt: skip
    tail = tail.strip()
    final = (tail + "\n" if tail else "") + answer_text(solution.answer, Tags())
    messages.append({"role": "assistant", "content": final})
    return [{"role": "reasoner", "messages": messages}, *coders]


def demonstrations(solution: Solution, task: MathTask, fmt: Format) -> list[dict[str, Any]]:
    """The rows of one solution, each with the example's id (`rolerl sft` trains a problem's rows in one
    step, their shared prompt start once)."""
    rows = [tir_demonstration(solution, task)] if fmt == "tir" else msarl_demonstrations(solution, task)
    return [{**row, "id": solution.example.id} for row in rows]


def build(
    fmt: Format,
    out: str | Path,
    *,
    data: str | Path | None = None,
    split: str = SPLIT,
    limit: int | None = None,
    max_calls: int | None = None,
    workers: int = 8,
    runner: Runner | None = None,
    progress: bool = True,
) -> Report:
    """Convert GSM8K's train split (`data`: a data root, the gsm8k folder or train.jsonl; None = the
    default data root) into `fmt` demonstrations at `out` (JSONL, written atomically), each checked in
    the sandbox (`runner`; default: a `PythonSandbox`, which needs root). `limit`: the first N rows.
    `split` must be "train": no demonstration may come from the test split."""
    if split != SPLIT:
        raise ValueError(f"split={split!r}; allowed: 'train' (demonstrations never come from the test split)")
    if fmt not in FORMATS:
        raise ValueError(f"format={fmt!r}; allowed: {list(FORMATS)}")
    if limit is not None and limit < 1:
        raise ValueError(f"limit={limit}; allowed: an integer >= 1")
    if max_calls is not None and max_calls < 1:
        raise ValueError(f"max_calls={max_calls}; allowed: an integer >= 1")
    if workers < 1:
        raise ValueError(f"workers={workers}; allowed: an integer >= 1")
    task = MathTask("gsm8k", data, split=SPLIT, prompt_style="tool")
    dataset = task.dataset(SPLIT)
    examples = dataset.examples
    skipped = dataset.skipped
    if limit is not None:  # the first `limit` rows of the file, read or skipped
        examples = [e for e in examples if _row(e) < limit]
        skipped = [s for s in skipped if s.row < limit]
    report = Report(rows=len(examples) + len(skipped))
    for s in skipped:
        _drop(report, "unreadable_row", f"gsm8k/{SPLIT}/{s.row}")
    if runner is None:
        from rolerl.tools.python_sandbox import PythonSandbox, SandboxConfig

        with PythonSandbox(SandboxConfig(timeout_s=10, pool_size=min(workers, 8))) as box:
            rows = _convert(examples, task, box, fmt, max_calls, workers, report, progress)
    else:
        rows = _convert(examples, task, runner, fmt, max_calls, workers, report, progress)
    write_jsonl(out, rows)
    return report


def _row(example: Example) -> int:
    return int(example.id.rsplit("/", 1)[1])


def _drop(report: Report, reason: str, example_id: str) -> None:
    report.dropped[reason] += 1
    report.first.setdefault(reason, example_id)


def _convert(
    examples: list[Example],
    task: MathTask,
    runner: Runner,
    fmt: Format,
    max_calls: int | None,
    workers: int,
    report: Report,
    progress: bool,
) -> list[dict[str, Any]]:
    """The kept rows in example order; rows checked `workers` at a time (each waits on sandbox calls)."""
    from rolerl.progress import ProgressBar

    def one(example: Example) -> Solution | Dropped:
        try:
            return check(example, task, runner, max_calls)
        except Dropped as e:
            return e

    rows: list[dict[str, Any]] = []
    with ThreadPoolExecutor(workers) as pool, ProgressBar("demos", len(examples), enabled=progress) as bar:
        for i, (example, got) in enumerate(zip(examples, pool.map(one, examples), strict=True), 1):
            if isinstance(got, Dropped):
                _drop(report, got.reason, example.id)
            else:
                report.kept += 1
                report.calls += len(got.steps)
                rows += demonstrations(got, task, fmt)
            bar.update(i, f"{report.kept} kept")
    return rows


def summary_lines(report: Report, out: str | Path, fmt: str) -> Iterable[str]:
    """The command's printout: kept, then each reason's count and its first example."""
    yield f"{out}: {report.kept} of {report.rows} GSM8K train solutions kept as {fmt} demonstrations ({report.calls} tool calls)"
    for reason in REASONS:
        if report.dropped[reason]:
            yield f"  dropped {report.dropped[reason]:5d} {reason} (first: {report.first[reason]})"
