"""Shared fixtures: tiny random models of each family and (for `slow` tests) the real default model."""

from __future__ import annotations

import os

import pytest
import torch

from rolerl.models.tiny import ARCHS, default_tokenizer, tiny_model


def _test_threads() -> int:
    """The thread count changes how CPU kernels split their sums, so it is a knob, not a constant: CI runs
    the suite with 1 and 2 so a test that relies on one reduction order fails here, not on another CPU.
    On a machine busy with other work use 1: two threads on two busy cores wait for each other at every
    op, and the tiny-model tests (thousands of small ops) then run 5-50x slower."""
    raw = os.environ.get("ROLERL_TEST_THREADS", "2")
    if not raw.isdigit() or int(raw) < 1:
        raise pytest.UsageError(f"ROLERL_TEST_THREADS must be a positive integer; got {raw!r}")
    return int(raw)


torch.set_num_threads(_test_threads())


def pytest_report_header(config) -> str:
    threads, cap = torch.get_num_threads(), torch.backends.cpu.get_cpu_capability()
    return f"rolerl: torch {torch.__version__}, {threads} threads (ROLERL_TEST_THREADS), CPU {cap}"


@pytest.fixture(scope="session")
def tokenizer():
    return default_tokenizer()


@pytest.fixture(params=ARCHS)
def tiny(request, tokenizer):
    """`(model, tokenizer)` for each tiny family, fresh per test (tests modify models in place)."""
    return tiny_model(request.param, seed=0, tokenizer=tokenizer)


@pytest.fixture(scope="session")
def default_model_cpu():
    """The real default model (SmolLM2-135M-Instruct), fp32. Tests must not modify it: deepcopy first."""
    from rolerl import load_model

    return load_model("default", dtype="float32")


@pytest.fixture(scope="session")
def shared_data():
    """`../shared/data` beside the checkout (or `ROLERL_SHARED_DATA`): the real benchmark files. Missing is
    an error, not a skip: CI has them, and a test that silently skips proves nothing."""
    from pathlib import Path

    root = Path(os.environ.get("ROLERL_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))
    if not (root / "SOURCES.md").is_file():
        raise pytest.UsageError(
            f"benchmark data not found at {root}: check out ../shared beside the repo or set ROLERL_SHARED_DATA"
        )
    return root


def pytest_collection_modifyitems(config, items) -> None:
    """Tests marked `vllm` need real vLLM (`make test-vllm` runs them in .venv-vllm); elsewhere they skip,
    found out without importing vLLM (a slow import), so `make test` stays fast and needs no vLLM."""
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        return
    skip = pytest.mark.skip(reason="needs real vLLM: run `make test-vllm`")
    for item in items:
        if item.get_closest_marker("vllm") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def sandbox():
    """The real Python sandbox, one per module; a test that uses it skips without root (CI runs as root), so
    the module's tests that need no sandbox still run."""
    if os.geteuid() != 0:
        pytest.skip("the Python sandbox needs root (CI runs as root)")
    from rolerl.tools.python_sandbox import PythonSandbox

    with PythonSandbox() as box:
        yield box
