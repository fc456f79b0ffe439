"""Per-token RL losses and their aggregation: PPO clip (clip-higher, dual clip), KL k1/k3, entropy,
truncated importance sampling, and verl's four `loss_agg_mode`s.

Loss functions return per-token matrices `(B, T)`; one aggregation function turns a matrix into the
scalar that is back-propagated. Keeping the two apart is what lets every loss share one, tested,
normalisation (DESIGN "Numerics exist once"). Masks are binary `(B, T)` loss masks (1 on policy tokens,
0 on prompt, tool output and padding); per-role or per-sequence weights belong in the loss matrix, not
in the mask.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch
from torch import Tensor

# ---------------------------------------------------------------------------------------------------
# Aggregation (verl `agg_loss`, verl/trainer/ppo/core_algos.py, the `global_batch_info` version)
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AggNorm:
    """The normalisers of one optimizer step, counted over the *whole* (mini-)batch of that step.

    Pass the same `AggNorm` to every micro-batch's aggregation and the micro-batch losses sum to the
    full-batch loss (and their gradients to the full-batch gradient) in every mode. Counting them per
    micro-batch instead is the classic bug (verl#7200, verl PR #906 / #5877): the loss then depends on
    how the batch was split.
    """

    num_tokens: float  # Σ_{i,t} m_{i,t}: loss tokens in the batch (token-mean)
    num_seqs: float  # sequences with >= 1 loss token (all seq-mean-* modes; verl excludes empty rows)
    horizon: int  # the constant of seq-mean-token-sum-norm: max response length (Dr. GRPO's MAX_TOKENS)

    @classmethod
    def of(cls, *masks: Tensor, horizon: int | None = None) -> AggNorm:
        """Count over one or more `(b, T_k)` masks (e.g. every micro-batch of one mini-batch).

        `horizon` defaults to the widest mask, which is verl's default (`loss_mask.shape[-1]`, the
        padded width); pass the configured max response length to make it a true constant.
        """
        tokens = sum(int(m.bool().sum()) for m in masks)
        seqs = sum(int(m.bool().any(dim=-1).sum()) for m in masks)
        return cls(tokens, seqs, horizon if horizon is not None else max(m.shape[-1] for m in masks))


def _masked_token_sums(loss: Tensor, mask: Tensor) -> Tensor:
    # where(), not loss * mask: a NaN/inf at a padded position must not leak into the sum.
    return torch.where(mask.bool(), loss, torch.zeros_like(loss)).sum(dim=-1)  # (B,)


def _norm(mask: Tensor, norm: AggNorm | None) -> AggNorm:
    return norm if norm is not None else AggNorm.of(mask)


def token_mean(loss: Tensor, mask: Tensor, norm: AggNorm | None = None) -> Tensor:
    """`Σ_{i,t} m·L / N`, N = `norm.num_tokens` (verl `token-mean`; DAPO Sec. 3.3, token-level loss).

    Every token weighs the same, so long sequences get more total weight. Without `norm`, N is this
    mask's token count: correct for the full batch, wrong for a micro-batch. Micro-batching needs the
    global N. An empty batch gives 0 (denominator clamped to 1).
    """
    n = _norm(mask, norm).num_tokens
    return _masked_token_sums(loss, mask).sum() / max(n, 1)


def seq_mean_token_mean(loss: Tensor, mask: Tensor, norm: AggNorm | None = None) -> Tensor:
    """`Σ_i (Σ_t m·L / |o_i|) / G`, G = `norm.num_seqs` (verl `seq-mean-token-mean`; the original GRPO
    objective, DeepSeekMath Eq. 3). Every sequence weighs the same whatever its length (PAPERS 1.6: the
    paper-3 repo's mode). Rows with no loss token contribute 0 and are not counted in G. Micro-batching
    needs the global G (or equal, non-empty micro-batches scaled by b/G, which is what verl's
    `loss_scale_factor` does).
    """
    lengths = mask.bool().sum(dim=-1)  # (B,) |o_i|
    per_seq = _masked_token_sums(loss, mask) / lengths.clamp(min=1)  # (B,)
    return per_seq.sum() / max(_norm(mask, norm).num_seqs, 1)


def seq_mean_token_sum(loss: Tensor, mask: Tensor, norm: AggNorm | None = None) -> Tensor:
    """`Σ_i Σ_t m·L / G`, G = `norm.num_seqs` (verl `seq-mean-token-sum`). Scale grows with length;
    micro-batching needs the global G.
    """
    return _masked_token_sums(loss, mask).sum() / max(_norm(mask, norm).num_seqs, 1)


def seq_mean_token_sum_norm(loss: Tensor, mask: Tensor, norm: AggNorm | None = None) -> Tensor:
    """`Σ_i Σ_t m·L / (G · H)`, G = `norm.num_seqs`, H = `norm.horizon` (verl `seq-mean-token-sum-norm`;
    Dr. GRPO's constant normaliser, Liu et al. 2025; TRL `dr_grpo`, oat `drgrpo`).

    H is verl's `loss_scale_factor`, defaulting to the padded width; set it to the max response length
    so it is constant across steps and micro-batches. Older verl (before `global_batch_info`) divided
    the sum by H only, not by G: same direction, G times larger (verl#3741). Micro-batching needs the
    global G and a fixed H.
    """
    n = _norm(mask, norm)
    return _masked_token_sums(loss, mask).sum() / (max(n.num_seqs, 1) * n.horizon)


AggregationFn = Callable[[Tensor, Tensor, AggNorm | None], Tensor]

AGGREGATIONS: dict[str, AggregationFn] = {
    "token-mean": token_mean,
    "seq-mean-token-mean": seq_mean_token_mean,
    "seq-mean-token-sum": seq_mean_token_sum,
    "seq-mean-token-sum-norm": seq_mean_token_sum_norm,
}


def aggregate(loss: Tensor, mask: Tensor, mode: str, norm: AggNorm | None = None) -> Tensor:
    """`AGGREGATIONS[mode](loss, mask, norm)` with an error that names the allowed modes."""
    if mode not in AGGREGATIONS:
        raise ValueError(f"loss_agg_mode must be one of {sorted(AGGREGATIONS)}; got {mode!r}")
    return AGGREGATIONS[mode](loss, mask, norm)


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of `x` over `mask` (0 when the mask is empty); for metrics."""
    m = mask.bool()
    return torch.where(m, x, torch.zeros_like(x)).sum() / m.sum().clamp(min=1)


# ---------------------------------------------------------------------------------------------------
# Policy gradient: PPO clip with clip-higher and dual clip
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ClipStats:
    """Masked per-token statistics of the importance ratio `r = exp(logp - old_logp)`; 0-dim detached
    tensors (no host sync until `metrics()`)."""

    clip_frac: Tensor  # clipped surrogate chosen (verl `pg_clipfrac`) = clip_frac_high + clip_frac_low
    clip_frac_high: Tensor  # A > 0 and r > 1 + clip_high: the clip-higher bound is active
    clip_frac_low: Tensor  # A < 0 and r < 1 - clip_low
    dual_clip_frac: Tensor  # A < 0 and r > clip_c: the dual clip is active (verl `pg_clipfrac_lower`)
    approx_kl: Tensor  # mean(old_logp - logp), k1 estimate of KL(old || new) (verl `ppo_kl`)
    ratio_mean: Tensor
    ratio_min: Tensor
    ratio_max: Tensor

    def metrics(self, prefix: str = "pg/") -> dict[str, float]:
        """Flat `{prefix + field: float}` for the step's metrics dict (DESIGN style 12)."""
        return {prefix + f.name: float(getattr(self, f.name)) for f in fields(self)}


@dataclass(frozen=True)
class PolicyLoss:
    per_token: Tensor  # (B, T) loss matrix; aggregate it with AGGREGATIONS
    stats: ClipStats


def ppo_clip_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_c: float | None = None,
    is_weights: Tensor | None = None,
) -> PolicyLoss:
    """PPO clipped surrogate per token, `-min(r·A, clip(r, 1 - clip_low, 1 + clip_high)·A)`.

    - `clip_high > clip_low` is DAPO's clip-higher (Yu et al. 2025, Sec. 3.1; DAPO uses 0.2 / 0.28): it
      lets low-probability tokens with A > 0 grow further, against entropy collapse.
    - `clip_c` (> 1) is dual clip (Ye et al. 2020, arXiv 1912.09729): for A < 0 the loss is additionally
      capped at `-clip_c·A`, so a token whose ratio exploded cannot dominate. None disables it.
    - `is_weights` (B, T), e.g. `tis_weights(...)`, multiply the clipped per-token loss (verl applies
      rollout-correction weights after clipping).

    The log-ratio is clamped to [-20, 20] before `exp` as verl does, so a stale token cannot overflow.
    `advantages` is `(B, T)` or `(B,)` (broadcast over tokens).
    """
    if clip_c is not None and clip_c <= 1.0:
        raise ValueError(f"clip_c must be > 1 (dual clip caps the loss at -clip_c * A); got {clip_c}")
    adv = advantages[:, None] if advantages.dim() == 1 else advantages  # (B, T) or (B, 1)
    log_ratio = (logp - old_logp).clamp(-20.0, 20.0)  # (B, T)
    ratio = torch.exp(log_ratio)  # (B, T)
    unclipped = -adv * ratio  # (B, T)
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)  # (B, T)
    loss = torch.maximum(unclipped, clipped)  # (B, T) pessimistic bound
    dual = torch.zeros_like(loss, dtype=torch.bool)
    if clip_c is not None:
        cap = -adv * clip_c  # (B, T) only binds where A < 0
        dual = (adv < 0) & (loss > cap)
        loss = torch.where(dual, cap, loss)
    if is_weights is not None:
        loss = loss * is_weights
    with torch.no_grad():
        r, m = ratio.detach(), mask.bool()
        high = (adv > 0) & (clipped > unclipped)
        low = (adv < 0) & (clipped > unclipped)
        stats = ClipStats(
            clip_frac=masked_mean((clipped > unclipped).to(r.dtype), m),
            clip_frac_high=masked_mean(high.to(r.dtype), m),
            clip_frac_low=masked_mean(low.to(r.dtype), m),
            dual_clip_frac=masked_mean(dual.to(r.dtype), m),
            approx_kl=masked_mean(-log_ratio.detach(), m),
            ratio_mean=masked_mean(r, m),
            # An empty mask reports ratio 1 (no token moved) rather than +-inf.
            ratio_min=torch.where(m, r, torch.full_like(r, float("inf"))).min().nan_to_num(posinf=1.0),
            ratio_max=torch.where(m, r, torch.full_like(r, float("-inf"))).max().nan_to_num(neginf=1.0),
        )
    return PolicyLoss(per_token=loss, stats=stats)


POLICY_LOSSES: dict[str, Callable[..., PolicyLoss]] = {"ppo_clip": ppo_clip_loss}

# ---------------------------------------------------------------------------------------------------
# KL to the reference (the same model with adapters off); Schulman, "Approximating KL divergence", 2020
# ---------------------------------------------------------------------------------------------------


def kl_k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k1 = `logp - ref_logp` per token `(B, T)`: unbiased for KL(pi || ref) on tokens sampled from pi,
    high variance and can be negative. Used as a loss its gradient is the score function, which is zero
    in expectation on on-policy samples: prefer k3 as a penalty, k1 as a metric.
    """
    return logp - ref_logp


def kl_k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k3 = `exp(ref - logp) - (ref - logp) - 1` per token `(B, T)`: unbiased, always >= 0, low
    variance; the GRPO KL term (DeepSeekMath Eq. 4; verl `low_var_kl`). As verl does, the log-ratio is
    clamped to [-20, 20] and the estimate to [-10, 10] against bf16 outliers. Exactly 0 where
    logp == ref_logp.
    """
    log_ratio = (ref_logp - logp).clamp(-20.0, 20.0)  # (B, T)
    return (torch.exp(log_ratio) - log_ratio - 1.0).clamp(-10.0, 10.0)


KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {"k1": kl_k1, "k3": kl_k3}

# ---------------------------------------------------------------------------------------------------
# Entropy
# ---------------------------------------------------------------------------------------------------


def entropy_from_logits(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Entropy of `softmax(logits / T)` over the last axis, `(..., V) -> (...)`, in >= float32.

    `H = -Σ p·log p` with `log p = log_softmax(z)`: every term is <= 0, so there is no cancellation
    between large numbers (unlike `logsumexp(z) - E_p[z]`), and a one-hot distribution gives 0, not NaN.
    Use the same `T` as sampling and the log-probs (DESIGN "Log-probs").
    """
    z = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature  # (..., V)
    logp = torch.log_softmax(z, dim=-1)  # (..., V)
    return -(logp.exp() * logp).sum(dim=-1)


# ---------------------------------------------------------------------------------------------------
# Rollout / trainer mismatch: truncated importance sampling
# ---------------------------------------------------------------------------------------------------


def tis_weights(old_logp: Tensor, rollout_logp: Tensor, *, cap: float = 2.0) -> Tensor:
    """Truncated IS weights `min(exp(old_logp - rollout_logp), cap)` per token `(B, T)`, detached.

    `old_logp` is the trainer's recomputed log-prob, `rollout_logp` the sampler's: the weight corrects
    for sampling from the rollout engine's slightly different distribution (bf16, other kernels, vLLM).
    Truncation at `cap` bounds the variance (Yao et al. 2025, "Your Efficient RL Framework Secretly
    Brings You Off-Policy RL Training"; cap 2 as in its examples and SkyRL's `tis_imp_ratio_cap`). Only
    an upper cap: weights below 1 already shrink the update.
    """
    if cap <= 0:
        raise ValueError(f"TIS cap must be > 0; got {cap}")
    with torch.no_grad():
        return torch.exp(old_logp.float() - rollout_logp.float()).clamp(max=cap)


@dataclass(frozen=True)
class LogpMismatch:
    """Rollout vs trainer log-prob mismatch over the loss tokens; 0-dim detached tensors."""

    mean_abs: Tensor  # mean |old_logp - rollout_logp|
    max_abs: Tensor  # max |old_logp - rollout_logp|
    tis_weight_mean: Tensor  # mean truncated IS weight
    tis_truncated_frac: Tensor  # fraction of tokens with exp(delta) > cap

    def metrics(self, prefix: str = "logp_mismatch/") -> dict[str, float]:
        return {prefix + f.name: float(getattr(self, f.name)) for f in fields(self)}


def logp_mismatch(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, *, cap: float = 2.0) -> LogpMismatch:
    """Statistics the loop logs every step (issue 5: mean and max |delta logp|) plus the TIS weights'."""
    with torch.no_grad():
        m = mask.bool()
        delta = old_logp.float() - rollout_logp.float()  # (B, T)
        absd = torch.where(m, delta.abs(), torch.zeros_like(delta))
        w = tis_weights(old_logp, rollout_logp, cap=cap)
        return LogpMismatch(
            mean_abs=masked_mean(absd, m),
            max_abs=absd.max() if absd.numel() else absd.sum(),
            tis_weight_mean=masked_mean(w, m),
            tis_truncated_frac=masked_mean((delta > math.log(cap)).float(), m),
        )
