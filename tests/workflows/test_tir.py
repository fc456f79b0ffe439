"""The TIR workflow through the real engine and the real sandbox: a demonstration replayed token by token
comes back with the same ids and kinds SFT trains on, the sandbox's output spliced in, and reward 1."""

from __future__ import annotations

import asyncio

import pytest
import torch

from rolerl.models.lora import add_adapters
from rolerl.models.topology import Topology
from rolerl.roles import TOOL_OUTPUT, shift
from rolerl.rollout.engine import Engine
from rolerl.rollout.lockstep import LockstepBackend
from rolerl.rollout.sampling import SamplingParams
from rolerl.tasks.synthetic import SyntheticTask, demonstration_text
from rolerl.train.sft import demonstration_turns
from rolerl.workflows import TIR, WORKFLOWS, Context, derive_seed


def scripted(scripts: dict[int, list[int]]):
    """A sampler that picks each row's scripted token (by seed and sampled-token counter) with its real
    log-prob under the engine's logits."""

    def sampler(logits, params, seeds, counters):
        tokens = torch.tensor([scripts[int(s)][int(c)] for s, c in zip(seeds, counters, strict=True)])
        logp = torch.log_softmax(logits.float(), -1).gather(1, tokens[:, None]).squeeze(1)
        return tokens, logp

    return sampler


def run_episodes(model, tok, sandbox, task, examples, texts, route_of):
    """Replay `texts` (demonstration-style completions) as episode j of examples[j] through TIR."""
    add_adapters(model, ["reason", "tool"], rank=4)
    seeds = [derive_seed(1000 + j, 0) for j in range(len(texts))]  # call 0 of episode seed 1000 + j
    scripts = {}
    for seed, ex, text in zip(seeds, examples, texts, strict=True):
        (turn,) = demonstration_turns(tok, {"role": "policy", "messages": [*task.prompt(ex), {
            "role": "assistant", "content": text}]}, route_of)  # fmt: skip
        scripts[seed] = [t for t, k in zip(turn.completion_ids, turn.kinds, strict=True) if k != TOOL_OUTPUT]
    engine = Engine(model, tok, max_batch=4, tools={"python": sandbox}, sampler=scripted(scripts))
    backend = LockstepBackend(engine)
    workflow = TIR(task)

    async def main():
        ctxs = [Context(backend, tok, route_of, SamplingParams(max_new_tokens=64), 1000 + j, tool="python")
                for j in range(len(texts))]  # fmt: skip
        return await asyncio.gather(
            *[backend.episode(workflow.run(c, e)) for c, e in zip(ctxs, examples, strict=True)]
        )

    return asyncio.run(main()), scripts


def test_demonstrations_replayed_through_the_engine_give_the_sft_tokens_kinds_and_reward(tiny, sandbox):
    model, tok = tiny
    task = SyntheticTask(("two_step", "units", "change"), format_reward=0.1)
    examples = task.examples("train", 3, seed=0)
    texts = [demonstration_text(e.meta["expr"], int(e.answer)) for e in examples]
    texts[2] = "I think it is <answer>0</answer>"  # a wrong answer without a tool call
    route_of = {
        "policy": Topology.from_preset("dart", ["policy"]).route_of("policy", {"reason": 0, "tool": 1})
    }
    episodes, _ = run_episodes(model, tok, sandbox, task, examples, texts, route_of)
    for ep, ex, text in zip(episodes, examples, texts, strict=True):
        (turn,) = ep.turns
        (ref,) = demonstration_turns(tok, {"role": "policy", "messages": [*task.prompt(ex), {
            "role": "assistant", "content": text}]}, route_of)  # fmt: skip
        assert turn.completion_ids == ref.completion_ids, "the engine's splice == SFT's tokenisation"
        assert turn.kinds == ref.kinds and turn.prompt_ids == ref.prompt_ids
        assert turn.routes == shift(["prompt"] * len(turn.prompt_ids) + turn.kinds, route_of["policy"])
        assert turn.finish_reason == "eos"
    ok1, ok2, wrong = episodes
    for ep, ex in ((ok1, examples[0]), (ok2, examples[1])):
        assert ep.reward == 1.0 and ep.metadata["correct"] and ep.metadata["tool_calls"] == 1
        assert ep.turns[0].tool_calls[0].output.strip() == ex.answer, "the sandbox really ran the code"
        assert set(ep.turns[0].kinds) == {"reasoning", "tool_call", "tool_output", "answer"}
    assert wrong.reward == 0.0 and not wrong.metadata["correct"] and wrong.metadata["tool_calls"] == 0
    assert "tool_output" not in wrong.turns[0].kinds and "tool_call" not in wrong.turns[0].kinds


def test_a_wrong_tool_result_is_a_wrong_but_well_formed_answer(tiny, sandbox):
    model, tok = tiny
    task = SyntheticTask(("two_step",), format_reward=0.1)
    (ex,) = task.examples("train", 1, seed=4)
    text = demonstration_text(ex.meta["expr"] + " + 1", int(ex.answer) + 1)  # computes the wrong thing
    route_of = {"policy": {"prompt": 0, "reasoning": 0, "tool_call": 0, "tool_output": 0, "answer": 0}}
    (ep,), _ = run_episodes(model, tok, sandbox, task, [ex], [text], route_of)
    assert ep.turns[0].tool_calls[0].output.strip() == str(int(ex.answer) + 1)
    assert ep.reward == pytest.approx(0.1) and not ep.metadata["correct"]


def test_tir_needs_a_tool():
    assert WORKFLOWS["tir"] is TIR
    ctx = Context(None, None, {"policy": {}}, SamplingParams(), 0, tool=None)
    with pytest.raises(ValueError, match="rollout.tool"):
        asyncio.run(TIR(SyntheticTask()).run(ctx, SyntheticTask().examples("train", 1, 0)[0]))
