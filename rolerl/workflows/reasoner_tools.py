"""Reasoner + tool agent (MSARL, PAPERS 3): a reasoner plans and asks for computations in natural language,
`<request>...</request>`; a `coder` tool agent (its own role, its own small model under `separate`) writes
Python for each request in `<code>` tags, which the sandbox runs (the engine splices `<output>`); the
reasoner continues from its own exact ids plus "Result: ..." (`ctx.follow_up`) until it answers in
`<answer>` tags. Requests are the reasoner's tool calls (`REASONER_TAGS`): its calls stop at
`</request>` before any tool runs, and under `dart` the request tokens train the tool adapter, as a
search query does in the search agent. v4's condensing interpreter role is not built: the engine already
cuts long output to `tool_output_tokens`.

Nested sampling (the MSARL prototype's `n_reasoning x n_code`): each request gets `coder_samples` coder
calls, gathered in parallel, siblings on one prompt. The reasoner is given the output of the first sample
whose code ran without error, else the first one's error (the prototype extends the history with the best
code's output; running is the only score known before the outcome). A coder sample "ran" when it made a
tool call and its last call did not fail (a coder may fix its code and rerun). With `role_rewards` each
coder call's `Turn.reward` is the prototype's graded code reward, its "matches the intermediate ground
truth" read as "the episode is solved": 1.0 if it ran and the episode is solved, 0.2 if it ran and the
episode is not, 0.0 if it failed or wrote no code; without, the coder gets the outcome. The reasoner's
reward is the outcome (the task's reward on its last text). As in MSARL v4, a request's samples are a
sibling group (`Turn.group`, with `sibling_groups` and `coder_samples` > 1): their advantages compare them
with each other, while the reasoner's group is `algorithm.group_key`'s, over the task's episodes. Greedy
decoding (`temperature` 0: a greedy `rolerl eval`) would write one program `coder_samples` times over, so
a request then gets one coder call, which stands for them all (same result, same rewards).

Role metrics (`Context.measure`, `workflow/reasoner_tools/<metric>`; docs/WORKFLOWS.md):
- `coder_ran`: per coder call, its code ran (a tool call whose last call did not fail);
- `coder_reward`: per coder call, its own reward (the graded reward above; the outcome without
  `role_rewards`);
- `reasoner_uses_result`: over the episodes that end in an `<answer>` after at least one result that did
  not error, the answer is a value the coder returned: the answer (stripped) equals a non-empty line of
  such a result (stripped) or a number in one, numbers compared as numbers (`42` = `42.0`).

Malformed output (counted, `workflow/reasoner_tools/malformed/<case>`; the call goes on):
- `no_answer`: a reasoner turn with neither a request nor an answer (or no answer after the cap): graded;
- `empty_request`: the result is an error message, no coder runs (it counts as a request);
- `no_code`: a coder sample without a tool call (reward 0); if no sample has one, the result is an error;
- `tool_cap`: a request beyond `max_tool_requests` is not served; the reasoner is asked to answer now.
"""

from __future__ import annotations

import asyncio
import re

from rolerl.roles import Tags
from rolerl.tasks.base import Example, Messages, Task
from rolerl.types import Episode, Turn
from rolerl.workflows.base import Context

REASONER_TAGS = Tags(
    tool_open="<request>", tool_close="</request>", output_open="<result>", output_close="</result>"
)
REASONER_SYSTEM = (
    "Solve the problem step by step. A tool agent can run Python for you: when you need a computation, "
    "describe it in words inside <request></request> (e.g. <request>compute 17 * 23</request>) and stop; "
    "its result comes back as 'Result: ...'. Put the final answer inside <answer></answer> tags, e.g. "
    "<answer>42</answer>."
)
CODER_SYSTEM = (
    "You are a Python tool agent. Write Python code between <code> and </code> that does what the request "
    "asks and prints the result. It runs, and its output appears between <output> and </output>."
)
CAP_MESSAGE = (
    "No more tool requests are possible ({m} used). Give your final answer now in <answer></answer> tags."
)
_ACTION = re.compile(r"<(request|answer)>(.*?)</\1>", re.DOTALL)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")


def uses_result(answer: str, results: list[str]) -> bool:
    """Whether `answer` is a value of the tool `results` (the `reasoner_uses_result` rule, module doc)."""
    answer = answer.strip()
    values = [line.strip() for r in results for line in r.splitlines() if line.strip()]
    values += [n for r in results for n in _NUMBER.findall(r)]
    if answer in values:
        return True
    if not _NUMBER.fullmatch(answer):
        return False
    return any(_NUMBER.fullmatch(v) and float(v) == float(answer) for v in values)


def next_action(text: str) -> tuple[str | None, str]:
    """`("request" | "answer", body)` of the first closed request or answer tag in `text`, or `(None, "")`."""
    m = _ACTION.search(text)
    return (m.group(1), m.group(2).strip()) if m else (None, "")


class ReasonerTools:
    name = "reasoner_tools"
    roles = ("reasoner", "coder")
    tool = "python"  # the engine tool it needs (`rolerl eval` and `collect` default to it)
    role_tags = {"reasoner": REASONER_TAGS}  # the requests are the reasoner's tool calls

    def __init__(
        self,
        task: Task,
        max_tool_requests: int = 3,
        coder_samples: int = 1,
        role_rewards: bool = True,
        sibling_groups: bool = True,
    ) -> None:
        if max_tool_requests < 0:
            raise ValueError(
                f"reasoner_tools: max_tool_requests={max_tool_requests}; allowed: an integer >= 0"
            )
        if coder_samples < 1:
            raise ValueError(f"reasoner_tools: coder_samples={coder_samples}; allowed: an integer >= 1")
        self.task, self.max_tool_requests = task, max_tool_requests
        self.coder_samples, self.role_rewards = coder_samples, role_rewards
        self.sibling_groups = sibling_groups and coder_samples > 1  # a group of one has no signal

    async def run(self, ctx: Context, example: Example) -> Episode:
        if ctx.tool != "python":
            raise ValueError("the reasoner_tools workflow needs the Python tool: set rollout.tool=python")
        question = [m for m in self.task.prompt(example) if m["role"] != "system"]
        turn = await self._reason(ctx, [{"role": "system", "content": REASONER_SYSTEM}, *question])
        coders: list[tuple[Turn, bool]] = []  # every coder call and whether its code ran
        served: list[str] = []  # the outputs of the results that did not error
        requests = 0
        while True:
            action, request = next_action(ctx.text(turn))
            if action != "request":
                if action is None:
                    ctx.malformed("no_answer")
                break
            if requests == self.max_tool_requests:
                ctx.malformed("tool_cap")
                turn = await self._reason(ctx, self._reply(ctx, turn, CAP_MESSAGE.format(m=requests)))
                if next_action(ctx.text(turn))[0] != "answer":
                    ctx.malformed("no_answer")
                break
            requests += 1
            if not request:
                ctx.malformed("empty_request")
                result = "error: the request was empty"
            else:
                result = await self._tool_work(ctx, example, request, coders, served)
            turn = await self._reason(ctx, self._reply(ctx, turn, f"Result: {result}"))
        text = ctx.text(turn)
        reward = self.task.reward(example, text)
        check = getattr(self.task, "check", None)
        correct = check(example, text) if check is not None else reward >= 1.0
        if self.role_rewards:  # MSARL's graded tool-agent reward (module doc)
            for coder, ran in coders:
                coder.reward = (1.0 if correct else 0.2) if ran else 0.0
        for coder, ran in coders:
            ctx.measure("coder_ran", ran)
            ctx.measure("coder_reward", reward if coder.reward is None else coder.reward)
        action, answer = next_action(text)
        if served and action == "answer":
            ctx.measure("reasoner_uses_result", uses_result(answer, served))
        return ctx.episode(
            example, reward, correct=correct, text=text, requests=requests, code_ran=sum(r for _, r in coders)
        )

    async def _reason(self, ctx: Context, prompt: Messages | list[int]) -> Turn:
        return await ctx.generate("reasoner", prompt, tags=REASONER_TAGS, stop=("</request>", "</answer>"))

    @staticmethod
    def _reply(ctx: Context, turn: Turn, content: str) -> list[int]:
        return ctx.follow_up(turn, [{"role": "user", "content": content}])  # token in, token out

    async def _tool_work(
        self,
        ctx: Context,
        example: Example,
        request: str,
        coders: list[tuple[Turn, bool]],
        served: list[str],
    ) -> str:
        """One request: `coder_samples` sibling coder calls; the result the reasoner sees (module doc), its
        output added to `served` when it did not error."""
        prompt = [
            {"role": "system", "content": CODER_SYSTEM},
            {"role": "user", "content": f"Problem: {example.question}\n\nRequest: {request}"},
        ]
        n = 1 if ctx.sampling.temperature == 0 else self.coder_samples  # greedy siblings are one program
        samples = await asyncio.gather(*[ctx.generate("coder", prompt) for _ in range(n)])
        ran = [bool(t.tool_calls) and not t.tool_calls[-1].error for t in samples]
        request_index = len(coders) // n
        for t, ok in zip(samples, ran, strict=True):
            if self.sibling_groups and n > 1:
                t.group = f"request{request_index}"
            coders.append((t, ok))
            if not t.tool_calls:
                ctx.malformed("no_code")
        used = [t for t, ok in zip(samples, ran, strict=True) if ok] + [t for t in samples if t.tool_calls]
        if not used:
            return "error: the tool agent wrote no code"
        call = used[0].tool_calls[-1]
        output = call.output.strip() or "(no output)"
        if not call.error:
            served.append(output)
        return f"error\n{output}" if call.error else output
