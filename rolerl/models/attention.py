"""Switching a Hugging Face model's attention implementation for the duration of a block."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def attention_implementation(model, name: str) -> Iterator[None]:
    """Run the block with `model`'s attention set to `name` (a transformers attention implementation or a
    name registered with `AttentionInterface`), on the config and any nested text config; restore after."""
    configs = {id(c): c for c in (model.config, getattr(model.config, "text_config", None)) if c is not None}
    saved = {k: c._attn_implementation for k, c in configs.items()}
    for c in configs.values():
        c._attn_implementation = name
    try:
        yield
    finally:
        for k, c in configs.items():
            c._attn_implementation = saved[k]


GROUPED_SDPA = "rolerl_grouped_sdpa"


def grouped_sdpa(
    module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs
):
    """transformers' SDPA attention, except that on CPU, with a mask, grouped K/V heads reach the kernel as
    they are (`enable_gqa`). transformers repeats K and V per query head whenever a mask is given (CUDA's
    fused kernels need it), and autograd keeps the repeated copies for backward: 3x the K/V bytes on a
    model with 3 query heads per KV head. PyTorch's CPU flash kernel takes grouped heads with a mask, forward
    and backward (the same outputs: the same kernel, reading each KV head once)."""
    from torch.nn import functional as F
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    grouped = key.shape[1] != query.shape[1]
    if (
        query.device.type == "cpu"
        and grouped
        and attention_mask is not None
        and query.shape[2] > 1
        and kwargs.get("position_bias") is None
        and kwargs.get("softcap") is None
    ):
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True
        )
        return out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(
        module,
        query,
        key,
        value,
        attention_mask,
        dropout=dropout,
        scaling=scaling,
        is_causal=is_causal,
        **kwargs,
    )


def register_grouped_sdpa() -> None:
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(GROUPED_SDPA, grouped_sdpa)
    AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)  # the masks transformers builds for SDPA


LEAN_EAGER = "rolerl_lean_eager"


def lean_eager(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' eager attention (Llama's `eager_attention_forward`) recomputed in backward
    (non-reentrant activation checkpointing of the attention alone): autograd keeps its inputs (the query,
    the K/V heads as they are, the mask) instead of what eager's ops keep, the probabilities twice (`(B, H,
    T, S)` in fp32 and in the compute dtype) and K/V repeated per query head. Under bf16 autocast that was
    about a third of what a training micro-batch kept (8 rows x ~240 positions on the default model), and
    it grows with the square of the length. The recomputation runs the same ops under the same autocast
    state, so values and gradients are eager's, bit for bit; the cost is eager's attention forward once
    more per layer in backward. For Llama-family models (their eager attention is Llama's and reads no other
    keyword argument); without grad, with dropout in training or `output_attentions`, plain eager."""
    from torch.utils.checkpoint import checkpoint
    from transformers.models.llama.modeling_llama import eager_attention_forward

    args = (module, query, key, value, attention_mask, scaling, dropout)
    dropping = dropout > 0 and module.training
    if dropping or not torch.is_grad_enabled() or kwargs.get("output_attentions"):
        return eager_attention_forward(*args, **kwargs)
    out, _ = checkpoint(eager_attention_forward, *args, use_reentrant=False, preserve_rng_state=False)
    return out, None


def register_lean_eager() -> None:
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import eager_mask

    AttentionInterface.register(LEAN_EAGER, lean_eager)
    AttentionMaskInterface.register(LEAN_EAGER, eager_mask)  # eager's additive masks
