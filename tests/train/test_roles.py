"""Per-role credit and control (issue 13): role shares of the loss derived by hand, optimizer-step counts
under both step policies, per-role KL, credit rules and episode-counted advantage groups, and the
per-role gradient diagnostics."""

from __future__ import annotations

import dataclasses
import math
import statistics

import pytest
import torch

import rolerl
from rolerl.algorithms import AggNorm, aggregate, grpo_advantages, rloo_advantages
from rolerl.algorithms.weighting import role_share_weights
from rolerl.config import AlgorithmConfig, ConfigError, load_config
from rolerl.diagnostics import role_gradients
from rolerl.models.lora import adapter_specs
from rolerl.roles import ANSWER, KIND_INDEX, REASONING, TOOL_CALL, shift
from rolerl.train import credit as credit_module
from rolerl.train.credit import advantages_of, turn_rewards
from rolerl.train.monitor import episode_metrics
from rolerl.train.optim import model_optimizer
from rolerl.train.policy import select_rows, token_logprobs
from rolerl.train.update import Aligned, LossSettings, Part, Schedule, accumulate_gradients, ppo_update
from rolerl.types import Episode, Turn, collate
from tests.train.test_update import randomize_adapters

KINDS = [REASONING, REASONING, TOOL_CALL, ANSWER]


def two_role_model(tokenizer, adapters: dict[str, str], dtype=torch.float64):
    """A tiny model with the named adapters (randomised, so losses depend on them) and each role's route
    table: `adapters[role]` is the adapter computing every kind of that role."""
    model, _ = rolerl.tiny_model("llama", seed=0, tokenizer=tokenizer, dtype=dtype)
    rolerl.add_adapters(model, list(dict.fromkeys(adapters.values())), rank=4)
    randomize_adapters(model, seed=1, std=0.1)
    index = {n: i for i, n in enumerate(adapter_specs(model))}
    route_of = {role: dict.fromkeys(["prompt", "reasoning", "tool_call", "tool_output", "answer"], index[a])
                for role, a in adapters.items()}  # fmt: skip
    return model, route_of


def turns_of(route_of, spec: list[tuple[str, int]], seed: int = 0) -> list[Turn]:
    """One turn per `(role, completion length)`, prompts of different lengths."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, (role, n) in enumerate(spec):
        prompt = torch.randint(3, 4000, (3 + i % 3,), generator=g).tolist()
        kinds = (KINDS * 4)[:n]
        ids = torch.randint(3, 4000, (n,), generator=g).tolist()
        out.append(Turn(role, prompt, ids, kinds, shift(["prompt"] * len(prompt) + kinds, route_of[role]),
                        [0.0] * n))  # fmt: skip
    return out


def on_policy(model, batch):
    """Old log-probs = the model's own (fp64: the PPO ratio is 1 up to ~1e-15), so each token's PG loss
    is exactly -advantage."""
    with torch.no_grad():
        logp = token_logprobs(model, batch, temperature=1.0).logp
    batch.old_logp = batch.old_logp.to(logp.dtype)
    batch.old_logp[:, :-1] = torch.where(batch.loss_mask[:, :-1].bool(), logp, 0.0)
    return batch


SPEC = [("voter", 3), ("voter", 5), ("voter", 4), ("judge", 7)]  # 3 outputs / 12 tokens vs 1 / 7
ADV = [1.0, -0.5, 2.0, -1.0]


def expected(share: str | dict, agg: str) -> float:
    """The loss `Σ_r s_r · L_r` by hand: per-token loss -A, L_r aggregated within role r."""
    voters = [(n, a) for (r, n), a in zip(SPEC, ADV, strict=True) if r == "voter"]
    judges = [(n, a) for (r, n), a in zip(SPEC, ADV, strict=True) if r == "judge"]

    def within(rows):  # role-internal aggregation
        if agg == "token-mean":
            return sum(-a * n for n, a in rows) / sum(n for n, _ in rows)
        return sum(-a for _, a in rows) / len(rows)  # seq-mean-token-mean: -A is constant per sequence

    lv, lj = within(voters), within(judges)
    tokens_v, tokens_j = sum(n for n, _ in voters), sum(n for n, _ in judges)
    shares = {
        "outputs": (3 / 4, 1 / 4),
        "tokens": (tokens_v / (tokens_v + tokens_j), tokens_j / (tokens_v + tokens_j)),
        "equal": (1 / 2, 1 / 2),
    }
    if share == "aggregate":
        share = "tokens" if agg == "token-mean" else "outputs"
    sv, sj = shares[share] if isinstance(share, str) else (share["voter"] / 4, share["judge"] / 4)
    return sv * lv + sj * lj


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("share", ["aggregate", "outputs", "tokens", "equal", {"voter": 1.0, "judge": 3.0}])
def test_role_share_losses_equal_hand_derived_values(tokenizer, share, agg):
    model, route_of = two_role_model(tokenizer, {"voter": "policy", "judge": "policy"})
    batch = on_policy(model, collate(turns_of(route_of, SPEC), ADV, route_of, role_names=["voter", "judge"]))
    s = LossSettings(AlgorithmConfig(loss_agg=agg, role_share=share), temperature=1.0, horizon=16)
    out = ppo_update([Part.of(model, batch)], model_optimizer(model), s, Schedule(), micro_batch_size=3,
                     generator=torch.Generator().manual_seed(0))  # fmt: skip
    assert out["loss/total"] == pytest.approx(expected(share, agg), rel=1e-9, abs=1e-12)
    if share == "equal":  # each role's weight in the loss is exactly 1/2
        assert out["role/voter/loss_share"] == pytest.approx(0.5, abs=1e-12)
        assert out["role/judge/loss_share"] == pytest.approx(0.5, abs=1e-12)
    natural = {"token-mean": 12 / 19, "seq-mean-token-mean": 3 / 4}[agg]  # voter's share without reweighting
    if share == "aggregate":
        assert out["role/voter/loss_share"] == pytest.approx(natural, abs=1e-12)
    # the parts add up to the loss in every case
    assert out["role/voter/loss"] + out["role/judge/loss"] == pytest.approx(out["loss/total"], rel=1e-9)


@pytest.mark.parametrize("share", ["outputs", "tokens", "equal"])
def test_one_role_under_every_share_is_the_plain_single_policy_loss(tokenizer, share):
    """`shared` with seq-mean-token-mean and one role: every share rule gives weight 1 to its role, so the
    loss and the gradient are exactly those of plain aggregation (the same ops: the factor is 1.0)."""
    results, grads = [], []
    for rule in ("aggregate", share):
        model, route_of = two_role_model(tokenizer, {"policy": "policy"})  # the same fresh model each time
        spec = [("policy", n) for n in (3, 5, 4, 7)]
        batch = on_policy(model, collate(turns_of(route_of, spec), ADV, route_of))
        s = LossSettings(AlgorithmConfig(loss_agg="seq-mean-token-mean", role_share=rule), 1.0, 16)
        opt = model_optimizer(model)
        seen = {}
        opt.torch.register_step_pre_hook(
            lambda *a, seen=seen, opt=opt: seen.update(g=[p.grad.clone() for p in opt.params])
        )
        out = ppo_update([Part.of(model, batch)], opt, s, Schedule(), micro_batch_size=2,
                         generator=torch.Generator().manual_seed(0))  # fmt: skip
        results.append(out["loss/total"])
        grads.append(seen["g"])
    assert results[0] == results[1] == pytest.approx(sum(-a for a in ADV) / 4, rel=1e-9)
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
    lengths = torch.tensor([3.0, 5.0, 0.0, 7.0])
    assert torch.equal(role_share_weights(lengths, torch.zeros(4, dtype=torch.long), ["policy"],
                                          "seq-mean-token-mean", share), torch.ones(4, dtype=torch.float64))  # fmt: skip


def voting_batch(tokenizer, adapters, episodes: int = 2):
    """`episodes` x (3 voter calls + 1 aggregator call), as a voting workflow makes."""
    model, route_of = two_role_model(tokenizer, adapters, dtype=torch.float32)
    spec = [(r, 4 + (i % 3)) for i in range(episodes) for r in ("voter", "voter", "voter", "aggregator")]
    adv = [(-1.0) ** i * (1 + i % 3) for i in range(len(spec))]
    batch = collate(turns_of(route_of, spec), adv, route_of, role_names=["voter", "aggregator"])
    return model, on_policy(model, batch)


@pytest.mark.parametrize(
    ("adapters", "merged", "want"),
    [
        ({"voter": "voter", "aggregator": "aggregator"}, False, {"voter": 3, "aggregator": 1}),
        ({"voter": "voter", "aggregator": "aggregator"}, True, {"voter": 1, "aggregator": 1}),
        ({"voter": "policy", "aggregator": "policy"}, False, {"policy": 4}),
        ({"voter": "policy", "aggregator": "policy"}, True, {"policy": 1}),
    ],
)
def test_optimizer_steps_per_adapter_under_both_step_policies(tokenizer, adapters, merged, want):
    """A role with 3 parallel instances fills 3 mini-batches when mini-batches are cut per role (verl's
    update per role): per_minibatch steps its adapter 3 times per training step, merged once."""
    model, batch = voting_batch(tokenizer, adapters)
    opt = model_optimizer(model)
    s = LossSettings(AlgorithmConfig(), 1.0, 16)
    schedule = Schedule(mini_batch_size=2, by_role=True, merged=merged)
    out = ppo_update([Part.of(model, batch)], opt, s, schedule, micro_batch_size=8,
                     generator=torch.Generator().manual_seed(0))  # fmt: skip
    assert opt.steps == want
    assert {k.split("/")[1]: v for k, v in out.items() if k.endswith("/steps")} == {
        k: float(v) for k, v in want.items()
    }
    assert out["optimizer_steps"] == (1.0 if merged else 4.0)


def test_merged_step_uses_the_mean_of_the_mini_batch_gradients(tokenizer):
    model, batch = voting_batch(tokenizer, {"voter": "voter", "aggregator": "aggregator"})
    s = LossSettings(AlgorithmConfig(), 1.0, 16)
    schedule = Schedule(mini_batch_size=2, by_role=True, merged=True)
    order = torch.randperm(8, generator=torch.Generator().manual_seed(0))
    minis = schedule.mini_batches_of(order, batch.roles)
    assert [len(m) for m in minis] == [2, 2, 2, 2] and {batch.roles[int(i)] for i in minis[3]} == {
        "aggregator"
    }
    voter = [p for n, p in model.named_parameters() if n.endswith(".voter")]
    total = [torch.zeros_like(p) for p in voter]
    for rows in minis[:3]:  # the voter's three mini-batches, each normalised on its own
        model.zero_grad(set_to_none=True)
        sub = select_rows(batch, rows)
        accumulate_gradients(model, sub, Aligned(sub.old_logp), s, micro_batch_size=8)
        total = [t + p.grad for t, p in zip(total, voter, strict=True)]
    model.zero_grad(set_to_none=True)
    opt = model_optimizer(model, grad_clip=0.0)
    seen = {}
    opt.torch.register_step_pre_hook(lambda *a: seen.update(grads=[p.grad.clone() for p in voter]))
    ppo_update([Part.of(model, batch)], opt, s, schedule, micro_batch_size=8,
               generator=torch.Generator().manual_seed(0))  # fmt: skip
    for got, want in zip(seen["grads"], total, strict=True):
        torch.testing.assert_close(got, want / 3, atol=1e-7, rtol=1e-5)


def test_clip_scope_group_clips_each_adapter_alone(tokenizer):
    model, batch = voting_batch(tokenizer, {"voter": "voter", "aggregator": "aggregator"})
    s = LossSettings(AlgorithmConfig(), 1.0, 16)
    for scope in ("global", "group"):
        model.zero_grad(set_to_none=True)
        opt = model_optimizer(model, grad_clip=1e-4, clip_scope=scope)
        accumulate_gradients(model, batch, Aligned(batch.old_logp), s, micro_batch_size=8)
        before = opt.clip(scope="global" if scope == "global" else "group")
        after = {g.name: float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in g.params.values()])))
                 for g in opt.groups}  # fmt: skip
        assert min(before[g] for g in after) > 1e-3  # both far above the limit
        if scope == "group":
            assert all(v == pytest.approx(1e-4, rel=1e-3) for v in after.values())
        else:
            total = math.sqrt(sum(v * v for v in after.values()))
            assert total == pytest.approx(1e-4, rel=1e-3)
            ratio = after["voter"] / after["aggregator"]
            assert ratio == pytest.approx(before["voter"] / before["aggregator"], rel=1e-4)


def test_per_role_kl_weights_only_that_roles_tokens(tokenizer):
    model, route_of = two_role_model(tokenizer, {"voter": "policy", "judge": "policy"})
    batch = on_policy(model, collate(turns_of(route_of, SPEC), ADV, route_of, role_names=["voter", "judge"]))
    norm = AggNorm.of(batch.loss_mask, horizon=16)
    from rolerl.algorithms import KL_ESTIMATORS
    from rolerl.train.update import loss_terms

    s = LossSettings(AlgorithmConfig(beta=0.0), 1.0, 16, role_beta={"judge": 0.5})
    _, metrics, _ = loss_terms(model, batch, Aligned(batch.old_logp), norm, s)
    with torch.no_grad():
        logp = token_logprobs(model, batch, temperature=1.0).logp
        ref = token_logprobs(model, batch, temperature=1.0, routes=-1).logp
    judge = (batch.role_index[:, :1] == 1).double()
    kl = KL_ESTIMATORS["k3"](logp, ref) * 0.5 * judge
    want = float(aggregate(kl, batch.loss_mask[:, :-1], "token-mean", norm))
    assert want > 0 and metrics["loss/kl"] == pytest.approx(want, rel=1e-9)


def episode(task: str, rewards: list[tuple[str, float | None]], outcome: float, role_rewards=None) -> Episode:
    turns = [Turn(role, [1, 2], [3], ["answer"], [0, 0, 0], [0.0], reward=r) for role, r in rewards]
    return Episode(task, turns, reward=outcome, role_rewards=role_rewards or {})


def test_credit_rules_outcome_role_mix():
    ep = episode("t", [("voter", 0.2), ("voter", None), ("aggregator", None)], 1.0, {"voter": 0.7})
    got = {rule: turn_rewards([ep], AlgorithmConfig(reward=rule, mix_alpha=0.5)).rewards.tolist()
           for rule in ("outcome", "role", "mix")}  # fmt: skip
    assert got["outcome"] == [1.0, 1.0, 1.0]
    assert got["role"] == [0.2, 0.7, 1.0]  # the call's own, else the role's, else the outcome
    assert got["mix"] == [0.5 + 0.2, 0.5 + 0.7, 0.5 + 0.0]  # alpha x team + local (0 if none)


def test_role_reward_mean_logs_each_calls_own_reward():
    eps = [episode("t", [("voter", 0.2), ("voter", None), ("aggregator", None)], 1.0, {"voter": 0.7}),
           episode("t", [("voter", None)], 0.0)]  # fmt: skip

    class P:
        route_of = {"voter": {}, "aggregator": {}}

    metrics = episode_metrics(eps, P())
    assert metrics["role/voter/reward_mean"] == pytest.approx((0.2 + 0.7 + 0.0) / 3)
    assert metrics["role/aggregator/reward_mean"] == 1.0 and metrics["role/voter/turns"] == 3


def test_sibling_calls_form_their_own_group_and_leave_the_role_instance_count():
    ep = episode("t", [("coder", 1.0), ("coder", 0.0), ("coder", 0.5), ("reasoner", None)], 1.0)
    for t in ep.turns[:2]:
        t.group = "request0"
    credit = turn_rewards([ep, episode("t", [("coder", 0.0), ("reasoner", None)], 0.0)],
                          AlgorithmConfig(reward="role", group_key="role_instance"))  # fmt: skip
    assert credit.keys == [("t", 0, "coder", "request0")] * 2 + [("t", "coder", 0), ("t", "reasoner", 0)] + [
        ("t", "coder", 0), ("t", "reasoner", 0)]  # fmt: skip
    assert credit.units == [(0, 1), (0, 2), 0, 0, 1, 1]
    adv = advantages_of(AlgorithmConfig(advantage="dr_grpo"), credit)
    assert adv.tolist() == pytest.approx([0.5, -0.5, 0.25, 0.5, -0.25, -0.5])


def test_an_episode_with_several_calls_counts_once_in_its_group():
    """group_key task: episode A has 3 voter calls, B one; per call, A would weigh 3/4 of the mean."""
    eps = [episode("t", [("voter", None)] * 3, 1.0), episode("t", [("voter", None)], 0.0)]
    credit = turn_rewards(eps, AlgorithmConfig(reward="outcome"))
    assert credit.units == [0, 0, 0, 1]
    adv = advantages_of(AlgorithmConfig(), credit)
    # episode level: rewards (1, 0), mean 0.5, unbiased std sqrt(0.5)
    want = 0.5 / (math.sqrt(0.5) + 1e-6)
    assert adv.tolist() == pytest.approx([want, want, want, -want], rel=1e-12)
    per_call = grpo_advantages(credit.rewards, credit.keys)  # the hazard: mean 0.75
    assert float(per_call[3]) < -1.5 * want
    loo = rloo_advantages(credit.rewards, credit.keys, units=credit.units)
    assert loo.tolist() == pytest.approx([1.0, 1.0, 1.0, -1.0])  # each episode's baseline: the other one


def test_a_task_group_of_roles_with_their_own_rewards_is_reported(caplog, monkeypatch):
    """MSARL with one coder sample a request: every episode failed (reasoner 0), each coder call ran (0.2).
    Under group_key task the episodes differ only in their call counts, and the tiny std between them
    turns that into large advantages for every call (the warning says so); under role, the reasoner's
    group has no signal and the coder's compares its calls with each other."""
    monkeypatch.setattr(credit_module, "_WARNED", set())  # said once a process: not before this test
    calls = [(2, 1), (3, 2), (2, 2), (4, 3)]  # (reasoner calls, coder calls) of 4 failed episodes
    eps = [episode("t", [("reasoner", None)] * r + [("coder", 0.2)] * c, 0.0) for r, c in calls]
    credit = turn_rewards(eps, AlgorithmConfig(reward="role", group_key="task"))
    adv = advantages_of(AlgorithmConfig(), credit)
    # each episode's value is 0.2 c / (r + c): 1/15, 0.08, 0.1, 0.6/7, with a std of ~0.014 between them
    values = [0.2 * c / (r + c) for r, c in calls]
    mean, std = statistics.mean(values), statistics.stdev(values)
    assert float(adv[0]) == pytest.approx(-mean / (std + 1e-6)) and float(adv[0]) < -5
    assert [r.message for r in caplog.records if "group_key=task puts roles" in r.message]
    caplog.clear()
    by_role = turn_rewards(eps, AlgorithmConfig(reward="role", group_key="role"))
    adv = advantages_of(AlgorithmConfig(), by_role)
    reasoner = torch.tensor([r == "reasoner" for r in by_role.roles])
    assert not adv[reasoner].any() and not adv[~reasoner].any()  # every call of a role alike: no signal
    assert not [r for r in caplog.records if "group_key=task" in r.message]


def test_role_normalised_advantages_give_each_role_unit_scale():
    eps = [episode(f"t{k}", [("voter", 0.1 * (i % 2)), ("judge", float(i % 2))], 0.0)
           for k in range(3) for i in range(4)]  # fmt: skip
    credit = turn_rewards(eps, AlgorithmConfig(reward="role", group_key="role"))
    adv = advantages_of(AlgorithmConfig(reward="role", group_key="role", norm="role"), credit)
    roles = torch.tensor([r == "voter" for r in credit.roles])
    # unit std up to GRPO's eps in the denominator (1e-6 against role stds of 0.05 and 0.5)
    assert float(adv[roles].std()) == pytest.approx(1.0, rel=1e-4)
    assert float(adv[~roles].std()) == pytest.approx(1.0, rel=1e-4)
    with pytest.raises(ConfigError, match="norm='role'.*advantage='rloo'"):
        load_config(None, ["algorithm.norm=role", "algorithm.advantage=rloo"])


def test_role_gradients_report_norms_and_the_cosine_and_leave_no_gradient(tokenizer):
    model, batch = voting_batch(tokenizer, {"voter": "policy", "aggregator": "policy"})
    s = LossSettings(AlgorithmConfig(), 1.0, 16)
    opt = model_optimizer(model)
    out = role_gradients([Part.of(model, batch)], s, opt, micro_batch_size=8)
    assert all(p.grad is None for p in opt.params), "the update that follows starts from no gradient"
    grads = {}
    for role in ("voter", "aggregator"):
        model.zero_grad(set_to_none=True)
        sub = select_rows(batch, [i for i, r in enumerate(batch.roles) if r == role])
        accumulate_gradients(model, sub, Aligned(sub.old_logp), s, micro_batch_size=8)
        grads[role] = torch.cat([p.grad.flatten().double() for p in opt.params])
        assert out[f"role/{role}/grad_norm/policy"] == pytest.approx(float(grads[role].norm()), rel=1e-6)
    cos = float(grads["voter"] @ grads["aggregator"] / (grads["voter"].norm() * grads["aggregator"].norm()))
    assert out["grad/cos/policy/voter__aggregator"] == pytest.approx(cos, rel=1e-6, abs=1e-9)


def test_kind_gradients_log_the_cosine_and_the_share_of_modules_in_conflict(tokenizer):
    model, batch = voting_batch(tokenizer, {"voter": "policy", "aggregator": "policy"})
    s = LossSettings(AlgorithmConfig(), 1.0, 16)
    opt = model_optimizer(model)
    out = role_gradients([Part.of(model, batch)], s, opt, micro_batch_size=8, groups="kind")
    assert all(p.grad is None for p in opt.params)
    grads = {}
    for kind in ("reasoning", "tool_call", "answer"):
        model.zero_grad(set_to_none=True)
        mask = torch.zeros_like(batch.loss_mask)
        mask[:, :-1] = batch.loss_mask[:, :-1] * (batch.kind_ids[:, 1:] == KIND_INDEX[kind])
        sub = dataclasses.replace(batch, loss_mask=mask)
        accumulate_gradients(model, sub, Aligned(sub.old_logp), s, micro_batch_size=8)
        grads[kind] = {
            n: p.grad.double().flatten().clone() for n, p in model.named_parameters() if p.grad is not None
        }
        flat = torch.cat(list(grads[kind].values()))
        assert out[f"kind/{kind}/grad_norm/policy"] == pytest.approx(float(flat.norm()), rel=1e-6)
    a, b = grads["reasoning"], grads["tool_call"]
    cos = float(torch.cat(list(a.values())) @ torch.cat(list(b.values()))) / float(
        torch.cat(list(a.values())).norm() * torch.cat(list(b.values())).norm())  # fmt: skip
    assert out["grad/cos/policy/reasoning__tool_call"] == pytest.approx(cos, rel=1e-6, abs=1e-9)
    modules = {}  # a module's lora_A and lora_B together
    for n in a:
        m = n.rsplit(".lora_", 1)[0]
        modules.setdefault(m, [[], []])
        modules[m][0].append(a[n])
        modules[m][1].append(b[n])
    signs = [float(torch.cat(x) @ torch.cat(y)) < 0 for x, y in modules.values()]
    assert len(modules) == 7 * 2  # two layers of the tiny model, 7 linears each
    assert out["grad/conflict_frac/policy/reasoning__tool_call"] == sum(signs) / len(signs)


def test_role_share_mapping_must_cover_the_workflow_roles(tmp_path):
    from rolerl.train.rl import check_roles

    cfg = load_config(None, ["algorithm.role_share={voter: 1}"])
    with pytest.raises(ConfigError, match=r"no weight for roles \['aggregator'\]"):
        check_roles(cfg, ["voter", "aggregator"])
    with pytest.raises(ConfigError, match=r"algorithm.role_share='half'; allowed"):
        load_config(None, ["algorithm.role_share=half"])
    with pytest.raises(ConfigError, match=r"roles.coder.beta=-1.0; allowed: null or a number >= 0"):
        load_config(None, ["roles.coder.beta=-1"])
    with pytest.raises(ConfigError, match=r"roles.coder.model='big'; allowed: main or a key of models"):
        load_config(None, ["roles.coder.model=big"])
