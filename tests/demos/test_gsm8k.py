"""GSM8K demonstrations (rolerl/demos/gsm8k.py): hand-picked train rows converted with the real
sandbox, each call reproducing its annotation; the drop reasons; the test split never read; the JSONL
trained by `rolerl sft` on the tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rolerl.demos import gsm8k as gd
from rolerl.roles import TOOL_CALL, TOOL_OUTPUT, Tags, format_tool_output, split_segments
from rolerl.tasks import math as math_tasks
from rolerl.tasks.math import MathTask
from rolerl.tools.base import ToolResult
from rolerl.train.checkpoint import RunDir
from rolerl.workflows.reasoner_tools import CODER_SYSTEM, REASONER_SYSTEM

# Rows of GSM8K's train.jsonl (0-based row numbers), chosen by hand.
DECIMAL_MONEY = {  # row 1: a division with a decimal result, money with `$`
    "question": "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. "
    "How much did she earn?",
    "answer": "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\nWorking 50 minutes, she earned 0.2 x 50 = "
    "$<<0.2*50=10>>10.\n#### 10",
}
MONEY = {  # row 2: money with `$`, a four-term expression
    "question": "Betty is saving money for a new wallet which costs $100. Betty has only half of the money "
    "she needs. Her parents decided to give her $15 for that purpose, and her grandparents twice as much as "
    "her parents. How much more money does Betty need to buy the wallet?",
    "answer": "In the beginning, Betty has only 100 / 2 = $<<100/2=50>>50.\nBetty's grandparents gave her "
    "15 * 2 = $<<15*2=30>>30.\nThis means, Betty needs 100 - 50 - 30 - 15 = $<<100-50-30-15=5>>5 more.\n#### 5",
}
MULTI_STEP = {  # row 5: five steps, two of them percentages
    "question": "Mark has a garden with flowers. He planted plants of three different colors in it. Ten of "
    "them are yellow, and there are 80% more of those in purple. There are only 25% as many green flowers as "
    "there are yellow and purple flowers. How many flowers does Mark have in his garden?",
    "answer": "There are 80/100 * 10 = <<80/100*10=8>>8 more purple flowers than yellow flowers.\nSo in "
    "Mark's garden, there are 10 + 8 = <<10+8=18>>18 purple flowers.\nPurple and yellow flowers sum up to "
    "10 + 18 = <<10+18=28>>28 flowers.\nThat means in Mark's garden there are 25/100 * 28 = <<25/100*28=7>>7 "
    "green flowers.\nSo in total Mark has 28 + 7 = <<28+7=35>>35 plants in his garden.\n#### 35",
}
PERCENT = {  # row 26: a percentage written as `* .01`, a decimal result
    "question": "Jack is stranded on a desert island. He wants some salt to season his fish. He collects 2 "
    "liters of seawater in an old bucket. If the water is 20% salt, how many ml of salt will Jack get when "
    "all the water evaporates?",
    "answer": "First find how many liters of the seawater are salt: 2 liters * 20% = <<2*20*.01=.4>>.4 "
    "liters\nThen multiply that amount by 1000 ml/liter to find the number of ml of salt Jack gets: .4 liters "
    "* 1000 ml/liter = <<.4*1000=400>>400 ml\n#### 400",
}
NO_ANNOTATION = {  # row 29
    "question": "Mrs. Snyder used to spend 40% of her monthly income on rent and utilities. Her salary was "
    "recently increased by $600 so now her rent and utilities only amount to 25% of her monthly income. How "
    "much was her previous monthly income?",
    "answer": "Let her previous monthly income be p\nThe cost of her rent and utilities was 40% of p which is "
    "(40/100)*p = 2p/5\nDividing both sides by 3 gives p = $1000\n#### 1000",
}
HAND_PICKED = [DECIMAL_MONEY, MONEY, MULTI_STEP, PERCENT]
# What Python prints for each annotation's expression (worked out by hand: `/` is a float division).
OUTPUTS = [
    ["0.2\n", "10.0\n"],
    ["50.0\n", "30\n", "5\n"],
    ["8.0\n", "18\n", "28\n", "7.0\n", "35\n"],
    ["0.4\n", "400.0\n"],
]
ANSWERS = ["10", "5", "35", "400"]


class Eval:
    """A stand-in for the sandbox where none can run: Python's own `print(eval(...))` of the call."""

    def __init__(self, override: dict[str, str] | None = None) -> None:
        self.override, self.calls = override or {}, []

    def run(self, args: str) -> ToolResult:
        self.calls.append(args)
        if args in self.override:
            return ToolResult(stdout=self.override[args])
        try:
            return ToolResult(stdout=f"{eval(args.removeprefix('print(')[:-1])}\n")  # noqa: S307
        except SyntaxError as e:
            return ToolResult(stderr=f"SyntaxError: {e}\n", exit_code=1)


def write_data(root: Path, rows: list[dict], test: str | None = "") -> Path:
    """A data root holding gsm8k/train.jsonl (and test.jsonl unless `test` is None)."""
    (root / "gsm8k").mkdir(parents=True)
    (root / "gsm8k" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if test is not None:
        (root / "gsm8k" / "test.jsonl").write_text(test)
    return root


def examples(tmp_path: Path, rows: list[dict]) -> tuple[MathTask, list]:
    task = MathTask("gsm8k", write_data(tmp_path, rows), split="train", prompt_style="tool")
    return task, task.dataset("train").examples


def test_hand_picked_rows_reproduce_their_annotations_in_the_sandbox(tmp_path, sandbox):
    task, exs = examples(tmp_path, HAND_PICKED)
    for ex, outputs, answer in zip(exs, OUTPUTS, ANSWERS, strict=True):
        solution = gd.check(ex, task, sandbox)
        assert [s.output for s in solution.steps] == outputs, ex.id
        assert solution.answer == answer
        for step in solution.steps:  # each call's code, rerun, prints its annotation's value
            printed = sandbox.run(step.code).stdout
            assert float(printed) == pytest.approx(float(step.written.lstrip("$")), rel=1e-12)
        text = gd.tir_text(solution, task.tags)
        assert task.check(ex, text)  # the project's grader reads the tagged answer as the gold
        calls = [seg for kind, seg in split_segments(text, task.tags) if kind == TOOL_OUTPUT]
        assert calls == [format_tool_output(task.tags, o) for o in outputs]  # spliced as the engine does


def test_tir_text_of_a_decimal_division_with_money(tmp_path):
    task, (ex,) = examples(tmp_path, [DECIMAL_MONEY])
    text = gd.tir_text(gd.check(ex, task, Eval()), Tags())
    assert text == (
        "Weng earns 12/60 =\n<code>\nprint(12/60)\n</code><output>\n0.2\n</output>\n"
        "$0.2 per minute.\nWorking 50 minutes, she earned 0.2 x 50 =\n<code>\nprint(0.2*50)\n</code>"
        "<output>\n10.0\n</output>\n$10.\nThe answer is <answer>10</answer>."
    )
    kinds = [k for k, _ in split_segments(text, Tags())]
    assert kinds.count(TOOL_CALL) == 2 and kinds.count(TOOL_OUTPUT) == 2  # two calls, two outputs spliced


def test_msarl_split_of_a_multi_step_solution(tmp_path):
    task, (ex,) = examples(tmp_path, [MONEY])
    reasoner, *coders = gd.msarl_demonstrations(gd.check(ex, task, Eval()), task)
    assert reasoner["role"] == "reasoner" and [c["role"] for c in coders] == ["coder"] * 3
    m = reasoner["messages"]
    assert m[0] == {"role": "system", "content": REASONER_SYSTEM}
    assert m[1] == {"role": "user", "content": MONEY["question"]}
    assert [x["role"] for x in m[2:]] == ["assistant", "user"] * 3 + ["assistant"]
    assert m[2]["content"] == "In the beginning, Betty has only 100 / 2 =\n<request>compute 100/2</request>"
    assert m[4]["content"] == "$50.\nBetty's grandparents gave her 15 * 2 =\n<request>compute 15*2</request>"
    assert [x["content"] for x in m[3::2]] == ["Result: 50.0", "Result: 30", "Result: 5"]
    assert m[-1]["content"] == "$5 more.\nThe answer is <answer>5</answer>."
    assert task.check(ex, m[-1]["content"])
    assert coders[2]["messages"] == [
        {"role": "system", "content": CODER_SYSTEM},
        {"role": "user", "content": f"Problem: {MONEY['question']}\n\nRequest: compute 100-50-30-15"},
        {"role": "assistant", "content": "<code>\nprint(100-50-30-15)\n</code><output>\n5\n</output>\n"},
    ]


def test_rows_are_dropped_by_reason(tmp_path):
    wrong_last = {**MONEY, "answer": MONEY["answer"].replace("#### 5", "#### 6")}
    unreadable = {**PERCENT, "answer": PERCENT["answer"].replace("=.4>>", "=x>>")}
    no_run = {**MULTI_STEP, "answer": MULTI_STEP["answer"].replace("<<10+8=", "<<10+08=")}  # leading zero
    rows = [DECIMAL_MONEY, NO_ANNOTATION, wrong_last, unreadable, no_run, MULTI_STEP, {"question": "q"}]
    out = tmp_path / "out.jsonl"
    runner = Eval(override={"print(25/100*28)": "7.5\n"})  # MULTI_STEP's 4th call "prints" a wrong value
    report = gd.build("tir", out, data=write_data(tmp_path / "d", rows), runner=runner, progress=False)
    assert report.summary() == {"rows": 7, "kept": 1, "calls": 2, "dropped": {
        "unreadable_row": 1, "no_annotation": 1, "annotation_unreadable": 1, "code_error": 1,
        "output_differs": 1, "answer_differs": 1}}  # fmt: skip
    assert (
        report.first["output_differs"] == "gsm8k/train/5"
        and report.first["unreadable_row"] == "gsm8k/train/6"
    )
    assert [json.loads(x)["messages"][1]["content"] for x in out.read_text().splitlines()] == [
        DECIMAL_MONEY["question"]
    ]
    capped = gd.build("msarl", out, data=tmp_path / "d", limit=3, max_calls=1, runner=Eval(), progress=False)
    assert capped.summary()["dropped"] == {"no_annotation": 1, "too_many_calls": 2}
    assert out.read_text() == ""  # rewritten, atomically, with nothing kept


def test_the_test_split_is_never_read(tmp_path, monkeypatch):
    read = []
    real = math_tasks._file_rows
    monkeypatch.setattr(math_tasks, "_file_rows", lambda path: read.append(Path(path).name) or real(path))
    root = write_data(tmp_path, HAND_PICKED, test="not json, and never opened\n")
    report = gd.build("tir", tmp_path / "o.jsonl", data=root, runner=Eval(), progress=False)
    assert report.kept == 4 and read == ["train.jsonl"]
    (root / "gsm8k" / "test.jsonl").unlink()  # no test file at all: nothing changes
    assert gd.build("msarl", tmp_path / "o.jsonl", data=root, runner=Eval(), progress=False).kept == 4
    with pytest.raises(ValueError, match="split='test'; allowed: 'train'"):
        gd.build("tir", tmp_path / "o.jsonl", data=root, split="test", runner=Eval())
    test_file = tmp_path / "t" / "test.jsonl"
    test_file.parent.mkdir()
    test_file.write_text(json.dumps(MONEY) + "\n")
    with pytest.raises(ValueError, match="is the 'test' split; asked for 'train'"):
        gd.build("tir", tmp_path / "o.jsonl", data=test_file, runner=Eval())
    assert read == ["train.jsonl", "train.jsonl"]


@pytest.mark.parametrize("fmt", gd.FORMATS)
def test_rolerl_sft_trains_a_step_on_the_demonstrations(tmp_path, fmt):
    from rolerl.cli import main

    root = write_data(tmp_path / "data", [MONEY, MULTI_STEP])
    out = tmp_path / f"{fmt}.jsonl"
    report = gd.build(fmt, out, data=root, runner=Eval(), progress=False)
    assert report.kept == 2 and report.calls == 8
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["role"] for r in rows] == (["policy"] * 2 if fmt == "tir" else ["reasoner"] + ["coder"] * 3
                                         + ["reasoner"] + ["coder"] * 5)  # fmt: skip
    # each row names its problem: a problem's rows train in one step, their common prompt start once
    ids = ["gsm8k/train/0", "gsm8k/train/1"]
    assert [r["id"] for r in rows] == (ids if fmt == "tir" else [ids[0]] * 4 + [ids[1]] * 6)
    # the recipe's own config; sft.batch_size counts calls (assistant messages): 64 puts them all in one step
    args = ["sft", f"gsm8k-{fmt}", "--data", str(out), "--set", "model.spec=tiny:llama", "model.device=cpu",
            "adapters.rank=4", f"run.dir={tmp_path / 'run'}", "run.tensorboard=false", "sft.epochs=1",
            "sft.batch_size=64"]  # fmt: skip
    assert main(args) == 0
    metrics = RunDir(tmp_path / "run", tensorboard=False).read_metrics()
    assert [m["step"] for m in metrics] == [1] and metrics[0]["loss/sft"] > 0


def test_cli_demos_refuses_without_a_sandbox_or_prints_counts(tmp_path, capsys, monkeypatch):
    from rolerl.cli import main

    root = write_data(tmp_path / "data", [DECIMAL_MONEY, NO_ANNOTATION])
    real = gd.build
    monkeypatch.setattr(gd, "build", lambda *a, **k: real(*a, **{**k, "runner": Eval()}))
    out = tmp_path / "d.jsonl"
    argv = ["demos", "gsm8k", "--format", "tir", "--out", str(out), "--data", str(root), "--no-progress"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out.strip().splitlines()[-1])
    assert {k: summary[k] for k in ("rows", "kept", "calls", "dropped")} == {
        "rows": 2, "kept": 1, "calls": 2, "dropped": {"no_annotation": 1}}  # fmt: skip
    assert "dropped     1 no_annotation (first: gsm8k/train/1)" in captured.err
    assert main([*argv, "--limit", "0"]) == 2
    assert "limit=0; allowed: an integer >= 1" in capsys.readouterr().err


def test_a_tir_demonstration_replayed_through_the_engine_gives_the_sft_tokens(tmp_path, tokenizer, sandbox):
    """The multi-step demonstration, its sampled tokens forced one by one through the `tir` workflow with
    the real sandbox: the engine splices the same output ids SFT trains on, and the episode is correct."""
    import asyncio

    from rolerl.models.lora import add_adapters
    from rolerl.models.tiny import tiny_model
    from rolerl.rollout.engine import Engine
    from rolerl.rollout.lockstep import LockstepBackend
    from rolerl.rollout.sampling import SamplingParams
    from rolerl.train.sft import demonstration_turns
    from rolerl.workflows import TIR, Context, derive_seed
    from tests.workflows.test_tir import scripted

    model, tok = tiny_model("llama", seed=0, tokenizer=tokenizer)  # one family: the splice is the tokenizer's
    add_adapters(model, ["policy"], rank=4)
    task, (ex,) = examples(tmp_path, [MULTI_STEP])
    row = gd.tir_demonstration(gd.check(ex, task, sandbox), task)
    route_of = {"policy": {k: 0 for k in ("prompt", "reasoning", "tool_call", "tool_output", "answer")}}
    (ref,) = demonstration_turns(tok, row, route_of)
    script = [t for t, k in zip(ref.completion_ids, ref.kinds, strict=True) if k != TOOL_OUTPUT]
    engine = Engine(model, tok, max_batch=1, tools={"python": sandbox},
                    sampler=scripted({derive_seed(7, 0): script}))  # fmt: skip
    ctx = Context(LockstepBackend(engine), tok, route_of, SamplingParams(max_new_tokens=len(script)), 7,
                  tool="python", max_tool_calls=5)  # fmt: skip
    episode = asyncio.run(ctx.backend.episode(TIR(task).run(ctx, ex)))
    (turn,) = episode.turns
    assert turn.prompt_ids == ref.prompt_ids and turn.completion_ids == ref.completion_ids
    assert turn.kinds == ref.kinds
    assert [c.output for c in turn.tool_calls] == OUTPUTS[2]
    assert episode.reward == 1.0 and episode.metadata["correct"] and episode.metadata["tool_calls"] == 5
