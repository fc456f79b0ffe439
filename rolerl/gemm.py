"""Products with a frozen fp32 weight on CPU, through oneDNN instead of torch's BLAS (MKL).

The trainer's largest GEMMs multiply by weights that never change: the input gradient `dy W` of every base
layer under the adapters, and the LM head's logits `h E^T` and softmax-weighted rows `p E`. torch runs fp32
`mm` on CPU through MKL, which ran at its AVX2 speed on an AMD CPU with AVX-512 (the same with MKL held to
AVX2): on that 2-core EPYC (Zen 5), oneDNN ran the default model's layer shapes at ~2x MKL's GFLOP/s and
the head's at 1.7-2.8x; held to AVX2, at 1.0-1.5x. On an Intel Xeon with AMX, MKL's AVX-512 code was as
fast or faster (oneDNN at 0.77-1.04x). So `auto` takes oneDNN on AMD CPUs only
(`rolerl.hardware.fp32_gemm_choice`); `benchmarks/train_gemm.py` measures a CPU, figures in
docs/BENCHMARKS.md ("fp32 training GEMMs through oneDNN"). Either way the results are fp32 products,
rounded in another order. The layers' forward `x W^T` stays torch's (`rolerl.models.lora`): it is the op
of the forward without grad and of the plain model, and values must not depend on whether autograd is
recording.

`linear` and `matmul` take oneDNN's path only where it is a plain fp32 product on CPU outside autograd (in
a custom autograd node's forward or backward, or without grad): fp32 operands, no autocast, no operand
autograd would differentiate through (oneDNN's op has no derivative), oneDNN built in and enabled
(`torch.backends.mkldnn`). Everything else, and everything under `set_backend("torch")`, is torch's own op.
The backend is one setting per process, as torch's backend flags are (`train.kernels`, which
`rolerl.run.policy.build_policy` applies).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from rolerl.hardware import fp32_gemm_choice

BACKENDS = ("auto", "onednn", "torch")
_backend = "auto"


@functools.cache
def onednn_built() -> bool:
    """Whether this torch has oneDNN's linear op."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@functools.cache
def auto_onednn() -> bool:
    """Whether `auto` means oneDNN on this machine (`rolerl.hardware.fp32_gemm_choice`)."""
    return onednn_built() and fp32_gemm_choice("cpu")[0] == "onednn"


def set_backend(name: str) -> str:
    """Use `name` for every later product (`onednn`: oneDNN where it applies; `auto`: the same on CPUs where
    `auto_onednn()`, else `torch`); returns the previous setting."""
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"GEMM backend must be one of {BACKENDS}, got {name!r}")
    previous, _backend = _backend, name
    return previous


def backend() -> str:
    return _backend


def uses_onednn(x: Tensor, weight: Tensor) -> bool:
    """Whether `linear(x, weight)` / `matmul(x, weight)` run on oneDNN."""
    return (
        (_backend == "onednn" or (_backend == "auto" and auto_onednn()))
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and x.device.type == "cpu"
        and weight.device.type == "cpu"
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        and not torch.is_autocast_enabled("cpu")
        and onednn_built()
        and torch.backends.mkldnn.enabled
    )


def linear(x: Tensor, weight: Tensor) -> Tensor:
    """`x @ weight.T` for `x` `(..., in)` and `weight` `(out, in)`: the head's logits."""
    if uses_onednn(x, weight):
        return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
    return x @ weight.T


def matmul(x: Tensor, weight: Tensor) -> Tensor:
    """`x @ weight` for `x` `(N, out)` and `weight` `(out, in)`: a linear layer's input gradient `dy W`, or
    the head's rows averaged under a softmax. oneDNN reads the transposed view in place (no copy)."""
    if uses_onednn(x, weight):
        return torch.ops.mkldnn._linear_pointwise(x, weight.t(), None, "none", [], "")
    return x @ weight
