"""`rolerl recipe` (issue 47): each GSM8K recipe end to end on the tiny model, its rerun skipping finished
stages, and the errors for bad input; `rolerl.pipeline`'s markers on their own."""

from __future__ import annotations

import json
import math
import os
import time

import pytest

from rolerl.cli import main
from rolerl.pipeline import Pipeline

needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="the recipes' Python sandbox needs root (CI runs as root)"
)
STAGES = ["demos", "eval-base", "sft", "eval-warm", "rl", "eval-rl", "report"]
TINY = ["--model", "tiny:llama", "--demos", "4", "--limit", "2", "--steps", "1", "--no-progress",
        "--set", "rollout.max_new_tokens=8", "train.tasks_per_step=1", "rollout.n=2", "sft.batch_size=8",
        "model.device=cpu", "run.tensorboard=false"]  # fmt: skip


def lines(path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module", params=["gsm8k-tir", "gsm8k-msarl"])
def recipe(request, tmp_path_factory, shared_data):
    """Each recipe run once on the tiny model (4 train rows, 2 test problems, 1 GRPO step); the tests below read
    its directory, the last one cuts it short."""
    if os.geteuid() != 0:
        pytest.skip("the recipes' Python sandbox needs root (CI runs as root)")
    name = request.param
    out = tmp_path_factory.mktemp("recipe") / name
    argv = ["recipe", name, "--out", str(out), "--data", str(shared_data), *TINY]
    assert main(argv) == 0
    return name, out, argv


def test_every_stage_leaves_its_outputs(recipe):
    name, out, _ = recipe
    results = json.loads((out / "results.json").read_text())
    assert sorted(results["seconds"]) == sorted(STAGES)
    # demonstrations: GSM8K's first 4 train rows all convert (their annotations are plain arithmetic); TIR is
    # one row per solution, MSARL one reasoner row per solution and one coder row per computation
    made = results["demos"]
    assert made["kept"] == 4
    assert (
        made["rows"] == len(lines(out / "demos.jsonl")) == (4 if name == "gsm8k-tir" else 4 + made["calls"])
    )
    adapters = {"gsm8k-tir": ["policy"], "gsm8k-msarl": ["coder", "reasoner"]}[name]
    for run in ("base", "sft", "rl/checkpoints/step_1"):
        assert sorted(p.name for p in (out / run / "adapters").iterdir()) == adapters, run
        assert all((out / run / "adapters" / a / "adapter_model.safetensors").is_file() for a in adapters)
    # each evaluation: greedy, one sample of each of the same 2 test problems
    ids = None
    for stage in ("base", "warm", "rl"):
        summary = results["evals"][f"{stage}/gsm8k"]
        samples = [json.loads(line) for line in lines(out / "eval" / stage / "samples.jsonl")]
        assert summary["n"] == len(samples) == 2 and {s["sample"] for s in samples} == {0}
        assert summary["accuracy"] == sum(s["correct"] for s in samples) / 2
        # where the answers went (rolerl failures): every sample in one class, the right ones as `correct`
        assert (
            sum(summary["failures"].values()) == 2
            and summary["failures"]["correct"] == 2 * summary["accuracy"]
        )
        # and per difficulty (the solution's steps): the same 2 samples, the same right ones
        cells = summary["by_difficulty"].values()
        assert sum(n for n, _ in cells) == 2 and sum(r for _, r in cells) == summary["failures"]["correct"]
        assert ids in (None, [s["id"] for s in samples]) and all("/test/" in s["id"] for s in samples)
        ids = [s["id"] for s in samples]
    warm, after = (results["evals"][f"{s}/gsm8k"]["accuracy"] for s in ("warm", "rl"))
    assert results["gain"]["points"] == pytest.approx(100 * (after - warm))
    paired = results["gain"]["paired"]  # the same 2 problems' changes, from the two samples.jsonl
    correct = {stage: {s["id"]: s["correct"] for s in map(json.loads, lines(out / "eval" / stage / "samples.jsonl"))}
               for stage in ("warm", "rl")}  # fmt: skip
    up = sum(correct["rl"][i] and not correct["warm"][i] for i in ids)
    down = sum(correct["warm"][i] and not correct["rl"][i] for i in ids)
    assert (paired["n"], paired["wrong_to_right"], paired["right_to_wrong"]) == (2, up, down)
    assert paired["points"] == pytest.approx(results["gain"]["points"])  # the same mean, paired or not
    # the GRPO run: one step, then the recipe's evaluations as its eval rows (0: the warm start)
    rows = [json.loads(line) for line in lines(out / "rl" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 0, 1] and "reward/mean" in rows[0]
    assert [r["eval/pass@1"] for r in rows[1:]] == [warm, after]
    page = (out / "report" / "report.html").read_text()
    assert "GSM8K test set" in page and "GSM8K test: " in page  # the before/after table and the gain


def test_a_rerun_skips_every_finished_stage(recipe, capsys):
    name, out, argv = recipe
    before = json.loads((out / "results.json").read_text())
    marks = {s: (out / "stages" / f"{s}.json").stat().st_mtime_ns for s in STAGES}
    t0 = time.perf_counter()
    assert main([*argv, "--json"]) == 0
    seconds = time.perf_counter() - t0
    captured = capsys.readouterr()
    assert json.loads(captured.out.strip().splitlines()[-1])["evals"] == before["evals"]
    assert captured.err.count("done already") == len(STAGES)
    assert {s: (out / "stages" / f"{s}.json").stat().st_mtime_ns for s in STAGES} == marks
    assert seconds < 5, "nothing is loaded or run again"
    assert len(lines(out / "rl" / "metrics.jsonl")) == 3
    # the same directory with other flags: refused at the first stage they change, naming the flag
    assert main([*argv, "--limit", "3"]) == 2
    assert "stage 'eval-base' finished with limit=2 (now 3)" in capsys.readouterr().err
    other = "gsm8k-msarl" if name == "gsm8k-tir" else "gsm8k-tir"
    assert main(["recipe", other, *argv[2:]]) == 2
    assert f"holds recipe {name!r}" in capsys.readouterr().err


def test_a_stage_cut_short_continues_where_it_stopped(recipe, capsys, caplog):
    _, out, argv = recipe
    # as if killed after GRPO's last checkpoint but before its marker, midway through the evaluation after
    for stage in ("rl", "eval-rl", "report"):
        (out / "stages" / f"{stage}.json").unlink()
    samples = out / "eval" / "rl" / "samples.jsonl"
    first = lines(samples)
    samples.write_text(first[0] + "\n")  # one of its two samples was written
    assert main(argv) == 0
    assert capsys.readouterr().out.count("done already") == 4
    assert "the checkpoint is at step 1, train.steps=1: nothing to train" in caplog.text  # GRPO resumed
    assert lines(samples) == first  # the missing sample only, the same one (greedy)
    rows = [json.loads(line) for line in lines(out / "rl" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 0, 1], "no step trained again, no evaluation row twice"


def test_a_second_seed_starts_from_the_first_runs_warm_start(recipe, tmp_path, capsys):
    """--warm-from: the first run's demos, sft and base/warm evaluations copied, only GRPO (seed 1) and its
    evaluation run; a rerun skips everything; a source made with other inputs is refused before any write."""
    name, out, argv = recipe
    flags = argv[4:]  # --data ... and the tiny settings, as the first run
    second = tmp_path / "seed1"
    # GRPO's own settings may differ (RL_ONLY): an easier training pool, another temperature
    rl_only = ["--set", "rollout.temperature=0.7", "task.max_difficulty=3", "train.tasks_per_step=2"]
    rl_only += ["task.workflow_options.coder_samples=1"] * (name == "gsm8k-msarl")  # sampling only
    assert main(["recipe", name, "--out", str(second), "--seed", "1", "--warm-from", str(out), *flags,
                 *rl_only, "--pass-k", "2"]) == 0  # fmt: skip
    log = capsys.readouterr().out
    assert log.count("done already") == 4 and f"the warm start (seed 0) is {out}'s, copied" in log
    first, results = (json.loads((d / "results.json").read_text()) for d in (out, second))
    assert {k: results["evals"][k] for k in ("base/gsm8k", "warm/gsm8k")} == {
        k: first["evals"][k] for k in ("base/gsm8k", "warm/gsm8k")
    }
    for adapter in (out / "sft" / "adapters").iterdir():
        copied = second / "sft" / "adapters" / adapter.name / "adapter_model.safetensors"
        assert copied.read_bytes() == (adapter / "adapter_model.safetensors").read_bytes()
    config = (second / "rl" / "config.yaml").read_text()
    assert "seed: 1" in config and str(second / "sft" / "adapters") in config
    assert "temperature: 0.7" in config and "max_difficulty: 3" in config and "tasks_per_step: 2" in config
    rl_inputs = json.loads((second / "stages" / "rl.json").read_text())["inputs"]
    assert rl_inputs["seed"] == 1 and rl_inputs["warm_seed"] == 0 and rl_inputs["warm_from"] == str(out)
    # --pass-k: the final adapters sampled twice a problem at the training temperature, pass@1 and @2
    sampled = [json.loads(line) for line in lines(second / "eval" / "rl-sampled" / "samples.jsonl")]
    assert sorted((s["id"], s["sample"]) for s in sampled) == sorted(
        (s["id"], j) for s in sampled[::2] for j in (0, 1)
    )  # fmt: skip
    by_id = {}
    for s in sampled:
        by_id.setdefault(s["id"], []).append(s["correct"])
    assert results["sampled"]["pass@2"] == sum(any(c) for c in by_id.values()) / 2
    assert (
        results["sampled"]["pass@1"] == sum(map(sum, by_id.values())) / 4
        and results["sampled"]["stage"] == "rl"
    )
    two = [float(any(c)) for c in by_id.values()]  # 2 problems: the error of their mean, by hand
    assert results["sampled"]["stderr/pass@2"] == pytest.approx(abs(two[0] - two[1]) / 2 / math.sqrt(2))
    assert (
        "after RL, sampled: pass@1" in log and f"pass@2 {100 * results['sampled']['pass@2']:.1f}% +- " in log
    )
    rerun = [
        "recipe",
        name,
        "--out",
        str(second),
        "--seed",
        "1",
        "--warm-from",
        str(out),
        *flags,
        *rl_only,
        "--pass-k",
        "2",
    ]
    assert main(rerun) == 0
    assert capsys.readouterr().out.count("done already") == len(STAGES) + 1
    # refused, naming why, and nothing written
    fresh = tmp_path / "refused"
    for extra, message in [
        (["--limit", "3"], "its warm start was made with limit=2 (here 3)"),
        (["--steps", "0"], "it needs --steps >= 1"),
        # a warm start of another topology: only from one adapter (gsm8k-tir's shared -> dart, next test)
        *(
            [
                (
                    ["--topology", "shared"],
                    "its warm start is --topology isolated, with the adapters ['coder', 'reasoner']",
                )
            ]
            if name == "gsm8k-msarl"
            else []
        ),  # fmt: skip
        (["--pass-k", "1"], "--pass-k 1: allowed an integer >= 2"),
        (["--set", "sft.lr=0.001"], "'sft.lr=0.001'"),  # the warm start reads it
    ]:
        assert main(["recipe", name, "--out", str(fresh), "--warm-from", str(out), *flags, *extra]) == 2
        assert message in capsys.readouterr().err and not fresh.exists()
    assert main(["recipe", name, "--out", str(fresh), "--warm-from", str(tmp_path), *flags]) == 2
    assert "is not a recipe's directory" in capsys.readouterr().err and not fresh.exists()


def test_dart_grpo_starts_from_the_shared_warm_start(recipe, tmp_path, capsys):
    """--topology dart --warm-from a shared run: its warm start and evaluations copied, GRPO's reason and tool
    adapters both start from the shared adapter (adapters.init_from), trained and evaluated as DART."""
    name, out, argv = recipe
    if name != "gsm8k-tir":
        pytest.skip("gsm8k-tir's topologies: shared and dart")
    dart = tmp_path / "dart"
    assert (
        main(["recipe", name, "--out", str(dart), "--topology", "dart", "--warm-from", str(out), *argv[4:]])
        == 0
    )
    log = capsys.readouterr().out
    assert (
        log.count("done already") == 4
        and "it is a shared warm start: each dart adapter starts from its one" in log
    )
    first, results = (json.loads((d / "results.json").read_text()) for d in (out, dart))
    assert results["evals"]["warm/gsm8k"] == first["evals"]["warm/gsm8k"]
    config = (dart / "rl" / "config.yaml").read_text()
    assert "preset: dart" in config and "init_from:\n    '*': policy" in config
    assert sorted(p.name for p in (dart / "rl" / "checkpoints" / "step_1" / "adapters").iterdir()) == [
        "reason",
        "tool",
    ]
    inputs = json.loads((dart / "stages" / "rl.json").read_text())["inputs"]
    assert inputs["topology"] == "dart" and inputs["warm_topology"] == "shared"
    assert results["evals"]["rl/gsm8k"]["n"] == 2  # the DART adapters evaluated (their own names)
    assert (
        main(["recipe", name, "--out", str(dart), "--topology", "dart", "--warm-from", str(out), *argv[4:]])
        == 0
    )
    assert capsys.readouterr().out.count("done already") == len(STAGES)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["nope"], "unknown recipe 'nope'; recipes: gsm8k-msarl, gsm8k-tir"),
        (["gsm8k-tir", "--limit", "0"], "--limit 0: allowed an integer >= 1"),
        (["gsm8k-tir", "--demos", "0"], "--demos 0: allowed an integer >= 1"),
        (["gsm8k-tir", "--steps", "-1"], "--steps -1: allowed an integer >= 0"),
        (
            ["gsm8k-tir", "--topology", "isolated"],
            "--topology 'isolated': recipe gsm8k-tir runs shared, dart",
        ),
        (["gsm8k-tir", "--data", "{missing}"], "no gsm8k/train.jsonl there"),
        (["gsm8k-tir", "--set", "rollout.n=0"], "rollout.n"),
    ],
)
def test_bad_input_is_one_clear_line_before_anything_runs(args, message, tmp_path, shared_data, capsys):
    out = tmp_path / "out"
    args = [a.replace("{missing}", str(tmp_path / "no-data")) for a in args]
    argv = ["recipe", *args, "--out", str(out)]
    assert main(argv if "--data" in args else [*argv, "--data", str(shared_data)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rolerl recipe: error: ") and message in err and "Traceback" not in err
    assert not out.exists(), "nothing was written"


def test_pipeline_markers_skip_finished_stages_and_refuse_changed_inputs(tmp_path, monkeypatch):
    calls: list[str] = []

    def stage_interrupted():
        raise KeyboardInterrupt

    def stage(name: str, fail: bool = False):
        def fn():
            calls.append(name)
            if fail:
                raise RuntimeError("killed")
            return {"value": len(calls)}

        return fn

    log: list[str] = []
    pipe = Pipeline(2, log.append, tmp_path)
    assert pipe.run("a", "first", stage("a"), {"limit": 2, "tags": ("x",)}) == {"value": 1}
    with pytest.raises(RuntimeError):
        pipe.run("b", "second", stage("b", fail=True))
    assert log == ["1/2 first", "2/2 second"] and not (tmp_path / "stages" / "b.json").exists()
    again = Pipeline(2, log.append, tmp_path)
    assert again.run("a", "first", stage("a"), {"limit": 2, "tags": ("x",)}) == {"value": 1}  # the marker's
    assert again.run("b", "second", stage("b")) == {"value": 3}
    assert (
        calls == ["a", "b", "b"] and again.skipped == ["a"] and log[2].startswith("1/2 first: done already")
    )
    with pytest.raises(ValueError, match=r"stage 'a' finished with limit=2 \(now 3\)"):
        Pipeline(2, log.append, tmp_path).run("a", "first", stage("a"), {"limit": 3, "tags": ("x",)})
    # a stage's seconds are those of every run it took, the cut-short ones too
    clock = iter([0.0, 5.0, 10.0, 12.0, 20.0, 21.5])
    monkeypatch.setattr("rolerl.pipeline.time.perf_counter", lambda: next(clock))
    for _ in range(2):
        with pytest.raises(KeyboardInterrupt):
            Pipeline(1, log.append, tmp_path).run("c", "third", stage_interrupted)
    assert json.loads((tmp_path / "stages" / "c.partial.json").read_text()) == {"seconds": 7.0, "runs": 2}
    last = Pipeline(1, log.append, tmp_path)
    assert last.run("c", "third", stage("c")) == {"value": 4} and last.seconds["c"] == 8.5
    assert log[-1] == "1/1 third (continued: 7s in 2 earlier runs)"
    marker = json.loads((tmp_path / "stages" / "c.json").read_text())
    assert (
        marker["seconds"] == 8.5
        and marker["runs"] == 3
        and not (tmp_path / "stages" / "c.partial.json").exists()
    )
    monkeypatch.undo()
    plain = Pipeline(1, log.append)  # no root: nothing is marked, every run runs
    plain.run("a", "first", stage("a"))
    plain.run("a", "first", stage("a"))
    assert calls[-2:] == ["a", "a"] and set(plain.seconds) == {"a"}


def test_an_imitation_cut_short_goes_on_from_its_checkpoint(tmp_path, monkeypatch, caplog):
    """The sft stage of a rerun resumes the imitation a Ctrl-C stopped (its marker missing, a checkpoint of
    each step here); one cut short under other inputs (another command into the directory) starts again."""
    import dataclasses

    import rolerl.train.sft as sft_module
    from rolerl.recipe import RecipeSettings, _imitate
    from rolerl.train.checkpoint import RunDir, TrainingInterrupted
    from tests.train.test_sft import _demos

    root = tmp_path / "run"
    root.mkdir()
    _demos(root / "demos.jsonl", 5)
    sets = ("model.device=cpu", "run.tensorboard=false", "sft.batch_size=2", "run.checkpoint_every=1",
            "train.micro_batch_size=1")  # fmt: skip
    settings = RecipeSettings("gsm8k-tir", out=str(root), model="tiny:llama", overrides=sets, progress=False)
    real, calls = sft_module._imitation_step, []

    def interrupted_in_step_3(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(sft_module, "_imitation_step", interrupted_in_step_3)
    with pytest.raises(TrainingInterrupted, match=r"interrupted at step 3 \(step 2 is checkpointed\)"):
        _imitate(settings, root, print)
    monkeypatch.setattr(sft_module, "_imitation_step", real)
    said: list[str] = []
    caplog.set_level("INFO")
    assert _imitate(settings, root, said.append) == {"adapters": str(root / "sft" / "adapters")}
    assert f"resume {root / 'sft'}: from step 2" in caplog.text and not said
    assert [r["step"] for r in RunDir(root / "sft", tensorboard=False).read_metrics()] == [1, 2, 3]
    other = dataclasses.replace(settings, overrides=(*sets, "sft.lr=1e-3"))
    _imitate(other, root, said.append)
    assert said == [
        f"the imitation cut short in {root / 'sft'} was trained on other inputs (sft.lr: 0.0002 -> 0.001): it "
        "starts again"
    ]
    assert [r["step"] for r in RunDir(root / "sft", tensorboard=False).read_metrics()] == [1, 2, 3]


def test_a_trainer_stopped_inside_the_recipe_says_to_rerun_the_recipe(tmp_path, monkeypatch, capsys):
    """Ctrl-C or SIGTERM in the imitation or GRPO stage: the trainer checkpointed its last step, and the
    command to continue is the recipe itself (its rerun resumes that stage), exit status 130."""
    import rolerl.recipe
    from rolerl.train.checkpoint import TrainingInterrupted

    def stopped(settings, log):
        raise TrainingInterrupted(17, 16, tmp_path / "sft", "stopped by SIGTERM", command="sft")

    monkeypatch.setattr(rolerl.recipe, "run_recipe", stopped)
    assert main(["recipe", "gsm8k-msarl", "--out", str(tmp_path), "--no-progress"]) == 130
    assert capsys.readouterr().err.strip() == (
        f"rolerl recipe: stopped by SIGTERM at step 17 of {tmp_path / 'sft'} (step 16 is checkpointed); rerun "
        "the same command to continue"
    )
