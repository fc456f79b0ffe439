"""Token kinds, the tag state machine and `shift`: the one routing rule (DESIGN "every token carries its role").

Every token of every sequence has a kind. The kind decides the route (via the topology's table), the loss
mask (only `POLICY_KINDS` carry loss) and the per-kind diagnostics. Kinds are decided here, once:

- rollout feeds each sampled token's exact bytes to a `TagStateMachine`; a token's kind is the machine's
  state at the token's left edge, so the opening tag's tokens are `reasoning` and the closing tag's tokens
  belong to the tag's body (the reasoning adapter opens a call, the tool adapter writes it and closes it);
- forced tokens (spliced tool output) are `tool_output` and never move the machine;
- `shift` turns kinds into routes: position `p` is computed by the adapter of the token it predicts.

`splice_tokenize` is the engine's own tokenisation of forced text and SFT's tokenisation of imitation data,
so both train on token sequences that a rollout can produce. Token bytes come from `rolerl.tokens`
(re-exported here).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields

import torch

from rolerl.tokens import encode_exact, token_bytes

__all__ = [
    "ANSWER",
    "KINDS",
    "KIND_INDEX",
    "POLICY_KINDS",
    "PROMPT",
    "REASONING",
    "STATES",
    "TOOL_CALL",
    "TOOL_OUTPUT",
    "TagEvent",
    "TagStateMachine",
    "Tags",
    "encode_exact",
    "format_tool_output",
    "kind_table",
    "shift",
    "shift_batch",
    "splice_tokenize",
    "split_segments",
    "token_bytes",
]

PROMPT, REASONING, TOOL_CALL, ANSWER = "prompt", "reasoning", "tool_call", "answer"
TOOL_OUTPUT = "tool_output"
KINDS: tuple[str, ...] = (PROMPT, REASONING, TOOL_CALL, TOOL_OUTPUT, ANSWER)
KIND_INDEX: dict[str, int] = {k: i for i, k in enumerate(KINDS)}  # kind -> id in `kind_ids` tensors
POLICY_KINDS: frozenset[str] = frozenset({REASONING, TOOL_CALL, ANSWER})  # sampled by the model: carry loss
STATES: tuple[str, ...] = (REASONING, TOOL_CALL, ANSWER)  # the kinds a sampled token can get


@dataclass(frozen=True)
class Tags:
    """The tag strings of a request. Answer tags may be None (then there is no answer state)."""

    tool_open: str = "<code>"
    tool_close: str = "</code>"
    output_open: str = "<output>"
    output_close: str = "</output>"
    answer_open: str | None = "<answer>"
    answer_close: str | None = "</answer>"

    def __post_init__(self) -> None:
        if (self.answer_open is None) != (self.answer_close is None):
            raise ValueError("Tags.answer_open and Tags.answer_close must both be set or both be None")
        seen: dict[str, str] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.name.startswith("answer_"):
                continue
            if not isinstance(value, str) or not value:
                raise ValueError(f"Tags.{f.name} must be a non-empty string; got {value!r}")
            if value in seen:
                raise ValueError(
                    f"Tags.{f.name}={value!r} is the same as Tags.{seen[value]}; tags must differ"
                )
            seen[value] = f.name


# ---------------------------------------------------------------------------------------------------------
# The tag state machine


@dataclass(frozen=True)
class TagEvent:
    """A tag pair that closed inside a fed token: `kind` is "tool_call" or "answer"; `body` is the raw
    text between the opening and the closing tag (not stripped; invalid UTF-8 replaced)."""

    kind: str
    body: str


_Transition = tuple[bytes, str, str | None]  # (tag bytes, next state, event kind on completion)


def _transitions(tags: Tags) -> dict[str, tuple[_Transition, ...]]:
    reasoning: list[_Transition] = [(tags.tool_open.encode(), TOOL_CALL, None)]
    table: dict[str, tuple[_Transition, ...]] = {
        TOOL_CALL: ((tags.tool_close.encode(), REASONING, TOOL_CALL),)
    }
    if tags.answer_open is not None and tags.answer_close is not None:
        reasoning.append((tags.answer_open.encode(), ANSWER, None))
        table[ANSWER] = ((tags.answer_close.encode(), REASONING, ANSWER),)
    table[REASONING] = tuple(reasoning)
    return table


class TagStateMachine:
    """Tracks which tag the model is inside, byte by byte, across token boundaries.

    States: `reasoning` (outside tags), `tool_call` (after the tool tag opened, until it closes), `answer`.
    There is no nesting: inside a tool call only the closing tool tag counts (a `<code>` or `<answer>` in
    the body is body text), inside an answer only the closing answer tag. The output tags never move the
    machine: a model that writes `<output>` itself is writing policy text (DESIGN), and forced output goes
    through `feed_forced`. A partial tag (`<co`) is kept across tokens until it completes or is broken.
    """

    __slots__ = ("tags", "_bytes", "_trans", "_maxlen", "_state", "_window", "_body")

    def __init__(self, tags: Tags, token_bytes: Sequence[bytes], start_kind: str = REASONING) -> None:
        if start_kind not in STATES:
            raise ValueError(f"start_kind={start_kind!r}; allowed: {list(STATES)}")
        self.tags = tags
        self._bytes = token_bytes
        self._trans = _transitions(tags)
        self._maxlen = max(len(t) for ts in self._trans.values() for t, _, _ in ts)
        self._state = start_kind
        self._window = b""  # the last bytes fed since the last transition, at most `_maxlen`
        self._body = bytearray()  # bytes since the opening tag, while inside a tag pair

    @property
    def state(self) -> str:
        return self._state

    def kind_of_next(self) -> str:
        """The kind the next sampled token gets: the state at its left edge."""
        return self._state

    def feed(self, token_id: int) -> list[TagEvent]:
        """Consume one sampled token; return the tag pairs that closed inside it (usually none)."""
        data = self._bytes[token_id] if 0 <= token_id < len(self._bytes) else b""
        trans = self._trans[self._state]
        window = self._window + data
        # Fast path: no tag of this state can complete unless its first byte is in the window.
        if not any(window.find(t[:1]) >= 0 for t, _, _ in trans):
            self._window = window[-self._maxlen :]
            if self._state != REASONING:
                self._body += data
            return []
        events: list[TagEvent] = []
        for b in data:
            self._window = (self._window + bytes((b,)))[-self._maxlen :]
            if self._state != REASONING:
                self._body.append(b)
            for tag, nxt, event in self._trans[self._state]:
                if self._window.endswith(tag):
                    if event is not None:
                        body = bytes(self._body[: len(self._body) - len(tag)])
                        events.append(TagEvent(event, body.decode("utf-8", "replace")))
                    # Reset: a later tag is made of bytes after this one (no overlap across a transition).
                    self._state, self._window, self._body = nxt, b"", bytearray()
                    break
        return events

    def feed_forced(self, token_ids: Sequence[int]) -> None:
        """Consume tokens the engine forced in (kind `tool_output`). The state does not change, but a
        partial tag is dropped: forced text separates the model's bytes before and after it."""
        if len(token_ids):
            self._window = b""

    def feed_all(self, token_ids: Sequence[int]) -> tuple[list[str], list[TagEvent]]:
        """Feed sampled tokens in order; return each token's kind and all events (for scripts and tests)."""
        kinds: list[str] = []
        events: list[TagEvent] = []
        for t in token_ids:
            kinds.append(self._state)
            events += self.feed(t)
        return kinds, events

    def copy(self) -> TagStateMachine:
        new = TagStateMachine.__new__(TagStateMachine)
        new.tags, new._bytes, new._trans, new._maxlen = self.tags, self._bytes, self._trans, self._maxlen
        new._state, new._window, new._body = self._state, self._window, bytearray(self._body)
        return new


# ---------------------------------------------------------------------------------------------------------
# Routing: position p is computed by the adapter of the token it predicts (p + 1)


def _route(route_of: Mapping[str, int], kind: str) -> int:
    try:
        return route_of[kind]
    except KeyError:
        raise ValueError(f"no route for kind {kind!r}; route_of has {sorted(route_of)}") from None


def shift(kinds: Sequence[str], route_of: Mapping[str, int]) -> list[int]:
    """`route[p] = route_of[kinds[p + 1]]`; the last position takes its own kind's route (DESIGN).

    In decode, the last fed position predicts a token not sampled yet: its route is
    `route_of[machine.kind_of_next()]`, which is what this gives once that token is appended.
    """
    n = len(kinds)
    return [_route(route_of, kinds[min(p + 1, n - 1)]) for p in range(n)]


def kind_table(route_of: Mapping[str, int], device: torch.device | str | None = None) -> torch.Tensor:
    """`route_of` as a `(len(KINDS),)` long tensor indexed by `KIND_INDEX`; kinds it lacks route to -1."""
    unknown = set(route_of) - set(KINDS)
    if unknown:
        raise ValueError(f"unknown kinds {sorted(unknown)}; allowed: {list(KINDS)}")
    return torch.tensor([route_of.get(k, -1) for k in KINDS], dtype=torch.long, device=device)


def shift_batch(kind_ids: torch.Tensor, table: torch.Tensor, pad_mask: torch.Tensor) -> torch.Tensor:
    """`shift` for a padded `(B, T)` batch of `KIND_INDEX` ids; pads (`pad_mask` true/1) route to -1.

    `table` is `(len(KINDS),)` for one role, or `(B, len(KINDS))` for one role per row. The predicted token
    is the next non-pad position of the row, so left padding, right padding and both agree with `shift`
    on the row's real tokens.
    """
    b, t = kind_ids.shape
    valid = ~pad_mask.bool()  # (B, T)
    pos = torch.arange(t, device=kind_ids.device).expand(b, t)  # (B, T)
    cand = torch.where(valid, pos, t)  # (B, T) own position if real, else t
    after = cand.flip(1).cummin(1).values.flip(1)  # (B, T) first real position >= p
    nxt = torch.cat([after[:, 1:], after.new_full((b, 1), t)], dim=1)  # (B, T) first real position > p
    src = torch.where(nxt < t, nxt, pos)  # (B, T) the last real position predicts itself
    k = kind_ids.gather(1, src).clamp(min=0)  # (B, T) clamp: pad ids may be anything
    route = table[k] if table.dim() == 1 else table.gather(1, k)  # (B, T)
    return route.masked_fill(~valid, -1)


# ---------------------------------------------------------------------------------------------------------
# Tokenising forced text and imitation data


def splice_tokenize(tokenizer, segments: Sequence[tuple[str, str]]) -> tuple[list[int], list[str]]:
    """Tokenise `(kind, text)` segments one by one and concatenate: `(ids, kinds)` with one kind per token.

    Each segment is tokenised alone (`encode_exact`), so tokens never merge across a segment boundary:
    that is what rollout does at a splice (forced tool output is tokenised on its own, with this function),
    and what SFT must imitate. At a boundary between two *sampled* segments (reasoning text, then the tool
    call body) a rollout may sample a token that spans the boundary; segment-wise tokenisation is one of
    the tokenisations a model can sample, not the only one.
    """
    ids: list[int] = []
    kinds: list[str] = []
    for kind, text in segments:
        if kind not in KIND_INDEX:
            raise ValueError(f"unknown kind {kind!r}; allowed: {list(KINDS)}")
        seg = encode_exact(tokenizer, text)
        ids += seg
        kinds += [kind] * len(seg)
    return ids, kinds


def format_tool_output(tags: Tags, text: str) -> str:
    """The forced text for one tool result: `<output>\\n{text}\\n</output>\\n`, one trailing newline of
    `text` dropped so that printed output does not leave a blank line. The engine tokenises it whole with
    `encode_exact`; `split_segments` cuts such a block out of SFT text as one segment, so both get the
    same ids."""
    body = text[:-1] if text.endswith("\n") else text
    return f"{tags.output_open}\n{body}\n{tags.output_close}\n"


def split_segments(text: str, tags: Tags) -> list[tuple[str, str]]:
    """Cut a written trajectory (SFT data) into `(kind, text)` segments with the machine's convention.

    Opening tags are `reasoning`; a tag's body and its closing tag take the tag's kind. An output block
    (`<output>` ... `</output>` and one following newline) is `tool_output` only right after a tool call
    closed (whitespace in between joins the block), as one segment, so that a block in the engine's
    format (`format_tool_output`) tokenises to the engine's forced ids; anywhere else it is model text.
    """
    segments: list[tuple[str, str]] = []
    opens = [(tags.tool_open, TOOL_CALL, tags.tool_close)]
    if tags.answer_open is not None and tags.answer_close is not None:
        opens.append((tags.answer_open, ANSWER, tags.answer_close))
    i, start, after_call = 0, 0, False
    while i < len(text):
        if after_call:
            after_call = False
            j = len(text) - len(text[i:].lstrip())
            if text.startswith(tags.output_open, j) and (end := text.find(tags.output_close, j)) >= 0:
                end += len(tags.output_close)
                end += text.startswith("\n", end)
                segments.append((TOOL_OUTPUT, text[i:end]))
                i = start = end
                continue
        found = [(text.find(o, i), o, k, c) for o, k, c in opens]
        found = [f for f in found if f[0] >= 0]
        if not found:
            break
        pos, open_tag, kind, close_tag = min(found)
        body_start = pos + len(open_tag)
        segments.append((REASONING, text[start:body_start]))
        close = text.find(close_tag, body_start)
        end = len(text) if close < 0 else close + len(close_tag)
        segments.append((kind, text[body_start:end]))
        i = start = end
        after_call = kind == TOOL_CALL and close >= 0
    segments.append((REASONING, text[start:]))
    return [(k, s) for k, s in segments if s]
