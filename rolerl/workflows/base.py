"""What a workflow is, and the `Context` it talks to the model through.

A workflow is a plain async function of `(ctx, example)` that returns an `Episode`; many run at once and
the rollout backend batches their model calls together. `ctx.generate(role, messages)` applies the chat
template, routes every token of the call with the topology's table for that role, seeds the call
deterministically, and records the `Turn` (exact ids, kinds, routes, log-probs) for training.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from rolerl.roles import Tags
from rolerl.rollout.recorder import GenerationRequest
from rolerl.rollout.sampling import SamplingParams
from rolerl.rollout.scheduler import RolloutBackend
from rolerl.tasks.base import Example, Messages
from rolerl.types import Episode, Turn
from rolerl.workflows.chat import follow_up_ids


def derive_seed(*parts: int | str) -> int:
    """A 63-bit seed that is a pure function of `parts` (run seed, step, task, sample, call...).

    The engine's sampling is counter-based per request seed, so a call's tokens depend on its seed only:
    deriving seeds from the call's coordinates makes a resumed run sample exactly what the uninterrupted
    run sampled.
    """
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


@dataclass(frozen=True)
class RoleCalls:
    """How one role's calls run, where it differs from the `Context`'s defaults: the model (and its
    tokenizer) that serves them, and call settings that leave the trainer's log-probs as they are."""

    model: str = "main"  # the engine that serves the role (`GenerationRequest.model`)
    tokenizer: Any = None  # None = the context's
    max_new_tokens: int | None = None
    top_p: float | None = None
    max_tool_calls: int | None = None
    tool: str | None = None  # the engine tool its calls may call; None = the context's, "none" = no tool
    stop: tuple[str, ...] = ()  # stop strings added to each call's own
    tags: Mapping[str, str] = field(default_factory=dict)  # tool and output tags replacing the call's

    def sampling(self) -> dict[str, Any]:
        """The `SamplingParams` fields this role overrides."""
        out = {"max_new_tokens": self.max_new_tokens, "top_p": self.top_p}
        return {k: v for k, v in out.items() if v is not None}


@runtime_checkable
class Workflow(Protocol):
    roles: tuple[str, ...]  # the roles it calls `ctx.generate` with (the topology is built for these)
    # optional: `tool = "python"`, the engine tool it needs when none is configured (`rolerl eval`);
    # `role_tags = {"policy": SEARCH_TAGS}`, a role whose calls use other tags than `Tags()` (its
    # demonstrations are cut with them, `rolerl sft`: see `role_tags`)

    async def run(self, ctx: Context, example: Example) -> Episode: ...


@dataclass
class Context:
    """One episode's handle on the model. Fresh per episode; `turns` collects its model calls in order."""

    backend: RolloutBackend
    tokenizer: Any
    route_of: Mapping[str, Mapping[str, int]]  # role -> (kind -> adapter index), `Topology.route_of`
    sampling: SamplingParams  # the run's defaults; `generate(**overrides)` replaces fields per call
    seed: int  # the episode's seed; call k samples with `derive_seed(seed, k)`
    tool: str | None = None  # the engine tool a closed tool tag calls; None = tags are plain text
    tags: Tags = field(default_factory=Tags)
    max_tool_calls: int = 4
    roles: Mapping[str, RoleCalls] = field(default_factory=dict)  # per-role model and call settings
    turns: list[Turn | None] = field(default_factory=list)  # None: a call still in flight
    problems: dict[str, int] = field(default_factory=dict)  # malformed outputs by case (`malformed`)
    measures: dict[str, list[float]] = field(default_factory=dict)  # role metric -> [sum, count] (`measure`)

    async def generate(
        self,
        role: str,
        messages_or_ids: Messages | Sequence[int],
        *,
        tags: Tags | None = None,
        **sampling: Any,
    ) -> Turn:
        """One model call as `role`: chat messages (template applied, generation prompt added) or token ids.
        `tags` replaces the context's tool/answer tags for this call (a search agent's `<search>`)."""
        if role not in self.route_of:
            raise ValueError(f"role {role!r} is not in this run's topology; roles: {sorted(self.route_of)}")
        if sampling.get("temperature", self.sampling.temperature) != self.sampling.temperature:
            raise ValueError(
                f"ctx.generate(temperature={sampling['temperature']}): the trainer computes log-probs at the "
                f"run's temperature ({self.sampling.temperature}), so a call sampled at another one would "
                "get wrong PPO ratios; change rollout.temperature instead"
            )
        calls = self.roles.get(role, RoleCalls())
        ids = self.prompt_ids(messages_or_ids, role)
        seed = derive_seed(self.seed, len(self.turns))  # call k of this episode
        params = dataclasses.replace(self.sampling, **{"seed": seed, **calls.sampling(), **sampling})
        if calls.stop:
            params = dataclasses.replace(params, stop=tuple(dict.fromkeys((*params.stop, *calls.stop))))
        tool = self.tool if calls.tool is None else (None if calls.tool == "none" else calls.tool)
        request = GenerationRequest(
            ids,
            params,
            role=role,
            route_of=self.route_of[role],
            tags=dataclasses.replace(tags or self.tags, **calls.tags),
            tool=tool,
            max_tool_calls=self.max_tool_calls if calls.max_tool_calls is None else calls.max_tool_calls,
            model=calls.model,
        )
        self.turns.append(None)  # reserve the call's index before awaiting (seeds stay per call index)
        index = len(self.turns) - 1
        turn = await self.backend.generate(request)
        self.turns[index] = turn
        return turn

    def follow_up(self, turn: Turn, messages: Messages) -> list[int]:
        """The prompt ids of a call that continues `turn`'s conversation with `messages` (feedback, a tool
        result): `turn`'s exact ids, then the chat template around the new messages (`workflows.chat`).
        Pass them to `generate` instead of re-rendering decoded text."""
        return follow_up_ids(self.tokenizer_of(turn.role), turn, messages)

    def malformed(self, case: str) -> None:
        """Count one malformed model output of this episode (`workflow/<name>/malformed/<case>` in the
        step's metrics); the workflow applies its documented rule and carries on."""
        self.problems[case] = self.problems.get(case, 0) + 1

    def measure(self, metric: str, value: float) -> None:
        """One observation of a role's own metric (`workflow/<name>/<metric>` in the step's metrics: the
        mean of every observation of the step, pooled over its episodes; docs/WORKFLOWS.md lists them).
        A workflow observes where it knows the truth: per episode, per verdict, per worker..."""
        total = self.measures.setdefault(metric, [0.0, 0.0])
        total[0] += float(value)
        total[1] += 1.0

    def tokenizer_of(self, role: str | None) -> Any:
        """The tokenizer of `role`'s model (roles on other models have their own vocabulary)."""
        calls = self.roles.get(role) if role is not None else None
        return calls.tokenizer if calls is not None and calls.tokenizer is not None else self.tokenizer

    def prompt_ids(self, messages_or_ids: Messages | Sequence[int], role: str | None = None) -> list[int]:
        """Token ids of a prompt for `role` (its model's chat template), or `messages_or_ids` as given."""
        if messages_or_ids and isinstance(messages_or_ids[0], int):
            return list(messages_or_ids)
        enc = self.tokenizer_of(role).apply_chat_template(
            list(messages_or_ids), add_generation_prompt=True, tokenize=True, return_dict=True
        )
        return list(enc["input_ids"])

    def text(self, turn: Turn) -> str:
        """The completion as text (tool output included, special tokens dropped)."""
        return self.tokenizer_of(turn.role).decode(turn.completion_ids, skip_special_tokens=True)

    def episode(self, example: Example, reward: float, **metadata: Any) -> Episode:
        """The finished episode: every recorded turn, the outcome reward, and `correct` = reward >= 1."""
        metadata.setdefault("correct", reward >= 1.0)
        if self.problems:
            metadata.setdefault("malformed", dict(self.problems))
        if self.measures:
            metadata.setdefault("measures", {k: list(v) for k, v in self.measures.items()})
        turns = [t for t in self.turns if t is not None]  # a call never awaited is not part of the episode
        return Episode(task_id=example.id, turns=turns, reward=float(reward), metadata=metadata)


def workflow_name(workflow: Any) -> str:
    """The name its metrics go under (`workflow/<name>/...`): its `name`, else its class's, lower case."""
    return getattr(workflow, "name", type(workflow).__name__.lower())


def pooled_measures(measures: Sequence[Mapping[str, Sequence[float]]]) -> dict[str, float]:
    """Each role metric of many episodes' `metadata["measures"]` (`Context.measure`): the mean of all its
    observations, pooled (sum of sums over sum of counts), so an episode with three verdicts weighs three
    times one with one; a metric nobody observed is absent, not 0."""
    sums: dict[str, list[float]] = {}
    for m in measures:
        for metric, (total, count) in m.items():
            acc = sums.setdefault(metric, [0.0, 0.0])
            acc[0] += total
            acc[1] += count
    return {metric: total / count for metric, (total, count) in sorted(sums.items()) if count > 0}
