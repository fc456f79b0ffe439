"""Turn validation, route checks, and `collate`'s alignment (column p is about token p + 1)."""

from __future__ import annotations

import math

import pytest
import torch

from rolerl.roles import ANSWER, KIND_INDEX, REASONING, TOOL_CALL, TOOL_OUTPUT, shift
from rolerl.types import Episode, Group, ToolCall, Turn, collate

R, C, X, A, P = REASONING, TOOL_CALL, TOOL_OUTPUT, ANSWER, "prompt"  # X: tool output (forced)
NAN = float("nan")
ROUTE_OF = {"coder": {P: 0, R: 0, C: 1, X: 0, A: 0}, "judge": {P: 2, R: 2, C: 2, X: 2, A: 2}}


def make_turn(role: str, prompt: list[int], completion: list[int], kinds: list[str], logprobs: list[float]):
    routes = shift([P] * len(prompt) + kinds, ROUTE_OF[role])
    return Turn(role, prompt, completion, kinds, routes, logprobs, "stop", [])


def test_turn_validates_lengths_kinds_and_finish_reason():
    with pytest.raises(ValueError, match="2 completion ids, 1 kinds"):
        Turn("coder", [1], [2, 3], [R], [0, 0, 0], [0.0, 0.0])
    with pytest.raises(ValueError, match="unknown kinds"):
        Turn("coder", [1], [2], ["code"], [0, 0], [0.0])
    with pytest.raises(ValueError, match="finish_reason"):
        Turn("coder", [1], [2], [R], [0, 0], [0.0], "done")  # type: ignore[arg-type]


def test_turn_properties_and_route_check():
    t = make_turn("coder", [5, 6], [7, 8, 9], [R, C, X], [-0.1, -0.2, NAN])
    assert t.ids == [5, 6, 7, 8, 9] and len(t) == 5
    assert t.all_kinds == [P, P, R, C, X]
    assert t.routes == [0, 0, 1, 0, 0]
    t.check_routes(ROUTE_OF["coder"])
    t.check_routes()  # consistent with some table
    with pytest.raises(ValueError, match="position 2"):
        t.check_routes({P: 0, R: 0, C: 0, X: 0, A: 0})
    # Positions 1 and 2 both predict a reasoning token but store different routes: no table gives that.
    bad = Turn("coder", [5, 6], [7, 8], [R, R], [0, 0, 1, 1], [-0.1, -0.2])
    with pytest.raises(ValueError, match="position 2.*predicting a 'reasoning' token"):
        bad.check_routes()


def test_collate_alignment_hand_example():
    # prompt [10, 11]; completion 20 (R), 21 (C), 22 (X, forced), 23 (A).
    # Positions:      0:10(P)  1:11(P)  2:20(R)  3:21(C)  4:22(X)  5:23(A)
    # Predicts:            11       20       21       22       23       -
    # loss_mask:            0        1        1        0        1        0
    t1 = make_turn("coder", [10, 11], [20, 21, 22, 23], [R, C, X, A], [-0.5, -0.25, NAN, -2.0])
    t2 = make_turn("judge", [30], [31, 32], [R, A], [-1.0, -3.0])
    batch = collate([t1, t2], [1.5, [0.5, -1.0]], ROUTE_OF, weights=[1.0, 0.5], pad_id=99)
    assert batch.input_ids.tolist() == [[10, 11, 20, 21, 22, 23], [30, 31, 32, 99, 99, 99]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]]
    assert batch.loss_mask.tolist() == [[0, 1, 1, 0, 1, 0], [1, 1, 0, 0, 0, 0]]
    assert batch.old_logp.tolist() == [[0, -0.5, -0.25, 0, -2.0, 0], [-1.0, -3.0, 0, 0, 0, 0]]
    assert batch.advantages.tolist() == [[0, 1.5, 1.5, 0, 1.5, 0], [0.5, -1.0, 0, 0, 0, 0]]
    # routes: the adapter of the predicted token (C -> 1 for the coder); pads -1.
    assert batch.routes.tolist() == [[0, 0, 1, 0, 0, 0], [2, 2, 2, -1, -1, -1]]
    k = KIND_INDEX
    assert batch.kind_ids.tolist() == [[k[P], k[P], k[R], k[C], k[X], k[A]], [k[P], k[R], k[A], -1, -1, -1]]
    assert batch.role_names == ["coder", "judge"] and batch.roles == ["coder", "judge"]
    assert batch.role_index.tolist() == [[0] * 6, [1, 1, 1, -1, -1, -1]]
    assert batch.weights.tolist() == [1.0, 0.5]
    assert not torch.isnan(batch.old_logp).any()  # the forced token's NaN never reaches the batch
    # The mask lines up with the trainer's shift: logp of input_ids[:, 1:] from hidden[:, :-1].
    targets = batch.input_ids[:, 1:][batch.loss_mask[:, :-1].bool()]
    assert targets.tolist() == [20, 21, 23, 31, 32]


def test_collate_rejects_wrong_routes_and_nan_sampled_logprobs():
    t = make_turn("coder", [1], [2, 3], [R, C], [-0.1, -0.1])
    with pytest.raises(ValueError, match="stores route"):
        collate([t], [1.0], {"coder": {P: 0, R: 0, C: 0, X: 0, A: 0}})
    nan_turn = make_turn("coder", [1], [2], [R], [NAN])
    with pytest.raises(ValueError, match="NaN log-prob"):
        collate([nan_turn], [1.0], ROUTE_OF)
    with pytest.raises(ValueError, match="not in role_names"):
        collate([t], [1.0], ROUTE_OF, role_names=["judge"])
    with pytest.raises(ValueError, match="3 advantages for 2 completion tokens"):
        collate([t], [[1.0, 2.0, 3.0]], ROUTE_OF)


def test_collate_empty_prompt_first_token_has_no_loss():
    t = make_turn("coder", [], [2, 3], [R, R], [-0.1, -0.2])
    batch = collate([t], [1.0])
    assert batch.loss_mask.tolist() == [[1, 0]] and batch.old_logp.tolist()[0][0] == pytest.approx(-0.2)


def test_records_compose():
    call = ToolCall("python", "print(1)", "1", start=3, end=9)
    t = make_turn("coder", [1], [2], [R], [-0.1])
    t.tool_calls.append(call)
    ep = Episode("gsm8k/0", [t], reward=1.0, role_rewards={"coder": 1.0})
    g = Group("gsm8k/0", [ep])
    assert g.episodes[0].turns[0].tool_calls[0].end == 9 and not math.isnan(ep.reward)
    assert collate([t], [0.0]).to("cpu").input_ids.tolist() == [[1, 2]]
