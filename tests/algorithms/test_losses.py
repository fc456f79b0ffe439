"""Losses, KL, entropy, TIS and aggregation against numbers computed by hand; micro-batch == full batch."""

import math

import pytest
import torch

from rolerl.algorithms import (
    AGGREGATIONS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    AggNorm,
    aggregate,
    entropy_from_logits,
    kl_k1,
    kl_k3,
    logp_mismatch,
    ppo_clip_loss,
    tis_weights,
)

F64 = torch.float64


def close(actual, expected, atol=1e-12):
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=F64), torch.as_tensor(expected, dtype=F64), rtol=0, atol=atol
    )


# ------------------------------------------------------------------------------------------------
# Aggregation
# ------------------------------------------------------------------------------------------------

# Row 0: 3 loss tokens (1, 2, 3); row 1: 1 loss token (5); row 2: no loss token (excluded from G).
# The NaN sits at a padded position: it must not leak into any mode.
LOSS = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0], [9.0, 9.0, 9.0, float("nan")]], dtype=F64)
MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])


def test_aggnorm_counts():
    # tokens 3 + 1 + 0 = 4; sequences with >= 1 token: 2; horizon: padded width 4
    assert AggNorm.of(MASK) == AggNorm(num_tokens=4, num_seqs=2, horizon=4)
    assert AggNorm.of(MASK[:1], MASK[1:], horizon=16) == AggNorm(4, 2, 16)


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", (1 + 2 + 3 + 5) / 4),  # Σ m·L / N = 11 / 4 = 2.75
        ("seq-mean-token-mean", ((1 + 2 + 3) / 3 + 5 / 1) / 2),  # (2 + 5) / G=2 = 3.5
        ("seq-mean-token-sum", ((1 + 2 + 3) + 5) / 2),  # (6 + 5) / G=2 = 5.5
        ("seq-mean-token-sum-norm", ((1 + 2 + 3) + 5) / (2 * 4)),  # 11 / (G=2 · H=4) = 1.375
    ],
)
def test_aggregation_hand_values(mode, expected):
    close(aggregate(LOSS, MASK, mode), expected)


def test_aggregation_explicit_normalisers():
    norm = AggNorm(num_tokens=10, num_seqs=5, horizon=11)
    close(aggregate(LOSS, MASK, "token-mean", norm), 11 / 10)  # Σ m·L = 11 over a global N = 10
    close(aggregate(LOSS, MASK, "seq-mean-token-mean", norm), (2 + 5) / 5)
    close(aggregate(LOSS, MASK, "seq-mean-token-sum", norm), 11 / 5)
    close(aggregate(LOSS, MASK, "seq-mean-token-sum-norm", norm), 11 / (5 * 11))


@pytest.mark.parametrize("mode", sorted(AGGREGATIONS))
def test_empty_mask_gives_zero(mode):
    close(aggregate(LOSS, torch.zeros_like(MASK), mode), 0.0)


def test_unknown_mode_names_the_choices():
    with pytest.raises(ValueError, match="seq-mean-token-sum-norm"):
        aggregate(LOSS, MASK, "mean")


# ------------------------------------------------------------------------------------------------
# PPO clip: every case of (sign of A) x (ratio inside / above / below), clip-higher and dual clip
# ------------------------------------------------------------------------------------------------

CLIP_LOW, CLIP_HIGH, CLIP_C = 0.2, 0.28, 3.0  # ratio window [0.8, 1.28]
# (A, r, loss without dual clip, loss with dual clip c=3); loss = -min(r·A, clip(r, 0.8, 1.28)·A)
CASES = [
    (+1.0, 1.1, -1.1, -1.1),  # A>0 inside: unclipped r·A
    (+1.0, 1.5, -1.28, -1.28),  # A>0 above 1.28: clipped at 1 + clip_high (clip-higher bound)
    (+1.0, 0.5, -0.5, -0.5),  # A>0 below 0.8: min picks r·A = 0.5 < 0.8, no clip
    (-1.0, 1.1, 1.1, 1.1),  # A<0 inside: -(-1.1)
    (-1.0, 0.5, 0.8, 0.8),  # A<0 below 0.8: min(-0.5, -0.8) = -0.8, clipped at 1 - clip_low
    (-1.0, 1.5, 1.5, 1.5),  # A<0 above 1.28: min(-1.5, -1.28) = -1.5, unclipped; 1.5 < c=3
    (-1.0, 5.0, 5.0, 3.0),  # A<0, r=5 > c: dual clip caps the loss at -c·A = 3
    (+2.0, 5.0, -2.56, -2.56),  # A>0 far above: -2 · 1.28; dual clip never applies to A>0
    (0.0, 1.7, 0.0, 0.0),  # A=0: no gradient signal either way
]


def _case_tensors():
    adv = torch.tensor([[c[0] for c in CASES]], dtype=F64)  # (1, 9)
    ratio = torch.tensor([[c[1] for c in CASES]], dtype=F64)
    old = torch.full_like(ratio, -1.3)
    return adv, old + torch.log(ratio), old, torch.ones_like(ratio, dtype=torch.long)


@pytest.mark.parametrize("dual", [False, True])
def test_ppo_clip_cases(dual):
    adv, logp, old, mask = _case_tensors()
    out = ppo_clip_loss(
        logp, old, adv, mask, clip_low=CLIP_LOW, clip_high=CLIP_HIGH, clip_c=CLIP_C if dual else None
    )
    close(out.per_token[0], [c[3 if dual else 2] for c in CASES])
    s = out.stats
    close(s.clip_frac, 3 / 9)  # cases 2, 5, 8 use the clipped branch
    close(s.clip_frac_high, 2 / 9)  # cases 2, 8
    close(s.clip_frac_low, 1 / 9)  # case 5
    close(s.dual_clip_frac, 1 / 9 if dual else 0.0)  # case 7
    close(s.ratio_max, 5.0)
    close(s.ratio_min, 0.5)
    close(s.ratio_mean, (1.1 + 1.5 + 0.5 + 1.1 + 0.5 + 1.5 + 5 + 5 + 1.7) / 9)
    # approx_kl = mean(old - logp) = -mean(log r)
    close(s.approx_kl, -sum(math.log(c[1]) for c in CASES) / 9)
    m = s.metrics()
    assert set(m) >= {"pg/clip_frac", "pg/dual_clip_frac", "pg/approx_kl"} and all(
        isinstance(v, float) for v in m.values()
    )


def test_ppo_clip_gradient_flows_only_where_unclipped():
    adv, logp, old, mask = _case_tensors()
    logp = logp.clone().requires_grad_()
    out = ppo_clip_loss(logp, old, adv, mask, clip_low=CLIP_LOW, clip_high=CLIP_HIGH, clip_c=CLIP_C)
    out.per_token.sum().backward()
    # d(-A·r)/dlogp = -A·r where unclipped; 0 where clipped (2, 5, 8) or dual-clipped (7) or A = 0 (9)
    expected = [-1.1, 0.0, -0.5, 1.1, 0.0, 1.5, 0.0, 0.0, 0.0]
    close(logp.grad[0], expected)


def test_ppo_sequence_advantages_broadcast_and_is_weights():
    # (B,) advantages broadcast over tokens; IS weights multiply the clipped loss
    logp = torch.log(torch.tensor([[1.1, 0.5], [1.1, 0.5]], dtype=F64))
    old = torch.zeros_like(logp)
    w = torch.tensor([[2.0, 0.5], [1.0, 1.0]], dtype=F64)
    out = ppo_clip_loss(logp, old, torch.tensor([1.0, -1.0], dtype=F64), torch.ones(2, 2), is_weights=w)
    # row 0, A=+1: -1.1·2 = -2.2 and -0.5·0.5 = -0.25; row 1, A=-1: +1.1, +0.8 (clipped at 0.8)
    close(out.per_token, [[-2.2, -0.25], [1.1, 0.8]])


def test_ppo_log_ratio_clamped_at_20():
    out = ppo_clip_loss(
        torch.tensor([[50.0]], dtype=F64),
        torch.zeros(1, 1, dtype=F64),
        torch.tensor([[-1.0]], dtype=F64),
        torch.ones(1, 1),
    )
    close(out.per_token, [[math.exp(20.0)]])  # exp(50) would be used unclamped; verl clamps to 20


def test_ppo_rejects_bad_dual_clip():
    adv, logp, old, mask = _case_tensors()
    with pytest.raises(ValueError, match="clip_c"):
        ppo_clip_loss(logp, old, adv, mask, clip_c=0.9)


def test_policy_loss_registry():
    assert POLICY_LOSSES["ppo_clip"] is ppo_clip_loss


# ------------------------------------------------------------------------------------------------
# KL, entropy, TIS
# ------------------------------------------------------------------------------------------------


def test_kl_hand_values():
    logp = torch.log(torch.tensor([0.5, 0.25], dtype=F64))
    ref = torch.log(torch.tensor([0.25, 0.5], dtype=F64))
    # k1 = logp - ref: ln 2 = 0.693147, -ln 2
    close(kl_k1(logp, ref), [math.log(2), -math.log(2)])
    # k3 = e^(ref-logp) - (ref-logp) - 1: 0.5 + ln 2 - 1 = 0.193147; 2 - ln 2 - 1 = 0.306853
    close(kl_k3(logp, ref), [0.5 + math.log(2) - 1, 2 - math.log(2) - 1])
    # k3 clamps like verl: a log-ratio of 30 is clamped to 20 and the estimate to 10
    close(kl_k3(torch.tensor([0.0], dtype=F64), torch.tensor([30.0], dtype=F64)), [10.0])


@pytest.mark.parametrize("name", sorted(KL_ESTIMATORS))
def test_kl_exactly_zero_when_policy_is_reference(name):
    logp = torch.randn(4, 7, generator=torch.Generator().manual_seed(0)).requires_grad_()
    kl = KL_ESTIMATORS[name](logp, logp.detach().clone())
    assert torch.equal(kl, torch.zeros_like(kl))
    kl.sum().backward()
    # k3's gradient 1 - e^(ref - logp) vanishes at the reference; k1's is the constant 1
    assert torch.equal(logp.grad, torch.ones_like(logp) if name == "k1" else torch.zeros_like(logp))


def test_entropy_hand_values():
    # uniform over 4: ln 4; p = (1/4, 3/4): -(1/4 ln 1/4 + 3/4 ln 3/4) = 0.562335
    h_two = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    close(entropy_from_logits(torch.zeros(4, dtype=F64)), math.log(4))
    close(entropy_from_logits(torch.tensor([0.0, math.log(3)], dtype=F64)), h_two)
    # temperature 2 on logits (0, 2 ln 3) is the same distribution
    close(entropy_from_logits(torch.tensor([0.0, 2 * math.log(3)], dtype=F64), temperature=2.0), h_two)
    close(entropy_from_logits(torch.tensor([1000.0, 0.0], dtype=F64)), 0.0)  # no NaN at one-hot


def test_tis_weights_hand_values():
    old = torch.log(torch.tensor([[1.5, 3.0, 0.5]])).requires_grad_()
    rollout = torch.zeros(1, 3)
    w = tis_weights(old, rollout, cap=2.0)
    # min(e^(old - rollout), 2): 1.5, min(3, 2) = 2, 0.5
    close(w, [[1.5, 2.0, 0.5]], atol=1e-6)
    assert not w.requires_grad
    mm = logp_mismatch(old, rollout, torch.tensor([[1, 1, 0]]), cap=2.0)
    # over the two loss tokens: |delta| = ln 1.5 = 0.405465, ln 3 = 1.098612
    close(mm.mean_abs, (math.log(1.5) + math.log(3)) / 2, atol=1e-6)
    close(mm.max_abs, math.log(3), atol=1e-6)
    close(mm.tis_weight_mean, (1.5 + 2.0) / 2, atol=1e-6)
    close(mm.tis_truncated_frac, 0.5)  # token 2 (ratio 3 > cap 2)
    assert set(mm.metrics()) == {
        f"logp_mismatch/{k}" for k in ("mean_abs", "max_abs", "tis_weight_mean", "tis_truncated_frac")
    }


# ------------------------------------------------------------------------------------------------
# Micro-batched accumulation == full batch, for every aggregation mode
# ------------------------------------------------------------------------------------------------


def _objective(logp, old, ref, adv, mask, mode, norm):
    pg = ppo_clip_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, clip_c=3.0).per_token
    return aggregate(pg + 0.05 * kl_k3(logp, ref), mask, mode, norm)  # (B, T) -> scalar


def _batch():
    g = torch.Generator().manual_seed(1)
    b, t = 7, 9
    lengths = torch.tensor([9, 1, 4, 0, 6, 3, 8])  # ragged, one empty row
    mask = (torch.arange(t)[None, :] < lengths[:, None]).long()  # (B, T)
    old = -torch.rand(b, t, generator=g, dtype=F64) * 3
    logp = (old + 0.3 * torch.randn(b, t, generator=g, dtype=F64)).requires_grad_()
    ref = old + 0.1 * torch.randn(b, t, generator=g, dtype=F64)
    adv = torch.randn(b, generator=g, dtype=F64)
    return logp, old, ref, adv, mask


# Uneven micro-batches, each trimmed to its own padded width (as a micro-batch collator would).
SPLITS = [(0, 2), (2, 3), (3, 7)]


@pytest.mark.parametrize("mode", sorted(AGGREGATIONS))
def test_micro_batches_with_global_norm_equal_full_batch(mode):
    logp, old, ref, adv, mask = _batch()
    full = _objective(logp, old, ref, adv, mask, mode, AggNorm.of(mask))
    (g_full,) = torch.autograd.grad(full, logp)

    micro_masks, total, grad = [], 0.0, torch.zeros_like(logp)
    for s, e in SPLITS:
        w = max(int(mask[s:e].sum(-1).max()), 1)
        micro_masks.append(mask[s:e, :w])
    # The normalisers are counted once over the whole batch, with the full horizon T, and shared.
    norm = AggNorm.of(*micro_masks, horizon=mask.shape[-1])
    assert norm == AggNorm.of(mask)
    for (s, e), m in zip(SPLITS, micro_masks, strict=True):
        w = m.shape[-1]
        part = _objective(logp[s:e, :w], old[s:e, :w], ref[s:e, :w], adv[s:e], m, mode, norm)
        (g,) = torch.autograd.grad(part, logp)  # a real loop calls part.backward() and accumulates
        total, grad = total + part, grad + g
    close(total, full)
    close(grad, g_full)


@pytest.mark.parametrize("mode", sorted(AGGREGATIONS))
def test_micro_batches_with_local_norm_do_not(mode):
    # Documents why the global count is needed in every mode: with per-micro-batch counts (and, for
    # seq-mean-token-sum-norm, per-micro-batch padded widths) the summed loss is not the full loss,
    # whatever constant the micro losses are then scaled by.
    logp, old, ref, adv, mask = _batch()
    full = _objective(logp, old, ref, adv, mask, mode, None)
    parts = []
    for s, e in SPLITS:
        w = max(int(mask[s:e].sum(-1).max()), 1)
        parts.append(
            _objective(logp[s:e, :w], old[s:e, :w], ref[s:e, :w], adv[s:e], mask[s:e, :w], mode, None)
        )
    summed, mean = sum(parts), sum(parts) / len(parts)
    assert not torch.isclose(summed, full) and not torch.isclose(mean, full)
