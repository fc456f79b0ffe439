"""Gradient isolation: the cost of `adapters.isolation: strict` (one autograd pass per adapter) against
`route` (one backward), on the default model with DART's two adapters, in one process, same batch.

    python benchmarks/isolation.py --json                 # 16 rows x (48 prompt + 128 completion) tokens
    python benchmarks/isolation.py --rows 8 --steps 2     # a quick look

Each round runs both modes (alternating order); medians of the rounds and the strict/route ratio are
reported with the machine (rolerl.hardware.describe()).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch

import rolerl
from rolerl.config import AlgorithmConfig
from rolerl.hardware import describe
from rolerl.models.lora import adapter_parameters
from rolerl.models.topology import Topology
from rolerl.roles import REASONING, TOOL_CALL, TOOL_OUTPUT, shift
from rolerl.train.update import Aligned, LossSettings, accumulate_gradients
from rolerl.types import Turn, collate


def batch_for(route_of, rows: int, prompt: int, completion: int, seed: int = 0):
    """Rows of reasoning with one tool call (code, then spliced output) in the middle, random ids."""
    g = torch.Generator().manual_seed(seed)
    third = completion // 3
    kinds = (
        [REASONING] * third
        + [TOOL_CALL] * third
        + [TOOL_OUTPUT] * 8
        + [REASONING] * (completion - 2 * third - 8)
    )
    turns = []
    for _ in range(rows):
        ids = torch.randint(3, 40000, (prompt + completion,), generator=g).tolist()
        routes = shift(["prompt"] * prompt + kinds, route_of)
        logprobs = [math.nan if k == TOOL_OUTPUT else -1.0 for k in kinds]
        turns.append(Turn("policy", ids[:prompt], ids[prompt:], kinds, routes, logprobs))
    adv = torch.randn(rows, generator=g).tolist()
    return collate(turns, adv, {"policy": route_of}, pad_id=2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--prompt", type=int, default=48)
    p.add_argument("--completion", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=3, help="rounds (each times both modes once)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    model, _ = rolerl.load_model("default", dtype="float32")
    rolerl.add_adapters(model, ["reason", "tool"], rank=8)
    route_of = Topology.from_preset("dart", ["policy"]).route_of("policy", {"reason": 0, "tool": 1})
    batch = batch_for(route_of, args.rows, args.prompt, args.completion)
    params = adapter_parameters(model)
    times: dict[str, list[float]] = {"route": [], "strict": []}
    for step in range(args.steps + 1):  # the first round warms up
        for mode in ("route", "strict") if step % 2 == 0 else ("strict", "route"):
            s = LossSettings(AlgorithmConfig(), 1.0, args.completion, isolation=mode, adapter_params=params)
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            accumulate_gradients(model, batch, Aligned(batch.old_logp), s, args.micro_batch)
            if step > 0:
                times[mode].append(time.perf_counter() - t0)
    med = {m: statistics.median(t) for m, t in times.items()}
    out = {
        "machine": describe(),
        "rows": args.rows, "tokens_per_row": args.prompt + args.completion, "micro_batch": args.micro_batch,
        "route_s": round(med["route"], 3), "strict_s": round(med["strict"], 3),
        "strict_vs_route": round(med["strict"] / med["route"], 3),
    }  # fmt: skip
    print(json.dumps(out) if args.json else json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
