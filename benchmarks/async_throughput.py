"""Asynchronous training's throughput (issue 50): the demo's GRPO (tool-integrated reasoning with the Python
sandbox) synchronous and with its rollouts 1 and 2 training steps behind, with the tool as fast as the
sandbox is and with added latency (a remote sandbox or search service: every call sleeps `--latency` more).

Each arm is one `rolerl demo` in a subprocess of its own (`run_demo`: the same imitation warm start, then
`--steps` GRPO steps; small held-out evaluations, which are not timed here), one after the other, the same
seed. The demo takes `train.mini_batches: 2` optimizer steps per training step, so a lag of L training
steps is `train.max_staleness: 2L`. Per arm, from the run's metrics.jsonl (the first step, which overlaps
nothing, left out):

  steps/hour    3600 / the median `time/step`
  trainer idle  the share of the steps' time the trainer waited for episodes (`time/rollout`: in the
                synchronous loop the whole rollout, asynchronously only the wait for the rollout thread)
  engine idle   the share of that time the engine did not generate: the update's share synchronously,
                1 - the rollout thread's generation time (`time/rollout_thread`) over the steps' time otherwise

`--workload search`: the search agent (Search-R1's loop, `rolerl train search-agent`, DART's adapters) on
HotpotQA's 500 IRCoT questions against a real retrieval server (`rolerl serve-retriever` over their
contexts, started here on a free port), each search slowed by `--latency` on the client (a remote index).
The untrained model never searches (docs/RESULTS.md, 0 of 500), so the arms start from a small imitation
warm start built here once (`--demos` questions: a `<search>` for the question, the server's real
passages, the gold answer in `<answer>`; `rolerl sft search-agent`). `train.mini_batches` is 1 there: a
lag of L steps is `train.max_staleness: L`.

On a CPU the rollout thread and the update share the same cores, so overlapping them gains only what one
of them leaves idle (tool latency, the GIL-free waits); on a GPU with the engine on other devices (or a vLLM
server) the update and the generation each have their own hardware. docs/BENCHMARKS.md has the table.

    .venv/bin/python benchmarks/async_throughput.py --json                     # ~25 min on 2 cores
    .venv/bin/python benchmarks/async_throughput.py --lags 0 1 --latency 0.5   # a subset
    .venv/bin/python benchmarks/async_throughput.py --out runs/async --json    # resumes: finished arms are read
    .venv/bin/python benchmarks/async_throughput.py --workload search --latency 0.5 --out runs/async-search
With --json the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

MINI_BATCHES = 2  # demo.yaml's train.mini_batches: optimizer steps per training step


def child(args) -> None:
    """One arm in this process: the workload's tool slowed by `latency` seconds a call, then its training."""
    import rolerl.tools as tools

    tool = "search" if args.workload == "search" else "python"
    latency, make = args.latency, tools.TOOLS[tool]

    class Slow:
        def __init__(self, inner) -> None:
            self.inner, self.name, self.description = inner, inner.name, inner.description

        def run(self, code: str):
            time.sleep(latency)
            return self.inner.run(code)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    if latency > 0:
        tools.TOOLS[tool] = lambda **o: Slow(make(**o))
    if args.workload == "search":
        from rolerl.cli import main as cli

        sets = [*SEARCH_SETS, f"rollout.tool_options={{url: '{args.url}', k: 3}}", f"train.steps={args.steps}",
                f"train.max_staleness={args.lag}", f"adapters.init={args.warm}", f"run.seed={args.seed}",
                f"run.dir={args.run_dir}"]  # fmt: skip
        if cli(["train", "search-agent", "--set", *sets]) != 0:
            raise SystemExit(f"rolerl train search-agent failed ({args.run_dir})")
        return
    from rolerl.demo import DemoSettings, run_demo

    settings = DemoSettings(
        run_dir=args.run_dir, seed=args.seed, demos=args.demos, eval_format=8, eval_rl=8, eval_base=8,
        rl_steps=args.steps,
        overrides=(f"train.max_staleness={MINI_BATCHES * args.lag}", "run.progress=false",
                   "run.tensorboard=false", "run.checkpoint_every=1000"),
    )  # fmt: skip
    run_demo(settings, log=lambda *a: None)


# the search agent's arms: 4 questions x 4 samples a step, 128 new tokens a call, at most 2 searches; as the
# demo: fp32 weights (bf16 autocast, rollouts from a bf16 copy where the CPU has bf16), PPO's old log-probs
# recomputed by the trainer and TIS capped at 2 (what a lag needs, the same in every arm)
SEARCH_SETS = ["model.dtype=float32", "algorithm.old_logp=recompute", "algorithm.tis_cap=2.0",
               "train.tasks_per_step=4", "rollout.n=4", "rollout.max_new_tokens=128", "rollout.max_tool_calls=2",
               "run.progress=false", "run.tensorboard=false", "run.checkpoint_every=1000"]  # fmt: skip
CORPUS = "qa/wiki_corpus/hotpotqa_ircot500_contexts_corpus.jsonl.gz"


def start_retriever(corpus: Path) -> tuple[subprocess.Popen, str]:
    """`rolerl serve-retriever` over `corpus` on a free port; returns the process and its /retrieve URL."""
    cmd = [sys.executable, "-m", "rolerl", "serve-retriever", str(corpus), "--port", "0", "--workers", "8"]
    server = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    for line in server.stderr:  # the BM25 index is built (or read from its cache) first
        if "serving retrieval at " in line:
            url = line.split("serving retrieval at ", 1)[1].split()[0]
            threading.Thread(target=server.stderr.read, daemon=True).start()  # keep the pipe drained
            return server, url  # the server logs its /retrieve URL
    raise SystemExit(f"rolerl serve-retriever stopped before serving (exit {server.wait()})")


def search_warm_start(root: Path, url: str, n: int, seed: int) -> Path:
    """`n` search demonstrations (the question as the query, the server's passages, the gold answer) and
    `rolerl sft search-agent` on them, once under `root`; returns the adapters' directory."""
    from rolerl.roles import format_tool_output
    from rolerl.tasks import load_task
    from rolerl.tasks.synthetic import write_jsonl
    from rolerl.tools.search import search_tool
    from rolerl.workflows.search_agent import SEARCH_TAGS

    out = root / "warm" / "adapters"
    if out.is_dir():
        return out
    task, tool = load_task("hotpotqa"), search_tool(url=url, k=3)
    rows = []
    for ex in task.examples("dev_ircot500", n, seed):
        passages = tool.run(ex.question)
        if not passages.ok:
            raise SystemExit(f"the retrieval server failed: {passages.text()}")
        text = (f"<think>I need to look this up.</think>\n<search>{ex.question}</search>"
                + format_tool_output(SEARCH_TAGS, passages.text())
                + f"<think>The passages say it.</think>\n<answer>{task.golds(ex)[0]}</answer>")  # fmt: skip
        rows.append(
            {"role": "policy", "messages": [*task.search_prompt(ex), {"role": "assistant", "content": text}]}
        )
    data = write_jsonl(root / "warm-demos.jsonl", rows)
    sets = ["sft.epochs=2", "sft.lr=5e-4", "run.progress=false", "run.tensorboard=false",
            f"run.dir={root / 'warm'}", f"run.seed={seed}"]  # fmt: skip
    subprocess.run([sys.executable, "-m", "rolerl", "sft", "search-agent", "--data", str(data),
                    "--overwrite", "--set", *sets], check=True)  # fmt: skip
    return out


def summarize(metrics: list[dict], lag: int) -> dict:
    metrics = [r for r in metrics if "time/step" in r]  # the demo appends its evaluations' rows
    rows = [r for r in metrics if r["step"] > 1]
    step = [r["time/step"] for r in rows]
    wait = sum(r["time/rollout"] for r in rows)
    total = sum(step)
    busy = sum(r.get("time/rollout_thread", 0.0) for r in rows) if lag else wait
    return {
        "steps_per_hour": 3600 / statistics.median(step),
        "step_s_median": statistics.median(step),
        "trainer_idle": wait / total,
        "engine_idle": max(0.0, 1 - busy / total),
        "update_s_median": statistics.median(r["time/update"] for r in rows),
        "tool_calls_per_step": statistics.mean(r.get("tools/calls", 0.0) for r in rows),
        "accuracy_mean": statistics.mean(r["accuracy"] for r in metrics),
        "dropped_turns": sum(r.get("async/dropped_turns", 0.0) for r in rows),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=["tir", "search"], default="tir",
                   help="tir: the demo with the Python sandbox; search: the search agent against a retrieval "
                   "server (default: %(default)s)")  # fmt: skip
    p.add_argument("--lags", type=int, nargs="+", default=[0, 1, 2], help="training steps behind (0 = sync)")
    p.add_argument("--latency", type=float, nargs="+", default=[0.0, 0.5], help="seconds added per tool call")
    p.add_argument("--steps", type=int, default=8, help="GRPO steps per arm")
    p.add_argument("--demos", type=int, default=128, help="imitation demonstrations of the warm start")
    p.add_argument(
        "--data",
        type=Path,
        help="the benchmark data root (search: default $ROLERL_SHARED_DATA or ../shared/data)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--out",
        type=Path,
        help="run directories (default: a new temporary one); an arm whose "
        "run finished there is read, not run again",
    )
    p.add_argument("--json", action="store_true")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--lag", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--run-dir", help=argparse.SUPPRESS)
    p.add_argument("--url", help=argparse.SUPPRESS)
    p.add_argument("--warm", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        args.latency = args.latency[0]
        return child(args)
    from rolerl.hardware import describe

    out = {"cpu": describe(), "threads": os.environ.get("BENCH_THREADS", "torch default"), "arms": []}
    root = args.out or Path(tempfile.mkdtemp(prefix="rolerl-async-"))
    search = args.workload == "search"
    out["workload"] = args.workload
    extra, server = [], None
    if search:
        from rolerl.tasks.base import default_data_dir

        server, url = start_retriever((args.data or default_data_dir()) / CORPUS)
        extra = [
            "--workload",
            "search",
            "--url",
            url,
            "--warm",
            str(search_warm_start(root, url, args.demos, args.seed)),
        ]
    try:
        for latency in args.latency:
            for lag in args.lags:
                run_dir = root / f"lag{lag}-latency{latency}"
                cmd = [sys.executable, __file__, "--child", "--lag", str(lag), "--latency", str(latency),
                       "--steps", str(args.steps), "--demos", str(args.demos), "--seed", str(args.seed),
                       "--run-dir", str(run_dir), *extra]  # fmt: skip
                t0 = time.perf_counter()
                done = run_dir / ("done" if search else "results.json")
                if not done.exists():
                    subprocess.run(cmd, check=True)
                    done.touch()
                metrics = run_dir / ("metrics.jsonl" if search else "rl/metrics.jsonl")
                rows = [json.loads(x) for x in metrics.read_text().splitlines()]
                staleness = lag if search else MINI_BATCHES * lag
                arm = {"lag": lag, "max_staleness": staleness, "latency_s": latency,
                       "wall_s": time.perf_counter() - t0} | summarize(rows, lag)  # fmt: skip
                out["arms"].append(arm)
                print(f"lag {lag} latency {latency:.1f} s: {arm['steps_per_hour']:.0f} steps/h "
                      f"(step {arm['step_s_median']:.1f} s, update {arm['update_s_median']:.1f} s), trainer idle "
                      f"{arm['trainer_idle']:.0%}, engine idle {arm['engine_idle']:.0%}, "
                      f"{arm['tool_calls_per_step']:.0f} tool calls/step", flush=True)  # fmt: skip
    finally:
        if server is not None:
            server.terminate()
            server.wait()
    for arm in out["arms"]:
        sync = [a for a in out["arms"] if a["lag"] == 0 and a["latency_s"] == arm["latency_s"]]
        arm["speedup_vs_sync"] = arm["steps_per_hour"] / sync[0]["steps_per_hour"] if sync else None
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
