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
- `separate`: the `isolated` table, each role on its own base model (`model_of`; MSARL's reasoner and
  small tool agents): a role's turns run on and train only its model's adapter;
- `none`: base model only (a frozen reference, or evaluation);
- a custom table (`from_table`): role -> adapter for every kind, or role -> {kind: adapter | None}.

A route is the pair `(model_of[role], table[role, kind])`: an adapter lives in one model, so adapter names
are unique across models and one adapter never serves roles of two models.

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
    model_of: Mapping[str, str] = field(default_factory=dict)  # role -> model name; default "main"

    def __post_init__(self) -> None:
        roles = self.roles
        if not roles:
            raise ValueError("Topology.table is empty: give at least one role")
        unknown = sorted(set(self.model_of) - set(roles))
        if unknown:
            raise ValueError(f"Topology.model_of names roles {unknown} that the table lacks; roles: {roles}")
        home: dict[str, str] = {}
        for (role, _), name in self.table.items():
            if name is not None and home.setdefault(name, self.model(role)) != self.model(role):
                raise ValueError(
                    f"adapter {name!r} serves roles on models {home[name]!r} and {self.model(role)!r}; an "
                    "adapter lives in one model: give each model's roles their own adapter names"
                )
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
        cls,
        name: str,
        roles: Sequence[str],
        train_kinds: Sequence[str] | Mapping[str, Sequence[str]] | None = None,
        model_of: Mapping[str, str] | None = None,
    ) -> Topology:
        """The preset `name` (one of `PRESETS`) for the workflow's `roles`. `train_kinds` (the kinds with
        loss: one list for every role, or per role) is required by `masked` and narrows the loss of any
        other preset. `model_of` puts roles on other models than "main"; `separate` needs every role on a
        model of its own."""
        if name not in PRESETS:
            raise ValueError(f"unknown topology preset {name!r}; allowed: {sorted(PRESETS)}")
        _check_roles(roles)
        if name == "masked" and not train_kinds:
            raise ValueError(
                f"the masked preset needs train_kinds: the kinds that carry loss, a non-empty subset of "
                f"{sorted(POLICY_KINDS)} (e.g. [reasoning])"
            )
        model_of = dict(model_of or {})
        if name == "separate":
            on = [model_of.get(r, "main") for r in roles]
            shared = sorted(r for r, m in zip(roles, on, strict=True) if on.count(m) > 1)
            if shared:
                raise ValueError(
                    f"the separate preset runs every role on its own model, but roles {shared} share one; "
                    "name a model per role (roles.<role>.model and models.<name>)"
                )
        rule = PRESETS[name]
        table = {(r, k): rule(r, k) for r in roles for k in KINDS}
        return cls(table, preset=name, train_kinds=_kinds_of(roles, train_kinds), model_of=model_of)

    @classmethod
    def from_table(
        cls,
        spec: Mapping[str, str | Mapping[str, str | None]],
        roles: Sequence[str],
        train_kinds: Sequence[str] | Mapping[str, Sequence[str]] | None = None,
        model_of: Mapping[str, str] | None = None,
    ) -> Topology:
        """A custom table: `spec[role]` is an adapter name (every kind), or `{kind: adapter | None, default:
        adapter | None}`, a kind not listed taking `default`. Every role of the workflow needs an entry,
        every policy kind with loss must be mapped (explicitly or by `default`; None = base only), and the
        errors name the entry."""
        _check_roles(roles)
        missing = [r for r in roles if r not in spec]
        if missing or set(spec) - set(roles):
            raise ValueError(
                f"adapters.table must have one entry per role of the workflow {list(roles)}; "
                + (f"missing {missing}" if missing else f"unknown roles {sorted(set(spec) - set(roles))}")
            )
        kinds_of = _kinds_of(roles, train_kinds)
        table: dict[tuple[str, str], str | None] = {}
        for role in roles:
            entry = spec[role]
            if isinstance(entry, str):
                entry = {"default": entry}
            bad = sorted(set(entry) - {*KINDS, "default"})
            if bad:
                raise ValueError(
                    f"adapters.table.{role} has keys {bad}; allowed: the kinds {list(KINDS)} and default"
                )
            for kind in KINDS:
                if kind in entry or "default" in entry:
                    table[(role, kind)] = entry.get(kind, entry.get("default"))
                elif kind in kinds_of.get(role, POLICY_KINDS):
                    raise ValueError(
                        f"adapters.table.{role} leaves {kind!r} unmapped, and {role}'s {kind} tokens carry "
                        "loss: map it to an adapter (or null for base only), or give a default"
                    )
                else:
                    table[(role, kind)] = None  # a kind without loss, not listed: base only
                name = table[(role, kind)]
                if name is not None and (not isinstance(name, str) or not name):
                    raise ValueError(f"adapters.table.{role}.{kind}={name!r}; give an adapter name or null")
        return cls(table, preset="custom", train_kinds=kinds_of, model_of=dict(model_of or {}))

    def model(self, role: str) -> str:
        """The model that runs `role`'s calls (and holds its adapters)."""
        return self.model_of.get(role, "main")

    @property
    def models(self) -> list[str]:
        """The models this topology uses, in role order."""
        return list(dict.fromkeys(self.model(r) for r in self.roles))

    def adapters_of_model(self, model: str) -> list[str]:
        """The adapters that live in `model`, in order of first use."""
        return [n for n in self.adapter_names() if any(
            self.table[(r, k)] == n and self.model(r) == model for r in self.roles for k in KINDS)]  # fmt: skip

    def route(self, role: str, kind: str) -> tuple[str, str | None]:
        """The route of a `(role, kind)` token: `(model, adapter or None)`."""
        return self.model(role), self.adapter_of(role, kind)

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


def _check_roles(roles: Sequence[str]) -> None:
    if not roles or len(set(roles)) != len(roles) or not all(isinstance(r, str) and r for r in roles):
        raise ValueError(f"roles must be distinct non-empty names; got {list(roles)}")


def _kinds_of(
    roles: Sequence[str], train_kinds: Sequence[str] | Mapping[str, Sequence[str]] | None
) -> dict[str, frozenset[str]]:
    """`train_kinds` as role -> kinds: one list for every role, or a mapping per role."""
    if not train_kinds:
        return {}
    if isinstance(train_kinds, Mapping):
        return {r: frozenset(k) for r, k in train_kinds.items() if k}
    return {r: frozenset(train_kinds) for r in roles}


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
    "separate": _isolated,  # the isolated table; `model_of` puts each role on its own model
    "none": _none,
}
