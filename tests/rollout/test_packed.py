"""Packed linears in the engine, on oneDNN's packing and on the native GEMM's (`rollout.kernels`): the same
tokens and log-probs as `F.linear`, weights that change are packed again, a released model frees its plain
weights and still generates the same, clear refusals."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch.nn import functional as F

import rolerl
from rolerl.models.lora import RoutedLoRALinear, merged_delta
from rolerl.rollout import native
from rolerl.rollout.engine import Engine, GenerationRequest, rollout_copy
from rolerl.rollout.kv import KVCache
from rolerl.rollout.packed import (
    PackedLinears,
    _drop_file_pages,
    _file_mappings,
    onednn_supported,
    resolve_kernels,
)
from rolerl.rollout.sampling import SamplingParams
from tests.models.test_lora import randomize_adapters
from tests.rollout.test_engine import assert_same_or_near_tie
from tests.tolerance import assert_close_ulps

pytestmark = pytest.mark.skipif(
    not onednn_supported(torch.device("cpu"), torch.float32), reason="torch built without oneDNN"
)

# the two packings: oneDNN's, and the native fp32 GEMM's (`gemm.c`) where the native kernels build
NATIVE = pytest.mark.skipif(native.kernel() is None, reason="the native kernels did not build")
PACKINGS = ["onednn", pytest.param("native", marks=NATIVE)]
PROMPTS = ["The capital of France is", "def add(a, b):", "1, 2, 3, 4,", "Once upon a time there was a"]
KINDS = ("prompt", "reasoning", "tool_call", "tool_output", "answer")


def requests(tok, greedy: bool, n: int = 10) -> list[GenerationRequest]:
    # two adapters, rows alternating between them (two roles in one batch)
    routes = [dict.fromkeys(KINDS, 0), dict.fromkeys(KINDS, 1)]
    return [
        GenerationRequest(
            tok.encode(p, add_special_tokens=False),
            SamplingParams(greedy=greedy, seed=i, max_new_tokens=n),
            route_of=routes[i % 2],
        )
        for i, p in enumerate(PROMPTS)
    ]


def with_adapters(model):
    rolerl.add_adapters(model, ["a", "b"], rank=4, alpha=8)
    randomize_adapters(model, std=0.2)
    return model


@pytest.mark.parametrize("kind", PACKINGS)
def test_linear_layer_equals_f_linear_for_any_row_count(kind):
    torch.manual_seed(0)
    layer = torch.nn.Linear(96, 160, bias=True)
    packed = PackedLinears(layer, batch_hint=32, kind=kind)
    for shape in [(1, 96), (7, 96), (3, 5, 96), (200, 96)]:
        x = torch.randn(*shape)
        with torch.inference_mode():
            expected = F.linear(x.double(), layer.weight.double(), layer.bias.double())
            with packed():
                got = layer(x)
        # another blocking of a 96-term fp32 dot product: a few ulps of the largest value
        assert_close_ulps(got.double(), expected, 64, torch.float32)
    assert "forward" not in layer.__dict__  # swapped back out


@pytest.mark.parametrize("kind", PACKINGS)
def test_engine_packed_equals_torch_kernels_greedy_and_logprobs(tiny, kind):
    model, tok = tiny
    with_adapters(model)
    for greedy in (True, False):
        torch_turns, packed_turns = (
            Engine(model, tok, max_batch=4, kernels=k).generate(requests(tok, greedy))
            for k in ("torch", kind)
        )
        for a, b in zip(torch_turns, packed_turns, strict=True):
            assert a.completion_ids == b.completion_ids  # random tiny models: wide margins, no near ties
            assert_close_ulps(torch.tensor(b.logprobs), torch.tensor(a.logprobs), 4096, torch.float32)


@pytest.mark.parametrize("kind", PACKINGS)
def test_a_changed_base_weight_is_packed_again(tiny, kind):
    model, tok = tiny
    with_adapters(model)
    engine = Engine(model, tok, max_batch=4, kernels=kind)
    before = engine.generate(requests(tok, True))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.down_proj.base_layer.weight.mul_(-3.0)  # in place: same storage, new version
    after = engine.generate(requests(tok, True))
    fresh = Engine(model, tok, max_batch=4, kernels="torch").generate(requests(tok, True))
    assert [t.completion_ids for t in after] == [t.completion_ids for t in fresh]
    assert [t.completion_ids for t in after] != [t.completion_ids for t in before]


def same_matrix(packed: torch.Tensor | native.PackedWeight, weight: torch.Tensor) -> bool:
    if isinstance(packed, native.PackedWeight):  # the native GEMM's panels: always a copy
        return False
    try:
        return packed.data_ptr() == weight.data_ptr()
    except RuntimeError:  # an opaque oneDNN copy has no storage
        return False


@pytest.mark.parametrize("tied_head", ["share", "copy"])
@pytest.mark.parametrize(
    "dtype, kind",
    [
        (torch.float32, "onednn"),
        (torch.bfloat16, "onednn"),
        pytest.param(torch.float32, "native", marks=NATIVE),
    ],
)
def test_a_tied_head_runs_on_the_embeddings_matrix_unless_copied_and_equals_f_linear(dtype, kind, tied_head):
    if not onednn_supported(torch.device("cpu"), dtype):
        pytest.skip(f"no packed oneDNN linear for {dtype} on this CPU")
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.embed, model.head = torch.nn.Embedding(300, 64), torch.nn.Linear(64, 300, bias=False)
    model.head.weight = model.embed.weight  # tied
    model.other = torch.nn.Linear(64, 300, bias=False)  # same shape, its own weight: packed
    model.to(dtype)
    packed = PackedLinears(model, batch_hint=32, tied_head=tied_head, kind=kind)
    (head, _), (other, _), *_ = packed.weights()
    assert isinstance(other, native.PackedWeight) == (kind == "native")
    assert same_matrix(head, model.embed.weight) == (tied_head == "share")  # no copy unless asked
    assert not same_matrix(other, model.other.weight)
    for rows in (1, 7, 200):
        x = torch.randn(rows, 64).to(dtype)
        with torch.inference_mode(), packed():
            got = model.head(x)
        expected = F.linear(x.double(), model.embed.weight.double())
        # fp32: a 64-term dot product; bf16: exact products summed in fp32, the output rounded to bf16 once
        ulps = 64 if dtype == torch.float32 else 2
        assert_close_ulps(got.double(), expected, ulps=ulps, dtype=dtype)
    with pytest.raises(
        ValueError, match=r"rollout.tied_head must be one of \('share', 'copy'\), got 'twice'"
    ):
        PackedLinears(model, tied_head="twice")


@pytest.mark.parametrize("kind", PACKINGS)
def test_a_released_model_frees_its_weights_and_generates_the_same(tiny, kind):
    model, tok = tiny
    with_adapters(model)
    plain = copy.deepcopy(model)
    expected = Engine(copy.deepcopy(model), tok, max_batch=4, kernels=kind).generate(requests(tok, False))
    head = model.get_output_embeddings()
    tied = head.weight is model.get_input_embeddings().weight
    before = sum(p.numel() for p in model.parameters())
    engine = Engine(model, tok, max_batch=4, kernels=kind, owns_model=True)
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    kept = [m for m in linears if m.weight.numel()]
    assert kept == ([head] if tied else [])  # a tied head stays
    # ... and runs on the embeddings' own matrix: no packed copy of it
    assert same_matrix(engine.packed.weights()[-1][0], head.weight) == tied
    assert sum(p.numel() for p in model.parameters()) < before
    got = engine.generate(requests(tok, False))
    assert [t.completion_ids for t in got] == [t.completion_ids for t in expected]
    assert [t.logprobs for t in got] == [t.logprobs for t in expected]  # same packed ops, same order
    if tied:  # asked to, a released model's head runs on a packed copy: the embeddings stay for the lookups
        engine = Engine(plain, tok, max_batch=4, kernels=kind, owns_model=True, tied_head="copy")
        assert not same_matrix(engine.packed.weights()[-1][0], plain.get_output_embeddings().weight)
        assert plain.get_input_embeddings().weight.numel()
        for a, b in zip(engine.generate(requests(tok, False)), expected, strict=True):  # another GEMM layout
            assert a.completion_ids == b.completion_ids  # random tiny models: wide margins, no near ties
            assert_close_ulps(torch.tensor(a.logprobs), torch.tensor(b.logprobs), 4096, torch.float32)
    with pytest.raises(ValueError, match="rollout.tied_head must be one of"):
        Engine(model, tok, kernels="torch", tied_head="twice")  # refused whatever the kernels


def test_rollout_copy_engine_releases_the_copy_not_the_trainer(tiny):
    model, tok = tiny
    with_adapters(model)
    copy_ = rollout_copy(model, torch.float32)
    Engine(copy_, tok, max_batch=4, kernels="onednn", source=model)
    assert all(m.weight.numel() for m in model.modules() if type(m) is torch.nn.Linear)  # trainer intact
    assert not all(m.weight.numel() for m in copy_.modules() if type(m) is torch.nn.Linear)


def one_adapter_requests(tok, n: int = 10, adapter: int = 0) -> list[GenerationRequest]:
    # every token on one adapter (a): the lean decoder merges it into the packed weights
    route = dict.fromkeys(KINDS, adapter)
    return [
        GenerationRequest(
            tok.encode(p, add_special_tokens=False),
            SamplingParams(greedy=False, seed=i, max_new_tokens=n),
            route_of=route,
        )
        for i, p in enumerate(PROMPTS)
    ]


def assert_same_turns(got, want) -> None:
    assert [t.completion_ids for t in got] == [t.completion_ids for t in want]
    assert [t.logprobs for t in got] == [t.logprobs for t in want]


@pytest.mark.parametrize("kind", PACKINGS)
def test_a_rollout_copy_frees_its_packed_weights_between_rollouts_and_packs_them_from_the_source(tiny, kind):
    """A copy released with its source (the trainer's model) frees its packed weights on `sleep` (nothing
    keeps them alive: the copy takes no memory while the trainer updates) and packs them again from the
    source's weights on the next request; it merges an adapter every token uses and follows the source's
    adapters through `sync`. At every point it samples what an engine over the trainer's own model
    samples, bit for bit (fp32: the same weights, the same packed ops)."""
    import gc
    import weakref

    model, tok = tiny
    with_adapters(model)
    engine = Engine(rollout_copy(model, torch.float32), tok, max_batch=4, kernels=kind, source=model)
    trainer = Engine(model, tok, max_batch=4, kernels=kind)
    assert all(m.weight.numel() == 0 for m in engine.model.modules() if type(m) is torch.nn.Linear
               and m is not engine.model.get_output_embeddings())  # fmt: skip
    for reqs in (requests(tok, False), one_adapter_requests(tok), requests(tok, True)):
        assert_same_turns(engine.generate(reqs), trainer.generate(reqs))
        if reqs[0].route_of["answer"] == 0 and reqs[1].route_of["answer"] == 0 and engine.lean is not None:
            assert engine.packed.merged == "a"
        packed = [weakref.ref(w) for w, _ in engine.packed.weights()]
        engine.sleep()
        trainer.sleep()
        gc.collect()
        assert all(ref() is None for ref in packed), "the copy's packed weights outlive sleep()"
        assert engine.packed.merged is None
    before = engine.generate(one_adapter_requests(tok))
    randomize_adapters(model, seed=1, std=0.2)  # an update of the trainer's adapters
    engine.sync()
    after = engine.generate(one_adapter_requests(tok))  # without a sleep: the merged weights follow
    assert_same_turns(after, trainer.generate(one_adapter_requests(tok)))
    assert [t.logprobs for t in after] != [t.logprobs for t in before]


@pytest.mark.skipif(
    not onednn_supported(torch.device("cpu"), torch.bfloat16), reason="no native bf16 on this CPU"
)
def test_a_bf16_rollout_copy_merges_in_fp32_and_rounds_once(tiny):
    """A bf16 copy of an fp32 trainer merges adapter a (its own bf16 A and B) as bf16(W + s B A) summed in
    fp32: it samples what a bf16 copy of a model whose fp32 weights hold those sums samples, bit for bit
    (random tiny models sample from nearly flat distributions: one rounding apart, the tokens part)."""
    model, tok = tiny
    plain = copy.deepcopy(model)
    with_adapters(model)
    merged = dict(plain.named_modules())
    with torch.no_grad():
        for name, m in rollout_copy(model, torch.bfloat16).named_modules():
            if isinstance(m, RoutedLoRALinear) and "a" in m.lora_A:
                merged[name].weight.add_(merged_delta(m, "a", torch.float32))
    engine = Engine(rollout_copy(model, torch.bfloat16), tok, max_batch=4, kernels="onednn", source=model)
    if engine.lean is None:
        pytest.skip("merging is the lean decoder's")
    want = Engine(rollout_copy(plain, torch.bfloat16), tok, max_batch=4, kernels="onednn", owns_model=True)
    got = engine.generate(one_adapter_requests(tok))
    assert engine.packed.merged == "a"
    assert_same_turns(got, want.generate(one_adapter_requests(tok, adapter=-1)))  # no adapters


def test_a_source_must_match_the_copy():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    other = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 5))
    with pytest.raises(ValueError, match="no linear layer '1' of shape"):
        PackedLinears(model).release(other)


@pytest.mark.parametrize("kind", PACKINGS)
def test_engines_over_one_model_share_one_packed_copy(tiny, kind):
    import gc
    import weakref

    model, tok = tiny
    with_adapters(model)
    first = Engine(model, tok, max_batch=4, kernels=kind)
    second = Engine(model, tok, max_batch=8, kernels=kind)  # e.g. the run's evaluation engine
    assert first.packed is second.packed
    other = Engine(copy.deepcopy(model), tok, max_batch=4, kernels=kind)
    assert other.packed is not first.packed and other.packed.model is other.model
    assert [t.completion_ids for t in first.generate(requests(tok, True))] == [
        t.completion_ids for t in other.generate(requests(tok, True))
    ]
    packed = weakref.ref(other.packed)
    del other
    gc.collect()
    assert packed() is None  # the table does not keep a model (or its packed weights) alive


def test_kernel_choice_and_refusals(monkeypatch):
    cpu = torch.device("cpu")
    built = native.kernel()
    # fp32: the native GEMM where the kernels build with AVX2 or AVX-512, else oneDNN
    assert resolve_kernels("auto", cpu, torch.float32) == ("native" if built and built.isa else "onednn")
    bf16 = "onednn" if onednn_supported(cpu, torch.bfloat16) else "torch"
    assert resolve_kernels("auto", cpu, torch.bfloat16) == bf16  # the native GEMM is fp32 only
    assert resolve_kernels("onednn", cpu, torch.float32) == "onednn"
    assert resolve_kernels("torch", cpu, torch.float32) == "torch"
    assert resolve_kernels("auto", cpu, torch.float16) == "torch"  # no packed fp16 path
    with pytest.raises(ValueError, match="float16"):
        resolve_kernels("onednn", cpu, torch.float16)
    with pytest.raises(
        ValueError, match=r"'native' runs float32 models on CPU; this model is torch.bfloat16"
    ):
        resolve_kernels("native", cpu, torch.bfloat16)
    with pytest.raises(ValueError, match=r"kernels must be one of \('auto', 'native', 'onednn', 'torch'\)"):
        resolve_kernels("mkl", cpu, torch.float32)
    assert resolve_kernels("auto", torch.device("cuda"), torch.float32) == "torch"
    with pytest.raises(ValueError, match="runs float32 models on CPU; this model is torch.float32 on cuda"):
        resolve_kernels("native", torch.device("cuda"), torch.float32)
    # no compiler: auto falls back to oneDNN; asked for by name, the reason is given
    monkeypatch.setattr(native, "kernel", lambda: None)
    monkeypatch.setattr(native, "_failure", "no C compiler (set CC, or install gcc)")
    assert resolve_kernels("auto", cpu, torch.float32) == "onednn"
    with pytest.raises(RuntimeError, match=r"'native': the kernels did not build \(no C compiler"):
        resolve_kernels("native", cpu, torch.float32)


def up8(n: int) -> int:
    return -(-n // 8) * 8


def test_kv_cache_is_sized_to_the_longest_request_and_never_held_twice(tiny, monkeypatch):
    """Sized to the longest request joining (its positions but the last, which is sampled and never fed;
    8-position multiples, not a power of two); a longer call with nothing running frees the old cache before
    it allocates; growth under a running row grows by a quarter and frees each of the old cache's layers as
    it copies them."""
    model, tok = tiny
    engine = Engine(model, tok, max_batch=4)
    ids = tok.encode("Hello", add_special_tokens=False)
    longer = tok.encode("Hello there, how are you", add_special_tokens=False)

    def req(prompt, n, seed=0):
        return GenerationRequest(prompt, SamplingParams(greedy=True, max_new_tokens=n, seed=seed))

    engine.generate([req(ids, 300), req(longer, 300)])  # the longer prompt is not first: sized for both
    first = engine.cache.capacity
    assert first == up8(len(longer) + 300 - 1)

    held = []
    real_init = KVCache.__init__

    def spy(self, *args, **kwargs):
        held.append(engine.cache)  # what the engine still holds while the next cache is allocated
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(KVCache, "__init__", spy)
    engine.generate([req(ids, first + 1)])  # needs len(ids) + first > first positions
    assert held == [None] and engine.cache.capacity == up8(len(ids) + first)

    engine = Engine(model, tok, max_batch=4)
    engine.submit(req(ids, 40))
    engine.step()
    old = engine.cache
    assert old.capacity == up8(len(ids) + 40 - 1)
    engine.submit(req(ids, 100, seed=1))
    engine.step()  # admitted while the first row runs: the cache grows and that row's keys move over
    assert engine.cache.capacity == up8(max(len(ids) + 100 - 1, old.capacity + old.capacity // 4))
    assert all(t.numel() == 0 for t in (*old.k, *old.v))  # every old layer freed


def test_kv_cache_holds_slots_for_the_requests_there_are(tiny):
    """A large `max_batch` costs nothing until used: 4 requests take 4 of 64 slots; requests arriving one
    by one while others run double the slots (1, 2, 4: not a copy at every admission), and the running rows
    keep their keys through the growth: each request equals its solo run."""
    model, tok = tiny
    with_adapters(model)
    reqs = requests(tok, True)
    solo = [Engine(model, tok, max_batch=1).generate([r])[0] for r in reqs]
    engine = Engine(model, tok, max_batch=64)
    engine.generate(reqs)
    assert engine.cache.slots == 4
    engine = Engine(model, tok, max_batch=64)
    slots, done = [], {}
    for req in reqs:
        engine.submit(req)
        for _ in range(2):
            done.update(engine.step())
            slots.append(engine.cache.slots)
    while engine.has_work:
        done.update(engine.step())
    assert sorted(set(slots)) == [1, 2, 4] and len(done) == 4
    for handle, (req, want) in enumerate(zip(reqs, solo, strict=True)):
        assert_same_or_near_tie(model, req, want, done[handle])


def test_kv_cache_memory_is_never_read_before_it_is_zeroed_or_written(tiny, monkeypatch):
    """The cache is allocated unzeroed (`KVCache.reach` zeroes columns as forwards first read them). With
    its fresh memory filled with NaN, rows of different lengths (shorter rows read masked positions) and a
    longer request admitted mid-run (the cache grows, the running row's keys are copied over) give each
    request's solo tokens and log-probs. Without `reach` in `make_batch` the log-probs are NaN; without it
    before the growth's copies, the running row loses its keys."""
    model, tok = tiny
    with_adapters(model)
    reqs = requests(tok, True)[:3]
    for r, n in zip(reqs, (5, 40, 150), strict=True):
        r.sampling.max_new_tokens = n  # the third is admitted when the first ends, and outgrows the cache
    solo = [Engine(model, tok, max_batch=1).generate([r])[0] for r in reqs]
    real = KVCache.__init__

    def poisoned(self, *args, **kwargs):
        real(self, *args, **kwargs)
        for t in (*self.k, *self.v):
            t.fill_(float("nan"))

    monkeypatch.setattr(KVCache, "__init__", poisoned)
    engine = Engine(model, tok, max_batch=2)
    turns = engine.generate(reqs)
    assert engine.cache.capacity > len(reqs[1].prompt_ids) + 40  # it grew
    for req, got, want in zip(reqs, turns, solo, strict=True):
        assert_same_or_near_tie(model, req, want, got)  # greedy: the same tokens, log-probs within 1e-4


def resident_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="Linux only")
def test_released_weights_mapped_from_a_file_leave_memory(tmp_path):
    # a checkpoint's weights are pages of the safetensors file mapped into memory: dropping them must shrink
    # the resident set; anonymous memory (a weight computed in this process) must be left untouched
    path = tmp_path / "weights.bin"
    values = torch.arange(16 * 2**20, dtype=torch.float32)  # 64 MiB
    values.numpy().tofile(path)
    del values
    mapped = torch.from_file(str(path), shared=False, size=16 * 2**20, dtype=torch.float32)
    assert float(mapped[-1]) == 16 * 2**20 - 1
    mapped.sum()  # touch every page
    before = resident_mb()
    _drop_file_pages(mapped, _file_mappings())
    assert before - resident_mb() > 48
    assert float(mapped[12345]) == 12345  # a later read fetches the file's pages again
    anonymous = torch.full((4 * 2**20,), 7.0)
    _drop_file_pages(anonymous, _file_mappings())
    assert bool((anonymous == 7.0).all())


@pytest.mark.parametrize("groups", [1, 3])
def test_decode_attention_equals_sdpa_on_a_strided_cache(groups):
    """The fp32 decode attention (two matmuls) against fp64 SDPA, on the engine's layout: a view of a
    longer cache, a per-row additive mask hiding each row's unwritten columns."""
    from rolerl.rollout.kv import _decode_attention

    torch.manual_seed(0)
    b, kv_heads, d, capacity, kv = 5, 2, 16, 40, 29
    cache_k, cache_v = torch.randn(2, b, kv_heads, capacity, d).unbind(0)
    k, v = cache_k[:, :, :kv], cache_v[:, :, :kv]  # strided, as in the engine
    q = torch.randn(b, kv_heads, groups, d) * 3
    lens = torch.tensor([1, 7, 29, 12, 20])
    mask = torch.zeros(b, 1, 1, kv).masked_fill_(torch.arange(kv) >= lens[:, None, None, None], float("-inf"))
    got = _decode_attention(q, k, v, mask, d**-0.5)
    expected = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask.double())
    # softmax weights and a d-term sum: a few fp32 ulps of the largest output
    assert_close_ulps(got.double(), expected, ulps=64, dtype=torch.float32)
    assert torch.allclose(got[0], v[0, :, :1].expand(kv_heads, groups, d))  # one visible key: its value


def test_sleep_frees_the_cache_the_scratch_and_the_packed_copy_and_the_next_turns_are_the_same(tiny):
    model, tok = tiny
    with_adapters(model)
    engine = Engine(model, tok, max_batch=4, kernels="onednn")  # the trainer's model: a packed copy
    first = engine.generate(requests(tok, False))
    scratch = engine.sampler.scratch  # the sampler's (B, V) terms, one buffer for every step
    assert engine.cache is not None and engine.packed._packed and scratch is not None
    assert [t.completion_ids for t in engine.generate(requests(tok, False))] == [
        t.completion_ids for t in first
    ]
    assert engine.sampler.scratch is scratch
    engine.sleep()
    assert engine.cache is None and not engine.packed._packed and engine.sampler.scratch is None
    again = engine.generate(requests(tok, False))  # allocates and packs again
    assert engine.packed._packed
    assert [t.completion_ids for t in again] == [t.completion_ids for t in first]
    assert [t.logprobs for t in again] == [t.logprobs for t in first]  # the same ops on the same weights
    engine.submit(requests(tok, False)[0])
    with pytest.raises(RuntimeError, match="in flight"):
        engine.sleep()


def test_an_owned_model_keeps_its_packed_weights_through_sleep(tiny):
    model, tok = tiny
    with_adapters(model)
    engine = Engine(model, tok, max_batch=4, kernels="onednn", owns_model=True)
    first = engine.generate(requests(tok, True, n=6))
    engine.sleep()
    assert engine.cache is None and engine.packed._packed  # its only weights
    again = engine.generate(requests(tok, True, n=6))
    assert [t.completion_ids for t in again] == [t.completion_ids for t in first]
