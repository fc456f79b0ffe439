"""Rollout throughput: the rolerl engine vs transformers `generate`, same prompts, same dtype.

Case 1 (fixed length): temperature 1, top-p 1, top-k 0 passed explicitly to both sides, EOS ignored,
`--new-tokens` per row, batch 8 / 32 / 64. Rows:
  base   no adapter on either side
  lora   rolerl with two routed adapters (rows alternate between them, as two roles in one batch) vs HF
         with one unmerged PEFT adapter (what TRL rolls out with)
  policy rolerl with one routed adapter on every token, on a model it shares (as a training run's engine
         shares the trainer's: plain weights kept, the adapter merged into the packed copy), vs the same HF
         side as `lora`
Each measurement runs in its own subprocess; median of `--runs` runs after a warm-up. Also model FLOPs
utilisation against the matmul peak measured in the same subprocess.

Case 2 (tools): EOS on, variable lengths, chat prompts; half the rows call a tool that sleeps 0.5 s
(the call is forced at a fixed step by wrapping the sampler, so every run makes the same calls). Reports
the share of the no-tool throughput the engine keeps.

Case 3 (long, `--cases long`): batch 32, no adapters, 512 and 1,024 new tokens per row with EOS ignored,
and a mix of lengths: EOS on, up to 1,024 new tokens, counting each row's tokens up to its EOS (HF keeps
computing finished rows until the last one ends; the engine drops them). One timed run per side after a
16-token warm-up (`--long-runs`), tokens/s and peak RSS per side.

The rolerl side owns its model (generation only, as in `rolerl eval`), so its packed oneDNN weights
replace the plain ones (`Engine(owns_model=True)`); `--kernels torch` measures the engine on `F.linear`,
`--attention torch` its decode attention in SDPA instead of the native kernel, `--adapter-kernel torch` the
routed adapters of its decode steps in torch's masked GEMMs instead of the native kernel, `--tied-head copy`
its LM head (tied to the embeddings on the default model) on a packed copy instead of the shared matrix.

    python benchmarks/rollout.py --json                                   # cases 1-2 (~20 min on 2 cores)
    python benchmarks/rollout.py --dtypes bfloat16 --batches 32 --runs 3  # one cell
    python benchmarks/rollout.py --json --cases long                      # case 3 (~40 min on 2 cores)
    python benchmarks/rollout.py --json --cases vllm --batches 32 64      # vLLM's columns (rollout_vllm.py)
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


def child(
    side: str,
    row: str,
    dtype: str,
    batch: int,
    new: int,
    runs: int,
    eos: bool = False,
    kernels: str = "auto",
    attention: str = "auto",
    adapter_kernel: str = "auto",
    tied_head: str = "share",
    pointwise: str = "auto",
) -> dict:
    """One side of one cell. `eos`: stop rows at EOS (variable lengths, as RL produces) and count the tokens
    up to and including each row's EOS; else every row generates exactly `new` tokens. The warm-up
    generates 16 tokens (a full-length warm-up would double a 1,024-token cell)."""
    import torch

    import rolerl

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    # before the model: measured after the generations, its three 2048^2 matrices sat on top of whatever a
    # side still held (the engine keeps its KV cache for the next call; HF frees its own) and counted in
    # that side's peak RSS
    peak = matmul_peak(getattr(torch, dtype))
    model, tok = rolerl.load_model("default", dtype=dtype)
    ids = prompts(tok, batch)
    flops = decode_flops(model, batch, sum(map(len, ids)) / batch, new)  # before any adapter or packing
    gen_eos = model.generation_config.eos_token_id  # an int, a list (Qwen) or None
    eos_ids = {tok.eos_token_id, *(gen_eos if isinstance(gen_eos, list) else [gen_eos])} - {None}
    if side == "hf":
        tok.padding_side = "left"
        enc = tok.pad({"input_ids": ids}, return_tensors="pt")
        if row in ("lora", "policy"):
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
        kwargs = dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0)
        if not eos:
            model.generation_config.eos_token_id = None  # fixed length: EOS ignored (no logits processor)

        def once(n: int) -> int:
            with torch.inference_mode():
                out = model.generate(**enc, **kwargs, max_new_tokens=n, pad_token_id=tok.pad_token_id)
            gen = out[:, enc["input_ids"].shape[1] :]
            if not eos:
                return gen.numel()
            ended = torch.isin(gen, torch.tensor(sorted(eos_ids)))
            first = torch.where(ended.any(1), ended.int().argmax(1) + 1, gen.shape[1])
            return int(first.sum())
    else:
        from rolerl.rollout.engine import Engine, GenerationRequest
        from rolerl.rollout.sampling import SamplingParams

        kinds = ("prompt", "reasoning", "tool_call", "tool_output", "answer")
        route_ofs = [None, None]
        if row == "lora":
            rolerl.add_adapters(model, ["reason", "tool"], rank=8)
            route_ofs = [dict.fromkeys(kinds, i) for i in (0, 1)]
        elif row == "policy":
            rolerl.add_adapters(model, ["policy"], rank=8)
            route_ofs = [dict.fromkeys(kinds, 0)] * 2
        # generation only: nothing else runs this model, so packed kernels replace its plain weights; the
        # policy row's model is a trainer's (kept, and its adapter can be merged into the packed copy)
        engine = Engine(
            model,
            tok,
            max_batch=batch,
            kernels=kernels,
            attention=attention,
            adapter_kernel=adapter_kernel,
            tied_head=tied_head,
            pointwise=pointwise,
            owns_model=row != "policy",
        )

        def once(n: int) -> int:
            reqs = [
                GenerationRequest(
                    p,
                    SamplingParams(
                        temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=n, ignore_eos=not eos, seed=i
                    ),
                    route_of=route_ofs[i % 2],
                )
                for i, p in enumerate(ids)
            ]
            return sum(len(t.completion_ids) for t in engine.generate(reqs))

    once(16)  # warm-up
    times, counts = [], []
    for _ in range(runs):
        t0 = time.perf_counter()
        counts.append(once(new))
        times.append(time.perf_counter() - t0)
    rates = [c / t for c, t in zip(counts, times, strict=True)]
    med = statistics.median(times)
    flops *= statistics.median(counts) / (batch * new)  # rows that stopped at EOS did less work
    return {
        "side": side,
        "row": row,
        "dtype": dtype,
        "batch": batch,
        "tokens_per_s": statistics.median(rates),
        "tokens": counts,
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
        "tool_calls": engine.stats["tool_calls"] / (runs + 1),  # per run (the warm-up is one)
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
    p.add_argument("--rows", nargs="+", default=["base", "lora"], choices=["base", "lora", "policy"])
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument(
        "--cases", nargs="+", default=["fixed", "tools"], choices=["fixed", "tools", "long", "vllm"]
    )
    p.add_argument(
        "--vllm-python",
        default=os.path.join(
            os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".venv-vllm/bin/python"
        ),
        help="the interpreter vLLM's side runs in (case vllm: benchmarks/rollout_vllm.py)",
    )
    p.add_argument("--rounds", type=int, default=1, help="rounds of both sides per cell, alternating")
    p.add_argument("--long-runs", type=int, default=1, help="timed runs per side in case 3")
    p.add_argument(
        "--kernels", default="auto", choices=["auto", "native", "onednn", "torch"], help="rolerl's linears"
    )
    p.add_argument(
        "--attention", default="auto", choices=["auto", "native", "torch"], help="rolerl's decode attention"
    )
    p.add_argument(
        "--adapter-kernel",
        default="auto",
        choices=["auto", "native", "torch"],
        help="rolerl's routed adapters at decode steps",
    )
    p.add_argument(
        "--tied-head",
        default="share",
        choices=["share", "copy"],
        help="rolerl's LM head tied to the embeddings: on that matrix, or on a packed copy",
    )
    p.add_argument(
        "--pointwise",
        default="auto",
        choices=["auto", "native", "torch"],
        help="rolerl's residual adds and RMSNorms",
    )
    p.add_argument(
        "--skip-tools", action="store_true", help="skip case 2 (same as leaving it out of --cases)"
    )
    p.add_argument("--json", action="store_true")
    p.add_argument("--eos", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--child", nargs=4, metavar=("SIDE", "ROW", "DTYPE", "BATCH"), help=argparse.SUPPRESS)
    p.add_argument("--tool-child", nargs=3, metavar=("DTYPE", "BATCH", "WITH_TOOLS"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        side, row, dtype, batch = args.child
        res = child(
            side, row, dtype, int(batch), args.new_tokens, args.runs, args.eos, args.kernels, args.attention,
            args.adapter_kernel, args.tied_head, args.pointwise,
        )  # fmt: skip
        print(json.dumps(res))
        return
    if args.tool_child:
        dtype, batch, with_tools = args.tool_child
        print(
            json.dumps(
                tool_child(dtype, int(batch), 2 * int(batch), args.new_tokens, args.runs, with_tools == "1")
            )
        )
        return

    native = [
        "--attention",
        args.attention,
        "--adapter-kernel",
        args.adapter_kernel,
        "--tied-head",
        args.tied_head,
        "--pointwise",
        args.pointwise,
    ]
    common = ["--runs", str(args.runs), "--kernels", args.kernels, *native]
    summary: dict = {
        "new_tokens": args.new_tokens,
        "runs": args.runs,
        "rounds": args.rounds,
        "kernels": args.kernels,
        "attention": args.attention,
        "adapter_kernel": args.adapter_kernel,
        "tied_head": args.tied_head,
        "pointwise": args.pointwise,
        "threads": int(os.environ.get("BENCH_THREADS", "2")),
        "machine": describe(),  # every figure says which CPU it came from
    }

    def cell(key: str, row: str, dtype: str, batch: int, extra: list[str]) -> None:
        # sides alternate, one subprocess each per round; the ratio is the median of the rounds' ratios, so a
        # machine that drifts between rounds moves both sides of each ratio together
        rounds = [
            {side: run(["--child", side, row, dtype, str(batch), *extra]) for side in ("hf", "rolerl")}
            for _ in range(args.rounds)
        ]
        med = lambda side, k: statistics.median(r[side][k] for r in rounds)  # noqa: E731
        peak = med("rolerl", "matmul_peak_gflops")
        summary[key] = {
            "hf_tok_s": round(med("hf", "tokens_per_s"), 1),
            "rolerl_tok_s": round(med("rolerl", "tokens_per_s"), 1),
            "ratio": round(
                statistics.median(r["rolerl"]["tokens_per_s"] / r["hf"]["tokens_per_s"] for r in rounds), 2
            ),
            "round_ratios": [round(r["rolerl"]["tokens_per_s"] / r["hf"]["tokens_per_s"], 2) for r in rounds],
            # both against one peak (the rolerl subprocesses'): single 2048^3 timings fluctuate
            "hf_mfu": round(
                statistics.median(r["hf"]["mfu"] * r["hf"]["matmul_peak_gflops"] for r in rounds) / peak, 4
            ),
            "rolerl_mfu": round(med("rolerl", "mfu"), 4),
            "matmul_peak_gflops": round(peak, 1),
            "hf_peak_rss_mb": round(max(r["hf"]["peak_rss_mb"] for r in rounds)),
            "rolerl_peak_rss_mb": round(max(r["rolerl"]["peak_rss_mb"] for r in rounds)),
            "hf_tokens": [r["hf"]["tokens"] for r in rounds],
            "rolerl_tokens": [r["rolerl"]["tokens"] for r in rounds],
        }
        print(key, summary[key], flush=True)

    if "fixed" in args.cases:
        for dtype in args.dtypes:
            for row in args.rows:
                for batch in args.batches:
                    cell(
                        f"{dtype}/{row}/b{batch}",
                        row,
                        dtype,
                        batch,
                        [*common, "--new-tokens", str(args.new_tokens)],
                    )
    if "tools" in args.cases and not args.skip_tools:
        dtype = args.dtypes[-1]
        tool_args = [*common, "--new-tokens", str(args.new_tokens)]
        plain = run(["--tool-child", dtype, "32", "0", *tool_args])
        tools = run(["--tool-child", dtype, "32", "1", *tool_args])
        summary[f"{dtype}/tools/b32"] = {
            "no_tool_tok_s": round(plain["tokens_per_s"], 1),
            "tool_tok_s": round(tools["tokens_per_s"], 1),
            "kept": round(tools["tokens_per_s"] / plain["tokens_per_s"], 3),
            "tool_calls": tools["tool_calls"],
        }
        print(f"{dtype}/tools/b32", summary[f"{dtype}/tools/b32"], flush=True)
    if "long" in args.cases:
        long = ["--runs", str(args.long_runs), "--kernels", args.kernels, *native]
        for dtype in args.dtypes:
            for new in (512, 1024):
                cell(f"{dtype}/long{new}/b32", "base", dtype, 32, [*long, "--new-tokens", str(new)])
            cell(f"{dtype}/eos1024/b32", "base", dtype, 32, [*long, "--new-tokens", "1024", "--eos"])
    if "vllm" in args.cases:  # vLLM's CPU build beside the built-in engine (benchmarks/rollout_vllm.py)
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from rollout_vllm import compare

        summary |= compare(args, run)
    print(json.dumps(summary) if args.json else json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
