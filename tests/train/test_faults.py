"""Faults across ranks and processes (issue 49, part 3): a rank SIGKILLed mid-step or mid-checkpoint, or one
that hangs, stops the other rank with an error that says what happened and names `--resume`, in bounded
time; `--resume` then continues from the last complete checkpoint to the uninterrupted run's result; a full
disk during a checkpoint keeps the previous checkpoint and names the directory.

The kills are placed by the test-only hook `ROLERL_FAULT` (`rolerl.train.distributed.fault_point`). Every
process wait is bounded (`LIMIT`): a regression fails here instead of hanging CI."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rolerl.config import ConfigError
from rolerl.run.policy import build_policy
from rolerl.train import checkpoint as ckpt
from rolerl.train.checkpoint import (
    CheckpointWriteError,
    TrainingInterrupted,
    checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from rolerl.train.distributed import FAULT_ENV
from rolerl.train.optim import policy_optimizer
from tests.train.test_checkpoint import SHORT, metrics, run
from tests.train.test_distributed import ROOT, WORKER, adapters, assert_runs_match
from tests.train.test_distributed import metrics as run_metrics
from tests.train.test_rl import strip_time, tiny_config

LIMIT = 240  # seconds for one torchrun job; a 3-step 2-rank run takes ~15 s on 2 cores
STOPPED = (  # how a rank stops after another failed: the collective's error, or torchrun's SIGTERM
    r"(rank \d of 2: \w[\w ]* failed \(.*\): another rank died"
    r"|stopped by SIGTERM \(torchrun sends it to the other)"
)


# ---- torchrun jobs


def torchrun(run_dir: Path, *args: str, fault: str | None = None) -> tuple[int, str, float]:
    """Run `dist_worker.py` under torchrun with 2 ranks: (exit status, output, seconds). A job past `LIMIT`
    is killed whole and the test fails: the agent's session, and the ranks (torchrun starts each in a
    session of its own), found by `run_dir` on their command line."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env.pop(FAULT_ENV, None)
    if fault:
        env[FAULT_ENV] = fault
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(WORKER),
           str(run_dir), *args]  # fmt: skip
    start = time.monotonic()
    job = subprocess.Popen(
        cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, _ = job.communicate(timeout=LIMIT)
    except subprocess.TimeoutExpired:
        for pid in [job.pid, *live_ranks(run_dir)]:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        out, _ = job.communicate(timeout=60)  # the ranks held the pipe open
        pytest.fail(f"torchrun did not finish within {LIMIT} s (a rank hangs):\n{out[-4000:]}")
    assert not live_ranks(run_dir), "torchrun left a rank running"
    return job.returncode, out, time.monotonic() - start


def stop_message(out: str, pattern: str = STOPPED) -> str:
    """The error a rank stopped with: the last line of `out` that matches `pattern` and names `--resume`
    (the line before it in the chain, the collective's own failure, does not)."""
    lines = [m[0] for m in re.finditer(pattern + r".*", out) if "--resume" in m[0]]
    assert lines, out[-4000:]
    return lines[-1]


def live_ranks(run_dir: Path) -> list[int]:
    """Processes whose command line names `run_dir` (the ranks of its job)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and str(run_dir).encode() in (proc / "cmdline").read_bytes():
                found.append(int(proc.name))
        except OSError:  # gone meanwhile
            pass
    return found


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    """The 2-rank run the killed and resumed ones must reproduce (`test_distributed.run_config`: 3 steps,
    a checkpoint each step)."""
    run_dir = tmp_path_factory.mktemp("faults") / "uninterrupted"
    code, out, _ = torchrun(run_dir)
    assert code == 0, out[-4000:]
    return run_dir


def assert_resumes_to(run_dir: Path, want: Path, *args: str) -> None:
    """`--resume` with 2 ranks ends where the uninterrupted run ended: every step's metrics, the adapters
    (tolerances of test_distributed: the float32 sums run in another order only across rank counts)."""
    code, out, _ = torchrun(run_dir, "--resume", *args)
    assert code == 0, out[-4000:]
    assert_runs_match(run_metrics(run_dir), run_metrics(want))
    for name, w in adapters(want).items():
        torch.testing.assert_close(adapters(run_dir)[name], w, rtol=1e-4, atol=1e-6)
    assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".")]


@pytest.mark.slow
def test_rank_killed_mid_step_stops_the_other_and_resume_matches(tmp_path, uninterrupted):
    """Rank 1 is SIGKILLed in step 2's update (rank 0 waits for its gradients, or computes). Rank 0 stops
    at once with an error naming the dead peer (gloo sees the socket close) or torchrun's SIGTERM, either
    way naming `--resume`; on its way out it checkpoints step 1 (checkpoints every 2 steps here)."""
    run_dir = tmp_path / "run"
    code, out, seconds = torchrun(run_dir, "run.checkpoint_every=2", fault="kill:rank1:step2:update")
    assert code != 0 and "Signal 9 (SIGKILL) received by PID" in out, out[-4000:]
    message = stop_message(out)
    assert "step 1 is checkpointed" in message and f"--resume {run_dir}" in message, message
    assert seconds < 120, seconds  # ~15 s here; a hang at a collective runs into LIMIT
    assert [s for s, _ in checkpoints(run_dir)] == [1]
    assert_resumes_to(run_dir, uninterrupted, "run.checkpoint_every=2")


@pytest.mark.slow
def test_rank0_killed_mid_checkpoint_leaves_no_checkpoint_and_resume_matches(tmp_path, uninterrupted):
    """Rank 0 is SIGKILLed while it writes step 2's checkpoint (adapters written, state.pt not). The half
    write stays a hidden temp directory, never `step_2`; rank 1, waiting for it, stops knowing that step 1
    is the last complete checkpoint; `--resume` removes the leftover and redoes steps 2-3."""
    run_dir = tmp_path / "run"
    code, out, seconds = torchrun(run_dir, fault="kill:rank0:step2:checkpoint")
    assert code != 0 and "Signal 9 (SIGKILL) received by PID" in out, out[-4000:]
    message = stop_message(out)
    assert "step 1 is checkpointed" in message and f"--resume {run_dir}" in message, message
    assert seconds < 120, seconds
    assert [s for s, _ in checkpoints(run_dir)] == [1]
    (partial,) = [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".step_2-")]
    assert (partial / "adapters" / "policy").is_dir() and not (partial / "state.pt").exists()
    assert [r["step"] for r in run_metrics(run_dir)] == [1, 2]  # step 2 was logged, not checkpointed
    assert_resumes_to(run_dir, uninterrupted)


@pytest.mark.slow
def test_a_rank_that_hangs_times_out_after_dist_timeout_s(tmp_path):
    """Rank 1 stops answering (alive, asleep) in step 2's update: rank 0's collective gives up after
    `train.dist_timeout_s` (5 s here; torch's default would wait 30 min), and torchrun's SIGTERM then stops
    rank 1 too."""
    run_dir = tmp_path / "run"
    code, out, seconds = torchrun(run_dir, "train.dist_timeout_s=5", fault="hang:rank1:step2:update")
    assert code != 0
    message = stop_message(out, r"rank 0 of 2: \w[\w ]* failed \(.*\): another rank died or did not answer")
    assert "step 1 is checkpointed" in message and f"--resume {run_dir}" in message, message
    assert "stopped by SIGTERM" in out  # rank 1, asleep, stopped through its error path too
    assert seconds < 120, seconds


def test_dist_timeout_s_is_validated():
    with pytest.raises(ConfigError, match=r"train.dist_timeout_s=0.0; allowed: a number of seconds > 0"):
        tiny_config("/tmp/unused", "train.dist_timeout_s=0.0")


def test_sigterm_stops_a_run_like_ctrl_c(tmp_path, monkeypatch):
    """SIGTERM (how torchrun stops the ranks left after one fails, how schedulers preempt) checkpoints the
    last completed step and says how to continue; the process's own handler is back afterwards."""
    import rolerl.train.rl as rl

    step_fn = rl.train_step

    def sigterm_at_step_2(cfg, step, *args, **kwargs):
        if step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return step_fn(cfg, step, *args, **kwargs)

    monkeypatch.setattr(rl, "train_step", sigterm_at_step_2)
    cfg = tiny_config(tmp_path, *SHORT, "train.steps=3", "run.checkpoint_every=10")
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(TrainingInterrupted) as stopped:
        run(cfg)
    assert str(stopped.value) == (
        f"stopped by SIGTERM at step 2 (step 1 is checkpointed); continue with rolerl train --resume {tmp_path}"
    )
    assert [s for s, _ in checkpoints(tmp_path)] == [1]
    assert signal.getsignal(signal.SIGTERM) is before


# ---- a full disk during a checkpoint


def enospc_after(nbytes: int, when: str, wrapped: bool = False):
    """A `torch.save` that writes `nbytes` of the state into files whose path contains `when`, then fails as
    a full disk does: ENOSPC naming the file, or (`wrapped`) as torch 2.13's writer reports it, a
    RuntimeError raised while handling the file's OSError (seen on a full tmpfs); other saves go through."""
    real = torch.save

    def save(obj, f, *args, **kwargs):
        name = f.name if hasattr(f, "write") else f  # an open file or a path
        if when not in str(name):
            return real(obj, f, *args, **kwargs)
        with open(name, "r+b" if hasattr(f, "write") else "wb") as out:
            out.write(b"\x00" * nbytes)
        try:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(name))
        except OSError:
            if not wrapped:
                raise
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")  # noqa: B904

    return save


def test_full_disk_during_a_checkpoint_keeps_the_previous_one(tmp_path, capsys, monkeypatch):
    """`rolerl train` whose step-2 checkpoint hits ENOSPC half-way through state.pt: it stops (status 2,
    one line) naming the checkpoint directory and the full disk; step_1 is intact and loads; nothing of
    step 2's write is left; once there is space again, --resume continues to the uninterrupted result."""
    from rolerl.cli import main

    config = tmp_path / "config.yaml"  # the tiny test config, as a file the CLI reads
    config.write_text(tiny_config(tmp_path, *SHORT, "train.steps=3", "run.checkpoint_every=1").to_yaml())
    assert main(["train", str(config), "--set", f"run.dir={tmp_path / 'full'}"]) == 0
    want = strip_time(metrics(tmp_path / "full"))
    run_dir = tmp_path / "run"
    monkeypatch.setattr(torch, "save", enospc_after(4096, f"{os.sep}.step_2-", wrapped=True))
    assert main(["train", str(config), "--set", f"run.dir={run_dir}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    root = run_dir / "checkpoints"
    assert err[-1].startswith(
        f"rolerl train: error: could not write checkpoint step_2 in {str(root)!r}: the disk is full ([Errno 28]"
    ), err[-1]
    assert err[-1].endswith(
        f"nothing of it was kept and step_1 is intact; free space there, then continue with rolerl train "
        f"--resume {run_dir}"
    ), err[-1]
    assert sorted(p.name for p in root.iterdir()) == ["step_1"]
    monkeypatch.undo()
    cfg = tiny_config(run_dir, *SHORT, "train.steps=3")
    policy = build_policy(cfg, ["policy"])
    optimizer = policy_optimizer(policy, cfg.optim)
    assert load_checkpoint(root / "step_1", {"policy": policy.model}, optimizer)["step"] == 1
    assert main(["train", "--resume", str(run_dir)]) == 0
    assert strip_time(metrics(run_dir)) == want


def test_checkpoint_write_error_says_full_disk_and_keeps_errno(tmp_path, monkeypatch):
    cfg = tiny_config(tmp_path)
    policy = build_policy(cfg, ["policy"])
    optimizer = policy_optimizer(policy, cfg.optim)
    monkeypatch.setattr(torch, "save", enospc_after(100, "state.pt"))
    with pytest.raises(CheckpointWriteError) as error:
        save_checkpoint(tmp_path, 1, {"policy": policy.model}, optimizer, keep_last=2)
    assert isinstance(error.value, OSError) and error.value.errno == errno.ENOSPC
    assert "no earlier checkpoint exists" in str(error.value)
    assert list((tmp_path / "checkpoints").iterdir()) == []


def test_a_crash_while_deleting_an_old_checkpoint_never_leaves_half_of_one(tmp_path, monkeypatch):
    """keep_last deletes the oldest checkpoint; a process killed midway through that delete must not leave
    a `step_N` with some of its files (it would count as a checkpoint, and be resumed from were the newer
    one damaged)."""
    cfg = tiny_config(tmp_path)
    policy = build_policy(cfg, ["policy"])
    optimizer = policy_optimizer(policy, cfg.optim)
    save_checkpoint(tmp_path, 1, {"policy": policy.model}, optimizer, keep_last=1)
    real = ckpt.shutil.rmtree

    def killed_midway(path, ignore_errors=False):
        path = Path(path)
        if path.is_dir() and (path / "state.pt").exists():
            (path / "state.pt").unlink()  # the first file went, then the process died
            raise KeyboardInterrupt
        return real(path, ignore_errors=ignore_errors)

    monkeypatch.setattr(ckpt.shutil, "rmtree", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, 2, {"policy": policy.model}, optimizer, keep_last=1)
    monkeypatch.undo()
    assert [s for s, _ in checkpoints(tmp_path)] == [2]
    ckpt.clean_partial(tmp_path)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_2"]


def test_a_full_tmpfs_during_a_checkpoint(tmp_path):
    """A real full disk: a 1 MiB tmpfs holding a run checkpointed at step 1, then filled to 64 KiB of free
    space: enough for the resumed run's config, metrics and step 2's adapter (36 KB), not for its state.pt
    (100 KB). The run stops naming the directory; step_1 is intact; with space again the run finishes."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        run_dir = disk / "run"
        cfg = tiny_config(run_dir, *SHORT, "train.steps=2", "run.checkpoint_every=1", "run.keep_last=1")
        run(cfg, stop_after=1)
        stat = os.statvfs(disk)
        filler = disk / "filler"
        filler.write_bytes(b"\x00" * (stat.f_bavail * stat.f_frsize - 64 * 1024))
        with pytest.raises(CheckpointWriteError) as error:
            run(cfg, resume=True)
        message = str(error.value)
        assert error.value.errno == errno.ENOSPC, message
        assert message.startswith(
            f"could not write checkpoint step_2 in {str(run_dir / 'checkpoints')!r}: the disk is full"
        ), message
        assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_1"]
        filler.unlink()
        run(cfg, resume=True)
        assert [s for s, _ in checkpoints(run_dir)] == [2]
        assert [r["step"] for r in metrics(run_dir)] == [1, 2]
    finally:
        # lazy: a file the failed write left open (held by a traceback) must not keep the mount alive
        subprocess.run(["umount", "--lazy", str(disk)], capture_output=True, timeout=30)
