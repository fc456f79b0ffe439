"""One decode step of the engine, and its attention alone: where the time of a step goes.

`step`: the engine's own forward (packed weights, its KV cache, its attention) over `--batch` rows with
`--kv` cached positions, one new token each, plus the LM head; median of `--runs` after a warm-up, with the
decode attention as shipped (two batched matmuls in fp32) and with SDPA, alternating. Also the 211 packed
linear layers alone on random rows (the GEMM floor of a step).

`attention`: the decode attention alone on the engine's layout (batch x 3 KV heads x 3 queries, head dim
64, a strided view of a longer cache, an additive mask): SDPA vs the two matmuls, per number of keys.

    python benchmarks/decode_step.py step --batch 32 --kv 100
    python benchmarks/decode_step.py attention --batch 32
Figures and the CPU they ran on: docs/BENCHMARKS.md ("Round three").
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch
from torch.nn import functional as F

from rolerl.hardware import describe


def median_ms(fn, runs: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def _sdpa(q, k, v, mask, scale):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def attention(batch: int, runs: int) -> None:
    from rolerl.rollout.kv import _decode_attention

    kv_heads, groups, d = 3, 3, 64
    for kv in (48, 128, 192, 512, 1088):
        cache_k, cache_v = torch.randn(2, batch, kv_heads, kv + 64, d).unbind(0)
        k, v = cache_k[:, :, :kv], cache_v[:, :, :kv]
        q = torch.randn(batch, kv_heads, groups, d)
        mask = torch.zeros(batch, 1, 1, kv)
        mask[..., kv - 5 :] = float("-inf")
        args = (q, k, v, mask, d**-0.5)
        sdpa = median_ms(functools.partial(_sdpa, *args), runs)
        mm = median_ms(functools.partial(_decode_attention, *args), runs)
        print(f"{kv:5d} keys: SDPA {1e3 * sdpa:7.0f} us   matmuls {1e3 * mm:7.0f} us   ({sdpa / mm:.2f}x)")


def step(batch: int, kv: int, runs: int) -> None:
    import rolerl
    import rolerl.rollout.kv as kv_module
    from rolerl.rollout.engine import Engine
    from rolerl.rollout.kv import engine_forward, make_batch

    model, tok = rolerl.load_model("default", dtype="float32")
    engine = Engine(model, tok, max_batch=batch, owns_model=True)
    engine._ensure_cache(kv + 64)
    ids = torch.randint(0, 1000, (batch, 1))

    def forward() -> None:
        b = make_batch(engine.cache, list(range(batch)), [kv] * batch, 1, [1] * batch)
        with torch.inference_mode(), engine_forward(model, b), engine.packed():
            hidden = engine.decoder(
                input_ids=ids, position_ids=b.positions, use_cache=False
            ).last_hidden_state
            engine.lm_head(hidden[:, -1])

    shipped = kv_module._decode_attention
    results: dict[str, list[float]] = {"matmuls": [], "sdpa": []}
    for _ in range(2):  # alternate, so that machine drift hits both
        for name, fn in (("matmuls", shipped), ("sdpa", _sdpa)):
            kv_module._decode_attention = fn
            results[name].append(median_ms(forward, runs))
    kv_module._decode_attention = shipped
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    rows = {m.in_features: torch.randn(batch, m.in_features) for m in linears}

    def gemms() -> None:
        with torch.inference_mode():
            for m in linears:
                m(rows[m.in_features])

    print(describe())
    print(f"batch {batch}, {kv} cached positions, ms per step (median of {runs}, two alternating rounds):")
    for name, ms in results.items():
        print(f"  decode attention {name:8s} {' / '.join(f'{x:.1f}' for x in ms)}")
    print(f"  {len(linears)} packed linear layers alone: {median_ms(gemms, runs):.1f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["step", "attention"])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--kv", type=int, default=100, help="cached positions per row (step)")
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.what == "attention":
        attention(args.batch, args.runs)
    else:
        step(args.batch, args.kv, args.runs)


if __name__ == "__main__":
    main()
