"""A built-in task family for tool-integrated reasoning: procedurally generated word problems with exact
integer answers, seeded train/test splits, an answer checker, and programmatic demonstrations.

The families come in two groups (docs/history/RESULTS-history.md has the probe that chose them):

- `FORMAT_FAMILIES` teach the format by imitation: a bare expression and one-step word problems (add,
  take away, groups of, three people's total, one unit conversion, the cost of several things). A warm
  start on their demonstrations learns to write `print(...)` in the tool tags, read the output and
  answer in `<answer>` tags.
- `RL_FAMILIES` are what RL trains and evaluation measures, each a composition of the format families'
  steps or a twist on one: a distractor quantity, a mixed-unit conversion, groups plus extras, equal
  sharing (a division), "k times as many". The warm-started model writes *some* expression for them,
  often the wrong one: its pass@1 is well below its pass@8, which is the gap a few dozen GRPO steps can
  close by sharpening. `PROBE_FAMILIES` adds the candidates the probe rejected (two steps and change from
  a payment, never solved in 8 samples; the difference of two counts, already solved).

Splits are disjoint by construction: a problem belongs to `test` iff a hash of its text falls in one
tenth of the hash space, so no `train` problem is ever a `test` problem, whatever the seeds.
"""

from __future__ import annotations

import json
import random
import re
import zlib
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from rolerl.roles import Tags, format_tool_output
from rolerl.tasks.arithmetic import extract_answer
from rolerl.tasks.base import Example, Messages

SYSTEM = (  # short on purpose: every rollout prefills it
    "Solve it with Python: write code in <code></code>, its output appears in <output></output>. "
    "Put the final integer answer in <answer></answer>."
)

NAMES = ("Ann", "Ben", "Carla", "Dev", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jack", "Kira", "Leo",
         "Maya", "Noah", "Olga", "Pablo", "Rosa", "Sam", "Tara", "Umar")  # fmt: skip
ITEMS = ("apples", "marbles", "stickers", "pencils", "cards", "coins", "books", "shells", "stamps", "cookies",
         "beads", "balloons")  # fmt: skip
CONTAINERS = ("boxes", "bags", "jars", "baskets", "crates", "packs")
THINGS = ("notebook", "pen", "ticket", "sandwich", "toy car", "plant", "cup of tea", "comic")
UNITS = (  # (big unit, small unit, small per big)
    ("hours", "minutes", 60),
    ("minutes", "seconds", 60),
    ("days", "hours", 24),
    ("weeks", "days", 7),
    ("meters", "centimeters", 100),
    ("kilograms", "grams", 1000),
    ("dollars", "cents", 100),
)

Problem = tuple[str, str, int]  # (question, the Python expression a demonstration prints, answer)


def _pick(rng: random.Random, seq: Sequence[Any], k: int = 1) -> list[Any]:
    return rng.sample(list(seq), k)


# ---- format families: what imitation teaches ------------------------------------------------------------


def _arith(rng: random.Random) -> Problem:
    a, b, c = rng.randint(12, 99), rng.randint(2, 30), rng.randint(2, 99)
    op1, op2 = rng.choice("+-*"), rng.choice("+-")
    expr = f"{a} {op1} {b} {op2} {c}"
    return f"Compute {expr}.", expr, eval(expr)  # noqa: S307 - digits and operators we generated


def _add(rng: random.Random) -> Problem:
    (name,), (item,) = _pick(rng, NAMES), _pick(rng, ITEMS)
    a, b = rng.randint(11, 150), rng.randint(11, 150)
    verb = rng.choice(("finds", "buys", "is given", "wins"))
    q = f"{name} has {a} {item}. {name} {verb} {b} more. How many {item} does {name} have now?"
    return q, f"{a} + {b}", a + b


def _sub(rng: random.Random) -> Problem:
    name, friend = _pick(rng, NAMES, 2)
    (item,) = _pick(rng, ITEMS)
    a = rng.randint(40, 200)
    b = rng.randint(5, a - 5)
    q = f"{name} has {a} {item} and gives {b} of them to {friend}. How many {item} does {name} have left?"
    return q, f"{a} - {b}", a - b


def _mul(rng: random.Random) -> Problem:
    (box,), (item,) = _pick(rng, CONTAINERS), _pick(rng, ITEMS)
    a, b = rng.randint(3, 40), rng.randint(3, 40)
    q = f"There are {a} {box} with {b} {item} in each. How many {item} are there in total?"
    return q, f"{a} * {b}", a * b


def _add3(rng: random.Random) -> Problem:
    names, (item,) = _pick(rng, NAMES, 3), _pick(rng, ITEMS)
    a, b, c = rng.randint(5, 90), rng.randint(5, 90), rng.randint(5, 90)
    q = (
        f"{names[0]} has {a} {item}, {names[1]} has {b} {item} and {names[2]} has {c} {item}. "
        f"How many {item} do they have together?"
    )
    return q, f"{a} + {b} + {c}", a + b + c


def _convert(rng: random.Random) -> Problem:
    big, small, per = rng.choice(UNITS)
    a = rng.randint(2, 19)
    return f"How many {small} are there in {a} {big}?", f"{a} * {per}", a * per


def _cost(rng: random.Random) -> Problem:
    (thing,) = _pick(rng, THINGS)
    price, count = rng.randint(2, 19), rng.randint(2, 9)
    q = f"A {thing} costs {price} dollars. How many dollars do {count} of them cost?"
    return q, f"{price} * {count}", price * count


# ---- RL families: what RL trains and evaluation measures ------------------------------------------------


def _two_step(rng: random.Random) -> Problem:
    name, friend = _pick(rng, NAMES, 2)
    (item,) = _pick(rng, ITEMS)
    a, b = rng.randint(20, 150), rng.randint(5, 90)
    c = rng.randint(3, a + b - 3)
    q = (
        f"{name} has {a} {item}. {name} buys {b} more and then gives {c} to {friend}. "
        f"How many {item} does {name} have now?"
    )
    return q, f"{a} + {b} - {c}", a + b - c


def _distractor(rng: random.Random) -> Problem:
    name, friend = _pick(rng, NAMES, 2)
    item, other = _pick(rng, ITEMS, 2)
    a, d = rng.randint(30, 200), rng.randint(10, 200)
    c = rng.randint(3, a - 3)
    q = (
        f"{name} has {a} {item} and {d} {other}. {name} gives {c} {item} to {friend}. "
        f"How many {item} does {name} have left?"
    )
    return q, f"{a} - {c}", a - c


def _change(rng: random.Random) -> Problem:
    (name,), (thing,) = _pick(rng, NAMES), _pick(rng, THINGS)
    price, count = rng.randint(2, 19), rng.randint(2, 9)
    paid = rng.choice([p for p in (20, 50, 100, 200) if p > price * count])
    q = (
        f"A {thing} costs {price} dollars. {name} buys {count} of them and pays with {paid} dollars. "
        f"How many dollars of change does {name} get?"
    )
    return q, f"{paid} - {price} * {count}", paid - price * count


def _units(rng: random.Random) -> Problem:
    big, small, per = rng.choice(UNITS)
    a, b = rng.randint(2, 19), rng.randint(1, per - 1)
    q = f"How many {small} are there in {a} {big} and {b} {small}?"
    return q, f"{a} * {per} + {b}", a * per + b


def _groups(rng: random.Random) -> Problem:
    (box,), (item,) = _pick(rng, CONTAINERS), _pick(rng, ITEMS)
    a, b, c = rng.randint(3, 30), rng.randint(3, 30), rng.randint(2, 60)
    q = f"There are {a} {box} with {b} {item} in each, and {c} more {item} on the table. How many {item} are there?"
    return q, f"{a} * {b} + {c}", a * b + c


def _difference(rng: random.Random) -> Problem:
    name, other = _pick(rng, NAMES, 2)
    (item,) = _pick(rng, ITEMS)
    a = rng.randint(40, 200)
    b = rng.randint(5, a - 5)
    q = f"{name} has {a} {item} and {other} has {b} {item}. How many more {item} does {name} have than {other}?"
    return q, f"{a} - {b}", a - b


def _share(rng: random.Random) -> Problem:
    (name,), (item,) = _pick(rng, NAMES), _pick(rng, ITEMS)
    each, friends = rng.randint(3, 25), rng.randint(2, 9)
    q = (
        f"{name} shares {each * friends} {item} equally among {friends} friends. "
        f"How many {item} does each friend get?"
    )
    return q, f"{each * friends} // {friends}", each


def _times(rng: random.Random) -> Problem:
    name, other = _pick(rng, NAMES, 2)
    (item,) = _pick(rng, ITEMS)
    a, k = rng.randint(5, 60), rng.randint(2, 9)
    q = f"{name} has {a} {item}. {other} has {k} times as many {item}. How many {item} does {other} have?"
    return q, f"{a} * {k}", a * k


FAMILIES: dict[str, Callable[[random.Random], Problem]] = {
    "arith": _arith,
    "add": _add,
    "sub": _sub,
    "mul": _mul,
    "add3": _add3,
    "convert": _convert,
    "cost": _cost,
    "two_step": _two_step,
    "distractor": _distractor,
    "change": _change,
    "units": _units,
    "groups": _groups,
    "difference": _difference,
    "share": _share,
    "times": _times,
}
FORMAT_FAMILIES: tuple[str, ...] = ("arith", "add", "sub", "mul", "add3", "convert", "cost")
# Chosen by the probe in docs/history/RESULTS-history.md: warm-start pass@8 well above pass@1, below saturation.
RL_FAMILIES: tuple[str, ...] = ("distractor", "units", "groups", "share", "times")
# Every candidate the probe measures; two_step and change had pass@8 = 0 (nothing for RL to sharpen),
# difference a pass@1 near 1 (nothing left to gain).
PROBE_FAMILIES: tuple[str, ...] = (*RL_FAMILIES, "two_step", "change", "difference")
SPLITS = ("train", "test")

_NUMBER = re.compile(r"^[-+]?\d[\d,]*(\.0*)?$")


def parse_answer(answer: str | None) -> int | None:
    """An integer from an answer string: `42`, ` 42. `, `+42`, `1,234`, `42.0`, `$42`; else None."""
    if answer is None:
        return None
    s = answer.strip().rstrip(".").replace(" ", "").lstrip("$")
    if not _NUMBER.match(s):
        return None
    return int(s.replace(",", "").split(".")[0])


def tool_call_text(code: str, output: str, tags: Tags) -> str:
    """A tool call in a demonstration: `code` in the tool tags, then the tool's `output` exactly as the
    engine splices it (`format_tool_output`, right after the closing tool tag)."""
    return f"{tags.tool_open}\n{code}\n{tags.tool_close}" + format_tool_output(tags, output)


def answer_text(answer: str | int, tags: Tags) -> str:
    """A demonstration's closing sentence with the tagged answer."""
    return f"The answer is {tags.answer_open}{answer}{tags.answer_close}."


def write_jsonl(path: str | Path, rows: Iterable[dict[str, Any]]) -> Path:
    """`rows` as JSONL at `path`, written atomically (a temporary file renamed into place)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.replace(path)
    return path


def demonstration_text(expr: str, answer: int, tags: Tags | None = None) -> str:
    """The assistant message of a demonstration: a tool call, its output exactly as the engine splices it
    (`format_tool_output`, right after the closing tool tag), and the tagged answer."""
    tags = tags or Tags()
    return tool_call_text(f"print({expr})", f"{answer}\n", tags) + answer_text(answer, tags)


class SyntheticTask:
    """Word problems from `families` (names of `FAMILIES`), drawn round-robin so every split is balanced.

    `examples(split, n, seed)` is a pure function of its arguments; `Example.meta` holds the family and the
    reference expression. The reward is 1 for the right integer in the last `<answer>` (or `\\boxed{}`),
    else 0; `format_reward` (default 0) is added to a wrong answer that is still well-formed (a tool call
    was made and an answer given), never to a right one.
    """

    def __init__(
        self, families: Sequence[str] = RL_FAMILIES, *, format_reward: float = 0.0, name: str = "synthetic"
    ) -> None:
        unknown = [f for f in families if f not in FAMILIES]
        if unknown or not families:
            raise ValueError(f"families={list(families)!r}; allowed: a non-empty list of {list(FAMILIES)}")
        if not 0 <= format_reward < 1:
            raise ValueError(f"format_reward={format_reward}; allowed: a number in [0, 1)")
        self.families, self.format_reward, self.name = tuple(families), format_reward, name

    def examples(self, split: str, n: int, seed: int) -> list[Example]:
        if split not in SPLITS:
            raise ValueError(f"split={split!r}; allowed: {list(SPLITS)}")
        rng = random.Random(zlib.crc32(f"{self.name}/{split}/{seed}".encode()))
        out: list[Example] = []
        while len(out) < n:
            family = self.families[len(out) % len(self.families)]
            question, expr, answer = FAMILIES[family](rng)
            if _split_of(question) != split:
                continue  # rejection keeps the splits disjoint
            meta = {"family": family, "expr": expr}
            out.append(Example(f"{self.name}/{split}/{seed}/{len(out)}", question, str(answer), meta))
        return out

    def prompt(self, example: Example) -> Messages:
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": example.question}]

    def answer_of(self, text: str) -> str | None:
        """The final answer, normalised, or None (what maj@k votes on)."""
        value = parse_answer(extract_answer(text))
        return None if value is None else str(value)

    def check(self, example: Example, text: str) -> bool:
        value = parse_answer(extract_answer(text))
        return value is not None and value == int(example.answer)

    def reward(self, example: Example, text: str) -> float:
        if self.check(example, text):
            return 1.0
        well_formed = "</code>" in text and extract_answer(text) is not None
        return self.format_reward if well_formed else 0.0

    def demonstration(self, example: Example, tags: Tags | None = None) -> dict[str, Any]:
        """One SFT row (`rolerl sft` JSONL): the prompt and the programmatic solution."""
        text = demonstration_text(example.meta["expr"], int(example.answer), tags)
        return {"role": "policy", "messages": [*self.prompt(example), {"role": "assistant", "content": text}]}

    def write_demonstrations(self, path: str | Path, n: int, seed: int, split: str = "train") -> Path:
        """`n` demonstrations of `split` as JSONL at `path` (written atomically)."""
        return write_jsonl(path, (self.demonstration(e) for e in self.examples(split, n, seed)))


def _split_of(question: str) -> str:
    return "test" if zlib.crc32(question.encode()) % 10 == 0 else "train"


def format_task() -> SyntheticTask:
    """The demonstration families (`task.name: synthetic_format`)."""
    return SyntheticTask(FORMAT_FAMILIES, name="synthetic_format")


def rl_task() -> SyntheticTask:
    """The RL / evaluation families (`task.name: synthetic`)."""
    return SyntheticTask(RL_FAMILIES, name="synthetic")
