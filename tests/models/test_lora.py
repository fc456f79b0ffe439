"""RoutedLoRALinear against PEFT and against a slow per-token reference."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from peft import LoraConfig, get_peft_model

import rolerl
from rolerl.models.lora import AdapterSpec, RoutedLoRALinear, RouteState, adapter_specs, routed_layers
from tests.tolerance import assert_close_ulps

NAMES = ["reason", "tool", "answer", "unused"]  # three used, one no token is routed to


def randomize_adapters(model, seed: int = 0, std: float = 0.1) -> None:
    """Fresh adapters are the identity (B = 0); give B (and A) random values so adapters differ."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)


def reference_forward(layer: RoutedLoRALinear, x: torch.Tensor) -> torch.Tensor:
    """Slow, obviously-correct routed LoRA: one token at a time, y = W x + b + s_k B_k A_k x."""
    route = layer.state.route
    names = layer.state.names
    rows = []
    for b in range(x.shape[0]):
        cols = []
        for t in range(x.shape[1]):
            k = route if isinstance(route, int) else int(route[b, t])
            y = layer.base_layer(x[b, t])
            if k >= 0 and names[k] in layer.lora_A:
                spec = layer.state.adapters[names[k]]
                y = y + spec.scaling * (layer.lora_B[names[k]] @ (layer.lora_A[names[k]] @ x[b, t]))
            cols.append(y)
        rows.append(torch.stack(cols))
    return torch.stack(rows)


def route_patterns(batch: int, length: int, kind: str, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "random":  # any of -1, 0, 1, 2 per token
        route = torch.randint(-1, 3, (batch, length), generator=g)
    else:  # contiguous spans, as a DART episode: reason ... tool ... reason ... answer
        route = torch.zeros(batch, length, dtype=torch.long)
        for b in range(batch):
            cuts = sorted(torch.randperm(length - 1, generator=g)[:3].add(1).tolist())
            for i, (lo, hi) in enumerate(zip([0, *cuts], [*cuts, length], strict=True)):
                route[b, lo:hi] = [0, 1, 0, 2][i]
        route[:, :2] = -1  # a base-only prefix
    assert set(route.unique().tolist()) >= {0, 1, 2}, "the pattern must exercise three adapters"
    return route


@pytest.fixture
def routed(tiny):
    model, _ = tiny
    base = copy.deepcopy(model)
    rolerl.add_adapters(model, NAMES, rank={"reason": 4, "tool": 8, "answer": 2, "unused": 4}, alpha=16)
    randomize_adapters(model)
    return model, base


def test_single_adapter_matches_peft(tiny):
    model, _ = tiny
    peft_model = get_peft_model(
        copy.deepcopy(model), LoraConfig(r=8, lora_alpha=16, target_modules="all-linear")
    )
    rolerl.add_adapters(model, ["policy"], rank=8, alpha=16)
    randomize_adapters(model)
    copy_into_peft(model, peft_model, "policy")
    ids = torch.randint(0, model.config.vocab_size, (3, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = peft_model(ids).logits
        with rolerl.routes(model, "policy"):
            scalar = model(ids).logits
        per_token = model(ids, routes=torch.zeros_like(ids)).logits
    torch.testing.assert_close(scalar, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(per_token, expected, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_single_adapter_matches_peft_on_default_model(default_model_cpu):
    base, _ = default_model_cpu
    model = copy.deepcopy(base)
    peft_model = get_peft_model(
        copy.deepcopy(base), LoraConfig(r=16, lora_alpha=32, target_modules="all-linear")
    )
    rolerl.add_adapters(model, ["policy"], rank=16, alpha=32)
    randomize_adapters(model, std=0.02)
    copy_into_peft(model, peft_model, "policy")
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = peft_model(ids).logits
        got = model(ids, routes=torch.zeros_like(ids)).logits
        base_logits = base(ids).logits
    assert (expected - base_logits).abs().max() > 1e-2, "the adapter must change the logits"
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def copy_into_peft(model, peft_model, name: str) -> None:
    layers = dict(routed_layers(model))
    n = 0
    with torch.no_grad():
        for path, module in peft_model.base_model.model.named_modules():
            if path in layers and hasattr(module, "lora_A"):
                module.lora_A["default"].weight.copy_(layers[path].lora_A[name])
                module.lora_B["default"].weight.copy_(layers[path].lora_B[name])
                n += 1
    assert n == len(layers) > 0


@pytest.mark.parametrize("pattern", ["random", "contiguous"])
def test_mixed_routes_match_per_token_reference_layer_by_layer(routed, pattern):
    model, _ = routed
    ids = torch.randint(0, model.config.vocab_size, (3, 13), generator=torch.Generator().manual_seed(3))
    route = route_patterns(3, 13, pattern)
    seen = []

    def check(layer, inputs, output):
        seen.append((layer, inputs[0], output))

    handles = [layer.register_forward_hook(check) for _, layer in routed_layers(model)]
    with torch.no_grad(), rolerl.routes(model, route):
        fast = model(ids).logits
        for layer, x, out in seen:
            torch.testing.assert_close(out, reference_forward(layer, x), atol=1e-5, rtol=1e-5)
    for h in handles:
        h.remove()
    assert len(seen) == len(list(routed_layers(model))) == 2 * 7
    with torch.no_grad():
        slow = _reference_model_logits(model, ids, route)
    # whole-model logits (scale ~30) after 14 layers of fp32 rounding in another summation order
    torch.testing.assert_close(fast, slow, atol=1e-5 * slow.abs().max(), rtol=1e-5)


def _reference_model_logits(model, ids, route, backward_weights=None):
    original = RoutedLoRALinear.forward
    RoutedLoRALinear.forward = reference_forward
    try:
        with rolerl.routes(model, route):
            logits = model(ids).logits
            if backward_weights is not None:
                (logits * backward_weights).sum().backward()
    finally:
        RoutedLoRALinear.forward = original
    return logits


def test_route_minus_one_is_exactly_the_base_model(routed):
    model, base = routed
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = base(ids).logits
        # Route -1: every routed layer returns its base layer's output untouched, the base model's ops
        # exactly, so the logits are equal bit for bit.
        assert torch.equal(model(ids, routes=torch.full_like(ids, -1)).logits, expected)
        with rolerl.routes(model, -1):
            assert torch.equal(model(ids).logits, expected)
        assert torch.equal(model(ids).logits, expected), "outside any routes() block the model is base only"


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copy_routes_itself_and_leaves_the_original_alone(routed, how):
    """A copy's `routes=` must set the copy's route state: hooks that closed over the original's state made
    `clone(ids, routes=r)` compute the base model and change the original's route for that call."""
    model, base = routed
    clone = copy.deepcopy(model) if how == "deepcopy" else pickle.loads(pickle.dumps(model))
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(16))
    route = route_patterns(2, 9, "random", seed=17)
    seen = []  # the original's route while the copy runs
    layer = next(layer for _, layer in routed_layers(clone))
    layer.register_forward_hook(lambda *_: seen.append(model._rolerl_route_state.route))
    with torch.no_grad(), rolerl.routes(model, "tool"):
        got = clone(ids, routes=route).logits
        assert [type(r) for r in seen] == [int] and seen == [1], "the copy set the original's route"
        assert model._rolerl_route_state.route == 1
    with torch.no_grad():
        want = model(ids, routes=route).logits
        base_logits = base(ids).logits
    assert (got - base_logits).abs().max() > 1e-2, "the copy computed the base model"
    # Same weights (copied bit for bit), same route, same ops on the same shapes: equal bit for bit.
    assert torch.equal(got, want)


@pytest.mark.parametrize("pattern", ["random", "contiguous"])
def test_gradients_isolated_and_equal_to_reference(routed, pattern):
    model, _ = routed
    ids = torch.randint(0, model.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(5))
    route = route_patterns(2, 10, pattern, seed=6)
    weights = torch.randn(2, 10, model.config.vocab_size, generator=torch.Generator().manual_seed(7))
    with rolerl.routes(model, route):
        (model(ids).logits * weights).sum().backward()
    fast = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    _reference_model_logits(model, ids, route, backward_weights=weights)
    slow = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    for name, p in model.named_parameters():
        if "lora_" not in name:
            assert not p.requires_grad and name not in fast, f"base weight {name} got a gradient"
        elif ".unused" in name:
            assert name not in fast or torch.count_nonzero(fast[name]) == 0, f"{name} must get no gradient"
        else:
            assert torch.count_nonzero(fast[name]) > 0, f"{name} was used but got no gradient"
            # fp32 sums over 49k-vocab logits in another order: tolerance relative to the gradient's scale
            scale = slow[name].abs().max()
            torch.testing.assert_close(fast[name], slow[name], atol=1e-5 * scale, rtol=1e-4)


def test_decode_step_routes_apply_to_single_tokens(routed):
    """A cached decode step with a (B, 1) route gives the logits of the full pass at that position."""
    model, _ = routed
    ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(8))
    route = route_patterns(2, 8, "random", seed=9)
    with torch.no_grad():
        full = model(ids, routes=route).logits
        out = model(ids[:, :-1], routes=route[:, :-1], use_cache=True)
        step = model(ids[:, -1:], routes=route[:, -1:], past_key_values=out.past_key_values).logits
    # Other kernels on other shapes (attention over the cache, one-token matmuls): the logits round
    # differently, by up to ~10 ulps of the largest logit measured (1.9e-5 at ~20): an absolute 1e-5 failed.
    assert_close_ulps(step[:, 0], full[:, -1], ulps=64)


def test_fresh_adapter_is_identity_and_only_lora_trains(tiny):
    model, _ = tiny
    ids = torch.randint(0, model.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(10))
    with torch.no_grad():
        before = model(ids).logits
    rolerl.add_adapters(model, ["a", "b"], rank=4)
    with torch.no_grad():
        after = model(ids, routes=torch.tensor([[0, 1, 0, 1, -1, 0]])).logits
    torch.testing.assert_close(after, before, atol=0, rtol=0)  # B = 0: each layer adds exact zeros
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert adapter_specs(model)["a"].alpha == 8.0  # alpha defaults to 2 * rank


def test_adapters_can_be_added_in_two_calls_and_to_some_modules(tiny):
    model, _ = tiny
    rolerl.add_adapters(model, "a", rank=4)
    rolerl.add_adapters(model, "b", rank=2, target_modules=["q_proj", "v_proj"])
    paths = {p.rsplit(".", 1)[-1] for p, layer in routed_layers(model) if "b" in layer.lora_A}
    assert paths == {"q_proj", "v_proj"}
    randomize_adapters(model)
    ids = torch.randint(0, model.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(11))
    route = torch.tensor([[0, 1, 1, -1, 0], [1, 1, 0, 0, -1]])
    with torch.no_grad():
        fast = model(ids, routes=route).logits
        slow = _reference_model_logits(model, ids, route)
    # per-token reference vs stacked matmuls: another summation order in 14 routed layers, ~5 ulps of the
    # largest logit measured (an absolute 1e-5 passed by 20%)
    assert_close_ulps(fast, slow, ulps=64)


# ---- bad input ----------------------------------------------------------------------------------------


def test_route_index_with_no_adapter_is_rejected(routed):
    model, _ = routed
    ids = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match=r"route index 4 has no adapter; allowed: -1 .* 0\.\.3"):
        model(ids, routes=torch.tensor([[0, 1, 4, 0]]))
    with pytest.raises(ValueError, match="route index -2 has no adapter"):
        model(ids, routes=torch.tensor([[0, -2, 1, 0]]))
    with pytest.raises(KeyError, match="unknown adapter 'nope'.*'reason'"), rolerl.routes(model, "nope"):
        pass
    with pytest.raises(ValueError, match="route index 9"), rolerl.routes(model, 9):
        pass


def test_route_of_wrong_shape_is_rejected(routed):
    model, _ = routed
    with pytest.raises(
        ValueError, match=r"route shape \(1, 3\) does not match the input's \(B, T\) = \(1, 4\)"
    ):
        model(torch.zeros(1, 4, dtype=torch.long), routes=torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\(B, T\) integer tensor"):
        model(torch.zeros(1, 4, dtype=torch.long), routes=torch.zeros(4))
    # the failed calls left no route behind
    assert model._rolerl_route_state.route == -1


def test_targets_matching_nothing_are_rejected(tiny):
    model, _ = tiny
    with pytest.raises(ValueError, match=r"matches no linear layer.*allowed: 'all-linear'.*'q_proj'"):
        rolerl.add_adapters(model, "a", target_modules=["attn.qkv"])
    with pytest.raises(ValueError, match="matches no linear layer"):
        rolerl.add_adapters(model, "a", target_modules="lm_head")


def test_routes_without_adapters_and_duplicate_names_are_rejected(tiny):
    model, _ = tiny
    with pytest.raises(ValueError, match="no rolerl adapters"), rolerl.routes(model, 0):
        pass
    rolerl.add_adapters(model, "a")
    with pytest.raises(ValueError, match="'a' is taken"):
        rolerl.add_adapters(model, "a")


@pytest.mark.parametrize("uniform", [False, True])
def test_rollout_weight_cache_follows_every_update(tiny, uniform):
    """Without grad the stacked A/B are cached (one adapter on every token: with its scaling folded into B);
    an in-place update (optimizer step, load) must show."""
    model, _ = tiny
    rolerl.add_adapters(model, ["a", "b"], rank=2)
    ids = torch.randint(0, model.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(12))
    route = torch.tensor([[0, 1, 1, -1, 0], [1, 0, 0, 1, -1]])
    if uniform:
        route = torch.ones_like(route)
    with torch.no_grad():
        before = model(ids, routes=route).logits
    randomize_adapters(model, seed=13)  # in place, as an optimizer step
    with torch.no_grad():
        cached = model(ids, routes=route).logits
        with rolerl.routes(model, 1):
            model(ids)  # another layout in between
        again = model(ids, routes=route).logits
    fresh = model(ids, routes=route).logits.detach()  # grad enabled: no cache
    assert not torch.allclose(before, cached)
    if uniform:  # (A x) (s B) vs (s A x) B: equal up to float rounding
        torch.testing.assert_close(cached, fresh, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(again, fresh, rtol=1e-5, atol=1e-5)
    else:  # the cached and the fresh stack are the same cat of the same weights, then the same ops
        assert torch.equal(cached, fresh) and torch.equal(again, fresh)


@pytest.mark.parametrize("pattern", ["random", "contiguous"])
def test_gather_implementation_equals_masked(routed, pattern, monkeypatch):
    """The gather/index_add alternative (kept for benchmarking) gives the masked path's logits and grads."""
    model, _ = routed
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(14))
    route = route_patterns(2, 9, pattern, seed=15)
    results = []
    for impl in ("masked", "gather"):
        monkeypatch.setattr(RoutedLoRALinear, "impl", impl)
        model.zero_grad(set_to_none=True)
        logits = model(ids, routes=route).logits
        logits.square().mean().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((logits.detach(), grads))
    (a, ga), (b, gb) = results
    torch.testing.assert_close(a, b, atol=1e-5 * a.abs().max(), rtol=1e-5)
    assert ga.keys() == gb.keys() and ga
    for name in ga:
        torch.testing.assert_close(ga[name], gb[name], atol=1e-4 * ga[name].abs().max(), rtol=1e-4)


@pytest.mark.parametrize("route", ["uniform", "mixed"])
@pytest.mark.parametrize("x_grad", [True, False])
def test_training_node_equals_autograd_composition_in_float64(route, x_grad):
    """`_LoRALinear` (training's forward as one node: the adapter accumulated into the base GEMM's output,
    its input gradient into the base's) gives autograd's values and gradients through `base(x) + delta`,
    in float64; an input without grad gets none, a base unfrozen by hand keeps autograd's path."""
    g = torch.Generator().manual_seed(21)
    state = RouteState({"r": AdapterSpec("r", 4, 8.0), "t": AdapterSpec("t", 2, 3.0)})
    layer = RoutedLoRALinear(torch.nn.Linear(12, 7, bias=True), state)
    for spec in state.adapters.values():
        layer.add_adapter(spec)
    with torch.no_grad():
        for p in [*layer.lora_A.values(), *layer.lora_B.values()]:
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))
    layer.double()
    routes = torch.randint(-1, 2, (3, 5), generator=g) if route == "mixed" else 0
    state.set(routes)
    x = torch.randn(3, 5, 12, generator=g, dtype=torch.float64).requires_grad_(x_grad)
    probe = torch.randn(3, 5, 7, generator=g, dtype=torch.float64)

    def run(fused: bool):
        layer.zero_grad(set_to_none=True)
        x.grad = None
        y = layer(x) if fused else layer._add_adapters(x, layer.base_layer(x))
        (y * probe).sum().backward()
        grads = {n: p.grad for n, p in layer.named_parameters() if p.grad is not None}
        return y.detach(), grads, x.grad

    y_fused, g_fused, x_fused = run(True)
    y_plain, g_plain, x_plain = run(False)
    torch.testing.assert_close(y_fused, y_plain, rtol=1e-12, atol=1e-12)
    assert g_fused.keys() == g_plain.keys()
    used = {"r"} if route == "uniform" else {"r", "t"}
    assert {n.split(".")[1] for n in g_fused} == used  # lora_A.<name> / lora_B.<name>: used adapters only
    for name in g_plain:
        torch.testing.assert_close(g_fused[name], g_plain[name], rtol=1e-12, atol=1e-12)
    if x_grad:
        torch.testing.assert_close(x_fused, x_plain, rtol=1e-12, atol=1e-12)
    else:
        assert x_fused is None and x_plain is None
    node = type(layer(x).grad_fn).__name__
    assert node == "_LoRALinearBackward", node  # the fused node ran (not a fallback)
    layer.base_layer.weight.requires_grad_(True)  # unfrozen by hand: the fused node would drop its gradient
    layer(x).sum().backward()
    assert layer.base_layer.weight.grad is not None


def test_training_node_under_bf16_autocast_keeps_one_input_copy_and_no_weight_copy():
    """Under CPU bf16 autocast the training node computes in bf16 as autocast's composition does (values and
    gradients within bf16 rounding), while keeping for backward one bf16 copy of an input that three layers
    read (q/k/v) and no bf16 copy of any weight; autocast's composition keeps a copy of the input per op
    and a copy of each weight."""
    g = torch.Generator().manual_seed(5)
    state = RouteState({"r": AdapterSpec("r", 4, 8.0), "t": AdapterSpec("t", 2, 3.0)})
    layers = [RoutedLoRALinear(torch.nn.Linear(48, 24, bias=False), state) for _ in range(3)]
    for layer in layers:
        for spec in state.adapters.values():
            layer.add_adapter(spec)
        with torch.no_grad():
            for p in [*layer.lora_A.values(), *layer.lora_B.values()]:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    state.set(torch.randint(-1, 2, (2, 16), generator=g))
    x0 = torch.randn(2, 16, 48, generator=g).requires_grad_()
    probes = [torch.randn(2, 16, 24, generator=g) for _ in layers]

    def run(fused: bool):
        for layer in layers:
            layer.zero_grad(set_to_none=True)
        x0.grad, saved = None, []
        hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t)
        with hooks, torch.autocast("cpu", dtype=torch.bfloat16):
            x = x0 * 1.0  # a non-leaf input, as a norm's output is
            ys = [layer(x) if fused else layer._add_adapters(x, layer.base_layer(x)) for layer in layers]
        sum((y.float() * p).sum() for y, p in zip(ys, probes, strict=True)).backward()
        grads = {f"{i}.{n}": p.grad for i, layer in enumerate(layers) for n, p in layer.named_parameters()}
        return ys, {n: v for n, v in grads.items() if v is not None}, x0.grad, saved

    ys_fused, g_fused, x_fused, saved_fused = run(True)
    ys_plain, g_plain, x_plain, saved_plain = run(False)
    assert {type(y.grad_fn).__name__ for y in ys_fused} == {"_LoRALinearBackward"}
    for yf, yp in zip(ys_fused, ys_plain, strict=True):
        assert yf.dtype == yp.dtype == torch.bfloat16
        # the base GEMM rounds to bf16 on both sides; the adapter's output is added in the GEMM's fp32
        # accumulator (fused) or after its own rounding (composition): a few bf16 ulps of the largest output
        assert_close_ulps(yf.float(), yp.float(), 4, torch.bfloat16)
    assert g_fused.keys() == g_plain.keys() and g_fused
    for name in g_plain:  # bf16 products summed over 32 tokens: a few ulps of the largest gradient entry
        assert g_fused[name].dtype == torch.float32
        assert_close_ulps(g_fused[name], g_plain[name], 8, torch.bfloat16)
    assert_close_ulps(x_fused, x_plain, 8, torch.bfloat16)

    def copies(saved, like):  # bf16 tensors kept for backward of `like`'s size (views included)
        return {
            t.untyped_storage().data_ptr()
            for t in saved
            if t.dtype == torch.bfloat16 and t.numel() == like.numel()
        }

    weight = layers[0].base_layer.weight
    assert len(copies(saved_fused, weight)) == 0 and len(copies(saved_plain, weight)) == 3
    assert len(copies(saved_fused, x0)) == 1 and len(copies(saved_plain, x0)) >= 3
