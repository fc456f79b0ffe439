"""The decoder forward of a training batch, computing each shared prompt once.

GRPO samples `n` completions of every prompt, so the rows of a training batch come in groups that share
their whole prompt (same ids, same routes). A plain forward recomputes that prompt `n` times. Here the
distinct prompts run once (with the cache on), their keys and values are indexed out to every row of the
group, and only the rows' own tokens run a second forward that attends to them. Autograd flows through
the index, so each prompt's activations receive the gradients of all the rows that read it: values and
gradients equal the plain forward up to float rounding (the matmuls have other shapes). With a 60-token
prompt and 128-token completions in groups of 8, that is 27% fewer positions through the decoder, and
fewer activations kept for backward. Rows whose prompts differ but start alike share that start the same
way: the system prompt of imitation data (~47 of ~110 positions in `rolerl demo`), or a system prompt and a
problem (MSARL's coder calls on one problem, each with its own request).

On CPU under SDPA, rows of different lengths run that second pass packed end to end (`PackedRows`: one
`(1, N)` pass of real tokens, attention per row), so the linear layers compute no padding either.

A row that another row continues runs inside it (`carriers`): a reasoner's calls in one conversation each
start with the call before it, prompt and completion, so the last call's forward computes every earlier
call's positions (causal attention: a position sees only the ones before it). Their log-probs are read
from it; the conversation's prompt runs once instead of once a call (an MSARL step on GSM8K: 1.9x fewer
decoder positions, docs/BENCHMARKS.md).

`hidden_at` returns the final hidden states at the positions asked for (the loss positions), so the
full `(B, T, d)` tensor of a padded batch is never assembled.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable
from torch.nn import functional as F
from transformers import AttentionInterface, DynamicCache

from rolerl.models.attention import GROUPED_SDPA, LEAN_EAGER, attention_implementation
from rolerl.models.lora import routes as lora_routes
from rolerl.roles import KIND_INDEX
from rolerl.roles import PROMPT as PROMPT_KIND
from rolerl.types import TrainBatch

PROMPT = KIND_INDEX[PROMPT_KIND]
_CACHE_ARG: dict[type, str] = {}
PACKED_ROWS = "rolerl_packed_rows"  # no mask function registered: transformers builds no mask for it
MIN_COMMON = 8  # a common start of different prompts shorter than this is not worth the second pass


def hidden_at(
    model: nn.Module, batch: TrainBatch, routes: Tensor | int, keep: Tensor, *, share_prefix: bool = True
) -> Tensor:
    """`(N, d)` final hidden states at the `True` positions of `keep` `(B, T)`, in row-major order.

    `routes` is the batch's `(B, T)` routes or one int for every token (-1: the reference). With
    `share_prefix`, rows whose prompts are identical (ids and routes) compute that prompt once.
    """
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    # Grouped by the batch's own routes even for the reference (route -1): the policy and reference forwards
    # of a micro-batch then have the same shapes and rounding (KL exactly 0 at zero adapters).
    plan = _plan(model, batch) if share_prefix else None
    if plan is None:
        ids, mask = batch.input_ids, batch.attention_mask  # (B, T)
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)  # (B, T) right padding: pads repeat nothing harmful
        with lora_routes(model, routes):
            hidden = decoder(input_ids=ids, attention_mask=mask, position_ids=position_ids).last_hidden_state
        return hidden[keep]
    return _shared_forward(model, decoder, batch, routes, keep, *plan)


def carriers(batch: TrainBatch, rows: Sequence[int] | None = None) -> list[int]:
    """Each row's carrier among `rows` (default all; row indices of `batch`): the row whose forward
    computes all of its positions, itself or a longer row that starts with it: the same ids at each of its
    positions and the same routes at each position but its last (the last position predicts nothing in
    this row, so its route, `shift`'s guess of the next token's kind, changes no log-prob of it). A carrier
    is no other row's start; rows alike are carried by one of them. Sorted, a row's successor starts with
    it whenever any row does, so one pass finds them."""
    rows = list(range(batch.input_ids.shape[0])) if rows is None else list(rows)
    lengths = batch.attention_mask[rows].sum(-1).tolist()
    both = torch.stack([batch.input_ids[rows], batch.routes[rows]], -1).reshape(len(rows), -1).cpu().numpy()
    # a row's key: id, route, id, route, ..., its last id (not its last route)
    keys = [both[i, : 2 * n - 1].tobytes() if n else None for i, n in enumerate(lengths)]
    order = sorted((i for i in range(len(rows)) if keys[i] is not None), key=keys.__getitem__)
    out = list(rows)
    for a, nxt in zip(order[-2::-1], order[:0:-1], strict=True):  # from the end: a run's carrier is its last
        if keys[nxt].startswith(keys[a]):  # fixed-width items: a byte prefix is a prefix of positions
            out[a] = out[nxt]
    return out


def _plan(model: nn.Module, batch: TrainBatch) -> tuple[Tensor, Tensor, list[int]] | None:
    """`(prefix length (B,), group (B,), first row of each group)`, or None when sharing saves nothing or
    the model's attention cannot take the explicit mask it needs. Rows whose prompts start alike (ids and
    `batch.routes`) form a group that runs that start, its prefix, once: the whole prompt where the rows
    have the same one (GRPO's samples of a problem), the part they have in common where they differ after
    it (a system prompt; the coder calls of one problem, each asking for another computation). The groups
    are the split of the rows that saves the most positions (`_prefix_groups`)."""
    config = model.config
    if config._attn_implementation not in ("sdpa", "eager", GROUPED_SDPA, LEAN_EAGER):
        return None  # e.g. flash-attention-2 takes no 4D mask
    if any(t != "full_attention" for t in (getattr(config, "layer_types", None) or ())):
        return None  # sliding-window layers would need their own mask
    is_prompt = (batch.kind_ids == PROMPT).long()  # (B, T)
    prompt_len = is_prompt.cumprod(-1).sum(-1)  # (B,) leading prompt positions
    if bool((prompt_len == 0).any()):
        return None
    prompts = [
        list(zip(batch.input_ids[r, :n].tolist(), batch.routes[r, :n].tolist(), strict=True))
        for r, n in enumerate(prompt_len.tolist())
    ]
    groups = _prefix_groups(prompts)
    if len(groups) == len(prompts):
        return None  # no two rows share enough: nothing to save
    # the prompt pass pads every group to the longest shared prefix: a row alone runs no more of its prompt
    # there (the rest of it goes with its own tokens)
    p = max(n for rows, n in groups if len(rows) > 1)
    groups = [(rows, n if len(rows) > 1 else min(n, p)) for rows, n in groups]
    lengths = batch.attention_mask.sum(-1).tolist()
    # the row pass runs each row's own positions: packed, or padded to the longest
    own = [lengths[r] - n for rows, n in groups for r in rows]
    packed = _packable(model, batch.input_ids)
    shared = len(groups) * p + (sum(own) if packed else len(own) * max(own))
    if shared >= (sum(lengths) if packed else batch.input_ids.numel()):
        return None  # the padded prompt pass would cost more positions than it saves
    device, b = batch.input_ids.device, len(prompts)
    groups.sort(key=lambda grp: min(grp[0]))  # numbered by their first row
    prefix, group = [0] * b, [0] * b
    for g, (rows, n) in enumerate(groups):
        for r in rows:
            prefix[r], group[r] = n, g
    firsts = [min(rows) for rows, _ in groups]
    return torch.tensor(prefix, device=device), torch.tensor(group, device=device), firsts


def _prefix_groups(prompts: list[list[tuple[int, int]]]) -> list[tuple[list[int], int]]:
    """The rows split into groups `(rows, prefix length)` that save the most positions, `(rows - 1) *
    prefix` each. Sorted, rows that start alike are neighbours, so the best split is into runs of the
    sorted order, found exactly by dynamic programming (B is a micro-batch: a few dozen rows). A run's
    prefix is the shortest common start of its neighbours, at least `MIN_COMMON` positions unless it is
    every one of their whole prompts. A row alone has its whole prompt as its prefix."""
    order = sorted(range(len(prompts)), key=lambda r: prompts[r])
    common = [_common_length(prompts[a], prompts[b]) for a, b in zip(order, order[1:], strict=False)]
    best = [0] * (len(order) + 1)  # best[j]: the most positions the first j sorted rows save
    last = [(0, 0)] * (len(order) + 1)  # best[j]'s last run: where it starts, its prefix
    for j in range(1, len(order) + 1):
        n = longest = len(prompts[order[j - 1]])
        best[j], last[j] = best[j - 1], (j - 1, n)  # row j - 1 alone
        for i in range(j - 2, -1, -1):  # runs [i, j): the longest of equal savings wins (fewer groups)
            n, longest = min(n, common[i]), max(longest, len(prompts[order[i]]))
            if n < MIN_COMMON and longest > n:  # short and not the whole prompt: nor will a longer run be
                break
            if best[i] + (j - 1 - i) * n >= best[j]:
                best[j], last[j] = best[i] + (j - 1 - i) * n, (i, n)
    groups, j = [], len(order)
    while j > 0:
        i, n = last[j]
        groups.append(([order[k] for k in range(i, j)], n))
        j = i
    return groups


def _common_length(a: list, b: list) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def cache_arg(decoder: nn.Module, cache: DynamicCache) -> dict:
    """`{name: cache}` for the decoder's cache argument: `cache` in newer transformers 5.x, `past_key_values`
    before. The other name would vanish into the decoder's `**kwargs`: the cache silently unused, the rows
    attending to nothing of their prompt."""
    kind = type(decoder)
    if kind not in _CACHE_ARG:
        params = inspect.signature(decoder.forward).parameters
        _CACHE_ARG[kind] = "cache" if "cache" in params else "past_key_values"
    return {_CACHE_ARG[kind]: cache}


def _shared_forward(
    model: nn.Module,
    decoder: nn.Module,
    batch: TrainBatch,
    routes: Tensor | int,
    keep: Tensor,
    prompt_len: Tensor,
    group: Tensor,
    firsts: list[int],
) -> Tensor:
    ids, device = batch.input_ids, batch.input_ids.device
    u = len(firsts)
    lengths = batch.attention_mask.sum(-1)  # (B,)
    # 1. the distinct prompts, right-padded to P: (U, P)
    p = int(prompt_len.max())
    first = torch.tensor(firsts, device=device)
    p_len = prompt_len[first]  # (U,)
    p_valid = torch.arange(p, device=device)[None, :] < p_len[:, None]  # (U, P)
    p_ids = torch.where(p_valid, ids[first, :p], ids[first, :p].new_zeros(()))
    p_routes = routes if isinstance(routes, int) else torch.where(p_valid, routes[first, :p], -1)
    cache = DynamicCache()
    with lora_routes(model, p_routes):
        p_hidden = decoder(
            input_ids=p_ids,
            attention_mask=p_valid.long(),
            position_ids=torch.arange(p, device=device).expand(u, p),
            **cache_arg(decoder, cache),
            use_cache=True,
        ).last_hidden_state  # (U, P, d)
    # 2. each row's own tokens, attending to its group's prompt keys and values: packed end to end (CPU,
    # SDPA, rows of different lengths) or right-padded to the longest (one attention call per layer, where
    # packing would remove no padding); `start[r]` is where row r's first own token is in `s_hidden`
    own = lengths - prompt_len  # (B,)
    if _packable(model, ids) and int(own.min()) < int(own.max()):
        s_hidden, start = _packed_rows(model, decoder, batch, routes, cache, prompt_len, group, own, p)
    else:
        s_hidden, start = _padded_rows(model, decoder, batch, routes, cache, prompt_len, group, own, p)
    # 3. the hidden states at the kept positions: from the prompt pass before the row's prompt ends,
    # from the row pass after
    rows, pos = keep.nonzero(as_tuple=True)  # (N,), (N,) row-major, like boolean indexing
    n_prompt = prompt_len[rows]
    index = torch.where(pos < n_prompt, group[rows] * p + pos, u * p + start[rows] + (pos - n_prompt))
    flat = torch.cat([p_hidden.reshape(u * p, -1), s_hidden])  # (U·P + rows' positions, d)
    return flat.index_select(0, index)


def _padded_rows(model, decoder, batch, routes, cache, prompt_len, group, own, p) -> tuple[Tensor, Tensor]:
    """The row pass right-padded to the longest row `S`: `(B·S, d)` hidden states, row r's at `r·S`."""
    ids, device = batch.input_ids, batch.input_ids.device
    b, s = ids.shape[0], max(int(own.max()), 1)
    cols = prompt_len[:, None] + torch.arange(s, device=device)[None, :]  # (B, S) positions in the row
    s_valid = cols < (prompt_len + own)[:, None]  # (B, S)
    at = cols.clamp(max=ids.shape[1] - 1)
    s_ids = torch.where(s_valid, ids.gather(1, at), ids.new_zeros(()))
    s_routes = routes if isinstance(routes, int) else torch.where(s_valid, routes.gather(1, at), -1)
    rows_cache = DynamicCache()
    for i, layer in enumerate(cache.layers):
        rows_cache.update(layer.keys.index_select(0, group), layer.values.index_select(0, group), i)
    with lora_routes(model, s_routes):
        s_hidden = decoder(
            input_ids=s_ids,
            attention_mask=_suffix_mask(model, prompt_len, p, s),
            position_ids=cols,
            **cache_arg(decoder, rows_cache),
            use_cache=True,
        ).last_hidden_state  # (B, S, d)
    return s_hidden.reshape(b * s, -1), torch.arange(b, device=device) * s


def _packable(model: nn.Module, ids: Tensor) -> bool:
    """Whether the row pass can run packed: SDPA on CPU (GPUs keep one padded kernel call per layer; the
    trainer's eager attention under bf16 autocast keeps its padded masks)."""
    return ids.device.type == "cpu" and model.config._attn_implementation in ("sdpa", GROUPED_SDPA)


def _packed_rows(model, decoder, batch, routes, cache, prompt_len, group, own, p) -> tuple[Tensor, Tensor]:
    """The row pass with every row's own tokens packed end to end, `(1, N)`: the linear layers compute no
    padding (RL completions end anywhere up to the token limit).
    Attention runs per row (`packed_rows_attention`) over the prompt cache laid out as one `(1, Hkv, U·P,
    D)` row. Returns `(N, d)` hidden states and row r's offset in them."""
    ids, device = batch.input_ids, batch.input_ids.device
    start = torch.cat([own.new_zeros(1), own.cumsum(0)[:-1]])  # (B,)
    n = int(own.sum())
    row_of = torch.repeat_interleave(torch.arange(len(own), device=device), own)  # (N,)
    cols = prompt_len[row_of] + torch.arange(n, device=device) - start[row_of]  # (N,) positions in the row
    s_ids = ids[row_of, cols][None]  # (1, N)
    s_routes = routes if isinstance(routes, int) else routes[row_of, cols][None]
    rows_cache = DynamicCache()
    for i, layer in enumerate(cache.layers):
        u, hkv, _, d = layer.keys.shape
        rows_cache.update(
            layer.keys.transpose(0, 1).reshape(1, hkv, u * p, d),
            layer.values.transpose(0, 1).reshape(1, hkv, u * p, d),
            i,
        )  # (1, Hkv, U·P, D): prompt g's keys in columns [g·P, g·P + its length)
    layout = PackedRows.of(own.tolist(), (group * p).tolist(), prompt_len.tolist(), u * p, device)
    with lora_routes(model, s_routes), attention_implementation(model, PACKED_ROWS):
        s_hidden = decoder(
            input_ids=s_ids,
            position_ids=cols[None],
            use_cache=True,
            rolerl_rows=layout,
            **cache_arg(decoder, rows_cache),
        ).last_hidden_state  # (1, N, d)
    return s_hidden[0], start


@dataclass
class PackedRows:
    """Where each row of a packed row pass is: its queries `[starts[i], starts[i + 1])`, its prompt's keys
    `[prompts[i][0], + prompts[i][1])` of the prompt cache, its own keys after the cache's `own` columns;
    `masks[i]` `(L_i, prompt + L_i)`: every prompt key, its own keys causally. Rows without own tokens are
    left out."""

    starts: list[int]
    prompts: list[tuple[int, int]]
    masks: list[Tensor]
    own: int
    _additive: dict = field(default_factory=dict, repr=False, compare=False)

    def additive_masks(self, dtype: torch.dtype) -> list[Tensor]:
        """`masks` as `(1, 1, L_i, prompt + L_i)` additive masks (0 / -inf) of `dtype`, as SDPA turns a
        boolean mask into for its kernel; built once per pass (every layer reads them)."""
        if dtype not in self._additive:
            made: dict[int, Tensor] = {}
            for m in self.masks:
                if id(m) not in made:  # rows of one (prompt, length) share one boolean mask
                    made[id(m)] = torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill_(
                        ~m, float("-inf")
                    )[None, None]
            self._additive[dtype] = [made[id(m)] for m in self.masks]
        return self._additive[dtype]

    def row_keys(self, key: Tensor, i: int) -> Tensor:
        """Row i's keys (or values) `(1, Hkv, prompt + L_i, D)`: its prompt's cache columns, then its own."""
        first, count = self.prompts[i]
        a, b = self.own + self.starts[i], self.own + self.starts[i + 1]
        return torch.cat([key[:, :, first : first + count], key[:, :, a:b]], 2)

    @classmethod
    def of(cls, lengths, firsts, prompt_lengths, own: int, device) -> PackedRows:
        starts, prompts, masks, at, made = [0], [], [], 0, {}
        for length, first, count in zip(lengths, firsts, prompt_lengths, strict=True):
            if length == 0:
                continue
            at += length
            starts.append(at)
            prompts.append((first, count))
            if (count, length) not in made:
                causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
                made[count, length] = torch.cat(
                    [torch.ones(length, count, dtype=torch.bool, device=device), causal], 1
                )
            masks.append(made[count, length])
        return cls(starts, prompts, masks, own)


def packed_rows_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers attention over a packed row pass (`PackedRows`, passed as `rolerl_rows`): query
    `(1, H, N, D)`, key/value `(1, Hkv, U·P + N, D)` (the prompt cache, then the pass's own keys); per row,
    one SDPA call of its queries over its prompt's keys and its own. Grouped K/V heads are not repeated."""
    rows: PackedRows = kwargs["rolerl_rows"]
    if query.device.type == "cpu" and dropout == 0.0:
        if torch.is_autocast_enabled("cpu"):  # as SDPA under autocast: q, k, v in its lower precision (rope
            dtype = torch.get_autocast_dtype("cpu")  # leaves q and k in fp32 while v is already bf16)
            query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
        return _PackedRowsAttention.apply(query, key, value, rows, scaling), None
    outs = []  # attention dropout in training: SDPA per row under autograd
    for i, mask in enumerate(rows.masks):
        a, b = rows.starts[i], rows.starts[i + 1]
        k, v = rows.row_keys(key, i), rows.row_keys(value, i)
        outs.append(
            F.scaled_dot_product_attention(
                query[:, :, a:b], k, v, attn_mask=mask, dropout_p=dropout, scale=scaling, enable_gqa=True
            )
        )  # (1, H, L_i, D)
    return torch.cat(outs, 2).transpose(1, 2).contiguous(), None


_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class _PackedRowsAttention(torch.autograd.Function):
    """`packed_rows_attention` on CPU as one autograd node over the pass's whole query, key and value.

    Per row it calls the kernel SDPA dispatches to on CPU (flash attention; grouped K/V heads read in
    place), forward and backward, so values and each row's gradients are SDPA's. What autograd through
    the per-row slices and cats would add is gone: every row's slice of the query and keys gave backward
    a zero-filled gradient of the whole pass's shape (`SliceBackward`, 8 rows x 5 slices x 30 layers per
    imitation step in `rolerl demo`), and the row outputs a cat. Here each row's gradients land in their
    columns of one query, key and value gradient (the prompt's keys, read by every row of its group,
    accumulate). Saved: each row's output and log-sum-exp, as SDPA's node saves."""

    @staticmethod
    def forward(ctx, query, key, value, rows: PackedRows, scale):
        masks = rows.additive_masks(query.dtype)
        outs, lses = [], []
        for i, mask in enumerate(masks):
            a, b = rows.starts[i], rows.starts[i + 1]
            out, lse = _flash(
                query[:, :, a:b], rows.row_keys(key, i), rows.row_keys(value, i), attn_mask=mask, scale=scale
            )  # (1, H, L_i, D), (1, H, L_i)
            outs.append(out)
            lses.append(lse)
        ctx.save_for_backward(query, key, value, *outs, *lses)
        ctx.rows, ctx.scale = rows, scale
        return torch.cat(outs, 2).transpose(1, 2).contiguous()  # (1, N, H, D)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        query, key, value, *saved = ctx.saved_tensors
        rows: PackedRows = ctx.rows
        n = len(rows.masks)
        outs, lses = saved[:n], saved[n:]
        grad = grad.transpose(1, 2)  # (1, H, N, D)
        dq, dk, dv = torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value)
        # each row's keys are gathered again (small copies) rather than kept from forward for backward
        for i, mask in enumerate(rows.additive_masks(query.dtype)):
            a, b = rows.starts[i], rows.starts[i + 1]
            first, count = rows.prompts[i]
            gq, gk, gv = _flash_backward(
                grad[:, :, a:b], query[:, :, a:b], rows.row_keys(key, i), rows.row_keys(value, i),
                outs[i], lses[i], 0.0, False, attn_mask=mask, scale=ctx.scale,
            )  # fmt: skip
            dq[:, :, a:b] = gq
            for total, part in ((dk, gk), (dv, gv)):
                total[:, :, first : first + count] += part[:, :, :count]  # the prompt: shared by its group
                total[:, :, rows.own + a : rows.own + b] = part[:, :, count:]  # the row's own keys
        return dq, dk, dv, None, None


def _suffix_mask(model: nn.Module, prompt_len: Tensor, p: int, s: int) -> Tensor:
    """`(B, 1, S, P + S)` mask of the row pass: query j sees its row's prompt keys (`k < prompt_len`) and
    its own keys up to itself (`P <= k <= P + j`). Pad queries see earlier pads: finite, never used.
    Boolean for SDPA; additive for eager attention, which adds the mask to the scores."""
    device = prompt_len.device
    k = torch.arange(p + s, device=device)  # (P+S,)
    j = torch.arange(s, device=device)  # (S,)
    prompt_keys = k[None, None, :] < prompt_len[:, None, None]  # (B, 1, P+S)
    own_keys = (k[None, :] >= p) & (k[None, :] - p <= j[:, None])  # (S, P+S)
    allowed = (prompt_keys | own_keys[None]).unsqueeze(1)  # (B, 1, S, P+S)
    if model.config._attn_implementation in ("sdpa", GROUPED_SDPA):
        return allowed
    zero = torch.zeros((), device=device)
    return torch.where(allowed, zero, torch.full((), torch.finfo(torch.float32).min, device=device))


AttentionInterface.register(PACKED_ROWS, packed_rows_attention)
