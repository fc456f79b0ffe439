"""The trained model: base + topology adapters, and its routed forward to per-token log-probs.

One forward serves the trainer, the reference (route -1: the same weights with adapters off, no second
copy) and SFT: the decoder's hidden states under the batch's routes, then `chunked_logprobs` with the
rollout temperature, so the `(B, T, V)` logits never exist at once (DESIGN "Log-probs").
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rolerl import gemm
from rolerl.algorithms import TokenLogprobs, chunked_logprobs
from rolerl.config import Config, OptimConfig
from rolerl.hardware import fp32_gemm_choice, resolve_bf16, resolve_precision
from rolerl.heap import LARGEST_KEPT_BLOCK
from rolerl.models.adapters_io import load_adapter
from rolerl.models.attention import (
    GROUPED_SDPA,
    LEAN_EAGER,
    attention_implementation,
    register_grouped_sdpa,
    register_lean_eager,
)
from rolerl.models.load import load_model, resolve_dtype
from rolerl.models.lora import adapter_specs, add_adapters
from rolerl.models.tiny import tiny_from_spec
from rolerl.models.topology import Topology
from rolerl.train import lean_ops
from rolerl.train.optim import Optimizer, ParamGroup, adapter_groups
from rolerl.train.prefix import hidden_at
from rolerl.types import TrainBatch

log = logging.getLogger(__name__)


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

    def optimizer(self, cfg: OptimConfig, lr: float | None = None) -> Optimizer:
        """AdamW over the trainable adapters, one group each; `lr` replaces every group's peak lr (SFT)."""
        self.trainable()  # the error above when there is nothing to train
        groups = self.groups if lr is None else [dataclasses.replace(g, lr=lr) for g in self.groups]
        return Optimizer(groups, cfg)


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
        _warm_start(members, cfg.adapters.init)
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
    return load_model(spec, dtype=dtype, device=str(device))


def _warm_start(members: dict[str, Member], init: str) -> None:
    names = {n: m for m in members.values() for n in adapter_specs(m.model)}
    found = [n for n in names if (Path(init) / n).is_dir()]
    if not found:
        raise FileNotFoundError(
            f"adapters.init={init!r} holds none of this run's adapters {list(names)} (as PEFT directories "
            "named after them, e.g. `rolerl sft` output RUN_DIR/adapters)"
        )
    for name, member in names.items():
        if name in found:
            load_adapter(member.model, name, Path(init) / name)
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


def autocast(device: torch.device, bf16: bool):
    """bf16 autocast on CPU or GPU when asked for, else nothing."""
    if not bf16:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)


def token_logprobs(
    model: nn.Module,
    batch: TrainBatch,
    *,
    temperature: float,
    chunk_size: int | None = None,
    routes: torch.Tensor | int | None = None,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    share_prefix: bool = True,
) -> TokenLogprobs:
    """`(B, T-1)` log-probs (and entropies) of `input_ids[:, 1:]` under `routes` (default: the batch's).

    Column `p` is about token `p + 1`, the alignment of `TrainBatch`'s masks (slice them `[:, :-1]`).
    Only positions on the loss mask run the LM head; the others get log-prob 0 and entropy 0 (no
    gradient). `routes=-1` is the reference. `share_prefix` computes each prompt shared by several rows
    once (`rolerl.train.prefix`; equal up to float rounding). `entropy_grad=False`: the entropies are a
    metric, with no gradient (`chunked_logprobs`).
    """
    keep = batch.loss_mask[:, :-1].bool()  # (B, T-1): positions whose next token is trained
    keep = torch.cat([keep, torch.zeros_like(keep[:, :1])], 1)  # (B, T): the last position predicts nothing
    head = model.get_output_embeddings()
    route = batch.routes if routes is None else routes
    with _attention_for(model, batch.input_ids):
        hidden = hidden_at(model, batch, route, keep, share_prefix=share_prefix)  # (N, d)
    targets = batch.input_ids[:, 1:][keep[:, :-1]]  # (N,)
    out = chunked_logprobs(
        hidden[None],  # (1, N, d): position p predicts token p + 1
        head.weight,
        targets[None],
        bias=head.bias,
        temperature=temperature,
        chunk_size=chunk_size,
        with_entropy=with_entropy,
        entropy_grad=entropy_grad,
    )
    mask = keep[:, :-1]
    entropy = None if out.entropy is None else _scatter(out.entropy[0], mask)
    return TokenLogprobs(logp=_scatter(out.logp[0], mask), entropy=entropy)


def _scatter(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`(N,)` values into the `True` positions of `mask` `(B, T)`, zeros elsewhere (differentiable)."""
    return values.new_zeros(mask.shape).masked_scatter(mask, values)


# The largest `(B, H, T, T)` block of fp32 attention scores the trainer's eager attention may build: the largest
# block glibc serves from the heap kept by `rolerl.heap` (its mmap threshold). Larger blocks are mapped for
# each allocation and every page faulted in again: the first update of a 512-token GRPO run (8 rows x ~570
# positions per micro-batch) took 69.7 s and 12.9 million page faults with eager, 44.4 s and 1.6 million
# with SDPA, which builds no such block (docs/BENCHMARKS.md, GRPO round thirteen).
EAGER_MAX_SCORES = LARGEST_KEPT_BLOCK


@contextlib.contextmanager
def _attention_for(model: nn.Module, ids: torch.Tensor):
    """The trainer's attention kernel on CPU. Under bf16 autocast, eager attention for small batches: SDPA's
    CPU flash kernel is slow in backward there (8 x 123 tokens on the default model, fwd+bwd, one thread:
    7.2 s with SDPA, 5.1-5.4 s eager; in fp32 the two are about equal, and eager's fp32 softmax would cost
    fp64 its precision). Eager builds `(B, H, T, T)` scores per layer, so batches whose scores exceed
    `EAGER_MAX_SCORES` keep SDPA (there the two kernels take about the same time, before eager's page
    faults); on Llama-family models eager runs as `lean_eager`, which recomputes the scores in backward
    instead of keeping them (eager's autograd kept about a third of a micro-batch's activations in them).
    SDPA on CPU runs as `grouped_sdpa`: grouped K/V heads are not repeated per query head (what autograd
    keeps for backward shrinks by the K/V copies). GPUs and other implementations keep the model's own."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if ids.device.type != "cpu" or config._attn_implementation != "sdpa":
        yield
        return
    rows, length = ids.shape
    scores = rows * config.num_attention_heads * length * length * 4  # bytes of fp32 scores per layer
    if torch.is_autocast_enabled("cpu") and scores <= EAGER_MAX_SCORES:
        lean = getattr(config, "model_type", None) in lean_ops.FAMILIES
        if lean:
            register_lean_eager()
        with attention_implementation(model, LEAN_EAGER if lean else "eager"):
            yield
        return
    register_grouped_sdpa()
    with attention_implementation(model, GROUPED_SDPA):
        yield


def select_rows(batch: TrainBatch, rows: torch.Tensor | Sequence[int]) -> TrainBatch:
    """Rows `rows` of `batch`, with the columns trimmed to the longest selected row (less padding)."""
    idx = torch.as_tensor(rows, dtype=torch.long)
    width = max(int(batch.attention_mask[idx].sum(-1).max()), 1) if len(idx) else 1
    out = {}
    for key, value in vars(batch).items():
        if isinstance(value, torch.Tensor):
            value = value[idx.to(value.device)]
            out[key] = value[:, :width] if value.dim() == 2 else value
        elif key == "roles":
            out[key] = [value[i] for i in idx.tolist()]
        else:
            out[key] = value
    return TrainBatch(**out)
