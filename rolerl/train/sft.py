"""Imitation warm-start: supervised training of the topology's adapters on role-labelled demonstrations.

Data: JSONL, one conversation per line, `{"role": "<workflow role>", "messages": [chat messages]}` (role
defaults to "policy"), or one model call per line as token ids (`rolerl collect` writes these:
`{"role", "prompt_ids", "completion_ids", "kinds", "vocab"}`, trained as they are). Each assistant message
of a conversation is one model call, written the way a rollout writes it: reasoning, tool calls in the
tool tags, tool output in the engine's format (`format_tool_output`), the answer, in the tags the
workflow's role calls with (`call_tags`: the search agent's `<search>`/`<information>`, `roles.<r>.tags`
over them). It is cut with `split_segments` and tokenised segment by segment with `splice_tokenize` (the
engine's own tokenisation of forced text), so SFT trains on exactly the token sequences rollouts produce
(DESIGN). The prompt of a call is the chat template of the messages before it; a call that continues the
one before it (a reasoner after a tool result) joins that call's row where the routes allow (`chained`:
the same loss and gradient, the conversation's prompt run once). The rows of one `"id"` (a demonstration:
the reasoner's conversation and the coder's calls on one problem) train in the same step, side by side,
so the prompt start they share (system prompt and problem) runs once (`rolerl.train.prefix`). Routes come
from `shift` with the topology, so SFT updates exactly the adapter each token would train in RL; the loss
(token-mean negative log-likelihood) is on policy kinds only, never on prompt or tool output.

A run checkpoints every `run.checkpoint_every` steps (`checkpoints/step_N`, as RL's: adapters, optimizer
and RNG state, atomic), and Ctrl-C or SIGTERM checkpoints the last completed step. `resume` goes on from
the newest one: the shuffle is a function of `run.seed`, so the resumed run takes the very batches the
uninterrupted one would have, and ends with the same adapters. A checkpoint records what it was trained on
(the data file's hash, the turn count, the `sft` settings, the seed, the adapters), and a resume with
anything else is refused with what differs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from rolerl.algorithms import AggNorm, aggregate
from rolerl.config import Config
from rolerl.heap import keep_freed_memory
from rolerl.models.adapters_io import save_adapter
from rolerl.models.lora import adapter_specs
from rolerl.progress import ProgressBar
from rolerl.roles import (
    ANSWER,
    KINDS,
    PROMPT,
    REASONING,
    TOOL_CALL,
    TOOL_OUTPUT,
    Tags,
    shift,
    splice_tokenize,
    split_segments,
)
from rolerl.run.policy import Policy, build_policy
from rolerl.signals import Terminated, sigterm_raises, stopping
from rolerl.train.checkpoint import (
    Completed,
    RunDir,
    StepUndo,
    TrainingInterrupted,
    clean_partial,
    load_newest,
    prepare_run_dir,
    save_checkpoint,
)
from rolerl.train.optim import lr_factor, policy_optimizer
from rolerl.train.policy import autocast, select_rows, token_logprobs
from rolerl.types import TrainBatch, Turn, collate
from rolerl.workflows import role_tags

log = logging.getLogger(__name__)


def read_demonstrations(path: str | Path) -> list[dict[str, Any]]:
    """Lines of `{"role": str, "messages": [{"role": str, "content": str}, ...], "id": optional}`; errors
    name the file, the line (counting blank ones, as an editor does) and the field. `id` (a string or an
    integer) ties the rows of one demonstration together (module doc)."""
    rows = []
    for n, line in enumerate(Path(path).read_text().split("\n"), 1):  # not splitlines: JSON may hold U+2028
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:  # its "line 1" is the line within this row: give the file's
            raise ValueError(f"{path}:{n}: not valid JSON ({e.msg} at column {e.colno})") from None
        token_row = isinstance(row, dict) and "prompt_ids" in row
        if not isinstance(row, dict) or not (token_row or isinstance(row.get("messages"), list)):
            raise ValueError(
                f"{path}:{n}: expected {{'role': ..., 'messages': [...]}} or a token row {{'role': ..., "
                f"'prompt_ids': [...], 'completion_ids': [...], 'kinds': [...]}}; got {line[:80]!r}"
            )
        if not isinstance(row.get("role", "policy"), str):
            raise ValueError(f"{path}:{n}: role must be a string (a workflow role); got {row['role']!r:.80}")
        key = row.get("id")
        if key is not None and (isinstance(key, bool) or not isinstance(key, str | int)):
            raise ValueError(
                f"{path}:{n}: id must be a string or an integer (a demonstration's); got {key!r:.60}"
            )
        unit = {} if key is None else {"id": str(key)}
        if token_row:
            rows.append(_token_row(row, f"{path}:{n}") | unit)
            continue
        for i, message in enumerate(row["messages"]):
            _check_message(message, f"{path}:{n}: messages[{i}]")
        rows.append({"role": row.get("role", "policy"), "messages": row["messages"]} | unit)
    return rows


def _token_row(row: dict[str, Any], where: str) -> dict[str, Any]:
    """A `rolerl collect` row (its role already checked): ids are integers >= 0, one known kind per
    completion id."""
    for field in ("prompt_ids", "completion_ids", "kinds"):
        if not isinstance(row.get(field), list):
            raise ValueError(f"{where}: {field} must be a list; got {row.get(field)!r:.60}")
    for field in ("prompt_ids", "completion_ids"):
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in row[field]):
            raise ValueError(f"{where}: {field} must hold token ids (integers >= 0)")
    if len(row["kinds"]) != len(row["completion_ids"]):
        raise ValueError(
            f"{where}: {len(row['kinds'])} kinds for {len(row['completion_ids'])} completion ids (one each)"
        )
    bad = sorted(set(row["kinds"]) - set(KINDS) | ({PROMPT} & set(row["kinds"])))
    if bad:
        raise ValueError(
            f"{where}: unknown completion kinds {bad}; allowed: {[k for k in KINDS if k != PROMPT]}"
        )
    return {"role": row.get("role", "policy"), "where": where, "vocab": row.get("vocab"),
            **{f: row[f] for f in ("prompt_ids", "completion_ids", "kinds")}}  # fmt: skip


def _check_message(message: Any, where: str) -> None:
    if not isinstance(message, dict):
        raise ValueError(f"{where} must be an object {{'role': ..., 'content': ...}}; got {message!r:.80}")
    for field in ("role", "content"):
        value = message.get(field)
        if not isinstance(value, str):
            hint = " (join a list of text parts into one string)" if isinstance(value, list) else ""
            got = "nothing" if value is None else f"{type(value).__name__} {value!r:.60}"
            raise ValueError(f"{where}.{field} must be a string{hint}; got {got}")


def demonstration_turns(
    tokenizer,
    conversation: Mapping[str, Any],
    route_of: Mapping[str, Mapping[str, int]],
    *,
    tags: Tags | None = None,
    max_len: int | None = None,
) -> list[Turn]:
    """One `Turn` per assistant message: prompt ids from the chat template, completion ids and kinds from
    `splice_tokenize(split_segments(text))` plus the end-of-turn token the model must learn to sample,
    routes from `shift`. Log-probs are 0 (unused: SFT has no old policy)."""
    tags = tags or Tags()
    role = conversation["role"]
    if role not in route_of:
        raise ValueError(f"demonstration role {role!r} is not in the topology; roles: {sorted(route_of)}")
    if "prompt_ids" in conversation:
        return [_token_turn(tokenizer, conversation, route_of[role], max_len)]
    messages = list(conversation["messages"])
    turns = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        enc = tokenizer.apply_chat_template(
            messages[:i], add_generation_prompt=True, tokenize=True, return_dict=True
        )
        prompt = list(enc["input_ids"])
        segments = split_segments(message["content"], tags)
        ids, kinds = splice_tokenize(tokenizer, segments)
        if tokenizer.eos_token_id is not None:  # the model ends its turn by sampling EOS
            ids.append(tokenizer.eos_token_id)
            kinds.append(_end_kind(segments, tags))
        turns.append(_turn(role, prompt, ids, kinds, route_of[role], max_len, "eos"))
    return turns


def chained(turns: Sequence[Turn], route_of: Mapping[str, Mapping[str, int]]) -> list[Turn]:
    """A conversation's calls as one row wherever a call's prompt is the call before it, prompt and
    completion, then the new messages (a reasoner continuing after a result, as `follow_up_ids` builds it),
    and every shared position has the same route: the row's logits at each call's tokens are those of the
    call's own row (causal attention), so its loss and gradient are the calls' together, while the
    conversation's prompt runs once instead of once a call. The new messages carry no loss (`PROMPT`)."""
    out: list[Turn] = []
    for turn in turns:
        last = out[-1] if out else None
        if last is not None and last.role == turn.role:
            seq = last.prompt_ids + last.completion_ids
            if turn.prompt_ids[: len(seq)] == seq:
                gap = len(turn.prompt_ids) - len(seq)
                kinds = last.kinds + [PROMPT] * gap + turn.kinds
                routes = shift([PROMPT] * len(last.prompt_ids) + kinds, route_of[turn.role])
                if routes == turn.routes and routes[: len(seq)] == last.routes:  # each call's own routes
                    out[-1] = dataclasses.replace(
                        turn, prompt_ids=last.prompt_ids, completion_ids=turn.prompt_ids[len(last.prompt_ids) :]
                        + turn.completion_ids, kinds=kinds, routes=routes,
                        logprobs=last.logprobs + [0.0] * gap + turn.logprobs,
                    )  # fmt: skip
                    continue
        out.append(turn)
    return out


def _token_turn(tokenizer, row: Mapping[str, Any], route_of: Mapping[str, int], max_len: int | None) -> Turn:
    """A token row as it is (a rollout's exact ids and kinds); its ids must fit the role's vocabulary."""
    size = len(tokenizer)
    if row.get("vocab") is not None and row["vocab"] != size:
        raise ValueError(
            f"{row['where']}: collected with a tokenizer of {row['vocab']} tokens; role {row['role']!r} runs "
            f"on one of {size}: token rows only train the model family they were sampled from"
        )
    prompt, ids = list(row["prompt_ids"]), list(row["completion_ids"])
    if max(prompt + ids, default=0) >= size:
        raise ValueError(f"{row['where']}: token id {max(prompt + ids)} is outside the vocabulary ({size})")
    return _turn(row["role"], prompt, ids, list(row["kinds"]), route_of, max_len, "stop")


def _turn(role, prompt, ids, kinds, route_of, max_len, finish) -> Turn:
    """The demonstration's `Turn` (cut to `max_len`), routed by `shift`; log-probs 0 (SFT has no old
    policy), NaN on tool output as in rollouts."""
    if max_len is not None and len(prompt) + len(ids) > max_len:
        log.warning("demonstration cut from %d to %d tokens", len(prompt) + len(ids), max_len)
        keep = max(max_len - len(prompt), 0)
        ids, kinds = ids[:keep], kinds[:keep]
    routes = shift([PROMPT] * len(prompt) + kinds, route_of)
    logprobs = [0.0 if k != TOOL_OUTPUT else math.nan for k in kinds]
    return Turn(role, prompt, ids, kinds, routes, logprobs, finish)


def _end_kind(segments: Sequence[tuple[str, str]], tags: Tags) -> str:
    """The tag state after the text: inside a tag only if the last segment opened one and never closed."""
    if not segments:
        return REASONING
    kind, text = segments[-1]
    closes = {TOOL_CALL: tags.tool_close, ANSWER: tags.answer_close}
    return kind if kind in closes and not text.endswith(closes[kind] or "") else REASONING


def sft_loss(
    model: torch.nn.Module,
    batch: TrainBatch,
    norm: AggNorm,
    chunk_size: int | None,
    bf16: bool,
    share_prefix: bool = True,
) -> torch.Tensor:
    """Token-mean NLL over the policy tokens of `batch`, normalised by the whole batch's `norm`.
    `share_prefix`: the start all the rows' prompts have in common (a system prompt) runs once."""
    with autocast(batch.input_ids.device, bf16):
        logp = token_logprobs(
            model, batch, temperature=1.0, chunk_size=chunk_size, share_prefix=share_prefix
        ).logp  # (b, T-1)
    return aggregate(-logp, batch.loss_mask[:, :-1], "token-mean", norm)


def sft(
    cfg: Config,
    roles: Sequence[str] | None = None,
    *,
    policy: Policy | None = None,
    overwrite: bool = False,
    every_kind: bool = False,
    resume: bool = False,
) -> Path:
    """Train the adapters on `cfg.sft.data`; write them to `cfg.run.dir/adapters/<name>` (PEFT dirs).

    `policy` trains an already built model in place (e.g. `rolerl demo`, which then evaluates and RL-trains
    it); by default the model and adapters `cfg` names are built for `roles` (default: the data's roles).
    A `run.dir` that already holds a run is refused (its metrics would mix) unless `overwrite`. The loss
    covers the kinds `adapters.train_kinds` names, as in RL, unless `every_kind` (`rolerl demo`'s warm start
    teaches the whole tool format, then RL trains only the chosen kinds). `resume` continues the run in
    `cfg.run.dir` from its newest checkpoint (module doc); one stopped before its first starts again."""
    if resume and overwrite:
        raise ValueError("resume and overwrite exclude each other: continue the run, or replace it")
    data = read_demonstrations(cfg.sft.data)
    if not resume:
        prepare_run_dir(cfg.run.dir, "sft", overwrite=overwrite)
    if policy is None:
        roles = list(roles) if roles else sorted({row["role"] for row in data})
        policy = build_policy(cfg, roles)
    roles = list(policy.route_of)
    for row in data:
        if row["role"] not in policy.route_of:
            raise ValueError(
                f"demonstration role {row['role']!r} is not in the topology; roles: {sorted(roles)}"
            )
    tags = call_tags(cfg, roles)  # e.g. the search agent's: a query is a tool call, as in rollouts
    turns, units = training_rows(data, policy, tags, cfg.sft.max_len)
    if not turns:
        raise ValueError(f"{cfg.sft.data!r} holds no assistant messages to imitate")
    loss_kinds = None if every_kind else {role: policy.topology.loss_kinds(role) for role in roles}
    parts = _parts(policy, turns, roles, loss_kinds)
    generator = torch.Generator().manual_seed(cfg.run.seed)
    batches = step_rows(units, cfg.sft.batch_size, cfg.sft.epochs, generator)
    unit_of = unit_index(units, len(turns))
    steps = len(batches)
    optimizer = policy_optimizer(policy, cfg.optim, lr=cfg.sft.lr)
    trained_on = _trained_on(cfg, turns, policy)
    start = _restore(cfg, policy, optimizer, trained_on) if resume else 0
    if cfg.train.heap == "keep":
        keep_freed_memory()  # every step reuses the pages of the one before (rolerl.heap)
    run = RunDir(
        cfg.run.dir, tensorboard=cfg.run.tensorboard, resume_step=start if resume else None,
        wandb=cfg.run.wandb, wandb_entity=cfg.run.wandb_entity,
    )  # fmt: skip
    run.write_config(cfg)
    step = 0
    for member in policy.members.values():
        member.model.eval()  # no dropout (as in rollouts); train mode also runs p=0 dropout kernels (slow)
    done, undo = Completed(start, saved=start), StepUndo(policy.trainable(), optimizer)

    def checkpoint() -> None:
        save_checkpoint(cfg.run.dir, done.step, policy.adapter_models(), optimizer,
                        keep_last=cfg.run.keep_last, extra={"sft": trained_on}, rng=done.rng)  # fmt: skip
        done.saved = done.step

    try:
        with (
            sigterm_raises(),
            ProgressBar("imitation", steps, completed=start, enabled=cfg.run.progress) as bar,
        ):
            for epoch, rows in batches:
                if step < start:  # resumed: the same shuffle, so this batch is the one already trained
                    step += 1
                    continue
                t0 = time.perf_counter()
                lr = optimizer.set_lr(lr_factor(step, steps, cfg.optim))
                undo.arm()
                optimizer.zero_grad()
                loss, tokens = _imitation_step(parts, rows, cfg, policy.bf16, unit_of)
                norms = optimizer.clip()
                optimizer.step()
                step += 1
                run.log({"step": step, "epoch": epoch, "loss/sft": loss, "grad_norm": norms["global"],
                         "lr": next(iter(lr.values())), "tokens": tokens,
                         "time/step": time.perf_counter() - t0})  # fmt: skip
                done.complete(step, next(iter(lr.values())))
                undo.disarm()
                if step % cfg.run.checkpoint_every == 0 and step < steps:
                    checkpoint()
                bar.update(step, f"loss {loss:.4f}")
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (`Terminated`): keep the last completed step
        stopping()
        if done.step > done.saved:
            undo.undo()  # a step cut short in its optimizer update is put back
            checkpoint()
        why = "stopped by SIGTERM" if isinstance(e, Terminated) else "interrupted"
        raise TrainingInterrupted(done.step + 1, done.saved, cfg.run.dir, why, command="sft") from e
    finally:
        undo.close()
        run.close()
    out = Path(cfg.run.dir) / "adapters"
    for member in policy.members.values():
        for name in adapter_specs(member.model):
            save_adapter(member.model, name, out / name)
    return out


class ResumeMismatch(ValueError):
    """A resume whose checkpoint was trained on other data or settings: `differ` says which, old -> new."""

    def __init__(self, run_dir: str, step: int, differ: str) -> None:
        self.differ = differ
        super().__init__(
            f"resume {run_dir}: its checkpoint step_{step} was trained on other inputs ({differ}); resume with "
            "the run's own, or start again with --overwrite"
        )


def _trained_on(cfg: Config, turns: Sequence[Turn], policy: Policy) -> dict[str, Any]:
    """What a checkpoint's steps were trained on: a resume must match it (module doc)."""
    digest = hashlib.sha256(Path(cfg.sft.data).read_bytes()).hexdigest()[:16]
    return {"data": digest, "turns": len(turns), "seed": cfg.run.seed, "adapters": sorted(policy.adapter_names),
            **{f"sft.{k}": v for k, v in dataclasses.asdict(cfg.sft).items() if k != "data"}}  # fmt: skip


def _restore(cfg: Config, policy: Policy, optimizer: Any, trained_on: dict[str, Any]) -> int:
    """Load the newest readable checkpoint of `cfg.run.dir` after checking what it was trained on; returns its
    step (0: none yet, the run starts again)."""
    clean_partial(cfg.run.dir)
    state = load_newest(cfg.run.dir, policy.adapter_models(), optimizer)
    if state is None:
        log.warning("resume %s: no checkpoint yet; imitation starts again from step 0", cfg.run.dir)
        return 0
    saved = state.get("extra", {}).get("sft", {})
    differ = [f"{k}: {saved.get(k)!r} -> {v!r}" for k, v in trained_on.items() if saved.get(k) != v]
    if differ:
        raise ResumeMismatch(cfg.run.dir, state["step"], "; ".join(differ))
    log.info("resume %s: from step %d", cfg.run.dir, state["step"])
    return int(state["step"])


def call_tags(cfg: Config, roles: Sequence[str]) -> dict[str, Tags]:
    """Each role's tags as its rollout calls use them (`Context.generate`): the workflow's own for the role
    (`rolerl.workflows.role_tags`, else `Tags()`), with `roles.<r>.tags` replacing theirs."""
    base = role_tags(cfg.task.workflow)
    out = {}
    for role in roles:
        rc = cfg.roles.get(role)
        out[role] = dataclasses.replace(base.get(role, Tags()), **((rc.tags or {}) if rc else {}))
    return out


def _parts(
    policy: Policy, turns: Sequence[Turn], roles: list[str], loss_kinds: Mapping[str, Any] | None
) -> list[tuple[torch.nn.Module, list[int], TrainBatch]]:
    """Per model: its model, the global indices of its turns, and those turns collated."""
    out = []
    for name, member in policy.members.items():
        mine = [i for i, t in enumerate(turns) if policy.topology.model(t.role) == name]
        if mine:
            pad = member.tokenizer.pad_token_id if member.tokenizer.pad_token_id is not None else 0
            batch = collate([turns[i] for i in mine], [0.0] * len(mine), policy.route_of, role_names=roles,
                            pad_id=pad, loss_kinds=loss_kinds)  # fmt: skip
            out.append((member.model, mine, batch))
    return out


def training_rows(
    data: Sequence[Mapping[str, Any]], policy: Policy, tags: Mapping[str, Tags], max_len: int | None
) -> tuple[list[Turn], list[list[int]]]:
    """The demonstrations' training rows (each conversation's calls, `chained` where exact) and the units
    a step keeps together: the turn indices of each demonstration (rows with one id), or of one row."""
    turns: list[Turn] = []
    units: dict[Any, list[int]] = {}
    for n, row in enumerate(data):
        made = chained(demonstration_turns(
            policy.tokenizer_of(row["role"]), row, policy.route_of, tags=tags.get(row["role"]), max_len=max_len,
        ), policy.route_of)  # fmt: skip
        units.setdefault(("id", row["id"]) if "id" in row else ("row", n), []).extend(
            range(len(turns), len(turns) + len(made))
        )
        turns += made
    return turns, [u for u in units.values() if u]


def unit_index(units: Sequence[Sequence[int]], n: int) -> list[int]:
    """Each of the `n` turns' unit (its position in `units`)."""
    out = [0] * n
    for u, members in enumerate(units):
        for t in members:
            out[t] = u
    return out


def step_rows(
    units: Sequence[Sequence[int]], size: int, epochs: int, generator: torch.Generator
) -> list[tuple[int, torch.Tensor]]:
    """Every step's `(epoch, turn indices)`: each epoch the units (a demonstration's turns) in a shuffle of
    `generator`, filled into steps of at most `size` turns (a larger unit is a step of its own). With one
    turn a unit, `randperm(turns).split(size)`."""
    out = []
    for epoch in range(epochs):
        step: list[int] = []
        for u in torch.randperm(len(units), generator=generator).tolist():
            if step and len(step) + len(units[u]) > size:
                out.append((epoch, torch.tensor(step)))
                step = []
            step += units[u]
        if step:
            out.append((epoch, torch.tensor(step)))
    return out


def _grouped(batch: TrainBatch, rows: list[int], unit_of: Mapping[int, int]) -> list[int]:
    """A step's rows by role, then demonstration (`unit_of`, by the step's rows of `batch`), then length: a
    demonstration's calls of one role sit side by side, so a micro-batch runs the prompt start they share
    (system prompt and problem) once (`share_prefix`); rows whose demonstration has no other call of their
    role pad to rows of like length and share their role's system prompt. The step's gradient is the sum
    over its rows in any order."""
    lengths = batch.attention_mask.sum(-1).tolist()
    calls = Counter((batch.roles[i], unit_of[i]) for i in rows)
    return sorted(rows, key=lambda i: (batch.roles[i], unit_of[i] if calls[batch.roles[i], unit_of[i]] > 1 else -1,
                                       lengths[i]))  # fmt: skip


def _imitation_step(
    parts, rows: torch.Tensor, cfg: Config, bf16: bool, unit_of: Sequence[int] | None = None
) -> tuple[float, float]:
    """Accumulate one optimizer step's gradients over `rows` (global turn indices, any models; `unit_of`:
    each turn's demonstration, default its own); returns the loss and its token count (the normaliser is
    counted over every model's rows of the step)."""
    chosen = []
    for model, mine, batch in parts:
        where = {r: i for i, r in enumerate(mine)}
        local = [where[r] for r in rows.tolist() if r in where]
        if local:
            # each of the step's rows' demonstration (its own turn index where none are given)
            units = {i: mine[i] if unit_of is None else unit_of[mine[i]] for i in local}
            chosen.append((model, select_rows(batch, _grouped(batch, local, units))))
    norm = AggNorm.of(*[b.loss_mask for _, b in chosen])
    loss = 0.0
    for model, batch in chosen:
        batch = batch.to(next(model.parameters()).device)
        b, size = batch.input_ids.shape[0], cfg.train.micro_batch_size
        for start in range(0, b, size):
            mb = select_rows(batch, range(start, min(start + size, b)))
            part = sft_loss(model, mb, norm, cfg.train.chunk_size, bf16, cfg.train.share_prefix)
            part.backward()
            loss += float(part.detach())
    return loss, float(norm.num_tokens)
