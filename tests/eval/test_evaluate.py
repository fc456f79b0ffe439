"""`evaluate_groups`: several groups of problems (another task, another workflow) in one batch give each
group what `evaluate` gives it alone."""

from __future__ import annotations

import pytest

from rolerl.eval import evaluate, evaluate_groups
from rolerl.eval.harness import EvalSpec, spec_policy
from rolerl.rollout.engine import Engine
from rolerl.tasks import load_task
from rolerl.workflows import load_workflow


def test_groups_in_one_batch_equal_each_group_alone():
    spec = EvalSpec(task="arithmetic", model="tiny:llama", max_new_tokens=8, progress=False)
    task = load_task("arithmetic")
    workflow = load_workflow("single_turn", task, {})
    policy, _, _ = spec_policy(spec, workflow.roles)
    engine = Engine(policy.model, policy.tokenizer, max_batch=32)
    first, second = task.examples("test", 6, 0), task.examples("test", 12, 1)[6:]
    kw = dict(max_new_tokens=8, tool=None, greedy=False, samples=2, seed=3)
    alone = {
        "a": evaluate(engine, policy.route_of, workflow, first, **kw),
        "b": evaluate(engine, policy.route_of, workflow, second, ids=range(6, 12), **kw),
    }
    progress = []
    together = evaluate_groups(
        engine, policy.route_of, {"a": (workflow, first, None), "b": (workflow, second, range(6, 12))},
        on_episode=lambda done, total: progress.append((done, total)), **kw,
    )  # fmt: skip
    assert progress[-1] == (24, 24) and len(progress) == 24
    for group, want in alone.items():
        got = together[group]
        assert got.examples == want.examples and got.seconds > 0
        for got_eps, want_eps in zip(got.episodes, want.episodes, strict=True):
            # sampled at temperature 1 with each episode's own seed: the same tokens whatever shares the
            # batch (a batch shape's rounding can flip a draw only at a near-tie: none on these seeds)
            assert [e.turns[0].completion_ids for e in got_eps] == [
                e.turns[0].completion_ids for e in want_eps
            ]
        assert got.correct() == want.correct()
    # the ids seed the samples: the second group under ids 0..5 draws other tokens
    renumbered = evaluate(engine, policy.route_of, workflow, second, **kw)
    assert [e.turns[0].completion_ids for eps in renumbered.episodes for e in eps] != [
        e.turns[0].completion_ids for eps in together["b"].episodes for e in eps
    ]


def test_greedy_with_several_samples_is_refused():
    with pytest.raises(ValueError, match="greedy evaluation with samples > 1"):
        evaluate_groups({}, {}, {}, samples=2)
