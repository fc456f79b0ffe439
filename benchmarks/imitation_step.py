"""The imitation (SFT) step of `rolerl demo` with the prompts' common start shared, and without.

`rolerl demo`'s demonstrations all begin with the same system prompt (~47 of ~110 positions per row);
`train.share_prefix` runs that start once per micro-batch (`rolerl.train.prefix`). Both arms train a fresh
policy on the same demonstrations, alternating arms over `--rounds` (each arm first once), in this one
process; the step times after each run's first step are pooled per arm (median), and the loss curves are
printed side by side (the same numbers up to float rounding: the matmuls have other shapes).

    python benchmarks/imitation_step.py --demos 48 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--demos", type=int, default=48, help="demonstrations (one epoch; batch 8)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()

    import torch

    from rolerl.config import load_config
    from rolerl.demo import DEFAULT_CONFIG
    from rolerl.hardware import describe
    from rolerl.run.policy import build_policy
    from rolerl.tasks.synthetic import format_task, rl_task
    from rolerl.train.sft import sft
    from rolerl.workflows.tir import TIR

    torch.set_num_threads(args.threads)
    print(describe(), flush=True)
    root = Path(tempfile.mkdtemp(prefix="rolerl-imitation-"))
    data = format_task().write_demonstrations(root / "demos.jsonl", args.demos, 0)
    times: dict[bool, list[float]] = {True: [], False: []}
    losses: dict[bool, list[float]] = {}
    for r in range(args.rounds):
        for share in (True, False) if r % 2 == 0 else (False, True):
            run_dir = root / f"{share}-{r}"
            cfg = load_config(DEFAULT_CONFIG, [
                f"run.dir={run_dir}", f"sft.data={data}", "sft.epochs=1", "run.progress=false",
                "run.tensorboard=false", f"train.share_prefix={str(share).lower()}",
            ])  # fmt: skip
            policy = build_policy(cfg, TIR(rl_task()).roles)
            t0 = time.perf_counter()
            sft(cfg, policy=policy, overwrite=True, every_kind=True)
            rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            times[share] += [row["time/step"] for row in rows[1:]]
            losses[share] = [row["loss/sft"] for row in rows]
            print(f"round {r} share_prefix={share}: {time.perf_counter() - t0:.1f} s, "
                  f"median step {statistics.median(row['time/step'] for row in rows[1:]):.2f} s", flush=True)  # fmt: skip
    on, off = statistics.median(times[True]), statistics.median(times[False])
    print(f"median step: shared start {on:.2f} s, plain {off:.2f} s, ratio {on / off:.3f}")
    print("loss per step (shared / plain):")
    for a, b in zip(losses[True], losses[False], strict=True):
        print(f"  {a:.6f}  {b:.6f}")


if __name__ == "__main__":
    main()
