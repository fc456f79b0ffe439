"""Evaluation metrics: unbiased pass@k and the standard errors the results tables quote."""

from __future__ import annotations

import math


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of a problem with `c` correct among `n` samples (Chen et al. 2021), `k <= n`."""
    if not 0 <= c <= n:
        raise ValueError(f"need 0 <= c <= n; got c={c}, n={n}")
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples per problem; got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def binomial_stderr(p: float, n: int) -> float:
    """Standard error of an accuracy `p` measured on `n` independent problems."""
    return math.sqrt(p * (1 - p) / n) if n > 0 else math.nan


def pooled_gain(before: list[tuple[float, int]], after: list[tuple[float, int]]) -> tuple[float, float]:
    """(gain, standard error) of `after - before`, each a list of (accuracy, n) per seed, pooled over seeds:
    accuracies are averaged with weights n, and the error is that of a difference of two pooled
    binomial proportions."""

    def pool(xs: list[tuple[float, int]]) -> tuple[float, int]:
        n = sum(m for _, m in xs)
        return sum(p * m for p, m in xs) / n, n

    (p0, n0), (p1, n1) = pool(before), pool(after)
    return p1 - p0, math.sqrt(p0 * (1 - p0) / n0 + p1 * (1 - p1) / n1)
