"""The engine's lean decoder (`rolerl.rollout.decoder`) computes what Hugging Face's forward computes: logits
and cached keys/values against HF's forward in float64 on the three tiny families, with routed adapters
and mixed per-token routes, through prefill, decode and gathered slots, dense and flat (decode rows, tool
output spliced in and dummies in one forward of real tokens only); adapters injected after the
engine was built are used; a model it does not cover runs HF's forward; a released model still runs its
own forward on the fused packed weights. The float64 comparisons run with the routed adapters in torch's
GEMMs and in the native kernel (`lora.c`, where a C compiler is there), which must then have run."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import rolerl
from rolerl.models.lora import routes as routes_ctx
from rolerl.rollout import native
from rolerl.rollout.decoder import LeanDecoder, _adapters, lean_support
from rolerl.rollout.engine import Engine
from rolerl.rollout.kv import KVCache, engine_forward, make_batch, make_layout
from rolerl.rollout.packed import onednn_supported
from tests.models.test_lora import randomize_adapters
from tests.rollout.test_packed import requests, with_adapters
from tests.tolerance import assert_close_ulps

pytestmark = pytest.mark.skipif(
    not onednn_supported(torch.device("cpu"), torch.float32), reason="torch built without oneDNN"
)

# (slots, cached lengths, new tokens per row): a ragged prefill, a decode step over slots 0..2 (read as a
# view of the cache), a gathered extend of two rows in another order (tool output spliced), a decode step
STEPS = [
    ([0, 1, 2], [0, 0, 0], [5, 3, 4]),
    ([0, 1, 2], [5, 3, 4], [1, 1, 1]),
    ([2, 0], [5, 6], [3, 2]),
    ([0, 1, 2], [8, 4, 8], [1, 1, 1]),
]


def hf_logits(model, cache, ids, routes, batch):
    with torch.inference_mode(), engine_forward(model, batch), routes_ctx(model, routes):
        hidden = model.get_decoder()(input_ids=ids, position_ids=batch.positions, use_cache=False)
        return model.get_output_embeddings()(hidden.last_hidden_state)


def lean_logits(decoder, ids, routes, batch):
    with torch.inference_mode(), routes_ctx(decoder.model, routes):
        return decoder.head(decoder(ids, batch))


def assert_step_equals_hf(decoder, reference, caches, ids, routes, slots, lens, n_new):
    """One forward of the lean decoder (fp32) against HF's (float64) on the same cache slots: the logits of
    every fed position within 256 fp32 ulps of the largest (two layers of width 64 give a few dozen; the rest
    is room for other CPUs' kernels: a wrong route, head or position is off by far more)."""
    width = ids.shape[1]
    got = lean_logits(decoder, ids, routes, make_batch(caches[torch.float32], slots, lens, width, n_new))
    want = hf_logits(reference, caches[torch.float64], ids, routes,
                     make_batch(caches[torch.float64], slots, lens, width, n_new))  # fmt: skip
    for b, n in enumerate(n_new):
        assert_close_ulps(got[b, :n].double(), want[b, :n], 256, torch.float32)


@pytest.fixture(
    params=[
        "torch",
        pytest.param("native", marks=pytest.mark.skipif(native.kernel() is None, reason="no C compiler")),
    ]
)
def adapter_kernel(request, monkeypatch):
    """The lean decoder's routed adapters in torch's GEMMs (None) or in the native kernel, whose calls are
    then counted: `(kernel, calls)`."""
    calls = []
    if request.param == "torch":
        return None, calls
    original = native.NativeStep.add_
    monkeypatch.setattr(native.NativeStep, "add_", lambda self, *a: calls.append(1) or original(self, *a))
    return native.kernel(), calls


def against_float64(tiny, capacity: int, adapter_kernel=(None, [])):
    """The tiny model with two routed adapters, its float64 copy, a lean decoder over it (its routed adapters
    in `adapter_kernel`'s kernel), and a 4-slot cache per dtype."""
    model, _ = tiny
    with_adapters(model)
    caches = {d: KVCache(model.config, 4, capacity, d, "cpu") for d in (torch.float32, torch.float64)}
    decoder = LeanDecoder(model, batch_hint=4)
    decoder.adapter_kernel = adapter_kernel[0]
    return model, copy.deepcopy(model).double(), decoder, caches


def kernel_ran(adapter_kernel) -> bool:
    """Whether the native kernel, where the test asked for it, added the adapters (every forward here is
    small enough for it)."""
    kernel, calls = adapter_kernel
    return kernel is None or len(calls) > 0


def test_lean_decoder_equals_hf_forward_in_float64(tiny, adapter_kernel):
    model, reference, decoder, caches = against_float64(tiny, 32, adapter_kernel)
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    for slots, lens, n_new in STEPS:
        width = max(n_new)
        ids = torch.randint(0, vocab, (len(slots), width), generator=g)
        routes = torch.randint(-1, 2, (len(slots), width), generator=g)  # base, adapter a or b per token
        assert_step_equals_hf(decoder, reference, caches, ids, routes, slots, lens, n_new)
    for layer in range(model.config.num_hidden_layers):
        for k32, k64 in ((caches[torch.float32].k[layer], caches[torch.float64].k[layer]),
                         (caches[torch.float32].v[layer], caches[torch.float64].v[layer])):  # fmt: skip
            for slot, length in enumerate([9, 5, 9]):
                assert_close_ulps(k32[slot, :, :length].double(), k64[slot, :, :length], 256, torch.float32)
    assert kernel_ran(adapter_kernel)


# flat forwards: a ragged prefill (one extend segment), decode rows with a dummy (a row waiting on its tool)
# and tool output spliced in (slots 0..3: a decode segment read as a view, the extend row riding along in
# it as a dummy), a gathered forward of a one-token row and a longer one, a dense decode step
FLAT_STEPS = [
    ([0, 1, 2, 3], [0, 0, 0, 0], [5, 3, 4, 2]),
    ([0, 1, 2, 3], [5, 3, 4, 2], [1, 0, 3, 1]),
    ([2, 0], [7, 6], [1, 2]),
    ([0, 1, 2, 3], [8, 3, 8, 3], [1, 1, 1, 1]),
]


def flat_logits(decoder, ids, routes, cache, slots, lens, n_new):
    """The lean decoder's logits `(B, T, V)` at each row's fed positions, from one forward over the
    `make_layout` layout of the step (the rows' real tokens only, in the layout's order)."""
    layout, order = make_layout(cache, slots, lens, n_new)
    if layout.dense is not None:
        return lean_logits(decoder, ids, routes, layout)
    fed = sorted((order[b], b) for b, n in enumerate(n_new) if n)
    flat_ids = torch.cat([ids[b, : n_new[b]] for _, b in fed])[None]  # (1, N)
    flat_routes = torch.cat([routes[b, : n_new[b]] for _, b in fed])[None]
    logits = lean_logits(decoder, flat_ids, flat_routes, layout)[0]  # (N, V)
    out = logits.new_zeros((*ids.shape, logits.shape[-1]))
    for b, n in enumerate(n_new):
        out[b, :n] = logits[order[b] : order[b] + n]
    return out


def test_flat_layouts_equal_hf_forward_in_float64(tiny, adapter_kernel):
    """Rows feeding different numbers of tokens in one forward of real tokens only (no padding, no dummy
    positions in the linear layers) give HF's padded forward's logits and cached keys/values (float64)."""
    model, reference, decoder, caches = against_float64(tiny, 32, adapter_kernel)
    g = torch.Generator().manual_seed(2)
    vocab = model.config.vocab_size
    for slots, lens, n_new in FLAT_STEPS:
        width = max(n_new)
        layout, _ = make_layout(caches[torch.float32], slots, lens, n_new)
        assert (layout.dense is not None) == (min(n_new) == width)
        if n_new == [1, 0, 3, 1]:
            decode, extend = layout.segments
            assert decode.batch.contiguous and decode.batch.positions.shape == (4, 1)
            assert extend.batch.slots.tolist() == [2] and len(layout.positions[0]) == 5  # real tokens only
        ids = torch.randint(0, vocab, (len(slots), width), generator=g)
        routes = torch.randint(-1, 2, (len(slots), width), generator=g)
        got = flat_logits(decoder, ids, routes, caches[torch.float32], slots, lens, n_new)
        want = hf_logits(reference, caches[torch.float64], ids, routes,
                         make_batch(caches[torch.float64], slots, lens, width, n_new))  # fmt: skip
        for b, n in enumerate(n_new):
            assert_close_ulps(got[b, :n].double(), want[b, :n], 256, torch.float32)
    for layer in range(model.config.num_hidden_layers):
        for k32, k64 in ((caches[torch.float32].k[layer], caches[torch.float64].k[layer]),
                         (caches[torch.float32].v[layer], caches[torch.float64].v[layer])):  # fmt: skip
            for slot, length in enumerate([9, 4, 9, 4]):
                assert_close_ulps(k32[slot, :, :length].double(), k64[slot, :, :length], 256, torch.float32)
    assert kernel_ran(adapter_kernel)


def test_engine_runs_the_lean_decoder_on_packed_kernels_only(tiny):
    model, tok = tiny
    assert lean_support(model) is None
    assert Engine(model, tok, max_batch=4, kernels="onednn").lean is not None
    assert Engine(model, tok, max_batch=4, kernels="torch").lean is None


def test_adapters_injected_after_the_engine_was_built_are_used(tiny):
    model, tok = tiny
    engine = Engine(model, tok, max_batch=4, kernels="onednn")
    unrouted = [dataclasses.replace(r, route_of=None) for r in requests(tok, True)]
    base = engine.generate(unrouted)
    with_adapters(model)
    after = engine.generate(requests(tok, True))
    fresh = Engine(copy.deepcopy(model), tok, max_batch=4, kernels="torch").generate(requests(tok, True))
    assert [t.completion_ids for t in after] == [t.completion_ids for t in fresh]
    assert [t.completion_ids for t in after] != [t.completion_ids for t in base]


def test_a_model_it_does_not_cover_runs_hf_forward(tiny):
    model, tok = tiny
    with_adapters(model)
    expected = Engine(copy.deepcopy(model), tok, max_batch=4, kernels="torch").generate(requests(tok, True))
    headless = copy.deepcopy(model)
    headless.lm_head = torch.nn.Sequential(headless.lm_head)
    assert "LM head is Sequential" in lean_support(headless)
    layer = model.model.layers[1].mlp
    layer.down_proj = torch.nn.Sequential(layer.down_proj)  # not a linear: the lean decoder cannot fuse it
    assert "down_proj is Sequential" in lean_support(model)
    engine = Engine(model, tok, max_batch=4, kernels="onednn")
    assert engine.lean is None and engine.packed is not None
    assert [t.completion_ids for t in engine.generate(requests(tok, True))] == [
        t.completion_ids for t in expected
    ]


def test_a_released_model_still_runs_its_own_forward(tiny):
    """The fused q/k/v and gate/up weights replace the plain ones; each projection keeps its columns."""
    model, tok = tiny
    with_adapters(model)
    randomize_adapters(model, seed=1, std=0.2)
    ids = torch.tensor([tok.encode("The capital of France is", add_special_tokens=False)])
    with torch.inference_mode(), routes_ctx(model, 1):
        expected = model(ids).logits
    Engine(model, tok, max_batch=4, kernels="onednn", owns_model=True)
    assert model.model.layers[0].self_attn.q_proj.base_layer.weight.numel() == 0
    with torch.inference_mode(), routes_ctx(model, 1):
        got = model(ids).logits
    # another blocking of the same fp32 GEMMs: a few ulps through two layers
    assert_close_ulps(got, expected, 256, torch.float32)


def test_fused_adapters_equal_each_layers_own_adapters(tiny):
    """q/k/v as one pair of adapter GEMMs: adapters on q and v only (k a plain linear, a zero block of its
    columns), two adapters of different ranks, per-token routes mixing them and the base, one adapter on
    every token, no adapter at all; a changed adapter weight is picked up (the stacked copy is rebuilt)."""
    model, _ = tiny
    rolerl.add_adapters(model, ["a", "b"], rank={"a": 4, "b": 2}, target_modules=["q_proj", "v_proj"])
    randomize_adapters(model, std=0.2)
    attn = model.model.layers[0].self_attn
    fused = _adapters(attn.q_proj, attn.k_proj, attn.v_proj)
    assert [(lo, hi) for _, lo, hi in fused.members] == [(0, 64), (96, 128)]  # tiny: 4 q heads, 2 kv of 16
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, attn.q_proj.in_features, generator=g)
    base = torch.randn(3, 5, fused.width, generator=g)
    mixed = torch.randint(-1, 2, (3, 5), generator=g)

    def one_by_one():
        y = base.clone()
        for m, lo, hi in fused.members:
            m.adapt_(x, y[..., lo:hi])
        return y

    for route in (mixed, 0, 1, -1, "changed"):
        if route == "changed":
            with torch.no_grad():
                attn.v_proj.lora_B["b"].add_(0.5)
            route = mixed
        with torch.inference_mode(), routes_ctx(model, route):
            got, want = fused.add_(x, base.clone()), one_by_one()
        assert_close_ulps(got, want, 16, torch.float32)
        if isinstance(route, int) and route < 0:
            assert torch.equal(got, base)
        else:
            assert torch.equal(got[..., 64:96], base[..., 64:96]), (
                "k has no adapter: its columns stay the base's"
            )
            assert not torch.equal(got, base)


def test_an_adapter_every_token_uses_is_merged_and_other_routes_subtract_it(tiny, adapter_kernel):
    """The first forward whose tokens all use adapter a packs a into the base weights; later forwards under
    mixed routes, under b alone and under the base alone subtract it and still equal HF's forward (float64);
    an update of a's weights re-packs; dropping the packed copy unmerges."""
    model, reference, decoder, caches = against_float64(tiny, 40, adapter_kernel)
    g = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    steps = [*STEPS, ([0, 1, 2], [9, 5, 9], [1, 1, 1]), ([0, 1, 2], [10, 6, 10], [2, 1, 2]),
             ([0, 1, 2], [12, 7, 12], [1, 1, 1])]  # fmt: skip
    plan = [0, "mixed", 1, -1, "update", "mixed", 0]  # the route of each step
    for (slots, lens, n_new), route in zip(steps, plan, strict=True):
        if route == "update":  # an optimizer step on a's weights: the merged copy must follow
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if ".lora_B.a" in name:
                        p.add_(0.05)
                for p, q in zip(model.parameters(), reference.parameters(), strict=True):
                    q.copy_(p)
            route = 0
        width = max(n_new)
        ids = torch.randint(0, vocab, (len(slots), width), generator=g)
        routes = torch.randint(-1, 2, (len(slots), width), generator=g) if route == "mixed" else route
        assert_step_equals_hf(decoder, reference, caches, ids, routes, slots, lens, n_new)
        assert decoder.packed.merged == "a", "merged by the first forward, kept through other routes"
    assert kernel_ran(adapter_kernel)
    decoder.packed.drop()
    assert decoder.packed.merged is None
    with pytest.raises(RuntimeError, match="merged"):
        decoder.packed.merge_adapter("a")
        with decoder.packed():
            pass
