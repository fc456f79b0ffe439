"""What every rollout backend shares: the request type and the per-call recorder.

A backend (the built-in `Engine`, the vLLM backend) decides *how* tokens are produced; the `Recorder`
decides what they mean. It accepts one sampled token at a time (its id and sampling log-prob), tracks
the tag state machine and so each token's kind, the stop conditions (EOS, stop strings, length), opens a
tool call when a closing tool tag completes (a tag split across tokens included), splices a tool's output
as forced `tool_output` token ids (never re-tokenised text: token ids in, token ids out), and builds the
`Turn` with routes equal to `shift(kinds, route_of)`. Two backends fed the same token stream therefore
produce the same `Turn`: ids, kinds, routes, log-probs and tool calls.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from rolerl.roles import (
    PROMPT,
    TOOL_CALL,
    TOOL_OUTPUT,
    Tags,
    TagStateMachine,
    encode_exact,
    format_tool_output,
    shift,
)
from rolerl.rollout.sampling import SamplingParams
from rolerl.tools.base import Tool, ToolResult
from rolerl.types import ToolCall, Turn


@dataclass
class GenerationRequest:
    """One model call: a prompt, how to sample, and which adapter each kind of token goes to."""

    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    role: str = "policy"
    route_of: Mapping[str, int] | None = None  # kind -> adapter index (topology.route_of); None = base only
    tags: Tags = field(default_factory=Tags)
    tool: str | None = None  # the engine tool a closed tool tag calls; None = tags are plain text
    max_tool_calls: int = 4  # per turn; one more call ends the turn with finish_reason "tool_limit"
    tool_output_tokens: int = 256  # budget of spliced output per call (the tool's text is cut to fit)
    max_total_tokens: int | None = None  # prompt + completion, spliced output included; None = max_len
    model: str = "main"  # the model (engine) that serves the call, for backends with several

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("prompt_ids must not be empty")


@dataclass
class AdapterVersion:
    """One version of the trained adapters, for a backend to `sync` to instead of the trainer's live weights
    (asynchronous training: the trainer has moved on while the engine samples an older version).
    `tensors[model]` holds the `lora_` parameters (by name) of the adapters that changed since the
    version before; `versions[model][route]` every adapter's optimizer step count. Keyed by the trainer's
    model objects (an engine's `source`)."""

    step: int  # the training step after which these weights were taken
    tensors: dict[object, dict[str, object]]
    versions: dict[object, list[int]]


class Recorder:
    """One model call being generated: its ids, kinds, log-probs, tool calls and finish reason.

    `table` maps every id the model can produce to its bytes (`token_bytes(tokenizer, vocab_size)`),
    `eos_ids` end the call (unless `sampling.ignore_eos`), `max_len` caps prompt + completion."""

    def __init__(
        self, req: GenerationRequest, table: Sequence[bytes], eos_ids: frozenset[int], max_len: int
    ) -> None:
        self.req = req
        self.table = table
        self.eos_ids = eos_ids
        self.max_length = max_length(req, max_len)
        self.sm = TagStateMachine(req.tags, table)
        self.ids: list[int] = list(req.prompt_ids)
        self.kinds: list[str] = [PROMPT] * len(req.prompt_ids)  # one per position
        self.logprobs: list[float] = []  # one per completion position (NaN for forced tool output)
        self.versions: list[int] = []  # one per completion position: the sampling adapter's version (`Turn`)
        self.sampled = 0  # sampled tokens so far (the sampler's counter)
        self.tail = b""  # recent completion bytes, for stop strings
        self.tool_calls: list[ToolCall] = []
        self.finish: str | None = None

    def route(self, kind: str) -> int:
        return -1 if self.req.route_of is None else int(self.req.route_of.get(kind, -1))

    def next_kind(self) -> str:
        """The kind of the next sampled token (what the tag state machine says now)."""
        return self.sm.kind_of_next()

    def next_route(self) -> int:
        """The route of the position that predicts the next token: the adapter of its kind."""
        return self.route(self.sm.kind_of_next())

    def accept(self, token: int, logp: float, versions: Sequence[int] = ()) -> str | None:
        """Record one sampled token. Returns the body of the tool call it closed (run the request's tool
        and `splice` the result), else None; sets `finish` when the call ends here (eos, stop, length,
        tool_limit). `versions[route]`: the version of each adapter of the backend's weights (none = 0);
        the token records its sampling adapter's (-1 when the base computed it)."""
        req, sp = self.req, self.req.sampling
        route = self.next_route()
        self.versions.append(-1 if route < 0 else (versions[route] if route < len(versions) else 0))
        self.kinds.append(self.sm.kind_of_next())
        self.ids.append(token)
        self.logprobs.append(logp)
        self.sampled += 1
        events = self.sm.feed(token)
        self.tail = (self.tail + self.table[token])[-256:]
        if token in self.eos_ids and not sp.ignore_eos or token in sp.stop_token_ids:
            self.finish = "eos"
        elif any(s.encode() in self.tail for s in sp.stop):
            self.finish = "stop"
        elif self.sampled >= sp.max_new_tokens or len(self.ids) >= self.max_length:
            self.finish = "length"
        if self.finish:
            return None
        call = next((e for e in events if e.kind == TOOL_CALL), None)
        if call is None or req.tool is None:
            return None
        if len(self.tool_calls) >= req.max_tool_calls:
            self.finish = "tool_limit"
            return None
        self.tool_calls.append(ToolCall(name=req.tool, args=call.body))
        return call.body

    def splice(self, result: ToolResult, tool_failed: bool, tokenizer, wall_s: float = 0.0) -> list[int]:
        """Record the last call's output: the tool's text cut to `tool_output_tokens` at a token boundary
        (then said so), wrapped in the output tags, encoded exactly and cut to the room left. Returns the
        forced ids (their kind is `tool_output`, their log-prob NaN); none = no room left (`finish` is
        then "length")."""
        req = self.req
        call = self.tool_calls[-1]
        text = result.text()
        body_ids = encode_exact(tokenizer, text)
        if len(body_ids) > req.tool_output_tokens:
            head = b"".join(self.table[i] for i in body_ids[: req.tool_output_tokens])
            text = head.decode("utf-8", "ignore") + "\n[output truncated]\n"
        forced = encode_exact(tokenizer, format_tool_output(req.tags, text))
        forced = forced[: max(self.max_length - len(self.ids) - 1, 0)]
        call.output, call.error, call.tool_failed = text, not result.ok, tool_failed or result.tool_failed
        call.timed_out, call.wall_s = result.timed_out, wall_s
        start = len(self.ids) - len(req.prompt_ids)
        call.start, call.end = start, start + len(forced)
        if not forced:
            self.finish = "length"
            return []
        self.sm.feed_forced(forced)
        self.ids.extend(forced)
        self.kinds.extend([TOOL_OUTPUT] * len(forced))
        self.logprobs.extend([math.nan] * len(forced))
        self.versions.extend([-1] * len(forced))  # not sampled: no policy produced them
        if len(self.ids) >= self.max_length:
            self.finish = "length"
        return forced

    def routes(self) -> list[int]:
        """The route of every position: `shift(kinds, route_of)`."""
        return shift(self.kinds, _RouteOf(self))

    def turn(self, fed_routes: Sequence[int] | None = None) -> Turn:
        """The finished call as a `Turn`. `fed_routes`: the routes a backend actually computed positions
        with, checked against `routes()` (a backend that routes per token must agree with `shift`)."""
        routes = self.routes()
        if fed_routes is not None and routes[: len(fed_routes)] != list(fed_routes):
            bad = next(p for p, (a, b) in enumerate(zip(routes, fed_routes, strict=False)) if a != b)
            raise AssertionError(f"fed route {fed_routes[bad]} at position {bad}, shift() says {routes[bad]}")
        n = len(self.req.prompt_ids)
        return Turn(
            role=self.req.role,
            prompt_ids=list(self.req.prompt_ids),
            completion_ids=self.ids[n:],
            kinds=self.kinds[n:],
            routes=routes,
            logprobs=self.logprobs,
            finish_reason=self.finish or "length",
            tool_calls=self.tool_calls,
            versions=self.versions,
        )


class _RouteOf(Mapping):
    """`Recorder.route` as the mapping `shift` expects (kinds the topology does not name route to -1)."""

    def __init__(self, rec: Recorder) -> None:
        self.rec = rec

    def __getitem__(self, kind: str) -> int:
        return self.rec.route(kind)

    def __iter__(self):
        return iter(self.rec.req.route_of or {})

    def __len__(self) -> int:
        return len(self.rec.req.route_of or {})


def max_length(req: GenerationRequest, max_len: int) -> int:
    """The most positions a request can occupy, to size a cache (never more than max_len)."""
    tools = req.max_tool_calls * (req.tool_output_tokens + 32) if req.tool else 0
    limit = min(req.max_total_tokens or max_len, max_len)
    return min(limit, len(req.prompt_ids) + req.sampling.max_new_tokens + tools)


def run_tool(tool: Tool, args: str) -> tuple[ToolResult, bool]:
    """`(result, the tool itself failed)`. A tool error never crashes the batch: it becomes text the model
    sees, and `ToolCall.tool_failed` lets the trainer tell it from the model's own failing code."""
    if not args.strip():
        return ToolResult(stderr="error: empty tool call\n", exit_code=1), False
    try:
        return tool.run(args), False
    except Exception as e:  # noqa: BLE001 - any tool failure is the model's observation, not ours
        return ToolResult(stderr=f"error: {type(e).__name__}: {e}\n", exit_code=1), True
