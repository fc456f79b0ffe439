"""LEAS interaction coefficients: the smoothing at k = 0 and k = n, the 6x6 solve against a hand-made λ,
the closed form against the solve, filtering, reading `rolerl eval` samples, input errors, CSV and plot."""

from __future__ import annotations

import csv
import json
import math

import pytest
import torch

from rolerl.diagnostics.interaction import (
    COEFFICIENTS,
    VARIANTS,
    attribute,
    closed_form_l23,
    design_matrix,
    interaction,
    plot,
    read_eval_samples,
    smoothed_logit,
    solve_coefficients,
    summary,
    write_csv,
)
from tests.tolerance import assert_close_ulps, ulp_tol


def test_smoothing_keeps_zero_and_full_success_finite():
    # N = 50: s = 0.5/51 and 50.5/51, so logit = log(0.5/50.5) = -log(101) and +log(101).
    z = smoothed_logit(torch.tensor([0, 50, 25]), 50)
    assert z.dtype == torch.float64 and torch.isfinite(z).all()
    assert_close_ulps(z, torch.tensor([-math.log(101), math.log(101), 0.0], dtype=torch.float64), 4)
    with pytest.raises(ValueError, match="0 <= k <= n"):
        smoothed_logit(51, 50)


def test_design_matrix_rows_are_the_papers_table():
    assert list(VARIANTS) == ["base", "reas", "tool", "joint", "hybrid_tool", "hybrid_reas"]
    assert design_matrix().tolist() == [
        [1, 0, 0, 0, 0, 0],
        [1, 0, 1, 0, 1, 0],
        [1, 1, 0, 1, 0, 0],
        [1, 1, 1, 1, 1, 1],
        [1, 1, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0],
    ]


def test_solve_recovers_a_hand_made_lambda():
    lam = torch.tensor([-1.0, 0.5, 0.25, -0.75, 1.5, -2.0], dtype=torch.float64)  # l1 l2 l3 l12 l13 l23
    z = design_matrix() @ lam
    # By hand from the table: base = l1, reas = l1+l3+l13, tool = l1+l2+l12, joint = all six,
    # hybrid_tool = l1+l2, hybrid_reas = l1+l3 (dyadic values: exact).
    assert z.tolist() == [-1.0, 0.75, -1.25, -1.5, -0.5, -0.75]
    assert_close_ulps(solve_coefficients(z[None])[0], lam, 8)
    # Closed form: -1.5 - (-1.25) - 0.75 + (-1) = -2 = l23.
    assert closed_form_l23(z[0], z[1], z[2], z[3]).item() == -2.0


def test_closed_form_equals_the_solved_l23_on_random_z():
    z = torch.randn(200, 6, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 3
    solved = solve_coefficients(z)[:, 5]
    closed = closed_form_l23(z[:, 0], z[:, 1], z[:, 2], z[:, 3])
    # An LU solve of a 6x6 integer system: a few roundings at the scale of the largest |z|.
    torch.testing.assert_close(solved, closed, rtol=0, atol=ulp_tol(z, 32))


def _counts(table: dict[str, list[int]], n: int = 10) -> dict[str, dict[str, tuple[int, int]]]:
    """variant -> [k per question] as variant -> {q<i>: (k, n)}."""
    return {v: {f"q{i}": (k, n) for i, k in enumerate(ks)} for v, ks in table.items()}


# N = 10: k = 5 gives z = 0, k = 10 gives a = log 21 = logit(10.5/11), k = 0 gives -a. By the closed form
# λ23 = z_joint - z_tool - z_reas + z_base: q0 = -2a (interference), q1 = +a (synergy), q2 never solved
# (dropped), q3 = -a, q4 = -a.
FOUR = {
    "base": [5, 5, 0, 5, 0],
    "reas": [10, 5, 0, 10, 5],
    "tool": [10, 5, 0, 5, 5],
    "joint": [5, 10, 0, 5, 5],
}


def test_filtering_and_share_of_negative_l23_match_the_hand_count():
    res = attribute(_counts(FOUR))
    assert [r.id for r in res.rows] == ["q0", "q1", "q3", "q4"] and res.kept == 4 and res.dropped == 1
    a = math.log(21)
    assert_close_ulps(res.l23, torch.tensor([-2 * a, a, -a, -a], dtype=torch.float64), 8)
    assert res.share_negative == 3 / 4
    assert all(r.coefficients is None for r in res.rows)  # no hybrids: closed form only
    assert [r.joint_accuracy for r in res.rows] == [0.5, 1.0, 0.5, 0.5]
    assert res.rows[0].k == {"base": 5, "reas": 10, "tool": 10, "joint": 5} and res.rows[0].n == 10
    text = summary(res)
    assert "75.0% of 4 kept" in text and "1 dropped" in text


def test_six_variants_give_the_full_solve_consistent_with_the_closed_form():
    res = attribute(_counts({**FOUR, "hybrid_tool": [3, 0, 0, 7, 1], "hybrid_reas": [2, 9, 0, 0, 4]}))
    assert res.variants == tuple(VARIANTS)
    for r in res.rows:
        assert list(r.coefficients) == list(COEFFICIENTS)
        assert abs(r.coefficients["l23"] - r.l23) <= ulp_tol(torch.tensor(list(r.z.values())), 32)
        assert r.coefficients["l1"] == r.z["base"]  # base's row of X is e1


def _logit(k: int, n: int) -> float:
    """The smoothed logit written out: logit((k + 1/2) / (n + 1)) = log((k + 1/2) / (n - k + 1/2))."""
    return math.log((k + 0.5) / (n - k + 0.5))


def _by_hand(z: dict[str, float]) -> dict[str, float]:
    """Each coefficient as a difference of two variants' logits, read off the paper's table (PAPERS 2.3):
    base = l1, hybrid_tool = l1 + l2, hybrid_reas = l1 + l3, tool = l1 + l2 + l12,
    reas = l1 + l3 + l13, joint = l1 + l2 + l3 + l12 + l13 + l23."""
    return {
        "l1": z["base"],
        "l2": z["hybrid_tool"] - z["base"],
        "l3": z["hybrid_reas"] - z["base"],
        "l12": z["tool"] - z["hybrid_tool"],
        "l13": z["reas"] - z["hybrid_reas"],
        "l23": z["joint"] - z["tool"] - z["reas"] + z["base"],
    }


def test_every_coefficient_of_the_full_solve_equals_its_hand_difference():
    """l1, l2, l3, l12, l13 and l23 of `attribute` (the 6x6 solve) against the differences of logits above,
    the logits computed here from the counts, not by `smoothed_logit`."""
    table = {**FOUR, "hybrid_tool": [3, 0, 0, 7, 1], "hybrid_reas": [2, 9, 0, 0, 4]}
    res = attribute(_counts(table))
    assert [r.id for r in res.rows] == ["q0", "q1", "q3", "q4"]
    for r in res.rows:
        q = int(r.id[1:])
        z = {v: _logit(ks[q], 10) for v, ks in table.items()}
        scale = torch.tensor(list(z.values()), dtype=torch.float64)
        assert r.z == pytest.approx(z, abs=ulp_tol(scale, 4))
        want = _by_hand(z)
        assert list(r.coefficients) == list(want)
        for name, value in want.items():  # an LU solve of a 6x6 integer system: a few roundings
            assert abs(r.coefficients[name] - value) <= ulp_tol(scale, 32), (r.id, name)
    # e.g. q3 by hand: l2 = z(7) - z(5) = log(7.5/3.5), l12 = z(5) - z(7) = -l2, l3 = z(0) - z(5) = -log 21
    q3 = res.rows[2].coefficients
    assert q3["l2"] == pytest.approx(math.log(7.5 / 3.5), abs=1e-12)
    assert q3["l12"] == pytest.approx(-math.log(7.5 / 3.5), abs=1e-12)
    assert q3["l3"] == pytest.approx(-math.log(21), abs=1e-12)


def test_the_solve_recovers_known_coefficients_of_many_questions():
    """z built from known λ by the table's sums (written out per variant, no design matrix): the solve
    returns λ, every coefficient in its own column."""
    lam = torch.randn(64, 6, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 2
    l1, l2, l3, l12, l13, l23 = lam.unbind(1)
    z = torch.stack(
        [l1, l1 + l3 + l13, l1 + l2 + l12, l1 + l2 + l3 + l12 + l13 + l23, l1 + l2, l1 + l3], dim=1
    )  # (Q, 6) in VARIANTS order: base, reas, tool, joint, hybrid_tool, hybrid_reas
    assert list(VARIANTS) == ["base", "reas", "tool", "joint", "hybrid_tool", "hybrid_reas"]
    torch.testing.assert_close(solve_coefficients(z), lam, rtol=0, atol=ulp_tol(z, 32))


def test_all_zero_questions_are_dropped_and_all_zero_input_is_an_error():
    res = attribute(_counts({"base": [0, 1], "reas": [0, 0], "tool": [0, 0], "joint": [0, 0]}))
    assert [r.id for r in res.rows] == ["q1"] and res.dropped == 1
    with pytest.raises(ValueError, match="none of the 2 questions"):
        attribute(_counts({v: [0, 0] for v in FOUR}))


def _write_samples(path, rows):
    path.mkdir(parents=True, exist_ok=True)
    (path / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_read_eval_samples_counts_correct_samples_per_id(tmp_path):
    rows = [{"id": "a", "sample": j, "correct": j < 2, "reward": 0.0} for j in range(3)]
    rows += [{"id": "b", "sample": j, "correct": False} for j in range(3)]
    _write_samples(tmp_path / "ev", rows)
    assert read_eval_samples(tmp_path / "ev") == {"a": (2, 3), "b": (0, 3)}
    assert read_eval_samples(tmp_path / "ev" / "samples.jsonl") == {"a": (2, 3), "b": (0, 3)}
    _write_samples(tmp_path / "dup", rows + rows[:1])
    with pytest.raises(ValueError, match="appears twice"):
        read_eval_samples(tmp_path / "dup")
    _write_samples(tmp_path / "bad", [{"id": "a", "sample": 0}])
    with pytest.raises(ValueError, match="samples.jsonl:1"):
        read_eval_samples(tmp_path / "bad")


def test_interaction_end_to_end_from_eval_directories(tmp_path):
    dirs = {}
    for v, ks in FOUR.items():
        rows = [{"id": f"q{i}", "sample": j, "correct": j < k} for i, k in enumerate(ks) for j in range(10)]
        _write_samples(tmp_path / v, rows)
        dirs[v] = tmp_path / v
    assert interaction(dirs).l23.tolist() == attribute(_counts(FOUR)).l23.tolist()


def test_mismatched_questions_or_sample_counts_raise():
    c = _counts(FOUR)
    del c["tool"]["q3"]
    with pytest.raises(ValueError, match="'tool'.*first mismatch: 'q3'"):
        attribute(c)
    c = _counts(FOUR)
    c["reas"]["q9"] = (1, 10)
    with pytest.raises(ValueError, match="'reas'.*first mismatch: 'q9'"):
        attribute(c)
    c = _counts(FOUR)
    c["joint"]["q1"] = (10, 12)
    with pytest.raises(ValueError, match="'joint': 'q1' has n=12, base has n=10"):
        attribute(c)


def test_variant_name_errors():
    with pytest.raises(ValueError, match="no variants"):
        interaction({})
    with pytest.raises(ValueError, match="unknown.*'unified'.*allowed: base, reas"):
        interaction({"unified": "x", "base": "x"})
    with pytest.raises(ValueError, match=r"missing.*\['joint'\]"):
        attribute(_counts({v: ks for v, ks in FOUR.items() if v != "joint"}))
    with pytest.raises(ValueError, match="both hybrids"):
        attribute(_counts({**FOUR, "hybrid_tool": [1, 1, 1, 1, 1]}))


def test_csv_has_the_header_and_one_row_per_kept_question(tmp_path):
    res = attribute(_counts({**FOUR, "hybrid_tool": [3, 0, 0, 7, 1], "hybrid_reas": [2, 9, 0, 0, 4]}))
    path = write_csv(res, tmp_path / "leas.csv")
    with path.open() as f:
        table = list(csv.reader(f))
    z_cols = [f"z_{v}" for v in VARIANTS]
    assert table[0] == [
        "id",
        "n",
        *(f"k_{v}" for v in VARIANTS),
        *z_cols,
        *COEFFICIENTS,
        "l23_closed",
        "joint_accuracy",
    ]
    assert [row[0] for row in table[1:]] == ["q0", "q1", "q3", "q4"]
    assert [float(row[-2]) for row in table[1:]] == res.l23.tolist()  # full precision round-trips
    assert not (tmp_path / "leas.csv.tmp").exists()
    four = list(csv.reader(write_csv(attribute(_counts(FOUR)), tmp_path / "four.csv").open()))
    assert "l12" not in four[0] and len(four) == 5


def test_plot_writes_a_png(tmp_path):
    path = plot(attribute(_counts(FOUR)), tmp_path / "leas.png", bins=5)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 1000
