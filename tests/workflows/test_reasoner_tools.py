"""Reasoner + tool agent (MSARL) on the scripted backend: requests, the coder's code and spliced output, the
reasoner's token-in-token-out follow-ups, nested coder samples in parallel, MSARL's role rewards and group
keys under each credit rule, the malformed cases; one episode through the real engine and sandbox; training
runs on the tiny model (isolated, and separate with a byte-level coder model) and (slow) the default one."""

from __future__ import annotations

import asyncio
import os
import re

import pytest
import torch

from rolerl.config import AlgorithmConfig, load_config
from rolerl.models.lora import add_adapters
from rolerl.models.tiny import tiny_model
from rolerl.roles import KINDS
from rolerl.rollout.engine import Engine, GenerationRequest
from rolerl.rollout.lockstep import LockstepBackend
from rolerl.rollout.sampling import SamplingParams
from rolerl.tasks import ArithmeticTask
from rolerl.tasks.base import Example
from rolerl.train.checkpoint import RunDir
from rolerl.train.credit import advantages_of, turn_rewards
from rolerl.train.rl import train
from rolerl.types import ToolCall, Turn
from rolerl.workflows import derive_seed, load_workflow
from rolerl.workflows import reasoner_tools as rt
from rolerl.workflows.base import Context
from rolerl.workflows.reasoner_tools import CAP_MESSAGE, REASONER_TAGS, ReasonerTools
from tests.train.test_rl import TINY
from tests.workflows.scripted import ScriptedBackend

root = pytest.mark.skipif(os.geteuid() != 0, reason="the Python sandbox needs root (CI runs as root)")
TASK = ArithmeticTask()
EXAMPLE = Example("arith/0", "What is 17 * 23?", "391")
ROUTES = {role: dict.fromkeys(KINDS, i) for i, role in enumerate(ReasonerTools.roles)}
ASK = "I need a product. <request>compute 17 * 23</request>"
CODE = "<code>\nprint(17 * 23)\n</code>\n<output>\n391\n</output>\nDone."
ERROR = "<code>\nprint(17 / 0)\n</code>\n<output>\nTraceback: ZeroDivisionError\n</output>\n"


class ToolScripted(ScriptedBackend):
    """The scripted backend plus what the engine records of each closed `<code>` call: its code, the output
    scripted after it, and an error when that output is a traceback (the scripted backend runs no tool)."""

    async def generate(self, request: GenerationRequest) -> Turn:
        turn = await super().generate(request)
        assert self.calls[-1].request is request
        if request.tool is not None and request.tags.tool_open == "<code>":
            found = re.findall(
                r"<code>(.*?)</code>\s*<output>\n(.*?)\n</output>", self.calls[-1].completion, re.S
            )
            turn.tool_calls = [ToolCall("python", c, o, error=o.startswith("Traceback")) for c, o in found]
        return turn


def run(reasoner, coder=CODE, tokenizer=None, seed: int = 0, temperature: float = 1.0, **options):
    """One episode: `reasoner(prompt)` and `coder(k)` (k = the coder call's index in the episode) script the
    two roles."""
    seeds = {derive_seed(seed, k): k for k in range(64)}
    coders = []

    def reply(request, prompt: str) -> str:
        if request.role == "reasoner":
            return reasoner(prompt)
        coders.append(seeds[request.sampling.seed])
        return coder(len(coders) - 1) if callable(coder) else coder

    backend = ToolScripted(tokenizer, reply)
    ctx = Context(backend, tokenizer, ROUTES, SamplingParams(temperature=temperature), seed, tool="python")
    episode = asyncio.run(ReasonerTools(TASK, **options).run(ctx, EXAMPLE))
    return episode, backend, ctx


def asks_then(answer: str = "So it is <answer>391</answer>."):
    return lambda prompt: answer if "user\nResult:" in prompt else ASK


def test_request_code_result_and_answer(tokenizer):
    episode, backend, ctx = run(asks_then(), tokenizer=tokenizer)
    first, coder, second = episode.turns
    assert [t.role for t in episode.turns] == ["reasoner", "coder", "reasoner"]
    reasoner_call, coder_call, _ = backend.calls
    assert "<request></request>" in reasoner_call.prompt and "What is 17 * 23?" in reasoner_call.prompt
    assert reasoner_call.request.tags == REASONER_TAGS and "</request>" in reasoner_call.request.sampling.stop
    assert "Problem: What is 17 * 23?\n\nRequest: compute 17 * 23<|im_end|>" in coder_call.prompt
    assert coder_call.request.tool == "python" and coder_call.request.tags.tool_open == "<code>"
    # token in, token out: the reasoner continues from its own exact ids
    assert second.prompt_ids[: len(first.ids)] == first.ids
    assert second.prompt_ids == ctx.follow_up(first, [{"role": "user", "content": "Result: 391"}])
    assert backend.calls[-1].prompt.endswith(
        "<|im_start|>user\nResult: 391<|im_end|>\n<|im_start|>assistant\n"
    )
    assert "tool_call" in first.kinds, "the request is the reasoner's tool call (the tool adapter under dart)"
    assert {"tool_call", "tool_output"} <= set(coder.kinds)
    assert episode.reward == 1.0 and episode.metadata["correct"] and episode.metadata["requests"] == 1
    assert (
        episode.metadata["text"] == "So it is <answer>391</answer>." and "malformed" not in episode.metadata
    )
    assert [t.reward for t in episode.turns] == [None, 1.0, None]


def test_nested_coder_samples_are_parallel_siblings_with_role_rewards(tokenizer):
    samples = [ERROR, CODE.replace("391", "390"), "I cannot write code."]
    episode, backend, _ = run(asks_then(), lambda k: samples[k], tokenizer=tokenizer, coder_samples=3)
    assert [t.role for t in episode.turns] == ["reasoner", "coder", "coder", "coder", "reasoner"]
    assert backend.max_in_flight("coder") == 3, "the siblings reach the backend together"
    assert len({c.request.sampling.seed for c in backend.calls if c.role == "coder"}) == 3
    assert len({c.prompt for c in backend.calls if c.role == "coder"}) == 1, "siblings share one prompt"
    assert backend.calls[-1].prompt.endswith("user\nResult: 390<|im_end|>\n<|im_start|>assistant\n"), (
        "the first sibling that ran is used"
    )
    assert episode.metadata["malformed"] == {"no_code": 1} and episode.metadata["code_ran"] == 1
    assert [t.reward for t in episode.turns] == [None, 0.0, 1.0, 0.0, None]
    wrong, _, _ = run(asks_then("<answer>390</answer>"), lambda k: samples[k], tokenizer=tokenizer,
                      seed=1, coder_samples=3)  # fmt: skip
    assert [t.reward for t in wrong.turns] == [None, 0.0, 0.2, 0.0, None] and wrong.reward == 0.0
    plain, _, _ = run(
        asks_then(), lambda k: samples[k], tokenizer=tokenizer, coder_samples=3, role_rewards=False
    )
    assert [t.reward for t in plain.turns] == [None] * 5
    errors, backend, _ = run(asks_then(), ERROR, tokenizer=tokenizer, coder_samples=2)
    assert "user\nResult: error\nTraceback: ZeroDivisionError<|im_end|>" in backend.calls[-1].prompt
    assert [t.reward for t in errors.turns] == [None, 0.0, 0.0, None]

    # credit: per episode [reasoner, coder x3, reasoner]; rewards 1.0 (solved) and 0.0
    want = {
        "outcome": [1, 1, 1, 1, 1] + [0, 0, 0, 0, 0],
        "role": [1, 0, 1, 0, 1] + [0, 0, 0.2, 0, 0],
        "mix": [0.5, 0.5, 1.5, 0.5, 0.5] + [0, 0, 0.2, 0, 0],
    }
    for rule, rewards in want.items():
        credit = turn_rewards([episode, wrong], AlgorithmConfig(reward=rule, mix_alpha=0.5))
        assert credit.rewards.tolist() == pytest.approx(rewards), rule
    # A request's siblings are an advantage group of their own (Turn.group), each call counted once
    assert [t.group for t in episode.turns] == [None, "request0", "request0", "request0", None]
    alg = AlgorithmConfig(group_key="role")
    credit = turn_rewards([episode, wrong], alg)
    assert credit.keys[1:4] == [("arith/0", 0, "coder", "request0")] * 3
    assert credit.keys[6:9] == [("arith/0", 1, "coder", "request0")] * 3
    got = advantages_of(alg, credit)
    # siblings (0, 1, 0): mean 1/3, unbiased std sqrt(1/3); (0, 0.2, 0): the same scaled by 0.2
    s = 3**-0.5
    assert got[[1, 2, 3]].tolist() == pytest.approx(
        [-1 / 3 / (s + 1e-6), 2 / 3 / (s + 1e-6), -1 / 3 / (s + 1e-6)]
    )
    t = 0.2 * s
    assert got[[6, 7, 8]].tolist() == pytest.approx(
        [-0.2 / 3 / (t + 1e-6), 0.4 / 3 / (t + 1e-6), -0.2 / 3 / (t + 1e-6)]
    )
    a = 0.5 / (0.5**0.5 + 1e-6)  # the reasoner: outcomes 1 and 0, mean 0.5, std sqrt(0.5)
    assert got[[0, 4, 5, 9]].tolist() == pytest.approx([a, a, -a, -a])
    # Without sibling groups the coder calls are in group_key's group: role holds every coder call of the
    # task's episodes, each episode counted once
    flat, _, _ = run(
        asks_then(), lambda k: samples[k], tokenizer=tokenizer, coder_samples=3, sibling_groups=False
    )
    flat_wrong, _, _ = run(asks_then("<answer>390</answer>"), lambda k: samples[k], tokenizer=tokenizer,
                           seed=1, coder_samples=3, sibling_groups=False)  # fmt: skip
    assert all(t.group is None for t in flat.turns)
    credit = turn_rewards([flat, flat_wrong], alg)
    assert set(credit.keys[1:4] + credit.keys[6:9]) == {("arith/0", "coder")}
    # coder units: episode means 1/3 and 0.2/3 -> mean 0.2, std (1/3 - 1/15)/sqrt(2)
    std = (1 / 3 - 1 / 15) / 2**0.5
    coder = [(r - 0.2) / (std + 1e-6) for r in (0, 1, 0, 0, 0.2, 0)]
    got = advantages_of(alg, credit)
    assert got[[1, 2, 3, 6, 7, 8]].tolist() == pytest.approx(coder)
    assert got[[0, 4, 5, 9]].tolist() == pytest.approx([a, a, -a, -a])
    one, _, _ = run(asks_then(), lambda k: samples[k], tokenizer=tokenizer, coder_samples=1)
    assert all(t.group is None for t in one.turns), "one sample per request: no sibling group (no signal)"


def test_greedy_decoding_calls_the_coder_once_a_request(tokenizer):
    """At temperature 0 the siblings would be one program written coder_samples times: one call stands for
    them, with the rewards and metadata one such sibling gets (a greedy evaluation costs 1/coder_samples)."""
    ask_twice = lambda p: "<answer>782</answer>" if p.count("user\nResult:") == 2 else ASK  # noqa: E731
    episode, backend, _ = run(ask_twice, tokenizer=tokenizer, temperature=0.0, coder_samples=4)
    assert [t.role for t in episode.turns] == ["reasoner", "coder", "reasoner", "coder", "reasoner"]
    assert [c.role for c in backend.calls].count("coder") == 2 and backend.max_in_flight("coder") == 1
    assert all(t.group is None for t in episode.turns), "a greedy request has no siblings to compare"
    assert [t.reward for t in episode.turns] == [None, 0.2, None, 0.2, None] and episode.reward == 0.0
    assert episode.metadata["code_ran"] == 2 and episode.metadata["requests"] == 2
    sampled, backend, _ = run(ask_twice, tokenizer=tokenizer, temperature=1.0, coder_samples=4)
    assert [c.role for c in backend.calls].count("coder") == 8 and backend.max_in_flight("coder") == 4
    assert {t.group for t in sampled.turns if t.role == "coder"} == {"request0", "request1"}


def test_malformed_cases(tokenizer):
    episode, backend, _ = run(lambda p: "It is probably 391.", tokenizer=tokenizer)
    assert episode.metadata["malformed"] == {"no_answer": 1} and len(episode.turns) == 1
    assert episode.reward == 0.0 and episode.metadata["requests"] == 0

    episode, backend, _ = run(asks_then(), "I cannot.", tokenizer=tokenizer)
    assert episode.metadata["malformed"] == {"no_code": 1} and episode.turns[1].reward == 0.0
    assert "user\nResult: error: the tool agent wrote no code<|im_end|>" in backend.calls[-1].prompt

    empty = lambda p: "<answer>391</answer>" if "user\nResult:" in p else "<request> </request>"  # noqa: E731
    episode, backend, _ = run(empty, tokenizer=tokenizer)
    assert episode.metadata["malformed"] == {"empty_request": 1} and episode.metadata["requests"] == 1
    assert [c.role for c in backend.calls] == ["reasoner", "reasoner"], "no coder for an empty request"
    assert "user\nResult: error: the request was empty<|im_end|>" in backend.calls[-1].prompt

    greedy = lambda p: "<answer>391</answer>" if "No more tool requests" in p else ASK  # noqa: E731
    episode, backend, _ = run(greedy, tokenizer=tokenizer, max_tool_requests=1)
    assert [t.role for t in episode.turns] == ["reasoner", "coder", "reasoner", "reasoner"]
    assert episode.metadata["malformed"] == {"tool_cap": 1} and episode.metadata["requests"] == 1
    assert CAP_MESSAGE.format(m=1) in backend.calls[-1].prompt and episode.reward == 1.0
    assert episode.turns[3].prompt_ids[: len(episode.turns[2].ids)] == episode.turns[2].ids

    episode, _, _ = run(lambda p: ASK, tokenizer=tokenizer, max_tool_requests=0)
    assert episode.metadata["malformed"] == {"tool_cap": 1, "no_answer": 1} and len(episode.turns) == 2


def test_options_and_the_tool_are_checked(tokenizer):
    workflow = load_workflow("rolerl.workflows.reasoner_tools:ReasonerTools", TASK, {"coder_samples": 4})
    assert workflow.coder_samples == 4 and workflow.max_tool_requests == 3 and workflow.role_rewards
    with pytest.raises(ValueError, match="coder_samples=0; allowed: an integer >= 1"):
        ReasonerTools(TASK, coder_samples=0)
    with pytest.raises(ValueError, match="max_tool_requests=-1; allowed: an integer >= 0"):
        ReasonerTools(TASK, max_tool_requests=-1)
    ctx = Context(None, tokenizer, ROUTES, SamplingParams(), 0, tool=None)
    with pytest.raises(ValueError, match="rollout.tool=python"):
        asyncio.run(ReasonerTools(TASK).run(ctx, EXAMPLE))


def test_one_episode_through_the_real_engine_and_sandbox(tokenizer, sandbox):
    """The reasoner's call stops at `</request>` and runs nothing; two coder siblings really run (one fails,
    one prints 42); the reasoner gets 42 and answers."""
    model, tok = tiny_model("qwen3", seed=0, tokenizer=tokenizer)
    add_adapters(model, ["reasoner", "coder"], rank=4)
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    seed = 7
    scripts = {
        derive_seed(seed, 0): ids("Let me ask.<request>compute 6 * 7</request> and I go on talking"),
        derive_seed(seed, 1): ids("<code>print(6 / 0)</code>") + [tok.eos_token_id],
        derive_seed(seed, 2): ids("<code>print(6 * 7)</code>") + [tok.eos_token_id],
        derive_seed(seed, 3): ids("<answer>42</answer> more"),
    }

    def sampler(logits, params, seeds, counters):
        tokens = torch.tensor([scripts[int(s)][int(c)] for s, c in zip(seeds, counters, strict=True)])
        return tokens, torch.log_softmax(logits.float(), -1).gather(1, tokens[:, None]).squeeze(1)

    engine = Engine(model, tok, max_batch=4, tools={"python": sandbox}, sampler=sampler)
    backend = LockstepBackend(engine)
    example = Example("arith/1", "What is 6 * 7?", "42")

    async def main():
        ctx = Context(backend, tok, ROUTES, SamplingParams(max_new_tokens=64), seed, tool="python")
        return await backend.episode(ReasonerTools(TASK, coder_samples=2).run(ctx, example))

    episode = asyncio.run(main())
    engine.close()
    ask, failed, ran, answer = episode.turns
    assert ask.finish_reason == "stop" and not ask.tool_calls, "no tool runs on a request"
    assert tok.decode(ask.completion_ids).endswith("</request>")
    assert failed.tool_calls[0].error and "ZeroDivisionError" in failed.tool_calls[0].output
    assert ran.tool_calls[0].output.strip() == "42" and not ran.tool_calls[0].error
    assert answer.prompt_ids[: len(ask.ids)] == ask.ids
    assert tok.decode(answer.prompt_ids[len(ask.ids) :]).endswith(
        "user\nResult: 42<|im_end|>\n<|im_start|>assistant\n"
    )
    assert answer.finish_reason == "stop" and tok.decode(answer.completion_ids) == "<answer>42</answer>"
    assert episode.reward == 1.0 and [t.reward for t in episode.turns] == [None, 0.0, 1.0, None]


def reasoner_always_asks(monkeypatch):
    """A random tiny model never writes a request: make every reasoner reply without a tag one, so the coder
    runs (on its own model under `separate`) and training sees both roles."""
    real = rt.next_action
    monkeypatch.setattr(rt, "next_action", lambda text: real(text) if real(text)[0] else ("request", "6 * 7"))


@root
@pytest.mark.parametrize("separate", [False, True])
def test_reasoner_tools_trains_on_the_tiny_model(tmp_path, monkeypatch, separate):
    reasoner_always_asks(monkeypatch)
    topology = (["adapters.preset=separate", "models.coder=tiny:qwen3:bytes", "roles.coder.model=coder"]
                if separate else ["adapters.preset=isolated"])  # fmt: skip
    cfg = load_config(None, [*TINY, f"run.dir={tmp_path}", "train.steps=1", "task.name=arithmetic",
                             "task.workflow=rolerl.workflows.reasoner_tools:ReasonerTools",
                             "task.workflow_options={max_tool_requests: 1}", "rollout.tool=python",
                             "algorithm.group_key=role", *topology])  # fmt: skip
    train(cfg)
    (row,) = RunDir(tmp_path, tensorboard=False).read_metrics()
    # 8 episodes: ask, code, ask again (over the cap), answer (or not)
    assert row["role/reasoner/turns"] == 24.0 and row["role/coder/turns"] == 8.0
    assert row["workflow/reasoner_tools/malformed/tool_cap"] == 1.0
    # the role metrics (tests/workflows/test_role_metrics.py): a coder's reward is 0 unless its code ran
    assert (
        0.0 <= row["workflow/reasoner_tools/coder_reward"] <= row["workflow/reasoner_tools/coder_ran"] <= 1.0
    )
    assert row["adapter/reasoner/steps"] == 1.0 and row["adapter/coder/steps"] == 1.0
    assert row["logp_mismatch/max_abs"] < 1e-3


TOPOLOGIES = {
    "shared": ["adapters.preset=shared"],
    "isolated": ["adapters.preset=isolated"],
    "dart": ["adapters.preset=dart"],
    # MSARL's layout: the reasoner on the default model, the coder on a small model of its own
    "separate": ["adapters.preset=separate", "models.coder=tiny:qwen3:bytes", "roles.coder.model=coder"],
}


@root
@pytest.mark.slow
@pytest.mark.parametrize("topology", list(TOPOLOGIES))
def test_reasoner_tools_on_the_default_model(tmp_path, monkeypatch, topology):
    reasoner_always_asks(monkeypatch)  # the untrained 135M model does not follow the request protocol
    cfg = load_config(None, [
        "model.spec=default", "model.device=cpu", "train.bf16=false", f"run.dir={tmp_path}", "train.steps=2",
        "train.skip_inert_rows=false",  # every row's rollout log-probs against the trainer's (logp_mismatch)
        "train.tasks_per_step=1", "rollout.n=2", "rollout.max_new_tokens=32", "task.name=arithmetic",
        "task.workflow=rolerl.workflows.reasoner_tools:ReasonerTools", "rollout.tool=python",
        "task.workflow_options={max_tool_requests: 1, coder_samples: 2}", *TOPOLOGIES[topology],
        "adapters.rank=4", "run.progress=false", "run.tensorboard=false", "algorithm.reward=role",
    ])  # fmt: skip
    train(cfg)
    rows = RunDir(tmp_path, tensorboard=False).read_metrics()
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:  # 2 episodes: ask, 2 coder siblings, ask again (over the cap), answer
        assert row["role/reasoner/turns"] == 6.0 and row["role/coder/turns"] == 4.0
        assert row["workflow/reasoner_tools/malformed/tool_cap"] == 1.0
        assert row["logp_mismatch/max_abs"] < 1e-3
        adapters = {k.split("/")[1] for k in row if k.startswith("adapter/") and k.endswith("/steps")}
        want = {"dart": {"reason", "tool"}, "shared": {"policy"}}.get(topology, {"reasoner", "coder"})
        assert adapters == want
