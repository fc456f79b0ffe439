"""The trained model: base + topology adapters, and its routed forward to per-token log-probs.

One forward serves the trainer, the reference (route -1: the same weights with adapters off, no second
copy) and SFT: the decoder's hidden states under the batch's routes, then `chunked_logprobs` with the
rollout temperature, so the `(B, T, V)` logits never exist at once (DESIGN "Log-probs").
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rolerl.algorithms import TokenLogprobs, chunked_logprobs
from rolerl.config import Config
from rolerl.hardware import resolve_bf16, resolve_precision
from rolerl.models.adapters_io import load_adapter
from rolerl.models.attention import attention_implementation
from rolerl.models.load import load_model, resolve_dtype
from rolerl.models.lora import adapter_specs, add_adapters
from rolerl.models.tiny import tiny_model
from rolerl.models.topology import Topology
from rolerl.train.prefix import hidden_at
from rolerl.types import TrainBatch

log = logging.getLogger(__name__)


@dataclass
class Policy:
    model: nn.Module
    tokenizer: Any
    topology: Topology
    route_of: dict[str, dict[str, int]]  # role -> (kind -> adapter index), for rollout, collate and SFT
    device: torch.device
    bf16: bool = False  # bf16 autocast for training forwards (`train.bf16`, resolved for this device)

    @property
    def adapter_names(self) -> list[str]:
        return list(adapter_specs(self.model))

    def trainable(self) -> list[nn.Parameter]:
        """The adapters' parameters, in a fixed order (the optimizer's state is saved by position); an error
        when there are none (preset `none`: evaluation and references only)."""
        params = [p for _, p in self.model.named_parameters() if p.requires_grad]
        if not params:
            raise ValueError(
                f"adapters.preset={self.topology.preset!r} gives the model no trainable adapter: nothing to "
                "train (preset none is for evaluation and references)"
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


def build_policy(cfg: Config, roles: Sequence[str]) -> Policy:
    """Load `cfg.model`, add the adapters `cfg.adapters.preset` needs for `roles`, optionally warm-start them
    from `cfg.adapters.init/<name>` (PEFT directories, e.g. written by `rolerl sft`)."""
    device = resolve_device(cfg.model.device)
    spec = cfg.model.spec
    dtype = resolve_precision(cfg.model.dtype, device, "model.dtype")
    if spec.startswith("tiny:"):
        model, tokenizer = tiny_model(spec.split(":", 1)[1], seed=cfg.run.seed, dtype=resolve_dtype(dtype))  # type: ignore[arg-type]
        model.to(device)
    else:
        model, tokenizer = load_model(spec, dtype=dtype, device=str(device))
    topology = Topology.from_preset(cfg.adapters.preset, roles, cfg.adapters.train_kinds)
    names = topology.adapter_names()
    targets = cfg.adapters.target_modules
    # LoRA's A is drawn from the global RNG: seed it from the run, so two same-seed runs start identical
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.run.seed)
        add_adapters(model, names, rank=cfg.adapters.rank, alpha=cfg.adapters.alpha, target_modules=targets)
    if cfg.adapters.init:
        found = [n for n in names if (Path(cfg.adapters.init) / n).is_dir()]
        if not found:
            raise FileNotFoundError(
                f"adapters.init={cfg.adapters.init!r} holds none of this run's adapters {names} (as PEFT "
                "directories named after them, e.g. `rolerl sft` output RUN_DIR/adapters)"
            )
        for name in names:
            if name in found:
                load_adapter(model, name, Path(cfg.adapters.init) / name)
            else:  # e.g. imitation covered only some roles of an isolated topology
                log.warning("adapters.init has no %r adapter; it starts fresh", name)
    model.to(device)
    model.eval()  # always: no dropout in rollout or training (a model built from a config starts in train mode)
    index = {n: i for i, n in enumerate(adapter_specs(model))}
    route_of = {role: topology.route_of(role, index) for role in roles}
    bf16 = resolve_bf16(cfg.train.bf16, device)
    return Policy(model, tokenizer, topology, route_of, device, bf16=bf16)


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
    chunk_size: int = 512,
    routes: torch.Tensor | int | None = None,
    with_entropy: bool = False,
    share_prefix: bool = True,
) -> TokenLogprobs:
    """`(B, T-1)` log-probs (and entropies) of `input_ids[:, 1:]` under `routes` (default: the batch's).

    Column `p` is about token `p + 1`, the alignment of `TrainBatch`'s masks (slice them `[:, :-1]`).
    Only positions on the loss mask run the LM head; the others get log-prob 0 and entropy 0 (no
    gradient). `routes=-1` is the reference. `share_prefix` computes each prompt shared by several rows
    once (`rolerl.train.prefix`; equal up to float rounding).
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
    )
    mask = keep[:, :-1]
    entropy = None if out.entropy is None else _scatter(out.entropy[0], mask)
    return TokenLogprobs(logp=_scatter(out.logp[0], mask), entropy=entropy)


def _scatter(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`(N,)` values into the `True` positions of `mask` `(B, T)`, zeros elsewhere (differentiable)."""
    return values.new_zeros(mask.shape).masked_scatter(mask, values)


EAGER_MAX_LEN = 1024


@contextlib.contextmanager
def _attention_for(model: nn.Module, ids: torch.Tensor):
    """Eager attention for short batches under CPU bf16 autocast: SDPA's CPU flash kernel is slow in backward
    there (8 x 123 tokens on the default model, fwd+bwd, one thread: 7.2 s with SDPA, 5.1-5.4 s eager; in
    fp32 the two are about equal, and eager's fp32 softmax would cost fp64 its precision). Eager keeps
    `(B, H, T, T)` scores per layer for backward, so long batches and GPUs keep the model's own kernel."""
    cpu_bf16 = ids.device.type == "cpu" and torch.is_autocast_enabled("cpu")
    if not cpu_bf16 or ids.shape[1] > EAGER_MAX_LEN:
        yield
        return
    with attention_implementation(model, "eager"):
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
