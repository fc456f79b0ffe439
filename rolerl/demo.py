"""`rolerl demo`: tool-integrated reasoning on the built-in word problems, end to end on a CPU.

1. evaluate the base model (greedy) on held-out problems of both family groups;
2. warm-start the adapters by imitation on programmatic demonstrations of the *format* families;
3. evaluate the warm start (and, with `probe_k`, its pass@1 / pass@k on every candidate family);
4. train with GRPO on the *RL* families (the TIR workflow, the Python sandbox as the tool);
5. evaluate again; print a before/after table; write `results.json`, a plot of reward and accuracy per
   step, the run directories of both trainings (metrics, PEFT adapters) under `run_dir`.

Every number is a pure function of the settings and the seed (greedy evaluation, counter-based sampling,
lockstep batching), up to the wall-clock timing of tool calls (docs/RESULTS.md).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rolerl import pipeline
from rolerl.config import Config, load_config
from rolerl.eval import EvalResult, by_family_table, evaluate, evaluate_groups, pooled_gain
from rolerl.pipeline import Pipeline, write_json
from rolerl.progress import ProgressBar
from rolerl.report.plots import plot_metrics
from rolerl.tasks.synthetic import PROBE_FAMILIES, SyntheticTask, format_task, rl_task
from rolerl.workflows.tir import TIR


@dataclass
class DemoSettings:
    """What `rolerl demo` runs; `quick_check()` is the 2-minute pipeline check. Training hyperparameters not here come
    from `rolerl/configs/demo.yaml` (overridable with `--set`)."""

    model: str = "default"
    run_dir: str | None = None  # None = runs/demo-<date>-<time>
    seed: int = 0
    demos: int = 256  # imitation demonstrations (format families)
    eval_format: int = 64  # held-out problems of the format families
    eval_rl: int = 256  # held-out problems of the RL families
    eval_base: int = 64  # the base model is evaluated on the first this-many of each (it scores ~0)
    probe_k: int = 0  # > 0: also estimate the warm start's pass@1 and pass@k on every candidate family
    probe_n: int = 64  # problems in that probe
    rl_steps: int | None = None  # None = demo.yaml's train.steps; 0 = stop after the warm start
    overrides: tuple[str, ...] = ()  # `section.field=value` for the config
    quick: bool = False  # a pipeline check: too short to show a gain (the output says so)

    @classmethod
    def quick_check(cls, **kw: Any) -> DemoSettings:
        """About 2 minutes on 2 cores: fewer problems and demonstrations, 2 GRPO steps of 2 x 8 episodes.
        It checks that every stage works on this machine; 2 steps are too few to move accuracy. Every row runs
        the update's forward and backward (`train.skip_inert_rows=false`): its two groups often score alike,
        which would leave that stage unchecked."""
        overrides = ("train.tasks_per_step=2", "train.skip_inert_rows=false", *kw.pop("overrides", ()))
        # (the user's --set comes last and wins)
        return cls(**{"demos": 48, "eval_format": 8, "eval_rl": 24, "eval_base": 8, "rl_steps": 2,
                      "overrides": overrides, "quick": True, **kw})  # fmt: skip


DEFAULT_CONFIG = Path(__file__).parent / "configs" / "demo.yaml"
RESULTS_DOC = "docs/RESULTS.md of the rolerl repository"


def demo_config(settings: DemoSettings) -> Config:
    overrides = [f"model.spec={settings.model}", f"run.seed={settings.seed}", *settings.overrides]
    if settings.rl_steps:  # 0 = no RL (the config needs >= 1 step; run_demo skips the stage)
        overrides.append(f"train.steps={settings.rl_steps}")
    return load_config(DEFAULT_CONFIG, overrides)


def run_demo(settings: DemoSettings, log=print) -> dict[str, Any]:
    """The whole pipeline; returns (and writes to `run_dir/results.json`) every evaluation's summary."""
    from rolerl.hardware import describe
    from rolerl.rollout.engine import Engine, rollout_copy
    from rolerl.run.engines import rollout_dtype
    from rolerl.run.policy import build_policy
    from rolerl.tools import build_tools
    from rolerl.train.rl import resolve_old_logp, train
    from rolerl.train.sft import sft

    t_start = time.perf_counter()
    root = Path(settings.run_dir or time.strftime("runs/demo-%Y%m%d-%H%M%S"))
    if (root / "results.json").exists():
        raise ValueError(f"run_dir={str(root)!r} already holds a demo; choose another --run-dir")
    root.mkdir(parents=True, exist_ok=True)
    cfg = demo_config(settings)
    progress = cfg.run.progress
    fmt, rl = format_task(), rl_task()
    workflow = TIR(rl)
    policy = build_policy(cfg, workflow.roles)
    if settings.quick:
        log(
            "quick mode: a pipeline check of every stage (2 RL steps on a few problems are too few to move "
            f"accuracy); the full demo's measured gains are in {RESULTS_DOC}"
        )
    sampling = rollout_dtype(cfg, policy)
    old_logp = resolve_old_logp(cfg, policy)[0].algorithm.old_logp
    log(
        f"model {cfg.model.spec} ({cfg.model.dtype}), adapters {policy.adapter_names} rank {cfg.adapters.rank}, "
        f"bf16 training {'on' if policy.bf16 else 'off'}, rollouts and evaluations in "
        f"{str(sampling).removeprefix('torch.') if sampling else cfg.model.dtype}, PPO's old log-probs "
        f"{'recomputed' if old_logp == 'recompute' else 'from the rollout'} ({describe()})"
    )
    tools = build_tools(["python"])  # fails now, with what to do, where the sandbox cannot work
    # the evaluations sample as the RL rollouts do (and as `train`'s held-out evaluations): from a copy in
    # `rollout.dtype` where that is not the trainer's (adapters synced before each), else the trainer's
    engine = Engine(
        rollout_copy(policy.model, sampling) if sampling else policy.model,
        policy.tokenizer,
        max_batch=cfg.rollout.max_batch,
        tools=tools,
        source=policy.model if sampling else None,
        kernels=cfg.rollout.kernels,
        attention=cfg.rollout.attention,
        adapter_kernel=cfg.rollout.adapter_kernel,
        tied_head=cfg.rollout.tied_head,
        pointwise=cfg.rollout.pointwise,
        prefix_cache=cfg.rollout.prefix_cache,
    )
    held_out = {
        "format": fmt.examples("test", settings.eval_format, settings.seed),
        "rl": rl.examples("test", settings.eval_rl, settings.seed),
    }
    results: dict[str, Any] = {"settings": dataclasses.asdict(settings), "evals": {}}

    def run_eval(stage: str, limit: int | None = None) -> dict[str, EvalResult]:
        """Both groups in one batch (their episodes share the engine's forwards)."""
        groups = {g: (TIR(fmt if g == "format" else rl), ex[:limit], None) for g, ex in held_out.items()}
        total = sum(len(ex) for _, ex, _ in groups.values())
        engine.sync()  # a copy takes the trainer's current adapters
        with ProgressBar(f"eval {stage}", total, enabled=progress, transient=True) as bar:
            out = evaluate_groups(
                engine, policy.route_of, groups, max_new_tokens=cfg.rollout.max_new_tokens,
                max_tool_calls=cfg.rollout.max_tool_calls, seed=settings.seed,
                on_episode=lambda done, _: bar.update(done),
            )  # fmt: skip
        engine.sleep()  # its KV cache and packed weights are rebuilt by the next evaluation
        for group, result in out.items():
            s = result.summary()
            results["evals"][f"{stage}/{group}"] = s
            log(f"  {stage:>10} {group:>6}: {100 * s['accuracy']:5.1f}% +- {100 * s['stderr']:.1f} "
                f"(n={int(s['n'])}, tool use {100 * s['tool_use']:.0f}%, done at {result.seconds:.0f}s)")  # fmt: skip
        return out

    pipe = Pipeline(5, log)  # numbered and timed; not resumable: the stages hand one policy along
    stage: dict[str, dict[str, EvalResult]] = {}

    def imitate() -> None:
        data = fmt.write_demonstrations(root / "demonstrations.jsonl", settings.demos, settings.seed)
        sft_cfg = dataclasses.replace(
            cfg,
            run=dataclasses.replace(cfg.run, dir=str(root / "sft")),
            sft=dataclasses.replace(cfg.sft, data=str(data)),
        )
        # every policy kind: the warm start teaches the whole format even when RL trains only some kinds
        sft(sft_cfg, policy=policy, overwrite=True, every_kind=True)  # results.json guards a finished demo

    def warm_eval() -> None:
        stage["warm"] = run_eval("warm")
        if settings.probe_k > 0:
            results["probe"] = probe(engine, policy, settings, cfg)
            log(f"  probe (candidate families, {settings.probe_n} problems, T={cfg.rollout.temperature}): "
                f"pass@1 {100 * results['probe']['pass@1']:.1f}%, "
                f"pass@{settings.probe_k} {100 * results['probe'][f'pass@{settings.probe_k}']:.1f}%")  # fmt: skip

    rl_cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, dir=str(root / "rl")))
    try:
        pipe.run("base", "evaluating the base model (greedy)",
                 lambda: stage.update(base=run_eval("base", settings.eval_base)))  # fmt: skip
        pipe.run("sft", f"imitation warm start on {settings.demos} demonstrations x {cfg.sft.epochs} epochs",
                 imitate)  # fmt: skip
        results["sft_s"] = pipe.seconds["sft"]
        pipe.run("warm", "evaluating the warm start", warm_eval)
        base, warm = stage["base"], stage["warm"]
        after = warm
        if settings.rl_steps != 0:
            pipe.run("rl", f"GRPO on the RL families: {cfg.train.steps} steps x {cfg.train.tasks_per_step} "
                     f"tasks x {cfg.rollout.n} samples",
                     lambda: {"dir": str(train(rl_cfg, task=rl, workflow=workflow, policy=policy, overwrite=True))})  # fmt: skip
            results["rl_s"] = pipe.seconds["rl"]
            pipe.run("after", "evaluating after RL", lambda: stage.update(rl=run_eval("rl")))
            after = stage["rl"]
            log_evaluations(root / "rl", {0: warm, cfg.train.steps: after}, tensorboard=cfg.run.tensorboard)
            plot_metrics(
                root / "rl" / "metrics.jsonl",
                root / "training.png",
                "rolerl demo: TIR on the RL families",
                held_out={0: warm["rl"].accuracy(), cfg.train.steps: after["rl"].accuracy()},
            )
    finally:
        tools["python"].close()
    table = {"base": base, "warm start": warm} | ({"after RL": after} if after is not warm else {})
    for group in held_out:
        log(f"\n{group} families (held-out, greedy)")
        log(by_family_table({name: r[group] for name, r in table.items()}))
    if after is not warm:
        gain, se = pooled_gain([(warm["rl"].accuracy(), len(held_out["rl"]))],
                               [(after["rl"].accuracy(), len(held_out["rl"]))])  # fmt: skip
        results["gain"] = {"points": 100 * gain, "stderr_points": 100 * se}
        z = f"{gain / se:+.1f}" if se > 0 else "n/a"
        log(f"\nRL families: {100 * gain:+.1f} points over the warm start ({z} pooled standard errors)")
        if settings.quick:
            log(
                f"(quick mode is a pipeline check, not a result: see {RESULTS_DOC} for the full demo's gains)"
            )
    results["total_s"] = time.perf_counter() - t_start
    write_json(root / "results.json", results)
    log(f"wrote {root}/results.json" + (f", {root}/training.png" if after is not warm else "")
        + f" ({results['total_s'] / 60:.1f} min)")  # fmt: skip
    return results


def log_evaluations(run_dir: Path, evals: dict[int, dict[str, EvalResult]], tensorboard: bool = True) -> None:
    """The demo's held-out evaluations as its GRPO run's `eval/*` metrics, one row per step (0: the warm
    start), so `rolerl report` draws them: `eval/pass@1`, `eval/stderr`, `eval/examples` and
    `eval/tool_call_rate` of the RL families (the task trained on), `eval/format/pass@1` of the format
    families, and `eval/<family>/pass@1` of each family. The base model is not a step of this run: its
    figures are in results.json and the report's before/after table."""
    rows = {}
    for step, results in evals.items():
        rl, fmt = results["rl"], results["format"]
        rows[step] = {"pass@1": rl.accuracy(), "stderr": rl.stderr(), "examples": float(len(rl.examples)),
                      "tool_call_rate": rl.tool_use(), "format/pass@1": fmt.accuracy()}  # fmt: skip
        for result in (rl, fmt):
            rows[step] |= {f"{fam}/pass@1": result.accuracy(fam) for fam in result.families()}
    pipeline.log_evaluations(run_dir, rows, tensorboard=tensorboard)


def probe(engine, policy, settings: DemoSettings, cfg: Config) -> dict[str, float]:
    """pass@1 and pass@k of the current adapters at the rollout temperature, on every candidate family
    (`PROBE_FAMILIES`: the RL families and others that were considered for RL). It draws from the train
    split: choosing families never looks at the held-out problems."""
    task = SyntheticTask(PROBE_FAMILIES, name="synthetic_probe")
    examples = task.examples("train", settings.probe_n, settings.seed + 1)
    r = evaluate(
        engine, policy.route_of, TIR(task), examples, samples=settings.probe_k, greedy=False,
        temperature=cfg.rollout.temperature, max_new_tokens=cfg.rollout.max_new_tokens,
        max_tool_calls=cfg.rollout.max_tool_calls, seed=settings.seed,
    )  # fmt: skip
    out = {
        "pass@1": r.pass_at(1),
        f"pass@{settings.probe_k}": r.pass_at(settings.probe_k),
        "seconds": r.seconds,
    }
    for fam in r.families():
        out[f"pass@1/{fam}"] = r.pass_at(1, fam)
        out[f"pass@{settings.probe_k}/{fam}"] = r.pass_at(settings.probe_k, fam)
    return out
