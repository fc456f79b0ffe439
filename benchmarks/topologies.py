"""The cost of a topology: one RL training step (rollout + update) of a two-role workflow under `shared`
(one model, one adapter), `isolated` (one model, an adapter per role) and `separate` (each role on its own
copy of the base model: two models, two engines), in one process, on the same tasks and seeds.

    python benchmarks/topologies.py --json                   # default model, 4 rounds
    python benchmarks/topologies.py --model tiny:llama       # a quick look

The workflow: a solver answers an arithmetic question, a checker reads the answer and replies (two calls
per episode, one per role). The adapters start at zero and the learning rate is tiny, so every arm samples
the same tokens in every step and only the topology's cost differs: separate models mean two engines
(each batches only its role's calls) and two models' memory. Each round runs one step of every arm, in
rotating order; medians of the rounds and the ratios to `shared` are reported with the machine
(rolerl.hardware.describe()), and each arm's parameter memory.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile

import torch

from rolerl.config import load_config
from rolerl.hardware import describe
from rolerl.run.policy import build_policy
from rolerl.tasks import ArithmeticTask
from rolerl.train.optim import policy_optimizer
from rolerl.train.rl import _backend, _engines, train_step

ARMS = {
    "shared": ["adapters.preset=shared"],
    "isolated": ["adapters.preset=isolated"],
    "separate": ["adapters.preset=separate", "roles.checker.model=copy"],
}


class SolveCheck:
    """Two roles, one call each: the solver answers, the checker reads the answer and replies."""

    roles = ("solver", "checker")

    def __init__(self, task) -> None:
        self.task = task

    async def run(self, ctx, example):
        answer = ctx.text(await ctx.generate("solver", self.task.prompt(example)))
        await ctx.generate("checker", [{"role": "user", "content": f"Is {answer.strip()[:200]!r} right?"}])
        return ctx.episode(example, self.task.reward(example, answer))


def arm(name: str, args, out: str):
    overrides = [
        f"model.spec={args.model}", f"models.copy={args.model}", "model.dtype=float32",
        f"rollout.n={args.n}", f"rollout.max_new_tokens={args.tokens}", f"train.tasks_per_step={args.tasks}",
        f"train.micro_batch_size={args.micro_batch}", "optim.lr=1e-12", "optim.schedule=constant",
        "train.bf16=false", f"run.dir={out}/{name}", "run.progress=false", "run.tensorboard=false",
        "algorithm.group_key=role",
        *ARMS[name],
    ]  # fmt: skip
    cfg = load_config(None, overrides)
    task = ArithmeticTask()
    workflow = SolveCheck(task)
    policy = build_policy(cfg, workflow.roles)
    optimizer = policy_optimizer(policy, cfg.optim)
    backend = _backend(cfg, _engines(cfg, policy))
    params = sum(p.numel() * p.element_size() for m in policy.members.values() for p in m.model.parameters())
    return cfg, policy, optimizer, backend, task, workflow, params


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--tasks", type=int, default=4)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    times: dict[str, list[dict[str, float]]] = {name: [] for name in ARMS}
    with tempfile.TemporaryDirectory() as out:
        arms = {name: arm(name, args, out) for name in ARMS}
        try:
            for step in range(args.rounds + 1):  # round 0 warms up
                names = list(ARMS)
                names = names[step % len(names) :] + names[: step % len(names)]
                for name in names:
                    cfg, policy, optimizer, backend, task, workflow, _ = arms[name]
                    m = train_step(
                        cfg, step + 1, policy, policy.trainable(), optimizer, backend, task, workflow
                    )
                    if step > 0:
                        times[name].append({k: m[k] for k in ("time/rollout", "time/update", "time/step")}
                                           | {"tokens": m["role/solver/tokens"] + m["role/checker/tokens"]})  # fmt: skip
        finally:
            for a in arms.values():
                a[3].close()  # the backends and their engines
        memory = {name: a[6] for name, a in arms.items()}
    result = {"machine": describe(), "args": vars(args), "arms": {}}
    for name, rows in times.items():
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        base = {k: statistics.median(r[k] for r in times["shared"]) for k in rows[0]}
        result["arms"][name] = {
            **{f"{k}_median": v for k, v in med.items()},
            **{f"{k}_vs_shared": med[k] / base[k] for k in ("time/rollout", "time/update", "time/step")},
            "param_mb": memory[name] / 2**20,
        }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(result["machine"])
        for name, r in result["arms"].items():
            print(f"{name:>9}: step {r['time/step_median']:.2f}s ({r['time/step_vs_shared']:.2f}x), rollout "
                  f"{r['time/rollout_median']:.2f}s ({r['time/rollout_vs_shared']:.2f}x), update "
                  f"{r['time/update_median']:.2f}s ({r['time/update_vs_shared']:.2f}x), "
                  f"{r['tokens_median']:.0f} tokens, params {r['param_mb']:.0f} MB")  # fmt: skip


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
