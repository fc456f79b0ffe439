"""One decode step of the engine, and its attention alone: where the time of a step goes.

`step`: one decode step over `--batch` rows with `--kv` cached positions, one new token each, plus the LM
head (median of `--runs` after a warm-up): the engine's lean decoder (`rolerl.rollout.decoder`) against HF's
forward with the engine's attention and packed weights, alternating; then the GEMMs alone (the GEMM floor of
a step): every linear packed on its own, and packed in the lean decoder's groups (q/k/v and gate/up fused).

`gemms`: a decode step's weight GEMMs alone (the lean decoder's 121 fused groups and the LM head, in a step's
order, on the default model's fp32 weights) at `--batches` rows: `F.linear` (MKL) on the plain weights,
oneDNN on its packed copies, and the native GEMM (`gemm.c`) on its panels, alternating, two rounds; ms per
step, GFLOP/s and GB/s of weights streamed.

`attention`: the decode attention alone on the engine's layout (batch x 3 KV heads x 3 queries, head dim
64, a strided view of a longer cache, an additive mask): SDPA vs the two matmuls (fp32) vs the native
kernel (`rolerl.rollout.native`, reading the cache in place), per number of keys.

    python benchmarks/decode_step.py step --batch 32 --kv 100
    python benchmarks/decode_step.py gemms --batches 8 32 64
    python benchmarks/decode_step.py attention --batch 32 [--dtype bfloat16]
Figures and the CPU they ran on: docs/BENCHMARKS.md ("The decode step's parts"); earlier ones in
docs/history/BENCHMARKS-history.md ("Round three", "Round fourteen").
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


def attention(batch: int, runs: int, dtype: torch.dtype) -> None:
    from rolerl.rollout.kv import _decode_attention
    from rolerl.rollout.native import kernel

    native = kernel()
    kv_heads, groups, d = 3, 3, 64
    print(describe())
    print(f"decode attention, batch {batch}, {kv_heads} KV heads x {groups} queries, head dim {d}, {dtype}:")
    for kv in (48, 128, 192, 512, 1088, 2048):
        cache_k, cache_v = torch.randn(2, batch, kv_heads, kv + 64, d).to(dtype).unbind(0)
        k, v = cache_k[:, :, :kv], cache_v[:, :, :kv]
        q = torch.randn(batch, kv_heads, groups, d).to(dtype)
        positions = torch.full((batch, 1), kv - 1)
        positions[::2] -= 5  # half the rows shorter, as the mask below says
        mask = torch.zeros(batch, 1, 1, kv, dtype=dtype)
        mask[::2, ..., kv - 5 :] = float("-inf")
        args = (q, k, v, mask, d**-0.5)
        times = {"SDPA": median_ms(functools.partial(_sdpa, *args), runs)}
        if dtype == torch.float32:
            times["matmuls"] = median_ms(functools.partial(_decode_attention, *args), runs)
        if native is not None:
            call = (q, cache_k, cache_v, torch.arange(batch), positions, d**-0.5)
            times["native"] = median_ms(functools.partial(native.decode_attention, *call), runs)
        line = "   ".join(f"{name} {1e3 * ms:7.0f} us" for name, ms in times.items())
        ratio = f"   (native {times['SDPA'] / times['native']:.2f}x SDPA)" if "native" in times else ""
        print(f"{kv:5d} keys: {line}{ratio}")


def step(batch: int, kv: int, runs: int) -> None:
    import copy

    import rolerl
    from rolerl.rollout.engine import Engine
    from rolerl.rollout.kv import KVCache, engine_forward, make_batch
    from rolerl.rollout.packed import PackedLinears, packed_linear

    model, tok = rolerl.load_model("default", dtype="float32")
    engine = Engine(model, tok, max_batch=batch)  # its lean decoder (rolerl.rollout.decoder)
    engine.cache = KVCache(model.config, batch, kv + 64, engine.dtype, engine.device)  # a slot per row
    engine.cache.reach(kv + 64)
    twin = copy.deepcopy(model)  # HF's forward with the engine's attention, on its own packed weights
    twin_packed = PackedLinears(twin, batch)
    twin_decoder = twin.get_decoder()
    ids = torch.randint(0, 1000, (batch, 1))

    def lean() -> None:
        b = make_batch(engine.cache, list(range(batch)), [kv] * batch, 1, [1] * batch)
        with torch.inference_mode():
            engine.lean.head(engine.lean(ids, b)[:, -1])

    def hf() -> None:
        b = make_batch(engine.cache, list(range(batch)), [kv] * batch, 1, [1] * batch)
        with torch.inference_mode(), engine_forward(twin, b), twin_packed():
            hidden = twin_decoder(input_ids=ids, position_ids=b.positions, use_cache=False).last_hidden_state
            twin.lm_head(hidden[:, -1])

    results: dict[str, list[float]] = {"lean decoder": [], "HF forward": []}
    for _ in range(2):  # alternate, so that machine drift hits both
        for name, fn in (("lean decoder", lean), ("HF forward", hf)):
            results[name].append(median_ms(fn, runs))
    rows = {}
    for group in engine.packed.groups:
        rows.setdefault(group[0].in_features, torch.randn(batch, group[0].in_features))
    weights = engine.packed.weights()
    linears = [m for m in twin.modules() if type(m) is torch.nn.Linear]

    def gemms_fused() -> None:
        with torch.inference_mode():
            for group, (w, bias) in zip(engine.packed.groups, weights, strict=True):
                packed_linear(rows[group[0].in_features], w, bias)

    def gemms_separate() -> None:
        with torch.inference_mode(), twin_packed():
            for m in linears:
                m(rows[m.in_features])

    print(describe())
    print(f"batch {batch}, {kv} cached positions, ms per step (median of {runs}, two alternating rounds):")
    for name, ms in results.items():
        print(f"  {name:14s} {' / '.join(f'{x:.1f}' for x in ms)}")
    print(f"  GEMMs alone: {len(linears)} packed linears {median_ms(gemms_separate, runs):.1f}, "
          f"{len(weights)} fused groups {median_ms(gemms_fused, runs):.1f}")  # fmt: skip


def gemms(batches: list[int], runs: int) -> None:
    import rolerl
    from rolerl.rollout import native
    from rolerl.rollout.decoder import LeanDecoder
    from rolerl.rollout.packed import packed_linear

    model, _ = rolerl.load_model("default", dtype="float32")
    groups = LeanDecoder(model, 32).groups  # q/k/v, o, gate/up, down per layer, then the head
    plain = [torch.cat([m.weight.detach() for m in g]) for g in groups]
    kernel = native.kernel()
    sides = {
        "F.linear (MKL)": [(F.linear, w) for w in plain],
        "oneDNN packed": [(packed_linear, torch.ops.mkldnn._reorder_linear_weight(w, 32)) for w in plain],
    }
    if kernel is not None:
        sides["native packed"] = [(packed_linear, kernel.pack(w)) for w in plain]
    weight_bytes = sum(w.numel() * 4 for w in plain)
    print(describe())
    print(f"{len(plain)} GEMMs per step ({len(plain) - 1} fused groups + the head), {weight_bytes / 1e6:.0f} MB "
          f"of fp32 weights; ms per step (median of {runs}, two alternating rounds), GFLOP/s, GB/s of weights:")  # fmt: skip
    for rows in batches:
        xs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in plain}
        flops = sum(2 * rows * w.numel() for w in plain)
        times: dict[str, list[float]] = {name: [] for name in sides}
        for _ in range(2):
            for name, calls in sides.items():

                def run(calls=calls, xs=xs) -> None:
                    with torch.inference_mode():
                        for (fn, w), p in zip(calls, plain, strict=True):
                            fn(xs[p.shape[1]], w, None)

                times[name].append(median_ms(run, runs))
        line = "   ".join(
            f"{name} {min(ms):6.1f} ({flops / min(ms) / 1e6:4.0f} GFLOP/s, {weight_bytes / min(ms) / 1e6:4.1f} GB/s)"
            for name, ms in times.items()
        )
        print(f"{rows:4d} rows: {line}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["step", "gemms", "attention"])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--batches", type=int, nargs="+", default=[8, 32, 64], help="rows per GEMM (gemms)")
    p.add_argument("--kv", type=int, default=100, help="cached positions per row (step)")
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="attention")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.what == "attention":
        attention(args.batch, args.runs, getattr(torch, args.dtype))
    elif args.what == "gemms":
        gemms(args.batches, args.runs)
    else:
        step(args.batch, args.kv, args.runs)


if __name__ == "__main__":
    main()
