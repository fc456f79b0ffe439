"""Advantages against numbers computed by hand.

The fixture has four groups, interleaved so grouping cannot rely on order:

    group a: rewards 1, 2, 3   mean 2, unbiased var ((1)^2 + 0 + (1)^2) / 2 = 1, std 1
    group b: rewards 0, 4      mean 2, unbiased var (4 + 4) / 1 = 8,             std 2*sqrt(2)
    group c: reward 5          singleton
    group d: rewards 0.7 x 3   zero variance
"""

import math

import pytest
import torch

from rolerl.algorithms import (
    ADVANTAGES,
    dr_grpo_advantages,
    group_index,
    grpo_advantages,
    rloo_advantages,
    zero_variance_groups,
    zero_variance_mask,
)

KEYS = ["a", "b", "a", "c", "b", "a", "d", "d", "d"]
REWARDS = torch.tensor([1.0, 0.0, 2.0, 5.0, 4.0, 3.0, 0.7, 0.7, 0.7], dtype=torch.float64)
EPS = 1e-6


def test_group_index_first_appearance_order():
    ids, keys = group_index(KEYS)
    assert keys == ["a", "b", "c", "d"]
    assert ids.tolist() == [0, 1, 0, 2, 1, 0, 3, 3, 3]


def test_grpo_hand_values():
    # a: (r - 2) / (1 + eps)          -> -1, 0, +1 (over 1 + eps)
    # b: (r - 2) / (2*sqrt(2) + eps)  -> -2 / 2.828427..., +2 / 2.828427... = -/+ 0.707106...
    # c, d: exactly 0 (singleton, zero variance)
    sb = 2 * math.sqrt(2) + EPS
    expected = [-1 / (1 + EPS), -2 / sb, 0.0, 0.0, 2 / sb, 1 / (1 + EPS), 0.0, 0.0, 0.0]
    adv = grpo_advantages(REWARDS, KEYS, eps=EPS)
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-12)
    assert adv.dtype == REWARDS.dtype and not adv.requires_grad


def test_dr_grpo_hand_values():
    # r - mean_g, no std: a -> -1, 0, 1; b -> -2, +2; c, d -> 0
    expected = [-1.0, -2.0, 0.0, 0.0, 2.0, 1.0, 0.0, 0.0, 0.0]
    adv = dr_grpo_advantages(REWARDS, KEYS)
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-12)


def test_rloo_hand_values():
    # r_i - mean of the others:
    # a: 1 - (2+3)/2 = -1.5;  2 - (1+3)/2 = 0;  3 - (1+2)/2 = +1.5
    # b: 0 - 4 = -4;  4 - 0 = +4
    # c: no other member -> 0;  d: all equal -> 0
    expected = [-1.5, -4.0, 0.0, 0.0, 4.0, 1.5, 0.0, 0.0, 0.0]
    adv = rloo_advantages(REWARDS, KEYS)
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", sorted(ADVANTAGES))
def test_registry_uniform_signature_and_float32(name):
    adv = ADVANTAGES[name](REWARDS.float(), KEYS)
    ref = ADVANTAGES[name](REWARDS, KEYS)
    assert adv.dtype == torch.float32
    torch.testing.assert_close(adv, ref.float())


@pytest.mark.parametrize("name", sorted(ADVANTAGES))
def test_zero_variance_is_exactly_zero_despite_rounding(name):
    # Eight float32 copies of 0.7 have a float32 mean 6e-8 below 0.7, so the textbook
    # (r - mean) / (std + 1e-6) gives +0.056 to every member of a solve-all group: pure rounding noise.
    r = torch.full((8,), 0.7)
    # Summed left to right, one correctly rounded float32 add at a time (the same on every CPU): r.mean()'s
    # order is the kernel's, and a pairwise order sums eight equal values exactly (x+x, 2x+2x, 4x+4x).
    mean = sum(r, torch.zeros(())) / 8
    naive = (r - mean) / (r.std() + 1e-6)  # std is ~6e-8 or 0, depending on the same order
    assert naive.abs().min() > 0.05  # the hazard is real
    assert torch.equal(ADVANTAGES[name](r, [7] * 8), torch.zeros(8))
    r64 = torch.full((3,), 0.1, dtype=torch.float64)  # float64 mean of three 0.1 is not 0.1 either
    assert torch.equal(ADVANTAGES[name](r64, [7] * 3), torch.zeros(3, dtype=torch.float64))


def test_tuple_and_tensor_keys():
    # (task, role) keys: the same task's two roles are separate groups.
    keys = [("t0", "gen"), ("t0", "agg"), ("t0", "gen"), ("t0", "agg")]
    r = torch.tensor([1.0, 0.0, 0.0, 1.0])
    torch.testing.assert_close(dr_grpo_advantages(r, keys), torch.tensor([0.5, -0.5, -0.5, 0.5]))
    # integer tensor keys behave like the same list of ints
    tk = torch.tensor([3, 3, 9, 9])
    torch.testing.assert_close(dr_grpo_advantages(r, tk), dr_grpo_advantages(r, [3, 3, 9, 9]))
    torch.testing.assert_close(dr_grpo_advantages(r, tk), torch.tensor([0.5, -0.5, -0.5, 0.5]))


def test_zero_variance_report():
    assert zero_variance_groups(REWARDS, KEYS) == ["c", "d"]
    assert zero_variance_groups(REWARDS, KEYS, include_singletons=False) == ["d"]
    mask = zero_variance_mask(REWARDS, KEYS)
    assert mask.tolist() == [False, False, False, True, False, False, True, True, True]
    mask = zero_variance_mask(REWARDS, KEYS, include_singletons=False)
    assert mask.tolist() == [False, False, False, False, False, False, True, True, True]


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="one group key each"):
        grpo_advantages(REWARDS, KEYS[:-1])
