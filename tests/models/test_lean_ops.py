"""The trainer's lean MLP (`rolerl.models.lean_ops`): the same forward as HF's bit for bit, gradients equal to
float64 and to autograd's through HF's ops within fp32 rounding, a third fewer bytes kept for backward,
bf16 autocast unchanged, other families left alone."""

from __future__ import annotations

import copy

import torch
from torch.nn import functional as F

import rolerl
from rolerl.models import lean_ops
from rolerl.models.lora import routes as routes_ctx
from tests.models.test_lora import randomize_adapters
from tests.tolerance import assert_close_ulps


def test_silu_mul_forward_is_hf_and_gradients_match_float64():
    g = torch.Generator().manual_seed(1)
    gate, up = (torch.randn(4, 7, 32, generator=g) * 4).requires_grad_(), torch.randn(4, 7, 32, generator=g)
    up.requires_grad_()
    out = lean_ops.silu_mul(gate, up)
    assert torch.equal(out, F.silu(gate) * up)
    probe = torch.randn(out.shape, generator=g)
    (out * probe).sum().backward()
    g64, u64 = gate.detach().double().requires_grad_(), up.detach().double().requires_grad_()
    (F.silu(g64) * u64 * probe.double()).sum().backward()
    assert_close_ulps(gate.grad.double(), g64.grad, 16, torch.float32)
    assert_close_ulps(up.grad.double(), u64.grad, 16, torch.float32)


def kept_down_inputs(model, ids) -> int:
    """How many tensors the autograd graph of a forward keeps that are the down projections' inputs
    (`h = silu(gate) * up`): found by walking the graph's saved tensors (a recomputed one is new memory)."""
    inputs = []
    hooks = [
        layer.mlp.down_proj.register_forward_pre_hook(lambda _m, args: inputs.append(args[0]))
        for layer in model.model.layers
    ]
    with routes_ctx(model, 0):
        out = model(input_ids=ids).logits
    for h in hooks:
        h.remove()
    ptrs = {h.untyped_storage().data_ptr() for h in inputs}
    found, seen, stack = 0, set(), [out.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for name in dir(node):
            # C++ nodes expose `_saved_<name>`; a custom Function's (`rolerl.models.lora._LoRALinear`)
            # `saved_tensors`, unpacked through the saved-tensor hooks as its backward would see them
            if name.startswith("_saved_") or name == "saved_tensors":
                values = getattr(node, name)
                for value in values if isinstance(values, tuple) else (values,):
                    if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() in ptrs:
                        found += 1
        stack += [n for n, _ in node.next_functions]
    return found


def test_patched_model_gives_the_same_loss_close_gradients_and_saves_less(tiny):
    model, tok = tiny
    rolerl.add_adapters(model, ["a"], rank=4, target_modules="all-linear")
    randomize_adapters(model, std=0.1)
    plain = copy.deepcopy(model)
    n = lean_ops.install(model)
    layers = model.config.num_hidden_layers
    assert n == layers
    assert lean_ops.install(model) == 0  # once
    ids = torch.tensor([tok.encode("The capital of France is Paris, and", add_special_tokens=False)] * 2)
    losses = []
    for m in (model, plain):
        with routes_ctx(m, 0):
            logits = m(input_ids=ids).logits
        loss = torch.log_softmax(logits, -1)[:, :-1].gather(-1, ids[:, 1:, None]).mean()
        loss.backward()
        losses.append(loss)
    assert torch.equal(losses[0], losses[1])  # forward: the same ops
    grads = dict(model.named_parameters())
    for name, p in plain.named_parameters():
        if p.grad is not None:
            # the SiLU derivative in one expression instead of autograd's chain, through two layers
            assert_close_ulps(grads[name].grad, p.grad, 512, torch.float32, msg=name)
    # the plain model's down projection adapters keep their input; the patched ones recompute it
    assert kept_down_inputs(plain, ids) >= model.config.num_hidden_layers
    assert kept_down_inputs(model, ids) == 0


def test_other_families_are_left_alone():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    assert lean_ops.install(model) == 0


def test_bf16_autocast_forward_unchanged(tiny):
    model, tok = tiny
    rolerl.add_adapters(model, ["a"], rank=4)
    plain = copy.deepcopy(model)
    lean_ops.install(model)
    ids = torch.tensor([tok.encode("Hello there", add_special_tokens=False)])
    with torch.autocast("cpu", dtype=torch.bfloat16), routes_ctx(model, 0), routes_ctx(plain, 0):
        assert torch.equal(model(input_ids=ids).logits, plain(input_ids=ids).logits)
