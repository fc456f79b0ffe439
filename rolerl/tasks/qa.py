"""Open-domain and multi-hop QA benchmarks (NQ, TriviaQA, PopQA, HotpotQA, 2Wiki, MuSiQue, Bamboogle) as
`Task`s graded by SQuAD exact match (or token F1), with a plain prompt and a Search-R1 prompt.

One row parser reads every format in shared/data/qa (SOURCES.md): NQ-open `{question, answer[list]}`,
FlashRAG `{id, question, golden_answers}`, Q/A pairs `{question, answer}` (with MuSiQue's
`answer_aliases`), and IRCoT `{question_id, question_text, answers_objects, contexts}` (its supporting
paragraphs go to `Example.meta["supporting"]`). A row without a question or without a gradable gold answer
is skipped and reported (a warning with the count and the first few, and `QADataset.skipped`), never kept
to be graded wrong: e.g. NQ's gold "---" and HotpotQA's "The The" normalise to "" under SQuAD rules, which
an empty prediction would match.
"""

from __future__ import annotations

import gzip
import json
import logging
import random
import re
import threading
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from rolerl.roles import Tags
from rolerl.tasks.base import Example, Messages, default_data_dir
from rolerl.tasks.qa_metrics import exact_match, extract_answer, f1, normalize_answer

log = logging.getLogger(__name__)

PromptStyle = Literal["plain", "search_r1"]
Metric = Literal["em", "f1"]

# The tags the Search-R1 prompt teaches; a workflow that offers the `search` tool uses these.
SEARCH_R1_TAGS = Tags(
    tool_open="<search>", tool_close="</search>", output_open="<information>", output_close="</information>"
)
PLAIN_SYSTEM = (
    "Answer the question with a short answer (a name, a date, a number or a few words). "
    "Put the final answer inside <answer></answer>, e.g. <answer>Paris</answer>."
)
# Search-R1's instruction (Jin et al. 2025, Sec. 3.2 "training template"), in our words; it is one user
# message, as there.
SEARCH_R1_INSTRUCTION = (
    "Answer the given question. You must reason inside <think> and </think> first every time you get new "
    "information. If you find you lack some knowledge after reasoning, you can call a search engine by "
    "writing <search> query </search>, and it will return the top search results between <information> "
    "and </information> (the system fills these in; do not write them yourself). You can search as many "
    "times as you want. If you find no further external knowledge is needed, give the answer directly "
    "inside <answer> and </answer>, without detailed explanations. For example, <answer> Beijing </answer>."
)


@dataclass(frozen=True)
class Skipped:
    """A row (or one gold answer of a row) that was not loaded, and why."""

    where: str  # "file:line" for JSONL, "file[index]" for a JSON list or a hub dataset
    reason: str


@dataclass
class QADataset:
    """One split of a benchmark: its examples, and what was left out of them."""

    name: str
    split: str
    source: str  # the file or hub dataset it came from
    examples: list[Example]
    skipped: list[Skipped] = field(default_factory=list)  # rows left out entirely
    dropped_golds: list[Skipped] = field(default_factory=list)  # ungradable golds of rows that kept others

    def __len__(self) -> int:
        return len(self.examples)


class _BadRow(ValueError):
    pass


def _question(row: Mapping[str, Any]) -> str:
    for key in ("question", "question_text"):
        if key in row:
            q = row[key]
            if not isinstance(q, str) or not q.strip():
                raise _BadRow(f"{key!r} is empty or not a string: {q!r}")
            return q.strip()
    raise _BadRow(f"no 'question' (or 'question_text') field; fields: {sorted(row)}")


def _raw_golds(row: Mapping[str, Any]) -> list[Any]:
    if "golden_answers" in row:  # FlashRAG
        value = row["golden_answers"]
    elif "answers_objects" in row:  # IRCoT: spans, else a number, else a date
        value = []
        for obj in row["answers_objects"] or []:
            if not isinstance(obj, dict):
                raise _BadRow(f"answers_objects holds a {type(obj).__name__}, not an object")
            date = obj.get("date") or {}
            date_text = " ".join(str(date[k]) for k in ("day", "month", "year") if date.get(k))
            value += list(obj.get("spans") or []) or [x for x in (obj.get("number"), date_text) if x][:1]
    elif "answer" in row:  # NQ-open (a list), Q/A pairs (a string), MuSiQue (plus aliases)
        value = row["answer"] if isinstance(row["answer"], list) else [row["answer"]]
        value = value + list(row.get("answer_aliases") or [])
    else:
        raise _BadRow(f"no answer field (golden_answers, answer or answers_objects); fields: {sorted(row)}")
    value = value if isinstance(value, list) else [value]
    if not value:
        raise _BadRow("the gold answer list is empty")
    return value


def _supporting(row: Mapping[str, Any]) -> list[dict[str, str]] | None:
    """The supporting paragraphs of an IRCoT (`contexts`) or MuSiQue (`paragraphs`) row, else None."""
    paragraphs = row.get("contexts", row.get("paragraphs"))
    if paragraphs is None:
        return None
    try:
        return [
            {"title": str(p["title"]), "text": str(p["paragraph_text"])}
            for p in paragraphs
            if p.get("is_supporting")
        ]
    except (KeyError, TypeError, AttributeError) as e:
        raise _BadRow(f"contexts/paragraphs need title, paragraph_text, is_supporting: {e!r}") from None


def parse_row(row: Any, where: str) -> tuple[str, list[str], dict[str, Any], list[Skipped]]:
    """`(question, golds, meta, dropped golds)` of one row of any supported format; raises ValueError
    when the row has no question or no gradable gold (one that SQuAD normalisation leaves non-empty)."""
    if not isinstance(row, Mapping):
        raise _BadRow(f"a row is a {type(row).__name__}, not a JSON object")
    question, golds, dropped = _question(row), [], []
    for g in _raw_golds(row):
        if isinstance(g, int) and not isinstance(g, bool):
            g = str(g)  # a year or count stored as a number
        if not isinstance(g, str) or not normalize_answer(g):
            dropped.append(
                Skipped(where, f"gold answer {g!r} is empty after SQuAD normalisation or not text")
            )
        elif g.strip() not in golds:
            golds.append(g.strip())
    if not golds:
        reasons = "; ".join(d.reason for d in dropped)
        raise _BadRow(f"no gradable gold answer ({reasons})")
    meta: dict[str, Any] = {"golds": golds}
    if (source_id := row.get("id", row.get("question_id"))) is not None:
        meta["source_id"] = str(source_id)
    if "type" in row:  # HotpotQA: bridge / comparison
        meta["type"] = row["type"]
    if (supporting := _supporting(row)) is not None:
        meta["supporting"] = supporting
    return question, golds, meta, dropped


def _open_text(path: Path):
    return gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else path.open(encoding="utf-8")


def read_rows(path: str | Path) -> Iterator[tuple[str, Any]]:
    """`(where, row)` for each row of a `.jsonl` or `.json` (a list) file, gzipped or not; a JSONL line
    that is not JSON comes back as a `ValueError` in place of the row."""
    path = Path(path)
    kind = path.name.removesuffix(".gz").rsplit(".", 1)[-1]
    if kind not in ("jsonl", "json"):
        raise ValueError(f"{path}: unknown file type; allowed: .jsonl or .json (a list), optionally .gz")
    with _open_text(path) as f:
        if kind == "json":
            rows = json.load(f)
            if not isinstance(rows, list):
                raise ValueError(
                    f"{path}: the top level is a {type(rows).__name__}; need a JSON list of rows"
                )
            yield from ((f"{path}[{i}]", row) for i, row in enumerate(rows))
            return
        for lineno, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield f"{path}:{lineno}", json.loads(line)
                except json.JSONDecodeError as e:
                    yield f"{path}:{lineno}", _BadRow(f"not valid JSON: {e}")


def build_dataset(name: str, split: str, source: str, rows: Iterator[tuple[str, Any]]) -> QADataset:
    """Parse `rows` into examples with ids `name/split/<row index>` (stable: skipped rows keep theirs)."""
    ds = QADataset(name, split, source, [])
    for i, (where, row) in enumerate(rows):
        try:
            if isinstance(row, Exception):
                raise row
            question, golds, meta, dropped = parse_row(row, where)
        except ValueError as e:
            ds.skipped.append(Skipped(where, str(e)))
            continue
        ds.dropped_golds += dropped
        ds.examples.append(Example(f"{name}/{split}/{i}", question, golds[0], meta))
    for what, items in (("rows skipped", ds.skipped), ("gold answers dropped", ds.dropped_golds)):
        if items:
            first = "; ".join(f"{s.where}: {s.reason}" for s in items[:3])
            log.warning("%s/%s (%s): %d %s (first: %s)", name, split, source, len(items), what, first)
    if not ds.examples:
        raise ValueError(f"{source}: no usable rows ({len(ds.skipped)} skipped; first: {ds.skipped[:1]})")
    return ds


def load_qa_file(path: str | Path, name: str, split: str) -> QADataset:
    """One split from a local file (see `read_rows` and `parse_row` for the formats)."""
    return build_dataset(name, split, str(path), read_rows(path))


def load_qa_hub(dataset_id: str, config: str | None, split: str, name: str) -> QADataset:
    """One split of a Hugging Face dataset (e.g. `RUC-NLPIR/FlashRAG_datasets`, config `nq`). `datasets`
    is optional (the `hub` extra) and is imported only here."""
    try:
        import datasets
    except ImportError:
        raise ImportError(
            f"loading {dataset_id!r} from the Hugging Face hub needs `datasets` (pip install 'rolerl[hub]'); "
            "or pass a local file path"
        ) from None
    try:
        rows = datasets.load_dataset(dataset_id, config, split=split)
    except Exception as e:  # noqa: BLE001 - offline, unknown id/config/split: one line that says which
        raise ValueError(
            f"could not load {dataset_id!r} (config {config!r}, split {split!r}) from the Hugging Face hub: "
            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}; offline? pass a local file path"
        ) from e
    source = f"{dataset_id}:{config}:{split}"
    return build_dataset(name, split, source, ((f"{source}[{i}]", r) for i, r in enumerate(rows)))


class QATask:
    """A QA benchmark as a `Task`. `loaders[split]()` gives that split's `QADataset`, read once, lazily.

    `examples(split, n, seed)` samples without replacement, a pure function of its arguments. The reward is
    the exact match (1.0/0.0) of the last `<answer>` against any gold, or token F1 with `metric="f1"`;
    `check` is always exact match, `scores` gives both (the eval harness reports them)."""

    def __init__(
        self,
        name: str,
        loaders: Mapping[str, Callable[[], QADataset]],
        *,
        prompt_style: PromptStyle = "plain",
        metric: Metric = "em",
    ) -> None:
        if prompt_style not in get_args(PromptStyle):
            raise ValueError(f"prompt_style={prompt_style!r}; allowed: {list(get_args(PromptStyle))}")
        if metric not in get_args(Metric):
            raise ValueError(f"metric={metric!r}; allowed: {list(get_args(Metric))}")
        if not loaders:
            raise ValueError(f"QATask {name!r} needs at least one split")
        self.name, self.loaders = name, dict(loaders)
        self.prompt_style, self.metric = prompt_style, metric
        self._datasets: dict[str, QADataset] = {}
        self._lock = threading.Lock()

    @property
    def splits(self) -> list[str]:
        return list(self.loaders)

    def dataset(self, split: str) -> QADataset:
        if split not in self.loaders:
            raise ValueError(f"{self.name}: split={split!r}; allowed: {self.splits}")
        with self._lock:
            if split not in self._datasets:
                self._datasets[split] = self.loaders[split]()
            return self._datasets[split]

    def size(self, split: str) -> int:
        return len(self.dataset(split))

    def examples(self, split: str, n: int, seed: int) -> list[Example]:
        pool = self.dataset(split).examples
        if not 0 <= n <= len(pool):
            raise ValueError(
                f"n={n}; {self.name}/{split} has {len(pool)} examples (drawn without replacement)"
            )
        rng = random.Random(zlib.crc32(f"{self.name}/{split}/{seed}".encode()))
        return [pool[i] for i in rng.sample(range(len(pool)), n)]

    def prompt(self, example: Example) -> Messages:
        """The closed-book prompt (`plain`, the default), or Search-R1's when `prompt_style` says so."""
        if self.prompt_style == "search_r1":
            return self.search_prompt(example)
        return [
            {"role": "system", "content": PLAIN_SYSTEM},
            {"role": "user", "content": example.question},
        ]

    def search_prompt(self, example: Example) -> Messages:
        """Search-R1's prompt (the `search_agent` workflow asks for it whatever `prompt_style` is)."""
        q = example.question if example.question.endswith("?") else example.question + "?"  # as Search-R1
        return [{"role": "user", "content": f"{SEARCH_R1_INSTRUCTION} Question: {q}\n"}]

    @staticmethod
    def golds(example: Example) -> list[str]:
        return example.meta.get("golds") or [example.answer]

    def answer_of(self, text: str) -> str | None:
        """The normalised answer (so that maj@k counts "The Beatles" and "beatles" as one vote)."""
        answer = extract_answer(text)
        return normalize_answer(answer) if answer is not None else None

    def scores(self, example: Example, text: str) -> dict[str, float]:
        answer = extract_answer(text)
        return {"em": exact_match(answer, self.golds(example)), "f1": f1(answer, self.golds(example))}

    def check(self, example: Example, text: str) -> bool:
        return exact_match(extract_answer(text), self.golds(example)) == 1.0

    def reward(self, example: Example, text: str) -> float:
        score = exact_match if self.metric == "em" else f1
        return score(extract_answer(text), self.golds(example))


@dataclass(frozen=True)
class Benchmark:
    """Where a benchmark's splits are: files under shared/data/qa, and its FlashRAG hub config."""

    files: dict[str, str]  # split -> path relative to the qa/ data directory
    hub_config: str  # config name in RUC-NLPIR/FlashRAG_datasets
    hub_splits: tuple[str, ...]


# NQ-open's "dev" file (3610) is the set the open-domain literature (DPR, FlashRAG, Search-R1) calls NQ
# *test*; the TriviaQA and PopQA files are 1000-row subsamples, hence "test_1k" and no "test".
QA_BENCHMARKS: dict[str, Benchmark] = {
    "nq": Benchmark(
        {
            "test": "nq_open/NQ-open.dev.jsonl",
            "test_1k": "flashrag_1k_subsamples/nq_test_1k.jsonl",
            "efficientqa": "nq_open/NQ-open.efficientqa.dev.1.1.jsonl",
        },
        "nq",
        ("train", "dev", "test"),
    ),
    "triviaqa": Benchmark(
        {"test_1k": "flashrag_1k_subsamples/triviaqa_test_1k.jsonl"}, "triviaqa", ("train", "dev", "test")
    ),
    "popqa": Benchmark({"test_1k": "flashrag_1k_subsamples/popqa_test_1k.jsonl"}, "popqa", ("test",)),
    "hotpotqa": Benchmark(
        {
            "dev": "hotpotqa/hotpot_dev_v1_simplified.json",
            "dev_ircot500": "hotpotqa/ircot_dev_subsampled_500.jsonl.gz",
        },
        "hotpotqa",
        ("train", "dev"),
    ),
    "2wiki": Benchmark(
        {"dev": "2wikimultihopqa/2wikimultihop_dev_questions_and_answers.json"},
        "2wikimultihopqa",
        ("train", "dev"),
    ),
    "musique": Benchmark(
        {
            "dev": "musique/musique_ans_dev_questions_and_answers.json",
            "train": "musique/musique_ans_train_questions_and_answers.json.gz",
        },
        "musique",
        ("train", "dev"),
    ),
    "bamboogle": Benchmark({"test": "bamboogle/test.jsonl"}, "bamboogle", ("test",)),
}
_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


def qa_task(
    name: str,
    path: str | Path | None = None,
    *,
    split: str | None = None,
    splits: Sequence[str] | None = None,
    hub_config: str | None = None,
    prompt_style: PromptStyle = "plain",
    metric: Metric = "em",
) -> QATask:
    """The benchmark `name` (a key of `QA_BENCHMARKS`). `path`: None = the files under `default_data_dir()`;
    a directory = a data root (holding `qa/`) or the `qa/` directory itself; a file = one split, named
    `split` (default: the benchmark's first); otherwise a Hugging Face dataset id, read lazily with
    `datasets` (config `hub_config`, default FlashRAG's; `splits` default FlashRAG's). For a directory or a
    hub id, `split` (one) or `splits` (several) narrow the splits the task offers."""
    if name not in QA_BENCHMARKS:
        raise ValueError(f"unknown QA benchmark {name!r}; allowed: {sorted(QA_BENCHMARKS)}")
    bench = QA_BENCHMARKS[name]
    kw: dict[str, Any] = {"prompt_style": prompt_style, "metric": metric}
    if path is not None and not Path(path).exists() and _HUB_ID.match(str(path)):
        config = hub_config or bench.hub_config
        names = list(splits or ([split] if split else bench.hub_splits))
        return QATask(name, {s: _hub_loader(str(path), config, s, name) for s in names}, **kw)
    if path is not None and Path(path).is_file():
        split = split or next(iter(bench.files))
        return QATask(name, {split: _file_loader(Path(path), name, split)}, **kw)
    root = Path(path) if path is not None else default_data_dir()
    if not root.is_dir():
        raise FileNotFoundError(
            f"{name}: {root} is not a file, a directory or a Hugging Face dataset id (owner/name)"
            + ("; set ROLERL_SHARED_DATA to the data directory" if path is None else "")
        )
    qa_root = root / "qa" if (root / "qa").is_dir() else root
    wanted = splits or ([split] if split else list(bench.files))
    if unknown := [s for s in wanted if s not in bench.files]:
        raise ValueError(f"{name}: split(s) {unknown} have no file; allowed: {list(bench.files)}")
    files = {s: qa_root / bench.files[s] for s in wanted}
    if missing := [str(p) for p in files.values() if not p.is_file()]:
        raise FileNotFoundError(f"{name}: missing data file(s) {missing} (data root {root})")
    return QATask(name, {s: _file_loader(p, name, s) for s, p in files.items()}, **kw)


def _file_loader(path: Path, name: str, split: str) -> Callable[[], QADataset]:
    return lambda: load_qa_file(path, name, split)


def _hub_loader(dataset_id: str, config: str, split: str, name: str) -> Callable[[], QADataset]:
    return lambda: load_qa_hub(dataset_id, config, split, name)
