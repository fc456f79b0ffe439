"""Prepacked linear weights for the engine's forwards on CPU (the engine's own fp32 GEMM, or oneDNN).

A decode step multiplies a few dozen rows by every weight of the model. At that shape a CPU GEMM on the
plain weight spends much of its time re-laying it out on every call; packed once, in the layout the kernel
reads, the weight serves every step (what inductor does for frozen CPU graphs). Two packings (`kind`):
`onednn` (fp32, or bf16 where the CPU has it natively): oneDNN's blocked format, 1.6x less time than
`F.linear` for the weight GEMMs of a batch-32 fp32 decode step (docs/BENCHMARKS.md); `native` (fp32): the
panels of `rolerl.rollout.native`'s `gemm.c`, which overlaps streaming each weight from memory with the
arithmetic on it, 1.2-1.6x less time again at 8-64 rows.

`PackedLinears(model)` packs every `nn.Linear` of the model (the base layers under routed adapters and
the LM head; the adapters' small matrices stay as they are), layers that read one input side by side when
asked (`groups`: the engine's lean decoder runs q/k/v and gate/up as one GEMM each), and, inside
`with packed():`, runs those layers on the packed copies. Inference only: no autograd. A weight that
changes (its tensor version or storage moves, e.g. a trainable base) is packed again on the next use. The
packed copies take as much memory as the weights they copy; a model only the engine uses (`release()`: a
rollout copy in another dtype, or a generation-only model) keeps the packed copies alone and frees the plain
weights. A rollout copy released with its `source` (the trainer's model) still drops its packed copies
between rollouts, packs them again from the source's weights, and takes a merged adapter. An LM head tied
to the input embeddings is not copied unless asked (`tied_head`): oneDNN runs it on that matrix itself.
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import partial

import torch
from torch import nn
from torch.nn import functional as F

from rolerl.gemm import onednn_built
from rolerl.models.lora import RoutedLoRALinear, merged_delta
from rolerl.rollout import native

KERNELS = ("auto", "native", "onednn", "torch")
PACKED = ("native", "onednn")  # the kernels that run on packed weights (`PackedLinears.kind`)
TIED_HEADS = ("share", "copy")


def onednn_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether packed oneDNN linears run for this device and dtype: CPU, oneDNN built in, fp32 anywhere,
    bf16 only where oneDNN has a native bf16 path (it refuses or emulates slowly elsewhere)."""
    if device.type != "cpu" or not onednn_built():
        return False
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return False


def checked_tied_head(tied_head: str) -> str:
    if tied_head not in TIED_HEADS:
        raise ValueError(f"rollout.tied_head must be one of {TIED_HEADS}, got {tied_head!r}")
    return tied_head


def resolve_kernels(kernels: str, device: torch.device, dtype: torch.dtype) -> str:
    """`rollout.kernels`: `auto` -> `native` for fp32 on a CPU where the native kernels build with AVX2 or
    AVX-512 (docs/BENCHMARKS.md: faster than oneDNN's packed GEMMs at decode steps on AMX, AVX512-BF16 and
    AVX2 CPUs), else `onednn` where supported (bf16 with native bf16), else `torch`. `native` or `onednn`
    where they cannot run is an error that says why."""
    if kernels not in KERNELS:
        raise ValueError(f"rollout.kernels must be one of {KERNELS}, got {kernels!r}")
    ok = onednn_supported(device, dtype)
    if kernels == "onednn" and not ok:
        raise ValueError(
            f"rollout.kernels 'onednn' needs a CPU model in float32 (or bfloat16 on a CPU with native bf16) "
            f"and a torch built with oneDNN; this model is {dtype} on {device}: use 'auto' or 'torch'"
        )
    if kernels == "native":
        if device.type != "cpu" or dtype != torch.float32:
            raise ValueError(
                f"rollout.kernels 'native' runs float32 models on CPU; this model is {dtype} on {device}: "
                "use 'auto' (bf16: onednn where the CPU has native bf16)"
            )
        if native.kernel() is None:
            raise RuntimeError(
                f"rollout.kernels 'native': the kernels did not build ({native._failure}); use 'auto'"
            )
        return "native"
    if kernels != "auto":
        return kernels
    built = native.kernel() if device.type == "cpu" and dtype == torch.float32 else None
    if built is not None and built.isa:  # a generic-vector build (neither AVX2 nor AVX-512) is not measured
        return "native"
    return "onednn" if ok else "torch"


class PackedLinears:
    """The model's linear layers, packed once (`kind`: oneDNN's format or the native GEMM's panels) and
    swapped in for the duration of a block.

    `groups` packs layers that read the same input as one GEMM (the rollout engine's q/k/v and gate/up:
    `rolerl.rollout.decoder`): their weights concatenated by output rows. Every other linear is a group of
    its own. `weights()` gives the packed weight and bias of every group, in order.

    `tied_head`: `share` runs an LM head tied to the input embeddings on that matrix itself, `copy` packs a
    copy of it, as any other weight. A packed copy is opaque (no row can be read back for the token lookups),
    so `copy` holds the matrix twice: +57 MB for the default model in bf16, +113 MB in fp32, +545 MB for
    Qwen2.5-0.5B in fp32. Its GEMM on the plain matrix is slower on some CPUs and not on others
    (docs/BENCHMARKS.md): on a 2-core AVX-512 EPYC, a bf16 decode step's head took 8.7 ms at 32 rows against
    5.7 packed, while on an AVX2 one the fp32 head ran at the packed speed in the engine."""

    def __init__(
        self,
        model: nn.Module,
        batch_hint: int = 32,
        groups: Sequence[Sequence[nn.Linear]] = (),
        tied_head: str = "share",
        kind: str = "onednn",
    ) -> None:
        self.tied_head = checked_tied_head(tied_head)
        self.kind = _checked_kind(kind)
        self._model = weakref.ref(model)  # not a strong reference: `of` keys its table by the model
        self.linears = [m for m in model.modules() if type(m) is nn.Linear]
        grouped = {id(m) for g in groups for m in g}
        self.groups = [tuple(g) for g in groups] + [(m,) for m in self.linears if id(m) not in grouped]
        self.batch_hint = batch_hint
        self._packed: dict[tuple[int, ...], tuple[tuple, tuple[torch.Tensor, torch.Tensor | None]]] = {}
        self.released = False
        self.merged: str | None = None  # the adapter whose weights the packed weights hold (`merge_adapter`)
        self._routed: dict[int, RoutedLoRALinear] = {}  # id(base linear) -> the routed layer wrapping it
        self._shared: set[int] | None = None  # `_shared_ptrs()`, kept while packing
        self._sources: dict[int, nn.Linear] = {}  # id(linear) -> its source's (`release(source)`)

    @classmethod
    def of(
        cls,
        model: nn.Module,
        batch_hint: int = 32,
        groups: Sequence[Sequence[nn.Linear]] = (),
        tied_head: str = "share",
        kind: str = "onednn",
    ) -> PackedLinears:
        """The packed linears of `model`, one set per model: engines over the same model (a training run's
        rollout engine and its evaluation engine) share one packed copy of the weights. `tied_head` and
        `kind` are the latest caller's (a released model keeps what it was packed with)."""
        packed = _PER_MODEL.get(model)
        if packed is None:
            packed = _PER_MODEL[model] = cls(model, batch_hint, groups, tied_head, kind)
        else:
            packed.tied_head, packed.kind = checked_tied_head(tied_head), _checked_kind(kind)
        return packed

    @property
    def model(self) -> nn.Module:
        return self._model()

    @property
    def repackable(self) -> bool:
        """Whether the packed copies can be built again: the plain weights are there, or a source's."""
        return not self.released or bool(self._sources)

    def regroup(self, groups: Sequence[Sequence[nn.Linear]]) -> None:
        """Pack `groups` together from now on (every other linear alone), e.g. after adapters were injected
        into the model; nothing to do when they are the groups already."""
        groups = [tuple(g) for g in groups]
        grouped = {id(m) for g in groups for m in g}
        linears = [m for m in self.model.modules() if type(m) is nn.Linear]
        new = groups + [(m,) for m in linears if id(m) not in grouped]
        if new == self.groups:
            return
        if self.released:
            raise RuntimeError(
                "the linear layers of a released model cannot be regrouped (its weights are gone)"
            )
        self.linears, self.groups = linears, new
        self._packed = {k: v for k, v in self._packed.items() if k in {tuple(map(id, g)) for g in new}}
        self.merged = None  # the adapters may have changed with the layers
        self._shared = None

    def merge_adapter(self, name: str | None) -> None:
        """Pack adapter `name` into the base weights of the layers that carry it (`W + scaling * B @ A`, in
        the weights' dtype), None = the plain base weights; re-packed whenever that adapter's weights change.
        Only for a caller that subtracts it from tokens routed elsewhere (`FusedAdapters`, the engine's lean
        decoder); never on a model released without a source (its plain weights are gone)."""
        if name == self.merged:
            return
        if name is not None and not self.repackable:
            raise RuntimeError("a released model's packed weights cannot take a merged adapter")
        self.merged = name
        self._routed = {
            id(m.base_layer): m for m in self.model.modules() if isinstance(m, RoutedLoRALinear)
        } if name is not None else {}  # fmt: skip

    def weights(self) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """`(packed weight, bias)` of every group, packing again any whose weights changed."""
        return [self._pack(g) for g in self.groups]

    @contextmanager
    def __call__(self) -> Iterator[None]:
        """Run every linear layer of the model on its packed weights inside the block."""
        if self.merged is not None:  # the routed layers would add it a second time
            raise RuntimeError(
                f"adapter {self.merged!r} is merged into the packed weights: lean decoder only"
            )
        if self.released:  # the packed forwards are installed for good
            yield
            return
        self._install()
        try:
            yield
        finally:
            for m in self.linears:
                m.__dict__.pop("forward", None)

    def drop(self) -> None:
        """Free the packed copies (a model the trainer also runs keeps its plain weights, a copy released
        with a source packs again from the source's); the next use packs again. Nothing to drop on a model
        released without a source: the packed copies are its weights."""
        if self.repackable:
            self._packed.clear()
            self.merged = None  # the next rollout chooses again, at no extra cost
            self._shared = None

    def release(self, source: nn.Module | None = None) -> int:
        """Pack every layer, install the packed forwards for good and free the plain weights (a weight
        shared with another module, e.g. an LM head tied to the embeddings, is kept). The model then runs
        only without autograd and its linear weights are frozen. Returns the bytes freed.

        `source`: the model this one copies in another dtype (`rollout_copy`; the same module names and
        shapes). Its weights, cast to this model's dtype, stand in for the freed ones: `drop()` then frees the
        packed copies too (a rollout copy takes no memory while the trainer updates) and the next use packs
        them again, with a merged adapter where the lean decoder asks for one."""
        if source is not None:
            self._sources = _sources(self.model, source)
        shared = self._shared = self._shared_ptrs()  # `_tied` reads it while the groups are packed
        uses = Counter(m.weight.data_ptr() for m in self.linears)
        maps = _file_mappings()
        freed = 0
        for group in self.groups:  # group by group: the peak is the weights plus one group, not twice them
            if not self._sources:  # else packed from the source's weights when first used
                self._install(group)
            for m in group:
                if m.weight.data_ptr() not in shared and uses[m.weight.data_ptr()] == 1:
                    freed += m.weight.numel() * m.weight.element_size()
                    _drop_file_pages(m.weight, maps)
                    m.weight = nn.Parameter(m.weight.new_empty(0), requires_grad=False)
        if self._sources:
            self._packed.clear()
            self._install()
        self.released = True
        return freed

    def _tied(self, m: nn.Linear) -> bool:
        """Whether `m`, with `tied_head` share, runs on its own weight, which another module owns too (an LM
        head tied to the input embeddings)."""
        if self.tied_head != "share":
            return False
        if self._shared is None:  # once per packing round (`drop` and `regroup` forget it)
            self._shared = self._shared_ptrs()
        return m.weight.data_ptr() in self._shared

    def _shared_ptrs(self) -> set[int]:
        """Where the parameters of the model's modules other than its linears live."""
        return {
            p.data_ptr()
            for m in self.model.modules()
            if type(m) is not nn.Linear
            for p in m.parameters(False)
        }

    def _install(self, *groups: tuple[nn.Linear, ...]) -> None:
        """Each linear's forward on its group's packed weight (a member of a larger group keeps its own
        columns of the group's output; through __dict__: nn.Module.__setattr__ costs ~1 ms per step here).
        All groups by default."""
        for group in groups or self.groups:
            if self._sources:  # packed (again after each `drop`) when first called
                forward = partial(self._repacking_forward, group)
            else:
                forward = partial(_packed_forward, *self._pack(group))
            lo = 0
            for m in group:
                m.__dict__["forward"] = forward(None if len(group) == 1 else (lo, lo + m.out_features))
                lo += m.out_features

    def _pack(self, group: tuple[nn.Linear, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        key = tuple(id(m) for m in group)
        state = (self.tied_head, self.kind, *((m.weight._version, m.weight.data_ptr()) for m in group))
        carriers = [self._carrier(m) for m in group] if self.merged is not None else []
        if any(carriers):  # the merged adapter's weights too
            state += (self.merged, *((p._version, p.data_ptr()) for c in carriers if c for p in c))
        # a released copy's freed weights: its source's (None where the model's own are there)
        sources = [self._sources.get(id(m)) if not m.weight.numel() else None for m in group]
        state += tuple((s.weight._version, s.weight.data_ptr()) for s in sources if s is not None)
        cached = self._packed.get(key)
        if cached is not None and (cached[0] == state or not self.repackable):  # the weights are gone
            return cached[1]
        with torch.no_grad():
            # from a source: summed with a merged adapter in its dtype (fp32 for a bf16 rollout copy) and
            # rounded to this model's dtype once
            plain = [m.weight if s is None else s.weight for m, s in zip(group, sources, strict=True)]
            w = plain[0] if len(group) == 1 else torch.cat(plain)
            if any(carriers):  # W + scaling * B @ A on the carriers' rows, W alone elsewhere
                deltas = [
                    merged_delta(
                        self._routed[id(m)], self.merged, torch.promote_types(w.dtype, c[0].dtype)
                    ).to(w.dtype)
                    if c
                    else w.new_zeros(m.out_features, m.in_features)
                    for m, c in zip(group, carriers, strict=True)
                ]
                w = w + torch.cat(deltas)
            w = w.to(group[0].weight.dtype)
            if len(group) == 1 and not any(carriers) and self._tied(group[0]):
                packed = w.detach()  # a tied head: on the embeddings' own matrix (`_tied`)
            elif self.kind == "native":
                packed = native.kernel().pack(w)
            else:
                packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), self.batch_hint)
            biases = [m.bias for m in group]
            if all(b is None for b in biases):
                bias = None
            else:
                bias = torch.cat([
                    m.bias.detach() if m.bias is not None else m.weight.new_zeros(m.out_features) for m in group
                ])  # fmt: skip
        self._packed[key] = (state, (packed, bias))
        return packed, bias

    def _repacking_forward(self, group: tuple[nn.Linear, ...], columns: tuple[int, int] | None):
        """A released copy's forward of one layer of `group` (its `columns` of the group's output, None =
        all) on the group's packed weight as it is now (`drop` may have freed the one there was)."""
        lo, hi = columns or (None, None)

        def forward(x: torch.Tensor) -> torch.Tensor:
            out = packed_linear(x, *self._pack(group))
            return out if columns is None else out[..., lo:hi].contiguous()

        return forward

    def _carrier(self, m: nn.Linear) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The merged adapter's A and B on the routed layer wrapping `m`, if it carries that adapter."""
        routed = self._routed.get(id(m))
        if routed is None or self.merged not in routed.lora_A:
            return None
        return routed.lora_A[self.merged], routed.lora_B[self.merged]


def _sources(model: nn.Module, source: nn.Module) -> dict[int, nn.Linear]:
    """id(linear of `model`) -> the linear of the same name in `source`, which must have the same shape."""
    theirs = dict(source.named_modules())
    out = {}
    for name, m in model.named_modules():
        if type(m) is not nn.Linear:
            continue
        s = theirs.get(name)
        if type(s) is not nn.Linear or s.weight.shape != m.weight.shape:
            raise ValueError(
                f"the source model has no linear layer {name!r} of shape {tuple(m.weight.shape)}"
            )
        out[id(m)] = s
    return out


_PER_MODEL: weakref.WeakKeyDictionary[nn.Module, PackedLinears] = weakref.WeakKeyDictionary()


def _checked_kind(kind: str) -> str:
    if kind not in PACKED:
        raise ValueError(f"packed kernels must be one of {PACKED}, got {kind!r}")
    return kind


def packed_linear(
    x: torch.Tensor, weight: torch.Tensor | native.PackedWeight, bias: torch.Tensor | None
) -> torch.Tensor:
    """`F.linear` on a packed weight: the native GEMM's, or oneDNN's (its packed format or, for a tied head
    on the embeddings' matrix, a plain weight; `F.linear` where torch has no oneDNN)."""
    if type(weight) is native.PackedWeight:
        return weight.kernel.linear(x, weight, bias)
    if weight.layout == torch.strided and not onednn_built():
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _packed_forward(
    weight: torch.Tensor | native.PackedWeight,
    bias: torch.Tensor | None,
    columns: tuple[int, int] | None = None,
):
    if columns is None:
        return partial(packed_linear, weight=weight, bias=bias)
    lo, hi = columns

    def forward_columns(x: torch.Tensor) -> torch.Tensor:
        # a layer run alone outside the engine's decoder (a released model): the whole group, then its part
        return packed_linear(x, weight, bias)[..., lo:hi].contiguous()

    return forward_columns


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
