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
through `backend.sync`. A checkpoint at step `c` keeps the versions that the rollouts of steps `c + 1 ..
c + k` sample (`state`), so a run resumed from it samples what the uninterrupted run samples. A thread
rather than a process: the engine's and the trainer's work is in torch kernels and the engine's own C
kernels, which release the GIL, and a thread shares the frozen base weights and the tokenizer without a
copy; the engine samples from its own copy of the model (adapters and all), so the trainer's update never
changes the weights under a rollout in flight. `k = 0` never starts the thread: it is the synchronous loop.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from rolerl.models.lora import adapter_specs, named_adapter_parameters
from rolerl.roles import POLICY_KINDS
from rolerl.rollout.engine import Engine
from rolerl.rollout.lockstep import LockstepBackend
from rolerl.rollout.recorder import AdapterVersion
from rolerl.rollout.scheduler import EngineBackend, ModelRouter, RolloutBackend
from rolerl.rollout.vllm_backend import VLLMBackend
from rolerl.run.policy import Policy
from rolerl.types import Episode, Turn

log = logging.getLogger(__name__)


def adapter_versions(policy: Policy, steps: Mapping[str, int]) -> dict[object, list[int]]:
    """The trainer's model -> each adapter's version, in route-index order (a frozen adapter: 0)."""
    return {
        m.model: [int(steps.get(name, 0)) for name in adapter_specs(m.model)] for m in policy.members.values()
    }


def backend_engines(backend: RolloutBackend) -> list[Engine]:
    """The built-in engines behind `backend` (none for vLLM: `vllm_backends`)."""
    if isinstance(backend, EngineBackend):
        return [backend.engine]
    if isinstance(backend, LockstepBackend):
        return list(backend.engines.values())
    if isinstance(backend, ModelRouter):
        return [e for b in backend.backends.values() for e in backend_engines(b)]
    return []


def vllm_backends(backend: RolloutBackend) -> list[VLLMBackend]:
    """The vLLM backends behind `backend`."""
    if isinstance(backend, ModelRouter):
        return [v for b in backend.backends.values() for v in vllm_backends(b)]
    return [backend] if isinstance(backend, VLLMBackend) else []


def stamp_versions(backend: RolloutBackend, policy: Policy, steps: Mapping[str, int]) -> None:
    """The synchronous loop: the engines sample from the trainer's adapters as they are now (vLLM serves
    them too: the loop syncs it after every update)."""
    versions = adapter_versions(policy, steps)
    for engine in backend_engines(backend):
        engine.versions = list(versions.get(engine.source if engine.source is not None else engine.model, []))
    for served in vllm_backends(backend):
        served.stamp(versions.get(served.source, []))


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
    from the adapters after step `s - 1 - lag` (never before `floor`: the run's start). `generate(step)`
    runs one step's rollout (the loop's own); `episodes(step)` waits for it; `publish(step, ...)` after each
    update gives the thread that version. `log` records `(rollout step, weights step)` of every rollout, as
    run. `resumed`: what the checkpoint at `start` kept (`state`); without it (a synchronous run's
    checkpoint, an older one) the floor is `start`, and the first `lag` rollouts sample its adapters.
    `close_s` bounds how long `close` waits for a rollout in flight."""

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
        resumed: Mapping[str, Any] | None = None,
        partial: bool = False,
        wait_s: float = 5.0,
        close_s: float = 30.0,
    ) -> None:
        if lag < 1:
            raise ValueError(f"RolloutPipeline needs a lag >= 1 (0 is the synchronous loop); got {lag}")
        self.backend, self.policy, self.generate = backend, policy, generate
        self.lag, self.start, self.last, self.wait_s, self.close_s = lag, start, last, wait_s, close_s
        self.floor = start
        # every adapter's tensors (by the trainer's model) and step counts of each version a checkpoint may
        # keep; unchanged tensors are shared between versions
        self._full: dict[int, tuple[dict[object, dict[str, torch.Tensor]], dict[str, int]]] = {
            start: ({m.model: _cloned(m.model) for m in policy.members.values()}, dict(steps))
        }
        older = self._resumed(resumed) if resumed is not None else None
        if older is not None:
            self.floor = int(resumed["floor"])
            self._full |= older
        elif start > 0:
            log.warning(
                "the checkpoint at step %d keeps no adapter versions for asynchronous rollouts (a synchronous "
                "or older run wrote it, or with another train.max_staleness): the rollouts of steps %d-%d "
                "sample its adapters, unlike the uninterrupted run",
                start, start + 1, start + lag,
            )  # fmt: skip
        # each version holds every adapter, so the engine may start from any of them
        self._versions: dict[int, AdapterVersion] = {
            s: AdapterVersion(s, tensors, adapter_versions(policy, n))
            for s, (tensors, n) in self._full.items()
        }
        self._steps = dict(steps)  # the step counts of the newest version published
        self._results: dict[int, list[Episode]] = {}
        self._error: tuple[int, BaseException] | None = None  # the rollout step that failed, and why
        self._step = start  # the rollout step in flight (or the last one run)
        self._closed = self._ended = False
        self._cv = threading.Condition()
        self.log: list[tuple[int, int]] = []
        self.partial = partial  # `train.partial_rollouts`: `_generate_partial`
        self._switches: dict[int, int] = {}  # rollout step -> the engines' switches with rows in flight
        self._times: dict[
            int, tuple[float, float]
        ] = {}  # rollout step -> (s waiting for its version, s generating)
        self._thread = threading.Thread(target=self._run, name="rolerl-rollout", daemon=True)
        self._thread.start()

    def weights_step(self, step: int) -> int:
        """The training step whose adapters sample the rollout of `step`."""
        return max(self.floor, step - 1 - self.lag)

    def state(self, step: int) -> dict[str, Any]:
        """What a checkpoint at `step` keeps so that a run resumed from it samples the rollouts of steps
        `step + 1 .. step + lag` from the versions the uninterrupted run samples: every adapter's tensors
        (by member, then parameter name) and step counts of each such version older than `step` (`step`'s
        own are the checkpoint's adapters), and the floor. Plain dicts and tensors (`torch.save`)."""
        member = {m.model: name for name, m in self.policy.members.items()}
        need = {self.weights_step(s) for s in range(step + 1, step + self.lag + 1)} - {step}
        with self._cv:
            kept = {s: self._full[s] for s in sorted(need)}
        versions = {
            s: {"steps": dict(n), "tensors": {member[m]: dict(t) for m, t in tensors.items()}}
            for s, (tensors, n) in kept.items()
        }
        return {"lag": self.lag, "floor": self.floor, "versions": versions}

    def _resumed(
        self, saved: Mapping[str, Any]
    ) -> dict[int, tuple[dict[object, dict[str, torch.Tensor]], dict[str, int]]] | None:
        """The versions `saved` (`state` at `start`) keeps, by the trainer's models; None unless they are
        every version the rollouts of steps `start + 1 .. start + lag` need."""
        floor, versions = int(saved["floor"]), saved["versions"]
        need = {max(floor, s - 1 - self.lag) for s in range(self.start + 1, self.start + self.lag + 1)}
        if floor > self.start or not need - {self.start} <= set(versions):
            return None
        models = {name: m.model for name, m in self.policy.members.items()}
        if any(set(v["tensors"]) != set(models) for v in versions.values()):
            return None
        return {
            int(s): ({models[name]: t for name, t in v["tensors"].items()}, dict(v["steps"]))
            for s, v in versions.items()
        }

    def publish(self, step: int, policy: Policy, steps: Mapping[str, int]) -> dict[str, float]:
        """The adapters after the update of `step`: those whose step count changed, cloned now (the trainer
        goes on updating its own). Returns `async/synced_adapters`, how many changed, and how the thread spent
        the time of `step`'s rollout: `time/rollout_thread_wait` waiting for its version (the engine idle),
        `time/rollout_thread` syncing and generating."""
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
            newest = self._full[max(self._full)][0]
            self._full[step] = ({m: t | tensors.get(m, {}) for m, t in newest.items()}, dict(steps))
            # a checkpoint of `step` or, after an error later in this step's loop, of `step - 1`
            for s in [s for s in self._full if s < self.weights_step(step)]:
                del self._full[s]
            self._cv.notify_all()
        metrics = {"async/synced_adapters": float(len(changed))}
        with (
            self._cv
        ):  # `step`'s rollout is done (the trainer has its episodes): how its thread spent the time
            wait, busy = self._times.pop(step, (0.0, 0.0))
        metrics |= {"time/rollout_thread_wait": wait, "time/rollout_thread": busy}
        if self.partial:  # `step`'s rollout is done: the trainer has its episodes
            with self._cv:
                metrics["async/partial_switches"] = float(self._switches.pop(step, 0))
        return metrics

    def episodes(self, step: int) -> list[Episode]:
        """Step `step`'s episodes, once the thread has them. A rollout that failed raises
        `RolloutThreadError` naming its step and cause; a thread that ended without `step`'s rollout (and
        without an error) raises one too, at once."""
        with self._cv:
            while step not in self._results:
                if self._error is not None:
                    failed, e = self._error
                    raise RolloutThreadError(
                        f"the rollout of step {failed} failed in the rollout thread: {type(e).__name__}: {e}"
                    ) from e
                if self._ended:
                    raise RolloutThreadError(
                        f"the rollout thread ended after step {self._step}'s rollout, without step {step}'s "
                        "and without an error"
                    )
                self._cv.wait(self.wait_s)
            return self._results.pop(step)

    def close(self) -> None:
        """Stop the thread after the rollout in flight, waiting for it at most `close_s` seconds (it is not
        cut short: the engine would be left mid-step). One still running then is left to the backend's
        `close`, which fails its requests; the thread is a daemon and never keeps the process alive."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(self.close_s)
        if self._thread.is_alive():
            log.warning(
                "the rollout of step %d is still running %.0f s after the run stopped; leaving it to the "
                "backend's close",
                self._step, self.close_s,
            )  # fmt: skip

    def _run(self) -> None:
        loaded = None
        try:
            for step in range(self.start + 1, self.last + 1):
                want = self.weights_step(step)
                t0 = time.perf_counter()
                with self._cv:
                    while want not in self._versions and not self._closed:
                        self._cv.wait(self.wait_s)
                    if self._closed:
                        return
                    self._step = step
                    todo = [
                        v
                        for s, v in sorted(self._versions.items())
                        if (loaded is None or loaded < s) and s <= want
                    ]
                    for s in [s for s in self._versions if s < want]:
                        del self._versions[s]  # no later rollout samples from an older version
                t1 = time.perf_counter()
                for version in todo:  # each holds the adapters changed since the one before
                    self.backend.sync(version)
                loaded = want if loaded is None else max(loaded, want)  # a partial rollout may be ahead
                if self.partial:
                    episodes, loaded = self._generate_partial(step, loaded)
                else:
                    episodes = self.generate(step)
                with self._cv:
                    self.log.append((step, want))
                    self._times[step] = (t1 - t0, time.perf_counter() - t1)
                    self._results[step] = episodes
                    self._cv.notify_all()
        except BaseException as e:  # noqa: BLE001 - the trainer raises it from `episodes`
            if self._closed:  # the run stopped first (the backend's close fails a rollout left running)
                log.info("the rollout of step %d stopped with the run: %s", self._step, e)
            else:
                log.exception("the rollout of step %d failed", self._step)
            with self._cv:
                self._error = (self._step, e)
        finally:
            with self._cv:
                self._ended = True
                self._cv.notify_all()

    def _generate_partial(self, step: int, loaded: int) -> tuple[list[Episode], int]:
        """`generate(step)` with partial rollouts: each engine, at the start of each of its steps (in the
        thread that steps it), switches to the newest version published since the one it holds, never one
        after step `step - 1` (`Engine.poll`, `Engine.switch`). Versions only get newer, so every token stays
        within the bound. Returns the episodes and the version every engine holds after it (one that sampled
        nothing since another switched catches up here)."""
        engines = backend_engines(self.backend)
        at = dict.fromkeys(map(id, engines), loaded)  # engine -> the version it holds
        before = sum(e.stats["switches"] for e in engines)
        for e in engines:
            e.poll = functools.partial(self._newer, at, id(e), step - 1)
        try:
            episodes = self.generate(step)
        finally:
            for e in engines:
                e.poll = None
        newest = max(at.values(), default=loaded)
        for e in engines:
            if at[id(e)] < newest:
                e.sync(self._newer(at, id(e), newest))
        with self._cv:
            self._switches[step] = sum(e.stats["switches"] for e in engines) - before
        return episodes, newest

    def _newer(self, at: dict[int, int], engine: int, bound: int) -> AdapterVersion | None:
        """The versions published after `at[engine]`, up to `bound`, as one (each holds the adapters changed
        since the one before: the later one's tensors win); None when there is none. `at[engine]` moves to
        it."""
        with self._cv:
            steps = [s for s in sorted(self._versions) if at[engine] < s <= bound]
            if not steps:
                return None
            at[engine] = steps[-1]
            tensors: dict[object, dict[str, object]] = {}
            for s in steps:
                for model, named in self._versions[s].tensors.items():
                    tensors.setdefault(model, {}).update(named)
            return AdapterVersion(steps[-1], tensors, self._versions[steps[-1]].versions)


class RolloutThreadError(RuntimeError):
    """The rollout thread failed, or ended without the rollout the trainer waits for."""


def _cloned(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: p.detach().clone() for k, p in named_adapter_parameters(model)}


def snapshot_tensors(policy: Policy) -> dict[str, torch.Tensor]:
    """Every adapter parameter of the policy, cloned (tests compare runs' final weights with it)."""
    return {
        f"{name}/{k}": p.detach().clone()
        for name, m in policy.members.items()
        for k, p in named_adapter_parameters(m.model)
    }
