"""A deterministic scripted `RolloutBackend` for workflow tests: each call's completion is whatever
`reply(request, text_of_prompt)` says, tokenised as a rollout would write it (the tag state machine's kinds,
`shift` routes), with no model at all. It records every request and how many calls were in flight when
each arrived, so a test can check that parallel calls reach the backend together."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rolerl.roles import PROMPT, TOOL_OUTPUT, shift, splice_tokenize, split_segments
from rolerl.rollout.engine import GenerationRequest
from rolerl.types import Turn


@dataclass
class Call:
    role: str
    prompt: str  # the decoded prompt
    completion: str
    in_flight: int  # calls in flight when this one arrived (itself included)
    request: GenerationRequest


@dataclass
class ScriptedBackend:
    tokenizer: Any
    reply: Callable[[GenerationRequest, str], str]  # (request, decoded prompt) -> completion text
    calls: list[Call] = field(default_factory=list)
    _in_flight: int = 0

    async def generate(self, request: GenerationRequest) -> Turn:
        self._in_flight += 1
        arrived = self._in_flight
        prompt = self.tokenizer.decode(request.prompt_ids)
        text = self.reply(request, prompt)
        for _ in range(3):  # let other coroutines submit before this call returns
            await asyncio.sleep(0)
        ids, kinds = splice_tokenize(self.tokenizer, split_segments(text, request.tags))
        ids.append(self.tokenizer.eos_token_id)
        kinds.append(kinds[-1] if kinds and kinds[-1] != TOOL_OUTPUT else "reasoning")
        routes = shift([PROMPT] * len(request.prompt_ids) + kinds, request.route_of or {})
        logprobs = [math.nan if k == TOOL_OUTPUT else -1.0 for k in kinds]
        self.calls.append(Call(request.role, prompt, text, arrived, request))
        self._in_flight -= 1
        return Turn(request.role, list(request.prompt_ids), ids, kinds, routes, logprobs, "eos")

    def close(self) -> None:
        pass

    def max_in_flight(self, role: str) -> int:
        return max((c.in_flight for c in self.calls if c.role == role), default=0)
