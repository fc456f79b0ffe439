"""Credit: each model call's reward under `algorithm.reward`, its advantage group under
`algorithm.group_key`, and the advantages (episodes counted once per group; GRPO's std per role under
`algorithm.norm: role`). docs/TRAINING.md "Per-role credit" says why each rule is what it is."""

from __future__ import annotations

import logging
from collections import Counter, defaultdict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from rolerl.algorithms import ADVANTAGES, role_normalised_advantages
from rolerl.config import AlgorithmConfig
from rolerl.types import Episode, Turn

log = logging.getLogger(__name__)
_WARNED: set[tuple[str, ...]] = set()  # mixed groups already reported, by their roles (once a process)


@dataclass
class Credit:
    """Every model call of a step with its reward, advantage group, episode (the unit that counts once
    in a group's statistics) and role."""

    turns: list[Turn]
    rewards: torch.Tensor  # (N,) float64
    keys: list[Hashable]  # advantage group of each call
    units: list[Hashable]  # the unit that counts once in its group: the episode, or the call (siblings)
    roles: list[str]


def turn_rewards(episodes: Sequence[Episode], alg: AlgorithmConfig | str) -> Credit:
    """Every call's reward under `alg.reward` and its advantage group under `alg.group_key`: `task`,
    `(task, role)` or `(task, role, k)` for the k-th call of that role in its episode. A call with a
    `Turn.group` is in its episode's sibling group `(task, episode, role, group)` instead, where each call
    counts once (MSARL's n tool-agent samples of one request, compared with each other).

    Rewards: `outcome` = the episode's; `role` = the call's own `Turn.reward`, else its role's
    `Episode.role_rewards`, else the outcome; `mix` = `mix_alpha` x outcome + the call's or role's own
    reward (0 when it has none: the multi-agent frameworks' team + local credit)."""
    if isinstance(alg, str):  # a bare group key: the default credit rule
        alg = AlgorithmConfig(group_key=alg)  # type: ignore[arg-type]
    turns, rewards, keys, units, roles = [], [], [], [], []
    owners: defaultdict[Hashable, set[str]] = defaultdict(set)  # task group -> roles with their own reward
    shared: defaultdict[Hashable, set[str]] = defaultdict(set)  # task group -> every role in it
    for e, ep in enumerate(episodes):
        seen: Counter[str] = Counter()
        for turn in ep.turns:
            own = turn.reward if turn.reward is not None else ep.role_rewards.get(turn.role)
            if alg.reward == "outcome":
                reward = ep.reward
            elif alg.reward == "role":
                reward = own if own is not None else ep.reward
            else:
                reward = alg.mix_alpha * ep.reward + (own if own is not None else 0.0)
            turns.append(turn)
            rewards.append(reward)
            units.append(e if turn.group is None else (e, len(turns)))
            roles.append(turn.role)
            if turn.group is not None:
                keys.append((ep.task_id, e, turn.role, turn.group))
            elif alg.group_key == "task":
                keys.append(ep.task_id)
                shared[ep.task_id].add(turn.role)
                if own is not None and alg.reward != "outcome":
                    owners[ep.task_id].add(turn.role)
            elif alg.group_key == "role":
                keys.append((ep.task_id, turn.role))
            else:
                keys.append((ep.task_id, turn.role, seen[turn.role]))
                seen[turn.role] += 1
    _warn_mixed(shared, owners)
    return Credit(turns, torch.tensor(rewards, dtype=torch.float64), keys, units, roles)


def _warn_mixed(shared: dict[Hashable, set[str]], owners: dict[Hashable, set[str]]) -> None:
    """Say (once a process) when a `group_key: task` group holds several roles and one of them is scored by
    its own reward: its advantages then compare one role's reward with another's (MSARL's graded coder
    reward in the reasoner's group: the reasoner's advantages averaged -4 to -14 where nearly every episode
    failed)."""
    for key, present in shared.items():
        if len(present) > 1 and owners.get(key):
            roles = tuple(sorted(present))
            if roles not in _WARNED:
                _WARNED.add(roles)
                log.warning(
                    "algorithm.group_key=task puts roles %s in one advantage group while %s score by their own "
                    "reward (algorithm.reward=role or mix): each call is compared with the other roles' rewards. "
                    "algorithm.group_key=role compares each role with itself", list(roles), sorted(owners[key]),
                )  # fmt: skip


def advantages_of(alg: AlgorithmConfig, credit: Credit) -> torch.Tensor:
    """Advantages of every call: `alg.advantage` over the groups, episodes counted once per group; with
    `alg.norm: role`, GRPO's std per role (`role_normalised_advantages`)."""
    if alg.norm == "role":
        return role_normalised_advantages(credit.rewards, credit.keys, credit.roles, units=credit.units)
    return ADVANTAGES[alg.advantage](credit.rewards, credit.keys, units=credit.units)
