"""The native residual add + RMSNorm (`norm.c`, `rollout.pointwise`): the sum is torch's `x + y` bit for bit;
the norm equals a float64 reference within the two roundings HF makes in the model's dtype, and HF's own
`LlamaRMSNorm` but for the last bits of its fp32 sum of squares (bf16: one unit in the last place, on a tiny
fraction of the elements); widths with and without a vector tail, many rows on 1 or 2 threads alike, NaN
kept to its row, bad inputs refused. Only HF's own norm classes, forward untouched, run it. The engine with
it gives torch's log-probs."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from rolerl.rollout import native
from rolerl.rollout.decoder import _plain_rms_norm
from rolerl.rollout.engine import Engine
from rolerl.rollout.packed import PACKED, resolve_kernels
from tests.rollout.test_engine import scripted_requests, scripted_sampler
from tests.rollout.test_native import count_calls

KERNEL = native.kernel()
pytestmark = pytest.mark.skipif(KERNEL is None, reason="no C compiler: the native kernels did not build")


def inputs(rows, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, d, generator=g) * 3).to(dtype)
    y = torch.randn(rows, d, generator=g).to(dtype)
    norm = LlamaRMSNorm(d, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(d, generator=g) * 0.5 + 1)
    return x, y, norm


def reference(s: torch.Tensor, norm: LlamaRMSNorm) -> torch.Tensor:
    """HF's formula in float64, rounded nowhere."""
    s64 = s.double()
    r = torch.rsqrt(s64.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight.double() * (s64 * r)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "d"), [(32, 576), (7, 100), (3, 1), (0, 64), (300, 576)])
def test_the_sum_is_torchs_and_the_norm_is_hfs(dtype, rows, d):
    x, y, norm = inputs(rows, d, dtype)
    with torch.no_grad():
        total, got = KERNEL.rms_norm(x, norm.weight, norm.variance_epsilon, y)
        alone_x, alone = KERNEL.rms_norm(x, norm.weight, norm.variance_epsilon)
        want_total = x + y
        hf, hf_alone = norm(want_total), norm(x)
    assert torch.equal(total, want_total) and alone_x is x
    assert got.dtype == alone.dtype == dtype and got.shape == (rows, d)
    # two roundings to the dtype (the normalised row, then its product with the weight): each within half a
    # unit in the last place, eps = a unit at 1
    eps = torch.finfo(dtype).eps
    for out, s in ((got, want_total), (alone, x)):
        torch.testing.assert_close(
            out.double(), reference(s, norm), rtol=eps * (1.01 if dtype == torch.bfloat16 else 4), atol=1e-30
        )
    for out, want in ((got, hf), (alone, hf_alone)):
        if dtype == torch.float32:  # torch's fp32 sum of d squares, rounded in an order of its own
            torch.testing.assert_close(out, want, rtol=16 * eps, atol=0)
        else:  # the same roundings as HF's; var's last bit moves one on the rare rounding boundary
            ulps = (out.float() - want.float()).abs() / want.float().abs().clamp(min=1e-30)
            assert float(ulps.max()) <= eps if ulps.numel() else True  # one unit in the last place at most
            assert int((out != want).sum()) <= max(1, out.numel() // 100)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_many_rows_on_one_or_two_threads_give_the_same_bits_and_nan_stays_in_its_row(dtype):
    x, y, norm = inputs(400, 576, dtype, seed=1)  # 230k elements: the rows split over the threads
    x[5, 7] = float("nan")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = KERNEL.rms_norm(x, norm.weight, norm.variance_epsilon, y)
        torch.set_num_threads(2)
        two = KERNEL.rms_norm(x, norm.weight, norm.variance_epsilon, y)
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(one, two, strict=True):  # the sum, the norm: bit for bit, NaN where NaN
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    assert bool(one[1][5].isnan().all()) and not bool(one[1][torch.arange(400) != 5].isnan().any())


def test_inputs_the_kernel_cannot_read_are_refused():
    x, y, norm = inputs(4, 64, torch.float32)
    with pytest.raises(ValueError, match="one dtype"):
        KERNEL.rms_norm(x, norm.weight.bfloat16(), 1e-5, y)
    with pytest.raises(ValueError, match="one dtype"):
        KERNEL.rms_norm(x, norm.weight[:10], 1e-5)
    with pytest.raises(ValueError, match="one dtype"):
        KERNEL.rms_norm(x, norm.weight, 1e-5, y[:2])
    with pytest.raises(ValueError, match="one dtype"):
        KERNEL.rms_norm(x.double(), norm.weight.double(), 1e-5)
    with pytest.raises(ValueError, match="rollout.pointwise must be one of"):
        native.resolve_pointwise("fused", torch.device("cpu"))


def test_only_hfs_own_rmsnorm_runs_natively():
    norm = LlamaRMSNorm(8)
    assert _plain_rms_norm(norm)
    patched = LlamaRMSNorm(8)
    patched.forward = lambda h: h  # replaced on the instance: its forward is no longer HF's
    assert not _plain_rms_norm(patched) and not _plain_rms_norm(torch.nn.LayerNorm(8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engine_with_the_native_norms_gives_torchs_logprobs(tokenizer, dtype, monkeypatch):
    """The same scripted tokens through an engine on each setting: log-probs within rounding (fp32: the
    sums of squares' last bits through two layers; bf16: a unit in the last place of a normalised row moves
    the bf16 logits by a few of theirs, as between any two bf16 kernels) and the kernel ran for every norm of
    every forward; `native` where the engine does not run its own decoder is an error that says so."""
    import rolerl

    calls = count_calls(monkeypatch, "rms_norm")
    model, tok = rolerl.tiny_model("llama", dtype=dtype, tokenizer=tokenizer)
    scripts, reqs = scripted_requests(tok, 10)
    if resolve_kernels("auto", torch.device("cpu"), dtype) not in PACKED:  # bf16 on a CPU without native bf16
        with pytest.raises(ValueError, match="runs on the engine's own decoder only"):
            Engine(model, tok, max_batch=4, pointwise="native")
        pytest.skip(
            f"the engine's own decoder does not run {dtype} on this CPU (rollout.kernels auto: torch)"
        )
    logprobs = {}
    for pointwise in ("torch", "native"):
        engine = Engine(model, tok, max_batch=4, pointwise=pointwise, sampler=scripted_sampler(scripts))
        logprobs[pointwise] = [t.logprobs for t in engine.generate(reqs)]
        assert (engine.pointwise is None) == (pointwise == "torch")
    norms = 2 * model.config.num_hidden_layers + 1
    assert len(calls) >= 10 * norms and len(calls) % norms == 0  # 9 decode steps and the prefills
    limit = 1e-4 if dtype == torch.float32 else 0.25
    for a, b in zip(logprobs["torch"], logprobs["native"], strict=True):
        assert len(a) == len(b) == 10
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < limit
    with pytest.raises(ValueError, match="rollout.pointwise 'native' runs on the engine's own decoder only"):
        Engine(model, tok, max_batch=2, kernels="torch", pointwise="native")
