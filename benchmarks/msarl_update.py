"""The update of one MSARL GRPO step on GSM8K: each reasoner conversation run inside its last call
(`rolerl.train.prefix.carriers`), against every model call its own forward row (rolerl before carriers).

A reasoner that asks the coder agent n times makes n calls, each prompt the one before plus its completion
and the tool result; as rows of their own, the conversation's prompt runs n times. One rollout step of the
`gsm8k-msarl` recipe (its config, `--warm` adapters, `--tasks` problems x `--n` samples) is collected once;
then each arm runs the step's `ppo_update` from the same adapters in a fresh subprocess (peak RSS is the
arm's own: its `ru_maxrss`, model load included), alternating arms over `--rounds`. Reported: the median
update time per arm and their ratio, forward rows and positions, peak RSS, and the loss and gradient norm
(the same update: equal up to float rounding).

    python benchmarks/msarl_update.py --warm runs/gsm8k-msarl-easy-s0/sft/adapters --tasks 4 --n 4
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ARMS = ("carried", "per-call")


def setup(args: argparse.Namespace, run_dir: Path):
    """The recipe's config with the benchmark's sizes, its task (difficulty-cut), workflow and policy."""
    from rolerl.recipe import RecipeSettings, recipe_config
    from rolerl.run.policy import build_policy
    from rolerl.tasks import load_task
    from rolerl.tasks.math import at_most
    from rolerl.workflows import load_workflow

    extra = [f"train.tasks_per_step={args.tasks}", f"rollout.n={args.n}", f"run.dir={run_dir}",
             f"train.micro_batch_size={args.micro_batch}", "run.progress=false", "run.tensorboard=false"]  # fmt: skip
    extra += [f"adapters.init={args.warm}"] * (args.warm is not None)
    cfg = recipe_config(RecipeSettings("gsm8k-msarl", seed=args.seed, progress=False), *extra, *args.set)
    task = load_task(cfg.task.name, cfg.task.data)
    if cfg.task.max_difficulty is not None:
        task = at_most(task, cfg.task.split, cfg.task.max_difficulty)
    workflow = load_workflow(cfg.task.workflow, task, cfg.task.workflow_options)
    return cfg, task, workflow, build_policy(cfg, workflow.roles)


def collect(args: argparse.Namespace, path: Path) -> dict:
    """One rollout step's turns and advantages, saved to `path`."""
    import torch

    from rolerl.rollout.vllm_checks import resolve_backend
    from rolerl.train import rl
    from rolerl.train.credit import advantages_of, turn_rewards

    cfg, task, workflow, policy = setup(args, path.parent / "run")
    cfg, _ = resolve_backend(cfg, policy)
    backend = rl._backend(cfg, rl._engines(cfg, policy), policy)
    backend.sync(policy)
    t0 = time.perf_counter()
    episodes = rl.rollout_step(cfg, args.step, policy, backend, task, workflow)
    seconds = time.perf_counter() - t0
    credit = turn_rewards(episodes, cfg.algorithm)
    advantages = advantages_of(cfg.algorithm, credit)
    torch.save({"turns": credit.turns, "advantages": advantages.tolist()}, path)
    rewards = [float(r) for r in credit.rewards]
    return {"rollout_s": seconds, "episodes": len(episodes), "turns": len(credit.turns),
            "reward_mean": sum(rewards) / max(len(rewards), 1)}  # fmt: skip


@contextlib.contextmanager
def per_call():
    """rolerl before carriers: every row its own carrier (and its own micro-batch slot)."""
    from rolerl.train import policy, update

    real = policy.carriers

    def alone(batch, rows=None):
        return list(range(batch.input_ids.shape[0])) if rows is None else list(rows)

    policy.carriers = update.carriers = alone
    try:
        yield
    finally:
        policy.carriers = update.carriers = real


def run_arm(args: argparse.Namespace) -> dict:
    """One arm's update of the saved step, from the policy's starting adapters."""
    import torch

    from rolerl.train import rl
    from rolerl.train.optim import policy_optimizer
    from rolerl.train.prefix import carriers
    from rolerl.train.update import ppo_update
    from rolerl.workflows import derive_seed

    saved = torch.load(args.batch, weights_only=False)
    cfg, _, _, policy = setup(args, Path(args.batch).parent / f"run-{args.arm}")
    cfg, _ = rl.resolve_old_logp(cfg, policy)
    parts = rl.collate_parts(policy, saved["turns"], saved["advantages"])
    rows = sum(p.batch.input_ids.shape[0] for p in parts)
    positions = sum(int(p.batch.attention_mask.sum()) for p in parts)
    forward = [sorted(set(carriers(p.batch))) for p in parts]
    carried = sum(int(p.batch.attention_mask[own].sum()) for p, own in zip(parts, forward, strict=True))
    optimizer = policy_optimizer(policy, cfg.optim)
    generator = torch.Generator().manual_seed(derive_seed(cfg.run.seed, "shuffle", args.step))
    with per_call() if args.arm == "per-call" else contextlib.nullcontext():
        t0 = time.perf_counter()
        metrics = ppo_update(parts, optimizer, rl.loss_settings(cfg, policy), rl.schedule(cfg),
                             micro_batch_size=cfg.train.micro_batch_size, generator=generator)  # fmt: skip
        seconds = time.perf_counter() - t0
    carrying = args.arm == "carried"
    return {
        "arm": args.arm, "update_s": seconds, "rows": rows, "positions": positions,
        "forward_rows": sum(map(len, forward)) if carrying else rows, "forward_positions": carried if carrying else positions,
        "loss": metrics["loss/total"], "grad_norm": metrics["grad_norm"],
        "inert_frac": metrics["update/inert_frac"], "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--warm", help="the warm start's adapters (an sft/adapters directory); default: fresh ones"
    )
    p.add_argument("--tasks", type=int, default=4, help="problems in the step (train.tasks_per_step)")
    p.add_argument("--n", type=int, default=4, help="samples per problem (rollout.n)")
    p.add_argument("--micro-batch", type=int, default=16, help="train.micro_batch_size (forward rows)")
    p.add_argument("--rounds", type=int, default=1, help="updates per arm, arms alternating")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step", type=int, default=1, help="which step's problems (a function of the seed)")
    p.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="more config overrides")
    p.add_argument("--json", action="store_true", help="end with one JSON line of the results")
    p.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)
    p.add_argument("--batch", help=argparse.SUPPRESS)
    args = p.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    if args.arm:
        print(json.dumps(run_arm(args)), flush=True)
        return
    from rolerl.hardware import describe

    print(describe(), flush=True)
    path = Path(tempfile.mkdtemp(prefix="rolerl-msarl-update-")) / "step.pt"
    step = collect(args, path)
    print(f"rollout: {step['episodes']} episodes, {step['turns']} model calls, reward {step['reward_mean']:.3f}, "
          f"{step['rollout_s']:.0f} s", flush=True)  # fmt: skip
    passed = [a for a in sys.argv[1:] if a not in ("--json",)]
    runs: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    for r in range(args.rounds):
        for arm in ARMS if r % 2 == 0 else ARMS[::-1]:
            out = subprocess.run([sys.executable, __file__, *passed, "--arm", arm, "--batch", str(path)],
                                 check=True, capture_output=True, text=True).stdout  # fmt: skip
            result = json.loads(out.strip().splitlines()[-1])
            runs[arm].append(result)
            print(f"round {r} {arm:>8}: update {result['update_s']:.1f} s, {result['forward_rows']} forward rows "
                  f"({result['forward_positions']} positions) of {result['rows']} ({result['positions']}), "
                  f"loss {result['loss']:.6f}, grad norm {result['grad_norm']:.6f}, "
                  f"peak RSS {result['peak_rss_mb']:.0f} MB", flush=True)  # fmt: skip
    median = {arm: statistics.median(r["update_s"] for r in rs) for arm, rs in runs.items()}
    summary = {
        "step": step, "threads": args.threads, "tasks": args.tasks, "n": args.n,
        "update_s": median, "speedup": median["per-call"] / median["carried"],
        "forward_positions": {arm: rs[0]["forward_positions"] for arm, rs in runs.items()},
        "peak_rss_mb": {arm: max(r["peak_rss_mb"] for r in rs) for arm, rs in runs.items()},
    }  # fmt: skip
    print(f"update median: carried {median['carried']:.1f} s, per call {median['per-call']:.1f} s: "
          f"{summary['speedup']:.2f}x", flush=True)  # fmt: skip
    if args.json:
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
