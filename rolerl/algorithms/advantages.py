"""Outcome-reward advantages over configurable groups: GRPO, Dr. GRPO, RLOO.

Every estimator takes one scalar reward per episode (or per role call) and one group key per episode,
and returns one advantage per episode; the loop broadcasts it to that episode's policy tokens. A group
key is any hashable (a task id, `(task_id, role)`, `(task_id, role, instance)`...) so the caller
decides what "the group" is (DESIGN: `Group`; PAPERS 1.4: verl groups by `{task}_{trajectory}_step{k}`).

Two kinds of group carry no learning signal and get an advantage of exactly 0.0 in every estimator:

- **singleton groups** (one member): there is nothing to compare against. verl gives these mean 0 and
  std 1, i.e. an advantage equal to the raw reward; with 0/1 rewards that pushes up every singleton
  sample regardless of quality, so we deliberately differ.
- **zero-variance groups** (all rewards bitwise equal: solve-all / solve-none): `r - mean` is 0 in exact
  arithmetic, but a float mean such as `(0.7 + 0.7 + 0.7) / 3` need not equal 0.7, and GRPO would then
  divide that rounding error by `std + eps ~ eps` and produce O(0.1) noise advantages. We set 0.0
  explicitly. `zero_variance_groups` / `zero_variance_mask` report these so the loop can drop them (DAPO's
  dynamic sampling filters them; verl keeps them with zero advantage).

**Units.** A workflow episode can make several calls that land in one group (three voter calls under
`group_key: task`). Counted per call, an episode with more calls would weigh more in its group's mean
and std, and a group of n episodes would look like more than n samples. With `units` (the episode of
each call) each episode counts once: its value is the mean of its calls' rewards, the group statistics
are over episodes, and each call's advantage is its own reward minus the episode-level baseline (RLOO
leaves out the call's whole episode). With outcome rewards this is exactly episode-level GRPO.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import torch
from torch import Tensor

GroupKeys = Sequence[Hashable] | Tensor
AdvantageFn = Callable[[Tensor, GroupKeys], Tensor]


def group_index(group_keys: GroupKeys) -> tuple[Tensor, list[Hashable]]:
    """Map keys to dense group ids in order of first appearance: `(ids (N,), keys_of_each_id (G,))`."""
    keys = group_keys.tolist() if isinstance(group_keys, Tensor) else list(group_keys)
    first: dict[Hashable, int] = {}
    ids = [first.setdefault(k, len(first)) for k in keys]
    return torch.tensor(ids, dtype=torch.long), list(first)


def _group_moments(rewards: Tensor, ids: Tensor, n_groups: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per-episode group count, mean, unbiased std and a zero-signal flag, all `(N,)`, in float64."""
    r = rewards.detach().to(torch.float64)  # (N,) float64 so the mean of a group is as exact as it gets
    count = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, ids, torch.ones_like(r))  # (G,)
    mean = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, ids, r) / count  # (G,)
    sq = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, ids, (r - mean[ids]) ** 2)  # (G,)
    # Unbiased (n - 1) std, as torch.std and verl's compute_grpo_outcome_advantage use.
    std = (sq / (count - 1).clamp(min=1)).sqrt()  # (G,)
    lo = torch.full((n_groups,), float("inf"), dtype=torch.float64).scatter_reduce_(0, ids, r, "amin")
    hi = torch.full((n_groups,), float("-inf"), dtype=torch.float64).scatter_reduce_(0, ids, r, "amax")
    no_signal = (count < 2) | (lo == hi)  # (G,) singleton or all rewards bitwise equal
    return count[ids], mean[ids], std[ids], no_signal[ids]


def _moments(
    rewards: Tensor, ids: Tensor, n_groups: int, units: Sequence[Hashable] | None
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """`_group_moments` where each *unit* (e.g. an episode) counts once: a unit's value is the mean of its
    members' rewards in the group, and count, mean and std are over units. Returns per member `(N,)`:
    unit count, mean, std, no-signal flag and the member's unit value. `units=None`: every member is a
    unit (exactly `_group_moments`)."""
    if units is None:
        count, mean, std, no_signal = _group_moments(rewards, ids, n_groups)
        return count, mean, std, no_signal, rewards.detach().to(torch.float64)
    if len(units) != len(ids):
        raise ValueError(f"{len(units)} unit keys for {len(ids)} rewards")
    uid, pairs = group_index([(g, u) for g, u in zip(ids.tolist(), units, strict=True)])  # (N,), (U,)
    r = rewards.detach().to(torch.float64)
    size = torch.zeros(len(pairs), dtype=torch.float64).index_add_(0, uid, torch.ones_like(r))  # (U,)
    value = torch.zeros(len(pairs), dtype=torch.float64).index_add_(0, uid, r) / size  # (U,)
    owner = torch.tensor([g for g, _ in pairs], dtype=torch.long)  # (U,) group of each unit
    count, mean, std, no_signal = (x[uid] for x in _group_moments(value, owner, n_groups))
    flat = _group_moments(rewards, ids, n_groups)[3]  # members all bitwise equal
    return count, mean, std, no_signal | flat, value[uid]


def _check(rewards: Tensor, ids: Tensor) -> None:
    if rewards.dim() != 1 or rewards.shape[0] != ids.shape[0]:
        raise ValueError(
            f"rewards must be (N,) with one group key each; got {tuple(rewards.shape)} "
            f"rewards and {ids.shape[0]} keys"
        )


def grpo_advantages(
    rewards: Tensor, group_keys: GroupKeys, *, units: Sequence[Hashable] | None = None, eps: float = 1e-6
) -> Tensor:
    """GRPO: `A_i = (r_i - mean_g) / (std_g + eps)`, unbiased std (DeepSeekMath, outcome supervision;
    verl `grpo`).

    `units[i]` (e.g. the episode of a model call): members of one unit count once in the group's mean and
    std (module docstring). Singleton and zero-variance groups get exactly 0.0. Returns `(N,)` in the
    rewards' dtype, detached.
    """
    ids, keys = group_index(group_keys)
    _check(rewards, ids)
    _, mean, std, no_signal, _ = _moments(rewards, ids, len(keys), units)
    adv = (rewards.detach().to(torch.float64) - mean) / (std + eps)  # (N,)
    return adv.masked_fill(no_signal, 0.0).to(rewards.dtype)


def dr_grpo_advantages(
    rewards: Tensor, group_keys: GroupKeys, *, units: Sequence[Hashable] | None = None
) -> Tensor:
    """Dr. GRPO: `A_i = r_i - mean_g`, no std division (Liu et al. 2025, "Understanding R1-Zero-Like
    Training": the std term up-weights too-easy and too-hard questions).

    Pair it with `seq-mean-token-sum-norm` aggregation to drop GRPO's length bias as well. Singleton and
    zero-variance groups get exactly 0.0. Returns `(N,)`, detached.
    """
    ids, keys = group_index(group_keys)
    _check(rewards, ids)
    _, mean, _, no_signal, _ = _moments(rewards, ids, len(keys), units)
    adv = rewards.detach().to(torch.float64) - mean  # (N,)
    return adv.masked_fill(no_signal, 0.0).to(rewards.dtype)


def rloo_advantages(
    rewards: Tensor, group_keys: GroupKeys, *, units: Sequence[Hashable] | None = None
) -> Tensor:
    """RLOO: `A_i = r_i - mean_{j != i} r_j = n / (n - 1) * (r_i - mean_g)` (Ahmadian et al. 2024,
    "Back to Basics"; verl `rloo`). The leave-one-out baseline does not depend on `r_i`, so the estimator
    is unbiased. Singleton groups (no other member to form a baseline) and zero-variance groups get
    exactly 0.0. Returns `(N,)`, detached.
    """
    ids, keys = group_index(group_keys)
    _check(rewards, ids)
    count, mean, _, no_signal, value = _moments(rewards, ids, len(keys), units)
    r = rewards.detach().to(torch.float64)
    if units is None:
        adv = (r - mean) * count / (count - 1).clamp(min=1)  # (N,)
    else:  # the baseline leaves out the member's whole unit: the mean of the other units' values
        adv = r - (count * mean - value) / (count - 1).clamp(min=1)
    return adv.masked_fill(no_signal, 0.0).to(rewards.dtype)


def role_normalised_advantages(
    rewards: Tensor,
    group_keys: GroupKeys,
    roles: Sequence[Hashable],
    *,
    units: Sequence[Hashable] | None = None,
    eps: float = 1e-6,
) -> Tensor:
    """GRPO with the std per role (`algorithm.norm: role`, Dr. MAS's per-agent normalisation):
    `A_i = (r_i - mean_g) / (std_role(i) + eps)`, where `std_role` is the unbiased std of the centred
    rewards `r_j - mean_g(j)` over that role's members in groups with signal. A role whose rewards barely
    vary no longer gets advantages blown up by a tiny group std, and every role's advantages have unit
    scale. Groups without signal still get exactly 0.0."""
    centred = dr_grpo_advantages(rewards, group_keys, units=units).to(torch.float64)  # (N,)
    ids, keys = group_index(group_keys)
    no_signal = _moments(rewards, ids, len(keys), units)[3]
    out = torch.zeros_like(centred)
    for role in dict.fromkeys(roles):
        mine = torch.tensor([r == role for r in roles]) & ~no_signal  # (N,)
        if int(mine.sum()) >= 2:
            out[mine] = centred[mine] / (centred[mine].std() + eps)
    return out.to(rewards.dtype)


ADVANTAGES: dict[str, AdvantageFn] = {
    "grpo": grpo_advantages,
    "dr_grpo": dr_grpo_advantages,
    "rloo": rloo_advantages,
}


def zero_variance_mask(rewards: Tensor, group_keys: GroupKeys, *, include_singletons: bool = True) -> Tensor:
    """`(N,)` bool: True for episodes whose group has no reward spread (all rewards bitwise equal).

    With `include_singletons` (default) one-member groups count too, since every estimator gives them
    0.0 as well; this is the set whose advantages are identically zero and whose tokens only add KL and
    entropy terms. The loop uses it to filter (DAPO dynamic sampling) or just to log the fraction.
    """
    ids, keys = group_index(group_keys)
    _check(rewards, ids)
    count, _, _, no_signal = _group_moments(rewards, ids, len(keys))
    return no_signal if include_singletons else no_signal & (count >= 2)


def zero_variance_groups(
    rewards: Tensor, group_keys: GroupKeys, *, include_singletons: bool = True
) -> list[Hashable]:
    """The keys of the groups `zero_variance_mask` flags, in order of first appearance."""
    ids, keys = group_index(group_keys)
    mask = zero_variance_mask(rewards, group_keys, include_singletons=include_singletons)
    flagged = set(ids[mask].tolist())
    return [k for g, k in enumerate(keys) if g in flagged]
