"""Imitation warm-start: segment-wise tokenisation, loss only on policy kinds, routes = `shift`, and a run."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import rolerl
from rolerl.algorithms import AggNorm, logprobs_from_logits
from rolerl.config import load_config
from rolerl.models.topology import Topology
from rolerl.roles import (
    POLICY_KINDS,
    TOOL_OUTPUT,
    Tags,
    encode_exact,
    format_tool_output,
    shift,
    splice_tokenize,
)
from rolerl.roles import split_segments as split
from rolerl.train.checkpoint import RunDir
from rolerl.train.sft import demonstration_turns, read_demonstrations, sft, sft_loss
from rolerl.types import collate

ANSWER_TEXT = "Let me compute.<code>print(6*7)</code><output>\n42\n</output>\nSo <answer>42</answer>"
CONVERSATION = {
    "role": "policy",
    "messages": [
        {"role": "system", "content": "Use Python."},
        {"role": "user", "content": "What is 6 * 7?"},
        {"role": "assistant", "content": ANSWER_TEXT},
    ],
}


def dart_route_of():
    return {"policy": Topology.from_preset("dart", ["policy"]).route_of("policy", {"reason": 0, "tool": 1})}


def test_demonstration_turn_tokens_kinds_and_routes(tokenizer):
    route_of = dart_route_of()
    (turn,) = demonstration_turns(tokenizer, CONVERSATION, route_of)
    prompt = tokenizer.apply_chat_template(
        CONVERSATION["messages"][:2], add_generation_prompt=True, return_dict=True
    )
    assert turn.prompt_ids == list(prompt["input_ids"])
    ids, kinds = splice_tokenize(tokenizer, split(ANSWER_TEXT, Tags()))
    assert turn.completion_ids == [*ids, tokenizer.eos_token_id] and turn.kinds == [*kinds, "reasoning"]
    # The tool output is exactly the engine's forced ids for that result.
    forced = [i for i, k in zip(turn.completion_ids, turn.kinds, strict=True) if k == TOOL_OUTPUT]
    assert forced == encode_exact(tokenizer, format_tool_output(Tags(), "42"))
    assert {"reasoning", "tool_call", "tool_output", "answer"} == set(turn.kinds)
    # Routes are `shift` of the dart table: tool-call tokens are computed by (predicted at) the tool adapter.
    assert turn.routes == shift(turn.all_kinds, route_of["policy"])
    call = [p for p, k in enumerate(turn.all_kinds) if k == "tool_call"]
    assert [turn.routes[p - 1] for p in call] == [1] * len(call)
    assert set(turn.routes) == {0, 1}


def test_sft_loss_is_nll_on_policy_kinds_only(tokenizer):
    model, tok = rolerl.tiny_model("llama", seed=0, tokenizer=tokenizer)
    rolerl.add_adapters(model, ["reason", "tool"], rank=4)
    route_of = dart_route_of()
    (turn,) = demonstration_turns(tok, CONVERSATION, route_of)
    short = dict(
        CONVERSATION, messages=[*CONVERSATION["messages"][:2], {"role": "assistant", "content": "42"}]
    )
    turns = [turn, *demonstration_turns(tok, short, route_of)]
    batch = collate(turns, [0.0, 0.0], route_of, pad_id=2)
    # Column p carries loss iff token p+1 is a policy kind (never prompt, never tool output).
    for row, t in enumerate(turns):
        kinds = t.all_kinds
        want = [float(kinds[p + 1] in POLICY_KINDS) for p in range(len(kinds) - 1)] + [0.0]
        assert batch.loss_mask[row, : len(kinds)].tolist() == want
    loss = sft_loss(model, batch, AggNorm.of(batch.loss_mask), chunk_size=5, bf16=False)
    logits = model(batch.input_ids, attention_mask=batch.attention_mask, routes=batch.routes).logits
    logp = logprobs_from_logits(logits[:, :-1], batch.input_ids[:, 1:])
    mask = batch.loss_mask[:, :-1].bool()
    assert float(loss.detach()) == pytest.approx(float(-logp[mask].mean().detach()), rel=1e-5)
    loss.backward()
    names = {n.rsplit(".", 1)[-1] for n, p in model.named_parameters() if p.grad is not None}
    assert names == {"reason", "tool"}  # both adapters learn, the base does not


def step_grads(policy, parts, rows, cfg, micro: int, unit_of=None) -> list[torch.Tensor]:
    """The adapters' gradients of one imitation step over `rows`, in micro-batches of `micro` (fp32)."""
    import rolerl.train.sft as sft_module

    for p in policy.trainable():
        p.grad = None
    train = dataclasses.replace(cfg.train, micro_batch_size=micro)
    sft_module._imitation_step(parts, rows, dataclasses.replace(cfg, train=train), False, unit_of)
    return [p.grad.clone() for p in policy.trainable()]


def test_an_imitation_step_groups_its_rows_by_role_and_length_and_keeps_the_gradient(monkeypatch):
    """Micro-batches of one role and like lengths (less padding, the role's prompt start shared): the step's
    gradient equals one micro-batch of every row (fp32: float sums in another order)."""
    import rolerl.train.sft as sft_module
    from rolerl.run.policy import build_policy

    cfg = load_config(None, ["model.spec=tiny:llama", "model.device=cpu", "adapters.preset=isolated",
                             "adapters.rank=4", "train.micro_batch_size=2", "train.bf16=false"])  # fmt: skip
    policy = build_policy(cfg, ["asker", "coder"])
    for p in policy.trainable():  # B = 0 at the start: make both factors move the loss
        torch.nn.init.normal_(p, std=0.05)
    conversations = []
    for i, role in enumerate(["asker", "coder"] * 3):
        text = ANSWER_TEXT if i % 3 else "<answer>42</answer>"
        user = {"role": "user", "content": "What is 6 * 7?" + " Think." * i}
        conversations.append({"role": role, "messages": [user, {"role": "assistant", "content": text}]})
    tok = policy.tokenizer_of("asker")
    turns = [t for c in conversations for t in demonstration_turns(tok, c, policy.route_of)]
    parts = sft_module._parts(policy, turns, ["asker", "coder"], None)
    rows = torch.tensor([0, 1, 2, 3, 4, 5])
    seen = []
    real_loss = sft_module.sft_loss
    monkeypatch.setattr(sft_module, "sft_loss", lambda m, b, *a: seen.append(b) or real_loss(m, b, *a))

    grouped = step_grads(policy, parts, rows, cfg, 2)
    assert [b.roles for b in seen] == [["asker"] * 2, ["asker", "coder"], ["coder"] * 2]
    lengths = [int(n) for b in seen for n in b.attention_mask.sum(-1)]
    assert lengths[:3] == sorted(lengths[:3]) and lengths[3:] == sorted(lengths[3:]), "by length in a role"
    seen.clear()
    whole = step_grads(policy, parts, rows, cfg, 6)
    assert len(seen) == 1
    for g, w in zip(grouped, whole, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)
    assert any(bool(torch.any(g != 0)) for g in grouped)


def test_a_conversations_calls_train_as_one_row_with_their_loss_and_gradient(tokenizer):
    """A call that continues the one before (its prompt = that call + the result message) joins its row: the
    same loss tokens, loss and adapter gradient as the calls' own rows (fp32), the conversation's prompt run
    once. Under DART the earlier call's tool-call tokens route to `tool` where the later call's prompt routes
    them to `reason`: those calls stay apart."""
    from rolerl.roles import KINDS
    from rolerl.train.sft import chained

    model, tok = rolerl.tiny_model("llama", seed=0, tokenizer=tokenizer)
    rolerl.add_adapters(model, ["reason", "tool"], rank=4)
    for name, p in model.named_parameters():
        if "lora_" in name:
            torch.nn.init.normal_(p, std=0.05)
    system, user = CONVERSATION["messages"][:2]
    conversation = {"role": "policy", "messages": [
        system, user, {"role": "assistant", "content": "Let me compute.<code>print(6*7)</code>"},
        {"role": "user", "content": "Result: 42"},
        {"role": "assistant", "content": "Check: <code>print(42 / 7)</code>"},
        {"role": "user", "content": "Result: 6.0"},
        {"role": "assistant", "content": "So <answer>42</answer>"},
    ]}  # fmt: skip
    one = {"policy": dict.fromkeys(KINDS, 0)}  # every token on one adapter (shared, isolated)
    calls = demonstration_turns(tok, conversation, one)
    (row,) = chained(calls, one)
    assert row.prompt_ids == calls[0].prompt_ids
    assert row.prompt_ids + row.completion_ids == calls[-1].prompt_ids + calls[-1].completion_ids
    assert len(row.prompt_ids) + len(row.completion_ids) < sum(
        len(c.prompt_ids) + len(c.completion_ids) for c in calls
    )

    def loss_and_grads(turns):
        batch = collate(turns, [0.0] * len(turns), one, pad_id=2)
        model.zero_grad()
        loss = sft_loss(model, batch, AggNorm.of(batch.loss_mask), chunk_size=None, bf16=False)
        loss.backward()
        grads = [p.grad.clone() for n, p in model.named_parameters() if n.endswith("lora_B.reason")]
        return float(loss.detach()), int(batch.loss_mask.sum()), grads

    (a, n_a, g_a), (b, n_b, g_b) = loss_and_grads(calls), loss_and_grads([row])
    assert n_a == n_b and a == pytest.approx(b, rel=1e-5)
    for x, y in zip(g_a, g_b, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-6)
    dart = dart_route_of()
    assert len(chained(demonstration_turns(tok, conversation, dart), dart)) == 3


def test_a_demonstrations_rows_train_in_one_step():
    """`step_rows`: each epoch every turn once, a unit (a demonstration's turns) never split, steps of at
    most the batch size (a larger unit alone), and with one turn a unit the plain shuffle."""
    import rolerl.train.sft as sft_module

    plain = sft_module.step_rows([[i] for i in range(10)], 4, 2, torch.Generator().manual_seed(7))
    g = torch.Generator().manual_seed(7)
    expected = [(e, rows) for e in range(2) for rows in torch.randperm(10, generator=g).split(4)]
    assert [e for e, _ in plain] == [e for e, _ in expected]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(plain, expected, strict=True))
    units = [[0, 1, 2], [3], [4, 5], [6, 7, 8, 9, 10, 11], [12, 13]]
    steps = sft_module.step_rows(units, 4, 3, torch.Generator().manual_seed(0))
    for epoch in range(3):
        rows = [r for e, step in steps if e == epoch for r in step.tolist()]
        assert sorted(rows) == list(range(14))
    for _, step in steps:
        made = [u for u in units if set(u) & set(step.tolist())]
        assert all(set(u) <= set(step.tolist()) for u in made), "a unit split across steps"
        assert len(step) <= 4 or made == [units[3]]
    # filled in the shuffle's order: a unit that would overflow the step starts the next one
    first = torch.randperm(5, generator=torch.Generator().manual_seed(0)).tolist()
    assert steps[0][1].tolist()[: len(units[first[0]])] == units[first[0]]


def test_a_step_puts_a_demonstrations_calls_side_by_side(monkeypatch):
    """Rows of one demonstration and role sit next to each other in the step's order (their micro-batch runs
    the prompt start they share once); rows alone in their demonstration keep the length order; the
    gradient is the one of a single micro-batch."""
    import rolerl.train.sft as sft_module
    from rolerl.run.policy import build_policy

    cfg = load_config(None, ["model.spec=tiny:llama", "model.device=cpu", "adapters.preset=isolated",
                             "adapters.rank=4", "train.micro_batch_size=3", "train.bf16=false"])  # fmt: skip
    policy = build_policy(cfg, ["asker", "coder"])
    for p in policy.trainable():
        torch.nn.init.normal_(p, std=0.05)
    problems = ["What is 6 * 7? " + "Think. " * 9, "What is 2 + 2? " + "Be brief. " * 4]
    conversations, unit_of = [], []
    for u, (problem, requests) in enumerate(
        zip(problems, (["6*7", "42/1", "7*6"], ["2+2", "4*1"]), strict=True)
    ):
        conversations.append({"role": "asker", "messages": [{"role": "user", "content": problem},
                                                             {"role": "assistant", "content": ANSWER_TEXT}]})  # fmt: skip
        unit_of.append(u)
        for r in requests:
            user = {"role": "user", "content": f"Problem: {problem}\n\nRequest: compute {r}"}
            conversations.append({"role": "coder", "messages": [user, {"role": "assistant", "content": f"<answer>{r}</answer>"}]})  # fmt: skip
            unit_of.append(u)
    tok = policy.tokenizer_of("asker")
    turns = [t for c in conversations for t in demonstration_turns(tok, c, policy.route_of)]
    parts = sft_module._parts(policy, turns, ["asker", "coder"], None)
    rows = torch.tensor([6, 2, 0, 5, 1, 3, 4])  # the shuffle's order: both problems' calls interleaved
    seen = []
    real_loss = sft_module.sft_loss
    monkeypatch.setattr(sft_module, "sft_loss", lambda m, b, *a: seen.append(b) or real_loss(m, b, *a))

    grouped = step_grads(policy, parts, rows, cfg, 3, unit_of)
    # asker rows (one per problem: by length), then problem 0's three coder calls, then problem 1's two
    assert [b.roles for b in seen] == [["asker", "asker", "coder"], ["coder"] * 3, ["coder"]]
    texts = [tok.decode(b.input_ids[i].tolist()) for b in seen for i in range(b.input_ids.shape[0])]
    assert ["6 * 7" in t for t in texts[2:]] == [True] * 3 + [False] * 2
    seen.clear()
    whole = step_grads(policy, parts, rows, cfg, 7, unit_of)
    for g, w in zip(grouped, whole, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)


def test_read_demonstrations_errors(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(
        json.dumps({"messages": CONVERSATION["messages"]}) + "\n\n" + json.dumps({"text": "x"}) + "\n"
    )
    with pytest.raises(ValueError, match=r"d.jsonl:3: expected"):
        read_demonstrations(path)
    path.write_text(json.dumps({"messages": CONVERSATION["messages"]}) + "\n")
    assert read_demonstrations(path)[0]["role"] == "policy"
    path.write_text("".join(json.dumps(dict(CONVERSATION, id=key)) + "\n" for key in ("a/1", 7)))
    assert [row["id"] for row in read_demonstrations(path)] == ["a/1", "7"]
    path.write_text(json.dumps(dict(CONVERSATION, id=True)) + "\n")
    with pytest.raises(ValueError, match=r"d.jsonl:1: id must be a string or an integer .*; got True"):
        read_demonstrations(path)
    with pytest.raises(ValueError, match="demonstration role 'judge' is not in the topology"):
        demonstration_turns(None, dict(CONVERSATION, role="judge"), dart_route_of())


def test_read_demonstrations_names_the_real_line_and_field(tmp_path):
    path = tmp_path / "d.jsonl"
    good = json.dumps(CONVERSATION)
    path.write_text(f"{good}\n\n{good}\n\n" + '{"messages": [{"role": "user", "content": "hi"}\n')
    with pytest.raises(ValueError) as error:  # json's own message says "line 1": the row's, not the file's
        read_demonstrations(path)
    assert str(error.value) == f"{path}:5: not valid JSON (Expecting ',' delimiter at column 48)"
    row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ["a", "b"]}]}
    path.write_text(f"{good}\n{json.dumps(row)}\n")
    with pytest.raises(ValueError) as error:
        read_demonstrations(path)
    assert str(error.value) == (
        f"{path}:2: messages[1].content must be a string (join a list of text parts into one string); "
        "got list ['a', 'b']"
    )
    for bad, field in ((42, "content"), (None, "content")):
        path.write_text(json.dumps({"messages": [{"role": "assistant", "content": bad}]}) + "\n")
        with pytest.raises(ValueError, match=rf"d.jsonl:1: messages\[0\]\.{field} must be a string; got "):
            read_demonstrations(path)
    path.write_text(json.dumps({"messages": ["hi"]}) + "\n")
    with pytest.raises(ValueError, match=r"d.jsonl:1: messages\[0\] must be an object"):
        read_demonstrations(path)


def test_sft_run_writes_peft_adapters_that_moved(tmp_path):
    data = tmp_path / "demos.jsonl"
    data.write_text("".join(json.dumps(CONVERSATION) + "\n" for _ in range(3)))
    cfg = load_config(
        None,
        [
            "model.spec=tiny:llama",
            "model.device=cpu",
            "adapters.preset=dart",
            "adapters.rank=4",
            f"sft.data={data}",
            "sft.epochs=2",
            "sft.batch_size=2",
            "sft.lr=1e-2",
            "train.micro_batch_size=1",
            f"run.dir={tmp_path / 'sft'}",
            "run.tensorboard=false",
        ],
    )
    out = sft(cfg)
    rows = RunDir(tmp_path / "sft", tensorboard=False).read_metrics()
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and all(r["loss/sft"] > 0 for r in rows)
    assert rows[-1]["loss/sft"] < rows[0]["loss/sft"]  # the same demonstration four times: it learns it
    for name in ("reason", "tool"):
        assert (out / name / "adapter_config.json").is_file() and (
            out / name / "adapter_model.safetensors"
        ).is_file()
    model, _ = rolerl.tiny_model("llama", seed=0)
    rolerl.load_adapter(model, "tool", out / "tool")
    b = [p for n, p in model.named_parameters() if n.endswith("lora_B.tool")]
    assert any(bool(torch.any(x != 0)) for x in b)  # B started at zero
    # A second sft into the same directory would overwrite the adapters and duplicate metrics steps
    with pytest.raises(
        ValueError, match=r"already holds a run; continue it with --resume .*, choose another run.dir, or"
    ):
        sft(cfg)
    assert [r["step"] for r in RunDir(tmp_path / "sft", tensorboard=False).read_metrics()] == [1, 2, 3, 4]
    sft(dataclasses.replace(cfg, sft=dataclasses.replace(cfg.sft, epochs=1)), overwrite=True)
    assert [r["step"] for r in RunDir(tmp_path / "sft", tensorboard=False).read_metrics()] == [1, 2]


def _demos(path, n: int) -> None:
    """`n` different demonstrations (so that each batch of a shuffle differs)."""
    rows = []
    for i in range(n):
        text = ANSWER_TEXT.replace("6*7", f"6*{i}").replace("42", str(6 * i))
        user = {"role": "user", "content": f"What is 6 * {i}?"}
        rows.append(
            dict(
                CONVERSATION,
                messages=[CONVERSATION["messages"][0], user, {"role": "assistant", "content": text}],
            )
        )
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _sft_cfg(data, run_dir, *extra):
    return load_config(None, ["model.spec=tiny:llama", "model.device=cpu", "adapters.preset=dart",
                              "adapters.rank=4", f"sft.data={data}", "sft.epochs=2", "sft.batch_size=2",
                              "sft.lr=1e-2", "train.micro_batch_size=1", "run.checkpoint_every=2",
                              "run.keep_last=3", f"run.dir={run_dir}", "run.tensorboard=false", *extra])  # fmt: skip


def test_sft_resumes_where_sigterm_stopped_it_and_ends_as_the_uninterrupted_run(
    tmp_path, monkeypatch, capsys
):
    """Checkpoints every run.checkpoint_every steps, the last completed step on SIGTERM; `rolerl sft --resume`
    takes the very batches the uninterrupted run took (the shuffle is the seed's): the same losses, bit for bit
    the same adapters (the same ops in the same order on one machine)."""
    import signal

    from safetensors.torch import load_file

    import rolerl.train.sft as sft_module
    from rolerl.cli import main
    from rolerl.run.layout import checkpoints
    from rolerl.train.checkpoint import TrainingInterrupted

    before = signal.getsignal(signal.SIGTERM)
    data = tmp_path / "demos.jsonl"
    _demos(data, 5)  # 3 steps an epoch (2, 2, 1), 6 in all
    whole = sft(_sft_cfg(data, tmp_path / "whole"))
    assert [s for s, _ in checkpoints(tmp_path / "whole")] == [2, 4], "every 2 steps; the end writes adapters"

    real, calls = sft_module._imitation_step, []

    def stopped_in_step_4(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            signal.raise_signal(signal.SIGTERM)  # as a scheduler preempting the job
        return real(*args, **kwargs)

    monkeypatch.setattr(sft_module, "_imitation_step", stopped_in_step_4)
    cut = tmp_path / "cut"
    with pytest.raises(TrainingInterrupted) as info:
        sft(_sft_cfg(data, cut))
    assert str(info.value) == (
        f"stopped by SIGTERM at step 4 (step 3 is checkpointed); continue with rolerl sft --resume {cut}"
    )
    assert [s for s, _ in checkpoints(cut)] == [2, 3] and not (cut / "adapters").exists()
    assert signal.getsignal(signal.SIGTERM) == before, "SIGTERM's handler is put back"
    monkeypatch.setattr(sft_module, "_imitation_step", real)

    assert main(["sft", "--resume", str(cut)]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == {"adapters": str(cut / "adapters")}
    a, b = (RunDir(d, tensorboard=False).read_metrics() for d in (tmp_path / "whole", cut))
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5, 6], "step 4's cut-short row is not kept; each step once"
    assert [r["loss/sft"] for r in b] == [r["loss/sft"] for r in a]
    for name in ("reason", "tool"):
        x, y = (load_file(str(d / name / "adapter_model.safetensors")) for d in (whole, cut / "adapters"))
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), name


def test_sft_resume_refuses_other_inputs_and_starts_a_run_without_checkpoints(tmp_path, caplog):
    from rolerl.train.sft import ResumeMismatch

    data = tmp_path / "demos.jsonl"
    _demos(data, 5)
    run = tmp_path / "run"
    sft(_sft_cfg(data, run))
    with pytest.raises(
        ResumeMismatch, match=r"step_4 was trained on other inputs \(sft\.lr: 0\.01 -> 0\.02\)"
    ):
        sft(_sft_cfg(data, run, "sft.lr=2e-2"), resume=True)
    _demos(data, 4)
    with pytest.raises(ResumeMismatch, match=r"data: '[0-9a-f]{16}' -> '[0-9a-f]{16}'; turns: 5 -> 4"):
        sft(_sft_cfg(data, run), resume=True)
    with pytest.raises(ValueError, match="resume and overwrite exclude each other"):
        sft(_sft_cfg(data, run), resume=True, overwrite=True)
    fresh = tmp_path / "fresh"
    sft(_sft_cfg(data, fresh, "run.checkpoint_every=100"), resume=True)
    assert "no checkpoint yet; imitation starts again from step 0" in caplog.text
    assert [r["step"] for r in RunDir(fresh, tensorboard=False).read_metrics()] == [1, 2, 3, 4]


def test_cli_sft(tmp_path, capsys):
    from rolerl.cli import main
    from tests.train.test_rl import SMOKE

    data = tmp_path / "demos.jsonl"
    data.write_text(json.dumps(CONVERSATION) + "\n")
    args = ["model.spec=tiny:llama", "model.device=cpu", "adapters.rank=4", f"run.dir={tmp_path / 'run'}"]
    assert main(["sft", SMOKE, "--data", str(data), "--set", *args, "run.tensorboard=false"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["adapters"] == str(tmp_path / "run" / "adapters")
    assert (tmp_path / "run" / "adapters" / "policy" / "adapter_model.safetensors").is_file()
    assert main(["sft", SMOKE, "--set", *args]) == 2
    assert "sft.data is empty" in capsys.readouterr().err


def test_rl_starts_from_sft_adapters(tmp_path, caplog):
    from rolerl.run.policy import build_policy

    data = tmp_path / "demos.jsonl"
    data.write_text(json.dumps(dict(CONVERSATION, role="solver")) + "\n")
    base = ["model.spec=tiny:llama", "model.device=cpu", "adapters.preset=isolated", "adapters.rank=4"]
    cfg = load_config(
        None, [*base, f"sft.data={data}", "sft.lr=1e-2", f"run.dir={tmp_path}", "run.tensorboard=false"]
    )
    out = sft(cfg)
    warm = build_policy(load_config(None, [*base, f"adapters.init={out}"]), ["solver", "judge"])
    params = dict(warm.model.named_parameters())
    assert any(bool(torch.any(p != 0)) for n, p in params.items() if n.endswith("lora_B.solver"))
    assert all(bool(torch.all(p == 0)) for n, p in params.items() if n.endswith("lora_B.judge"))
    assert "no 'judge' adapter; it starts fresh" in caplog.text
    with pytest.raises(FileNotFoundError, match="holds none of this run's adapters"):
        build_policy(load_config(None, [*base, f"adapters.init={tmp_path / 'nothing'}"]), ["judge"])


def test_dart_starts_both_adapters_from_one_shared_warm_start(tmp_path):
    """adapters.init_from {"*": policy}: DART's reason and tool adapters are bit-for-bit copies of the shared
    warm start's one adapter, so the DART policy computes what the shared one does, whatever the routes."""
    from rolerl.errors import ConfigError
    from rolerl.run.policy import build_policy

    data = tmp_path / "demos.jsonl"
    data.write_text(json.dumps(CONVERSATION) + "\n")
    base = ["model.spec=tiny:llama", "model.device=cpu", "adapters.rank=4", "train.bf16=false"]
    out = sft(load_config(None, [*base, f"sft.data={data}", "sft.lr=1e-2", f"run.dir={tmp_path}",
                                 "run.tensorboard=false"]))  # fmt: skip
    shared = build_policy(load_config(None, [*base, f"adapters.init={out}"]), ["policy"])
    dart = build_policy(
        load_config(
            None, [*base, "adapters.preset=dart", f"adapters.init={out}", "adapters.init_from={'*': policy}"]
        ),
        ["policy"],
    )
    trained = {
        n.replace(".policy", ""): p for n, p in shared.model.named_parameters() if n.endswith(".policy")
    }
    assert any(bool(torch.any(p != 0)) for n, p in trained.items() if "lora_B" in n)  # the warm start moved
    for adapter in ("reason", "tool"):
        copy = {
            n.replace(f".{adapter}", ""): p
            for n, p in dart.model.named_parameters()
            if n.endswith(f".{adapter}")
        }
        assert copy.keys() == trained.keys() and all(torch.equal(copy[n], trained[n]) for n in trained)
    ids = torch.tensor([[5, 9, 2, 7, 3, 8, 1, 4]])
    mixed = torch.tensor([[0, 0, 1, 1, 1, 0, 1, 0]])  # reasoning and tool-call tokens on their own adapters
    with torch.no_grad():
        want = shared.model(ids, routes=torch.zeros_like(ids)).logits
        for route in (mixed, torch.zeros_like(ids), torch.ones_like(ids)):
            torch.testing.assert_close(dart.model(ids, routes=route).logits, want)  # fp32's tolerance
    # a source that is not there, an adapter the run lacks, a mapping without a directory: named
    with pytest.raises(FileNotFoundError, match=r"adapters.init_from.tool='nothing'"):
        build_policy(load_config(None, [*base, "adapters.preset=dart", f"adapters.init={out}",
                                        "adapters.init_from.tool=nothing"]), ["policy"])  # fmt: skip
    with pytest.raises(ValueError, match=r"adapters.init_from.coder: this run has no such adapter"):
        build_policy(load_config(None, [*base, f"adapters.init={out}", "adapters.init_from.coder=policy"]),
                     ["policy"])  # fmt: skip
    with pytest.raises(ConfigError, match="adapters.init .* is not set"):
        load_config(None, [*base, "adapters.init_from={'*': policy}"])


PASSAGES = "Doc 1(Title: Paris) Paris is the capital and largest city of France."


def search_text():  # a search agent's reply as its rollout writes it (the passages spliced by the engine)
    from rolerl.workflows.search_agent import SEARCH_TAGS

    call = "<think>Look it up.</think>\n<search>capital of France</search>"
    return call + format_tool_output(SEARCH_TAGS, PASSAGES) + "<answer>Paris</answer>"


def test_search_agent_demonstrations_are_cut_with_its_tags(tmp_path, tokenizer):
    """`rolerl sft` with `task.workflow: search_agent` cuts a demonstration with `<search>`/`<information>`
    as its rollouts do: the query trains the DART tool adapter, the passages carry no loss. With `Tags()`
    (what sft used before) the whole reply would be reasoning, the passages included."""
    from rolerl.workflows import role_tags
    from rolerl.workflows.search_agent import SEARCH_TAGS

    assert role_tags("search_agent") == {"policy": SEARCH_TAGS} and role_tags("tir") == {}
    assert role_tags("reasoner_tools")["reasoner"].tool_close == "</request>"
    conversation = {"role": "policy", "messages": [{"role": "user", "content": "Q?"},
                                                   {"role": "assistant", "content": search_text()}]}  # fmt: skip
    route_of = dart_route_of()
    (turn,) = demonstration_turns(tokenizer, conversation, route_of, tags=SEARCH_TAGS)
    query = [i for i, k in zip(turn.completion_ids, turn.kinds, strict=True) if k == "tool_call"]
    assert tokenizer.decode(query).strip() == "capital of France</search>"
    forced = [i for i, k in zip(turn.completion_ids, turn.kinds, strict=True) if k == TOOL_OUTPUT]
    assert forced == encode_exact(tokenizer, format_tool_output(SEARCH_TAGS, PASSAGES))
    (plain,) = demonstration_turns(tokenizer, conversation, route_of)
    assert TOOL_OUTPUT not in plain.kinds and "tool_call" not in plain.kinds

    # The run uses the workflow's tags: its logged token count is the search-tag cut's policy tokens.
    data = tmp_path / "demos.jsonl"
    data.write_text(json.dumps(conversation) + "\n")
    sets = ["model.spec=tiny:llama", "model.device=cpu", "adapters.preset=dart", "adapters.rank=4",
            f"sft.data={data}", "sft.epochs=1", f"run.dir={tmp_path / 'sft'}", "run.tensorboard=false"]  # fmt: skip
    _, tok = rolerl.tiny_model("llama", seed=0)
    (want,) = demonstration_turns(tok, conversation, route_of, tags=SEARCH_TAGS)
    # `roles.<r>.tags` replace the workflow's, in sft as in rollouts (`Context.generate`)
    retagged = "roles={policy: {tags: {tool_open: '<search>', tool_close: '</search>', " + (
        "output_open: '<information>', output_close: '</information>'}}}"
    )
    plain_tok = demonstration_turns(tok, conversation, route_of)[0]
    for extra, reference in (
        (["task.workflow=search_agent"], want),
        (["task.workflow=tir"], plain_tok),
        (["task.workflow=tir", retagged], want),
    ):
        sft(load_config(None, [*sets, *extra]), overwrite=True)
        (row,) = RunDir(tmp_path / "sft", tensorboard=False).read_metrics()
        assert row["tokens"] == sum(k in POLICY_KINDS for k in reference.kinds), extra
    assert sum(k in POLICY_KINDS for k in want.kinds) < sum(k in POLICY_KINDS for k in plain.kinds)


def test_role_tags_errors():
    from rolerl.workflows import role_tags

    with pytest.raises(ValueError, match="unknown workflow 'nope'"):
        role_tags("nope")
    with pytest.raises(ValueError, match="role_tags must map role names to rolerl.roles.Tags"):
        role_tags("tests.train.test_sft:BadTags")


class BadTags:
    roles = ("policy",)
    role_tags = {"policy": "<search>"}
