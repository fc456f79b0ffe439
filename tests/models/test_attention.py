"""`grouped_sdpa`: transformers' SDPA attention with grouped K/V heads passed to the CPU kernel as they are.
The same logits and gradients as the model's own SDPA with a padding mask and with the trainer's shared-
prefix mask, and K/V kept for backward once per KV head, not once per query head. `lean_eager`: eager
attention as one node that recomputes its probabilities in backward instead of keeping them."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import rolerl
from rolerl.models.attention import (
    GROUPED_SDPA,
    LEAN_EAGER,
    attention_implementation,
    register_grouped_sdpa,
    register_lean_eager,
)
from rolerl.models.lora import routes as routes_ctx
from tests.models.test_lora import randomize_adapters
from tests.tolerance import assert_close_ulps, ulp_tol


def forward_backward(model, ids, mask, name: str | None):
    ctx = attention_implementation(model, name) if name else attention_implementation(model, "sdpa")
    shapes = []
    with (
        ctx,
        routes_ctx(model, 0),
        torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t),
    ):
        logits = model(input_ids=ids, attention_mask=mask).logits
    (logits * mask[..., None]).square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads, shapes


def padded_case(tiny):
    """The tiny model with a random adapter, a copy of it, and 3 rows with right padding (transformers
    then builds a 4D mask)."""
    model, tok = tiny
    rolerl.add_adapters(model, ["a"], rank=4)
    randomize_adapters(model, std=0.1)
    ids = torch.tensor([tok.encode("One two three four five six seven", add_special_tokens=False)] * 3)
    mask = torch.ones_like(ids)
    mask[1, 5:], mask[2, 3:] = 0, 0
    return model, copy.deepcopy(model), ids, mask


def test_grouped_sdpa_equals_sdpa_and_keeps_kv_once(tiny):
    model, plain, ids, mask = padded_case(tiny)
    register_grouped_sdpa()
    got, got_grads, got_shapes = forward_backward(model, ids, mask, GROUPED_SDPA)
    want, want_grads, want_shapes = forward_backward(plain, ids, mask, None)
    # the same CPU flash kernel over the same values (bit for bit on the CPUs we ran); a few ulps of room in
    # case another CPU's dispatch blocks grouped heads differently
    assert_close_ulps(got, want, 8, torch.float32)
    assert got_grads.keys() == want_grads.keys() and got_grads
    for name, g in got_grads.items():
        # backward sums a KV head's gradient over its query heads in another order: fp32 rounding
        assert_close_ulps(g, want_grads[name], 64, torch.float32, msg=name)
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv = (3, config.num_key_value_heads, ids.shape[1], head_dim)
    repeated = (3, config.num_attention_heads, ids.shape[1], head_dim)
    assert want_shapes.count(repeated) > got_shapes.count(repeated)  # the model's SDPA keeps repeated K/V
    assert got_shapes.count(kv) >= 2 * config.num_hidden_layers  # K and V kept per KV head


def max_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref.double()).abs().max())


@pytest.mark.parametrize("autocast", [False, True])
def test_lean_eager_within_eager_rounding_and_keeps_no_probabilities(tiny, autocast):
    """`lean_eager` computes eager's values with the same roundings (its GEMMs group a KV head's query heads,
    so only a kernel that blocks them otherwise could round differently) and gradients from a recompute of
    the probabilities: logits within a few ulps of eager's, every gradient as close to a float64 model's as
    eager's is. What it keeps for backward holds no `(B, H, T, T)` tensor (eager keeps the probabilities in
    fp32 and in the compute dtype) and is smaller in all. In fp32 and under CPU bf16 autocast (the setting
    the trainer uses it in)."""
    model, plain, ids, mask = padded_case(tiny)
    exact = copy.deepcopy(plain).double()
    register_lean_eager()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        got, got_grads, got_shapes = forward_backward(model, ids, mask, LEAN_EAGER)
        want, want_grads, want_shapes = forward_backward(plain, ids, mask, "eager")
    _, ref_grads, _ = forward_backward(exact, ids, mask, "eager")
    compute = torch.bfloat16 if autocast else torch.float32
    assert_close_ulps(got, want, 4 if autocast else 64, compute)
    assert got_grads.keys() == want_grads.keys() == ref_grads.keys() and got_grads
    for name, g in got_grads.items():
        ref = ref_grads[name]
        # the recompute and the grouped GEMMs sum in another order than eager's autograd: as close to the
        # float64 gradient as eager's, give or take the compute dtype's rounding of the largest element
        assert max_err(g, ref) <= 2 * max_err(want_grads[name], ref) + ulp_tol(ref, 8, compute), name
    config = model.config
    t, heads = ids.shape[1], config.num_attention_heads
    probs = (3, heads, t, t)
    assert want_shapes.count(probs) >= config.num_hidden_layers and got_shapes.count(probs) == 0
    kept, eager_kept = (sum(math.prod(s) for s in shapes) for shapes in (got_shapes, want_shapes))
    assert kept < eager_kept


def attention_inputs(b=3, h=6, hkv=2, t=5, s=9, d=8, mask="rows", dtype=torch.float32, seed=0):
    """Random q `(B, H, T, D)`, k/v `(B, Hkv, S, D)` and an additive mask: per row with one query whose keys
    are all masked (`rows`), one for every row (`shared`) or None."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, t, d, generator=g, dtype=dtype)
    k = torch.randn(b, hkv, s, d, generator=g, dtype=dtype)
    v = torch.randn(b, hkv, s, d, generator=g, dtype=dtype)
    m = None
    if mask != "none":
        allowed = torch.rand(b if mask == "rows" else 1, 1, t, s, generator=g) < 0.7
        allowed[..., 0] = True
        if mask == "rows":
            allowed[1, 0, 2] = False  # a query that sees nothing: eager gives it uniform weights
        m = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)
    up = torch.randn(b, t, h, d, generator=g, dtype=torch.float64)
    return q, k, v, m, up


def attend(fn, q, k, v, mask, autocast):
    """`fn(module, q, k, v, mask)` as a Llama attention layer calls it, under bf16 autocast or not."""
    import types

    module = types.SimpleNamespace(num_key_value_groups=q.shape[1] // k.shape[1], training=False)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        return fn(module, q, k, v, mask, scaling=q.shape[-1] ** -0.5)[0]


def run_attention(fn, q, k, v, mask, up, autocast, need=(True, True, True)):
    """The output of `attend` and the gradients of `(out * up).sum()` of the inputs `need` marks."""
    leaves = [x.detach().clone().requires_grad_(n) for x, n in zip((q, k, v), need, strict=True)]
    out = attend(fn, *leaves, mask, autocast)
    (out.double() * up).sum().backward()
    return out.detach(), [x.grad for x in leaves]


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize(("heads", "mask"), [((6, 2), "rows"), ((6, 6), "shared"), ((4, 1), "none")])
def test_grouped_eager_node_equals_eager(autocast, heads, mask):
    """The node behind `lean_eager` against eager's own ops on random inputs: grouped query heads (3 per KV
    head, none, all on one), a mask per row with a query that sees no key, one mask for all rows, none.
    Values within eager's rounding; gradients as close to float64 eager's as eager's own."""
    from transformers.models.llama.modeling_llama import eager_attention_forward

    from rolerl.models.attention import lean_eager

    q, k, v, m, up = attention_inputs(h=heads[0], hkv=heads[1], mask=mask)
    got, got_g = run_attention(lean_eager, q, k, v, m, up, autocast)
    want, want_g = run_attention(eager_attention_forward, q, k, v, m, up, autocast)
    m64 = None if m is None else m.double()
    ref, ref_g = run_attention(eager_attention_forward, q.double(), k.double(), v.double(), m64, up, False)
    compute = torch.bfloat16 if autocast else torch.float32
    assert got.dtype == want.dtype and got.shape == want.shape and got.is_contiguous()
    # GEMMs of `G·T` rows may block their sums otherwise than eager's `T`-row ones (fp32 here): a few ulps
    assert_close_ulps(got, want, 4 if autocast else 16, compute)
    for name, g, w, r in zip("qkv", got_g, want_g, ref_g, strict=True):
        assert g.dtype == w.dtype, name
        assert max_err(g, r) <= 2 * max_err(w, r) + ulp_tol(r, 4, compute), name
    with torch.no_grad():  # the rollout-free forwards (old log-probs, the KL reference): the same values
        plain = attend(lean_eager, q, k, v, m, autocast)
    assert torch.equal(plain, got)


def test_grouped_eager_node_gradients_only_where_asked():
    """Only the inputs that require grad get one (the others' GEMMs are skipped), each equal to the one of
    a call where all three require it (the same ops)."""
    from rolerl.models.attention import lean_eager

    q, k, v, m, up = attention_inputs()
    _, every = run_attention(lean_eager, q, k, v, m, up, True)
    for need in [(False, False, True), (True, False, False), (False, True, False)]:
        _, grads = run_attention(lean_eager, q, k, v, m, up, True, need)
        for g, full, n in zip(grads, every, need, strict=True):
            assert (g is not None) == n
            if n:
                assert torch.equal(g, full)


def test_lean_eager_other_masks_keep_eagers_ops():
    """A mask of another form (boolean, one per head) takes eager's own ops, recomputed as a checkpoint:
    eager's values and gradients bit for bit."""
    from transformers.models.llama.modeling_llama import eager_attention_forward

    from rolerl.models.attention import _GroupedEager, lean_eager

    q, k, v, m, up = attention_inputs()
    per_head = m.expand(-1, q.shape[1], -1, -1).clone()
    assert not _GroupedEager.applies(q, k, v, per_head) and not _GroupedEager.applies(q, k, v, m == 0)
    got, got_g = run_attention(lean_eager, q, k, v, per_head, up, True)
    want, want_g = run_attention(eager_attention_forward, q, k, v, per_head, up, True)
    assert torch.equal(got, want)
    for g, w in zip(got_g, want_g, strict=True):
        assert torch.equal(g, w)
