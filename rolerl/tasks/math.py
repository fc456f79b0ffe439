"""Math benchmarks as tasks: GSM8K, MATH-500, MATH train, AIME 2024/2025 and AMC 2023, graded with
`math-verify` through `MathGrader` (rolerl/tasks/math_grader.py).

    task = math_task("math500")                       # ../shared/data/math/math500_test.jsonl
    task = math_task("gsm8k", "/data/gsm8k/test.jsonl")
    task = math_task("aime24", "HuggingFaceH4/aime_2024", split="train")   # needs `datasets`

Each benchmark knows its split files under the data root (`BENCHMARKS`, fields in shared/data/SOURCES.md).
A row with a missing field or an unreadable gold answer (empty, not a string or number, unbalanced braces,
a GSM8K answer without `#### <number>`) is skipped and reported, never graded as wrong: a log warning with
the count and the first few, and `MathDataset.skipped`. Example ids are `<benchmark>/<split>/<row>` with
the row's 0-based index in its file, so they stay stable when other rows are skipped.
"""

from __future__ import annotations

import gzip
import json
import logging
import random
import re
import threading
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from rolerl.roles import Tags
from rolerl.tasks.base import Example, Messages, default_data_dir
from rolerl.tasks.math_grader import (
    ANSWER_SOURCES,
    AnswerSource,
    Grade,
    MathGrader,
    default_grader,
    extract_boxed,
    extract_tagged,
    final_answer,
)

log = logging.getLogger(__name__)

PromptStyle = Literal["boxed", "tool"]
PROMPT_STYLES: tuple[PromptStyle, ...] = ("boxed", "tool")
# Qwen2.5-Math's chain-of-thought prompt, the one the published MATH-500 / AIME numbers use.
BOXED_SYSTEM = "Please reason step by step, and put your final answer within \\boxed{}."
TOOL_SYSTEM = (  # the TIR workflow's format (rolerl/workflows/tir.py), as SyntheticTask's prompt
    "Solve the math problem. You can run Python: write code in {tool_open}{tool_close}, its output appears "
    "in {output_open}{output_close}. Reason step by step and put the final answer in "
    "{answer_open}{answer_close}, e.g. {answer_open}\\frac{{3}}{{4}}{answer_close}."
)


class _BadRow(ValueError):
    """A row that cannot become an example; the message says which field and why."""


@dataclass(frozen=True)
class Skipped:
    row: int  # 0-based index of the row in its source
    reason: str


@dataclass
class MathDataset:
    """One split of a benchmark: its examples and the rows left out."""

    name: str
    split: str
    source: str  # the file or hub dataset read
    examples: list[Example]
    skipped: list[Skipped] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.examples)


@dataclass(frozen=True)
class Benchmark:
    files: dict[str, str]  # split -> file under the data root; the first is the default split
    read: Callable[[dict[str, Any]], tuple[str, str, dict[str, Any]]]  # row -> (question, gold, meta)
    answer_order: tuple[AnswerSource, ...] = ("tag", "boxed")  # where a reply's final answer is


# ---- row readers -----------------------------------------------------------------------------------------

_GSM8K_NUMBER = re.compile(r"^-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?$")


def _text(row: dict[str, Any], *names: str) -> str:
    """The first of `names` present in `row`, a non-empty string."""
    name = next((n for n in names if n in row), None)
    if name is None:
        raise _BadRow(f"missing field {' or '.join(map(repr, names))}")
    value = row[name]
    if not isinstance(value, str) or not value.strip():
        raise _BadRow(f"field {name!r} is {'empty' if value in ('', None) else type(value).__name__}")
    return value


def _gold(row: dict[str, Any], name: str = "answer") -> str:
    """A gold answer as a string: `27.0` (AMC's floats) -> `27`. Rejects empty values and unbalanced
    braces, which math-verify would read as something else or nothing."""
    if name not in row:
        raise _BadRow(f"missing field {name!r}")
    value = row[name]
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise _BadRow(f"field {name!r} is {type(value).__name__}, not a string or number")
    if isinstance(value, float):
        value = str(int(value)) if value.is_integer() else repr(value)
    gold = str(value).strip()
    if not gold:
        raise _BadRow(f"field {name!r} is empty")
    depth = 0
    for ch in re.sub(r"\\[{}]", "", gold):
        depth += (ch == "{") - (ch == "}")
        if depth < 0:
            break
    if depth != 0:
        raise _BadRow(f"field {name!r} has unbalanced braces: {gold!r}")
    return gold


def _gsm8k(row: dict[str, Any]) -> tuple[str, str, dict[str, Any]]:
    question, answer = _text(row, "question"), _text(row, "answer")
    solution, sep, number = answer.rpartition("####")
    number = number.strip()
    if not sep or not _GSM8K_NUMBER.match(number):
        raise _BadRow(f"field 'answer' does not end with '#### <number>': ...{answer[-40:]!r}")
    return question, number.replace(",", ""), {"solution": solution.strip()}


def _math500(row: dict[str, Any]) -> tuple[str, str, dict[str, Any]]:
    meta = {k: row[k] for k in ("subject", "level", "unique_id", "solution") if k in row}
    meta["family"] = row.get("subject", "all")  # per-subject accuracy in `EvalResult.summary`
    return _text(row, "problem"), _gold(row), meta


def _math_train(row: dict[str, Any]) -> tuple[str, str, dict[str, Any]]:
    meta = {k: row[k] for k in ("index", "level", "type", "solution") if k in row}
    meta["family"] = row.get("type", "all")
    return _text(row, "problem"), _gold(row), meta


def _competition(row: dict[str, Any]) -> tuple[str, str, dict[str, Any]]:
    meta = {k: row[k] for k in ("id", "url") if k in row}
    return _text(row, "problem", "question"), _gold(row), meta


BENCHMARKS: dict[str, Benchmark] = {
    # GSM8K replies often end "... so she has 18 apples." without a box: the last number is the answer.
    "gsm8k": Benchmark(
        {"test": "gsm8k/test.jsonl", "train": "gsm8k/train.jsonl"}, _gsm8k, ("tag", "boxed", "number")
    ),
    "math500": Benchmark({"test": "math/math500_test.jsonl"}, _math500),
    "math_train": Benchmark({"train": "math/math_train.jsonl.gz"}, _math_train),
    "aime24": Benchmark({"test": "aime/aime24_test.jsonl"}, _competition),
    "aime25": Benchmark({"test": "aime/aime25_test.jsonl"}, _competition),
    "amc23": Benchmark({"test": "aime/amc23_test.jsonl"}, _competition),
}


# ---- loading ---------------------------------------------------------------------------------------------

_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+(:[\w.-]+)?$")  # owner/name, optionally :config


def load_benchmark(name: str, path: str | Path | None = None, split: str | None = None) -> MathDataset:
    """One split of benchmark `name` (a key of `BENCHMARKS`; split default: its first). `path`: None = the
    data root `default_data_dir()`; a directory = a data root or the benchmark's own folder; a file = that
    split; else a Hugging Face dataset id `owner/name[:config]` (needs `datasets`)."""
    bench = _benchmark(name)
    split = split or next(iter(bench.files))
    if path is not None and not Path(path).exists() and _is_hub_id(str(path)):
        return _build(name, split, str(path), bench, _hub_rows(str(path), split))
    file = _split_file(name, bench, path, split)
    return _build(name, split, str(file), bench, _file_rows(file))


def _benchmark(name: str) -> Benchmark:
    if name not in BENCHMARKS:
        raise ValueError(f"unknown math benchmark {name!r}; allowed: {list(BENCHMARKS)}")
    return BENCHMARKS[name]


def _is_hub_id(text: str) -> bool:
    return bool(_HUB_ID.match(text)) and not text.endswith((".json", ".jsonl", ".gz"))


def _split_file(name: str, bench: Benchmark, path: str | Path | None, split: str) -> Path:
    root = default_data_dir() if path is None else Path(path).expanduser()
    if root.is_file():
        holds = next((s for s, f in bench.files.items() if Path(f).name == root.name), None)
        if holds is not None and holds != split:
            raise ValueError(f"{name}: {root} is the {holds!r} split; asked for {split!r}")
        return root
    if split not in bench.files:
        raise ValueError(f"{name}: split={split!r}; allowed: {list(bench.files)}")
    rel = Path(bench.files[split])
    for file in (root / rel, root / rel.name):  # the data root, or the benchmark's own folder
        if file.is_file():
            return file
    hint = "; set ROLERL_SHARED_DATA to the data directory" if path is None else ""
    raise FileNotFoundError(f"{name}: no {rel} under {root} (nor a file or a hub id owner/name){hint}")


def _file_rows(path: Path) -> list[Any]:
    """The rows of a .jsonl, .jsonl.gz or .json (a list) file; a line that is not JSON becomes a
    `_BadRow` in its place, so it is reported with its row number."""
    opener: Callable[..., Any] = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        if path.name.removesuffix(".gz").endswith(".json"):
            rows = json.load(f)
            if not isinstance(rows, list):
                raise ValueError(f"{path}: a .json benchmark file must hold a list of rows")
            return rows
        out: list[Any] = []
        for line in f:
            if line.strip():
                try:
                    out.append(json.loads(line))
                except ValueError as e:
                    out.append(_BadRow(f"not JSON ({e})"))
        return out


def _hub_rows(dataset_id: str, split: str) -> list[Any]:
    repo, _, config = dataset_id.partition(":")
    try:
        import datasets
    except ImportError:
        raise ImportError(
            f"loading {dataset_id!r} from the Hugging Face Hub needs `datasets`: pip install 'rolerl[hub]' "
            "(or pass a local file or directory)"
        ) from None
    try:
        return list(datasets.load_dataset(repo, config or None, split=split))
    except Exception as e:  # offline, unknown id, config or split: one line that says which
        first = str(e).splitlines()[0] if str(e) else ""
        raise RuntimeError(
            f"could not load {dataset_id!r} split {split!r} from the Hugging Face Hub "
            f"({type(e).__name__}: {first}); offline? pass a local file or directory instead"
        ) from e


def _build(name: str, split: str, source: str, bench: Benchmark, rows: Iterable[Any]) -> MathDataset:
    ds = MathDataset(name, split, source, [])
    total = 0
    for i, row in enumerate(rows):
        total += 1
        try:
            if isinstance(row, _BadRow):
                raise row
            if not isinstance(row, dict):
                raise _BadRow(f"a {type(row).__name__}, not an object")
            question, gold, meta = bench.read(row)
        except _BadRow as e:
            ds.skipped.append(Skipped(i, str(e)))
            continue
        ds.examples.append(Example(f"{name}/{split}/{i}", question, gold, meta))
    if ds.skipped:
        first = "; ".join(f"row {s.row}: {s.reason}" for s in ds.skipped[:3])
        log.warning("%s/%s: skipped %d of %d rows of %s, first: %s", name, split, len(ds.skipped), total,
                    source, first)  # fmt: skip
    return ds


# ---- the task --------------------------------------------------------------------------------------------


class MathTask:
    """A math benchmark as a `Task`; splits are read lazily, once.

    `examples(split, n, seed)` samples `n` without replacement, a pure function of its arguments (and a
    prefix of the draw for a larger `n`).
    `prompt_style="boxed"` asks for step-by-step reasoning and a `\\boxed{}` answer; `"tool"` for the TIR
    format (Python in the tool tags, the answer in the answer tags). The reward is 1.0 when the final answer
    (`answer_order`: the benchmark's default unless given) equals the gold under math-verify, else
    `format_reward` for a reply in the asked format (a box; a tool call and a tagged answer), else 0.
    Grading goes through `grader` (default: the process-wide `default_grader()`)."""

    def __init__(
        self,
        name: str,
        path: str | Path | None = None,
        *,
        split: str | None = None,
        prompt_style: PromptStyle = "boxed",
        format_reward: float = 0.0,
        answer_order: tuple[AnswerSource, ...] | None = None,
        grader: MathGrader | None = None,
        tags: Tags | None = None,
    ) -> None:
        bench = _benchmark(name)
        if prompt_style not in PROMPT_STYLES:
            raise ValueError(f"prompt_style={prompt_style!r}; allowed: {list(PROMPT_STYLES)}")
        if not 0 <= format_reward < 1:
            raise ValueError(f"format_reward={format_reward}; allowed: a number in [0, 1)")
        order = tuple(answer_order or bench.answer_order)
        if not order or any(s not in ANSWER_SOURCES for s in order):
            raise ValueError(f"answer_order={answer_order!r}; allowed: a non-empty tuple of {ANSWER_SOURCES}")
        self.name, self.path, self.prompt_style, self.format_reward = name, path, prompt_style, format_reward
        self.answer_order, self.tags, self._grader = order, tags or Tags(), grader
        t = self.tags
        self._answer_tags = (t.answer_open, t.answer_close) if t.answer_open else ("<answer>", "</answer>")
        # A file path holds one split: the one its name says, else `split`, else the benchmark's first.
        self.splits = tuple(bench.files) if split is None else (split,)
        if path is not None and Path(path).is_file():
            holds = next((s for s, f in bench.files.items() if Path(f).name == Path(path).name), None)
            self.splits = (split or holds or next(iter(bench.files)),)
        self._datasets: dict[str, MathDataset] = {}
        self._lock = threading.Lock()

    @property
    def grader(self) -> MathGrader:
        return self._grader or default_grader()

    def dataset(self, split: str) -> MathDataset:
        """The split's examples and skipped rows (read on first use)."""
        if split not in self.splits:
            raise ValueError(f"{self.name}: split={split!r}; allowed: {list(self.splits)}")
        with self._lock:
            if split not in self._datasets:
                self._datasets[split] = load_benchmark(self.name, self.path, split)
            return self._datasets[split]

    def size(self, split: str) -> int:
        return len(self.dataset(split))

    def examples(self, split: str, n: int, seed: int) -> list[Example]:
        pool = self.dataset(split).examples
        if not 0 <= n <= len(pool):
            raise ValueError(f"{self.name}/{split}: n={n}; allowed: 0 <= n <= {len(pool)} (the split's size)")
        # A seeded shuffle of the whole split, cut at n: draws without replacement, and a shorter draw is a
        # prefix of a longer one (an eval at --limit 100 is the first 100 of one at 200).
        order = list(range(len(pool)))
        random.Random(zlib.crc32(f"{self.name}/{split}/{seed}".encode())).shuffle(order)
        return [pool[i] for i in order[:n]]

    def prompt(self, example: Example) -> Messages:
        """The prompt of `prompt_style`: step-by-step with a `\\boxed{}` answer, or the tool format."""
        return self._prompt(example, self.prompt_style)

    def tool_prompt(self, example: Example) -> Messages:
        """The tool format's prompt whatever `prompt_style` is (the TIR workflow asks for it)."""
        return self._prompt(example, "tool")

    def _prompt(self, example: Example, style: str) -> Messages:
        if style == "boxed":
            system = BOXED_SYSTEM
        else:
            t = self.tags
            if t.answer_open is None or t.answer_close is None:
                raise ValueError("prompt_style='tool' needs answer tags: Tags.answer_open/close are None")
            system = TOOL_SYSTEM.format(
                tool_open=t.tool_open, tool_close=t.tool_close, output_open=t.output_open,
                output_close=t.output_close, answer_open=t.answer_open, answer_close=t.answer_close,
            )  # fmt: skip
        return [{"role": "system", "content": system}, {"role": "user", "content": example.question}]

    def answer_of(self, text: str) -> str | None:
        """The final answer, lightly normalised (what maj@k votes on; equal answers written differently,
        `1/2` and `0.5`, still vote apart)."""
        answer = self._final(text)
        return None if answer is None else _vote_key(answer)

    def grade(self, example: Example, text: str) -> Grade:
        return self.grader.grade(example.answer, self._final(text))

    def check(self, example: Example, text: str) -> bool:
        return self.grade(example, text).correct

    def reward(self, example: Example, text: str) -> float:
        if self.check(example, text):
            return 1.0
        return self.format_reward if self._well_formed(text) else 0.0

    def _final(self, text: str) -> str | None:
        return final_answer(text, self.answer_order, self._answer_tags)

    def _well_formed(self, text: str) -> bool:
        if self.prompt_style == "boxed":
            return extract_boxed(text) is not None
        t = self.tags
        tagged = t.answer_open is not None and extract_tagged(text, t.answer_open, t.answer_close) is not None
        return t.tool_close in text and tagged


DIFFICULTY = {  # what task.max_difficulty reads, per benchmark
    "gsm8k": "the reference solution's steps (its lines; 2 to 8, a few more)",
    "math500": "the MATH level (1 to 5)",
    "math_train": "the MATH level (1 to 5)",
}


def difficulty(name: str, example: Example) -> int | None:
    """How hard `example` of benchmark `name` is (DIFFICULTY), None where the row does not tell."""
    if name == "gsm8k":
        solution = str(example.meta.get("solution", ""))
        return sum(1 for line in solution.splitlines() if line.strip()) or None
    if name in DIFFICULTY:
        level = re.search(r"\d+", str(example.meta.get("level", "")))
        return int(level.group()) if level else None
    return None


def at_most(task: Any, split: str, max_difficulty: int) -> Any:
    """`task` with `split` cut to the problems of difficulty <= `max_difficulty` (`Subset`); rows whose
    difficulty is unknown are left out."""
    from rolerl.tasks.base import Subset

    name = getattr(task, "name", None)
    if name not in DIFFICULTY:
        raise ValueError(
            f"task.max_difficulty={max_difficulty}: task {name!r} tells no difficulty; allowed for "
            f"{sorted(DIFFICULTY)} (or null)"
        )

    def keep(example: Example) -> bool:
        d = difficulty(name, example)
        return d is not None and d <= max_difficulty

    return Subset(task, split, keep, f"of difficulty <= {max_difficulty}: {DIFFICULTY[name]}")


def _vote_key(answer: str) -> str:
    """A final answer as maj@k compares it: spacing, `\\left`/`\\right`, `$`, degrees and a whole-answer
    `\\text{}` dropped, `\\dfrac` -> `\\frac`, integers canonical (`1,000.0` -> `1000`, `025` -> `25`)."""
    s = re.sub(r"\\(?:left|right|!|,|;|:)|\\?\$|\s", "", answer)
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = re.sub(r"^\\text\{(.*)\}$", r"\1", s)
    s = re.sub(r"\^\{?\\circ\}?", "", s)
    if re.fullmatch(r"-?(\d{1,3}(,\d{3})+|\d+)(\.0*)?", s):
        s = str(int(s.replace(",", "").split(".")[0]))
    return s


def math_task(name: str, path: str | Path | None = None, **kwargs: Any) -> MathTask:
    """The task for benchmark `name` ("gsm8k", "math500", "math_train", "aime24", "aime25", "amc23") from
    `path` (a data root, a split file, or a hub id; None = `default_data_dir()`); `kwargs` go to
    `MathTask` (split, prompt_style, format_reward, answer_order, grader, tags)."""
    return MathTask(name, path, **kwargs)
