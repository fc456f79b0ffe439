"""DART on vLLM: how far a token-routed rollout through vLLM is from the policy the trainer computes, per
kind of token, and the truncated-importance-sampling weights that correct it, beside the built-in engine
on the same requests.

vLLM applies one LoRA per request, so the backend switches adapter at the tags and each segment re-reads
the prefix under its own adapter: earlier positions' keys and values are not the routed ones. The trainer
recomputes the log-probs under the true routing (`algorithm.old_logp: recompute`) and weighs each token by
`min(exp(trainer - rollout), tis_cap)`. The built-in engine routes every position exactly, so its weights
are 1 up to kernel rounding.

Episodes: the few-shot tool prompt of the real-vLLM tests (tests/rollout/real_vllm/parity.py: the model
writes `<code>` calls, an echo tool answers), `--episodes` seeds, `--new-tokens` each, fp32, on the default
model with two random rank-8 LoRA adapters (`--std`: the size of their weights; larger adapters differ
more, and so do their prefixes). Run it in vLLM's venv (`make test-vllm` builds it):

    VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/python benchmarks/vllm_dart.py --episodes 32 --new-tokens 96
The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' parity helpers


def measure(args) -> dict:
    from rolerl.config import load_config
    from rolerl.hardware import describe
    from rolerl.models.load import load_model
    from rolerl.rollout.engine import Engine
    from rolerl.rollout.vllm_backend import VLLMBackend, _offline_llm
    from tests.rollout.real_vllm.parity import (
        TEMPERATURE,
        TOPOLOGIES,
        Recording,
        adapted_model,
        engine_parity,
        parity,
        requests,
        run_all,
    )
    from tests.rollout.test_engine import EchoTool

    base, tok = load_model("default", dtype="float32", device="cpu")
    adapters, table = TOPOLOGIES["dart"]
    route_of = table()
    model = adapted_model(base, adapters, std=args.std)
    work = Path(tempfile.mkdtemp(prefix="rolerl-vllm-dart-"))
    cfg = load_config(None, [f"run.dir={work}", "rollout.backend=vllm", "rollout.max_len=1024",
                             "rollout.vllm={max_loras: 4, max_lora_rank: 16, enforce_eager: true}"])  # fmt: skip
    t0 = time.perf_counter()
    llm = Recording(_offline_llm("default", cfg, 8, base))
    startup = time.perf_counter() - t0
    backend = VLLMBackend(llm, tok, adapters=adapters, work_dir=work / "adapters", tools={"echo": EchoTool()},
                          max_len=1024, vocab_size=model.config.vocab_size, eos_ids=[tok.eos_token_id],
                          temperature=TEMPERATURE)  # fmt: skip
    backend.sync(model)
    try:
        turns = run_all(backend, requests(tok, route_of, n=args.episodes, max_new_tokens=args.new_tokens))
        tool_calls = backend.stats["tool_calls"]
    finally:
        backend.close()
        llm.llm.shutdown()
    segment, routed = parity(model, turns, route_of, adapters, llm.segments)
    engine = Engine(model, tok, tools={"echo": EchoTool()}, max_len=1024)
    mine = engine.generate(requests(tok, route_of, n=args.episodes, max_new_tokens=args.new_tokens))
    exact = engine_parity(model, mine, route_of)

    def side(p) -> dict:
        return {
            kind: {"n": len(d), "max_abs": max(d), "mean_abs": sum(d) / len(d)} | p.tis(args.tis_cap)[kind]
            for kind, d in sorted(p.deltas.items())
        }

    return {
        "cpu": describe(),
        "episodes": args.episodes,
        "new_tokens": args.new_tokens,
        "adapter_std": args.std,
        "temperature": TEMPERATURE,
        "tis_cap": args.tis_cap,
        "vllm_startup_s": round(startup, 1),
        "vllm_tool_calls": tool_calls,
        "engine_tool_calls": sum(len(t.tool_calls) for t in mine),
        "vllm_vs_segment_adapter": side(segment),
        "vllm_vs_true_routing": side(routed),
        "engine_vs_true_routing": side(exact),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--episodes", type=int, default=32, help="requests (one seed each)")
    ap.add_argument("--new-tokens", type=int, default=96, help="new tokens per request at most")
    ap.add_argument("--std", type=float, default=0.02, help="std of the random LoRA weights")
    ap.add_argument("--tis-cap", type=float, default=2.0, help="algorithm.tis_cap")
    out = measure(ap.parse_args())
    for name in ("vllm_vs_segment_adapter", "vllm_vs_true_routing", "engine_vs_true_routing"):
        for kind, r in out[name].items():
            print(
                f"{name:24s} {kind:10s} n={r['n']:5d} |d| max {r['max_abs']:.2e} mean {r['mean_abs']:.2e}  "
                f"w mean {r['mean']:.4f} min {r['min']:.3f} max {r['max']:.3f} capped {r['capped']:.2%}"
            )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
