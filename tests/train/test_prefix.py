"""Shared-prompt forward == the plain forward: log-probs, entropies and every adapter's gradient, on each
tiny architecture, with groups of rows sharing prompts of different lengths, or different prompts sharing
their start, two routed adapters, ragged completions, and the reference (route -1); plus when sharing must
not happen."""

from __future__ import annotations

import math

import pytest
import torch

import rolerl
from rolerl.models.topology import Topology
from rolerl.roles import ANSWER, REASONING, TOOL_CALL, TOOL_OUTPUT, shift
from rolerl.train import prefix
from rolerl.train.policy import autocast, token_logprobs
from rolerl.types import Turn, collate
from tests.models.test_lora import randomize_adapters

R, C, X, A = REASONING, TOOL_CALL, TOOL_OUTPUT, ANSWER


def grouped_batch(route_of, groups=((5, 3), (9, 2), (2, 1)), seed=0, system=0):
    """Groups of `(prompt length, rows)`: rows of a group share the prompt, completions differ in length
    and kinds (tool output included), so prompts and completions are both ragged. `system`: every prompt
    starts with the same that-many tokens (in the prompt length)."""
    g = torch.Generator().manual_seed(seed)
    pattern = [R, R, C, C, X, X, X, R, A, A, R, R]
    turns = []
    start = torch.randint(3, 4000, (system,), generator=g).tolist()
    for p_len, rows in groups:
        prompt = start + torch.randint(3, 4000, (p_len - system,), generator=g).tolist()
        for i in range(rows):
            kinds = pattern[: 4 + 3 * i + p_len % 3]
            completion = torch.randint(3, 4000, (len(kinds),), generator=g).tolist()
            logprobs = [math.nan if k == X else -1.0 for k in kinds]
            routes = shift(["prompt"] * p_len + kinds, route_of)
            turns.append(Turn("policy", prompt, completion, kinds, routes, logprobs))
    adv = torch.randn(len(turns), generator=g).tolist()
    return collate(turns, adv, {"policy": route_of}, pad_id=2)


def routed_model(arch, tokenizer, dtype=torch.float32):
    model, _ = rolerl.tiny_model(arch, seed=0, tokenizer=tokenizer, dtype=dtype)
    rolerl.add_adapters(model, ["reason", "tool"], rank=4)
    randomize_adapters(model, seed=1, std=0.1)
    model.eval()
    route_of = Topology.from_preset("dart", ["policy"]).route_of("policy", {"reason": 0, "tool": 1})
    return model, route_of


def logprobs_and_grads(model, batch, share, routes=None):
    model.zero_grad(set_to_none=True)
    out = token_logprobs(model, batch, temperature=0.7, chunk_size=5, with_entropy=True, routes=routes,
                         share_prefix=share)  # fmt: skip
    up = torch.linspace(-1, 1, out.logp.numel()).view_as(out.logp).to(out.logp.dtype)
    ((out.logp * up).sum() - 0.3 * out.entropy.sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_shared_prefix_equals_plain_forward(arch, attn, tokenizer):
    model, route_of = routed_model(arch, tokenizer, dtype=torch.float64)
    model.config._attn_implementation = attn
    batch = grouped_batch(route_of)
    assert prefix._plan(model, batch) is not None  # 6 rows, 3 distinct prompts: it shares
    calls = []
    decoder = model.get_decoder()
    hook = decoder.register_forward_pre_hook(
        lambda _m, _a, kw: calls.append(kw["input_ids"].shape), with_kwargs=True
    )
    shared, g_shared = logprobs_and_grads(model, batch, share=True)
    own = int((batch.attention_mask.sum(-1) - batch.attention_mask.new_tensor([5, 5, 5, 9, 9, 2])).sum())
    # 3 prompts of <= 9 tokens once, then the 6 rows' own tokens: packed end to end under SDPA on the CPU
    # (44 positions), padded to the longest row (6 x 12) under eager attention
    assert calls == [(3, 9), (1, own) if attn == "sdpa" else (6, 12)] and own == 44
    hook.remove()
    plain, g_plain = logprobs_and_grads(model, batch, share=False)
    mask = batch.loss_mask[:, :-1].bool()
    atol = 1e-10 if attn == "sdpa" else 2e-5  # HF's eager attention takes its softmax in fp32
    torch.testing.assert_close(shared.logp, plain.logp, rtol=0, atol=atol)
    torch.testing.assert_close(shared.entropy[mask], plain.entropy[mask], rtol=0, atol=atol)
    assert torch.equal(shared.logp[~mask], torch.zeros_like(shared.logp[~mask]))
    assert set(g_shared) == set(g_plain) and any("tool" in n for n in g_shared)  # both adapters trained
    for name, g in g_plain.items():  # the adapters are fp32 parameters: their gradients carry fp32 rounding
        torch.testing.assert_close(g_shared[name], g, rtol=1e-5, atol=1e-5 * float(g.abs().max()), msg=name)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_different_prompts_share_their_common_start(arch, tokenizer):
    """Imitation data: every prompt differs, all start with the same system prompt. That start runs once;
    the values and gradients are the plain forward's."""
    model, route_of = routed_model(arch, tokenizer, dtype=torch.float64)
    batch = grouped_batch(route_of, groups=((14, 1), (11, 1), (16, 1), (12, 1)), system=10)
    calls = []
    hook = model.get_decoder().register_forward_pre_hook(
        lambda _m, _a, kw: calls.append(kw["input_ids"].shape), with_kwargs=True
    )
    shared, g_shared = logprobs_and_grads(model, batch, share=True)
    hook.remove()
    # the 10-token start once, then the 4 rows' own tokens packed (the plain forward: 4 rows of <= 21)
    assert calls == [(1, 10), (1, int(batch.attention_mask.sum()) - 4 * 10)]
    plain, g_plain = logprobs_and_grads(model, batch, share=False)
    torch.testing.assert_close(shared.logp, plain.logp, rtol=0, atol=1e-10)
    mask = batch.loss_mask[:, :-1].bool()
    torch.testing.assert_close(shared.entropy[mask], plain.entropy[mask], rtol=0, atol=1e-10)
    assert set(g_shared) == set(g_plain)
    for name, g in g_plain.items():
        torch.testing.assert_close(g_shared[name], g, rtol=1e-5, atol=1e-5 * float(g.abs().max()), msg=name)
    # whole-prompt groups where they save more positions: 4 + 2 rows sharing 14- and 11-token prompts save
    # 3 x 14 + 11 = 53, the common start 5 x 10 = 50 (with 3 + 2 rows: 39 against 40, the start wins)
    grouped = grouped_batch(route_of, groups=((14, 4), (11, 2)), system=10)
    prompt_len, group, firsts = prefix._plan(model, grouped)
    assert prompt_len.tolist() == [14] * 4 + [11] * 2 and firsts == [0, 4]
    assert prefix._plan(model, grouped_batch(route_of, groups=((14, 3), (11, 2)), system=10))[2] == [0]
    # a start routed differently on one row is not common past that position: that row (3 positions alike,
    # below prefix.MIN_COMMON) is a group of its own, the other three share their start; the prompt pass
    # runs 10 positions of each group (the lone row's other 6 go with its own tokens: no padding)
    batch.routes[2, 3] = 1 - int(batch.routes[2, 3])
    prompt_len, group, firsts = prefix._plan(model, batch)
    assert prompt_len.tolist() == [10, 10, 10, 10] and group.tolist() == [0, 0, 1, 0] and firsts == [0, 2]
    batch.routes[0, 5] = 1 - int(batch.routes[0, 5])  # rows 1 and 3 alike on 10 positions, row 0 on 5
    prompt_len, group, firsts = prefix._plan(model, batch)
    assert prompt_len.tolist() == [10, 10, 10, 10] and group.tolist() == [0, 1, 2, 1] and firsts == [0, 1, 2]
    shared, g_shared = logprobs_and_grads(model, batch, share=True)
    plain, g_plain = logprobs_and_grads(model, batch, share=False)
    torch.testing.assert_close(shared.logp, plain.logp, rtol=0, atol=1e-10)
    batch.routes[1, 7] = 1 - int(batch.routes[1, 7])  # and on 7
    assert prefix._plan(model, batch) is None  # every row alone: nothing to share


def test_calls_on_one_problem_share_the_problem(tokenizer):
    """MSARL's coder calls: one system prompt, then a problem, then a request that differs call by call.
    The calls on a problem run system prompt and problem once, a group per problem (sharing only the
    system prompt would save fewer positions); a row like no other keeps its whole prompt. Values and
    gradients are the plain forward's."""
    model, route_of = routed_model("llama", tokenizer, dtype=torch.float64)
    g = torch.Generator().manual_seed(3)
    system, a, b = (torch.randint(3, 4000, (n,), generator=g).tolist() for n in (10, 12, 9))
    prompts = {"a1": system + a + [5, 6, 7], "b1": system + b + [5, 9], "a2": system + a + [8, 6],
               "lone": [11, 12, 13, 14, 15], "b2": system + b + [6, 9, 9], "a3": system + a + [9]}  # fmt: skip
    turns = []
    for i, prompt in enumerate(prompts.values()):
        kinds = [R, R, C, C, X, A][: 3 + i % 4]
        routes = shift(["prompt"] * len(prompt) + kinds, route_of)
        completion = torch.randint(3, 4000, (len(kinds),), generator=g).tolist()
        turns.append(
            Turn("policy", prompt, completion, kinds, routes, [math.nan if k == X else -1.0 for k in kinds])
        )
    batch = collate(turns, [0.5, -1.0, 0.2, 1.0, -0.3, 0.7], {"policy": route_of}, pad_id=2)
    prompt_len, group, firsts = prefix._plan(model, batch)
    # (3 - 1) x 22 + (2 - 1) x 19 = 63 positions saved, against 4 x 10 = 40 for the system prompt alone
    assert prompt_len.tolist() == [22, 19, 22, 5, 19, 22] and group.tolist() == [0, 1, 0, 2, 1, 0]
    assert firsts == [0, 1, 3]
    shared, g_shared = logprobs_and_grads(model, batch, share=True)
    plain, g_plain = logprobs_and_grads(model, batch, share=False)
    mask = batch.loss_mask[:, :-1].bool()
    torch.testing.assert_close(shared.logp, plain.logp, rtol=0, atol=1e-10)
    torch.testing.assert_close(shared.entropy[mask], plain.entropy[mask], rtol=0, atol=1e-10)
    assert set(g_shared) == set(g_plain)
    for name, grad in g_plain.items():
        torch.testing.assert_close(
            g_shared[name], grad, rtol=1e-5, atol=1e-5 * float(grad.abs().max()), msg=name
        )


def test_packed_rows_take_a_row_without_tokens_of_its_own(tokenizer):
    """A row that is all prompt (no completion token) has no queries in the packed row pass; the others
    still equal the plain forward."""
    model, route_of = routed_model("llama", tokenizer, dtype=torch.float64)
    batch = grouped_batch(route_of)
    batch.attention_mask[2, 5:] = 0  # row 2 (prompt of 5 tokens) keeps only its prompt
    batch.loss_mask[2] = 0
    layout = prefix.PackedRows.of([3, 0, 4], [0, 0, 9], [5, 5, 9], 18, "cpu")
    assert layout.starts == [0, 3, 7] and layout.prompts == [(0, 5), (9, 9)]
    assert layout.masks[1].shape == (4, 13) and layout.masks[1][0].tolist() == [True] * 10 + [False] * 3
    with torch.no_grad():
        shared = token_logprobs(model, batch, temperature=1.0, share_prefix=True).logp
        plain = token_logprobs(model, batch, temperature=1.0, share_prefix=False).logp
    torch.testing.assert_close(shared, plain, rtol=0, atol=1e-10)


def test_rows_of_one_length_take_the_padded_pass(tokenizer):
    """Packing removes padding; rows whose own tokens are all as long have none, and keep one attention
    call per layer (the padded pass: `(rows, length)` ids)."""
    model, route_of = routed_model("llama", tokenizer, dtype=torch.float64)
    batch = grouped_batch(route_of, groups=((5, 1), (9, 1)))
    batch.attention_mask[0, 9:] = 0  # row 0: a 5-token prompt and 4 own tokens
    batch.loss_mask[0, 9:] = 0
    batch.input_ids[1] = batch.input_ids[0]  # row 1 alike but for its last token (rows alike would run
    batch.input_ids[1, 8] += 1  # once: `carriers`): one group of two rows of 4 own tokens
    batch.routes[1] = batch.routes[0]
    batch.kind_ids[1] = batch.kind_ids[0]
    batch.attention_mask[1] = batch.attention_mask[0]
    batch.loss_mask[1] = batch.loss_mask[0]
    calls = []
    hook = model.get_decoder().register_forward_pre_hook(
        lambda _m, _a, kw: calls.append(tuple(kw["input_ids"].shape)), with_kwargs=True
    )
    with torch.no_grad():
        shared = token_logprobs(model, batch, temperature=1.0, share_prefix=True).logp
    hook.remove()
    assert calls == [(1, 5), (2, 4)]
    with torch.no_grad():
        plain = token_logprobs(model, batch, temperature=1.0, share_prefix=False).logp
    torch.testing.assert_close(shared, plain, rtol=0, atol=1e-10)


def test_reference_route_and_bf16_autocast(tokenizer):
    """route -1 (the KL reference) through the shared path equals the plain one; under CPU bf16 autocast
    (eager attention, additive mask) the two paths agree within bf16 rounding."""
    model, route_of = routed_model("llama", tokenizer)
    batch = grouped_batch(route_of, seed=3)
    with torch.no_grad():
        ref_shared = token_logprobs(model, batch, temperature=1.0, routes=-1, share_prefix=True).logp
        ref_plain = token_logprobs(model, batch, temperature=1.0, routes=-1, share_prefix=False).logp
        torch.testing.assert_close(ref_shared, ref_plain, rtol=0, atol=2e-5)
        with autocast(torch.device("cpu"), True):
            bf_shared = token_logprobs(model, batch, temperature=1.0, share_prefix=True).logp
            bf_plain = token_logprobs(model, batch, temperature=1.0, share_prefix=False).logp
    torch.testing.assert_close(bf_shared, bf_plain, rtol=0, atol=0.1)
    assert float((bf_shared - bf_plain).abs().mean()) < 0.02


def test_packed_rows_under_bf16_autocast(tokenizer, monkeypatch):
    """Batches too large for eager attention keep SDPA under bf16 autocast, and rows of different lengths
    run packed (`packed_rows_attention`): there rope leaves q and k in fp32 while v is bf16, which the
    flash kernel refused ("expected scalar type Float but found BFloat16", a search agent's first update).
    The packed pass takes autocast's dtype as SDPA does; forward and backward agree with the plain path
    within bf16 rounding."""
    from rolerl.train import policy

    monkeypatch.setattr(policy, "EAGER_MAX_SCORES", 0)  # as a long batch: SDPA, not eager
    model, route_of = routed_model("llama", tokenizer)
    batch = grouped_batch(route_of, seed=3)
    with autocast(torch.device("cpu"), True):
        shared, g_shared = logprobs_and_grads(model, batch, share=True)
        plain, g_plain = logprobs_and_grads(model, batch, share=False)
    eps = torch.finfo(torch.bfloat16).eps  # log-probs of ~-30 differ by a few bf16 roundings of their size
    torch.testing.assert_close(shared.logp, plain.logp, rtol=4 * eps, atol=0.1)
    assert float((shared.logp - plain.logp).abs().mean()) < 0.02
    assert g_shared.keys() == g_plain.keys()
    assert {n.rsplit(".", 1)[-1] for n in g_shared} == {"reason", "tool"}
    for name, g in g_shared.items():  # bf16 rounding: the gradients point the same way
        cos = torch.nn.functional.cosine_similarity(g.flatten().float(), g_plain[name].flatten().float(), 0)
        assert float(cos) > 0.99, name


def test_no_sharing_when_it_cannot_help_or_cannot_be_masked(tokenizer):
    model, route_of = routed_model("llama", tokenizer)
    distinct = grouped_batch(route_of, groups=((4, 1), (6, 1), (5, 1)))
    assert prefix._plan(model, distinct) is None  # every prompt differs
    batch = grouped_batch(route_of)
    # same prompt ids but a different adapter on one row's prompt: that row must not share. Then sharing
    # saves 5 + 9 positions, and the prompt pass pads 4 + 4 + 7 (every group to the 9-token prompt): none
    batch.routes[1, 0] = 1
    assert prefix._plan(model, batch) is None
    batch = grouped_batch(route_of, groups=((5, 4), (9, 2), (2, 1)))
    batch.routes[1, 0] = 1  # with another row of the first prompt, 10 + 9 saved against 15 padded
    prompt_len, group, firsts = prefix._plan(model, batch)
    assert group.tolist() == [0, 1, 0, 0, 2, 2, 3] and firsts == [0, 1, 4, 6]
    assert prompt_len.tolist() == [5, 5, 5, 5, 9, 9, 2]
    model.config._attn_implementation = "flash_attention_2"  # takes no 4D mask
    assert prefix._plan(model, batch) is None


def test_the_decoder_fills_the_cache_passed_under_its_own_argument_name(tokenizer):
    """transformers 5.x renamed the decoder's cache argument (`past_key_values` -> `cache`); the other name
    vanishes into `**kwargs`, and the row pass then attends to nothing of its prompt (what the H200 check of
    2026-12-04 found under transformers 5.17). Whatever version is installed, the cache we pass is filled."""
    model, _ = rolerl.tiny_model("qwen3", seed=0, tokenizer=tokenizer)
    decoder = model.get_decoder()
    cache = prefix.DynamicCache()
    ids = torch.arange(3, 10)[None]  # (1, 7)
    decoder(input_ids=ids, use_cache=True, **prefix.cache_arg(decoder, cache))
    assert cache.get_seq_length() == 7


def test_cache_arg_follows_the_signature():
    class New(torch.nn.Module):
        def forward(self, input_ids=None, cache=None, **kwargs): ...

    class Old(torch.nn.Module):
        def forward(self, input_ids=None, past_key_values=None, **kwargs): ...

    assert list(prefix.cache_arg(New(), "c")) == ["cache"]
    assert list(prefix.cache_arg(Old(), "c")) == ["past_key_values"]
