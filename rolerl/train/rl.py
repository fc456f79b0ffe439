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
import dataclasses
import functools
import logging
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rolerl.algorithms import zero_variance_mask
from rolerl.config import Config, ConfigError, load_config
from rolerl.eval.harness import held_out
from rolerl.hardware import bf16_choice
from rolerl.heap import keep_freed_memory
from rolerl.progress import ProgressBar
from rolerl.rollout.engine import Engine
from rolerl.rollout.lockstep import LockstepBackend
from rolerl.rollout.sampling import SamplingParams
from rolerl.rollout.scheduler import EngineBackend, ModelRouter, RolloutBackend
from rolerl.rollout.vllm_checks import resolve_backend
from rolerl.run.engines import build_engines, role_calls
from rolerl.run.policy import Policy, build_policy, resolve_device
from rolerl.signals import Terminated, sigterm_raises, stopping
from rolerl.tasks import Example, Task, load_task
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
from rolerl.train.credit import advantages_of, turn_rewards
from rolerl.train.distributed import SINGLE, Dist, RankFailure, fault_point, init_from_env
from rolerl.train.distributed import close as close_dist
from rolerl.train.grad_conflict import role_gradients
from rolerl.train.monitor import ToolHealth, episode_metrics, sampled_tokens, ticker
from rolerl.train.optim import Optimizer, lr_factor, policy_optimizer
from rolerl.train.pipeline import RolloutPipeline, RolloutThreadError, staleness, stamp_versions
from rolerl.train.update import LossSettings, Part, Schedule, ppo_update
from rolerl.types import Episode, Turn, collate
from rolerl.workflows import Context, Workflow, derive_seed, load_workflow
from rolerl.workflows.base import workflow_name

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
    larger `train.steps` follows the longer schedule from its next step on. Ctrl-C, SIGTERM (or an
    error) checkpoints the last completed step first; Ctrl-C and SIGTERM then raise `TrainingInterrupted`.
    `stop_after` ends the run after that step, as a kill would (no extra checkpoint). Returns the run
    directory.

    Under torchrun (`WORLD_SIZE` > 1) each process is one data-parallel rank (`rolerl.train.distributed`):
    the run, its metrics and its checkpoints are those of one process on the same global batch, and rank
    0 writes them. A collective that fails (another rank died or hung) raises `RankFailure`, which names
    the `--resume` command (docs/DISTRIBUTED.md "When a rank fails").
    """
    if resume and overwrite:
        raise ValueError("resume and overwrite exclude each other: continue the run, or replace it")
    cuda = resolve_device(cfg.model.device).type == "cuda"
    dist = init_from_env(cuda=cuda, timeout_s=cfg.train.dist_timeout_s)
    ok = False
    try:
        # torchrun stops the ranks left after one failed with SIGTERM
        with sigterm_raises(keep_after_error=dist.active):
            out = _train(cfg, dist, task, workflow, policy, resume, overwrite, stop_after)
        ok = True
        return out
    finally:
        close_dist(dist, ok)


def _train(
    cfg: Config,
    dist: Dist,
    task: Task | None,
    workflow: Workflow | None,
    policy: Policy | None,
    resume: bool,
    overwrite: bool,
    stop_after: int | None,
) -> Path:
    if not resume and dist.main:
        prepare_run_dir(cfg.run.dir, "train", overwrite=overwrite)
    dist.barrier()  # the others start once rank 0 has checked the directory
    task = task if task is not None else load_task(cfg.task.name, cfg.task.data)
    if cfg.task.max_difficulty is not None:
        from rolerl.tasks.math import at_most

        task = at_most(task, cfg.task.split, cfg.task.max_difficulty)
        log.info(f"task.max_difficulty={cfg.task.max_difficulty}: RL draws {len(task.pool)} of the "
                 f"{task.total} {cfg.task.name}/{cfg.task.split} problems ({task.about})")  # fmt: skip
    workflow = (
        workflow
        if workflow is not None
        else load_workflow(cfg.task.workflow, task, cfg.task.workflow_options)
    )
    policy = policy if policy is not None else build_policy(cfg, workflow.roles)
    check_roles(cfg, list(policy.route_of))
    if cfg.train.heap == "keep":
        keep_freed_memory()  # every update reuses the pages of the one before (rolerl.heap)
    given = cfg  # written as the user gave it: a resume resolves its `auto`s again on its own machine
    cfg, why = resolve_backend(cfg, policy)
    if given.rollout.backend == "auto":
        log.info(why)
    cfg, why = resolve_old_logp(cfg, policy)
    if given.algorithm.old_logp == "auto":
        log.info(why)
    params = policy.trainable()
    optimizer = policy_optimizer(policy, cfg.optim)
    seed_everything(cfg.run.seed)  # nothing here draws from global RNGs by design; code we call might
    start, versions = _restore(cfg, policy, optimizer, dist) if resume else (0, None)  # RNG states too
    dist.broadcast(params)  # the ranks start from rank 0's adapters (seeded alike; this makes sure)
    evaluation = _held_out_set(cfg, task) if cfg.eval.every else None
    if cfg.train.max_staleness and dist.active:
        raise ConfigError("train.max_staleness runs in one process for now; run it without torchrun")
    # before any write: a tool that cannot work here stops the run now; asynchronous training samples from
    # a copy (the trainer updates while it samples) and evaluates through engines over the trainer's model
    engines = _engines(cfg, policy, copy=bool(cfg.train.max_staleness))
    scorers = _engines(cfg, policy) if cfg.train.max_staleness and evaluation is not None else engines
    run = RunDir(
        cfg.run.dir,
        tensorboard=cfg.run.tensorboard,
        resume_step=start if resume else None,
        wandb=cfg.run.wandb,
        wandb_entity=cfg.run.wandb_entity,
    ) if dist.main else _NoRun()  # fmt: skip
    run.write_config(given)
    health = ToolHealth()
    backend = _backend(cfg, engines, policy)
    backend.sync(policy)  # a backend with its own copy of the weights (vLLM) serves the current adapters
    last = min(cfg.train.steps, stop_after) if stop_after is not None else cfg.train.steps
    pipeline = None
    if cfg.train.async_lag:  # rollouts in a background thread, up to max_staleness steps behind
        generate = functools.partial(
            rollout_step, cfg, policy=policy, backend=backend, task=task, workflow=workflow
        )
        pipeline = RolloutPipeline(
            backend, policy, optimizer.steps, generate, lag=cfg.train.async_lag, start=start, last=last,
            resumed=versions, partial=cfg.train.partial_rollouts,
        )  # fmt: skip
    done = Completed(start, saved=start)
    undo = StepUndo(params, optimizer)
    try:
        progress = cfg.run.progress and dist.main
        with ProgressBar("train", cfg.train.steps, completed=start, enabled=progress) as bar:
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
                    dist=dist,
                    pipeline=pipeline,
                )
                metrics["lr"] = lr
                if evaluation is not None and (step % cfg.eval.every == 0 or step == cfg.train.steps):
                    report("evaluating on held-out examples")
                    # through vLLM too when it samples the rollouts (it serves the adapters just synced; under
                    # train.max_staleness it serves older ones, and the scorers hold the trainer's own)
                    via = backend if cfg.rollout.backend == "vllm" and pipeline is None else None
                    scores = held_out(cfg, policy, scorers, *evaluation, step, dist=dist, backend=via)
                    metrics |= {f"eval/{k}": v for k, v in scores.items()}
                run.log(metrics)
                done.complete(step, lr)
                undo.disarm()
                if step % cfg.run.checkpoint_every == 0 or step == cfg.train.steps:
                    _checkpoint(cfg, policy, optimizer, done, dist, pipeline)
                bar.update(step, f"reward {metrics['reward/mean']:.3f} acc {metrics['accuracy']:.2f}")
    except BaseException as e:
        stopping()  # a SIGTERM from now on must not cut short the checkpoint below or the report
        _checkpoint_on_error(cfg, policy, optimizer, done, undo, dist, pipeline)
        if isinstance(e, RankFailure):  # say how to go on: the newest complete checkpoint is always safe
            kept = f"step {done.saved} is checkpointed" if done.saved else "no step is checkpointed"
            raise RankFailure(
                f"{e}; {kept}; continue from the last complete checkpoint with rolerl train --resume "
                f"{cfg.run.dir} (launched by torchrun, as this run was)"
            ) from e
        if isinstance(e, RolloutThreadError):  # asynchronous training: say how to go on, as above
            kept = f"step {done.saved} is checkpointed" if done.saved else "no step is checkpointed"
            raise RolloutThreadError(f"{e}; {kept}; continue with rolerl train --resume {cfg.run.dir}") from e
        if isinstance(e, KeyboardInterrupt) and not isinstance(e, TrainingInterrupted):
            why = "interrupted"
            if isinstance(e, Terminated):  # under torchrun: another rank failed (its error says why)
                why = "stopped by SIGTERM" + (
                    " (torchrun sends it to the other ranks when one fails: see that rank's error)"
                    if dist.active
                    else ""
                )
            raise TrainingInterrupted(done.step + 1, done.saved, cfg.run.dir, why) from e
        raise
    finally:
        undo.close()
        if pipeline is not None:
            pipeline.close()
        backend.close()
        for engine in {id(e): e for e in [*engines.values(), *scorers.values()]}.values():
            for tool in engine.tools.values():  # e.g. the sandbox's worker processes
                getattr(tool, "close", lambda: None)()
        run.close()
    return Path(cfg.run.dir)


def _lr(cfg: Config, step: int) -> float:
    """The lr of (1-based) training `step`: a pure function of the config, so a resumed run, and one
    extended by a larger `train.steps`, uses the schedule of a fresh run of its length from there on."""
    return cfg.optim.lr * lr_factor(step - 1, cfg.train.steps, cfg.optim)


def _set_lr(optimizer: Optimizer, cfg: Config, step: int) -> float:
    """Every adapter's lr for `step` (its peak x the schedule); returns `optim.lr`'s (the logged `lr`).
    Under either step policy the schedule advances once per training step, however many optimizer steps
    an adapter takes in it."""
    optimizer.set_lr(lr_factor(step - 1, cfg.train.steps, cfg.optim))
    return _lr(cfg, step)


def _checkpoint(
    cfg: Config,
    policy: Policy,
    optimizer: Optimizer,
    done: Completed,
    dist: Dist = SINGLE,
    pipeline: RolloutPipeline | None = None,
) -> None:
    """Rank 0 writes (every rank holds the same adapters and optimizer state); the others wait for it, so
    a checkpoint a step reports exists once any rank goes on. With a `pipeline`, the adapter versions the
    next rollouts sample are kept too (a resumed run then equals the uninterrupted one)."""
    if dist.main:
        extra = {"train_steps": cfg.train.steps, "lr": done.lr}  # what `_restore` says when a run is extended
        rollout = pipeline.state(done.step) if pipeline is not None else None
        save_checkpoint(
            cfg.run.dir, done.step, policy.adapter_models(), optimizer,
            keep_last=cfg.run.keep_last, extra=extra, rng=done.rng, rollout=rollout,
        )  # fmt: skip
        done.saved = done.step
    dist.barrier()
    done.saved = done.step  # the other ranks: only once rank 0 says the write is complete


def _checkpoint_on_error(
    cfg: Config,
    policy: Policy,
    optimizer: Optimizer,
    done: Completed,
    undo: StepUndo,
    dist: Dist = SINGLE,
    pipeline: RolloutPipeline | None = None,
) -> None:
    """Checkpoint the last completed step if it is not yet, undoing a cut-short update first. Never
    raises: the error that got us here is the one to report. Under torchrun only rank 0 writes, and no
    rank waits for another (a failed rank would never arrive)."""
    if done.step <= done.saved or not dist.main:
        return
    try:
        undo.undo()
        _checkpoint(cfg, policy, optimizer, done, pipeline=pipeline)
        log.warning("stopped during step %d: checkpointed step %d", done.step + 1, done.step)
    except Exception as e:  # e.g. the disk is full: keep the older checkpoint
        log.warning("could not checkpoint step %d on the way out (%s)", done.step, e)


def _restore(
    cfg: Config, policy: Policy, optimizer: Optimizer, dist: Dist = SINGLE
) -> tuple[int, dict[str, Any] | None]:
    """Load the newest readable checkpoint and return its step and the adapter versions an asynchronous run
    kept with it (`RolloutPipeline.state`; None otherwise); step 0 (start again) for a run that stopped
    before its first checkpoint. Every rank reads the same checkpoint (any number of ranks may resume a
    run written by any number); rank 0 clears partial writes first."""
    if dist.main:
        clean_partial(cfg.run.dir)
    dist.barrier()
    state = load_newest(cfg.run.dir, policy.adapter_models(), optimizer)
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
        return 0, None
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
    return start, state.get("rollout")


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
    optimizer: Optimizer,
    backend: RolloutBackend,
    task: Task,
    workflow: Workflow,
    report: Callable[[str], None] | None = None,
    health: ToolHealth | None = None,
    dist: Dist = SINGLE,
    pipeline: RolloutPipeline | None = None,
) -> dict[str, float]:
    """One RL step; returns its flat metrics dict. `report` receives a short progress text now and then
    (rollout tokens, update micro-batches) for a progress bar. Under data parallelism (`dist`) this rank
    rolls out its own tasks, every rank sees every episode, and the update computes this rank's rows.
    With a `pipeline` (`train.max_staleness` >= 1) the step's episodes come from its background thread,
    and the updated adapters are published to it instead of synced to the backend."""
    report = report or (lambda text: None)
    t0 = time.perf_counter()
    # 1. tasks, and n episodes of each through the workflow, all concurrently (one batched engine per model)
    if pipeline is None:
        stamp_versions(backend, policy, optimizer.steps)  # each token records its adapter's version
        before = sampled_tokens(backend)
        with ticker(lambda: report(f"rollout: {sampled_tokens(backend) - before} tokens sampled")):
            episodes = rollout_step(cfg, step, policy, backend, task, workflow, dist)
        backend.sleep()  # the update's activations may take the memory only sampling needed
    else:
        report("waiting for the rollout thread")
        episodes = pipeline.episodes(step)
    if health is not None:
        health.check(step, episodes)
    t1 = time.perf_counter()
    # 2. rewards (the credit rule) -> advantages over the configured groups, each episode counted once
    credit = turn_rewards(episodes, cfg.algorithm)
    turns, rewards, keys = credit.turns, credit.rewards, credit.keys
    own = [dist.owns(e // cfg.rollout.n) for e, ep in enumerate(episodes) for _ in ep.turns]  # as `turns`
    metrics: dict[str, float] = {"step": step} | episode_metrics(episodes, policy, workflow_name(workflow))
    keep = list(range(len(turns)))
    ages, stale = staleness(turns, policy, optimizer.steps, cfg.train.max_staleness)
    metrics |= ages
    if pipeline is not None:  # tokens too far behind their own adapter carry no loss
        keep = sorted(set(keep) - set(stale))
        metrics["async/dropped_turns"] = float(len(stale))
    if cfg.algorithm.filter_zero_variance and turns:
        flat = zero_variance_mask(rewards, keys)
        keep = [i for i in keep if not bool(flat[i])]
        metrics["filtered/zero_variance_frac"] = 1.0 - len(keep) / len(turns)
    advantages = advantages_of(cfg.algorithm, credit) if turns else rewards
    metrics["advantage/abs_mean"] = float(advantages.abs().mean()) if turns else 0.0
    # 3. collate per model and update the adapters
    if keep:
        owned = [own[i] for i in keep] if dist.active else None
        parts = collate_parts(policy, [turns[i] for i in keep], [float(advantages[i]) for i in keep], owned)
        settings = loss_settings(cfg, policy)
        fault_point("update", step)  # test-only: a rank killed mid-step (tests/train/test_faults.py)
        if cfg.diagnostics.grad_every and step % cfg.diagnostics.grad_every == 0:
            metrics |= role_gradients(
                parts, settings, optimizer, cfg.train.micro_batch_size, cfg.diagnostics.grad_groups, dist
            )
        generator = torch.Generator().manual_seed(derive_seed(cfg.run.seed, "shuffle", step))
        # The model stays in eval mode: RL wants no dropout (the rollout had none), and train mode makes HF
        # run p=0 dropout kernels over attention weights (measured ~30% slower fwd+bwd on CPU).
        metrics |= ppo_update(
            parts,
            optimizer,
            settings,
            schedule(cfg),
            micro_batch_size=cfg.train.micro_batch_size,
            generator=generator,
            progress=lambda done, total: report(f"update {done}/{total} micro-batches"),
            dist=dist,
        )
        if pipeline is None:
            metrics |= backend.sync(policy)  # the next rollout samples from the updated adapters
    if pipeline is not None:  # every step, trained or not: the rollout thread waits for each version
        metrics |= pipeline.publish(step, policy, optimizer.steps)
    t2 = time.perf_counter()
    metrics |= {"time/rollout": t1 - t0, "time/update": t2 - t1, "time/step": t2 - t0}
    return metrics


def rollout_step(
    cfg: Config,
    step: int,
    policy: Policy,
    backend: RolloutBackend,
    task: Task,
    workflow: Workflow,
    dist: Dist = SINGLE,
) -> list[Episode]:
    """Step `step`'s tasks (a pure function of the seed and the step) and their episodes, every rank's."""
    examples = task.examples(
        cfg.task.split, cfg.train.tasks_per_step, derive_seed(cfg.run.seed, "tasks", step)
    )
    mine = asyncio.run(rollout(cfg, step, policy, backend, workflow, examples, dist))
    return dist.interleave(mine, len(examples), cfg.rollout.n)  # every rank: the whole step, in order


def schedule(cfg: Config) -> Schedule:
    t = cfg.train
    return Schedule(
        ppo_epochs=t.ppo_epochs, mini_batches=t.mini_batches, mini_batch_size=t.mini_batch_size,
        by_role=t.mini_batch_by == "role", merged=t.step_policy == "merged",
    )  # fmt: skip


def loss_settings(cfg: Config, policy: Policy) -> LossSettings:
    """What the update needs from the config: the algorithm, the rollout's temperature, per-role
    coefficients and loss weights."""
    roles = cfg.roles
    return LossSettings(
        algorithm=resolve_old_logp(cfg, policy)[0].algorithm,
        temperature=cfg.rollout.temperature,
        # seq-mean-token-sum-norm's constant: the longest response any role may sample
        horizon=max(
            [cfg.rollout.max_new_tokens, *(c.max_new_tokens for c in roles.values() if c.max_new_tokens)]
        ),
        chunk_size=cfg.train.chunk_size,
        bf16=policy.bf16,
        share_prefix=cfg.train.share_prefix,
        skip_inert=cfg.train.skip_inert_rows,
        isolation=cfg.adapters.isolation,
        role_beta={r: c.beta for r, c in roles.items() if c.beta is not None},
        role_entropy={r: c.entropy_coef for r, c in roles.items() if c.entropy_coef is not None},
        loss_weight={r: c.loss_weight for r, c in roles.items() if c.loss_weight != 1.0},
    )


def collate_parts(
    policy: Policy, turns: Sequence[Turn], advantages: Sequence[float], owned: Sequence[bool] | None = None
) -> list[Part]:
    """One `Part` per model: its roles' turns padded into a `TrainBatch` on the policy's device. `owned`
    (data parallelism): which turns this rank computes."""
    role_names = list(policy.route_of)
    parts = []
    for name, member in policy.members.items():
        mine = [i for i, t in enumerate(turns) if policy.topology.model(t.role) == name]
        if not mine:
            continue
        batch = collate(
            [turns[i] for i in mine],
            [advantages[i] for i in mine],
            policy.route_of,
            role_names=role_names,
            pad_id=_pad_id(member.tokenizer),
            loss_kinds={role: policy.topology.loss_kinds(role) for role in role_names},
        ).to(policy.device)
        if any(g.model == name for g in policy.groups):  # else every adapter of the model is frozen
            rows = None if owned is None else [k for k, i in enumerate(mine) if owned[i]]
            parts.append(Part.of(member.model, batch, rows))
    return parts


def check_roles(cfg: Config, roles: Sequence[str]) -> None:
    """`algorithm.role_share` as a mapping needs a weight for every role of the workflow."""
    share = cfg.algorithm.role_share
    if isinstance(share, dict):
        missing = [r for r in roles if r not in share]
        unknown = sorted(set(share) - set(roles))
        if missing or unknown:
            raise ConfigError(
                f"algorithm.role_share={share}: "
                + (f"no weight for roles {missing}" if missing else f"unknown roles {unknown}")
                + f"; the workflow's roles are {list(roles)}"
            )


async def rollout(
    cfg: Config,
    step: int,
    policy: Policy,
    backend: RolloutBackend,
    workflow: Workflow,
    examples: list[Example],
    dist: Dist = SINGLE,
) -> list[Episode]:
    """`rollout.n` episodes per example, all at once; episode `(i, j)` is seeded by `(seed, step, i, j)`.
    Under data parallelism, only the examples this rank owns (`Dist.owns`), in order."""
    sampling = SamplingParams(
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        max_new_tokens=cfg.rollout.max_new_tokens,
    )
    tool = None if cfg.rollout.tool == "none" else cfg.rollout.tool
    calls = role_calls(cfg, policy)
    main = next(iter(policy.members.values()))

    def context(i: int, j: int) -> Context:
        seed = derive_seed(cfg.run.seed, step, i, j)
        route_of, n_calls = policy.route_of, cfg.rollout.max_tool_calls
        return Context(
            backend, main.tokenizer, route_of, sampling, seed, tool=tool, max_tool_calls=n_calls, roles=calls
        )

    runs = [backend.episode(workflow.run(context(i, j), ex))
            for i, ex in enumerate(examples) if dist.owns(i) for j in range(cfg.rollout.n)]  # fmt: skip
    return list(await asyncio.gather(*runs))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _held_out_set(cfg: Config, task: Task) -> tuple[Task, Workflow, list[Example]]:
    """`eval.task` (default: the training task), its workflow and `eval.limit` examples of `eval.split`."""
    held = load_task(cfg.eval.task, cfg.eval.data) if cfg.eval.task else task
    if held is task and cfg.eval.split == cfg.task.split:
        raise ConfigError(
            f"eval.split={cfg.eval.split!r} is the training split (task.split): evaluate on held-out examples"
        )
    examples = held.examples(cfg.eval.split, cfg.eval.limit, derive_seed(cfg.run.seed, "eval"))
    return held, load_workflow(cfg.task.workflow, held, cfg.task.workflow_options), examples


def _engines(cfg: Config, policy: Policy, copy: bool = False) -> dict[str, Engine]:
    """One rollout engine per model, with the run's tool, started now: a tool that cannot work on this
    machine (the sandbox without root, say) fails here with its own error, before any step. `copy`: over
    a copy of the model (`build_engines`)."""
    options = dict(cfg.rollout.tool_options) if cfg.rollout.tool_options else {}
    return build_engines(
        cfg, policy, cfg.rollout.tool, options, cfg.rollout.max_batch, cfg.rollout.max_len, copy=copy
    )


def resolve_old_logp(cfg: Config, policy: Policy) -> tuple[Config, str]:
    """`cfg` with `algorithm.old_logp: auto` resolved, and why. `recompute` where the rollout's log-probs come
    from other arithmetic than the trainer's forward: vLLM's kernels, bf16 autocast in training, a rollout
    copy in another dtype (`rollout.dtype`); else `rollout`: the engine runs the trainer's own weights in
    their dtype, so its log-probs equal the recompute up to kernel rounding (~1e-5 in fp32) and the update
    saves a forward over every row. `tis_cap` applies only where that resolves to `recompute`."""
    alg = cfg.algorithm
    if alg.old_logp != "auto":
        return cfg, f"algorithm.old_logp={alg.old_logp}"
    cfg = resolve_backend(cfg, policy)[
        0
    ]  # rollout.backend: auto (callers outside `train` pass it unresolved)
    weights = {next(m.model.parameters()).dtype for m in policy.members.values()}
    name = cfg.rollout.dtype
    if name == "auto":
        name = "bfloat16" if bf16_choice(policy.device)[0] else "model"
    if cfg.train.max_staleness:
        mode, why = "recompute", "asynchronous rollouts sample from older adapters (decoupled PPO)"
    elif cfg.rollout.backend == "vllm":
        mode, why = "recompute", "vLLM samples with its own kernels"
    elif policy.bf16:
        mode, why = "recompute", "training autocasts to bf16, the rollout does not"
    elif name != "model" and weights != {getattr(torch, name)}:
        mode, why = (
            "recompute",
            f"the rollout samples from a {name} copy of the {sorted(map(str, weights))} weights",
        )
    else:
        mode, why = "rollout", "the rollout samples from the trainer's own weights with the same arithmetic"
    resolved = dataclasses.replace(alg, old_logp=mode, tis_cap=alg.tis_cap if mode == "recompute" else None)
    return dataclasses.replace(cfg, algorithm=resolved), f"algorithm.old_logp=auto -> {mode}: {why}"


def _backend(cfg: Config, engines: dict[str, Engine], policy: Policy) -> RolloutBackend:
    if cfg.rollout.backend == "vllm":
        from rolerl.rollout.vllm_backend import build_vllm_backend

        # under train.max_staleness the engines sample from copies: vLLM loads each version into them too
        replicas = {name: e.model for name, e in engines.items() if e.source is not None}
        return build_vllm_backend(
            cfg, policy, {name: e.tools for name, e in engines.items()}, replicas=replicas
        )
    if cfg.rollout.backend == "lockstep":
        return LockstepBackend(engines)
    if len(engines) == 1:
        return EngineBackend(next(iter(engines.values())))
    return ModelRouter({name: EngineBackend(engine) for name, engine in engines.items()})


class _NoRun:
    """What ranks other than 0 log to: nothing (rank 0 writes the run's files)."""

    def write_config(self, cfg: Config) -> None:
        pass

    def log(self, metrics: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


def _pad_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
