"""Float comparisons for tests: exact where the two sides run the same ops in the same order on the same
shapes, otherwise within a tolerance derived from the dtype (issue 11: CPUs differ in how they round).

Two computations of one value that sum in another order (stacked adapters in another order, another
batch width, a decode step against a full pass) differ by some units in the last place (ulps) of the
largest magnitude involved, not of each element: a small logit inherits the rounding of the big terms it
was summed from. So the bound is `ulps · eps(dtype) · max |expected|`, with `ulps` chosen per test and
justified where it is used (accumulation length, number of layers the difference passes through).
"""

from __future__ import annotations

import torch


def ulp_tol(expected: torch.Tensor, ulps: float, dtype: torch.dtype | None = None) -> float:
    """`ulps` units of `dtype`'s eps (default: `expected`'s, the dtype the rounding happened in) at the
    scale of `max |expected|`."""
    eps = torch.finfo(dtype or expected.dtype).eps
    return ulps * eps * float(expected.detach().abs().max()) if expected.numel() else 0.0


def assert_close_ulps(
    actual: torch.Tensor, expected: torch.Tensor, ulps: float, dtype: torch.dtype | None = None, msg=None
) -> None:
    """`|actual - expected| <= ulps · eps · max |expected|` elementwise (see the module docstring)."""
    torch.testing.assert_close(actual, expected, rtol=0, atol=ulp_tol(expected, ulps, dtype), msg=msg)
