"""W&B logging (`run.wandb`), in W&B's offline mode: what a run logs there, read back from the files W&B
writes into `RUN_DIR/wandb/`; a missing `wandb` package is a clear error; no `run.wandb`, no import."""

from __future__ import annotations

import hashlib
import json
import struct
import sys
from dataclasses import dataclass, field

import matplotlib
import pytest

from rolerl.config import ConfigError, load_config
from rolerl.train.checkpoint import RunDir
from rolerl.train.rl import train
from tests.train.test_rl import tiny_config

matplotlib.use("Agg")


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """W&B in offline mode, with its caches and settings under tmp_path (nothing in ~, no server)."""
    pytest.importorskip("wandb", reason="the wandb extra is not installed: pip install 'rolerl[wandb]'")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / var.lower()))
    monkeypatch.delenv("WANDB_RUN_ID", raising=False)
    monkeypatch.delenv("WANDB_RESUME", raising=False)


def offline_runs(run_dir):
    """W&B's offline run directories under `run_dir/wandb/`, oldest first, once written out: `finish()`
    returns before wandb-core has flushed an offline run's log; shutting W&B's service down waits for it."""
    import wandb

    wandb.teardown()
    return sorted((run_dir / "wandb").glob("offline-run-*"))


def records(offline_run):
    """The protobuf `Record`s of an offline run. wandb-core keeps what a run logged only in its
    transaction log `run-<id>.wandb` (what `wandb sync` uploads): a LevelDB-style log after a 7-byte file
    header, in 32 KiB blocks of chunks `<crc u32><length u16><type u8>` (type 1 whole, 2/3/4 first/middle/
    last part of a record)."""
    from wandb.proto.wandb_internal_pb2 import Record

    (log,) = offline_run.glob("run-*.wandb")
    data, block = log.read_bytes(), 32768
    assert data[:4] == b":W&B"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is zero padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            yield Record.FromString(pending)
            pending = b""


@dataclass
class Logged:
    rows: list[dict] = field(default_factory=list)  # history rows (W&B adds _step, _runtime, _timestamp)
    config: dict = field(default_factory=dict)
    step_metric: dict[str, str] = field(default_factory=dict)  # metric name or glob -> its step metric
    exit_code: int | None = None


def read_offline_run(offline_run) -> Logged:
    out = Logged()
    for record in records(offline_run):
        kind = record.WhichOneof("record_type")
        if kind in ("history", "config"):
            items = record.history.item if kind == "history" else record.config.update
            values = {x.key or ".".join(x.nested_key): json.loads(x.value_json) for x in items}
            out.rows.append(values) if kind == "history" else out.config.update(values)
        elif kind == "metric":
            out.step_metric[record.metric.name or record.metric.glob_name] = record.metric.step_metric
        elif kind == "exit":
            out.exit_code = record.exit.exit_code
    return out


def path_id(run_dir) -> str:
    return hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:16]


def numbers(row: dict) -> dict:
    return {k: v for k, v in row.items() if isinstance(v, (int, float))}


def test_training_run_logs_metrics_config_and_plots(tmp_path, offline):
    import matplotlib.pyplot as plt

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    plt.imsave(run_dir / "curve.png", [[0.0, 1.0], [1.0, 0.0]])  # a PNG in the run dir goes up on close
    train(tiny_config(run_dir, "train.steps=2", "run.wandb=rolerl-test"))
    (run,) = offline_runs(run_dir)
    assert run.name.endswith(f"-{path_id(run_dir)}"), "the W&B id is the hash of the run dir's path"
    got = read_offline_run(run)
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    *metrics, plots = got.rows
    assert len(logged) == 2 and "reward/mean" in logged[0]
    for want, row in zip(logged, metrics, strict=True):
        assert {k: row[k] for k in numbers(want)} == numbers(want)  # as metrics.jsonl has it, to the bit
    assert plots["step"] == 2 and plots["plots/curve._type"] == "image-file"
    assert (run / "files" / plots["plots/curve.path"]).is_file()
    assert got.config["train"]["steps"] == 2 and got.config["model"]["spec"] == "tiny:llama"
    assert got.config["run"]["wandb"] == "rolerl-test"
    assert got.step_metric == {"step": "", "*": "step"} and got.exit_code == 0


def test_a_resumed_run_continues_the_same_wandb_run(tmp_path, offline):
    run_dir = tmp_path / "run"
    cfg = tiny_config(run_dir, "train.steps=4", "run.checkpoint_every=2", "run.wandb=rolerl-test")
    train(cfg, stop_after=3)  # killed after step 3's log, before a checkpoint: resuming runs step 3 again
    train(cfg, resume=True)
    first, second = offline_runs(run_dir)
    # both W&B runs carry the id of the run dir (two runs started in one second get a "-1" dir suffix)
    assert all(f"-{path_id(run_dir)}" in run.name for run in (first, second))
    steps = [[row["step"] for row in read_offline_run(run).rows] for run in (first, second)]
    assert steps == [[1, 2, 3], [3, 4]], "`step` is a metric: W&B's own step never has to go back"


def test_only_numbers_are_logged(tmp_path, offline):
    run = RunDir(tmp_path, tensorboard=False, wandb="rolerl-test")
    run.log({"step": 1, "loss": 0.5, "done": True, "note": "text", "per_role": [1, 2]})
    run.close()
    (row,) = read_offline_run(offline_runs(tmp_path)[0]).rows
    assert {k: v for k, v in row.items() if not k.startswith("_")} == {"step": 1, "loss": 0.5, "done": True}
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["note"] == "text", "metrics.jsonl has all"


def test_a_run_that_fails_is_marked_failed(tmp_path, offline):
    run = RunDir(tmp_path, tensorboard=False, wandb="rolerl-test")
    with pytest.raises(RuntimeError, match="a step failed"):
        try:
            raise RuntimeError("a step failed")
        finally:  # as in the trainer: close() runs while the error is on its way out
            run.close()
    assert read_offline_run(offline_runs(tmp_path)[0]).exit_code == 1


def test_a_bad_project_name_is_a_config_error():
    with pytest.raises(ConfigError, match=r"run\.wandb='team/proj'; allowed: null or a W&B project name"):
        load_config(None, ["run.wandb=team/proj"])  # the team goes in run.wandb_entity


def test_missing_wandb_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    cfg = tiny_config(tmp_path, "train.steps=1", "run.wandb=rolerl-test")
    with pytest.raises(ImportError, match=r"run\.wandb='rolerl-test' needs .*pip install 'rolerl\[wandb\]'"):
        train(cfg)
    assert not (tmp_path / "metrics.jsonl").exists(), "it stops before the first step"


def test_no_wandb_project_never_imports_wandb(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # any `import wandb` would raise
    train(tiny_config(tmp_path, "train.steps=1"))
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 1
    assert not (tmp_path / "wandb").exists()
