"""Rollout throughput: the rolerl engine vs transformers `generate`, same prompts, same dtype.

Case 1 (fixed length): temperature 1, top-p 1, top-k 0 passed explicitly to both sides, EOS ignored,
`--new-tokens` per row, batch 8 / 32 / 64. Rows:
  base   no adapter on either side
  lora   rolerl with two routed adapters (rows alternate between them, as two roles in one batch) vs HF
         with one unmerged PEFT adapter (what TRL rolls out with)
Each measurement runs in its own subprocess; median of `--runs` runs after a warm-up. Also model FLOPs
utilisation against the matmul peak measured in the same subprocess.

Case 2 (tools): EOS on, variable lengths, chat prompts; half the rows call a tool that sleeps 0.5 s
(the call is forced at a fixed step by wrapping the sampler, so every run makes the same calls). Reports
the share of the no-tool throughput the engine keeps.

    python benchmarks/rollout.py --json                                   # everything (~20 min on 2 cores)
    python benchmarks/rollout.py --dtypes bfloat16 --batches 32 --runs 3  # one cell
The last line with --json is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

from rolerl.hardware import describe, fast_dtypes

QUESTIONS = [
    "Write a short story about a robot learning to paint.",
    "Explain how a bicycle stays upright.",
    "What are the main causes of the seasons on Earth?",
    "Describe the water cycle for a ten-year-old.",
    "List some tips for learning a new language.",
    "Why is the sky blue?",
    "How do vaccines train the immune system?",
    "Summarise the plot of a heist movie you invent.",
]


def prompts(tokenizer, batch: int) -> list[list[int]]:
    out = []
    for i in range(batch):
        chat = [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)] + f" (variant {i})"}]
        out.append(
            list(
                tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=True)["input_ids"]
            )
        )
    return out


def matmul_peak(dtype) -> float:
    import torch

    a = torch.randn(2048, 2048, dtype=dtype)
    b = torch.randn(2048, 2048, dtype=dtype)
    a @ b
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 2 * 2048**3 / min(times)


def decode_flops(model, batch: int, prompt_len: float, new: int) -> float:
    """Forward FLOPs of generating `new` tokens per row: 2 * matmul params per token + attention."""
    cfg = model.config
    params = (
        sum(p.numel() for n, p in model.named_parameters() if "embed" not in n) + model.lm_head.weight.numel()
    )
    heads, head_dim = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads
    ctx = prompt_len + new / 2  # mean context length while decoding
    attn = 4 * cfg.num_hidden_layers * heads * head_dim * ctx
    return batch * new * (2 * params + attn)


def child(side: str, row: str, dtype: str, batch: int, new: int, runs: int) -> dict:
    import torch

    import rolerl

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    model, tok = rolerl.load_model("default", dtype=dtype)
    ids = prompts(tok, batch)
    if side == "hf":
        tok.padding_side = "left"
        enc = tok.pad({"input_ids": ids}, return_tensors="pt")
        if row == "lora":
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
        kwargs = dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=new)
        model.generation_config.eos_token_id = None  # fixed length: EOS ignored (no extra logits processor)

        def once() -> int:
            with torch.inference_mode():
                out = model.generate(**enc, **kwargs, pad_token_id=tok.pad_token_id)
            return (out.shape[1] - enc["input_ids"].shape[1]) * batch
    else:
        from rolerl.rollout.engine import Engine, GenerationRequest
        from rolerl.rollout.sampling import SamplingParams

        route_ofs = [None, None]
        if row == "lora":
            rolerl.add_adapters(model, ["reason", "tool"], rank=8)
            route_ofs = [
                dict.fromkeys(("prompt", "reasoning", "tool_call", "tool_output", "answer"), i)
                for i in (0, 1)
            ]
        engine = Engine(model, tok, max_batch=batch)

        def once() -> int:
            reqs = [
                GenerationRequest(
                    p,
                    SamplingParams(
                        temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=new, ignore_eos=True, seed=i
                    ),
                    route_of=route_ofs[i % 2],
                )
                for i, p in enumerate(ids)
            ]
            return sum(len(t.completion_ids) for t in engine.generate(reqs))

    once()  # warm-up
    times, tokens = [], 0
    for _ in range(runs):
        t0 = time.perf_counter()
        tokens = once()
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    flops = decode_flops(
        model if side == "rolerl" or row == "base" else model.base_model.model,
        batch,
        sum(map(len, ids)) / batch,
        new,
    )
    peak = matmul_peak(model.dtype)
    return {
        "side": side,
        "row": row,
        "dtype": dtype,
        "batch": batch,
        "tokens_per_s": tokens / med,
        "runs_s": [round(t, 2) for t in times],
        "mfu": flops / med / peak,
        "matmul_peak_gflops": peak / 1e9,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def tool_child(dtype: str, batch: int, requests: int, new: int, runs: int, with_tools: bool) -> dict:
    """EOS on, variable lengths; with tools, every other request calls a 0.5 s tool at its 8th token."""
    import torch

    import rolerl
    from rolerl.rollout.engine import Engine, GenerationRequest
    from rolerl.rollout.sampling import SamplingParams, sample
    from rolerl.tools.base import ToolResult

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    model, tok = rolerl.load_model("default", dtype=dtype)
    call = tok.encode("<code>sleep()</code>", add_special_tokens=False)

    class SleepTool:
        name, description = "sleep", "sleeps 0.5 s"

        def run(self, args: str) -> ToolResult:
            time.sleep(0.5)
            return ToolResult(stdout="done\n", wall_s=0.5)

    def sampler(logits, params, seeds, counters):
        tokens, logps = sample(logits, params, seeds, counters)
        for i, (s, c) in enumerate(zip(seeds.tolist(), counters.tolist(), strict=True)):
            if with_tools and s % 2 and 8 <= c < 8 + len(call):
                tokens[i] = call[c - 8]
                logps[i] = torch.log_softmax(logits[i].float(), -1)[tokens[i]]
        return tokens, logps

    engine = Engine(model, tok, max_batch=batch, tools={"sleep": SleepTool()}, sampler=sampler)
    ids = prompts(tok, requests)

    def once() -> tuple[int, float]:
        reqs = [
            GenerationRequest(p, SamplingParams(max_new_tokens=new, seed=i), tool="sleep")
            for i, p in enumerate(ids)
        ]
        t0 = time.perf_counter()
        turns = engine.generate(reqs)
        sampled = sum(sum(k != "tool_output" for k in t.kinds) for t in turns)
        return sampled, time.perf_counter() - t0

    once()
    results = [once() for _ in range(runs)]
    engine.close()
    rates = [n / t for n, t in results]
    return {
        "with_tools": with_tools,
        "tokens_per_s": statistics.median(rates),
        "sampled_tokens": results[-1][0],
        "tool_calls": engine.stats["tool_calls"],
    }


def run(args_list: list[str]) -> dict:
    out = subprocess.run([sys.executable, __file__, *args_list], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{args_list} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--dtypes",
        nargs="+",
        default=fast_dtypes(),
        choices=["float32", "bfloat16"],
        help="default: float32, plus bfloat16 where the CPU has native bf16 (rolerl.hardware)",
    )
    p.add_argument("--batches", nargs="+", type=int, default=[8, 32, 64])
    p.add_argument("--rows", nargs="+", default=["base", "lora"], choices=["base", "lora"])
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--skip-tools", action="store_true", help="skip case 2")
    p.add_argument("--json", action="store_true")
    p.add_argument("--child", nargs=4, metavar=("SIDE", "ROW", "DTYPE", "BATCH"), help=argparse.SUPPRESS)
    p.add_argument("--tool-child", nargs=3, metavar=("DTYPE", "BATCH", "WITH_TOOLS"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        side, row, dtype, batch = args.child
        print(json.dumps(child(side, row, dtype, int(batch), args.new_tokens, args.runs)))
        return
    if args.tool_child:
        dtype, batch, with_tools = args.tool_child
        print(
            json.dumps(
                tool_child(dtype, int(batch), 2 * int(batch), args.new_tokens, args.runs, with_tools == "1")
            )
        )
        return

    common = ["--new-tokens", str(args.new_tokens), "--runs", str(args.runs)]
    summary: dict = {
        "new_tokens": args.new_tokens,
        "runs": args.runs,
        "threads": int(os.environ.get("BENCH_THREADS", "2")),
        "machine": describe(),  # every figure says which CPU it came from
    }
    for dtype in args.dtypes:
        for row in args.rows:
            for batch in args.batches:
                res = {
                    side: run(["--child", side, row, dtype, str(batch), *common]) for side in ("hf", "rolerl")
                }
                key = f"{dtype}/{row}/b{batch}"
                summary[key] = {
                    "hf_tok_s": round(res["hf"]["tokens_per_s"], 1),
                    "rolerl_tok_s": round(res["rolerl"]["tokens_per_s"], 1),
                    "ratio": round(res["rolerl"]["tokens_per_s"] / res["hf"]["tokens_per_s"], 2),
                    # both against one peak (the rolerl subprocess's): single 2048^3 timings fluctuate
                    "hf_mfu": round(
                        res["hf"]["mfu"]
                        * res["hf"]["matmul_peak_gflops"]
                        / res["rolerl"]["matmul_peak_gflops"],
                        4,
                    ),
                    "rolerl_mfu": round(res["rolerl"]["mfu"], 4),
                    "matmul_peak_gflops": round(res["rolerl"]["matmul_peak_gflops"], 1),
                    "hf_peak_rss_mb": round(res["hf"]["peak_rss_mb"]),
                    "rolerl_peak_rss_mb": round(res["rolerl"]["peak_rss_mb"]),
                }
                print(key, summary[key], flush=True)
    if not args.skip_tools:
        dtype = args.dtypes[-1]
        plain = run(["--tool-child", dtype, "32", "0", *common])
        tools = run(["--tool-child", dtype, "32", "1", *common])
        summary[f"{dtype}/tools/b32"] = {
            "no_tool_tok_s": round(plain["tokens_per_s"], 1),
            "tool_tok_s": round(tools["tokens_per_s"], 1),
            "kept": round(tools["tokens_per_s"] / plain["tokens_per_s"], 3),
            "tool_calls": tools["tool_calls"],
        }
        print(f"{dtype}/tools/b32", summary[f"{dtype}/tools/b32"], flush=True)
    print(json.dumps(summary) if args.json else json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
