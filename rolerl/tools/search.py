"""Retrieval for search agents: a BM25 index over a local passage corpus (cached on disk) and the `search`
tool; the client for any Search-R1-style retrieval server and our own such server are in
`rolerl.tools.retrieval_http`, and the types both use (`Passage`, `Retriever`, `RetrieverError`, still
importable from here) in `rolerl.tools.retrieval_types`.

Everything that retrieves has one method, `search(queries, k) -> list[list[Passage]]` (`Retriever`), so
the tool works the same over a local index or a remote server. The wire protocol is Search-R1's
`retrieval_server.py`: `POST /retrieve` with `{"queries": [...], "topk": k, "return_scores": true}`
answers `{"result": [[{"document": {"id", "contents": "title\\ntext"}, "score": s}, ...], ...]}` (without
`return_scores`, each list holds the documents alone).

A search that fails (the server errs, answers garbage or not at all) is a tool error the trainer can see:
a `ToolResult` with a non-zero exit code (and `timed_out` for a timeout) and the error in stderr, never
text that reads like retrieved documents.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal, get_args

from rolerl.tools.base import ToolResult

# The shared types live below this module and `retrieval_http` (which must not import this one); they
# stay importable from here, where they were first defined.
from rolerl.tools.retrieval_types import Passage, Retriever, RetrieverError

__all__ = [
    "CACHE_DIR",
    "BM25Retriever",
    "Passage",
    "PassageFormat",
    "Retriever",
    "RetrieverError",
    "SearchTool",
    "format_passages",
    "load_corpus",
    "search_tool",
]

log = logging.getLogger(__name__)

PassageFormat = Literal["search_r1", "plain"]
CACHE_DIR = Path(os.environ.get("ROLERL_CACHE", Path.home() / ".cache" / "rolerl")) / "bm25"  # as models
_CACHE_FORMAT = 1  # bump when the cache layout changes: old entries then fail validation and are rebuilt


def format_passages(passages: Sequence[Passage], fmt: PassageFormat = "search_r1") -> str:
    """`search_r1`: `Doc 1(Title: t) text\\n` per passage, byte for byte what Search-R1's `_passages2string`
    gives (models trained there expect it); `plain`: `[1] title\\ntext` blocks separated by blank lines."""
    if fmt == "search_r1":
        return "".join(f"Doc {i}(Title: {p.title}) {p.text}\n" for i, p in enumerate(passages, 1))
    if fmt == "plain":
        return "\n".join(f"[{i}] {p.title}\n{p.text}\n" for i, p in enumerate(passages, 1))
    raise ValueError(f"fmt={fmt!r}; allowed: {list(get_args(PassageFormat))}")


# ---- corpus and the BM25 index ---------------------------------------------------------------------------


def _passage(row: Any, i: int, where: str) -> Passage:
    """One corpus row: `{id?, title, text}`, or Search-R1's wiki-18 `{id, contents: "title\\ntext"}`."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: a passage is a {type(row).__name__}; need a JSON object")
    title, text = row.get("title", ""), row.get("text")
    if text is None and isinstance(row.get("contents"), str):
        title, _, text = row["contents"].partition("\n")
    if not isinstance(text, str) or not isinstance(title, str):
        raise ValueError(
            f"{where}: a passage needs string 'text' (or 'contents') and 'title'; got {sorted(row)}"
        )
    return Passage(str(row.get("id", i)), title, text)


def load_corpus(path: str | Path) -> list[Passage]:
    """Passages from a JSONL file of rows or a JSON list (either gzipped); ids default to the row index."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        if path.name.removesuffix(".gz").endswith(".json"):
            rows = json.load(f)
            if not isinstance(rows, list):
                raise ValueError(f"{path}: the top level is a {type(rows).__name__}; need a list of passages")
            passages = [_passage(r, i, f"{path}[{i}]") for i, r in enumerate(rows)]
        else:
            passages = []
            for n, line in enumerate(f, 1):
                try:
                    row = json.loads(line) if line.strip() else None
                except json.JSONDecodeError as e:
                    raise ValueError(
                        f"{path}:{n}: not JSON ({e}); a corpus is JSONL or a JSON list"
                    ) from None
                if row is not None:
                    passages.append(_passage(row, len(passages), f"{path}:{n}"))
    if not passages:
        raise ValueError(f"{path}: the corpus has no passages")
    if len({p.id for p in passages}) != len(passages):
        raise ValueError(f"{path}: passage ids are not unique")
    return passages


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


class BM25Retriever:
    """BM25 (Lucene variant, `bm25s`) over a local corpus. The index is built once per corpus content and
    settings and cached under `cache_dir/<sha256 of the corpus file>/<settings>/` (written to a temporary
    directory, then renamed into place; a cache that fails validation is rebuilt with a warning).

    k1=0.9, b=0.4 are Pyserini's defaults, the BM25 Search-R1 and FlashRAG report. No stemmer: PyStemmer
    is not a dependency. Searching only reads the index, so one retriever serves many threads."""

    def __init__(
        self,
        corpus: str | Path,
        *,
        k1: float = 0.9,
        b: float = 0.4,
        stopwords: Literal["en", "none"] = "en",
        cache_dir: str | Path | None = CACHE_DIR,  # None: build in memory, never cache
    ) -> None:
        if k1 < 0 or not 0 <= b <= 1:
            raise ValueError(f"BM25 k1={k1}, b={b}; allowed: k1 >= 0 and 0 <= b <= 1")
        if stopwords not in ("en", "none"):
            raise ValueError(f"stopwords={stopwords!r}; allowed: 'en', 'none'")
        self.corpus_path = Path(corpus)
        self.k1, self.b, self.stopwords = k1, b, stopwords
        self.passages = load_corpus(self.corpus_path)
        self.cache_hit = False  # whether the index came from the cache
        settings = f"k1={k1}-b={b}-stopwords={stopwords}"
        self.cache_path = (
            None if cache_dir is None else Path(cache_dir) / _sha256(self.corpus_path) / settings
        )
        self.model = self._load()
        if self.model is None:
            self.model = self._build()
            if self.cache_path is not None:
                self._save()
        self.vocab = self.model.vocab_dict

    def _tokenize(self, texts: list[str]) -> list[list[str]]:
        import bm25s

        sw = "en" if self.stopwords == "en" else None
        return bm25s.tokenize(texts, stopwords=sw, return_ids=False, show_progress=False)

    def _build(self):
        import bm25s

        t0 = time.perf_counter()
        model = bm25s.BM25(k1=self.k1, b=self.b, method="lucene")
        model.index(self._tokenize([f"{p.title}\n{p.text}" for p in self.passages]), show_progress=False)
        log.info("BM25: indexed %s in %.1f s", self.corpus_path, time.perf_counter() - t0)
        return model

    def _meta(self) -> dict[str, Any]:
        import bm25s

        return {"format": _CACHE_FORMAT, "bm25s": bm25s.__version__, "num_docs": len(self.passages)}

    def _load(self):
        """The cached index, or None when there is none or it fails validation (then it is rebuilt)."""
        import bm25s

        path = self.cache_path
        if path is None or not path.is_dir():
            return None
        try:
            meta = json.loads((path / "meta.json").read_text())
            if {k: meta.get(k) for k in self._meta()} != self._meta():
                raise ValueError(f"made for {meta}, need {self._meta()}")
            for name, digest in meta["files"].items():
                if _sha256(path / name) != digest:
                    raise ValueError(f"{name} does not match its recorded sha256")
            model = bm25s.BM25.load(path, load_corpus=False, show_progress=False)
        except Exception as e:  # noqa: BLE001 - any damage means the same thing: rebuild
            log.warning("BM25 cache %s is unusable (%s: %s); rebuilding it", path, type(e).__name__, e)
            return None
        self.cache_hit = True
        return model

    def _save(self) -> None:
        """Write to a temporary sibling directory and rename it into place: a reader never sees half an
        index, and of two processes racing, one wins and the other's copy is dropped."""
        final = self.cache_path
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=final.parent))
            self.model.save(tmp, show_progress=False)
            files = {p.name: _sha256(p) for p in tmp.iterdir()}
            (tmp / "meta.json").write_text(json.dumps(self._meta() | {"files": files}, indent=1))
            if final.exists():  # the unusable entry `_load` rejected
                shutil.rmtree(final, ignore_errors=True)
            try:
                tmp.rename(final)
            except OSError:
                shutil.rmtree(tmp, ignore_errors=True)
        except OSError as e:  # a read-only or full disk costs a rebuild next time, not this run
            log.warning("BM25: could not cache the index at %s (%s); continuing without a cache", final, e)

    def search(self, queries: Sequence[str], k: int) -> list[list[Passage]]:
        if isinstance(queries, str):
            raise TypeError("queries is one string; pass a list of query strings")
        if k < 1:
            raise ValueError(f"k={k}; need k >= 1")
        # Unknown words cannot score; a query without known words matches nothing (bm25s would rank
        # arbitrary zero-score passages instead).
        tokens = [[t for t in q if t in self.vocab] for q in self._tokenize(list(queries))]
        out: list[list[Passage]] = [[] for _ in queries]
        rows = [i for i, q in enumerate(tokens) if q]
        if rows:
            k = min(k, len(self.passages))
            docs, scores = self.model.retrieve(
                [tokens[i] for i in rows], k=k, show_progress=False, n_threads=0
            )
            for i, idx, sc in zip(rows, docs.tolist(), scores.tolist(), strict=True):
                out[i] = [replace(self.passages[j], score=s) for j, s in zip(idx, sc, strict=True) if s > 0]
        return out


# ---- the tool --------------------------------------------------------------------------------------------


class SearchTool:
    """The `search` tool: the call's body is the query; stdout is the top `k` passages, formatted."""

    name = "search"

    def __init__(
        self, retriever: Retriever, k: int = 3, fmt: PassageFormat = "search_r1", max_output_chars: int = 8000
    ) -> None:
        if k < 1 or max_output_chars < 1:
            raise ValueError(f"k={k}, max_output_chars={max_output_chars}; both must be >= 1")
        format_passages([], fmt)  # validates fmt
        self.retriever, self.k, self.fmt, self.max_output_chars = retriever, k, fmt, max_output_chars
        self.description = f"search: write a search query; the top {k} passages come back"

    def run(self, args: str) -> ToolResult:
        t0 = time.perf_counter()
        query = " ".join(args.split())
        if not query:
            return ToolResult(stderr="error: empty search query\n", exit_code=2)
        try:
            (passages,) = self.retriever.search([query], self.k)
        except TimeoutError as e:
            return ToolResult(
                stderr=f"error: search timed out: {e}\n",
                exit_code=1,
                timed_out=True,
                wall_s=time.perf_counter() - t0,
                tool_failed=True,
            )
        except Exception as e:  # noqa: BLE001 - a broken backend is the call's failure, shown as one
            return ToolResult(
                stderr=f"error: search failed: {type(e).__name__}: {e}\n",
                exit_code=1,
                wall_s=time.perf_counter() - t0,
                tool_failed=True,
            )
        text = format_passages(passages, self.fmt) or "No passages matched the query.\n"
        cut = len(text) > self.max_output_chars
        return ToolResult(
            stdout=text[: self.max_output_chars], truncated=cut, wall_s=time.perf_counter() - t0
        )


def search_tool(
    corpus: str | None = None,
    url: str | None = None,
    k: int = 3,
    timeout_s: float = 10.0,
    fmt: PassageFormat = "search_r1",
    cache_dir: str | None = None,
    max_output_chars: int = 8000,
    max_attempts: int = 5,
) -> SearchTool:
    """The `search` tool factory (`TOOLS["search"]`): BM25 over a local `corpus` file, or the retrieval
    server at `url` (`.../retrieve`). Exactly one of them. With `url`, a call tries up to `max_attempts`
    times on connection errors and HTTP 5xx, all within `timeout_s` (`HTTPRetriever`)."""
    if (corpus is None) == (url is None):
        raise ValueError(
            "the search tool needs exactly one of corpus (a passage file) or url (a /retrieve URL)"
        )
    retriever: Retriever
    if corpus is not None:
        retriever = BM25Retriever(corpus, cache_dir=cache_dir if cache_dir is not None else CACHE_DIR)
    else:
        from rolerl.tools.retrieval_http import HTTPRetriever

        retriever = HTTPRetriever(url, timeout_s, max_attempts=max_attempts)  # type: ignore[arg-type]
    return SearchTool(retriever, k, fmt, max_output_chars)
