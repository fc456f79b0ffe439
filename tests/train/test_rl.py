"""The RL loop on the tiny model: a 2-step smoke run, exact resume, checkpoints, and `rolerl train`."""

from __future__ import annotations

import asyncio
import json
import math

import pytest
import torch

from rolerl.cli import main
from rolerl.config import load_config
from rolerl.models.adapters_io import load_adapter
from rolerl.run.policy import build_policy
from rolerl.train.checkpoint import RunDir, checkpoints, clean_partial, save_checkpoint
from rolerl.train.optim import policy_optimizer
from rolerl.train.rl import train
from rolerl.workflows import SingleTurn
from tests.workflows.test_single_turn import EchoTask

SMOKE = "smoke"  # the example config shipped in the package
TINY = [
    "model.spec=tiny:llama",
    "model.device=cpu",
    "rollout.n=4",
    "rollout.max_new_tokens=12",
    "train.tasks_per_step=2",
    "train.micro_batch_size=3",
    "optim.lr=1e-2",
    "optim.warmup_steps=1",
    "adapters.rank=4",
    "run.progress=false",
    "run.tensorboard=false",
    # fp32 on every machine: train.bf16=auto picks bf16 on a CPU with AVX512-BF16/AMX, and these tests'
    # tolerances (trainer vs rollout log-probs < 1e-3) are fp32's; bf16 rounding alone is ~1e-1 there
    "train.bf16=false",
    # every row runs in the update, also those of groups that scored alike (a tiny random model's groups often
    # all do): the tests compare every row's rollout log-probs with the trainer's (`logp_mismatch/*`)
    "train.skip_inert_rows=false",
]


def tiny_config(tmp_path, *extra: str):
    return load_config(None, [*TINY, f"run.dir={tmp_path}", *extra])


def test_two_step_smoke_run_trains_adapters_only(tmp_path):
    cfg = tiny_config(tmp_path / "run", "train.steps=2", "algorithm.beta=0.05", "train.mini_batches=2")
    task = EchoTask()
    workflow = SingleTurn(task)
    policy = build_policy(cfg, workflow.roles)
    base = {n: p.detach().clone() for n, p in policy.model.named_parameters() if "lora_" not in n}
    adapters = {n: p.detach().clone() for n, p in policy.model.named_parameters() if "lora_" in n}
    run_dir = train(cfg, task=task, workflow=workflow, policy=policy)
    rows = RunDir(run_dir, tensorboard=False).read_metrics()
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["reward/std"] > 0 and rows[0]["advantage/abs_mean"] > 0, "the echo task gives a signal"
    for r in rows:
        assert all(
            math.isfinite(r[k]) for k in ("loss/total", "loss/pg", "loss/kl", "kl", "entropy", "grad_norm")
        )
        assert r["logp_mismatch/max_abs"] < 1e-3 and r["optimizer_steps"] == 2.0
        assert r["update/inert_frac"] == 0.0  # beta > 0: every row has a loss (its KL), none is skipped
        assert r["role/policy/turns"] == 8.0 and "time/rollout" in r and "tools/calls" in r
    assert rows[0]["lr"] == pytest.approx(0.01)  # warm-up step 1 of 1: the full lr
    params = dict(policy.model.named_parameters())
    assert all(torch.equal(params[n], w) for n, w in base.items()), "base weights never change"
    assert any(not torch.equal(params[n], w) for n, w in adapters.items()), "adapters learn"
    # The final checkpoint holds PEFT adapters equal to the trained weights.
    ((step, path),) = checkpoints(run_dir)[-1:]
    assert step == 2 and (path / "adapters" / "policy" / "adapter_config.json").is_file()
    fresh = build_policy(cfg, workflow.roles)
    load_adapter(fresh.model, "policy", path / "adapters" / "policy")
    loaded = dict(fresh.model.named_parameters())
    assert all(torch.equal(loaded[n], params[n]) for n in adapters)
    assert load_config(run_dir / "config.yaml") == cfg


def strip_time(rows):
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]


def test_interrupted_and_resumed_run_matches_uninterrupted(tmp_path):
    extra = ("train.steps=3", "run.checkpoint_every=1", "run.keep_last=2", "rollout.max_new_tokens=8")
    task = EchoTask()
    full = train(tiny_config(tmp_path / "full", *extra), task=task, workflow=SingleTurn(task))
    cut_cfg = tiny_config(tmp_path / "cut", *extra)
    train(cut_cfg, task=task, workflow=SingleTurn(task), stop_after=2)
    # Killed while writing step 2's checkpoint: its metrics line exists, the newest whole checkpoint is step 1.
    step_2 = dict(checkpoints(cut_cfg.run.dir))[2]
    step_2.rename(step_2.with_name(".step_2-partial"))
    assert [s for s, _ in checkpoints(cut_cfg.run.dir)] == [1]
    assert len(RunDir(cut_cfg.run.dir, tensorboard=False).read_metrics()) == 2
    train(cut_cfg, task=task, workflow=SingleTurn(task), resume=True)
    got = strip_time(RunDir(cut_cfg.run.dir, tensorboard=False).read_metrics())
    want = strip_time(RunDir(full, tensorboard=False).read_metrics())
    assert [r["step"] for r in got] == [1, 2, 3]
    assert got == want  # bit-identical metrics (losses, rewards, grad norms), not just close
    assert [s for s, _ in checkpoints(cut_cfg.run.dir)] == [2, 3]  # keep_last=2
    assert not (tmp_path / "cut" / "checkpoints" / ".step_2-partial").exists()


class SolverJudge:
    """Two roles: a solver answers, two judges read the answer in parallel; the judges' reward is the
    episode's, the solver's is its own (a per-role reward)."""

    roles = ("solver", "judge")

    def __init__(self, task) -> None:
        self.task = task

    async def run(self, ctx, example):
        answer = await ctx.generate("solver", self.task.prompt(example))
        text = ctx.text(answer)
        review = [{"role": "user", "content": f"Is this right? {text}"}]
        await asyncio.gather(ctx.generate("judge", review), ctx.generate("judge", review, max_new_tokens=4))
        episode = ctx.episode(example, self.task.reward(example, text))
        episode.role_rewards["solver"] = float(len(text) % 3 == 0)
        return episode


def test_isolated_two_role_workflow_trains_both_adapters(tmp_path):
    cfg = tiny_config(
        tmp_path, "train.steps=1", "adapters.preset=isolated", "algorithm.group_key=role_instance"
    )
    workflow = SolverJudge(EchoTask())
    policy = build_policy(cfg, workflow.roles)
    assert policy.adapter_names == ["solver", "judge"]
    before = {n: p.detach().clone() for n, p in policy.model.named_parameters() if "lora_B" in n}
    train(cfg, task=workflow.task, workflow=workflow, policy=policy)
    (row,) = RunDir(tmp_path, tensorboard=False).read_metrics()
    assert row["role/solver/turns"] == 8.0 and row["role/judge/turns"] == 16.0
    assert 0 < row["role/judge/tokens"] <= 8 * (12 + 4)  # the second judge's call samples at most 4 tokens
    assert row["role/solver/loss"] + row["role/judge/loss"] == pytest.approx(row["loss/total"], abs=1e-6)
    after = dict(policy.model.named_parameters())
    for role in ("solver", "judge"):
        moved = [not torch.equal(after[n], w) for n, w in before.items() if n.endswith(f"lora_B.{role}")]
        assert any(moved), f"the {role} adapter learns"


def test_threaded_backend_runs_a_step(tmp_path):
    cfg = tiny_config(
        tmp_path, "train.steps=1", "rollout.backend=threaded", "algorithm.filter_zero_variance=true"
    )
    train(cfg, task=EchoTask(), workflow=SingleTurn(EchoTask()))
    (row,) = RunDir(tmp_path, tensorboard=False).read_metrics()
    assert row["episodes"] == 8.0 and 0 <= row["filtered/zero_variance_frac"] <= 1


def test_resume_without_checkpoint_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoints/step_N"):
        train(tiny_config(tmp_path), task=EchoTask(), workflow=SingleTurn(EchoTask()), resume=True)


def test_checkpoints_keep_last_k_and_are_atomic(tmp_path, monkeypatch):
    cfg = tiny_config(tmp_path)
    policy = build_policy(cfg, ["policy"])
    opt = policy_optimizer(policy, cfg.optim)
    sched = torch.optim.lr_scheduler.LambdaLR(opt.torch, lambda s: 1.0)
    for step in range(1, 5):
        save_checkpoint(tmp_path, step, {"policy": policy.model}, opt, sched, keep_last=2)
    assert [s for s, _ in checkpoints(tmp_path)] == [3, 4]
    state = torch.load(tmp_path / "checkpoints" / "step_4" / "state.pt", weights_only=False)
    assert state["step"] == 4 and {"optimizer", "scheduler", "rng"} <= set(state)
    assert set(state["rng"]) >= {"python", "numpy", "torch"}

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path, 5, {"policy": policy.model}, opt, sched, keep_last=2)
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step_3", "step_4"], (
        "no half-written step_5, no temp dir"
    )
    (root / ".step_6-leftover").mkdir()  # what a killed process leaves
    assert [s for s, _ in checkpoints(tmp_path)] == [3, 4]
    clean_partial(tmp_path)
    assert sorted(p.name for p in root.iterdir()) == ["step_3", "step_4"]


def test_cli_train_and_config_errors(tmp_path, capsys):
    run_dir = tmp_path / "cli"
    code = main(["train", SMOKE, "--set", *TINY, "train.steps=1", f"run.dir={run_dir}"])
    assert code == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["step"] == 1 and out["run_dir"] == str(run_dir)
    assert (run_dir / "checkpoints" / "step_1" / "adapters" / "policy").is_dir()
    # --resume reads RUN_DIR/config.yaml; --set extends the run by one step
    assert main(["train", "--resume", str(run_dir), "--set", "train.steps=2"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["step"] == 2
    assert [r["step"] for r in RunDir(run_dir, tensorboard=False).read_metrics()] == [1, 2]
    assert main(["train", SMOKE, "--set", "optim.lr=fast"]) == 2
    assert "optim.lr='fast'; expected a number" in capsys.readouterr().err
    assert main(["train"]) == 2
    assert main(["train", SMOKE, "--set", *TINY, f"run.dir={run_dir}"]) == 2
    assert "already holds a run; continue it with --resume" in capsys.readouterr().err


def test_tensorboard_mirrors_metrics_and_resume_purges_rewritten_steps(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def scalars():
        acc = EventAccumulator(str(tmp_path / "tensorboard"))
        acc.Reload()
        return [(e.step, e.value) for e in acc.Scalars("reward/mean")]

    run = RunDir(tmp_path)
    for step in (1, 2, 3):
        run.log({"step": step, "reward/mean": step / 10, "note": "text is not a scalar"})
    run.close()
    assert scalars() == [(1, pytest.approx(0.1)), (2, pytest.approx(0.2)), (3, pytest.approx(0.3))]
    resumed = RunDir(tmp_path, resume_step=1)  # the crash happened after step 3's log, before its checkpoint
    resumed.log({"step": 2, "reward/mean": 0.5})
    resumed.close()
    assert scalars() == [(1, pytest.approx(0.1)), (2, pytest.approx(0.5))]
    assert [r["step"] for r in RunDir(tmp_path, tensorboard=False).read_metrics()] == [1, 2]


def test_engines_sleep_through_the_update_and_the_run_is_unchanged(tmp_path, monkeypatch):
    """Before each update the engines free their KV cache and packed weight copies (`backend.sleep`); the
    next rollout rebuilds them. A run whose engines never sleep gives the same metrics, bit for bit (the
    lockstep backend is deterministic)."""
    from rolerl.rollout.engine import Engine

    extra = ("train.steps=2", "rollout.max_new_tokens=8")
    task = EchoTask()
    slept = []
    sleep = Engine.sleep
    monkeypatch.setattr(Engine, "sleep", lambda self: (sleep(self), slept.append(self.cache is None)))
    asleep = train(tiny_config(tmp_path / "sleep", *extra), task=task, workflow=SingleTurn(task))
    monkeypatch.setattr(Engine, "sleep", lambda self: None)
    awake = train(tiny_config(tmp_path / "awake", *extra), task=task, workflow=SingleTurn(task))
    assert slept == [True, True]  # once per step
    got, want = (strip_time(RunDir(d, tensorboard=False).read_metrics()) for d in (asleep, awake))
    assert got == want


def test_the_threaded_backend_sleeps_in_its_engine_thread(tmp_path, monkeypatch):
    import threading

    from rolerl.rollout.engine import Engine

    threads = []
    sleep = Engine.sleep
    record = lambda self: (sleep(self), threads.append(threading.current_thread().name))  # noqa: E731
    monkeypatch.setattr(Engine, "sleep", record)
    cfg = tiny_config(tmp_path, "train.steps=2", "rollout.max_new_tokens=8", "rollout.backend=threaded")
    train(cfg, task=EchoTask(), workflow=SingleTurn(EchoTask()))  # closing the backend drains its inbox
    assert threads == ["rolerl-engine"] * 2


def test_train_heap_decides_whether_the_process_keeps_its_freed_memory(tmp_path, monkeypatch):
    """`train.heap: keep` (the default) turns on `rolerl.heap.keep_freed_memory` once per run; `trim` leaves
    glibc's defaults (the setting is process-wide: recorded here, not applied to the test process)."""
    import rolerl.train.rl as rl

    calls = []
    monkeypatch.setattr(rl, "keep_freed_memory", lambda: calls.append(1) or True)
    for heap, want in (("trim", 0), ("keep", 1)):
        calls.clear()
        train(tiny_config(tmp_path / heap, "train.steps=1", f"train.heap={heap}"), task=EchoTask(),
              workflow=SingleTurn(EchoTask()))  # fmt: skip
        assert len(calls) == want, heap
    assert load_config(None, []).train.heap == "keep"
