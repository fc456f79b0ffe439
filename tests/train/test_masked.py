"""The `masked` topology: one shared adapter that every token runs through, with loss only on the chosen
kinds (issue 13: the reasoning-only and tool-only variants of the interaction analysis)."""

from __future__ import annotations

import torch

from rolerl.algorithms import AggNorm
from rolerl.config import load_config
from rolerl.roles import KIND_INDEX, TOOL_CALL
from rolerl.run.policy import build_policy
from rolerl.train.sft import demonstration_turns, sft_loss
from rolerl.types import collate

TEXT = "Let me compute.<code>print(6 * 7)</code><output>\n42\n</output>\nSo <answer>42</answer>"
ROW = {"role": "policy", "messages": [{"role": "user", "content": "What is 6 * 7?"},
                                      {"role": "assistant", "content": TEXT}]}  # fmt: skip


def masked_batch(train_kinds: str | None):
    preset = ["adapters.preset=masked", f"adapters.train_kinds={train_kinds}"] if train_kinds else []
    cfg = load_config(None, ["model.spec=tiny:llama", "adapters.rank=2", "train.bf16=false", *preset])
    policy = build_policy(cfg, ["policy"])
    turns = demonstration_turns(policy.tokenizer, ROW, policy.route_of)
    loss_kinds = {"policy": policy.topology.loss_kinds("policy")}
    return policy, collate(turns, [1.0], policy.route_of, loss_kinds=loss_kinds)


def test_reasoning_only_leaves_no_loss_on_tool_calls_and_still_routes_them_through_the_adapter():
    policy, batch = masked_batch("[reasoning]")
    _, full = masked_batch(None)
    target = full.kind_ids[:, 1:]  # (B, T-1): the kind of the token each position predicts
    tool_call = (target == KIND_INDEX[TOOL_CALL]) & (full.loss_mask[:, :-1] > 0)
    reasoning = (target == KIND_INDEX["reasoning"]) & (full.loss_mask[:, :-1] > 0)
    assert bool(tool_call.any()) and bool(reasoning.any())
    assert float(batch.loss_mask[:, :-1][tool_call].abs().sum()) == 0.0  # no loss on tool-call tokens
    assert bool((batch.loss_mask[:, :-1][reasoning] == 1).all())  # reasoning keeps its loss
    assert float(batch.loss_mask[:, :-1][target == KIND_INDEX["answer"]].sum()) == 0.0
    assert torch.equal(batch.routes, full.routes) and bool((batch.routes[:, :-1][tool_call] == 0).all())
    assert policy.adapter_names == ["policy"]


def test_masked_loss_equals_the_full_loss_restricted_to_the_chosen_kinds():
    """The same model and tokens: the masked SFT loss is the token-mean NLL over reasoning tokens only (the
    full batch with the other kinds' mask zeroed computes the same ops, so the two are equal exactly)."""
    policy, batch = masked_batch("[reasoning]")
    _, full = masked_batch(None)
    torch.manual_seed(0)
    for p in policy.trainable():  # nonzero adapters, so the loss depends on them
        p.data.normal_(0, 0.1)
    target = full.kind_ids[:, 1:]
    restricted = full.loss_mask.clone()
    restricted[:, :-1] *= (target == KIND_INDEX["reasoning"]).float()
    full.loss_mask = restricted
    losses = []
    for b in (batch, full):
        loss = sft_loss(policy.model, b, AggNorm.of(b.loss_mask), chunk_size=64, bf16=False)
        losses.append(float(loss.detach()))
    assert losses[0] == losses[1] and losses[0] > 0


def test_preset_none_has_nothing_to_train():
    import pytest

    cfg = load_config(None, ["model.spec=tiny:llama", "adapters.preset=none"])
    policy = build_policy(cfg, ["policy"])
    assert policy.route_of["policy"] == dict.fromkeys(policy.route_of["policy"], -1)
    with pytest.raises(ValueError, match="preset='none' gives the model no trainable adapter"):
        policy.trainable()
