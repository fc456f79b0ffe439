"""Per-role (or per-kind) gradients on each adapter during training, the cosine between two groups'
gradients on a shared adapter and the share of its modules where they conflict (`diagnostics.grad_every`,
`diagnostics.grad_groups`; PAPERS: a role's share of a shared adapter's update is set by the averaging
rule, and roles, or reasoning and tool use, whose gradients point apart interfere).

One backward per group over that group's tokens with the step's PPO loss and advantages, with the group's
own normaliser (its loss as if it trained alone), at the weights the step's rollout used; the gradients are
cleared afterwards, so the update that follows is unchanged (it costs one extra forward and backward per
group). `rolerl diagnose grad-conflict` is the standalone, per-trajectory measurement
(`rolerl.diagnostics.conflict`, built on `cosine` here).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rolerl.algorithms import AggNorm
from rolerl.roles import KIND_INDEX, KINDS, POLICY_KINDS
from rolerl.train.distributed import SINGLE, Dist
from rolerl.train.optim import Optimizer
from rolerl.train.policy import select_rows
from rolerl.train.update import Aligned, LossSettings, Part, accumulate_gradients
from rolerl.types import TrainBatch

ModuleGrads = dict[str, torch.Tensor]  # module name -> its parameters' gradient, flattened (float32)
_LAYER = re.compile(r"layers\.(\d+)\.")


def module_of(param_name: str) -> str:
    """The module a parameter belongs to: `...q_proj.lora_A.tool` -> `...q_proj`, `...q_proj.weight` ->
    `...q_proj`."""
    name = re.sub(r"\.lora_[AB]\.[^.]+$", "", param_name)
    return re.sub(r"\.(weight|bias)$", "", name)


def layer_of(module: str) -> str:
    m = _LAYER.search(module)
    return f"layer {int(m.group(1)):02d}" if m else "other"


@dataclass
class Angle:
    """One pair of partial gradients: overall cosine, per layer and per module, and the share of modules
    whose cosine is negative (among modules where both gradients are nonzero)."""

    cos: float
    layers: dict[str, float]
    modules: dict[str, float]
    conflict_frac: float

    @property
    def degrees(self) -> float:
        return math.degrees(math.acos(max(-1.0, min(1.0, self.cos))))


def cosine(a: ModuleGrads, b: ModuleGrads) -> Angle | None:
    """The angle between two gradients given by module (None if either is zero)."""
    dots = {m: float(a[m].double() @ b[m].double()) for m in a}
    na = {m: float(a[m].double().norm()) for m in a}
    nb = {m: float(b[m].double().norm()) for m in b}
    total_a, total_b = math.sqrt(sum(x * x for x in na.values())), math.sqrt(sum(x * x for x in nb.values()))
    if total_a == 0 or total_b == 0:
        return None
    modules = {m: dots[m] / (na[m] * nb[m]) for m in a if na[m] > 0 and nb[m] > 0}
    layers: dict[str, list[float]] = {}
    for m in a:
        layers.setdefault(layer_of(m), []).append(m)
    per_layer = {}
    for layer, ms in sorted(layers.items()):
        la = math.sqrt(sum(na[m] ** 2 for m in ms))
        lb = math.sqrt(sum(nb[m] ** 2 for m in ms))
        if la > 0 and lb > 0:
            per_layer[layer] = sum(dots[m] for m in ms) / (la * lb)
    conflict = sum(c < 0 for c in modules.values()) / max(len(modules), 1)
    return Angle(sum(dots.values()) / (total_a * total_b), per_layer, modules, conflict)


def role_gradients(
    parts: Sequence[Part],
    s: LossSettings,
    optimizer: Optimizer,
    micro_batch_size: int,
    groups: str = "role",
    dist: Dist = SINGLE,
) -> dict[str, float]:
    """`<role|kind>/<g>/grad_norm/<adapter>` for every adapter group g reaches, and for every pair of groups
    that both reach an adapter `grad/cos/<adapter>/<a>__<b>` (overall cosine) and
    `grad/conflict_frac/<adapter>/<a>__<b>` (the share of the adapter's modules where it is negative).
    `groups`: `role` (each role's rows) or `kind` (each policy kind's tokens, every row). Under data
    parallelism each rank computes its own rows and the group's gradients are summed over ranks before
    any norm or cosine (a cosine of summed gradients, not a mean of each rank's cosines)."""
    flat: dict[str, dict[str, ModuleGrads]] = {}  # group -> adapter -> module -> gradient
    for group, subs in _groups(parts, groups):
        optimizer.zero_grad()
        norm = AggNorm.of(*[sub.loss_mask for _, _, sub in subs], horizon=s.horizon)
        if norm.num_tokens == 0:
            continue
        for part, rows, sub in subs:
            mine = part.mine(rows)
            if not mine:
                continue
            sub = sub if len(mine) == len(rows) else select_rows(sub, mine)
            ps = dataclasses.replace(s, adapter_params=part.adapter_params)
            accumulate_gradients(part.model, sub, Aligned(sub.old_logp), ps, micro_batch_size, norm=norm)
        dist.reduce_gradients(optimizer.params)
        flat[group] = {g.name: _by_module(g.params) for g in optimizer.groups
                       if any(p.grad is not None for p in g.params.values())}  # fmt: skip
    optimizer.zero_grad()
    out: dict[str, float] = {}
    for group, by_adapter in flat.items():
        for adapter, modules in by_adapter.items():
            norm = math.sqrt(sum(float(g.double().norm()) ** 2 for g in modules.values()))
            out[f"{groups}/{group}/grad_norm/{adapter}"] = norm
    for a, b in itertools.combinations(flat, 2):
        for adapter in flat[a].keys() & flat[b].keys():
            angle = cosine(flat[a][adapter], flat[b][adapter])
            if angle is not None:
                out[f"grad/cos/{adapter}/{a}__{b}"] = angle.cos
                out[f"grad/conflict_frac/{adapter}/{a}__{b}"] = angle.conflict_frac
    return out


def _groups(parts: Sequence[Part], groups: str) -> list[tuple[str, list[tuple[Part, list[int], TrainBatch]]]]:
    """Each group's sub-batches `(part, its rows of the part, sub-batch)`: a role's rows, or every row with
    the loss mask narrowed to one kind."""
    if groups == "role":
        roles = list(dict.fromkeys(r for part in parts for r in part.batch.roles))
        out = []
        for role in roles:
            subs = []
            for part in parts:
                rows = [i for i, r in enumerate(part.batch.roles) if r == role]
                if rows:
                    subs.append((part, rows, select_rows(part.batch, rows)))
            out.append((role, subs))
        return out
    out = []
    for kind in (k for k in KINDS if k in POLICY_KINDS):
        subs = []
        for part in parts:
            b = part.batch
            mask = torch.zeros_like(b.loss_mask)
            mask[:, :-1] = b.loss_mask[:, :-1] * (
                b.kind_ids[:, 1:] == KIND_INDEX[kind]
            )  # column p: token p+1
            subs.append((part, list(range(b.input_ids.shape[0])), dataclasses.replace(b, loss_mask=mask)))
        out.append((kind, subs))
    return out


def _by_module(params: dict[str, torch.Tensor]) -> ModuleGrads:
    by: dict[str, list[torch.Tensor]] = {}
    for name, p in params.items():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        by.setdefault(module_of(name), []).append(g.detach().flatten().float())
    return {m: torch.cat(v) for m, v in by.items()}
