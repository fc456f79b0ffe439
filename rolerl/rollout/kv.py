"""The engine-owned KV cache, plugged into Hugging Face models through transformers' attention interface.

HF caches keep one position for the whole batch; the engine needs one length per row, so that rows can
splice tool output of different lengths and finished rows can be replaced by waiting requests. The cache
is preallocated once as `(slots, kv_heads, capacity, head_dim)` per layer and never re-grown per step
(re-allocation is a large share of HF decode time on CPU, see PERFORMANCE_NOTES).

A forward over `B` rows appends `T` new positions per row (`n_new[b] <= T`; the rest is padding whose
keys land beyond the row's length and are overwritten before anyone attends to them). Rows are slots
`0..B-1` in order for decode steps (a view of the cache, no copy), or any slot subset for prefill and
tool splicing (gathered).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from rolerl.heap import trim_heap
from rolerl.models.attention import attention_implementation
from rolerl.rollout.native import NativeKernel

ATTN_NAME = "rolerl_engine"


def attention_shape(config) -> tuple[int, int, int, int]:
    """`(layers, query heads, key/value heads, head dim)` of a (text) model config: the head dim is
    `config.head_dim` where the config has one (Qwen3), else hidden size / query heads."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return text.num_hidden_layers, text.num_attention_heads, text.num_key_value_heads, head_dim


class KVCache:
    def __init__(
        self, config, slots: int, capacity: int, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        self.layers, _, self.kv_heads, self.head_dim = attention_shape(config)
        self.slots, self.capacity, self.dtype, self.device = slots, capacity, dtype, torch.device(device)
        # one scratch column beyond `capacity` receives the keys of padding and dummy positions
        shape = (slots, self.kv_heads, capacity + 1, self.head_dim)
        # Not zeroed here: `reach` zeroes columns as forwards first read them. Zeroing all of it up front
        # touched every page of a cache sized for the longest request (0.8-1.3 s per rollout on 2 cores).
        self.k = [torch.empty(shape, dtype=dtype, device=self.device) for _ in range(self.layers)]
        self.v = [torch.empty(shape, dtype=dtype, device=self.device) for _ in range(self.layers)]
        self.zeroed = 0  # columns [0, zeroed) of every slot hold zeros or written keys/values
        self.native: NativeKernel | None = None  # the decode attention kernel (rollout.attention)

    def reach(self, columns: int) -> None:
        """Make columns `[0, columns)` safe to read: a forward reads every slot up to its longest row, and
        the masked positions of shorter rows must hold finite numbers (0 * NaN is NaN in `softmax @ v`).
        Zeroes in blocks of 64 columns, so that decode steps rarely pay for it."""
        if columns <= self.zeroed:
            return
        end = self._reach_end(columns)
        for cache in (*self.k, *self.v):
            cache[:, :, self.zeroed : end].zero_()
        self.zeroed = end

    def _reach_end(self, columns: int) -> int:
        """Where zeroing for `columns` stops: at least 64 columns past what is zeroed, at most the capacity."""
        return min(max(columns, self.zeroed + 64), self.capacity)

    @property
    def nbytes(self) -> int:
        return 2 * self.layers * self.k[0].numel() * self.k[0].element_size()

    def take_rows(self, old: KVCache, rows: int) -> None:
        """Slots `0..rows-1` of `old` into this (larger) cache, layer by layer, each of `old`'s layers freed
        once copied: the growth's peak is the larger cache plus one layer, not both caches. `old` is
        unusable afterwards. Columns `[0, old.zeroed)` are copied whole (beyond a row's length they hold
        zeros or stale keys, finite either way); this cache is zeroed as `reach(old.zeroed)` would."""
        end = self._reach_end(old.zeroed)
        for mine, theirs in ((self.k, old.k), (self.v, old.v)):
            for layer, dst in enumerate(mine):
                dst[:, :, self.zeroed : end].zero_()
                dst[:rows, :, : old.zeroed] = theirs[layer][:rows, :, : old.zeroed]
                theirs[layer] = theirs[layer].new_empty(0)
        self.zeroed = end
        trim_heap()

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy slot `src`'s first `length` positions to slot `dst` (compaction after a row finishes)."""
        for cache in (*self.k, *self.v):
            cache[dst, :, :length] = cache[src, :, :length]


class PrefixStore:
    """The keys and values of finished rows, kept so that a request continuing one (a follow-up prompt:
    the turn's exact ids, then the next message) copies the positions they share instead of computing
    them again. A multi-turn workflow otherwise prefills its whole conversation at every turn (MSARL's
    reasoner on GSM8K: ~1,100 prompt positions an episode, ~220 of them new). Any prompt reuses the
    longest start it shares with a kept row, ids and routes both (a system prompt and problem, as sibling
    calls of one role have), so the keys and values copied are exactly those its own forward would
    compute (up to the rounding of another batch's forward). Least recently used rows go first once
    more than `budget` positions are kept; nothing is valid after the weights change (`clear`)."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.entries: OrderedDict[int, _Kept] = OrderedDict()  # oldest first
        self.positions = 0
        self._next = 0

    def put(self, cache: KVCache, slot: int, ids: Sequence[int], routes: Sequence[int]) -> None:
        """Keep slot `slot`'s first `len(ids)` positions (those fed: `ids` with their `routes`)."""
        n = len(ids)
        if n < MIN_KEPT or n > self.budget:
            return
        k = torch.stack([layer[slot, :, :n] for layer in cache.k])  # (layers, kv_heads, n, head_dim)
        v = torch.stack([layer[slot, :, :n] for layer in cache.v])
        self.entries[self._next] = _Kept(tuple(ids), tuple(routes), k, v)
        self._next += 1
        self.positions += n
        while self.positions > self.budget:
            self.drop(next(iter(self.entries)))

    def match(self, ids: Sequence[int], routes: Sequence[int], limit: int) -> tuple[int, int] | None:
        """`(entry, n)`: the kept row sharing the longest start with `ids` and `routes` (the newest of
        equals), `n <= limit` positions of it, at least `MIN_KEPT`; None where none does."""
        ids, routes = tuple(ids[:limit]), tuple(routes[:limit])
        best, length = None, MIN_KEPT - 1
        for key in reversed(self.entries):
            kept, m = self.entries[key], length + 1
            if m > len(ids):
                break
            if kept.ids[:m] != ids[:m] or kept.routes[:m] != routes[:m]:
                continue  # cannot share more than the best so far: one comparison, not a search
            n = _common(kept.ids, ids, _common(kept.routes, routes, min(len(kept.ids), len(ids))))
            best, length = key, n
        return None if best is None else (best, length)

    def load(self, key: int, n: int, cache: KVCache, slot: int) -> None:
        """Entry `key`'s first `n` positions into slot `slot` (its most recent use: dropped last)."""
        kept = self.entries[key]
        self.entries.move_to_end(key)
        cache.reach(n)  # columns a later `reach` would zero: make them written-safe first
        for layer in range(cache.layers):
            cache.k[layer][slot, :, :n] = kept.k[layer, :, :n]
            cache.v[layer][slot, :, :n] = kept.v[layer, :, :n]

    def length(self, key: int) -> int:
        return len(self.entries[key].ids)

    def drop(self, key: int) -> None:
        self.positions -= len(self.entries.pop(key).ids)

    def clear(self) -> None:
        self.entries.clear()
        self.positions = 0


MIN_KEPT = 8  # starts shorter than this are not worth a lookup


@dataclass
class _Kept:
    ids: tuple[int, ...]
    routes: tuple[int, ...]
    k: torch.Tensor  # (layers, kv_heads, positions, head_dim)
    v: torch.Tensor


def _common(a: Sequence, b: Sequence, limit: int) -> int:
    """How many leading items `a` and `b` share, at most `limit`: a binary search over slice comparisons,
    which run in C (a row's few hundred positions against each kept row, every admission)."""
    lo, hi = 0, min(limit, len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while lo < hi - 1:  # a[:lo] == b[:lo], a[:hi] != b[:hi]
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if a[:mid] == b[:mid] else (lo, mid)
    return lo


@dataclass
class Batch:
    """What the attention function needs to know about the current forward."""

    cache: KVCache
    slots: torch.Tensor  # (B,) cache slot of each row
    contiguous: bool  # slots == arange(B): read the cache as a view
    lens: torch.Tensor  # (B,) positions already in the cache
    positions: torch.Tensor  # (B, T) lens[:, None] + arange(T): RoPE positions of the new tokens
    writes: torch.Tensor  # (B, T) cache column of each new key (scratch column for padding)
    kv_len: int  # max(lens + T): how much of the cache this forward reads
    mask: torch.Tensor  # (B, 1, T, kv_len) additive, in the cache dtype: 0 = attend, -inf = not


def make_batch(cache: KVCache, slots: list[int], lens: list[int], width: int, n_new: list[int]) -> Batch:
    """Row `b` appends `n_new[b] <= width` positions after its `lens[b]` cached ones; the remaining
    (padding or dummy) positions write to the scratch column `cache.capacity` and are never read."""
    device = cache.device
    slot_t = torch.tensor(slots, dtype=torch.long, device=device)
    lens_t = torch.tensor(lens, dtype=torch.long, device=device)
    n_t = torch.tensor(n_new, dtype=torch.long, device=device)
    steps = torch.arange(width, device=device)
    positions = lens_t[:, None] + steps  # (B, T) RoPE positions
    kv_len = max(max(a + b for a, b in zip(lens, n_new, strict=True)), 1)
    if kv_len > cache.capacity:
        raise RuntimeError(f"KV cache capacity {cache.capacity} exceeded ({kv_len}); raise max_len")
    cache.reach(kv_len)
    writes = torch.where(steps[None, :] < n_t[:, None], positions, cache.capacity)  # (B, T)
    keys = torch.arange(kv_len, device=device)
    # causal per row; a padding query still sees key 0, so no softmax row is empty (no NaN). Additive and
    # built once per forward: SDPA would convert a bool mask in every layer.
    hidden = keys[None, None, None, :] > positions[:, None, :, None]  # (B, 1, T, kv_len)
    mask = torch.zeros(hidden.shape, dtype=cache.dtype, device=device).masked_fill_(hidden, float("-inf"))
    contiguous = slots == list(range(len(slots)))
    return Batch(cache, slot_t, contiguous, lens_t, positions, writes, kv_len, mask)


@dataclass
class Segment:
    """One attention group of a flat forward: its rows' `Batch` and, for each of its `(B, T)` query
    positions, the token of the flat forward it takes (`index`, padding and dummies point at any token:
    their keys go to the scratch column and their outputs are dropped), and which of those positions are
    real (`real`, in flat order: the segment's tokens are `[start, start + len(real))` of the forward)."""

    batch: Batch
    index: torch.Tensor  # (B * T,)
    real: torch.Tensor  # (n,) positions of the segment's real tokens in its (B * T) layout
    start: int


@dataclass
class Layout:
    """Where the tokens of one engine forward sit. Dense: `(B, T)` ids, one segment read as it is (no
    gathers). Flat: `(1, N)` ids holding only real tokens, so that the linear layers skip padding and
    dummies; attention runs per segment on its rows' padded `(B, T)` view: rows appending one token read
    the cache as decode steps do, rows appending several (prompts, spliced tool output) as prefill does."""

    positions: torch.Tensor  # (B, T) dense or (1, N) flat: RoPE positions of the forward's tokens
    segments: list[Segment]
    dense: Batch | None = None  # the one segment of a dense layout

    @classmethod
    def of(cls, batch: Batch) -> Layout:
        return cls(batch.positions, [], batch)


def make_layout(
    cache: KVCache, slots: list[int], lens: list[int], n_new: list[int]
) -> tuple[Layout, list[int]]:
    """The layout of a forward where row `b` (cache slot `slots[b]`, `lens[b]` positions cached) appends
    `n_new[b]` tokens, and the order of the flat forward's tokens: `order[b]` = the flat position of row
    `b`'s first token. Dense when no row has padding or a dummy (every `n_new` equal and > 0); else flat,
    with rows appending at most one token in a decode segment (all rows when `slots` are `0..B-1`: the
    cache is read as a view, the others ride along as dummies) and rows appending more in an extend one."""
    width = max(n_new)
    if min(n_new) == width > 0:
        batch = make_batch(cache, slots, lens, width, n_new)
        return Layout.of(batch), [b * width for b in range(len(slots))]
    if width == 0:
        raise ValueError("a forward needs at least one new token")
    contiguous = slots == list(range(len(slots)))
    one = [b for b, n in enumerate(n_new) if n <= 1 or contiguous]
    many = [b for b, n in enumerate(n_new) if n > 1]
    groups = []
    if any(n_new[b] == 1 for b in one):
        groups.append((one, [n_new[b] if n_new[b] <= 1 else 0 for b in one], 1))
    if many:
        groups.append((many, [n_new[b] for b in many], max(n_new[b] for b in many)))
    order, positions, segments, start = [0] * len(slots), [], [], 0
    for rows, counts, cols in groups:
        batch = make_batch(cache, [slots[b] for b in rows], [lens[b] for b in rows], cols, counts)
        index, real, at = [], [], start
        for i, (b, n) in enumerate(zip(rows, counts, strict=True)):
            if n:
                order[b] = at
                positions.extend(range(lens[b], lens[b] + n))
                real.extend(range(i * cols, i * cols + n))
            index.extend(range(at, at + n))
            index.extend([start] * (cols - n))  # padding: any token of the segment
            at += n
        segments.append(Segment(batch, torch.tensor(index), torch.tensor(real), start))
        start = at
    return Layout(torch.tensor([positions]), segments), order


def attend_layout(layout: Layout, layer: int, q, k, v, scaling: float | None = None) -> torch.Tensor:
    """`attend` over a layout. Dense: q `(B, T, H, D)`, k/v `(B, T, Hkv, D)`; flat: `(1, N, heads, D)`.
    Returns `(B, T, H * D)` or `(1, N, H * D)`."""
    if layout.dense is not None:
        b, t, heads, d = q.shape
        out = attend(layout.dense, layer, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scaling)
        return out.reshape(b, t, heads * d)
    _, n, heads, d = q.shape
    q, k, v = q[0], k[0], v[0]
    out = q.new_empty(n, heads * d)
    for seg in layout.segments:
        b, t = seg.batch.positions.shape
        qs, ks, vs = (x.index_select(0, seg.index).view(b, t, -1, d).transpose(1, 2) for x in (q, k, v))
        o = attend(seg.batch, layer, qs, ks, vs, scaling).reshape(b * t, heads * d)
        out[seg.start : seg.start + len(seg.real)] = (
            o if len(seg.real) == b * t else o.index_select(0, seg.real)
        )
    return out[None]


def fused_decode(batch: Batch | None, dtype: torch.dtype, head_dim: int, groups: int) -> bool:
    """Whether a forward over `batch` (None: a flat layout) is a decode step that `decode_step` runs in one
    native call per layer: one new token per row, the native attention on, a cache in `dtype` it covers."""
    native = batch.cache.native if batch is not None else None
    if native is None or batch.positions.shape[1] != 1:
        return False
    k = batch.cache.k[0]
    return k.dtype == dtype and k.stride(-1) == 1 and native.covers(dtype, head_dim, groups) is None


def decode_step(batch: Batch, layer: int, qkv, cos, sin, scaling: float | None = None) -> torch.Tensor:
    """A decode step's RoPE, cache writes and attention for `layer` in one native call (`fused_decode`): qkv
    `(B, 1, heads of q, k and v, D)` as the fused projection gives it, cos and sin `(B, D)` (sin's first half
    negated). Returns `(B, 1, H * D)`."""
    b, _, _, d = qkv.shape
    scale = d**-0.5 if scaling is None else scaling
    k, v = batch.cache.k[layer], batch.cache.v[layer]
    out = batch.cache.native.decode_step(
        qkv, cos, sin, k, v, batch.slots, batch.positions, batch.writes, scale
    )
    return out.view(b, 1, -1)


_current: Batch | None = None


def engine_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention interface over the engine's cache (`attend`); HF passes `(B, H, T, D)`."""
    batch = _current
    if batch is None:
        raise RuntimeError(f"attention implementation {ATTN_NAME!r} is only valid inside the rollout engine")
    return attend(batch, module.layer_idx, query, key, value, scaling), None


def attend(batch: Batch, layer: int, query, key, value, scaling: float | None = None) -> torch.Tensor:
    """Write the new keys/values of `layer` to the engine cache and attend to it.

    query `(B, H, T, D)`, key/value `(B, Hkv, T, D)` after RoPE (any strides). Returns `(B, T, H, D)`.
    """
    k_cache, v_cache = batch.cache.k[layer], batch.cache.v[layer]
    rows = batch.slots[:, None]  # (B, 1) broadcast against positions (B, T)
    k_cache[rows, :, batch.writes] = key.transpose(1, 2).to(k_cache.dtype)  # (B, T, Hkv, D)
    v_cache[rows, :, batch.writes] = value.transpose(1, 2).to(v_cache.dtype)
    b, heads, t, d = query.shape
    groups = heads // k_cache.shape[1]
    native = batch.cache.native
    if t == 1 and native is not None:
        # Decode: the query heads sharing a KV head become that head's "query positions" (HF's repeat_kv
        # maps query head h to KV head h // groups), so grouped-query attention needs no copy of K/V.
        q = query.reshape(b, k_cache.shape[1], groups, d)  # (B, Hkv, G, D)
        if native.supports(q, k_cache):  # reads the cache in place: no view, gather or mask
            scale = d**-0.5 if scaling is None else scaling
            out = native.decode_attention(q, k_cache, v_cache, batch.slots, batch.positions, scale)
            return out.reshape(b, 1, heads, d)
    if batch.contiguous:
        k, v = k_cache[:b, :, : batch.kv_len], v_cache[:b, :, : batch.kv_len]
    else:
        k = k_cache[:, :, : batch.kv_len].index_select(0, batch.slots)  # copies only what is read
        v = v_cache[:, :, : batch.kv_len].index_select(0, batch.slots)
    mask = batch.mask
    if k.dtype != query.dtype:  # a no-op `.to` still costs a dispatch, x3 per layer per step
        k, v, mask = k.to(query.dtype), v.to(query.dtype), mask.to(query.dtype)
    if t == 1:
        q = query.reshape(b, k.shape[1], groups, d)  # (B, Hkv, G, D), as above
        if q.dtype == torch.float32:
            out = _decode_attention(q, k, v, mask, d**-0.5 if scaling is None else scaling)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling)  # (B, Hkv, G, D)
        return out.reshape(b, 1, heads, d)
    out = F.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous()


def _decode_attention(q, k, v, mask, scale: float) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v for a few queries per KV head, as two batched matmuls. At decode
    shapes (G <= 8 queries, a strided view of the cache) SDPA's flash kernel on CPU spends more on tiling
    than on the arithmetic: this is 1.1-1.2x faster per step at batch 8-32 (fp32; docs/BENCHMARKS.md). In
    fp32 only: in bf16 the scores would be rounded to bf16 before the softmax, which SDPA avoids."""
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale).add_(mask)  # (B, Hkv, G, kv)
    return torch.matmul(torch.softmax(scores, dim=-1), v)  # (B, Hkv, G, D)


def register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, engine_attention)


@contextmanager
def engine_forward(model, batch: Batch):
    """Run `model` with the engine's attention over `batch`, restoring its attention implementation."""
    global _current
    register()
    _current = batch
    try:
        with attention_implementation(model, ATTN_NAME):
            yield
    finally:
        _current = None
