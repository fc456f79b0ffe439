"""The policy update of one training step: PPO epochs x mini-batches x micro-batches.

A mini-batch is one optimizer step of the adapters its rows ran through (`step_policy: per_minibatch`),
or, with `merged`, each adapter takes one step per epoch with the mean of its mini-batches' gradients
(PAPERS 1.7: a parallel role whose k instances fill k mini-batches otherwise takes k steps). Mini-batches
mix every role's rows, or are cut from each role's rows separately (`mini_batch_by: role`, verl's update
per role). A step's rows may come from several models (`Part`s: the `separate` preset); they are
shuffled together and a mini-batch's normalisers count all of them.

Each mini-batch's micro-batches are aggregated with one `AggNorm` counted over the whole mini-batch, so
the accumulated gradient equals the full mini-batch gradient in every aggregation mode (verl#7200, verl
PR #906: counting normalisers per micro-batch is the classic bug). Each role's share of a mini-batch's
loss is set by per-sequence weights (`algorithm.role_share`, `rolerl.algorithms.weighting`). The loss of a
micro-batch is PPO clip on the routed forward, plus each role's `beta` x KL to the reference (the same
model with route -1) and minus its `entropy_coef` x entropy, each per token, weighted per sequence, and
aggregated once.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import Tensor, nn

from rolerl.algorithms import KL_ESTIMATORS, AggNorm, aggregate, logp_mismatch, masked_mean, ppo_clip_loss
from rolerl.algorithms.losses import tis_weights
from rolerl.algorithms.weighting import loss_shares, role_share_weights
from rolerl.config import AlgorithmConfig
from rolerl.models.lora import adapter_parameters, adapter_specs
from rolerl.roles import KIND_INDEX, KINDS, POLICY_KINDS
from rolerl.train.distributed import SINGLE, Dist
from rolerl.train.optim import Optimizer
from rolerl.train.policy import autocast, select_rows, token_logprobs
from rolerl.train.prefix import carriers
from rolerl.types import TrainBatch


@dataclass
class LossSettings:
    """What the loss needs besides the batch (from `AlgorithmConfig`, the rollout and `TrainConfig`)."""

    algorithm: AlgorithmConfig
    temperature: float  # the rollout temperature: trainer, KL and entropy use the same T (DESIGN)
    horizon: int  # seq-mean-token-sum-norm's constant: the max response length
    chunk_size: int | None = None  # positions per log-prob chunk; None: `chunk_positions`
    bf16: bool = False
    share_prefix: bool = True  # one forward per distinct prompt of a micro-batch (rolerl.train.prefix)
    skip_inert: bool = True  # rows whose loss is zero at every token run no forward (`inert_rows`)
    # route: a token's loss reaches every adapter it depends on; strict: only the adapter of its position
    # (DART's gradient masking; `adapters.isolation`). Strict needs `adapter_params`.
    isolation: str = "route"
    adapter_params: dict[int, list[nn.Parameter]] = field(default_factory=dict)  # route -> its parameters
    role_beta: dict[str, float] = field(default_factory=dict)  # role -> KL weight (default algorithm.beta)
    role_entropy: dict[str, float] = field(
        default_factory=dict
    )  # role -> entropy coef (default the algorithm's)
    loss_weight: dict[str, float] = field(default_factory=dict)  # role -> loss multiplier (default 1)

    def _per_role(self, name: str) -> tuple[dict[str, float], float]:
        """`(role -> value, default)` of coefficient `name` (beta, entropy)."""
        if name == "beta":
            return self.role_beta, self.algorithm.beta
        return self.role_entropy, self.algorithm.entropy_coef

    def coefficients(self, mb: TrainBatch, name: str) -> Tensor | float:
        """`name` (beta, entropy) per row of `mb` `(b, 1)`, or one float when no role overrides it."""
        table, default = self._per_role(name)
        if not table:
            return default
        per_role = torch.tensor([table.get(r, default) for r in mb.role_names], dtype=torch.float32)
        return per_role.to(mb.weights.device)[mb.role_index[:, 0].clamp(min=0)][:, None]  # (b, 1)

    def uses(self, name: str) -> bool:
        """Whether any role's `name` coefficient is non-zero (the KL then needs a reference forward)."""
        table, default = self._per_role(name)
        return default > 0 or any(v > 0 for v in table.values())

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
            elif k.endswith(("_max", "/max_abs")):
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

    # PPO's old log-probs (the rollout's, or recomputed); None: the training forward's own, detached (an
    # update of one optimizer step trains the very policy they would be recomputed from)
    old_logp: Tensor | None
    is_weights: Tensor | None = None  # truncated IS weights, when TIS is on
    # TIS from the training forward's own log-probs: of the `fresh` rows, or of every row without them
    tis_cap: float | None = None
    # (B,) bool: rows whose first training forward comes before any optimizer step and was not recomputed:
    # it gives their old log-probs (`own_old`: the trainer's are PPO's) and TIS weights, kept by `keep`
    fresh: Tensor | None = None
    own_old: bool = False

    def rows(self, rows: Tensor | list[int], width: int) -> Aligned:
        w = None if self.is_weights is None else self.is_weights[rows, :width]
        old = None if self.old_logp is None else self.old_logp[rows, :width]
        fresh = None if self.fresh is None else self.fresh[rows]
        return Aligned(old, w, self.tis_cap, fresh, self.own_old)

    def keep(self, rows: list[int], logp: Tensor, rollout: Tensor) -> None:
        """Keep what the fresh ones among `rows` took from their training forward (its detached `logp`
        `(len(rows), W)`, `rollout` their rollout log-probs) for the epochs after: they are fresh no more."""
        if self.fresh is None or not rows:
            return
        at = self.fresh[rows].nonzero().squeeze(1)
        if not len(at):
            return
        which, width = torch.tensor(rows)[at], logp.shape[1]
        if self.own_old:
            self.old_logp[which, :width] = logp[at]
        if self.tis_cap is not None:
            self.is_weights[which, :width] = tis_weights(logp[at], rollout[at], cap=self.tis_cap)
        self.fresh[which] = False


def inert_rows(batch: TrainBatch, s: LossSettings) -> Tensor:
    """`(B,)` bool: the rows whose every loss term is zero at every token, whose forward and backward add
    only exact zeros to the gradient: no loss token with a non-zero advantage (a GRPO group whose samples
    all scored alike) and neither a KL nor an entropy term for their role, or a sequence weight or role
    loss weight of 0. PPO's clipped term, truncated IS and every aggregation are linear in the advantage.
    Keep in step with `loss_terms`."""
    live = batch.loss_mask[:, :-1] > 0
    signal = ((batch.advantages[:, :-1] != 0) & live).any(-1)  # NaN is signal: it must reach the loss
    for name in ("beta", "entropy"):
        coef = s.coefficients(batch, name)  # a float, or (B, 1) per role
        if isinstance(coef, Tensor):
            signal |= coef[:, 0].to(signal.device) != 0
        elif coef != 0:
            signal[:] = True
    role_weight = [s.loss_weight.get(r, 1.0) for r in batch.roles]
    weight = batch.weights * torch.tensor(role_weight, dtype=batch.weights.dtype, device=batch.weights.device)
    return ~signal | (weight.to(signal.device) == 0)


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
        # entropy is a metric unless a role's coefficient puts it in the loss (a frozen head's backward is
        # then cheaper: rolerl.algorithms.logprobs)
        entropy_grad = s.uses("entropy")
        out = token_logprobs(model, mb, with_entropy=True, entropy_grad=entropy_grad, **s.logprob_args())
    logp, entropy = out.logp, out.entropy  # (b, T-1)
    adv = mb.advantages[:, :-1]  # (b, T-1)
    own, fresh = logp.detach(), None if aligned.fresh is None else aligned.fresh[:, None]  # fresh: (b, 1)
    old = own if aligned.old_logp is None else aligned.old_logp[:, :-1]
    if fresh is not None and aligned.own_old:
        old = torch.where(fresh, own, old)
    is_weights = None if aligned.is_weights is None else aligned.is_weights[:, :-1]
    if aligned.tis_cap is not None:
        mine = tis_weights(own, mb.old_logp[:, :-1], cap=aligned.tis_cap)
        is_weights = mine if fresh is None else torch.where(fresh, mine, is_weights)
    pg = ppo_clip_loss(
        logp,
        old,
        adv,
        mask,
        clip_low=alg.clip_low,
        clip_high=alg.clip_high,
        clip_c=alg.clip_c,
        is_weights=is_weights,
    )
    per_token = pg.per_token  # (b, T-1)
    metrics = pg.stats.metrics()
    if s.uses("beta"):
        # The reference on this very micro-batch (same shapes, same rounding): with zero adapters the KL is
        # exactly 0, which a reference computed once per step over other row groupings would not give.
        with torch.no_grad(), autocast(mb.input_ids.device, s.bf16):
            ref = token_logprobs(model, mb, routes=-1, **s.logprob_args())
        kl = KL_ESTIMATORS[alg.kl](logp, ref.logp)  # (b, T-1)
        beta = s.coefficients(mb, "beta")  # a float, or (b, 1) per role
        per_token = per_token + beta * kl
        metrics["kl"] = float(masked_mean(kl.detach(), mask))
        metrics["loss/kl"] = _part(beta * kl, mb, mask, alg, norm)
    if s.uses("entropy"):
        coef = s.coefficients(mb, "entropy")
        per_token = per_token - coef * entropy
        metrics["loss/entropy"] = _part(-coef * entropy, mb, mask, alg, norm)
    metrics["entropy"] = float(masked_mean(entropy.detach(), mask))
    metrics["loss/pg"] = _part(pg.per_token, mb, mask, alg, norm)
    weighted = per_token * mb.weights[:, None].to(per_token.dtype)  # (b, T-1) per-sequence weights
    metrics |= split_metrics(weighted.detach(), entropy.detach(), adv, mb, norm, alg.loss_agg)
    return weighted, metrics, logp.detach()


def split_metrics(
    weighted: Tensor, entropy: Tensor | None, adv: Tensor, mb: TrainBatch, norm: AggNorm, agg: str
) -> dict[str, float | Mean]:
    """Per role and per kind of target token: its part of the aggregated loss (aggregation is linear in
    the loss matrix, so the parts add up to the loss), its loss tokens, mean entropy (without `entropy`:
    rows that ran no forward, none) and mean advantage."""
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
        if entropy is not None:
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
    return float(
        aggregate(per_token.detach() * mb.weights[:, None].to(per_token.dtype), mask, alg.loss_agg, norm)
    )


def accumulate_gradients(
    model: nn.Module,
    batch: TrainBatch,
    aligned: Aligned,
    s: LossSettings,
    micro_batch_size: int,
    tick: Callable[[], None] = lambda: None,
    norm: AggNorm | None = None,
) -> tuple[float, Sums, Tensor]:
    """Backward over `batch` in micro-batches, with the normalisers of the whole `batch` (or `norm`, those
    of a mini-batch that spans several models' batches).

    Returns the total loss (= the full-batch loss), token-weighted metric sums, and the detached trainer
    log-probs `(B, T)` in TrainBatch alignment. Gradients accumulate into `.grad` (not zeroed here).
    `tick` is called after each micro-batch (progress).
    """
    norm = norm if norm is not None else AggNorm.of(batch.loss_mask, horizon=s.horizon)
    logp_all = torch.zeros_like(batch.old_logp)  # (B, T)
    total, sums = 0.0, Sums()
    for rows in by_length(batch, range(batch.input_ids.shape[0]), micro_batch_size, s.share_prefix):
        mb = select_rows(batch, rows)
        width = mb.input_ids.shape[1]
        weighted, metrics, logp = loss_terms(model, mb, aligned.rows(rows, width), norm, s)
        total += float(backward(weighted, mb, norm, s))
        sums.add(float(mb.loss_mask.sum()), metrics)
        logp_all[rows, : width - 1] = logp.to(logp_all.dtype)
        # Dropped before the next micro-batch's forward, not when it returns and rebinds the names. They
        # hold little once backward has run, but alive through that forward they cost 1.1-2.3 GB of peak
        # RSS in a 512-token GRPO step (docs/history/BENCHMARKS-history.md, GRPO round six): the heap
        # fragments around them.
        del weighted, metrics, logp
        tick()
    return total, sums, logp_all


def by_length(batch: TrainBatch, rows: Sequence[int], size: int, carry: bool = False) -> list[list[int]]:
    """`rows` in micro-batches of `size`, shortest rows first: a micro-batch is padded to its longest row,
    and rows of like length together pad least (RL's completions end anywhere up to the token limit). The
    gradient is the sum over micro-batches with the whole batch's normalisers, so which rows share one
    changes only the float rounding. With `carry` (the forward runs rows inside their carriers,
    `rolerl.train.policy.carried`), a carrier's rows go with it, and `size` counts the rows a forward
    runs: a reasoner's conversation, each of its calls a row, is one."""
    rows = list(rows)
    lengths = batch.attention_mask.sum(-1).tolist()
    families: dict[int, list[int]] = {}  # carrier -> its rows (itself included)
    for r, c in zip(rows, carriers(batch, rows) if carry and rows else rows, strict=True):
        families.setdefault(c, []).append(r)
    order = sorted(families, key=lambda r: lengths[r])  # stable: equal lengths keep their (shuffled) order
    return [[r for c in order[i : i + size] for r in families[c]] for i in range(0, len(order), size)]


@torch.no_grad()
def recompute_logprobs(
    model: nn.Module,
    batch: TrainBatch,
    s: LossSettings,
    micro_batch_size: int,
    tick: Callable[[], None] = lambda: None,
    rows: Sequence[int] | None = None,
) -> Tensor:
    """The trainer's log-probs of every loss token before any update, `(B, T)` in TrainBatch alignment;
    only of `rows` (default all; the others stay 0)."""
    out = torch.zeros_like(batch.old_logp)
    todo = range(batch.input_ids.shape[0]) if rows is None else rows
    for rows in by_length(batch, todo, micro_batch_size, s.share_prefix):
        mb = select_rows(batch, rows)
        with autocast(mb.input_ids.device, s.bf16):
            lp = token_logprobs(model, mb, **s.logprob_args()).logp
        out[rows, : mb.input_ids.shape[1] - 1] = lp.float()
        tick()
    return out


@dataclass
class Part:
    """One model's rows of a step's batch (a step spans several models under the `separate` preset)."""

    model: nn.Module
    batch: TrainBatch
    adapters: list[str]  # route index -> adapter name (the model's adapter order)
    adapter_params: dict[int, list[nn.Parameter]] = field(default_factory=dict)  # for strict isolation
    aligned: Aligned | None = None  # set by `ppo_update`
    # the rows this process computes (data parallelism: its own episodes'); None = every row. Normalisers
    # and role shares always count every row.
    owned: frozenset[int] | None = None
    # rows that run no forward because their loss is zero at every token (`inert_rows`; set by `ppo_update`)
    inert: frozenset[int] = frozenset()

    @classmethod
    def of(cls, model: nn.Module, batch: TrainBatch, owned: Sequence[int] | None = None) -> Part:
        """`model`'s rows; strict isolation differentiates only trainable adapters (a frozen one has none)."""
        params = {i: [p for p in ps if p.requires_grad] for i, ps in adapter_parameters(model).items()}
        mine = None if owned is None else frozenset(owned)
        return cls(
            model, batch, list(adapter_specs(model)), {i: ps for i, ps in params.items() if ps}, owned=mine
        )

    def mine(self, rows: Sequence[int]) -> list[int]:
        """The positions in `rows` (row indices of this part) of the rows this process computes."""
        return [j for j, r in enumerate(rows) if self._owns(r) and r not in self.inert]

    def idle(self, rows: Sequence[int]) -> list[int]:
        """The positions in `rows` of this process's inert rows: counted in the metrics, never run."""
        return [j for j, r in enumerate(rows) if self._owns(r) and r in self.inert]

    def _owns(self, row: int) -> bool:
        return self.owned is None or row in self.owned


@dataclass
class Schedule:
    """How a step's rows become optimizer steps (`TrainConfig`)."""

    ppo_epochs: int = 1
    mini_batches: int = 1  # mini-batches per epoch (when `mini_batch_size` is None)
    mini_batch_size: int | None = None  # rows per mini-batch; None = split into `mini_batches`
    by_role: bool = False  # cut mini-batches from each role's rows separately (verl's update per role)
    merged: bool = False  # step_policy merged: one step per adapter per epoch over all its mini-batches

    def mini_batches_of(self, order: Tensor, roles: Sequence[str]) -> list[Tensor]:
        """The epoch's mini-batches (global row indices) given a shuffled `order` and each row's role."""
        pools = [order]
        if self.by_role:
            pools = [order[torch.tensor([roles[i] == r for i in order.tolist()], dtype=torch.bool)]
                     for r in dict.fromkeys(roles)]  # fmt: skip
        out = []
        for pool in pools:
            if self.mini_batch_size is not None:
                out += list(pool.split(self.mini_batch_size))
            else:
                out += list(pool.tensor_split(self.mini_batches))
        return [rows for rows in out if len(rows)]


def ppo_update(
    parts: Sequence[Part],
    optimizer: Optimizer,
    s: LossSettings,
    schedule: Schedule,
    *,
    micro_batch_size: int,
    generator: torch.Generator,
    progress: Callable[[int, int], None] | None = None,
    dist: Dist = SINGLE,
) -> dict[str, float]:
    """PPO epochs over the step's rows (one `Part` per model); each mini-batch is one optimizer step of the
    adapters it touched, or (`schedule.merged`) each adapter takes one step per epoch. Under data
    parallelism (`dist`) each rank computes its parts' `owned` rows, gradients are summed over ranks before
    each step and the metrics are merged over ranks.

    Rows of all parts are shuffled together; a mini-batch's normaliser (`AggNorm`) and role shares are
    counted over all its rows. `old_logp: recompute` (or TIS) needs the trainer's log-probs of every row
    under the policy before the update. A row whose first training forward comes before any optimizer
    step (the first mini-batch's rows; every row with `merged` steps) has them from that forward: its old
    log-probs and TIS weights are that forward's (detached; the PPO ratio starts at 1, as TRL does with one
    iteration) and are kept for later epochs. Only the other rows run a no-grad forward first: none in an
    update of one optimizer step, half of them with two mini-batches. Either way the rollout/trainer
    mismatch is measured once on every row (without recomputing, on the first mini-batch's rows: a random
    share, at no extra cost). `progress(done, total)` is called after each micro-batch forward.

    With `s.skip_inert`, rows whose loss is zero at every token (`inert_rows`: in GRPO, every row of a group
    whose samples scored alike) run no forward, backward or recompute: they would add exact zeros, so the
    gradient is the same up to float rounding (other rows share the micro-batches), and an adapter that only
    they reach still steps with a zero gradient (as AdamW moved it when they ran). The normalisers, role
    shares, loss-token counts and advantage means count them; the entropy, PPO ratio and rollout/trainer
    mismatch metrics cover the rows that ran. `update/inert_frac` is the step's share of inert rows.
    """
    alg = s.algorithm
    offsets = [0]
    for part in parts:
        offsets.append(offsets[-1] + part.batch.input_ids.shape[0])
        inert = inert_rows(part.batch, s).nonzero().squeeze(1).tolist() if s.skip_inert else ()
        part.inert = frozenset(inert)
    roles = [r for part in parts for r in part.batch.roles]
    order0 = torch.randperm(offsets[-1], generator=generator)  # epoch 0's, drawn first: it decides `early`
    first = schedule.mini_batches_of(order0, roles)
    one_step = schedule.ppo_epochs == 1 and (schedule.merged or len(first) == 1)
    needed = alg.old_logp == "recompute" or alg.tis_cap is not None
    # rows whose first training forward comes before any optimizer step (every row under merged steps,
    # else the first mini-batch's): that forward gives their old log-probs; only the others are recomputed
    early = set((order0 if schedule.merged else first[0]).tolist())
    todo = [
        [r for r in p.mine(range(p.batch.input_ids.shape[0])) if r + offsets[i] not in early]
        if needed
        else []
        for i, p in enumerate(parts)
    ]
    total_mb = schedule.ppo_epochs * sum(
        len(by_length(part.batch, _mine(part, _local(rows, offsets, i)), micro_batch_size, s.share_prefix))
        for rows in first
        for i, part in enumerate(parts)
    ) + sum(
        len(by_length(p.batch, rows, micro_batch_size, s.share_prefix))
        for p, rows in zip(parts, todo, strict=True)
    )
    done = 0

    def tick() -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total_mb)

    mismatch = Sums()
    for i, (part, rows) in enumerate(zip(parts, todo, strict=True)):
        batch = part.batch
        trainer = recompute_logprobs(part.model, batch, s, micro_batch_size, tick, rows) if rows else None
        if trainer is not None:
            sub = select_rows(batch, rows)
            width = sub.input_ids.shape[1]
            mismatch.add(0.0, _mismatch(trainer[rows, :width], sub.old_logp, sub.loss_mask, alg.tis_cap, sub))
        if not needed:
            part.aligned = Aligned(old_logp=batch.old_logp)
        elif one_step:  # the training forwards' own log-probs, used once: nothing to keep
            old = None if alg.old_logp == "recompute" else batch.old_logp
            part.aligned = Aligned(old_logp=old, tis_cap=alg.tis_cap)
        else:
            fresh = torch.zeros(batch.input_ids.shape[0], dtype=torch.bool)
            fresh[_local(torch.tensor(sorted(early)), offsets, i)] = True
            trainer = trainer if trainer is not None else torch.zeros_like(batch.old_logp)
            part.aligned = Aligned(
                old_logp=trainer if alg.old_logp == "recompute" else batch.old_logp,
                is_weights=tis_weights(trainer, batch.old_logp, cap=alg.tis_cap) if alg.tis_cap else None,
                tis_cap=alg.tis_cap,
                fresh=fresh,
                own_old=alg.old_logp == "recompute",
            )
    sums, losses, norms, touched = Sums(), [], [], Counter()
    for epoch in range(schedule.ppo_epochs):
        order = order0 if epoch == 0 else torch.randperm(offsets[-1], generator=generator)
        batches = schedule.mini_batches_of(order, roles)
        if schedule.merged:
            optimizer.zero_grad()
        for k, rows in enumerate(batches):
            if not schedule.merged:
                optimizer.zero_grad()
            # the forwards before the first optimizer step measure the rollout/trainer mismatch of the rows
            # not recomputed
            measure = epoch == 0 and (k == 0 or schedule.merged)
            loss, mb_sums, hit, reached = _mini_batch(
                parts, rows, offsets, s, micro_batch_size, tick, measure
            )
            _zero_grads(optimizer, reached)  # the adapters only inert rows reached step as when they ran
            touched.update(hit)
            losses.append(loss)
            sums.merge(mb_sums)
            if not schedule.merged:
                dist.reduce_gradients(optimizer.params)
                norms.append(optimizer.clip())
                optimizer.step()
        if schedule.merged:  # each adapter's mean over the mini-batches that touched it
            dist.reduce_gradients(optimizer.params)
            for group in optimizer.groups:
                for p in group.params.values():
                    if p.grad is not None and touched[group.name] > 1:
                        p.grad.div_(touched[group.name])
            norms.append(optimizer.clip())
            optimizer.step()
            touched.clear()
    if dist.active:  # every rank's sums, merged in rank order; the losses summed over ranks
        mismatch, sums = (_merged(s_) for s_ in zip(*dist.gather((mismatch, sums)), strict=True))
        losses = dist.sum(losses)
    sums.merge(mismatch)  # every row's mismatch once: recomputed, or measured by its first forward
    metrics = sums.result(len(losses))
    metrics["loss/total"] = sum(losses) / max(len(losses), 1)
    metrics["grad_norm"] = sum(n["global"] for n in norms) / max(len(norms), 1)
    metrics["optimizer_steps"] = float(len(norms))
    metrics["update/inert_frac"] = sum(len(part.inert) for part in parts) / max(offsets[-1], 1)
    for group in optimizer.groups:
        mine = [n[group.name] for n in norms if group.name in n]
        if mine:
            metrics[f"adapter/{group.name}/grad_norm"] = sum(mine) / len(mine)
        metrics[f"adapter/{group.name}/steps"] = float(len(mine))
    return metrics


def _merged(parts: Sequence[Sums]) -> Sums:
    out = Sums()
    for part in parts:
        out.merge(part)
    return out


def _zero_grads(optimizer: Optimizer, adapters: set[str]) -> None:
    """A zero gradient for each trainable parameter of `adapters` that has none: the optimizer steps them."""
    for group in optimizer.groups:
        if group.name in adapters:
            for p in group.params.values():
                if p.grad is None and p.requires_grad:
                    p.grad = torch.zeros_like(p)


def _mine(part: Part, local: list[int]) -> list[int]:
    """The rows among `local` (part `part`'s row indices) this process runs a forward for."""
    return [local[j] for j in part.mine(local)]


def _local(rows: Tensor, offsets: Sequence[int], i: int) -> list[int]:
    """The rows of part `i` among global `rows`, as that part's row indices (in the given order)."""
    return [r - offsets[i] for r in rows.tolist() if offsets[i] <= r < offsets[i + 1]]


def _mini_batch(
    parts: Sequence[Part],
    rows: Tensor,
    offsets: Sequence[int],
    s: LossSettings,
    micro_batch_size: int,
    tick: Callable[[], None],
    measure: bool,
) -> tuple[float, Sums, set[str], set[str]]:
    """Accumulate one mini-batch's gradients over every part it has rows of; returns its loss, metric sums,
    the adapters its rows ran through, and the adapters this process's inert rows would have given a (zero)
    gradient had they run (those routed at any of their positions; under strict isolation, at their loss
    positions)."""
    subs = []
    for i, part in enumerate(parts):
        local = _local(rows, offsets, i)
        if local:
            sub = select_rows(part.batch, local)
            subs.append((part, local, sub))
    norm = AggNorm.of(*[sub.loss_mask for _, _, sub in subs], horizon=s.horizon)
    _share_roles([sub for _, _, sub in subs], s)
    loss, sums, hit, reached = 0.0, Sums(), set(), set()
    for part, local, sub in subs:
        live = sub.loss_mask.sum(-1) > 0  # (b,)
        used = sub.routes[live][sub.attention_mask[live] > 0].unique().tolist()
        hit |= {part.adapters[a] for a in used if a >= 0}  # over every rank's rows: the same on each
        idle = part.idle(local)
        if idle:  # inert rows: zero loss parts, their tokens and (zero) advantages; no entropy
            rest = select_rows(sub, idle)
            zeros = torch.zeros_like(rest.advantages[:, :-1])
            split = split_metrics(zeros, None, rest.advantages[:, :-1], rest, norm, s.algorithm.loss_agg)
            sums.add(float(rest.loss_mask.sum()), {"loss/pg": 0.0, **split})
            if s.isolation == "route":
                at = rest.routes[rest.attention_mask > 0]
            else:
                at = rest.routes[:, :-1][rest.loss_mask[:, :-1] > 0]
            reached |= {part.adapters[a] for a in at.unique().tolist() if a >= 0}
        mine = part.mine(local)
        if not mine:
            continue
        if len(mine) < len(local):  # data parallelism: this rank's rows, weighted and normalised as above
            sub, local = select_rows(sub, mine), [local[j] for j in mine]
        width = sub.input_ids.shape[1]
        ps = dataclasses.replace(s, adapter_params=part.adapter_params)
        part_loss, part_sums, logp = accumulate_gradients(
            part.model, sub, part.aligned.rows(local, width), ps, micro_batch_size, tick, norm
        )
        part.aligned.keep(local, logp, sub.old_logp)
        loss += part_loss
        sums.merge(part_sums)
        if measure:
            sums.add(0.0, _mismatch(logp, sub.old_logp, sub.loss_mask, s.algorithm.tis_cap, sub))
    for name, share in _role_shares(subs, s).items():
        sums.add(0.0, {f"role/{name}/loss_share": Mean(share, 1.0)})
    return loss, sums, hit, reached


def _share_roles(subs: Sequence[TrainBatch], s: LossSettings) -> None:
    """Scale each row's weight by its role's share factor (`algorithm.role_share`) and loss weight,
    counted over the whole mini-batch (every part)."""
    share = s.algorithm.role_share
    if share == "aggregate" and not s.loss_weight:
        return
    lengths = torch.cat([sub.loss_mask.sum(-1).cpu() for sub in subs])  # (B,)
    role_ids = torch.cat([sub.role_index[:, 0].cpu() for sub in subs])  # (B,)
    names = subs[0].role_names
    factor = role_share_weights(lengths, role_ids, names, s.algorithm.loss_agg, share)  # (B,) float64
    factor *= torch.tensor([s.loss_weight.get(names[r], 1.0) for r in role_ids.tolist()], dtype=torch.float64)
    start = 0
    for sub in subs:
        n = sub.input_ids.shape[0]
        sub.weights = sub.weights * factor[start : start + n].to(sub.weights)
        start += n


def _role_shares(subs, s: LossSettings) -> dict[str, float]:
    """Each role's realised share of the mini-batch loss's weight (`loss_shares`)."""
    batches = [sub for _, _, sub in subs]
    lengths = torch.cat([b.loss_mask.sum(-1).cpu() for b in batches])
    role_ids = torch.cat([b.role_index[:, 0].cpu() for b in batches])
    weights = torch.cat([b.weights.cpu() for b in batches])
    names = batches[0].role_names
    return {names[r]: v for r, v in loss_shares(lengths, role_ids, weights, s.algorithm.loss_agg).items()}


def _mismatch(
    trainer: Tensor, rollout: Tensor, mask: Tensor, cap: float | None, batch: TrainBatch | None = None
) -> dict[str, float | Mean]:
    """The rollout/trainer log-prob mismatch of one batch, as `Sums` entries (means over its loss tokens);
    with `batch` (the rows of these tensors) also the mean |delta| per role and per kind of token, where a
    backend's approximation shows (vLLM's one adapter per segment under a token-routed topology)."""
    stats = logp_mismatch(trainer, rollout, mask, cap=cap if cap is not None else 2.0)
    n = float(mask.bool().sum())
    out: dict[str, float | Mean] = {
        k: v if k.endswith("/max_abs") else Mean(v, n) for k, v in stats.metrics().items()
    }
    if cap is None:  # TIS off: its statistics describe nothing that was applied
        out = {k: v for k, v in out.items() if not k.startswith("logp_mismatch/tis")}
    if batch is None:
        return out
    live = mask.bool()
    delta = torch.where(live, (trainer.float() - rollout.float()).abs(), 0.0)  # (B, T); NaN outside the mask
    kinds = torch.full_like(batch.kind_ids, -1)
    kinds[:, :-1] = batch.kind_ids[:, 1:]  # column p is about token p + 1
    groups = {f"role/{name}": batch.role_index[:, :1] == r for r, name in enumerate(batch.role_names)}
    groups |= {f"kind/{k}": kinds == KIND_INDEX[k] for k in KINDS if k in POLICY_KINDS}
    for name, where in groups.items():
        where = where & live
        count = float(where.sum())
        if count:
            out[f"logp_mismatch/{name}/mean_abs"] = Mean(float(delta[where].sum()) / count, count)
    return out
