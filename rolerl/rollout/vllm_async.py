"""vLLM's async engine (`AsyncLLM`) in this process, shaped like the offline `LLM` for `VLLMBackend`.

Why: `LLM.generate` returns when every request of the call is done, so with it each episode's segment waits
for the slowest segment of its batch, and a tool call waits for the whole batch (issue 46, finding 8).
`AsyncLLM` takes requests one at a time into vLLM's continuous batching and finishes each on its own, as
the built-in engine's rows do: an episode whose segment stops at a tool tag runs its tool while the others
still generate, then sends its next segment into the running batch.

`AsyncLLM` lives on an event loop of its own, in a daemon thread: its output handler is a task on the loop
it was created on, and the RL loop runs each step's rollout in a fresh `asyncio.run`. `submit` hands a
request to that loop and returns a `concurrent.futures.Future` (what `ServerLLM.submit` returns too), which
the backend awaits from whichever loop it runs on. The engine core is vLLM's own process, as with `LLM`.

Each request carries its own seed (vLLM draws a request's samples from its own generator), so the tokens do
not depend on which requests share a batch; the log-probs can differ by kernel rounding between batch
compositions (tests/rollout/real_vllm checks both against the batch path).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import weakref
from concurrent.futures import Future
from typing import Any


class AsyncEngine:
    """`AsyncLLM` behind the offline `LLM`'s surface (`generate`, `llm_engine.add_lora/remove_lora/
    list_loras`, `reset_prefix_cache`) plus `submit(prompt, params, lora) -> Future[RequestOutput]`.
    `engine_args`: vLLM's `AsyncEngineArgs` keywords (`model`, `dtype`, `enable_lora`, ...)."""

    def __init__(self, **engine_args: Any) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rolerl-vllm-async", daemon=True)
        self._thread.start()
        self._ids = itertools.count()

        async def build() -> Any:  # on the engine's loop: its output handler starts there
            return AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_args))

        self.engine = self._call(build())
        # like `LLM`, the engine core stops when this object is collected (a run's backend dropped), or at
        # exit: nothing on the loop refers back to this wrapper, so dropping it is enough
        self._stop = weakref.finalize(self, _stop, self.engine, self._loop, self._thread)
        self.max_model_len: int | None = getattr(self.engine.model_config, "max_model_len", None)
        self.llm_engine = self  # the LoRA calls of `LLM.llm_engine`, answered below
        try:  # only the final output of each request crosses back (not one per token)
            from vllm.sampling_params import RequestOutputKind

            self._final_only: Any = RequestOutputKind.FINAL_ONLY
        except ImportError:  # pragma: no cover - every supported version has it
            self._final_only = None

    def submit(self, prompt: Any, params: Any, lora: Any = None) -> Future:
        """Start one request now; the future holds its `RequestOutput` when it finishes."""
        if self._final_only is not None:
            params.output_kind = self._final_only
        prompt = (
            {"prompt_token_ids": list(prompt.prompt_token_ids)}
            if hasattr(prompt, "prompt_token_ids")
            else prompt
        )
        request_id, engine = f"rolerl-{next(self._ids)}", self.engine

        async def run() -> Any:
            last = None
            async for out in engine.generate(prompt, params, request_id, lora_request=lora):
                last = out
            return last

        return asyncio.run_coroutine_threadsafe(run(), self._loop)

    def generate(self, prompts, sampling_params, lora_request=None, use_tqdm: bool = False) -> list[Any]:
        """`LLM.generate`'s contract (every output, in order, when all are done): the sync probe uses it."""
        loras = lora_request if isinstance(lora_request, list) else [lora_request] * len(prompts)
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        jobs = [self.submit(p, s, r) for p, s, r in zip(prompts, params, loras, strict=True)]
        return [job.result() for job in jobs]

    def add_lora(self, request: Any) -> bool:
        return self._call(self.engine.add_lora(request))

    def remove_lora(self, lora_id: int) -> bool:
        return self._call(self.engine.remove_lora(lora_id))

    def list_loras(self) -> set[int]:
        return set(self._call(self.engine.list_loras()))

    def reset_prefix_cache(self) -> None:
        self._call(self.engine.reset_prefix_cache())

    def shutdown(self) -> None:
        """Stop the engine core process and the loop thread (once; collection or exit do it otherwise)."""
        self._stop()

    def _call(self, coro) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()


def _stop(engine: Any, loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> None:
    async def down() -> None:  # on the engine's own loop, where its output handler task runs
        engine.shutdown()

    if loop.is_running():
        asyncio.run_coroutine_threadsafe(down(), loop).result(timeout=120)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
