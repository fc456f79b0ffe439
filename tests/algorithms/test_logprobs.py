"""Chunked log-probs == naive log-softmax (values and gradients), plus a value computed by hand."""

import math

import pytest
import torch

from rolerl.algorithms import chunked_logprobs, entropy_from_logits, logprobs_from_logits
from tests.tolerance import assert_close_ulps, ulp_tol


def _inputs(dtype=torch.float32, b=3, t=7, d=16, v=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, t, d, generator=g, dtype=dtype).requires_grad_()
    weight = (0.5 * torch.randn(v, d, generator=g, dtype=dtype)).requires_grad_()
    bias = (0.1 * torch.randn(v, generator=g, dtype=dtype)).requires_grad_()
    targets = torch.randint(0, v, (b, t), generator=g)
    targets[0, 2] = targets[-1, -1] = -100  # ignored positions (padding / non-policy)
    upstream = torch.randn(b, t, generator=g, dtype=dtype)  # a generic upstream gradient
    return hidden, weight, bias, targets, upstream


def test_hand_value():
    # d = 1, hidden 1, head rows (0, ln 2, ln 5): logits (0, ln 2, ln 5), softmax (1, 2, 5) / 8.
    hidden = torch.ones(1, 1, 1)
    weight = torch.tensor([[0.0], [math.log(2)], [math.log(5)]])
    out = chunked_logprobs(hidden, weight, torch.tensor([[2]]), with_entropy=True)
    torch.testing.assert_close(out.logp, torch.tensor([[math.log(5 / 8)]]))  # -0.470004
    h = -sum(p * math.log(p) for p in (1 / 8, 2 / 8, 5 / 8))  # 0.900256
    torch.testing.assert_close(out.entropy, torch.tensor([[h]]))
    # temperature 2: logits / 2 = (0, ln sqrt 2, ln sqrt 5); p = (1, 1.414214, 2.236068) / 4.650282
    out_t = chunked_logprobs(hidden, weight, torch.tensor([[2]]), temperature=2.0)
    torch.testing.assert_close(
        out_t.logp, torch.tensor([[math.log(math.sqrt(5) / (1 + math.sqrt(2) + math.sqrt(5)))]])
    )


@pytest.mark.parametrize("chunk_size", [1, 4, 21, 100])  # one position, ragged last chunk, exact, > N
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_equals_naive_fp32(chunk_size, temperature):
    hidden, weight, bias, targets, up = _inputs()
    out = chunked_logprobs(hidden, weight, targets, bias=bias, temperature=temperature, chunk_size=chunk_size)
    grads = torch.autograd.grad((out.logp * up).sum(), (hidden, weight, bias))

    logits = hidden @ weight.T + bias  # (B, T, V): the naive path materialises all of it
    ref = logprobs_from_logits(logits, targets, temperature=temperature)
    ref_grads = torch.autograd.grad((ref * up).sum(), (hidden, weight, bias))

    assert out.logp.dtype == torch.float32 and out.entropy is None
    # Logits from another matmul shape (a chunk vs the whole batch), then z - lse: a few ulps of the largest
    # |log-prob| apart (measured up to 1 ulp; an absolute 2e-6 was 2 ulps at |logp| ~ 8).
    assert_close_ulps(out.logp, ref, ulps=8)
    assert torch.equal(out.logp[0, 2], torch.tensor(0.0)) and torch.equal(out.logp[-1, -1], torch.tensor(0.0))
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)


def test_entropy_in_the_same_chunks():
    hidden, weight, bias, targets, up = _inputs()
    out = chunked_logprobs(
        hidden, weight, targets, bias=bias, temperature=0.7, chunk_size=5, with_entropy=True
    )
    loss = (out.logp * up).sum() - 0.3 * out.entropy.sum()
    grads = torch.autograd.grad(loss, (hidden, weight, bias))

    logits = hidden @ weight.T + bias
    ref_ent = entropy_from_logits(logits, temperature=0.7)
    ref_loss = (logprobs_from_logits(logits, targets, temperature=0.7) * up).sum() - 0.3 * ref_ent.sum()
    ref_grads = torch.autograd.grad(ref_loss, (hidden, weight, bias))

    # entropy is defined at every position, ignored targets included
    torch.testing.assert_close(out.entropy, ref_ent, rtol=0, atol=2e-6)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)


def test_gradcheck_fp64():
    hidden, weight, bias, targets, up = _inputs(torch.float64, b=2, t=3, d=4, v=6)

    def f(h, w, b):
        out = chunked_logprobs(h, w, targets, bias=b, temperature=0.7, chunk_size=2, with_entropy=True)
        return (out.logp * up).sum() + (out.entropy * up.flip(0)).sum()

    assert torch.autograd.gradcheck(f, (hidden, weight, bias), fast_mode=True)


def test_frozen_head_gets_no_grad_and_tied_weights_work():
    hidden, weight, _, targets, up = _inputs()
    frozen = weight.detach()  # an LM head LoRA does not train
    out = chunked_logprobs(hidden, frozen, targets, chunk_size=8)
    (out.logp * up).sum().backward()
    assert hidden.grad is not None and frozen.grad is None


def test_bf16_autocast_matches_naive_under_autocast():
    hidden, weight, bias, targets, up = _inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = chunked_logprobs(hidden, weight, targets, chunk_size=4)
        ref = logprobs_from_logits(hidden @ weight.T, targets)
    gh, gw = torch.autograd.grad((out.logp * up).sum(), (hidden, weight))
    rh, rw = torch.autograd.grad((ref * up).sum(), (hidden, weight))
    assert out.logp.dtype == torch.float32 and gh.dtype == torch.float32
    torch.testing.assert_close(out.logp, ref, rtol=0, atol=1e-4)
    torch.testing.assert_close(gh, rh, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(gw, rw, rtol=2e-2, atol=2e-2)


def test_bad_arguments():
    hidden, weight, _, targets, _ = _inputs()
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_logprobs(hidden, weight, targets, chunk_size=0)


def test_entropy_at_full_vocab_matches_fp64():
    """At the real vocabulary size (V = 49152) the fp32 entropy and its gradient stay within a few fp32 ulps
    of an fp64 reference. A length-V `bmm` dot product for E_p[z] was off by ~1e-5..1e-4 relative."""
    g = torch.Generator().manual_seed(0)
    v = 49152
    # d = 1 and powers of two for hidden: the fp32 logits are exact, so only the softmax maths is measured.
    hidden = torch.tensor([1.0, 2.0, 0.5, 4.0, 0.25, 1.0])[None, :, None]  # (1, 6, 1)
    weight = (3 * torch.randn(v, 1, generator=g)).requires_grad_()
    targets = torch.zeros(1, 6, dtype=torch.long)
    out = chunked_logprobs(hidden, weight, targets, chunk_size=4, with_entropy=True)
    (grad,) = torch.autograd.grad(out.entropy.sum(), weight)

    w64 = weight.detach().double().requires_grad_()
    logsm = torch.log_softmax(hidden.double() @ w64.T, dim=-1)  # (1, 6, V)
    ref = -(logsm.exp() * logsm).sum(-1)
    (ref_grad,) = torch.autograd.grad(ref.sum(), w64)
    logsm, ref = logsm.detach(), ref.detach()

    # H = log Σ exp z - E_p[z]: exp and log within an ulp, pairwise sums over V within a few ulps, so a
    # few ulps of the terms' size (|E_p[z]| <= |log Σ exp z| + H); the gradient Σ_t h_t p (log p + H) likewise.
    eps = torch.finfo(torch.float32).eps
    terms = 2 * ref.abs().max() + logsm.logsumexp(-1).abs().max()
    torch.testing.assert_close(out.entropy.double(), ref, rtol=0, atol=16 * eps * float(terms))
    scale = float((hidden * logsm.exp() * (logsm.abs() + ref[..., None])).sum(1).max())
    torch.testing.assert_close(grad.double(), ref_grad, rtol=0, atol=16 * eps * scale)


def test_default_chunk_keeps_each_cpu_block_within_the_kept_heap():
    """On CPU the default chunk is the most positions whose fp32 `(chunk, V)` logits fit in 32 MiB (2^25
    bytes / (4 V), floored, at least 16); on a GPU 512. Worked by hand: 2^25 / 196,608 = 170.7 at the
    default model's 49,152 tokens; 2^25 / 607,744 = 55.2 at Qwen's 151,936."""
    from rolerl.algorithms.logprobs import chunk_positions

    assert chunk_positions(49_152, "cpu") == 170
    assert chunk_positions(151_936, "cpu") == 55
    assert chunk_positions(10_000_000, "cpu") == 16
    assert chunk_positions(50, "cpu") == 167_772
    assert chunk_positions(151_936, "cuda") == 512
    # the default chunking is a chunking like any other: the same values as one chunk per position
    hidden, weight, bias, targets, _ = _inputs()
    default = chunked_logprobs(hidden, weight, targets, bias=bias)
    single = chunked_logprobs(hidden, weight, targets, bias=bias, chunk_size=1)
    assert_close_ulps(default.logp, single.logp, ulps=8)


def _node(out):
    """The `_ChunkedLogprobs` node behind `out.logp` (a view of its output)."""
    return out.logp.grad_fn.next_functions[0][0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_frozen_head_gradient_from_the_forward_equals_the_recomputed_one(dtype, temperature):
    """A frozen head (LoRA) without entropy: backward forms `(W[target] - E_p[W]) / T` from the `E_p[W]` the
    forward saved, instead of recomputing the logits. The hidden gradient equals the recomputing path's
    (the same head trainable) and the naive reference's, ignored positions included (zero)."""
    hidden, weight, bias, targets, up = _inputs(dtype)
    frozen_w, frozen_b = weight.detach(), bias.detach()
    direct = chunked_logprobs(hidden, frozen_w, targets, bias=frozen_b, temperature=temperature, chunk_size=4)
    (g_direct,) = torch.autograd.grad((direct.logp * up).sum(), hidden)
    recomputed = chunked_logprobs(hidden, weight, targets, bias=bias, temperature=temperature, chunk_size=4)
    g_recomputed, _ = torch.autograd.grad((recomputed.logp * up).sum(), (hidden, weight))
    ref = logprobs_from_logits(hidden @ frozen_w.T + frozen_b, targets, temperature=temperature)
    (g_ref,) = torch.autograd.grad((ref * up).sum(), hidden)
    assert torch.equal(direct.logp, recomputed.logp)  # the forward's values do not change
    assert _node(direct).direct and not _node(recomputed).direct  # each path ran
    assert g_direct.dtype == dtype
    # sums over V in another order (E_p[W] then the difference, against p·g then the GEMM): a few ulps
    assert_close_ulps(g_direct, g_recomputed, 16)
    assert_close_ulps(g_direct, g_ref, 16)
    assert torch.equal(g_direct[0, 2], torch.zeros_like(g_direct[0, 2]))  # an ignored position


def test_frozen_head_gradient_from_the_forward_under_bf16_autocast():
    """Under bf16 autocast `E_p[W]` comes from a bf16 GEMM of the probabilities, as the recomputing path's
    gradient comes from a bf16 GEMM of `p·g`: both within bf16 rounding of the fp32 reference."""
    hidden, weight, _, targets, up = _inputs(d=64, v=300)
    frozen = weight.detach()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        direct = chunked_logprobs(hidden, frozen, targets, chunk_size=4)
        recomputed = chunked_logprobs(hidden, weight, targets, chunk_size=4)
    (g_direct,) = torch.autograd.grad((direct.logp * up).sum(), hidden)
    g_recomputed, _ = torch.autograd.grad((recomputed.logp * up).sum(), (hidden, weight))
    (g_ref,) = torch.autograd.grad((chunked_logprobs(hidden, weight, targets).logp * up).sum(), hidden)
    assert g_direct.dtype == torch.float32 and _node(direct).direct
    err_direct, err_recomputed = (g_direct - g_ref).abs().max(), (g_recomputed - g_ref).abs().max()
    # hidden and W rounded to bf16 (2^-8 relative) dominate both; the direct path adds no more than that
    assert err_direct <= 2 * err_recomputed + ulp_tol(g_ref, 4, torch.bfloat16)
    assert_close_ulps(g_direct, g_ref, 32, torch.bfloat16)


def test_entropy_as_a_metric_takes_the_frozen_head_path():
    """`entropy_grad=False` (the update's entropy when no role's coefficient uses it): the same log-probs and
    entropies bit for bit, an entropy without gradient, and a frozen head's backward from `E_p[W]` (no
    logits recomputed), whose hidden gradient is the recomputing path's within a few ulps."""
    hidden, weight, _, targets, up = _inputs(v=300)
    frozen = weight.detach()
    metric = chunked_logprobs(hidden, frozen, targets, chunk_size=4, with_entropy=True, entropy_grad=False)
    full = chunked_logprobs(hidden, frozen, targets, chunk_size=4, with_entropy=True)
    assert torch.equal(metric.logp, full.logp) and torch.equal(metric.entropy, full.entropy)
    assert not metric.entropy.requires_grad and full.entropy.requires_grad
    assert _node(metric).direct and not _node(full).direct
    (g_metric,) = torch.autograd.grad((metric.logp * up).sum(), hidden)
    (g_full,) = torch.autograd.grad((full.logp * up).sum(), hidden)
    assert_close_ulps(g_metric, g_full, 16)


class _HeadCasts(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the dtype casts of tensors with `numel` elements (the head's) that run inside the block."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.numel, self.count = numel, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default and args[0].numel() == self.numel:
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("frozen", [True, False])
def test_bf16_autocast_casts_the_head_once_per_pass(frozen, monkeypatch):
    """Under bf16 autocast an fp32 head is cast once per forward and once per backward, not once per chunk
    and GEMM (on the default model each of those casts cost about as much as the chunk's GEMM), with the
    values of autocast's own per-chunk casts: the same log-probs, entropies and gradients bit for bit."""
    from rolerl.algorithms import logprobs

    hidden, weight, _, targets, up = _inputs(d=64, v=300)
    weight = weight.detach().requires_grad_(not frozen)
    wrt = (hidden,) if frozen else (hidden, weight)

    def run():
        with torch.autocast("cpu", dtype=torch.bfloat16), _HeadCasts(weight.numel()) as fwd:
            out = chunked_logprobs(hidden, weight, targets, chunk_size=4, with_entropy=True,
                                   entropy_grad=False)  # fmt: skip
        with _HeadCasts(weight.numel()) as bwd:
            grads = torch.autograd.grad((out.logp * up).sum(), wrt)
        return out, grads, fwd.count, bwd.count

    out, grads, fwd, bwd = run()
    assert fwd == 1  # 21 positions: 6 chunks, each with a logits GEMM and an E_p[W] one
    assert bwd == (0 if frozen else 1)  # the frozen head's backward runs no GEMM
    monkeypatch.setattr(logprobs, "_gemm_weight", lambda w: w)  # autocast casts the head for each GEMM
    ref, ref_grads, ref_fwd, _ = run()
    assert ref_fwd == (12 if frozen else 6)  # (the trainable head's forward: the logits GEMM only)
    assert torch.equal(out.logp, ref.logp) and torch.equal(out.entropy, ref.entropy)
    for g, r in zip(grads, ref_grads, strict=True):
        assert torch.equal(g, r)
