"""A deterministic `RolloutBackend`: the engine steps only when every live episode is waiting on it.

`EngineBackend` steps the engine in a free-running thread, so which requests share a forward depends on
when each coroutine got to submit. The engine's sampling is counter-based per request, but its forward
is batch-invariant only up to float rounding, and a near tie in a peaked distribution then flips a token
(tests/rollout/test_engine.py reports such ties). Two same-seed runs, or a run and its resumption, could
then sample differently. Here the engine is stepped from the event loop, and only once every episode
started with `episode()` is blocked in `generate` (or done), so batch composition is a function of the
requests alone and a resumed run samples exactly what the uninterrupted one did. Requests are handed
to the engine in (episode, call) order, not arrival order, so even workflows that await other things
(sleeps, their own I/O) between model calls batch identically every time.

Several models (the `separate` preset) get one engine each: `GenerationRequest.model` picks it, and every
engine with work steps in name order when all episodes wait, so batching stays deterministic across
models too.

Engine tools finish on their own threads, so a tool-using rollout's splice timing is still wall-clock
dependent. A workflow that fans out and resumes on the *first* finished call (`as_completed`) lets the
engine step before it submits again; with `gather` (wait for all) batching stays deterministic.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
from collections.abc import Awaitable, Mapping
from typing import TypeVar

from rolerl.rollout.engine import Engine
from rolerl.rollout.recorder import AdapterVersion, GenerationRequest
from rolerl.types import Turn

T = TypeVar("T")
_EPISODE: contextvars.ContextVar[int | None] = contextvars.ContextVar("rolerl_episode", default=None)


class LockstepBackend:
    """Run episodes with `await backend.episode(coro)` (all of a step's at once, e.g. via gather)."""

    def __init__(self, engine: Engine | Mapping[str, Engine]) -> None:
        self.engines = dict(engine) if isinstance(engine, Mapping) else {"main": engine}
        self._ids = itertools.count()
        self._outstanding: dict[int, int] = {}  # live episode -> requests submitted and not yet finished
        self._calls: dict[int, int] = {}  # live episode -> model calls made so far
        self._queue: list[tuple[int, int, GenerationRequest, asyncio.Future]] = []  # not yet submitted
        self._owner: dict[tuple[str, int], tuple[int, asyncio.Future]] = {}  # (model, handle) -> (ep, future)
        self._changed: asyncio.Event | None = None
        self._pump: asyncio.Task | None = None

    @property
    def engine(self) -> Engine:
        """The engine, when there is one model."""
        if len(self.engines) != 1:
            raise ValueError(f"this backend serves {len(self.engines)} models {list(self.engines)}")
        return next(iter(self.engines.values()))

    async def episode(self, coro: Awaitable[T]) -> T:
        """Run one episode's coroutine; the engine waits for it whenever it is not waiting on the engine."""
        ep = next(self._ids)
        if not self._outstanding:  # the first episode of a rollout: it shares kept prefixes with its own only
            for engine in self.engines.values():
                engine.forget_kept()
        self._outstanding[ep], self._calls[ep] = 0, 0
        token = _EPISODE.set(ep)
        self._ensure_pump()
        try:
            return await coro
        finally:
            _EPISODE.reset(token)
            del self._outstanding[ep], self._calls[ep]
            self._changed.set()

    async def generate(self, request: GenerationRequest) -> Turn:
        ep = _EPISODE.get()
        if ep is None or ep not in self._outstanding:
            raise RuntimeError("LockstepBackend.generate must be called inside backend.episode(...)")
        future = asyncio.get_running_loop().create_future()
        # Queued, not submitted: the pump submits in (episode, call) order, whatever order they arrived in
        self._queue.append((ep, self._calls[ep], request, future))
        self._calls[ep] += 1
        self._outstanding[ep] += 1
        self._ensure_pump()
        self._changed.set()
        return await future

    def sleep(self) -> None:
        """Every engine frees its sampling memory (KV cache, packed weight copies) until the next request."""
        for engine in self.engines.values():
            engine.sleep()

    def sync(self, policy) -> dict[str, float]:
        """Engines with their own copy of the weights (`rollout.dtype`, asynchronous training) take the new
        adapters: the trainer's, or those of an `AdapterVersion`."""
        out: dict[str, float] = {}
        version = policy if isinstance(policy, AdapterVersion) else None
        for engine in self.engines.values():
            out |= engine.sync(version)
        return out

    def close(self) -> None:
        if self._pump is not None:
            self._pump.cancel()
        for engine in self.engines.values():
            engine.close()

    # ---- internals --------------------------------------------------------------------------------------

    def _ensure_pump(self) -> None:
        if self._changed is None or self._pump is None or self._pump.done():
            self._changed = asyncio.Event()
            self._pump = asyncio.get_running_loop().create_task(self._run())
            self._pump.add_done_callback(self._pump_ended)

    def _pump_ended(self, pump: asyncio.Task) -> None:
        """A pump that raised takes its requests down with it. Ctrl-C or SIGTERM inside an engine step has
        already left the event loop (asyncio re-raises them) for the caller to handle: reading it here
        keeps asyncio from printing it a second time, as a task exception never retrieved."""
        error = None if pump.cancelled() else pump.exception()
        if isinstance(error, Exception):  # a bug of the pump's own: every waiting call fails with it
            for ep, future in [*self._owner.values(), *((q[0], q[3]) for q in self._queue)]:
                self._resolve(ep, future, None, error)
            self._owner.clear()
            self._queue.clear()

    def _all_waiting(self) -> bool:
        return all(n > 0 for n in self._outstanding.values())

    async def _run(self) -> None:
        while self._outstanding or self._owner:
            while not self._all_waiting():
                self._changed.clear()
                await self._changed.wait()
            self._submit_queued()
            busy = [name for name in sorted(self.engines) if self.engines[name].has_work]
            if not busy:
                self._changed.clear()
                await self._changed.wait()
                continue
            for name in busy:
                self._step(name)
            await asyncio.sleep(0)  # let resumed coroutines run before checking again

    def _step(self, name: str) -> None:
        engine = self.engines[name]
        try:
            finished = engine.step()
        except Exception as e:  # noqa: BLE001 - an engine failure fails every request waiting on it, loudly
            engine.reset()
            for key in [k for k in self._owner if k[0] == name]:
                self._resolve(*self._owner.pop(key), None, e)
            return
        for handle, turn in finished:
            # resolved now, not when the coroutine resumes: the next step waits for it to submit or end
            self._resolve(*self._owner.pop((name, handle)), turn, None)

    def _submit_queued(self) -> None:
        for ep, _, request, future in sorted(self._queue, key=lambda q: (q[0], q[1])):
            try:
                engine = self.engines.get(request.model)
                if engine is None:
                    raise ValueError(
                        f"no engine serves model {request.model!r}; models: {list(self.engines)}"
                    )
                self._owner[(request.model, engine.submit(request))] = (ep, future)
            except Exception as e:  # noqa: BLE001 - a bad request fails its own caller only
                self._resolve(ep, future, None, e)
        self._queue.clear()

    def _resolve(
        self, ep: int, future: asyncio.Future, turn: Turn | None, error: BaseException | None
    ) -> None:
        if ep in self._outstanding:
            self._outstanding[ep] -= 1
        if future.done():  # the episode was cancelled
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(turn)
