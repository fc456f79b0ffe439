"""Per-token log-probs (and entropy) of target tokens from hidden states and the LM head, in chunks.

The trainer needs `log_softmax(h W^T / T)[target]` at every response position. Materialising the
`(B, T, V)` logits, their log-softmax and its gradient costs `3 · B·T·V` floats (1.7 GB in fp32 at
B=8, T=384, V=49152), far more than a 135M model's weights. `chunked_logprobs` computes the logits
`chunk_size` positions at a time, with at most two `(chunk, V)` blocks alive; its backward recomputes
each block's logits instead of storing them (a custom autograd.Function: the recompute is one matmul
per chunk, the softmax gradient is formed in place, the head's gradient accumulated with `addmm_`).
What is saved for backward is one float per position (the log-sum-exp) plus references to `hidden`
and the head weight, which are alive anyway. `benchmarks/chunked_logprobs.py` measures the peaks.
With a frozen head (LoRA training) and no entropy gradient, the forward also forms `E_p[W]` per position
(`(N, d)`, one GEMM per chunk from the probabilities it already has), and backward is
`(W[target] - E_p[W]) / T` per position: no logits recomputed, no GEMM (of the head's three GEMMs per
position, forward, recompute and input gradient, two remain).

Alignment is the caller's job: position `p`'s hidden state predicts token `p + 1`, so pass
`hidden[:, :-1]` with `input_ids[:, 1:]`. The head must be a plain linear (weight `(V, d)`, optional
bias); a model with final-logit soft-capping or a logit scale needs that folded in first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from rolerl.gemm import linear, matmul
from rolerl.heap import LARGEST_KEPT_BLOCK

GPU_CHUNK = 512  # positions per chunk on an accelerator (its caching allocator reuses any block size)


@dataclass(frozen=True)
class TokenLogprobs:
    logp: Tensor  # (B, T) fp32 (fp64 for fp64 inputs) log_softmax(logits / T)[target]; 0 where ignored
    entropy: Tensor | None  # (B, T) entropy of softmax(logits / T), or None if not asked for


def _acc_dtype(x: Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)  # bf16/fp16/fp32 -> fp32; fp64 stays fp64


def chunk_positions(vocab: int, device: torch.device | str) -> int:
    """The default positions per chunk. On CPU, the most whose fp32 `(chunk, V)` block fits the largest
    block the kept heap serves (`rolerl.heap`; 170 at V = 49,152, 55 at 151,936, never under 16): a larger
    block is mapped for each allocation and its pages faulted in again, chunk after chunk (a 512-token GRPO
    update on the default model: 0.34 GB more peak and 0.7 million more faults at 512 positions than at
    128; docs/history/BENCHMARKS-history.md, GRPO round thirteen). On accelerators 512."""
    if torch.device(device).type != "cpu":
        return GPU_CHUNK
    return max(16, LARGEST_KEPT_BLOCK // (4 * vocab))


def _gemm_weight(weight: Tensor) -> Tensor:
    """The head as every chunk's GEMM reads it: under autocast (bf16 training) an fp32 head cast once per
    pass, where autocast would cast all of it again for each chunk's GEMM (on the default model a strided
    copy of `W^T` per chunk, as long as the chunk's GEMM itself); otherwise `weight`. The same values:
    autocast's cast is this one."""
    dev = weight.device.type
    if torch.is_autocast_enabled(dev) and weight.dtype == torch.float32:
        return weight.to(torch.get_autocast_dtype(dev))
    return weight


def _block_logits(h: Tensor, weight: Tensor, bias: Tensor | None, temperature: float) -> Tensor:
    """`(n, d) -> (n, V)` logits / T for one chunk of positions (a fresh buffer, safe to edit)."""
    acc = _acc_dtype(h)
    z = linear(h, weight).to(acc)  # (n, V); the matmul in the model's dtype, softmax maths in >= fp32
    if bias is not None:
        z = z + bias.to(acc)
    return z.div_(temperature) if temperature != 1.0 else z


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk_size, with_entropy, direct):
        # hidden (N, d), weight (V, d), bias (V,) | None, targets (N,) long with ignore positions < 0.
        # direct: only `hidden` needs a gradient, through logp alone (see `chunked_logprobs`)
        n_pos = hidden.shape[0]
        valid = targets >= 0  # (N,)
        safe = targets.clamp(min=0)  # (N,) gather index
        acc = _acc_dtype(hidden)
        logp = hidden.new_zeros(n_pos, dtype=acc)  # (N,)
        lse = hidden.new_empty(n_pos, dtype=acc)  # (N,) the only per-position state we keep
        ent = hidden.new_empty(n_pos if with_entropy else 0, dtype=acc)  # (N,) or (0,)
        expect = hidden.new_empty((n_pos if direct else 0, hidden.shape[1]), dtype=acc)  # (N, d) E_p[W]
        w = _gemm_weight(weight)
        for s in range(0, n_pos, chunk_size):
            e = min(s + chunk_size, n_pos)
            z = _block_logits(hidden[s:e], w, bias, temperature)  # (n, V)
            # One pass each: max, shift in place, exp, sum (logsumexp would allocate its own shifted copy).
            top = z.amax(dim=-1)  # (n,)
            z.sub_(top[:, None])  # (n, V) logits - max, <= 0
            logp[s:e] = z.gather(1, safe[s:e, None]).squeeze(1)  # minus log Σ exp, below
            p = torch.exp(z) if with_entropy else z.exp_()  # (n, V) unnormalised probabilities
            total = p.sum(dim=-1)  # (n,) >= 1 (the max term is exp 0)
            log_total = total.log()
            lse[s:e] = top + log_total
            logp[s:e] -= log_total
            if with_entropy:  # H = log Σ exp z - E_p[z] with z <= 0: a sum of two terms >= 0, no cancellation
                ent[s:e] = log_total - _rowdot(p, z, hidden.device.type) / total
            if direct:  # E_p[W]: the head rows averaged under the softmax, as backward's GEMM would form them
                expect[s:e] = matmul(p.to(w.dtype), w).to(acc).div_(total[:, None])
            del z, p
        del w
        logp = logp.masked_fill_(~valid, 0.0)
        ctx.save_for_backward(hidden, weight, bias, targets, lse, expect)
        ctx.direct = direct
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        # Recompute under the forward's autocast state (bf16 training), or the recomputed logits would
        # not be the ones whose log-sum-exp we saved.
        dev = hidden.device.type
        ctx.autocast = (dev, torch.get_autocast_dtype(dev), torch.is_autocast_enabled(dev))
        if not with_entropy or direct:
            ctx.mark_non_differentiable(ent)
        ctx.set_materialize_grads(False)  # an output the loss does not use arrives as None: skip its work
        return logp, ent

    @staticmethod
    @once_differentiable
    def backward(ctx, g_logp, g_ent):
        hidden, weight, bias, targets, lse, expect = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        valid = targets >= 0
        safe = targets.clamp(min=0)
        if g_logp is None:
            g_logp = lse.new_zeros(lse.shape)
        g_logp = torch.where(valid, g_logp, torch.zeros_like(g_logp))  # (N,) ignored targets: no grad
        if ctx.direct:  # d logp / d h = (W[target] - E_p[W]) / T: no logits again, no GEMM
            own = weight.index_select(0, safe).to(expect.dtype)  # (N, d)
            grad_h = own.sub_(expect).mul_((g_logp / ctx.temperature)[:, None]).to(hidden.dtype)
            return grad_h, None, None, None, None, None, None, None
        grad_h = torch.empty_like(hidden) if need_h else None  # (N, d)
        acc = lse.dtype
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None  # (V, d)
        grad_b = torch.zeros(weight.shape[0], dtype=acc, device=weight.device) if need_b else None  # (V,)
        dev, amp_dtype, amp_on = ctx.autocast
        with torch.autocast(dev, dtype=amp_dtype, enabled=amp_on):
            _chunked_backward(ctx, hidden, weight, bias, safe, lse, g_logp, g_ent, grad_h, grad_w, grad_b)
        grad_w = grad_w.to(weight.dtype) if need_w else None
        grad_b = grad_b.to(bias.dtype) if need_b else None
        return grad_h, grad_w, grad_b, None, None, None, None, None


def _chunked_backward(ctx, hidden, weight, bias, safe, lse, g_logp, g_ent, grad_h, grad_w, grad_b) -> None:
    """Accumulate the gradients chunk by chunk into `grad_h (N, d)`, `grad_w (V, d)`, `grad_b (V,)`."""
    use_ent = g_ent is not None and g_ent.numel() > 0
    w = _gemm_weight(weight)
    for s in range(0, hidden.shape[0], ctx.chunk_size):
        e = min(s + ctx.chunk_size, hidden.shape[0])
        h = hidden[s:e]  # (n, d)
        z = _block_logits(h, w, bias, ctx.temperature)  # (n, V) recomputed, not stored
        # d logp_tgt / dz = onehot(tgt) - p;  dH/dz = -p (z - E_p[z]).  At most two (n, V) buffers live.
        if use_ent:
            logsm = z.sub_(lse[s:e, None])  # (n, V) log-softmax, in z's buffer
            p = logsm.exp()  # (n, V) softmax
            neg_h = _rowdot(p, logsm, hidden.device.type)  # (n,) E_p[log p] = -H
            # -p (z - E_p[z]) = -p (log p - E_p[log p]); reuses z's buffer
            grad_z = logsm.sub_(neg_h[:, None]).mul_(p).mul_(-g_ent[s:e, None])  # (n, V)
            grad_z.addcmul_(p, g_logp[s:e, None], value=-1.0)
            del p
        else:
            grad_z = z.sub_(lse[s:e, None]).exp_().mul_(-g_logp[s:e, None])  # (n, V) -p·g, in z's buffer
        grad_z.scatter_add_(1, safe[s:e, None], g_logp[s:e, None])
        if ctx.temperature != 1.0:
            grad_z.div_(ctx.temperature)  # chain rule through z = logits / T
        if grad_b is not None:
            grad_b += grad_z.sum(dim=0)
        if grad_h is not None:
            grad_h[s:e] = matmul(grad_z.to(w.dtype), w)  # (n, d), in the autocast dtype if any
        if grad_w is not None:
            # In place and in the accumulation dtype (in-place ops are exempt from autocast): no (V, d)
            # temporary per chunk, and a full-precision weight gradient under bf16 autocast.
            grad_w.addmm_(grad_z.T, h.to(grad_w.dtype))  # (V, d)
        del grad_z


def _rowdot(a: Tensor, b: Tensor, device_type: str) -> Tensor:
    """`(a * b).sum(-1)` for `(n, V)` blocks, a few rows at a time: a `(rows, V)` temporary of ~4 MB, not
    another `(n, V)` block. An elementwise product and a sum, not `bmm`: in fp32 a length-V `bmm` dot
    product is off by 1e-5..1e-4 relative at V = 49152, the sum's pairwise reduction by ~1e-7."""
    rows = max(1, (1 << 20) // max(1, a.shape[1]))
    with torch.autocast(device_type, enabled=False):
        if a.shape[0] <= rows:
            return (a * b).sum(-1)
        return torch.cat([(a[s : s + rows] * b[s : s + rows]).sum(-1) for s in range(0, a.shape[0], rows)])


def chunked_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    bias: Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    ignore_index: int = -100,
) -> TokenLogprobs:
    """`log_softmax((hidden @ weight.T + bias) / temperature)[targets]`, `chunk_size` positions at a time
    (default `chunk_positions`).

    hidden `(B, T, d)`, weight `(V, d)` (the LM head, or the tied embedding), targets `(B, T)` long.
    Positions whose target equals `ignore_index` get log-prob 0 and no gradient. Values and gradients
    (w.r.t. hidden, weight and bias) match `logprobs_from_logits` on the full logits up to float
    rounding; peak extra memory is `O(chunk_size · V)` instead of `O(B · T · V)`. Entropy, if asked
    for, is computed from the same chunks and is differentiable too, unless `entropy_grad=False` (a
    metric only: a frozen head's backward then takes the path without logits). Not twice differentiable.
    """
    if chunk_size is None:
        chunk_size = chunk_positions(weight.shape[0], hidden.device)
    if temperature <= 0 or chunk_size <= 0:
        raise ValueError(f"temperature and chunk_size must be > 0; got {temperature}, {chunk_size}")
    b, t, d = hidden.shape
    tgt = targets.reshape(-1).long()  # (N,)
    tgt = torch.where(tgt == ignore_index, torch.full_like(tgt, -1), tgt)
    # A frozen head (LoRA training) with no entropy gradient: backward needs only E_p[W] per position,
    # formed in the forward from the probabilities it already has (one GEMM per chunk); backward then runs
    # no GEMM and no logits, where it would recompute each chunk's logits and multiply their gradient by W
    direct = (
        torch.is_grad_enabled()
        and hidden.requires_grad
        and not weight.requires_grad
        and (bias is None or not bias.requires_grad)
        and not (with_entropy and entropy_grad)
    )
    logp, ent = _ChunkedLogprobs.apply(
        hidden.reshape(b * t, d), weight, bias, tgt, float(temperature), int(chunk_size), with_entropy, direct
    )
    return TokenLogprobs(logp=logp.view(b, t), entropy=ent.view(b, t) if with_entropy else None)


def logprobs_from_logits(
    logits: Tensor, targets: Tensor, *, temperature: float = 1.0, ignore_index: int = -100
) -> Tensor:
    """The naive reference: `log_softmax(logits / T)[targets]`, `(B, T, V) -> (B, T)`, fp32 (fp64 in, fp64).

    Materialises the full log-softmax; fine for small vocabularies and tests, and the definition
    `chunked_logprobs` must reproduce.
    """
    valid = targets != ignore_index  # (B, T)
    acc = torch.promote_types(logits.dtype, torch.float32)
    logsm = torch.log_softmax(logits.to(acc) / temperature, dim=-1)  # (B, T, V)
    logp = logsm.gather(-1, torch.where(valid, targets, 0).long()[..., None]).squeeze(-1)  # (B, T)
    return torch.where(valid, logp, torch.zeros_like(logp))
