"""The native fp32 GEMM (`gemm.c`, `rollout.kernels: native`): within the rounding bound of a k-term fp32 sum
of a float64 reference, for widths on and off the panel (the last panel padded), 1 to hundreds of rows (on
and off the register block, over the row chunk), with and without bias, rows that are strided views; a row
gives the same bits alone, in any batch and on any number of threads (each output is one sum in input
order); NaN and inf stay in their row; bad inputs are refused."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from rolerl.rollout import native

KERNEL = native.kernel()
pytestmark = pytest.mark.skipif(KERNEL is None, reason="no C compiler: the native kernels did not build")


def weights(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) / max(k, 1) ** 0.5, torch.randn(n, generator=g)


def assert_within_fp32_sum_bound(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None):
    """|got - exact| <= 2 (k + 1) u (|b| + sum_i |x_i w_i|) (+ a denormal unit): the standard bound for a sum
    of k fp32 products onto the bias, each step rounded once (FMA) or twice (u = 2^-24), in any order."""
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    scale = F.linear(x.double().abs(), w.double().abs())
    k, u = x.shape[-1], 2.0**-24
    if b is not None:
        scale = scale + b.double().abs()
    bound = 2 * (k + 1) * u * scale + 1e-37
    err = (got.double() - exact).abs()
    assert bool((err <= bound).all()), (
        f"max error {float(err.max()):.3g} over the bound {float(bound.min()):.3g}"
    )


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("n, k", [(1, 7), (47, 64), (49, 96), (100, 576), (960, 576), (576, 1536), (33, 1)])
@pytest.mark.parametrize("rows", [1, 5, 8, 13, 32, 64, 300])
def test_linear_is_within_the_fp32_bound_of_the_exact_product(rows, n, k, bias):
    w, b = weights(n, k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    got = KERNEL.linear(x, KERNEL.pack(w), b if bias else None)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    assert_within_fp32_sum_bound(got, x, w, b if bias else None)


@pytest.mark.parametrize("rows", [3, 40])
def test_rows_may_be_views_and_batches_of_any_rank(rows):
    w, b = weights(50, 70)
    wide = torch.randn(rows, 2, 90)
    x = wide[:, 1, 10:80]  # rows 180 floats apart, the last dim contiguous
    got = KERNEL.linear(x, KERNEL.pack(w), b)
    assert_within_fp32_sum_bound(got, x, w, b)
    x3 = torch.randn(2, rows, 70)
    assert torch.equal(
        KERNEL.linear(x3, KERNEL.pack(w), b),
        KERNEL.linear(x3.reshape(-1, 70), KERNEL.pack(w), b).view(2, rows, 50),
    )
    xt = torch.randn(70, rows).t()  # not row-major: copied
    assert torch.equal(
        KERNEL.linear(xt, KERNEL.pack(w), b), KERNEL.linear(xt.contiguous(), KERNEL.pack(w), b)
    )
    # a weight that is a view (its rows further apart) packs as its copy does
    big = torch.randn(50, 100)
    assert torch.equal(KERNEL.pack(big[:, :70]).panels, KERNEL.pack(big[:, :70].contiguous()).panels)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_row_gives_the_same_bits_alone_in_any_batch_and_on_any_threads(threads):
    w, b = weights(200, 160)
    packed = KERNEL.pack(w)
    x = torch.randn(70, 160)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([KERNEL.linear(x[i : i + 1], packed, b) for i in range(70)])
        torch.set_num_threads(threads)
        for lo, hi in [(0, 70), (5, 18), (3, 4), (60, 70)]:
            assert torch.equal(KERNEL.linear(x[lo:hi], packed, b), alone[lo:hi])
    finally:
        torch.set_num_threads(before)


def test_nan_and_inf_stay_in_their_row():
    w, b = weights(60, 40)
    x = torch.randn(10, 40)
    x[2, 5], x[7, 39] = float("nan"), float("inf")
    got = KERNEL.linear(x, KERNEL.pack(w), b)
    assert got[2].isnan().all() and not got[7].isfinite().any()
    others = [i for i in range(10) if i not in (2, 7)]
    assert got[others].isfinite().all()
    assert torch.equal(got[others], KERNEL.linear(x[others], KERNEL.pack(w), b))


def test_empty_rows_and_inputs():
    w, b = weights(20, 8)
    assert KERNEL.linear(torch.randn(0, 8), KERNEL.pack(w), b).shape == (0, 20)
    none = KERNEL.linear(torch.randn(4, 0), KERNEL.pack(torch.randn(20, 0)), b)
    assert torch.equal(none, b.expand(4, 20))  # an empty sum: the bias


def test_bad_inputs_are_refused():
    w, b = weights(20, 8)
    packed = KERNEL.pack(w)
    assert repr(packed) == "PackedWeight(20, 8)"
    assert packed.panels.numel() == -(-20 // KERNEL.panel) * KERNEL.panel * 8  # the last panel padded
    with pytest.raises(ValueError, match=r"x \(3, 9\) torch.float32 on cpu do not fit a packed \(20, 8\)"):
        KERNEL.linear(torch.randn(3, 9), packed)
    with pytest.raises(ValueError, match="bias"):
        KERNEL.linear(torch.randn(3, 8), packed, torch.randn(21))
    with pytest.raises(ValueError, match="torch.bfloat16"):
        KERNEL.linear(torch.randn(3, 8).bfloat16(), packed)
    with pytest.raises(ValueError, match="not a 2-D float32 matrix on CPU"):
        KERNEL.pack(w.bfloat16())
    with pytest.raises(ValueError, match="not a 2-D float32 matrix on CPU"):
        KERNEL.pack(torch.randn(8))
