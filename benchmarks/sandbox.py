"""Python sandbox throughput: calls/s for a trivial snippet and a 0.5 s snippet at concurrency 1, 2 and 8.

Peer, in the same run: a bare `subprocess.run([python, "-I", "-c", code])` per call, the usual
unsandboxed way (no uid drop, no namespaces, no limits). The ratio says what the isolation costs, or
saves: our workers are forked from a warm zygote and pre-forked, the peer starts an interpreter each time.

    sudo .venv/bin/python benchmarks/sandbox.py [--repeats 5] [--json]

Needs root (the sandbox drops each call to a dedicated uid). With --json the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from rolerl.tools import PythonSandbox, SandboxConfig

SNIPPETS = {"trivial": "print(1 + 1)", "sleep_0.5s": "import time\ntime.sleep(0.5)\nprint('done')"}


def peer_run(code: str) -> str:
    return subprocess.run(
        [sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=10, env={}
    ).stdout


def calls_per_s(call: Callable[[str], str], code: str, concurrency: int, n_calls: int) -> float:
    with ThreadPoolExecutor(concurrency) as pool:
        t0 = time.perf_counter()
        outputs = list(pool.map(lambda _: call(code), range(n_calls)))
        elapsed = time.perf_counter() - t0
    assert all(out.strip() in ("2", "done") for out in outputs), outputs[:3]
    return n_calls / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5, help="median over this many timed runs per cell")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 8])
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("run as root: the sandbox drops each call to a dedicated uid")

    load_before = os.getloadavg()
    cfg = SandboxConfig(pool_size=max(args.concurrency), uid_base=63000, uid_count=100)
    rows = []
    with PythonSandbox(cfg) as sandbox:
        iso = sandbox.isolation
        ours = lambda code: sandbox.run(code).stdout  # noqa: E731
        for _ in range(20):  # warm up: zygote, pool, page cache
            ours(SNIPPETS["trivial"])
            peer_run(SNIPPETS["trivial"])
        latencies = []
        for _ in range(50):
            t0 = time.perf_counter()
            ours(SNIPPETS["trivial"])
            latencies.append(time.perf_counter() - t0)
        for name, code in SNIPPETS.items():
            for conc in args.concurrency:
                # Enough calls for ~1-3 s per timed run; the sleep snippet is wall-bound (0.5 s each).
                n_calls = max(4 * conc, 40) if name == "trivial" else 2 * conc
                ours_cps = statistics.median(
                    calls_per_s(ours, code, conc, n_calls) for _ in range(args.repeats)
                )
                peer_cps = statistics.median(
                    calls_per_s(peer_run, code, conc, n_calls) for _ in range(args.repeats)
                )
                rows.append(
                    {"snippet": name, "concurrency": conc, "calls": n_calls, "sandbox_calls_per_s": round(ours_cps, 2),
                     "subprocess_calls_per_s": round(peer_cps, 2), "ratio": round(ours_cps / peer_cps, 2)}
                )  # fmt: skip
                print(
                    f"{name:>11}  c={conc}  sandbox {ours_cps:7.1f}/s  bare subprocess {peer_cps:7.1f}/s  "
                    f"ratio {ours_cps / peer_cps:5.2f}",
                    flush=True,
                )
    result = {
        "benchmark": "python_sandbox",
        "rows": rows,
        "trivial_latency_ms_p50": round(statistics.median(latencies) * 1000, 2),
        "repeats": args.repeats,
        "isolation": {
            "uid_dropped": iso.uid != 0,
            "mount_ns": iso.mount_namespace,
            "net_ns": iso.network_namespace,
            "pid_ns": iso.pid_namespace,
            "ipc_ns": iso.ipc_namespace,
            "seccomp": iso.seccomp,
            "memory_cgroup": iso.memory_cgroup,
        },
        "cpus": os.cpu_count(),
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
        "kernel": platform.release(),
    }
    print(f"trivial call latency, c=1: p50 {result['trivial_latency_ms_p50']} ms")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
