"""The topology: which adapter (or the base model) computes each `(role, kind)` of token.

A topology is a table `(role, kind) -> adapter name | None` (None = base only, route -1). `route_of`
resolves the names to a model's adapter indices, giving the `kind -> route` map that `rolerl.roles.shift`
turns into per-position routes. Presets (DESIGN "Preset defaults"):

- `shared`: every role and kind -> one adapter `policy` (joint policy, SP);
- `dart`: `tool_call` -> `tool`, every other kind (prompt, reasoning, tool output, answer) -> `reason`
  (DART's two token-routed adapters);
- `isolated`: every kind of a role -> an adapter named after the role (IP), so serving one role's adapter
  with PEFT or vLLM computes exactly what training computed;
- `masked`: the `shared` table, trained only on the kinds in `train_kinds` (e.g. reasoning only): every
  token still runs through the adapter, only the chosen kinds carry loss (the interaction analysis needs
  the reasoning-only and tool-only variants);
- `none`: base model only (a frozen reference, or evaluation).

`train_kinds[role]` is the set of kinds whose tokens carry loss for that role (default: every policy kind:
reasoning, tool call, answer). It changes the loss mask only, never the routes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from rolerl.roles import KINDS, POLICY_KINDS, TOOL_CALL


@dataclass(frozen=True)
class Topology:
    """`table[(role, kind)]` is the adapter name that computes positions predicting such a token."""

    table: Mapping[tuple[str, str], str | None]
    preset: str = "custom"
    train_kinds: Mapping[str, frozenset[str]] = field(default_factory=dict)  # role -> kinds with loss

    def __post_init__(self) -> None:
        roles = self.roles
        if not roles:
            raise ValueError("Topology.table is empty: give at least one role")
        for role, kinds in self.train_kinds.items():
            if role not in roles or not kinds or not set(kinds) <= POLICY_KINDS:
                raise ValueError(
                    f"Topology.train_kinds[{role!r}]={sorted(kinds)}; allowed: a role of the table "
                    f"{roles} and a non-empty subset of {sorted(POLICY_KINDS)}"
                )
        for role, kind in self.table:
            if kind not in KINDS:
                raise ValueError(
                    f"Topology.table has kind {kind!r} for role {role!r}; allowed: {list(KINDS)}"
                )
        missing = [(r, k) for r in roles for k in KINDS if (r, k) not in self.table]
        if missing:
            raise ValueError(f"Topology.table lacks {missing}; every role needs all kinds {list(KINDS)}")

    @classmethod
    def from_preset(
        cls, name: str, roles: Sequence[str], train_kinds: Sequence[str] | None = None
    ) -> Topology:
        """The preset `name` (one of `PRESETS`) for the workflow's `roles`; `train_kinds` (every role's
        kinds with loss) is required by `masked` and narrows the loss of any other preset."""
        if name not in PRESETS:
            raise ValueError(f"unknown topology preset {name!r}; allowed: {sorted(PRESETS)}")
        if not roles or len(set(roles)) != len(roles) or not all(isinstance(r, str) and r for r in roles):
            raise ValueError(f"roles must be distinct non-empty names; got {list(roles)}")
        if name == "masked" and not train_kinds:
            raise ValueError(
                f"the masked preset needs train_kinds: the kinds that carry loss, a non-empty subset of "
                f"{sorted(POLICY_KINDS)} (e.g. [reasoning])"
            )
        rule = PRESETS[name]
        kinds = {r: frozenset(train_kinds) for r in roles} if train_kinds else {}
        return cls({(r, k): rule(r, k) for r in roles for k in KINDS}, preset=name, train_kinds=kinds)

    def loss_kinds(self, role: str) -> frozenset[str]:
        """The kinds whose tokens carry loss for `role` (`train_kinds`, default every policy kind)."""
        return self.train_kinds.get(role, POLICY_KINDS)

    @property
    def roles(self) -> list[str]:
        return list(dict.fromkeys(r for r, _ in self.table))

    def adapter_names(self) -> list[str]:
        """The adapters this topology needs, in order of first use (role order, then `KINDS` order)."""
        names = (self.table[(r, k)] for r in self.roles for k in KINDS)
        return list(dict.fromkeys(n for n in names if n is not None))

    def adapter_of(self, role: str, kind: str) -> str | None:
        if role not in self.roles:
            raise ValueError(f"unknown role {role!r}; this topology has roles {self.roles}")
        if kind not in KINDS:
            raise ValueError(f"unknown kind {kind!r}; allowed: {list(KINDS)}")
        return self.table[(role, kind)]

    def route_of(self, role: str, adapter_index: Mapping[str, int]) -> dict[str, int]:
        """`kind -> route` for `role`, with names resolved through the model's `adapter_index`
        (`{name: i}` in the model's adapter order); base-only kinds get -1."""
        out: dict[str, int] = {}
        for kind in KINDS:
            name = self.adapter_of(role, kind)
            if name is None:
                out[kind] = -1
            elif name in adapter_index:
                out[kind] = adapter_index[name]
            else:
                raise ValueError(
                    f"topology {self.preset!r} routes ({role!r}, {kind!r}) to adapter {name!r}, "
                    f"but the model has adapters {list(adapter_index)}"
                )
        return out


def _shared(role: str, kind: str) -> str | None:
    return "policy"


def _dart(role: str, kind: str) -> str | None:
    return "tool" if kind == TOOL_CALL else "reason"


def _isolated(role: str, kind: str) -> str | None:
    return role


def _none(role: str, kind: str) -> str | None:
    return None


PRESETS: dict[str, Callable[[str, str], str | None]] = {
    "shared": _shared,
    "masked": _shared,  # the shared table; `train_kinds` decides which kinds carry loss
    "dart": _dart,
    "isolated": _isolated,
    "none": _none,
}
