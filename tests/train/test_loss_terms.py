"""Each optional term of the update against gradients derived by hand (issue 49): truncated IS weights, the
entropy bonus (the algorithm's and a role's coefficient), and role loss weights other than 0 and 1.

The expected gradient is the hand-written objective over `tests.train.reference`'s log-probs and entropies
(a plain forward of each row alone), differentiated with `torch.autograd.grad`. The update runs with its old
log-probs equal to its own (`Aligned(None)`, or `old_logp: recompute` with one optimizer step), so the PPO
ratio is exactly 1 and no clip binds: the clipped surrogate `-A·w·r` has the gradient `-A·w·∇log p`. A
term dropped, its sign flipped or its weight ignored moves the gradient by far more than the tolerance."""

from __future__ import annotations

import math

import pytest
import torch

from rolerl.config import AlgorithmConfig
from rolerl.train import update as update_module
from rolerl.train.optim import model_optimizer
from rolerl.train.update import Aligned, LossSettings, Part, Schedule, accumulate_gradients, ppo_update
from tests.train.reference import (
    adapter_params,
    assert_grads_close,
    grad_of,
    reference_terms,
    two_role_batch,
    two_role_model,
)
from tests.train.test_update import dart_model, grads, hand_batch

T = 0.8  # the rollout temperature of `hand_batch` and of these settings
# rollout log-prob = trainer's - delta: TIS weights exp(0.5), exp(-1), and exp(3) = 20.1 truncated at cap 2
DELTAS = (0.5, -1.0, 3.0)
WEIGHTS = (math.exp(0.5), math.exp(-1.0), 2.0)
CAP = 2.0


def settings(**alg) -> LossSettings:
    return LossSettings(algorithm=AlgorithmConfig(**alg), temperature=T, horizon=16, chunk_size=7)


def cycle_at_loss_tokens(batch, values) -> torch.Tensor:
    """`(B, T)` float64 holding `values` in turn at the loss positions (row-major), 0 elsewhere."""
    m = batch.loss_mask.bool()
    out = torch.zeros(batch.loss_mask.shape, dtype=torch.float64)
    k = int(m.sum())
    out[m] = torch.tensor(values, dtype=torch.float64).repeat(k // len(values) + 1)[:k]
    return out


def pg_objective(batch, logp, token_weight=None, row_weight=None, entropy=None, coef=None):
    """Token-mean of `w_i · (-A · c_t · log p - coef_i · H)` over the loss tokens (no PG term without
    `logp`), `c_t` = `token_weight`
    (TIS), `w_i` = the row's weight times `row_weight` (role loss weights): the objective whose gradient
    the update must give at PPO ratio 1."""
    m = batch.loss_mask[:, :-1].double()  # (B, T-1)
    w = batch.weights.double()[:, None] * (1.0 if row_weight is None else row_weight[:, None])
    per_token = torch.zeros_like(m) if logp is None else -batch.advantages[:, :-1].double() * logp
    if token_weight is not None:
        per_token = per_token * token_weight[:, :-1]
    if entropy is not None:
        per_token = per_token - coef * entropy
    return (m * w * per_token).sum() / m.sum()


# ---- truncated importance sampling --------------------------------------------------------------------


def tis_setup(tokenizer):
    model, _, route_of = dart_model(tokenizer, dtype=torch.float64)
    batch = hand_batch(model, route_of)  # advantages of both signs, row weights 1, 0.5, 2, 1, 0.25
    logp, _ = reference_terms(model, batch, T)
    delta = cycle_at_loss_tokens(batch, DELTAS)
    # the rollout's log-probs: the trainer's minus delta at every loss token
    batch.old_logp[:, :-1] = torch.where(batch.loss_mask[:, :-1].bool(), logp.detach() - delta[:, :-1], 0.0)
    return model, batch, logp, cycle_at_loss_tokens(batch, WEIGHTS)


@pytest.mark.parametrize("source", ["given", "from the forward"])
def test_tis_weights_multiply_each_tokens_policy_gradient(tokenizer, source):
    """Weights exp(0.5), exp(-1) and the cap 2 on the loss tokens in turn: the gradient is
    Σ m·w·(-A)·c_t·∇log p / N; the loss at ratio 1 is Σ m·w·(-A)·c_t / N. `given`: the weights the update
    precomputed (`Aligned.is_weights`); `from the forward`: the update computes them from its own log-probs
    and the rollout's (`Aligned.tis_cap`)."""
    model, batch, logp, c = tis_setup(tokenizer)
    aligned = Aligned(None, is_weights=c.float()) if source == "given" else Aligned(None, tis_cap=CAP)
    loss, sums, _ = accumulate_gradients(model, batch, aligned, settings(), micro_batch_size=2)
    want = grad_of(pg_objective(batch, logp, token_weight=c), adapter_params(model))
    # the weights from the forward round through fp32 (tis_weights) on |log p| <~ 35: ~4e-6 relative
    assert_grads_close(grads(model), want, rtol=2e-5)
    m = batch.loss_mask[:, :-1].double()
    hand = float((m * batch.weights[:, None] * -batch.advantages[:, :-1] * c[:, :-1]).sum() / m.sum())
    assert loss == pytest.approx(hand, rel=2e-5)
    unweighted = float((m * batch.weights[:, None] * -batch.advantages[:, :-1]).sum() / m.sum())
    assert abs(hand - unweighted) > 0.1 * abs(unweighted), "the weights change the loss: the test can fail"
    if source == "from the forward":
        assert sums.result()["pg/ratio_max"] == 1.0 == sums.result()["pg/ratio_min"]


def test_tis_weights_of_an_update_of_two_mini_batches(tokenizer, monkeypatch):
    """`ppo_update` with `old_logp: recompute`, TIS at cap 2 and two mini-batches: the first mini-batch's
    weights come from its own forward, the second's from the recompute before the update (`Aligned`
    built by `ppo_update`). The optimizer's step is held back, so each step's gradient is checked against
    its mini-batch's hand objective (normalised by that mini-batch's tokens)."""
    model, batch, logp, c = tis_setup(tokenizer)
    s = settings(old_logp="recompute", tis_cap=CAP)
    optimizer = model_optimizer(model, grad_clip=0.0)
    seen, rows_of = [], []
    monkeypatch.setattr(optimizer, "step", lambda: seen.append(grads(model)) or [])
    real = update_module._mini_batch
    monkeypatch.setattr(
        update_module, "_mini_batch", lambda parts, rows, *a: rows_of.append(rows) or real(parts, rows, *a)
    )
    ppo_update([Part.of(model, batch)], optimizer, s, Schedule(mini_batches=2), micro_batch_size=2,
               generator=torch.Generator().manual_seed(0))  # fmt: skip
    assert len(seen) == 2 and sorted(torch.cat(rows_of).tolist()) == list(range(5))
    for got, rows in zip(seen, rows_of, strict=True):
        keep = torch.zeros(5, 1)
        keep[rows] = 1.0
        sub = type(batch)(**vars(batch))
        sub.loss_mask = batch.loss_mask * keep  # the other mini-batch's tokens neither count nor weigh
        # the recomputed old log-probs are stored in fp32: ratio 1 within ~4e-6 of |log p| <~ 35
        assert_grads_close(got, grad_of(pg_objective(sub, logp, token_weight=c), adapter_params(model)), 2e-5)


# ---- the entropy bonus -------------------------------------------------------------------------------


@pytest.mark.parametrize("advantages", ["zero", "hand_batch's"])
def test_entropy_bonus_gradient_sign_size_and_metrics(tokenizer, advantages):
    """`algorithm.entropy_coef` 0.1: the loss is PG - 0.1·H (a bonus: descending it raises the entropy),
    so the gradient is ∇ Σ m·w·(-A·log p - 0.1·H) / N; with zero advantages it is the entropy term's
    alone. `loss/entropy` = -0.1·Σ m·w·H / N and `entropy` = the mean H over the loss tokens, against an
    entropy computed from the plain forward's logits."""
    model, _, route_of = dart_model(tokenizer, dtype=torch.float64)
    batch = hand_batch(model, route_of)
    if advantages == "zero":
        batch.advantages.zero_()
    loss, sums, _ = accumulate_gradients(
        model, batch, Aligned(None), settings(entropy_coef=0.1), micro_batch_size=2
    )
    logp, entropy = reference_terms(model, batch, T)
    params = adapter_params(model)
    want = grad_of(pg_objective(batch, logp, entropy=entropy, coef=0.1), params)
    got = grads(model)
    assert_grads_close(got, want, rtol=1e-5)
    m = batch.loss_mask[:, :-1].double()
    h = entropy.detach()
    bonus = float(-0.1 * (m * batch.weights[:, None] * h).sum() / m.sum())
    metrics = sums.result()
    assert metrics["loss/entropy"] == pytest.approx(bonus, rel=1e-9)
    assert metrics["entropy"] == pytest.approx(float((m * h).sum() / m.sum()), rel=1e-9)
    if advantages == "zero":
        assert loss == pytest.approx(bonus, rel=1e-9) and metrics["loss/pg"] == 0.0
        # the bonus's sign: a small step down the gradient raises the (weighted) mean entropy
        mean_h = grad_of((m * batch.weights[:, None] * entropy).sum() / m.sum(), params)
        assert sum(float((got[n].double() * mean_h[n]).sum()) for n in params) < 0


@pytest.mark.parametrize(("default", "per_role"), [(0.05, {"b": 0.3}), (0.05, {"a": 0.0}), (0.0, {"a": 0.2})])
def test_a_roles_entropy_coef_replaces_the_algorithms_on_its_rows(tokenizer, default, per_role):
    """`roles.<r>.entropy_coef` (`LossSettings.role_entropy`) on role r's rows, `algorithm.entropy_coef`
    on the others; roles a and b train adapters a and b, so each adapter's gradient is its role's
    coefficient times -∇ Σ m·w·H / N over that role's rows (exactly zero for a coefficient of 0)."""
    model = two_role_model(tokenizer)
    batch = two_role_batch([0.0] * 6, weights=[1.0, 0.5, 2.0, 1.0, 0.25, 1.5])
    s = settings(entropy_coef=default)
    s.role_entropy = per_role
    _, sums, _ = accumulate_gradients(model, batch, Aligned(None), s, micro_batch_size=4)
    _, entropy = reference_terms(model, batch, T)
    coef = torch.tensor([per_role.get(r, default) for r in batch.roles], dtype=torch.float64)[:, None]
    want = grad_of(pg_objective(batch, None, entropy=entropy, coef=coef), adapter_params(model))
    got = grads(model)
    assert_grads_close(got, want, rtol=1e-5)
    for role in ("a", "b"):
        mine = [g for n, g in got.items() if n.endswith(f".{role}")]
        if per_role.get(role, default) == 0:
            assert all(float(g.abs().max()) == 0.0 for g in mine)
        else:
            assert mine and all(bool(g.abs().sum() > 0) for g in mine)
    m = batch.loss_mask[:, :-1].double()
    bonus = float(-(coef * m * batch.weights[:, None] * entropy.detach()).sum() / m.sum())
    # per-role coefficients are held in fp32 (0.05 and 0.3 are not): 1e-7 relative
    assert sums.result()["loss/entropy"] == pytest.approx(bonus, rel=1e-6)


# ---- role loss weights -------------------------------------------------------------------------------


@pytest.mark.parametrize("share", ["aggregate", "equal"])
def test_role_loss_weights_scale_their_roles_gradient(tokenizer, monkeypatch, share):
    """`roles.a.loss_weight` 0.5 and `roles.b.loss_weight` 2 multiply each role's loss on top of
    `algorithm.role_share` (token-mean): with `aggregate` a row's weight is w_i·lw_r; with `equal` it is
    w_i·lw_r·(1/2)·N/N_r (each role half of the loss, N_r its loss tokens). Checked on the gradient each
    optimizer step receives (the step itself held back) and on `loss/total`."""
    model = two_role_model(tokenizer)
    batch = two_role_batch([1.0, -0.5, 2.0, -1.5, 0.75, 1.25], weights=[1.0, 0.5, 2.0, 1.0, 0.25, 1.5])
    s = settings(old_logp="recompute", role_share=share)  # one optimizer step: old log-probs its own
    s.loss_weight = {"a": 0.5, "b": 2.0}
    optimizer = model_optimizer(model, grad_clip=0.0)
    seen = []
    monkeypatch.setattr(optimizer, "step", lambda: seen.append(grads(model)) or [])
    metrics = ppo_update([Part.of(model, batch)], optimizer, s, Schedule(), micro_batch_size=4,
                         generator=torch.Generator().manual_seed(0))  # fmt: skip
    lengths = batch.loss_mask.sum(-1).double()
    tokens = {r: float(sum(n for n, q in zip(lengths, batch.roles, strict=True) if q == r)) for r in "ab"}
    factor = {r: 1.0 if share == "aggregate" else 0.5 * float(lengths.sum()) / tokens[r] for r in "ab"}
    row_weight = torch.tensor([s.loss_weight[r] * factor[r] for r in batch.roles], dtype=torch.float64)
    logp, _ = reference_terms(model, batch, T)
    (got,) = seen
    assert_grads_close(got, grad_of(pg_objective(batch, logp, row_weight=row_weight), adapter_params(model)))
    m = batch.loss_mask[:, :-1].double()
    w = batch.weights.double() * row_weight
    assert metrics["loss/total"] == pytest.approx(
        float((m * w[:, None] * -batch.advantages[:, :-1]).sum() / m.sum())
    )


def test_role_coefficients_and_loss_weights_reach_the_loss_settings(tmp_path):
    """`roles.<r>.loss_weight` and `roles.<r>.entropy_coef` from the config are what the update gets."""
    from rolerl.run.policy import build_policy
    from rolerl.train.rl import loss_settings
    from tests.train.test_rl import tiny_config

    cfg = tiny_config(tmp_path, "adapters.preset=isolated", "algorithm.entropy_coef=0.05", "roles.a.loss_weight=0.5",
                      "roles.b.loss_weight=2", "roles.b.entropy_coef=0.3", "roles.a.beta=0.1")  # fmt: skip
    s = loss_settings(cfg, build_policy(cfg, ["a", "b"]))
    assert (
        s.loss_weight == {"a": 0.5, "b": 2.0} and s.role_entropy == {"b": 0.3} and s.role_beta == {"a": 0.1}
    )
    assert s.algorithm.entropy_coef == 0.05 and s.temperature == cfg.rollout.temperature
