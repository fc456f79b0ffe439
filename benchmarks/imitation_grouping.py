"""The imitation (SFT) step with a step's rows grouped into micro-batches by role and length, and in the
shuffle's order.

MSARL's demonstrations mix a reasoner's calls (long prompts: the problem and every result so far) with a
coder's (short: one request), and each role's rows start with the role's own system prompt. In the
shuffle's order a micro-batch pads to its longest row and its rows share no prompt start; grouped
(`rolerl.train.sft._grouped`, the default) it pads to rows of like length and runs the shared start once
(`train.share_prefix`). Both arms run the same batches of the same shuffle on one policy (fresh gradients
each time, no optimizer step), alternating which goes first, in this one process; the median of each arm's
step times is printed with their ratio. The step's gradient is the same sum either way
(tests/train/test_sft.py).

    rolerl demos gsm8k --format msarl --limit 2000 --out runs/msarl-demos.jsonl
    python benchmarks/imitation_grouping.py --data runs/msarl-demos.jsonl --steps 6 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="demonstrations JSONL (rolerl demos ... --out)")
    p.add_argument(
        "--config", default="gsm8k-msarl", help="the config whose model, adapters and sft it reads"
    )
    p.add_argument("--steps", type=int, default=6, help="steps (batches of sft.batch_size) per arm")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()

    import torch

    import rolerl.train.sft as sft
    from rolerl.config import load_config
    from rolerl.hardware import describe
    from rolerl.run.policy import build_policy

    torch.set_num_threads(args.threads)
    print(describe(), flush=True)
    cfg = load_config(args.config, [f"sft.data={args.data}", f"run.dir={tempfile.mkdtemp()}"])
    data = sft.read_demonstrations(cfg.sft.data)
    roles = sorted({row["role"] for row in data})
    policy = build_policy(cfg, roles)
    tags = sft.call_tags(cfg, roles)
    turns = [t for row in data for t in sft.demonstration_turns(
        policy.tokenizer_of(row["role"]), row, policy.route_of, tags=tags.get(row["role"]), max_len=cfg.sft.max_len)]  # fmt: skip
    print(f"{len(data)} demonstrations, {len(turns)} calls, batch {cfg.sft.batch_size}, "
          f"micro-batch {cfg.train.micro_batch_size}", flush=True)  # fmt: skip
    parts = sft._parts(policy, turns, list(policy.route_of), None)
    for member in policy.members.values():
        member.model.eval()
    shuffle = torch.randperm(len(turns), generator=torch.Generator().manual_seed(cfg.run.seed))
    grouped = sft._grouped
    times: dict[str, list[float]] = {"grouped": [], "shuffled": []}
    for i, rows in enumerate(shuffle.split(cfg.sft.batch_size)[: args.steps]):
        for arm in ("grouped", "shuffled") if i % 2 == 0 else ("shuffled", "grouped"):
            sft._grouped = grouped if arm == "grouped" else (lambda batch, rows: rows)
            for param in policy.trainable():
                param.grad = None
            t0 = time.perf_counter()
            sft._imitation_step(parts, rows, cfg, policy.bf16)
            times[arm].append(time.perf_counter() - t0)
    sft._grouped = grouped
    for arm, ts in times.items():
        print(f"{arm:9s} median {statistics.median(ts):.2f} s  ({', '.join(f'{t:.1f}' for t in ts)})")
    ratio = statistics.median(times["shuffled"]) / statistics.median(times["grouped"])
    print(f"grouped is {ratio:.2f}x faster a step")


if __name__ == "__main__":
    main()
