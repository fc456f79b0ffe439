"""`rolerl serve-retriever` under load: HotpotQA BM25 (the 4858-paragraph IRCoT-500 corpus), 20 questions
per request, 8/32/64/256 clients on loopback, each configuration in its own server process.

Peer, in the same run: the stdlib's defaults that `serve-retriever` had before issue 49, reproduced by
configuration (`--backlog 5 --workers 0`: a listen backlog of 5, a thread per connection). Against it,
the sized backlog and the bounded worker pool (`--backlog 1024 --workers N`, one row per N given).

Each client level runs in rounds, as an RL step does: all clients are released at once (a barrier), each
sends one request on a fresh connection (plain `http.client`, no retries, so every refused or reset
connection counts as a failure), and the round ends when all have answered or failed. Rounds repeat until
about `--requests` requests were sent or `--level-s` seconds passed. Reported per level: requests
answered and failed (with the error kinds), p50 and p99 latency of the answered ones (from the release
to the last byte), and answered requests per second of wall time.

    .venv/bin/python benchmarks/retrieval_server.py [--clients 8 32 64 256] [--workers 16] [--json]

With --json the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import gzip
import http.client
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

DATA = Path(os.environ.get("ROLERL_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))
CORPUS = DATA / "qa/wiki_corpus/hotpotqa_ircot500_contexts_corpus.jsonl.gz"
QUESTIONS = DATA / "qa/hotpotqa/ircot_dev_subsampled_500.jsonl.gz"


def start_server(backlog: int, workers: int, cache: str) -> tuple[subprocess.Popen, str, int]:
    """`rolerl serve-retriever` on a free loopback port: the process, its host and port."""
    cmd = [sys.executable, "-m", "rolerl", "serve-retriever", str(CORPUS), "--port", "0", "--backlog", str(backlog),
           "--workers", str(workers), "--cache-dir", cache]  # fmt: skip
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:  # type: ignore[union-attr]
        if "serving retrieval at" in line:
            url = line.split("serving retrieval at http://")[1].split("/")[0]
            host, port = url.rsplit(":", 1)
            threading.Thread(target=proc.stderr.read, daemon=True).start()  # type: ignore[union-attr]
            return proc, host, int(port)
    raise RuntimeError(f"serve-retriever exited with {proc.wait()} before serving")


def one_request(host: str, port: int, body: bytes, timeout: float) -> tuple[str, float]:
    """`("ok" or the error's kind, seconds)` of one POST on a fresh connection."""
    t0 = time.perf_counter()
    try:
        conn = http.client.HTTPConnection(host, port, timeout=timeout)
        try:
            conn.request("POST", "/retrieve", body, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            data = resp.read()
        finally:
            conn.close()
        if resp.status != 200:
            return f"HTTP {resp.status}", time.perf_counter() - t0
        n = len(json.loads(data)["result"])
        return ("ok" if n == 20 else f"{n} results"), time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001 - counted by kind
        return type(e).__name__, time.perf_counter() - t0


def run_level(host: str, port: int, bodies: list[bytes], clients: int, args: argparse.Namespace) -> dict:
    rounds = max(1, math.ceil(args.requests / clients))
    results: list[tuple[str, float]] = []
    lock = threading.Lock()
    t0 = time.perf_counter()
    done_rounds = 0
    for r in range(rounds):
        if time.perf_counter() - t0 > args.level_s:
            break
        start = threading.Barrier(clients)

        def client(i: int, r: int = r, start: threading.Barrier = start) -> None:
            body = bodies[(r * clients + i) % len(bodies)]
            start.wait()
            out = one_request(host, port, body, args.timeout)
            with lock:
                results.append(out)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        done_rounds += 1
    wall = time.perf_counter() - t0
    ok = sorted(s for kind, s in results if kind == "ok")
    failed = Counter(kind for kind, _ in results if kind != "ok")
    q = statistics.quantiles(ok, n=100, method="inclusive") if len(ok) > 1 else ok * 99
    return {
        "clients": clients,
        "rounds": done_rounds,
        "requests": len(results),
        "ok": len(ok),
        "failed": sum(failed.values()),
        "errors": dict(failed),
        "p50_ms": round(1000 * statistics.median(ok), 1) if ok else None,
        "p99_ms": round(1000 * q[98], 1) if ok else None,
        "ok_per_s": round(len(ok) / wall, 1),
        "wall_s": round(wall, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, nargs="+", default=[8, 32, 64, 256])
    ap.add_argument(
        "--workers", type=int, nargs="+", default=[16], help="pool sizes to compare (one row each)"
    )
    ap.add_argument("--requests", type=int, default=512, help="about this many requests per client level")
    ap.add_argument("--level-s", type=float, default=60.0, help="no new round after this many seconds")
    ap.add_argument("--timeout", type=float, default=30.0, help="seconds one request may take")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = ap.parse_args()

    with gzip.open(QUESTIONS, "rt") as f:
        questions = [json.loads(line)["question_text"] for line in f]
    bodies = [
        json.dumps({"queries": questions[i : i + 20], "topk": 3, "return_scores": True}).encode()
        for i in range(0, len(questions) - 19, 20)
    ]
    configs = [("stdlib: backlog 5, thread per connection", 5, 0)]
    configs += [(f"rolerl: backlog 1024, {w} workers", 1024, w) for w in args.workers]
    load_before = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        for name, backlog, workers in configs:
            proc, host, port = start_server(backlog, workers, cache)
            try:
                for body in bodies[:4]:  # warm up: imports, page cache, the first search
                    assert one_request(host, port, body, args.timeout)[0] == "ok"
                for clients in args.clients:
                    row = {"server": name, "backlog": backlog, "workers": workers}
                    row |= run_level(host, port, bodies, clients, args)
                    rows.append(row)
                    print(
                        f"{name:42s} {clients:4d} clients: {row['ok']:4d} ok {row['failed']:4d} failed "
                        f"p50 {row['p50_ms']} ms p99 {row['p99_ms']} ms {row['ok_per_s']} ok/s {row['errors']}",
                        flush=True,
                    )
            finally:
                proc.send_signal(2)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
    try:
        from rolerl.hardware import describe

        machine = describe()
    except Exception as e:  # noqa: BLE001 - torch missing: name the CPU without it
        machine = f"{platform.processor() or platform.machine()} ({type(e).__name__})"
    summary = {
        "machine": machine,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "load_before": [round(x, 2) for x in load_before],
        "load_after": [round(x, 2) for x in os.getloadavg()],
        "queries_per_request": 20,
        "rows": rows,
    }
    print(f"machine: {machine}; load average before {summary['load_before']}, after {summary['load_after']}")
    if args.json:
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
