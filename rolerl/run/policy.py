"""The policy a run trains or evaluates: its base models, the topology's adapters in them, and the routes.

`build_policy` loads the models a config names (`model.spec`, `models.<name>`), adds the adapters the
topology needs, optionally warm-starts them (`adapters.init`) and groups the trainable ones by adapter
(`ParamGroup`: what the optimizer steps, `rolerl.train.optim`). Training and evaluation both build their
policy here; its training forward (per-token log-probs) is `rolerl.train.policy`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rolerl import gemm
from rolerl.config import Config
from rolerl.hardware import fp32_gemm_choice, resolve_bf16, resolve_precision
from rolerl.models import lean_ops
from rolerl.models.adapters_io import load_adapter
from rolerl.models.load import load_model, resolve_dtype
from rolerl.models.lora import adapter_specs, add_adapters, routed_layers
from rolerl.models.tiny import tiny_from_spec
from rolerl.models.topology import Topology
from rolerl.progress import is_rank_zero

log = logging.getLogger(__name__)


@dataclass
class ParamGroup:
    """One adapter's trainable parameters, by name (`<layer path>.lora_A` / `.lora_B`)."""

    name: str
    params: dict[str, nn.Parameter]
    lr: float  # peak learning rate; the schedule multiplies it
    model: str = "main"  # the model the adapter lives in


def adapter_groups(
    models: Mapping[str, nn.Module], lrs: Mapping[str, float], frozen: Sequence[str] = ()
) -> list[ParamGroup]:
    """One `ParamGroup` per adapter of every model (adapter names are unique across models), in model then
    route-index order; `frozen` adapters get `requires_grad=False` and no group. `lrs[name]` is each
    trainable adapter's peak lr."""
    groups = []
    for model_name, model in models.items():
        for name in adapter_specs(model):
            params = {}
            for path, layer in routed_layers(model):
                if name in layer.lora_A:
                    params[f"{path}.lora_A"] = layer.lora_A[name]
                    params[f"{path}.lora_B"] = layer.lora_B[name]
            if name in frozen:
                for p in params.values():
                    p.requires_grad_(False)
                continue
            groups.append(ParamGroup(name, params, lrs[name], model_name))
    return groups


@dataclass
class Member:
    """One base model of the policy, with its tokenizer and the adapters that live in it."""

    model: nn.Module
    tokenizer: Any


@dataclass
class Policy:
    """The trained models (one, `main`, unless roles run on models of their own), their topology and the
    trainable adapters as named parameter groups."""

    members: dict[str, Member]  # model name -> model and tokenizer
    topology: Topology
    route_of: dict[str, dict[str, int]]  # role -> (kind -> adapter index in the role's model)
    device: torch.device
    bf16: bool = False  # bf16 autocast for training forwards (`train.bf16`, resolved for this device)
    groups: list[ParamGroup] = field(default_factory=list)  # the trainable adapters (frozen ones excluded)

    @property
    def model(self) -> nn.Module:
        """The model, when there is one (every preset but `separate`); else use `model_of(role)`."""
        return self._only().model

    @property
    def tokenizer(self) -> Any:
        return self._only().tokenizer

    def _only(self) -> Member:
        if len(self.members) != 1:
            raise ValueError(
                f"this policy has {len(self.members)} models {list(self.members)}: ask for a role's with "
                "policy.model_of(role) / policy.tokenizer_of(role)"
            )
        return next(iter(self.members.values()))

    def model_of(self, role: str) -> nn.Module:
        return self.members[self.topology.model(role)].model

    def tokenizer_of(self, role: str) -> Any:
        return self.members[self.topology.model(role)].tokenizer

    @property
    def adapter_names(self) -> list[str]:
        """Every adapter of every model (names are unique across models)."""
        return [n for m in self.members.values() for n in adapter_specs(m.model)]

    def adapter_models(self) -> dict[str, nn.Module]:
        """Adapter name -> the model that holds it (what checkpoints save and load)."""
        return {n: m.model for m in self.members.values() for n in adapter_specs(m.model)}

    def trainable(self) -> list[nn.Parameter]:
        """The trainable adapters' parameters, in group order; an error when there are none (preset `none`,
        or every adapter frozen: evaluation and references only)."""
        params = [p for g in self.groups for p in g.params.values()]
        if not params:
            raise ValueError(
                f"adapters.preset={self.topology.preset!r} gives the model no trainable adapter: nothing to "
                "train (preset none is for evaluation and references; per_adapter.<name>.trainable: false "
                "freezes an adapter)"
            )
        return params


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(
            f"model.device={name!r} but this torch ({torch.__version__}) sees no CUDA device; use "
            "model.device=auto or cpu, or install a CUDA build of torch"
        )
    return torch.device(name)


def build_topology(cfg: Config, roles: Sequence[str]) -> Topology:
    """The topology `cfg` describes for the workflow's `roles`: the preset or `adapters.table`, each role's
    kinds with loss (`roles.<r>.train_kinds`, else `adapters.train_kinds`) and model (`roles.<r>.model`)."""
    unknown = sorted(set(cfg.roles) - set(roles))
    if unknown:
        raise ValueError(f"roles.{unknown[0]}: the workflow has no such role; its roles are {list(roles)}")
    default = cfg.adapters.train_kinds
    kinds = {r: (cfg.roles[r].train_kinds if r in cfg.roles and cfg.roles[r].train_kinds else default)
             for r in roles}  # fmt: skip
    kinds = {r: k for r, k in kinds.items() if k}
    model_of = {r: cfg.roles[r].model for r in roles if r in cfg.roles}
    if cfg.adapters.preset == "custom":
        return Topology.from_table(cfg.adapters.table or {}, roles, kinds, model_of)
    if cfg.adapters.preset == "masked" and set(kinds) != set(roles):
        raise ValueError("adapters.preset='masked' needs train_kinds for every role (adapters.train_kinds)")
    return Topology.from_preset(cfg.adapters.preset, roles, kinds, model_of)


def build_policy(cfg: Config, roles: Sequence[str]) -> Policy:
    """Load the models `cfg` names (`model.spec` as `main`, and `models.<name>` for roles placed on them),
    add the adapters the topology needs (rank and alpha per adapter), optionally warm-start them from
    `cfg.adapters.init/<name>` (PEFT directories, e.g. written by `rolerl sft`)."""
    device = resolve_device(cfg.model.device)
    topology = build_topology(cfg, roles)
    names = topology.adapter_names()
    unknown = sorted(set(cfg.adapters.per_adapter) - set(names))
    if unknown:
        raise ValueError(
            f"adapters.per_adapter.{unknown[0]}: this topology ({cfg.adapters.preset}) has no such adapter; "
            f"its adapters are {names}"
        )
    members = {}
    for name in topology.models:
        model, tokenizer = _load(cfg, name, device)
        mine = topology.adapters_of_model(name)
        each = {n: cfg.adapters.per_adapter.get(n) for n in mine}
        ranks = {n: (e.rank if e and e.rank else cfg.adapters.rank) for n, e in each.items()}
        alphas = {n: (e.alpha if e and e.alpha else cfg.adapters.alpha) for n, e in each.items()}
        # LoRA's A is drawn from the global RNG: seed it from the run, so two same-seed runs start identical
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.run.seed)
            add_adapters(model, mine, rank=ranks, alpha=alphas, target_modules=cfg.adapters.target_modules)
        model.to(device)
        model.eval()  # always: no dropout in rollout or training (a model built from a config starts in train mode)
        lean_ops.install(model)  # the MLP keeps half the bytes for backward (Llama families; same forward)
        members[name] = Member(model, tokenizer)
    if cfg.adapters.init:
        _warm_start(members, cfg.adapters.init, cfg.adapters.init_from)
    route_of = {}
    for role in roles:
        index = {n: i for i, n in enumerate(adapter_specs(members[topology.model(role)].model))}
        route_of[role] = topology.route_of(role, index)
    frozen = [n for n, e in cfg.adapters.per_adapter.items() if not e.trainable]
    groups = adapter_groups({m: members[m].model for m in members}, _adapter_lrs(cfg, topology), frozen)
    bf16 = resolve_bf16(cfg.train.bf16, device)
    gemm.set_backend(resolve_train_kernels(cfg.train.kernels, device))
    return Policy(members, topology, route_of, device, bf16=bf16, groups=groups)


def _load(cfg: Config, name: str, device: torch.device) -> tuple[nn.Module, Any]:
    """Model `name`: `main` is `model.spec`, any other a key of `models`; dtype and device from `model`."""
    if name != "main" and name not in cfg.models:
        raise ValueError(f"a role runs on model {name!r}, which models does not name: {sorted(cfg.models)}")
    spec = cfg.model.spec if name == "main" else cfg.models[name]
    dtype = resolve_precision(cfg.model.dtype, device, "model.dtype")
    if spec.startswith("tiny:"):
        model, tokenizer = tiny_from_spec(spec, seed=cfg.run.seed, dtype=resolve_dtype(dtype))
        return model.to(device), tokenizer
    return load_model(spec, dtype=dtype, device=str(device), progress=cfg.run.progress and is_rank_zero())


def _warm_start(members: dict[str, Member], init: str, init_from: dict[str, str]) -> None:
    """Each adapter from `init/<its source>`: `init_from`'s entry for it, else its `*` entry, else its own
    name. A source `init_from` names must exist; an adapter found under its own name nowhere starts fresh."""
    names = {n: m for m in members.values() for n in adapter_specs(m.model)}
    unknown = sorted(set(init_from) - set(names) - {"*"})
    if unknown:
        raise ValueError(
            f"adapters.init_from.{unknown[0]}: this run has no such adapter; its adapters are {list(names)} "
            "(or '*' for every one)"
        )
    source = {n: init_from.get(n, init_from.get("*", n)) for n in names}
    found = [n for n in names if (Path(init) / source[n]).is_dir()]
    missing = [n for n in names if n not in found and (n in init_from or "*" in init_from)]
    if missing:
        key = missing[0] if missing[0] in init_from else "*"
        raise FileNotFoundError(
            f"adapters.init_from.{key}={source[missing[0]]!r}: {init!r} has no such adapter directory"
        )
    if not found:
        raise FileNotFoundError(
            f"adapters.init={init!r} holds none of this run's adapters {list(names)} (as PEFT directories "
            "named after them, e.g. `rolerl sft` output RUN_DIR/adapters; adapters.init_from maps other names)"
        )
    for name, member in names.items():
        if name in found:
            load_adapter(member.model, name, Path(init) / source[name])
        else:  # e.g. imitation covered only some roles of an isolated topology
            log.warning("adapters.init has no %r adapter; it starts fresh", name)


def _adapter_lrs(cfg: Config, topology: Topology) -> dict[str, float]:
    """Each adapter's peak lr: `per_adapter.<name>.lr`, else `optim.lr` x the `lr_scale` of the roles it
    serves (an error if those roles disagree)."""
    out = {}
    for name in topology.adapter_names():
        own = cfg.adapters.per_adapter.get(name)
        if own is not None and own.lr is not None:
            out[name] = own.lr
            continue
        users = sorted({r for (r, k), n in topology.table.items() if n == name})
        scales = {r: cfg.roles[r].lr_scale if r in cfg.roles else 1.0 for r in users}
        if len(set(scales.values())) > 1:
            raise ValueError(
                f"adapter {name!r} serves roles {users} whose lr_scale differ ({scales}); set one lr for it "
                f"with adapters.per_adapter.{name}.lr"
            )
        out[name] = cfg.optim.lr * next(iter(scales.values()))
    return out


def resolve_train_kernels(kernels: str, device: torch.device) -> str:
    """`train.kernels` for `rolerl.gemm`: `onednn` needs a CPU and a torch built with oneDNN; `auto` becomes
    `rolerl.hardware.fp32_gemm_choice`'s pick, logged with its reason."""
    if kernels == "onednn" and (device.type != "cpu" or not gemm.onednn_built()):
        where = "this torch is built without oneDNN" if device.type == "cpu" else f"the model is on {device}"
        raise ValueError(f"train.kernels 'onednn' runs on a CPU with oneDNN; {where}: use 'auto' or 'torch'")
    if kernels != "auto":
        return kernels
    choice, why = fp32_gemm_choice(device)
    if choice == "onednn" and not gemm.onednn_built():
        choice, why = "torch", "this torch is built without oneDNN"
    log.info("train.kernels=auto -> %s: %s", choice, why)
    return choice
