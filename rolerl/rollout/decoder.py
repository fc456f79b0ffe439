"""The engine's own forward over Llama-family decoders (Llama, Mistral, Qwen2, Qwen3) on packed weights.

The same modules and weights as Hugging Face's forward, in the same order of operations, without the
layers' plumbing (per-layer keyword passing, mask construction, the attention-interface lookup: 5-15% of a
batch-32 decode step on two AVX2 cores, more at batch 8; docs/BENCHMARKS.md). Per layer, q/k/v run as one GEMM and
gate/up as another (their weights packed side by side, `PackedLinears` groups), and RoPE rotates the query
and key heads together. Routed adapters add their output to their layer's columns of the fused result
(`FusedAdapters`: one pair of small GEMMs per fused group), so per-token routes work as in the HF
forward; an adapter that every token of a rollout uses is merged into the packed weights instead
(`LeanDecoder._merged`), and only tokens routed elsewhere pay for adapters.

Tests check it against HF's forward with the engine's attention, in float64, on the three tiny
families, with routed adapters, prefill, decode and gathered slots; a model it does not cover (another
family, a layer that is not a plain or routed linear) runs HF's forward instead (`lean_support` says why).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from rolerl.models.lora import FusedAdapters, RoutedLoRALinear
from rolerl.rollout.kv import Batch, Layout, attend_layout, attention_shape, decode_step, fused_decode
from rolerl.rollout.native import NativeStep
from rolerl.rollout.packed import PackedLinears, packed_linear

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
# the most rows (tokens) of a forward whose routed adapters go through the native kernel (`_native_step`)
NATIVE_ROWS = 128
# HF's RMSNorm classes of those families (one formula, `LlamaRMSNorm.forward`): the native kernel's
_RMS_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")
_PROJECTIONS = {
    "self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}


def _base(m: nn.Module) -> nn.Linear | None:
    base = m.base_layer if isinstance(m, RoutedLoRALinear) else m
    return base if type(base) is nn.Linear else None


def lean_support(model) -> str | None:
    """None when `LeanDecoder` can run `model`, else the reason it cannot (the engine then runs HF's)."""
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    if kind not in FAMILIES:
        return f"model_type {kind!r} is not one of {FAMILIES}"
    rope = getattr(config, "rope_parameters", None) or {}
    if getattr(config, "partial_rotary_factor", 1.0) != 1.0 or rope.get("partial_rotary_factor", 1.0) != 1.0:
        return "partial rotary embeddings"
    inner = getattr(model, "model", None)
    for name in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if not hasattr(inner, name):
            return f"the decoder has no {name!r}"
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(head) is not nn.Linear:
        return f"the LM head is {type(head).__name__}, not a linear"
    for i, layer in enumerate(inner.layers):
        for part, names in _PROJECTIONS.items():
            for name in names:
                m = getattr(getattr(layer, part, None), name, None)
                if m is None or _base(m) is None:
                    return f"layer {i} {part}.{name} is {type(m).__name__}, not a linear or routed linear"
        if not hasattr(layer.mlp, "act_fn"):
            return f"layer {i} mlp has no act_fn"
    return None


@dataclass
class _Layer:
    index: int
    norm1: nn.Module
    norm2: nn.Module
    q_norm: nn.Module | None  # Qwen3: RMSNorm over each head of q and k before RoPE
    k_norm: nn.Module | None
    act: nn.Module
    scaling: float
    # the routed layers of each GEMM (q/k/v, o, gate/up, down), adding into their columns of its output
    qkv_adapters: FusedAdapters
    o_adapter: FusedAdapters
    gate_up_adapters: FusedAdapters
    down_adapter: FusedAdapters


class LeanDecoder:
    """`decoder(ids, batch) -> hidden (B, T, d)` after the final norm, writing the engine's KV cache, and
    `decoder.head(hidden) -> logits`."""

    def __init__(self, model, batch_hint: int, tied_head: str = "share", kernels: str = "onednn") -> None:
        reason = lean_support(model)
        if reason is not None:
            raise ValueError(f"LeanDecoder cannot run this model: {reason}")
        self.model = model
        self.adapter_kernel = None  # a native kernel for the routed adapters of decode steps (the engine's)
        self.pointwise = None  # a native kernel for the residual adds and RMSNorms (the engine's)
        inner = model.model
        self.embed, self.rotary, self.norm = inner.embed_tokens, inner.rotary_emb, inner.norm
        _, self.q_heads, self.kv_heads, self.head_dim = attention_shape(model.config)
        self._plan()
        self.packed = PackedLinears.of(model, batch_hint, self.groups, tied_head, kernels)
        self.packed.regroup(self.groups)

    def _projections(self) -> tuple[nn.Module, ...]:
        """Every projection module of every layer, in order (they change when adapters are injected)."""
        return tuple(
            getattr(getattr(layer, part), name)
            for layer in self.model.model.layers
            for part, names in _PROJECTIONS.items()
            for name in names
        )

    def _plan(self) -> None:
        self.signature = self._projections()
        self.layers: list[_Layer] = []
        self.groups: list[tuple[nn.Linear, ...]] = []
        for i, layer in enumerate(self.model.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            q, k, v, o = (getattr(attn, n) for n in _PROJECTIONS["self_attn"])
            gate, up, down = (getattr(mlp, n) for n in _PROJECTIONS["mlp"])
            self.groups += [
                (_base(q), _base(k), _base(v)),
                (_base(o),),
                (_base(gate), _base(up)),
                (_base(down),),
            ]
            self.layers.append(
                _Layer(
                    i, layer.input_layernorm, layer.post_attention_layernorm,
                    getattr(attn, "q_norm", None), getattr(attn, "k_norm", None), mlp.act_fn,
                    float(attn.scaling), _adapters(q, k, v), _adapters(o), _adapters(gate, up), _adapters(down),
                )
            )  # fmt: skip
        self.groups.append((self.model.get_output_embeddings(),))
        norms = [m for layer in self.layers for m in (layer.norm1, layer.norm2)] + [self.norm]
        self._native_norms = {id(m) for m in norms if _plain_rms_norm(m)}

    def __call__(self, ids: torch.Tensor, layout: Batch | Layout) -> torch.Tensor:
        """Hidden states after the final norm: `(B, T, d)` for `(B, T)` ids over a `Batch` or a dense
        `Layout`, `(1, N, d)` for a flat layout's `(1, N)` ids (its tokens only: no padding, no dummies)."""
        if isinstance(layout, Batch):
            layout = Layout.of(layout)
        if self._projections() != self.signature:  # adapters injected (or removed) since the last forward
            if lean_support(self.model) is not None:
                raise RuntimeError(f"the engine's model changed: {lean_support(self.model)}")
            self._plan()
            self.packed.regroup(self.groups)
        merged = self._merged()
        weights = self.packed.weights()
        n = len(self.layers)
        self._head = weights[4 * n]
        b, t = ids.shape
        hq, hkv, d = self.q_heads, self.kv_heads, self.head_dim
        x = self.embed(ids)  # (B, T, hidden)
        native = self._native_step(b * t, x.dtype, merged)
        cos, sin = self.rotary(x, layout.positions)  # (B, T, D)
        # HF's rotate_half(x) * sin == x.roll(D/2) * [-sin_lo, sin_hi]: the same products, one op fewer
        half = d // 2
        cos, sin = cos[:, :, None], torch.cat([-sin[..., :half], sin[..., half:]], -1)[:, :, None]

        def rope(h: torch.Tensor) -> torch.Tensor:  # (B, T, heads, D)
            return h * cos + h.roll(half, -1) * sin

        # a decode step on the native attention: RoPE, the cache writes and attention in one call per layer
        fused = self.layers[0].q_norm is None and fused_decode(layout.dense, x.dtype, d, hq // hkv)
        if fused:
            cos_rows, sin_rows = cos.reshape(b, d), sin.reshape(b, d)

        add_norm = self._add_norm
        out = None  # the last sublayer's output, added to the residual stream by the next norm's call
        for layer in self.layers:
            qkv_w, o_w, gu_w, down_w = weights[4 * layer.index : 4 * layer.index + 4]
            x, h = add_norm(layer.norm1, x, out)
            qkv = layer.qkv_adapters.add_(h, packed_linear(h, *qkv_w), merged, native)
            qkv = qkv.view(b, t, hq + 2 * hkv, d)
            if fused:
                h = decode_step(layout.dense, layer.index, qkv, cos_rows, sin_rows, layer.scaling)
            else:
                if layer.q_norm is not None:
                    q, k = rope(layer.q_norm(qkv[:, :, :hq])), rope(layer.k_norm(qkv[:, :, hq : hq + hkv]))
                else:
                    qk = rope(qkv[:, :, : hq + hkv])
                    q, k = qk[:, :, :hq], qk[:, :, hq:]
                v = qkv[:, :, hq + hkv :]
                h = attend_layout(layout, layer.index, q, k, v, layer.scaling)  # (B, T, H D)
            out = layer.o_adapter.add_(h, packed_linear(h, *o_w), merged, native)
            x, h = add_norm(layer.norm2, x, out)
            gu = layer.gate_up_adapters.add_(h, packed_linear(h, *gu_w), merged, native)  # (B, T, 2 I)
            inner = gu.shape[-1] // 2
            h = layer.act(gu[..., :inner]).mul_(gu[..., inner:])
            out = layer.down_adapter.add_(h, packed_linear(h, *down_w), merged, native)
        return add_norm(self.norm, x, out)[1]

    def _add_norm(
        self, norm: nn.Module, x: torch.Tensor, out: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """HF's residual add `x + out` (none before the first layer) and `norm` of the sum: `(sum, normed)`, in
        one call of the native kernel (`pointwise`) where `norm` is HF's RMSNorm in the stream's dtype."""
        if self.pointwise is not None and id(norm) in self._native_norms and norm.weight.dtype == x.dtype:
            return self.pointwise.rms_norm(x, norm.weight, norm.variance_epsilon, out)
        if out is not None:
            x = x + out  # HF: residual + output
        return x, norm(x)

    def _merged(self) -> int | None:
        """The index of the adapter merged into the packed weights (None: the plain base weights). The first
        forward after the packed copy was (re)built whose tokens all use one adapter merges that one into
        it: a rollout of one policy adapter then runs no adapter GEMMs at all (~20% of a batch-16 decode
        step with a rank-16 adapter on every linear, docs/BENCHMARKS.md). It stays until the copy is dropped
        (`Engine.sleep`) or regrouped; other routes subtract it (`FusedAdapters`)."""
        packed, state = self.packed, getattr(self.model, "_rolerl_route_state", None)
        if state is None:
            return None
        if packed.merged is None and packed.repackable and state.uniform():
            name = state.names[state.used()[0]]
            if state.adapters[name].dropout == 0:
                packed.merge_adapter(name)
        return state.names.index(packed.merged) if packed.merged in state.adapters else None

    def _native_step(self, rows: int, dtype: torch.dtype, merged: int | None) -> NativeStep | None:
        """This forward's routed adapters in the native kernel (`adapter_kernel`), for a decode step's rows
        (at most `NATIVE_ROWS`: a prefill's many tokens go through torch's GEMMs, which read each adapter
        matrix once for all of them); None where it does not apply."""
        kernel, state = self.adapter_kernel, getattr(self.model, "_rolerl_route_state", None)
        if kernel is None or state is None or not state.adapters or not 0 < rows <= NATIVE_ROWS:
            return None
        if dtype not in (torch.float32, torch.bfloat16):
            return None
        if isinstance(state.route, torch.Tensor) and state.route.numel() != rows:
            return None  # torch's path raises the error that names the shapes
        return kernel.step(rows, state.terms(rows, merged), dtype)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head on the packed weight of the last forward."""
        return packed_linear(hidden, *self._head)

    def sleep(self) -> None:
        """Let go of the last forward's head weight, so that `PackedLinears.drop` frees it too, and of the
        adapters' copies (the native kernel's fp32 tables, torch's stacked matrices), rebuilt at the next
        rollout as they would be anyway after the trainer's update."""
        self._head = None
        for layer in self.layers:
            for group in (layer.qkv_adapters, layer.o_adapter, layer.gate_up_adapters, layer.down_adapter):
                group.release()


def _plain_rms_norm(m: nn.Module) -> bool:
    """Whether `m` computes HF's RMSNorm as written (`norm.c` does the same): one of the families' classes,
    its forward transformers' own (not replaced on the class or the instance), a 1-D weight, a float eps."""
    forward = getattr(type(m), "forward", None)
    return (
        type(m).__name__ in _RMS_NORMS
        and getattr(forward, "__module__", "").startswith("transformers.models.")
        and "forward" not in m.__dict__
        and isinstance(getattr(m, "variance_epsilon", None), float)
        and isinstance(getattr(m, "weight", None), torch.Tensor)
        and m.weight.dim() == 1
    )


def _adapters(*modules: nn.Module) -> FusedAdapters:
    """The routed layers among `modules` (one fused GEMM's members, in column order) and their columns."""
    out, lo = [], 0
    for m in modules:
        hi = lo + _base(m).out_features
        if isinstance(m, RoutedLoRALinear):
            out.append((m, lo, hi))
        lo = hi
    return FusedAdapters(out, lo)
