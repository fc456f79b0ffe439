"""The native decode attention (`rolerl.rollout.native`): softmax(scale q k^T) v of each row over its own
cached keys equals a float64 reference built from the same inputs, for fp32 and bf16 caches, the head dims
the kernel specialises (64, 128) and two it does not (48, 16), 1 to 16 query heads per KV head, rows in any
cache slot, lengths from one key to several blocks; no read past a row's keys (NaN there stays out), scores
that would overflow a naive exp, lengths and slots outside the cache; the same numbers on 1 and 2 threads;
in bf16 at least as close to the reference as SDPA. The engine with it gives SDPA's log-probs. Without a
compiler, or for a model it does not cover, the engine keeps SDPA and says why; a build is cached and
written atomically."""

from __future__ import annotations

import logging

import pytest
import torch
from torch.nn import functional as F

from rolerl.rollout import native
from rolerl.rollout.engine import Engine, GenerationRequest
from rolerl.rollout.sampling import SamplingParams
from tests.rollout.test_engine import prompt_ids, scripted_requests, scripted_sampler
from tests.tolerance import ulp_tol

KERNEL = native.kernel()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="no C compiler: the engine keeps SDPA")


def count_calls(monkeypatch, method: str) -> list:
    """A list that grows by one at each call of `NativeKernel.<method>` (which still runs) for this test."""
    calls, original = [], getattr(native.NativeKernel, method)
    monkeypatch.setattr(native.NativeKernel, method, lambda self, *a: calls.append(1) or original(self, *a))
    return calls


def cache_and_query(dtype, slots_total, capacity, kv_heads, groups, head_dim, rows, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(slots_total, kv_heads, capacity + 1, head_dim, generator=g).to(dtype)
    v = torch.randn(slots_total, kv_heads, capacity + 1, head_dim, generator=g).to(dtype)
    q = torch.randn(rows, kv_heads, groups, head_dim, generator=g).to(dtype)
    return q, k, v


def reference(q, k, v, slots, positions, scale):
    """Row by row in float64 over keys `[0, positions[b]]` of slot `slots[b]`."""
    out = torch.empty(q.shape, dtype=torch.float64)
    for b in range(q.shape[0]):
        n = int(positions[b, 0]) + 1
        keys, values = k[int(slots[b]), :, :n].double(), v[int(slots[b]), :, :n].double()  # (Hkv, n, D)
        scores = torch.einsum("hgd,hnd->hgn", q[b].double(), keys) * scale
        out[b] = torch.softmax(scores, -1) @ values
    return out


def assert_matches_reference(got, want, v, dtype):
    """fp32: within 128 fp32 ulps of max |V| (a dot product of <= 128 terms, an exp good to 2 ulps, a sum
    over the keys); a row reading one key too many or too few is off by ~|V| / n, 100x more. bf16: the
    same plus the output's own rounding to bf16 (half an ulp of it)."""
    atol = 128 * torch.finfo(torch.float32).eps * float(v.float().nan_to_num(0.0).abs().max())
    if dtype == torch.bfloat16:
        atol += ulp_tol(want, 0.5, torch.bfloat16)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=atol)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("head_dim", "groups"), [(64, 3), (128, 1), (48, 7), (16, 16)])
def test_decode_attention_equals_the_reference(dtype, head_dim, groups):
    # rows in scattered slots of a larger cache; lengths 1, one block (64), one past a block, several blocks
    slots = torch.tensor([5, 0, 3, 2, 6])
    positions = torch.tensor([[0], [63], [64], [200], [129]])
    q, k, v = cache_and_query(dtype, 8, 256, 2, groups, head_dim, len(slots))
    scale = 0.3
    got = KERNEL.decode_attention(q, k, v, slots, positions, scale)
    assert got.dtype == dtype and got.shape == q.shape
    assert_matches_reference(got, reference(q, k, v, slots, positions, scale), v, dtype)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_keys_past_a_row_are_never_read(dtype):
    q, k, v = cache_and_query(dtype, 3, 130, 2, 3, 64, 3)
    slots, positions = torch.tensor([0, 1, 2]), torch.tensor([[10], [64], [99]])
    for b, n in enumerate([11, 65, 100]):
        k[b, :, n:] = float("nan")
        v[b, :, n:] = float("nan")
    got = KERNEL.decode_attention(q, k, v, slots, positions, 0.125)
    assert torch.isfinite(got).all()
    assert_matches_reference(got, reference(q, k, v, slots, positions, 0.125), v, dtype)


@needs_kernel
def test_scores_that_overflow_a_naive_exp_and_scores_far_below_zero():
    q, k, v = cache_and_query(torch.float32, 2, 100, 1, 2, 64, 2)
    slots, positions = torch.tensor([0, 1]), torch.tensor([[99], [99]])
    g = torch.Generator().manual_seed(1)
    # row 0: small integers, so that scores (up to ~3e4: exp overflows fp32 without the running max) are
    # exact in fp32 and only the softmax's own rounding remains
    q[0] = torch.randint(-3, 4, q[0].shape, generator=g).float() * 50
    k[0] = torch.randint(-3, 4, k[0].shape, generator=g).float()
    k[1] = k[1, :, :1]  # every key of row 1 the same vector: equal scores...
    q[1] = -5000 * k[1, 0, 0] / k[1, 0, 0].norm() ** 2  # ... of -5000 for the first query
    got = KERNEL.decode_attention(q, k, v, slots, positions, 1.0)
    want = reference(q, k, v, slots, positions, 1.0)
    assert torch.isfinite(got).all()
    assert_matches_reference(got, want, v, torch.float32)
    # equal scores far below exp's range still give the plain mean of the values
    torch.testing.assert_close(got[1, 0, 0].double(), v[1, 0, :100].double().mean(0), rtol=0, atol=1e-5)


@needs_kernel
def test_lengths_and_slots_outside_the_cache_are_clamped_or_zero():
    q, k, v = cache_and_query(torch.float32, 2, 40, 2, 2, 64, 3)
    slots, positions = torch.tensor([1, 2, -1]), torch.tensor([[500], [5], [5]])
    got = KERNEL.decode_attention(q, k, v, slots, positions, 0.125)
    clamped = reference(q[:1], k, v, slots[:1], torch.tensor([[40]]), 0.125)  # all 41 columns
    assert_matches_reference(got[:1], clamped, v, torch.float32)
    assert (got[1:] == 0).all()  # slots 2 and -1 are not in a 2-slot cache


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_and_two_threads_give_the_same_numbers(dtype):
    """Each (row, KV head) is one task on one thread, in the same order of operations: exact."""
    q, k, v = cache_and_query(dtype, 6, 300, 3, 3, 64, 6)
    slots, positions = torch.arange(6), torch.tensor([[299], [7], [150], [64], [0], [200]])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = KERNEL.decode_attention(q, k, v, slots, positions, 0.125)
        torch.set_num_threads(2)
        two = KERNEL.decode_attention(q, k, v, slots, positions, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


@needs_kernel
def test_bf16_is_at_least_as_close_to_the_reference_as_sdpa():
    """SDPA rounds the probabilities to bf16 before multiplying by V; the kernel keeps them in fp32."""
    q, k, v = cache_and_query(torch.bfloat16, 16, 400, 3, 3, 64, 16, seed=1)
    slots, positions = torch.arange(16), torch.randint(50, 400, (16, 1))
    want = reference(q, k, v, slots, positions, 0.125)
    keys = torch.arange(401)
    mask = torch.zeros(16, 1, 1, 401, dtype=torch.bfloat16).masked_fill_(
        keys[None, None, None, :] > positions[:, None, :, None], float("-inf")
    )
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.125)
    got = KERNEL.decode_attention(q, k, v, slots, positions, 0.125)
    assert (got.double() - want).abs().max() <= (sdpa.double() - want).abs().max()


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engine_with_native_attention_gives_sdpas_logprobs(tokenizer, dtype, monkeypatch):
    """The same scripted tokens through an engine on each attention: log-probs within rounding (fp32: a
    few ulps through two layers; bf16: the attention output's last bit moves the bf16 logits by a few of
    their ulps, as between any two bf16 kernels), and the kernel really ran at every decode step."""
    import rolerl

    calls = count_calls(monkeypatch, "decode_attention")
    model, tok = rolerl.tiny_model("qwen3", dtype=dtype, tokenizer=tokenizer)
    scripts, reqs = scripted_requests(tok, 12)
    logprobs = {}
    for attention in ("torch", "native"):
        engine = Engine(model, tok, max_batch=4, attention=attention, sampler=scripted_sampler(scripts))
        logprobs[attention] = [t.logprobs for t in engine.generate(reqs)]
    assert len(calls) >= 11 * model.config.num_hidden_layers  # 11 decode steps of 2 layers
    limit = 1e-4 if dtype == torch.float32 else 0.25
    for a, b in zip(logprobs["torch"], logprobs["native"], strict=True):
        assert len(a) == len(b) == 12
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < limit


@pytest.mark.parametrize("cc", ["/nonexistent/cc", "false"])
def test_without_a_working_compiler_auto_keeps_sdpa_and_native_is_an_error(
    fresh_build, monkeypatch, caplog, cc
):
    monkeypatch.setenv("CC", cc)
    with caplog.at_level(logging.WARNING, logger="rolerl.rollout.native"):
        assert native.kernel() is None
    assert "native kernels unavailable" in caplog.text
    cpu = torch.device("cpu")
    assert native.resolve_attention("auto", cpu) is None
    assert native.resolve_attention("torch", cpu) is None
    with pytest.raises(RuntimeError, match="did not build"):
        native.resolve_attention("native", cpu)
    assert native.resolve_pointwise("auto", cpu) is None  # the norms too keep torch's ops
    with pytest.raises(RuntimeError, match="rollout.pointwise 'native': the kernels did not build"):
        native.resolve_pointwise("native", cpu)
    assert list(fresh_build.rglob("*")) in ([], [fresh_build / "native"])  # no half-written library


def test_bad_attention_settings_are_rejected():
    with pytest.raises(ValueError, match="auto.*native.*torch"):
        native.resolve_attention("flash", torch.device("cpu"))
    with pytest.raises(ValueError, match="CPU only"):
        native.resolve_attention("native", torch.device("meta"))


@needs_kernel
def test_a_build_is_cached_per_machine_and_reused(fresh_build, monkeypatch):
    built = native.kernel()
    assert built is not None and built.path.parent == fresh_build / "native"
    assert [p.name for p in built.path.parent.iterdir()] == [built.path.name]  # no temporary left over
    native.kernel.cache_clear()

    def no_compile(cmd, *args, **kwargs):
        if "-o" in cmd:
            raise AssertionError("compiled again")
        return original(cmd, *args, **kwargs)

    original = native.subprocess.run
    monkeypatch.setattr(native.subprocess, "run", no_compile)
    assert native.kernel().path == built.path


@needs_kernel
def test_a_model_the_kernel_does_not_cover_keeps_sdpa_and_native_says_why(tokenizer, caplog):
    from transformers import AutoModelForCausalLM

    from rolerl.models.tiny import tiny_config

    config = tiny_config("llama", vocab_size=len(tokenizer), num_attention_heads=8, head_dim=8)
    model = AutoModelForCausalLM.from_config(config).eval()
    with caplog.at_level(logging.INFO, logger="rolerl.rollout.engine"):
        engine = Engine(model, tokenizer, max_batch=2)
    assert engine.native is None and "head dim 8" in caplog.text
    req = GenerationRequest(prompt_ids(tokenizer, "Hi"), SamplingParams(greedy=True, max_new_tokens=4))
    assert len(engine.generate([req])[0].completion_ids) == 4
    with pytest.raises(ValueError, match="does not cover this model's head dim 8"):
        Engine(model, tokenizer, max_batch=2, attention="native")
    assert (
        KERNEL.covers(torch.float16, 64, 3) is not None and KERNEL.covers(torch.bfloat16, 64, 17) is not None
    )
    assert KERNEL.covers(torch.bfloat16, 64, 16) is None and KERNEL.covers(torch.float32, 256, 1) is None
