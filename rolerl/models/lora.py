"""Token-routed multi-adapter LoRA.

`RoutedLoRALinear` wraps a frozen `nn.Linear` and carries K named LoRA adapters. Every token is computed
by at most one of them, chosen by a per-token route tensor `(B, T)` of adapter indices (`-1` = base only).
The route is shared by all wrapped layers of a model through one `RouteState`, set by the `routes()`
context manager or by a `routes=` keyword to the model's forward, for full passes and decode steps alike.

The forward stacks the A/B matrices of the adapters a batch actually uses into one `(R, in)` / `(out, R)`
pair and multiplies the rank activations by a per-token rank mask that also carries each adapter's
scaling (DESIGN's hint). So two rank-8 adapters that split a sequence cost the FLOPs of one rank-16
adapter, need no gather or scatter, and an adapter no token used receives no gradient at all.
Measured against a gather/index_add variant in `benchmarks/routed_lora.py`; see docs/BENCHMARKS.md.
"""

from __future__ import annotations

import math
import re
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.autograd.function import once_differentiable
from torch.nn import functional as F

from rolerl.gemm import matmul

RouteLike = torch.Tensor | int | str | None


@dataclass
class AdapterSpec:
    """Hyper-parameters of one adapter; identical on every layer it is injected into."""

    name: str
    rank: int
    alpha: float
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=list)  # the module paths it was injected into

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


class RouteState:
    """The current route of one model, shared by all its `RoutedLoRALinear` layers.

    Analysing the route (which adapters are used, the per-token rank mask) happens once per forward
    here rather than once per layer: the rank layout is the same in every layer that carries the
    same adapters, so the mask is built once per layout and reused.
    """

    def __init__(self, adapters: dict[str, AdapterSpec]) -> None:
        self.adapters = adapters  # name -> spec, in index order (the index is the route value)
        self.route: torch.Tensor | int = -1  # (B, T) long tensor, or one index for every token
        self._used: list[int] | None = None
        self._uniform = False
        self._masks: dict[tuple[int, ...], torch.Tensor] = {}
        self.saved: list[tuple | None] = []  # snapshots taken by the forward hooks, restored after the call
        self._cast: tuple | None = None  # (weakref to an input, its version, weakref to its autocast copy)

    @property
    def names(self) -> list[str]:
        return list(self.adapters)

    def set(self, route: RouteLike) -> None:
        self.route = self.resolve(route)
        self._used, self._uniform, self._masks = None, False, {}

    def plan(self, carried: tuple[str, ...]) -> tuple[list[int], list[AdapterSpec], bool] | None:
        """For a layer carrying adapters `carried`: `(used indices, their specs, uniform)` under the current
        route, or None when none of them is used. Computed once per route and layer kind, not per call
        (a decode step calls every wrapped layer: ~200 calls on a 30-layer model)."""
        key = ("plan", carried)
        if key not in self._masks:
            names = self.names
            used = [i for i in self.used() if names[i] in carried]
            specs = [self.adapters[names[i]] for i in used]
            self._masks[key] = (used, specs, self.uniform()) if used else None
        return self._masks[key]

    def snapshot(self) -> tuple:
        return self.route, self._used, self._uniform, self._masks

    def cast(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`x.to(dtype)` for a training forward under autocast, made once per input: q/k/v (gate/up) read
        the same input, and the copy made for the first serves the others, so autograd keeps one copy
        instead of one per layer (autocast casts per op). Held by weak references only: the copy lives as
        long as the layers that saved it for backward."""
        if self._cast is not None:
            source, version, copy = self._cast
            out = copy()
            if source() is x and version == x._version and out is not None and out.dtype == dtype:
                return out
        out = x.to(dtype)
        self._cast = (weakref.ref(x), x._version, weakref.ref(out))
        return out

    def restore(self, snapshot: tuple) -> None:
        self.route, self._used, self._uniform, self._masks = snapshot

    def resolve(self, route: RouteLike) -> torch.Tensor | int:
        """Turn a name, an index or a tensor into a validated route."""
        names = self.names
        allowed = f"-1 (base only) or 0..{len(names) - 1} = {names}" if names else "-1 (no adapters yet)"
        if route is None:
            return -1
        if isinstance(route, str):
            if route not in self.adapters:
                raise KeyError(f"unknown adapter {route!r}; adapters on this model: {names}")
            return names.index(route)
        if isinstance(route, int):
            if not -1 <= route < len(names):
                raise ValueError(f"route index {route} has no adapter; allowed: {allowed}")
            return route
        if not isinstance(route, torch.Tensor) or route.dtype.is_floating_point or route.dim() != 2:
            got = f"{type(route).__name__} {getattr(route, 'dtype', '')} {tuple(getattr(route, 'shape', ()))}"
            raise ValueError(f"route must be an int, an adapter name or a (B, T) integer tensor; got {got}")
        if route.numel():
            lo, hi = int(route.min()), int(route.max())
            if lo < -1 or hi >= len(names):
                bad = lo if lo < -1 else hi
                raise ValueError(f"route index {bad} has no adapter; allowed: {allowed}")
        return route.long()

    def used(self) -> list[int]:
        """Indices of the adapters at least one token is routed to, sorted (one host sync per forward)."""
        if self._used is None:
            if isinstance(self.route, int):
                self._used, self._uniform = ([], False) if self.route < 0 else ([self.route], True)
            else:
                values = torch.unique(self.route).tolist()
                self._used = [i for i in values if i >= 0]
                self._uniform = len(values) == 1 and values[0] >= 0
        return self._used

    def uniform(self) -> bool:
        """True when every token goes to the same adapter (no mask needed: the plain LoRA path)."""
        self.used()
        return self._uniform

    def positions(self, index: int, device: torch.device) -> torch.Tensor:
        """Flat positions routed to adapter `index` (for the gather implementation)."""
        key = ("pos", index, device)
        if key not in self._masks:
            self._masks[key] = (self.route.reshape(-1) == index).nonzero().squeeze(1).to(device)
        return self._masks[key]

    def terms(self, rows: int, merged: int | None = None) -> tuple[torch.Tensor, ...] | None:
        """Per row of a forward (one token each) the adapters to add and their factors, for the native
        kernel: `(rows, 2)` route indices (-1 = none), `(rows, 2)` fp32 factors and the rows ordered by
        terms (rows with the same adapters then share a pass over its matrices). A token adds its own
        adapter with its scaling; where adapter `merged` is in the base weights, a token routed elsewhere also
        adds it with -scaling and a token routed to it adds nothing. None when no token adds anything."""
        key = ("terms", rows, merged)
        if key not in self._masks:
            route = self.route
            own = route.reshape(-1).cpu() if isinstance(route, torch.Tensor) else torch.full((rows,), route)
            if merged is None:
                terms = torch.stack([own, torch.full_like(own, -1)], 1)
            else:  # the merged weights serve its own tokens; every other token takes it out again
                served = own == merged
                terms = torch.stack([torch.where(served, -1, own), torch.where(served, -1, merged)], 1)
            scalings = torch.tensor([s.scaling for s in self.adapters.values()] + [0.0])  # [-1]: none
            factors = scalings[terms]
            factors[:, 1].neg_()
            order = group_rows(terms)
            self._masks[key] = (terms.contiguous(), factors, order) if bool((terms >= 0).any()) else None
        return self._masks[key]

    def mask(
        self,
        layout: tuple[int, ...],
        ranks: Sequence[int],
        scalings: Sequence[float],
        like: torch.Tensor,
        merged: int | None = None,
    ):
        """Per-token rank mask `(N, R)`: `scaling_k` on the ranks of the token's adapter, 0 elsewhere.
        `merged`: that adapter's weights are already in the base weight (the rollout engine's packed copy),
        so its ranks carry `-scaling` on every token routed elsewhere and 0 on its own tokens."""
        key = (*layout, like.dtype, like.device, merged)
        if key not in self._masks:
            route = self.route
            route = (
                route.reshape(-1).to(like.device)
                if isinstance(route, torch.Tensor)
                else torch.tensor([route], device=like.device)  # one route for every token
            )
            # the counts on the activations' device: CUDA's index_select refuses CPU ones
            repeats = torch.tensor(ranks, device=like.device)
            owner = torch.repeat_interleave(torch.tensor(layout, device=like.device), repeats)
            scale = torch.repeat_interleave(torch.tensor(scalings, device=like.device), repeats)
            hit = route[:, None] == owner[None, :]  # (N, R)
            zero = torch.zeros((), dtype=like.dtype, device=like.device)
            mask = torch.where(hit, scale.to(like.dtype), zero)
            if merged is not None:
                mask = mask - torch.where(owner == merged, scale.to(like.dtype), zero)
            self._masks[key] = mask
        return self._masks[key]


def group_rows(terms: torch.Tensor) -> torch.Tensor:
    """The rows of `terms` `(rows, 2)` (adapter indices, -1 = none) ordered so that rows with equal terms are
    next to each other, in their original order within a group (for `rolerl.rollout.native`'s kernel)."""
    if not terms.numel():
        return torch.zeros(0, dtype=torch.int64)
    return torch.argsort((terms[:, 0] + 1) * (int(terms.max()) + 2) + terms[:, 1] + 1, stable=True)


class RoutedLoRALinear(nn.Module):
    """A frozen linear layer plus named LoRA adapters selected per token by the model's `RouteState`."""

    impl = "masked"  # or "gather"; chosen by benchmarks/routed_lora.py (docs/BENCHMARKS.md)

    def __init__(self, base_layer: nn.Linear, state: RouteState) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.state = state
        self.lora_A = nn.ParameterDict()  # name -> (r, in)
        self.lora_B = nn.ParameterDict()  # name -> (out, r)
        self.lora_dropout = nn.ModuleDict()
        self.__dict__["_carried"] = ()  # the adapters on this layer (none yet: preset none wraps with none)
        base_layer.weight.requires_grad_(False)
        if base_layer.bias is not None:
            base_layer.bias.requires_grad_(False)

    @property
    def in_features(self) -> int:
        return self.base_layer.in_features

    @property
    def out_features(self) -> int:
        return self.base_layer.out_features

    def add_adapter(self, spec: AdapterSpec) -> None:
        """PEFT's default init: A kaiming-uniform(a=sqrt(5)), B zero, so a fresh adapter is the identity."""
        w = self.base_layer.weight
        a = torch.empty(spec.rank, self.in_features, dtype=torch.float32, device=w.device)
        nn.init.kaiming_uniform_(a, a=math.sqrt(5))
        b = torch.zeros(self.out_features, spec.rank, dtype=torch.float32, device=w.device)
        self.lora_A[spec.name] = nn.Parameter(a)
        self.lora_B[spec.name] = nn.Parameter(b)
        self.lora_dropout[spec.name] = nn.Dropout(spec.dropout) if spec.dropout > 0 else nn.Identity()
        # the adapters on this layer, as a plain attribute (read on every call: the hot path)
        self.__dict__["_carried"] = tuple(self.lora_A)
        self.__dict__.pop("_stack_cache", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            fused = self._fused_train(x)
            if fused is not None:
                return fused
        return self._add_adapters(x, self.base_layer(x))

    def _fused_train(self, x: torch.Tensor) -> torch.Tensor | None:
        """Training's forward as one autograd node (`_LoRALinear`), or None where it does not apply (dropout,
        the gather implementation, no adapter used, a dtype other than the weights' or autocast's). Under
        autocast the node computes in autocast's dtype, as autocast would, with one copy of the input per
        fused input (`RouteState.cast`) and none of the weight kept for backward."""
        plan = self.state.plan(self._carried)
        if plan is None or self.impl != "masked":
            return None
        used, specs, uniform = plan
        w, bias = self.base_layer.weight, self.base_layer.bias
        if any(s.dropout > 0 for s in specs) or w.requires_grad:
            return None  # (a base unfrozen by hand keeps autograd's path: this node gives W no gradient)
        if bias is not None and bias.requires_grad:
            return None
        dtype = w.dtype
        if torch.is_autocast_enabled(x.device.type):
            dtype = torch.get_autocast_dtype(x.device.type)
            if x.dtype != dtype and x.dtype == torch.float32 and w.dtype in (torch.float32, dtype):
                x = self.state.cast(x, dtype)
        if x.dtype != dtype or w.dtype not in (torch.float32, dtype):
            return None
        if isinstance(self.state.route, torch.Tensor) and self.state.route.shape != x.shape[:-1]:
            return None  # _add_adapters raises the error that names the shapes
        a, b = self._stacked(tuple(s.name for s in specs), dtype)  # (R, in), (out, R): differentiable
        if uniform:
            mask = torch.full((1, a.shape[0]), specs[0].scaling, dtype=x.dtype, device=x.device)
        else:
            mask = self.state.mask(tuple(used), [s.rank for s in specs], [s.scaling for s in specs], x)
        return _LoRALinear.apply(x, w, bias, a, b, mask)

    def adapt_(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Add the routed adapters' output for input `x` to `y` (this layer's base output, possibly a view
        into a wider one: the rollout engine runs q/k/v as one GEMM), in place. Without autograd only."""
        out = self._add_adapters(x, y)
        if out is not y:
            y.copy_(out)
        return y

    def _add_adapters(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        state = self.state
        plan = state.plan(self._carried)
        if plan is None:
            return y
        used, specs, uniform = plan
        if isinstance(state.route, torch.Tensor) and state.route.shape != x.shape[:-1]:
            raise ValueError(
                f"route shape {tuple(state.route.shape)} does not match the input's (B, T) = "
                f"{tuple(x.shape[:-1])}; pass one route per token"
            )
        if uniform:
            if not torch.is_grad_enabled() and specs[0].dropout == 0:
                a, b = self._stacked((specs[0].name,), x.dtype, scaled=specs[0].scaling)
                return y.add_(F.linear(F.linear(x, a), b).to(y.dtype))  # rollout: no autograd, in place
            return y + self._one_adapter(x, specs[0]).to(y.dtype)
        if self.impl == "gather":
            return self._gather(x, y, used, specs)
        delta = self._masked(x, used, specs).to(y.dtype)
        return y + delta if torch.is_grad_enabled() else y.add_(delta)

    def _one_adapter(self, x: torch.Tensor, spec: AdapterSpec) -> torch.Tensor:
        a, b = self._stacked((spec.name,), x.dtype)
        h = F.linear(self.lora_dropout[spec.name](x), a) * spec.scaling  # (B, T, r)
        return F.linear(h, b)

    def _masked(self, x: torch.Tensor, used: list[int], specs: list[AdapterSpec]) -> torch.Tensor:
        names = tuple(s.name for s in specs)
        a, b = self._stacked(names, x.dtype)  # (R, in), (out, R)
        if any(s.dropout > 0 for s in specs):
            # Each adapter sees its own dropout of x (as in PEFT); with dropout 0 (the default) one shared x.
            h = torch.cat([F.linear(self.lora_dropout[n](x), self.lora_A[n].to(x.dtype)) for n in names], -1)
        else:
            h = F.linear(x, a)  # (B, T, R)
        mask = self.state.mask(tuple(used), [s.rank for s in specs], [s.scaling for s in specs], h)
        return F.linear(h * mask.view(*h.shape), b)  # (B, T, out)

    def _stacked(
        self, names: tuple[str, ...], dtype: torch.dtype, scaled: float | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The adapters' A stacked by rows and B by columns, in the activation dtype (fp32 master weights:
        cast the small matrices, not the activations); `scaled` folds one adapter's scaling into B. Without
        grad (rollout) the result is cached until a weight changes (tracked by tensor versions), saving two
        cats and casts per layer per decode step."""
        if torch.is_grad_enabled():
            return _stack(
                [self.lora_A[n] for n in names] + [self.lora_B[n] for n in names], len(names), dtype
            )
        cached = self.__dict__.get("_stack_cache")
        if cached is not None and cached[0] == (names, dtype, scaled):
            params, state, result = cached[1:]
            if state == [(p._version, p.data_ptr()) for p in params]:
                return result
        params = [self.lora_A[n] for n in names] + [self.lora_B[n] for n in names]
        a, b = _stack(params, len(names), dtype)
        result = (a, b if scaled is None else b * scaled)
        state = [(p._version, p.data_ptr()) for p in params]
        self.__dict__["_stack_cache"] = ((names, dtype, scaled), params, state, result)
        return result

    def _gather(
        self, x: torch.Tensor, y: torch.Tensor, used: list[int], specs: list[AdapterSpec]
    ) -> torch.Tensor:
        """Alternative kept for measurement: gather each adapter's tokens, LoRA them, scatter-add back."""
        flat_x, out = x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1])
        for index, spec in zip(used, specs, strict=True):
            pos = self.state.positions(index, x.device)
            delta = self._one_adapter(flat_x.index_select(0, pos), spec).to(y.dtype)
            out = out.index_add(0, pos, delta)
        return out.view_as(y)

    def extra_repr(self) -> str:
        return f"adapters={list(self.lora_A)}"


class _LoRALinear(torch.autograd.Function):
    """`y = x W^T + bias + ((x A^T) * mask) B^T` with a frozen `W` and `bias`, as one autograd node.

    The same GEMMs as autograd runs through `base_layer(x) + delta`, without the elementwise passes around
    them: the adapter's output accumulates into the base output inside the second GEMM (`addmm_`), and in
    backward the adapter's input gradient into the base's (`addmm_`), instead of an add of two `(N, out)`
    (`(N, in)`) tensors each. `mask` is `(N, R)` per token (routes mixing adapters, scalings included) or
    `(1, R)` (one adapter for every token: its scaling). Saved for backward: `x` (alive anyway) and the
    `(N, R)` rank activations. A weight in another dtype than `x` (fp32 under bf16 autocast) is cast for
    each GEMM and not kept: backward casts it again. The input gradient's GEMM `dy W` is `rolerl.gemm`'s
    (oneDNN's in fp32 on CPU); the forward's stays `F.linear`, the op of the layer's forward without
    autograd and of the plain model, so that values computed with and without grad are equal bit for bit."""

    @staticmethod
    def forward(ctx, x, weight, bias, a, b, mask):
        x2 = x.reshape(-1, x.shape[-1])  # (N, in)
        h = (x2 @ a.T).mul_(mask)  # (N, R) rank activations, scaled and routed
        y = F.linear(x2, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))  # (N, out)
        y.addmm_(h, b.T)
        ctx.save_for_backward(x, weight, a, b, mask, h)  # x itself, not a view: `RouteState.cast` tracks it
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x, weight, a, b, mask, h = ctx.saved_tensors
        x2 = x.reshape(-1, x.shape[-1])
        g = grad.reshape(-1, grad.shape[-1]).to(x.dtype)  # (N, out)
        gb = g.T @ h if ctx.needs_input_grad[4] else None  # (out, R)
        gh = (g @ b).mul_(mask)  # (N, R)
        ga = gh.T @ x2 if ctx.needs_input_grad[3] else None  # (R, in)
        gx = None
        if ctx.needs_input_grad[0]:
            gx = matmul(g, weight.to(x.dtype)).addmm_(gh, a).view(x.shape)  # (N, in)
        return gx, None, None, ga, gb, None


class FusedAdapters:
    """The routed adapters of layers whose base outputs are columns of one fused GEMM (the rollout engine's
    q/k/v and gate/up, `rolerl.rollout.decoder`), applied as one pair of GEMMs: `y += (x A^T * mask) B^T`
    with the layers' A stacked by rows and each layer's B in its own rows of a block matrix. Per layer that
    is `adapt_`'s arithmetic (a zero block adds exact zeros); per step it is 2 small GEMMs and one add per
    group instead of 2 and one per layer. Without autograd only; stacked weights are cached until a
    weight changes (tensor versions).

    `merged`: the adapter whose weights the base weights already hold (`PackedLinears.merge_adapter`): a
    forward whose tokens all use it adds nothing, any other token subtracts it and adds its own."""

    def __init__(self, members: Sequence[tuple[RoutedLoRALinear, int, int]], width: int) -> None:
        self.members = list(members)  # (layer, first column, end column) in the fused output
        self.width = width  # the fused output's columns
        self._cache: tuple | None = None
        self._tables: list | None = None  # [adapters carried, params, versions, the kernel's tables]

    def add_(self, x: torch.Tensor, y: torch.Tensor, merged: int | None = None, native=None) -> torch.Tensor:
        """Add the routed adapters' output for input `x` to the fused output `y` (..., width) in place.
        `native`: this forward's step of a native kernel (`rolerl.rollout.native.NativeStep`, made for
        `merged`), which adds them row by row, each row through its own adapter only; torch's GEMMs where
        it does not apply (an adapter with dropout, an input of other rows or layout than the step's)."""
        if not self.members:
            return y
        state = self.members[0][0].state
        if native is not None and native.fits(x, y):
            if native.terms is None:
                return y  # no row adds or takes out anything
            tables = self._native_tables(native.kernel, state)
            if tables is not None:
                native.add_(x, y, tables)
                return y
        plans = []
        for m, lo, hi in self.members:
            plan = m.state.plan(m._carried)
            used, specs = list(plan[0]) if plan else [], list(plan[1]) if plan else []
            if merged is not None and state.names[merged] in m._carried and merged not in used:
                used, specs = [*used, merged], [*specs, state.adapters[state.names[merged]]]  # to subtract
            if used:
                plans.append((m, lo, hi, used, specs))
        uniform = state.uniform()
        if not plans or (merged is not None and uniform and state.used() == [merged]):
            return y
        if any(s.dropout > 0 for *_, specs in plans for s in specs):
            if merged is not None:
                raise RuntimeError("an adapter with dropout cannot be merged into the base weights")
            for m, lo, hi, *_ in plans:  # each adapter's own dropout of x: the layers one by one
                m.adapt_(x, y[..., lo:hi])
            return y
        if isinstance(state.route, torch.Tensor) and state.route.shape != x.shape[:-1]:
            raise ValueError(
                f"route shape {tuple(state.route.shape)} does not match the input's (B, T) = "
                f"{tuple(x.shape[:-1])}; pass one route per token"
            )
        plain = uniform and merged is None  # one adapter on every token: its scaling folded into B
        a, b = self._stacked(plans, x.dtype, plain)
        h = F.linear(x, a)  # (..., R): every layer's ranks of every adapter it adds
        if not plain:
            layout = [(i, spec) for *_, used, specs in plans for i, spec in zip(used, specs, strict=True)]
            mask = state.mask(
                tuple(i for i, _ in layout), [s.rank for _, s in layout], [s.scaling for _, s in layout], h,
                merged=merged,
            )  # fmt: skip
            h = h * (mask.view(*h.shape) if mask.shape[0] == h[..., 0].numel() else mask[0])
        return y.add_(F.linear(h, b).to(y.dtype))

    def release(self) -> None:
        """Free the cached stacked weights and the native kernel's tables (built again when next used)."""
        self._cache = self._tables = None

    def _native_tables(self, kernel, state: RouteState):
        """The kernel's tables of every adapter the members carry (slot = route index), in fp32, rebuilt
        when a weight or the adapters change; None where one of them has dropout."""
        carried = (len(state.adapters), *(m._carried for m, _, _ in self.members))  # slots: route indices
        cache = self._tables
        if cache is None or cache[0] != carried:
            if any(state.adapters[n].dropout > 0 for m, _, _ in self.members for n in m._carried):
                self._tables = [carried, None, None, None]  # remembered: not checked again per call
                return None
            params = [p for m, _, _ in self.members for n in m._carried for p in (m.lora_A[n], m.lora_B[n])]
            cache = self._tables = [carried, params, None, None]
        if cache[1] is None:
            return None
        versions = [(p._version, p.data_ptr()) for p in cache[1]]
        if cache[2] != versions:
            index = {name: i for i, name in enumerate(state.names)}
            layers = [
                (lo, hi, {index[n]: (m.lora_A[n], m.lora_B[n]) for n in m._carried})
                for m, lo, hi in self.members
            ]
            in_features = self.members[0][0].in_features
            cache[2:] = [versions, kernel.tables(layers, len(index), in_features, self.width)]
        return cache[3]

    def _stacked(self, plans, dtype: torch.dtype, scaled: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """`A (R, in)` and the block matrix `B (width, R)`; `scaled`: the one adapter's scaling in B."""
        key = (tuple((id(m), tuple(used)) for m, _, _, used, _ in plans), dtype, scaled)
        params = [
            p for m, _, _, _, specs in plans for s in specs for p in (m.lora_A[s.name], m.lora_B[s.name])
        ]
        versions = [(p._version, p.data_ptr()) for p in params]
        if self._cache is not None and self._cache[:2] == (key, versions):
            return self._cache[2]
        blocks_a, placed, rank = [], [], 0
        for m, lo, hi, _, specs in plans:
            for s in specs:
                blocks_a.append(m.lora_A[s.name].detach().to(dtype))
                placed.append((lo, hi, rank, s, m.lora_B[s.name].detach().to(dtype)))
                rank += s.rank
        a = torch.cat(blocks_a)
        b = torch.zeros(self.width, rank, dtype=dtype, device=a.device)
        for lo, hi, at, s, weight in placed:
            b[lo:hi, at : at + s.rank] = weight * s.scaling if scaled else weight  # as `_stacked`
        self._cache = (key, versions, (a, b))
        return a, b


def merged_delta(layer: RoutedLoRALinear, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`scaling * B @ A` of adapter `name` on `layer` `(out, in)`: what merging it adds to the base weight,
    computed in `dtype` (default: the adapter's)."""
    spec = layer.state.adapters[name]
    a, b = layer.lora_A[name].detach(), layer.lora_B[name].detach()
    return (b.to(dtype or b.dtype) * spec.scaling) @ a.to(dtype or a.dtype)


def _stack(params: list[torch.Tensor], k: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    a = torch.cat(params[:k]) if k > 1 else params[0]
    b = torch.cat(params[k:], 1) if k > 1 else params[k]
    return a.to(dtype), b.to(dtype)


# ---------------------------------------------------------------------------------------------------------
# Injection into a model


def _state(model: nn.Module) -> RouteState | None:
    return getattr(model, "_rolerl_route_state", None)


def routed_layers(model: nn.Module) -> Iterator[tuple[str, RoutedLoRALinear]]:
    for name, module in model.named_modules():
        if isinstance(module, RoutedLoRALinear):
            yield name, module


def adapter_specs(model: nn.Module) -> dict[str, AdapterSpec]:
    """The adapters of a model, name -> spec, in route-index order."""
    state = _state(model)
    return dict(state.adapters) if state else {}


def adapter_parameters(model: nn.Module) -> dict[int, list[nn.Parameter]]:
    """Route index -> that adapter's parameters (A and B of every layer it wraps), in a fixed order."""
    names = list(adapter_specs(model))
    out: dict[int, list[nn.Parameter]] = {i: [] for i in range(len(names))}
    for _, layer in routed_layers(model):
        for i, name in enumerate(names):
            if name in layer.lora_A:
                out[i] += [layer.lora_A[name], layer.lora_B[name]]
    return out


def named_adapter_parameters(
    model: nn.Module, names: Sequence[str] | None = None
) -> Iterator[tuple[str, nn.Parameter]]:
    """`(parameter path, parameter)` of the LoRA weights of `model` (`<layer>.lora_A.<adapter>` and
    `lora_B`), of the adapters `names` only (None: every adapter): what a copy of the model is synced by."""
    for path, p in model.named_parameters():
        if ".lora_" in path and (names is None or path.rsplit(".", 1)[-1] in names):
            yield path, p


def _candidate_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """Linear layers inside the decoder blocks (never the LM head or the embeddings)."""
    out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    found = {}
    for name, module in model.named_modules():
        if isinstance(module, RoutedLoRALinear):
            found[name] = module.base_layer
        elif isinstance(module, nn.Linear) and module is not out_emb and ".base_layer" not in name:
            found[name] = module
    return {n: m for n, m in found.items() if not n.endswith("lm_head")}


def match_targets(model: nn.Module, target_modules: str | Sequence[str] | None) -> list[str]:
    """Module paths matched by PEFT-style targets.

    `None` or "all-linear": every linear layer of the decoder blocks. A string: a regex that must match
    the whole module path (PEFT's rule). A list: names that equal a path or end it after a dot.
    """
    candidates = _candidate_linears(model)
    if target_modules is None or target_modules == "all-linear":
        matched = list(candidates)
    elif isinstance(target_modules, str):
        matched = [n for n in candidates if re.fullmatch(target_modules, n)]
    else:
        targets = list(target_modules)
        matched = [n for n in candidates if any(n == t or n.endswith("." + t) for t in targets)]
    if not matched:
        leaves = sorted({n.rsplit(".", 1)[-1] for n in candidates})
        raise ValueError(
            f"target_modules={target_modules!r} matches no linear layer of this model; "
            f"allowed: 'all-linear', a regex over module paths, or names such as {leaves}"
        )
    return matched


def _per_adapter(value, names: Sequence[str], what: str):
    if isinstance(value, dict):
        missing = [n for n in names if n not in value]
        if missing:
            raise ValueError(f"{what} has no entry for adapters {missing}; give a number or one per adapter")
        return [value[n] for n in names]
    return [value] * len(names)


def add_adapters(
    model: nn.Module,
    names: str | Sequence[str],
    rank: int | dict[str, int] = 8,
    alpha: float | dict[str, float] | None = None,
    target_modules: str | Sequence[str] | None = None,
    dropout: float = 0.0,
) -> nn.Module:
    """Add LoRA adapters `names` to the linear layers of `model` matched by `target_modules`.

    The base model is frozen (every parameter that is not a LoRA matrix stops requiring grad). `rank`
    and `alpha` are one value or a dict per adapter; alpha defaults to 2 * rank. Route index `i` selects
    the i-th adapter ever added, in order. Returns the same model, modified in place.
    """
    names = [names] if isinstance(names, str) else list(names)
    state = _state(model)
    if state is None:
        state = RouteState({})
        model._rolerl_route_state = state
        _install_forward_hooks(model)
    for n in names:
        if n in state.adapters or not n or not n.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"adapter name {n!r} is taken or invalid; existing: {state.names}")
    ranks = _per_adapter(rank, names, "rank")
    alphas = _per_adapter(alpha, names, "alpha")
    if not 0 <= dropout < 1:
        raise ValueError(f"dropout must be in [0, 1); got {dropout}")
    targets = match_targets(model, target_modules)
    for p in model.parameters():
        p.requires_grad_(False)
    for n, r, a in zip(names, ranks, alphas, strict=True):
        if not isinstance(r, int) or r <= 0:
            raise ValueError(f"rank of adapter {n!r} must be a positive int; got {r!r}")
        state.adapters[n] = AdapterSpec(n, r, float(2 * r if a is None else a), dropout, targets)
    for path in targets:
        layer = _wrap(model, path, state)
        for n in names:
            layer.add_adapter(state.adapters[n])
    for _, layer in routed_layers(model):
        for p in [*layer.lora_A.values(), *layer.lora_B.values()]:
            p.requires_grad_(True)
    return model


def _wrap(model: nn.Module, path: str, state: RouteState) -> RoutedLoRALinear:
    module = model.get_submodule(path)
    if isinstance(module, RoutedLoRALinear):
        return module
    parent_path, _, child = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    wrapped = RoutedLoRALinear(module, state)
    setattr(parent, child, wrapped)
    return wrapped


def _install_forward_hooks(model: nn.Module) -> None:
    """`model(input_ids, routes=...)` sets the route for that one call and restores the previous one.

    The hooks are module-level functions that find the state through the module they are called on, not
    a closure over it: `copy.deepcopy(model)` copies the hook dict but not the functions in it, so a
    closure would make the copy's `routes=` set the original's state (and pickling would fail)."""
    model.register_forward_pre_hook(_set_routes_hook, with_kwargs=True)
    model.register_forward_hook(_restore_routes_hook, with_kwargs=True, always_call=True)


def _set_routes_hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    state = _state(module)
    if "routes" not in kwargs:
        state.saved.append(None)
        return None
    state.saved.append(state.snapshot())
    state.set(kwargs.pop("routes"))
    return args, kwargs


def _restore_routes_hook(module: nn.Module, args: tuple, kwargs: dict, output):
    state = _state(module)
    previous = state.saved.pop() if state.saved else None
    if previous is not None:
        state.restore(previous)
    return output


@contextmanager
def routes(model: nn.Module, route_ids: RouteLike) -> Iterator[RouteState]:
    """Route every forward of `model` inside the block: an adapter name or index for all tokens, or a
    `(B, T)` tensor of adapter indices (`-1` = base only). Outside any block the model runs base only."""
    state = _state(model)
    if state is None:
        raise ValueError("this model has no rolerl adapters; call rolerl.add_adapters(model, names) first")
    previous = state.snapshot()
    state.set(route_ids)
    try:
        yield state
    finally:
        state.restore(previous)
