"""Data parallelism on torch.distributed (issue 18), with gloo and two CPU processes: two ranks on a global
batch give one process's adapter update and metrics (strict isolation, and an adapter no row of one rank
reaches, included); a torchrun run equals one process's run; a 2-rank run resumed on 1 rank continues it.

Equal "to float tolerance": the ranks cut the same rows into different micro-batches, so sums run in
another order, and the adapters are float32 (the base of the update-level test is float64). One process
regrouping micro-batches moves the adapters by up to ~3e-6 after these updates; a lost or double-counted
row moves them by ~lr = 1e-2."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rolerl.config import load_config
from rolerl.models.tiny import default_tokenizer
from rolerl.roles import ANSWER, REASONING, TOOL_CALL, TOOL_OUTPUT, shift
from rolerl.train.checkpoint import RunDir, checkpoints
from rolerl.train.distributed import SINGLE, Dist
from rolerl.train.optim import model_optimizer
from rolerl.train.policy import token_logprobs
from rolerl.train.update import Part, Schedule, ppo_update
from rolerl.types import Turn, collate
from tests.train.test_update import dart_model, settings

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("dist_worker.py")
R, C, X, A = REASONING, TOOL_CALL, TOOL_OUTPUT, ANSWER


# ---- the update: 2 ranks == 1 process on the same global batch


def global_batch(model, route_of):
    """8 rows: rows 0-4 call a tool (both adapters compute positions), rows 5-7 do not (the tool adapter
    computes nothing there). Rank 0 owns rows 0-4, rank 1 rows 5-7, so rank 1 never reaches the tool
    adapter. Old log-probs are the model's own plus noise (some ratios clip)."""
    g = torch.Generator().manual_seed(0)
    tools, plain = [R, R, C, C, C, X, X, R, A, A, R], [R, R, R, A, A, R]
    turns = []
    for i in range(8):
        kinds = tools[: 6 + i] if i < 5 else plain[: 3 + i - 5 + 1]
        prompt = torch.randint(3, 4000, (3 + i % 3,), generator=g).tolist()
        completion = torch.randint(3, 4000, (len(kinds),), generator=g).tolist()
        routes = shift(["prompt"] * len(prompt) + kinds, route_of)
        turns.append(Turn("policy", prompt, completion, kinds, routes, [-1.0] * len(kinds)))
    adv = (torch.randn(8, generator=g) * 1.5).tolist()
    weights = [1.0, 0.5, 2.0, 1.0, 0.25, 1.5, 1.0, 0.75]
    batch = collate(turns, adv, {"policy": route_of}, weights=weights, pad_id=2)
    with torch.no_grad():
        logp = token_logprobs(model, batch, temperature=0.8).logp.to(batch.old_logp.dtype)
    noise = torch.randn(logp.shape, generator=g, dtype=logp.dtype) * 0.3
    batch.old_logp[:, :-1] = torch.where(batch.loss_mask[:, :-1].bool(), logp + noise, 0.0)
    return batch, [list(range(5)), [5, 6, 7]]


def update(dist: Dist, isolation: str, merged: bool, inert: bool = False) -> dict:
    """`inert`: no KL or entropy term, and rows 2 and 5-7 (all of rank 1's) with zero advantage: they run no
    forward, so rank 1 computes nothing at all."""
    model, _, route_of = dart_model(default_tokenizer(), dtype=torch.float64)
    batch, owned = global_batch(model, route_of)
    optimizer = model_optimizer(model, lr=1e-2, weight_decay=0.1)
    coefs = {} if inert else {"beta": 0.05, "entropy_coef": 0.01}
    s = settings(loss_agg="seq-mean-token-mean", old_logp="recompute", **coefs)
    s.isolation = isolation
    if inert:
        batch.advantages[[2, 5, 6, 7]] = 0.0
    part = Part.of(model, batch, owned[dist.rank] if dist.active else None)
    metrics = ppo_update(
        [part], optimizer, s, Schedule(ppo_epochs=2, mini_batches=2, merged=merged),
        micro_batch_size=2, generator=torch.Generator().manual_seed(3), dist=dist,
    )  # fmt: skip
    params = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    return {"metrics": metrics, "params": params, "steps": dict(optimizer.steps)}


CASES = [
    ("strict", False, False),
    ("route", True, False),
    ("route", False, True),
]  # (isolation, merged, inert)


def update_rank(rank: int, world: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        results = [update(Dist(rank, world), *case) for case in CASES]
        torch.save(results, f"{out}.{rank}")
    finally:
        torch.distributed.destroy_process_group()


def test_two_ranks_update_equals_one_process(tmp_path):
    import torch.multiprocessing as mp

    out = str(tmp_path / "result")
    mp.spawn(update_rank, args=(2, str(tmp_path / "store"), out), nprocs=2, join=True)
    ranks = [torch.load(f"{out}.{r}", weights_only=False) for r in range(2)]
    for case, (isolation, merged, inert) in enumerate(CASES):
        one = update(SINGLE, isolation, merged, inert)
        assert one["metrics"]["update/inert_frac"] == (0.5 if inert else 0.0)
        for got in (ranks[0][case], ranks[1][case]):
            assert got["steps"] == one["steps"] and one["steps"]["tool"] > 0
            for name, p in one["params"].items():
                torch.testing.assert_close(got["params"][name], p, rtol=1e-4, atol=1e-5)
            assert got["metrics"].keys() == one["metrics"].keys()
            for k, v in one["metrics"].items():
                assert got["metrics"][k] == pytest.approx(v, rel=1e-4, abs=1e-6), (isolation, k)
        for name, p in ranks[0][case]["params"].items():  # the ranks stay identical to the bit
            assert torch.equal(p, ranks[1][case]["params"][name])


# ---- whole runs: torchrun with 2 ranks == one process; a 2-rank run resumed on 1 rank


def run_config(run_dir: str, *extra: str):
    """The test runs' config: the echo task (a signal a random model produces) on the tiny model, 2 tasks
    x 4 samples a step, 2 mini-batches, per-kind gradient diagnostics every step, an evaluation at step 2."""
    sets = [
        "model.spec=tiny:llama", "model.device=cpu", "train.bf16=false", "adapters.rank=4",
        "rollout.n=4", "rollout.max_new_tokens=8", "train.tasks_per_step=2", "train.micro_batch_size=3",
        "train.mini_batches=2", "optim.lr=1e-2", "optim.warmup_steps=0", "algorithm.beta=0.05",
        "train.steps=3", "run.checkpoint_every=1", "run.keep_last=3", "run.progress=false",
        "run.tensorboard=false", "eval.every=2", "eval.limit=3", "diagnostics.grad_every=1",
        "diagnostics.grad_groups=kind", f"run.dir={run_dir}",
    ]  # fmt: skip
    return load_config(None, [*sets, *extra])


def torchrun(run_dir: Path, *args: str, ranks: int = 2) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
           str(WORKER), str(run_dir), *args]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def metrics(run_dir: Path) -> list[dict]:
    rows = RunDir(run_dir, tensorboard=False).read_metrics()
    return [{k: v for k, v in r.items() if not k.startswith("time/") and k != "eval/seconds"} for r in rows]


def adapters(run_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    step, path = checkpoints(run_dir)[-1]
    return load_file(path / "adapters" / "policy" / "adapter_model.safetensors")


def assert_runs_match(got: list[dict], want: list[dict]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for a, b in zip(got, want, strict=True):
        assert a.keys() == b.keys()
        for k, v in b.items():
            # the rollout/trainer mismatch is itself fp32 rounding (~1e-6): only its size can agree
            tol = 1e-4 if k.startswith("logp_mismatch/") else 1e-6
            assert math.isclose(a[k], v, rel_tol=1e-4, abs_tol=tol), (a["step"], k, a[k], v)


def test_torchrun_two_ranks_equal_one_process_and_resume_on_one_rank(tmp_path):
    from rolerl.train.rl import train
    from rolerl.workflows import SingleTurn
    from tests.workflows.test_single_turn import EchoTask

    one, two = tmp_path / "one", tmp_path / "two"
    task = EchoTask()
    train(run_config(str(one)), task=task, workflow=SingleTurn(task))
    torchrun(two)
    want = metrics(one)
    assert len(want) == 3 and any(r["reward/std"] > 0 for r in want) and "eval/pass@1" in want[1]
    assert want[2]["kind/reasoning/grad_norm/policy"] > 0  # the diagnostics ran (on summed gradients)
    assert_runs_match(metrics(two), want)
    for name, w in adapters(one).items():
        torch.testing.assert_close(adapters(two)[name], w, rtol=1e-4, atol=1e-6)
    # Killed after step 2: resume the 2-rank run on one process; it redoes step 3 as the ranks did.
    final = adapters(two)
    shutil.rmtree(dict(checkpoints(two))[3])
    train(run_config(str(two)), task=task, workflow=SingleTurn(task), resume=True)
    assert_runs_match(metrics(two), want)
    for name, w in final.items():
        torch.testing.assert_close(adapters(two)[name], w, rtol=1e-4, atol=1e-6)


def test_cli_train_under_torchrun(tmp_path):
    """`torchrun -m rolerl train CONFIG` is the documented entry point: two ranks, one metrics file, one
    line per step."""
    run_dir = tmp_path / "cli"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "rolerl",
           "train", "smoke", "--set", "model.spec=tiny:llama", "model.device=cpu",
           "train.steps=1", "rollout.max_new_tokens=6", "train.bf16=false", "run.progress=false",
           f"run.dir={run_dir}"]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1] and rows[0]["role/policy/turns"] == 8.0
    assert [s for s, _ in checkpoints(run_dir)] == [1]
