"""Gradient conflict between token kinds: angles on hand-made gradients where the answer is known, module
cosines that add up to the overall one by their norms, partial gradients equal to an independent
backward over each kind's tokens, and a measurement that leaves the model as it was."""

from __future__ import annotations

import csv
import json
import math

import pytest
import torch

from rolerl.diagnostics.conflict import ConflictReport, episode_gradients, select_params
from rolerl.models.lora import add_adapters
from rolerl.models.tiny import tiny_model
from rolerl.models.topology import Topology
from rolerl.roles import PROMPT, shift
from rolerl.train.grad_conflict import cosine, layer_of, module_of
from rolerl.train.policy import token_logprobs
from rolerl.types import Episode, Turn, collate
from tests.tolerance import assert_close_ulps


def grads(**modules: list[float]) -> dict[str, torch.Tensor]:
    return {name.replace("_", "."): torch.tensor(v) for name, v in modules.items()}


def test_angles_of_parallel_orthogonal_and_opposed_gradients():
    a = grads(layers_0_q=[1.0, 0.0], layers_1_q=[0.0, 2.0])
    assert cosine(a, a).cos == pytest.approx(1.0) and cosine(a, a).degrees == pytest.approx(0.0, abs=1e-5)
    ortho = cosine(a, grads(layers_0_q=[0.0, 1.0], layers_1_q=[3.0, 0.0]))
    assert ortho.cos == 0.0 and ortho.degrees == pytest.approx(90.0) and ortho.conflict_frac == 0.0
    # module 0 opposed, module 1 aligned: overall positive, half the modules in conflict
    mixed = cosine(a, grads(layers_0_q=[-1.0, 0.0], layers_1_q=[0.0, 1.0]))
    assert mixed.modules == {"layers.0.q": -1.0, "layers.1.q": 1.0} and mixed.conflict_frac == 0.5
    assert mixed.layers == {"layer 00": -1.0, "layer 01": 1.0}
    assert mixed.cos == pytest.approx((-1 * 1 + 2 * 1) / (math.sqrt(5) * math.sqrt(2)))
    assert cosine(a, grads(layers_0_q=[0.0, 0.0], layers_1_q=[0.0, 0.0])) is None  # no direction


def test_module_cosines_add_up_to_the_overall_one_by_their_norms():
    gen = torch.Generator().manual_seed(0)
    a = {
        f"layers.{i}.m{j}": torch.randn(7, generator=gen, dtype=torch.float64)
        for i in range(3)
        for j in range(2)
    }
    b = {m: torch.randn(7, generator=gen, dtype=torch.float64) for m in a}
    angle = cosine(a, b)
    na, nb = {m: a[m].norm() for m in a}, {m: b[m].norm() for m in b}
    total = math.sqrt(sum(float(x) ** 2 for x in na.values())) * math.sqrt(
        sum(float(x) ** 2 for x in nb.values())
    )
    weighted = sum(float(na[m] * nb[m]) * angle.modules[m] for m in a) / total
    flat = float(torch.cat(list(a.values())) @ torch.cat(list(b.values()))) / total
    assert angle.cos == pytest.approx(weighted, rel=1e-12) and angle.cos == pytest.approx(flat, rel=1e-6)


def test_report_pairs_same_kind_across_and_kinds_within_trajectories():
    t0 = {"reasoning": grads(layers_0_q=[1.0, 0.0]), "tool_call": grads(layers_0_q=[0.0, 1.0])}
    t1 = {"reasoning": grads(layers_0_q=[1.0, 1.0])}
    report = ConflictReport()
    report.add("q0", [t0, t1])
    got = {(p.comparison, p.a, p.b, p.i, p.j): round(p.angle.degrees, 6) for p in report.pairs}
    assert got == {
        ("same", "reasoning", "reasoning", 0, 1): 45.0,
        ("cross", "reasoning", "tool_call", 0, 0): 90.0,
    }
    rows = {(r["comparison"], r["a"]): r for r in report.summary()}
    assert rows[("same", "reasoning")]["mean_angle"] == pytest.approx(45.0)
    assert rows[("cross", "reasoning")]["under_30"] == 0.0 and rows[("cross", "reasoning")]["pairs"] == 1


def test_names_of_modules_and_layers():
    assert module_of("model.layers.3.self_attn.q_proj.lora_A.tool") == "model.layers.3.self_attn.q_proj"
    assert module_of("model.layers.3.mlp.up_proj.weight") == "model.layers.3.mlp.up_proj"
    assert layer_of("model.layers.3.mlp.up_proj") == "layer 03" and layer_of("lm_head") == "other"


def dart_episode(tokenizer):
    """A tiny model with DART's two adapters (nonzero B, so every LoRA parameter has a gradient) and one
    trajectory: reasoning, a tool call, its output, more reasoning, the answer."""
    model, tok = tiny_model("llama", seed=0, tokenizer=tokenizer)
    add_adapters(model, ["reason", "tool"], rank=4)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(hash(name) % 2**31))
    route_of = {
        "policy": Topology.from_preset("dart", ["policy"]).route_of("policy", {"reason": 0, "tool": 1})
    }
    prompt = tok.apply_chat_template([{"role": "user", "content": "2+3?"}], add_generation_prompt=True,
                                     tokenize=True, return_dict=True)["input_ids"]  # fmt: skip
    kinds = ["reasoning"] * 5 + ["tool_call"] * 4 + ["tool_output"] * 3 + ["reasoning"] * 3 + ["answer"] * 2
    ids = [100 + i for i in range(len(kinds))]
    routes = shift([PROMPT] * len(prompt) + kinds, route_of["policy"])
    logprobs = [math.nan if k == "tool_output" else -1.0 for k in kinds]
    turn = Turn("policy", list(prompt), ids, kinds, routes, logprobs)
    return model, route_of, Episode("q", [turn, turn], 1.0)  # two calls: sums over both


def test_partial_gradients_equal_a_backward_over_each_kinds_tokens(tokenizer):
    model, route_of, episode = dart_episode(tokenizer)
    params = select_params(model, "adapters")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    got = episode_gradients(model, episode, route_of, params)
    assert set(got) == {"reasoning", "tool_call", "answer"}
    assert all(p.grad is None for p in model.parameters()), "autograd.grad: no .grad left behind"
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    (turn,) = episode.turns[:1]
    batch = collate([turn, turn], [0.0, 0.0], route_of)
    for kind, n_tokens in [("reasoning", 8), ("tool_call", 4), ("answer", 2)]:
        model.zero_grad(set_to_none=True)
        logp = token_logprobs(model, batch, temperature=1.0).logp  # (2, T-1)
        mask = batch.loss_mask[:, :-1].bool() & (batch.kind_ids[:, 1:] == ["prompt", "reasoning", "tool_call",
                                                                         "tool_output", "answer"].index(kind))  # fmt: skip
        assert int(mask.sum()) == 2 * n_tokens
        (-logp[mask].sum() / mask.sum()).backward()
        assert set(got[kind]) == {module_of(n) for n in params}
        want = torch.cat([params[n].grad.flatten() for n in params])
        have = torch.cat([got[kind][module_of(n)] for n in dict.fromkeys(module_of(n) for n in params)])
        # two calls backpropagated apart and summed vs one batch of two rows: the same sums in another
        # order, through 2 layers of fp32 matmuls
        assert_close_ulps(have, _reorder(want, params), 256)
        model.zero_grad(set_to_none=True)


def _reorder(flat: torch.Tensor, params) -> torch.Tensor:
    """`flat` (in parameter order) regrouped by module, the order `episode_gradients` concatenates in."""
    pieces, start = {}, 0
    for name, p in params.items():
        pieces.setdefault(module_of(name), []).append(flat[start : start + p.numel()])
        start += p.numel()
    return torch.cat([torch.cat(v) for v in pieces.values()])


def test_identical_trajectories_are_left_out_and_all_weights_work(tokenizer):
    model, route_of, episode = dart_episode(tokenizer)
    frozen = {n: p.requires_grad for n, p in model.named_parameters()}
    report = ConflictReport()
    g = episode_gradients(model, episode, route_of, select_params(model, "all"))
    report.add("q", [g, g, {"reasoning": {m: 2 * v for m, v in g["reasoning"].items()}}])
    same = [p for p in report.pairs if p.comparison == "same"]
    # the two identical trajectories are counted, not paired; the scaled copy is parallel to both
    assert report.duplicates == {"reasoning": 1, "tool_call": 1, "answer": 1}
    assert len(same) == 2 and all(p.angle.cos == pytest.approx(1.0, abs=1e-6) for p in same)
    rows = {(r["comparison"], r["a"], r["b"]): r for r in report.summary()}
    assert rows[("same", "reasoning", "reasoning")]["identical_pairs_left_out"] == 1
    assert {n: p.requires_grad for n, p in model.named_parameters()} == frozen, "requires_grad restored"
    assert "model.embed_tokens" in g["reasoning"]
    with pytest.raises(
        ValueError, match=r"--params 'judge' selects no parameter; allowed: adapters, all, or one"
    ):
        select_params(model, "judge")


def test_cli_writes_the_tables_and_the_plot(tmp_path, capsys):
    from rolerl.cli import main

    args = ["diagnose", "grad-conflict", "--task", "arithmetic", "--model", "tiny:llama", "--limit", "2",
            "--samples", "3", "--max-new-tokens", "6", "--params", "all", "--out", str(tmp_path)]  # fmt: skip
    assert main(args) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["samples"] == 3 and summary["queries"] == 2 and summary["params"] == "all"
    pairs = list(csv.DictReader((tmp_path / "pairs.csv").open()))
    same = [r for r in pairs if r["comparison"] == "same"]
    assert (
        len(same) == sum(r["pairs"] for r in summary["comparisons"] if r["comparison"] == "same") <= 2 * 3 * 3
    )
    assert (tmp_path / "angles.png").stat().st_size > 0 and (tmp_path / "layers.csv").exists()
    assert "queries x 3 samples" in capsys.readouterr().out
    assert main([*args[:-4], "--params", "adapters", "--out", str(tmp_path / "x")]) == 2
    assert "--params 'adapters' selects no parameter" in capsys.readouterr().err
    assert main([*args[:-2], "--max-memory-gb", "0.001", "--out", str(tmp_path / "y")]) == 2
    assert "use fewer --samples, --params adapters, or raise the limit" in capsys.readouterr().err


@pytest.mark.parametrize("groups", ["role", "kind"])
def test_a_run_with_gradient_diagnostics_trains_exactly_as_one_without(tmp_path, groups):
    """The extra backwards leave the adapters, the optimizer state and the RNG streams as they were: the
    same metrics (less the diagnostics' own) and the same adapters after 2 steps."""
    from rolerl.train.checkpoint import RunDir
    from rolerl.train.rl import train
    from tests.train.test_rl import SolverJudge, strip_time, tiny_config
    from tests.workflows.test_single_turn import EchoTask

    rows = {}
    for name, extra in [
        ("plain", []),
        ("diag", ["diagnostics.grad_every=1", f"diagnostics.grad_groups={groups}"]),
    ]:
        task = EchoTask()
        cfg = tiny_config(tmp_path / name, "train.steps=2", "rollout.max_new_tokens=6", *extra)
        train(cfg, task=task, workflow=SolverJudge(task))
        rows[name] = strip_time(RunDir(tmp_path / name, tensorboard=False).read_metrics())
    first = rows["diag"][0]
    assert any(k.startswith(f"{groups}/") and "/grad_norm/" in k for k in first)
    cosines = [k for k in first if k.startswith("grad/cos/")]
    assert groups == "kind" or cosines, "two roles on the shared adapter: their cosine is logged"
    assert all(k.replace("cos", "conflict_frac", 1) in first for k in cosines)
    diag_only = ("grad/", f"{groups}/")
    clean = [
        {k: v for k, v in r.items() if not (k.startswith(diag_only) and "grad" in k)} for r in rows["diag"]
    ]
    assert clean == rows["plain"]
    saved = sorted(
        (tmp_path / "plain" / "checkpoints" / "step_2" / "adapters").glob("*/adapter_model.safetensors")
    )
    assert saved
    for a in saved:
        b = tmp_path / "diag" / a.relative_to(tmp_path / "plain")
        assert a.read_bytes() == b.read_bytes()
