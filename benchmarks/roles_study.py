"""The studies of issue 48 at CPU scale: multi-role workflows whose roles learn, each from the role warm
start of its workflow, on the demo's word problems (`synthetic`) with the Python sandbox, where the default
135M model solves ~40% of the held-out problems after imitation (docs/RESULTS.md "Workflows"); on GSM8K it
solves 0.5-1% (docs/RESULTS.md, the base model at 512 tokens): too few rewarded episodes for a 4-step run
to move, and 512-token calls would cost ~8x the time of 64-token ones. Arms (`ARMS`), at the same budget each (`STEPS` steps x `TASKS` problems x
`SAMPLES` episodes, `max_new_tokens` 64 per call):

- voting (3 voters, 1 aggregator; outcome reward broadcast, groups per voter index, seq-mean-token-mean):
  `voting-shared` vs `voting-isolated` vs `voting-isolated-merged`, each role's calls in their own
  mini-batches (`mini_batch_by: role`: the voter adapter takes 3 optimizer steps per step unless
  `step_policy: merged`, paper 3's drift); and under `shared` with both roles in one mini-batch,
  `voting-shared-aggregate` vs `voting-shared-equal` (`algorithm.role_share`: per-output averaging gives
  the voters 3/4 of the loss and the aggregator 1/4, against 1/2 each);
- eval_opt (2 rounds; role reward: the evaluator is paid for a right verdict) and orch_workers (3 workers;
  outcome reward, groups per role): `shared` vs `isolated`, one optimizer step per adapter per step;
- `tir` (one policy, from the demo's TIR imitation) vs `reasoner_tools` (a reasoner asking a coder,
  `isolated`, from imitation of its own protocol), both on the same 256 format problems.

Warm start, built once per workflow under `--out` and reused by its arms and seeds: the workflow's role
demonstrations (`rolerl demos <workflow> --task synthetic_format`, 256 train problems of the demo's format
families, disjoint from the RL and held-out families; `reasoner_tools`: `_study.reasoner_tools_demos`;
`tir`: the task's demonstrations) and `rolerl sft demo` on them under `shared` (2 epochs), the one adapter
copied under every role's name for the `isolated` arms, so that every arm of a workflow starts from the same
weights. Held-out: greedy, the same `EVAL_LIMIT` test problems, through the arm's own workflow, before RL
(the warm start, once per workflow) and after.

    python benchmarks/roles_study.py run --seeds 0 1 2 [--arms voting-shared ...] [--out runs/roles_study]
    python benchmarks/roles_study.py summarize [benchmarks/results/roles_study]

Each finished run writes `RESULTS/<arm>-s<seed>.json` (the overrides, commit, CPU, wall times, held-out
accuracy and role metrics before and after with each problem's 0/1, and the per-step metrics); `run` skips
the runs whose file exists, so the study accumulates across sessions (a run cut short starts again; the
warm starts and the before-evaluations under `--out` are reused while that directory lives). One process:
torch uses both cores (or `OMP_NUM_THREADS=1` for two processes side by side, each on its own workflows: two
processes must not build one warm start at once).
Time, measured on a 2-core EPYC (docs/RESULTS.md "Roles study"): tir and reasoner_tools ~22 min for 3 seeds
with both warm starts at 2 threads; at one thread, two processes side by side, voting's 5 arms x 3 seeds ~81
min with its warm start (~24 min: its aggregator rows hold three solutions), orch_workers' 2 x 3 ~75 min
(warm start ~43 min: its synthesizer rows too), eval_opt's seeds 1-2 ~13 min (warm start reused); all 33
runs ~2.2 h of wall time. The warm starts are rebuilt in a new session (their adapters are not committed).
`--quick` runs the same stages on the tiny random model (a test of the script, not a study).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from _study import held_out, main, mean_se, problem_means, reasoner_tools_demos, rolerl, step_records

RESULTS = Path(__file__).parent / "results" / "roles_study"
STEPS, TASKS, SAMPLES, EVAL_LIMIT, DEMOS = 4, 4, 4, 64, 256
COMMON = [
    "rollout.max_new_tokens=64", "rollout.max_tool_calls=2", "rollout.tool=python", f"rollout.n={SAMPLES}",
    f"train.steps={STEPS}", f"train.tasks_per_step={TASKS}", "train.mini_batches=1", "algorithm.beta=0.0",
    "run.progress=false", "run.checkpoint_every=100", "rollout.max_batch=32", "rollout.max_len=1024",
]  # fmt: skip
# the stages on the tiny random model, a few problems, one step: a test of the script
QUICK = {"sets": ["model.spec=tiny:llama", "model.dtype=float32", "rollout.max_new_tokens=8", "rollout.n=2",
                  "train.steps=1", "train.tasks_per_step=2", "sft.epochs=1", "train.micro_batch_size=8"],
         "demos": 4, "eval": 4, "max_new_tokens": 8}  # fmt: skip
WORKFLOWS = {  # workflow -> (options, the roles its adapters are named after under `isolated`)
    "voting": ({"voters": 3}, ["voter", "aggregator"]),
    "eval_opt": ({"rounds": 2}, ["generator", "evaluator"]),
    "orch_workers": ({"workers": 3}, ["orchestrator", "worker", "synthesizer"]),
    "tir": ({}, []),
    "reasoner_tools": ({"max_tool_requests": 2}, ["reasoner", "coder"]),
}
VOTING = ["algorithm.reward=outcome", "algorithm.group_key=role_instance",
          "algorithm.loss_agg=seq-mean-token-mean"]  # fmt: skip
BY_ROLE = ["train.mini_batch_by=role", f"train.mini_batch_size={TASKS * SAMPLES}"]
ARMS: dict[str, tuple[str, str, list[str]]] = {  # arm -> (workflow, preset, overrides)
    "voting-shared": ("voting", "shared", [*VOTING, *BY_ROLE]),
    "voting-isolated": ("voting", "isolated", [*VOTING, *BY_ROLE]),
    "voting-isolated-merged": ("voting", "isolated", [*VOTING, *BY_ROLE, "train.step_policy=merged"]),
    "voting-shared-aggregate": ("voting", "shared", [*VOTING, "algorithm.role_share=aggregate"]),
    "voting-shared-equal": ("voting", "shared", [*VOTING, "algorithm.role_share=equal"]),
    "eval_opt-shared": ("eval_opt", "shared", ["algorithm.reward=role", "algorithm.group_key=role"]),
    "eval_opt-isolated": ("eval_opt", "isolated", ["algorithm.reward=role", "algorithm.group_key=role"]),
    "orch_workers-shared": ("orch_workers", "shared", ["algorithm.reward=outcome", "algorithm.group_key=role"]),
    "orch_workers-isolated": ("orch_workers", "isolated",
                              ["algorithm.reward=outcome", "algorithm.group_key=role"]),
    "tir": ("tir", "shared", []),
    "reasoner_tools": ("reasoner_tools", "isolated", ["algorithm.reward=role"]),
}  # fmt: skip
TABLES = {"voting": ("voting",), "eval_opt": ("eval_opt",), "orch_workers": ("orch_workers",),
          "tir vs reasoner_tools": ("tir", "reasoner_tools")}  # fmt: skip
COMPARISONS = [  # (arm a, arm b): the differences the issue asks about
    ("voting-shared", "voting-isolated"),
    ("voting-isolated", "voting-isolated-merged"),
    ("voting-shared-aggregate", "voting-shared-equal"),
    ("eval_opt-shared", "eval_opt-isolated"),
    ("orch_workers-shared", "orch_workers-isolated"),
    ("tir", "reasoner_tools"),
]


def warm_demos(workflow: str, path: Path, n: int) -> Path:
    """The workflow's imitation rows from `n` train problems of the demo's format families, at `path`."""
    if workflow == "tir":
        from rolerl.tasks.synthetic import format_task

        return format_task().write_demonstrations(path, n, seed=0)
    if workflow == "reasoner_tools":
        return reasoner_tools_demos(path, n)
    from rolerl.demos.roles import build  # `rolerl demos <workflow> --task synthetic_format --limit n`
    from rolerl.tasks import load_task
    from rolerl.workflows import load_workflow

    task = load_task("synthetic_format")
    build(
        load_workflow(workflow, task, WORKFLOWS[workflow][0]),
        task.examples("train", n, 0),
        path,
        progress=False,
    )
    return path


def warm_start(out: Path, workflow: str, quick: bool) -> Path:
    """The workflow's warm start (module doc): `out/warm-<workflow>/adapters` (one adapter per role for
    `reasoner_tools`, else `policy`); built once."""
    warm = out / f"warm-{workflow}"
    names = WORKFLOWS[workflow][1] if workflow == "reasoner_tools" else ["policy"]
    if all((warm / "adapters" / n / "adapter_config.json").exists() for n in names):
        return warm / "adapters"
    shutil.rmtree(warm, ignore_errors=True)
    warm.mkdir(parents=True)
    demos = warm_demos(workflow, warm / "demos.jsonl", QUICK["demos"] if quick else DEMOS)
    preset = "isolated" if workflow == "reasoner_tools" else "shared"
    rolerl("sft", "demo", "--data", str(demos), "--set", f"run.dir={warm}", f"adapters.preset={preset}",
           "run.progress=false", *(QUICK["sets"] if quick else []), log=warm / "sft.log")  # fmt: skip
    return warm / "adapters"


def init_dir(out: Path, workflow: str, preset: str, quick: bool) -> Path:
    """The `adapters.init` directory of an arm: the warm start, its one adapter copied under each role's
    name for an `isolated` arm of a role workflow."""
    adapters = warm_start(out, workflow, quick)
    if preset == "shared" or workflow == "reasoner_tools":
        return adapters
    target = out / f"warm-{workflow}" / "isolated"
    for role in WORKFLOWS[workflow][1]:
        if not (target / role).exists():
            shutil.copytree(adapters / "policy", target / role)
    return target


def evaluate(workflow: str, policy: list[str], target: Path, quick: bool) -> dict[str, Any]:
    """Greedy held-out accuracy and role metrics through `workflow` on the same test problems every time
    (`_study.held_out`); an evaluation already in `target` is read, not rerun."""
    if not (target / "results.json").exists():
        shutil.rmtree(target, ignore_errors=True)
        options = [x for k, v in WORKFLOWS[workflow][0].items() for x in ("--option", f"{k}={v}")]
        limit, tokens = (QUICK["eval"], QUICK["max_new_tokens"]) if quick else (EVAL_LIMIT, 64)
        model = ["--model", "tiny:llama"] if quick else []
        rolerl("eval", "--task", "synthetic", "--workflow", workflow, *policy, *model, "--limit", str(limit),
               "--tool", "python", "--max-new-tokens", str(tokens), "--max-tool-calls", "2", *options,
               "--out", str(target), log=target.with_suffix(".log"))  # fmt: skip
    return held_out(target)


def overrides(arm: str, quick: bool) -> list[str]:
    """The `--set` overrides of `arm`'s RL run on the `demo` config (its warm start's `adapters.init` aside)."""
    workflow, preset, sets = ARMS[arm]
    options = json.dumps(WORKFLOWS[workflow][0]).replace('"', "")  # the config's YAML mapping
    return [f"task.workflow={workflow}", f"task.workflow_options={options}", f"adapters.preset={preset}",
            *COMMON, *sets, *(QUICK["sets"] if quick else [])]  # fmt: skip


def run_arm(out: Path, arm: str, seed: int, quick: bool) -> dict[str, Any]:
    """One arm and seed: the warm start's held-out figures, RL, the trained policy's; the summary record."""
    from rolerl.hardware import describe

    workflow, preset, _ = ARMS[arm]
    init = init_dir(out, workflow, preset, quick)
    warm = out / f"warm-{workflow}"
    before = evaluate(workflow, ["--adapters", str(init), "--preset", preset], warm / "before", quick)
    target = out / f"{arm}-s{seed}"
    shutil.rmtree(target, ignore_errors=True)
    sets = overrides(arm, quick)
    print(f"{arm} seed {seed}", flush=True)
    t0 = time.perf_counter()
    rolerl("train", "demo", "--set", f"run.dir={target}", f"run.seed={seed}", f"adapters.init={init}",
           *sets, log=out / f"{arm}-s{seed}.log")  # fmt: skip
    wall = time.perf_counter() - t0
    after = evaluate(workflow, ["--run", str(target)], out / f"after-{arm}-s{seed}", quick)
    return {
        "arm": arm, "workflow": workflow, "seed": seed, "quick": quick, "overrides": sets,
        "budget": {"steps": STEPS, "tasks_per_step": TASKS, "samples": SAMPLES} if not quick else "quick",
        "commit": _commit(), "cpu": describe(), "rl_wall_s": round(wall, 1),
        "held_out": {"before": before, "after": after}, "steps": step_records(target),
    }  # fmt: skip


def run(out: Path, seeds: list[int], arms: list[str], results: Path | None, quick: bool) -> None:
    """Every arm x seed whose summary is not in `results` yet (default: `RESULTS`; `out/results` with
    `--quick`)."""
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise SystemExit(f"--arms {unknown}: allowed: {list(ARMS)}")
    results = results or (out / "results" if quick else RESULTS)
    results.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    for seed in seeds:
        for arm in arms:
            path = results / f"{arm}-s{seed}.json"
            if path.exists():
                continue
            record = run_arm(out, arm, seed, quick)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(record, indent=1) + "\n")
            tmp.replace(path)


def summarize(results: Path, plot: Path | None) -> str:
    """A markdown table per workflow (mean over seeds of held-out accuracy before and after RL, its
    standard errors over seeds and over problems, each role metric before -> after, RL wall time), then
    the differences between the arms `COMPARISONS` names and whether each exceeds its noise."""
    records = [json.loads(p.read_text()) for p in sorted(results.glob("*-s*.json"))]
    if not records:
        return f"no summaries in {results}"
    budgets: dict[str, list[str]] = {}
    for r in records:
        budgets.setdefault(json.dumps(r.get("budget"), sort_keys=True), []).append(f"{r['arm']}-s{r['seed']}")
    if len(budgets) > 1:  # arms compared at different budgets would say nothing
        found = "; ".join(f"{b}: {', '.join(runs)}" for b, runs in budgets.items())
        raise SystemExit(
            f"{results}: the summaries were run at different budgets ({found}); move one set away"
        )
    by_arm: dict[str, list[dict]] = {}
    for r in sorted(
        records, key=lambda r: (list(ARMS).index(r["arm"]) if r["arm"] in ARMS else 99, r["seed"])
    ):
        by_arm.setdefault(r["arm"], []).append(r)
    lines = []
    for title, workflows in TABLES.items():
        arms = {a: rs for a, rs in by_arm.items() if rs[0]["workflow"] in workflows}
        if arms:
            lines += [f"### {title}", "", *_table(arms), ""]
    diffs = [_difference(by_arm[a], by_arm[b], a, b) for a, b in COMPARISONS if a in by_arm and b in by_arm]
    if diffs:
        lines += ["### differences (held-out accuracy after RL)", "",
                  "| a vs b | a - b | SE seeds | SE problems (paired) | noise (SE) | beyond 2 SE? |",
                  "|---|---|---|---|---|---|", *diffs, ""]  # fmt: skip
    if plot is not None and by_arm:
        from _study import plot_curves

        curves = {a: [[s["accuracy"] for s in r["steps"]] for r in rs] for a, rs in by_arm.items()}
        plot_curves(curves, plot, "issue 48 roles study", "rollout accuracy (episode correct)")
    return "\n".join(lines)


def accuracy(runs: list[dict], when: str) -> dict[str, Any]:
    """Held-out accuracy of an arm's runs at `when` (before / after): the mean over seeds, its standard
    error over seeds (None with one seed) and over problems (each problem's mean over seeds), and the
    per-problem means."""
    mean, se_seeds = mean_se([r["held_out"][when]["accuracy"] for r in runs])
    problems = problem_means([r["held_out"][when]["correct"] for r in runs])
    _, se_problems = mean_se(list(problems.values()))
    return {"mean": mean, "se_seeds": se_seeds, "se_problems": se_problems, "problems": problems}


def _table(arms: dict[str, list[dict]]) -> list[str]:
    keys = sorted({k for rs in arms.values() for r in rs for w in ("before", "after")
                   for k in r["held_out"][w]["roles"]})  # fmt: skip
    head = ["arm", "seeds", "held-out before", "after (SE seeds, SE problems)",
            *(k.removeprefix("workflow/") for k in keys), "RL wall"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for arm, runs in arms.items():
        before, after = accuracy(runs, "before"), accuracy(runs, "after")
        roles = []
        for k in keys:
            pair = [[r["held_out"][w]["roles"][k] for r in runs if k in r["held_out"][w]["roles"]]
                    for w in ("before", "after")]  # fmt: skip
            roles.append(" -> ".join(f"{100 * mean_se(v)[0]:.1f}" if v else "n/a" for v in pair))
        wall = mean_se([r["rl_wall_s"] for r in runs])[0] / 60
        cells = [arm, ",".join(str(r["seed"]) for r in runs), f"{100 * before['mean']:.1f}%",
                 f"{100 * after['mean']:.1f}% ({_pct(after['se_seeds'])}, {_pct(after['se_problems'])})",
                 *roles, f"{wall:.1f} min"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def difference(a: list[dict], b: list[dict]) -> dict[str, float | None]:
    """Arm a's held-out accuracy after RL minus arm b's: the difference of the means over seeds, its
    standard error over seeds (sqrt(se_a^2 + se_b^2), independent seeds; None unless both have 2+), over
    problems (of the per-problem differences of the seed means, paired: the same problems), and the noise
    sqrt(seeds^2 + problems^2) the difference is judged against."""
    x, y = accuracy(a, "after"), accuracy(b, "after")
    se_seeds = None
    if x["se_seeds"] is not None and y["se_seeds"] is not None:
        se_seeds = (x["se_seeds"] ** 2 + y["se_seeds"] ** 2) ** 0.5
    ids = sorted(set(x["problems"]) & set(y["problems"]))
    _, se_problems = mean_se([x["problems"][i] - y["problems"][i] for i in ids])
    noise = ((se_seeds or 0.0) ** 2 + (se_problems or 0.0) ** 2) ** 0.5
    return {"diff": x["mean"] - y["mean"], "se_seeds": se_seeds, "se_problems": se_problems, "noise": noise}


def _difference(a: list[dict], b: list[dict], name_a: str, name_b: str) -> str:
    d = difference(a, b)
    beyond = "yes" if abs(d["diff"]) > 2 * d["noise"] else "no"
    if d["se_seeds"] is None:
        beyond += " (one seed: problems only)"
    return (f"| {name_a} vs {name_b} | {100 * d['diff']:+.1f} | {_pct(d['se_seeds'])} | {_pct(d['se_problems'])} "
            f"| {100 * d['noise']:.1f} | {beyond} |")  # fmt: skip


def _pct(se: float | None) -> str:
    return "n/a" if se is None else f"+- {100 * se:.1f}"


def _commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], capture_output=True, text=True, cwd=Path(__file__).parent
        ).stdout

    head = git("rev-parse", "--short", "HEAD").strip() or "unknown"
    return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no").strip() else "")


def _options(p) -> None:
    p.add_argument(
        "--arms", nargs="+", default=list(ARMS), metavar="ARM", help=f"(default: all) {list(ARMS)}"
    )
    p.add_argument("--results", type=Path, default=None, help=f"summaries (default: {RESULTS})")
    p.add_argument("--quick", action="store_true", help="the tiny random model, a few problems, one step")


if __name__ == "__main__":
    main(__doc__, run, summarize, out="runs/roles_study", plot=None, run_options=_options,
         summarize_default=str(RESULTS))  # fmt: skip
