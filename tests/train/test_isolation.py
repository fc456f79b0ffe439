"""Gradient isolation (issue 13, DART's gradient masking): under `strict` the loss at a position reaches
only the adapter that computes it; under `route` attention carries it into the other adapter too."""

from __future__ import annotations

import pytest
import torch

from rolerl.models.lora import adapter_parameters
from rolerl.roles import ANSWER, KIND_INDEX, REASONING, TOOL_CALL
from rolerl.train.update import Aligned, LossSettings, accumulate_gradients
from tests.train.reference import adapter_params, assert_grads_close, grad_of, reference_terms
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


def test_strict_gradient_of_each_adapter_is_the_backward_of_its_own_kinds_tokens(tokenizer):
    """Loss on both kinds (PG and an entropy bonus): under strict, each adapter's gradient is
    `torch.autograd.grad` of the hand objective over only the positions it computes, by DART's table on the
    kind of the token a position predicts (reasoning and answer -> reason, tool call -> tool), with the
    whole batch's normaliser; under route, the gradient of the whole objective, which is that plus the
    other kind's tokens' gradient reaching it through attention. The objective is written from a plain
    forward of each row (`tests.train.reference`) at PPO ratio 1 (`Aligned(None)`)."""
    model, _, route_of = dart_model(tokenizer, dtype=torch.float64)
    batch = hand_batch(model, route_of)
    target = batch.kind_ids[:, 1:]  # (B, T-1): the kind each position predicts
    m = batch.loss_mask[:, :-1].double()
    kinds = {
        "reason": (target == KIND_INDEX[REASONING]) | (target == KIND_INDEX[ANSWER]),
        "tool": target == KIND_INDEX[TOOL_CALL],
    }
    assert all(bool((m * k).sum() > 0) for k in kinds.values()), "loss on both kinds"
    assert torch.equal(m, m * (kinds["reason"] | kinds["tool"])), "every loss token is one of them"
    coef = 0.05
    s = settings(entropy_coef=coef)

    def update(isolation: str) -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        ps = LossSettings(s.algorithm, s.temperature, s.horizon, s.chunk_size, isolation=isolation,
                          adapter_params=adapter_parameters(model))  # fmt: skip
        accumulate_gradients(model, batch, Aligned(None), ps, micro_batch_size=2)
        return grads(model)

    strict, route = update("strict"), update("route")
    logp, entropy = reference_terms(model, batch, s.temperature)
    per_token = batch.weights.double()[:, None] * (-batch.advantages[:, :-1].double() * logp - coef * entropy)

    def objective(where: torch.Tensor) -> torch.Tensor:  # the token-mean with the whole batch's N
        return (m * where * per_token).sum() / m.sum()

    params = adapter_params(model)
    mine = {a: {n: p for n, p in params.items() if n.endswith(f".{a}")} for a in kinds}
    own = {a: grad_of(objective(kinds[a]), mine[a]) for a in kinds}
    assert_grads_close(strict, own["reason"] | own["tool"])
    cross = {a: grad_of(objective(kinds[b]), mine[a]) for a, b in (("reason", "tool"), ("tool", "reason"))}
    for a in kinds:
        assert_grads_close(route, {n: own[a][n] + cross[a][n] for n in mine[a]})
        # the other kind's share is not rounding: strict and route really differ on each adapter
        assert max(float(g.abs().max()) for g in cross[a].values()) > 1e-3 * max(
            float(g.abs().max()) for g in own[a].values()
        )


def test_an_adapter_that_computed_no_position_is_not_stepped(tokenizer):
    """AdamW moves a parameter with a zero gradient (momentum, weight decay) but skips one whose gradient is
    None: a routed layer computes only the adapters its tokens use, so the tool adapter of a mini-batch
    without tool calls gets no gradient and stays bit-identical, weights and optimizer state (issue 13)."""
    import math

    from rolerl.roles import ANSWER, REASONING, shift
    from rolerl.train.optim import model_optimizer
    from rolerl.train.update import Part, Schedule, ppo_update
    from rolerl.types import Turn, collate

    model, _, route_of = dart_model(tokenizer)
    optimizer = model_optimizer(model, lr=1e-2, weight_decay=0.1)
    s = settings()  # route isolation

    def update(batch):
        return ppo_update([Part.of(model, batch)], optimizer, s, Schedule(), micro_batch_size=4,
                          generator=torch.Generator().manual_seed(0))  # fmt: skip

    update(hand_batch(model, route_of))  # tool calls: both adapters step, Adam state for both
    tool = adapter_parameters(model)[1]
    before = [p.detach().clone() for p in tool]
    state = {i: {k: v.clone() for k, v in optimizer.torch.state[p].items()} for i, p in enumerate(tool)}
    kinds = [REASONING] * 4 + [ANSWER] * 2
    turns = [
        Turn("policy", [5, 6, 7], [8 + i, 9, 10, 11, 12, 13], kinds, shift(["prompt"] * 3 + kinds, route_of),
             [-1.0] * len(kinds))
        for i in range(3)
    ]  # fmt: skip
    no_tools = collate(turns, [1.0, -1.0, 0.5], {"policy": route_of}, pad_id=2)
    assert 1 not in no_tools.routes.unique().tolist()
    reason_before = [p.detach().clone() for p in adapter_parameters(model)[0]]
    update(no_tools)
    assert all(torch.equal(b, p) for b, p in zip(before, tool, strict=True))
    for i, p in enumerate(tool):
        assert all(torch.equal(state[i][k], v) for k, v in optimizer.torch.state[p].items())
    moved = [not torch.equal(b, p) for b, p in zip(reason_before, adapter_parameters(model)[0], strict=True)]
    assert any(moved) and not math.isnan(float(adapter_parameters(model)[0][0].detach().sum()))


def test_strict_isolation_skips_a_frozen_adapter(tokenizer):
    """A frozen adapter (`per_adapter.<name>.trainable: false`) computes its positions but has nothing to
    differentiate: strict isolation leaves it out instead of failing."""
    from rolerl.train.update import Part

    model, _, route_of = dart_model(tokenizer)
    for n, p in model.named_parameters():
        if n.endswith(".tool"):
            p.requires_grad_(False)
    batch = hand_batch(model, route_of)
    part = Part.of(model, batch)
    assert list(part.adapter_params) == [0]
    base = settings()
    s = LossSettings(base.algorithm, base.temperature, base.horizon, base.chunk_size, isolation="strict",
                     adapter_params=part.adapter_params)  # fmt: skip
    accumulate_gradients(model, batch, Aligned(batch.old_logp), s, micro_batch_size=2)
    g = grads(model)
    assert of(g, "reason") and not of(g, "tool")
