"""The RL loop, top to bottom: tasks -> rollout -> rewards -> advantages -> collate -> PPO update -> metrics
-> checkpoint (DESIGN "Own the loop"; nanochat's chat_rl and torchtune's recipes are the model).

Only adapters train: the base weights are frozen by `add_adapters` and the reference for KL is the same
model with route -1. Every random choice of a step is a pure function of `(run.seed, step, ...)`: tasks
come from `task.examples(split, n, seed)`, each model call samples with a counter-based seed derived from
`(run seed, step, task, sample, call)`, and PPO's shuffling uses a generator seeded the same way, so a run
resumed from a checkpoint reproduces the uninterrupted run's metrics exactly.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import random
import time
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path

import numpy as np
import torch

from rolerl.algorithms import ADVANTAGES, zero_variance_mask
from rolerl.config import Config, ConfigError, load_config
from rolerl.models.lora import adapter_parameters
from rolerl.progress import ProgressBar
from rolerl.roles import KINDS, POLICY_KINDS, PROMPT
from rolerl.rollout.engine import Engine
from rolerl.rollout.lockstep import LockstepBackend
from rolerl.rollout.sampling import SamplingParams
from rolerl.rollout.scheduler import EngineBackend, RolloutBackend
from rolerl.tasks import TASKS, Example, Task
from rolerl.train.checkpoint import (
    Completed,
    RunDir,
    StepUndo,
    TrainingInterrupted,
    clean_partial,
    holds_run,
    load_newest,
    prepare_run_dir,
    save_checkpoint,
)
from rolerl.train.monitor import ToolHealth, sampled_tokens, ticker
from rolerl.train.policy import Policy, build_policy
from rolerl.train.update import LossSettings, lr_factor, ppo_update
from rolerl.types import Episode, Turn, collate
from rolerl.workflows import WORKFLOWS, Context, Workflow, derive_seed

log = logging.getLogger(__name__)


def train(
    cfg: Config,
    *,
    task: Task | None = None,
    workflow: Workflow | None = None,
    policy: Policy | None = None,
    resume: bool = False,
    overwrite: bool = False,
    stop_after: int | None = None,
) -> Path:
    """Run `cfg.train.steps` steps (continuing from the newest checkpoint of `cfg.run.dir` if `resume`).

    `task`/`workflow` override the config's registry names and `policy` the model the config names
    (tests, notebooks: `build_policy(cfg, workflow.roles)`). A fresh run refuses a `run.dir` that holds a
    run unless `overwrite`; `resume` falls back past unreadable checkpoints and restarts a run that has
    none from step 0. The lr of step s is always the schedule of `cfg` (`_lr`), so a run extended by a
    larger `train.steps` follows the longer schedule from its next step on. Ctrl-C (or an error)
    checkpoints the last completed step first; Ctrl-C then raises `TrainingInterrupted`. `stop_after`
    ends the run after that step, as a kill would (no extra checkpoint). Returns the run directory.
    """
    if resume and overwrite:
        raise ValueError("resume and overwrite exclude each other: continue the run, or replace it")
    if not resume:
        prepare_run_dir(cfg.run.dir, "train", overwrite=overwrite)
    task = task if task is not None else TASKS[cfg.task.name]()
    workflow = workflow if workflow is not None else WORKFLOWS[cfg.task.workflow](task)
    policy = policy if policy is not None else build_policy(cfg, workflow.roles)
    params = policy.trainable()
    optimizer = torch.optim.AdamW(
        params, lr=cfg.optim.lr, betas=tuple(cfg.optim.betas), weight_decay=cfg.optim.weight_decay
    )
    seed_everything(cfg.run.seed)  # nothing here draws from global RNGs by design; code we call might
    start = _restore(cfg, policy, optimizer) if resume else 0  # RNG states restored too
    engine = _engine(cfg, policy)  # before any write: a tool that cannot work here stops the run now
    run = RunDir(cfg.run.dir, tensorboard=cfg.run.tensorboard, resume_step=start if resume else None)
    run.write_config(cfg)
    health = ToolHealth()
    backend = LockstepBackend(engine) if cfg.rollout.backend == "lockstep" else EngineBackend(engine)
    last = min(cfg.train.steps, stop_after) if stop_after is not None else cfg.train.steps
    done = Completed(start, saved=start)
    undo = StepUndo(params, optimizer)
    try:
        with ProgressBar("train", cfg.train.steps, completed=start, enabled=cfg.run.progress) as bar:
            for step in range(start + 1, last + 1):
                lr = _set_lr(optimizer, cfg, step)  # the schedule counts training steps (PAPERS 1.5)
                undo.arm()
                report = functools.partial(bar.update, step - 1)  # progress inside the step
                metrics = train_step(
                    cfg,
                    step,
                    policy,
                    params,
                    optimizer,
                    backend,
                    task,
                    workflow,
                    report=report,
                    health=health,
                )
                metrics["lr"] = lr
                run.log(metrics)
                done.complete(step, lr)
                undo.disarm()
                if step % cfg.run.checkpoint_every == 0 or step == cfg.train.steps:
                    _checkpoint(cfg, policy, optimizer, done)
                bar.update(step, f"reward {metrics['reward/mean']:.3f} acc {metrics['accuracy']:.2f}")
    except BaseException as e:
        _checkpoint_on_error(cfg, policy, optimizer, done, undo)
        if isinstance(e, KeyboardInterrupt) and not isinstance(e, TrainingInterrupted):
            raise TrainingInterrupted(done.step + 1, done.saved, cfg.run.dir) from e
        raise
    finally:
        undo.close()
        backend.close()
        for tool in engine.tools.values():  # e.g. the sandbox's worker processes
            getattr(tool, "close", lambda: None)()
        run.close()
    return Path(cfg.run.dir)


def _lr(cfg: Config, step: int) -> float:
    """The lr of (1-based) training `step`: a pure function of the config, so a resumed run, and one
    extended by a larger `train.steps`, uses the schedule of a fresh run of its length from there on."""
    return cfg.optim.lr * lr_factor(step - 1, cfg.train.steps, cfg.optim)


def _set_lr(optimizer: torch.optim.Optimizer, cfg: Config, step: int) -> float:
    lr = _lr(cfg, step)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


def _checkpoint(cfg: Config, policy: Policy, optimizer: torch.optim.Optimizer, done: Completed) -> None:
    extra = {"train_steps": cfg.train.steps, "lr": done.lr}  # what `_restore` says when a run is extended
    save_checkpoint(
        cfg.run.dir, done.step, policy.model, policy.adapter_names, optimizer,
        keep_last=cfg.run.keep_last, extra=extra, rng=done.rng,
    )  # fmt: skip
    done.saved = done.step


def _checkpoint_on_error(
    cfg: Config, policy: Policy, optimizer: torch.optim.Optimizer, done: Completed, undo: StepUndo
) -> None:
    """Checkpoint the last completed step if it is not yet, undoing a cut-short update first. Never
    raises: the error that got us here is the one to report."""
    if done.step <= done.saved:
        return
    try:
        undo.undo()
        _checkpoint(cfg, policy, optimizer, done)
        log.warning("stopped during step %d: checkpointed step %d", done.step + 1, done.step)
    except Exception as e:  # e.g. the disk is full: keep the older checkpoint
        log.warning("could not checkpoint step %d on the way out (%s)", done.step, e)


def _restore(cfg: Config, policy: Policy, optimizer: torch.optim.Optimizer) -> int:
    """Load the newest readable checkpoint and return its step; 0 (start again) for a run that stopped
    before its first checkpoint."""
    clean_partial(cfg.run.dir)
    state = load_newest(cfg.run.dir, policy.model, policy.adapter_names, optimizer)
    if state is None:
        if not holds_run(cfg.run.dir) and not (Path(cfg.run.dir) / "config.yaml").exists():
            raise FileNotFoundError(
                f"--resume {cfg.run.dir!r}: no checkpoints/step_N and no run (config.yaml, metrics.jsonl) "
                "in that directory"
            )
        log.warning(
            "--resume %s: the run stopped before its first checkpoint; starting it again from step 0 "
            "(its metrics.jsonl and TensorBoard logs are replaced)",
            cfg.run.dir,
        )
        return 0
    start = int(state["step"])
    old = state.get("extra", {}).get("train_steps") or _config_steps(Path(cfg.run.dir) / "config.yaml")
    if start >= cfg.train.steps:
        log.warning(
            "--resume: the checkpoint is at step %d, train.steps=%d: nothing to train", start, cfg.train.steps
        )
    elif old is not None and old != cfg.train.steps:
        was = state.get("extra", {}).get("lr")
        was = f"; was {was:.3g} at step {start}" if was is not None else ""
        log.info(
            "train.steps %d -> %d: lr follows the %d-step %s schedule from step %d (%.3g%s)",
            old, cfg.train.steps, cfg.train.steps, cfg.optim.schedule, start + 1, _lr(cfg, start + 1), was,
        )  # fmt: skip
    return start


def _config_steps(path: Path) -> int | None:
    """`train.steps` of a run's saved config (checkpoints written before `extra` carried it)."""
    try:
        return load_config(path).train.steps
    except (ConfigError, OSError):  # a missing or hand-edited file: then we cannot tell, and say nothing
        return None


def train_step(
    cfg: Config,
    step: int,
    policy: Policy,
    params: Sequence[torch.nn.Parameter],
    optimizer: torch.optim.Optimizer,
    backend: RolloutBackend,
    task: Task,
    workflow: Workflow,
    report: Callable[[str], None] | None = None,
    health: ToolHealth | None = None,
) -> dict[str, float]:
    """One RL step; returns its flat metrics dict. `report` receives a short progress text now and then
    (rollout tokens, update micro-batches) for a progress bar."""
    report = report or (lambda text: None)
    t0 = time.perf_counter()
    # 1. tasks, and n episodes of each through the workflow, all concurrently (one batched engine)
    examples = task.examples(
        cfg.task.split, cfg.train.tasks_per_step, derive_seed(cfg.run.seed, "tasks", step)
    )
    before = sampled_tokens(backend)
    with ticker(lambda: report(f"rollout: {sampled_tokens(backend) - before} tokens sampled")):
        episodes = asyncio.run(rollout(cfg, step, policy, backend, workflow, examples))
    if health is not None:
        health.check(step, episodes)
    t1 = time.perf_counter()
    # 2. rewards -> advantages over the configured groups
    turns, rewards, keys = turn_rewards(episodes, cfg.algorithm.group_key)
    metrics: dict[str, float] = {"step": step} | episode_metrics(episodes, policy)
    keep = list(range(len(turns)))
    if cfg.algorithm.filter_zero_variance and turns:
        flat = zero_variance_mask(rewards, keys)
        keep = [i for i in keep if not bool(flat[i])]
        metrics["filtered/zero_variance_frac"] = 1.0 - len(keep) / len(turns)
    advantages = ADVANTAGES[cfg.algorithm.advantage](rewards, keys) if turns else rewards
    metrics["advantage/abs_mean"] = float(advantages.abs().mean()) if turns else 0.0
    # 3. collate and update the adapters
    if keep:
        kept = [turns[i] for i in keep]
        batch = collate(
            kept,
            [float(advantages[i]) for i in keep],
            policy.route_of,
            role_names=list(policy.route_of),
            pad_id=_pad_id(policy.tokenizer),
            loss_kinds={role: policy.topology.loss_kinds(role) for role in policy.route_of},
        ).to(policy.device)
        settings = LossSettings(
            algorithm=cfg.algorithm,
            temperature=cfg.rollout.temperature,
            horizon=cfg.rollout.max_new_tokens,
            chunk_size=cfg.train.logprob_chunk,
            bf16=policy.bf16,
            share_prefix=cfg.train.share_prefix,
            isolation=cfg.adapters.isolation,
            adapter_params=adapter_parameters(policy.model) if cfg.adapters.isolation == "strict" else {},
        )
        generator = torch.Generator().manual_seed(derive_seed(cfg.run.seed, "shuffle", step))
        # The model stays in eval mode: RL wants no dropout (the rollout had none), and train mode makes HF
        # run p=0 dropout kernels over attention weights (measured ~30% slower fwd+bwd on CPU).
        metrics |= ppo_update(
            policy.model,
            params,
            optimizer,
            batch,
            settings,
            ppo_epochs=cfg.train.ppo_epochs,
            mini_batches=cfg.train.mini_batches,
            micro_batch_size=cfg.train.micro_batch_size,
            grad_clip=cfg.optim.grad_clip,
            generator=generator,
            progress=lambda done, total: report(f"update {done}/{total} micro-batches"),
        )
    t2 = time.perf_counter()
    metrics |= {"time/rollout": t1 - t0, "time/update": t2 - t1, "time/step": t2 - t0}
    return metrics


async def rollout(
    cfg: Config,
    step: int,
    policy: Policy,
    backend: RolloutBackend,
    workflow: Workflow,
    examples: list[Example],
) -> list[Episode]:
    """`rollout.n` episodes per example, all at once; episode `(i, j)` is seeded by `(seed, step, i, j)`."""
    sampling = SamplingParams(
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        max_new_tokens=cfg.rollout.max_new_tokens,
    )
    tool = None if cfg.rollout.tool == "none" else cfg.rollout.tool

    def context(i: int, j: int) -> Context:
        seed = derive_seed(cfg.run.seed, step, i, j)
        route_of, tokenizer, calls = policy.route_of, policy.tokenizer, cfg.rollout.max_tool_calls
        return Context(backend, tokenizer, route_of, sampling, seed, tool=tool, max_tool_calls=calls)

    runs = [workflow.run(context(i, j), ex) for i, ex in enumerate(examples) for j in range(cfg.rollout.n)]
    if isinstance(backend, LockstepBackend):
        runs = [backend.episode(run) for run in runs]
    return list(await asyncio.gather(*runs))


def turn_rewards(
    episodes: Sequence[Episode], group_key: str
) -> tuple[list[Turn], torch.Tensor, list[Hashable]]:
    """Every turn with its reward (the role's reward if the workflow set one, else the episode's) and its
    advantage group key: `task`, `(task, role)` or `(task, role, k)` for the k-th call of that role."""
    turns, rewards, keys = [], [], []
    for ep in episodes:
        seen: Counter[str] = Counter()
        for turn in ep.turns:
            turns.append(turn)
            rewards.append(ep.role_rewards.get(turn.role, ep.reward))
            if group_key == "task":
                keys.append(ep.task_id)
            elif group_key == "role":
                keys.append((ep.task_id, turn.role))
            else:
                keys.append((ep.task_id, turn.role, seen[turn.role]))
            seen[turn.role] += 1
    return turns, torch.tensor(rewards, dtype=torch.float64), keys


def episode_metrics(episodes: Sequence[Episode], policy: Policy) -> dict[str, float]:
    """Rewards, accuracy, lengths, tools and per-role counts of a step's episodes."""
    rewards = torch.tensor([e.reward for e in episodes], dtype=torch.float64)
    turns = [t for e in episodes for t in e.turns]
    calls = [c for t in turns for c in t.tool_calls]
    out = {
        "reward/mean": float(rewards.mean()) if len(rewards) else math.nan,
        "reward/std": float(rewards.std()) if len(rewards) > 1 else 0.0,
        "accuracy": sum(_correct(e) for e in episodes) / max(len(episodes), 1),
        "episodes": float(len(episodes)),
        "response_length/mean": sum(len(t.completion_ids) for t in turns) / max(len(turns), 1),
        "truncated_frac": sum(t.finish_reason == "length" for t in turns) / max(len(turns), 1),
        "tools/calls": float(len(calls)),
        "tools/errors": float(sum(c.error for c in calls)),  # the code failed, or the tool did
        "tools/error_rate": sum(c.error for c in calls) / len(calls) if calls else 0.0,
        "tools/failures": float(sum(c.tool_failed for c in calls)),  # the tool itself failed
        "tools/timeouts": float(sum(c.timed_out for c in calls)),
    }
    for role in policy.route_of:
        mine = [t for t in turns if t.role == role]
        out[f"role/{role}/turns"] = float(len(mine))
        rewards_of = [e.role_rewards.get(role, e.reward) for e in episodes for t in e.turns if t.role == role]
        if rewards_of:
            out[f"role/{role}/reward_mean"] = sum(rewards_of) / len(rewards_of)
        out[f"role/{role}/tokens"] = float(sum(k in POLICY_KINDS for t in mine for k in t.kinds))
        acted = [e for e in episodes if any(t.role == role for t in e.turns)]
        if acted:  # the outcome of the episodes the role took part in
            out[f"role/{role}/accuracy"] = sum(_correct(e) for e in acted) / len(acted)
    kinds = Counter(k for t in turns for k in t.kinds)
    for kind in KINDS:
        if kind != PROMPT:
            out[f"kind/{kind}/tokens"] = float(kinds[kind])
    return out


def _correct(episode: Episode) -> bool:
    return bool(episode.metadata.get("correct", episode.reward >= 1.0))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _engine(cfg: Config, policy: Policy) -> Engine:
    """The rollout engine with the run's tool, started now: a tool that cannot work on this machine (the
    sandbox without root, say) fails here with its own error, before any step."""
    from rolerl.tools import build_tools

    tools = build_tools([] if cfg.rollout.tool == "none" else [cfg.rollout.tool])
    return Engine(
        policy.model, policy.tokenizer, max_batch=cfg.rollout.max_batch, max_len=cfg.rollout.max_len,
        tools=tools,
    )  # fmt: skip


def _pad_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
