"""The workflow study of issue 15, at CPU scale: paper 3's voting workflow (3 voters and an aggregator) on
the demo's word problems with the Python sandbox, from the demo's imitation warm start (one adapter
trained on the TIR format, copied to every role's adapter), with GRPO under

- `shared`: one adapter for both roles (paper 3's SP);
- `isolated`: an adapter per role (IP); each role's calls fill their own mini-batches (`mini_batch_by:
  role`, `mini_batch_size` = the step's episodes), so the voter adapter takes 3 optimizer steps per
  training step and the aggregator 1 (paper 3's drift); `shared` is mini-batched the same way (4 steps);
- `isolated-merged`: `isolated` with `step_policy: merged` (one step per adapter per step, the mini-batches'
  gradients averaged: paper 3's intervention);

outcome reward broadcast, advantage groups per voter index (`role_instance`), the same seeds and budget;
and, at the same budget (steps x tasks x samples), `reasoner_tools` (a reasoner asking a coder for
computations, `isolated`, warm-started by imitation of its own protocol on the same 256 problems) against
single-agent `tir`.

    python benchmarks/workflow_study.py run --out runs/wstudy --seeds 0 1          # ~15 min per run on 2 cores
    python benchmarks/workflow_study.py summarize runs/wstudy --plot docs/workflow_study.png

`run` skips runs whose metrics show the last step, so it resumes after an interruption (a run cut short
is started again; delete its `.claim` file first). Several `run` processes can share the work (each claims
a run or an evaluation before it starts it): on 2 cores, two processes at one thread each. Held-out accuracy: greedy, the same 128 test problems (`rolerl eval`, seed 0), through
each arm's own workflow, before (the warm start) and after RL.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from _study import main, plot_curves, reasoner_tools_demos, rolerl

STEPS, TASKS, SAMPLES, EVAL_LIMIT = 6, 4, 4, 64
COMMON = [
    "rollout.max_new_tokens=64", "rollout.max_tool_calls=2", "rollout.tool=python", f"rollout.n={SAMPLES}",
    f"train.steps={STEPS}", f"train.tasks_per_step={TASKS}", "train.mini_batches=1", "algorithm.beta=0.0",
    "run.progress=false", "run.checkpoint_every=100",
    # the engine's KV cache grows with max_batch x max_len (the model's 8192 by default): a voting run
    # reached 13 GB resident without these bounds; prompts + samples here stay under 1024 positions
    "rollout.max_batch=32", "rollout.max_len=1024",
]  # fmt: skip
VOTING = ["task.workflow=voting", "task.workflow_options={voters: 3}", "algorithm.reward=outcome",
          "algorithm.group_key=role_instance", "train.mini_batch_by=role",
          f"train.mini_batch_size={TASKS * SAMPLES}"]  # fmt: skip
ARMS = {  # arm -> (workflow, roles its adapters are named after, overrides)
    "shared": ("voting", ["policy"], [*VOTING, "adapters.preset=shared"]),
    "isolated": ("voting", ["voter", "aggregator"], [*VOTING, "adapters.preset=isolated"]),
    "isolated-merged": ("voting", ["voter", "aggregator"],
                        [*VOTING, "adapters.preset=isolated", "train.step_policy=merged"]),
    "tir": ("tir", ["policy"], ["task.workflow=tir", "adapters.preset=shared"]),
    "reasoner_tools": ("reasoner_tools", ["reasoner", "coder"],
                       ["task.workflow=reasoner_tools", "task.workflow_options={max_tool_requests: 2}",
                        "adapters.preset=isolated", "algorithm.reward=role"]),
}  # fmt: skip
SEEDED = ("shared", "isolated", "isolated-merged")  # the arms run with every seed; the others with the first


def warm_start(out: Path) -> Path:
    """The demo's imitation warm start (256 format demonstrations x 2 epochs): `out/warm/adapters/policy`."""
    from rolerl.tasks.synthetic import format_task

    warm = out / "warm"
    if not (warm / "adapters" / "policy" / "adapter_config.json").exists():
        shutil.rmtree(warm, ignore_errors=True)
        warm.mkdir(parents=True)
        demos = format_task().write_demonstrations(warm / "demos.jsonl", 256, seed=0)
        rolerl("sft", "demo", "--data", str(demos), "--set", f"run.dir={warm}",
               "run.progress=false", log=out / "warm.log")  # fmt: skip
    return warm / "adapters" / "policy"


def reasoner_tools_warm_start(out: Path) -> Path:
    """The same imitation for `reasoner_tools` (MSARL trains its agents by imitation first): on the same
    256 format problems x 2 epochs, the reasoner asks for the expression in words and answers from the
    result, the coder prints it; `out/warm-rt/adapters/{reasoner,coder}`."""
    warm = out / "warm-rt"
    if not (warm / "adapters" / "coder" / "adapter_config.json").exists():
        shutil.rmtree(warm, ignore_errors=True)
        warm.mkdir(parents=True)
        demos = reasoner_tools_demos(warm / "demos.jsonl", 256)
        rolerl("sft", "demo", "--data", str(demos), "--set", f"run.dir={warm}",
               "adapters.preset=isolated", "run.progress=false", log=out / "warm-rt.log")  # fmt: skip
    return warm / "adapters"


def init_dir(out: Path, policy: Path, names: list[str]) -> Path:
    """The warm-start adapter copied under each of `names` (a directory for `adapters.init`)."""
    target = out / "init" / "-".join(names)
    for name in names:
        if not (target / name).exists():
            shutil.copytree(policy, target / name)
    return target


def done(run_dir: Path) -> bool:
    path = run_dir / "metrics.jsonl"
    return path.exists() and any(json.loads(x)["step"] == STEPS for x in path.read_text().splitlines())


def claim(path: Path) -> bool:
    """Take the job `path` names for this worker (`run` may run in several processes at once)."""
    try:
        os.close(os.open(path.with_name(path.name + ".claim"), os.O_CREAT | os.O_EXCL))
        return True
    except FileExistsError:
        return False


def evaluate(out: Path, workflow: str, policy: list[str], target: Path) -> None:
    """Greedy held-out accuracy through `workflow` on the same `EVAL_LIMIT` test problems for every run."""
    if (target / "results.json").exists() or not claim(target):
        return
    shutil.rmtree(target, ignore_errors=True)
    options = {"voting": ["--option", "voters=3"], "reasoner_tools": ["--option", "max_tool_requests=2"]}
    rolerl("eval", "--task", "synthetic", "--workflow", workflow, *policy, "--limit", str(EVAL_LIMIT),
           "--tool", "python", "--max-new-tokens", "64", "--max-tool-calls", "2", *options.get(workflow, []),
           "--out", str(target), log=target.with_suffix(".log"))  # fmt: skip


def run(out: Path, seeds: list[int]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    policy = warm_start(out)
    inits = {arm: reasoner_tools_warm_start(out) if arm == "reasoner_tools" else init_dir(out, policy, names)
             for arm, (_, names, _) in ARMS.items()}  # fmt: skip
    for arm, (workflow, names, _) in ARMS.items():  # the warm start through each workflow, once
        if not arm.endswith("-merged"):
            preset = "isolated" if len(names) > 1 else "shared"
            adapters = ["--adapters", str(inits[arm]), "--preset", preset]
            evaluate(out, workflow, adapters, out / f"before-{arm}")
    for seed in seeds:
        for arm, (workflow, _, sets) in ARMS.items():
            target = out / f"{arm}-s{seed}"
            if (arm not in SEEDED and seed != seeds[0]) or not (done(target) or claim(target)):
                continue
            if not done(target):
                shutil.rmtree(target, ignore_errors=True)
                print(f"{arm} seed {seed}", flush=True)
                rolerl("train", "demo", "--set", f"run.dir={target}", f"run.seed={seed}",
                       f"adapters.init={inits[arm]}", *COMMON, *sets,
                       log=out / f"{arm}-s{seed}.log")  # fmt: skip
            evaluate(out, workflow, ["--run", str(target)], out / f"after-{arm}-s{seed}")


def summarize(out: Path, plot: Path | None) -> str:
    lines = [
        "| arm | seed | held-out before RL | after RL | rollout accuracy: first step / last step "
        "| optimizer steps per adapter | malformed aggregator choices | RL wall time |",
        "|---|---|---|---|---|---|---|---|",
    ]
    curves: dict[str, list[list[float]]] = {}
    for arm in ARMS:
        before = _before(out, arm)
        for path in sorted(out.glob(f"{arm}-s*/metrics.jsonl")):
            metrics = [json.loads(x) for x in path.read_text().splitlines()]
            if metrics[-1]["step"] != STEPS:
                continue
            seed = path.parent.name.rsplit("-s", 1)[1]
            curves.setdefault(arm, []).append([m["accuracy"] for m in metrics])
            last = metrics[-1]
            steps = ", ".join(f"{k.split('/')[1]} {sum(m[k] for m in metrics) / STEPS:.0f}"
                              for k in sorted(last) if k.startswith("adapter/") and k.endswith("/steps"))  # fmt: skip
            bad = sum(v for m in metrics for k, v in m.items() if k.startswith("workflow/voting/malformed/"))
            wall = sum(m.get("time/step", 0.0) for m in metrics) / 60
            lines.append(
                f"| {arm} | {seed} | {before} | {_held_out(out / f'after-{arm}-s{seed}')} | "
                f"{100 * metrics[0]['accuracy']:.0f}% / "
                f"{100 * last['accuracy']:.0f}% | {steps} per step | "
                f"{'n/a' if arm in ('tir', 'reasoner_tools') else f'{bad / STEPS:.2f} per episode'} | {wall:.1f} min |"
            )
    if plot is not None and curves:
        plot_curves(
            curves,
            plot,
            "voting SP vs IP vs IP-merged; reasoner_tools vs tir",
            "rollout accuracy (episode correct)",
        )
    return "\n".join(lines)


def _before(out: Path, arm: str) -> str:
    return _held_out(out / f"before-{arm.removesuffix('-merged')}")


def _held_out(target: Path) -> str:
    path = target / "results.json"
    if not path.exists():
        return "n/a"
    m = json.loads(path.read_text())["metrics"]
    return f"{100 * m['pass@1']:.1f}% (+- {100 * m['stderr']:.1f})"


if __name__ == "__main__":
    main(__doc__, run, summarize, out="runs/wstudy", plot="docs/workflow_study.png")
