"""`await backend.generate(request)` from many concurrent workflow coroutines.

Workflows are plain async functions (`ctx.generate(role, messages)`); each awaits one model call at a
time, and many run at once. The scheduler feeds all their requests to one engine, whose continuous
batching mixes roles and adapters in one batch. The engine steps in a background thread (torch releases
the GIL inside its kernels), so the event loop stays free to run tools and workflow logic.

`RolloutBackend` is the Protocol every backend implements (the built-in engine's, the lockstep one, vLLM's):
`generate` one call, run an episode's coroutine (`episode`: the lockstep backend tracks which calls
belong to which episode; the others just await it), `sleep` before an optimizer step (free what only
sampling needs while the trainer runs: the KV cache, packed copies of the trainer's weights), `sync` the
policy's weights after it (in-process engines read the trainer's own weights: nothing to do; vLLM loads
new adapter versions).
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Awaitable
from typing import Any, Protocol, TypeVar, runtime_checkable

from rolerl.rollout.engine import Engine
from rolerl.rollout.recorder import AdapterVersion, GenerationRequest
from rolerl.types import Turn

T = TypeVar("T")


@runtime_checkable
class RolloutBackend(Protocol):
    async def generate(self, request: GenerationRequest) -> Turn: ...

    async def episode(self, coro: Awaitable[T]) -> T: ...

    def sleep(self) -> None: ...

    def sync(self, policy: Any) -> dict[str, float]: ...

    def close(self) -> None: ...


class InProcess:
    """What a backend over the trainer's own model does for `episode` and `sync`: nothing."""

    async def episode(self, coro: Awaitable[T]) -> T:
        return await coro

    def sync(self, policy: Any) -> dict[str, float]:
        return {}


class EngineBackend(InProcess):
    """A `RolloutBackend` over the local `Engine`: requests from any coroutine, batched together."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._waiters: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="rolerl-engine", daemon=True)
        self._thread.start()

    async def generate(self, request: GenerationRequest) -> Turn:
        if self._closed:
            raise RuntimeError("backend is closed")
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._inbox.put((request, loop, future))
        return await future

    def sync(self, policy: Any) -> dict[str, float]:
        """The engine's own copy of the weights, when it has one (`rollout.dtype`, asynchronous training),
        takes the new adapters: the trainer's, or those of an `AdapterVersion`."""
        return self.engine.sync(policy if isinstance(policy, AdapterVersion) else None)

    def sleep(self) -> None:
        """Free the engine's sampling memory, in its own thread, before any request queued after this."""
        self._inbox.put(_SLEEP)

    def close(self) -> None:
        self._closed = True
        self._inbox.put(None)
        self._thread.join(timeout=10)
        self.engine.close()

    def _loop(self) -> None:
        while True:
            for item in self._drain(block=not self.engine.has_work):  # block only when idle
                if item is None:
                    self._fail_all(RuntimeError("backend closed"))
                    return
                if item is _SLEEP:
                    if not self.engine.has_work:  # a request in flight wins: sleeping is an optimisation
                        self.engine.sleep()
                    continue
                self._submit(*item)
            if not self.engine.has_work:
                continue
            try:
                finished = self.engine.step()
            except Exception as e:  # noqa: BLE001 - an engine failure fails every waiting request, loudly
                self._fail_all(e)
                self.engine.reset()
                continue
            for handle, turn in finished:
                loop, future = self._waiters.pop(handle)
                loop.call_soon_threadsafe(_resolve, future, turn, None)

    def _drain(self, block: bool) -> list:
        items = [self._inbox.get()] if block else []
        while True:
            try:
                items.append(self._inbox.get_nowait())
            except queue.Empty:
                return items

    def _submit(self, request: GenerationRequest, loop, future) -> None:
        try:
            handle = self.engine.submit(request)
        except Exception as e:  # noqa: BLE001 - a bad request fails its own caller only
            loop.call_soon_threadsafe(_resolve, future, None, e)
            return
        self._waiters[handle] = (loop, future)

    def _fail_all(self, error: BaseException) -> None:
        for loop, future in self._waiters.values():
            loop.call_soon_threadsafe(_resolve, future, None, error)
        self._waiters.clear()


_SLEEP = object()  # the inbox's message for `EngineBackend.sleep`


def _resolve(future: asyncio.Future, result, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class ModelRouter:
    """A `RolloutBackend` over one backend per model: each request goes to `backends[request.model]`
    (the `separate` preset with the threaded backend: one free-running engine per model)."""

    def __init__(self, backends: dict[str, RolloutBackend]) -> None:
        self.backends = backends

    async def generate(self, request: GenerationRequest) -> Turn:
        backend = self.backends.get(request.model)
        if backend is None:
            raise ValueError(f"no engine serves model {request.model!r}; models: {list(self.backends)}")
        return await backend.generate(request)

    async def episode(self, coro: Awaitable[T]) -> T:
        return await coro

    def sync(self, policy: Any) -> dict[str, float]:
        out: dict[str, float] = {}
        for backend in self.backends.values():
            out |= backend.sync(policy)
        return out

    def sleep(self) -> None:
        for backend in self.backends.values():
            backend.sleep()

    def close(self) -> None:
        for backend in self.backends.values():
            backend.close()
