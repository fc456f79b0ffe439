"""Per-role gradients on each adapter, and the cosine between roles' gradients on a shared adapter
(`diagnostics.grad_every`; PAPERS: a role's share of a shared adapter's update is set by the averaging
rule, and roles whose gradients point apart interfere).

One backward per role over that role's rows, with the role's own normaliser (its loss as if it trained
alone), at the weights the step's rollout used; the gradients are cleared afterwards, so the update that
follows is unchanged (it costs one extra forward and backward over the batch).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import torch

from rolerl.algorithms import AggNorm
from rolerl.train.optim import Optimizer
from rolerl.train.policy import select_rows
from rolerl.train.update import Aligned, LossSettings, Part, accumulate_gradients


def role_gradients(
    parts: Sequence[Part], s: LossSettings, optimizer: Optimizer, micro_batch_size: int
) -> dict[str, float]:
    """`role/<r>/grad_norm/<adapter>` for every adapter role r reaches, and `grad/cos/<adapter>/<r1>__<r2>`
    for every pair of roles that both reach an adapter."""
    roles = list(dict.fromkeys(r for part in parts for r in part.batch.roles))
    flat: dict[str, dict[str, torch.Tensor]] = {}  # role -> adapter -> flattened gradient
    for role in roles:
        optimizer.zero_grad()
        subs = [(part, select_rows(part.batch, [i for i, r in enumerate(part.batch.roles) if r == role]))
                for part in parts if role in part.batch.roles]  # fmt: skip
        norm = AggNorm.of(*[sub.loss_mask for _, sub in subs], horizon=s.horizon)
        if norm.num_tokens == 0:
            continue
        for part, sub in subs:
            ps = dataclasses.replace(s, adapter_params=part.adapter_params)
            accumulate_gradients(part.model, sub, Aligned(sub.old_logp), ps, micro_batch_size, norm=norm)
        flat[role] = {
            g.name: torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten().double()
                               for p in g.params.values()])
            for g in optimizer.groups
            if any(p.grad is not None for p in g.params.values())
        }  # fmt: skip
    optimizer.zero_grad()
    out: dict[str, float] = {}
    for role, by_adapter in flat.items():
        for adapter, g in by_adapter.items():
            out[f"role/{role}/grad_norm/{adapter}"] = float(g.norm())
    for a, b in itertools.combinations(flat, 2):
        for adapter in flat[a].keys() & flat[b].keys():
            ga, gb = flat[a][adapter], flat[b][adapter]
            denom = float(ga.norm() * gb.norm())
            if denom > 0:
                out[f"grad/cos/{adapter}/{a}__{b}"] = float(ga @ gb) / denom
    return out
