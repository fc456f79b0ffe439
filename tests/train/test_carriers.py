"""A row that another row continues runs inside it (`rolerl.train.prefix.carriers`): a reasoner's calls in
one conversation, each prompt the call before it plus its completion and a tool result. Which rows are
carried (by hand, and where routes or ids differ), then the update through carriers against the plain
one on the tiny model: log-probs, loss and every adapter's gradient in each aggregation mode with each
call's own advantage and weight, PPO's epochs and mini-batches, and the positions the forward saves."""

from __future__ import annotations

import copy

import pytest
import torch

import rolerl
from rolerl.config import AlgorithmConfig
from rolerl.roles import ANSWER, KINDS, PROMPT, REASONING, TOOL_CALL, TOOL_OUTPUT, shift
from rolerl.train.optim import model_optimizer
from rolerl.train.policy import token_logprobs
from rolerl.train.prefix import carriers
from rolerl.train.update import (
    Aligned,
    LossSettings,
    Part,
    Schedule,
    accumulate_gradients,
    by_length,
    ppo_update,
)
from rolerl.types import Turn, collate
from tests.models.test_lora import randomize_adapters
from tests.tolerance import assert_close_ulps

R, C, X, A = REASONING, TOOL_CALL, TOOL_OUTPUT, ANSWER
AGG_MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
ISOLATED = {"reasoner": {k: 0 for k in KINDS}, "coder": {k: 1 for k in KINDS}}  # one adapter per role
DART = {"reasoner": {PROMPT: 0, R: 0, C: 1, X: 0, A: 0}, "coder": {k: 1 for k in KINDS}}


def conversation(g, route_of, calls=3, first=12, offset=0):
    """One reasoner conversation as its calls' turns, the way a rollout records them: each call's prompt is
    the one before it, its completion, then a tool result message (new prompt tokens)."""
    pattern = [R, R, C, C, C, R, A, A]
    prompt, turns = torch.randint(3, 4000, (first,), generator=g).tolist(), []
    for i in range(calls):
        kinds = pattern[: 4 + (i + offset) % 5]  # completions of 4 to 8 tokens
        completion = torch.randint(3, 4000, (len(kinds),), generator=g).tolist()
        routes = shift([PROMPT] * len(prompt) + kinds, route_of["reasoner"])
        turns.append(Turn("reasoner", prompt, completion, kinds, routes, [-1.0] * len(kinds)))
        prompt = prompt + completion + torch.randint(3, 4000, (3,), generator=g).tolist()
    return turns


def step_turns(route_of, seed=0):
    """Two conversations of 3 and 4 calls and two coder calls: 9 rows, whose forward runs 4 (each
    conversation inside its last call, the coder calls alone)."""
    g = torch.Generator().manual_seed(seed)
    turns = conversation(g, route_of, 3) + conversation(g, route_of, 4, first=9, offset=2)
    for n in (5, 7):
        kinds = [C] * n + [A]
        prompt = torch.randint(3, 4000, (10,), generator=g).tolist()
        ids = torch.randint(3, 4000, (len(kinds),), generator=g).tolist()
        turns.append(Turn("coder", prompt, ids, kinds, shift([PROMPT] * 10 + kinds, route_of["coder"]),
                          [-1.0] * len(kinds)))  # fmt: skip
    return turns


def batch_of(turns, route_of, model, seed=0):
    """Per-token advantages of both signs (each call its own), per-call weights, old log-probs = the
    model's own plus noise (some ratios clip)."""
    g = torch.Generator().manual_seed(seed)
    adv = [(torch.randn(len(t.completion_ids), generator=g) * 1.5).tolist() for t in turns]
    weights = (torch.rand(len(turns), generator=g) + 0.25).tolist()
    batch = collate(turns, adv, route_of, weights=weights, role_names=["coder", "reasoner"], pad_id=2)
    with torch.no_grad():
        logp = token_logprobs(model, batch, temperature=0.8, share_prefix=False).logp
    noise = torch.randn(logp.shape, generator=g) * 0.3
    batch.old_logp[:, :-1] = torch.where(batch.loss_mask[:, :-1].bool(), logp + noise, 0.0)
    return batch


def two_adapter_model(tokenizer, dtype):
    model, _ = rolerl.tiny_model("llama", seed=0, tokenizer=tokenizer, dtype=dtype)
    rolerl.add_adapters(model, ["reasoner", "coder"], rank=4)
    randomize_adapters(model, seed=1, std=0.1)
    return model


def settings(share: bool, **alg) -> LossSettings:
    return LossSettings(
        algorithm=AlgorithmConfig(**alg), temperature=0.8, horizon=16, chunk_size=7, share_prefix=share
    )


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_which_rows_are_carried():
    turns = step_turns(ISOLATED)
    batch = collate(turns, [0.0] * len(turns), ISOLATED, pad_id=2)
    # each conversation's calls run inside its last; the coder calls (another prompt) alone
    assert carriers(batch) == [2, 2, 2, 6, 6, 6, 6, 7, 8]
    assert carriers(batch, [0, 1, 7]) == [1, 1, 7]  # among the rows asked for only
    # rows alike: one carries the other
    twin = collate([*turns[:3], turns[2]], [0.0] * 4, ISOLATED, pad_id=2)
    assert carriers(twin) in ([3, 3, 3, 3], [2, 2, 2, 2])
    # a row continues another only where it has the other's ids and routes, but for the other's last route
    moved = collate(turns[:3], [0.0] * 3, ISOLATED, pad_id=2)
    n0 = int(moved.attention_mask[0].sum())
    moved.routes[2, n0 - 1] = 1  # row 2 routed otherwise at row 0's last position: it still carries row 0,
    assert carriers(moved) == [1, 1, 2]  # (as row 1 does) but no longer row 1, whose position that is not
    moved.routes[1, n0 - 2] = 1  # row 1 at the position that predicts row 0's last token: row 2 carries 0
    assert carriers(moved) == [2, 1, 2]
    moved.input_ids[2, n0 - 1] += 1  # and row 2 no longer has row 0's last token: every row alone
    assert carriers(moved) == [0, 1, 2]
    # DART routes a tool call to its own adapter while it is sampled and to the reasoning adapter once it
    # is a later call's prompt: nothing is carried (the later call's forward is not the earlier one's)
    dart = step_turns(DART)
    assert carriers(collate(dart, [0.0] * len(dart), DART, pad_id=2)) == list(range(len(dart)))


def test_micro_batches_keep_a_carrier_with_its_rows():
    batch = collate(step_turns(ISOLATED), [0.0] * 9, ISOLATED, pad_id=2)
    assert batch.attention_mask.sum(-1).tolist() == [16, 24, 33, 15, 25, 36, 43, 16, 18]
    # 4 forward rows (carriers 7, 8, 2, 6: 16, 18, 33, 43 positions), 2 a micro-batch, shortest first, each
    # carrier's rows with it; without carrying, 2 rows of the 9 a micro-batch
    assert by_length(batch, range(9), 2, carry=True) == [[7, 8], [0, 1, 2, 3, 4, 5, 6]]
    assert by_length(batch, range(9), 2) == [[3, 0], [7, 8], [1, 4], [2, 5], [6]]
    assert by_length(batch, [1, 2, 8], 1, carry=True) == [[8], [1, 2]]


@pytest.mark.parametrize(
    ("dtype", "mode"), [(torch.float64, m) for m in AGG_MODES] + [(torch.float32, "seq-mean-token-mean")]
)
def test_the_update_through_carriers_is_the_update_of_each_call(tokenizer, dtype, mode):
    """Each call keeps its own advantages, weight and (seq-mean-token-mean) its own token mean: log-probs, loss, gradients and the per-role metrics are the plain forward's, while the forward
    runs 4 rows of the 9 (110 of their 226 positions)."""
    model = two_adapter_model(tokenizer, dtype)
    batch = batch_of(step_turns(ISOLATED), ISOLATED, model)
    s = dict(loss_agg=mode, beta=0.1, entropy_coef=0.01, clip_c=3.0)
    shapes = []
    hook = model.get_decoder().register_forward_pre_hook(
        lambda _m, _a, kw: shapes.append(tuple(kw["input_ids"].shape)), with_kwargs=True
    )
    loss, sums, logp = accumulate_gradients(model, batch, Aligned(batch.old_logp), settings(True, **s), 2)
    got = grads(model)
    # policy and reference forward of each micro-batch: coder calls 7, 8 (16, 18 positions), then the
    # conversations' last calls 2, 6 (33, 43), which carry calls 0, 1 and 3, 4, 5
    assert shapes == [(2, 18), (2, 18), (2, 43), (2, 43)]
    model.zero_grad(set_to_none=True)
    shapes.clear()
    want_loss, want_sums, want_logp = accumulate_gradients(
        model, batch, Aligned(batch.old_logp), settings(False, **s), 9
    )
    hook.remove()
    assert shapes == [(9, 43), (9, 43)]
    want = grads(model)
    mask = batch.loss_mask[:, :-1].bool()
    ulps = 64 if dtype == torch.float64 else 256  # sums of the same products in another order and shape
    assert_close_ulps(logp[:, :-1][mask], want_logp[:, :-1][mask], ulps)
    assert loss == pytest.approx(want_loss, rel=1e-10 if dtype == torch.float64 else 1e-5)
    assert set(got) == set(want) and {n.split(".")[-1] for n in got} == {"reasoner", "coder"}
    for name, g in want.items():  # fp32 adapter parameters: fp32 rounding in their gradients
        torch.testing.assert_close(got[name], g, rtol=1e-5, atol=1e-5 * float(g.abs().max()), msg=name)
    got_m, want_m = sums.result(), want_sums.result()
    assert got_m.keys() == want_m.keys()
    for key in ("role/reasoner/loss", "role/coder/loss", "kind/tool_call/loss_tokens", "entropy", "kl"):
        assert got_m[key] == pytest.approx(want_m[key], rel=1e-4, abs=1e-6), key


def test_ppo_epochs_and_mini_batches_through_carriers(tokenizer):
    """Two epochs of two mini-batches with recomputed old log-probs (half the rows recomputed, the rest
    from their first training forward) and equal role shares: the same losses and gradient norms as the plain update, the
    adapters where it takes them, and a progress count of the micro-batches that ran."""
    base = two_adapter_model(tokenizer, torch.float64)
    batch = batch_of(step_turns(ISOLATED), ISOLATED, base)
    runs = []
    for share in (True, False):
        model, seen = copy.deepcopy(base), []
        metrics = ppo_update(
            [Part.of(model, batch)], model_optimizer(model),
            settings(share, old_logp="recompute", loss_agg="seq-mean-token-mean", role_share="equal"),
            Schedule(ppo_epochs=2, mini_batches=2), micro_batch_size=2,
            generator=torch.Generator().manual_seed(0), progress=lambda done, total, seen=seen: seen.append((done, total)),
        )  # fmt: skip
        params = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        runs.append((metrics, params, seen))
    (got, ends, ticks), (want, plain_ends, plain_ticks) = runs
    assert got["optimizer_steps"] == want["optimizer_steps"] == 4.0
    keys = ("loss/total", "grad_norm", "pg/ratio_mean", "logp_mismatch/mean_abs", "role/coder/loss_share")
    for key in keys:
        assert got[key] == pytest.approx(want[key], rel=1e-6), key  # old log-probs are kept in fp32
    start = dict(base.named_parameters())
    for name, p in plain_ends.items():  # AdamW steps of ~lr: within 1e-4 of how far they moved
        moved = float((p - start[name].detach()).abs().max())
        assert moved > 0 and float((ends[name] - p).abs().max()) <= 1e-4 * moved, name
    for seen in (ticks, plain_ticks):  # one tick a micro-batch, numbered in order, the total counted ahead
        assert seen == [(done, len(seen)) for done in range(1, len(seen) + 1)]
    assert len(ticks) == 7 and len(plain_ticks) == 12  # fewer forward rows: fewer micro-batches
