"""The update on the tiny model: micro-batched == full-batch gradients for the real loss, KL exactly zero
at zero adapters, recompute/TIS bookkeeping, and the learning-rate schedule."""

from __future__ import annotations

import copy
import math
import weakref

import pytest
import torch

import rolerl
from rolerl.algorithms.losses import tis_weights
from rolerl.config import AlgorithmConfig, OptimConfig
from rolerl.models.topology import Topology
from rolerl.roles import ANSWER, REASONING, TOOL_CALL, TOOL_OUTPUT, shift
from rolerl.train import update as update_module
from rolerl.train.optim import lr_factor, model_optimizer
from rolerl.train.policy import select_rows, token_logprobs
from rolerl.train.update import (
    Aligned,
    LossSettings,
    Part,
    Schedule,
    accumulate_gradients,
    by_length,
    loss_terms,
    ppo_update,
    recompute_logprobs,
)
from rolerl.types import Turn, collate
from tests.models.test_lora import randomize_adapters

R, C, X, A = REASONING, TOOL_CALL, TOOL_OUTPUT, ANSWER
AGG_MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


def dart_model(tokenizer, randomize: bool = True, dtype: torch.dtype = torch.float32):
    model, tok = rolerl.tiny_model("llama", seed=0, tokenizer=tokenizer, dtype=dtype)
    rolerl.add_adapters(model, ["reason", "tool"], rank=4)
    if randomize:
        randomize_adapters(model, seed=1, std=0.1)
    route_of = Topology.from_preset("dart", ["policy"]).route_of("policy", {"reason": 0, "tool": 1})
    return model, tok, route_of


def hand_batch(model, route_of, n: int = 5, seed: int = 0):
    """`n` turns of different lengths mixing every kind; old log-probs = the model's own plus noise, so
    some ratios clip; advantages of both signs; per-sequence weights."""
    g = torch.Generator().manual_seed(seed)
    pattern = [R, R, C, C, C, X, X, R, A, A, R]
    turns = []
    for i in range(n):
        prompt = torch.randint(3, 4000, (3 + i,), generator=g).tolist()
        kinds = pattern[: 5 + i]
        completion = torch.randint(3, 4000, (len(kinds),), generator=g).tolist()
        logprobs = [math.nan if k == X else -1.0 for k in kinds]
        turns.append(
            Turn(
                "policy",
                prompt,
                completion,
                kinds,
                shift(["prompt"] * len(prompt) + kinds, route_of),
                logprobs,
            )
        )
    adv = (torch.randn(n, generator=g) * 1.5).tolist()
    batch = collate(turns, adv, {"policy": route_of}, weights=[1.0, 0.5, 2.0, 1.0, 0.25][:n], pad_id=2)
    with torch.no_grad():
        logp = token_logprobs(model, batch, temperature=0.8).logp  # (B, T-1)
    noise = torch.randn(logp.shape, generator=g) * 0.3
    batch.old_logp[:, :-1] = torch.where(batch.loss_mask[:, :-1].bool(), logp + noise, 0.0)
    return batch


def settings(**alg) -> LossSettings:
    return LossSettings(algorithm=AlgorithmConfig(**alg), temperature=0.8, horizon=16, chunk_size=7)


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


CASES = [(torch.float64, m) for m in AGG_MODES] + [
    (torch.float32, "token-mean"),
    (torch.float32, "seq-mean-token-mean"),
]


@pytest.mark.parametrize(("dtype", "mode"), CASES)
def test_micro_batched_gradients_equal_full_batch(tokenizer, dtype, mode):
    """With the mini-batch's AggNorm, micro-batches of 2 give the full batch's loss and gradients: exact
    up to the final cast to the fp32 adapter weights in fp64; in fp32 the rows' different padded widths
    change the forward's rounding, so the match is to ~1e-6."""
    model, _, route_of = dart_model(tokenizer, dtype=dtype)
    batch = hand_batch(model, route_of)
    s = settings(loss_agg=mode, beta=0.1, entropy_coef=0.01, clip_c=3.0)
    b = batch.input_ids.shape[0]
    full_loss, full_sums, _ = accumulate_gradients(
        model, batch, Aligned(batch.old_logp), s, micro_batch_size=b
    )
    full = grads(model)
    model.zero_grad(set_to_none=True)
    micro_loss, micro_sums, _ = accumulate_gradients(
        model, batch, Aligned(batch.old_logp), s, micro_batch_size=2
    )
    micro = grads(model)
    assert set(full) == set(micro) and len(full) > 0
    assert all("lora_" in n for n in full), "only adapters get gradients"
    assert {n.split(".")[-1] for n in full} >= {"reason", "tool"}, "both routed adapters learn"
    exact = dtype == torch.float64
    assert micro_loss == pytest.approx(full_loss, abs=1e-12 if exact else 1e-6)
    for name in full:
        tol = {"atol": 1e-7, "rtol": 1e-6} if exact else {"atol": 5e-6, "rtol": 1e-4}
        torch.testing.assert_close(micro[name], full[name], **tol)
    assert 0 < full_sums.result()["pg/clip_frac"] < 1  # the noise makes some ratios clip, not all
    assert micro_sums.result()["entropy"] == pytest.approx(full_sums.result()["entropy"], rel=1e-5)


def test_micro_batches_take_rows_of_like_length_together(tokenizer, monkeypatch):
    """Rows in shuffled order (lengths 16, 8, 14, 10, 12) go into micro-batches shortest first, each
    trimmed to its longest row: widths 10, 14, 16 (in the given order: 16, 14, 12, more padding); the
    loss, gradients and log-probs stay the full batch's."""
    model, _, route_of = dart_model(tokenizer, dtype=torch.float64)
    batch = select_rows(hand_batch(model, route_of), [4, 0, 3, 1, 2])
    assert batch.attention_mask.sum(-1).tolist() == [16, 8, 14, 10, 12]
    assert by_length(batch, range(5), 2) == [[1, 3], [4, 2], [0]]
    s = settings(beta=0.1)
    full_loss, _, full_logp = accumulate_gradients(
        model, batch, Aligned(batch.old_logp), s, micro_batch_size=5
    )
    full = grads(model)
    model.zero_grad(set_to_none=True)
    widths = []
    real = update_module.select_rows

    def spy(b, rows):
        out = real(b, rows)
        widths.append(out.input_ids.shape[1])
        return out

    monkeypatch.setattr(update_module, "select_rows", spy)
    loss, _, logp = accumulate_gradients(model, batch, Aligned(batch.old_logp), s, micro_batch_size=2)
    assert widths == [10, 14, 16]
    assert loss == pytest.approx(full_loss, abs=1e-12)
    torch.testing.assert_close(logp, full_logp, rtol=0, atol=1e-12)
    for name, g in grads(model).items():
        torch.testing.assert_close(g, full[name], rtol=1e-6, atol=1e-7)


def test_a_micro_batch_lets_go_of_its_loss_before_the_next_forward(tokenizer, monkeypatch):
    """The previous micro-batch's loss and log-probs are gone when the next one's forward starts (kept
    alive through it, the heap fragmented: +1.1-2.3 GB peak RSS in a 512-token GRPO step)."""
    model, _, route_of = dart_model(tokenizer, dtype=torch.float64)
    batch = hand_batch(model, route_of)
    real, refs, alive = update_module.loss_terms, [], []

    def spy(*args):
        alive.append([ref() is not None for ref in refs])  # what earlier micro-batches left alive
        weighted, metrics, logp = real(*args)
        refs.extend([weakref.ref(weighted), weakref.ref(logp)])
        return weighted, metrics, logp

    monkeypatch.setattr(update_module, "loss_terms", spy)
    accumulate_gradients(model, batch, Aligned(batch.old_logp), settings(), micro_batch_size=2)
    assert alive == [[], [False] * 2, [False] * 4]


@pytest.mark.parametrize("kl", ["k1", "k3"])
def test_kl_is_exactly_zero_when_adapters_are_zero(tokenizer, kl):
    model, _, route_of = dart_model(tokenizer, randomize=False)  # fresh adapters: B = 0
    batch = hand_batch(model, route_of)
    from rolerl.algorithms import AggNorm

    norm = AggNorm.of(batch.loss_mask, horizon=16)
    _, metrics, _ = loss_terms(model, batch, Aligned(batch.old_logp), norm, settings(beta=0.5, kl=kl))
    # Exact, not close: B = 0 makes each routed layer add exact zeros, so the policy and the reference
    # (route -1) forwards compute the same values with the same ops, and k1, k3 of equal log-probs are 0.
    assert metrics["kl"] == 0.0 and metrics["loss/kl"] == 0.0
    # Through the whole update too (one optimizer step: its forward sees the zero adapters).
    update = ppo_update(
        [Part.of(model, batch)], model_optimizer(model), settings(beta=0.5, kl=kl), Schedule(),
        micro_batch_size=2, generator=torch.Generator(),
    )  # fmt: skip
    assert update["kl"] == 0.0 and update["loss/kl"] == 0.0
    randomize_adapters(model, seed=1, std=0.1)
    _, metrics, _ = loss_terms(model, batch, Aligned(batch.old_logp), norm, settings(beta=0.5, kl=kl))
    assert metrics["kl"] != 0.0


def test_recompute_gives_ratio_one_and_logs_mismatch_and_tis(tokenizer):
    model, _, route_of = dart_model(tokenizer)
    batch = hand_batch(model, route_of)
    opt = model_optimizer(model)
    params = opt.params
    before = [p.detach().clone() for p in params]
    s = settings(old_logp="recompute", tis_cap=2.0)
    metrics = ppo_update(
        [Part.of(model, batch)], opt, s, Schedule(), micro_batch_size=2,
        generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    # Old log-probs recomputed by the same forward: the first (only) pass has ratio 1 (up to the rounding of
    # the shuffled micro-batches' different padded widths) and nothing clips.
    assert metrics["pg/ratio_min"] == pytest.approx(1.0, abs=1e-5) and metrics["pg/clip_frac"] == 0.0
    assert metrics["pg/ratio_max"] == pytest.approx(1.0, abs=1e-5)
    # The batch's "rollout" log-probs are the recompute plus N(0, 0.3) noise: the mismatch shows it.
    assert 0.1 < metrics["logp_mismatch/mean_abs"] < 0.5 and metrics["logp_mismatch/max_abs"] > 0.5
    assert 0 < metrics["logp_mismatch/tis_weight_mean"] <= 2.0
    assert (
        metrics["optimizer_steps"] == 1.0
        and math.isfinite(metrics["loss/total"])
        and metrics["grad_norm"] > 0
    )
    assert any(not torch.equal(a, p) for a, p in zip(before, params, strict=True))


def test_one_optimizer_step_takes_old_logprobs_and_tis_from_its_own_forward(tokenizer, monkeypatch):
    """An update of one optimizer step trains the very policy its old log-probs would be recomputed from: it
    takes them (and the TIS weights) from its own forward, detached, with no recomputing forward. The same
    loss and gradients as recomputing first (float64: the two forwards agree to rounding), the PPO ratio
    exactly 1, the mismatch and TIS still measured over every row; with two mini-batches (the second runs
    on updated weights) the old log-probs are recomputed first, as before."""
    model, _, route_of = dart_model(tokenizer, dtype=torch.float64)
    batch = hand_batch(model, route_of)
    s = settings(old_logp="recompute", tis_cap=2.0)
    trainer = recompute_logprobs(model, batch, s, 2)
    first = Aligned(trainer, tis_weights(trainer, batch.old_logp, cap=2.0))
    want_loss, _, _ = accumulate_gradients(model, batch, first, s, micro_batch_size=2)
    want = grads(model)
    model.zero_grad(set_to_none=True)
    got_loss, _, _ = accumulate_gradients(model, batch, Aligned(None, tis_cap=2.0), s, micro_batch_size=2)
    # the recomputed log-probs are stored in the batch's fp32 (`old_logp`), so the ratio of the recomputing
    # path is 1 within fp32 rounding of |log p| (<~ 10): 1e-6 relative, not float64's
    assert got_loss == pytest.approx(want_loss, rel=1e-5)
    got = grads(model)
    assert got.keys() == want.keys() and got
    for name, g in got.items():
        torch.testing.assert_close(g, want[name], rtol=1e-5, atol=1e-5 * float(want[name].abs().max()))
    model.zero_grad(set_to_none=True)
    calls, real = [], update_module.recompute_logprobs
    monkeypatch.setattr(update_module, "recompute_logprobs", lambda *a, **k: calls.append(1) or real(*a, **k))
    one = ppo_update(
        [Part.of(model, batch)], model_optimizer(model), s, Schedule(), micro_batch_size=2,
        generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    assert not calls and one["pg/ratio_min"] == one["pg/ratio_max"] == 1.0
    assert 0.1 < one["logp_mismatch/mean_abs"] < 0.5 and 0 < one["logp_mismatch/tis_weight_mean"] <= 2.0
    two = ppo_update(
        [Part.of(model, batch)], model_optimizer(model), s, Schedule(mini_batches=2), micro_batch_size=2,
        generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    assert calls == [1] and two["optimizer_steps"] == 2.0


def full_recompute_update(model, batch, s, schedule, micro_batch_size, generator) -> list[float]:
    """The update with every row's old log-probs (and TIS weights) recomputed first: one model, mini-batches
    of every role together, `per_minibatch` steps. Returns each optimizer step's loss."""
    trainer = recompute_logprobs(model, batch, s, micro_batch_size)
    aligned = Aligned(trainer, tis_weights(trainer, batch.old_logp, cap=s.algorithm.tis_cap))
    opt, losses = model_optimizer(model, grad_clip=0.0), []
    for _ in range(schedule.ppo_epochs):
        order = torch.randperm(batch.input_ids.shape[0], generator=generator)
        for rows in schedule.mini_batches_of(order, batch.roles):
            opt.zero_grad()
            sub = select_rows(batch, rows.tolist())
            loss, _, _ = accumulate_gradients(
                model, sub, aligned.rows(rows.tolist(), sub.input_ids.shape[1]), s, micro_batch_size
            )
            opt.step()
            losses.append(loss)
    return losses


def test_rows_trained_before_any_step_take_old_logprobs_from_that_forward(tokenizer, monkeypatch):
    """The first mini-batch's rows run their first forward before any optimizer step: their old log-probs
    (`recompute`) and TIS weights come from it and are kept for the next epoch; only the other rows are
    recomputed first. Two epochs of two mini-batches end with the same adapters and losses as recomputing
    every row (float64: the two forwards agree to rounding), and the mismatch is measured once per row, as
    the full recompute measures it. Under `merged` steps no row is recomputed at all."""
    base, _, route_of = dart_model(tokenizer, dtype=torch.float64)
    batch = hand_batch(base, route_of, n=5)
    s = settings(old_logp="recompute", tis_cap=1.5)
    schedule = Schedule(ppo_epochs=2, mini_batches=2)
    ref = copy.deepcopy(base)
    want = full_recompute_update(ref, batch, s, schedule, 2, torch.Generator().manual_seed(0))
    recomputed, real = [], update_module.recompute_logprobs
    monkeypatch.setattr(
        update_module, "recompute_logprobs",
        lambda *a, **k: recomputed.append(sorted(a[5])) or real(*a, **k),
    )  # fmt: skip
    model = copy.deepcopy(base)
    got = ppo_update(
        [Part.of(model, batch)], model_optimizer(model, grad_clip=0.0), s, schedule, micro_batch_size=2,
        generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    first = schedule.mini_batches_of(torch.randperm(5, generator=torch.Generator().manual_seed(0)), [])[0]
    assert recomputed == [sorted(set(range(5)) - set(first.tolist()))]  # the second mini-batch's rows only
    assert got["optimizer_steps"] == 4.0
    # the recomputed log-probs are stored in the batch's fp32 (`old_logp`), the kept ones too, but the first
    # mini-batch's first pass uses its float64 own: agreement within fp32 rounding, not float64's
    assert got["loss/total"] == pytest.approx(sum(want) / len(want), rel=1e-5)
    moved = 0.0
    for (name, p), q, p0 in zip(model.named_parameters(), ref.parameters(), base.parameters(), strict=True):
        got_step, want_step = (p - p0).detach(), (q - p0).detach()
        atol = 1e-4 * float(want_step.abs().max())
        torch.testing.assert_close(got_step, want_step, rtol=1e-4, atol=atol, msg=name)
        moved = max(moved, atol)
    assert moved > 0
    # the mismatch of every row, once: as a forward over all of them measures it
    trainer = real(base, batch, s, 2)
    full = update_module._mismatch(trainer, batch.old_logp, batch.loss_mask, s.algorithm.tis_cap)
    assert got["logp_mismatch/mean_abs"] == pytest.approx(full["logp_mismatch/mean_abs"].value, rel=1e-6)
    assert got["logp_mismatch/max_abs"] == pytest.approx(full["logp_mismatch/max_abs"], rel=1e-6)
    recomputed.clear()
    merged = ppo_update(
        [Part.of(model, batch)], model_optimizer(model, grad_clip=0.0), s,
        Schedule(ppo_epochs=2, mini_batches=2, merged=True), micro_batch_size=2,
        generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    assert not recomputed and merged["optimizer_steps"] == 2.0
    assert merged["pg/ratio_max"] > 1.0 or merged["pg/ratio_min"] < 1.0  # epoch 2: the kept old log-probs


def test_rollout_old_logp_mismatch_from_the_first_pass_and_mini_batches(tokenizer):
    model, _, route_of = dart_model(tokenizer)
    batch = hand_batch(model, route_of)
    opt = model_optimizer(model, grad_clip=0.0)
    one = ppo_update(
        [Part.of(model, batch)], opt, settings(), Schedule(), micro_batch_size=3,
        generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    assert 0.1 < one["logp_mismatch/mean_abs"] < 0.5 and "logp_mismatch/tis_weight_mean" not in one
    two = ppo_update(
        [Part.of(model, batch)], opt, settings(), Schedule(ppo_epochs=2, mini_batches=2), micro_batch_size=3,
        generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    assert two["optimizer_steps"] == 4.0 and "logp_mismatch/max_abs" in two


def test_lr_schedule_hand_values():
    o = OptimConfig(lr=1.0, warmup_steps=2, schedule="cosine", min_lr_ratio=0.0)
    got = [lr_factor(s, 6, o) for s in range(6)]
    want = [0.5, 1.0, 1.0, 0.5 * (1 + math.cos(math.pi / 4)), 0.5, 0.5 * (1 + math.cos(3 * math.pi / 4))]
    assert got == pytest.approx(want)
    assert lr_factor(5, 6, OptimConfig(warmup_steps=0, schedule="constant")) == 1.0
    floor = OptimConfig(warmup_steps=0, min_lr_ratio=0.1)
    assert lr_factor(0, 4, floor) == 1.0 and lr_factor(10, 4, floor) == pytest.approx(0.1)


def test_bf16_autocast_loss_and_gradients_are_finite_and_close(tokenizer):
    model, _, route_of = dart_model(tokenizer)
    batch = hand_batch(model, route_of)
    full, _, _ = accumulate_gradients(
        model, batch, Aligned(batch.old_logp), settings(beta=0.1), micro_batch_size=5
    )
    model.zero_grad(set_to_none=True)
    s = settings(beta=0.1)
    s.bf16 = True
    half, _, _ = accumulate_gradients(model, batch, Aligned(batch.old_logp), s, micro_batch_size=5)
    assert math.isfinite(half) and half == pytest.approx(full, abs=0.05)
    g = grads(model)
    assert g and all(bool(torch.isfinite(v).all()) and v.dtype == torch.float32 for v in g.values())


def test_cpu_bf16_training_forward_uses_eager_attention_with_sdpa_numerics(tokenizer, monkeypatch):
    """Under CPU bf16 autocast the training forward switches to eager attention (faster backward); it must
    give SDPA's log-probs up to bf16 rounding and restore the model's implementation afterwards."""
    import rolerl.train.policy as policy

    model, _, route_of = dart_model(tokenizer)
    batch = hand_batch(model, route_of)

    def run(bf16=True):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            return token_logprobs(model, batch, temperature=1.0).logp.float()

    mask = batch.loss_mask[:, :-1].bool()
    exact = run(bf16=False)[mask]
    eager = run()[mask]
    assert model.config._attn_implementation == "sdpa", "restored after the forward"
    monkeypatch.setattr(policy, "EAGER_MAX_SCORES", 0)  # every batch is "large": SDPA stays
    sdpa = run()[mask]
    assert (eager != sdpa).any(), "the two kernels really ran"
    err_eager, err_sdpa = (eager - exact).abs().mean(), (sdpa - exact).abs().mean()
    print(f"mean |bf16 - fp32| log-prob: eager {err_eager:.4f}, sdpa {err_sdpa:.4f}")
    assert err_eager < 1.5 * err_sdpa + 1e-3


def test_cpu_bf16_training_attention_is_eager_only_while_its_scores_fit_the_kept_heap(tiny):
    """Eager attention builds a `(B, H, T, T)` block of fp32 scores per layer; past `EAGER_MAX_SCORES` (the
    largest block the kept heap serves) the trainer keeps SDPA, at any row count; without autocast, SDPA."""
    import rolerl.train.policy as policy
    from rolerl.models import lean_ops
    from rolerl.models.attention import GROUPED_SDPA, LEAN_EAGER

    model, _ = tiny
    eager = LEAN_EAGER if model.config.model_type in lean_ops.FAMILIES else "eager"

    def chosen(rows: int, length: int, bf16: bool = True) -> str:
        ids = torch.zeros(rows, length, dtype=torch.long)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16), policy._attention_for(model, ids):
            return model.config._attn_implementation

    heads = model.config.num_attention_heads
    for rows in (1, 8):
        edge = math.isqrt(policy.EAGER_MAX_SCORES // (4 * heads * rows))  # the longest eager batch
        assert chosen(rows, edge) == eager
        assert chosen(rows, edge + 1) == GROUPED_SDPA
        assert chosen(rows, 16, bf16=False) == GROUPED_SDPA
    assert model.config._attn_implementation == "sdpa"  # restored
