"""The `(role, kind) -> adapter` table: presets, name resolution, and errors that name allowed values."""

from __future__ import annotations

import pytest

from rolerl.models.topology import PRESETS, Topology
from rolerl.roles import KINDS, POLICY_KINDS, shift

ROLES = ["reasoner", "coder"]


def test_presets_tables():
    shared = Topology.from_preset("shared", ROLES)
    assert shared.adapter_names() == ["policy"]
    assert {shared.adapter_of(r, k) for r in ROLES for k in KINDS} == {"policy"}

    dart = Topology.from_preset("dart", ROLES)
    assert dart.adapter_names() == ["reason", "tool"]
    assert {k: dart.adapter_of("reasoner", k) for k in KINDS} == {
        "prompt": "reason",
        "reasoning": "reason",
        "tool_call": "tool",
        "tool_output": "reason",
        "answer": "reason",
    }

    iso = Topology.from_preset("isolated", ROLES)
    assert iso.adapter_names() == ["reasoner", "coder"]
    assert {iso.adapter_of("coder", k) for k in KINDS} == {"coder"}  # prompt and tool output included

    none = Topology.from_preset("none", ROLES)
    assert none.adapter_names() == [] and none.route_of("coder", {}) == dict.fromkeys(KINDS, -1)
    assert sorted(PRESETS) == ["dart", "isolated", "masked", "none", "separate", "shared"]

    masked = Topology.from_preset("masked", ROLES, ["reasoning"])
    assert masked.table == shared.table  # the same routes: only the loss differs
    assert masked.loss_kinds("coder") == {"reasoning"} and shared.loss_kinds("coder") == set(POLICY_KINDS)


def test_masked_needs_policy_kinds():
    with pytest.raises(ValueError, match="masked preset needs train_kinds"):
        Topology.from_preset("masked", ROLES)
    with pytest.raises(ValueError, match=r"train_kinds\['reasoner'\]=\['tool_output'\]; allowed"):
        Topology.from_preset("masked", ROLES, ["tool_output"])


def test_route_of_resolves_model_indices():
    dart = Topology.from_preset("dart", ["agent"])
    # The model may hold more adapters, in any order: names resolve through its index.
    route_of = dart.route_of("agent", {"other": 0, "tool": 1, "reason": 2})
    assert route_of == {"prompt": 2, "reasoning": 2, "tool_call": 1, "tool_output": 2, "answer": 2}
    # The DART convention end to end: the reasoning adapter opens the call, the tool adapter writes it.
    kinds = ["prompt", "reasoning", "tool_call", "tool_call", "tool_output", "reasoning"]
    assert shift(kinds, route_of) == [2, 1, 1, 2, 2, 2]


def test_route_of_with_real_adapters(tiny):
    from rolerl.models.lora import adapter_specs, add_adapters

    model, _ = tiny
    iso = Topology.from_preset("isolated", ROLES)
    add_adapters(model, iso.adapter_names(), rank=2)
    index = {name: i for i, name in enumerate(adapter_specs(model))}
    assert iso.route_of("coder", index) == dict.fromkeys(KINDS, 1)


def test_errors_name_allowed_values():
    with pytest.raises(ValueError, match=r"unknown topology preset 'dartt'; allowed: \['dart'"):
        Topology.from_preset("dartt", ROLES)
    with pytest.raises(ValueError, match="distinct"):
        Topology.from_preset("shared", ["a", "a"])
    dart = Topology.from_preset("dart", ROLES)
    with pytest.raises(
        ValueError, match=r"unknown role 'judge'; this topology has roles \['reasoner', 'coder'\]"
    ):
        dart.adapter_of("judge", "reasoning")
    with pytest.raises(ValueError, match="unknown kind 'code'; allowed"):
        dart.adapter_of("coder", "code")
    with pytest.raises(ValueError, match=r"adapter 'tool', but the model has adapters \['reason'\]"):
        dart.route_of("coder", {"reason": 0})


def test_custom_table_must_be_complete():
    table = {("agent", k): ("tool" if k == "tool_call" else None) for k in KINDS}
    topo = Topology(table)
    assert topo.adapter_names() == ["tool"] and topo.route_of("agent", {"tool": 0})["reasoning"] == -1
    del table[("agent", "answer")]
    with pytest.raises(ValueError, match="lacks.*answer"):
        Topology(table)
    with pytest.raises(ValueError, match="kind 'code'"):
        Topology({**table, ("agent", "answer"): None, ("agent", "code"): None})
