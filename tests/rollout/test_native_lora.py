"""The native routed-adapter kernel (`lora.c`, `NativeKernel.lora_add`): each row's adapters added into a fused
group's output equal a float64 reference, for fp32 and bf16, input widths and ranks that are and are not
multiples of the vector width, groups whose layers carry different adapters, rows that add nothing, add
their own adapter, or take a merged one out; the same bits whatever the row order and thread count; a
table or term that points outside the tables is an error, never a read out of bounds. `RouteState.terms`
gives the terms derived by hand; the engine with the kernel gives torch's log-probs and falls back (or
refuses, for `native`) where it does not apply."""

from __future__ import annotations

import logging

import pytest
import torch

import rolerl
from rolerl.models.lora import RouteState
from rolerl.rollout import native
from rolerl.rollout.engine import Engine, GenerationRequest
from rolerl.rollout.packed import onednn_supported
from rolerl.rollout.sampling import SamplingParams
from tests.models.test_lora import randomize_adapters
from tests.rollout.test_engine import PROMPTS, prompt_ids, scripted_sampler

KERNEL = native.kernel()
pytestmark = pytest.mark.skipif(KERNEL is None, reason="no C compiler: the engine keeps torch's GEMMs")


def group(g, in_features, widths, carried, ranks):
    """A fused group's layers: `(lo, hi, {slot: (A (r, in), B (out, r))})`, layer i carrying `carried[i]`."""
    layers, lo = [], 0
    for width, slots in zip(widths, carried, strict=True):
        mats = {
            s: (
                torch.randn(ranks[s], in_features, generator=g),
                torch.randn(width, ranks[s], generator=g) / 4,
            )
            for s in slots
        }
        layers.append((lo, lo + width, mats))
        lo += width
    return layers, lo


def reference(x, y, layers, terms, factors):
    """Row by row in float64, and the same sums over absolute values (the rounding error's scale)."""
    out, scale = y.double().clone(), y.double().abs()
    for n in range(x.shape[0]):
        xn = x[n].double()
        for t in range(2):
            s, f = int(terms[n, t]), float(factors[n, t])
            for lo, hi, mats in layers:
                if s >= 0 and s in mats:
                    a, b = (m.double() for m in mats[s])
                    out[n, lo:hi] += f * (b @ (a @ xn))
                    scale[n, lo:hi] += abs(f) * (b.abs() @ (a.abs() @ xn.abs()))
    return out, scale


def check(got, want, scale, dtype, length):
    """fp32 sums of `length` products: within (length + 2) fp32 eps of the sum of absolute values; a bf16
    output also rounds to bf16 once per term (two at most)."""
    bound = (length + 2) * torch.finfo(torch.float32).eps * scale
    if dtype == torch.bfloat16:
        bound = bound + 2 * torch.finfo(torch.bfloat16).eps * scale
    err = (got.double() - want).abs()
    assert bool((err <= bound).all()), f"max error {float(err.max())} over bound {float(bound.min())}"


CASES = [  # in_features, layer widths, slots carried per layer, ranks per slot
    (64, [64, 32, 32], [{0, 1}, {0, 1}, {0, 1}], {0: 8, 1: 8}),  # q/k/v, two adapters everywhere
    (40, [100], [{0, 2}], {0: 3, 2: 17}),  # widths and ranks off the vector width, slot 1 nowhere
    (200, [48, 33], [{1}, {0, 1}], {0: 1, 1: 5}),  # layers carrying different adapters
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("rows", [1, 6, 37])
def test_lora_add_equals_the_reference(dtype, case, rows):
    in_features, widths, carried, ranks = case
    g = torch.Generator().manual_seed(rows)
    layers, width = group(g, in_features, widths, carried, ranks)
    n_slots = 3
    tables = KERNEL.tables(layers, n_slots, in_features, width)
    x = torch.randn(rows, in_features, generator=g).to(dtype)
    y = torch.randn(rows, width, generator=g).to(dtype)
    own = torch.randint(-1, n_slots, (rows,), generator=g)
    merged = torch.randint(-1, n_slots, (rows,), generator=g)  # per row here, to cover every pairing
    terms = torch.stack([own, merged], 1)
    factors = torch.stack([torch.rand(rows, generator=g) * 4, -torch.rand(rows, generator=g)], 1)
    factors = torch.where(terms >= 0, factors, 0.0)
    got = KERNEL.lora_add(x, y.clone(), tables, terms, factors)
    want, scale = reference(x, y, layers, terms, factors)
    check(got, want, scale, dtype, in_features + max(ranks.values()))
    assert torch.equal(got[(terms < 0).all(1)], y[(terms < 0).all(1)]), "a row with no terms is untouched"


def test_row_order_and_threads_do_not_change_a_bit():
    """Rows go through in groups of up to four with equal terms; each row's sums are its own, so any order
    of the rows and any thread count give the same bits."""
    g = torch.Generator().manual_seed(0)
    layers, width = group(g, 64, [64, 32, 32], [{0, 1}] * 3, {0: 8, 1: 8})
    tables = KERNEL.tables(layers, 2, 64, width)
    x, y = torch.randn(33, 64, generator=g), torch.randn(33, width, generator=g)
    terms = torch.stack([torch.arange(33) % 3 - 1, torch.full((33,), -1)], 1)
    factors = torch.where(terms >= 0, 2.0, 0.0)
    grouped = KERNEL.lora_add(x, y.clone(), tables, terms, factors)
    assert not torch.equal(grouped, y)
    reverse = KERNEL.lora_add(x, y.clone(), tables, terms, factors, torch.arange(32, -1, -1))
    assert torch.equal(grouped, reverse)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            assert torch.equal(KERNEL.lora_add(x, y.clone(), tables, terms, factors), grouped)
    finally:
        torch.set_num_threads(threads)


def test_bad_inputs_are_errors_and_never_read_out_of_bounds():
    g = torch.Generator().manual_seed(0)
    layers, width = group(g, 32, [16, 16], [{0}, {0}], {0: 4})
    tables = KERNEL.tables(layers, 1, 32, width)
    x, y = torch.randn(4, 32, generator=g), torch.randn(4, width, generator=g)
    terms, factors = torch.zeros(4, 2, dtype=torch.int64), torch.ones(4, 2)
    terms[:, 1] = -1
    with pytest.raises(ValueError, match="slots"):
        KERNEL.lora_add(x, y.clone(), tables, terms + 1, factors)  # slot 1 is not in the tables
    with pytest.raises(ValueError, match="permutation"):
        KERNEL.lora_add(x, y.clone(), tables, terms, factors, torch.tensor([0, 0, 1, 2]))
    with pytest.raises(ValueError, match=r"\(\.\.\., 32\)"):
        KERNEL.lora_add(torch.randn(4, 31), y.clone(), tables, terms, factors)
    with pytest.raises(TypeError, match="int64"):
        KERNEL.lora_add(x, y.clone(), tables, terms.int(), factors)
    with pytest.raises(ValueError, match="LoRATables"):
        KERNEL.tables([(0, 16, {0: (torch.randn(4, 32), torch.randn(15, 4))})], 1, 32, 16)
    for field, value in ((0, 10**9), (1, 10**6), (3, 5)):  # A past the table, R past it, blocks past them
        broken = KERNEL.tables(layers, 1, 32, width)
        broken.slots[0, field] = value
        with pytest.raises(RuntimeError, match="outside the tables"):
            KERNEL.lora_add(x, y.clone(), broken, terms, factors)
    broken = KERNEL.tables(layers, 1, 32, width)
    broken.blocks[1, 1] = width + 1  # a block's columns past the row
    with pytest.raises(RuntimeError, match="outside the tables"):
        KERNEL.lora_add(x, y.clone(), broken, terms, factors)


def test_route_state_terms_are_the_hand_derived_ones():
    """Adapters a (scaling 2), b (scaling 0.5): rows routed to a, b and the base. Without a merged adapter a
    row adds its own; with a merged into the base weights its own rows add nothing, the others take a out."""
    specs = {n: rolerl.models.lora.AdapterSpec(n, rank=4, alpha=alpha) for n, alpha in (("a", 8), ("b", 2))}
    state = RouteState(specs)
    state.set(torch.tensor([[0], [1], [-1]]))
    terms, factors, order = state.terms(3)
    assert terms.tolist() == [[0, -1], [1, -1], [-1, -1]]
    assert factors.tolist() == [[2.0, 0.0], [0.5, 0.0], [0.0, 0.0]]
    assert sorted(order.tolist()) == [0, 1, 2]
    terms, factors, order = state.terms(3, merged=0)
    assert terms.tolist() == [[-1, -1], [1, 0], [-1, 0]]
    assert factors.tolist() == [[0.0, 0.0], [0.5, -2.0], [0.0, -2.0]]
    assert order.tolist() == [0, 2, 1]  # rows with equal terms next to each other
    state.set(0)  # every token on a
    assert state.terms(5, merged=0) is None  # nothing to add: the merged weights are a
    assert state.terms(2)[0].tolist() == [[0, -1], [0, -1]]


needs_lean = pytest.mark.skipif(
    not onednn_supported(torch.device("cpu"), torch.float32), reason="torch built without oneDNN"
)


@needs_lean
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engine_with_the_adapter_kernel_gives_torchs_logprobs(tokenizer, dtype, monkeypatch):
    """Scripted tokens through engines whose routed adapters run in torch's GEMMs and in the kernel: rows on
    adapter a, adapter b and the base in one batch, log-probs within rounding (fp32: a few ulps through two
    layers; bf16: the kernel keeps the adapters in fp32 where torch's path rounds them to bf16), the
    kernel ran at every decode step, and its tables freed by `sleep` come back the same."""
    if dtype == torch.bfloat16 and not onednn_supported(torch.device("cpu"), dtype):
        pytest.skip("no native bf16 on this CPU")
    calls = []
    original = native.NativeStep.add_
    monkeypatch.setattr(native.NativeStep, "add_", lambda self, *a: calls.append(1) or original(self, *a))
    model, tok = rolerl.tiny_model("qwen3", dtype=dtype, tokenizer=tokenizer)
    rolerl.add_adapters(model, ["a", "b"], rank={"a": 4, "b": 8})
    randomize_adapters(model, std=0.2)
    g = torch.Generator().manual_seed(0)
    scripts = {s: torch.randint(0, 1000, (12,), generator=g).tolist() for s in range(len(PROMPTS))}
    kinds = ("prompt", "reasoning", "tool_call", "tool_output", "answer")
    reqs = [
        GenerationRequest(
            prompt_ids(tok, p),
            SamplingParams(seed=s, max_new_tokens=12, ignore_eos=True),
            route_of=None if s % 3 == 2 else dict.fromkeys(kinds, s % 3),
        )
        for s, p in enumerate(PROMPTS)
    ]
    logprobs = {}
    for kernel in ("torch", "native"):
        engine = Engine(model, tok, max_batch=4, adapter_kernel=kernel, sampler=scripted_sampler(scripts))
        assert (engine.adapter_kernel is None) == (kernel == "torch")
        logprobs[kernel] = [t.logprobs for t in engine.generate(reqs)]
    steps = 11 * model.config.num_hidden_layers * 4  # decode steps x layers x fused groups
    assert len(calls) >= steps
    engine.sleep()  # between rollouts the kernel's fp32 copies of the adapters are freed, then rebuilt
    groups = [g for layer in engine.lean.layers for g in (layer.qkv_adapters, layer.gate_up_adapters)]
    assert all(g._tables is None for g in groups)
    assert [t.logprobs for t in engine.generate(reqs)] == logprobs["native"]
    limit = 1e-4 if dtype == torch.float32 else 0.25
    for a, b in zip(logprobs["torch"], logprobs["native"], strict=True):
        assert len(a) == len(b) == 12
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < limit


@needs_lean
def test_where_the_kernel_does_not_apply_auto_keeps_torch_and_native_says_why(tiny, caplog):
    model, tok = tiny
    with caplog.at_level(logging.INFO, logger="rolerl.rollout.engine"):
        engine = Engine(model, tok, max_batch=2, kernels="torch")
    assert engine.adapter_kernel is None and "engine's own decoder" in caplog.text
    with pytest.raises(ValueError, match="adapter_kernel 'native' runs on the engine's own decoder"):
        Engine(model, tok, max_batch=2, kernels="torch", adapter_kernel="native")
    with pytest.raises(ValueError, match="adapter_kernel must be one of"):
        Engine(model, tok, max_batch=2, adapter_kernel="fast")


def test_adapters_with_dropout_keep_torchs_path(tiny, monkeypatch):
    """An adapter with dropout (each adapter its own dropout of x, as in PEFT) is not the kernel's: a group
    carrying one adds through torch's path, the same numbers as without a step, on every call."""
    from rolerl.models.lora import routes as routes_ctx
    from rolerl.rollout.decoder import _adapters

    model, _ = tiny
    rolerl.add_adapters(model, ["a", "b"], rank=4, dropout=0.1)
    randomize_adapters(model, std=0.2)
    model.eval()  # dropout off: the two paths are then comparable
    calls = []
    monkeypatch.setattr(native.NativeStep, "add_", lambda self, *a: calls.append(1))
    attn = model.model.layers[0].self_attn
    fused = _adapters(attn.q_proj, attn.k_proj, attn.v_proj)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 1, attn.q_proj.in_features, generator=g)
    base = torch.randn(4, 1, fused.width, generator=g)
    route = torch.tensor([[0], [1], [-1], [0]])
    with torch.inference_mode(), routes_ctx(model, route):
        state = attn.q_proj.state
        step = KERNEL.step(4, state.terms(4), torch.float32)
        want = fused.add_(x, base.clone())
        for _ in range(2):
            assert torch.equal(fused.add_(x, base.clone(), None, step), want)
    assert not calls and not torch.equal(want, base)
