"""`grouped_sdpa`: transformers' SDPA attention with grouped K/V heads passed to the CPU kernel as they are.
The same logits and gradients as the model's own SDPA with a padding mask and with the trainer's shared-
prefix mask, and K/V kept for backward once per KV head, not once per query head. `lean_eager`: eager
attention that recomputes its probabilities in backward instead of keeping them."""

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
from tests.tolerance import assert_close_ulps


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


@pytest.mark.parametrize("autocast", [False, True])
def test_lean_eager_equals_eager_and_keeps_no_probabilities(tiny, autocast):
    """`lean_eager` runs eager's ops, and again in backward under the same autocast state, so the logits and
    the gradients are eager's, bit for bit. What it keeps for backward holds no `(B, H, T, T)`
    tensor (eager keeps the probabilities in fp32 and in the compute dtype) and is smaller in all. In fp32
    and under CPU bf16 autocast (the setting the trainer uses it in)."""
    model, plain, ids, mask = padded_case(tiny)
    register_lean_eager()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        got, got_grads, got_shapes = forward_backward(model, ids, mask, LEAN_EAGER)
        want, want_grads, want_shapes = forward_backward(plain, ids, mask, "eager")
    assert torch.equal(got, want)
    assert got_grads.keys() == want_grads.keys() and got_grads
    for name, g in got_grads.items():
        assert torch.equal(g, want_grads[name]), name
    config = model.config
    t, heads = ids.shape[1], config.num_attention_heads
    probs = (3, heads, t, t)
    assert want_shapes.count(probs) >= config.num_hidden_layers and got_shapes.count(probs) == 0
    kept, eager_kept = (sum(math.prod(s) for s in shapes) for shapes in (got_shapes, want_shapes))
    assert kept < eager_kept
