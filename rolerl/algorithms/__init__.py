"""GRPO-family numerics: advantages, per-token losses, aggregation, chunked log-probs.

Each variant is one short function, chosen by name from one registry dict per kind: `ADVANTAGES`,
`POLICY_LOSSES`, `KL_ESTIMATORS`, `AGGREGATIONS`.
"""

from rolerl.algorithms.advantages import (
    ADVANTAGES,
    dr_grpo_advantages,
    group_index,
    grpo_advantages,
    rloo_advantages,
    zero_variance_groups,
    zero_variance_mask,
)
from rolerl.algorithms.logprobs import TokenLogprobs, chunked_logprobs, logprobs_from_logits
from rolerl.algorithms.losses import (
    AGGREGATIONS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    AggNorm,
    ClipStats,
    LogpMismatch,
    PolicyLoss,
    aggregate,
    entropy_from_logits,
    kl_k1,
    kl_k3,
    logp_mismatch,
    masked_mean,
    ppo_clip_loss,
    seq_mean_token_mean,
    seq_mean_token_sum,
    seq_mean_token_sum_norm,
    tis_weights,
    token_mean,
)

__all__ = [
    "ADVANTAGES",
    "AGGREGATIONS",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "AggNorm",
    "ClipStats",
    "LogpMismatch",
    "PolicyLoss",
    "TokenLogprobs",
    "aggregate",
    "chunked_logprobs",
    "dr_grpo_advantages",
    "entropy_from_logits",
    "group_index",
    "grpo_advantages",
    "kl_k1",
    "kl_k3",
    "logp_mismatch",
    "logprobs_from_logits",
    "masked_mean",
    "ppo_clip_loss",
    "rloo_advantages",
    "seq_mean_token_mean",
    "seq_mean_token_sum",
    "seq_mean_token_sum_norm",
    "tis_weights",
    "token_mean",
    "zero_variance_groups",
    "zero_variance_mask",
]
