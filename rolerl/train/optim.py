"""The optimizer, the learning-rate schedule and gradient clipping, in one place (RL and imitation both
build theirs here).

Every trainable adapter is one AdamW parameter group (`rolerl.run.policy.ParamGroup`), named after it,
with its own peak learning rate (`adapters.per_adapter.<name>.lr`, else `optim.lr` x the `lr_scale` of the
roles it serves). Clipping is over all groups at once or each group alone (`optim.clip_scope`). A group is stepped only when one of its
parameters received a gradient (AdamW would otherwise move it through momentum and weight decay), and
every group counts its own steps. The state is saved by adapter and parameter name, not by position, so
resuming under another topology fails with the names that differ instead of loading misaligned moments.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from rolerl.config import OptimConfig
from rolerl.models.lora import adapter_specs
from rolerl.run.policy import ParamGroup, Policy, adapter_groups


class OptimizerStateError(ValueError):
    """A saved optimizer state that does not fit this run's adapters (a topology or rank change)."""


@dataclass
class Optimizer:
    """AdamW over named parameter groups, with the run's schedule and clipping.

    `step()` steps only the groups that hold a gradient and counts steps per group (`steps`); it returns the
    names of the groups it stepped."""

    groups: list[ParamGroup]
    cfg: OptimConfig
    steps: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.groups:
            raise ValueError("no trainable adapter: nothing to optimise")
        self.torch = torch.optim.AdamW(
            [{"params": list(g.params.values()), "lr": g.lr, "name": g.name} for g in self.groups],
            lr=self.groups[0].lr,
            betas=tuple(self.cfg.betas),
            weight_decay=self.cfg.weight_decay,
        )
        self.steps = {g.name: 0 for g in self.groups}

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for g in self.groups for p in g.params.values()]

    def zero_grad(self) -> None:
        self.torch.zero_grad(set_to_none=True)

    def set_lr(self, factor: float) -> dict[str, float]:
        """Each group's lr = its peak x `factor` (the schedule's value at this step); returns them."""
        for g, pg in zip(self.groups, self.torch.param_groups, strict=True):
            pg["lr"] = g.lr * factor
        return {g.name: g.lr * factor for g in self.groups}

    def clip(self, scope: str | None = None) -> dict[str, float]:
        """Clip to `cfg.grad_clip` (0 = measure only) over all groups (`global`) or each alone (`group`);
        returns the norms before clipping: `"global"` and one per group that has a gradient."""
        scope = scope or self.cfg.clip_scope
        norms = {g.name: _norm(g.params.values()) for g in self.groups if _has_grad(g)}
        total = math.sqrt(sum(n * n for n in norms.values()))
        limit = self.cfg.grad_clip
        if limit > 0:
            if scope == "global":
                _scale(
                    [g for g in self.groups if _has_grad(g)], limit / (total + 1e-6) if total > limit else 1.0
                )
            else:
                for g in self.groups:
                    if g.name in norms and norms[g.name] > limit:
                        _scale([g], limit / (norms[g.name] + 1e-6))
        return {"global": total} | norms

    def step(self) -> list[str]:
        stepped = [g.name for g in self.groups if _has_grad(g)]
        if stepped:
            self.torch.step()
        for name in stepped:
            self.steps[name] += 1
        return stepped

    def state_dict(self) -> dict[str, Any]:
        """AdamW's state keyed by `<adapter>/<parameter name>`, with each group's steps."""
        state = self.torch.state_dict()["state"]
        by_name: dict[str, Any] = {}
        index = 0
        for g in self.groups:
            for pname in g.params:
                if index in state:
                    by_name[f"{g.name}/{pname}"] = state[index]
                index += 1
        return {"format": "rolerl-named-1", "state": by_name, "steps": dict(self.steps),
                "groups": {g.name: sorted(g.params) for g in self.groups}}  # fmt: skip

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Restore a `state_dict()`; an `OptimizerStateError` names the adapters (or parameters) that differ."""
        if not isinstance(saved, dict) or saved.get("format") != "rolerl-named-1":
            raise OptimizerStateError(
                "the checkpoint's optimizer state is not keyed by adapter name (written by an older rolerl); "
                "start a fresh run, or warm-start its adapters with adapters.init"
            )
        mine = {g.name: sorted(g.params) for g in self.groups}
        theirs = saved["groups"]
        if mine != theirs:
            raise OptimizerStateError(_difference(mine, theirs))
        state, index = {}, 0
        for g in self.groups:
            for pname, p in g.params.items():
                entry = saved["state"].get(f"{g.name}/{pname}")
                if entry is not None:
                    if entry["exp_avg"].shape != p.shape:
                        raise OptimizerStateError(
                            f"adapter {g.name!r}: {pname} has shape {tuple(p.shape)} here and "
                            f"{tuple(entry['exp_avg'].shape)} in the checkpoint (a rank change?)"
                        )
                    state[index] = entry
                index += 1
        full = self.torch.state_dict()
        full["state"] = state
        self.torch.load_state_dict(full)
        self.steps = {g.name: int(saved["steps"].get(g.name, 0)) for g in self.groups}


def _difference(mine: dict[str, list[str]], theirs: dict[str, list[str]]) -> str:
    missing = sorted(set(theirs) - set(mine))
    extra = sorted(set(mine) - set(theirs))
    changed = sorted(n for n in set(mine) & set(theirs) if mine[n] != theirs[n])
    parts = []
    if missing:
        parts.append(f"the checkpoint trains adapters {missing} that this run does not")
    if extra:
        parts.append(f"this run trains adapters {extra} that the checkpoint has no state for")
    if changed:
        parts.append(f"adapters {changed} wrap other layers here (adapters.target_modules changed?)")
    return (
        "the checkpoint does not fit this run's topology: " + "; ".join(parts)
        + ". Resume with the configuration it was written with, or start a fresh run (adapters.init can "
        "warm-start from its adapters)"
    )  # fmt: skip


def _has_grad(g: ParamGroup) -> bool:
    return any(p.grad is not None for p in g.params.values())


def _norm(params) -> float:
    grads = [p.grad for p in params if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(x.float()) for x in grads])))


def _scale(groups: Sequence[ParamGroup], factor: float) -> None:
    if factor >= 1.0:
        return
    for g in groups:
        for p in g.params.values():
            if p.grad is not None:
                p.grad.mul_(factor)


def lr_factor(step: int, total_steps: int, o: OptimConfig) -> float:
    """The lr multiplier of (0-based) `step`: linear warm-up over `o.warmup_steps`, then constant or cosine
    towards `o.min_lr_ratio`; the cosine reaches its floor one step after the last, so the last step learns."""
    if step < o.warmup_steps:
        return (step + 1) / o.warmup_steps
    if o.schedule == "constant":
        return 1.0
    progress = min((step - o.warmup_steps) / max(total_steps - o.warmup_steps, 1), 1.0)
    return o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def policy_optimizer(policy: Policy, cfg: OptimConfig, lr: float | None = None) -> Optimizer:
    """AdamW over `policy`'s trainable adapters, one group each; `lr` replaces every group's peak lr (SFT)."""
    policy.trainable()  # its error when there is nothing to train
    groups = policy.groups if lr is None else [dataclasses.replace(g, lr=lr) for g in policy.groups]
    return Optimizer(groups, cfg)


def model_optimizer(model: nn.Module, lr: float = 1e-3, **optim: Any) -> Optimizer:
    """An `Optimizer` over every adapter of one model, all at `lr` (`optim`: `OptimConfig` fields), for
    tests, notebooks and benchmarks that build a model by hand."""
    names = list(adapter_specs(model))
    return Optimizer(adapter_groups({"main": model}, dict.fromkeys(names, lr)), OptimConfig(lr=lr, **optim))
