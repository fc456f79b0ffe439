"""A tiny built-in task: two-operand integer arithmetic, answered in `\\boxed{}` or `<answer>` tags.

Small on purpose: tests and smoke runs need a task that exists offline and rewards exactly. The real
synthetic task family (issue 6) lives in `synthetic.py`.
"""

from __future__ import annotations

import random
import re
import zlib

from rolerl.tasks.base import Example, Messages

SYSTEM = (
    "Solve the problem. Put the final answer, a single integer, inside <answer></answer> tags, "
    "e.g. <answer>42</answer>."
)
_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_TAGGED = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_INT = re.compile(r"^[-+]?\d[\d,]*$")
_LAST_INT = re.compile(r"(?<![\w.])-?\d+(?![\w.]\d)")  # integers standing alone (not 3 of 3.5 or x2)


def extract_answer(text: str) -> str | None:
    """The last `\\boxed{...}` or `<answer>...</answer>` in `text` (whichever comes later), stripped."""
    found = [(m.start(), m.group(1)) for m in _BOXED.finditer(text)]
    found += [(m.start(), m.group(1)) for m in _TAGGED.finditer(text)]
    return max(found)[1].strip() if found else None


def parse_int(answer: str | None) -> int | None:
    if answer is None:
        return None
    answer = answer.strip().rstrip(".").replace(" ", "")
    return int(answer.replace(",", "")) if _INT.match(answer) else None


class ArithmeticTask:
    """`a op b` with operands in `[0, max_operand]`; splits draw from disjoint seed streams.

    Strict (default): the answer is the last `<answer>`/`\\boxed{}` integer, reward 1 if right, else 0; an
    untrained small model never uses the tags, so every reward is 0. `lenient=True` also takes the last
    integer of a reply without tags, and `format_reward` goes to a wrong reply that still gave an integer:
    rewards that vary within a group from the first step (`task.name: arithmetic_lenient`, the smoke run).
    """

    name = "arithmetic"

    def __init__(
        self, max_operand: int = 20, ops: str = "+-*", *, lenient: bool = False, format_reward: float = 0.0
    ) -> None:
        bad = set(ops) - set(_OPS)
        if bad or not ops:
            raise ValueError(f"ops={ops!r}; allowed: a non-empty string of {''.join(_OPS)}")
        if not 0 <= format_reward < 1:
            raise ValueError(f"format_reward={format_reward}; allowed: a number in [0, 1)")
        self.max_operand, self.ops = max_operand, ops
        self.lenient, self.format_reward = lenient, format_reward

    def examples(self, split: str, n: int, seed: int) -> list[Example]:
        rng = random.Random(zlib.crc32(f"{split}/{seed}".encode()))
        out = []
        for i in range(n):
            a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
            op = rng.choice(self.ops)
            out.append(
                Example(f"arithmetic/{split}/{seed}/{i}", f"What is {a} {op} {b}?", str(_OPS[op](a, b)))
            )
        return out

    def prompt(self, example: Example) -> Messages:
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": example.question}]

    def answer_of(self, text: str) -> str | None:
        """The final answer as the reward reads it, normalised (an integer string), or None: what maj@k
        votes on."""
        answer = extract_answer(text)
        if answer is None and self.lenient:
            found = _LAST_INT.findall(text)
            answer = found[-1] if found else None
        value = parse_int(answer)
        return None if value is None else str(value)

    def reward(self, example: Example, text: str) -> float:
        value = self.answer_of(text)
        if value is None:
            return 0.0
        return 1.0 if int(value) == int(example.answer) else self.format_reward
