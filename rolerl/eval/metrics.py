"""Evaluation metrics: unbiased pass@k and the standard errors the results tables quote."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


def mean_stderr(values: Sequence[float]) -> float:
    """Standard error of the mean of per-problem scores (each problem's pass@k estimate, or whether its
    majority answer is right): their spread over the problems over sqrt(problems). For 0/1 scores it is
    `binomial_stderr` of their mean; a problem's several samples count once, through its score."""
    n = len(values)
    if n == 0:
        return math.nan
    mean = sum(values) / n
    return math.sqrt(sum((v - mean) ** 2 for v in values) / n / n)


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


@dataclass(frozen=True)
class PairedGain:
    """`after - before` on the same problems: the mean of each problem's change (+1 wrong -> right, -1 right
    -> wrong, 0 unchanged) and its standard error, smaller than `pooled_gain`'s where the two agree."""

    gain: float
    stderr: float
    wrong_to_right: int
    right_to_wrong: int
    n: int

    @property
    def z(self) -> float:
        """The gain in standard errors (McNemar's statistic up to the n/(n-1) of a sample variance)."""
        return self.gain / self.stderr if self.stderr > 0 else 0.0


def paired_gain(before: Mapping[str, bool], after: Mapping[str, bool]) -> PairedGain:
    """The paired gain of two evaluations of the same problems, each `problem id -> correct`."""
    if before.keys() != after.keys():
        only = len(before.keys() - after.keys()), len(after.keys() - before.keys())
        raise ValueError(
            f"a paired gain needs the same problems; {only[0]} only before, {only[1]} only after"
        )
    n = len(before)
    if n == 0:
        raise ValueError("a paired gain needs at least one problem")
    up = sum(1 for k, ok in after.items() if ok and not before[k])
    down = sum(1 for k, ok in after.items() if before[k] and not ok)
    mean = (up - down) / n
    variance = (up + down) / n - mean * mean  # of the per-problem change, in {-1, 0, 1}
    return PairedGain(mean, math.sqrt(max(variance, 0.0) / n), up, down, n)
