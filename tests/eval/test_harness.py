"""`rolerl eval` end to end on a tiny model: results and samples written, metrics equal to what the samples
say, `--resume` after a kill gives the uninterrupted result, trained adapters loaded from a run."""

from __future__ import annotations

import json

import pytest

from rolerl.cli import main
from rolerl.eval.harness import EvalSpec, run_eval

BASE = dict(task="arithmetic", model="tiny:llama", max_new_tokens=6, limit=5, progress=False, chunk=2)


def test_eval_writes_samples_and_metrics_that_agree(tmp_path):
    spec = EvalSpec(**BASE, n=4, temperature=1.0, out=str(tmp_path / "ev"))
    results = run_eval(spec, log_line=lambda _: None)
    rows = [json.loads(x) for x in (tmp_path / "ev" / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 20 and {(r["id"], r["sample"]) for r in rows} == {
        (r["id"], j) for r in rows for j in range(4)
    }
    m = results["metrics"]
    assert m["examples"] == 5 and m["samples"] == 20
    assert m["pass@1"] == sum(r["correct"] for r in rows) / 20
    assert {"pass@2", "pass@4", "tokens/mean", "truncated_rate", "role/policy/calls"} <= set(m)
    assert m["tokens/mean"] == sum(r["tokens"] for r in rows) / 20 <= 6
    saved = json.loads((tmp_path / "ev" / "results.json").read_text())
    assert saved["metrics"] == m and saved["spec"]["n"] == 4 and saved["identity"]["model"] == "tiny:llama"
    turn = rows[0]["turns"][0]
    assert (
        turn["role"] == "policy"
        and "What is" in turn["prompt"]
        and set(turn["kinds"]) <= {"reasoning", "answer"}
    )


def test_a_small_chunk_does_not_cap_the_batch(tmp_path, monkeypatch):
    from rolerl.rollout.engine import Engine

    rows, step = [], Engine.step

    def counting(engine):
        rows.append(len(engine.active))
        return step(engine)

    monkeypatch.setattr(Engine, "step", counting)
    spec = EvalSpec(**BASE, n=2, temperature=1.0, max_batch=8, out=str(tmp_path / "ev"))  # chunk=2: 4 rows
    run_eval(spec, log_line=lambda _: None)
    # chunks of 4 examples x 2 samples fill the 8 rows (2 examples a chunk would run 4 at most)
    assert max(rows) == 8
    assert len((tmp_path / "ev" / "samples.jsonl").read_text().splitlines()) == 10


def test_resume_after_a_kill_gives_the_uninterrupted_result(tmp_path):
    full = run_eval(
        EvalSpec(**BASE, n=2, temperature=1.0, out=str(tmp_path / "full")), log_line=lambda _: None
    )
    cut = tmp_path / "cut"
    run_eval(EvalSpec(**BASE, n=2, temperature=1.0, out=str(cut)), log_line=lambda _: None)
    lines = (cut / "samples.jsonl").read_text().splitlines()
    (cut / "samples.jsonl").write_text("\n".join(lines[:3]) + "\n" + lines[3][:20])  # a kill mid-write
    with pytest.raises(ValueError, match="exists: continue it with --resume"):
        run_eval(EvalSpec(**BASE, n=2, temperature=1.0, out=str(cut)), log_line=lambda _: None)
    again = run_eval(
        EvalSpec(**BASE, n=2, temperature=1.0, out=str(cut), resume=True), log_line=lambda _: None
    )
    assert again["metrics"] == full["metrics"]  # each sample's seed is a function of (seed, example, j)
    got = sorted((cut / "samples.jsonl").read_text().splitlines())
    assert got == sorted((tmp_path / "full" / "samples.jsonl").read_text().splitlines())


def test_sigterm_keeps_the_finished_chunks_and_says_how_to_resume(tmp_path, monkeypatch, capsys):
    """SIGTERM (a scheduler, `kill`) mid-evaluation: the chunks written stay, the one line says how to go on
    (`rolerl eval` exits 130 with it); the resumed evaluation equals the uninterrupted one."""
    import signal

    import rolerl.eval.harness as harness

    # max_batch 4, 2 samples an example: chunks of 2 examples (4 samples), 2 and 1
    full = run_eval(
        EvalSpec(**BASE, n=2, temperature=1.0, max_batch=4, out=str(tmp_path / "full")),
        log_line=lambda _: None,
    )
    real, chunks = harness._append, []

    def then_sigterm(path, samples):
        real(path, samples)
        chunks.append(len(samples))
        if len(chunks) == 2:
            signal.raise_signal(signal.SIGTERM)

    monkeypatch.setattr(harness, "_append", then_sigterm)
    out = tmp_path / "cut"
    with pytest.raises(harness.EvalInterrupted) as stopped:
        run_eval(EvalSpec(**BASE, n=2, temperature=1.0, max_batch=4, out=str(out)), log_line=lambda _: None)
    assert str(stopped.value) == (
        f"stopped by SIGTERM after 8 of 10 samples (in {out / 'samples.jsonl'}); continue with the same "
        "command and --resume"
    )
    assert len((out / "samples.jsonl").read_text().splitlines()) == 8 and chunks == [4, 4]
    monkeypatch.setattr(harness, "_append", real)
    again = run_eval(
        EvalSpec(**BASE, n=2, temperature=1.0, max_batch=4, out=str(out), resume=True),
        log_line=lambda _: None,
    )
    assert again["metrics"] == full["metrics"]

    def stop(spec):
        raise stopped.value

    monkeypatch.setattr(harness, "run_eval", stop)
    assert (
        main(["eval", "--task", "arithmetic", "--model", "tiny:llama", "--limit", "5", "--out", str(out)])
        == 130
    )
    assert capsys.readouterr().err.strip().endswith(f"rolerl eval: {stopped.value}")


def test_eval_loads_a_training_runs_newest_checkpoint(tmp_path):
    from rolerl.config import load_config
    from rolerl.train.rl import train
    from tests.train.test_rl import TINY

    cfg = load_config(None, [*TINY, f"run.dir={tmp_path / 'run'}", "train.steps=1", "task.name=arithmetic"])
    train(cfg)
    results = run_eval(EvalSpec(**BASE, run=str(tmp_path / "run")), log_line=lambda _: None)
    assert results["identity"]["step"] == 1 and results["identity"]["adapters"].endswith("step_1/adapters")


def test_a_runs_evaluation_takes_its_configs_dtype_unless_dtype_is_given(tmp_path):
    """`--run` takes the model and its dtype from the run's config: results.json says what ran, here bfloat16;
    an explicit `--dtype` overrides it; a `--model` other than the run's, or a `--preset`, is refused (the
    adapters fit only the run's model and topology) instead of being ignored."""
    from rolerl.config import load_config
    from rolerl.train.rl import train
    from tests.train.test_rl import TINY

    cfg = load_config(None, [*TINY, f"run.dir={tmp_path / 'run'}", "train.steps=1", "task.name=arithmetic",
                             "model.dtype=bfloat16"])  # fmt: skip
    train(cfg)
    run = str(tmp_path / "run")
    results = run_eval(EvalSpec(**BASE | {"limit": 2}, run=run), log_line=lambda _: None)
    assert results["spec"]["dtype"] is None and results["identity"]["dtype"] == "bfloat16"
    assert results["identity"]["model"] == cfg.model.spec
    wide = run_eval(EvalSpec(**BASE | {"limit": 2}, run=run, dtype="float32"), log_line=lambda _: None)
    assert wide["identity"]["dtype"] == "float32"  # and the run's own model, named, is accepted (BASE's)
    plain = run_eval(EvalSpec(**BASE | {"limit": 2}), log_line=lambda _: None)
    assert plain["identity"]["dtype"] == "float32"
    with pytest.raises(ValueError, match=r"--model tiny:qwen2 with --run .*leave --model out"):
        run_eval(EvalSpec(**BASE | {"model": "tiny:qwen2"}, run=run), log_line=lambda _: None)
    with pytest.raises(ValueError, match="--preset dart with --run: .*--table"):
        EvalSpec(**BASE, run=run, preset="dart")


def test_eval_errors_are_one_line_and_name_the_flag(tmp_path, capsys):
    with pytest.raises(ValueError, match="--n > 1 needs sampling"):
        EvalSpec(task="arithmetic", n=2)
    with pytest.raises(ValueError, match="--resume needs --out"):
        EvalSpec(task="arithmetic", resume=True)
    assert main(["eval", "--task", "nope", "--model", "tiny:llama", "--limit", "1"]) == 2
    assert "unknown task 'nope'" in capsys.readouterr().err
    assert main(["eval", "--task", "arithmetic", "--model", "tiny:llama"]) == 2
    assert "give --limit N" in capsys.readouterr().err


def test_the_rl_loop_evaluates_every_n_steps_without_changing_training(tmp_path):
    from rolerl.config import load_config
    from rolerl.train.checkpoint import RunDir
    from rolerl.train.rl import train
    from tests.train.test_rl import TINY, strip_time

    common = [*TINY, "train.steps=2", "task.name=arithmetic", "rollout.max_new_tokens=6"]
    plain = train(load_config(None, [*common, f"run.dir={tmp_path / 'plain'}"]))
    evald = train(
        load_config(None, [*common, f"run.dir={tmp_path / 'eval'}", "eval.every=1", "eval.limit=3"])
    )
    a = strip_time(RunDir(plain, tensorboard=False).read_metrics())
    b = strip_time(RunDir(evald, tensorboard=False).read_metrics())
    assert all("eval/pass@1" in r and r["eval/examples"] == 3 for r in b)
    assert [{k: v for k, v in r.items() if not k.startswith("eval/")} for r in b] == a
    with pytest.raises(ValueError, match="eval.split='train' is the training split"):
        train(load_config(None, [*common, f"run.dir={tmp_path / 'bad'}", "eval.every=1", "eval.split=train"]))


@pytest.mark.slow
def test_eval_on_the_default_model_and_a_benchmark_resumes_exactly(tmp_path, shared_data):
    spec = dict(task="gsm8k", data=str(shared_data), model="default", max_new_tokens=24, limit=4, chunk=2,
                progress=False)  # fmt: skip
    full = run_eval(EvalSpec(**spec, out=str(tmp_path / "full")), log_line=lambda _: None)
    cut = tmp_path / "cut"
    run_eval(EvalSpec(**spec, out=str(cut)), log_line=lambda _: None)
    lines = (cut / "samples.jsonl").read_text().splitlines()
    (cut / "samples.jsonl").write_text(lines[0] + "\n")
    again = run_eval(EvalSpec(**spec, out=str(cut), resume=True), log_line=lambda _: None)
    assert again["metrics"] == full["metrics"] and full["metrics"]["examples"] == 4
    assert full["identity"]["model"] == "default"


def test_tool_none_runs_no_tool_even_where_the_workflow_has_one():
    with pytest.raises(ValueError, match="the tir workflow needs a tool"):
        run_eval(EvalSpec(**BASE, workflow="tir", tool="none"), log_line=lambda _: None)


def test_a_finished_imitation_is_evaluated_with_its_final_adapters(tmp_path):
    """`--run` of a finished `rolerl sft` (570 steps, checkpoints every 25) evaluates its final adapters,
    written after its last checkpoint (step 550): the recipes' warm-start evaluations once measured that
    checkpoint while GRPO started from the final adapters. A run with checkpoints newer than its adapters
    (resumed or extended since) evaluates its newest checkpoint; one with checkpoints only, that."""
    import os

    from rolerl.eval.harness import newest_adapters
    from rolerl.run.layout import checkpoints

    def write(directory, when):
        (directory / "policy").mkdir(parents=True)
        (directory / "policy" / "adapter_model.safetensors").write_bytes(b"x")
        os.utime(directory / "policy" / "adapter_model.safetensors", (when, when))

    run = tmp_path / "sft"
    write(run / "checkpoints" / "step_525" / "adapters", 1000)
    write(run / "checkpoints" / "step_550" / "adapters", 2000)
    assert newest_adapters(run, checkpoints(run)) == (550, str(run / "checkpoints" / "step_550" / "adapters"))
    write(run / "adapters", 3000)  # the run finished: its last 20 steps are in these alone
    assert newest_adapters(run, checkpoints(run)) == ("final", str(run / "adapters"))
    write(run / "checkpoints" / "step_575" / "adapters", 4000)  # extended by a resumed run since
    assert newest_adapters(run, checkpoints(run)) == (575, str(run / "checkpoints" / "step_575" / "adapters"))
    assert newest_adapters(tmp_path / "empty", []) == (None, None)
