"""Switching a Hugging Face model's attention implementation for the duration of a block."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.autograd.function import once_differentiable


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
    """transformers' eager attention (Llama's `eager_attention_forward`) as one autograd node that keeps its
    inputs, not its probabilities, and recomputes them in backward (`_GroupedEager`). Eager's autograd keeps
    the probabilities twice (`(B, H, T, S)` in fp32 and in the compute dtype) and K/V repeated per query
    head: under bf16 autocast about a third of what a training micro-batch kept (8 rows x ~240 positions on
    the default model), growing with the square of the length. For Llama-family models (their eager
    attention is Llama's and reads no other keyword argument); without grad, with dropout in training,
    `output_attentions` or a mask of another form, eager's own ops (recomputed in backward, as a
    checkpoint, where grad is on)."""
    from torch.utils.checkpoint import checkpoint
    from transformers.models.llama.modeling_llama import eager_attention_forward

    args = (module, query, key, value, attention_mask, scaling, dropout)
    dropping = dropout > 0 and module.training
    if dropping or kwargs.get("output_attentions"):
        return eager_attention_forward(*args, **kwargs)
    if _GroupedEager.applies(query, key, value, attention_mask):
        dev = query.device.type
        dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else query.dtype
        if not torch.is_grad_enabled():
            return _grouped_eager(query, key, value, attention_mask, scaling, dtype)[0], None
        return _GroupedEager.apply(query, key, value, attention_mask, scaling, dtype), None
    if not torch.is_grad_enabled():
        return eager_attention_forward(*args, **kwargs)
    out, _ = checkpoint(eager_attention_forward, *args, use_reentrant=False, preserve_rng_state=False)
    return out, None


def _grouped_eager(query, key, value, mask, scaling, dtype):
    """`(out (B, T, H, D), grouped queries (B, Hkv, G·T, D), keys, values)` in `dtype`: `_GroupedEager`'s
    forward (with or without autograd)."""
    b, h, t, d = query.shape
    hkv, s = key.shape[1], key.shape[2]
    g = h // hkv
    with torch.autocast(query.device.type, enabled=False):
        qg = query.to(dtype).reshape(b, hkv, g * t, d)
        kc, vc = key.to(dtype), value.to(dtype)
        p = _probabilities(qg, kc, mask, scaling, (b, h, t, s))
        pc = p.to(query.dtype).to(dtype).view(b, hkv, g * t, s)  # eager: `.to(query.dtype)`, then autocast
        del p
        out = torch.matmul(pc, vc).view(b, h, t, d).transpose(1, 2).contiguous()  # (B, T, H, D)
    return out, qg, kc, vc


def _probabilities(qg, kc, mask, scaling, shape) -> torch.Tensor:
    """`(B, H, T, S)` fp32 softmax of the scaled scores plus the mask, from the grouped queries `qg`
    `(B, Hkv, G·T, D)` and the keys `kc` in the compute dtype (eager's rounding at every step)."""
    scores = torch.matmul(qg, kc.transpose(-1, -2)).mul_(scaling).view(shape)  # compute dtype
    if mask is not None:
        scores = scores + mask  # eager adds the mask in its dtype (fp32): the sum is promoted
    return torch.softmax(scores, dim=-1, dtype=torch.float32)


class _GroupedEager(torch.autograd.Function):
    """Eager attention's values, `softmax(q k^T * scaling + mask) v` with the softmax in fp32, computed as
    eager computes them under autocast (or without: `dtype` is autocast's or the query's): q and k cast to
    `dtype` for the scores' GEMM, the scaled scores plus the additive mask, softmax in fp32, cast to the
    query's dtype and to `dtype` for the GEMM with v. The `G` query heads of a KV head run as one GEMM of
    `G·T` rows against that head's keys (eager repeats K and V per query head first), and backward's
    `dK` and `dV` GEMMs sum over the group as they go.

    Kept for backward: q, k and v in `dtype` and the mask; backward recomputes the scores (one GEMM) and
    their softmax, not eager's whole forward, and forms the gradients with four GEMMs:
    `dV = P^T dO`, `dP = dO V^T`, `dS = P (dP - rowsum(dP P))`, `dQ = dS K s`, `dK = dS^T Q s`."""

    @staticmethod
    def applies(
        query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None
    ) -> bool:
        """Whether the inputs have the forms eager's Llama attention gets: `(B, H, T, D)` queries, `(B, Hkv,
        S, D)` keys and values with `H` a multiple of `Hkv`, an additive float mask `(B or 1, 1, T, S)`."""
        if query.dim() != 4 or key.shape != value.shape or key.dim() != 4:
            return False
        b, h, t, _ = query.shape
        if key.shape[0] != b or h % key.shape[1] or key.shape[3] != query.shape[3]:
            return False
        if mask is None:
            return True
        return (
            mask.is_floating_point()
            and mask.dim() == 4
            and mask.shape[0] in (1, b)
            and mask.shape[1] == 1
            and tuple(mask.shape[2:]) == (t, key.shape[2])
        )

    @staticmethod
    def forward(ctx, query, key, value, mask, scaling, dtype):
        out, qg, kc, vc = _grouped_eager(query, key, value, mask, scaling, dtype)
        ctx.save_for_backward(qg, kc, vc, mask)
        ctx.scaling, ctx.dtypes = scaling, (query.dtype, key.dtype, value.dtype)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        qg, kc, vc, mask = ctx.saved_tensors
        q_dtype, k_dtype, v_dtype = ctx.dtypes
        b, hkv, gt, d = qg.shape
        s = kc.shape[2]
        h = grad.shape[2]
        t = gt // (h // hkv)
        dtype = qg.dtype
        with torch.autocast(qg.device.type, enabled=False):
            p = _probabilities(qg, kc, mask, ctx.scaling, (b, h, t, s))  # (B, H, T, S)
            dout = grad.to(dtype).transpose(1, 2).reshape(b, hkv, gt, d)  # (B, Hkv, G·T, D)
            dq = dk = dv = None
            if ctx.needs_input_grad[2]:
                pc = p.to(q_dtype).to(dtype).view(b, hkv, gt, s)
                dv = torch.matmul(pc.transpose(-1, -2), dout).to(v_dtype)  # (B, Hkv, S, D)
                del pc
            if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
                dp = torch.matmul(dout, vc.transpose(-1, -2)).view(b, h, t, s).float()  # (B, H, T, S)
                ds = dp.sub_((dp * p).sum(-1, keepdim=True)).mul_(p)  # softmax's backward, in fp32
                del p
                dsc = ds.to(dtype).mul_(ctx.scaling).view(b, hkv, gt, s)  # through the scaling, as eager
                del ds, dp
                if ctx.needs_input_grad[0]:
                    dq = torch.matmul(dsc, kc).view(b, h, t, d).to(q_dtype)
                if ctx.needs_input_grad[1]:
                    dk = torch.matmul(dsc.transpose(-1, -2), qg).to(k_dtype)  # (B, Hkv, S, D)
        return dq, dk, dv, None, None, None


def register_lean_eager() -> None:
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import eager_mask

    AttentionInterface.register(LEAN_EAGER, lean_eager)
    AttentionMaskInterface.register(LEAN_EAGER, eager_mask)  # eager's additive masks
