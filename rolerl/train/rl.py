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
import math
import random
import time
from collections import Counter
from collections.abc import Hashable, Sequence
from pathlib import Path

import numpy as np
import torch

from rolerl.algorithms import ADVANTAGES, zero_variance_mask
from rolerl.config import Config
from rolerl.progress import ProgressBar
from rolerl.rollout.engine import Engine
from rolerl.rollout.lockstep import LockstepBackend
from rolerl.rollout.sampling import SamplingParams
from rolerl.rollout.scheduler import EngineBackend, RolloutBackend
from rolerl.tasks import TASKS, Example, Task
from rolerl.train.checkpoint import RunDir, checkpoints, clean_partial, load_checkpoint, save_checkpoint
from rolerl.train.policy import Policy, build_policy
from rolerl.train.update import LossSettings, lr_factor, ppo_update
from rolerl.types import Episode, Turn, collate
from rolerl.workflows import WORKFLOWS, Context, Workflow, derive_seed


def train(
    cfg: Config,
    *,
    task: Task | None = None,
    workflow: Workflow | None = None,
    policy: Policy | None = None,
    resume: bool = False,
    stop_after: int | None = None,
) -> Path:
    """Run `cfg.train.steps` steps (continuing from the newest checkpoint of `cfg.run.dir` if `resume`).

    `task`/`workflow` override the config's registry names and `policy` the model the config names
    (tests, notebooks: `build_policy(cfg, workflow.roles)`). `stop_after` ends the run after that step,
    as an interruption would. Returns the run directory.
    """
    task = task if task is not None else TASKS[cfg.task.name]()
    workflow = workflow if workflow is not None else WORKFLOWS[cfg.task.workflow](task)
    policy = policy if policy is not None else build_policy(cfg, workflow.roles)
    params = policy.trainable()
    optimizer = torch.optim.AdamW(
        params, lr=cfg.optim.lr, betas=tuple(cfg.optim.betas), weight_decay=cfg.optim.weight_decay
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, cfg.train.steps, cfg.optim)
    )
    run_dir = Path(cfg.run.dir)
    if not resume and ((run_dir / "metrics.jsonl").exists() or checkpoints(run_dir)):
        raise ValueError(
            f"run.dir={str(run_dir)!r} already holds a run; continue it with --resume {run_dir} "
            "or choose another run.dir"
        )
    start = 0
    seed_everything(cfg.run.seed)  # nothing here draws from global RNGs by design; code we call might
    if resume:
        clean_partial(cfg.run.dir)
        found = checkpoints(cfg.run.dir)
        if not found:
            raise FileNotFoundError(f"--resume {cfg.run.dir!r}: no checkpoints/step_N in that run directory")
        state = load_checkpoint(found[-1][1], policy.model, policy.adapter_names, optimizer, scheduler)
        start = state["step"]  # RNG states restored too
    run = RunDir(cfg.run.dir, tensorboard=cfg.run.tensorboard, resume_step=start if resume else None)
    run.write_config(cfg)
    engine = _engine(cfg, policy)
    backend = LockstepBackend(engine) if cfg.rollout.backend == "lockstep" else EngineBackend(engine)
    last = min(cfg.train.steps, stop_after) if stop_after is not None else cfg.train.steps
    try:
        with ProgressBar("train", cfg.train.steps, completed=start, enabled=cfg.run.progress) as bar:
            for step in range(start + 1, last + 1):
                metrics = train_step(cfg, step, policy, params, optimizer, backend, task, workflow)
                metrics["lr"] = scheduler.get_last_lr()[0]
                scheduler.step()  # the schedule counts training steps, not optimizer steps (PAPERS 1.5)
                run.log(metrics)
                if step % cfg.run.checkpoint_every == 0 or step == cfg.train.steps:
                    save_checkpoint(
                        cfg.run.dir,
                        step,
                        policy.model,
                        policy.adapter_names,
                        optimizer,
                        scheduler,
                        keep_last=cfg.run.keep_last,
                    )
                bar.update(step, f"reward {metrics['reward/mean']:.3f} acc {metrics['accuracy']:.2f}")
    finally:
        backend.close()
        for tool in engine.tools.values():  # e.g. the sandbox's worker processes
            getattr(tool, "close", lambda: None)()
        run.close()
    return Path(cfg.run.dir)


def train_step(
    cfg: Config,
    step: int,
    policy: Policy,
    params: Sequence[torch.nn.Parameter],
    optimizer: torch.optim.Optimizer,
    backend: RolloutBackend,
    task: Task,
    workflow: Workflow,
) -> dict[str, float]:
    """One RL step; returns its flat metrics dict."""
    t0 = time.perf_counter()
    # 1. tasks, and n episodes of each through the workflow, all concurrently (one batched engine)
    examples = task.examples(
        cfg.task.split, cfg.train.tasks_per_step, derive_seed(cfg.run.seed, "tasks", step)
    )
    episodes = asyncio.run(rollout(cfg, step, policy, backend, workflow, examples))
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
        ).to(policy.device)
        settings = LossSettings(
            algorithm=cfg.algorithm,
            temperature=cfg.rollout.temperature,
            horizon=cfg.rollout.max_new_tokens,
            chunk_size=cfg.train.logprob_chunk,
            bf16=cfg.train.bf16,
            share_prefix=cfg.train.share_prefix,
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
        "accuracy": sum(bool(e.metadata.get("correct", e.reward >= 1.0)) for e in episodes)
        / max(len(episodes), 1),
        "episodes": float(len(episodes)),
        "response_length/mean": sum(len(t.completion_ids) for t in turns) / max(len(turns), 1),
        "truncated_frac": sum(t.finish_reason == "length" for t in turns) / max(len(turns), 1),
        "tools/calls": float(len(calls)),
        "tools/errors": float(sum(c.error for c in calls)),
        "tools/timeouts": float(sum(c.timed_out for c in calls)),
    }
    for role in policy.route_of:
        mine = [t for t in turns if t.role == role]
        out[f"role/{role}/turns"] = float(len(mine))
        rewards_of = [e.role_rewards.get(role, e.reward) for e in episodes for t in e.turns if t.role == role]
        if rewards_of:
            out[f"role/{role}/reward_mean"] = sum(rewards_of) / len(rewards_of)
        out[f"role/{role}/tokens"] = float(sum(k != "tool_output" for t in mine for k in t.kinds))
    return out


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _engine(cfg: Config, policy: Policy) -> Engine:
    tools = {}
    if cfg.rollout.tool == "python":
        from rolerl.tools.python_sandbox import PythonSandbox

        tools["python"] = PythonSandbox()
    return Engine(policy.model, policy.tokenizer, max_batch=cfg.rollout.max_batch, tools=tools)


def _pad_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
