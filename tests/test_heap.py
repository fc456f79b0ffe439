"""`rolerl.heap`: a process that keeps its freed memory keeps it resident and reuses its pages (a training
step's activations allocated again find them, without page faults); with glibc's defaults the freed blocks
go back to the system and every round faults their pages in again. Each case runs in its own process: the
setting is process-wide."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rolerl import heap

PROBE = """
import json, os, resource, sys
import torch
from rolerl import heap
kept = heap.keep_freed_memory() if sys.argv[1] == "keep" else False
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
resident = lambda: int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
rounds, returned = [], []
for _ in range(5):  # five "micro-batches": eight 8 MiB activations and small tensors, all freed after
    f0 = faults()
    big = [torch.ones(2**21) for _ in range(8)]
    small = [torch.ones(2**14) for _ in range(20)]
    rounds.append(faults() - f0)
    before = resident()
    del big, small
    heap.trim_heap()  # the engine's trim before a rollout: a no-op while the process keeps its memory
    returned.append((before - resident()) / 2**20)  # MiB given back to the system
print(json.dumps({"kept": kept, "keeping": heap.keeping(), "faults": rounds, "returned_mib": returned}))
"""


def probe(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(heap._libc() is None or sys.platform != "linux", reason="glibc on Linux only")
def test_kept_memory_stays_resident_and_is_reused_without_page_faults():
    default, kept = probe("default"), probe("keep")
    assert not default["keeping"] and kept["kept"] and kept["keeping"]
    # each round frees 64 MiB (8 x 8 MiB) plus 20 x 64 KiB
    assert all(mib >= 48 for mib in default["returned_mib"]), default
    assert all(mib <= 8 for mib in kept["returned_mib"]), kept
    # 64 MiB is 16,384 pages of 4 KiB (32 of 2 MiB where transparent huge pages are always on); kept pages
    # are found again once the heap holds free blocks that fit (glibc's placement decides which round)
    assert all(n >= 32 for n in default["faults"]), default
    assert min(kept["faults"][1:]) * 10 <= min(default["faults"][1:]), (kept, default)
