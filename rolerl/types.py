"""The records stages pass: `Turn` (one model call), `Episode`, `Group`, and the padded `TrainBatch`.

`Turn` keeps the engine's exact token ids, each completion token's kind and each position's route;
training uses those, never a re-tokenisation of text (DESIGN "every token carries its role").
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import torch

from rolerl.roles import KIND_INDEX, KINDS, POLICY_KINDS, PROMPT, shift

FinishReason = Literal["stop", "eos", "length", "tool_limit", "error"]
FINISH_REASONS: tuple[str, ...] = get_args(FinishReason)


@dataclass
class ToolCall:
    """One tool call made inside a turn and the output spliced back."""

    name: str  # the tool's name ("python", "search")
    args: str  # the call's body as the model wrote it between the tool tags (code, query)
    output: str = ""  # the text spliced in (after formatting and truncation to the budget)
    error: bool = (
        False  # the call did not succeed: the code failed, the call was malformed, or the tool failed
    )
    tool_failed: bool = False  # the tool itself failed (raised); its error is what the model saw
    timed_out: bool = False
    wall_s: float = 0.0
    start: int = -1  # spliced output = completion_ids[start:end]; -1 if nothing was spliced
    end: int = -1


@dataclass
class Turn:
    """One model call. Positions are those of `ids = prompt_ids + completion_ids`."""

    role: str
    prompt_ids: list[int]
    completion_ids: list[int]
    kinds: list[str]  # one per completion token; prompt tokens are implicitly "prompt"
    routes: list[int]  # one per position of `ids`: `shift(all_kinds, route_of)`
    # One per completion token: log_softmax(logits / T) of the sampled token. Forced tokens (tool output)
    # were not sampled and get NaN, so that using one by mistake shows up rather than reading as p = 1.
    logprobs: list[float]
    finish_reason: FinishReason = "stop"
    tool_calls: list[ToolCall] = field(default_factory=list)
    # this call's own reward (a workflow may score each voter, each worker); None = its role's or the
    # episode's (`algorithm.reward`)
    reward: float | None = None
    # sibling group: the calls of one episode with the same `group` (n samples of one request) form an
    # advantage group of their own, each call counted once, instead of `algorithm.group_key`'s group
    group: Hashable | None = None
    # One per completion token: the version of the adapter that sampled it (that adapter's optimizer step
    # count when the engine held its weights; the adapter is the route of the position predicting the
    # token). Forced tokens (tool output) and base-routed ones get -1. Empty = unknown (a Turn written
    # before versions were recorded): read as version 0 (`version_list`).
    versions: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        n, m = len(self.completion_ids), len(self.prompt_ids) + len(self.completion_ids)
        if len(self.kinds) != n or len(self.logprobs) != n or len(self.routes) != m:
            raise ValueError(
                f"Turn lengths disagree: {n} completion ids, {len(self.kinds)} kinds, {len(self.logprobs)} "
                f"logprobs (need {n}); {len(self.routes)} routes (need {m}, one per prompt+completion id)"
            )
        if self.versions and len(self.versions) != n:
            raise ValueError(
                f"Turn has {len(self.versions)} versions for {n} completion ids (need {n} or none)"
            )
        bad = set(self.kinds) - set(KINDS)
        if bad:
            raise ValueError(f"Turn.kinds has unknown kinds {sorted(bad)}; allowed: {list(KINDS)}")
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"Turn.finish_reason={self.finish_reason!r}; allowed: {list(FINISH_REASONS)}")

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.completion_ids

    @property
    def all_kinds(self) -> list[str]:
        """One kind per position of `ids`."""
        return [PROMPT] * len(self.prompt_ids) + self.kinds

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)

    def version_list(self) -> list[int]:
        """One version per completion token; 0 for every token of a Turn that recorded none."""
        return list(self.versions) if self.versions else [0] * len(self.completion_ids)

    def check_routes(self, route_of: Mapping[str, int] | None = None) -> None:
        """Raise unless `routes == shift(all_kinds, route_of)`. Without `route_of`, the table is read off
        the stored routes (the route of the first position predicting each kind) and must be consistent."""
        kinds = self.all_kinds
        if route_of is None:
            route_of = {}
            for p in range(len(kinds)):
                route_of.setdefault(kinds[min(p + 1, len(kinds) - 1)], self.routes[p])
        expected = shift(kinds, route_of)
        if expected != self.routes:
            p = next(i for i, (a, b) in enumerate(zip(expected, self.routes, strict=True)) if a != b)
            raise ValueError(
                f"Turn(role={self.role!r}) stores route {self.routes[p]} at position {p} but shift() gives "
                f"{expected[p]} (predicting a {kinds[min(p + 1, len(kinds) - 1)]!r} token)"
            )


def versions_to_runs(versions: Sequence[int]) -> list[list[int]]:
    """`[[version, count], ...]`: per-token versions run-length encoded for files (a turn's tokens mostly
    share one version: one pair per turn, two for a turn sampled across a weight sync)."""
    runs: list[list[int]] = []
    for v in versions:
        if runs and runs[-1][0] == v:
            runs[-1][1] += 1
        else:
            runs.append([int(v), 1])
    return runs


def runs_to_versions(runs: Sequence[Sequence[int]] | None) -> list[int]:
    """The inverse of `versions_to_runs`; None (a file written before versions) gives [] (unknown)."""
    return [int(v) for v, count in runs or () for _ in range(int(count))]


@dataclass
class Episode:
    """The turns of one workflow run on one task sample, and its rewards."""

    task_id: str
    turns: list[Turn]
    reward: float = 0.0  # the task's outcome reward
    role_rewards: dict[str, float] = field(default_factory=dict)  # per-role rewards, when a workflow has them
    metadata: dict[str, Any] = field(default_factory=dict)  # tool errors, truncation, the answer text...

    def own_reward(self, turn: Turn) -> float:
        """A call's own reward: its `Turn.reward`, else its role's, else the episode's outcome."""
        return turn.reward if turn.reward is not None else self.role_rewards.get(turn.role, self.reward)


@dataclass
class Group:
    """The episodes that share an advantage baseline (GRPO group); `key` is e.g. the task id."""

    key: Hashable
    episodes: list[Episode]


@dataclass
class TrainBatch:
    """Right-padded tensors. Column `p` of `loss_mask`, `advantages` and `old_logp` is about the token at
    `p + 1` (the one position `p` predicts), the same alignment as `routes`; the last column is always 0.
    Slice `[:, :-1]` to line them up with `chunked_logprobs(hidden[:, :-1], input_ids[:, 1:])`."""

    input_ids: torch.Tensor  # (B, T) long, pad_id at pads
    attention_mask: torch.Tensor  # (B, T) long, 1 on real tokens
    routes: torch.Tensor  # (B, T) long adapter index per position, -1 at pads
    kind_ids: torch.Tensor  # (B, T) long KIND_INDEX of the token at p (not shifted), -1 at pads
    loss_mask: torch.Tensor  # (B, T) float, 1 where token p+1 is a policy kind
    advantages: torch.Tensor  # (B, T) float advantage of token p+1, 0 off the loss mask
    old_logp: torch.Tensor  # (B, T) float sampling log-prob of token p+1, 0 off the loss mask
    role_index: torch.Tensor  # (B, T) long index into `role_names` of the row's role, -1 at pads
    roles: list[str]  # (B,) role of each sequence
    role_names: list[str]  # role_index -> role name
    weights: torch.Tensor  # (B,) float64 per-sequence loss weight (cast to the loss's dtype when applied)

    def to(self, device: torch.device | str) -> TrainBatch:
        moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in vars(self).items()}
        return TrainBatch(**moved)


def collate(
    turns: Sequence[Turn],
    advantages: Sequence[float | Sequence[float]],
    route_of: Mapping[str, Mapping[str, int]] | None = None,
    *,
    weights: Sequence[float] | None = None,
    role_names: Sequence[str] | None = None,
    pad_id: int = 0,
    loss_kinds: Mapping[str, Collection[str]] | None = None,
) -> TrainBatch:
    """Pad `turns` into a `TrainBatch`.

    `advantages[i]` is one float for the whole turn or one per completion token. `route_of[role]` is the
    role's `kind -> route` map (`Topology.route_of`); each turn's stored routes must equal `shift` of it
    (without `route_of` they must at least be a `shift` of some table). `role_names` fixes the role
    index order (default: sorted roles of the batch). `loss_kinds[role]` narrows the kinds that carry loss
    (`Topology.loss_kinds`, the `masked` preset; default: every policy kind); routes are never changed.
    """
    if len(advantages) != len(turns):
        raise ValueError(f"{len(advantages)} advantages for {len(turns)} turns")
    names = list(role_names) if role_names is not None else sorted({t.role for t in turns})
    b, t_max = len(turns), max((len(t) for t in turns), default=0)
    input_ids = torch.full((b, t_max), pad_id, dtype=torch.long)  # (B, T)
    attention_mask = torch.zeros(b, t_max, dtype=torch.long)  # (B, T)
    routes = torch.full((b, t_max), -1, dtype=torch.long)  # (B, T)
    kind_ids = torch.full((b, t_max), -1, dtype=torch.long)  # (B, T)
    role_index = torch.full((b, t_max), -1, dtype=torch.long)  # (B, T)
    loss_mask = torch.zeros(b, t_max)  # (B, T)
    adv = torch.zeros(b, t_max)  # (B, T)
    old_logp = torch.zeros(b, t_max)  # (B, T)
    for i, turn in enumerate(turns):
        turn.check_routes(None if route_of is None else route_of[turn.role])
        n, n_prompt = len(turn), len(turn.prompt_ids)
        input_ids[i, :n] = torch.tensor(turn.ids, dtype=torch.long)
        attention_mask[i, :n] = 1
        routes[i, :n] = torch.tensor(turn.routes, dtype=torch.long)
        kind_ids[i, :n] = torch.tensor([KIND_INDEX[k] for k in turn.all_kinds], dtype=torch.long)
        if turn.role not in names:
            raise ValueError(f"turn role {turn.role!r} is not in role_names {names}")
        role_index[i, :n] = names.index(turn.role)
        a = advantages[i]
        per_token = [float(a)] * len(turn.kinds) if isinstance(a, (int, float)) else [float(x) for x in a]
        if len(per_token) != len(turn.kinds):
            raise ValueError(f"turn {i}: {len(per_token)} advantages for {len(turn.kinds)} completion tokens")
        # Completion token j sits at position n_prompt + j and is predicted by position n_prompt + j - 1
        # (with no prompt, nothing predicts the first completion token: it carries no loss).
        skip = 1 if n_prompt == 0 else 0
        policy = torch.tensor([k in POLICY_KINDS for k in turn.kinds[skip:]], dtype=torch.bool)  # (n_c,)
        lp = torch.tensor(turn.logprobs[skip:], dtype=torch.float32)  # (n_c,)
        if bool(torch.isnan(lp[policy]).any()):
            raise ValueError(f"turn {i} ({turn.role!r}): a sampled token has a NaN log-prob")
        cols = slice(n_prompt + skip - 1, n - 1)
        trained = policy
        if loss_kinds is not None and turn.role in loss_kinds:
            keep = loss_kinds[turn.role]
            trained = torch.tensor([k in keep for k in turn.kinds[skip:]], dtype=torch.bool) & policy
        loss_mask[i, cols] = trained.float()
        adv[i, cols] = torch.where(policy, torch.tensor(per_token[skip:], dtype=torch.float32), 0.0)
        old_logp[i, cols] = torch.where(policy, lp, 0.0)
    if weights is not None and len(weights) != b:
        raise ValueError(f"{len(weights)} weights for {b} turns")
    # float64: role-share factors (2/3, 12/19...) multiply these, and a role's share should be exact
    w = torch.tensor(
        [1.0] * b if weights is None else [float(x) for x in weights], dtype=torch.float64
    )  # (B,)
    return TrainBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        routes=routes,
        kind_ids=kind_ids,
        loss_mask=loss_mask,
        advantages=adv,
        old_logp=old_logp,
        role_index=role_index,
        roles=[t.role for t in turns],
        role_names=names,
        weights=w,
    )
