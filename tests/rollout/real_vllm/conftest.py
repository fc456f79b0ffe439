"""Real vLLM (its CPU build; `make test-vllm` runs these in .venv-vllm, marker `vllm`): one offline engine
and one `vllm serve` per test session, shared by the tests (each starts in ~1-2 min on 2 cores), cleaned
of LoRA adapters after each test. The server runs on loopback with runtime LoRA loading on, from another
working directory than the tests', on a copy of the default model whose generation_config.json asks for a
repetition penalty and with a `--max-model-len` below the model's: the settings issue 46 found the backend
mishandled. A second server with raw log-probs starts only for the test that needs it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB per engine: the machine is shared
START_TIMEOUT_S = 900.0  # a cold start on a busy 2-core machine
SERVER_MAX_LEN = 512  # the server's --max-model-len, below the model's 8192
REPORT: list[str] = []  # what the session measured (start-up times, parity), printed at its end


def pytest_terminal_summary(terminalreporter) -> None:
    for line in REPORT:
        terminalreporter.write_line(f"real vLLM: {line}")


@pytest.fixture(scope="session")
def default_dir() -> Path:
    """The default model's converted safetensors directory (what vLLM loads)."""
    from rolerl.models.load import _resolve_to_directory

    return Path(_resolve_to_directory("default"))


def vllm_config(run_dir, *sets: str):
    from rolerl.config import load_config

    return load_config(None, [
        f"run.dir={run_dir}", "rollout.backend=vllm", "rollout.max_len=1024",
        "rollout.vllm={max_loras: 4, max_lora_rank: 16, enforce_eager: true}", *sets,
    ])  # fmt: skip


@pytest.fixture(scope="session")
def offline_engine(default_model_cpu, tmp_path_factory):
    """vLLM's offline engine (its `AsyncLLM`), built by rolerl's own `_offline_llm` (fp32 on CPU, processed
    log-probs)."""
    from rolerl.rollout.vllm_backend import _offline_llm

    cfg = vllm_config(tmp_path_factory.mktemp("offline"))
    t0 = time.perf_counter()
    llm = _offline_llm("default", cfg, 8, default_model_cpu[0])
    REPORT.append(f"offline LLM start-up {time.perf_counter() - t0:.1f} s")
    yield llm
    llm.shutdown()  # the engine-core process it spawned, and its loop thread


def _drop_loras(llm) -> None:
    for lora_id in sorted(llm.llm_engine.list_loras()):
        llm.llm_engine.remove_lora(lora_id)
    llm.reset_prefix_cache()


@pytest.fixture
def engine(offline_engine):
    """The session's engine for one test; its adapters are unloaded afterwards."""
    yield offline_engine
    _drop_loras(offline_engine)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 10.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read().decode())


class Server:
    """A `vllm serve` process on loopback (its own process group, so teardown ends its engine too)."""

    def __init__(self, model_dir: Path, cwd: Path, *args: str) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = cwd / "server.log"
        env = dict(os.environ, VLLM_ALLOW_RUNTIME_LORA_UPDATING="True")
        # `vllm serve` of vllm-cpu 0.32.0 dies at start (its CLI asks for the version of a package named
        # "vllm", and the CPU build's is "vllm-cpu"); the server module it runs starts the same server
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--host", "127.0.0.1",
               "--port", str(self.port), "--dtype", "float32", "--enable-lora", "--max-loras", "4",
               "--max-lora-rank", "16", "--enforce-eager", "--seed", "0",
               # whole prefills (vllm_checks.cpu_scheduling): 16 requests of at most SERVER_MAX_LEN a step
               "--max-num-seqs", "16", "--max-num-batched-tokens", str(16 * SERVER_MAX_LEN), *args]  # fmt: skip
        t0 = time.perf_counter()
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)  # fmt: skip
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}:\n{self.tail()}")
            if time.perf_counter() - t0 > START_TIMEOUT_S:
                self.stop()
                raise RuntimeError(
                    f"vllm serve did not answer within {START_TIMEOUT_S:.0f} s:\n{self.tail()}"
                )
            try:
                _get(self.url + "/v1/models", timeout=2)
                break
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(2)
        self.startup_s = time.perf_counter() - t0

    def tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-40:])

    def drop_loras(self) -> None:
        """Unload every adapter the server lists (a LoRA's card names its base model as parent)."""
        for card in _get(self.url + "/v1/models")["data"]:
            if card.get("parent"):
                body = json.dumps({"lora_name": card["id"]}).encode()
                req = urllib.request.Request(self.url + "/v1/unload_lora_adapter", data=body, method="POST",
                                             headers={"Content-Type": "application/json"})  # fmt: skip
                urllib.request.urlopen(req, timeout=30).read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)


@pytest.fixture(scope="session")
def penalised_model(default_dir, tmp_path_factory) -> Path:
    """The default model with `repetition_penalty: 1.3` in its generation_config.json: a server fills a
    request's missing sampling fields from it (and applies them before its processed log-probs)."""
    out = tmp_path_factory.mktemp("penalised_model")
    for f in default_dir.iterdir():
        if f.name != "generation_config.json":
            (out / f.name).symlink_to(f)
    generation = json.loads((default_dir / "generation_config.json").read_text())
    (out / "generation_config.json").write_text(json.dumps(generation | {"repetition_penalty": 1.3}))
    return out


@pytest.fixture(scope="session")
def vllm_server(penalised_model, tmp_path_factory):
    """`vllm serve` with processed log-probs, started in a directory of its own (not the tests' cwd)."""
    server = Server(penalised_model, tmp_path_factory.mktemp("server_cwd"), "--max-model-len",
                    str(SERVER_MAX_LEN), "--logprobs-mode", "processed_logprobs")  # fmt: skip
    REPORT.append(f"vllm serve start-up {server.startup_s:.1f} s")
    yield server
    server.stop()


@pytest.fixture
def server(vllm_server):
    yield vllm_server
    vllm_server.drop_loras()


@pytest.fixture(scope="session")
def raw_server(default_dir, tmp_path_factory):
    """`vllm serve` left at vLLM's default log-probs mode (raw: before temperature)."""
    server = Server(
        default_dir, tmp_path_factory.mktemp("raw_server_cwd"), "--max-model-len", str(SERVER_MAX_LEN)
    )
    REPORT.append(f"vllm serve (raw log-probs) start-up {server.startup_s:.1f} s")
    yield server
    server.stop()
