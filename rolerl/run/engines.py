"""A run's rollout engines and each role's call settings, as training and evaluation both build them.

`build_engines` starts one `Engine` per model of the policy, with the tools the run's calls may call
(`run_tools`), in the rollout's weights dtype (`rollout_dtype`); `role_calls` gives `Context` each role's
model, tokenizer and call settings (`roles.<r>`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from rolerl.config import Config, ConfigError
from rolerl.hardware import resolve_precision
from rolerl.rollout.engine import Engine, rollout_copy
from rolerl.run.policy import Policy
from rolerl.workflows.base import RoleCalls


def role_calls(cfg: Config, policy: Policy) -> dict[str, RoleCalls]:
    """Each role's model, tokenizer and call settings (`roles.<r>`), for `Context`."""
    out = {}
    for role in policy.route_of:
        rc = cfg.roles.get(role)
        model = policy.topology.model(role)
        out[role] = RoleCalls(
            model=model,
            tokenizer=policy.members[model].tokenizer,
            max_new_tokens=rc.max_new_tokens if rc else None,
            top_p=rc.top_p if rc else None,
            max_tool_calls=rc.max_tool_calls if rc else None,
            tool=rc.tool if rc else None,
            stop=tuple(rc.stop or ()) if rc else (),
            tags=dict(rc.tags or {}) if rc else {},
        )
    return out


def run_tools(cfg: Config, default: str | None) -> list[str]:
    """The engine tools a run's calls may call: `default` (the run's tool) and each role's own."""
    names = [default, *(rc.tool for rc in cfg.roles.values())]
    return list(dict.fromkeys(n for n in names if n and n != "none"))


def build_engines(
    cfg: Config,
    policy: Policy,
    tool: str | None,
    options: Mapping[str, Any],
    max_batch: int,
    max_len: int | None = None,
    copy: bool = False,
) -> dict[str, Engine]:
    """One engine per model of `policy`, each with the tools its calls may call (`run_tools`: `tool` and
    every role's own; `options` are `tool`'s factory's). `copy`: each engine samples from its own copy of
    the model, also in the trainer's dtype (asynchronous training: the trainer updates while it samples)."""
    from rolerl.tools import build_tools

    names = run_tools(cfg, tool)
    kwargs = {tool: dict(options)} if options and tool in names else {}
    dtype = rollout_dtype(cfg, policy)
    engines = {}
    for name, m in policy.members.items():
        model, source = m.model, None
        own = next(m.model.parameters()).dtype
        if copy or (dtype is not None and dtype != own):
            model, source = rollout_copy(m.model, dtype or own), m.model
        engines[name] = Engine(model, m.tokenizer, max_batch=max_batch, max_len=max_len,
                               tools=build_tools(names, **kwargs), source=source,
                               kernels=cfg.rollout.kernels, attention=cfg.rollout.attention,
                               adapter_kernel=cfg.rollout.adapter_kernel,
                               tied_head=cfg.rollout.tied_head, pointwise=cfg.rollout.pointwise,
                               prefix_cache=cfg.rollout.prefix_cache)  # fmt: skip
    return engines


def rollout_dtype(cfg: Config, policy: Policy) -> torch.dtype | None:
    """The engines' weights dtype (`rollout.dtype`), None = the trainer's own weights. Sampling in another
    precision than the trainer computes in makes the rollout's log-probs another distribution's: the
    trainer must recompute them (`algorithm.old_logp: recompute`; `tis_cap` corrects the sampling)."""
    name = cfg.rollout.dtype
    if name == "model":
        return None
    if name == "auto":
        name = resolve_precision("auto", policy.device, "rollout.dtype")
        if name == "float32":
            return None
    dtype = torch.bfloat16 if name == "bfloat16" else torch.float32
    weights = {next(m.model.parameters()).dtype for m in policy.members.values()}
    if weights != {dtype} and cfg.algorithm.old_logp == "rollout":
        raise ConfigError(
            f"rollout.dtype={cfg.rollout.dtype!r} samples in {dtype} while the trainer's weights are "
            f"{sorted(map(str, weights))}: set algorithm.old_logp=recompute (and algorithm.tis_cap, e.g. 2.0)"
        )
    return dtype
