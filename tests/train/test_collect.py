"""`rolerl collect`: which calls rejection sampling keeps, token rows that SFT trains on exactly as sampled,
a resumed collection equal to the uninterrupted one, and the CLI from collection to SFT adapters."""

from __future__ import annotations

import json

import pytest

from rolerl.cli import main
from rolerl.eval.harness import EvalSpec
from rolerl.roles import PROMPT, shift
from rolerl.train.collect import Keep, collect, kept_calls
from rolerl.train.sft import demonstration_turns, read_demonstrations
from rolerl.types import Episode, Turn, runs_to_versions
from tests.train.test_rl import SMOKE

SPEC = dict(task="arithmetic", model="tiny:llama", split="train", max_new_tokens=6, limit=5, n=3,
            temperature=1.0, progress=False, chunk=2)  # fmt: skip


def call(role: str, reward: float | None = None) -> Turn:
    return Turn(role, [1, 2], [3], ["answer"], [0, 0, 0], [0.0], reward=reward)


def test_kept_calls_by_outcome_role_own_reward_and_cap():
    eps = [
        Episode(
            "t", [call("reasoner"), call("coder", 1.0), call("coder", 0.0)], 1.0, metadata={"correct": True}
        ),
        Episode("t", [call("reasoner"), call("coder", 0.2)], 0.0, metadata={"correct": False}),
        Episode("t", [call("reasoner"), call("coder", 1.0)], 1.0, role_rewards={"reasoner": 0.5}),
    ]
    idx = lambda keep: [(j, eps[j].turns.index(t)) for j, t in kept_calls(eps, keep)]  # noqa: E731
    assert idx(Keep()) == [(0, 0), (0, 1), (0, 2), (2, 0), (2, 1)]  # correct episodes, every call
    assert idx(Keep("all")) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert idx(Keep(roles=("coder",), min_reward=1.0)) == [(0, 1), (2, 1)]  # coder code that ran, solved
    assert idx(Keep("all", min_reward=0.6)) == [(0, 0), (0, 1), (2, 1)]  # reasoner of ep 2: its role's 0.5
    assert idx(Keep(max_per_example=1)) == [(0, 0), (0, 1), (0, 2)]
    with pytest.raises(ValueError, match="--keep 'best'; allowed: 'correct', 'all'"):
        Keep("best")  # type: ignore[arg-type]


def rows_of(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_collected_rows_are_the_rollouts_ids_and_sft_trains_them_as_they_are(tmp_path, tokenizer):
    out = tmp_path / "demos.jsonl"
    counts = collect(EvalSpec(**SPEC), out, Keep("all"), log_line=lambda _: None)
    rows = rows_of(out)
    assert counts == {"examples": 5, "episodes": 15, "kept_episodes": 15, "calls": 15} and len(rows) == 15
    assert [(r["example"], r["sample"]) for r in rows[:3]] == [(rows[0]["example"], j) for j in range(3)]
    row = rows[0]
    assert row["role"] == "policy" and row["vocab"] == len(tokenizer) and 1 <= len(row["completion_ids"]) <= 6
    assert tokenizer.decode(row["completion_ids"]) == row["text"]
    # the base model (no adapters in this spec) sampled every token: version -1 ("no adapter"), one run
    assert row["versions"] == [[-1, len(row["completion_ids"])]]
    assert runs_to_versions(row["versions"]) == [-1] * len(row["completion_ids"])
    assert tokenizer.decode(row["prompt_ids"]).endswith("<|im_start|>assistant\n")
    # SFT reads the ids, kinds and routes as sampled: nothing re-tokenised
    data = read_demonstrations(out)
    route_of = {"policy": {"prompt": 0, "reasoning": 0, "tool_call": 1, "tool_output": 0, "answer": 0}}
    (turn,) = demonstration_turns(tokenizer, data[0], route_of)
    assert turn.prompt_ids == row["prompt_ids"] and turn.completion_ids == row["completion_ids"]
    assert turn.kinds == row["kinds"]
    assert turn.routes == shift([PROMPT] * len(row["prompt_ids"]) + row["kinds"], route_of["policy"])
    # correct-only keeps nothing from a random model (and writes an empty file)
    assert collect(EvalSpec(**SPEC), tmp_path / "none.jsonl", Keep(), log_line=lambda _: None)["calls"] == 0
    assert (tmp_path / "none.jsonl").read_text() == ""


def test_resume_after_a_kill_gives_the_uninterrupted_collection(tmp_path):
    full = tmp_path / "full.jsonl"
    collect(EvalSpec(**SPEC), full, Keep("all"), log_line=lambda _: None)
    lines = full.read_text().splitlines()
    first = json.loads(lines[0])["example"]
    cut = tmp_path / "cut.jsonl"
    # killed after the first chunk's rows were written but before it was marked done, mid-line
    cut.write_text("\n".join(lines[:7]) + "\n" + lines[7][:25])
    (tmp_path / "cut.jsonl.done").write_text(first + "\n")
    with pytest.raises(ValueError, match="exists: continue it with --resume"):
        collect(EvalSpec(**SPEC), cut, Keep("all"), log_line=lambda _: None)
    collect(EvalSpec(**SPEC), cut, Keep("all"), resume=True, log_line=lambda _: None)
    assert cut.read_text() == full.read_text()  # each sample's seed is a function of (seed, example, j)
    cut.unlink()  # a fresh collection into the same path ignores the old record of examples done
    collect(EvalSpec(**SPEC), cut, Keep("all"), log_line=lambda _: None)
    assert cut.read_text() == full.read_text()


def test_token_rows_are_checked(tmp_path, tokenizer):
    good = {
        "role": "policy",
        "prompt_ids": [1, 2],
        "completion_ids": [3, 4],
        "kinds": ["reasoning", "answer"],
    }
    cases = [
        ({"kinds": ["reasoning"]}, "1 kinds for 2 completion ids"),
        ({"kinds": ["reasoning", "prompt"]}, r"unknown completion kinds \['prompt'\]"),
        ({"completion_ids": [3, -1]}, r"completion_ids must hold token ids \(integers >= 0\)"),
        ({"prompt_ids": "1 2"}, "prompt_ids must be a list"),
    ]
    for change, message in cases:
        path = tmp_path / "bad.jsonl"
        path.write_text(json.dumps(good | change) + "\n")
        with pytest.raises(ValueError, match=f"bad.jsonl:1: {message}"):
            read_demonstrations(path)
    route_of = {"policy": {}}
    path = tmp_path / "other.jsonl"
    path.write_text(
        json.dumps(good | {"vocab": 259}) + "\n" + json.dumps(good | {"completion_ids": [3, 10**6]})
    )
    first, second = read_demonstrations(path)
    with pytest.raises(
        ValueError, match="collected with a tokenizer of 259 tokens; role 'policy' runs on one of"
    ):
        demonstration_turns(tokenizer, first, route_of)
    with pytest.raises(ValueError, match="other.jsonl:2: token id 1000000 is outside the vocabulary"):
        demonstration_turns(tokenizer, second, route_of)


def test_cli_collect_then_sft(tmp_path, capsys):
    out = tmp_path / "demos.jsonl"
    args = ["collect", "--task", "arithmetic", "--model", "tiny:llama", "--limit", "2", "--n", "2",
            "--max-new-tokens", "4", "--keep", "all", "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["calls"] == 4
    assert main([*args[:-2], "--roles", "judge", "--out", str(tmp_path / "x.jsonl")]) == 2
    assert "--roles ['judge'] are not roles of single_turn" in capsys.readouterr().err
    sft = ["sft", SMOKE, "--data", str(out), "--set", "model.spec=tiny:llama", "model.device=cpu",
           "adapters.rank=4", f"run.dir={tmp_path / 'sft'}", "run.tensorboard=false"]  # fmt: skip
    assert main(sft) == 0
    assert (tmp_path / "sft" / "adapters" / "policy" / "adapter_model.safetensors").is_file()
