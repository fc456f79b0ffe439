"""The imitation (SFT) pass over one set of rows, with a demonstration's rows in one step or shuffled one
by one.

MSARL's demonstrations hold, for each problem, the reasoner's conversation and one coder call per
request; each coder prompt is the coder's system prompt, the whole problem, then a request of a few words.
Shuffled one by one (before), a step's coder rows come from different problems and share only the system
prompt. With the rows of one id in one step (`rolerl sft` now, `rolerl.train.sft.step_rows`), they sit side
by side in a micro-batch and the system prompt and problem run once for all of them (`rolerl.train.prefix`,
whose groups are the split that saves the most positions). Both arms train the same rows (the first
`--steps` steps of the new schedule) from the same adapters (fresh gradients, no optimizer step), arm after
arm, the order swapped each round, in this one process. Printed: the decoder positions each arm runs
(padding included; exact), the median over rounds of each arm's wall time, and their ratio. Each step's
gradient is the sum of its rows' either way (tests/train/test_sft.py); only which rows share a step differs.

    rolerl demos gsm8k --format msarl --limit 2000 --out runs/msarl-demos.jsonl
    python benchmarks/imitation_units.py --data runs/msarl-demos.jsonl --steps 6 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="demonstrations JSONL with ids (rolerl demos ... --out)")
    p.add_argument(
        "--config", default="gsm8k-msarl", help="the config whose model, adapters and sft it reads"
    )
    p.add_argument("--steps", type=int, default=6, help="steps of the demonstration schedule to train")
    p.add_argument("--rounds", type=int, default=2, help="rounds of both arms (the order swapped each round)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides")
    args = p.parse_args()

    import torch

    import rolerl.train.sft as sft
    from rolerl.config import load_config
    from rolerl.hardware import describe
    from rolerl.run.policy import build_policy

    torch.set_num_threads(args.threads)
    print(describe(), flush=True)
    cfg = load_config(args.config, [f"sft.data={args.data}", f"run.dir={tempfile.mkdtemp()}", *args.set])
    data = sft.read_demonstrations(cfg.sft.data)
    roles = sorted({row["role"] for row in data})
    policy = build_policy(cfg, roles)
    turns, units = sft.training_rows(data, policy, sft.call_tags(cfg, roles), cfg.sft.max_len)
    size = cfg.sft.batch_size
    together = sft.step_rows(units, size, 1, torch.Generator().manual_seed(cfg.run.seed))[: args.steps]
    rows = [r for _, step in together for r in step.tolist()]
    apart = sft.step_rows([[r] for r in rows], size, 1, torch.Generator().manual_seed(cfg.run.seed))
    unit_of = sft.unit_index(units, len(turns))
    print(f"{len(data)} demonstration rows, {len(turns)} training rows in {len(units)} demonstrations; "
          f"{len(rows)} rows: {len(together)} steps together, {len(apart)} shuffled one by one "
          f"(batch {size}, micro-batch {cfg.train.micro_batch_size})", flush=True)  # fmt: skip
    parts = sft._parts(policy, turns, list(policy.route_of), None)
    for member in policy.members.values():
        member.model.eval()
    positions = {"together": 0, "apart": 0}
    counting: list[str] = []

    def count(_module, _args, kwargs) -> None:
        if counting:
            positions[counting[0]] += kwargs["input_ids"].numel()

    hooks = [
        m.model.get_decoder().register_forward_pre_hook(count, with_kwargs=True)
        for m in policy.members.values()
    ]
    arms = {"together": (together, unit_of), "apart": (apart, None)}
    times: dict[str, list[float]] = {arm: [] for arm in arms}
    for round_ in range(args.rounds):
        for arm in ("together", "apart") if round_ % 2 == 0 else ("apart", "together"):
            steps, units_of = arms[arm]
            counting[:] = [arm] if round_ == 0 else []
            t0 = time.perf_counter()
            for _, step in steps:
                for param in policy.trainable():
                    param.grad = None
                sft._imitation_step(parts, step, cfg, policy.bf16, units_of)
            times[arm].append(time.perf_counter() - t0)
            print(f"  round {round_ + 1}, {arm}: {times[arm][-1]:.1f} s", flush=True)
    for hook in hooks:
        hook.remove()
    for arm, ts in times.items():
        print(f"{arm:9s} {positions[arm]:>8d} positions  median {statistics.median(ts):.1f} s  "
              f"({', '.join(f'{t:.1f}' for t in ts)})")  # fmt: skip
    print(f"together: {positions['apart'] / positions['together']:.2f}x fewer positions, "
          f"{statistics.median(times['apart']) / statistics.median(times['together']):.2f}x faster")  # fmt: skip


if __name__ == "__main__":
    main()
