"""The rollout engine: continuous batching over an engine-owned KV cache, with per-token routes and
tool output spliced into the rows that called a tool while the other rows keep decoding.

One `step()`:
  1. rows whose tool finished get the output as forced `tool_output` tokens (DESIGN: fed as
     [last sampled token, forced tokens], the last forced position routed by what the model writes next);
  2. waiting requests fill free slots;
  3. an *extend* forward over rows with several pending tokens (new prompts, spliced output);
  4. a *decode* forward over all active rows, one token each (rows waiting on a tool ride along with a
     dummy token whose key goes to a scratch column, so the rows stay slots 0..n-1 and the cache is read
     as a view). On the lean decoder, extend and decode rows share one forward whose linear layers see
     only real tokens (a flat `Layout`: no padding, no dummies); attention runs per kind of row;
  5. sampling, the tag state machine, stop checks; finished rows free their slot (the last row moves in).

Everything training needs is recorded as it happens: token ids, each token's kind, the route each position
was computed with, sampling log-probs and the adapters' version. The routes fed are checked against
`shift` at the end. With partial rollouts (`poll`), a step first takes a newer version of the adapters,
if there is one, and recomputes the cache of the rows in flight under it (`switch`).
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext

import torch

from rolerl.heap import trim_heap
from rolerl.models.lora import named_adapter_parameters
from rolerl.models.lora import routes as routes_ctx
from rolerl.roles import PROMPT, TOOL_OUTPUT, token_bytes
from rolerl.rollout.decoder import LeanDecoder, lean_support
from rolerl.rollout.kv import KVCache, PrefixStore, attention_shape, engine_forward, make_batch, make_layout
from rolerl.rollout.native import resolve_adapter_kernel, resolve_attention, resolve_pointwise
from rolerl.rollout.packed import PACKED, PackedLinears, checked_tied_head, resolve_kernels
from rolerl.rollout.recorder import AdapterVersion, GenerationRequest, Recorder, run_tool
from rolerl.rollout.sampling import Sampler
from rolerl.tools.base import Tool
from rolerl.types import Turn

log = logging.getLogger(__name__)

# fresh prompts starting alike on fewer positions prefill them each (not worth a forward of its own)
MIN_COMMON_START = 8


class _Row(Recorder):
    """A `Recorder` in a cache slot: what it feeds next, with which routes, and its running tool."""

    def __init__(self, req: GenerationRequest, handle: int, engine: Engine) -> None:
        super().__init__(req, engine.bytes, engine.eos_ids, engine.max_len)
        self.handle = handle
        self.fed_routes: list[int] = []  # the route each fed position was computed with
        # prompt position p predicts p+1 (a prompt token, or the first sampled token for the last one)
        self.pending: list[int] = list(req.prompt_ids)
        self.pending_routes = [self.route(PROMPT)] * (len(self.pending) - 1) + [self.next_route()]
        self.cache_len = 0
        # (kept row, positions) its cache started from (`PrefixStore`)
        self.seed: tuple[int, int] | None = None
        self.future: Future | None = None
        self.call_started = 0.0


class Engine:
    """Batched sampler for HF causal LMs (Llama, Qwen2, Qwen3 families) with routed adapters and tools."""

    def __init__(
        self,
        model,
        tokenizer,
        *,
        max_batch: int = 32,
        max_len: int | None = None,
        max_tokens: int | None = None,
        tools: Mapping[str, Tool] | None = None,
        tool_workers: int = 8,
        sampler=None,
        source=None,
        kernels: str = "auto",
        attention: str = "auto",
        adapter_kernel: str = "auto",
        tied_head: str = "share",
        pointwise: str = "auto",
        owns_model: bool | None = None,
        prefix_cache: int = 0,
    ) -> None:
        """`max_len`: the most positions a row may use (prompt, samples and tool output; None = the model's
        `max_position_embeddings`). `sampler(logits, params, seeds, counters) -> (tokens, logprobs)`
        (None: a `rolerl.rollout.sampling.Sampler` of the engine's own); tests replace it with a script to
        drive exact token sequences (teacher forcing) through the real engine. `source`: the trainer's model when `model` is a copy in another dtype (`rollout_copy`):
        `sync()` copies its adapters in. `kernels`: `native` runs the linear layers on weights packed once
        for the engine's own fp32 GEMM, `onednn` for oneDNN's (`rolerl.rollout.packed`; CPU only), `torch`
        on `F.linear`; `auto` = `native` for fp32 where it builds, else `onednn` where supported.
        `attention`: `native` runs decode attention in a C kernel built with the machine's compiler
        (`rolerl.rollout.native`; CPU only), `torch` in SDPA, `auto` = `native` where it builds.
        `adapter_kernel`: the same for the routed adapters of a decode step on the engine's own decoder
        (`native`: each row through its own adapter in C; `torch`: masked GEMMs over every adapter's ranks).
        `tied_head`: with packed kernels, an LM head tied to the input embeddings runs on that matrix
        (`share`) or on a packed copy of it (`copy`: faster on some CPUs, the matrix held twice).
        `pointwise`: the residual adds and RMSNorms of the engine's own decoder in C (`native`) or torch's ops.
        `owns_model` (default: True with a `source`): nothing but this engine runs `model`, so
        with packed kernels its plain linear weights are freed (the packed copies replace them).
        `prefix_cache`: positions of finished rows' keys and values kept for requests that continue them
        (`PrefixStore`; 0 = none), dropped whenever the weights change."""
        self.model, self.tokenizer = model, tokenizer
        self.source = source
        self.sampler = Sampler() if sampler is None else sampler
        self.max_batch, self.max_len = max_batch, max_len or _model_max_len(model)
        self._warned_room = False
        self.max_tokens = max_tokens  # token budget: the sum of active rows' maximum lengths
        self.tools = dict(tools or {})
        self.pool = ThreadPoolExecutor(tool_workers, thread_name_prefix="rolerl-tool") if self.tools else None
        self.decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        self.lm_head = model.get_output_embeddings()
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.kernels = resolve_kernels(kernels, self.device, self.dtype)
        tied_head = checked_tied_head(tied_head)
        self.native = resolve_attention(attention, self.device)
        if self.native is not None:
            _, heads, kv_heads, head_dim = attention_shape(model.config)
            why = self.native.covers(self.dtype, head_dim, heads // kv_heads)
            if why is not None and attention == "native":
                raise ValueError(f"rollout.attention 'native' does not cover this model's {why}; use 'auto'")
            if why is not None:
                log.info("native decode attention does not cover this model's %s; the engine uses SDPA", why)
                self.native = None
        # on packed weights, the engine's own forward over Llama-family decoders (rolerl.rollout.decoder);
        # HF's forward with the engine's attention for any other model, or on `F.linear`
        self.lean = (
            LeanDecoder(model, max_batch, tied_head, self.kernels)
            if self.kernels in PACKED and lean_support(model) is None
            else None
        )
        self.adapter_kernel = self._lean_kernel(
            resolve_adapter_kernel(adapter_kernel, self.device),
            adapter_kernel,
            "adapter_kernel",
            "torch's GEMMs",
        )
        self.pointwise = self._lean_kernel(
            resolve_pointwise(pointwise, self.device), pointwise, "pointwise", "torch's ops"
        )
        if self.lean is not None:
            self.lean.adapter_kernel, self.lean.pointwise = self.adapter_kernel, self.pointwise
            self.packed = self.lean.packed
        else:
            packed = self.kernels in PACKED
            self.packed = (
                PackedLinears.of(model, max_batch, tied_head=tied_head, kind=self.kernels) if packed else None
            )
        if self.packed is not None and (source is not None if owns_model is None else owns_model):
            self.packed.release(source)
        # every id the head can produce: a model's vocabulary is often padded past its tokenizer's (Qwen3:
        # 151,936 rows, 151,669 tokens); an id with no token is b"" (as `tokenizer.decode` skips it)
        self.bytes = token_bytes(tokenizer, getattr(model.config, "vocab_size", None))
        eos = model.generation_config.eos_token_id if getattr(model, "generation_config", None) else None
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        self.eos_ids = frozenset(
            [*eos, *([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])]
        )
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.cache: KVCache | None = None
        self.kept = PrefixStore(prefix_cache) if prefix_cache > 0 else None
        self._kept_weights: tuple = ()  # `_weights_version()` when the kept rows were computed
        self.active: list[_Row] = []  # row i lives in cache slot i
        # route index -> the version of that adapter in the weights sampled from (each token records its
        # own: `Turn.versions`); set by the trainer (`rolerl.train.pipeline`), empty = every version 0
        self.versions: list[int] = []
        # partial rollouts (`train.partial_rollouts`): asked at the start of every step, in the thread that
        # steps the engine, for a newer version of the adapters to `switch` to (None: none yet)
        self.poll: Callable[[], AdapterVersion | None] | None = None
        self.waiting: deque[_Row] = deque()
        self._next_handle = 0
        self.stats = {"forward_s": 0.0, "sample_s": 0.0, "steps": 0, "decode_rows": 0, "tool_calls": 0,
                      "switches": 0, "kept_hits": 0, "kept_positions": 0}  # fmt: skip

    def _lean_kernel(self, kernel, setting: str, field: str, instead: str):
        """`kernel` (a native kernel for the engine's own decoder, resolved from `rollout.<field>`) where that
        decoder runs in a dtype it covers; else None, or an error where `setting` asked for native."""
        if kernel is None:
            return None
        why = None
        if self.lean is None:
            why = "runs on the engine's own decoder only (packed rollout.kernels, a Llama-family model)"
        elif self.dtype not in (torch.float32, torch.bfloat16):
            why = f"does not cover dtype {self.dtype} (float32 or bfloat16)"
        if why is not None and setting == "native":
            raise ValueError(f"rollout.{field} 'native' {why}; use 'auto'")
        if why is not None:
            log.info("rollout.%s native %s; the engine uses %s", field, why, instead)
            return None
        return kernel

    # ---- public API -------------------------------------------------------------------------------------

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Turn]:
        """Run `requests` to completion with continuous batching; results in request order."""
        handles = [self.submit(r) for r in requests]
        done: dict[int, Turn] = {}
        while len(done) < len(handles):
            for handle, turn in self.step():
                done[handle] = turn
            if not self.has_work and len(done) < len(handles):
                raise RuntimeError("engine stalled with unfinished requests")  # a bug, never a user error
        return [done[h] for h in handles]

    def submit(self, request: GenerationRequest) -> int:
        if request.tool is not None and request.tool not in self.tools:
            raise ValueError(f"request calls tool {request.tool!r}; engine tools: {sorted(self.tools)}")
        limit = min(request.max_total_tokens or self.max_len, self.max_len)
        if len(request.prompt_ids) >= limit:
            raise ValueError(
                f"prompt of {len(request.prompt_ids)} tokens leaves no room (max_len {self.max_len}); "
                "raise rollout.max_len or shorten the prompt"
            )
        room = limit - len(request.prompt_ids)
        if room < request.sampling.max_new_tokens and not self._warned_room:
            self._warned_room = True  # once per engine: a batch of long prompts would repeat it per row
            log.warning(
                "a prompt of %d tokens leaves room for %d of its %d new tokens (max_len %d): such rows end "
                "with finish_reason 'length'; raise rollout.max_len (the model allows %d)",
                len(request.prompt_ids), room, request.sampling.max_new_tokens, self.max_len,
                _model_max_len(self.model),
            )  # fmt: skip
        handle, self._next_handle = self._next_handle, self._next_handle + 1
        self.waiting.append(_Row(request, handle, self))
        return handle

    @property
    def has_work(self) -> bool:
        return bool(self.active or self.waiting)

    def step(self) -> list[tuple[int, Turn]]:
        """Advance every active row by one sampled token (or a splice); returns rows that finished."""
        self.stats["steps"] += 1
        version = self.poll() if self.poll is not None else None
        if version is not None:
            self.switch(version)
        for row in self.active:
            if row.future is not None and row.future.done():
                self._splice_tool_output(row)
        self._admit()
        extend, decode = self._ready(several=True), self._ready(several=False)
        if extend and decode and self.lean is not None:
            self._extend(extend, decode)  # one forward: its flat layout gives no row another's length
            return self._retire()
        if extend:
            self._extend(extend)
            decode = self._ready(several=False)  # the extended rows too: each sampled one token
        if decode:
            self._forward_and_sample(list(range(len(self.active))), sample_rows=set(decode))
        elif not extend and self.active:
            time.sleep(0.001)  # every row waits on a tool
        return self._retire()

    def _ready(self, several: bool) -> list[int]:
        """Active rows that are not waiting on a tool, with several pending tokens (a prompt, spliced tool
        output) or exactly one (a decode step)."""
        return [
            i
            for i, r in enumerate(self.active)
            if r.future is None and not r.finish and (len(r.pending) > 1 if several else len(r.pending) == 1)
        ]

    def reset(self) -> None:
        """Drop every active and waiting request (after a failure); the cache is kept."""
        for row in self.active:
            if row.future is not None:
                row.future.cancel()
        self.active.clear()
        self.waiting.clear()

    def sleep(self) -> None:
        """Between rollouts (while the trainer updates): free what only sampling needs, the KV cache, the
        sampler's scratch and the packed copy of weights that the trainer holds too, or that a rollout copy
        packs again from the trainer's weights (`PackedLinears.drop`); the next request allocates and packs
        them again. A generation-only model the engine owns keeps its packed weights (they are its only
        weights). Refused with requests in flight."""
        if self.has_work:
            raise RuntimeError("engine.sleep() with requests in flight")
        self.cache = None
        if self.kept is not None:
            self.kept.clear()
        if isinstance(self.sampler, Sampler):
            self.sampler.release()
        self._drop_packed()

    def sync(self, version: AdapterVersion | None = None) -> dict[str, float]:
        """Copy the trainer's adapter weights into this engine's copy of the model (cast to its dtype);
        nothing when the engine samples from the trainer's own model. With a `version` (asynchronous
        training), copy that version's changed adapters instead and record its versions on every token
        sampled from now on; the packed copies are dropped so the next forward packs the new adapters."""
        if version is not None and self.source is not None:
            self.sleep()
            self._take(version)
            return {}
        if self.source is None:
            return {}
        mine = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, p in named_adapter_parameters(self.source):
                mine[name].copy_(p)
        return {}

    def switch(self, version: AdapterVersion) -> None:
        """Take `version`'s adapters between two steps, with requests in flight (partial rollouts, called
        from `step` through `poll`). Every active row's cache is recomputed under them: its fed positions
        become pending again, so the next step prefills each row's whole sequence (rows alike share it, as
        fresh prompts do) and samples its next token from that forward. Each token sampled from now on then
        records the new version, and its log-prob is that version's forward over the sequence so far, not
        over keys and values the old adapters computed. `stats["switches"]` counts the switches that
        recomputed a row."""
        if self.source is None:
            raise ValueError("Engine.switch needs an engine over its own copy of the model (`source`)")
        self._drop_packed()
        self._take(version)
        recomputed = 0
        for row in self.active:
            if row.cache_len:
                row.pending = row.ids[: row.cache_len] + row.pending
                row.pending_routes = row.fed_routes + row.pending_routes
                row.fed_routes, row.cache_len = [], 0
                recomputed += 1
        self.stats["switches"] += bool(recomputed)

    def forget_kept(self) -> None:
        """Empty the prefix store (`prefix_cache`). `LockstepBackend` calls it as each rollout (a step's or
        an evaluation chunk's episodes) begins: its calls then continue only calls of the same rollout, so it
        samples the same tokens whatever the engine ran before (a resumed run, an evaluation continued from
        its kept chunks). A reused prefix's keys and values were computed in another batch than a prefill of
        them would be, equal up to the kernels' rounding, not bit for bit."""
        if self.kept is not None:
            self.kept.clear()

    def close(self) -> None:
        self.forget_kept()
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)

    # ---- internals --------------------------------------------------------------------------------------

    def _take(self, version: AdapterVersion) -> None:
        """Copy `version`'s changed adapters into the engine's copy; tokens sampled from now on record its
        versions."""
        mine = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, t in version.tensors.get(self.source, {}).items():
                mine[name].copy_(t)
        self.versions = list(version.versions.get(self.source, []))

    def _drop_packed(self) -> None:
        """Drop the packed weights and adapter copies; the next forward packs them from the weights then."""
        if self.lean is not None:
            self.lean.sleep()
        if self.packed is not None:
            self.packed.drop()

    def _admit(self) -> None:
        budget = self.max_tokens - sum(r.max_length for r in self.active) if self.max_tokens else 0
        joining = 0
        for row in self.waiting:
            if len(self.active) + joining >= self.max_batch:
                break
            if self.max_tokens and (self.active or joining) and row.max_length > budget:
                break  # the token budget is full; an empty batch always admits one request
            budget -= row.max_length
            joining += 1
        if not joining:
            return
        # a row's last position is sampled, never fed: its keys are never stored
        need = max(self.waiting[i].max_length for i in range(joining)) - 1
        self._ensure_cache(len(self.active) + joining, need)
        for _ in range(joining):
            self.active.append(self.waiting.popleft())
        if self.kept is not None and self.kept.entries:
            self._reuse_kept(range(len(self.active) - joining, len(self.active)))

    def _reuse_kept(self, indices: range) -> None:
        """The joining rows `indices` whose prompt starts as a kept row did (`PrefixStore`) copy those
        positions' keys and values and feed only the rest. A row sharing nothing keeps its whole prompt
        (identical and alike prompts are then shared by `_extend`)."""
        self._drop_stale_kept()
        for i in indices:
            row = self.active[i]
            found = self.kept.match(row.pending, row.pending_routes, len(row.pending) - 1)
            if found is None:
                continue
            key, n = found
            self.kept.load(key, n, self.cache, i)
            row.fed_routes, row.cache_len, row.seed = row.pending_routes[:n], n, (key, n)
            row.pending, row.pending_routes = row.pending[n:], row.pending_routes[n:]
            self.stats["kept_hits"] += 1
            self.stats["kept_positions"] += n

    def _drop_stale_kept(self) -> None:
        """Empty the store where the weights changed since its rows were kept; they are current from now."""
        version = self._weights_version()
        if version != self._kept_weights:
            self.kept.clear()
            self._kept_weights = version

    def _weights_version(self) -> tuple[tuple[int, int, int], ...]:
        """What identifies the weights' values: each parameter's object, storage and in-place version
        counter (which every in-place change bumps: an optimizer step, `sync`'s copies, a state dict
        loaded), so kept keys and values computed before any change are known stale."""
        return tuple((id(p), p.data_ptr(), p._version) for p in self.model.parameters())

    def _ensure_cache(self, rows: int, need: int) -> None:
        """Room for `rows` rows (the active ones first, in their slots) of up to `need` positions each."""
        old = self.cache
        if old is not None and old.capacity >= need and old.slots >= rows:
            return
        carry = old is not None and bool(self.active)
        if old is not None and not carry:
            # nothing to copy: free it before allocating the next one (both alive at once were the peak of a
            # rollout longer than the previous one: +127 MB at batch 32 x 512 tokens after 16)
            self.cache = old = None
            trim_heap()
        # sized to the longest request joining now (not a power of two: a 1,100-position row would hold
        # 2,048); growing under running rows copies them, so by at least a quarter: rising lengths do not
        # copy every time. Multiples of 8 positions: prompts a few tokens longer reuse the cache.
        if not carry:
            capacity = need
        else:
            capacity = old.capacity if old.capacity >= need else max(need, old.capacity + old.capacity // 4)
        capacity = -(-capacity // 8) * 8
        # slots for the requests there are, up to `max_batch` (which costs nothing until used); doubling when
        # requests come one by one, so that the rows are not copied at every admission
        if carry and old.slots >= rows:
            slots = old.slots
        else:
            wanted = len(self.active) + len(self.waiting)
            slots = min(self.max_batch, max(wanted, 2 * old.slots if carry else 1))
        self.cache = KVCache(self.model.config, slots, capacity, self.dtype, self.device)
        self.cache.native = self.native
        if carry:
            self.cache.take_rows(old, len(self.active))

    def _extend(self, indices: list[int], decode: Sequence[int] = ()) -> None:
        """Prefill prompts and splice tool output. Rows with the same fresh prompt (ids and routes: the `n`
        samples of a GRPO group) run it once; the others copy its cache and sample from its logits. Distinct
        fresh prompts that start alike (a system prompt) run that start once (`_prefill_common_start`).
        `decode`: rows with one pending token, decoded in the same forward (the lean decoder's flat layout)."""
        first: dict[tuple, int] = {}
        computed, copies = [], []
        for i in indices:
            row = self.active[i]
            if row.cache_len == 0:
                key = (tuple(row.pending), tuple(row.pending_routes))
            elif row.seed is not None and row.cache_len == row.seed[1]:  # a kept start, nothing fed since
                key = (row.seed, tuple(row.pending), tuple(row.pending_routes))
            else:
                key = (i,)
            if key in first:
                copies.append((first[key], i))
            else:
                first[key] = i
                computed.append(i)
        self._prefill_common_start(computed)
        if decode:  # every active row, so that the decode segment reads the cache as a view
            sample = {*computed, *decode}
            self._forward_and_sample(list(range(len(self.active))), sample_rows=sample, copies=copies)
        else:
            self._forward_and_sample(computed, copies=copies)

    def _forward_and_sample(
        self, indices: list[int], sample_rows: set[int] | None = None, copies: Sequence[tuple[int, int]] = ()
    ) -> None:
        """One forward over the active rows `indices` (those in `sample_rows`, default all, feed their
        pending tokens; the others ride along with a dummy) and one sampled token per fed row. `copies`:
        `(computed, copy)` pairs of rows with identical pending tokens; the copy gets the computed row's
        cache and logits, then samples with its own seed."""
        rows = [self.active[i] for i in indices]
        live = [sample_rows is None or i in sample_rows for i in indices]
        feeds = [(r.pending, r.pending_routes) if ok else ([], []) for r, ok in zip(rows, live, strict=True)]
        t0 = time.perf_counter()
        logits = self._forward(indices, feeds)
        if copies:
            at = {i: b for b, i in enumerate(indices)}
            for src, dst in copies:
                self.cache.move(src, dst, self.active[src].cache_len + len(self.active[src].pending))
            logits = torch.cat([logits, logits[[at[src] for src, _ in copies]]])  # (B + copies, V)
            rows += [self.active[dst] for _, dst in copies]
            live += [True] * len(copies)
        t1 = time.perf_counter()
        self.stats["forward_s"] += t1 - t0
        keep = [b for b, ok in enumerate(live) if ok]
        params = [rows[b].req.sampling for b in keep]
        seeds = torch.tensor([p.seed for p in params], dtype=torch.long)
        counters = torch.tensor([rows[b].sampled for b in keep], dtype=torch.long)
        logits = logits if len(keep) == len(rows) else logits[keep]  # (b, V); no copy in the common case
        tokens, logps = self.sampler(logits, params, seeds, counters)
        self.stats["sample_s"] += time.perf_counter() - t1
        self.stats["decode_rows"] += len(keep)
        for b, token, logp in zip(keep, tokens.tolist(), logps.tolist(), strict=True):
            row = rows[b]
            row.fed_routes.extend(row.pending_routes)
            row.cache_len += len(row.pending)
            row.pending, row.pending_routes = [], []
            self._accept(row, token, logp)

    def _forward(self, indices: list[int], feeds: Sequence[tuple[list[int], list[int]]]) -> torch.Tensor:
        """One forward over the active rows `indices`, row `b` appending `feeds[b]` (token ids, their
        routes; empty: a dummy position that writes nowhere) to its cache; `(B, V)` logits at each row's
        last fed position."""
        rows = [self.active[i] for i in indices]
        n_new = [len(fed) for fed, _ in feeds]
        if self.lean is not None:
            return self._forward_lean(indices, feeds, n_new)
        width = max(max(n_new), 1)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        # pads and dummies write to the scratch column and are never read: routed like the most common real
        # position, so a forward whose real tokens share one adapter stays uniform (the adapters' plain path)
        real = Counter(r for _, fed_routes in feeds for r in fed_routes)
        routes = torch.full((len(rows), width), real.most_common(1)[0][0] if real else -1, dtype=torch.long)
        for b, (fed, fed_routes) in enumerate(feeds):
            ids[b, : len(fed)] = torch.tensor(fed, dtype=torch.long)
            routes[b, : len(fed)] = torch.tensor(fed_routes, dtype=torch.long)
        batch = make_batch(self.cache, indices, [r.cache_len for r in rows], width, n_new)
        last = torch.tensor([max(n - 1, 0) for n in n_new], device=self.device)
        with torch.inference_mode(), self._routes(routes):
            kernels = self.packed() if self.packed is not None else nullcontext()
            with engine_forward(self.model, batch), kernels:
                hidden = self.decoder(
                    input_ids=ids.to(self.device), position_ids=batch.positions, use_cache=False
                ).last_hidden_state
                return self.lm_head(hidden[torch.arange(len(rows), device=self.device), last])

    def _forward_lean(
        self, indices: list[int], feeds: Sequence[tuple[list[int], list[int]]], n_new: list[int]
    ) -> torch.Tensor:
        """`_forward` on the lean decoder over a `Layout`: rows of different lengths (a decode step with
        prompts or tool output spliced into it, rows waiting on a tool) feed only their real tokens to the
        linear layers; attention runs per segment (`make_layout`)."""
        layout, order = make_layout(self.cache, indices, [self.active[i].cache_len for i in indices], n_new)
        if layout.dense is not None:
            ids = torch.tensor([fed for fed, _ in feeds], dtype=torch.long)
            routes = torch.tensor([fed_routes for _, fed_routes in feeds], dtype=torch.long)
        else:  # the flat order: `order[b]` is where row b's tokens start
            rows = sorted((o, b) for b, o in enumerate(order) if n_new[b])
            ids = torch.tensor([[t for _, b in rows for t in feeds[b][0]]], dtype=torch.long)
            routes = torch.tensor([[r for _, b in rows for r in feeds[b][1]]], dtype=torch.long)
        last = torch.tensor(
            [o + max(n - 1, 0) for o, n in zip(order, n_new, strict=True)], device=self.device
        )
        with torch.inference_mode(), self._routes(routes):
            hidden = self.lean(ids.to(self.device), layout)  # (B, T, d) dense, (1, N, d) flat
            return self.lean.head(hidden.flatten(0, 1)[last])  # (B, V)

    def _prefill_common_start(self, indices: list[int]) -> None:
        """Fresh prompts of the active rows `indices` that start alike (ids and routes over at least
        `MIN_COMMON_START` positions: a system prompt, one per role) run that start once, on one row of
        each such set, all sets in one forward; the other rows copy its keys and values, so each row's own
        forward feeds only the rest of its prompt (every row keeps at least one token to sample from)."""
        sets: dict[tuple, list[int]] = {}
        for i in indices:
            row = self.active[i]
            if row.cache_len == 0 and len(row.pending) > MIN_COMMON_START:
                key = (tuple(row.pending[:MIN_COMMON_START]), tuple(row.pending_routes[:MIN_COMMON_START]))
                sets.setdefault(key, []).append(i)
        starts = []  # (the active rows of a set, the length of their common start)
        for slots in sets.values():
            if len(slots) > 1:
                first, *others = (self.active[i] for i in slots)
                n = min(len(r.pending) for r in (first, *others)) - 1
                for r in others:
                    n = next((j for j in range(MIN_COMMON_START, n) if (r.pending[j], r.pending_routes[j]) !=
                              (first.pending[j], first.pending_routes[j])), n)  # fmt: skip
                starts.append((slots, n))
        if not starts:
            return
        t0 = time.perf_counter()
        leaders = [(slots[0], self.active[slots[0]], n) for slots, n in starts]
        self._forward(
            [i for i, _, _ in leaders], [(r.pending[:n], r.pending_routes[:n]) for _, r, n in leaders]
        )
        for slots, n in starts:
            for i in slots:
                if i != slots[0]:
                    self.cache.move(slots[0], i, n)
                row = self.active[i]
                row.fed_routes.extend(row.pending_routes[:n])
                row.cache_len = n
                row.pending, row.pending_routes = row.pending[n:], row.pending_routes[n:]
        self.stats["forward_s"] += time.perf_counter() - t0

    def _routes(self, routes: torch.Tensor):
        if getattr(self.model, "_rolerl_route_state", None) is None:
            if bool((routes >= 0).any()):
                raise ValueError(
                    "requests route tokens to adapters, but the model has none (rolerl.add_adapters)"
                )
            return nullcontext()
        return routes_ctx(self.model, routes.to(self.device))

    def _accept(self, row: _Row, token: int, logp: float) -> None:
        """Record one sampled token and decide what the row does next: feed it, or wait on its tool."""
        body = row.accept(token, logp, self.versions)
        if row.finish:
            return
        if body is not None:
            row.call_started = time.perf_counter()
            row.future = self.pool.submit(run_tool, self.tools[row.req.tool], body)
            row.pending = [token]
            return
        row.pending, row.pending_routes = [token], [row.next_route()]

    def _splice_tool_output(self, row: _Row) -> None:
        result, failed = row.future.result()
        row.future = None
        self.stats["tool_calls"] += 1
        forced = row.splice(result, failed, self.tokenizer, time.perf_counter() - row.call_started)
        if forced:
            # [last sampled, forced...]: all predict tool output, except the last forced, which predicts the
            # model's next token (after a `switch`, the row's recomputed positions come before them)
            routes = [*row.pending_routes, *[row.route(TOOL_OUTPUT)] * len(forced), row.next_route()]
            row.pending, row.pending_routes = [*row.pending, *forced], routes

    def _retire(self) -> list[tuple[int, Turn]]:
        out = []
        i = 0
        while i < len(self.active):
            row = self.active[i]
            if not row.finish:
                i += 1
                continue
            out.append((row.handle, row.turn(row.fed_routes)))
            if self.kept is not None:
                if len(out) == 1:  # the weights' identity once a step, not once a finished row
                    self._drop_stale_kept()
                self._keep(i, row)
            last = len(self.active) - 1
            if i != last:  # keep slots 0..n-1 dense: the last row moves into the freed slot
                moved = self.active[last]
                self.cache.move(last, i, moved.cache_len)
                self.active[i] = moved
            self.active.pop()
        return out

    def _keep(self, i: int, row: _Row) -> None:
        """Keep finished row `i`'s fed positions for a request that continues it. The kept row it continued
        in full is dropped: this one holds all of it."""
        key, n = row.seed or (None, 0)
        if key in self.kept.entries and n == self.kept.length(key):
            self.kept.drop(key)
        self.kept.put(self.cache, i, row.ids[: row.cache_len], row.fed_routes)


def _model_max_len(model) -> int:
    """The positions the model was trained for (8192 on SmolLM2), or 4096 when its config does not say."""
    return int(getattr(getattr(model, "config", None), "max_position_embeddings", None) or 4096)


def rollout_copy(model, dtype: torch.dtype):
    """A copy of `model` (adapters included) in `dtype`, frozen, for an engine that samples in another
    precision than the trainer computes in (`rollout.dtype`); `Engine(copy, source=model).sync()` keeps
    its adapters current."""
    import copy

    clone = copy.deepcopy(model).to(dtype)
    for p in clone.parameters():
        p.requires_grad_(False)
    return clone.eval()
