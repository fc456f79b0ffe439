"""Evaluation: `evaluate` a workflow on held-out examples; pass@k and standard errors."""

from rolerl.eval.evaluate import EvalResult, by_family_table, evaluate, evaluate_groups
from rolerl.eval.metrics import PairedGain, binomial_stderr, paired_gain, pass_at_k, pooled_gain

__all__ = [
    "EvalResult",
    "PairedGain",
    "binomial_stderr",
    "by_family_table",
    "evaluate",
    "evaluate_groups",
    "paired_gain",
    "pass_at_k",
    "pooled_gain",
]
