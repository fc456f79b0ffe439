"""A stand-in for vLLM's offline `LLM`, for testing `rolerl.rollout.vllm_backend` on a CPU (vLLM itself
cannot be installed on our machines). It behaves like vLLM where the backend depends on it:

- requests are `TokensPrompt`s with per-request `SamplingParams` and `LoRARequest`s; outputs carry
  `token_ids`, the sampled token's `Logprob` per position (`logprobs=0`), `finish_reason` and
  `stop_reason`, and `prompt_logprobs` when asked;
- a stop string ends the segment at the token whose text completes it (kept in the output, as with
  `include_stop_str_in_output`), matched on the text decoded so far (so a tag split across tokens stops
  where its last piece arrives); an EOS id ends it (included) unless `ignore_eos`; `max_tokens` caps it;
- `llm_engine.add_lora/remove_lora/list_loras` keep the loaded adapters; each load reads the PEFT
  directory's weights. `stale=True` models the silent failure: after the first load of an adapter the
  engine keeps serving those first weights whatever is loaded later.

Generation is a replay: `streams` are full id sequences (prompt + completion) a reference run produced
(the built-in engine with a scripted sampler); the next token of a context is the next id of the stream
it is a prefix of, with that stream's log-prob. The probe's prompt log-probs are a function of the served
adapter's weights, so a new adapter version changes them and a stale one does not."""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from rolerl.rollout.vllm_http import LoRARequest, SamplingParams, TokensPrompt


@dataclass
class Logprob:
    logprob: float


@dataclass
class CompletionOutput:
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]]
    finish_reason: str
    stop_reason: str | int | None


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


# the request types: the plain ones the HTTP client sends (the same fields as vLLM's)
API = SimpleNamespace(SamplingParams=SamplingParams, TokensPrompt=TokensPrompt, LoRARequest=LoRARequest)


class FakeEngine:
    """`llm.llm_engine`: LoRA management, with a log of every load and unload."""

    def __init__(self, stale: bool) -> None:
        self.stale = stale
        self.loras: dict[int, tuple[str, float]] = {}  # id -> (name, weight signature)
        self.first: dict[
            str, float
        ] = {}  # adapter -> signature of its first load (what a stale engine serves)
        self.log: list[tuple[str, int, str]] = []

    def add_lora(self, req: LoRARequest) -> bool:
        from safetensors.torch import load_file

        weights = load_file(str(Path(req.lora_path) / "adapter_model.safetensors"))
        signature = float(sum(float(w.double().abs().sum()) for w in weights.values()))
        adapter = req.lora_name.split("@")[0]
        self.first.setdefault(adapter, signature)
        self.loras[req.lora_int_id] = (req.lora_name, self.first[adapter] if self.stale else signature)
        self.log.append(("load", req.lora_int_id, req.lora_name))
        return True

    def remove_lora(self, lora_id: int) -> bool:
        self.log.append(("unload", lora_id, self.loras.pop(lora_id)[0]))
        return True

    def list_loras(self) -> set[int]:
        return set(self.loras)


class FakeLLM:
    def __init__(self, tokenizer, streams, *, eos_ids=(), stale=False, ignore_stop=False) -> None:
        """`streams`: `(ids, logprobs)` with one log-prob per id (NaN or anything at prompt positions).
        `ignore_stop`: an engine that never stops at stop strings (the backend must cut segments itself)."""
        self.tokenizer = tokenizer
        self.ignore_stop = ignore_stop
        self.streams = streams
        self.eos_ids = set(eos_ids)
        self.llm_engine = FakeEngine(stale)
        self.requests: list[tuple[list[int], SamplingParams, LoRARequest | None]] = []

    def generate(self, prompts, sampling_params, lora_request=None, use_tqdm=True) -> list[RequestOutput]:
        loras = lora_request if isinstance(lora_request, list) else [lora_request] * len(prompts)
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        return [self._one(p.prompt_token_ids, s, r) for p, s, r in zip(prompts, params, loras, strict=True)]

    def _one(self, prompt: list[int], sp: SamplingParams, lora: LoRARequest | None) -> RequestOutput:
        if lora is not None and lora.lora_int_id not in self.llm_engine.loras:
            self.llm_engine.add_lora(lora)  # vLLM loads an unknown adapter on first use
        self.requests.append((list(prompt), sp, lora))
        if sp.prompt_logprobs is not None:  # the probe: a function of the served adapter's weights
            shift = self.llm_engine.loras[lora.lora_int_id][1] if lora is not None else 0.0
            plp = [None] + [{t: Logprob(-1.0 - 1e-3 * shift - 1e-4 * i)} for i, t in enumerate(prompt[1:])]
            try:  # the probe's sampled tokens: a model that generates (ModelLLM) samples them
                pairs = list(itertools.islice(self._continue(prompt, sp, lora), sp.max_tokens))
            except AssertionError:  # a replay has no stream for the probe prompt
                pairs = [(0, -1.0)]
            completion = CompletionOutput(
                [t for t, _ in pairs], [{t: Logprob(lp)} for t, lp in pairs], "length", None
            )
            return RequestOutput(prompt, [completion], plp)
        out, lps, finish, reason = [], [], "length", None
        for token, logp in self._continue(prompt, sp, lora):
            out.append(token)
            lps.append({token: Logprob(logp)})
            text = self.tokenizer.decode(out, skip_special_tokens=False)
            hit = None if self.ignore_stop else next((s for s in sp.stop if s in text), None)
            if hit is not None:
                finish, reason = "stop", hit
                break
            if (token in self.eos_ids and not sp.ignore_eos) or token in sp.stop_token_ids:
                finish, reason = "stop", None if token in self.eos_ids else token
                break
            if len(out) >= sp.max_tokens:
                break
        return RequestOutput(prompt, [CompletionOutput(out, lps, finish, reason)])

    def _continue(self, prompt: list[int], sp: SamplingParams, lora: LoRARequest | None):
        """`(token, log-prob)` pairs continuing `prompt`: the replayed stream it is a prefix of."""
        for ids, logprobs in self.streams:
            if len(ids) > len(prompt) and ids[: len(prompt)] == prompt:
                yield from zip(ids[len(prompt) :], logprobs[len(prompt) :], strict=True)
                return
        raise AssertionError(f"the fake has no stream continuing this context of {len(prompt)} ids")


class ModelLLM(FakeLLM):
    """A fake that generates: its own copy of the model, each request's adapter weights read from the
    PEFT directory it was loaded from (never the trainer's tensors), every position on that adapter,
    sampling at the request's temperature from a generator seeded by its seed, processed log-probs."""

    def __init__(self, model, tokenizer, **kw) -> None:
        super().__init__(tokenizer, [], **kw)
        self.model = copy.deepcopy(model)
        self.serving: int | None = None  # the LoRA id whose weights the copy holds

    def _continue(self, prompt: list[int], sp: SamplingParams, lora: LoRARequest | None):
        from rolerl.models.adapters_io import load_adapter
        from rolerl.models.lora import routes

        adapter = None
        if lora is not None:
            adapter = lora.lora_name.split("@")[0]
            if self.serving != lora.lora_int_id:
                load_adapter(self.model, adapter, lora.lora_path)
                self.serving = lora.lora_int_id
        generator = torch.Generator().manual_seed(int(sp.seed or 0))
        ids = list(prompt)
        while True:
            with torch.no_grad(), routes(self.model, adapter if adapter is not None else -1):
                logits = self.model(input_ids=torch.tensor([ids])).logits[0, -1].float()
            logp = torch.log_softmax(logits / max(sp.temperature, 1e-6), -1)
            token = int(torch.multinomial(logp.exp(), 1, generator=generator))
            ids.append(token)
            yield token, float(logp[token])


def patch_offline_vllm(monkeypatch, tokenizer) -> list[ModelLLM]:
    """Make `rollout.backend: vllm` build a `ModelLLM` (generating with its own copy of the model and the
    adapter files each sync writes) instead of vLLM's offline engine; returns the list they are put in."""
    import rolerl.rollout.vllm_backend as vb

    monkeypatch.setattr(vb, "vllm_api", lambda: API)
    made: list[ModelLLM] = []

    def offline_llm(spec, cfg, max_rank, model):
        made.append(ModelLLM(model, tokenizer))
        return made[-1]

    monkeypatch.setattr(vb, "_offline_llm", offline_llm)
    return made
