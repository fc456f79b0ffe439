"""Policy versions on tokens, the staleness they imply, and asynchronous training (`train.max_staleness`).

Every sampled token records the version of the adapter that produced it (`Turn.versions`): that adapter's
optimizer step count in the weights the engine held. Adapters step at their own rates (a role that fills
more mini-batches, `trainable: false`), so one token's version is its own adapter's, never the step's.
A token's staleness is its adapter's step count now, in the trainer, minus the token's version.

With `train.max_staleness: k`, the rollout of step `s` samples from the adapters as they were after step
`s - 1 - k` (step 0: the start), a fixed version, so a run is a function of its config and seed like the
synchronous one. `RolloutPipeline` generates those rollouts in one background thread, in step order,
while the trainer updates: after the update of step `s` it `publish`es the adapters that changed (cloned,
the trainer goes on changing its own), and the thread, once it needs that version, hands it to the engine
through `backend.sync`. A thread rather than a process: the engine's and the trainer's work is in torch
kernels and the engine's own C kernels, which release the GIL, and a thread shares the frozen base
weights and the tokenizer without a copy; the engine samples from its own copy of the model (adapters
and all), so the trainer's update never changes the weights under a rollout in flight. `k = 0` never
starts the thread: it is the synchronous loop.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Mapping, Sequence

import torch

from rolerl.models.lora import adapter_specs, named_adapter_parameters
from rolerl.roles import POLICY_KINDS
from rolerl.rollout.engine import Engine
from rolerl.rollout.lockstep import LockstepBackend
from rolerl.rollout.recorder import AdapterVersion
from rolerl.rollout.scheduler import EngineBackend, ModelRouter, RolloutBackend
from rolerl.run.policy import Policy
from rolerl.types import Episode, Turn

log = logging.getLogger(__name__)


def adapter_versions(policy: Policy, steps: Mapping[str, int]) -> dict[object, list[int]]:
    """The trainer's model -> each adapter's version, in route-index order (a frozen adapter: 0)."""
    return {
        m.model: [int(steps.get(name, 0)) for name in adapter_specs(m.model)] for m in policy.members.values()
    }


def backend_engines(backend: RolloutBackend) -> list[Engine]:
    """The built-in engines behind `backend` (none for vLLM, whose tokens record version 0 for now)."""
    if isinstance(backend, EngineBackend):
        return [backend.engine]
    if isinstance(backend, LockstepBackend):
        return list(backend.engines.values())
    if isinstance(backend, ModelRouter):
        return [e for b in backend.backends.values() for e in backend_engines(b)]
    return []


def stamp_versions(backend: RolloutBackend, policy: Policy, steps: Mapping[str, int]) -> None:
    """The synchronous loop: the engines sample from the trainer's adapters as they are now."""
    versions = adapter_versions(policy, steps)
    for engine in backend_engines(backend):
        engine.versions = list(versions.get(engine.source if engine.source is not None else engine.model, []))


def token_adapters(turn: Turn, names: Sequence[str]) -> list[tuple[str, int]]:
    """`(adapter name, version)` of each sampled policy token of `turn` computed by an adapter."""
    n_prompt, versions, out = len(turn.prompt_ids), turn.version_list(), []
    for j, kind in enumerate(turn.kinds):
        p = n_prompt + j - 1  # the position that predicts completion token j
        if p < 0 or kind not in POLICY_KINDS or versions[j] < 0 or turn.routes[p] < 0:
            continue
        out.append((names[turn.routes[p]], versions[j]))
    return out


def staleness(
    turns: Sequence[Turn], policy: Policy, steps: Mapping[str, int], bound: int | None
) -> tuple[dict[str, float], list[int]]:
    """Per-adapter staleness of the tokens (adapter's step count now minus the token's version): metrics
    `staleness/<adapter>/{mean,max}` and the histogram `staleness/<adapter>/hist/<k>` (tokens `k` steps
    behind), and the indices of the turns with a token more than `bound` behind (none without a bound)."""
    names = {m: list(adapter_specs(policy.members[m].model)) for m in policy.members}
    hist: dict[str, Counter] = {}
    stale = []
    for i, turn in enumerate(turns):
        behind = [
            (name, int(steps.get(name, 0)) - v)
            for name, v in token_adapters(turn, names[policy.topology.model(turn.role)])
        ]
        for name, k in behind:
            hist.setdefault(name, Counter())[k] += 1
        if bound is not None and any(k > bound for _, k in behind):
            stale.append(i)
    metrics: dict[str, float] = {}
    for name, counts in sorted(hist.items()):
        total = sum(counts.values())
        metrics[f"staleness/{name}/mean"] = sum(k * c for k, c in counts.items()) / total
        metrics[f"staleness/{name}/max"] = float(max(counts))
        metrics |= {f"staleness/{name}/hist/{k}": float(c) for k, c in sorted(counts.items())}
    return metrics, stale


class RolloutPipeline:
    """Rollouts of steps `start + 1 .. last`, generated in a background thread in step order, step `s`'s
    from the adapters after step `s - 1 - lag` (never before `start`). `generate(step)` runs one step's
    rollout (the loop's own); `episodes(step)` waits for it; `publish(step, ...)` after each update gives
    the thread that version. `log` records `(rollout step, weights step)` of every rollout, as run."""

    def __init__(
        self,
        backend: RolloutBackend,
        policy: Policy,
        steps: Mapping[str, int],
        generate: Callable[[int], list[Episode]],
        *,
        lag: int,
        start: int,
        last: int,
        wait_s: float = 5.0,
    ) -> None:
        if lag < 1:
            raise ValueError(f"RolloutPipeline needs a lag >= 1 (0 is the synchronous loop); got {lag}")
        self.backend, self.policy, self.generate = backend, policy, generate
        self.lag, self.start, self.last, self.wait_s = lag, start, last, wait_s
        # the engines sample from a copy that equals the trainer's adapters now: version `start` changes none
        self._versions: dict[int, AdapterVersion] = {
            start: AdapterVersion(start, {}, adapter_versions(policy, steps))
        }
        self._steps = dict(steps)  # the step counts of the newest version published
        self._results: dict[int, list[Episode]] = {}
        self._error: BaseException | None = None
        self._closed = False
        self._cv = threading.Condition()
        self.log: list[tuple[int, int]] = []
        self._thread = threading.Thread(target=self._run, name="rolerl-rollout", daemon=True)
        self._thread.start()

    def weights_step(self, step: int) -> int:
        """The training step whose adapters sample the rollout of `step`."""
        return max(self.start, step - 1 - self.lag)

    def publish(self, step: int, policy: Policy, steps: Mapping[str, int]) -> dict[str, float]:
        """The adapters after the update of `step`: those whose step count changed, cloned now (the trainer
        goes on updating its own). Returns `async/synced_adapters`, how many changed."""
        changed = {name for name, n in steps.items() if n != self._steps.get(name, 0)}
        tensors: dict[object, dict[str, object]] = {}
        for m in policy.members.values():
            mine = [n for n in adapter_specs(m.model) if n in changed]
            params = {k: p.detach().clone() for k, p in named_adapter_parameters(m.model, mine)}
            if params:
                tensors[m.model] = params
        with self._cv:
            self._versions[step] = AdapterVersion(step, tensors, adapter_versions(policy, steps))
            self._steps = dict(steps)
            self._cv.notify_all()
        return {"async/synced_adapters": float(len(changed))}

    def episodes(self, step: int) -> list[Episode]:
        """Step `step`'s episodes, once the thread has them; the thread's error if it failed."""
        with self._cv:
            while step not in self._results:
                if self._error is not None:
                    raise RuntimeError(
                        f"the rollout thread failed before step {step}: {self._error}"
                    ) from self._error
                if not self._thread.is_alive():
                    raise RuntimeError(f"the rollout thread stopped before step {step}")
                self._cv.wait(self.wait_s)
            return self._results.pop(step)

    def close(self) -> None:
        """Stop after the rollout in flight (it is not cut short: the engine would be left mid-step)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join()

    def _run(self) -> None:
        loaded = None
        try:
            for step in range(self.start + 1, self.last + 1):
                want = self.weights_step(step)
                with self._cv:
                    while want not in self._versions and not self._closed:
                        self._cv.wait(self.wait_s)
                    if self._closed:
                        return
                    todo = [
                        v for s, v in sorted(self._versions.items()) if loaded is None or loaded < s <= want
                    ]
                    for s in [s for s in self._versions if s < want]:
                        del self._versions[s]  # no later rollout samples from an older version
                for version in todo:  # each holds the adapters changed since the one before
                    self.backend.sync(version)
                loaded = want
                episodes = self.generate(step)
                with self._cv:
                    self.log.append((step, want))
                    self._results[step] = episodes
                    self._cv.notify_all()
        except BaseException as e:  # noqa: BLE001 - the trainer raises it from `episodes`
            log.exception("the rollout thread failed")
            with self._cv:
                self._error = e
                self._cv.notify_all()


def snapshot_tensors(policy: Policy) -> dict[str, torch.Tensor]:
    """Every adapter parameter of the policy, cloned (tests compare runs' final weights with it)."""
    return {
        f"{name}/{k}": p.detach().clone()
        for name, m in policy.members.items()
        for k, p in named_adapter_parameters(m.model)
    }
