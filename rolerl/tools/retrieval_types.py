"""The types every retriever shares: `Passage`, the `Retriever` Protocol and `RetrieverError`.

They sit below both their users, the local BM25 index and the search tool (`rolerl.tools.search`) and
the HTTP client and server (`rolerl.tools.retrieval_http`), so neither of those imports the other at
import time. `rolerl.tools.search` re-exports them under their old names."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Passage:
    id: str
    title: str
    text: str
    score: float = 0.0  # the retriever's score for the query it answered (0.0 when unknown)


class Retriever(Protocol):
    def search(self, queries: Sequence[str], k: int) -> list[list[Passage]]:
        """The top `k` passages of each query, best first (fewer when fewer match)."""
        ...


class RetrieverError(RuntimeError):
    """The retrieval backend failed (an HTTP error, an answer of the wrong shape). Timeouts raise
    `TimeoutError` instead, so the tool can mark them as such."""
