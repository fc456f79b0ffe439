"""The native decode step (`decode_step`: RoPE, the cache writes and the attention of one layer in one call)
is the torch path's RoPE, index writes and the native attention bit for bit: the same rounded products and
sums (bf16 and fp32, no fused multiply-add), the same cache afterwards, the same output; head dims whose
halves fill whole vectors and one that does not; a write column outside the cache writes nothing; bad
inputs are refused. The engine with it gives the same log-probs, bit for bit, as without it."""

from __future__ import annotations

import pytest
import torch

from rolerl.rollout import kv, native
from rolerl.rollout.engine import Engine
from rolerl.rollout.packed import PACKED, resolve_kernels
from tests.rollout.test_engine import scripted_requests, scripted_sampler
from tests.rollout.test_native import count_calls

KERNEL = native.kernel()
pytestmark = pytest.mark.skipif(KERNEL is None, reason="no C compiler: the native kernels did not build")


def step_inputs(dtype, rows, kv_heads, groups, d, capacity=40, slots_total=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(rows, 1, kv_heads * (groups + 2), d, generator=g).to(dtype)
    cos = torch.randn(rows, d, generator=g).to(dtype)
    sin = torch.randn(rows, d, generator=g).to(dtype)
    k = torch.randn(slots_total, kv_heads, capacity + 1, d, generator=g).to(dtype)
    v = torch.randn(slots_total, kv_heads, capacity + 1, d, generator=g).to(dtype)
    slots = torch.randperm(slots_total, generator=g)[:rows]
    positions = torch.randint(0, capacity, (rows, 1), generator=g)
    return qkv, cos, sin, k, v, slots, positions


def torch_path(qkv, cos, sin, k, v, slots, positions, writes, scale):
    """What the decoder does without the fused call: RoPE in three torch ops, index writes, the attention."""
    rows, _, heads, d = qkv.shape
    kv_heads = k.shape[1]
    hq = heads - 2 * kv_heads
    h = qkv[:, :, : hq + kv_heads]
    c, s = cos[:, None, None], sin[:, None, None]
    qk = h * c + h.roll(d // 2, -1) * s
    k, v = k.clone(), v.clone()
    keep = (writes[:, 0] >= 0) & (writes[:, 0] < k.shape[2])
    new_k, new_v = qk[:, 0, hq:], qkv[:, 0, hq + kv_heads :]
    k[slots[keep], :, writes[keep, 0]] = new_k[keep]
    v[slots[keep], :, writes[keep, 0]] = new_v[keep]
    q = qk[:, 0, :hq].reshape(rows, kv_heads, hq // kv_heads, d)
    return KERNEL.decode_attention(q, k, v, slots, positions, scale), k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("kv_heads", "groups", "d"), [(3, 3, 64), (2, 1, 128), (1, 4, 48)])
def test_the_fused_step_is_the_torch_path_bit_for_bit(dtype, kv_heads, groups, d):
    qkv, cos, sin, k, v, slots, positions = step_inputs(dtype, 5, kv_heads, groups, d)
    writes = positions.clone()
    writes[3] = k.shape[2] + 7  # outside the cache: nothing written for that row
    want, want_k, want_v = torch_path(qkv, cos, sin, k, v, slots, positions, writes, 0.125)
    got = KERNEL.decode_step(qkv, cos, sin, k, v, slots, positions, writes, 0.125)
    assert torch.equal(k, want_k) and torch.equal(v, want_v)  # the cache, written in place
    assert torch.equal(got, want)


def test_rows_in_any_slots_on_one_or_two_threads_write_and_read_only_their_own():
    qkv, cos, sin, k, v, slots, positions = step_inputs(torch.bfloat16, 6, 3, 3, 64, capacity=200)
    results = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            kc, vc = k.clone(), v.clone()
            results.append(
                (KERNEL.decode_step(qkv, cos, sin, kc, vc, slots, positions, positions, 0.125), kc, vc)
            )
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


def test_inputs_the_step_cannot_read_are_refused():
    qkv, cos, sin, k, v, slots, positions = step_inputs(torch.float32, 3, 3, 3, 64)
    args = (cos, sin, k, v)
    with pytest.raises(ValueError, match="distinct cache slots"):
        KERNEL.decode_step(qkv, *args, torch.tensor([1, 1, 2]), positions, positions, 0.125)
    with pytest.raises(ValueError, match="are not"):
        KERNEL.decode_step(qkv[:, :, :-1], *args, slots, positions, positions, 0.125)  # a head short
    with pytest.raises(ValueError, match="are not"):
        KERNEL.decode_step(qkv.bfloat16(), *args, slots, positions, positions, 0.125)
    with pytest.raises(ValueError, match="are not"):
        KERNEL.decode_step(qkv, cos[:2], sin, k, v, slots, positions, positions, 0.125)
    with pytest.raises(TypeError, match="int64"):
        KERNEL.decode_step(qkv, *args, slots.int(), positions, positions, 0.125)
    with pytest.raises(ValueError, match="3 rows"):
        KERNEL.decode_step(qkv, *args, slots, positions[:2], positions, 0.125)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engine_with_the_fused_step_gives_the_same_logprobs_bit_for_bit(tokenizer, dtype, monkeypatch):
    import rolerl

    calls = count_calls(monkeypatch, "decode_step")
    model, tok = rolerl.tiny_model("llama", dtype=dtype, tokenizer=tokenizer)
    scripts, reqs = scripted_requests(tok, 10)
    if resolve_kernels("auto", torch.device("cpu"), dtype) not in PACKED:  # bf16 on a CPU without native bf16
        pytest.skip(f"the engine's own decoder (its fused step) does not run {dtype} on this CPU")
    engine = Engine(model, tok, max_batch=4, attention="native", sampler=scripted_sampler(scripts))
    fused = [t.logprobs for t in engine.generate(reqs)]
    assert len(calls) >= 9 * model.config.num_hidden_layers  # every layer of the 9 decode steps
    monkeypatch.setattr("rolerl.rollout.decoder.fused_decode", lambda *a: False)
    calls.clear()
    assert [t.logprobs for t in engine.generate(reqs)] == fused and not calls
    assert kv.fused_decode(None, dtype, 64, 3) is False  # a flat layout is never fused
