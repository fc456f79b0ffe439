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

On a CPU the rollout thread and the update share the same cores, so overlapping them gains only what one
of them leaves idle (tool latency, the GIL-free waits); on a GPU with the engine on other devices (or a vLLM
server) the update and the generation each have their own hardware. docs/BENCHMARKS.md has the table.

    .venv/bin/python benchmarks/async_throughput.py --json                     # ~25 min on 2 cores
    .venv/bin/python benchmarks/async_throughput.py --lags 0 1 --latency 0.5   # a subset
    .venv/bin/python benchmarks/async_throughput.py --out runs/async --json    # resumes: finished arms are read
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
import time
from pathlib import Path

MINI_BATCHES = 2  # demo.yaml's train.mini_batches: optimizer steps per training step


def child(args) -> None:
    """One arm in this process: the python tool slowed by `latency` seconds a call, then the demo."""
    import rolerl.tools as tools
    from rolerl.demo import DemoSettings, run_demo

    latency, make = args.latency, tools.TOOLS["python"]

    class Slow:
        def __init__(self, inner) -> None:
            self.inner, self.name, self.description = inner, inner.name, inner.description

        def run(self, code: str):
            time.sleep(latency)
            return self.inner.run(code)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    if latency > 0:
        tools.TOOLS["python"] = lambda **o: Slow(make(**o))
    settings = DemoSettings(
        run_dir=args.run_dir, seed=args.seed, demos=args.demos, eval_format=8, eval_rl=8, eval_base=8,
        rl_steps=args.steps,
        overrides=(f"train.max_staleness={MINI_BATCHES * args.lag}", "run.progress=false",
                   "run.tensorboard=false", "run.checkpoint_every=1000"),
    )  # fmt: skip
    run_demo(settings, log=lambda *a: None)


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
    p.add_argument("--lags", type=int, nargs="+", default=[0, 1, 2], help="training steps behind (0 = sync)")
    p.add_argument("--latency", type=float, nargs="+", default=[0.0, 0.5], help="seconds added per tool call")
    p.add_argument("--steps", type=int, default=8, help="GRPO steps per arm")
    p.add_argument("--demos", type=int, default=128, help="imitation demonstrations of the warm start")
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
    args = p.parse_args()
    if args.child:
        args.latency = args.latency[0]
        return child(args)
    from rolerl.hardware import describe

    out = {"cpu": describe(), "threads": os.environ.get("BENCH_THREADS", "torch default"), "arms": []}
    root = args.out or Path(tempfile.mkdtemp(prefix="rolerl-async-"))
    for latency in args.latency:
        for lag in args.lags:
            run_dir = root / f"lag{lag}-latency{latency}"
            cmd = [sys.executable, __file__, "--child", "--lag", str(lag), "--latency", str(latency),
                   "--steps", str(args.steps), "--demos", str(args.demos), "--seed", str(args.seed),
                   "--run-dir", str(run_dir)]  # fmt: skip
            t0 = time.perf_counter()
            if not (run_dir / "results.json").exists():
                subprocess.run(cmd, check=True)
            rows = [json.loads(x) for x in (run_dir / "rl" / "metrics.jsonl").read_text().splitlines()]
            arm = {"lag": lag, "max_staleness": MINI_BATCHES * lag, "latency_s": latency,
                   "wall_s": time.perf_counter() - t0} | summarize(rows, lag)  # fmt: skip
            out["arms"].append(arm)
            print(f"lag {lag} latency {latency:.1f} s: {arm['steps_per_hour']:.0f} steps/h "
                  f"(step {arm['step_s_median']:.1f} s, update {arm['update_s_median']:.1f} s), trainer idle "
                  f"{arm['trainer_idle']:.0%}, engine idle {arm['engine_idle']:.0%}, "
                  f"{arm['tool_calls_per_step']:.0f} tool calls/step", flush=True)  # fmt: skip
    for arm in out["arms"]:
        sync = next(a for a in out["arms"] if a["lag"] == 0 and a["latency_s"] == arm["latency_s"])
        arm["speedup_vs_sync"] = arm["steps_per_hour"] / sync["steps_per_hour"]
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
