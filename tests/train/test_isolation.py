"""Gradient isolation (issue 13, DART's gradient masking): under `strict` the loss at a position reaches
only the adapter that computes it; under `route` attention carries it into the other adapter too."""

from __future__ import annotations

import pytest
import torch

from rolerl.models.lora import adapter_parameters
from rolerl.train.update import Aligned, LossSettings, accumulate_gradients
from tests.train.test_update import dart_model, grads, hand_batch, settings


def run(model, batch, isolation: str, **alg) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    base = settings(**alg)
    s = LossSettings(
        base.algorithm, base.temperature, base.horizon, base.chunk_size,
        isolation=isolation, adapter_params=adapter_parameters(model),
    )  # fmt: skip
    loss, _, _ = accumulate_gradients(model, batch, Aligned(batch.old_logp), s, micro_batch_size=2)
    return loss, grads(model)


def only(batch, adapter: int):
    """`batch` with loss only at positions computed by `adapter` (routes[p] == adapter)."""
    out = type(batch)(**vars(batch))
    out.loss_mask = batch.loss_mask.clone()
    out.loss_mask[:, :-1] *= (batch.routes[:, :-1] == adapter).float()
    return out


def of(g: dict[str, torch.Tensor], adapter: str) -> list[torch.Tensor]:
    return [v for n, v in g.items() if n.endswith(f".{adapter}")]


@pytest.mark.parametrize(("loss_on", "other"), [(0, "tool"), (1, "reason")])
def test_strict_gives_exactly_zero_gradient_from_tokens_routed_elsewhere(tokenizer, loss_on, other):
    model, _, route_of = dart_model(tokenizer)
    batch = only(hand_batch(model, route_of), loss_on)
    mine = {0: "reason", 1: "tool"}[loss_on]
    _, strict = run(model, batch, "strict")
    assert of(strict, mine) and all(bool(v.abs().sum() > 0) for v in of(strict, mine))
    assert all(float(v.abs().max()) == 0.0 for v in of(strict, other))  # absent or exactly zero
    _, route = run(model, batch, "route")
    assert max(float(v.abs().max()) for v in of(route, other)) > 1e-6, "attention carries it across"
    for a, b in zip(of(strict, mine), of(route, mine), strict=True):  # its own adapter: the same gradient
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_strict_parts_add_up_to_the_loss_of_route(tokenizer):
    """The full loss under strict equals the route loss (aggregation is linear, one normaliser); the
    gradients differ on both adapters: under route each also gets the other's tokens' loss."""
    model, _, route_of = dart_model(tokenizer)
    batch = hand_batch(model, route_of)
    kw = {"loss_agg": "seq-mean-token-mean", "beta": 0.1, "entropy_coef": 0.01}
    loss_strict, strict = run(model, batch, "strict", **kw)
    loss_route, route = run(model, batch, "route", **kw)
    assert loss_strict == pytest.approx(loss_route, rel=1e-6, abs=1e-7)
    for name in ("reason", "tool"):
        diff = max(float((a - b).abs().max()) for a, b in zip(of(strict, name), of(route, name), strict=True))
        assert diff > 1e-6 and all(bool(v.abs().sum() > 0) for v in of(strict, name))
