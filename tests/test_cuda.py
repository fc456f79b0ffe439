"""CUDA correctness (issue 18), run by `benchmarks/gpu_check.sh` on a GPU machine and skipped elsewhere:
the engine's greedy tokens equal HF `generate`'s and its log-probs equal the trainer's recompute, on the
GPU, in fp32 (TF32 off) and bf16. Tiny Qwen3 with the byte tokenizer: nothing to download."""

from __future__ import annotations

import pytest
import torch

import rolerl
from rolerl.models.tiny import byte_tokenizer, tiny_model
from rolerl.roles import KINDS
from rolerl.rollout.engine import Engine, GenerationRequest
from rolerl.rollout.sampling import SamplingParams
from rolerl.train.policy import token_logprobs
from rolerl.types import collate

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="no CUDA device (benchmarks/gpu_check.sh runs these)"
    ),
]
PROMPTS = ["Why is the sky blue?", "def add(a, b):", "1, 2, 3, 4,", "Once upon a time"]


@pytest.fixture(autouse=True)
def no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def model_on_gpu(dtype: torch.dtype, adapters: bool):
    tok = byte_tokenizer()
    model, tok = tiny_model("qwen3", seed=0, tokenizer=tok, dtype=dtype)
    model.config.eos_token_id = model.generation_config.eos_token_id = tok.eos_token_id
    model.config.pad_token_id = model.generation_config.pad_token_id = tok.pad_token_id
    if adapters:
        rolerl.add_adapters(model, ["a", "b"], rank=4)
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(1)
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.normal_(0.0, 0.2)
    return model.cuda(), tok


def ids(tok, text: str) -> list[int]:
    chat = [{"role": "user", "content": text}]
    return list(tok.apply_chat_template(chat, add_generation_prompt=True, return_dict=True)["input_ids"])


def test_engine_greedy_equals_hf_generate_fp32_on_cuda():
    model, tok = model_on_gpu(torch.float32, adapters=False)
    reqs = [GenerationRequest(ids(tok, p), SamplingParams(greedy=True, max_new_tokens=16, ignore_eos=True))
            for p in PROMPTS]  # fmt: skip
    engine = Engine(model, tok, max_batch=4)
    turns = engine.generate(reqs)
    engine.close()
    for req, turn in zip(reqs, turns, strict=True):
        want = model.generate(torch.tensor([req.prompt_ids], device="cuda"), max_new_tokens=16, do_sample=False,
                              eos_token_id=None, pad_token_id=tok.pad_token_id)[0, len(req.prompt_ids) :]  # fmt: skip
        assert turn.completion_ids == want.tolist()


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-4), (torch.bfloat16, 0.1)])
def test_rollout_logprobs_equal_trainer_recompute_on_cuda(dtype, tol):
    """Two routed adapters, rows alternating between them; bf16's tolerance is two kernels' rounding of an
    8-bit mantissa, fp32's the order of additions."""
    model, tok = model_on_gpu(dtype, adapters=True)
    tables = {"a": dict.fromkeys(KINDS, 0), "b": dict.fromkeys(KINDS, 1)}
    reqs = [GenerationRequest(ids(tok, p), SamplingParams(temperature=1.0, seed=i, max_new_tokens=24, ignore_eos=True),
                              role="ab"[i % 2], route_of=tables["ab"[i % 2]])
            for i, p in enumerate(PROMPTS * 2)]  # fmt: skip
    engine = Engine(model, tok, max_batch=8)
    turns = engine.generate(reqs)
    engine.close()
    batch = collate(turns, [0.0] * len(turns), tables, pad_id=tok.pad_token_id).to("cuda")
    with torch.no_grad():
        trainer = token_logprobs(model, batch, temperature=1.0).logp.float()
    mask = batch.loss_mask[:, :-1].bool()
    delta = (trainer - batch.old_logp[:, :-1].to(trainer))[mask].abs()
    assert int(mask.sum()) == 8 * 24 and float(delta.max()) < tol
