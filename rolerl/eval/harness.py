"""`rolerl eval`: a model (and optionally trained adapters) on a task's held-out examples, through a
workflow, with every sample written down.

The harness resolves the task (a built-in name, with `--data` for a file or dataset id), the workflow and
the policy (a model spec, `--adapters DIR` of PEFT adapters, or `--run RUN` for a training run's config
and newest checkpoint), samples `n` episodes per example in chunks, appends each sample to
`samples.jsonl` as it finishes (so `--resume` skips what is there), and writes `results.json`: pass@1
(mean@n), unbiased pass@k, maj@k where the task extracts answers, the task's own scores (EM, F1 ...),
tool-call and tool-error rates, tokens and truncation, per-role statistics, and what produced them
(model, adapters, n, temperature, seed).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rolerl.eval.metrics import mean_stderr, pass_at_k
from rolerl.files import write_json
from rolerl.signals import Terminated, sigterm_raises
from rolerl.tasks.base import Example, Task, majority_correct
from rolerl.types import Episode
from rolerl.workflows.base import pooled_measures, workflow_name

log = logging.getLogger(__name__)


@dataclass
class EvalSpec:
    """What `rolerl eval` runs (its flags)."""

    task: str
    data: str | None = None  # the task's file or dataset id (benchmarks); None = the task's default
    split: str = "test"
    workflow: str = "single_turn"  # a built-in name or package.module:Class
    workflow_options: dict[str, Any] = field(default_factory=dict)  # the workflow's settings
    model: str | None = None  # None: a run's model, else "default" (SmolLM2-135M-Instruct)
    dtype: str | None = None  # None: a run's model.dtype, else float32; given, it overrides the run's
    adapters: str | None = None  # a directory of PEFT adapters named after the topology's adapters
    run: str | None = None  # a training run: its config (model, topology) and its newest checkpoint
    preset: str | None = None  # the topology of `adapters` (None: shared); a run's topology is its config's
    # a routing table instead of the preset or the run's topology (`adapters.table`: role -> adapter, or
    # {kind: adapter | None, default: ...}); e.g. one kind on a trained adapter and the rest on the base
    table: dict[str, Any] | None = None
    n: int = 1  # samples per example
    temperature: float = 0.0  # 0 = greedy (n must then be 1)
    top_p: float = 1.0
    max_new_tokens: int = 512
    tool: str | None = None  # None = the workflow's (tir: python); "none" = no tool
    max_tool_calls: int = 4
    tool_options: dict[str, Any] = field(
        default_factory=dict
    )  # the tool factory's options (search: corpus/url)
    limit: int | None = None  # examples; None = the whole split
    seed: int = 0
    out: str | None = None  # directory for results.json and samples.jsonl
    resume: bool = False
    chunk: int = 64  # examples per chunk (samples.jsonl grows chunk by chunk); at least max_batch / n
    max_batch: int = 32  # rows the engine decodes at once
    progress: bool = True

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"--n={self.n}; allowed: an integer >= 1")
        if self.temperature < 0:
            raise ValueError(f"--temperature={self.temperature}; allowed: 0 (greedy) or a number > 0")
        if self.temperature == 0 and self.n > 1:
            raise ValueError("--n > 1 needs sampling: give --temperature > 0 (greedy repeats one answer)")
        if self.adapters and self.run:
            raise ValueError("give --adapters DIR or --run RUN, not both")
        if self.resume and not self.out:
            raise ValueError("--resume needs --out DIR (the samples.jsonl to continue)")
        if self.table is not None and not (self.adapters or self.run):
            raise ValueError("--table routes to trained adapters: give --adapters DIR or --run RUN with it")
        if self.run and self.preset is not None:
            raise ValueError(
                f"--preset {self.preset} with --run: the run's config names its topology; to route its adapters "
                "another way give --table"
            )


class EvalInterrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM during an evaluation with an output directory: the samples of every finished chunk
    are in its samples.jsonl; `str()` says how to go on."""

    def __init__(self, why: str, kept: int, total: int, out: Path) -> None:
        self.why, self.kept, self.total, self.out = why, kept, total, out
        super().__init__(
            f"{why} after {kept} of {total} samples (in {out / 'samples.jsonl'}); continue with the same "
            "command and --resume"
        )


@dataclass
class Sample:
    """One episode of one example, as `samples.jsonl` stores it."""

    id: str
    sample: int
    reward: float
    correct: bool
    answer: str | None
    scores: dict[str, float]
    tokens: int
    truncated: bool
    tool_calls: int
    tool_errors: int
    roles: dict[str, dict[str, float]]  # role -> {calls, tokens}
    turns: list[dict[str, Any]] = field(default_factory=list)  # role, prompt, completion, kinds, tools
    measures: dict[str, list[float]] = field(default_factory=dict)  # role metric -> [sum, count]


def run_eval(spec: EvalSpec, log_line: Callable[[str], None] = print) -> dict[str, Any]:
    """Evaluate; returns the results dict (also written to `spec.out/results.json` when `out` is set)."""
    from rolerl.progress import ProgressBar
    from rolerl.tasks import load_task
    from rolerl.workflows import load_workflow

    task = load_task(spec.task, spec.data)
    workflow = load_workflow(spec.workflow, task, spec.workflow_options)
    examples = spec_examples(task, spec)
    out = Path(spec.out) if spec.out else None
    done = _read_samples(out / "samples.jsonl") if out and spec.resume else {}
    if out is not None:
        if not spec.resume and (out / "samples.jsonl").exists():
            raise ValueError(
                f"{out}/samples.jsonl exists: continue it with --resume, or choose another --out"
            )
        out.mkdir(parents=True, exist_ok=True)
    policy, cfg, identity = spec_policy(spec, workflow.roles)
    todo = [i for i, ex in enumerate(examples) if any((ex.id, j) not in done for j in range(spec.n))]
    t0 = time.perf_counter()
    total = len(examples) * spec.n
    try:
        with sigterm_raises(), ProgressBar("eval", total, completed=len(done), enabled=spec.progress) as bar:
            for chunk, episodes in rollouts(spec, workflow, policy, cfg, examples, todo, bar, len(done)):
                fresh = [
                    _sample(task, ex, j, ep, policy)
                    for ex, eps in zip(chunk, episodes, strict=True)
                    for j, ep in enumerate(eps)
                    if (ex.id, j) not in done
                ]
                for s in fresh:
                    done[(s.id, s.sample)] = s
                if out is not None:
                    _append(out / "samples.jsonl", fresh)
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM: what is written stays, and --resume goes on from it
        if out is None:
            raise
        why = "stopped by SIGTERM" if isinstance(e, Terminated) else "interrupted"
        raise EvalInterrupted(why, len(done), total, out) from e
    samples = [done[(ex.id, j)] for ex in examples for j in range(spec.n)]
    results = {
        "spec": dataclasses.asdict(spec),
        "identity": identity,
        "metrics": summarize(samples, spec.n, workflow_name(workflow)),
        "seconds": time.perf_counter() - t0,
    }
    if out is not None:
        write_json(out / "results.json", results)
    log_line(table(results["metrics"], spec))
    return results


def rollouts(
    spec: EvalSpec,
    workflow,
    policy,
    cfg,
    examples: Sequence[Example],
    todo: Sequence[int],
    bar,
    completed: int = 0,
) -> Iterator[tuple[list[Example], list[list[Episode]]]]:
    """`spec.n` episodes of each example `todo` names (indices into `examples`), a chunk of examples at a
    time through engines built for `policy`'s models: yields each chunk's examples and their episodes.
    A chunk is `spec.chunk` examples, or more where `spec.max_batch` rows need more (`chunk_size`).
    Sampling seeds depend on the example's index, so a chunk samples the same tokens whatever ran before."""
    from rolerl.eval.evaluate import evaluate
    from rolerl.run.engines import build_engines, role_calls

    tool = spec.tool if spec.tool is not None else getattr(workflow, "tool", None)
    tool = None if tool == "none" else tool
    engines = build_engines(cfg, policy, tool, spec.tool_options, spec.max_batch)
    size = chunk_size(spec)
    try:
        for start in range(0, len(todo), size):
            chunk = todo[start : start + size]
            result = evaluate(
                engines, policy.route_of, workflow, [examples[i] for i in chunk],
                samples=spec.n, greedy=spec.temperature == 0, temperature=spec.temperature or 1.0,
                top_p=spec.top_p, max_new_tokens=spec.max_new_tokens, tool=tool,
                max_tool_calls=spec.max_tool_calls, seed=spec.seed, roles=role_calls(cfg, policy), ids=chunk,
                on_episode=lambda k, _, at=completed: bar.update(at + k),
            )  # fmt: skip
            completed += len(chunk) * spec.n
            yield result.examples, result.episodes
    finally:
        for engine in engines.values():
            engine.close()
            for t in engine.tools.values():
                getattr(t, "close", lambda: None)()


def chunk_size(spec: EvalSpec) -> int:
    """Examples per chunk: `spec.chunk`, or enough for `spec.max_batch` rows (n per example). A chunk is one
    batch that drains before the next starts, so a smaller one would cap the batch below `max_batch`; on
    the CPU a decode step's time grows slower than its rows (docs/EVALUATION.md, "How long")."""
    return max(spec.chunk, -(-spec.max_batch // spec.n))


def held_out(
    cfg,
    policy,
    engines,
    task: Task,
    workflow,
    examples: Sequence[Example],
    step: int,
    dist,
    backend=None,
) -> dict[str, float]:
    """The RL loop's periodic evaluation (`cfg.eval`) through the run's own engines (or `backend`: the run's
    vLLM backend, serving the adapters just synced): `summarize`'s metrics.
    Its sampling seeds are its own (`eval`, example, sample), so training's samples do not change. `dist`
    is the run's process group (`rolerl.train.distributed.Dist`, `SINGLE` for one process): each rank
    evaluates its share of the examples, seeded by their global index, and every rank summarises all."""
    from rolerl.eval.evaluate import evaluate
    from rolerl.run.engines import role_calls

    e = cfg.eval
    ids = [i for i in range(len(examples)) if dist.owns(i)]
    result = evaluate(
        engines, policy.route_of, workflow, [examples[i] for i in ids], samples=e.n,
        greedy=e.temperature == 0, temperature=e.temperature or 1.0, top_p=cfg.rollout.top_p,
        max_new_tokens=e.max_new_tokens or cfg.rollout.max_new_tokens,
        tool=None if cfg.rollout.tool == "none" else cfg.rollout.tool, max_tool_calls=cfg.rollout.max_tool_calls,
        seed=cfg.run.seed, roles=role_calls(cfg, policy), ids=ids, backend=backend,
    )  # fmt: skip
    rows = [[_sample(task, ex, j, ep, policy) for j, ep in enumerate(eps)]
            for ex, eps in zip(result.examples, result.episodes, strict=True)]  # fmt: skip
    samples = [s for row in dist.interleave(rows, len(examples), 1) for s in row]  # in example order
    return summarize(samples, e.n, workflow_name(workflow)) | {"seconds": max(dist.gather(result.seconds))}


def summarize(samples: Sequence[Sample], n: int, workflow: str = "workflow") -> dict[str, float]:
    """The metrics of `samples` (n per example, grouped by example in order); each role's own metric as the
    step metrics name it (`workflow/<workflow>/<metric>`, pooled over the samples: docs/WORKFLOWS.md)."""
    by_example: dict[str, list[Sample]] = {}
    for s in samples:
        by_example.setdefault(s.id, []).append(s)
    rows = list(by_example.values())
    correct = [[s.correct for s in row] for row in rows]
    acc = sum(map(sum, correct)) / max(len(samples), 1)
    out: dict[str, float] = {
        "examples": float(len(rows)),
        "samples": float(len(samples)),
        "pass@1": acc,
        # over problems, each scored by its samples' mean: greedy (n = 1) the binomial error of the accuracy
        "stderr": mean_stderr([sum(c) / len(c) for c in correct]),
        "tool_call_rate": sum(s.tool_calls > 0 for s in samples) / max(len(samples), 1),
        "tool_calls/mean": sum(s.tool_calls for s in samples) / max(len(samples), 1),
        "tool_error_rate": sum(s.tool_errors for s in samples) / max(sum(s.tool_calls for s in samples), 1),
        "tokens/mean": sum(s.tokens for s in samples) / max(len(samples), 1),
        "truncated_rate": sum(s.truncated for s in samples) / max(len(samples), 1),
    }
    for k in _ks(n):
        scores = [pass_at_k(len(c), sum(c), k) for c in correct]
        out[f"pass@{k}"] = sum(scores) / max(len(rows), 1)
        if k == 1:
            continue
        out[f"stderr/pass@{k}"] = mean_stderr(scores)
        if all(s.answer is not None for s in samples):
            votes = [float(majority_correct([(s.answer, s.correct) for s in row[:k]])) for row in rows]
            out[f"maj@{k}"] = sum(votes) / max(len(rows), 1)
            out[f"stderr/maj@{k}"] = mean_stderr(votes)
    names = sorted({k for s in samples for k in s.scores})
    for name in names:
        values = [s.scores[name] for s in samples if name in s.scores]
        out[name] = sum(values) / max(len(values), 1)
    roles = sorted({r for s in samples for r in s.roles})
    for role in roles:
        mine = [s.roles[role] for s in samples if role in s.roles]
        out[f"role/{role}/calls"] = sum(m["calls"] for m in mine) / max(len(samples), 1)
        out[f"role/{role}/tokens"] = sum(m["tokens"] for m in mine) / max(len(samples), 1)
    for metric, value in pooled_measures([s.measures for s in samples]).items():
        out[f"workflow/{workflow}/{metric}"] = value
    return out


def stderr_key(metric: str) -> str:
    """Where `summarize` puts the standard error of `metric` (pass@k, maj@k)."""
    return "stderr" if metric == "pass@1" else f"stderr/{metric}"


def table(metrics: dict[str, float], spec: EvalSpec) -> str:
    """A short plain-text summary."""
    head = f"{spec.task} ({spec.split}), {int(metrics['examples'])} examples x {spec.n}, workflow {spec.workflow}"
    lines = [head]
    for key in ("pass@1", *[k for k in metrics if k.startswith(("pass@", "maj@")) and k != "pass@1"]):
        error = metrics.get(stderr_key(key))
        extra = f" +- {100 * error:.1f}" if error is not None else ""
        lines.append(f"  {key:<16} {100 * metrics[key]:6.1f}%{extra}")
    for key in ("em", "f1", "tool_call_rate", "tool_error_rate", "truncated_rate"):
        if key in metrics:
            lines.append(f"  {key:<16} {100 * metrics[key]:6.1f}%")
    lines.append(f"  {'tokens/mean':<16} {metrics['tokens/mean']:6.1f}")
    return "\n".join(lines)


def _ks(n: int) -> list[int]:
    """1, then powers of two up to n, then n."""
    ks = [1]
    while ks[-1] * 2 <= n:
        ks.append(ks[-1] * 2)
    return sorted({*ks, n})


def spec_examples(task: Task, spec: EvalSpec) -> list[Example]:
    """The examples `spec` runs: the first `limit` of its split (all of it without one), ids unique."""
    size = getattr(task, "size", None)
    total = size(spec.split) if callable(size) else None
    if spec.limit is None and total is None:
        raise ValueError(
            f"task {spec.task!r} does not say how many {spec.split!r} examples it has: give --limit N"
        )
    n = spec.limit if total is None else min(spec.limit or total, total)
    examples = task.examples(spec.split, n, spec.seed)
    ids = [ex.id for ex in examples]
    if len(set(ids)) != len(ids):
        raise ValueError(f"task {spec.task!r} gave duplicate example ids; samples.jsonl needs unique ones")
    return examples


def newest_adapters(run: Path, found: Sequence[tuple[int, Path]]) -> tuple[int | str | None, str | None]:
    """`(step, directory)` of a run's newest adapters: its final `adapters/` where they were written after its
    newest checkpoint (a finished `rolerl sft`, whose last steps follow its last checkpoint), else that
    checkpoint's (a finished `rolerl train` checkpoints its last step; a run cut short or extended since has
    newer checkpoints than any final adapters). `step` is "final" for the final adapters."""

    def written(directory: Path) -> float:
        return max((f.stat().st_mtime for f in directory.rglob("*") if f.is_file()), default=-1.0)

    final = run / "adapters"
    if final.is_dir() and (not found or written(final) >= written(found[-1][1] / "adapters")):
        return "final", str(final)
    if found:
        return found[-1][0], str(found[-1][1] / "adapters")
    return None, None


def spec_policy(spec: EvalSpec, roles: Sequence[str]):
    """The policy to evaluate, its config, and what identifies it (model, adapters, checkpoint)."""
    from rolerl.config import load_config
    from rolerl.models.load import model_name
    from rolerl.run.layout import checkpoints
    from rolerl.run.policy import build_policy

    if spec.run:
        run = Path(spec.run)
        overrides = ["model.device=cpu"] if not _cuda() else []
        if spec.dtype is not None:  # e.g. a run trained in bf16, evaluated in float32
            overrides.append(f"model.dtype={spec.dtype}")
        cfg = load_config(run / "config.yaml", overrides)
        if spec.model is not None and model_name(spec.model) != model_name(cfg.model.spec):
            raise ValueError(
                f"--model {spec.model} with --run {run}: the run trained {cfg.model.spec}, the only model its "
                "adapters fit; leave --model out"
            )
        found = checkpoints(run)
        step, init = newest_adapters(run, found)
        if init is None:
            raise FileNotFoundError(f"--run {run}: no checkpoints/step_N/adapters and no adapters/ directory")
        identity: dict[str, Any] = {"model": cfg.model.spec, "dtype": None}
        # the run's own adapters, by their names (its init_from named the warm start's)
        adapters = dataclasses.replace(cfg.adapters, init=init, init_from={})
        if spec.table is not None:
            adapters = dataclasses.replace(adapters, preset="custom", table=spec.table)
            identity["table"] = spec.table
        cfg = dataclasses.replace(cfg, adapters=adapters)
        identity |= {"run": str(run), "adapters": init, "step": step}
    else:
        model = spec.model or "default"
        identity = {"model": model, "dtype": None}
        overrides = [
            f"model.spec={model}",
            f"model.dtype={spec.dtype or 'float32'}",
            f"adapters.preset={spec.preset or 'shared'}",
            "train.bf16=false",  # nothing trains here: no need to resolve (and log) a training precision
        ]
        if spec.adapters:
            overrides.append(f"adapters.init={spec.adapters}")
            identity["adapters"] = spec.adapters
            if spec.table is not None:
                overrides[2] = "adapters.preset=custom"
                overrides.append(f"adapters.table={json.dumps(spec.table)}")
                identity["table"] = spec.table
        else:  # the base model alone: fresh adapters are the identity, no need to add any
            overrides[2] = "adapters.preset=none"
        cfg = load_config(None, overrides)
    policy = build_policy(cfg, roles)
    # the weights' dtype as they ran (`model.dtype: auto` -> bfloat16 on a CPU with native bf16)
    dtypes = {str(next(m.model.parameters()).dtype).removeprefix("torch.") for m in policy.members.values()}
    identity["dtype"] = dtypes.pop() if len(dtypes) == 1 else sorted(dtypes)
    return policy, cfg, identity


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _sample(task: Task, example: Example, j: int, episode: Episode, policy) -> Sample:
    text = episode.metadata.get("text")
    if text is None and episode.turns:
        text = policy.tokenizer_of(episode.turns[-1].role).decode(
            episode.turns[-1].completion_ids, skip_special_tokens=True
        )
    text = text or ""
    answer_of = getattr(task, "answer_of", None)
    scores_of = getattr(task, "scores", None)
    roles: dict[str, dict[str, float]] = {}
    turns = []
    for t in episode.turns:
        r = roles.setdefault(t.role, {"calls": 0.0, "tokens": 0.0})
        r["calls"] += 1
        r["tokens"] += sum(k != "tool_output" for k in t.kinds)
        tok = policy.tokenizer_of(t.role)
        turns.append({
            "role": t.role,
            "prompt": tok.decode(t.prompt_ids, skip_special_tokens=False),
            "completion": tok.decode(t.completion_ids, skip_special_tokens=True),
            "kinds": dict(Counter(t.kinds)),
            "finish_reason": t.finish_reason,
            "tool_calls": [{"args": c.args, "output": c.output, "error": c.error} for c in t.tool_calls],
        })  # fmt: skip
    calls = [c for t in episode.turns for c in t.tool_calls]
    return Sample(
        id=example.id,
        sample=j,
        reward=float(episode.reward),
        correct=bool(episode.metadata.get("correct", episode.reward >= 1.0)),
        answer=answer_of(text) if answer_of else None,
        scores=dict(scores_of(example, text)) if scores_of else {},
        tokens=int(sum(r["tokens"] for r in roles.values())),
        truncated=any(t.finish_reason == "length" for t in episode.turns),
        tool_calls=len(calls),
        tool_errors=sum(c.error for c in calls),
        roles=roles,
        turns=turns,
        measures={k: list(v) for k, v in episode.metadata.get("measures", {}).items()},
    )


def _append(path: Path, samples: Sequence[Sample]) -> None:
    append_lines(path, [json.dumps(dataclasses.asdict(s)) for s in samples])


def append_lines(path: str | Path, lines: Sequence[str]) -> None:
    """Append whole lines and flush them to disk: a kill loses at most the lines in flight."""
    with Path(path).open("a") as f:
        f.write("".join(line + "\n" for line in lines))
        f.flush()
        os.fsync(f.fileno())


def _read_samples(path: Path) -> dict[tuple[str, int], Sample]:
    """The samples already written (a last line cut short by a kill is dropped, with a warning)."""
    if not path.exists():
        return {}
    out = {}
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                log.warning("%s: the last line is cut short (a kill mid-write); that sample runs again", path)
                path.write_text("".join(x + "\n" for x in lines[:-1]))
                continue
            raise ValueError(f"{path}:{i + 1}: not JSON; the file is damaged") from None
        out[(row["id"], row["sample"])] = Sample(**row)
    return out
