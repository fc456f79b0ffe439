"""Sampling: the counter-based inverse CDF draws from the right distribution, per row, batch-invariantly."""

from __future__ import annotations

import pytest
import torch

from rolerl.rollout.sampling import (
    _BLOCK,
    Sampler,
    SamplingParams,
    _blocked_inverse_cdf,
    counter_uniform,
    sample,
    scratch_size,
    working_dtype,
)
from tests.tolerance import assert_close_ulps


def draws(logits: torch.Tensor, n: int, seed: int = 1, **params) -> tuple[torch.Tensor, torch.Tensor]:
    rows = logits.expand(n, -1).contiguous()
    return sample(rows, [SamplingParams(seed=seed, **params)] * n, torch.full((n,), seed), torch.arange(n))


def test_uniforms_are_uniform_and_depend_only_on_seed_and_counter():
    u = counter_uniform(torch.full((100_000,), 7), torch.arange(100_000))
    assert float(u.min()) >= 0 and float(u.max()) < 1
    hist = torch.histc(u.float(), bins=10, min=0, max=1) / 1e5
    assert (hist - 0.1).abs().max() < 0.005  # binomial sd ~ 0.001
    again = counter_uniform(torch.tensor([7, 8, 7]), torch.tensor([5, 5, 5]))
    assert again[0] == again[2] == u[5] and again[1] != again[0]


def test_frequencies_match_softmax_with_vocab_not_a_multiple_of_the_block():
    torch.manual_seed(0)
    logits = torch.randn(1, 300) * 2  # 300 = 2 blocks of 128 + a padded one
    tokens, logp = draws(logits, 20_000)
    p = torch.softmax(logits, -1)[0]
    freq = torch.bincount(tokens, minlength=300).float() / 20_000
    # per-token error within 5 binomial standard deviations
    assert ((freq - p).abs() <= 5 * (p * (1 - p) / 20_000).sqrt() + 1e-4).all()
    # The sampler's log-softmax is its own (blocked) computation: ~1 ulp of the largest log-prob apart;
    # an absolute 1e-6 was 1 ulp at |logp| ~ 10 and passed by 5% on this CPU.
    assert_close_ulps(logp, torch.log_softmax(logits, -1)[0, tokens], ulps=8)


def test_zero_probability_tokens_are_never_drawn_and_temperature_applies():
    torch.manual_seed(1)
    logits = torch.randn(1, 1000)
    logits[0, ::2] = -float("inf")
    tokens, _ = draws(logits, 5000, seed=2)
    assert bool((tokens % 2 == 1).all())
    tokens, logp = draws(logits, 10, temperature=0.5)
    torch.testing.assert_close(logp, torch.log_softmax(logits / 0.5, -1)[0, tokens])


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    tokens, _ = draws(logits, 2000, top_k=2)
    assert set(tokens.tolist()) == {0, 1}
    tokens, logp = draws(logits, 2000, top_p=0.7)  # 0.5 + 0.3 reaches 0.7: tokens 0 and 1
    assert set(tokens.tolist()) == {0, 1}
    torch.testing.assert_close(logp, logits[0, tokens], atol=1e-6, rtol=0)  # log-probs stay untruncated


def test_a_row_draws_the_same_token_alone_and_in_any_batch():
    torch.manual_seed(2)
    logits = torch.randn(6, 500)
    params = [SamplingParams(seed=i, top_k=[0, 20][i % 2]) for i in range(6)]
    seeds, counters = torch.arange(6), torch.full((6,), 3)
    batch, _ = sample(logits, params, seeds, counters)
    for i in range(6):
        alone, _ = sample(logits[i : i + 1], [params[i]], seeds[i : i + 1], counters[i : i + 1])
        assert alone.item() == batch[i].item()


def test_bf16_logits_sample_what_their_fp32_values_sample():
    """The sampler reads bf16 logits as they are (the row max is exact in bf16, `z - max` promotes to fp32):
    the same tokens and the same log-probs, bit for bit, as the same values upcast first."""
    torch.manual_seed(3)
    logits = (torch.randn(12, 700) * 4).bfloat16()
    params = [
        SamplingParams(seed=i, temperature=[1.0, 0.7, 0.0][i % 3], top_k=[0, 0, 0, 50][i % 4])
        for i in range(12)
    ]
    seeds, counters = torch.arange(12), torch.full((12,), 5)
    tokens, logp = sample(logits, params, seeds, counters)
    want_tokens, want_logp = sample(logits.float(), params, seeds, counters)
    assert torch.equal(tokens, want_tokens)
    assert torch.equal(logp, want_logp)
    scale = torch.tensor([p.scale for p in params])[:, None]
    want = torch.log_softmax(logits.float() / scale, -1).gather(1, tokens[:, None])[:, 0]
    assert_close_ulps(logp, want, ulps=8)


def test_a_target_rounded_up_to_the_total_draws_the_last_token_with_mass():
    """u * total can round up to the total (u < 1 in float64, the product in fp32): the search then points
    past the last block, which here holds no mass (a padded vocabulary whose last real tokens are -inf);
    the draw is the last token that has mass, never a padding index or a zero-probability token."""
    mass = torch.zeros(1, 3 * _BLOCK)
    mass[0, : _BLOCK + 5] = torch.rand(_BLOCK + 5, generator=torch.Generator().manual_seed(0)) + 0.5
    sums = mass.view(1, 3, _BLOCK).sum(-1)
    token = _blocked_inverse_cdf(mass, sums, torch.tensor([1 - 2.0**-53], dtype=torch.float64))
    assert token.item() == _BLOCK + 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_a_kept_scratch_changes_no_bit_whatever_it_held(dtype):
    """The engine's `Sampler` keeps its scratch from one step to the next: a batch with a narrower
    vocabulary, fewer rows, or a buffer full of garbage (NaN, huge values; a previous batch's terms in the
    last block's padding) samples exactly what a fresh buffer samples, greedy, tempered, top-k and top-p rows
    alike."""
    torch.manual_seed(4)
    params = [
        SamplingParams(seed=i, temperature=[1.0, 0.7, 0.0, 1.3][i % 4], top_k=[0, 0, 0, 0, 40][i % 5],
                       top_p=[1.0, 1.0, 0.9][i % 3])
        for i in range(10)
    ]  # fmt: skip
    plain = [SamplingParams(seed=i) for i in range(10)]  # the common case: every row at T = 1, unfiltered
    sampler = Sampler()
    sampler(torch.randn(16, 4 * _BLOCK).to(dtype), [SamplingParams()] * 16, torch.arange(16), torch.zeros(16))
    sampler.scratch.fill_(1e30)  # every element a previous batch's term could have left
    garbage = torch.full((10 * scratch_size(300),), float("nan"), dtype=working_dtype(dtype))
    for vocab in (300, 2 * _BLOCK):  # the padded block's zeros are rewritten on every call
        for ps in (params, plain):
            logits = (torch.randn(10, vocab) * 3).to(dtype)
            seeds, counters = torch.arange(10), torch.full((10,), 9)
            want_tokens, want_logp = sample(logits, ps, seeds, counters)
            for got_tokens, got_logp in (sampler(logits, ps, seeds, counters),
                                         sample(logits, ps, seeds, counters, garbage)):  # fmt: skip
                assert torch.equal(got_tokens, want_tokens) and torch.equal(got_logp, want_logp)
            scale = torch.tensor([p.scale for p in ps], dtype=working_dtype(dtype))[:, None]
            want = torch.log_softmax(logits.to(working_dtype(dtype)) / scale, -1).gather(
                1, want_tokens[:, None]
            )[:, 0]
            assert_close_ulps(want_logp, want, ulps=8)  # and right, not only equal
    assert sampler.scratch.numel() == 16 * 4 * _BLOCK  # kept, not reallocated for a smaller batch
    sampler.release()
    assert sampler.scratch is None


def test_a_scratch_that_cannot_hold_the_terms_is_refused():
    logits = torch.randn(2, 300)
    args = (logits, [SamplingParams()] * 2, torch.arange(2), torch.zeros(2))
    for bad in (
        torch.empty(2 * scratch_size(300) - 1),
        torch.empty(2 * scratch_size(300), dtype=torch.float64),
    ):
        with pytest.raises(ValueError, match=f"torch.float32 on cpu with at least {2 * 384} elements"):
            sample(*args, bad)
