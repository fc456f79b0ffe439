"""The engine's decode attention as a small C kernel, built on first use with the machine's C compiler.

At a decode step every row attends with one query per head to its own cached keys. On CPU, SDPA's flash
kernel and batched matmuls both pay per (row, KV head) for tiling and GEMM set-up that a few dozen keys of
64 dims never amortise: at batch 32 on the default model that was a quarter of a bf16 decode step
(docs/BENCHMARKS.md). `decode_attention.c` does the whole softmax(q k^T) v of one (row, KV head) in one
pass over its keys, reading the cache in place (cache slots and per-row lengths instead of a gather and a
mask), in fp32 whatever the cache's dtype (bf16 keys and values are widened as they are read; SDPA rounds
the probabilities to bf16 before multiplying by V, this kernel does not).

`kernel()` compiles the source once per machine and compiler (`cc -O3 -march=native -fopenmp`) into
`$ROLERL_CACHE/native` (default `~/.cache/rolerl/native`), keyed by the source, the flags, the compiler's
version and the CPU's flags, so that a home directory shared by different CPUs never loads a binary built
for another, and loads it with ctypes after torch: with torch's GNU OpenMP (`libgomp.so.1`, the PyPI
wheels') the kernel then runs on torch's own threads. With no compiler (or one without OpenMP), or a
build that fails, it returns None and says why once; the engine then keeps SDPA (`rollout.attention`).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from rolerl.models.load import cache_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("decode_attention.c")
# no -ffast-math or reassociation: the kernel spells its vector sums out (reduce_lanes), so the compiler
# keeps IEEE semantics (NaN and inf mean what they say) at no cost
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared")
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
ATTENTION = ("auto", "native", "torch")


class NativeKernel:
    """The loaded library: `decode_attention(q, k, v, slots, positions, scale)`."""

    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        fn = lib.rolerl_decode_attention
        fn.argtypes = [ptr] * 6 + [i64] * 10 + [ctypes.c_float, ctypes.c_int, ctypes.c_int]
        fn.restype = None
        limit = lib.rolerl_decode_attention_limit
        limit.argtypes, limit.restype = [ctypes.c_int], ctypes.c_int
        self.path, self._fn = path, fn
        self.max_head_dim, self.max_groups, self.isa = limit(0), limit(1), limit(2)

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


def resolve_attention(attention: str, device: torch.device) -> NativeKernel | None:
    """`rollout.attention`: `native` = the C kernel (an error where it cannot be built), `torch` = SDPA and
    matmuls, `auto` = native where the kernel builds with AVX2 or AVX-512 on this CPU, else torch."""
    if attention not in ATTENTION:
        raise ValueError(f"rollout.attention must be one of {ATTENTION}, got {attention!r}")
    if attention == "torch" or device.type != "cpu":
        if attention == "native":
            raise ValueError(f"rollout.attention 'native' runs on CPU only; this model is on {device}")
        return None
    built = kernel()
    if built is None and attention == "native":
        raise RuntimeError(f"rollout.attention 'native': the kernel did not build ({_failure}); use 'auto'")
    if built is not None and attention == "auto" and not built.isa:
        return None  # built without AVX2 or AVX-512: its generic vectors measured slower than torch's
    return built


_failure = ""


@functools.cache
def kernel() -> NativeKernel | None:
    """The compiled kernel, built once per machine (cached on disk), or None where it cannot be built."""
    global _failure
    try:
        return NativeKernel(_build())
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        _failure = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        log.warning("native decode attention unavailable (%s); the engine uses SDPA", _failure)
        return None


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        raise RuntimeError("no C compiler (set CC, or install gcc)")
    return cc


def _cpu_identity() -> str:
    """What `-march=native` depends on: the CPU's model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return f"{platform.machine()} {platform.processor()}"
    keep = ("model name", "flags", "Features", "CPU implementer", "CPU part")
    return "\n".join(sorted({ln for ln in lines if ln.split(":")[0].strip() in keep}))


def _build() -> Path:
    cc = _compiler()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    source = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, " ".join(FLAGS).encode(), version.encode(),
                                     _cpu_identity().encode()])).hexdigest()[:16]  # fmt: skip
    target = cache_dir() / "native" / f"decode_attention-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run(
            [cc, *FLAGS, "-o", tmp, str(SOURCE)], capture_output=True, text=True, timeout=120
        )
        if done.returncode != 0:
            raise RuntimeError(f"{cc} failed: {done.stderr.strip()[:500]}")
        os.replace(tmp, target)  # atomic: a concurrent build or a crash never leaves half a library
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target
