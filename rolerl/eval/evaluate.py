"""Evaluation: run a workflow over held-out examples through the engine and score pass@1 / pass@k.

Greedy by default (`samples=1`); with `samples=k` and sampling it estimates pass@k with the unbiased
estimator of Chen et al. (2021), `1 - C(n - c, k) / C(n, k)` per problem. All episodes run at once through
a `LockstepBackend`, so an evaluation is as batched as a rollout step and deterministic for a given seed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from rolerl.eval.metrics import mean_stderr, pass_at_k
from rolerl.rollout.engine import Engine
from rolerl.rollout.lockstep import LockstepBackend
from rolerl.rollout.sampling import SamplingParams
from rolerl.rollout.scheduler import RolloutBackend
from rolerl.tasks.base import Example
from rolerl.types import Episode
from rolerl.workflows.base import Context, RoleCalls, Workflow, derive_seed


@dataclass
class EvalResult:
    examples: list[Example]
    episodes: list[list[Episode]]  # per example, its samples
    seconds: float = 0.0

    def correct(self) -> list[list[bool]]:
        return [[bool(e.metadata.get("correct", e.reward >= 1.0)) for e in eps] for eps in self.episodes]

    def accuracy(self, family: str | None = None) -> float:
        """Mean correctness over all samples (= pass@1), optionally of one family (`Example.meta`)."""
        rows = self._rows(family)
        return sum(sum(r) for r in rows) / max(sum(len(r) for r in rows), 1)

    def pass_at(self, k: int, family: str | None = None) -> float:
        rows = self._rows(family)
        return sum(pass_at_k(len(r), sum(r), k) for r in rows) / max(len(rows), 1)

    def stderr(self, family: str | None = None) -> float:
        """Standard error of `accuracy` over the problems, each scored by the mean of its samples (one sample
        each: the binomial error); a problem's samples are not independent draws of the benchmark."""
        return mean_stderr([sum(r) / len(r) for r in self._rows(family) if r])

    def families(self) -> list[str]:
        return sorted({e.meta.get("family", "all") for e in self.examples})

    def tool_use(self) -> float:
        """Fraction of episodes that made at least one tool call."""
        eps = [e for row in self.episodes for e in row]
        return sum(bool(e.metadata.get("tool_calls")) for e in eps) / max(len(eps), 1)

    def summary(self) -> dict[str, float]:
        out = {"accuracy": self.accuracy(), "stderr": self.stderr(), "n": float(len(self.examples)),
               "tool_use": self.tool_use()}  # fmt: skip
        for fam in self.families():
            out[f"accuracy/{fam}"] = self.accuracy(fam)
        return out

    def _rows(self, family: str | None) -> list[list[bool]]:
        rows = self.correct()
        if family is None:
            return rows
        return [
            r for r, ex in zip(rows, self.examples, strict=True) if ex.meta.get("family", "all") == family
        ]


def evaluate(
    engine: Engine | Mapping[str, Engine],
    route_of: Mapping[str, Mapping[str, int]],
    workflow: Workflow,
    examples: Sequence[Example],
    *,
    samples: int = 1,
    greedy: bool = True,
    temperature: float = 1.0,
    top_p: float = 1.0,
    max_new_tokens: int = 256,
    tool: str | None = "python",
    max_tool_calls: int = 4,
    seed: int = 0,
    roles: Mapping[str, RoleCalls] | None = None,
    on_episode: Callable[[int, int], None] | None = None,
    ids: Sequence[int] | None = None,
    backend: RolloutBackend | None = None,
) -> EvalResult:
    """`samples` episodes of `workflow` per example through `engine` (or one engine per model, with each
    role's model and call settings in `roles`); `on_episode(done, total)` reports progress. Sample j of
    example i is seeded by `(seed, ids[i], j)` (`ids` default `range`), so a chunk of a larger evaluation
    samples what the whole would. The engines are not closed (their tools stay warm for the next one).
    `backend`: generate through it instead of a `LockstepBackend` over the engines (training's vLLM)."""
    return evaluate_groups(
        engine, route_of, {"": (workflow, examples, ids)}, samples=samples, greedy=greedy,
        temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens, tool=tool,
        max_tool_calls=max_tool_calls, seed=seed, roles=roles, on_episode=on_episode, backend=backend,
    )[""]  # fmt: skip


def evaluate_groups(
    engine: Engine | Mapping[str, Engine],
    route_of: Mapping[str, Mapping[str, int]],
    groups: Mapping[str, tuple[Workflow, Sequence[Example], Sequence[int] | None]],
    *,
    samples: int = 1,
    greedy: bool = True,
    temperature: float = 1.0,
    top_p: float = 1.0,
    max_new_tokens: int = 256,
    tool: str | None = "python",
    max_tool_calls: int = 4,
    seed: int = 0,
    roles: Mapping[str, RoleCalls] | None = None,
    on_episode: Callable[[int, int], None] | None = None,
    backend: RolloutBackend | None = None,
) -> dict[str, EvalResult]:
    """`evaluate` several `(workflow, examples, ids)` groups (e.g. two tasks) in one batch: their episodes
    share the engine's forwards (one evaluation of 8 + 24 problems costs about what the 24 alone cost: a
    decode step's time grows slowly with its rows). Each group's episodes are seeded as `evaluate` would
    seed them alone; its `seconds` is when its last episode ended."""
    if greedy and samples > 1:
        raise ValueError("greedy evaluation with samples > 1 repeats one answer; use greedy=False for pass@k")
    engines = dict(engine) if isinstance(engine, Mapping) else {"main": engine}
    sampling = SamplingParams(
        temperature=temperature, top_p=top_p, greedy=greedy, max_new_tokens=max_new_tokens
    )
    backend = backend if backend is not None else LockstepBackend(engines)
    tokenizer = next(iter(engines.values())).tokenizer
    total, done = sum(len(examples) for _, examples, _ in groups.values()) * samples, 0
    ended = dict.fromkeys(groups, 0.0)
    t0 = time.perf_counter()

    async def one(group: str, workflow: Workflow, example: Example, example_id: int, j: int) -> Episode:
        nonlocal done
        ctx = Context(backend, tokenizer, route_of, sampling, derive_seed(seed, "eval", example_id, j),
                      tool=tool, max_tool_calls=max_tool_calls, roles=roles or {})  # fmt: skip
        episode = await backend.episode(workflow.run(ctx, example))
        done += 1
        ended[group] = time.perf_counter() - t0
        if on_episode is not None:
            on_episode(done, total)
        return episode

    async def main() -> list[Episode]:
        runs = [
            one(group, workflow, ex, i if ids is None else ids[i], j)
            for group, (workflow, examples, ids) in groups.items()
            for i, ex in enumerate(examples)
            for j in range(samples)
        ]
        return list(await asyncio.gather(*runs))

    flat = iter(asyncio.run(main()))
    out = {}
    for group, (_, examples, _) in groups.items():
        rows = [[next(flat) for _ in range(samples)] for _ in examples]
        out[group] = EvalResult(list(examples), rows, seconds=ended[group])
    return out


def by_family_table(results: Mapping[str, EvalResult]) -> str:
    """A plain-text table: one row per family (and `all`), one column per named result."""
    names = list(results)
    fams = sorted({f for r in results.values() for f in r.families()})
    width = max([len(f) for f in fams] + [8])
    lines = [f"{'family':<{width}}  " + "  ".join(f"{n:>12}" for n in names)]
    for fam in [*fams, None]:
        cells = []
        for n in names:
            r = results[n]
            cells.append(
                f"{100 * r.accuracy(fam):11.1f}%" if fam is None or fam in r.families() else " " * 12
            )
        lines.append(f"{fam or 'all':<{width}}  " + "  ".join(cells))
    return "\n".join(lines)
