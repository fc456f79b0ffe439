"""Gradient conflict between token kinds (or roles), DART's measurement generalised (PAPERS 2.4).

For each trajectory (an episode: all its model calls) and each group of its tokens (a policy kind:
reasoning, tool call, answer; or a role), the *partial gradient* from that group's tokens only: the
gradient of their mean negative log-likelihood (the direction in which RL would raise their probability;
an advantage only scales it, and would flip its sign) with respect to a chosen parameter set, one backward
per group over one forward of each call. Two distributions are then compared, as in DART:

- **same group across trajectories** of one query: `angle(g_k(tau_i), g_k(tau_j))`, i != j (the baseline:
  how aligned one kind's gradient is with itself);
- **across groups within a trajectory**: `angle(g_a(tau_i), g_b(tau_i))`.

Every angle is given overall, per layer and per module (the LoRA-wrapped linear, or a weight): an overall
cosine near 0 can hide modules that conflict (cosine < 0) and modules that cooperate, so each pair also
reports the share of its modules in conflict. The overall cosine is the norm-weighted sum of the module
cosines: `cos = sum_m |a_m| |b_m| cos_m / (|a| |b|)`.

`autograd.grad` never touches `.grad`, so a measurement leaves the model, an optimizer and its state as
they were.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from rolerl.roles import KINDS, POLICY_KINDS
from rolerl.train.grad_conflict import Angle, ModuleGrads, cosine, module_of
from rolerl.train.policy import token_logprobs
from rolerl.types import Episode, collate


def select_params(model: nn.Module, which: str) -> dict[str, nn.Parameter]:
    """`adapters` = every LoRA parameter, an adapter's name = that adapter's, `all` = every weight."""
    named = dict(model.named_parameters())
    if which == "all":
        return named
    lora = {n: p for n, p in named.items() if ".lora_A." in n or ".lora_B." in n}
    if which != "adapters":
        lora = {n: p for n, p in lora.items() if n.endswith(f".{which}")}
    if not lora:
        adapters = sorted({n.rsplit(".", 1)[1] for n in named if ".lora_A." in n})
        raise ValueError(
            f"--params {which!r} selects no parameter; allowed: adapters, all, or one of {adapters}"
        )
    return lora


def episode_gradients(
    model: nn.Module,
    episode: Episode,
    route_of: Mapping[str, Mapping[str, int]],
    params: Mapping[str, nn.Parameter],
    *,
    group_by: str = "kind",
    temperature: float = 1.0,
) -> dict[str, ModuleGrads]:
    """Each group's partial gradient over the episode's calls (`group_by`: `kind` or `role`): the gradient
    of the mean NLL of the group's tokens, by module. Groups without tokens are absent."""
    names, tensors = list(params), list(params.values())
    was = [p.requires_grad for p in tensors]
    for p in tensors:
        p.requires_grad_(True)
    sums: dict[str, list[torch.Tensor | None]] = {}
    counts: dict[str, int] = {}
    try:
        for turn in episode.turns:
            batch = collate([turn], [0.0], route_of)
            with torch.enable_grad():
                scored = token_logprobs(model, batch, temperature=temperature, share_prefix=False)
                logp = scored.logp[0]  # (T-1,)
                on = batch.loss_mask[0, :-1].bool()  # (T-1,) column p is about token p + 1
                kinds = batch.kind_ids[0, 1:]  # (T-1,)
                groups = {turn.role: on} if group_by == "role" else {
                    KINDS[k]: on & (kinds == k) for k in range(len(KINDS)) if KINDS[k] in POLICY_KINDS
                }  # fmt: skip
                groups = {g: m for g, m in groups.items() if bool(m.any())}
                for i, (group, mask) in enumerate(groups.items()):
                    grads = torch.autograd.grad(
                        -logp[mask].sum(), tensors, retain_graph=i < len(groups) - 1, allow_unused=True
                    )
                    acc = sums.setdefault(group, [None] * len(tensors))
                    for j, g in enumerate(grads):
                        if g is not None:
                            acc[j] = g.detach().float() if acc[j] is None else acc[j] + g.detach().float()
                    counts[group] = counts.get(group, 0) + int(mask.sum())
    finally:
        for p, w in zip(tensors, was, strict=True):
            p.requires_grad_(w)
    out: dict[str, ModuleGrads] = {}
    for group, acc in sums.items():
        by_module: dict[str, list[torch.Tensor]] = {}
        for name, p, g in zip(names, tensors, acc, strict=True):
            flat = (g if g is not None else torch.zeros(p.shape)).flatten() / counts[group]
            by_module.setdefault(module_of(name), []).append(flat)
        out[group] = {m: torch.cat(parts) for m, parts in by_module.items()}
    return out


@dataclass
class Pair:
    comparison: str  # "same" (one group, two trajectories) or "cross" (two groups, one trajectory)
    a: str
    b: str
    query: str
    i: int
    j: int
    angle: Angle


@dataclass
class ConflictReport:
    pairs: list[Pair] = field(default_factory=list)
    # same-group pairs left out because the two gradients are bitwise equal: the trajectories sampled the
    # same tokens (a confident model often does), which says nothing about how two *different* samples align
    duplicates: dict[str, int] = field(default_factory=dict)

    def add(self, query: str, gradients: Sequence[Mapping[str, ModuleGrads]]) -> None:
        """The pairs of one query's trajectories (`gradients[i]`: group -> module grads of trajectory i)."""
        groups = sorted({g for grads in gradients for g in grads}, key=_group_order)
        for g in groups:
            for i, j in itertools.combinations(range(len(gradients)), 2):
                if g in gradients[i] and g in gradients[j]:
                    if all(torch.equal(gradients[i][g][m], gradients[j][g][m]) for m in gradients[i][g]):
                        self.duplicates[g] = self.duplicates.get(g, 0) + 1
                        continue
                    self._pair("same", g, g, query, i, j, gradients[i][g], gradients[j][g])
        for i, grads in enumerate(gradients):
            for a, b in itertools.combinations([g for g in groups if g in grads], 2):
                self._pair("cross", a, b, query, i, i, grads[a], grads[b])

    def _pair(self, comparison, a, b, query, i, j, ga, gb) -> None:
        angle = cosine(ga, gb)
        if angle is not None:
            self.pairs.append(Pair(comparison, a, b, query, i, j, angle))

    def summary(self) -> list[dict[str, float | str]]:
        """One row per (comparison, a, b): pairs, mean and median angle, share under 30 degrees, mean
        cosine, mean share of modules in conflict."""
        rows = []
        for key, pairs in _by(self.pairs, lambda p: (p.comparison, p.a, p.b)).items():
            degrees = sorted(p.angle.degrees for p in pairs)
            rows.append({
                "comparison": key[0], "a": key[1], "b": key[2], "pairs": len(pairs),
                "identical_pairs_left_out": self.duplicates.get(key[1], 0) if key[0] == "same" else 0,
                "mean_angle": sum(degrees) / len(degrees), "median_angle": _median(degrees),
                "under_30": sum(d < 30 for d in degrees) / len(degrees),
                "mean_cos": sum(p.angle.cos for p in pairs) / len(pairs),
                "conflict_frac": sum(p.angle.conflict_frac for p in pairs) / len(pairs),
            })  # fmt: skip
        return rows

    def layers(self) -> list[dict[str, float | str]]:
        """Per layer and (comparison, a, b): mean cosine, the share of pairs where it is negative."""
        return self._breakdown("layer", lambda angle: angle.layers)

    def modules(self) -> list[dict[str, float | str]]:
        """Per module and (comparison, a, b): mean cosine, the share of pairs where it is negative."""
        return self._breakdown("module", lambda angle: angle.modules)

    def _breakdown(self, column: str, values_of) -> list[dict[str, float | str]]:
        rows = []
        for key, pairs in _by(self.pairs, lambda p: (p.comparison, p.a, p.b)).items():
            for name in sorted({n for p in pairs for n in values_of(p.angle)}):
                values = [values_of(p.angle)[name] for p in pairs if name in values_of(p.angle)]
                rows.append({"comparison": key[0], "a": key[1], "b": key[2], column: name,
                             "mean_cos": sum(values) / len(values), "pairs": len(values),
                             "conflict_share": sum(v < 0 for v in values) / len(values)})  # fmt: skip
        return rows


def _group_order(group: str) -> tuple[int, str]:
    return (KINDS.index(group) if group in KINDS else len(KINDS), group)


def _by(items: Iterable, key) -> dict:
    out: dict = {}
    for item in items:
        out.setdefault(key(item), []).append(item)
    return out


def _median(sorted_values: Sequence[float]) -> float:
    n = len(sorted_values)
    return (sorted_values[(n - 1) // 2] + sorted_values[n // 2]) / 2
