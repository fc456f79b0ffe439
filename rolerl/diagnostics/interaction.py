"""LEAS / Capability Effect Attribution (DART §4, App. C; PAPERS 2.3): per question, how much of the joint
model's success comes from training reasoning and tool use *together* rather than apart.

Each model variant is an indicator vector x = [x1, x2, x3, x12, x13, x23] (base, tool, reasoning, and
"jointly optimised in one parameter subspace"); the question's logit success is z = x^T λ (Eq. 6). Six
variants give z = X λ (Eq. 7), solved per question; λ23 < 0 means the two capabilities interfere when they
share parameters, λ23 > 0 that they help each other. The closed form (Eq. 19/20)
λ23 = z_joint − z_tool − z_reas + z_base needs only the four trained variants. Attribution, not
prediction (Remark 4.4).
"""

from __future__ import annotations

import csv
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from rolerl.report.plots import save_png

# name -> x = [x1, x2, x3, x12, x13, x23], the table of PAPERS 2.3 (joint = the paper's M_Unified). The
# hybrids compose two models at inference only, so no pair is optimised together: their x12/x13/x23 are 0.
VARIANTS: dict[str, tuple[int, ...]] = {
    "base": (1, 0, 0, 0, 0, 0),
    "reas": (1, 0, 1, 0, 1, 0),
    "tool": (1, 1, 0, 1, 0, 0),
    "joint": (1, 1, 1, 1, 1, 1),
    "hybrid_tool": (1, 1, 0, 0, 0, 0),
    "hybrid_reas": (1, 0, 1, 0, 0, 0),
}
TRAINED = ("base", "reas", "tool", "joint")  # required; the closed form needs exactly these
HYBRIDS = ("hybrid_tool", "hybrid_reas")  # optional, both or neither (the 6x6 solve needs both)
COEFFICIENTS = ("l1", "l2", "l3", "l12", "l13", "l23")


def design_matrix() -> Tensor:
    """X (6, 6) float64, one row per variant in `VARIANTS` order (Eq. 7)."""
    return torch.tensor(list(VARIANTS.values()), dtype=torch.float64)


def smoothed_logit(k: Tensor | int, n: Tensor | int) -> Tensor:
    """logit(s) with s = (k + 0.5) / (n + 1) for k successes in n samples (float64, elementwise).

    The paper leaves s ∈ {0, 1} open (its logit is ±inf); this add-half smoothing keeps s inside (0, 1)
    and is symmetric (k = 0 and k = n give opposite logits, ±log(2n + 1))."""
    k, n = torch.as_tensor(k, dtype=torch.float64), torch.as_tensor(n, dtype=torch.float64)
    if bool((k < 0).any() | (k > n).any()):
        raise ValueError("successes k must satisfy 0 <= k <= n")
    return torch.logit((k + 0.5) / (n + 1))


def solve_coefficients(z: Tensor) -> Tensor:
    """λ (Q, 6) = X^{-1} z per question, from z (Q, 6) in `VARIANTS` order (a linear solve, no inverse)."""
    return torch.linalg.solve(design_matrix(), z.to(torch.float64).T).T


def closed_form_l23(z_base: Tensor, z_reas: Tensor, z_tool: Tensor, z_joint: Tensor) -> Tensor:
    """λ23 = z_joint − z_tool − z_reas + z_base (App. C, Eq. 19/20): the joint improvement over base minus
    the two separate improvements (x_joint − x_tool − x_reas + x_base = e_23)."""
    return z_joint - z_tool - z_reas + z_base


def read_eval_samples(path: str | Path) -> dict[str, tuple[int, int]]:
    """question id -> (k correct, n samples) from a `rolerl eval` output (its directory or `samples.jsonl`),
    in the order ids first appear."""
    path = Path(path)
    if path.is_dir():
        path = path / "samples.jsonl"
    counts: dict[str, tuple[int, int]] = {}
    seen: set[tuple[str, int]] = set()
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            qid, sample, correct = str(row["id"]), int(row["sample"]), bool(row["correct"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}:{i}: not a sample with id, sample, correct ({e})") from None
        if (qid, sample) in seen:  # counted twice, it would bias k/n
            raise ValueError(f"{path}:{i}: sample {sample} of {qid!r} appears twice")
        seen.add((qid, sample))
        k, n = counts.get(qid, (0, 0))
        counts[qid] = (k + correct, n + 1)
    if not counts:
        raise ValueError(f"{path}: no samples")
    return counts


@dataclass
class QuestionRow:
    """One kept question."""

    id: str
    n: int  # samples per variant (the same for every variant; checked)
    k: dict[str, int]  # variant -> correct samples
    z: dict[str, float]  # variant -> smoothed logit
    l23: float  # closed form (Eq. 19/20), from the four trained variants
    joint_accuracy: float  # k_joint / n, the accuracy overlay of Fig. 2
    coefficients: dict[str, float] | None = None  # l1..l23 from the 6x6 solve; None without the hybrids


@dataclass
class InteractionResult:
    """Per-question attribution over the questions some variant solved at least once (§4.3)."""

    variants: tuple[str, ...]  # in `VARIANTS` order
    rows: list[QuestionRow]
    dropped: int  # questions no variant ever solved

    @property
    def kept(self) -> int:
        return len(self.rows)

    @property
    def l23(self) -> Tensor:
        return torch.tensor([r.l23 for r in self.rows], dtype=torch.float64)

    @property
    def share_negative(self) -> float:
        """Share of kept questions with λ23 < 0 (interference; Fig. 2 reports 42-67%)."""
        return float((self.l23 < 0).double().mean())


def _check_variants(names: list[str]) -> None:
    if not names:
        raise ValueError(f"no variants given; need {', '.join(TRAINED)}, optionally {', '.join(HYBRIDS)}")
    if unknown := [v for v in names if v not in VARIANTS]:
        raise ValueError(f"unknown variant(s) {unknown}; allowed: {', '.join(VARIANTS)}")
    if missing := [v for v in TRAINED if v not in names]:
        raise ValueError(f"missing variant(s) {missing}; required: {', '.join(TRAINED)}")
    if sum(h in names for h in HYBRIDS) == 1:
        raise ValueError(f"give both hybrids ({', '.join(HYBRIDS)}) or neither; the 6x6 solve needs both")


def attribute(counts: Mapping[str, Mapping[str, tuple[int, int]]]) -> InteractionResult:
    """The attribution from variant -> question id -> (k, n). Every variant must cover the same ids with
    the same n (λ is per question, from one z per variant)."""
    _check_variants(list(counts))
    base = counts["base"]
    if not base:
        raise ValueError("variant 'base' has no questions")
    ids = list(base)
    for v, c in counts.items():
        if extra := [q for q in ids if q not in c] + [q for q in c if q not in base]:
            raise ValueError(f"variant {v!r} and base cover other questions; first mismatch: {extra[0]!r}")
        if bad := [q for q in ids if c[q][1] != base[q][1]]:
            raise ValueError(f"variant {v!r}: {bad[0]!r} has n={c[bad[0]][1]}, base has n={base[bad[0]][1]}")
    variants = tuple(v for v in VARIANTS if v in counts)
    k = torch.tensor([[counts[v][q][0] for v in variants] for q in ids], dtype=torch.int64)  # (Q, V)
    n = torch.tensor([base[q][1] for q in ids], dtype=torch.int64)  # (Q,)
    keep = (k >= 1).any(dim=1)
    if not keep.any():
        raise ValueError(f"none of the {len(ids)} questions has a correct sample under any variant")
    z = smoothed_logit(k, n[:, None])  # (Q, V)
    col = {v: z[:, i] for i, v in enumerate(variants)}
    l23 = closed_form_l23(col["base"], col["reas"], col["tool"], col["joint"])
    lam = solve_coefficients(z) if len(variants) == len(VARIANTS) else None  # (Q, 6)
    acc = k[:, variants.index("joint")].double() / n
    rows = [
        QuestionRow(
            id=ids[q],
            n=int(n[q]),
            k=dict(zip(variants, k[q].tolist(), strict=True)),
            z=dict(zip(variants, z[q].tolist(), strict=True)),
            l23=float(l23[q]),
            joint_accuracy=float(acc[q]),
            coefficients=None if lam is None else dict(zip(COEFFICIENTS, lam[q].tolist(), strict=True)),
        )
        for q in keep.nonzero().flatten().tolist()
    ]
    return InteractionResult(variants, rows, dropped=len(ids) - len(rows))


def interaction(samples: Mapping[str, str | Path]) -> InteractionResult:
    """The attribution from variant name -> `rolerl eval` output directory (or its `samples.jsonl`)."""
    _check_variants(list(samples))
    return attribute({v: read_eval_samples(p) for v, p in samples.items()})


def write_csv(result: InteractionResult, path: str | Path) -> Path:
    """One row per kept question (written atomically): id, n, k_/z_ per variant, l1..l23 when solved,
    l23_closed, joint_accuracy."""
    path = Path(path)
    solved = result.rows[0].coefficients is not None
    header = ["id", "n", *(f"k_{v}" for v in result.variants), *(f"z_{v}" for v in result.variants)]
    header += [*(COEFFICIENTS if solved else ()), "l23_closed", "joint_accuracy"]
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        for r in result.rows:
            coef = [r.coefficients[c] for c in COEFFICIENTS] if r.coefficients else []
            w.writerow([r.id, r.n, *r.k.values(), *r.z.values(), *coef, r.l23, r.joint_accuracy])
    tmp.replace(path)
    return path


def plot(result: InteractionResult, path: str | Path, bins: int = 30) -> Path:
    """Histogram of λ23 over questions, a line at 0, and on a second axis the mean joint-variant accuracy
    of each bin (Fig. 2's overlay), as a PNG (written atomically)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    path = Path(path)
    l23, acc = result.l23.numpy(), np.array([r.joint_accuracy for r in result.rows])
    fig, ax = plt.subplots(figsize=(6, 3.5))
    _, edges, _ = ax.hist(l23, bins=bins, color="tab:blue", alpha=0.6)
    ax.axvline(0.0, color="k", linestyle="--", linewidth=1)
    ax.set_xlabel("λ23 (< 0: interference, > 0: synergy)")
    ax.set_ylabel("questions")
    which = np.clip(np.digitize(l23, edges) - 1, 0, len(edges) - 2)  # the last edge is inclusive
    used = np.unique(which)
    ax2 = ax.twinx()
    centres = (edges[used] + edges[used + 1]) / 2
    ax2.plot(centres, [acc[which == b].mean() for b in used], "o-", color="tab:red")
    ax2.set_ylabel("joint accuracy (bin mean)", color="tab:red")
    ax2.set_ylim(0, 1)
    ax.set_title(f"λ23 < 0 on {result.share_negative:.1%} of {result.kept} questions")
    fig.tight_layout()
    return save_png(fig, path)


def summary(result: InteractionResult) -> str:
    """A few lines: the share with λ23 < 0, mean and median λ23, and the question counts."""
    l23 = result.l23
    return (
        f"λ23 < 0 (interference) on {result.share_negative:.1%} of {result.kept} kept questions "
        f"({result.dropped} dropped: no variant solved them)\n"
        f"λ23 mean {float(l23.mean()):+.3f}, median {float(l23.quantile(0.5)):+.3f}; "
        f"variants: {', '.join(result.variants)}"
    )
