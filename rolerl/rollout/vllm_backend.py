"""The vLLM rollout backend (`rollout.backend: vllm`, extra `rolerl[vllm]`, imported lazily).

vLLM generates; the shared `Recorder` (rolerl.rollout.recorder) decides what each token means, exactly as
in the built-in engine: token ids in, token ids out, never re-tokenised text. One model call is a series of
vLLM *segments*, each a request whose prompt is every id so far:

- a segment stops at the closing tool tag (a stop string, kept in the output); the recorder sees the
  call close, the tool runs, its output is spliced as forced ids, and the next segment continues from them;
- adapters are per request (`LoRARequest`). A token-routed topology (`dart`: reasoning and tool calls on
  different adapters) is generated segment by segment, switching adapter where the recorder's next route
  changes (stop strings at those tags make vLLM stop near there; tokens past the boundary, e.g. when a tag
  is split across tokens or shares a token with text, are discarded). Every position of a segment,
  including the re-read prefix, is computed with that segment's adapter, so the rollout's log-probs are
  not the true routing's: the trainer recomputes them (`algorithm.old_logp: recompute`, required) and
  truncated importance sampling (`algorithm.tis_cap`) corrects the rest;
- each segment is its own request, sent when its episode is ready and awaited on its own (`llm.submit`:
  vLLM's `AsyncLLM` in this process, rolerl.rollout.vllm_async, or a server over HTTP), so every episode
  advances at its own pace, as the built-in engine's rows do: one episode's tool runs while the others
  still generate. An engine with only `generate` (vLLM's `LLM`, the fakes) gets the segments queued at
  that moment as one batch, which returns when its slowest segment is done. Each request carries its own
  seed (`_segment_seed`: the call's seed and where the segment starts), so neither path's tokens depend
  on which other requests share a batch;
- log-probs are the sampled token's, looked up by id, in vLLM's processed mode (after temperature), i.e.
  `log_softmax(logits / T)`, what the trainer computes. With top-p/top-k vLLM renormalises over the kept
  set, which the trainer does not: that combination is refused unless the trainer recomputes.

After each optimizer step `sync(policy)` saves every changed adapter as a PEFT directory and loads it
under a **new** LoRA id and name (`<adapter>@v<k>`: reusing a name could serve prefix-cache entries
computed with the old weights), unloads old versions once no segment in flight uses them, checks that vLLM
lists the new version, and that its log-probs on a probe prompt changed when the trainer's own log-probs
on that probe did (`rollout/sync_check`; a served adapter that stayed the same after a real update is an
error, the silent failure several published trainers shipped). Only LoRA adapters can be synced.

Asynchronous training (`train.max_staleness`, rolerl.train.pipeline) syncs to an `AdapterVersion` instead:
the adapters after an older step, while the trainer has moved on. As the built-in engine's
`Engine.sync(version)` does with its own copy of the model, the backend copies the version's changed
adapters into `replica` (a copy of the trainer's model), writes the PEFT directories from it and probes
it, so what vLLM serves and what the probe compares with are that version, never the trainer's live
weights. Every sampled token records the version of the adapter that sampled it (`Turn.versions`): the
optimizer step count of the LoRA version its segment was sent with.

Tested against real vLLM (its CPU build, `make test-vllm`, tests/rollout/real_vllm/): the offline engine
and `vllm serve`, log-prob parity with the trainer per kind, GRPO runs, and the checks of
`rolerl.rollout.vllm_checks`; the fast suite drives this class with a fake engine (tests/rollout/fake_vllm.py).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import secrets
import shutil
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from rolerl.roles import token_bytes
from rolerl.rollout.recorder import AdapterVersion, GenerationRequest, Recorder, run_tool
from rolerl.rollout.vllm_checks import (
    MAX_TEMPERATURE,
    MIN_TEMPERATURE,
    check_vllm_config,
    check_vllm_version,
    cpu_scheduling,
    engine_max_len,
    vllm_dtype,
)
from rolerl.tools.base import Tool
from rolerl.types import Turn

log = logging.getLogger(__name__)
PROBE_TEXT = "The quick brown fox jumps over the lazy dog. 12 + 30 = 42. def f(x): return x * 2"
PROBE_TOKENS = 8  # sampled at the rollout temperature by every sync's probe
# Sampling fields a server fills from the model's generation_config.json when a request leaves them out
# (vLLM applies them before its processed log-probs): always sent, neutral, so the rollout samples from
# log_softmax(logits / T) alone, as the trainer assumes.
NEUTRAL = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "min_p": 0.0}


def vllm_api() -> SimpleNamespace:
    """The few vLLM types the backend builds requests from (imported here, on first use)."""
    try:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.lora.request import LoRARequest
    except ImportError as e:
        raise ImportError(
            "rollout.backend=vllm needs vLLM: pip install 'rolerl[vllm]' (a CUDA machine; docs/ROLLOUT.md)"
        ) from e
    return SimpleNamespace(SamplingParams=SamplingParams, TokensPrompt=TokensPrompt, LoRARequest=LoRARequest)


@dataclass
class ServedAdapter:
    """One adapter's weights as vLLM serves them: a PEFT directory loaded under its own LoRA id."""

    adapter: str
    version: int  # this backend's count of the adapter's loads (`@v<k>` in its LoRA name)
    lora_id: int
    path: Path
    step: int = 0  # the adapter's optimizer step count in these weights: what its tokens record
    in_flight: int = 0  # segments using it now
    # the backend instance's: a new backend never reuses an old one's names (on a long-lived server)
    tag: str = ""

    @property
    def lora_name(self) -> str:
        return f"{self.adapter}@v{self.version}" + (f".{self.tag}" if self.tag else "")


class VLLMBackend:
    """A `RolloutBackend` over a vLLM engine serving one base model: `AsyncEngine` (vLLM's `AsyncLLM` in
    this process), `ServerLLM` (a server over HTTP) or vLLM's batch `LLM`.

    `adapters`: the model's adapter names in route order (route r = `adapters[r]`, -1 = the base model).
    `logprobs`: `processed` (the rollout's log-probs are the trainer's, top-p/top-k refused) or `recompute`
    (the trainer recomputes them; any sampling). `api`: vLLM's request types (`vllm_api()`; tests pass a
    fake's). `temperature`: the rollout's, at which each sync's probe checks that the served log-probs are
    processed ones. `tag`: part of every LoRA name and directory, so that a backend started again on a
    running server (a resumed run) never meets its predecessor's names or prefix-cache entries (default:
    random; "" = none). `source`: the trainer's model whose adapters this serves (the key of an
    `AdapterVersion`'s tensors); `replica`: a copy of it (`rollout_copy`) that `sync(version)` loads each
    version into (asynchronous training; None: `sync(version)` is refused). Call `sync(policy)` once before
    the first rollout and after every optimizer step, or `sync(version)` with each version to sample."""

    def __init__(
        self,
        llm: Any,
        tokenizer,
        *,
        adapters: Sequence[str],
        work_dir: str | Path,
        tools: Mapping[str, Tool] | None = None,
        max_len: int = 4096,
        logprobs: str = "processed",
        vocab_size: int | None = None,
        eos_ids: Sequence[int] = (),
        model_name: str = "main",
        api: SimpleNamespace | None = None,
        tool_workers: int = 8,
        temperature: float = 1.0,
        tag: str | None = None,
        source: Any = None,
        replica: Any = None,
    ) -> None:
        if logprobs not in ("processed", "recompute"):
            raise ValueError(f"logprobs={logprobs!r}; allowed: 'processed', 'recompute'")
        limit = engine_max_len(llm)
        if limit is not None and max_len > limit:
            from rolerl.errors import ConfigError

            raise ConfigError(
                f"rollout.max_len={max_len} but the vLLM engine accepts at most {limit} positions (model "
                f"{model_name!r}, its max_model_len): set rollout.max_len <= {limit}, or start vLLM (a server: "
                "`--max-model-len`) with a larger one"
            )
        self.llm, self.tokenizer, self.api = llm, tokenizer, api or vllm_api()
        self.adapters = list(adapters)
        # absolute: a server resolves a relative adapter path against its own working directory
        self.work_dir = Path(work_dir).resolve()
        self.temperature = temperature
        self.tag = secrets.token_hex(3) if tag is None else tag
        self.tools = dict(tools or {})
        self.max_len, self.logprobs, self.model_name = max_len, logprobs, model_name
        self.table = token_bytes(tokenizer, vocab_size)
        eos = [*eos_ids, *([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])]
        self.eos_ids = frozenset(eos)
        self.source, self.replica = source, replica
        self.current: dict[str, ServedAdapter] = {}
        self.loaded: list[ServedAdapter] = []
        # after any id the engine already holds (another backend's): vLLM skips loading an id it has
        self._next_lora_id = max(self.llm.llm_engine.list_loras(), default=0) + 1
        self._synced: dict[str, dict[str, torch.Tensor]] = {}  # adapter -> the weights last synced
        self._probe_served: dict[str, list[float]] = {}
        self._probe_trainer: dict[str, torch.Tensor] = {}
        self._queue: list[tuple[Any, Any, Any, asyncio.Future]] = []
        self._pump: asyncio.Task | None = None
        self._generate_thread = ThreadPoolExecutor(1, thread_name_prefix="rolerl-vllm")
        self._tool_pool = (
            ThreadPoolExecutor(tool_workers, thread_name_prefix="rolerl-tool") if self.tools else None
        )
        self.stats = {"segments": 0, "tool_calls": 0, "discarded_tokens": 0}

    # ---- RolloutBackend -------------------------------------------------------------------------------

    async def generate(self, request: GenerationRequest) -> Turn:
        """One model call, segment by segment (tool calls, adapter switches), through the recorder."""
        self._check(request)
        rec = Recorder(request, self.table, self.eos_ids, self.max_len)
        while not rec.finish:
            route = rec.next_route()
            out, step = await self._segment(rec, route)
            versions = [step] * len(self.adapters)  # a segment's tokens all come from its one adapter
            body, used = None, 0
            for token, logp in out:
                used += 1
                body = rec.accept(token, logp, versions)
                if rec.finish or body is not None or rec.next_route() != route:
                    break  # the call ended, a tool runs, or the next token belongs to another adapter
            self.stats["discarded_tokens"] += len(out) - used
            if used == 0:
                raise RuntimeError(f"vLLM returned no token for a segment of a {request.role!r} call")
            if body is not None:
                t0 = time.perf_counter()
                loop = asyncio.get_running_loop()
                result, failed = await loop.run_in_executor(
                    self._tool_pool, run_tool, self.tools[request.tool], body
                )
                self.stats["tool_calls"] += 1
                rec.splice(result, failed, self.tokenizer, time.perf_counter() - t0)
        return rec.turn()

    async def episode(self, coro):
        """Episode scoping (the RL loop runs every episode through its backend's `episode`): nothing to do."""
        return await coro

    def sleep(self) -> None:
        """Nothing: vLLM manages its own memory (its sleep mode, for a GPU shared with the trainer, is not
        wired in)."""

    def sync(self, policy) -> dict[str, float]:
        """Serve new adapters: the policy's current ones (a `Policy`, or the model that holds them), or an
        `AdapterVersion`'s (asynchronous training). Each changed adapter is saved and loaded as a new
        version, old versions no segment uses are unloaded, and the served log-probs on a probe prompt must
        have changed wherever the trainer's did."""
        if isinstance(policy, AdapterVersion):
            return self._sync_version(policy)
        model = policy.members[self.model_name].model if hasattr(policy, "members") else policy
        _check_lora_only(model)
        return self._serve(model, self._changed(model, self.adapters))

    def stamp(self, steps: Sequence[int]) -> None:
        """The synchronous loop: the adapters served now are the trainer's as they are (synced after each
        update), so the tokens they sample record the trainer's step counts `steps` (in route order)."""
        for name, step in zip(self.adapters, steps, strict=False):
            if name in self.current:
                self.current[name].step = int(step)

    def close(self) -> None:
        self._generate_thread.shutdown(wait=False, cancel_futures=True)
        if self._tool_pool is not None:
            self._tool_pool.shutdown(wait=False, cancel_futures=True)

    # ---- requests -------------------------------------------------------------------------------------

    def _check(self, request: GenerationRequest) -> None:
        sp = request.sampling
        if self.logprobs == "processed" and (sp.top_p < 1.0 or sp.top_k > 0):
            raise ValueError(
                f"top_p={sp.top_p}, top_k={sp.top_k} with vLLM's processed log-probs: vLLM renormalises them "
                "over the kept tokens and the trainer does not. Use top_p 1 and top_k 0, or "
                "rollout.vllm.logprobs=recompute with algorithm.old_logp=recompute"
            )
        greedy = sp.greedy or sp.temperature == 0
        if not greedy and not MIN_TEMPERATURE <= sp.temperature <= MAX_TEMPERATURE:
            raise ValueError(
                f"temperature={sp.temperature} for a {request.role!r} call: vLLM samples at T in "
                f"[{MIN_TEMPERATURE}, {MAX_TEMPERATURE}] only (it raises smaller ones, refuses larger)"
            )
        if request.tool is not None and request.tool not in self.tools:
            raise ValueError(f"request calls tool {request.tool!r}; backend tools: {sorted(self.tools)}")
        if request.route_of and max(request.route_of.values()) >= len(self.adapters):
            raise ValueError(
                f"route {max(request.route_of.values())} but the model has adapters {self.adapters}"
            )

    def sampling_params(self, rec: Recorder) -> Any:
        """The vLLM `SamplingParams` of the next segment of `rec`'s call."""
        req, sp = rec.req, rec.req.sampling
        # Stop strings only save tokens: the recorder ends the call at the request's own stops, opens tool
        # calls and cuts a segment where the route changes whatever vLLM does. So, first what ends the call
        # or runs a tool, then only the tags where this request's adapter changes (vLLM's server takes 4).
        stops = list(sp.stop)
        if req.tool is not None:
            stops.append(req.tags.tool_close)
        stops += _switch_tags(req)
        remaining = min(sp.max_new_tokens - rec.sampled, rec.max_length - len(rec.ids))
        greedy = sp.greedy or sp.temperature == 0
        return self.api.SamplingParams(
            n=1, temperature=0.0 if greedy else sp.temperature, top_p=sp.top_p, top_k=sp.top_k if sp.top_k > 0 else -1,
            max_tokens=max(remaining, 1), seed=_segment_seed(sp.seed, len(rec.ids)), stop=list(dict.fromkeys(stops)),
            include_stop_str_in_output=True, stop_token_ids=list(sp.stop_token_ids), ignore_eos=sp.ignore_eos,
            logprobs=0, skip_special_tokens=False, spaces_between_special_tokens=False, **NEUTRAL,
        )  # fmt: skip

    def _lora_request(self, version: ServedAdapter) -> Any:
        return self.api.LoRARequest(version.lora_name, version.lora_id, str(version.path))

    async def _segment(self, rec: Recorder, route: int) -> tuple[list[tuple[int, float]], int]:
        """Generate one segment with the adapter of `route`: `(token, log-prob)` pairs as vLLM returned, and
        the step count of the adapter version the request was sent with (-1: the base model)."""
        version, step = None, -1
        if route >= 0:
            name = self.adapters[route]
            version = self.current.get(name)
            if version is None:
                raise RuntimeError(f"adapter {name!r} was never synced: call backend.sync(policy) first")
            version.in_flight += 1  # a sync from now on keeps it loaded until the segment is done
            step = version.step
        try:
            prompt = self.api.TokensPrompt(prompt_token_ids=list(rec.ids))
            lora = self._lora_request(version) if version is not None else None
            submit = getattr(self.llm, "submit", None)
            if submit is not None:  # per request (AsyncLLM, a server): this episode advances on its own
                output = await asyncio.wrap_future(submit(prompt, self.sampling_params(rec), lora))
            else:  # `LLM.generate`: batches, each done when its slowest segment is
                future = asyncio.get_running_loop().create_future()
                self._queue.append((prompt, self.sampling_params(rec), lora, future))
                if self._pump is None or self._pump.done():
                    self._pump = asyncio.create_task(self._drain())
                output = await future
        finally:
            if version is not None:
                version.in_flight -= 1
        self.stats["segments"] += 1
        completion = output.outputs[0]
        ids = list(completion.token_ids)
        return [(t, float(completion.logprobs[i][t].logprob)) for i, t in enumerate(ids)], step

    async def _drain(self) -> None:
        """Send the queued segments to vLLM as one batch, again until none is queued."""
        loop = asyncio.get_running_loop()
        while self._queue:
            await asyncio.sleep(0)  # every coroutine that is ready submits first: one larger batch
            batch, self._queue = self._queue, []
            prompts, params, loras = [b[0] for b in batch], [b[1] for b in batch], [b[2] for b in batch]
            try:
                outputs = await loop.run_in_executor(
                    self._generate_thread,
                    lambda p=prompts, s=params, r=loras: self.llm.generate(
                        p, s, lora_request=r, use_tqdm=False
                    ),
                )
            except Exception as e:  # noqa: BLE001 - a failed batch fails each of its callers
                for *_, future in batch:
                    future.set_exception(e)
                continue
            for (*_, future), output in zip(batch, outputs, strict=True):
                future.set_result(output)

    # ---- adapter versions -----------------------------------------------------------------------------

    def _sync_version(self, version: AdapterVersion) -> dict[str, float]:
        """Serve `version`'s adapters: its changed ones are copied into `replica` (cast to its dtype), saved
        from it and probed on it; every served adapter records the version's step counts."""
        if self.replica is None or self.source is None:
            raise RuntimeError(
                "VLLMBackend.sync(AdapterVersion) needs the trainer's model (`source`) and a copy of it "
                "(`replica`, rolerl.rollout.engine.rollout_copy) to load each version into: the trainer's own "
                "adapters have moved on (build_vllm_backend passes them under train.max_staleness)"
            )
        tensors = version.tensors.get(self.source, {})
        mine = dict(self.replica.named_parameters())
        with torch.no_grad():
            for key, t in tensors.items():
                mine[key].copy_(t)
        touched = {key.rsplit(".", 1)[-1] for key in tensors}  # `<layer>.lora_A.<adapter>`
        changed = self._changed(self.replica, [n for n in self.adapters if n in touched])
        return self._serve(self.replica, changed, version.versions.get(self.source, []))

    def _changed(self, model, names: Sequence[str]) -> dict[str, dict[str, torch.Tensor]]:
        """The weights of the adapters among `names` that differ in `model` from those last synced. The
        others keep being served: a frozen adapter, one no token reached, one a version holds unchanged."""
        out = {}
        for name in names:
            weights, old = _cpu_weights(model, name), self._synced.get(name)
            if old is None or not all(torch.equal(weights[k], old[k]) for k in weights):
                out[name] = weights
        return out

    def _serve(
        self, model, changed: Mapping[str, dict[str, torch.Tensor]], steps: Sequence[int] | None = None
    ) -> dict[str, float]:
        """Load the `changed` adapters of `model` (their weights as saved) as new versions, unload the idle
        old ones, check that vLLM lists the new ones and probe them on `model`. `steps`: every adapter's
        step count (route order), recorded on the versions served from now on (None: `stamp` does)."""
        from rolerl.models.adapters_io import save_adapter

        metrics: dict[str, float] = {}
        fresh: list[ServedAdapter] = []
        for name, weights in changed.items():
            previous = self.current.get(name)
            number = previous.version + 1 if previous else 1
            suffix = f"-{self.tag}" if self.tag else ""
            version = ServedAdapter(name, number, self._next_lora_id, self.work_dir / f"{name}-v{number}{suffix}",
                                    tag=self.tag)  # fmt: skip
            self._next_lora_id += 1
            save_adapter(model, name, version.path)
            self.llm.llm_engine.add_lora(self._lora_request(version))
            self.current[name], self._synced[name] = version, weights
            self.loaded.append(version)
            fresh.append(version)
            metrics[f"rollout/adapter_version/{name}"] = float(version.version)
        if steps is not None:
            self.stamp(steps)
        self._unload_idle()
        listed = set(self.llm.llm_engine.list_loras())
        missing = [v.lora_name for v in fresh if v.lora_id not in listed]
        if missing:
            raise RuntimeError(
                f"vLLM does not list the adapters just loaded: {missing} (listed ids {sorted(listed)})"
            )
        for version in fresh:
            metrics |= self._probe(model, version)
        metrics["rollout/sync_check"] = 1.0
        metrics["rollout/loras_loaded"] = float(len(self.loaded))
        return metrics

    def _check_processed(self, version: ServedAdapter, logits: torch.Tensor, sampled: list[int],
                         completion: Any) -> dict[str, float]:  # fmt: skip
        """The probe's sampled tokens: their served log-probs must be nearer the trainer's processed ones
        (`logits / T`) than its raw ones, else the engine serves raw log-probs."""
        served = torch.tensor([float(completion.logprobs[i][t].logprob) for i, t in enumerate(sampled)])
        target = torch.tensor(sampled)[:, None]
        processed = torch.log_softmax(logits / self.temperature, -1).gather(-1, target)[:, 0]
        raw = torch.log_softmax(logits, -1).gather(-1, target)[:, 0]
        to_processed, to_raw = (served - processed).abs(), (served - raw).abs()
        metrics = {f"rollout/probe_sampled_vs_trainer/{version.adapter}": float(to_processed.max())}
        if self.temperature != 1.0 and float(to_raw.mean()) < float(to_processed.mean()):
            raise RuntimeError(
                f"vLLM's log-probs for adapter {version.lora_name!r} at T={self.temperature} are raw ones "
                f"(mean |served - raw| {float(to_raw.mean()):.3g} < |served - processed| "
                f"{float(to_processed.mean()):.3g}), not log_softmax(logits / T) as the trainer computes: start "
                "the server with --logprobs-mode processed_logprobs"
            )
        return metrics

    def _unload_idle(self) -> None:
        keep = []
        for version in self.loaded:
            if self.current.get(version.adapter) is version or version.in_flight > 0:
                keep.append(version)
                continue
            self.llm.llm_engine.remove_lora(version.lora_id)
            shutil.rmtree(version.path, ignore_errors=True)
        self.loaded = keep

    def _probe(self, model, version: ServedAdapter) -> dict[str, float]:
        """Served vs trainer log-probs on the probe prompt under `version`'s adapter: when the trainer's
        changed since the last sync (by more than bf16 rounding), the served ones must have changed too.
        And the tokens the probe samples at the rollout temperature must carry processed log-probs
        (`log_softmax(logits / T)`), not raw ones: vLLM computes prompt log-probs before any sampling
        processor, so only sampled tokens tell a server started without `--logprobs-mode
        processed_logprobs` apart (at T = 1 the two are equal and nothing is wrong)."""
        ids = [int(i) for i in self.tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"]]
        route = self.adapters.index(version.adapter)
        params = self.api.SamplingParams(
            max_tokens=PROBE_TOKENS, temperature=self.temperature, prompt_logprobs=0, logprobs=0, seed=0,
            ignore_eos=True, **NEUTRAL,
        )  # fmt: skip
        (out,) = self.llm.generate([self.api.TokensPrompt(prompt_token_ids=ids)], [params],
                                   lora_request=[self._lora_request(version)], use_tqdm=False)  # fmt: skip
        completion = out.outputs[0]
        sampled = [int(t) for t in completion.token_ids]
        logits = _trainer_logits(model, ids + sampled, route)  # (len, V)
        targets = torch.tensor(ids[1:] + sampled)
        trainer = torch.log_softmax(logits[:-1], -1).gather(-1, targets[:, None])[:, 0]
        served = [float(step[t].logprob) for step, t in zip(out.prompt_logprobs[1:], ids[1:], strict=True)]
        name = version.adapter
        out_metrics = {
            f"rollout/probe_vs_trainer/{name}": max(
                abs(a - b) for a, b in zip(served, trainer[: len(ids) - 1].tolist(), strict=True)
            )
        }
        out_metrics |= self._check_processed(version, logits[len(ids) - 1 : -1], sampled, completion)
        trainer = trainer[: len(ids) - 1]
        before_t, before_s = self._probe_trainer.get(name), self._probe_served.get(name)
        self._probe_trainer[name], self._probe_served[name] = trainer, served
        if before_t is None:
            return out_metrics
        moved_trainer = float((trainer - before_t).abs().max())
        moved_served = max(abs(a - b) for a, b in zip(served, before_s, strict=True))
        out_metrics[f"rollout/probe_delta/{name}"] = moved_served
        if moved_trainer > 1e-2 and moved_served == 0.0:
            raise RuntimeError(
                f"vLLM serves adapter {version.lora_name!r} (LoRA id {version.lora_id}) but its log-probs on "
                f"the probe prompt did not change, while the trainer's moved by up to {moved_trainer:.3g}: it "
                "is serving a stale adapter or the base model"
            )
        return out_metrics


def _cpu_weights(model, name: str) -> dict[str, torch.Tensor]:
    """Adapter `name` of `model` under PEFT's keys, copied to the CPU (what a sync compares the next with)."""
    from rolerl.models.adapters_io import adapter_state_dict

    return {k: v.detach().to("cpu", copy=True) for k, v in adapter_state_dict(model, name).items()}


def _trainer_logits(model, ids: list[int], route: int) -> torch.Tensor:
    """The trainer's fp32 logits at every position of `ids`, all on adapter `route`, `(len(ids), V)`."""
    from rolerl.models.lora import routes as routes_ctx

    device = next(model.parameters()).device
    with torch.no_grad(), routes_ctx(model, route):
        return model(input_ids=torch.tensor([ids], device=device)).logits[0].float().cpu()


def _versions_in_flight(model) -> int:
    """vLLM's `max_loras` default: every adapter of the model twice (its current version, and the one
    segments that started before a sync still use)."""
    from rolerl.models.lora import adapter_specs

    return max(2, 2 * len(adapter_specs(model))) if model is not None else 4


def _check_lora_only(model) -> None:
    bad = [n for n, p in model.named_parameters() if p.requires_grad and "lora_" not in n]
    if bad:
        raise ValueError(
            f"the vLLM backend syncs LoRA adapters only, but {len(bad)} other parameters train "
            f"(e.g. {bad[:3]}): use the built-in engine (rollout.backend=lockstep) for full fine-tuning"
        )


def _switch_tags(req: GenerationRequest) -> list[str]:
    """The tags at which the request's route changes (the kinds on either side go to different adapters):
    under `dart` only the tool-call tags; none under `shared`."""
    if req.route_of is None:
        return []
    t, route = req.tags, lambda kind: req.route_of.get(kind, -1)
    sides = [(t.tool_open, "reasoning", "tool_call"), (t.tool_close, "tool_call", "tool_output"),
             (t.output_close, "tool_output", "reasoning"), (t.answer_open, "reasoning", "answer"),
             (t.answer_close, "answer", "reasoning")]  # fmt: skip
    return [tag for tag, before, after in sides if tag is not None and route(before) != route(after)]


def _segment_seed(seed: int, position: int) -> int:
    """A 63-bit seed per (request seed, segment start): segments never replay each other's random draws."""
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def build_vllm_backend(
    cfg, policy, tools: Mapping[str, Mapping[str, Tool]], llm_factory=None, replicas: Mapping | None = None
):
    """One `VLLMBackend` per model of `policy` (a `ModelRouter` over them when there are several), each
    with its engine's tools. `llm_factory(spec, cfg, max_rank, model) -> LLM` (default: vLLM's offline
    `LLM` for the model `spec` names, colocated with the trainer on this process's GPU; `model` is the
    trainer's, for tests' fakes). `replicas`: per model, a copy of the trainer's model for `sync(version)`
    (asynchronous training: the run's engines hold one)."""
    from rolerl.models.lora import adapter_specs
    from rolerl.rollout.scheduler import ModelRouter

    check_vllm_config(cfg, policy)
    url = cfg.rollout.vllm.get("url")
    if url and len(policy.members) > 1:
        from rolerl.errors import ConfigError

        raise ConfigError(f"rollout.vllm.url={url!r} serves one model; models {list(policy.members)} need one "
                          "server each, which is not supported yet: use the offline engine (no url)")  # fmt: skip
    factory = llm_factory or (_server_llm if url else _offline_llm)
    api = None
    if url:
        from rolerl.rollout.vllm_http import API as api
    backends = {}
    for name, member in policy.members.items():
        specs = adapter_specs(member.model)
        spec = cfg.model.spec if name == "main" else cfg.models[name]
        llm = factory(spec, cfg, max((s.rank for s in specs.values()), default=8), member.model)
        generation = getattr(member.model, "generation_config", None)
        eos = getattr(generation, "eos_token_id", None)
        limit = engine_max_len(llm)  # a larger rollout.max_len is refused by VLLMBackend
        backends[name] = VLLMBackend(
            llm, member.tokenizer, adapters=list(specs), work_dir=Path(cfg.run.dir) / ".vllm_adapters" / name,
            tools=tools.get(name, {}), max_len=cfg.rollout.max_len or min(limit or 4096, 4096),
            logprobs=str(cfg.rollout.vllm.get("logprobs", "processed")),
            vocab_size=getattr(member.model.config, "vocab_size", None),
            eos_ids=[eos] if isinstance(eos, int) else list(eos or []), model_name=name, api=api,
            temperature=cfg.rollout.temperature, source=member.model, replica=(replicas or {}).get(name),
        )  # fmt: skip
    return next(iter(backends.values())) if len(backends) == 1 else ModelRouter(backends)


def _server_llm(spec: str, cfg, max_rank: int, model=None):
    """A vLLM server over HTTP (`rollout.vllm.url`) serving the model `spec` names."""
    from rolerl.rollout.vllm_http import ServerLLM

    return ServerLLM(str(cfg.rollout.vllm["url"]), cfg.rollout.vllm.get("served_model"))


def _offline_llm(spec: str, cfg, max_rank: int, model=None):
    """vLLM's offline engine for the model `spec` names, sharing the GPU with the trainer: its `AsyncLLM`
    in this process (segments finish one by one, rolerl.rollout.vllm_async), its core in a process of its
    own."""
    from rolerl.models.load import _resolve_to_directory

    if spec.startswith("tiny:"):
        raise ValueError(
            f"model.spec={spec!r} is built in memory; vLLM serves saved models (a directory or hub id)"
        )
    directory = _resolve_to_directory(spec)  # the default GGUF model: its converted safetensors directory
    try:
        import vllm
    except ImportError as e:
        raise ImportError(
            "rollout.backend=vllm needs vLLM: pip install 'rolerl[vllm]' (docs/ROLLOUT.md)"
        ) from e
    check_vllm_version(vllm.__version__, "this process")
    from rolerl.rollout.vllm_async import AsyncEngine

    options = {k: v for k, v in cfg.rollout.vllm.items() if k not in ("logprobs", "url", "served_model")}
    device = next(model.parameters()).device.type if model is not None else "cuda"
    dtype = vllm_dtype(str(options.pop("dtype", "auto")), next(model.parameters()).dtype if model is not None
                       else getattr(torch, cfg.model.dtype, torch.float32), device)  # fmt: skip
    if device == "cpu":  # vLLM's CPU build: every prompt prefilled whole (vllm_checks.cpu_scheduling)
        max_len = cfg.rollout.max_len or getattr(model.config, "max_position_embeddings", 8192)
        options = cpu_scheduling(options, max_len)
    # vLLM's async engine, not `LLM`: each segment finishes on its own (vllm_async.py says why)
    return AsyncEngine(
        model=str(directory), dtype=dtype, seed=cfg.run.seed, enable_lora=True, disable_log_stats=True,
        max_lora_rank=int(options.pop("max_lora_rank", max(8, 2 ** math.ceil(math.log2(max_rank))))),
        max_loras=int(options.pop("max_loras", _versions_in_flight(model))), gpu_memory_utilization=float(options.pop("gpu_memory_utilization", 0.5)),
        max_model_len=cfg.rollout.max_len, logprobs_mode="processed_logprobs", **options,
    )  # fmt: skip
