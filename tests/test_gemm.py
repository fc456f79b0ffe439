"""`rolerl.gemm`: oneDNN's products are fp32 products of the same operands (within the rounding any fp32
summation order may give), taken only where nothing else changes (no autograd through them, no autocast,
fp32), and torch's own op everywhere else, bit for bit."""

from __future__ import annotations

import logging

import pytest
import torch

from rolerl import gemm
from rolerl.algorithms import chunked_logprobs
from rolerl.config import ConfigError, load_config
from rolerl.hardware import fp32_gemm_choice
from rolerl.models.lora import _LoRALinear
from rolerl.run.policy import resolve_train_kernels

onednn = pytest.mark.skipif(not gemm.onednn_built(), reason="this torch has no oneDNN")


@pytest.fixture(autouse=True)
def _restore_backend():
    """Each test on `onednn` (what `auto` is on AMD CPUs only), the process's setting back after it."""
    previous = gemm.set_backend("onednn")
    yield
    gemm.set_backend(previous)


def _rand(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def assert_fp32_product(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """`got` is `x @ w` rounded as some fp32 summation order may round it: |error| <= K u sum_k |x_k w_k|,
    the worst case of any order (Higham, Accuracy and Stability, 3.1)."""
    x64, w64 = x.double(), w.double()
    exact = x64 @ w64
    bound = x.shape[-1] * 2.0**-24 * (x64.abs() @ w64.abs())
    err = (got.double() - exact).abs()
    assert got.dtype == torch.float32 and bool((err <= bound + 1e-30).all()), float((err - bound).max())


@onednn
@pytest.mark.parametrize("rows", [0, 1, 7, 170])
def test_onednn_products_are_fp32_products(rows):
    x, w, g = _rand(rows, 96, seed=1), _rand(80, 96, seed=2), _rand(rows, 80, seed=4)
    assert gemm.uses_onednn(x, w)
    assert_fp32_product(gemm.linear(x, w), x, w.T)
    assert_fp32_product(gemm.matmul(g, w), g, w)
    assert gemm.linear(x, w).shape == (rows, 80) and gemm.matmul(g, w).shape == (rows, 96)


@onednn
def test_strided_operands_read_in_place():
    """A transposed activation, a column slice of a weight, a leading batch dimension, one vector."""
    x_t = _rand(96, 9, seed=5).T  # (9, 96), not contiguous
    w = _rand(80, 200, seed=6)[:, 50:146]  # (80, 96), row stride 200
    assert_fp32_product(gemm.linear(x_t, w), x_t, w.T)
    x3 = _rand(2, 5, 96, seed=7)
    assert_fp32_product(gemm.linear(x3, w), x3, w.T)
    g = _rand(9, 80, seed=8)
    assert_fp32_product(gemm.matmul(g, w), g, w)
    assert_fp32_product(gemm.linear(x_t[0], w), x_t[0], w.T)


def test_torch_backend_and_every_fallback_are_torch_op_for_op():
    x, w, g = _rand(6, 32, seed=1), _rand(24, 32, seed=2), _rand(6, 24, seed=4)
    gemm.set_backend("torch")
    assert not gemm.uses_onednn(x, w)
    assert torch.equal(gemm.linear(x, w), x @ w.T) and torch.equal(gemm.matmul(g, w), g @ w)
    gemm.set_backend("onednn")
    x64, w64 = x.double(), w.double()  # another dtype
    assert torch.equal(gemm.linear(x64, w64), x64 @ w64.T)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast's casts and dtype, as before
        assert not gemm.uses_onednn(x, w)
        assert torch.equal(gemm.linear(x, w), x @ w.T) and torch.equal(gemm.matmul(g, w), g @ w)
    tracked = x.clone().requires_grad_()  # oneDNN's op has no derivative: autograd needs torch's
    out = gemm.linear(tracked, w)
    assert out.grad_fn is not None and torch.equal(out, x @ w.T)
    with torch.no_grad():
        assert gemm.uses_onednn(tracked, w) == gemm.onednn_built()
    torch._C._set_mkldnn_enabled(False)  # the user turned oneDNN off (`torch.backends.mkldnn.enabled`)
    try:
        assert not gemm.uses_onednn(x, w)
    finally:
        torch._C._set_mkldnn_enabled(True)


def test_backend_and_train_kernels_are_checked():
    with pytest.raises(ValueError, match=r"one of \('auto', 'onednn', 'torch'\), got 'mkl'"):
        gemm.set_backend("mkl")
    with pytest.raises(ConfigError, match="train.kernels"):
        load_config(None, ["train.kernels=mkl"])
    with pytest.raises(ValueError, match="train.kernels 'onednn'.*cuda"):
        resolve_train_kernels("onednn", torch.device("cuda"))
    assert resolve_train_kernels("auto", torch.device("cuda")) == "torch"


@pytest.mark.parametrize(
    ("vendor", "expect"), [("AuthenticAMD", "onednn"), ("GenuineIntel", "torch"), ("", "torch")]
)
def test_auto_takes_onednn_on_amd_cpus_only(vendor, expect, monkeypatch, caplog):
    """MKL ran at its AVX2 speed on an AMD CPU (oneDNN measured 1.7-2.8x it on a Zen 5), and as fast as oneDNN
    or faster on an Intel Xeon; other CPUs were not measured and keep torch's."""
    import rolerl.hardware as hw

    cpu = hw.CpuInfo("AVX512", avx512_bf16=True, vendor=vendor)
    assert fp32_gemm_choice("cpu", cpu)[0] == expect
    assert fp32_gemm_choice("cuda", cpu)[0] == "torch"
    monkeypatch.setattr(hw, "cpu_info", lambda: cpu)
    with caplog.at_level(logging.INFO, logger="rolerl.run.policy"):
        got = resolve_train_kernels("auto", torch.device("cpu"))
    assert got == (expect if gemm.onednn_built() else "torch")
    assert f"train.kernels=auto -> {got}" in caplog.text
    assert resolve_train_kernels("torch", torch.device("cpu")) == "torch"  # a setting is kept as given


def test_auto_backend_follows_this_machines_choice():
    x, w = _rand(6, 32, seed=1), _rand(24, 32, seed=2)
    gemm.set_backend("auto")
    expect = gemm.onednn_built() and fp32_gemm_choice("cpu")[0] == "onednn"
    assert gemm.auto_onednn() == expect and gemm.uses_onednn(x, w) == expect
    gemm.set_backend("onednn")
    assert gemm.uses_onednn(x, w) == gemm.onednn_built()


class _OneDNNCalls(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the oneDNN linears that run inside the block."""

    count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.mkldnn._linear_pointwise.default
        return func(*args, **(kwargs or {}))


@onednn
def test_lora_node_input_gradient_through_onednn():
    """The training node's `dy W` on oneDNN: the same input gradient as torch's GEMM within fp32 rounding;
    the forward (still `F.linear`, as the layer without grad) and the adapters' gradients bit for bit."""
    from tests.tolerance import assert_close_ulps

    x, w = _rand(40, 64, seed=1).requires_grad_(), _rand(48, 64, seed=2)
    a, b = _rand(4, 64, seed=3).requires_grad_(), _rand(48, 4, seed=4).requires_grad_()
    mask, up = torch.full((1, 4), 0.5), _rand(40, 48, seed=5)

    def run(name):
        gemm.set_backend(name)
        with _OneDNNCalls() as calls:
            y = _LoRALinear.apply(x, w, None, a, b, mask)
            grads = torch.autograd.grad((y * up).sum(), (x, a, b))
        return y, grads, calls.count

    (y1, (gx1, ga1, gb1), n1), (y0, (gx0, ga0, gb0), n0) = run("onednn"), run("torch")
    assert (n1, n0) == (1, 0)  # backward's dy W only
    assert torch.equal(y1, y0) and torch.equal(ga1, ga0) and torch.equal(gb1, gb0)
    assert_close_ulps(gx1, gx0, 64)  # 48-term sums, then the adapter's rank-4 term added


@onednn
@pytest.mark.parametrize("frozen", [True, False])
def test_chunked_logprobs_on_onednn_match_torch(frozen):
    """The head's logits, E_p[W] and input gradient on oneDNN: log-probs and gradients as torch's within a
    few fp32 ulps of their scale (64 ulps: 64-term sums, then a log-sum-exp over 300 logits)."""
    from tests.tolerance import assert_close_ulps

    hidden = _rand(1, 21, 64, seed=1).requires_grad_()
    weight = (_rand(300, 64, seed=2) * 0.3).requires_grad_(not frozen)
    targets = torch.randint(0, 300, (1, 21), generator=torch.Generator().manual_seed(3))
    wrt = (hidden,) if frozen else (hidden, weight)

    def run(name):
        gemm.set_backend(name)
        out = chunked_logprobs(hidden, weight, targets, chunk_size=4, with_entropy=True, entropy_grad=False)
        return out, torch.autograd.grad(out.logp.sum(), wrt)

    (o1, g1), (o0, g0) = run("onednn"), run("torch")
    with _OneDNNCalls() as calls:
        run("onednn")
    # 6 chunks: frozen, the logits and E_p[W] (backward runs none); trainable, the logits, then backward's
    # recomputed logits and dh (dW = dz^T h stays torch's: the head's own weight is not frozen)
    assert calls.count == (12 if frozen else 18)
    assert_close_ulps(o1.logp, o0.logp, 64)
    assert_close_ulps(o1.entropy, o0.entropy, 64)
    for a, b in zip(g1, g0, strict=True):
        assert_close_ulps(a, b, 64)
