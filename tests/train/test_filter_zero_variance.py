"""`algorithm.filter_zero_variance` (DAPO dynamic sampling) in a training step: the turns of groups whose
rewards are all equal never reach the update, the others all do (issue 49)."""

from __future__ import annotations

import pytest

from rolerl.tasks import Example
from rolerl.train import rl
from rolerl.train.checkpoint import RunDir
from rolerl.train.rl import train
from rolerl.workflows import SingleTurn
from tests.train.test_rl import tiny_config


class ThreeGroups:
    """Three questions: every sample of `one` scores 1, every sample of `zero` 0, and the samples of
    `spread` score their text's character sum mod 7, over 7 (different texts, different rewards)."""

    name = "three_groups"

    def examples(self, split, n, seed):
        return [Example(q, f"Tell me about {q}.", "") for q in ("one", "zero", "spread")][:n]

    def prompt(self, example):
        return [{"role": "user", "content": example.question}]

    def reward(self, example, text):
        return {"one": 1.0, "zero": 0.0}.get(example.id, sum(map(ord, text)) % 7 / 7)


@pytest.mark.parametrize("filtered", [True, False])
def test_rows_of_groups_that_scored_alike_never_reach_the_update(tmp_path, monkeypatch, filtered):
    seen: dict[str, list] = {"credit": [], "collated": [], "parts": []}
    real_rewards, real_collate, real_update = rl.turn_rewards, rl.collate_parts, rl.ppo_update

    def rewards(episodes, alg):
        seen["credit"].append(out := real_rewards(episodes, alg))
        return out

    def collate(policy, turns, advantages, owned=None):
        seen["collated"].append((list(turns), list(advantages)))
        return real_collate(policy, turns, advantages, owned)

    def update(parts, *args, **kwargs):
        seen["parts"].append([p.batch for p in parts])
        return real_update(parts, *args, **kwargs)

    monkeypatch.setattr(rl, "turn_rewards", rewards)
    monkeypatch.setattr(rl, "collate_parts", collate)
    monkeypatch.setattr(rl, "ppo_update", update)
    task = ThreeGroups()
    cfg = tiny_config(tmp_path, "train.steps=1", "train.tasks_per_step=3", "rollout.n=4",
                      f"algorithm.filter_zero_variance={str(filtered).lower()}")  # fmt: skip
    train(cfg, task=task, workflow=SingleTurn(task))
    (credit,) = seen["credit"]
    # group_key task: one group per question
    assert credit.keys == ["one"] * 4 + ["zero"] * 4 + ["spread"] * 4
    assert credit.rewards[:8].tolist() == [1.0] * 4 + [0.0] * 4
    assert len(set(credit.rewards[8:].tolist())) > 1, "the spread group must have a spread"
    ((turns, advantages),) = seen["collated"]
    want = credit.turns[8:] if filtered else credit.turns
    assert len(turns) == len(want) and all(a is b for a, b in zip(turns, want, strict=True))
    assert all(a != 0 for a in advantages[-4:])
    ((batch,),) = seen["parts"]
    assert batch.input_ids.shape[0] == len(want)
    for row, turn in enumerate(want):  # the update's rows are those turns' tokens
        assert batch.input_ids[row, : len(turn.ids)].tolist() == turn.ids
    (row,) = RunDir(tmp_path, tensorboard=False).read_metrics()
    if filtered:
        assert row["filtered/zero_variance_frac"] == pytest.approx(8 / 12)
        # the normaliser counts the spread group's loss tokens only
        assert row["role/policy/loss_tokens"] == float(batch.loss_mask.sum())
    else:
        assert "filtered/zero_variance_frac" not in row and advantages[:8] == [0.0] * 8
