"""Inert rows (`train.skip_inert_rows`): rows whose loss is zero at every token run no forward in the update.
Which rows are inert, by hand; and the update with them skipped equals the update with every row run (the
adapters after three updates, Adam's steps, the loss and the token counts) under both isolations, two
mini-batches, merged steps, two PPO epochs and recomputed old log-probs with TIS, and two models in one
update, while the forwards see only the rows with a signal. An update with no signal at all still steps
AdamW on its momentum, as it did when the rows ran with zero gradients; so does a run through `train`."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from rolerl.train import update as update_module
from rolerl.train.optim import model_optimizer
from rolerl.train.update import Part, Schedule, inert_rows, ppo_update
from tests.train.test_update import dart_model, hand_batch, settings


def test_inert_rows_by_hand(tokenizer):
    model, _, route_of = dart_model(tokenizer, dtype=torch.float64)
    batch = hand_batch(model, route_of, n=5)
    live = batch.loss_mask[:, :-1] > 0
    batch.advantages[1] = 0.0
    batch.advantages[3] = -0.0
    # row 4: zero at every loss token, non-zero where no loss is taken (prompt, tool output, the last column)
    batch.advantages[4] = 7.0
    batch.advantages[4, :-1][live[4]] = 0.0
    assert bool((batch.advantages[4] != 0).any())
    # row 0: zero but for one NaN at a loss token, which must reach the loss
    batch.advantages[0] = 0.0
    batch.advantages[0, :-1][live[0].nonzero()[0]] = math.nan
    assert inert_rows(batch, settings()).tolist() == [False, True, False, True, True]
    # a KL or entropy term gives every row a loss (its role's coefficient, or the algorithm's)
    assert not inert_rows(batch, settings(beta=0.1)).any()
    assert not inert_rows(batch, settings(entropy_coef=0.01)).any()
    s = settings()
    s.role_beta = {"other": 0.5}  # another role's KL does not reach these rows
    assert inert_rows(batch, s).tolist() == [False, True, False, True, True]
    s.role_beta = {"policy": 0.5}
    assert not inert_rows(batch, s).any()
    s.role_beta, s.role_entropy = {}, {"policy": 0.0}
    assert inert_rows(batch, s).tolist() == [False, True, False, True, True]
    # a weight of 0 (the row's own, or its role's loss weight) zeroes every term
    batch.weights[2] = 0.0
    assert inert_rows(batch, settings()).tolist() == [False, True, True, True, True]
    s = settings()
    s.loss_weight = {"policy": 0.0}
    assert inert_rows(batch, s).all()


CASES = {
    "two mini-batches": ("route", Schedule(mini_batches=2), {}),
    "strict isolation": ("strict", Schedule(mini_batches=2), {}),
    "merged, two epochs, recompute + TIS": (
        "route",
        Schedule(ppo_epochs=2, mini_batches=2, merged=True),
        {"old_logp": "recompute", "tis_cap": 2.0},
    ),
    "two epochs of three mini-batches, recompute + TIS": (
        "route",
        Schedule(ppo_epochs=2, mini_batches=3),
        {"old_logp": "recompute", "tis_cap": 1.5},
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_skipping_inert_rows_gives_the_update_of_every_row(tokenizer, monkeypatch, case):
    isolation, schedule, alg = CASES[case]
    base, _, route_of = dart_model(tokenizer, dtype=torch.float64)
    batches = [hand_batch(base, route_of, n=5, seed=k) for k in range(3)]
    batches[1].advantages[[1, 3, 4]] = 0.0  # a step where 3 of 5 rows scored like their group
    batches[2].advantages.zero_()  # a step with no signal at all
    seen: list[list[int]] = []  # the lengths of the rows each forward saw
    real = update_module.token_logprobs

    def spy(model, mb, **kw):
        seen.append(mb.attention_mask.sum(-1).tolist())
        return real(model, mb, **kw)

    monkeypatch.setattr(update_module, "token_logprobs", spy)
    runs = {}
    for skip in (False, True):
        model = copy.deepcopy(base)
        optimizer = model_optimizer(model, lr=1e-2)
        s = settings(**alg)
        s.isolation, s.skip_inert = isolation, skip
        metrics, forwards = [], []
        for k, batch in enumerate(batches):
            seen.clear()
            metrics.append(
                ppo_update(
                    [Part.of(model, batch)],
                    optimizer,
                    s,
                    schedule,
                    micro_batch_size=2,
                    generator=torch.Generator().manual_seed(k),
                )  # fmt: skip
            )
            forwards.append(sorted({n for mb in seen for n in mb}))
        params = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
        runs[skip] = metrics, forwards, params, dict(optimizer.steps)
    (every, every_fw, want, want_steps), (skipped, skip_fw, got, got_steps) = runs[False], runs[True]
    lengths = batches[1].attention_mask.sum(-1).tolist()
    assert every_fw[1] == sorted(lengths) and skip_fw[1] == sorted(lengths[r] for r in (0, 2))
    assert every_fw[2] and skip_fw[2] == []  # nothing to run: not even a recompute
    assert skip_fw[0] == every_fw[0]
    assert got_steps == want_steps and all(n > 0 for n in want_steps.values())
    for name, p in want.items():
        step = (p - base.get_parameter(name)).detach()
        # the rows left share micro-batches in another order: float64 rounding apart in the forward, then
        # a few ulps of the fp32 adapters (~3e-8 at their size), where a dropped row or a skipped step would
        # move an adapter by up to ~lr = 1e-2
        torch.testing.assert_close(got[name], p, rtol=0, atol=1e-6, msg=name)
        assert float(step.abs().max()) > 1e-4, name  # every adapter moved, over the third update too
    for k in range(3):
        assert skipped[k]["update/inert_frac"] == [0.0, 0.6, 1.0][k] and every[k]["update/inert_frac"] == 0.0
        for key, value in every[k].items():
            if (
                key.endswith(("loss_tokens", "/advantage"))
                or key.startswith("loss/")
                or key == "optimizer_steps"
            ):
                # means of the batch's fp32 advantages over other groupings: fp32 rounding
                assert skipped[k][key] == pytest.approx(value, rel=1e-6, abs=1e-9), (k, key)
    assert "entropy" not in skipped[2] and every[2]["entropy"] > 0  # no row ran: no entropy to report


def test_a_model_whose_rows_are_all_inert_still_steps_its_adapter(tokenizer):
    """Two models in one update (the `separate` preset's parts): in the second update every row of model B is
    inert and some of model A's. Skipping them gives every run's adapters and AdamW steps per adapter: B's
    adapter still steps on momentum."""
    import rolerl
    from rolerl.config import OptimConfig
    from rolerl.models.topology import Topology
    from rolerl.run.policy import adapter_groups
    from rolerl.train.optim import Optimizer
    from tests.models.test_lora import randomize_adapters

    def build():
        models, batches = {}, {}
        for k, name in enumerate(("a", "b")):
            model, _ = rolerl.tiny_model("llama", seed=k, tokenizer=tokenizer, dtype=torch.float64)
            rolerl.add_adapters(model, [name], rank=4)
            randomize_adapters(model, seed=k + 1, std=0.1)
            route_of = Topology.from_preset("shared", ["policy"]).route_of("policy", {"policy": 0})
            models[name] = model
            batches[name] = [hand_batch(model, route_of, n=4, seed=10 * k + j) for j in range(2)]
        batches["a"][1].advantages[[0, 2]] = 0.0
        batches["b"][1].advantages.zero_()
        return models, batches

    runs = {}
    for skip in (False, True):
        models, batches = build()
        optimizer = Optimizer(adapter_groups(models, {"a": 1e-2, "b": 1e-2}), OptimConfig(lr=1e-2))
        s = settings()
        s.skip_inert = skip
        for j in range(2):
            parts = [Part.of(models[n], batches[n][j]) for n in ("a", "b")]
            last = ppo_update(parts, optimizer, s, Schedule(mini_batches=2), micro_batch_size=2,
                              generator=torch.Generator().manual_seed(j))  # fmt: skip
        params = {f"{n}.{k}": p.detach().clone() for n, m in models.items()
                  for k, p in m.named_parameters() if "lora_" in k}  # fmt: skip
        runs[skip] = params, dict(optimizer.steps), last
    (want, want_steps, every), (got, got_steps, skipped) = runs[False], runs[True]
    assert got_steps == want_steps == {"a": 4, "b": 4}
    assert skipped["update/inert_frac"] == 6 / 8 and every["update/inert_frac"] == 0.0
    for name, p in want.items():
        torch.testing.assert_close(got[name], p, rtol=0, atol=1e-6, msg=name)


def test_an_update_with_no_signal_still_moves_the_adapters_on_adam_momentum(tokenizer):
    """The premise of the third update above: with every advantage zero, AdamW still moves the adapters
    (momentum from the steps before), so an update that skipped the step would differ."""
    base, _, route_of = dart_model(tokenizer, dtype=torch.float64)
    model = copy.deepcopy(base)
    optimizer = model_optimizer(model, lr=1e-2)
    s = settings()
    ppo_update([Part.of(model, hand_batch(base, route_of))], optimizer, s, Schedule(), micro_batch_size=2,
               generator=torch.Generator().manual_seed(0))  # fmt: skip
    before = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    flat = hand_batch(base, route_of, seed=1)
    flat.advantages.zero_()
    metrics = ppo_update([Part.of(model, flat)], optimizer, s, Schedule(), micro_batch_size=2,
                         generator=torch.Generator().manual_seed(1))  # fmt: skip
    assert metrics["update/inert_frac"] == 1.0 and metrics["optimizer_steps"] == 1.0
    moved = max(
        float((p.detach() - before[n]).abs().max()) for n, p in model.named_parameters() if "lora_" in n
    )
    assert moved > 1e-3


def test_a_run_that_skips_inert_rows_ends_where_running_them_ends(tmp_path):
    """`train.skip_inert_rows` through `train` (the echo task on the tiny model, 3 steps of 2 mini-batches,
    the last with no signal at all): the run that skips its inert rows and the run that runs them sample the
    same episodes and end with the same adapters."""
    from safetensors.torch import load_file

    from rolerl.train.checkpoint import RunDir, checkpoints
    from rolerl.train.rl import train
    from rolerl.workflows import SingleTurn
    from tests.train.test_rl import tiny_config
    from tests.workflows.test_single_turn import EchoTask

    runs = {}
    for skip in (False, True):
        task = EchoTask()
        cfg = tiny_config(
            tmp_path / str(skip),
            "train.steps=3",
            "train.mini_batches=2",
            "run.seed=1",
            f"train.skip_inert_rows={str(skip).lower()}",
        )
        run_dir = train(cfg, task=task, workflow=SingleTurn(task))
        _, path = checkpoints(run_dir)[-1]
        adapters = load_file(path / "adapters" / "policy" / "adapter_model.safetensors")
        runs[skip] = RunDir(run_dir, tensorboard=False).read_metrics(), adapters
    (every, want), (skipped, got) = runs[False], runs[True]
    assert [r["update/inert_frac"] for r in every] == [0.0] * 3
    # half the groups scored alike, then all
    assert [r["update/inert_frac"] for r in skipped] == [0.5, 0.5, 1.0]
    for step, (a, b) in enumerate(zip(every, skipped, strict=True)):
        assert a["reward/mean"] == b["reward/mean"] and a["response_length/mean"] == b["response_length/mean"]
        # the first update's loss differs by rounding alone; later ones are taken on adapters that AdamW has
        # already moved apart by ~1e-5 (below), which shifts this near-zero loss (~7e-4) by up to ~1e-7
        # (1.5e-7 measured on an AVX2 EPYC, one thread)
        assert b["loss/total"] == pytest.approx(a["loss/total"], rel=1e-4, abs=1e-7 if step == 0 else 1e-6)
    assert got.keys() == want.keys()
    # fp32, and the rows left share micro-batches in another order: AdamW turns that rounding into ~1e-5 on
    # these adapters (measured: 9e-6), where the third step skipped (no gradient) would leave them ~lr = 1e-2
    # behind
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, rtol=0, atol=1e-4, msg=name)
