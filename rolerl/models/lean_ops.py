"""Leaner autograd for the trainer's forward: the MLP of Llama-family decoders keeping half the bytes.

The update's peak memory is the activations autograd keeps for backward. Of the ~38 KB per token and
layer that HF's forward keeps on the default model (fp32, adapters on every linear), 24 KB are the MLP's:
`gate`, `up`, `silu(gate)` and the product `h = silu(gate) * up` (which the down projection's adapter keeps
as its input). Here `silu(gate) * up` is one autograd function keeping `gate` and `up` only, and `h` is
recomputed from them when backward asks for it (saved-tensor hooks around the down projection): 12 KB.
The forward is the same ops in the same order (the same values, bit for bit); gradients differ from
autograd's through HF's ops by fp32 rounding (the SiLU derivative is computed in one expression).

`install(model)` patches the MLPs of a Llama-family model (Llama, Mistral, Qwen2, Qwen3; SiLU) in place
and returns how many it patched; other models are left as they are. Without autograd (the rollout engine,
`torch.no_grad`) the patched forward is HF's.
"""

from __future__ import annotations

import types

import torch
from torch import nn
from torch.nn import functional as F

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


class _SiluMul(torch.autograd.Function):
    """`silu(gate) * up`, saving `gate` and `up` (not `silu(gate)`)."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        sig = torch.sigmoid(gate)
        dgate = dup = None
        if ctx.needs_input_grad[0]:
            # silu'(g) = sig(g) * (1 + g * (1 - sig(g)))
            dgate = grad * up * (sig * (1 + gate * (1 - sig)))
        if ctx.needs_input_grad[1]:
            dup = grad * F.silu(gate)
        return dgate, dup


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return _SiluMul.apply(gate, up)
    return F.silu(gate) * up


def _mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    gate, up = self.gate_proj(x), self.up_proj(x)
    h = silu_mul(gate, up)
    if not h.requires_grad:
        return self.down_proj(h)
    # down_proj's adapters keep their input `h` for backward: keep (gate, up) instead (already kept) and
    # recompute `h` when backward asks for it (the same ops: the same values)
    storage, numel = h.untyped_storage().data_ptr(), h.numel()

    def pack(t: torch.Tensor):
        if t.untyped_storage().data_ptr() == storage and t.numel() == numel and t.dtype == h.dtype:
            return (gate, up, t.shape, t.stride(), t.storage_offset())
        return t

    def unpack(saved):
        if isinstance(saved, torch.Tensor):
            return saved
        g, u, shape, stride, offset = saved
        with torch.no_grad():
            return (F.silu(g) * u).as_strided(shape, stride, offset)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        return self.down_proj(h)


def install(model: nn.Module) -> int:
    """Patch the SiLU MLPs of a Llama-family `model` (see the module docstring); returns the number of
    modules patched (0 for a model of another family or activation, or one already patched)."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in FAMILIES or getattr(config, "hidden_act", None) != "silu":
        return 0
    patched = 0
    for module in model.modules():
        if (
            type(module).__name__.endswith("MLP")
            and all(hasattr(module, n) for n in ("gate_proj", "up_proj", "down_proj"))
            and "forward" not in module.__dict__
        ):
            module.forward = types.MethodType(_mlp_forward, module)
            patched += 1
    return patched
