"""Topologies from config (issue 13): separate models with their own tokenizers in one run (and its exact
resume), custom tables and their errors, per-adapter rank / alpha / lr / frozen adapters, and checkpoints
that do not fit the topology refused by name."""

from __future__ import annotations

import asyncio

import pytest
import torch

from rolerl.config import ConfigError, load_config
from rolerl.models.lora import adapter_specs
from rolerl.models.topology import Topology
from rolerl.roles import KINDS
from rolerl.rollout.sampling import SamplingParams
from rolerl.run.engines import run_tools
from rolerl.run.policy import build_policy
from rolerl.train.checkpoint import RunDir, checkpoints
from rolerl.train.optim import OptimizerStateError
from rolerl.train.rl import train
from rolerl.workflows.base import Context, RoleCalls
from tests.train.test_rl import SolverJudge, strip_time, tiny_config
from tests.workflows.scripted import ScriptedBackend
from tests.workflows.test_single_turn import EchoTask

SEPARATE = (
    "adapters.preset=separate",
    "models.judge=tiny:qwen3:bytes",  # another architecture and a 259-token byte vocabulary
    "roles.judge.model=judge",
    "algorithm.group_key=role_instance",
)


def test_separate_models_have_their_own_tokenizers_adapters_and_rollouts(tmp_path):
    cfg = tiny_config(tmp_path, "train.steps=1", *SEPARATE)
    workflow = SolverJudge(EchoTask())
    policy = build_policy(cfg, workflow.roles)
    assert list(policy.members) == ["main", "judge"]
    solver, judge = policy.model_of("solver"), policy.model_of("judge")
    assert solver.config.vocab_size == 49152 and judge.config.vocab_size == 259
    assert list(adapter_specs(solver)) == ["solver"] and list(adapter_specs(judge)) == ["judge"]
    assert policy.route_of["judge"]["answer"] == 0, "route indices are per model"
    with pytest.raises(ValueError, match=r"this policy has 2 models \['main', 'judge'\]"):
        _ = policy.model
    before = {r: {n: p.detach().clone() for n, p in policy.model_of(r).named_parameters() if "lora_B" in n}
              for r in workflow.roles}  # fmt: skip
    train(cfg, task=workflow.task, workflow=workflow, policy=policy)
    (row,) = RunDir(tmp_path, tensorboard=False).read_metrics()
    assert row["role/solver/turns"] == 8.0 and row["role/judge/turns"] == 16.0
    assert row["logp_mismatch/max_abs"] < 1e-3, "each model's trainer recompute matches its own rollout"
    assert row["adapter/solver/steps"] == 1.0 and row["adapter/judge/steps"] == 1.0
    for role in workflow.roles:
        after = dict(policy.model_of(role).named_parameters())
        assert any(not torch.equal(after[n], w) for n, w in before[role].items()), f"{role}'s model learns"
    ((_, path),) = checkpoints(tmp_path)
    assert sorted(p.name for p in (path / "adapters").iterdir()) == ["judge", "solver"]


def test_separate_run_resumes_exactly(tmp_path):
    task = EchoTask()
    extra = ("train.steps=3", "run.checkpoint_every=1", *SEPARATE)
    full = train(tiny_config(tmp_path / "full", *extra), task=task, workflow=SolverJudge(task))
    cut = tiny_config(tmp_path / "cut", *extra)
    train(cut, task=task, workflow=SolverJudge(task), stop_after=2)
    train(cut, task=task, workflow=SolverJudge(task), resume=True)
    got = strip_time(RunDir(cut.run.dir, tensorboard=False).read_metrics())
    want = strip_time(RunDir(full, tensorboard=False).read_metrics())
    assert [r["step"] for r in got] == [1, 2, 3] and got == want  # bit-identical across both models


def test_separate_needs_a_model_per_role(tmp_path):
    with pytest.raises(ValueError, match=r"roles \['judge', 'solver'\] share one"):
        build_policy(tiny_config(tmp_path, "adapters.preset=separate"), SolverJudge.roles)
    with pytest.raises(ConfigError, match=r"roles.judge.model='judge'; allowed: main or a key of models"):
        tiny_config(tmp_path, "adapters.preset=separate", "roles.judge.model=judge")


def test_a_checkpoint_of_another_topology_is_refused_by_name(tmp_path):
    task = EchoTask()
    cfg = tiny_config(tmp_path, "train.steps=1", "adapters.preset=isolated")
    train(cfg, task=task, workflow=SolverJudge(task))
    other = tiny_config(tmp_path, "train.steps=2", "adapters.preset=shared")
    with pytest.raises(
        OptimizerStateError,
        match=r"holds adapters \['judge', 'solver'\] and this run's topology has \['policy'\]",
    ):
        train(other, task=task, workflow=SolverJudge(task), resume=True)
    frozen = tiny_config(tmp_path, "train.steps=2", "adapters.preset=isolated",
                         "adapters.per_adapter.judge.trainable=false")  # fmt: skip
    with pytest.raises(
        OptimizerStateError, match=r"the checkpoint trains adapters \['judge'\] that this run does not"
    ):
        train(frozen, task=task, workflow=SolverJudge(task), resume=True)


def test_custom_table_routes_per_role_and_kind():
    spec = {"solver": {"default": "reason", "tool_call": "tool"}, "judge": "judge"}
    t = Topology.from_table(spec, ["solver", "judge"])
    assert t.adapter_names() == ["reason", "tool", "judge"]
    assert t.route("solver", "tool_call") == ("main", "tool") and t.adapter_of("judge", "prompt") == "judge"
    # kinds without loss may stay unmapped (base only); a kind with loss may not
    t = Topology.from_table({"solver": {"reasoning": "r", "tool_call": "r", "answer": "r"}}, ["solver"])
    assert t.adapter_of("solver", "prompt") is None and t.adapter_of("solver", "tool_output") is None
    with pytest.raises(ValueError, match=r"adapters.table.solver leaves 'answer' unmapped"):
        Topology.from_table({"solver": {"reasoning": "r", "tool_call": "r"}}, ["solver"])
    masked = Topology.from_table({"solver": {"reasoning": "r"}}, ["solver"], train_kinds=["reasoning"])
    assert masked.adapter_of("solver", "answer") is None  # no loss on answers: unmapped is allowed
    with pytest.raises(ValueError, match=r"adapters.table.solver has keys \['code'\]"):
        Topology.from_table({"solver": {"code": "r", "default": "r"}}, ["solver"])
    with pytest.raises(ValueError, match=r"missing \['judge'\]"):
        Topology.from_table({"solver": "r"}, ["solver", "judge"])
    with pytest.raises(ValueError, match=r"adapter 'shared' serves roles on models 'main' and 'big'"):
        Topology.from_table(
            {"solver": "shared", "judge": "shared"}, ["solver", "judge"], model_of={"judge": "big"}
        )


def test_custom_table_and_per_adapter_settings_from_yaml(tmp_path):
    path = tmp_path / "custom.yaml"
    path.write_text(
        "model: {spec: 'tiny:llama', device: cpu}\n"
        "adapters:\n"
        "  preset: custom\n"
        "  rank: 4\n"
        "  table:\n"
        "    solver: {default: reason, tool_call: tool}\n"
        "    judge: judge\n"
        "  per_adapter:\n"
        "    tool: {rank: 2, alpha: 8, lr: 0.005}\n"
        "    judge: {trainable: false}\n"
        "roles:\n"
        "  solver: {lr_scale: 2.0}\n"
    )
    cfg = load_config(path)
    policy = build_policy(cfg, ["solver", "judge"])
    specs = adapter_specs(policy.model)
    assert (specs["reason"].rank, specs["tool"].rank, specs["tool"].alpha) == (4, 2, 8.0)
    assert {g.name: g.lr for g in policy.groups} == {"reason": 2 * cfg.optim.lr, "tool": 0.005}
    judge = [p for n, p in policy.model.named_parameters() if n.endswith("lora_A.judge")]
    assert judge and not any(p.requires_grad for p in judge), "a frozen adapter is not trained"
    with pytest.raises(ConfigError, match="adapters.table is set with adapters.preset='shared'"):
        load_config(None, ["adapters.table={solver: x}"])
    with pytest.raises(ValueError, match=r"adapters.per_adapter.tool: this topology \(shared\) has no such"):
        build_policy(
            load_config(None, ["model.spec=tiny:llama", "adapters.per_adapter.tool.rank=2"]), ["solver"]
        )
    with pytest.raises(ValueError, match=r"roles.coder: the workflow has no such role"):
        build_policy(load_config(None, ["model.spec=tiny:llama", "roles.coder.beta=0.1"]), ["solver"])
    with pytest.raises(
        ValueError, match=r"adapter 'policy' serves roles \['judge', 'solver'\] whose lr_scale differ"
    ):
        build_policy(
            load_config(None, ["model.spec=tiny:llama", "roles.solver.lr_scale=2"]), ["solver", "judge"]
        )


def test_sft_imitates_each_role_on_its_own_model_and_tokenizer(tmp_path):
    import json

    from rolerl.models.adapters_io import load_adapter
    from rolerl.models.tiny import tiny_from_spec
    from rolerl.train.sft import sft

    data = tmp_path / "demos.jsonl"
    rows = [
        {
            "role": "solver",
            "messages": [{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": "5"}],
        },
        {
            "role": "judge",
            "messages": [{"role": "user", "content": "5?"}, {"role": "assistant", "content": "yes"}],
        },
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows * 2))
    cfg = tiny_config(tmp_path / "sft", *SEPARATE, f"sft.data={data}", "sft.epochs=3", "sft.batch_size=2",
                      "sft.lr=1e-2")  # fmt: skip
    out = sft(cfg, ["solver", "judge"])
    metrics = RunDir(tmp_path / "sft", tensorboard=False).read_metrics()
    assert len(metrics) == 6 and metrics[-1]["loss/sft"] < metrics[0]["loss/sft"]
    judge, _ = tiny_from_spec("tiny:qwen3:bytes")
    load_adapter(judge, "judge", out / "judge")  # the byte model's adapter fits the byte model
    assert any(bool(p.abs().sum() > 0) for n, p in judge.named_parameters() if n.endswith("lora_B.judge"))


def test_per_role_call_settings_apply_to_that_roles_calls_only(tmp_path):
    cfg = tiny_config(tmp_path, "train.steps=1", "adapters.preset=isolated", "roles.judge.max_new_tokens=3",
                      "roles.judge.top_p=0.5", "rollout.max_new_tokens=12")  # fmt: skip
    workflow = SolverJudge(EchoTask())
    train(cfg, task=workflow.task, workflow=workflow)
    (row,) = RunDir(tmp_path, tensorboard=False).read_metrics()
    # 8 episodes x 2 judge calls: the role's limit (3) on the first, the call's own (4) on the second
    assert row["role/judge/tokens"] <= 8 * (3 + 4) < 8 * (12 + 4)
    assert row["logp_mismatch/max_abs"] < 1e-3, "top_p changes sampling, never the trainer's log-probs"


def test_per_role_tool_and_stop_strings_reach_that_roles_requests(tokenizer):
    backend = ScriptedBackend(tokenizer, lambda request, prompt: "ok")
    tags = {"tool_open": "<tool_call>", "tool_close": "</tool_call>"}
    roles = {"planner": RoleCalls(tool="none", stop=("DONE",)), "coder": RoleCalls(tool="search", tags=tags)}
    route_of = {role: dict.fromkeys(KINDS, 0) for role in ("planner", "coder", "other")}
    ctx = Context(backend, tokenizer, route_of, SamplingParams(stop=("</x>",)), 0, tool="python", roles=roles)
    ask = [{"role": "user", "content": "hi"}]

    async def episode():
        await ctx.generate("planner", ask, stop=("</answer>",))
        await ctx.generate("coder", ask)
        await ctx.generate("other", ask)

    asyncio.run(episode())
    requests = [c.request for c in backend.calls]
    assert [r.tool for r in requests] == [None, "search", "python"]  # "none": this role calls no tool
    assert [r.sampling.stop for r in requests] == [("</answer>", "DONE"), ("</x>",), ("</x>",)]
    assert [(r.tags.tool_open, r.tags.output_open) for r in requests] == [
        ("<code>", "<output>"), ("<tool_call>", "<output>"), ("<code>", "<output>")]  # fmt: skip
    with pytest.raises(
        ConfigError, match=r"roles.coder.tags=\{'answer_open': 'A'\}; allowed: null or a mapping"
    ):
        load_config(None, ["roles.coder.tags={answer_open: A}"])
    cfg = load_config(None, ["rollout.tool=python", "roles.coder.tool=search", "roles.planner.tool=none",
                             "roles.planner.stop=[DONE]"])  # fmt: skip
    assert run_tools(cfg, cfg.rollout.tool) == ["python", "search"]
    assert cfg.roles["planner"].stop == ["DONE"] and cfg.roles["planner"].tool == "none"
    with pytest.raises(ConfigError, match=r"roles.coder.tool='bash'; allowed"):
        load_config(None, ["roles.coder.tool=bash"])
    with pytest.raises(ConfigError, match=r"roles.coder.stop=\[''\]; allowed: null or a list of non-empty"):
        load_config(None, ["roles.coder.stop=['']"])
