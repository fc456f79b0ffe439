"""The engine's decode attention and routed adapters as small C kernels, built on first use with the machine's
C compiler.

At a decode step every row attends with one query per head to its own cached keys. On CPU, SDPA's flash
kernel and batched matmuls both pay per (row, KV head) for tiling and GEMM set-up that a few dozen keys of
64 dims never amortise: at batch 32 on the default model that was a quarter of a bf16 decode step
(docs/BENCHMARKS.md). `decode_attention.c` does the whole softmax(q k^T) v of one (row, KV head) in one
pass over its keys, reading the cache in place (cache slots and per-row lengths instead of a gather and a
mask), in fp32 whatever the cache's dtype (bf16 keys and values are widened as they are read; SDPA rounds
the probabilities to bf16 before multiplying by V, this kernel does not).

`decode_step` in the same file runs a whole decode step of one layer after its q/k/v projection: RoPE of
the queries and the new key (rounded op by op as torch's ops round them), the new key and value written to
the row's cache column, and that attention, in one call where torch ran five ops and two indexed writes.

`norm.c` does HF's residual add and RMSNorm of a row in one call (eight torch ops), rounding where HF
rounds (`rollout.pointwise`).

`lora.c` adds the routed LoRA adapters of a fused group of layers at a decode step (`FusedAdapters`): each
row multiplies by its own adapter's matrices only, where torch's path runs every adapter's ranks on every row
under a mask and a block matrix of zeros, in two small GEMMs per fused group that cost more in set-up than
in arithmetic (`rollout.adapter_kernel`).

`gemm.c` runs the engine's fp32 linear layers on weights laid out once for it (`rollout.kernels: native`,
`pack` and `linear`): at a decode step's few dozen rows it computes on one panel of a weight while the next
streams in, where oneDNN's and MKL's GEMMs wait for each block of the weight they read.

`kernel()` compiles the sources once per machine and compiler (`cc -O3 -march=native -fopenmp`; another
target with `ROLERL_NATIVE_MARCH`, e.g. `x86-64-v3` for AVX2 code on an AVX-512 CPU) into
`$ROLERL_CACHE/native` (default `~/.cache/rolerl/native`), keyed by the sources, the flags, the compiler's
version and the CPU's flags, so that a home directory shared by different CPUs never loads a binary built
for another, and loads it with ctypes after torch: with torch's GNU OpenMP (`libgomp.so.1`, the PyPI
wheels') the kernel then runs on torch's own threads. With no compiler (or one without OpenMP), or a
build that fails, it returns None and says why once; the engine then keeps SDPA (`rollout.attention`),
torch's adapter GEMMs (`rollout.adapter_kernel`) and HF's norms (`rollout.pointwise`).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from rolerl.hardware import cpu_flags as _cpu_flags
from rolerl.models.load import cache_dir
from rolerl.models.lora import group_rows

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
SOURCES = (HERE / "decode_attention.c", HERE / "lora.c", HERE / "norm.c", HERE / "gemm.c")
HEADERS = (HERE / "lanes.h",)
# no -ffast-math or reassociation: the kernel spells its vector sums out (reduce_lanes), so the compiler
# keeps IEEE semantics (NaN and inf mean what they say) at no cost
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared")
# `-march=` for another target than this CPU: `x86-64-v3` builds the AVX2 code (8 float lanes) on an AVX-512
# machine, with `ATEN_CPU_CAPABILITY=avx2` how the benchmarks emulate an AVX2-only CPU (docs/BENCHMARKS.md)
MARCH_ENV = "ROLERL_NATIVE_MARCH"
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
ATTENTION = ("auto", "native", "torch")


class NativeKernel:
    """The loaded library: `decode_attention(q, k, v, slots, positions, scale)`, `decode_step(qkv, cos, sin,
    k, v, slots, positions, writes, scale)`, `lora_add(x, y, tables, terms, factors)`, `rms_norm(x, weight,
    eps, add)`, and `pack(weight)` / `linear(x, packed, bias)`."""

    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
        i64, ptr, cint = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        fn = lib.rolerl_decode_attention
        fn.argtypes = [ptr] * 6 + [i64] * 10 + [ctypes.c_float, cint, cint]
        fn.restype = None
        limit = lib.rolerl_decode_attention_limit
        limit.argtypes, limit.restype = [ctypes.c_int], ctypes.c_int
        lora = lib.rolerl_lora_add
        lora.argtypes = (
            [ptr, ptr] + [i64] * 5 + [ptr, i64, ptr, i64, ptr, i64, ptr, i64, ptr, ptr, ptr, cint, cint]
        )
        lora.restype = i64
        step = lib.rolerl_decode_step
        step.argtypes = [ptr, i64] + [ptr] * 7 + [i64, ptr] + [i64] * 9 + [ctypes.c_float, cint, cint]
        step.restype = None
        self._step = step
        norm = lib.rolerl_rms_norm
        norm.argtypes = [ptr] * 5 + [i64] * 2 + [ctypes.c_float, cint, cint]
        norm.restype = None
        self.path, self._fn, self._lora, self._norm = path, fn, lora, norm
        self.max_head_dim, self.max_groups, self.isa = limit(0), limit(1), limit(2)
        self._gemm = lib.rolerl_gemm
        self._gemm.argtypes = [ptr, i64, ptr, ptr, ptr] + [i64] * 4 + [cint]
        self._gemm.restype = None
        self._gemm_pack = lib.rolerl_gemm_pack
        self._gemm_pack.argtypes = [ptr, i64, ptr, i64, i64, cint]
        self._gemm_pack.restype = None
        self.panel = lib.rolerl_gemm_panel()  # output columns per panel of a packed weight

    def covers(self, dtype: torch.dtype, head_dim: int, groups: int) -> str | None:
        """None where the kernel runs a model of this dtype and attention shape, else why not."""
        if dtype not in DTYPES:
            return f"dtype {dtype} (float32 or bfloat16 only)"
        if head_dim % 16 or head_dim > self.max_head_dim:
            return f"head dim {head_dim} (a multiple of 16 up to {self.max_head_dim})"
        if groups > self.max_groups:
            return f"{groups} query heads per KV head (at most {self.max_groups})"
        return None

    def supports(self, q: torch.Tensor, cache: torch.Tensor) -> bool:
        """Whether `q` `(B, Hkv, G, D)` over a layer's cache `(slots, Hkv, capacity, D)` runs here."""
        return (
            q.dim() == cache.dim() == 4
            and q.device.type == cache.device.type == "cpu"
            and cache.dtype == q.dtype
            and cache.stride(-1) == 1
            and self.covers(q.dtype, q.shape[-1], q.shape[2]) is None
        )

    def decode_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        slots: torch.Tensor,
        positions: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """softmax(scale * q k^T) v per row over its own keys. q: `(B, Hkv, G, D)`; k, v: one layer's cache
        `(slots, Hkv, capacity, D)` (same strides, head dim contiguous); row `b` reads slot `slots[b]`,
        keys `[0, positions[b, 0]]` (at most the cache's; a slot outside the cache gives zeros). Returns
        `(B, Hkv, G, D)` in q's dtype."""
        rows, kv_heads, groups, head_dim = q.shape
        if (
            not self.supports(q, k)
            or k.stride() != v.stride()
            or k.shape != v.shape
            or k.shape[1] != kv_heads
        ):
            raise ValueError(
                f"decode_attention: q {tuple(q.shape)} {q.dtype} and k/v {tuple(k.shape)} {k.dtype} are not "
                f"(B, Hkv, G, D) and (slots, Hkv, capacity, D) in float32 or bfloat16 on CPU, D a multiple "
                f"of 16 up to {self.max_head_dim}, G up to {self.max_groups}"
            )
        if slots.dtype != torch.int64 or positions.dtype != torch.int64:
            raise TypeError("decode_attention: slots and positions must be int64")
        if slots.shape != (rows,) or positions.shape[0] != rows:
            raise ValueError(f"decode_attention: slots and positions must have {rows} rows")
        q, slots, positions = q.contiguous(), slots.contiguous(), positions.contiguous()
        out = torch.empty_like(q)
        self._fn(
            q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), slots.data_ptr(), positions.data_ptr(),
            positions.stride(0), rows, kv_heads, groups, head_dim, k.shape[0], k.shape[2],
            k.stride(0), k.stride(1), k.stride(2), scale, DTYPES[q.dtype], torch.get_num_threads(),
        )  # fmt: skip
        return out

    def decode_step(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        slots: torch.Tensor,
        positions: torch.Tensor,
        writes: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """One layer's decode step after its fused q/k/v projection, in one call: RoPE of the queries and the
        new keys as the engine's decoder computes it (`h * cos + h.roll(D/2) * sin`, `sin`'s first half
        negated, each op rounded to the dtype as torch rounds it), the new keys and values written to column
        `writes[b]` of row b's cache slot (a column outside the cache: not written), then `decode_attention`.
        qkv `(B, 1, Hkv * (G + 2), D)`: the q, k and v heads in that order, head dim contiguous; cos and sin
        `(B, D)`; k, v one layer's cache `(slots, Hkv, capacity, D)`; `slots` distinct. Returns `(B, Hkv, G,
        D)` in qkv's dtype."""
        rows, kv_heads, d = qkv.shape[0], k.shape[1], qkv.shape[-1]
        groups = qkv.shape[2] // kv_heads - 2 if qkv.dim() == 4 else 0
        if (
            qkv.dim() != 4
            or qkv.shape[1] != 1
            or qkv.shape[2] != kv_heads * (groups + 2)
            or groups < 1
            or qkv.stride(-1) != 1
            or qkv.stride(-2) != d
            or cos.shape != (rows, d)
            or sin.shape != (rows, d)
            or cos.dtype != qkv.dtype
            or sin.dtype != qkv.dtype
            or not (cos.is_contiguous() and sin.is_contiguous())
            or k.shape != v.shape
            or k.stride() != v.stride()
            or k.dim() != 4
            or k.shape[-1] != d
            or k.stride(-1) != 1
            or k.dtype != qkv.dtype
            or k.device.type != "cpu"
            or qkv.device.type != "cpu"
            or self.covers(qkv.dtype, d, groups) is not None
        ):
            raise ValueError(
                f"decode_step: qkv {tuple(qkv.shape)} {qkv.dtype}, cos/sin {tuple(cos.shape)} / {tuple(sin.shape)}"
                f" and k/v {tuple(k.shape)} {k.dtype} are not (B, 1, Hkv * (G + 2), D), (B, D) and (slots, Hkv,"
                f" capacity, D) of one dtype (float32 or bfloat16) on CPU, D a multiple of 16 up to "
                f"{self.max_head_dim}, G up to {self.max_groups}"
            )
        index = (slots, positions, writes)
        if any(t.dtype != torch.int64 for t in index):
            raise TypeError("decode_step: slots, positions and writes must be int64")
        if slots.shape != (rows,) or positions.shape[0] != rows or writes.numel() != rows:
            raise ValueError(f"decode_step: slots, positions and writes must have {rows} rows")
        if len(set(slots.tolist())) != rows:
            raise ValueError("decode_step: rows must be in distinct cache slots (each writes its own)")
        slots, positions, writes = (t.contiguous() for t in index)
        out = qkv.new_empty(rows, kv_heads, groups, d)
        self._step(
            qkv.data_ptr(), qkv.stride(0), cos.data_ptr(), sin.data_ptr(), k.data_ptr(), v.data_ptr(),
            out.data_ptr(), slots.data_ptr(), positions.data_ptr(), positions.stride(0), writes.data_ptr(),
            rows, kv_heads, groups, d, k.shape[0], k.shape[2], k.stride(0), k.stride(1), k.stride(2), scale,
            DTYPES[qkv.dtype], torch.get_num_threads(),
        )  # fmt: skip
        return out

    def lora_add(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        tables: LoRATables,
        terms: torch.Tensor,
        factors: torch.Tensor,
        order: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Add routed adapters to `y` `(..., width)` in place for input `x` `(..., in)` (same rows, same dtype:
        float32 or bfloat16, CPU): row `n` applies `terms[n, i]` (a slot of `tables`, -1 = none) times
        `factors[n, i]` for i = 0, 1. `order`: a permutation of the rows that puts rows with equal terms
        next to each other (they then share each pass over the matrices); default: sorted by terms.
        Returns `y`."""
        if (
            x.dtype not in DTYPES
            or y.dtype != x.dtype
            or x.device.type != "cpu"
            or y.device.type != "cpu"
            or x.shape[:-1] != y.shape[:-1]
            or x.shape[-1] != tables.in_features
            or y.shape[-1] != tables.width
        ):
            raise ValueError(
                f"lora_add: x {tuple(x.shape)} {x.dtype} and y {tuple(y.shape)} {y.dtype} are not (..., "
                f"{tables.in_features}) and (..., {tables.width}) of one dtype (float32 or bfloat16) on CPU"
            )
        rows = x[..., 0].numel()
        if terms.shape != (rows, 2) or factors.shape != (rows, 2):
            raise ValueError(f"lora_add: terms and factors must be ({rows}, 2) for {rows} rows")
        if terms.dtype != torch.int64 or factors.dtype != torch.float32:
            raise TypeError("lora_add: terms must be int64 and factors float32")
        if not y.is_contiguous():
            raise ValueError("lora_add: y must be contiguous (it is updated in place)")
        n_slots = tables.slots.shape[0]
        if terms.numel() and not -1 <= int(terms.min()) <= int(terms.max()) < n_slots:
            raise ValueError(f"lora_add: terms must be -1 (none) or one of the tables' {n_slots} slots")
        if order is None:
            order = group_rows(terms)
        elif order.dtype != torch.int64 or not torch.equal(order.sort().values, torch.arange(rows)):
            raise ValueError(f"lora_add: order must be an int64 permutation of the {rows} rows")
        step = NativeStep(self, rows, (terms.contiguous(), factors.contiguous(), order.contiguous()), x.dtype)
        step.add_(x.contiguous(), y, tables)
        return y

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, add: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """HF's RMSNorm of `x` `(..., d)` (`weight * round(x * rsqrt(mean(x^2) + eps))`, `norm.c`), after the
        residual add `x + add` when `add` is given: returns `(x + add, its norm)` (`(x, its norm)` without
        `add`). One dtype throughout (float32 or bfloat16), CPU."""
        d = x.shape[-1]
        if (
            x.dtype not in DTYPES
            or x.device.type != "cpu"
            or weight.shape != (d,)
            or weight.dtype != x.dtype
            or weight.device.type != "cpu"
            or (
                add is not None and (add.shape != x.shape or add.dtype != x.dtype or add.device.type != "cpu")
            )
        ):
            raise ValueError(
                f"rms_norm: x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype}"
                + (f", add {tuple(add.shape)} {add.dtype}" if add is not None else "")
                + " are not (..., d), (d,) and (..., d) of one dtype (float32 or bfloat16) on CPU"
            )
        x, weight = x.contiguous(), weight.contiguous()
        add = add.contiguous() if add is not None else None  # held until the call returns
        out = torch.empty_like(x)
        total = torch.empty_like(x) if add is not None else x
        rows = x.numel() // d if d else 0
        self._norm(
            x.data_ptr(), add.data_ptr() if add is not None else None, total.data_ptr(), weight.data_ptr(),
            out.data_ptr(), rows, d, eps, DTYPES[x.dtype], torch.get_num_threads(),
        )  # fmt: skip
        return total, out

    def pack(self, weight: torch.Tensor) -> PackedWeight:
        """`weight` `(out, in)` (fp32, CPU) laid out for `linear` (`gemm.c`): a copy of the same size, but
        for the last panel's padding to a multiple of `panel` columns."""
        if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
            raise ValueError(
                f"pack: weight {tuple(weight.shape)} {weight.dtype} on {weight.device} is not a 2-D float32 "
                "matrix on CPU"
            )
        n, k = weight.shape
        weight = weight.detach()
        if weight.stride(1) != 1:
            weight = weight.contiguous()
        panels = weight.new_empty(-(-n // self.panel) * self.panel * k)
        self._gemm_pack(weight.data_ptr(), weight.stride(0), panels.data_ptr(), n, k, torch.get_num_threads())
        return PackedWeight(self, panels, n, k)

    def linear(self, x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
        """`F.linear(x, W, bias)` for x `(..., in)` fp32 on CPU and W packed by `pack`: each output the bias
        plus the products added in input order, the same bits for a row alone or in any batch (`gemm.c`)."""
        n, k = weight.out_features, weight.in_features
        if (
            x.dtype != torch.float32
            or x.device.type != "cpu"
            or x.dim() < 1
            or x.shape[-1] != k
            or (bias is not None and (bias.shape != (n,) or bias.dtype != torch.float32))
        ):
            raise ValueError(
                f"linear: x {tuple(x.shape)} {x.dtype} on {x.device}"
                + (f", bias {tuple(bias.shape)} {bias.dtype}" if bias is not None else "")
                + f" do not fit a packed ({n}, {k}) float32 weight: x (..., {k}) and bias ({n},), float32 on CPU"
            )
        rows = x.reshape(-1, k) if k else x.new_empty(x.shape[:-1].numel(), 0)
        if k and rows.stride(1) != 1:
            rows = rows.contiguous()
        if bias is not None:
            bias = bias.detach().contiguous()
        out = x.new_empty(rows.shape[0], n)
        self._gemm(
            rows.data_ptr(), rows.stride(0) if k else 0, weight.panels.data_ptr(),
            bias.data_ptr() if bias is not None else None, out.data_ptr(), n, rows.shape[0], n, k,
            torch.get_num_threads(),
        )  # fmt: skip
        return out.view(*x.shape[:-1], n)

    def step(self, rows: int, terms: tuple[torch.Tensor, ...] | None, dtype: torch.dtype) -> NativeStep:
        """One decode forward's adapter calls over `rows` rows (`NativeStep`)."""
        return NativeStep(self, rows, terms, dtype)

    def tables(self, layers, n_slots: int, in_features: int, width: int) -> LoRATables:
        """The adapters of one fused group as `lora_add` reads them (`LoRATables`)."""
        return LoRATables(layers, n_slots, in_features, width)


class PackedWeight:
    """A linear layer's weight `(out_features, in_features)` as `gemm.c` reads it (`NativeKernel.pack`):
    `panels`, a flat fp32 tensor; `linear` multiplies by it."""

    __slots__ = ("kernel", "panels", "out_features", "in_features", "__weakref__")

    def __init__(
        self, kernel: NativeKernel, panels: torch.Tensor, out_features: int, in_features: int
    ) -> None:
        self.kernel, self.panels = kernel, panels
        self.out_features, self.in_features = out_features, in_features

    def __repr__(self) -> str:
        return f"PackedWeight({self.out_features}, {self.in_features})"


class NativeStep:
    """The routed adapters of one decode forward, for every fused group it runs (`FusedAdapters.add_`): the
    rows, and per row its terms (`(rows, 2)` slots, -1 = none), their factors `(rows, 2)` and the rows
    grouped by terms (`RouteState.terms`; None: no row adds anything), set up once per forward so that each
    group's call is one ctypes call."""

    def __init__(
        self, kernel: NativeKernel, rows: int, terms: tuple[torch.Tensor, ...] | None, dtype: torch.dtype
    ) -> None:
        if terms is not None and any(t.shape[0] != rows or not t.is_contiguous() for t in terms):
            raise ValueError(f"NativeStep: terms, factors and order must be contiguous, {rows} rows each")
        self.kernel, self.rows, self.dtype, self.terms = kernel, rows, dtype, terms
        self._tail = None
        if terms is not None:
            self._tail = (*(t.data_ptr() for t in terms), DTYPES[dtype], torch.get_num_threads())

    def fits(self, x: torch.Tensor, y: torch.Tensor) -> bool:
        """Whether `x` `(..., in)` and `y` `(..., width)` are this step's rows, dtype and layout."""
        return (
            x.dtype == y.dtype == self.dtype
            and x.numel() == self.rows * x.shape[-1]
            and y.numel() == self.rows * y.shape[-1]
            and x.is_contiguous()
            and y.is_contiguous()
        )

    def add_(self, x: torch.Tensor, y: torch.Tensor, tables: LoRATables) -> None:
        """`y += adapters(x)` in place, for `x` and `y` that `fit` and `tables` of their widths; the kernel
        checks every index it reads from the tables and the terms."""
        if self._tail is None:
            return
        if x.shape[-1] != tables.in_features or y.shape[-1] != tables.width:
            raise ValueError("NativeStep: x and y do not match the tables' widths")
        bad = self.kernel._lora(x.data_ptr(), y.data_ptr(), self.rows, *tables.head, *self._tail)
        if bad:
            why = "no scratch memory" if bad < 0 else f"{bad} terms or blocks outside the tables"
            raise RuntimeError(f"lora_add: {why}")


class LoRATables:
    """The adapters of one fused group, as `lora.c` reads them. `layers`: one entry per layer of the group,
    `(first column, end column, {slot: (A (r, in), B (out, r))})`, slot = the adapter's route index; every
    matrix is stored in fp32. Slot `s` stacks the A of every layer carrying adapter `s` (R ranks) and keeps
    one block per such layer: its columns, its ranks within the slot, its B transposed."""

    def __init__(self, layers, n_slots: int, in_features: int, width: int) -> None:
        self.in_features, self.width = in_features, width
        a_parts, b_parts, slots, blocks = [], [], [], []
        a_at = b_at = 0
        for s in range(n_slots):
            carriers = [(lo, hi, mats[s]) for lo, hi, mats in layers if s in mats]
            rank, first, stacked = 0, len(blocks), []
            for lo, hi, (a, b) in carriers:
                r = a.shape[0]
                if a.shape != (r, in_features) or b.shape != (hi - lo, r) or not 0 <= lo <= hi <= width:
                    raise ValueError(
                        f"LoRATables: adapter matrices {tuple(a.shape)} / {tuple(b.shape)} do "
                        f"not fit columns [{lo}, {hi}) of {width} over {in_features} inputs"
                    )
                stacked.append(a.detach().to(torch.float32))
                bt = b.detach().to(torch.float32).t().contiguous().reshape(-1)
                b_parts.append(bt)
                blocks.append((lo, hi, rank, r, b_at))
                rank, b_at = rank + r, b_at + bt.numel()
            slots.append((a_at, rank, first, len(blocks) - first))
            if rank:
                a_parts.append(torch.cat(stacked).reshape(-1))
                a_at += rank * in_features
        empty = torch.zeros(1)  # never read (a zero-length slot or table), a valid pointer all the same
        self.a = torch.cat(a_parts) if a_parts else empty
        self.b = torch.cat(b_parts) if b_parts else empty
        self.slots = torch.tensor(slots, dtype=torch.int64).reshape(-1, 4)
        self.blocks = torch.tensor(blocks, dtype=torch.int64).reshape(-1, 5)
        self.head = (  # lora.c's arguments after x, y and the rows
            in_features, width, in_features, width, self.a.data_ptr(), self.a.numel(), self.b.data_ptr(),
            self.b.numel(), self.slots.data_ptr(), self.slots.shape[0], self.blocks.data_ptr(),
            self.blocks.shape[0],
        )  # fmt: skip


def resolve_attention(attention: str, device: torch.device) -> NativeKernel | None:
    """`rollout.attention`: `native` = the C kernel (an error where it cannot be built), `torch` = SDPA and
    matmuls, `auto` = native where the kernel builds with AVX2 or AVX-512 on this CPU, else torch."""
    return _resolve(attention, device, "rollout.attention")


def resolve_adapter_kernel(setting: str, device: torch.device) -> NativeKernel | None:
    """`rollout.adapter_kernel`: the routed adapters of a decode step in `lora.c` (`native`; an error where
    it cannot be built) or in torch's GEMMs (`torch`); `auto` = native where it builds with AVX2 or AVX-512."""
    return _resolve(setting, device, "rollout.adapter_kernel")


def resolve_pointwise(setting: str, device: torch.device) -> NativeKernel | None:
    """`rollout.pointwise`: the residual adds and RMSNorms of the engine's own decoder in `norm.c` (`native`;
    an error where it cannot be built) or in torch's ops (`torch`); `auto` = native where it builds with AVX2
    or AVX-512."""
    return _resolve(setting, device, "rollout.pointwise")


def _resolve(setting: str, device: torch.device, field: str) -> NativeKernel | None:
    if setting not in ATTENTION:
        raise ValueError(f"{field} must be one of {ATTENTION}, got {setting!r}")
    if setting == "torch" or device.type != "cpu":
        if setting == "native":
            raise ValueError(f"{field} 'native' runs on CPU only; this model is on {device}")
        return None
    built = kernel()
    if built is None and setting == "native":
        raise RuntimeError(f"{field} 'native': the kernels did not build ({_failure}); use 'auto'")
    if built is not None and setting == "auto" and not built.isa:
        return None  # built without AVX2 or AVX-512: its generic vectors measured slower than torch's
    return built


_failure = ""


@functools.cache
def kernel() -> NativeKernel | None:
    """The compiled kernels, built once per machine (cached on disk), or None where they cannot be built."""
    global _failure
    try:
        built = NativeKernel(_build())
        missing = _missing_instructions(built.isa)
        if missing:  # a -march above this CPU's (ROLERL_NATIVE_MARCH): its code would die of SIGILL
            march = os.environ.get(MARCH_ENV) or "native"
            raise RuntimeError(f"built for {missing}, which this CPU lacks ({MARCH_ENV}={march})")
        return built
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        _failure = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        log.warning(
            "native kernels unavailable (%s); the engine uses SDPA, torch's adapter GEMMs and HF's norms",
            _failure,
        )
        return None


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        raise RuntimeError("no C compiler (set CC, or install gcc)")
    return cc


def _missing_instructions(isa: int) -> str:
    """The instructions a build of vector width `isa` (512, 256 or 0) needs and this CPU lacks, if known."""
    have = _cpu_flags()
    need = {512: {"avx512f"}, 256: {"avx2", "fma"}}.get(isa, set())
    return " ".join(sorted(need - have)) if have else ""


def _cpu_identity() -> str:
    """What `-march=native` depends on: the CPU's model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return f"{platform.machine()} {platform.processor()}"
    keep = ("model name", "flags", "Features", "CPU implementer", "CPU part")
    return "\n".join(sorted({ln for ln in lines if ln.split(":")[0].strip() in keep}))


def flags() -> tuple[str, ...]:
    """The compiler flags: `FLAGS`, with `-march=$ROLERL_NATIVE_MARCH` where that is set."""
    march = os.environ.get(MARCH_ENV, "").strip()
    if not march:
        return FLAGS
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._+-]*", march):
        raise RuntimeError(f"{MARCH_ENV}={march!r} is not a compiler target name (e.g. native, x86-64-v3)")
    return tuple(f"-march={march}" if f == "-march=native" else f for f in FLAGS)


def _build() -> Path:
    cc = _compiler()
    cflags = flags()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    parts = [p.read_bytes() for p in (*SOURCES, *HEADERS)]
    key = hashlib.sha256(b"\0".join([*parts, " ".join(cflags).encode(), version.encode(),
                                     _cpu_identity().encode()])).hexdigest()[:16]  # fmt: skip
    target = cache_dir() / "native" / f"rolerl-native-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run(
            [cc, *cflags, "-o", tmp, *map(str, SOURCES)], capture_output=True, text=True, timeout=120
        )
        if done.returncode != 0:
            raise RuntimeError(f"{cc} failed: {done.stderr.strip()[:500]}")
        os.replace(tmp, target)  # atomic: a concurrent build or a crash never leaves half a library
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target
