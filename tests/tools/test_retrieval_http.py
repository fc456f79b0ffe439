"""The retrieval server under load (a sized backlog and a bounded worker pool), the client's retries (on
connection errors and 5xx, within the deadline; never on 4xx), `rolerl serve-retriever` as a process, and
the import direction between `rolerl.tools.search` and `rolerl.tools.retrieval_http`. All on loopback."""

from __future__ import annotations

import ast
import http.client
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

import rolerl.tools.retrieval_http as retrieval_http
import rolerl.tools.search as search
from rolerl.tools.retrieval_http import HTTPRetriever, RetrieverServer
from rolerl.tools.retrieval_types import Passage, RetrieverError
from rolerl.tools.search import SearchTool

CORPUS = {"p0": ("Paris", "Paris is the capital of France."), "p1": ("Rome", "Rome has the Colosseum.")}


class _Words:
    """A tiny in-memory retriever: the passages sharing a word with the query, scored by how many.
    Records which threads ran it and the most searches that ran at once."""

    def __init__(self, hold: threading.Event | None = None) -> None:
        self.threads: set[str] = set()
        self.running = self.most_at_once = 0
        self.entered, self.hold = threading.Event(), hold
        self._lock = threading.Lock()

    def search(self, queries: Sequence[str], k: int) -> list[list[Passage]]:
        with self._lock:
            self.threads.add(threading.current_thread().name)
            self.running += 1
            self.most_at_once = max(self.most_at_once, self.running)
        self.entered.set()
        if self.hold is not None:
            assert self.hold.wait(10)
        try:
            out = []
            for q in queries:
                words = set(re.findall(r"\w+", q.lower()))
                scored = [
                    (len(words & set(re.findall(r"\w+", f"{t} {x}".lower()))), i)
                    for i, (t, x) in CORPUS.items()
                ]
                out.append(
                    [Passage(i, *CORPUS[i], float(s)) for s, i in sorted(scored, reverse=True) if s][:k]
                )
            return out
        finally:
            with self._lock:
                self.running -= 1


@contextmanager
def _serving(server: ThreadingHTTPServer) -> Iterator[ThreadingHTTPServer]:
    threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True).start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def _url(server: ThreadingHTTPServer) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}/retrieve"


# ---- the server under load -------------------------------------------------------------------------------


def _burst(url: str, clients: int) -> list[object]:
    """`clients` threads released at once, one request each, no retries: each one's passages or error."""
    client = HTTPRetriever(url, timeout_s=30, max_attempts=1)
    start, out = threading.Barrier(clients), [None] * clients

    def one(i: int) -> None:
        start.wait()
        try:
            out[i] = client.search(["capital of France", "Colosseum"], 1)
        except Exception as e:  # noqa: BLE001 - counted by the test
            out[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def test_256_simultaneous_clients_are_all_answered_by_a_bounded_pool():
    """The stdlib's backlog of 5 resets most of 256 simultaneous connections (~200 of 256 here, measured
    with workers=0, backlog=5); the sized backlog queues them and 4 workers answer every one."""
    words = _Words()
    with _serving(RetrieverServer(words, "127.0.0.1", 0, workers=4)) as server:
        t0 = time.perf_counter()
        out = _burst(server.url, 256)
        took = time.perf_counter() - t0
    # by hand: "capital of France" shares capital, of, france with p0; "Colosseum" one word with p1
    expected = [[Passage("p0", *CORPUS["p0"], 3.0)], [Passage("p1", *CORPUS["p1"], 1.0)]]
    failed = [o for o in out if not isinstance(o, list)]
    assert not failed, f"{len(failed)} of 256 failed, e.g. {failed[0]!r}"
    assert out == [expected] * 256
    # the pool bounds the threads: only its 4 workers ever searched, at most 4 at a time
    assert words.threads <= {f"retriever-worker-{i}" for i in range(4)} and words.most_at_once <= 4
    print(f"256 simultaneous clients answered in {took:.2f} s")


def test_thread_per_connection_is_still_available():
    words = _Words()
    with _serving(RetrieverServer(words, "127.0.0.1", 0, workers=0)) as server:
        out = _burst(server.url, 8)
    assert all(isinstance(o, list) for o in out)
    assert not any(name.startswith("retriever-worker") for name in words.threads)


def test_server_options_are_validated():
    with pytest.raises(ValueError, match=r"workers=-1, backlog=1024.*allowed: workers >= 0"):
        RetrieverServer(_Words(), "127.0.0.1", 0, workers=-1)
    with pytest.raises(ValueError, match=r"backlog=0.*backlog >= 1"):
        RetrieverServer(_Words(), "127.0.0.1", 0, backlog=0)


def test_an_idle_kept_alive_connection_does_not_hold_the_only_worker():
    """With one worker, a client that keeps its connection open and idle holds that worker for at most
    `keepalive_s`; then the next client is served (it would wait the 60 s request timeout otherwise)."""
    with _serving(RetrieverServer(_Words(), "127.0.0.1", 0, workers=1, keepalive_s=0.3)) as server:
        idle = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=5)
        idle.request("POST", "/retrieve", b'{"queries": ["Paris"]}')
        first = idle.getresponse()
        assert first.status == 200 and first.getheader("Connection") is None  # kept alive
        first.read()
        t0 = time.perf_counter()
        assert HTTPRetriever(server.url, timeout_s=5, max_attempts=1).search(["Rome"], 1)[0][0].id == "p1"
        waited = time.perf_counter() - t0
        idle.close()
    assert waited < 0.3 + 2.0, f"the second client waited {waited:.2f} s"


def test_a_connection_is_closed_after_its_answer_while_others_wait():
    """While connections wait for a worker, an answer says `Connection: close`, freeing the worker."""
    hold = threading.Event()
    words = _Words(hold)
    with _serving(RetrieverServer(words, "127.0.0.1", 0, workers=1)) as server:
        first = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=10)
        first.request("POST", "/retrieve", b'{"queries": ["Paris"]}')
        assert words.entered.wait(5)  # the only worker is busy with the first request
        waiting = threading.Thread(target=_burst, args=(server.url, 1))
        waiting.start()
        deadline = time.monotonic() + 5
        while not server.backlogged() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.backlogged()
        hold.set()
        answer = first.getresponse()
        assert answer.status == 200 and answer.getheader("Connection") == "close"
        answer.read()
        waiting.join(10)
        first.close()


# ---- the client's retries --------------------------------------------------------------------------------


class _ResetFirst(ThreadingHTTPServer):
    """Resets its first `resets` connections (SO_LINGER 0 makes close() send RST), then answers them
    with its handler."""

    daemon_threads = True

    def __init__(self, resets: int, handler: type[BaseHTTPRequestHandler]) -> None:
        self.resets, self.accepted = resets, 0
        super().__init__(("127.0.0.1", 0), handler)

    def verify_request(self, request, client_address) -> bool:
        self.accepted += 1
        if self.accepted <= self.resets:
            request.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            request.close()
            return False
        return True


class _Scripted(BaseHTTPRequestHandler):
    """Answers the n-th POST with `replies[n]` (the last one from then on), counting them in `seen`."""

    replies: list[int] = [200]
    seen: list[int]
    body = json.dumps({"result": [[{"document": {"id": "7", "contents": "T\nx"}, "score": 2.5}]]}).encode()

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.seen.append(1)
        status = self.replies[min(len(self.seen), len(self.replies)) - 1]
        body = self.body if status == 200 else b'{"error": "busy"}'
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def _scripted(*replies: int) -> type[_Scripted]:
    return type("Scripted", (_Scripted,), {"replies": list(replies), "seen": []})


ANSWER = [[Passage("7", "T", "x", 2.5)]]


def test_reset_connections_are_retried():
    with _serving(_ResetFirst(2, _scripted(200))) as server:
        assert (
            HTTPRetriever(_url(server), timeout_s=5, max_attempts=3, backoff_s=0.01).search(["q"], 1)
            == ANSWER
        )
        assert server.accepted == 3
    with _serving(_ResetFirst(2, _scripted(200))) as server:
        client = HTTPRetriever(_url(server), timeout_s=5, max_attempts=2, backoff_s=0.01)
        with pytest.raises(RetrieverError) as info:
            client.search(["q"], 1)
        assert server.accepted == 2
    message = str(info.value)
    assert message.startswith(_url(server)) and "failed after 2 attempt(s)" in message
    assert "ConnectionResetError" in message or "BrokenPipeError" in message  # which depends on timing


def test_503_twice_then_200_is_retried_with_a_backoff():
    handler = _scripted(503, 503, 200)
    with _serving(ThreadingHTTPServer(("127.0.0.1", 0), handler)) as server:
        t0 = time.perf_counter()
        assert HTTPRetriever(_url(server), timeout_s=5, backoff_s=0.05).search(["q"], 1) == ANSWER
        took = time.perf_counter() - t0
    assert len(handler.seen) == 3
    assert took >= 0.05 * 0.5 + 0.1 * 0.5  # two backoffs, each at least half its nominal 0.05 and 0.1 s


def test_4xx_is_not_retried():
    handler = _scripted(400)
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    with _serving(server), pytest.raises(RetrieverError, match=r"answered HTTP 400: .*busy"):
        HTTPRetriever(_url(server), timeout_s=5, backoff_s=0.01).search(["q"], 1)
    assert len(handler.seen) == 1


def test_retries_stop_at_the_deadline_and_the_tool_reports_them():
    with _serving(_ResetFirst(10**9, _scripted(200))) as server:
        client = HTTPRetriever(
            _url(server), timeout_s=1.0, max_attempts=1000, backoff_s=0.02, max_backoff_s=0.1
        )
        t0 = time.perf_counter()
        result = SearchTool(client).run("who wrote hamlet")
        took = time.perf_counter() - t0
    assert took < 1.0 + 1.0, f"retries went on for {took:.2f} s past a 1 s deadline"
    attempts = server.accepted
    assert 2 <= attempts < 1000
    assert not result.ok and result.tool_failed and not result.timed_out and result.stdout == ""
    assert f"failed after {attempts} attempt(s)" in result.stderr and "timeout_s=1.0" in result.stderr


def test_a_refused_connection_is_retried_then_reported():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    client = HTTPRetriever(f"http://127.0.0.1:{port}/retrieve", timeout_s=5, max_attempts=3, backoff_s=0.01)
    with pytest.raises(RetrieverError, match=r"failed after 3 attempt\(s\).*ConnectionRefusedError"):
        client.search(["q"], 1)


def test_client_options_are_validated():
    with pytest.raises(ValueError, match="max_attempts=0; need >= 1"):
        HTTPRetriever("http://127.0.0.1:1/retrieve", max_attempts=0)
    with pytest.raises(ValueError, match="backoff_s=3.0, max_backoff_s=2.0"):
        HTTPRetriever("http://127.0.0.1:1/retrieve", backoff_s=3.0)


# ---- `rolerl serve-retriever` as a process ---------------------------------------------------------------


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_serve_retriever_command(tmp_path, stop):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(
        "".join(json.dumps({"id": i, "title": t, "text": x}) + "\n" for i, (t, x) in CORPUS.items())
    )
    # `rolerl` with Ctrl-C's SIGINT handled as in a terminal: a suite run as a background job (`make test &`)
    # passes its children SIGINT ignored, and the command rightly keeps that (as under nohup)
    rolerl = (
        "import signal, sys; signal.signal(2, signal.default_int_handler); from rolerl.cli import main; "
        "sys.exit(main())"
    )
    cmd = [sys.executable, "-c", rolerl, "serve-retriever", str(corpus), "--port", "0", "--workers", "2",
           "--cache-dir", str(tmp_path / "cache")]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    try:
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)  # type: ignore[arg-type]
        reader.start()
        deadline = time.monotonic() + 60
        while not any("serving retrieval at" in line for line in lines) and time.monotonic() < deadline:
            assert proc.poll() is None, f"serve-retriever exited early: {''.join(lines)}"
            time.sleep(0.05)
        (line,) = [line for line in lines if "serving retrieval at" in line]
        assert "with 2 worker threads, backlog 1024" in line
        url = line.split("serving retrieval at ")[1].split()[0]
        assert url.startswith("http://127.0.0.1:") and url.endswith("/retrieve")
        req = urllib.request.Request(url, data=b'{"queries": ["Colosseum"], "topk": 1}')
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert json.loads(resp.read()) == {
                "result": [[{"id": "p1", "contents": "Rome\nRome has the Colosseum."}]]
            }
        proc.send_signal(stop)  # Ctrl-C or a kill: the server closes and the command returns 0
        assert proc.wait(30) == 0
        with pytest.raises(urllib.error.URLError):  # the port is closed
            urllib.request.urlopen(req, timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_serve_retriever_help_names_the_pool_and_backlog():
    out = subprocess.run(
        [sys.executable, "-m", "rolerl", "serve-retriever", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    assert "--workers WORKERS" in out and "--backlog BACKLOG" in out and "(default: 16)" in out


# ---- the import direction --------------------------------------------------------------------------------


def _imports(module) -> list[tuple[str, bool]]:
    """`(imported module, at module level)` for every import in `module`'s source."""
    tree = ast.parse(Path(module.__file__).read_text())
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.append((node.module, id(node) in top))
        elif isinstance(node, ast.Import):
            found += [(alias.name, id(node) in top) for alias in node.names]
    return found


def test_search_and_the_http_module_do_not_import_each_other_at_import_time():
    assert ("rolerl.tools.search", True) not in _imports(retrieval_http)
    assert ("rolerl.tools.search", False) not in _imports(retrieval_http)
    assert ("rolerl.tools.retrieval_http", True) not in _imports(search)  # only inside search_tool()
    code = "import sys, rolerl.tools.retrieval_http; print('rolerl.tools.search' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"
    # the old names still work
    assert search.Passage is Passage and search.RetrieverError is RetrieverError
    assert search.Retriever is retrieval_http.Retriever
