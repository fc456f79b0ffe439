"""An independent reference for the update's loss terms: log-probs and entropies from a plain Hugging Face
forward of each row alone (no padding, no prefix sharing, no chunked LM head), under the row's routes.

The tests that pin a term of the loss (TIS weights, the entropy bonus, role loss weights, strict isolation)
write the objective by hand from these (policy-gradient form: at PPO ratio 1, the clipped surrogate
`-A·w·r` has the gradient `-A·w·∇log p`) and differentiate it with `torch.autograd.grad`; none of them calls
the loss code they check.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import rolerl
from rolerl.models.lora import adapter_parameters, routes
from rolerl.roles import KINDS, REASONING, TOOL_CALL, shift
from rolerl.types import TrainBatch, Turn, collate
from tests.models.test_lora import randomize_adapters


def reference_terms(model: nn.Module, batch: TrainBatch, temperature: float) -> tuple[Tensor, Tensor]:
    """`(logp, entropy)`, each `(B, T-1)` in TrainBatch alignment (column p is about token p + 1), float64,
    differentiable; every position of each row's real tokens is filled (mask them yourself), pads are 0."""
    width = batch.input_ids.shape[1]
    logps, entropies = [], []
    for i in range(batch.input_ids.shape[0]):
        n = int(batch.attention_mask[i].sum())
        ids = batch.input_ids[i, :n][None]  # (1, n)
        with routes(model, batch.routes[i, :n][None]):
            logits = model(input_ids=ids).logits[0, :-1]  # (n-1, V): position p predicts token p + 1
        z = logits.double() / temperature
        log_p = z - torch.logsumexp(z, dim=-1, keepdim=True)  # (n-1, V)
        logps.append(F.pad(log_p.gather(1, ids[0, 1:, None])[:, 0], (0, width - n)))
        entropies.append(F.pad(-(log_p.exp() * log_p).sum(-1), (0, width - n)))
    return torch.stack(logps), torch.stack(entropies)


def grad_of(objective: Tensor, params: dict[str, nn.Parameter]) -> dict[str, Tensor]:
    """`name -> d objective / d param` (zeros where the objective does not reach); the graph is kept for
    further objectives over the same forward."""
    names = list(params)
    got = torch.autograd.grad(objective, [params[n] for n in names], retain_graph=True, allow_unused=True)
    return {n: torch.zeros_like(params[n]) if g is None else g for n, g in zip(names, got, strict=True)}


def adapter_params(model: nn.Module) -> dict[str, nn.Parameter]:
    """Every trainable LoRA parameter by name (the ones the update trains)."""
    return {n: p for n, p in model.named_parameters() if "lora_" in n and p.requires_grad}


def assert_grads_close(got: dict[str, Tensor], want: dict[str, Tensor], rtol: float = 1e-5) -> None:
    """Per parameter, within `rtol` of the largest |want| of that parameter: the adapters are fp32, so the
    update's gradients carry fp32 rounding (~1e-7 relative) whatever the model's dtype."""
    assert want and set(want) <= set(got) | {n for n, g in want.items() if not g.any()}
    for name, w in want.items():
        g = got.get(name, torch.zeros_like(w))
        atol = rtol * float(w.abs().max()) if w.any() else 0.0
        torch.testing.assert_close(g.double(), w.double(), rtol=rtol, atol=atol, msg=name)


def two_role_model(tokenizer, dtype: torch.dtype = torch.float64) -> nn.Module:
    """The tiny llama with adapters `a` and `b` (random, so both matter), one per role (`isolated`)."""
    model, _ = rolerl.tiny_model("llama", seed=0, tokenizer=tokenizer, dtype=dtype)
    rolerl.add_adapters(model, ["a", "b"], rank=4)
    randomize_adapters(model, seed=1, std=0.1)
    assert list(adapter_parameters(model)) == [0, 1]
    return model


ROLE_ROUTES = {"a": dict.fromkeys(KINDS, 0), "b": dict.fromkeys(KINDS, 1)}


def two_role_batch(advantages: list[float], weights: list[float] | None = None, seed: int = 0) -> TrainBatch:
    """One row per advantage, roles alternating a, b, of different lengths (prompt 3 + i, completion
    4 + i tokens of reasoning and tool-call kinds); the roles' routes are their own adapter everywhere."""
    g = torch.Generator().manual_seed(seed)
    pattern = [REASONING, REASONING, TOOL_CALL, TOOL_CALL, REASONING, REASONING, REASONING, TOOL_CALL]
    turns = []
    for i in range(len(advantages)):
        role = "ab"[i % 2]
        prompt = torch.randint(3, 4000, (3 + i,), generator=g).tolist()
        kinds = pattern[: 4 + i]
        completion = torch.randint(3, 4000, (len(kinds),), generator=g).tolist()
        all_kinds = ["prompt"] * len(prompt) + kinds
        turns.append(
            Turn(role, prompt, completion, kinds, shift(all_kinds, ROLE_ROUTES[role]), [-1.0] * len(kinds))
        )
    return collate(turns, advantages, ROLE_ROUTES, weights=weights, role_names=["a", "b"], pad_id=2)
