"""Retrieval over HTTP: a client for any Search-R1-style retrieval server (`HTTPRetriever`) and our own
such server over a local `Retriever` (`RetrieverServer`, `serve_retriever`, `rolerl serve-retriever`),
stdlib only. The wire protocol is Search-R1's `retrieval_server.py`: `POST /retrieve` with
`{"queries": [...], "topk": k, "return_scores": true}` answers
`{"result": [[{"document": {"id", "contents": "title\\ntext"}, "score": s}, ...], ...]}` (without
`return_scores`, each list holds the documents alone)."""

from __future__ import annotations

import http.client
import json
import logging
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from rolerl.tools.search import Passage, Retriever, RetrieverError

log = logging.getLogger(__name__)


def _doc_passage(item: Any, where: str) -> Passage:
    """A Search-R1 result entry: `{"document": doc, "score": s}`, or a bare `doc` (no `return_scores`)."""
    doc, score = (
        (item.get("document"), item.get("score", 0.0))
        if isinstance(item, dict) and "document" in item
        else (item, 0.0)
    )
    if not isinstance(doc, dict) or not isinstance(score, (int, float)):
        raise RetrieverError(f"{where}: a result entry is {str(item)[:200]!r}; need a document object")
    # `contents` first: Search-R1's client formats that, so the text matches what its models saw.
    if isinstance(doc.get("contents"), str):
        title, _, text = doc["contents"].partition("\n")
    elif isinstance(doc.get("text"), str):
        title, text = str(doc.get("title", "")), doc["text"]
    else:
        raise RetrieverError(f"{where}: a document has neither 'contents' nor 'text': {sorted(doc)}")
    return Passage(str(doc.get("id", "")), title, text, float(score))


class HTTPRetriever:
    """A client of a retrieval server (Search-R1's `retrieval_server.py` or `serve_retriever`). Raises
    `RetrieverError` on an HTTP error or a malformed answer and `TimeoutError` after `timeout_s` of
    silence (urllib's timeout is per socket operation, not for the whole exchange)."""

    def __init__(self, url: str, timeout_s: float = 10.0) -> None:
        parsed = urllib.parse.urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(f"url={url!r}; need http(s)://host:port/retrieve")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s}; need > 0")
        self.url, self.timeout_s = url, timeout_s
        # a loopback server is never behind the user's HTTP proxy
        local = parsed.hostname in ("localhost", "127.0.0.1", "::1")
        self._opener = urllib.request.build_opener(*([urllib.request.ProxyHandler({})] if local else []))

    def search(self, queries: Sequence[str], k: int) -> list[list[Passage]]:
        if isinstance(queries, str):
            raise TypeError("queries is one string; pass a list of query strings")
        body = json.dumps({"queries": list(queries), "topk": k, "return_scores": True}).encode()
        req = urllib.request.Request(self.url, data=body, headers={"Content-Type": "application/json"})
        try:
            with self._opener.open(req, timeout=self.timeout_s) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            detail = e.read(300).decode("utf-8", "replace").strip()
            raise RetrieverError(f"{self.url} answered HTTP {e.code}: {detail}") from None
        except OSError as e:  # URLError (refused, DNS), a timeout, a reset or closed connection
            reason = e.reason if isinstance(e, urllib.error.URLError) else e
            if isinstance(reason, TimeoutError):
                raise TimeoutError(f"{self.url}: no answer within {self.timeout_s} s") from None
            raise RetrieverError(f"{self.url}: {type(reason).__name__}: {reason}") from None
        except http.client.HTTPException as e:  # a malformed HTTP answer
            raise RetrieverError(f"{self.url}: {type(e).__name__}: {e}") from None
        try:
            result = json.loads(raw)["result"]
        except (ValueError, KeyError, TypeError):
            raise RetrieverError(
                f"{self.url} answered {raw[:200]!r}; need JSON {{'result': [...]}}"
            ) from None
        if not isinstance(result, list) or [type(r) for r in result] != [list] * len(queries):
            raise RetrieverError(f"{self.url}: 'result' must hold one list per query ({len(queries)})")
        return [[_doc_passage(item, self.url) for item in hits] for hits in result]


class _BadRequest(ValueError):
    pass


class RetrieverServer(ThreadingHTTPServer):
    """A Search-R1-compatible `POST /retrieve` over any `Retriever`, one thread per connection."""

    daemon_threads = True
    max_queries, max_topk, max_body_bytes = 1024, 1000, 8 << 20

    def __init__(self, retriever: Retriever, host: str, port: int, default_k: int = 3) -> None:
        self.retriever, self.default_k = retriever, default_k
        super().__init__((host, port), _RetrieveHandler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}/retrieve"

    def parse(self, body: bytes) -> tuple[list[str], int, bool]:
        """`(queries, topk, return_scores)` of a request body; `_BadRequest` names what is wrong."""
        try:
            req = json.loads(body)
        except ValueError as e:
            raise _BadRequest(f"the body is not JSON: {e}") from None
        if not isinstance(req, dict):
            raise _BadRequest("the body must be a JSON object with 'queries'")
        queries, k, scores = req.get("queries"), req.get("topk"), req.get("return_scores", False)
        if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries) or not queries:
            raise _BadRequest("'queries' must be a non-empty list of strings")
        if len(queries) > self.max_queries:
            raise _BadRequest(f"{len(queries)} queries; at most {self.max_queries} per request")
        k = self.default_k if k is None else k
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= self.max_topk:
            raise _BadRequest(f"'topk'={k!r}; allowed: an integer in 1..{self.max_topk}")
        if not isinstance(scores, bool):
            raise _BadRequest(f"'return_scores'={scores!r}; allowed: true or false")
        return queries, k, scores


class _RetrieveHandler(BaseHTTPRequestHandler):
    server: RetrieverServer
    protocol_version = "HTTP/1.1"
    timeout = 60  # seconds a connection may sit silent (a stalled client must not hold a thread forever)

    def _send(self, status: int, payload: dict[str, Any]) -> None:
        body = json.dumps(payload, ensure_ascii=False).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self._send(405, {"error": "use POST /retrieve with JSON {'queries': [...], 'topk': k}"})

    def do_POST(self) -> None:
        if urllib.parse.urlparse(self.path).path != "/retrieve":
            return self._send(404, {"error": f"unknown path {self.path!r}; POST /retrieve"})
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            self.close_connection = True
            return self._send(411, {"error": "a Content-Length header is required"})
        if not 0 <= length <= self.server.max_body_bytes:
            self.close_connection = True
            return self._send(413, {"error": f"body of {length} bytes; at most {self.server.max_body_bytes}"})
        try:
            queries, k, with_scores = self.server.parse(self.rfile.read(length))
        except _BadRequest as e:
            return self._send(400, {"error": str(e)})
        try:
            hits = self.server.retriever.search(queries, k)
        except Exception as e:  # noqa: BLE001 - the client gets the error; the server keeps serving
            log.exception("retrieval failed for %d queries", len(queries))
            return self._send(500, {"error": f"retrieval failed: {type(e).__name__}: {e}"})

        def entry(p: Passage) -> dict[str, Any]:
            doc = {"id": p.id, "contents": f"{p.title}\n{p.text}"}
            return {"document": doc, "score": p.score} if with_scores else doc

        self._send(200, {"result": [[entry(p) for p in ps] for ps in hits]})

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's signature
        log.debug("%s - %s", self.address_string(), format % args)


def serve_retriever(
    retriever: Retriever, host: str = "127.0.0.1", port: int = 8000, default_k: int = 3
) -> None:
    """Serve `retriever` at `http://host:port/retrieve` until interrupted (`rolerl serve-retriever`)."""
    server = RetrieverServer(retriever, host, port, default_k)
    log.warning("serving retrieval at %s (Ctrl-C stops)", server.url)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
