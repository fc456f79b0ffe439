"""A vLLM server over HTTP as the vLLM backend's engine (`rollout.vllm.url`): rollouts on a separate GPU.

`ServerLLM` speaks vLLM's OpenAI-compatible API and looks like the offline `LLM` to `VLLMBackend`, so the
backend's logic (segments, the recorder, adapter versions, the probe check) is the same in both modes:

- `POST /v1/completions` with the prompt as token ids, `return_token_ids` and
  `return_tokens_as_token_ids` (token ids out: the text is never re-tokenised), `logprobs: 0` (the sampled
  token's), the segment's stop strings (kept in the output) and seed; the adapter is the request's
  `model` (its LoRA name), the base model's name otherwise;
- every sampling field the server would otherwise fill from the model's `generation_config.json`
  (repetition, presence and frequency penalties, min-p) is sent explicitly, neutral;
- `POST /v1/load_lora_adapter` / `/v1/unload_lora_adapter` (start the server with
  `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`, `--enable-lora`, and `--logprobs-mode processed_logprobs`); the
  adapter directories must be readable by the server at the path the trainer wrote them to: paths are sent
  absolute, so a server on the same machine or on a shared filesystem mounted at the same path finds them
  (a remote server without one would need another transport, which is not built). Unloading drops the
  name; vLLM keeps the weights in its CPU LoRA cache until a newer adapter evicts them;
- each segment is one request, sent as soon as its episode is ready (`submit`, at most `workers` in
  flight, the rest queued here): episodes advance on their own, a tool call runs while others generate;
- `GET /v1/models` lists what is served (the base model and every loaded LoRA) and the server's
  `max_model_len`; `GET /version` its vLLM version (checked against `vllm_checks.MIN_VLLM`).

The trainer side needs no vLLM install in this mode: requests are built from the plain types below.
Tested against real `vllm serve` (tests/rollout/real_vllm/, `make test-vllm`) and a fake server
(tests/rollout/test_vllm_http.py).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from rolerl.rollout.vllm_checks import check_vllm_version


@dataclass
class SamplingParams:
    """The fields of vLLM's `SamplingParams` the backend sets, sent as the completion request's body."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_p: float = 0.0


@dataclass
class TokensPrompt:
    prompt_token_ids: list[int]


@dataclass
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str


MAX_STOPS = 4  # stop strings per completion request that vLLM's OpenAI-compatible server accepts
API = SimpleNamespace(SamplingParams=SamplingParams, TokensPrompt=TokensPrompt, LoRARequest=LoRARequest)


class ServerError(RuntimeError):
    """The vLLM server refused or failed a request; the message carries its answer."""


class ServerLLM:
    """vLLM's OpenAI-compatible server shaped like the offline `LLM` (`generate`, `llm_engine.add_lora`,
    `remove_lora`, `list_loras`). `url`: the server's root, e.g. `http://gpu-host:8000`; `model`: the base
    model's served name (default: the first model the server lists)."""

    def __init__(
        self, url: str, model: str | None = None, *, timeout_s: float = 600.0, workers: int = 64
    ) -> None:
        self.url = url.rstrip("/").removesuffix("/v1")
        self.timeout_s = timeout_s
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="rolerl-vllm-http")
        self.names: dict[int, str] = {}  # LoRA id -> name (the server knows adapters by name)
        self.version = str(self._request("GET", "/version", None).get("version", "0"))
        check_vllm_version(self.version, f"the vLLM server at {self.url}")
        models = self._request("GET", "/v1/models", None)["data"]
        self.model = model or models[0]["id"]
        base = next((m for m in models if m["id"] == self.model), models[0])
        # the longest prompt + completion it accepts (its --max-model-len); a longer request is answered 400
        self.max_model_len: int | None = base.get("max_model_len")
        self.llm_engine = self

    # ---- the offline LLM's surface ----------------------------------------------------------------------

    def submit(self, prompt, sampling_params, lora_request=None) -> Future:
        """Send one completion request now (at most `workers` in flight; the rest queue here); the future
        holds its output. The backend awaits each on its own, so an episode's tool call runs while other
        episodes' requests still generate."""
        return self.pool.submit(self._complete, prompt.prompt_token_ids, sampling_params, lora_request)

    def generate(self, prompts, sampling_params, lora_request=None, use_tqdm: bool = False) -> list[Any]:
        loras = lora_request if isinstance(lora_request, list) else [lora_request] * len(prompts)
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        jobs = [self.submit(p, s, r) for p, s, r in zip(prompts, params, loras, strict=True)]
        return [job.result() for job in jobs]

    def add_lora(self, req) -> bool:
        # absolute: the server resolves a relative path against its own working directory (then the hub)
        path = str(Path(req.lora_path).resolve())
        self._post("/v1/load_lora_adapter", {"lora_name": req.lora_name, "lora_path": path})
        self.names[req.lora_int_id] = req.lora_name
        return True

    def remove_lora(self, lora_id: int) -> bool:
        """Drop the name; the server frees the weights only when its LoRA cache evicts them."""
        self._post("/v1/unload_lora_adapter", {"lora_name": self.names.pop(lora_id)})
        return True

    def list_loras(self) -> set[int]:
        served = set(self._models())
        return {i for i, name in self.names.items() if name in served}

    # ---- HTTP ---------------------------------------------------------------------------------------------

    def _complete(self, prompt: list[int], sp, lora) -> SimpleNamespace:
        body = {k: v for k, v in _fields(sp).items() if v is not None and k != "n"}
        # the OpenAI API (and vLLM's server) takes at most 4 stop strings; they only save tokens here (the
        # backend's recorder enforces every stop and tag itself), so the first 4, the most useful, go
        body["stop"] = list(body.get("stop", []))[:MAX_STOPS]
        body |= {"model": lora.lora_name if lora is not None else self.model, "prompt": list(prompt),
                 "return_token_ids": True, "return_tokens_as_token_ids": True}  # fmt: skip
        choice = self._post("/v1/completions", body)["choices"][0]
        ids = choice.get("token_ids")
        lp = choice.get("logprobs") or {}
        if ids is None:  # servers before return_token_ids: the ids are in the "token_id:N" strings
            ids = [int(t.removeprefix("token_id:")) for t in lp.get("tokens", [])]
        values = lp.get("token_logprobs") or [None] * len(ids)
        logprobs = [{t: SimpleNamespace(logprob=v)} for t, v in zip(ids, values, strict=True)]
        completion = SimpleNamespace(token_ids=list(ids), logprobs=logprobs, finish_reason=choice.get("finish_reason"),
                                     stop_reason=choice.get("stop_reason"))  # fmt: skip
        prompt_lp = choice.get("prompt_logprobs")
        if prompt_lp is not None:
            prompt_lp = [None if d is None else {int(k): SimpleNamespace(logprob=v["logprob"]) for k, v in d.items()}
                         for d in prompt_lp]  # fmt: skip
        return SimpleNamespace(prompt_token_ids=list(prompt), outputs=[completion], prompt_logprobs=prompt_lp)

    def _models(self) -> list[str]:
        return [m["id"] for m in self._request("GET", "/v1/models", None)["data"]]

    def _post(self, path: str, body: dict) -> dict:
        return self._request("POST", path, body)

    def _request(self, method: str, path: str, body: dict | None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})  # fmt: skip
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as response:
                text = response.read().decode() or "{}"
        except urllib.error.HTTPError as e:
            raise ServerError(f"{method} {self.url}{path}: HTTP {e.code}: {e.read().decode()[:500]}") from e
        except urllib.error.URLError as e:
            raise ServerError(f"{method} {self.url}{path}: {e.reason} (is the vLLM server running?)") from e
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return {"text": text}  # the LoRA endpoints answer in plain text


def _fields(sp) -> dict[str, Any]:
    """A SamplingParams (ours, or vLLM's own) as a request body."""
    if hasattr(sp, "__dataclass_fields__"):
        return asdict(sp)
    return {k: getattr(sp, k) for k in SamplingParams.__dataclass_fields__ if hasattr(sp, k)}
