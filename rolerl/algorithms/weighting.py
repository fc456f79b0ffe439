"""Each role's share of a loss: per-sequence weights that make the aggregated loss `Σ_r s_r · L_r`.

`L_r` is role r's loss aggregated over its own sequences (its own token count for `token-mean`, its own
non-empty sequence count for the `seq-mean-*` modes), and `s_r` its share. Aggregation is linear in the
loss matrix, so scaling role r's rows by `f_r = s_r · D / D_r` (D the whole batch's denominator count, D_r
role r's) turns the plain aggregate into exactly that sum. Shares (PAPERS 1.6-1.7: with one shared
adapter, `seq-mean-token-mean` silently gives each role its share of the outputs, 3/4 to three voters and
1/4 to one aggregator):

- `aggregate`: no reweighting; the aggregation mode decides (`seq-mean-*`: outputs, `token-mean`: tokens);
- `outputs`: `s_r = G_r / G`, each role its share of the (non-empty) sequences;
- `tokens`: `s_r = N_r / N`, each role its share of the loss tokens;
- `equal`: `s_r = 1 / R`, R the roles present (count-equalising);
- `{role: w}`: `s_r = w_r / Σ w` over the roles present.

Shares are over the roles that have loss tokens in the batch (one optimizer step's mini-batch); a role
absent from it has nothing to weigh and the others' shares are renormalised.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

SHARES = ("aggregate", "outputs", "tokens", "equal")


def role_share_weights(
    lengths: Tensor, role_ids: Tensor, role_names: Sequence[str], agg: str, share: str | Mapping[str, float]
) -> Tensor:
    """`(B,)` per-sequence multipliers `f_r` for the share rule `share`.

    `lengths` `(B,)`: loss tokens per sequence; `role_ids` `(B,)`: index into `role_names`; `agg`: the
    aggregation mode (decides the denominators). Rows without loss tokens get 1 (they contribute nothing).
    """
    if isinstance(share, str) and share not in SHARES:
        raise ValueError(f"role_share={share!r}; allowed: {list(SHARES)} or a mapping role -> weight")
    out = torch.ones(lengths.shape[0], dtype=torch.float64)
    if share == "aggregate":
        return out
    live = lengths > 0  # (B,)
    present = sorted({int(r) for r in role_ids[live].tolist()})
    if not present:
        return out
    tokens = {r: float(lengths[live & (role_ids == r)].sum()) for r in present}  # N_r
    seqs = {r: float((live & (role_ids == r)).sum()) for r in present}  # G_r
    n, g = sum(tokens.values()), sum(seqs.values())
    own = tokens if agg == "token-mean" else seqs  # the denominator counts of the aggregation mode
    total = n if agg == "token-mean" else g
    if share == "outputs":
        shares = {r: seqs[r] / g for r in present}
    elif share == "tokens":
        shares = {r: tokens[r] / n for r in present}
    elif share == "equal":
        shares = {r: 1.0 / len(present) for r in present}
    else:
        missing = [role_names[r] for r in present if role_names[r] not in share]
        if missing:
            raise ValueError(f"role_share has no weight for roles {missing}; give one per role")
        weights = {r: float(share[role_names[r]]) for r in present}
        norm = sum(weights.values())
        if norm <= 0:
            raise ValueError(f"role_share weights of the roles present {weights} sum to 0")
        shares = {r: w / norm for r, w in weights.items()}
    for r in present:
        out[role_ids == r] = shares[r] * total / own[r]
    return out


def loss_shares(lengths: Tensor, role_ids: Tensor, weights: Tensor, agg: str) -> dict[int, float]:
    """Each role's share of the loss's weight: `Σ_{i∈r} w_i d_i / Σ_i w_i d_i`, with `d_i` a sequence's
    tokens (`token-mean`) or 1 for a non-empty sequence (`seq-mean-*`): what `role_share_weights` sets."""
    live = lengths > 0
    d = lengths.to(torch.float64) if agg == "token-mean" else live.to(torch.float64)
    mass = weights.to(torch.float64) * d  # (B,)
    total = float(mass.sum())
    if total == 0:
        return {}
    return {int(r): float(mass[role_ids == r].sum()) / total for r in sorted(set(role_ids[live].tolist()))}
