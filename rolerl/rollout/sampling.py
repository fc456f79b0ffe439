"""Sampling for the rollout engine: counter-based per-row RNG and inverse-CDF draws.

Each row owns a seed and a step counter; its uniform for a step is a hash of (seed, counter), so a
request's tokens do not depend on what else is in the batch or on torch's global RNG. One uniform per
row per step and an inverse-CDF lookup replace `torch.multinomial`, which spends ~22% of HF's decode
on this machine (PERFORMANCE_NOTES). Log-probs are the untruncated `log_softmax(logits / T)` of the
sampled token, as DESIGN requires of every stage.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

_M1 = 0xBF58476D1CE4E5B9 - (1 << 64)  # splitmix64 multipliers as signed int64 (torch has no uint64 mul)
_M2 = 0x94D049BB133111EB - (1 << 64)
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)


@dataclass
class SamplingParams:
    """How one request samples. `temperature=0` or `greedy=True` means argmax."""

    temperature: float = 1.0
    top_p: float = 1.0  # nucleus; 1 = off
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 256  # sampled tokens (forced tool output does not count)
    stop: tuple[str, ...] = ()  # stop strings, matched on the completion's bytes
    seed: int = 0
    greedy: bool = False
    ignore_eos: bool = False  # benchmarks generate fixed lengths
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)  # extra EOS-like ids

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0; got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1]; got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off); got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1; got {self.max_new_tokens}")
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        if self.temperature == 0:
            self.greedy = True

    @property
    def scale(self) -> float:
        """The temperature log-probs are computed at (1 for greedy, as HF reports greedy scores)."""
        return 1.0 if self.greedy else self.temperature


def _lshr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic on negatives)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def counter_uniform(seed: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """splitmix64(seed * golden + counter) -> uniform float64 in [0, 1), elementwise. `(B,)` -> `(B,)`."""
    z = seed.long() * _GOLDEN + counter.long()
    z = (z ^ _lshr(z, 30)) * _M1
    z = (z ^ _lshr(z, 27)) * _M2
    z = z ^ _lshr(z, 31)
    return _lshr(z, 11).double() * (1.0 / (1 << 53))


def sample(
    logits: torch.Tensor,  # (B, V)
    params: list[SamplingParams],
    seeds: torch.Tensor,  # (B,) long
    counters: torch.Tensor,  # (B,) long
    scratch: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return `(tokens (B,), logprobs (B,))`; each row is computed from its own logits and uniform only.

    Few passes over the `(B, V)` logits, each one a read of 6 MB at batch 32 x 49k vocabulary (a decode
    step's sampling is bound by them): the row max, `exp(z - max)` into one fp32 tensor, and its per-block
    sums, from which come the log-sum-exp and the draw (the CDF needs no normalising). bf16 logits are read
    as they are: the max is exact in bf16 and `z - max` promotes to fp32.

    `scratch`: fp32 (fp64 for fp64 logits), at least `B * scratch_size(V)` elements, holds those terms
    (the engine's `Sampler` keeps one across steps: on a VM a fresh 6 MB tensor per step costs more in page
    faults than its arithmetic); none = a new one. The results do not depend on it, bit for bit.

    One uniform per row: unfiltered rows walk the CDF in vocabulary order, rows with top-k / top-p in
    descending-probability order. A row's order depends on its own parameters only, never on its batch
    neighbours', so the same request draws the same token alone or in any batch."""
    b, vocab = logits.shape
    width = scratch_size(vocab)
    nb = width // _BLOCK
    work = working_dtype(logits.dtype)
    if scratch is None:
        scratch = torch.empty(b * width, dtype=work, device=logits.device)
    elif scratch.dtype != work or scratch.device != logits.device or scratch.numel() < b * width:
        raise ValueError(
            f"scratch must be {work} on {logits.device} with at least {b * width} elements; got "
            f"{scratch.dtype} on {scratch.device} with {scratch.numel()}"
        )
    e = scratch[: b * width].view(b, width)
    e[:, vocab:] = 0  # the last block's padding: zero mass, never drawn
    terms = e[:, :vocab]
    scales = [p.scale for p in params]
    if all(t == 1.0 for t in scales):
        z = logits  # (B, V), bf16 stays bf16: its max is exact
        top = z.amax(-1, keepdim=True).to(work)  # (B, 1)
        terms.copy_(z).sub_(top)  # the same as torch.sub(z, top), which widens z into a temporary first
    else:
        temperature = torch.tensor(scales, dtype=work, device=logits.device)[:, None]
        z = torch.div(logits, temperature, out=terms)  # logits / T, in fp32 (fp64 logits: fp64)
        top = z.amax(-1, keepdim=True)
        terms.sub_(top)
    terms.exp_()  # the largest term of each row is 1
    sums = e.view(b, nb, _BLOCK).sum(-1)  # (B, nb)
    lse = top.squeeze(1) + sums.sum(-1).log()  # (B,): logp = z - lse, the untruncated log_softmax
    tokens = torch.empty(b, dtype=torch.long, device=logits.device)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if greedy:
        tokens[greedy] = logits[greedy].argmax(-1)
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if sampled:
        u = counter_uniform(seeds, counters).to(logits.device)  # (B,); greedy rows ignore theirs
        plain = [i for i in sampled if params[i].top_k == 0 and params[i].top_p >= 1]
        if plain:
            rows = plain if len(plain) < b else slice(None)  # no (B, V) copy in the usual case
            tokens[plain] = _blocked_inverse_cdf(e[rows], sums[rows], u[plain])
        filtered = [i for i in sampled if not (params[i].top_k == 0 and params[i].top_p >= 1)]
        if filtered:
            logp = _scaled(logits[filtered], scales, filtered) - lse[filtered, None]
            tokens[filtered] = _filtered(logp, [params[i] for i in filtered], u[filtered])
    # z at the drawn tokens, from the logits (`e` now holds exp(z - max)): the same division, bit for bit
    return tokens, _scaled(logits.gather(1, tokens[:, None]), scales).squeeze(1) - lse


def scratch_size(vocab: int) -> int:
    """The scratch elements `sample` needs per row of a `vocab`-wide batch (the vocabulary, padded to blocks)."""
    return -(-vocab // _BLOCK) * _BLOCK


def working_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype `sample` computes in for logits of `dtype`: fp32, or fp64 for fp64 logits."""
    return torch.promote_types(dtype, torch.float32)


def _scaled(z: torch.Tensor, scales: list[float], rows: list[int] | None = None) -> torch.Tensor:
    """`z / T` row by row in the working dtype, as `sample` computed it for the whole batch (the same IEEE
    division)."""
    if rows is not None:
        scales = [scales[i] for i in rows]
    work = working_dtype(z.dtype)
    if all(t == 1.0 for t in scales):
        return z.to(work)
    return z.to(work) / torch.tensor(scales, dtype=work, device=z.device)[:, None]


class Sampler:
    """`sample` with its scratch kept from one call to the next (the engine's default sampler): a decode
    step reuses the last step's buffer instead of faulting in a fresh one. `release()` frees it (the engine
    does between rollouts)."""

    def __init__(self) -> None:
        self.scratch: torch.Tensor | None = None

    def __call__(
        self, logits: torch.Tensor, params: list[SamplingParams], seeds: torch.Tensor, counters: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        need, work = logits.shape[0] * scratch_size(logits.shape[1]), working_dtype(logits.dtype)
        old = self.scratch
        if old is None or old.numel() < need or old.device != logits.device or old.dtype != work:
            self.scratch = old = None  # the old one freed before the new one is taken
            self.scratch = torch.empty(need, dtype=work, device=logits.device)
        return sample(logits, params, seeds, counters, self.scratch)

    def release(self) -> None:
        self.scratch = None


_BLOCK = 128


def _blocked_inverse_cdf(mass: torch.Tensor, sums: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Draw from each row of `mass` `(b, nb * block)` (unnormalised, non-negative; `sums` `(b, nb)` its
    block sums) in vocabulary order, without a full-vocabulary cumsum (sequential per row, it was ~5% of a
    decode step): cumulate the block sums, find the block, then cumulate inside that block only. Searches
    use right=True, so a zero-mass token (a flat CDF step) is never drawn."""
    b, nb = sums.shape
    blocks = mass.view(b, nb, -1)
    block = blocks.shape[-1]
    csum = sums.cumsum(-1)  # (b, nb)
    target = (u * csum[:, -1].double()).float()[:, None]  # (b, 1)
    bi = torch.searchsorted(csum, target, right=True).squeeze(1)  # (b,)
    # a target rounded up to the total lands past the end: the last block with mass instead
    bi = torch.minimum(bi, nb - 1 - (sums > 0).flip(-1).int().argmax(-1))
    r = torch.arange(b, device=mass.device)
    before = torch.where(bi > 0, csum[r, (bi - 1).clamp(min=0)], torch.zeros((), device=mass.device))
    inner = blocks[r, bi]  # (b, block)
    j = torch.searchsorted(before[:, None] + inner.cumsum(-1), target, right=True).squeeze(1)
    last = block - 1 - (inner > 0).flip(-1).int().argmax(-1)  # the block's last token with mass (rounding)
    return bi * block + torch.minimum(j, last)


def _filtered(logp: torch.Tensor, params: list[SamplingParams], u: torch.Tensor) -> torch.Tensor:
    vocab = logp.shape[-1]
    k = max(p.top_k if p.top_k > 0 else vocab for p in params)
    values, index = logp.topk(min(k, vocab), dim=-1)  # (B, k), sorted descending
    probs = values.exp()
    keep = torch.ones_like(probs, dtype=torch.bool)
    for row, p in enumerate(params):
        if p.top_k > 0:
            keep[row, p.top_k :] = False
        if p.top_p < 1:
            # the smallest prefix whose mass reaches top_p (HF's rule: drop tokens after the mass is reached)
            before = probs[row].cumsum(0) - probs[row]
            keep[row] &= before < p.top_p * probs[row].sum()
    probs = torch.where(keep, probs, torch.zeros((), dtype=probs.dtype))
    cdf = probs.cumsum(-1)
    target = (u * cdf[:, -1].double()).float()[:, None]
    pick = torch.searchsorted(cdf, target, right=True).clamp_(max=probs.shape[1] - 1)
    return index.gather(1, pick).squeeze(1)
