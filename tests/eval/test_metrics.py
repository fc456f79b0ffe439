"""pass@k, standard errors and the pooled gain, against numbers computed by hand."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from rolerl.eval import EvalResult, paired_gain, pass_at_k, pooled_gain
from rolerl.tasks.base import Example
from rolerl.types import Episode


def test_pass_at_k_by_hand():
    assert pass_at_k(8, 0, 1) == 0.0 and pass_at_k(8, 8, 8) == 1.0
    assert pass_at_k(8, 2, 1) == pytest.approx(2 / 8)
    # 1 - C(6, 4) / C(8, 4) = 1 - 15 / 70
    assert pass_at_k(8, 2, 4) == pytest.approx(1 - 15 / 70)
    assert pass_at_k(8, 5, 4) == 1.0  # fewer than k wrong samples: some k-subset always has a right one
    with pytest.raises(ValueError, match="at least 4"):
        pass_at_k(3, 1, 4)
    with pytest.raises(ValueError, match="0 <= c <= n"):
        pass_at_k(3, 4, 1)


def test_pooled_gain_by_hand():
    gain, se = pooled_gain([(0.25, 100), (0.35, 100)], [(0.5, 100), (0.4, 100)])
    assert gain == pytest.approx(0.15)
    assert se == pytest.approx(math.sqrt(0.3 * 0.7 / 200 + 0.45 * 0.55 / 200))


def test_paired_gain_by_hand():
    before = {"a": True, "b": False, "c": False, "d": True}
    after = {"d": False, "c": True, "b": True, "a": True}  # b, c wrong -> right; d right -> wrong
    g = paired_gain(before, after)
    assert (g.wrong_to_right, g.right_to_wrong, g.n) == (2, 1, 4) and g.gain == 0.25
    # the changes (0, 1, 1, -1): variance 3/4 - 1/16 = 11/16, the mean's error sqrt(11/64)
    assert g.stderr == pytest.approx(math.sqrt(11 / 64)) and g.z == pytest.approx(0.25 / math.sqrt(11 / 64))
    same = paired_gain(before, before)
    assert (same.gain, same.stderr, same.z) == (0.0, 0.0, 0.0)
    # the pairing makes agreement count: every problem flipped the same way is a certain change
    assert paired_gain({"a": False, "b": False}, {"a": True, "b": True}).stderr == 0.0
    with pytest.raises(ValueError, match="the same problems; 1 only before, 0 only after"):
        paired_gain(before, {k: v for k, v in after.items() if k != "a"})
    with pytest.raises(ValueError, match="at least one problem"):
        paired_gain({}, {})


def test_eval_result_accuracy_pass_at_k_and_families():
    examples = [Example(str(i), "q", "1", {"family": f}) for i, f in enumerate("aab")]
    grid = [[1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]]
    episodes = [[Episode(ex.id, [], float(c), metadata={"correct": bool(c), "tool_calls": c}) for c in row]
                for ex, row in zip(examples, grid, strict=True)]  # fmt: skip
    r = EvalResult(examples, episodes)
    assert r.accuracy() == pytest.approx(5 / 12) and r.accuracy("a") == pytest.approx(5 / 8)
    assert r.pass_at(1) == pytest.approx((0.25 + 1 + 0) / 3)
    assert r.pass_at(2, "a") == pytest.approx(((1 - 3 / 6) + 1) / 2)  # 1 - C(3,2)/C(4,2) = 0.5
    assert r.families() == ["a", "b"] and r.tool_use() == pytest.approx(5 / 12)
    s = r.summary()
    assert s["accuracy/b"] == 0.0 and s["n"] == 3
    # over the 3 problems' means (1/4, 1, 0; mean 5/12): squared deviations 1/36 + 49/144 + 25/144 = 13/24,
    # / 3 problems / 3 again under the root; not the binomial error of 5/12 over the 12 samples
    assert r.stderr() == pytest.approx(math.sqrt(13 / 216)) and s["stderr"] == r.stderr()


def test_majority_vote_by_hand():
    from rolerl.tasks.base import majority_correct

    assert majority_correct([("4", True), ("5", False), ("4", True)])
    assert not majority_correct([("5", False), ("4", True), ("5", False)])
    assert majority_correct([("4", True), ("5", False)])  # a tie: the first answer seen wins
    assert not majority_correct([(None, False), (None, False)])
    assert majority_correct([(None, False), ("7", True)])  # no answer: no vote


def test_pass_at_k_equals_the_fraction_of_k_subsets_with_a_right_sample():
    """The estimator against its definition: over every k-subset of n samples (c right), the share that
    holds at least one right sample, enumerated."""
    import itertools

    for n in range(1, 9):
        for c in range(n + 1):
            samples = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(samples, k))
                want = sum(any(s) for s in subsets) / len(subsets)
                assert pass_at_k(n, c, k) == pytest.approx(want, abs=1e-12), (n, c, k)


def test_sampled_summary_errors_by_hand():
    """With n samples a problem, each pass@k and maj@k carries the standard error of the mean of its
    per-problem scores (the first sample's binomial error said nothing of the other n - 1): 3 problems x 4
    samples, right 4 / 2 / 0, derived by hand."""
    from rolerl.eval.harness import Sample, summarize, table

    answers = {"a": ["5"] * 4, "b": ["5", "5", "7", "8"], "c": ["9"] * 4}
    samples = [Sample(i, j, 0.0, a == "5", a, {}, 10, False, 0, 0, {}) for i, row in answers.items()
               for j, a in enumerate(row)]  # fmt: skip
    m = summarize(samples, 4)
    assert m["pass@1"] == pytest.approx(0.5) and m["stderr"] == pytest.approx(math.sqrt(0.5 / 9))
    # pass@2: 1, 1 - C(2,2)/C(4,2) = 5/6, 0; mean 11/18, squared deviations (49 + 16 + 121) / 324
    assert m["pass@2"] == pytest.approx(11 / 18)
    assert m["stderr/pass@2"] == pytest.approx(math.sqrt(186 / 324 / 9))
    assert m["pass@4"] == pytest.approx(2 / 3) and m["stderr/pass@4"] == pytest.approx(math.sqrt(6 / 81))
    assert m["maj@2"] == m["maj@4"] == pytest.approx(2 / 3)  # b: "5" twice in either prefix
    assert m["stderr/maj@4"] == pytest.approx(math.sqrt(6 / 81))
    greedy = summarize([s for s in samples if s.sample == 0], 1)  # 0/1 scores: the binomial error
    assert greedy["stderr"] == pytest.approx(math.sqrt((2 / 3) * (1 / 3) / 3))
    assert not [k for k in greedy if k.startswith("stderr/")]
    spec = SimpleNamespace(task="t", split="test", n=4, workflow="w")
    assert "pass@4             66.7% +- 27.2" in table(m, spec)
