"""Prepacked linear weights for the engine's forwards on CPU (oneDNN).

A decode step multiplies a few dozen rows by every weight of the model. At that shape the CPU's GEMM
spends much of its time re-laying out the weight matrix on every call; oneDNN can lay each weight out
once, in the blocked format its kernel reads, and reuse it for every step (what inductor does for frozen
CPU graphs). Measured on the default model (docs/BENCHMARKS.md): the weight GEMMs of a batch-32 fp32 decode
step take 1.6x less time than `F.linear`'s, on AVX-512 and with oneDNN and MKL limited to AVX2 alike.

`PackedLinears(model)` packs every `nn.Linear` of the model (the base layers under routed adapters and
the LM head; the adapters' small matrices stay as they are) and, inside `with packed():`, runs those
layers on the packed copies. Inference only: no autograd. A weight that changes (its tensor version or
storage moves, e.g. a trainable base) is packed again on the next entry. The packed copies take as much
memory as the weights they copy; a model only the engine uses (`release()`: a rollout copy in another dtype,
or a generation-only model) keeps the packed copies alone and frees the plain weights.
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

KERNELS = ("auto", "onednn", "torch")


def onednn_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether packed oneDNN linears run for this device and dtype: CPU, oneDNN built in, fp32 anywhere,
    bf16 only where oneDNN has a native bf16 path (it refuses or emulates slowly elsewhere)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return False


def resolve_kernels(kernels: str, device: torch.device, dtype: torch.dtype) -> str:
    """`auto` -> `onednn` where supported, else `torch`; `onednn` where unsupported is an error."""
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {KERNELS}, got {kernels!r}")
    ok = onednn_supported(device, dtype)
    if kernels == "onednn" and not ok:
        raise ValueError(
            f"rollout.kernels 'onednn' needs a CPU model in float32 (or bfloat16 on a CPU with native bf16) "
            f"and a torch built with oneDNN; this model is {dtype} on {device}: use 'auto' or 'torch'"
        )
    return "onednn" if kernels == "auto" and ok else ("torch" if kernels == "auto" else kernels)


class PackedLinears:
    """The model's linear layers, packed once for oneDNN and swapped in for the duration of a block."""

    def __init__(self, model: nn.Module, batch_hint: int = 32) -> None:
        self._model = weakref.ref(model)  # not a strong reference: `of` keys its table by the model
        self.linears = [m for m in model.modules() if type(m) is nn.Linear]
        self.batch_hint = batch_hint
        self._packed: dict[int, tuple[tuple[int, int], torch.Tensor]] = {}
        self.released = False

    @classmethod
    def of(cls, model: nn.Module, batch_hint: int = 32) -> PackedLinears:
        """The packed linears of `model`, one set per model: engines over the same model (a training run's
        rollout engine and its evaluation engine) share one packed copy of the weights."""
        packed = _PER_MODEL.get(model)
        if packed is None:
            packed = _PER_MODEL[model] = cls(model, batch_hint)
        return packed

    @property
    def model(self) -> nn.Module:
        return self._model()

    @contextmanager
    def __call__(self) -> Iterator[None]:
        if self.released:  # the packed forwards are installed for good
            yield
            return
        for m in self.linears:  # through __dict__: nn.Module.__setattr__ costs ~1 ms per step here
            m.__dict__["forward"] = _packed_forward(self._pack(m), m.bias)
        try:
            yield
        finally:
            for m in self.linears:
                m.__dict__.pop("forward", None)

    def drop(self) -> None:
        """Free the packed copies (a model the trainer also runs keeps its plain weights); the next
        `with packed():` packs again. Nothing to drop once released: the packed copies are the weights."""
        if not self.released:
            self._packed.clear()

    def release(self) -> int:
        """Pack every layer, install the packed forwards for good and free the plain weights (a weight
        shared with another module, e.g. an LM head tied to the embeddings, is kept). The model then runs
        only without autograd and its linear weights are frozen. Returns the bytes freed."""
        shared = {
            p.data_ptr()
            for m in self.model.modules()
            if type(m) is not nn.Linear
            for p in m.parameters(False)
        }
        uses = Counter(m.weight.data_ptr() for m in self.linears)
        maps = _file_mappings()
        freed = 0
        for m in self.linears:
            m.__dict__["forward"] = _packed_forward(self._pack(m), m.bias)
            if m.weight.data_ptr() not in shared and uses[m.weight.data_ptr()] == 1:
                freed += m.weight.numel() * m.weight.element_size()
                _drop_file_pages(m.weight, maps)
                m.weight = nn.Parameter(m.weight.new_empty(0), requires_grad=False)
        self.released = True
        return freed

    def _pack(self, m: nn.Linear) -> torch.Tensor:
        w = m.weight
        state = (w._version, w.data_ptr())
        cached = self._packed.get(id(m))
        if cached is not None and cached[0] == state:
            return cached[1]
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), self.batch_hint)
        self._packed[id(m)] = (state, packed)
        return packed


_PER_MODEL: weakref.WeakKeyDictionary[nn.Module, PackedLinears] = weakref.WeakKeyDictionary()


def _packed_forward(weight: torch.Tensor, bias: torch.Tensor | None):
    linear = torch.ops.mkldnn._linear_pointwise

    def forward(x: torch.Tensor) -> torch.Tensor:
        return linear(x, weight, bias, "none", [], "")

    return forward


def _file_mappings() -> list[tuple[int, int]]:
    """The address ranges of this process's file-backed memory mappings (Linux), else none."""
    try:
        with open("/proc/self/maps") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/"):  # a path: file-backed
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            out.append((lo, hi))
    return out


def _drop_file_pages(t: torch.Tensor, maps: list[tuple[int, int]]) -> None:
    """Weights loaded from safetensors are pages of the checkpoint file mapped into memory: freeing the
    tensor keeps them resident while other tensors (the embeddings) share the mapping. When every page of
    `t` lies in a file-backed mapping, tell the kernel we no longer need them (`MADV_DONTNEED`: a later read
    would fetch them from the file again; nothing reads them once the packed copy replaced them). Anonymous
    memory is left to the allocator, which frees it with the tensor."""
    import ctypes
    import mmap

    if t.device.type != "cpu" or not hasattr(mmap, "MADV_DONTNEED"):
        return
    page = mmap.PAGESIZE
    start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    lo, hi = -(-start // page) * page, end // page * page  # only pages wholly inside the tensor
    if hi <= lo or not any(a <= start and end <= b for a, b in maps):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), mmap.MADV_DONTNEED)
