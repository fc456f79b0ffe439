"""The vLLM backend over HTTP (`rollout.vllm.url`, issue 17) against a fake vLLM server: an HTTP server
in this process speaking the OpenAI-compatible endpoints the client uses (completions with token ids in
and out, runtime LoRA loading and unloading, the model list), backed by the replaying fake engine. The
same token stream gives the built-in engine's turns; adapters are loaded and unloaded by name; server
errors surface with the server's answer. A real vLLM server is never contacted here."""

from __future__ import annotations

import contextlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

import rolerl
from rolerl.rollout.vllm_backend import VLLMBackend
from rolerl.rollout.vllm_http import API, ServerError, ServerLLM
from tests.models.test_lora import randomize_adapters
from tests.rollout import fake_vllm
from tests.rollout.test_engine import EchoTool
from tests.rollout.test_vllm_backend import ADAPTERS, reference, run_all, same_turn, tables


class FakeServer(BaseHTTPRequestHandler):
    llm: fake_vllm.FakeLLM  # set per test
    ids: dict[str, int] = {}
    paths: dict[str, str] = {}
    version = "0.32.0"
    max_model_len: int | None = None  # what /v1/models reports (None: a server that does not say)
    bodies: list | None = None  # (path, body) of every POST, when a test wants them

    def log_message(self, *args) -> None:  # quiet
        pass

    def reply(self, code: int, payload) -> None:
        data = (payload if isinstance(payload, str) else json.dumps(payload)).encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/version":
            return self.reply(200, {"version": self.version})
        if self.path != "/v1/models":
            return self.reply(404, {"error": "no such route"})
        names = ["base", *(name for name, _ in self.llm.llm_engine.loras.values())]
        cards = [{"id": n} for n in names]
        if self.max_model_len is not None:
            cards[0]["max_model_len"] = self.max_model_len
        self.reply(200, {"data": cards})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.bodies is not None:
            self.bodies.append((self.path, body))
        engine = self.llm.llm_engine
        if self.path == "/v1/load_lora_adapter":
            lora_id = len(self.ids) + 100  # the server's own ids, unrelated to the client's
            self.ids[body["lora_name"]] = lora_id
            self.paths[body["lora_name"]] = body["lora_path"]
            engine.add_lora(fake_vllm.LoRARequest(body["lora_name"], lora_id, body["lora_path"]))
            return self.reply(200, "Success: LoRA adapter loaded")
        if self.path == "/v1/unload_lora_adapter":
            if body["lora_name"] not in self.ids:
                return self.reply(
                    404, {"message": f"The lora adapter '{body['lora_name']}' cannot be found."}
                )
            engine.remove_lora(self.ids.pop(body["lora_name"]))
            return self.reply(200, "Success: LoRA adapter unloaded")
        if self.path != "/v1/completions":
            return self.reply(404, {"error": "no such route"})
        if len(body.get("stop", [])) > 4:  # vLLM's server validates the OpenAI API's limit
            return self.reply(400, {"error": "body.stop: List should have at most 4 items after validation"})
        if not body.get("return_token_ids") or not body.get("return_tokens_as_token_ids"):
            return self.reply(400, {"error": "the client must ask for token ids"})
        lora = None
        if body["model"] != "base":
            lora = fake_vllm.LoRARequest(body["model"], self.ids[body["model"]], self.paths[body["model"]])
        fields = {k: v for k, v in body.items() if k in fake_vllm.SamplingParams.__dataclass_fields__}
        out = self.llm._one(body["prompt"], fake_vllm.SamplingParams(**fields), lora)
        c = out.outputs[0]
        choice = {
            "token_ids": c.token_ids, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
            "logprobs": {"tokens": [f"token_id:{t}" for t in c.token_ids],
                         "token_logprobs": [d[t].logprob for d, t in zip(c.logprobs, c.token_ids, strict=True)]},
        }  # fmt: skip
        if out.prompt_logprobs is not None:
            choice["prompt_logprobs"] = [None if d is None else {str(k): {"logprob": v.logprob} for k, v in d.items()}
                                         for d in out.prompt_logprobs]  # fmt: skip
        self.reply(200, {"choices": [choice]})


@contextlib.contextmanager
def serve(bodies: list | None = None, max_model_len: int | None = 256):
    """The fake server on a free loopback port; yields its URL."""
    FakeServer.ids, FakeServer.paths, FakeServer.version, FakeServer.bodies = {}, {}, "0.32.0", bodies
    FakeServer.max_model_len = max_model_len
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), FakeServer)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    finally:
        httpd.shutdown()


@pytest.fixture
def server():
    with serve(max_model_len=None) as url:
        yield url


def test_http_backend_gives_the_engines_turns_and_manages_adapters_by_name(server, tmp_path, tokenizer):
    model, tok = rolerl.tiny_model("llama", seed=0, tokenizer=tokenizer)
    rolerl.add_adapters(model, ADAPTERS, rank=4)
    randomize_adapters(model, std=0.2)
    reqs, want, streams, engine = reference(model, tok, tables()["dart"])
    FakeServer.llm = fake_vllm.FakeLLM(tok, streams, eos_ids=engine.eos_ids)
    llm = ServerLLM(server)
    assert llm.model == "base"
    b = VLLMBackend(llm, tok, adapters=ADAPTERS, work_dir=tmp_path, tools={"echo": EchoTool()}, max_len=engine.max_len,
                    logprobs="recompute", vocab_size=model.config.vocab_size, eos_ids=sorted(engine.eos_ids), api=API,
                    tag="")  # fmt: skip
    b.sync(model)
    assert llm.list_loras() == {1, 2} and set(FakeServer.ids) == {"reason@v1", "tool@v1"}
    for got, w in zip(run_all(b, reqs), want, strict=True):
        same_turn(got, w)
    with torch.no_grad():  # a training step on the tool adapter
        for name, p in model.named_parameters():
            if "lora_B" in name and name.endswith(".tool"):
                p.add_(0.5)
    metrics = b.sync(model)
    assert metrics["rollout/adapter_version/tool"] == 2.0 and metrics["rollout/probe_delta/tool"] > 0
    assert set(FakeServer.ids) == {"reason@v1", "tool@v2"}  # v1 of tool unloaded on the server, by name
    with pytest.raises(ServerError, match="cannot be found"):
        llm._post("/v1/unload_lora_adapter", {"lora_name": "nope@v9"})
    b.close()


def test_an_unreachable_server_says_so():
    with pytest.raises(ServerError, match="is the vLLM server running"):
        ServerLLM("http://127.0.0.1:9", timeout_s=2)
