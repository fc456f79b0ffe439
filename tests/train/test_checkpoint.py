"""Runs are always resumable: extending a run keeps its lr schedule continuous, a run stopped before its
first checkpoint has a way out, Ctrl-C checkpoints the last completed step, a damaged checkpoint falls back
to the previous one, and a fresh run never mixes with an old one."""

from __future__ import annotations

import logging
import signal
import threading

import pytest
from torch.optim.optimizer import register_optimizer_step_pre_hook

from rolerl.models.adapters_io import CorruptFileError
from rolerl.run.policy import build_policy
from rolerl.train.checkpoint import (
    CheckpointError,
    RunDir,
    TrainingInterrupted,
    checkpoints,
    clear_run,
    load_checkpoint,
    load_newest,
    save_checkpoint,
)
from rolerl.train.optim import lr_factor, policy_optimizer
from rolerl.train.rl import train
from rolerl.workflows import SingleTurn
from tests.train.test_rl import strip_time, tiny_config
from tests.workflows.test_single_turn import EchoTask

SHORT = ("rollout.max_new_tokens=8", "run.keep_last=5")


def run(cfg, **kwargs):
    task = kwargs.pop("task", EchoTask())
    return train(cfg, task=task, workflow=SingleTurn(task), **kwargs)


def metrics(run_dir):
    return RunDir(run_dir, tensorboard=False).read_metrics()


def test_extended_cosine_run_follows_the_longer_schedule(tmp_path, caplog):
    """Extending a finished 2-step cosine run to 5 steps: each new step's lr is the 5-step cosine's (it
    used to restart at 0.0 and jump: LambdaLR's restored state belonged to the 2-step horizon)."""
    run(tiny_config(tmp_path, *SHORT, "train.steps=2", "optim.warmup_steps=0"))
    cfg = tiny_config(tmp_path, *SHORT, "train.steps=5", "optim.warmup_steps=0")
    with caplog.at_level(logging.INFO, logger="rolerl.train.rl"):
        run(cfg, resume=True)
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    # the same expression the loop uses, so exact: lr * lr_factor(0-based step, new horizon)
    want = [cfg.optim.lr * lr_factor(s - 1, 5, cfg.optim) for s in (3, 4, 5)]
    assert [r["lr"] for r in rows[2:]] == want
    assert rows[2]["lr"] > 0.5 * cfg.optim.lr and rows[2]["lr"] > rows[3]["lr"] > rows[4]["lr"] > 0
    assert rows[1]["lr"] == cfg.optim.lr * lr_factor(1, 2, cfg.optim)  # taken with the old horizon
    assert (
        "train.steps 2 -> 5: lr follows the 5-step cosine schedule from step 3 (0.00655; was 0.005 at step 2)"
        in (caplog.text)
    )


def test_extended_constant_warmup_run_equals_a_fresh_run(tmp_path):
    schedule = ("optim.schedule=constant", "optim.warmup_steps=3")
    fresh = run(tiny_config(tmp_path / "fresh", *SHORT, *schedule, "train.steps=4"))
    run(tiny_config(tmp_path / "ext", *SHORT, *schedule, "train.steps=2"))
    run(tiny_config(tmp_path / "ext", *SHORT, *schedule, "train.steps=4"), resume=True)
    got, want = strip_time(metrics(tmp_path / "ext")), strip_time(metrics(fresh))
    assert [r["lr"] for r in got] == pytest.approx([1e-2 / 3, 2e-2 / 3, 1e-2, 1e-2], rel=1e-12)
    assert got == want  # bit-identical: the schedule of a fresh 4-step run, and an exact resume


def test_run_stopped_before_its_first_checkpoint_has_a_way_out(tmp_path, caplog):
    extra = (*SHORT, "train.steps=2", "run.checkpoint_every=10")
    want = strip_time(metrics(run(tiny_config(tmp_path / "full", *extra))))
    cfg = tiny_config(tmp_path / "cut", *extra)
    run(cfg, stop_after=1)  # killed after step 1: a metrics line, no checkpoint
    assert len(metrics(cfg.run.dir)) == 1 and not checkpoints(cfg.run.dir)
    with pytest.raises(ValueError, match=r"already holds a run; continue it with --resume .*--overwrite"):
        run(cfg)
    with caplog.at_level(logging.WARNING):
        run(cfg, resume=True)
    assert "stopped before its first checkpoint; starting it again from step 0" in caplog.text
    assert strip_time(metrics(cfg.run.dir)) == want  # step 1 was replaced, not duplicated
    # --overwrite replaces a whole run: no old metrics line or checkpoint survives
    (tmp_path / "cut" / "notes.txt").write_text("mine")
    run(tiny_config(tmp_path / "cut", *SHORT, "train.steps=1"), overwrite=True)
    assert [r["step"] for r in metrics(cfg.run.dir)] == [1]
    assert [s for s, _ in checkpoints(cfg.run.dir)] == [1]
    assert sorted(p.name for p in (tmp_path / "cut").iterdir()) == [
        "checkpoints", "config.yaml", "metrics.jsonl", "notes.txt"
    ]  # fmt: skip
    with pytest.raises(ValueError, match="resume and overwrite exclude each other"):
        run(cfg, resume=True, overwrite=True)


@pytest.fixture
def sigint_as_in_a_terminal():
    """Python's own SIGINT handler (KeyboardInterrupt), as a process run from a terminal has it. A process
    started in the background by a shell without job control (`cmd &` in a script, `nohup`) inherits SIGINT
    ignored, and Python then leaves it ignored: the Ctrl-C tests saw no interrupt when the suite ran that way
    (handler SIG_IGN, in session eighteen and twenty-two), which says nothing about the run's handling."""
    before = signal.getsignal(signal.SIGINT)
    if before == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def ctrl_c() -> str:
    """A real SIGINT to this process (so asyncio's own handling runs); returns the SIGINT handler, the
    calling thread and its blocked signals at that moment, for a failure that says why a Ctrl-C did not stop
    a run."""
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    seen = f"SIGINT handler {signal.getsignal(signal.SIGINT)!r}, thread {threading.current_thread().name}, blocked {blocked}"
    signal.raise_signal(signal.SIGINT)
    return seen


class InterruptingTask(EchoTask):
    """Ctrl-C at the `at`-th reward, during a rollout."""

    def __init__(self, at: int) -> None:
        self.at, self.calls, self.seen = at, 0, "no Ctrl-C sent"

    def reward(self, example, text):
        self.calls += 1
        if self.calls == self.at:
            self.seen = ctrl_c()
        return super().reward(example, text)


def test_ctrl_c_checkpoints_the_last_completed_step_and_resume_is_exact(tmp_path, sigint_as_in_a_terminal):
    extra = (*SHORT, "train.steps=4", "run.checkpoint_every=10", "train.mini_batches=2")
    want = strip_time(metrics(run(tiny_config(tmp_path / "full", *extra))))
    assert all(r["optimizer_steps"] == 2.0 for r in want)
    per_step = 2 * 4  # tasks_per_step x rollout.n rewards

    # 1. during step 3's rollout: the adapters are step 2's, checkpointed as they are
    cfg = tiny_config(tmp_path / "rollout", *extra)
    task = InterruptingTask(at=2 * per_step + 1)
    try:
        run(cfg, task=task)
    except TrainingInterrupted as e:
        stopped = e
    else:
        pytest.fail(f"the run did not stop at Ctrl-C ({task.seen})")
    assert isinstance(stopped, KeyboardInterrupt)
    assert (stopped.step, stopped.saved) == (3, 2)
    assert str(stopped) == (
        f"interrupted at step 3 (step 2 is checkpointed); continue with rolerl train --resume {cfg.run.dir}"
    )
    assert [s for s, _ in checkpoints(cfg.run.dir)] == [2]
    run(cfg, resume=True)
    assert strip_time(metrics(cfg.run.dir)) == want

    # 2. inside step 3's update, after its first of two optimizer steps: that step is undone first
    cfg = tiny_config(tmp_path / "update", *extra)
    calls = []

    def interrupt(optimizer, args, kwargs):
        calls.append(1)
        if len(calls) == 2 * 2 + 2:  # steps 1-2 take 2 optimizer steps each; step 3's second
            raise KeyboardInterrupt

    hook = register_optimizer_step_pre_hook(interrupt)  # global hooks run before the optimizer's own
    try:
        with pytest.raises(TrainingInterrupted, match="interrupted at step 3 .step 2 is checkpointed"):
            run(cfg)
    finally:
        hook.remove()
    run(cfg, resume=True)
    assert strip_time(metrics(cfg.run.dir)) == want  # step 3's half update did not leak into step_2


def test_damaged_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, caplog):
    cfg = tiny_config(tmp_path, *SHORT, "train.steps=3", "run.checkpoint_every=1", "run.keep_last=2")
    want = strip_time(metrics(run(cfg)))
    state = dict(checkpoints(tmp_path))[3] / "state.pt"
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])
    with caplog.at_level(logging.WARNING):
        run(cfg, resume=True)  # redoes step 3 from step_2
    assert f"checkpoint step_3 is unusable ({str(state)!r} is not a readable checkpoint state" in caplog.text
    assert strip_time(metrics(tmp_path)) == want
    assert [s for s, _ in checkpoints(tmp_path)] == [2, 3] and state.stat().st_size > 0  # step_3 re-saved


def test_load_newest_skips_damaged_files_and_names_the_last_one(tmp_path, caplog):
    cfg = tiny_config(tmp_path)
    policy = build_policy(cfg, ["policy"])
    optimizer = policy_optimizer(policy, cfg.optim)
    adapters = {"policy": policy.model}
    for step in (1, 2):
        save_checkpoint(tmp_path, step, adapters, optimizer, keep_last=3)
    weights = tmp_path / "checkpoints" / "step_2" / "adapters" / "policy" / "adapter_model.safetensors"
    weights.write_bytes(b"\x00" * 100)
    with caplog.at_level(logging.WARNING):
        assert load_newest(tmp_path, adapters, optimizer)["step"] == 1
    assert f"{str(weights)!r} is not a readable safetensors file" in caplog.text
    state = tmp_path / "checkpoints" / "step_1" / "state.pt"
    state.write_text("garbage")
    with pytest.raises(CheckpointError) as error:
        load_newest(tmp_path, adapters, optimizer)
    message = str(error.value)
    assert message.startswith(
        f"no usable checkpoint in {str(tmp_path)!r}: {str(weights)!r} is not a readable"
    )
    assert (
        "(and 1 older ones); restore that file from a backup, or start the run again with --overwrite"
        in message
    )
    assert "\n" not in message and isinstance(error.value, ValueError)
    with pytest.raises(CorruptFileError, match="state.pt' is not a readable checkpoint state"):
        load_checkpoint(state.parent, adapters, optimizer)


def test_metrics_with_a_line_cut_short_by_a_kill(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"st')
    with caplog.at_level(logging.WARNING):
        assert [r["step"] for r in RunDir(tmp_path, tensorboard=False, resume_step=1).read_metrics()] == [1]
    assert "line 3 is cut short" in caplog.text
    path.write_text('{"step": 1}\n\n{"st\n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl' line 3: not JSON"):
        RunDir(tmp_path, tensorboard=False).read_metrics()


def test_clear_run_removes_only_run_files(tmp_path):
    for name in ("checkpoints/step_1", "adapters/policy", "tensorboard", ".overwritten-x"):
        (tmp_path / name).mkdir(parents=True)
    for name in ("metrics.jsonl", "config.yaml", "demonstrations.jsonl"):
        (tmp_path / name).write_text("{}\n")
    clear_run(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demonstrations.jsonl"]


def test_cli_ctrl_c_prints_one_line_and_resume_continues(
    tmp_path, capsys, monkeypatch, sigint_as_in_a_terminal
):
    import rolerl.train.rl as rl
    from rolerl.cli import main
    from tests.train.test_rl import SMOKE, TINY

    step_fn = rl.train_step
    seen = []

    def ctrl_c_at_step_2(cfg, step, *args, **kwargs):
        if step == 2:
            seen.append(ctrl_c())
        return step_fn(cfg, step, *args, **kwargs)

    monkeypatch.setattr(rl, "train_step", ctrl_c_at_step_2)
    run_dir = tmp_path / "run"
    argv = [
        "train",
        SMOKE,
        "--set",
        *TINY,
        *SHORT,
        "train.steps=3",
        "run.checkpoint_every=10",
        f"run.dir={run_dir}",
    ]
    assert main(argv) == 130, f"the run did not stop at Ctrl-C ({seen})"
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        f"rolerl train: interrupted at step 2 (step 1 is checkpointed); continue with rolerl train --resume {run_dir}"
    )
    monkeypatch.undo()
    assert main(["train", "--resume", str(run_dir)]) == 0
    assert [r["step"] for r in metrics(run_dir)] == [1, 2, 3]
