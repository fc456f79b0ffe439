"""The vLLM rollout backend (`rollout.backend: vllm`, extra `rolerl[vllm]`, imported lazily).

vLLM generates; the shared `Recorder` (rolerl.rollout.recorder) decides what each token means, exactly as
in the built-in engine: token ids in, token ids out, never re-tokenised text. One model call is a series of
vLLM *segments*, each a request whose prompt is every id so far:

- a segment stops at the closing tool tag (a stop string, kept in the output); the recorder sees the
  call close, the tool runs, its output is spliced as forced ids, and the next segment continues from them;
- adapters are per request (`LoRARequest`). A token-routed topology (`dart`: reasoning and tool calls on
  different adapters) is generated segment by segment, switching adapter where the recorder's next route
  changes (stop strings at every tag make vLLM stop near there; tokens past the boundary, e.g. when a tag
  is split across tokens or shares a token with text, are discarded). Every position of a segment,
  including the re-read prefix, is computed with that segment's adapter, so the rollout's log-probs are
  not the true routing's: the trainer recomputes them (`algorithm.old_logp: recompute`, required) and
  truncated importance sampling (`algorithm.tis_cap`) corrects the rest;
- log-probs are the sampled token's, looked up by id, in vLLM's processed mode (after temperature), i.e.
  `log_softmax(logits / T)`, what the trainer computes. With top-p/top-k vLLM renormalises over the kept
  set, which the trainer does not: that combination is refused unless the trainer recomputes.

After each optimizer step `sync(policy)` saves every changed adapter as a PEFT directory and loads it
under a **new** LoRA id and name (`<adapter>@v<k>`: reusing a name could serve prefix-cache entries
computed with the old weights), unloads old versions once no segment in flight uses them, checks that vLLM
lists the new version, and that its log-probs on a probe prompt changed when the trainer's own log-probs
on that probe did (`rollout/sync_check`; a served adapter that stayed the same after a real update is an
error, the silent failure several published trainers shipped). Only LoRA adapters can be synced.

The real vLLM path is untested on our machines (no GPU wheel can be installed here): the tests drive
this class with a fake engine object that behaves like vLLM's `LLM` where it matters (tests/rollout/
fake_vllm.py).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
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
from rolerl.rollout.recorder import GenerationRequest, Recorder, run_tool
from rolerl.tools.base import Tool
from rolerl.types import Turn

log = logging.getLogger(__name__)
PROBE_TEXT = "The quick brown fox jumps over the lazy dog. 12 + 30 = 42. def f(x): return x * 2"


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
class AdapterVersion:
    """One adapter's weights as vLLM serves them: a PEFT directory loaded under its own LoRA id."""

    adapter: str
    version: int
    lora_id: int
    path: Path
    in_flight: int = 0  # segments using it now

    @property
    def lora_name(self) -> str:
        return f"{self.adapter}@v{self.version}"


class VLLMBackend:
    """A `RolloutBackend` over a vLLM `LLM` (offline engine in this process) serving one base model.

    `adapters`: the model's adapter names in route order (route r = `adapters[r]`, -1 = the base model).
    `logprobs`: `processed` (the rollout's log-probs are the trainer's, top-p/top-k refused) or `recompute`
    (the trainer recomputes them; any sampling). `api`: vLLM's request types (`vllm_api()`; tests pass a
    fake's). Call `sync(policy)` once before the first rollout and after every optimizer step."""

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
    ) -> None:
        if logprobs not in ("processed", "recompute"):
            raise ValueError(f"logprobs={logprobs!r}; allowed: 'processed', 'recompute'")
        self.llm, self.tokenizer, self.api = llm, tokenizer, api or vllm_api()
        self.adapters = list(adapters)
        self.work_dir = Path(work_dir)
        self.tools = dict(tools or {})
        self.max_len, self.logprobs, self.model_name = max_len, logprobs, model_name
        self.table = token_bytes(tokenizer, vocab_size)
        eos = [*eos_ids, *([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])]
        self.eos_ids = frozenset(eos)
        self.current: dict[str, AdapterVersion] = {}
        self.loaded: list[AdapterVersion] = []
        self._next_lora_id = 1
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
            out = await self._segment(rec, route)
            body, used = None, 0
            for token, logp in out:
                used += 1
                body = rec.accept(token, logp)
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
        """Serve the policy's current adapters (a `Policy`, or the model that holds them): each changed
        adapter is saved and loaded as a new version, old versions no segment uses are unloaded, and the
        served log-probs on a probe prompt must have changed wherever the trainer's did."""
        model = policy.members[self.model_name].model if hasattr(policy, "members") else policy
        _check_lora_only(model)
        from rolerl.models.adapters_io import adapter_state_dict, save_adapter

        metrics: dict[str, float] = {}
        fresh: list[AdapterVersion] = []
        for name in self.adapters:
            weights = {k: v.detach().to("cpu", copy=True) for k, v in adapter_state_dict(model, name).items()}
            old = self._synced.get(name)
            if old is not None and all(torch.equal(weights[k], old[k]) for k in weights):
                continue  # unchanged (a frozen adapter, or one no token reached): keep serving it
            previous = self.current.get(name)
            version = AdapterVersion(name, previous.version + 1 if previous else 1, self._next_lora_id,
                                     self.work_dir / f"{name}-v{(previous.version + 1) if previous else 1}")  # fmt: skip
            self._next_lora_id += 1
            save_adapter(model, name, version.path)
            self.llm.llm_engine.add_lora(self._lora_request(version))
            self.current[name], self._synced[name] = version, weights
            self.loaded.append(version)
            fresh.append(version)
            metrics[f"rollout/adapter_version/{name}"] = float(version.version)
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
        if request.tool is not None and request.tool not in self.tools:
            raise ValueError(f"request calls tool {request.tool!r}; backend tools: {sorted(self.tools)}")
        if request.route_of and max(request.route_of.values()) >= len(self.adapters):
            raise ValueError(
                f"route {max(request.route_of.values())} but the model has adapters {self.adapters}"
            )

    def sampling_params(self, rec: Recorder) -> Any:
        """The vLLM `SamplingParams` of the next segment of `rec`'s call."""
        req, sp = rec.req, rec.req.sampling
        tags = req.tags
        stops = list(sp.stop)
        if req.tool is not None:
            stops.append(tags.tool_close)
        if _routes_per_token(req):  # stop near every place the adapter may change
            stops += [tags.tool_open, tags.tool_close, tags.output_close]
            stops += [t for t in (tags.answer_open, tags.answer_close) if t is not None]
        remaining = min(sp.max_new_tokens - rec.sampled, rec.max_length - len(rec.ids))
        greedy = sp.greedy or sp.temperature == 0
        return self.api.SamplingParams(
            n=1, temperature=0.0 if greedy else sp.temperature, top_p=sp.top_p, top_k=sp.top_k if sp.top_k > 0 else -1,
            max_tokens=max(remaining, 1), seed=_segment_seed(sp.seed, len(rec.ids)), stop=list(dict.fromkeys(stops)),
            include_stop_str_in_output=True, stop_token_ids=list(sp.stop_token_ids), ignore_eos=sp.ignore_eos,
            logprobs=0, skip_special_tokens=False, spaces_between_special_tokens=False,
        )  # fmt: skip

    def _lora_request(self, version: AdapterVersion) -> Any:
        return self.api.LoRARequest(version.lora_name, version.lora_id, str(version.path))

    async def _segment(self, rec: Recorder, route: int) -> list[tuple[int, float]]:
        """Generate one segment with the adapter of `route`; `(token, log-prob)` pairs as vLLM returned."""
        version = None
        if route >= 0:
            name = self.adapters[route]
            version = self.current.get(name)
            if version is None:
                raise RuntimeError(f"adapter {name!r} was never synced: call backend.sync(policy) first")
            version.in_flight += 1
        try:
            prompt = self.api.TokensPrompt(prompt_token_ids=list(rec.ids))
            lora = self._lora_request(version) if version is not None else None
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
        return [(t, float(completion.logprobs[i][t].logprob)) for i, t in enumerate(ids)]

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

    def _unload_idle(self) -> None:
        keep = []
        for version in self.loaded:
            if self.current.get(version.adapter) is version or version.in_flight > 0:
                keep.append(version)
                continue
            self.llm.llm_engine.remove_lora(version.lora_id)
            shutil.rmtree(version.path, ignore_errors=True)
        self.loaded = keep

    def _probe(self, model, version: AdapterVersion) -> dict[str, float]:
        """Served vs trainer log-probs on the probe prompt under `version`'s adapter: when the trainer's
        changed since the last sync (by more than bf16 rounding), the served ones must have changed too."""
        ids = [int(i) for i in self.tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"]]
        route = self.adapters.index(version.adapter)
        trainer = _trainer_logprobs(model, ids, route)
        params = self.api.SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, logprobs=0)
        (out,) = self.llm.generate([self.api.TokensPrompt(prompt_token_ids=ids)], [params],
                                   lora_request=[self._lora_request(version)], use_tqdm=False)  # fmt: skip
        served = [float(step[t].logprob) for step, t in zip(out.prompt_logprobs[1:], ids[1:], strict=True)]
        name = version.adapter
        out_metrics = {
            f"rollout/probe_vs_trainer/{name}": max(
                abs(a - b) for a, b in zip(served, trainer.tolist(), strict=True)
            )
        }
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


def _trainer_logprobs(model, ids: list[int], route: int) -> torch.Tensor:
    """The trainer's log-probs of `ids[1:]` with every position on adapter `route`, `(len(ids)-1,)`."""
    from rolerl.models.lora import routes as routes_ctx

    device = next(model.parameters()).device
    x = torch.tensor([ids], device=device)
    with torch.no_grad(), routes_ctx(model, route):
        logits = model(input_ids=x).logits[0].float()
    return torch.log_softmax(logits[:-1], -1).gather(-1, x[0, 1:, None])[:, 0].cpu()


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


def _routes_per_token(req: GenerationRequest) -> bool:
    """Whether the request's kinds go to more than one adapter (or to an adapter and the base)."""
    return req.route_of is not None and len(set(req.route_of.values())) > 1


def _segment_seed(seed: int, position: int) -> int:
    """A 63-bit seed per (request seed, segment start): segments never replay each other's random draws."""
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def check_vllm_config(cfg, policy) -> None:
    """The settings the vLLM backend cannot honour, as `ConfigError`s naming the fields."""
    from rolerl.config import ConfigError

    mode = cfg.rollout.vllm.get("logprobs", "processed")
    top_ps = [cfg.rollout.top_p, *(c.top_p for c in cfg.roles.values() if c.top_p is not None)]
    if min(top_ps) < 1.0 and not (mode == "recompute" and cfg.algorithm.old_logp == "recompute"):
        raise ConfigError(
            f"rollout.top_p={min(top_ps)} with rollout.backend=vllm: vLLM's log-probs are renormalised over the "
            "kept tokens and the trainer's are not; set rollout.vllm.logprobs=recompute and "
            "algorithm.old_logp=recompute (or top_p 1)"
        )
    routed = [role for role, table in policy.route_of.items() if len(set(table.values())) > 1]
    if routed and cfg.algorithm.old_logp != "recompute":
        raise ConfigError(
            f"roles {routed} route tokens to several adapters (adapters.preset={cfg.adapters.preset!r}): vLLM "
            "applies one adapter per segment, so the rollout's log-probs are not the true routing's; set "
            "algorithm.old_logp=recompute (and algorithm.tis_cap, e.g. 2.0, to correct the mismatch)"
        )


def build_vllm_backend(cfg, policy, tools: Mapping[str, Mapping[str, Tool]], llm_factory=None):
    """One `VLLMBackend` per model of `policy` (a `ModelRouter` over them when there are several), each
    with its engine's tools. `llm_factory(spec, cfg, max_rank, model) -> LLM` (default: vLLM's offline
    `LLM` for the model `spec` names, colocated with the trainer on this process's GPU; `model` is the
    trainer's, for tests' fakes)."""
    from rolerl.models.lora import adapter_specs
    from rolerl.rollout.scheduler import ModelRouter

    check_vllm_config(cfg, policy)
    url = cfg.rollout.vllm.get("url")
    if url and len(policy.members) > 1:
        from rolerl.config import ConfigError

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
        backends[name] = VLLMBackend(
            llm, member.tokenizer, adapters=list(specs), work_dir=Path(cfg.run.dir) / ".vllm_adapters" / name,
            tools=tools.get(name, {}), max_len=cfg.rollout.max_len or 4096,
            logprobs=str(cfg.rollout.vllm.get("logprobs", "processed")),
            vocab_size=getattr(member.model.config, "vocab_size", None),
            eos_ids=[eos] if isinstance(eos, int) else list(eos or []), model_name=name, api=api,
        )  # fmt: skip
    return next(iter(backends.values())) if len(backends) == 1 else ModelRouter(backends)


def _server_llm(spec: str, cfg, max_rank: int, model=None):
    """A vLLM server over HTTP (`rollout.vllm.url`) serving the model `spec` names."""
    from rolerl.rollout.vllm_http import ServerLLM

    return ServerLLM(str(cfg.rollout.vllm["url"]), cfg.rollout.vllm.get("served_model"))


def _offline_llm(spec: str, cfg, max_rank: int, model=None):
    """vLLM's offline engine for the model `spec` names, sharing the GPU with the trainer."""
    from rolerl.models.load import _resolve_to_directory

    if spec.startswith("tiny:"):
        raise ValueError(
            f"model.spec={spec!r} is built in memory; vLLM serves saved models (a directory or hub id)"
        )
    directory = _resolve_to_directory(spec)  # the default GGUF model: its converted safetensors directory
    try:
        from vllm import LLM
    except ImportError as e:
        raise ImportError(
            "rollout.backend=vllm needs vLLM: pip install 'rolerl[vllm]' (docs/ROLLOUT.md)"
        ) from e
    options = {k: v for k, v in cfg.rollout.vllm.items() if k not in ("logprobs", "url", "served_model")}
    return LLM(
        model=str(directory), dtype=cfg.model.dtype, seed=cfg.run.seed, enable_lora=True,
        max_lora_rank=int(options.pop("max_lora_rank", max(8, 2 ** math.ceil(math.log2(max_rank))))),
        max_loras=int(options.pop("max_loras", _versions_in_flight(model))), gpu_memory_utilization=float(options.pop("gpu_memory_utilization", 0.5)),
        max_model_len=cfg.rollout.max_len, logprobs_mode="processed_logprobs", **options,
    )  # fmt: skip
