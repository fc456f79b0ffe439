"""Each role's own metric (`Context.measure` -> `workflow/<name>/<metric>`, docs/WORKFLOWS.md): scripted
episodes of the four multi-role workflows with known outcomes give the values derived by hand, pooled over a
step by `episode_metrics` and over samples by `rolerl eval`'s `summarize`."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rolerl.eval.harness import Sample, _sample, summarize
from rolerl.train.monitor import episode_metrics
from rolerl.types import Episode
from rolerl.workflows.base import pooled_measures
from rolerl.workflows.reasoner_tools import uses_result
from tests.workflows import test_eval_opt as eval_opt
from tests.workflows import test_orch_workers as orch_workers
from tests.workflows import test_reasoner_tools as rt
from tests.workflows import test_voting as voting
from tests.workflows.test_eval_opt import RIGHT, WRONG


def metrics(episodes: list[Episode], workflow: str, roles: tuple[str, ...]) -> dict[str, float]:
    """The step metrics' role-metric keys of `episodes`."""
    policy = SimpleNamespace(route_of=dict.fromkeys(roles))
    out = episode_metrics(episodes, policy, workflow)
    return {k: v for k, v in out.items() if k.startswith("workflow/") and "/malformed/" not in k}


def test_pooled_measures_weigh_observations_not_episodes():
    # episode 1: 3 verdicts, 2 right; episode 2: 1 verdict, wrong; episode 3: none -> 2 / 4, not (2/3 + 0) / 2
    pooled = pooled_measures([{"v": [2.0, 3.0], "w": [1.0, 1.0]}, {"v": [0.0, 1.0]}, {}])
    assert pooled == {"v": 0.5, "w": 1.0}
    assert pooled_measures([{"v": [0.0, 0.0]}]) == {}, "a metric nobody observed is absent, not 0"


def test_voting(tokenizer):
    five, six, none = "<answer>5</answer>", "<answer>6</answer>", "No idea."

    def episode(answers, choice):
        return voting.run(tokenizer, choice, answers=answers)[0]

    episodes = [
        # a voter was right, the aggregator chose it; the majority (6) was wrong
        episode([five, six, six], "\\boxed{1}"),
        # a voter was right, the aggregator chose a wrong one
        episode([five, six, six], "\\boxed{2}"),
        # voter 1 was right, but the choice is malformed: the aggregator chose nothing (the episode is right)
        episode([five, six, six], "I pick the first."),
        # two right voters, a right majority; the aggregator chose the wrong one
        episode([five, six, five], "\\boxed{2}"),
        # nobody was right: no choice to judge; the unanswered reply does not vote
        episode([six, none, none], "\\boxed{1}"),
    ]
    assert [e.metadata["measures"].get("aggregator_choice_acc") for e in episodes] == [
        [1.0, 1.0], [0.0, 1.0], [0.0, 1.0], [0.0, 1.0], None
    ]  # fmt: skip
    assert episodes[2].reward == 1.0 and episodes[2].metadata["malformed"] == {"no_choice": 1}
    assert metrics(episodes, "voting", ("voter", "aggregator")) == {
        "workflow/voting/choice_parsed": 4 / 5,  # episode 3's choice is malformed
        "workflow/voting/any_voter_correct": 4 / 5,
        "workflow/voting/aggregator_choice_acc": 1 / 4,
        "workflow/voting/majority_acc": 1 / 5,
    }


def test_eval_opt(tokenizer):
    five, six = "<answer>5</answer>", "<answer>6</answer>"
    # wrong -> (rightly judged wrong) -> revised right -> (rightly judged right): 2 right verdicts, a fix
    fixed, _ = eval_opt.run(tokenizer, [six, five], [WRONG, RIGHT])
    # right, judged wrong (a miss) -> broken to wrong, judged wrong (a hit) -> still wrong, no verdict (a miss)
    broken, _ = eval_opt.run(tokenizer, [five, six, six], [WRONG, WRONG, "Hmm."])
    assert broken.metadata["malformed"] == {"no_verdict": 1} and broken.metadata["rounds"] == 3
    assert [t.reward for t in broken.turns if t.role == "evaluator"] == [0.0, 1.0, 0.0]
    assert fixed.metadata["measures"] == {
        "generator_first_acc": [0.0, 1.0], "revision_wrong_to_right": [1.0, 1.0], "evaluator_verdict_acc": [2.0, 2.0],
        "verdict_parsed": [2.0, 2.0],
    }  # fmt: skip
    assert metrics([fixed, broken], "eval_opt", ("generator", "evaluator")) == {
        "workflow/eval_opt/evaluator_verdict_acc": 3 / 5,
        "workflow/eval_opt/verdict_parsed": 4 / 5,  # broken's third review has no verdict
        "workflow/eval_opt/generator_first_acc": 1 / 2,
        "workflow/eval_opt/revision_right_to_wrong": 1 / 1,
        "workflow/eval_opt/revision_wrong_to_right": 1 / 2,  # fixed's one fix, broken's second revision
    }


def test_orch_workers(tokenizer):
    # PLAN: 3 distinct strategies; the worker that counts up answers 6, the other two 5; the synthesis 5
    planned, _, _ = orch_workers.run(orch_workers.replies(), tokenizer=tokenizer)
    # no plan: one worker gets the plain problem (and answers 5); the synthesis is wrong
    unplanned, _, _ = orch_workers.run(
        orch_workers.replies("I will just solve it.", "<answer>7</answer>"), tokenizer=tokenizer
    )
    # 3 strategies for 2 workers: too many, an invalid plan; both kept workers answer (add: 5, count up: 6)
    crowded, _, _ = orch_workers.run(orch_workers.replies(), workers=2, tokenizer=tokenizer)
    assert unplanned.metadata["malformed"] == {"no_strategies": 1}
    assert crowded.metadata["malformed"] == {"too_many_strategies": 1}
    assert metrics(
        [planned, unplanned, crowded], "orch_workers", ("orchestrator", "worker", "synthesizer")
    ) == {
        "workflow/orch_workers/plan_valid": 1 / 3,
        "workflow/orch_workers/worker_acc": (2 + 1 + 1) / (3 + 1 + 2),
        "workflow/orch_workers/any_worker_correct": 3 / 3,
        "workflow/orch_workers/synthesizer_acc": 2 / 3,
    }


def test_reasoner_tools(tokenizer):
    ask = rt.asks_then
    # the code ran (391); the answer is that value: coder reward 1.0 (ran, solved)
    used, _, _ = rt.run(ask("So it is <answer>391</answer>."), tokenizer=tokenizer)
    # the code ran (391); the reasoner answers something else: coder reward 0.2 (ran, not solved)
    ignored, _, _ = rt.run(ask("<answer>400</answer>"), tokenizer=tokenizer)
    # the code failed: no result to use (no observation), coder reward 0
    failed, _, _ = rt.run(ask("<answer>391</answer>"), coder=rt.ERROR, tokenizer=tokenizer)
    # two coder samples, the first failed, the second ran: the reasoner gets the second's 391, uses it
    nested, _, _ = rt.run(
        ask("<answer>391</answer>"),
        coder=lambda k: [rt.ERROR, rt.CODE][k],
        coder_samples=2,
        tokenizer=tokenizer,
    )
    assert [t.reward for t in nested.turns if t.role == "coder"] == [0.0, 1.0]
    assert metrics([used, ignored, failed, nested], "reasoner_tools", ("reasoner", "coder")) == {
        "workflow/reasoner_tools/coder_ran": 3 / 5,
        "workflow/reasoner_tools/coder_reward": (1.0 + 0.2 + 0.0 + 0.0 + 1.0) / 5,
        "workflow/reasoner_tools/reasoner_uses_result": 2 / 3,
    }
    without, _, _ = rt.run(ask("<answer>400</answer>"), role_rewards=False, tokenizer=tokenizer)
    assert without.metadata["measures"]["coder_reward"] == [0.0, 1.0], "the outcome, when no graded reward"


@pytest.mark.parametrize(
    ("answer", "results", "expected"),
    [
        ("391", ["391"], True),
        (" 391.0 ", ["the product is 391"], True),  # a number in a result, compared as a number
        ("hello world", ["x\nhello world\n"], True),  # a whole line
        ("39", ["391"], False),  # not a substring match
        ("hello", ["hello world"], False),
        ("1e3", ["1000"], True),
        ("391", [], False),
    ],
)
def test_uses_result(answer, results, expected):
    assert uses_result(answer, results) is expected


def test_eval_samples_carry_them_and_the_summary_pools_them_like_the_step_metrics(tokenizer):
    five, six = "<answer>5</answer>", "<answer>6</answer>"
    episodes = [voting.run(tokenizer, c, answers=[five, six, six])[0] for c in ("\\boxed{1}", "\\boxed{2}")]
    policy = SimpleNamespace(tokenizer_of=lambda role: tokenizer)
    samples = [_sample(voting.TASK, voting.EXAMPLE, j, e, policy) for j, e in enumerate(episodes)]
    assert samples[1].measures == {"choice_parsed": [1.0, 1.0], "any_voter_correct": [1.0, 1.0],
                                   "aggregator_choice_acc": [0.0, 1.0], "majority_acc": [0.0, 1.0]}  # fmt: skip
    summary = {k: v for k, v in summarize(samples, 2, "voting").items() if k.startswith("workflow/")}
    assert (
        summary
        == metrics(episodes, "voting", ("voter", "aggregator"))
        == {
            "workflow/voting/choice_parsed": 1.0,
            "workflow/voting/any_voter_correct": 1.0,
            "workflow/voting/aggregator_choice_acc": 0.5,
            "workflow/voting/majority_acc": 0.0,
        }
    )


def test_eval_summary_pools_them_like_the_step_metrics(tokenizer):
    def sample(i: int, measures: dict[str, list[float]]) -> Sample:
        return Sample(f"x{i}", 0, 1.0, True, None, {}, 10, False, 0, 0, {}, measures=measures)

    out = summarize([sample(0, {"plan_valid": [1.0, 1.0]}), sample(1, {"plan_valid": [0.0, 1.0]}),
                     sample(2, {})], 1, "orch_workers")  # fmt: skip
    assert out["workflow/orch_workers/plan_valid"] == 0.5
    assert not [k for k in summarize([sample(0, {})], 1, "orch_workers") if k.startswith("workflow/")]
