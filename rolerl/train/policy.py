"""The trained model's routed forward to per-token log-probs (the model itself: `rolerl.run.policy`).

One forward serves the trainer, the reference (route -1: the same weights with adapters off, no second
copy) and SFT: the decoder's hidden states under the batch's routes, then `chunked_logprobs` with the
rollout temperature, so the `(B, T, V)` logits never exist at once (DESIGN "Log-probs").
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
from torch import nn

from rolerl.algorithms import TokenLogprobs, chunked_logprobs
from rolerl.heap import LARGEST_KEPT_BLOCK
from rolerl.models import lean_ops
from rolerl.models.attention import (
    GROUPED_SDPA,
    LEAN_EAGER,
    attention_implementation,
    register_grouped_sdpa,
    register_lean_eager,
)
from rolerl.train.prefix import carriers, hidden_at
from rolerl.types import TrainBatch


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
    mask = keep[:, :-1]
    head = model.get_output_embeddings()
    route = batch.routes if routes is None else routes
    index = None  # where each of the batch's kept positions is among the carriers' (`carried`)
    if share_prefix:
        batch, route, keep, index = carried(batch, route, keep)
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

    def per_row(values: torch.Tensor) -> torch.Tensor:  # (1, N) at the forward's kept positions -> (B, T-1)
        return _scatter(values[0] if index is None else values[0][index], mask)

    entropy = None if out.entropy is None else per_row(out.entropy)
    return TokenLogprobs(logp=per_row(out.logp), entropy=entropy)


def carried(
    batch: TrainBatch, routes: torch.Tensor | int, keep: torch.Tensor
) -> tuple[TrainBatch, torch.Tensor | int, torch.Tensor, torch.Tensor | None]:
    """The forward of `batch` reduced to its carriers (`rolerl.train.prefix.carriers`: the rows no other
    row starts with), keeping every position any row keeps: `(carriers' batch, their routes, their keep,
    index)`, where `index` `(N,)` gives each of `batch`'s kept positions (row-major) its place among the
    carriers' kept ones. `(batch, routes, keep, None)` when every row is its own carrier."""
    carrier = carriers(batch)
    own = sorted(set(carrier))
    if len(own) == len(carrier):
        return batch, routes, keep, None
    forward = select_rows(batch, own)
    width = forward.input_ids.shape[1]
    local = torch.full((len(carrier),), -1, dtype=torch.long, device=keep.device)
    local[own] = torch.arange(len(own), device=keep.device)
    row_of = local[torch.tensor(carrier, device=keep.device)]  # (B,) each row's carrier in `forward`
    rows, pos = keep.nonzero(as_tuple=True)  # (N,) row-major
    kept = torch.zeros(len(own), width, dtype=torch.bool, device=keep.device)
    kept[row_of[rows], pos] = True
    slot = torch.full(kept.shape, -1, dtype=torch.long, device=keep.device)
    slot[kept] = torch.arange(int(kept.sum()), device=keep.device)
    own_routes = routes if isinstance(routes, int) else routes[own][:, :width]
    return forward, own_routes, kept, slot[row_of[rows], pos]


def _scatter(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`(N,)` values into the `True` positions of `mask` `(B, T)`, zeros elsewhere (differentiable)."""
    return values.new_zeros(mask.shape).masked_scatter(mask, values)


# The largest `(B, H, T, T)` block of fp32 attention scores the trainer's eager attention may build: the largest
# block glibc serves from the heap kept by `rolerl.heap` (its mmap threshold). Larger blocks are mapped for
# each allocation and every page faulted in again: the first update of a 512-token GRPO run (8 rows x ~570
# positions per micro-batch) took 69.7 s and 12.9 million page faults with eager, 44.4 s and 1.6 million
# with SDPA, which builds no such block (docs/history/BENCHMARKS-history.md, GRPO round thirteen).
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
