"""A multi-turn evaluation with the engine's prefix store on and off (`rollout.prefix_cache`).

MSARL's reasoner stops at each request and continues, once the coder has answered, from its own ids plus
the result: without the store every continuation prefills the whole conversation again, and every coder
call its system prompt and problem. With it (`rolerl.rollout.kv.PrefixStore`) a call copies the keys and
values of the finished call it starts as and computes only what is new. Both arms evaluate the same
problems greedily with the same adapters (a recipe's run directory: its config and newest checkpoint), arm
after arm, the order swapped each round, in this one process. Printed per arm: the positions the model
computed (every forward's embedded ids: exact), the median wall time over rounds and the ratio, the
problems solved, how many episodes are token for token the same in both arms (the copied keys come from
another batch's forward, so a near tie can flip a token), and the most positions the store held.

    python benchmarks/prefix_cache.py --run runs/gsm8k-msarl-easy-s0/sft --limit 64 --rounds 2 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True, help="a run directory (config.yaml and adapters or checkpoints)")
    p.add_argument("--limit", type=int, default=64, help="GSM8K test problems (the recipe's fixed shuffle)")
    p.add_argument("--rounds", type=int, default=2, help="rounds of both arms (the order swapped each round)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-batch", type=int, default=64, help="rows at once (the recipes' rollout.max_batch)")
    args = p.parse_args()

    import torch

    from rolerl.eval.harness import EvalSpec, rollouts, spec_examples, spec_policy
    from rolerl.hardware import describe
    from rolerl.recipe import EVAL_SEED, TASK
    from rolerl.rollout.kv import PrefixStore
    from rolerl.tasks import load_task
    from rolerl.workflows import load_workflow

    torch.set_num_threads(args.threads)
    print(describe(), flush=True)
    from rolerl.config import load_config

    cfg = load_config(f"{args.run}/config.yaml")
    spec = EvalSpec(
        task=TASK, data=cfg.task.data, split="test", workflow=cfg.task.workflow,
        workflow_options=dict(cfg.task.workflow_options), run=args.run, max_new_tokens=cfg.rollout.max_new_tokens,
        tool=cfg.rollout.tool, max_tool_calls=cfg.rollout.max_tool_calls, limit=args.limit, seed=EVAL_SEED,
        max_batch=args.max_batch, progress=False,
    )  # fmt: skip
    task = load_task(spec.task, spec.data)
    workflow = load_workflow(spec.workflow, task, spec.workflow_options)
    examples = spec_examples(task, spec)
    policy, cfg, _ = spec_policy(spec, workflow.roles)
    positions = [0]
    for member in policy.members.values():  # every forward embeds the ids it computes
        member.model.get_input_embeddings().register_forward_pre_hook(
            lambda _m, x: positions.__setitem__(0, positions[0] + x[0].numel())
        )
    peak = [0]
    put = PrefixStore.put

    def observed_put(self, *a, **k):
        put(self, *a, **k)
        peak[0] = max(peak[0], self.positions)

    PrefixStore.put = observed_put

    class Bar:
        def update(self, *_):
            pass

    arms = {"off": 0, "on": cfg.rollout.prefix_cache or 32768}  # the recipe config sets 32768
    walls: dict[str, list[float]] = {a: [] for a in arms}
    seen: dict[str, dict] = {}
    for r in range(args.rounds):
        for arm in list(arms) if r % 2 == 0 else list(arms)[::-1]:
            cfg.rollout.prefix_cache = arms[arm]
            positions[0] = peak[0] = 0
            t0 = time.perf_counter()
            episodes = [
                eps[0] for _, chunk in rollouts(spec, workflow, policy, cfg, examples, range(len(examples)), Bar())
                for eps in chunk
            ]  # fmt: skip
            walls[arm].append(time.perf_counter() - t0)
            seen[arm] = {"positions": positions[0], "peak": peak[0], "episodes": episodes}
            print(f"round {r + 1} {arm:>3}: {walls[arm][-1]:6.1f} s, {positions[0]} positions computed, "
                  f"store peak {peak[0]} positions", flush=True)  # fmt: skip
    same = sum(
        [t.completion_ids for t in a.turns] == [t.completion_ids for t in b.turns]
        for a, b in zip(seen["off"]["episodes"], seen["on"]["episodes"], strict=True)
    )
    print(f"\n{len(examples)} problems, {args.rounds} rounds, max_batch {args.max_batch}:")
    for arm in arms:
        solved = sum(bool(e.metadata.get("correct", e.reward >= 1.0)) for e in seen[arm]["episodes"])
        tokens = sum(len(t.completion_ids) for e in seen[arm]["episodes"] for t in e.turns)
        print(f"  {arm:>3}: median {statistics.median(walls[arm]):6.1f} s, {seen[arm]['positions']} positions "
              f"computed, {tokens} completion tokens, {solved} solved")  # fmt: skip
    ratio = statistics.median(walls["off"]) / statistics.median(walls["on"])
    print(f"  on vs off: {ratio:.2f}x faster; positions {seen['off']['positions'] / seen['on']['positions']:.2f}x "
          f"fewer; {same} of {len(examples)} episodes identical; store peak {seen['on']['peak']} positions")  # fmt: skip


if __name__ == "__main__":
    main()
