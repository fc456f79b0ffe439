"""The process's C heap between training phases: keep the memory it frees, or give it back.

A training step allocates and frees its activations (GBs for long completions) once per micro-batch, and
the rollout between two updates needs little of that memory. glibc gives large blocks back to the system
as they are freed (every block over its mmap threshold, and the top of the heap past its trim threshold),
so the next micro-batch and the next step fault the same pages in again, each page zeroed by the kernel:
~2.5 us per 4 KiB page on the 2-core machines of docs/BENCHMARKS.md, ~1-3 million faults per 512-token GRPO
update. `keep_freed_memory()` makes glibc keep what the process frees (the heap is never trimmed, and
blocks up to 32 MB, the largest threshold glibc takes, come from it instead of a mapping of their own) so
that later allocations reuse those pages, as a GPU trainer's caching allocator keeps device memory; the
process's resident size then stays near its peak between steps instead of returning to the rollout's.
Blocks over 32 MB are mapped and faulted in again at every allocation whatever this module sets, so the
trainer keeps its own blocks under `LARGEST_KEPT_BLOCK` (its attention kernel and log-prob chunks; before
that, eager attention's scores made 12.9 million faults in one 512-token update). Measured:
docs/history/BENCHMARKS-history.md (GRPO, "Round ten" and "Round thirteen"). Off glibc (macOS, musl) both
calls are no-ops.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

# mallopt parameters (glibc's malloc.h)
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
# glibc's largest mmap threshold: the largest block the kept heap serves; larger blocks are still mapped
# for each allocation (and every page faulted in again)
LARGEST_KEPT_BLOCK = 32 << 20
_TOP_PAD = 256 << 20  # the heap grows by at least this much at a time

_keeping = False


def keep_freed_memory() -> bool:
    """From now on, glibc keeps the memory this process frees for its next allocations: the heap is never
    trimmed (`M_TRIM_THRESHOLD` -1), blocks up to 32 MB come from it (`M_MMAP_THRESHOLD`; larger ones are
    still mapped and unmapped one by one) and it grows 256 MB at a time (`M_TOP_PAD`). Process-wide and for
    the rest of the process; `trim_heap` becomes a no-op. True where it took effect."""
    global _keeping
    libc = _libc()
    if libc is None:
        return False
    _keeping = all(
        libc.mallopt(param, value)
        for param, value in (
            (_M_MMAP_THRESHOLD, LARGEST_KEPT_BLOCK),
            (_M_TRIM_THRESHOLD, -1),
            (_M_TOP_PAD, _TOP_PAD),
        )
    )
    return _keeping


def keeping() -> bool:
    """Whether `keep_freed_memory` is in effect in this process."""
    return _keeping


def trim_heap() -> None:
    """Give the C heap's free pages back to the system (glibc's `malloc_trim`), unless the process keeps
    them (`keep_freed_memory`: a trainer, whose next update reuses them). A freed cache layer of a few MB
    is often a hole in the heap, below blocks still in use, which glibc keeps mapped: after a rollout that
    outgrew a shorter one's cache, the old cache stayed resident (+127 MB at batch 32 x 512 tokens on the
    default model) until something reused it."""
    libc = _libc()
    if libc is not None and not _keeping:
        libc.malloc_trim(0)


@functools.cache
def _libc():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    if libc is None or not hasattr(libc, "malloc_trim") or not hasattr(libc, "mallopt"):
        return None  # not glibc: mallopt's parameters differ, and there is nothing to trim
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return libc
