"""The search agent through the real engine and a real BM25 search tool: a scripted trajectory's query
tokens are `tool_call` (the tool adapter's under `dart`), the retrieved passages are spliced as
`tool_output`, the answer is graded by EM; without the search tool the workflow says what to set; and
training runs on HotpotQA with BM25 over the shared data (tiny model; slow: the default model)."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from rolerl.config import load_config
from rolerl.models.lora import add_adapters
from rolerl.models.topology import Topology
from rolerl.roles import TOOL_OUTPUT, shift, splice_tokenize, split_segments
from rolerl.rollout.engine import Engine
from rolerl.rollout.lockstep import LockstepBackend
from rolerl.rollout.sampling import SamplingParams
from rolerl.tasks.base import Example
from rolerl.tasks.qa import QADataset, QATask
from rolerl.tools.search import search_tool
from rolerl.train.checkpoint import RunDir
from rolerl.train.rl import train
from rolerl.workflows import WORKFLOWS, Context, SearchAgent, derive_seed
from rolerl.workflows.search_agent import SEARCH_TAGS
from tests.train.test_rl import TINY

PASSAGES = [
    {"id": "p0", "title": "Paris", "text": "Paris is the capital of France."},
    {"id": "p1", "title": "Berlin", "text": "Berlin is the capital of Germany."},
]


def scripted(script: list[int]):
    def sampler(logits, params, seeds, counters):
        tokens = torch.tensor([script[int(c)] for c in counters])
        return tokens, torch.log_softmax(logits.float(), -1).gather(1, tokens[:, None]).squeeze(1)

    return sampler


def test_search_agent_replays_a_trajectory_with_a_real_search(tiny, tmp_path):
    model, tok = tiny
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(p) + "\n" for p in PASSAGES))
    tool = search_tool(corpus=str(corpus), k=1, cache_dir=str(tmp_path / "cache"))
    example = Example("qa/test/0", "What is the capital of Germany", "Berlin", {"golds": ["Berlin"]})
    task = QATask("qa", {"test": lambda: QADataset("qa", "test", "mem", [example], [], [])})
    text = "<think>I should look it up.</think><search>capital of Germany</search>"
    ids, kinds = splice_tokenize(tok, split_segments(text, SEARCH_TAGS))
    answer, answer_kinds = splice_tokenize(tok, split_segments("<answer>Berlin</answer>", SEARCH_TAGS))
    script = ids + answer + [tok.eos_token_id]
    add_adapters(model, ["reason", "tool"], rank=4)
    route_of = {
        "policy": Topology.from_preset("dart", ["policy"]).route_of("policy", {"reason": 0, "tool": 1})
    }
    engine = Engine(model, tok, max_batch=2, tools={"search": tool}, sampler=scripted(script))
    backend = LockstepBackend(engine)

    async def main():
        ctx = Context(backend, tok, route_of, SamplingParams(max_new_tokens=200), 7, tool="search")
        return await backend.episode(SearchAgent(task).run(ctx, example))

    episode = asyncio.run(main())
    (turn,) = episode.turns
    assert episode.reward == 1.0 and episode.metadata["correct"] and episode.metadata["em"] == 1.0
    (call,) = turn.tool_calls
    assert call.name == "search" and call.args.strip() == "capital of Germany" and not call.error
    assert call.output.startswith("Doc 1(Title: Berlin) Berlin is the capital of Germany.")
    sampled = [k for k in turn.kinds if k != TOOL_OUTPUT]
    assert sampled == kinds + answer_kinds + ["reasoning"]  # EOS after a closed answer: the reasoning state
    assert "tool_call" in turn.kinds and "tool_output" in turn.kinds
    assert turn.routes == shift(["prompt"] * len(turn.prompt_ids) + turn.kinds, route_of["policy"])
    query = [
        r
        for r, k in zip(turn.routes[len(turn.prompt_ids) - 1 :], turn.kinds, strict=False)
        if k == "tool_call"
    ]
    assert set(query) == {1}, "the query tokens are computed by the tool adapter"
    engine.close()


def test_search_agent_needs_the_search_tool():
    assert WORKFLOWS["search_agent"] is SearchAgent
    ctx = Context(None, None, {"policy": {}}, SamplingParams(), derive_seed(0), tool="python")
    with pytest.raises(ValueError, match="rollout.tool=search"):
        asyncio.run(SearchAgent(QATask("qa", {"test": lambda: None})).run(ctx, Example("a", "q?", "x")))


def search_run(shared_data, tmp_path, topology: str, model: list[str]) -> list[dict]:
    """`train.steps=2` of the search agent on HotpotQA (IRCoT's 500 dev questions) with BM25 over their
    contexts, from the shared data."""
    corpus = shared_data / "qa" / "wiki_corpus" / "hotpotqa_ircot500_contexts_corpus.jsonl.gz"
    cfg = load_config(None, [
        *model, f"run.dir={tmp_path / 'run'}", "train.steps=2", "train.tasks_per_step=2", "rollout.n=2",
        "task.name=hotpotqa", f"task.data={shared_data}", "task.split=dev_ircot500", "task.workflow=search_agent",
        "rollout.tool=search", f"rollout.tool_options={{corpus: {corpus}, cache_dir: {tmp_path / 'bm25'}}}",
        f"adapters.preset={topology}", "adapters.rank=4", "run.progress=false", "run.tensorboard=false",
        "train.skip_inert_rows=false",  # every row's rollout log-probs against the trainer's (logp_mismatch)
    ])  # fmt: skip
    train(cfg)
    rows = RunDir(tmp_path / "run", tensorboard=False).read_metrics()
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["episodes"] == 4.0 and row["logp_mismatch/max_abs"] < 1e-3
    return rows


@pytest.mark.parametrize("topology", ["isolated", "dart"])
def test_search_agent_trains_on_the_tiny_model(shared_data, tmp_path, topology):
    search_run(shared_data, tmp_path, topology, [*TINY[:2], "train.bf16=false", "rollout.max_new_tokens=12"])


@pytest.mark.slow
@pytest.mark.parametrize("topology", ["shared", "isolated", "dart"])
def test_search_agent_on_the_default_model(shared_data, tmp_path, topology):
    model = ["model.spec=default", "model.device=cpu", "train.bf16=false", "rollout.max_new_tokens=64"]
    rows = search_run(shared_data, tmp_path, topology, model)
    if topology == "dart":
        assert all(r["adapter/reason/steps"] == 1.0 for r in rows)
