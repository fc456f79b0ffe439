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
import queue
import random
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from rolerl.signals import sigterm_raises
from rolerl.tools.retrieval_types import Passage, Retriever, RetrieverError

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


class _Transient(Exception):
    """An attempt failed in a way that the next attempt may not: the server refused, reset or dropped the
    connection (busy, restarting), or answered 5xx. `/retrieve` only reads, so repeating it is safe."""


class HTTPRetriever:
    """A client of a retrieval server (Search-R1's `retrieval_server.py` or `serve_retriever`).

    One `search` may make up to `max_attempts` attempts: a refused, reset or dropped connection or an
    HTTP 5xx is retried after an exponential backoff (`backoff_s`, doubling, at most `max_backoff_s`,
    each scaled by a random factor in [0.5, 1] so that many clients failed together do not return
    together), all within `timeout_s` from the call's start: a retry that could not begin before then is
    not made. After that it raises `RetrieverError` naming the URL, the attempts and the last error. A 4xx
    or a malformed answer is raised at once (repeating the same request cannot fix it), and silence
    raises `TimeoutError` (each attempt's socket timeout is what remains of `timeout_s`; urllib's timeout
    bounds each socket operation, not the whole exchange)."""

    def __init__(
        self,
        url: str,
        timeout_s: float = 10.0,
        *,
        max_attempts: int = 5,
        backoff_s: float = 0.1,
        max_backoff_s: float = 2.0,
    ) -> None:
        parsed = urllib.parse.urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(f"url={url!r}; need http(s)://host:port/retrieve")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s}; need > 0")
        if max_attempts < 1:
            raise ValueError(f"max_attempts={max_attempts}; need >= 1 (1: never retry)")
        if not 0 <= backoff_s <= max_backoff_s:
            raise ValueError(
                f"backoff_s={backoff_s}, max_backoff_s={max_backoff_s}; need 0 <= backoff_s <= max"
            )
        self.url, self.timeout_s, self.max_attempts = url, timeout_s, max_attempts
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self._jitter = random.Random()  # its own stream: seeding the global RNG must not synchronise clients
        # a loopback server is never behind the user's HTTP proxy
        local = parsed.hostname in ("localhost", "127.0.0.1", "::1")
        self._opener = urllib.request.build_opener(*([urllib.request.ProxyHandler({})] if local else []))

    def search(self, queries: Sequence[str], k: int) -> list[list[Passage]]:
        if isinstance(queries, str):
            raise TypeError("queries is one string; pass a list of query strings")
        body = json.dumps({"queries": list(queries), "topk": k, "return_scores": True}).encode()
        start = time.monotonic()
        deadline = start + self.timeout_s
        for attempt in range(1, self.max_attempts + 1):
            try:
                raw = self._post(body, deadline, attempt)
                break
            except _Transient as e:
                last = e
            delay = self._backoff(attempt)
            if attempt == self.max_attempts or time.monotonic() + delay >= deadline:
                raise RetrieverError(
                    f"{self.url}: failed after {attempt} attempt(s) in {time.monotonic() - start:.2f} s "
                    f"(max_attempts={self.max_attempts}, timeout_s={self.timeout_s}); last error: {last}"
                ) from None
            log.debug("%s: attempt %d failed (%s); retrying in %.2f s", self.url, attempt, last, delay)
            time.sleep(delay)
        return self._parse(raw, len(queries))

    def _backoff(self, attempt: int) -> float:
        """Seconds to wait after failed attempt `attempt` (1-based): doubling, capped, with jitter."""
        return min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1)) * self._jitter.uniform(0.5, 1)

    def _post(self, body: bytes, deadline: float, attempt: int) -> bytes:
        """One attempt's answer body; `_Transient` when another attempt may succeed."""
        req = urllib.request.Request(self.url, data=body, headers={"Content-Type": "application/json"})
        try:
            with self._opener.open(req, timeout=max(deadline - time.monotonic(), 1e-3)) as resp:
                return resp.read()
        except urllib.error.HTTPError as e:
            detail = e.read(300).decode("utf-8", "replace").strip()
            if e.code >= 500:
                raise _Transient(f"HTTP {e.code}: {detail}") from None
            raise RetrieverError(f"{self.url} answered HTTP {e.code}: {detail}") from None
        except OSError as e:  # URLError (refused, DNS), a timeout, a reset or closed connection
            reason = e.reason if isinstance(e, urllib.error.URLError) else e
            if isinstance(reason, TimeoutError):
                raise TimeoutError(
                    f"{self.url}: no answer within {self.timeout_s} s (attempt {attempt})"
                ) from None
            if isinstance(reason, ConnectionError):  # refused, reset, aborted; RemoteDisconnected too
                raise _Transient(f"{type(reason).__name__}: {reason}") from None
            raise RetrieverError(f"{self.url}: {type(reason).__name__}: {reason}") from None
        except http.client.IncompleteRead as e:  # the connection closed mid-answer
            raise _Transient(f"{type(e).__name__}: {e}") from None
        except http.client.HTTPException as e:  # a malformed HTTP answer
            raise RetrieverError(f"{self.url}: {type(e).__name__}: {e}") from None

    def _parse(self, raw: bytes, n_queries: int) -> list[list[Passage]]:
        try:
            result = json.loads(raw)["result"]
        except (ValueError, KeyError, TypeError):
            raise RetrieverError(
                f"{self.url} answered {raw[:200]!r}; need JSON {{'result': [...]}}"
            ) from None
        if not isinstance(result, list) or [type(r) for r in result] != [list] * n_queries:
            raise RetrieverError(f"{self.url}: 'result' must hold one list per query ({n_queries})")
        return [[_doc_passage(item, self.url) for item in hits] for hits in result]


class _BadRequest(ValueError):
    pass


class RetrieverServer(ThreadingHTTPServer):
    """A Search-R1-compatible `POST /retrieve` over any `Retriever`.

    Sized for an RL step's burst (every episode of a batch searching at once, or several trainers sharing
    one server): the kernel queues up to `backlog` connections not yet accepted (the stdlib's default of
    5 overflows at ~32 simultaneous clients and the excess are reset), and a fixed pool of `workers`
    threads serves the accepted ones in turn, so 256 clients cost 256 queued sockets, not 256 threads
    contending for the GIL. `workers=0` is the stdlib's thread per connection (benchmarks compare it).
    Between requests a kept-alive connection waits at most `keepalive_s` (uvicorn's 5 s), and while
    connections are waiting for a worker an answer closes its connection, so idle connections never
    starve the pool."""

    daemon_threads = True
    max_queries, max_topk, max_body_bytes = 1024, 1000, 8 << 20

    def __init__(
        self,
        retriever: Retriever,
        host: str,
        port: int,
        default_k: int = 3,
        *,
        workers: int = 16,
        backlog: int = 1024,
        keepalive_s: float = 5.0,
    ) -> None:
        if workers < 0 or backlog < 1 or keepalive_s <= 0:
            raise ValueError(
                f"workers={workers}, backlog={backlog}, keepalive_s={keepalive_s}; allowed: workers >= 0 "
                "(0: a thread per connection), backlog >= 1, keepalive_s > 0"
            )
        self.retriever, self.default_k = retriever, default_k
        self.workers, self.keepalive_s = workers, keepalive_s
        self.request_queue_size = backlog  # read by server_activate's listen(), inside __init__ below
        self._jobs: queue.SimpleQueue[tuple[Any, Any] | None] = queue.SimpleQueue()
        self._waiting = 0  # connections accepted and not yet taken by a worker
        self._lock = threading.Lock()
        super().__init__((host, port), _RetrieveHandler)
        for i in range(workers):  # daemons: a stalled client must not keep the process from exiting
            threading.Thread(target=self._work, name=f"retriever-worker-{i}", daemon=True).start()

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.workers:
            return super().process_request(request, client_address)  # a new thread per connection
        with self._lock:
            self._waiting += 1
        self._jobs.put((request, client_address))

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            with self._lock:
                self._waiting -= 1
            self.process_request_thread(*job)  # handles, reports errors, closes the connection

    def backlogged(self) -> bool:
        """Whether accepted connections are waiting for a worker."""
        return self._waiting > 0

    def server_close(self) -> None:
        super().server_close()
        for _ in range(self.workers):  # each worker ends after the connections queued before it
            self._jobs.put(None)

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
    timeout = 60  # seconds a request may sit silent (a stalled client must not hold a worker forever)
    disable_nagle_algorithm = True  # headers and body are two writes: Nagle would hold the body ~40 ms

    def handle(self) -> None:
        self.close_connection = True
        self.handle_one_request()
        while not self.close_connection:  # kept alive: wait for the next request less long
            self.connection.settimeout(self.server.keepalive_s)
            self.handle_one_request()

    def parse_request(self) -> bool:
        self.connection.settimeout(self.timeout)  # a request line came: the rest gets the full timeout
        return super().parse_request()

    def _send(self, status: int, payload: dict[str, Any]) -> None:
        body = json.dumps(payload, ensure_ascii=False).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        if self.close_connection or self.server.backlogged():  # free this worker for a waiting one
            self.send_header("Connection", "close")  # also sets close_connection
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


def _somaxconn() -> int | None:
    """The kernel's cap on a listen backlog (Linux), or None where unknown."""
    try:
        return int(Path("/proc/sys/net/core/somaxconn").read_text())
    except (OSError, ValueError):
        return None


def serve_retriever(
    retriever: Retriever,
    host: str = "127.0.0.1",
    port: int = 8000,
    default_k: int = 3,
    *,
    workers: int = 16,
    backlog: int = 1024,
) -> None:
    """Serve `retriever` at `http://host:port/retrieve` until interrupted (`rolerl serve-retriever`)."""
    server = RetrieverServer(retriever, host, port, default_k, workers=workers, backlog=backlog)
    cap = _somaxconn()
    if cap is not None and cap < backlog:
        log.warning("the kernel caps the listen backlog at net.core.somaxconn = %d (asked: %d)", cap, backlog)
    pool = f"{workers} worker threads" if workers else "a thread per connection"
    log.warning("serving retrieval at %s with %s, backlog %d (Ctrl-C stops)", server.url, pool, backlog)
    try:
        with sigterm_raises():  # SIGTERM (kill, systemd, docker stop) ends it as Ctrl-C does
            server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
