"""vLLM's columns of `benchmarks/rollout.py` (`--cases vllm`): vLLM's CPU build beside the built-in engine,
on the same CPU, the same prompts (`rollout.prompts`) and the same sampling.

Each side runs in a subprocess of its own, one after the other, never both at once: the built-in engine in
this interpreter (`rollout.py --child` / `--tool-child`), vLLM under `--vllm-python` (default
.venv-vllm/bin/python: vLLM's CPU build pins another transformers than rolerl's venv). vLLM runs as
rolerl's offline backend runs it, `AsyncLLM` in the process (rolerl.rollout.vllm_async), its engine core
in a process of its own. Both sides get the same cores: BENCH_THREADS threads for the built-in engine, and
vLLM's engine core bound to every core (VLLM_CPU_NUM_OF_RESERVED_CPU=0; vLLM's default keeps one core for
its scheduler process, which on 2 cores halves its model's threads; set the variable to measure that).

Rows, per dtype (float32, and bfloat16 where the CPU has native bf16: `rolerl.hardware.fast_dtypes`):
  b32, b64  plain decode, no adapter: temperature 1, top-p 1, top-k off, EOS ignored, `--new-tokens` per
            row, one seed per row, the sampled token's log-prob returned (as the backend asks); median of
            `--runs` after a 16-token warm-up
  tools     the TIR workload of case 2: 64 requests, at most 32 in flight, EOS on; every other request
            writes `<code>sleep()</code>` at its 8th token (forced: vLLM samples 8 tokens, the call's ids and
            the tool's output are appended, the 0.5 s tool runs while the other requests generate, and
            vLLM continues), the rest generate freely; tokens/s counts sampled and forced-call tokens
            (not tool output), as the built-in side does
Start-up (engine construction to ready) is timed apart and is not in tokens/s. Peak memory: the built-in
engine's process RSS; vLLM's front-end process and its engine-core process (after shutdown, the largest
child's peak RSS) apart.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def vllm_child(dtype: str, batches: list[int], new: int, runs: int, tools: bool) -> dict:
    """The vLLM side of one dtype: one engine for every row (its start-up timed once)."""
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from rollout import prompts
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from rolerl.models.load import _resolve_to_directory
    from rolerl.rollout.vllm_async import AsyncEngine

    directory = str(_resolve_to_directory("default"))
    tok = AutoTokenizer.from_pretrained(directory)  # the tokenizer only: no model in the front-end's RSS
    t0 = time.perf_counter()
    seqs = max([*batches, 32])
    # every prompt prefilled whole (rolerl's backend does the same on a CPU: vllm_backend.cpu_batch_tokens):
    # vLLM's CPU build dies when it discards the token of a seeded request's partial prefill
    engine = AsyncEngine(model=directory, dtype=dtype, seed=0, max_model_len=1024, max_num_seqs=seqs,
                         max_num_batched_tokens=1024 * seqs, enforce_eager=True, disable_log_stats=True)  # fmt: skip
    out: dict = {"startup_s": round(time.perf_counter() - t0, 1), "vllm": _version()}

    def params(seed: int, n: int, eos: bool = False) -> SamplingParams:
        return SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_tokens=n, ignore_eos=not eos,
                              seed=seed, logprobs=0)  # fmt: skip

    for batch in batches:
        ids = prompts(tok, batch)

        def once(n: int, ids: list[list[int]] = ids) -> int:
            jobs = [engine.submit({"prompt_token_ids": p}, params(i, n)) for i, p in enumerate(ids)]
            return sum(len(j.result().outputs[0].token_ids) for j in jobs)

        once(16)
        rates = []
        for _ in range(runs):
            t = time.perf_counter()
            rates.append(once(new) / (time.perf_counter() - t))
        out[f"b{batch}"] = {
            "tokens_per_s": round(statistics.median(rates), 1),
            "rates": [round(r, 1) for r in rates],
        }
    if tools:
        out["tools"] = {
            k: _tool_run(engine, tok, new, params, with_tools=k == "tools") for k in ("plain", "tools")
        }
    out["frontend_peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    engine.shutdown()
    out["engine_peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)
    return out


def _tool_run(
    engine, tok, new: int, params, with_tools: bool, requests: int = 64, in_flight: int = 32
) -> dict:
    """Case 2 on vLLM: each request advances on its own (a coroutine; its tool in a thread)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from rollout import prompts

    from rolerl.roles import Tags, format_tool_output
    from rolerl.tokens import encode_exact

    call = tok.encode("<code>sleep()</code>", add_special_tokens=False)
    output = encode_exact(tok, format_tool_output(Tags(), "done\n"))
    ids = prompts(tok, requests)

    async def one(i: int, prompt: list[int], gate: asyncio.Semaphore) -> tuple[int, int]:
        async with gate:
            first = 8 if with_tools and i % 2 else new
            o = (
                await asyncio.wrap_future(
                    engine.submit({"prompt_token_ids": prompt}, params(i, first, eos=True))
                )
            ).outputs[0]
            sampled = len(o.token_ids)
            if first == new or o.finish_reason == "stop":
                return sampled, 0
            await asyncio.to_thread(time.sleep, 0.5)  # the tool
            rest = new - first - len(call)
            context = [*prompt, *o.token_ids, *call, *output]
            o2 = (
                await asyncio.wrap_future(
                    engine.submit({"prompt_token_ids": context}, params(i + 1000, rest, eos=True))
                )
            ).outputs[0]
            return sampled + len(call) + len(o2.token_ids), 1

    async def run() -> list[tuple[int, int]]:
        gate = asyncio.Semaphore(in_flight)
        return await asyncio.gather(*[one(i, p, gate) for i, p in enumerate(ids)])

    asyncio.run(run())  # warm-up
    t0 = time.perf_counter()
    results = asyncio.run(run())
    wall = time.perf_counter() - t0
    tokens = sum(n for n, _ in results)
    return {
        "tokens_per_s": round(tokens / wall, 1),
        "tokens": tokens,
        "tool_calls": sum(c for _, c in results),
    }


def _version() -> str:
    import vllm

    return vllm.__version__


def compare(args, run) -> dict:
    """The built-in engine's rows and vLLM's, per dtype (`run(argv)`: a `rollout.py` child's JSON)."""
    out: dict = {}
    common = ["--runs", str(args.runs), "--new-tokens", str(args.new_tokens)]
    for dtype in args.dtypes:
        tools = dtype == args.dtypes[-1]
        rows = {b: run(["--child", "rolerl", "base", dtype, str(b), *common]) for b in args.batches}
        if tools:
            plain = run(["--tool-child", dtype, "32", "0", *common])
            tooled = run(["--tool-child", dtype, "32", "1", *common])
        cmd = [args.vllm_python, __file__, "--dtype", dtype, "--batches", *map(str, args.batches), *common]
        proc = subprocess.run(
            [*cmd, *(["--tools"] if tools else [])], capture_output=True, text=True, check=False
        )
        if proc.returncode != 0:  # vLLM's engine core logs the cause first; its clients' tracebacks follow
            log = Path(tempfile.gettempdir()) / f"rolerl-bench-vllm-{dtype}.log"
            log.write_text(proc.stderr)
            first = proc.stderr.find("Traceback")
            raise RuntimeError(
                f"{cmd} failed (its whole stderr: {log}); the first error:\n{proc.stderr[max(first, 0) :][:3000]}"
            )
        v = json.loads(proc.stdout.strip().splitlines()[-1])
        for b, r in rows.items():
            out[f"{dtype}/vllm/b{b}"] = {
                "rolerl_tok_s": round(r["tokens_per_s"], 1), "vllm_tok_s": v[f"b{b}"]["tokens_per_s"],
                "ratio_rolerl_over_vllm": round(r["tokens_per_s"] / v[f"b{b}"]["tokens_per_s"], 2),
                "rolerl_peak_rss_mb": round(r["peak_rss_mb"]),
            }  # fmt: skip
        if tools:
            out[f"{dtype}/vllm/tools"] = {
                "rolerl_no_tool_tok_s": round(plain["tokens_per_s"], 1), "rolerl_tool_tok_s": round(tooled["tokens_per_s"], 1),
                "vllm_no_tool_tok_s": v["tools"]["plain"]["tokens_per_s"], "vllm_tool_tok_s": v["tools"]["tools"]["tokens_per_s"],
                "ratio_rolerl_over_vllm": round(tooled["tokens_per_s"] / v["tools"]["tools"]["tokens_per_s"], 2),
                "tool_calls": [tooled["tool_calls"], v["tools"]["tools"]["tool_calls"]],
            }  # fmt: skip
        out[f"{dtype}/vllm/engine"] = {
            k: v[k] for k in ("startup_s", "frontend_peak_rss_mb", "engine_peak_rss_mb", "vllm")
        }
        for k in [k for k in out if k.startswith(f"{dtype}/vllm")]:
            print(k, out[k], flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", required=True, choices=["float32", "bfloat16"])
    p.add_argument("--batches", nargs="+", type=int, default=[32, 64])
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--tools", action="store_true")
    a = p.parse_args()
    print(json.dumps(vllm_child(a.dtype, a.batches, a.new_tokens, a.runs, a.tools)))


if __name__ == "__main__":
    main()
