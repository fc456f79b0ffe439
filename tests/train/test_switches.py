"""The switches the workflow studies depend on, set through the config as a user sets them (not only through
`Schedule(...)` or `RoleCalls(...)`): `train.step_policy` and `train.mini_batch_by` change the optimizer
steps each adapter takes (docs/TRAINING.md, "Optimizer steps"); `roles.<r>.top_p` and
`roles.<r>.max_new_tokens` reach that role's generation requests while another role keeps the run's
defaults. Each test fails when its field is ignored (checked by breaking the wiring in `rolerl.train.rl`)."""

from __future__ import annotations

import pytest

from rolerl.config import load_config
from rolerl.train import rl
from rolerl.train.checkpoint import RunDir
from rolerl.train.rl import train
from tests.train.test_rl import TINY

# 2 tasks x 4 samples of 3 voters and 1 aggregator: 24 voter rows and 8 aggregator rows, isolated adapters
VOTING = [*TINY, "train.steps=1", "task.name=arithmetic", "task.workflow=voting",
          "task.workflow_options={voters: 3}", "adapters.preset=isolated", "train.mini_batch_size=8"]  # fmt: skip


@pytest.mark.parametrize(
    ("switches", "steps"),
    [
        # mini-batches cut per role: the voters' 24 rows fill 3 mini-batches of 8, the aggregator's 8 one, so
        # the role with 3 parallel instances takes 3 steps per training step (paper 3's drift); mixed
        # mini-batches (`batch`) would be 4, each stepping the voter adapter
        (["train.mini_batch_by=role"], {"voter": 3, "aggregator": 1}),
        # the same mini-batches, merged: one step per adapter per PPO epoch (2 epochs)
        (
            ["train.mini_batch_by=role", "train.step_policy=merged", "train.ppo_epochs=2"],
            {"voter": 2, "aggregator": 2},
        ),
    ],
)
def test_step_policy_and_mini_batch_by_from_the_config(tmp_path, switches, steps):
    train(load_config(None, [*VOTING, f"run.dir={tmp_path}", *switches]))
    (row,) = RunDir(tmp_path, tensorboard=False).read_metrics()
    logged = {k.split("/")[1]: v for k, v in row.items() if k.startswith("adapter/") and k.endswith("/steps")}
    assert logged == {k: float(v) for k, v in steps.items()}
    merged = "train.step_policy=merged" in switches
    assert row["optimizer_steps"] == (2.0 if merged else 4.0)  # per_minibatch: one step per mini-batch


class Spy:
    """The run's rollout backend, recording every request and the turn it returned."""

    def __init__(self, real) -> None:
        self.real, self.calls = real, []

    async def generate(self, request):
        turn = await self.real.generate(request)
        self.calls.append((request, turn))
        return turn

    def __getattr__(self, name: str):
        return getattr(self.real, name)


def test_role_top_p_and_max_new_tokens_reach_that_roles_requests(tmp_path, monkeypatch):
    spies: list[Spy] = []
    real = rl._backend
    monkeypatch.setattr(rl, "_backend", lambda *a, **k: spies.append(Spy(real(*a, **k))) or spies[-1])
    cfg = load_config(None, [*VOTING, f"run.dir={tmp_path}", "rollout.n=2", "rollout.top_p=0.9",
                             "roles.aggregator.top_p=0.5", "roles.aggregator.max_new_tokens=5"])  # fmt: skip
    train(cfg)
    (spy,) = spies
    by_role: dict[str, list] = {"voter": [], "aggregator": []}
    for request, turn in spy.calls:
        by_role[request.role].append((request.sampling.top_p, request.sampling.max_new_tokens, turn))
    assert len(by_role["voter"]) == 12 and len(by_role["aggregator"]) == 4  # 2 tasks x 2 samples
    assert {(p, n) for p, n, _ in by_role["aggregator"]} == {(0.5, 5)}
    assert {(p, n) for p, n, _ in by_role["voter"]} == {(0.9, 12)}, "the other role keeps the run's defaults"
    # the limit is the sampler's, not only the request's: a random tiny model writes to the limit
    assert max(len(t.completion_ids) for _, _, t in by_role["aggregator"]) <= 5
    assert max(len(t.completion_ids) for _, _, t in by_role["voter"]) > 5
