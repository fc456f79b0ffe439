"""Log-prob parity between a vLLM-backed rollout and the trainer, per kind of token (shared by the offline
and the server tests). The rollout's log-probs are vLLM's processed ones (`log_softmax(logits / T)` of the
sampled token); the references are the trainer's own forward (`rolerl.train.policy.token_logprobs`):

- `segment`: every position of a vLLM segment on that segment's one adapter, which is what vLLM computes
  (one LoRA per request, the re-read prefix included). The same arithmetic up to kernel rounding: the
  difference must stay within `FP32_BOUND`;
- `routed`: the true routing (each position on the adapter of the token it predicts), what the trainer's
  recompute uses. Equal to `segment` under `shared`; under `dart` it differs by design wherever a segment
  re-read a prefix computed by the other adapter (measured, and corrected in training by TIS).

FP32_BOUND, derived: a processed log-prob is z_t - logsumexp(z) with z = logits / T, so a perturbation d
of the logits moves it by at most 2 max|d| / T. vLLM's CPU kernels (its GEMMs, its paged attention) sum in
another order than torch's; an fp32 sum of k terms carries a relative error of at most about k u, and
typically sqrt(k) u (u = 2^-24 = 6.0e-8). With k <= 1536 (the MLP's inner width) per layer, 30 layers
whose errors add (~30 sqrt(k) u = 7.0e-5 relative on the residual stream) and logits of magnitude <= 25
here, max|d| ~ 25 x 7.0e-5 = 1.8e-3, and at T = 0.7 the bound is 2 x 1.8e-3 / 0.7 = 5e-3. The measured
differences are ~100x below it; the bound still catches every error the tests are about: a temperature
not applied (~0.1-1 per token), a repetition penalty applied (ln 1.3 = 0.26 on repeated tokens), a wrong or
stale adapter (the adapters move these log-probs by far more, checked)."""

from __future__ import annotations

import asyncio
import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

import rolerl
from rolerl.models.topology import Topology
from rolerl.rollout.engine import GenerationRequest
from rolerl.rollout.sampling import SamplingParams
from rolerl.types import Turn, collate

FP32_BOUND = 5e-3
TEMPERATURE = 0.7
# a few-shot prompt the default model continues with a tool call of its own (the tag <code> sampled)
FEW_SHOT = (
    "Q: 2 + 3?\nA: <code>print(2 + 3)</code><output>5\n</output>The answer is 5.\n"
    "Q: 7 * 6?\nA: <code>print(7 * 6)</code><output>42\n</output>The answer is 42.\n"
    "Q: 9 + 1?\nA: <code>print(9 + 1)</code><output>10\n</output>The answer is 10.\n"
    "Q: 12 - 4?\nA:"
)


def dart_table() -> dict[str, int]:
    return dict(Topology.from_preset("dart", ["policy"]).route_of("policy", {"reason": 0, "tool": 1}))


TOPOLOGIES = {
    "shared": (["policy"], lambda: dict.fromkeys(dart_table(), 0)),
    "dart": (["reason", "tool"], dart_table),
}


def adapted_model(base, adapters: Sequence[str], seed: int = 0, std: float = 0.02):
    """A copy of the default model with random LoRA adapters (B != 0, so they change the log-probs)."""
    model = copy.deepcopy(base)
    rolerl.add_adapters(model, list(adapters), rank=8)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return model


class Recording:
    """The engine, with every generate request's prompt length and adapter written down (segments)."""

    def __init__(self, llm) -> None:
        self.llm, self.segments = llm, []

    def __getattr__(self, name):
        return getattr(self.llm, name)

    def generate(self, prompts, sampling_params, lora_request=None, use_tqdm=False):
        loras = lora_request if isinstance(lora_request, list) else [lora_request] * len(prompts)
        for p, s, r in zip(prompts, sampling_params, loras, strict=True):
            self._record(p, s, r)
        return self.llm.generate(prompts, sampling_params, lora_request=lora_request, use_tqdm=use_tqdm)

    def submit(self, prompt, sampling_params, lora_request=None):
        self._record(prompt, sampling_params, lora_request)
        return self.llm.submit(prompt, sampling_params, lora_request)

    def _record(self, prompt, params, lora) -> None:
        if params.prompt_logprobs is None:  # a segment, not a sync's probe
            ids = (
                prompt["prompt_token_ids"] if isinstance(prompt, dict) else prompt.prompt_token_ids
            )  # vLLM's: a dict
            self.segments.append((list(ids), None if lora is None else lora.lora_name))


def requests(tok, route_of, n: int = 8, max_new_tokens: int = 48) -> list[GenerationRequest]:
    ids = tok.encode(FEW_SHOT, add_special_tokens=False)
    sampling = [
        SamplingParams(temperature=TEMPERATURE, seed=s, max_new_tokens=max_new_tokens) for s in range(n)
    ]
    return [GenerationRequest(list(ids), sp, route_of=route_of, tool="echo") for sp in sampling]


def run_all(backend, reqs) -> list[Turn]:
    async def main():
        return await asyncio.gather(*[backend.episode(backend.generate(r)) for r in reqs])

    return asyncio.run(main())


@dataclass
class Parity:
    """|rollout - reference| per kind of sampled token, and the signed `reference - rollout` (the log of
    the importance weight that truncated importance sampling gives the token)."""

    deltas: dict[str, list[float]] = field(default_factory=dict)
    log_ratios: dict[str, list[float]] = field(default_factory=dict)

    def add(self, kind: str, rollout: float, reference: float) -> None:
        self.deltas.setdefault(kind, []).append(abs(rollout - reference))
        self.log_ratios.setdefault(kind, []).append(reference - rollout)

    def tis(self, cap: float) -> dict[str, dict[str, float]]:
        """Per kind, the TIS weights `exp(reference - rollout)` the update would give these tokens: their
        mean, min and max before the cap, and the share the cap `min(w, cap)` cuts."""
        out = {}
        for kind, lr in sorted(self.log_ratios.items()):
            w = [math.exp(x) for x in lr]
            out[kind] = {"n": len(w), "mean": sum(w) / len(w), "min": min(w), "max": max(w),
                         "capped": sum(x > cap for x in w) / len(w)}  # fmt: skip
        return out

    def max(self) -> float:
        return max(max(v) for v in self.deltas.values())

    def summary(self) -> str:
        return ", ".join(f"{k}: n={len(v)} max {max(v):.2e} mean {sum(v) / len(v):.2e}"
                         for k, v in sorted(self.deltas.items()))  # fmt: skip


def _row_logprobs(model, turn: Turn, route_of, routes: int | None = None) -> torch.Tensor:
    """The trainer's log-probs of `turn`'s completion tokens `(n,)` (NaN where it computes none: tool
    output), under the true routing or every position on adapter `routes`."""
    from rolerl.train.policy import token_logprobs

    batch = collate([turn], [0.0], {turn.role: route_of}, pad_id=0)
    with torch.no_grad():
        lp = token_logprobs(model, batch, temperature=TEMPERATURE, routes=routes).logp[0]
    start = len(turn.prompt_ids) - 1  # column p is about token p + 1
    out = lp[start : start + len(turn.completion_ids)].clone()
    out[[k == "tool_output" for k in turn.kinds]] = math.nan
    return out


def parity(
    model, turns: Sequence[Turn], route_of, adapters: Sequence[str], segments
) -> tuple[Parity, Parity]:
    """(segment parity, routed parity) of `turns` generated through a `Recording` engine."""
    seg, routed = Parity(), Parity()
    for turn in turns:
        ids = turn.prompt_ids + turn.completion_ids
        true = _row_logprobs(model, turn, route_of)
        mine = sorted((len(p), lora) for p, lora in segments if ids[: len(p)] == p)
        by_adapter = {}
        for i, (kind, logp) in enumerate(zip(turn.kinds, turn.logprobs, strict=True)):
            if kind == "tool_output":
                continue
            position = len(turn.prompt_ids) + i
            lora = [lora for start, lora in mine if start <= position][-1]  # the segment that sampled it
            route = adapters.index(lora.split("@")[0])
            if route not in by_adapter:
                by_adapter[route] = _row_logprobs(model, turn, route_of, routes=route)
            seg.add(kind, logp, float(by_adapter[route][i]))
            routed.add(kind, logp, float(true[i]))
    return seg, routed


def engine_parity(model, turns: Sequence[Turn], route_of) -> Parity:
    """The built-in engine's `turns` against the trainer's true routing (the engine routes every position
    exactly, so only kernel rounding is left)."""
    out = Parity()
    for turn in turns:
        true = _row_logprobs(model, turn, route_of)
        for i, (kind, logp) in enumerate(zip(turn.kinds, turn.logprobs, strict=True)):
            if kind != "tool_output":
                out.add(kind, logp, float(true[i]))
    return out


def adapter_effect(model, turns: Sequence[Turn], route_of) -> float:
    """max |rollout log-prob - the base model's| (adapters off): how far the adapters move them."""
    gaps = []
    for turn in turns:
        base = _row_logprobs(model, turn, route_of, routes=-1)
        gaps += [abs(lp - float(b)) for lp, b, k in zip(turn.logprobs, base, turn.kinds, strict=True)
                 if k != "tool_output"]  # fmt: skip
    return max(gaps)
