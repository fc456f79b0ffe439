"""`rolerl recipe NAME`: a public benchmark's whole pipeline in one resumable command (issue 47).

For GSM8K with a Python tool (`gsm8k-tir`) or MSARL's reasoner and coder (`gsm8k-msarl`), each stage reading
the recipe's example config (rolerl/configs/<name>.yaml) with the flags on top:

1. demonstrations from GSM8K train: the calculator annotations as sandbox-checked tool calls (`rolerl demos`);
2. the base model on the test set (greedy pass@1): the recipe's adapters fresh, which add exactly zero;
3. the imitation warm start on the demonstrations (`rolerl sft`);
4. the warm start on the test set;
5. GRPO on GSM8K train with the sandbox, from the warm start (`rolerl train`);
6. the adapters after RL on the test set;
7. `results.json` (the three evaluations, the gain over the warm start with its standard error, each
   stage's wall time) and `rolerl report`'s page, with the before/after table.

Everything goes under one directory (`--out`, default runs/<name>). Each finished stage leaves a marker
(`rolerl.pipeline`), so a rerun of the same command skips what is done and goes on where it stopped: an
evaluation continues its samples.jsonl, GRPO and the imitation their newest checkpoint. The test subset
(`--limit N`: the first N of a fixed shuffle of the 1319 problems) does not depend on `--seed`, so every
seed and arm is measured on the same problems. `--warm-from DIR` copies another run's finished warm start (stages 1-4) so
that only GRPO, with this run's seed, and its evaluation run; `--pass-k N` adds a stage that samples the final
adapters N times a problem (pass@k, maj@k).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from rolerl.config import Config, load_config
from rolerl.files import write_json
from rolerl.pipeline import Log, Pipeline, differences, log_evaluations


@dataclass(frozen=True)
class Recipe:
    config: str  # the example config its stages read (`rolerl configs show NAME`)
    demos: Literal["tir", "msarl"]  # the converter's format (`rolerl demos gsm8k --format ...`)
    topologies: tuple[str, ...]  # the adapters.preset values it runs with (the first is the config's)
    about: str


RECIPES: dict[str, Recipe] = {
    "gsm8k-tir": Recipe(
        "gsm8k-tir", "tir", ("shared", "dart"), "tool-integrated reasoning with the Python sandbox on GSM8K"
    ),
    "gsm8k-msarl": Recipe(
        "gsm8k-msarl", "msarl", ("isolated", "shared"), "MSARL's reasoner and coder agent on GSM8K"
    ),
}
TASK = "gsm8k"
TEST_SIZE = 1319  # GSM8K's test split (the default --limit: all of it)
EVAL_SEED = 0  # the test subset's shuffle: the same problems for every --seed


@dataclass
class RecipeSettings:
    """What `rolerl recipe` runs (its flags); None = the recipe config's value."""

    name: str
    out: str | None = None  # None = runs/<name>
    seed: int = 0  # seeds the adapters, GRPO's sampling and shuffling (not the test subset)
    model: str | None = None  # model.spec: default (SmolLM2-135M-Instruct), tiny:llama, a HF id or a path
    topology: str | None = None  # adapters.preset, one of the recipe's `topologies`
    steps: int | None = None  # GRPO steps; 0 = stop after the warm start
    limit: int | None = None  # test problems; None = the whole test set
    demos: int | None = None  # convert the first N GSM8K train rows only; None = all of them
    data: str | None = None  # the data root holding gsm8k/{train,test}.jsonl; None = the default one
    overrides: tuple[str, ...] = ()  # `section.field=value` for the config, applied last
    # another run of this recipe whose finished warm start (demos, base and warm evaluations, sft) this one
    # starts from: only GRPO and its evaluation run here, with this run's --seed
    warm_from: str | None = None
    # sample the final adapters N times a test problem (pass@k, maj@k); None = greedy only
    pass_k: int | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        if self.name not in RECIPES:
            raise ValueError(f"unknown recipe {self.name!r}; recipes: {', '.join(sorted(RECIPES))}")
        allowed = RECIPES[self.name].topologies
        if self.topology is not None and self.topology not in allowed:
            raise ValueError(f"--topology {self.topology!r}: recipe {self.name} runs {', '.join(allowed)}")
        if self.limit is not None and self.limit < 1:
            raise ValueError(
                f"--limit {self.limit}: allowed an integer >= 1 (test problems; omit it for all {TEST_SIZE})"
            )
        if self.demos is not None and self.demos < 1:
            raise ValueError(f"--demos {self.demos}: allowed an integer >= 1 (omit it for every train row)")
        if self.steps is not None and self.steps < 0:
            raise ValueError(f"--steps {self.steps}: allowed an integer >= 0 (0 = stop after the warm start)")
        if self.pass_k is not None and self.pass_k < 2:
            raise ValueError(f"--pass-k {self.pass_k}: allowed an integer >= 2 (samples per test problem)")

    @property
    def root(self) -> Path:
        return Path(self.out or f"runs/{self.name}")


# the --set keys only GRPO reads (the demonstrations, SFT and the greedy evaluations never do): a run may
# change them and still share a warm start (--warm-from, or a rerun of its own directory). MSARL's coder
# siblings are sampling only: a greedy evaluation makes one coder call a request whatever coder_samples says
RL_ONLY = ("train.steps", "train.tasks_per_step", "rollout.n", "rollout.temperature", "rollout.top_p",
           "optim.lr", "task.max_difficulty", "task.split", "algorithm.",
           "task.workflow_options.coder_samples", "task.workflow_options.sibling_groups")  # fmt: skip
EVAL_DIRS = ("base", "warm", "rl", "warm-sampled", "rl-sampled")  # the evaluations, under OUT/eval/
WARM_STAGES = ("demos", "eval-base", "sft", "eval-warm")  # what --warm-from takes from another run
WARM_OUTPUTS = ("demos.jsonl", "base", "sft", "eval/base", "eval/warm")


def warm_overrides(overrides: list[str] | tuple[str, ...]) -> list[str]:
    """The --set entries the warm start reads: all but those of RL_ONLY's keys (and algorithm.*)."""

    def rl_only(entry: str) -> bool:
        key = entry.split("=", 1)[0].strip()
        return key in RL_ONLY or key.startswith(tuple(k for k in RL_ONLY if k.endswith(".")))

    return [o for o in overrides if not rl_only(o)]


def data_root(data: str | None) -> Path:
    """The data root (or gsm8k folder) holding both splits, checked now rather than stages later."""
    from rolerl.tasks.base import default_data_dir

    root = Path(data).expanduser() if data else default_data_dir()
    for split in ("train", "test"):
        if not any((d / f"{split}.jsonl").is_file() for d in (root / TASK, root)):
            where = f"--data {data}" if data else f"the default data root {root} (set ROLERL_SHARED_DATA)"
            raise FileNotFoundError(
                f"{where}: no {TASK}/{split}.jsonl there; give the directory that holds gsm8k/train.jsonl "
                "and gsm8k/test.jsonl (or the gsm8k folder itself)"
            )
    return root


def recipe_config(settings: RecipeSettings, *extra: str) -> Config:
    """The recipe's config with the flags on top (the user's --set last, so it wins); `extra` go before them."""
    flags = [f"run.seed={settings.seed}", f"run.progress={str(settings.progress).lower()}", "eval.every=0"]
    # eval.every=0: the recipe measures the whole test set itself, before and after; --set eval.every=N adds
    # the run's own periodic curve (on eval.limit problems)
    flags += [f"model.spec={settings.model}"] * (settings.model is not None)
    flags += [f"adapters.preset={settings.topology}"] * (settings.topology is not None)
    flags += [f"train.steps={settings.steps}"] * bool(settings.steps)  # 0: no RL stage, config untouched
    flags += [f"task.data={settings.data}"] * (settings.data is not None)
    return load_config(RECIPES[settings.name].config, [*flags, *extra, *settings.overrides])


def run_recipe(settings: RecipeSettings, log: Log = print) -> dict[str, Any]:
    """Every stage not finished yet; returns (and writes to OUT/results.json) the evaluations' summaries."""
    recipe, root = RECIPES[settings.name], settings.root
    data = data_root(settings.data)
    cfg = recipe_config(settings)  # a bad --set fails here, before any stage
    rl = settings.steps != 0
    # what each stage's outputs depend on: a rerun that changes one of them is refused at that stage
    policy = {"model": cfg.model.spec, "topology": cfg.adapters.preset, "seed": settings.seed,
              "overrides": list(settings.overrides), "data": str(data), "demos": settings.demos}  # fmt: skip
    steps = {"steps": cfg.train.steps if rl else 0}
    # the warm start's own seed and topology: this run's, or those of the run it is taken from (checked
    # before any write)
    warm_seed, warm_topology = (
        (settings.seed, cfg.adapters.preset)
        if settings.warm_from is None
        else _warm_source(settings, policy, rl)
    )
    _claim(root, settings.name)
    if settings.warm_from is not None:
        _copy_warm_start(Path(settings.warm_from).resolve(), root)
        steps |= {"warm_from": str(Path(settings.warm_from).resolve()), "warm_seed": warm_seed}
        steps |= {"warm_topology": warm_topology} if warm_topology != cfg.adapters.preset else {}
    warm = policy | {
        "seed": warm_seed,
        "topology": warm_topology,
        "overrides": warm_overrides(settings.overrides),
    }
    n_test = f"{settings.limit} of the {TEST_SIZE}" if settings.limit else f"all {TEST_SIZE}"
    pipe = Pipeline((7 if rl else 5) + bool(settings.pass_k), log, root)
    log(f"recipe {settings.name}: {recipe.about}; model {cfg.model.spec}, topology {cfg.adapters.preset}, "
        f"seed {settings.seed}, into {root}")  # fmt: skip
    if settings.warm_from is not None:
        log(
            f"the warm start (seed {warm_seed}) is {settings.warm_from}'s, copied: GRPO runs with seed {settings.seed}"
        )
    if warm_topology != cfg.adapters.preset:
        log(f"  it is a {warm_topology} warm start: each {cfg.adapters.preset} adapter starts from its one adapter, "
            "so GRPO starts from the very policy the warm start's evaluation measured")  # fmt: skip
    rows = "every" if settings.demos is None else f"the first {settings.demos}"
    made = pipe.run("demos", f"demonstrations ({recipe.demos}) from {rows} GSM8K train rows",
                    lambda: _demos(recipe, root, data, settings, log), {"data": str(data), "demos": settings.demos})  # fmt: skip
    evals: dict[str, dict[str, Any]] = {}
    test = {"limit": settings.limit}
    evals["base"] = pipe.run("eval-base", f"the base model on {n_test} test problems (greedy pass@1)",
                             lambda: _eval_base(settings, root, log), warm | test)  # fmt: skip
    pipe.run("sft", f"imitation warm start on {made.get('rows', '?')} demonstrations x {cfg.sft.epochs} epochs",
             lambda: _imitate(settings, root, log), warm)  # fmt: skip
    evals["warm"] = pipe.run("eval-warm", f"the warm start on {n_test} test problems",
                             lambda: _eval(settings, root, "warm", root / "sft", log), warm | test)  # fmt: skip
    if rl:
        pipe.run("rl", f"GRPO on GSM8K train: {cfg.train.steps} steps x {cfg.train.tasks_per_step} problems x "
                 f"{cfg.rollout.n} samples", lambda: _grpo(settings, root, warm_topology), policy | steps)  # fmt: skip
        evals["rl"] = pipe.run("eval-rl", f"after RL on {n_test} test problems",
                               lambda: _eval(settings, root, "rl", root / "rl", log), policy | steps | test)  # fmt: skip
    results = {"recipe": settings.name, "settings": dataclasses.asdict(settings), "demos": made,
               "evals": {f"{stage}/{TASK}": s for stage, s in evals.items()}}  # fmt: skip
    if rl:
        results["gain"] = _gain(evals["warm"], evals["rl"], root)
    if settings.pass_k:  # the final adapters sampled at the training temperature, on the same problems
        stage, run, what = ("rl", root / "rl", "after RL") if rl else ("warm", root / "sft", "the warm start")
        k, temp = settings.pass_k, cfg.rollout.temperature
        results["sampled"] = pipe.run(
            "pass-k", f"{what}: {k} samples per test problem at temperature {temp} (pass@k, maj@k)",
            lambda: _eval(settings, root, f"{stage}-sampled", run, log, n=k, temperature=temp),
            policy | steps | test | {"pass_k": k, "temperature": temp},
        )  # fmt: skip
        results["sampled"]["stage"] = stage
    report = pipe.run("report", "results.json and the report",
                      lambda: _report(root, results, cfg, rl), policy | steps | test)  # fmt: skip
    results["seconds"] = dict(pipe.seconds)
    write_json(root / "results.json", results)  # again: with the report stage's own time
    for line in summary_lines(results):
        log(line)
    log(f"report: {report.get('page')}")
    return results


def _warm_source(settings: RecipeSettings, policy: dict[str, Any], rl: bool) -> tuple[int, str]:
    """The seed and topology of `--warm-from`'s warm start, after checking that run is this recipe, finished
    every warm-start stage (WARM_STAGES), and made them with this run's inputs (model, the --set entries the
    warm start reads, data, --demos, --limit) but the seed, and with this run's topology or one adapter (a
    shared warm start, which every adapter of this run's topology then starts from)."""
    if not rl:
        raise ValueError("--warm-from starts GRPO from another run's warm start: it needs --steps >= 1")
    src = Path(settings.warm_from or "").resolve()
    if src == settings.root.resolve():
        raise ValueError(f"--warm-from {settings.warm_from}: that is --out itself")
    found = _recipe_of(src)
    if found != settings.name:
        held = f"holds recipe {found!r}" if found else "is not a recipe's directory (no recipe.json)"
        raise ValueError(f"--warm-from {settings.warm_from} {held}, not {settings.name!r}")
    missing = [n for n in WARM_STAGES if not (src / "stages" / f"{n}.json").is_file()]
    if missing:
        raise ValueError(
            f"--warm-from {settings.warm_from}: its warm start is not finished (no {', '.join(missing)} stage): "
            "run that recipe to its end, or with --steps 0"
        )
    inputs = json.loads((src / "stages" / "eval-warm.json").read_text())["inputs"]
    seed, topology = int(inputs.get("seed", 0)), str(inputs.get("topology", policy["topology"]))
    inputs |= {"overrides": warm_overrides(inputs.get("overrides", []))}
    here = policy | {"seed": seed, "topology": topology, "limit": settings.limit,
                     "overrides": warm_overrides(settings.overrides)}  # fmt: skip
    was = differences(inputs, here, word="here")
    if was:
        raise ValueError(f"--warm-from {settings.warm_from}: its warm start was made with {was}")
    if topology != policy["topology"] and len(held := _adapters(src / "sft")) != 1:
        raise ValueError(
            f"--warm-from {settings.warm_from}: its warm start is --topology {topology}, with the adapters "
            f"{held}; a run of another topology (here {policy['topology']}) starts every adapter from a warm "
            "start's one adapter: take it from a --topology shared run, or run this topology's own warm start"
        )
    return seed, topology


def _adapters(run: Path) -> list[str]:
    """The adapters a run directory saved (its adapters/<name> PEFT directories)."""
    return (
        sorted(p.name for p in (run / "adapters").iterdir() if p.is_dir())
        if (run / "adapters").is_dir()
        else []
    )


def _copy_warm_start(src: Path, root: Path) -> None:
    """Copy `src`'s warm start (WARM_OUTPUTS, then their stage markers) into `root`, unless a rerun finds it
    copied already; a copy cut short is redone (the markers come last)."""
    import shutil

    if (root / "stages" / "eval-warm.json").is_file():
        return
    for name in WARM_OUTPUTS:
        dest = root / name
        if dest.is_dir():
            shutil.rmtree(dest)
        if (src / name).is_dir():
            shutil.copytree(src / name, dest)
        elif (src / name).is_file():
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src / name, dest)
    for name in WARM_STAGES:  # their inputs as this run's warm stages see them (RL-only --set entries out)
        marker = json.loads((src / "stages" / f"{name}.json").read_text())
        if "overrides" in marker.get("inputs", {}):
            marker["inputs"]["overrides"] = warm_overrides(marker["inputs"]["overrides"])
        write_json(root / "stages" / f"{name}.json", marker)


def _recipe_of(root: Path) -> str | None:
    """The recipe whose directory `root` is (its recipe.json), or None."""
    mark = root / "recipe.json"
    return json.loads(mark.read_text()).get("recipe") if mark.is_file() else None


def _claim(root: Path, name: str) -> None:
    """OUT is this recipe's own: refuse another recipe's directory, or one that holds anything else."""
    mark = root / "recipe.json"
    if mark.is_file():
        found = _recipe_of(root)
        if found != name:
            raise ValueError(f"--out {root} holds recipe {found!r}, not {name!r}: choose another --out")
        return
    if root.exists() and any(root.iterdir()):
        raise ValueError(
            f"--out {root} exists and is not a recipe's directory (no recipe.json): choose another"
        )
    write_json(mark, {"recipe": name})


def _demos(recipe: Recipe, root: Path, data: Path, settings: RecipeSettings, log: Log) -> dict[str, Any]:
    from rolerl.demos import gsm8k as gsm8k_demos

    out = root / "demos.jsonl"
    report = gsm8k_demos.build(recipe.demos, out, data=data, limit=settings.demos, progress=settings.progress)
    for line in gsm8k_demos.summary_lines(report, out, recipe.demos):
        log("  " + line)
    rows = sum(1 for line in out.read_text().splitlines() if line.strip())
    return {**report.summary(), "rows": rows}


def _eval_base(settings: RecipeSettings, root: Path, log: Log) -> dict[str, Any]:
    """The base model as the recipe runs it: its topology's adapters fresh (LoRA's B = 0 adds exactly
    zero), saved beside the config, so the evaluation reads the same role settings as the warm start's."""
    from rolerl.models.adapters_io import save_adapter
    from rolerl.models.lora import adapter_specs
    from rolerl.run.policy import build_policy
    from rolerl.tasks import load_task
    from rolerl.workflows import load_workflow

    cfg = recipe_config(settings)
    workflow = load_workflow(
        cfg.task.workflow, load_task(cfg.task.name, cfg.task.data), cfg.task.workflow_options
    )
    policy = build_policy(cfg, workflow.roles)
    base = root / "base"
    for member in policy.members.values():
        for name in adapter_specs(member.model):
            save_adapter(member.model, name, base / "adapters" / name)
    (base / "config.yaml").write_text(cfg.to_yaml())
    del policy
    return _eval(settings, root, "base", base, log)


def _eval(
    settings: RecipeSettings,
    root: Path,
    stage: str,
    run: Path,
    log: Log,
    n: int = 1,
    temperature: float = 0.0,
) -> dict[str, Any]:
    """Greedy pass@1 of `run`'s adapters (its config: model, topology, role settings) on the test set, or
    `n` samples a problem at `temperature` (pass@k and maj@k too), continuing an evaluation cut short."""
    from rolerl.eval.failures import analyze
    from rolerl.eval.harness import EvalSpec, run_eval

    cfg = recipe_config(settings)
    out = root / "eval" / stage
    spec = EvalSpec(
        task=TASK, data=cfg.task.data, split="test", workflow=cfg.task.workflow,
        workflow_options=dict(cfg.task.workflow_options), run=str(run), n=n, temperature=temperature,
        max_new_tokens=cfg.rollout.max_new_tokens, tool=cfg.rollout.tool, max_tool_calls=cfg.rollout.max_tool_calls,
        limit=settings.limit, seed=EVAL_SEED, out=str(out), resume=(out / "samples.jsonl").exists(),
        max_batch=cfg.rollout.max_batch, progress=settings.progress,
    )  # fmt: skip
    result = run_eval(spec, log_line=lambda text: log("  " + text.replace("\n", "\n  ")))
    m, failures = result["metrics"], analyze(out)
    return {"accuracy": m["pass@1"], "stderr": m["stderr"], "n": m["examples"], "tool_use": m["tool_call_rate"],
            "truncated": m["truncated_rate"], "tokens": m["tokens/mean"], "seconds": result["seconds"],
            "failures": failures["counts"],
            "by_difficulty": {str(level): cell for level, cell in failures["by_difficulty"].items()},
            **{k: v for k, v in m.items() if k.startswith(("pass@", "maj@", "stderr/")) and n > 1}}  # fmt: skip


def _imitate(settings: RecipeSettings, root: Path, log: Log) -> dict[str, Any]:
    from rolerl.train.checkpoint import holds_run
    from rolerl.train.sft import ResumeMismatch, sft

    cfg = recipe_config(settings, f"sft.data={root / 'demos.jsonl'}", f"run.dir={root / 'sft'}")
    # a warm start cut short (no marker) goes on from its newest checkpoint, unless that was trained on other
    # inputs (another command into this directory): then it starts again; every policy kind is trained
    try:
        adapters = sft(cfg, resume=bool(holds_run(root / "sft")), every_kind=True)
    except ResumeMismatch as e:
        log(
            f"the imitation cut short in {root / 'sft'} was trained on other inputs ({e.differ}): it starts again"
        )
        adapters = sft(cfg, overwrite=True, every_kind=True)
    return {"adapters": str(adapters)}


def _grpo(settings: RecipeSettings, root: Path, warm_topology: str) -> dict[str, Any]:
    """GRPO from the warm start's adapters; a warm start of another topology has one adapter (`_warm_source`),
    which each of this run's adapters starts from."""
    from rolerl.train.checkpoint import holds_run
    from rolerl.train.rl import train

    rl_dir = root / "rl"
    extra = [f"adapters.init={root / 'sft' / 'adapters'}", f"run.dir={rl_dir}"]
    if warm_topology != recipe_config(settings).adapters.preset:
        (one,) = _adapters(root / "sft")
        extra.append(f"adapters.init_from={json.dumps({'*': one})}")
    cfg = recipe_config(settings, *extra)
    train(cfg, resume=bool(holds_run(rl_dir)))  # a run cut short goes on from its newest checkpoint
    lines = (rl_dir / "metrics.jsonl").read_text().splitlines()
    last = json.loads(lines[-1]) if lines else {}
    return {k: last[k] for k in ("step", "reward/mean", "accuracy") if k in last}


def _gain(warm: dict[str, Any], after: dict[str, Any], root: Path) -> dict[str, Any]:
    """RL's gain over the warm start: as two independent proportions, and paired on the same problems (each
    problem's change, from both evaluations' samples.jsonl)."""
    from rolerl.eval import paired_gain, pooled_gain

    gain, se = pooled_gain([(warm["accuracy"], int(warm["n"]))], [(after["accuracy"], int(after["n"]))])
    p = paired_gain(*(_greedy(root / "eval" / stage) for stage in ("warm", "rl")))
    paired = {"points": 100 * p.gain, "stderr_points": 100 * p.stderr, "wrong_to_right": p.wrong_to_right,
              "right_to_wrong": p.right_to_wrong, "n": p.n}  # fmt: skip
    return {"points": 100 * gain, "stderr_points": 100 * se, "label": "GSM8K test", "paired": paired}


def _greedy(out: Path) -> dict[str, bool]:
    """A greedy evaluation's `problem id -> correct` (its samples.jsonl)."""
    rows = (json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines() if line.strip())
    return {row["id"]: bool(row["correct"]) for row in rows}


def _report(root: Path, results: dict[str, Any], cfg: Config, rl: bool) -> dict[str, Any]:
    """results.json, the evaluations as the GRPO run's eval/* rows (step 0: the warm start), the page."""
    from rolerl.report.html import write_report

    write_json(root / "results.json", results)
    if rl:  # once: a report stage cut short after this has written them
        logged = {json.loads(line).get("step") for line in (root / "rl" / "metrics.jsonl").read_text().splitlines()
                  if "eval/pass@1" in line}  # fmt: skip
        rows = {step: {"pass@1": s["accuracy"], "stderr": s["stderr"], "examples": s["n"],
                       "tool_call_rate": s["tool_use"]}
                for step, s in ((0, results["evals"][f"warm/{TASK}"]), (cfg.train.steps, results["evals"][f"rl/{TASK}"]))}  # fmt: skip
        rows = {step: row for step, row in rows.items() if step not in logged}
        log_evaluations(root / "rl", rows, tensorboard=cfg.run.tensorboard)
    return {"page": str(write_report([root]))}


def summary_lines(results: dict[str, Any]) -> list[str]:
    """The before/after table: each stage's greedy pass@1 with its standard error, and the RL gain."""
    from rolerl.eval.harness import stderr_key

    names = {"base": "base model", "warm": "warm start", "rl": "after RL"}
    lines = [f"\n{results['recipe']}: GSM8K test, greedy pass@1"]
    for key, s in results["evals"].items():
        stage = key.split("/")[0]
        lines.append(f"  {names[stage]:<11} {100 * s['accuracy']:5.1f}% +- {100 * s['stderr']:.1f}  (n={int(s['n'])}, "
                     f"tool use {100 * s['tool_use']:.0f}%, {s['seconds']:.0f}s)")  # fmt: skip
        wrong = {k: v for k, v in s.get("failures", {}).items() if k != "correct" and v}
        if wrong:  # where the wrong answers go (rolerl failures)
            lines.append(
                "      wrong: "
                + ", ".join(f"{k} {v}" for k, v in sorted(wrong.items(), key=lambda kv: -kv[1]))
            )
    if "gain" in results:
        g = results["gain"]
        z = f" ({g['points'] / g['stderr_points']:+.1f} standard errors)" if g["stderr_points"] else ""
        lines.append(f"  RL over the warm start: {g['points']:+.1f} points{z}")
        if "paired" in g:
            p = g["paired"]
            z = f", {p['points'] / p['stderr_points']:+.1f} SE" if p["stderr_points"] else ""
            lines.append(f"    paired on the same {p['n']} problems: {p['points']:+.1f} +- {p['stderr_points']:.1f}"
                         f"{z} ({p['wrong_to_right']} wrong -> right, {p['right_to_wrong']} right -> wrong)")  # fmt: skip
    if "sampled" in results:
        s = results["sampled"]
        ks = sorted(
            (k for k in s if k.startswith(("pass@", "maj@"))), key=lambda k: (k[0], int(k.split("@")[1]))
        )
        shown = [
            f"{k} {100 * s[k]:.1f}%" + (f" +- {100 * s[e]:.1f}" if (e := stderr_key(k)) in s else "")
            for k in ks
        ]
        lines.append(f"  {names[s['stage']]}, sampled: " + ", ".join(shown))
    seconds = results.get("seconds", {})
    lines.append("  stage wall times: " + ", ".join(f"{k} {v:.0f}s" for k, v in seconds.items()))
    return lines
