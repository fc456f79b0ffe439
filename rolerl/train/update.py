"""The policy update of one training step: PPO epochs x mini-batches x micro-batches.

Each mini-batch is one optimizer step. Its micro-batches are aggregated with one `AggNorm` counted over
the whole mini-batch, so the accumulated gradient equals the full mini-batch gradient in every
aggregation mode (verl#7200, verl PR #906: counting normalisers per micro-batch is the classic bug).
The loss of a micro-batch is PPO clip on the routed forward, plus `beta` x KL to the reference (the same
model with route -1) and minus `entropy_coef` x entropy, each per token, weighted per sequence, and
aggregated once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import Tensor, nn

from rolerl.algorithms import KL_ESTIMATORS, AggNorm, aggregate, logp_mismatch, masked_mean, ppo_clip_loss
from rolerl.algorithms.losses import tis_weights
from rolerl.config import AlgorithmConfig, OptimConfig
from rolerl.roles import KIND_INDEX, KINDS, POLICY_KINDS
from rolerl.train.policy import autocast, select_rows, token_logprobs
from rolerl.types import TrainBatch


@dataclass
class LossSettings:
    """What the loss needs besides the batch (from `AlgorithmConfig`, the rollout and `TrainConfig`)."""

    algorithm: AlgorithmConfig
    temperature: float  # the rollout temperature: trainer, KL and entropy use the same T (DESIGN)
    horizon: int  # seq-mean-token-sum-norm's constant: the max response length
    chunk_size: int = 512
    bf16: bool = False
    share_prefix: bool = True  # one forward per distinct prompt of a micro-batch (rolerl.train.prefix)
    # route: a token's loss reaches every adapter it depends on; strict: only the adapter of its position
    # (DART's gradient masking; `adapters.isolation`). Strict needs `adapter_params`.
    isolation: str = "route"
    adapter_params: dict[int, list[nn.Parameter]] = field(default_factory=dict)  # route -> its parameters

    def logprob_args(self) -> dict:
        return {
            "temperature": self.temperature,
            "chunk_size": self.chunk_size,
            "share_prefix": self.share_prefix,
        }


class Mean(NamedTuple):
    """A metric that is a mean over its own tokens (a role's, a kind's): `Sums` weighs it by `count`."""

    value: float
    count: float


@dataclass
class Sums:
    """Metrics over micro-batches: loss parts (`loss/*`, `*/loss`; already globally normalised) and
    `*/loss_tokens` add up (then are averaged over optimizer steps),
    `*_max`/`*_min` take the extreme, a `Mean` is weighted by its own count, everything else is a mean
    weighted by the micro-batch's loss tokens."""

    tokens: float = 0.0
    weighted: dict[str, list[float]] = field(default_factory=dict)  # name -> [sum of value x weight, weight]
    totals: dict[str, float] = field(default_factory=dict)
    maxima: dict[str, float] = field(default_factory=dict)
    minima: dict[str, float] = field(default_factory=dict)

    def add(self, n: float, metrics: dict[str, float | Mean]) -> None:
        self.tokens += n
        for k, v in metrics.items():
            if isinstance(v, Mean):
                self._weigh(k, v.value * v.count, v.count)
            elif k.startswith("loss/") or k.endswith(("/loss", "/loss_tokens")):
                self.totals[k] = self.totals.get(k, 0.0) + v
            elif k.endswith("_max"):
                self.maxima[k] = max(self.maxima.get(k, float("-inf")), v)
            elif k.endswith("_min"):
                self.minima[k] = min(self.minima.get(k, float("inf")), v)
            else:
                self._weigh(k, v * n, n)

    def _weigh(self, k: str, value: float, weight: float) -> None:
        acc = self.weighted.setdefault(k, [0.0, 0.0])
        acc[0] += value
        acc[1] += weight

    def merge(self, other: Sums) -> None:
        self.tokens += other.tokens
        for k, (value, weight) in other.weighted.items():
            self._weigh(k, value, weight)
        self.add(0.0, other.totals | other.maxima | other.minima)

    def result(self, optimizer_steps: int = 1) -> dict[str, float]:
        """Means per token, loss parts per optimizer step, extremes as they are."""
        out = {k: v / max(w, 1.0) for k, (v, w) in self.weighted.items()}
        out |= {k: v / max(optimizer_steps, 1) for k, v in self.totals.items()}
        return out | self.maxima | self.minima


@dataclass
class Aligned:
    """Per-token tensors `(B, T)` in TrainBatch alignment (column p is about token p + 1) that travel with
    the batch's rows through mini- and micro-batching."""

    old_logp: Tensor  # PPO's old log-probs (the rollout's, or recomputed)
    is_weights: Tensor | None = None  # truncated IS weights, when TIS is on

    def rows(self, rows: Tensor | list[int], width: int) -> Aligned:
        w = None if self.is_weights is None else self.is_weights[rows, :width]
        return Aligned(self.old_logp[rows, :width], w)


def loss_terms(
    model: nn.Module, mb: TrainBatch, aligned: Aligned, norm: AggNorm, s: LossSettings
) -> tuple[Tensor, dict[str, float], Tensor]:
    """`(weighted, metrics, logp)` of one micro-batch: the per-token loss `(b, T-1)` (PPO clip, KL,
    entropy, times the sequence weight) before aggregation, which is linear in it: `backward` aggregates
    it whole or per adapter, role shares in parts, all with the mini-batch's `norm`, so micro-batch losses
    (and gradients) sum to the full one. `logp` `(b, T-1)` is detached (for the rollout/trainer
    mismatch)."""
    alg = s.algorithm
    mask = mb.loss_mask[:, :-1]  # (b, T-1)
    with autocast(mb.input_ids.device, s.bf16):
        out = token_logprobs(model, mb, with_entropy=True, **s.logprob_args())
    logp, entropy = out.logp, out.entropy  # (b, T-1)
    adv = mb.advantages[:, :-1]  # (b, T-1)
    pg = ppo_clip_loss(
        logp,
        aligned.old_logp[:, :-1],
        adv,
        mask,
        clip_low=alg.clip_low,
        clip_high=alg.clip_high,
        clip_c=alg.clip_c,
        is_weights=None if aligned.is_weights is None else aligned.is_weights[:, :-1],
    )
    per_token = pg.per_token  # (b, T-1)
    metrics = pg.stats.metrics()
    if alg.beta > 0:
        # The reference on this very micro-batch (same shapes, same rounding): with zero adapters the KL is
        # exactly 0, which a reference computed once per step over other row groupings would not give.
        with torch.no_grad(), autocast(mb.input_ids.device, s.bf16):
            ref = token_logprobs(model, mb, routes=-1, **s.logprob_args())
        kl = KL_ESTIMATORS[alg.kl](logp, ref.logp)  # (b, T-1)
        per_token = per_token + alg.beta * kl
        metrics["kl"] = float(masked_mean(kl.detach(), mask))
        metrics["loss/kl"] = _part(alg.beta * kl, mb, mask, alg, norm)
    if alg.entropy_coef > 0:
        per_token = per_token - alg.entropy_coef * entropy
        metrics["loss/entropy"] = _part(-alg.entropy_coef * entropy, mb, mask, alg, norm)
    metrics["entropy"] = float(masked_mean(entropy.detach(), mask))
    metrics["loss/pg"] = _part(pg.per_token, mb, mask, alg, norm)
    weighted = per_token * mb.weights[:, None].to(per_token.dtype)  # (b, T-1) per-sequence weights
    metrics |= split_metrics(weighted.detach(), entropy.detach(), adv, mb, norm, alg.loss_agg)
    return weighted, metrics, logp.detach()


def split_metrics(
    weighted: Tensor, entropy: Tensor, adv: Tensor, mb: TrainBatch, norm: AggNorm, agg: str
) -> dict[str, float | Mean]:
    """Per role and per kind of target token: its part of the aggregated loss (aggregation is linear in
    the loss matrix, so the parts add up to the loss), its loss tokens, mean entropy and mean advantage."""
    mask = mb.loss_mask[:, :-1] > 0  # (b, T-1)
    target = mb.kind_ids[:, 1:]  # (b, T-1): the kind of the token each position predicts
    parts = {f"role/{name}": (mb.role_index[:, :1] == r) & mask for r, name in enumerate(mb.role_names)}
    parts |= {f"kind/{k}": (target == KIND_INDEX[k]) & mask for k in KINDS if k in POLICY_KINDS}
    out: dict[str, float | Mean] = {}
    for name, where in parts.items():
        n = float(where.sum())
        if n == 0:
            continue
        out[f"{name}/loss"] = float(aggregate(weighted * where, mb.loss_mask[:, :-1], agg, norm))
        out[f"{name}/entropy"] = Mean(float(entropy[where].float().mean()), n)
        out[f"{name}/advantage"] = Mean(float(adv[where].float().mean()), n)
        out[f"{name}/loss_tokens"] = n  # per optimizer step, like the loss parts
    return out


def backward(weighted: Tensor, mb: TrainBatch, norm: AggNorm, s: LossSettings) -> Tensor:
    """Backpropagate one micro-batch's loss; returns it (detached).

    `route`: one backward of the whole loss. `strict` (DART's gradient masking): the loss at a position
    reaches only the adapter that computes that position (`routes[p]`, the adapter of the token it
    predicts), one `autograd.grad` per adapter over the same graph; attention would otherwise carry a
    tool token's loss into the reasoning adapter's keys and values. Positions routed to the base (-1)
    train nothing under strict. Aggregation is linear, so the parts add up to the loss of `route`."""
    mask, agg = mb.loss_mask[:, :-1], s.algorithm.loss_agg
    if s.isolation == "route":
        loss = aggregate(weighted, mask, agg, norm)
        loss.backward()
        return loss.detach()
    at = mb.routes[:, :-1]  # (b, T-1): the adapter of each loss position
    present = [a for a in s.adapter_params if bool(((at == a) & (mask > 0)).any())]
    total = weighted.new_zeros(())
    for i, a in enumerate(present):
        part = aggregate(weighted * (at == a), mask, agg, norm)
        params = s.adapter_params[a]
        grads = torch.autograd.grad(part, params, retain_graph=i < len(present) - 1, allow_unused=True)
        for p, g in zip(params, grads, strict=True):
            if g is not None:
                p.grad = g if p.grad is None else p.grad + g
        total = total + part.detach()
    return total


def _part(per_token: Tensor, mb: TrainBatch, mask: Tensor, alg: AlgorithmConfig, norm: AggNorm) -> float:
    """One term's share of the aggregated loss (for metrics)."""
    return float(aggregate(per_token.detach() * mb.weights[:, None], mask, alg.loss_agg, norm))


def accumulate_gradients(
    model: nn.Module,
    batch: TrainBatch,
    aligned: Aligned,
    s: LossSettings,
    micro_batch_size: int,
    tick: Callable[[], None] = lambda: None,
) -> tuple[float, Sums, Tensor]:
    """Backward over `batch` in micro-batches, with the normalisers of the whole `batch`.

    Returns the total loss (= the full-batch loss), token-weighted metric sums, and the detached trainer
    log-probs `(B, T)` in TrainBatch alignment. Gradients accumulate into `.grad` (not zeroed here).
    `tick` is called after each micro-batch (progress).
    """
    b = batch.input_ids.shape[0]
    norm = AggNorm.of(batch.loss_mask, horizon=s.horizon)
    logp_all = torch.zeros_like(batch.old_logp)  # (B, T)
    total, sums = 0.0, Sums()
    for start in range(0, b, micro_batch_size):
        rows = list(range(start, min(start + micro_batch_size, b)))
        mb = select_rows(batch, rows)
        width = mb.input_ids.shape[1]
        weighted, metrics, logp = loss_terms(model, mb, aligned.rows(rows, width), norm, s)
        total += float(backward(weighted, mb, norm, s))
        sums.add(float(mb.loss_mask.sum()), metrics)
        logp_all[rows, : width - 1] = logp.to(logp_all.dtype)
        tick()
    return total, sums, logp_all


@torch.no_grad()
def recompute_logprobs(
    model: nn.Module,
    batch: TrainBatch,
    s: LossSettings,
    micro_batch_size: int,
    tick: Callable[[], None] = lambda: None,
) -> Tensor:
    """The trainer's log-probs of every loss token before any update, `(B, T)` in TrainBatch alignment."""
    out = torch.zeros_like(batch.old_logp)
    for start in range(0, batch.input_ids.shape[0], micro_batch_size):
        rows = list(range(start, min(start + micro_batch_size, batch.input_ids.shape[0])))
        mb = select_rows(batch, rows)
        with autocast(mb.input_ids.device, s.bf16):
            lp = token_logprobs(model, mb, **s.logprob_args()).logp
        out[rows, : mb.input_ids.shape[1] - 1] = lp.float()
        tick()
    return out


def ppo_update(
    model: nn.Module,
    params: Sequence[nn.Parameter],
    optimizer: torch.optim.Optimizer,
    batch: TrainBatch,
    s: LossSettings,
    *,
    ppo_epochs: int,
    mini_batches: int,
    micro_batch_size: int,
    grad_clip: float,
    generator: torch.Generator,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, float]:
    """PPO epochs over `batch`; each of `mini_batches` shuffled row subsets is one optimizer step.

    `old_logp: recompute` (or TIS, or several mini-batches) runs one no-grad forward first, so the
    mismatch to the rollout's log-probs is measured before any update; otherwise the first (only)
    mini-batch's forward is that measurement, at no extra cost. `progress(done, total)` is called after
    each micro-batch forward.
    """
    alg = s.algorithm
    mask = batch.loss_mask
    b = batch.input_ids.shape[0]
    recompute = alg.old_logp == "recompute" or alg.tis_cap is not None or mini_batches > 1
    per_epoch = sum(
        math.ceil(len(rows) / micro_batch_size) for rows in torch.arange(b).tensor_split(mini_batches)
    )
    total_mb = ppo_epochs * per_epoch + (math.ceil(b / micro_batch_size) if recompute else 0)
    done = 0

    def tick() -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total_mb)

    metrics: dict[str, float] = {}
    trainer_logp = recompute_logprobs(model, batch, s, micro_batch_size, tick) if recompute else None
    if trainer_logp is not None:
        metrics |= _mismatch(trainer_logp, batch.old_logp, mask, alg.tis_cap)
    aligned = Aligned(
        old_logp=trainer_logp if alg.old_logp == "recompute" else batch.old_logp,
        is_weights=tis_weights(trainer_logp, batch.old_logp, cap=alg.tis_cap) if alg.tis_cap else None,
    )
    sums, losses, grad_norms = Sums(), [], []
    for epoch in range(ppo_epochs):
        order = torch.randperm(b, generator=generator)
        for rows in order.tensor_split(mini_batches):
            if len(rows) == 0:
                continue
            sub = select_rows(batch, rows)
            width = sub.input_ids.shape[1]
            optimizer.zero_grad(set_to_none=True)
            loss, mb_sums, logp = accumulate_gradients(
                model, sub, aligned.rows(rows, width), s, micro_batch_size, tick
            )
            if not recompute and epoch == 0:
                metrics |= _mismatch(logp, sub.old_logp, sub.loss_mask, None)
            grad_norms.append(_clip(params, grad_clip))
            optimizer.step()
            losses.append(loss)
            sums.merge(mb_sums)
    metrics |= sums.result(len(losses))
    metrics["loss/total"] = sum(losses) / max(len(losses), 1)
    metrics["grad_norm"] = sum(grad_norms) / max(len(grad_norms), 1)
    metrics["optimizer_steps"] = float(len(losses))
    return metrics


def _mismatch(trainer: Tensor, rollout: Tensor, mask: Tensor, cap: float | None) -> dict[str, float]:
    stats = logp_mismatch(trainer, rollout, mask, cap=cap if cap is not None else 2.0)
    out = stats.metrics()
    if cap is None:  # TIS off: its statistics describe nothing that was applied
        out = {k: v for k, v in out.items() if not k.startswith("logp_mismatch/tis")}
    return out


def _clip(params: Sequence[nn.Parameter], max_norm: float) -> float:
    grads = [p for p in params if p.grad is not None]
    if not grads:
        return 0.0
    if max_norm > 0:
        return float(torch.nn.utils.clip_grad_norm_(grads, max_norm))
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in grads])))


def lr_factor(step: int, total_steps: int, o: OptimConfig) -> float:
    """The lr multiplier of (0-based) `step`: linear warm-up over `o.warmup_steps`, then constant or cosine
    towards `o.min_lr_ratio`; the cosine reaches its floor one step after the last, so the last step learns."""
    if step < o.warmup_steps:
        return (step + 1) / o.warmup_steps
    if o.schedule == "constant":
        return 1.0
    progress = min((step - o.warmup_steps) / max(total_steps - o.warmup_steps, 1), 1.0)
    return o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
