"""Partial rollouts (`train.partial_rollouts`, issue 50): a rollout in flight switches to a newer version of
the adapters between two engine steps, recomputes its rows' cache, and each token records the version that
sampled it. The switch is made deterministic here: the test's `generate` steps the engine itself and plays
the trainer's publish (or waits for it) before a chosen step."""

from __future__ import annotations

import threading

import pytest
import torch

from rolerl.config import ConfigError, load_config
from rolerl.rollout.engine import Engine, rollout_copy
from rolerl.rollout.lockstep import LockstepBackend
from rolerl.rollout.recorder import GenerationRequest
from rolerl.rollout.sampling import SamplingParams
from rolerl.run.policy import build_policy
from rolerl.tools.base import ToolResult
from rolerl.train.checkpoint import RunDir
from rolerl.train.pipeline import RolloutPipeline, snapshot_tensors
from rolerl.train.policy import token_logprobs
from rolerl.train.rl import train
from rolerl.types import Episode, Turn, collate
from rolerl.workflows import SingleTurn
from tests.models.test_lora import randomize_adapters
from tests.rollout.test_engine import prompt_ids, scripted_sampler
from tests.train.test_async import ASYNC
from tests.train.test_rl import tiny_config
from tests.workflows.test_single_turn import EchoTask

TEMPERATURE = 0.7
# the trainer's fp32 forward and the engine's agree within ~1e-4 on any token (docs/TRAINING.md,
# `logp_mismatch`: each is within ~5e-5 of an fp64 forward); two versions' adapters (std 0.2) move a
# token's log-prob by far more than that
TOL = 1e-4
PROMPT = "Question: what is six times seven? Think first, then answer.\n"
TOOL_SCRIPT = "Let me compute<code>print(6 * 7)</code> so it is 42, which I now say out loud and clear."
TEXT_SCRIPT = (
    "No tool here, only plain text that goes on for a good while longer than the switch, and then on."
)


class GatedTool:
    """Echoes its input once `gate` is set: the test decides when a row waiting on it may go on."""

    name, description = "echo", "repeats its input, when allowed"

    def __init__(self) -> None:
        self.gate = threading.Event()

    def run(self, args: str) -> ToolResult:
        self.gate.wait(30)
        return ToolResult(stdout=args.strip() + "\n", wall_s=0.0)


def _setup(tmp_path, tokenizer):
    """The trainer's policy (adapters randomised, the start: version 0), an engine over its own copy whose
    sampler replays two scripts (seed 0: a tool call, seeds 1 and 2: the same plain text, so that two rows
    are alike), and the requests."""
    cfg = tiny_config(tmp_path / "run", "train.max_staleness=1", *ASYNC)
    policy = build_policy(cfg, ["policy"])
    randomize_adapters(policy.model, seed=0, std=0.2)
    tok = tokenizer
    scripts = {
        0: prompt_ids(tok, TOOL_SCRIPT),
        1: prompt_ids(tok, TEXT_SCRIPT),
        2: prompt_ids(tok, TEXT_SCRIPT),
    }
    tool = GatedTool()
    engine = Engine(
        rollout_copy(policy.model, torch.float32), tok, max_batch=3, tools={"echo": tool},
        sampler=scripted_sampler(scripts), source=policy.model,
    )  # fmt: skip
    reqs = [
        GenerationRequest(
            prompt_ids(tok, PROMPT),
            SamplingParams(temperature=TEMPERATURE, seed=seed, max_new_tokens=len(s)),
            route_of=policy.route_of["policy"],
            tool="echo",
        )
        for seed, s in scripts.items()
    ]
    return policy, engine, tool, reqs


def _stepper(engine: Engine, reqs, hooks):
    """`generate(step)`: the requests through the engine, stepped here; `hooks[(step, n)]()` runs before
    the engine's `n`-th step of that rollout (its `poll` comes first in that step)."""

    def generate(step: int) -> list[Episode]:
        handles = [engine.submit(r) for r in reqs]
        done: dict[int, Turn] = {}
        n = 0
        while engine.has_work:
            n += 1
            hooks.get((step, n), lambda: None)()
            done |= dict(engine.step())
        return [Episode(f"{step}/{h}", [done[h]]) for h in handles]

    return generate


def _update(policy, steps: dict[str, int], step: int) -> dict[str, torch.Tensor]:
    """The trainer's update of `step`: new adapters; returns their snapshot (that version's weights)."""
    randomize_adapters(policy.model, seed=step, std=0.2)
    steps["policy"] = step
    return snapshot_tensors(policy)


def _sampled(turn: Turn) -> list[int]:
    """The completion indices of `turn`'s sampled tokens (not forced tool output)."""
    return [j for j, k in enumerate(turn.kinds) if k != "tool_output"]


def _recomputed(
    policy, turn: Turn, weights: dict[str, torch.Tensor], temperature: float = TEMPERATURE
) -> torch.Tensor:
    """The trainer's log-prob of each sampled token of `turn` under the adapters `weights`."""
    model = policy.model
    with torch.no_grad():
        for k, p in model.named_parameters():
            if "lora_" in k:
                p.copy_(weights[f"main/{k}"])
        batch = collate([turn], [1.0], policy.route_of)
        logp = token_logprobs(model, batch, temperature=temperature).logp
    mask = batch.loss_mask[0, :-1].bool()
    assert int(mask.sum()) == len(_sampled(turn))
    return logp[0][mask]


def _check_versions_reproduce(
    policy, turn: Turn, weights: dict[int, dict[str, torch.Tensor]], temperature: float = TEMPERATURE
) -> None:
    """Each sampled token's log-prob is its recorded version's forward over the sequence so far."""
    versions = torch.tensor([turn.versions[j] for j in _sampled(turn)])
    rollout = torch.tensor([turn.logprobs[j] for j in _sampled(turn)])
    for v in versions.unique().tolist():
        gap = (_recomputed(policy, turn, weights[v], temperature) - rollout).abs()[versions == v]
        assert float(gap.max()) < TOL, f"tokens of version {v} are that version's log-probs"


def _split(turn: Turn) -> tuple[int, list[int]]:
    """How many sampled tokens come before the first one of another version than the first, and the
    versions in order of appearance."""
    versions = [turn.versions[j] for j in _sampled(turn)]
    order = list(dict.fromkeys(versions))
    return next((i for i, v in enumerate(versions) if v != versions[0]), len(versions)), order


# the engine step before which the test switches. The first step prefills the prompts and samples twice
# (prefill, then a decode step), so by then the text rows have sampled SWITCH_AT tokens, and the tool row
# has closed its call with its 16th (at step 15) and waits on its tool until step SWITCH_AT + 2
SWITCH_AT, TOOL_CLOSED = 18, 16


def _trainer_like(tmp_path, tokenizer, partial: bool):
    """Rollouts 1-3 at lag 1, the main thread as the trainer (it updates and publishes after each step's
    episodes). It publishes step 1 once rollout 2 (version 0, bound 1) is before its step SWITCH_AT, which
    waits for it, its tool row blocked on the tool across it; rollout 3 (version 1, bound 2) waits before
    its first step until step 2 is published."""
    policy, engine, tool, reqs = _setup(tmp_path, tokenizer)
    steps = {"policy": 0}
    weights = {0: snapshot_tensors(policy)}
    published = {1: threading.Event(), 2: threading.Event()}
    arrived = threading.Event()  # rollout 2 is at its step SWITCH_AT: the trainer may publish step 1

    def switch_here():
        arrived.set()
        published[1].wait(30)

    hooks = {
        (1, 1): tool.gate.set,
        (2, 1): tool.gate.clear,
        (2, SWITCH_AT): switch_here,
        (2, SWITCH_AT + 2): tool.gate.set,
        (3, 1): lambda: published[2].wait(30),
    }
    pipeline = RolloutPipeline(
        LockstepBackend(engine), policy, dict(steps), _stepper(engine, reqs, hooks), lag=1, start=0, last=3,
        partial=partial,
    )  # fmt: skip
    episodes, metrics = {}, {}
    try:
        for step in (1, 2, 3):
            episodes[step] = [t for ep in pipeline.episodes(step) for t in ep.turns]
            if step == 1:
                arrived.wait(30)
            weights[step] = _update(policy, steps, step)
            metrics[step] = pipeline.publish(step, policy, dict(steps))
            if step in published:
                published[step].set()
    finally:
        tool.gate.set()
        pipeline.close()
        engine.close()
    assert engine.poll is None, "the pipeline takes its hook back after each rollout"
    return policy, episodes, weights, metrics


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tokenizer):
    """The same rollouts with partial rollouts on and off."""
    return {
        partial: _trainer_like(tmp_path_factory.mktemp(f"partial_{partial}"), tokenizer, partial)
        for partial in (True, False)
    }


def test_a_partial_rollout_across_a_sync_carries_both_versions_each_its_own_logprobs(runs):
    policy, episodes, weights, metrics = runs[True]
    tool_row, *text_rows = episodes[2]
    # the switch comes before the engine's step SWITCH_AT: the text rows sampled SWITCH_AT tokens of
    # version 0; the tool row its tokens up to the call, and every one after its tool output (spliced
    # after the switch) is version 1's
    for turn in text_rows:
        assert _split(turn) == (SWITCH_AT, [0, 1])
    assert _split(tool_row) == (TOOL_CLOSED, [0, 1]) and tool_row.tool_calls
    calls = tool_row.tool_calls[0]
    assert set(tool_row.versions[calls.start : calls.end]) == {-1}
    for turn in episodes[2]:
        _check_versions_reproduce(policy, turn, weights)
    # a test that fails if the engine ignored the new version: version 0's adapters do not reproduce the
    # tokens sampled after the switch
    turn = text_rows[0]
    after = torch.tensor([turn.versions[j] == 1 for j in _sampled(turn)])
    rollout = torch.tensor([turn.logprobs[j] for j in _sampled(turn)])
    assert float((_recomputed(policy, turn, weights[0]) - rollout).abs()[after].min()) > 1e-3
    # rollout 3 (version 1, bound 2) starts after step 2 is published: it takes it before any token
    assert {v for t in episodes[3] for v in t.versions} == {2, -1}
    for turn in episodes[3]:
        _check_versions_reproduce(policy, turn, weights)
    assert [m["async/partial_switches"] for m in metrics.values()] == [0.0, 1.0, 0.0]


def test_off_samples_one_version_per_rollout_and_the_same_tokens_before_the_switch(runs):
    policy, off, weights, metrics = runs[False]
    on = runs[True][1]
    assert {v for t in off[2] for v in t.versions} == {0, -1}, "the new version waits for the next rollout"
    assert {v for t in off[3] for v in t.versions} == {1, -1}  # step 3 samples step 1's adapters
    for turn in off[2]:
        _check_versions_reproduce(policy, turn, weights)
    for a, b in zip(on[2], off[2], strict=True):
        assert a.completion_ids == b.completion_ids  # the scripts
        before = [j for j in _sampled(a) if a.versions[j] == 0]
        assert [a.logprobs[j] for j in before] == [b.logprobs[j] for j in before], "the same forwards"
    assert all("async/partial_switches" not in m for m in metrics.values())


def test_a_rollout_never_takes_a_version_after_the_step_before_it(tmp_path, tokenizer):
    """Lag 2: rollout 3 samples version 0 and may go up to version 2. Before its step SWITCH_AT the trainer
    (played by the rollout thread itself) has published steps 1, 2 and 3: the engine takes 1 and 2 as one
    switch (2's adapters), never 3."""
    policy, engine, tool, reqs = _setup(tmp_path, tokenizer)
    tool.gate.set()
    steps = {"policy": 0}
    weights = {0: snapshot_tensors(policy)}

    def trainer_runs_ahead():
        for step in (1, 2, 3):
            weights[step] = _update(policy, steps, step)
            pipeline.publish(step, policy, dict(steps))

    hooks = {(3, SWITCH_AT): trainer_runs_ahead}
    pipeline = RolloutPipeline(
        LockstepBackend(engine), policy, dict(steps), _stepper(engine, reqs, hooks), lag=2, start=0, last=3,
        partial=True,
    )  # fmt: skip
    try:
        episodes = {step: [t for ep in pipeline.episodes(step) for t in ep.turns] for step in (1, 2, 3)}
    finally:
        pipeline.close()
        engine.close()
    assert {v for s in (1, 2) for t in episodes[s] for v in t.versions} == {0, -1}
    for turn in episodes[3]:
        assert _split(turn)[1] == [0, 2]
        _check_versions_reproduce(policy, turn, weights)
    assert _split(episodes[3][1]) == (SWITCH_AT, [0, 2])
    assert engine.stats["switches"] == 1


def test_partial_rollouts_are_refused_where_they_cannot_work():
    with pytest.raises(ConfigError, match=r"train.partial_rollouts=true .* needs train.max_staleness >= 1"):
        load_config(None, ["train.partial_rollouts=true"])
    with pytest.raises(ConfigError, match=r"got max_staleness=0"):
        load_config(None, ["train.partial_rollouts=true", "train.max_staleness=0"])
    with pytest.raises(
        ConfigError, match=r"rollout.backend lockstep or threaded; got rollout.backend='vllm'"
    ):
        load_config(
            None, ["train.partial_rollouts=true", "train.max_staleness=1", "rollout.backend=vllm", *ASYNC]
        )
    cfg = load_config(None, ["train.partial_rollouts=true", "train.max_staleness=1", *ASYNC])
    assert cfg.train.partial_rollouts and not load_config(None, []).train.partial_rollouts


@pytest.mark.parametrize("backend", ["lockstep", "threaded"])
def test_staleness_one_with_partial_rollouts_tokens_carry_the_version_that_sampled_them(
    tmp_path, monkeypatch, backend
):
    """The loop with partial rollouts (switches happen when the trainer's timing lets them; the threaded
    backend's engine polls in its own thread): every token's version lies between its rollout's fixed
    version and the step before it, and that version's adapters reproduce its log-prob."""
    from rolerl.train import rl

    seen = {"episodes": {}, "weights": {}}

    class Recording(RolloutPipeline):
        def __init__(self, backend, policy, steps, *args, **kwargs):
            super().__init__(backend, policy, steps, *args, **kwargs)
            seen["pipeline"], seen["weights"][self.start] = self, snapshot_tensors(policy)

        def episodes(self, step):
            seen["episodes"][step] = out = super().episodes(step)
            return out

        def publish(self, step, policy, steps):
            seen["weights"][step] = snapshot_tensors(policy)
            return super().publish(step, policy, steps)

    monkeypatch.setattr(rl, "RolloutPipeline", Recording)
    partial = ["train.max_staleness=1", "train.partial_rollouts=true", f"rollout.backend={backend}", *ASYNC]
    cfg = tiny_config(tmp_path / "run", "train.steps=4", *partial)
    task = EchoTask()
    workflow = SingleTurn(task)
    policy = build_policy(cfg, workflow.roles)
    run_dir = train(cfg, task=task, workflow=workflow, policy=policy)
    rows = RunDir(run_dir, tensorboard=False).read_metrics()
    assert seen["pipeline"].log == [(1, 0), (2, 0), (3, 1), (4, 2)]
    for step, want in seen["pipeline"].log:
        for turn in (t for ep in seen["episodes"][step] for t in ep.turns):
            versions = [v for v in turn.versions if v >= 0]  # sampled by the adapter
            assert want <= min(versions) and max(versions) <= max(step - 1, 0)
            _check_versions_reproduce(policy, turn, seen["weights"], cfg.rollout.temperature)
    assert all(r["async/dropped_turns"] == 0.0 and r["staleness/policy/max"] <= 1.0 for r in rows)
    assert all(r["async/partial_switches"] >= 0.0 for r in rows)
