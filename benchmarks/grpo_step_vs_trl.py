"""One GRPO step, rolerl vs TRL's `GRPOTrainer`: the same work on both sides, time and peak RSS.

A step = sample 2 prompts x 8 completions of exactly `--max-new-tokens` tokens (temperature 1, top-p 1,
top-k 0), reward them, advantages normalised by each group's std, then ONE optimizer update over the 16
completions (PPO clip 0.2/0.28 with old log-probs = the current ones, so no extra forward; KL k3 to the
adapter-free model when beta > 0; loss = token-mean over all 16 completions), AdamW (lr 1e-5, weight
decay 0.01, betas 0.9/0.999, torch's own implementation), gradient clipping at 1.0.

Settings, side by side:
  model        `--model` ("default" = SmolLM2-135M-Instruct via `rolerl.load_model`, or "tiny:llama" for a
               smoke run); both sides load it the same way (`rolerl.load_model` / `rolerl.tiny_model`) and
               TRL gets the model object. float32 weights on both sides, except in `--mode bf16-base`.
  precision    `--mode fp32`: no autocast on either side (TRL bf16=False, fp16=False; rolerl train.bf16=false,
               set explicitly: its default "auto" autocasts where bf16 is native). `--mode bf16`: TRL
               bf16=True (its mixed precision) and rolerl train.bf16=true (bf16 autocast of the training
               forward); both sample as they do by default. `--mode fastest`: TRL bf16=True (its fastest
               supported CPU mode without vLLM) against rolerl's fastest honest mode: the engine samples
               from a bf16 copy (rollout.dtype=bfloat16), bf16 autocast in training, the trainer's old
               log-probs (old_logp=recompute: with one optimizer step per batch, as here, its update's own
               forward gives them, no extra forward) and truncated importance sampling (tis_cap 2).
               `--mode bf16-base`: the frozen base weights in bf16 on both sides (loaded so; the LoRA
               weights stay fp32: PEFT's autocast_adapter_dtype, rolerl's adapters), bf16=True / bf16
               autocast; TRL generates with that model, rolerl's engine samples from it (rollout.dtype=model)
               with the trainer's old log-probs and TIS, as in `fastest`.
  LoRA         r=16, alpha=32, dropout 0, all linear layers of the decoder (lm_head excluded on both).
               rolerl: adapters.rank=16, target_modules=all-linear, preset shared. TRL: peft LoraConfig.
  prompts      rolerl's `ArithmeticTask` chat prompts (system + user, chat template with the generation
               prompt); step s of both sides gets the examples rolerl's `train_step` draws for step s (TRL:
               a dataset of them in that order, shuffle_dataset=False). The prompt digest in the JSON
               confirms it.
  reward       `partial_reward` below on the decoded completion (special tokens dropped), on both sides.
  fixed length rolerl: the workflow passes `ignore_eos=True` to `ctx.generate` (EOS is sampled like any
               token and does not stop the row). TRL: generation_kwargs={"min_new_tokens": N}, which masks
               TRL's EOS ids until N tokens (TRL also cuts a completion at its first EOS after generating,
               so EOS must not be sampled there). Both produce 16 x N completion tokens; the JSON counts them.
  batching     TRL: per_device_train_batch_size=8, gradient_accumulation_steps=2, steps_per_generation=2,
               num_generations=8, num_iterations=1: one trainer step = one generate() of 16 rows and one
               optimizer update over 2 micro-batches of 8; old log-probs are not recomputed (TRL skips them
               when generation and updates are aligned). rolerl: tasks_per_step=2, rollout.n=8,
               micro_batch_size=8, mini_batches=1, ppo_epochs=1, old_logp=rollout (no extra forward).
               `--micro-batch` changes both sides together.
  loss         rolerl algorithm.loss_agg=token-mean; TRL loss_type="dapo" (normalised by the active tokens
               of the whole accumulated batch = token-mean over the 16 completions). rolerl advantage=grpo,
               TRL scale_rewards="group". KL: rolerl algorithm.kl=k3, beta; TRL beta (k3; the reference is
               the PEFT model with the adapter disabled, rolerl's is route -1: neither keeps a second copy).
               TRL computes the reference once per generation batch, rolerl per micro-batch: one reference
               forward per completion on each side. Both compute token entropies (metrics) in the loss.
  not used     TRL activation (gradient) checkpointing: off (TRL's default is on; rolerl does not
               checkpoint; asserted after training), no vLLM, no liger, no logging or saving inside the timed
               steps (logging_strategy=no, report_to=none, save_strategy=no), optim=adamw_torch (rolerl's
               torch.optim.AdamW; TRL's default would be the fused one).
  heap         `--heap keep` (default): both children keep the memory they free (`rolerl.heap.keep_freed_memory`,
               glibc: no trimming; rolerl's training does it with train.heap=keep), so neither re-faults its
               pages every micro-batch; `--heap default`: glibc's defaults on both sides (rolerl
               train.heap=trim).
  timing       each side in its own subprocess with the same environment (OMP/MKL threads, the same
               torch.set_num_threads, TOKENIZERS_PARALLELISM=false); sides alternate; `--warmup` steps are
               dropped, then the median of all timed steps of all rounds. TRL: a TrainerCallback from
               on_step_begin (before generation) to on_step_end (after the optimizer step); rolerl:
               `rolerl.train.rl.train_step` (tasks, rollout, reward, advantages, update). Peak RSS is the
               child's ru_maxrss (model loading included, the same load path on both sides; the TRL child
               also imports trl, datasets, pyarrow and pandas: `*_rss_after_load_mb` shows that share).

    python benchmarks/grpo_step_vs_trl.py --json                       # the full run, betas 0 and 0.04
                                                         # (est. 15-25 min on 2 quiet cores)
    python benchmarks/grpo_step_vs_trl.py --json --mode fastest --betas 0
    python benchmarks/grpo_step_vs_trl.py --json --mode fastest --betas 0 --max-new-tokens 512 --steps 2
    python benchmarks/grpo_step_vs_trl.py --model tiny:llama --steps 2 --warmup 1 --max-new-tokens 16
The last line with --json is one JSON object. TRL is a benchmark-only extra: `pip install -e ".[bench]"`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

GROUP = 8  # completions per prompt (rollout.n / num_generations)
PROMPTS = 2  # prompts per step
LR = 1e-5
SEED = 0


def partial_reward(answer: str, text: str) -> float:
    """1 for the right integer in the answer tags, else partial credit for the format and for the answer's
    digits, plus a continuous term, so groups of 8 rarely tie and advantages are non-zero."""
    from rolerl.tasks.arithmetic import extract_answer, parse_int

    value = parse_int(extract_answer(text))
    if value is not None and value == int(answer):
        return 1.0
    score = 0.2 * ("<answer>" in text) + 0.2 * (value is not None) + 0.2 * (answer in text)
    return score + 0.2 * sum(c.isdigit() for c in text) / max(len(text), 1)


def step_examples(task, step: int) -> list:
    """The examples rolerl's `train_step` draws at `step` (1-based), for TRL's dataset."""
    from rolerl.workflows import derive_seed

    return task.examples("train", PROMPTS, derive_seed(SEED, "tasks", step))


def digest(questions: list[str]) -> str:
    return hashlib.sha1("\n".join(sorted(questions)).encode()).hexdigest()[:12]


def base_dtype(mode: str) -> str:
    """The frozen base weights' dtype on both sides: bfloat16 in `bf16-base` mode, else float32."""
    return "bfloat16" if mode == "bf16-base" else "float32"


def load(model_spec: str, dtype: str = "float32"):
    import torch

    import rolerl

    if model_spec.startswith("tiny:"):
        return rolerl.tiny_model(model_spec.split(":", 1)[1], seed=SEED, dtype=getattr(torch, dtype))
    return rolerl.load_model(model_spec, dtype=dtype, device="cpu")


def rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def trl_child(args: argparse.Namespace, beta: float) -> dict:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rolerl.heap import keep_freed_memory
    from rolerl.tasks.arithmetic import ArithmeticTask

    torch.set_num_threads(args.threads)
    if args.heap == "keep":
        keep_freed_memory()  # the allocator setting rolerl trains with, on this side too
    total = args.warmup + args.steps
    task = ArithmeticTask()
    rows = [
        {"prompt": task.prompt(ex), "answer": ex.answer, "question": ex.question}
        for step in range(1, total + 1)
        for ex in step_examples(task, step)
    ]
    model, tokenizer = load(args.model, base_dtype(args.mode))
    after_load = rss_mb()
    seen: dict = {}  # what the current step's reward function saw

    def reward(completions, answer, question, **_) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        seen.update(questions=sorted(set(question)), rewards=list(map(partial_reward, answer, texts)))
        return seen["rewards"]

    class Timer(TrainerCallback):
        def __init__(self) -> None:
            self.t0, self.times, self.counts = 0.0, [], []

        def on_step_begin(self, *_, **__):
            self.t0 = time.perf_counter()

        def on_step_end(self, *_, **__):
            self.times.append(time.perf_counter() - self.t0)
            self.counts.append(
                {
                    "completions": seen["completions"],
                    "completion_tokens": seen["completion_tokens"],
                    "prompt_tokens": seen["prompt_tokens"],
                    "prompts": digest(seen["questions"]),
                    "reward_std": statistics.pstdev(seen["rewards"]),
                    "threads": torch.get_num_threads(),
                    "rss_mb": round(rss_mb()),
                }
            )

    timer = Timer()
    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(
            output_dir=out,
            per_device_train_batch_size=args.micro_batch,
            gradient_accumulation_steps=GROUP * PROMPTS // args.micro_batch,
            steps_per_generation=GROUP * PROMPTS // args.micro_batch,
            num_generations=GROUP,
            num_iterations=1,
            max_completion_length=args.max_new_tokens,
            generation_kwargs={"min_new_tokens": args.max_new_tokens},
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            beta=beta,
            loss_type="dapo",
            epsilon=0.2,
            epsilon_high=0.28,
            scale_rewards="group",
            learning_rate=LR,
            lr_scheduler_type="constant",
            weight_decay=0.01,
            max_grad_norm=1.0,
            optim="adamw_torch",
            bf16=args.mode != "fp32",  # TRL's mixed precision (autocast); its fastest supported CPU mode
            fp16=False,
            activation_checkpointing=False,  # transformers 5.24's name for gradient_checkpointing
            use_cpu=True,
            max_steps=total,
            shuffle_dataset=False,
            disable_dropout=True,
            seed=SEED,
            logging_strategy="no",
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            log_completions=False,
        )
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=reward,
            args=config,
            train_dataset=Dataset.from_list(rows),
            processing_class=tokenizer,
            peft_config=LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear"),
            callbacks=[timer],
        )
        generate = trainer._generate_and_score_completions

        def counted(batch):  # the tokens TRL actually trains on (masks of the generation batch)
            out = generate(batch)
            seen["completions"] = int(out["completion_mask"].shape[0])
            seen["completion_tokens"] = int(out["completion_mask"].sum())
            seen["prompt_tokens"] = int(out["prompt_mask"].sum())
            return out

        trainer._generate_and_score_completions = counted
        after_init = rss_mb()
        trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
        assert {p.dtype for p in trainer.model.parameters() if p.requires_grad} == {torch.float32}
        trainer.train()
        base = trainer.model.get_base_model()
        assert not base.is_activation_checkpointing and trainer.args.bf16 is (args.mode != "fp32"), (
            "not the requested no-checkpoint setup"
        )
    return result("trl", args, timer.times, timer.counts, trainable, after_load, after_init)


class FixedLengthSingleTurn:
    """rolerl's single-turn workflow with EOS ignored (fixed-length completions) and `partial_reward`."""

    roles = ("policy",)

    def __init__(self, task, log: list) -> None:
        self.task, self.log = task, log

    async def run(self, ctx, example):
        turn = await ctx.generate("policy", self.task.prompt(example), ignore_eos=True)
        text = ctx.text(turn)
        self.log.append((example.question, len(turn.prompt_ids), len(turn.completion_ids)))
        return ctx.episode(example, partial_reward(example.answer, text))


def rolerl_child(args: argparse.Namespace, beta: float) -> dict:
    import torch

    from rolerl.config import (
        AdaptersConfig,
        AlgorithmConfig,
        Config,
        ModelConfig,
        OptimConfig,
        RolloutConfig,
        RunConfig,
        TrainConfig,
    )
    from rolerl.heap import keep_freed_memory
    from rolerl.rollout.lockstep import LockstepBackend
    from rolerl.run.engines import build_engines
    from rolerl.run.policy import build_policy
    from rolerl.tasks.arithmetic import ArithmeticTask
    from rolerl.train.optim import policy_optimizer
    from rolerl.train.rl import train_step

    torch.set_num_threads(args.threads)
    total = args.warmup + args.steps
    with tempfile.TemporaryDirectory() as out:
        cfg = Config(
            model=ModelConfig(spec=args.model, dtype=base_dtype(args.mode), device="cpu"),
            adapters=AdaptersConfig(preset="shared", rank=16, alpha=32, target_modules="all-linear"),
            rollout=RolloutConfig(
                n=GROUP,
                max_new_tokens=args.max_new_tokens,
                temperature=1.0,
                top_p=1.0,
                max_batch=GROUP * PROMPTS,
                dtype="bfloat16" if args.mode == "fastest" else "model",
            ),
            algorithm=AlgorithmConfig(
                advantage="grpo",
                loss_agg="token-mean",
                clip_low=0.2,
                clip_high=0.28,
                kl="k3",
                beta=beta,
                # a bf16 rollout (a copy, or the bf16 base itself: the engine's kernels round otherwise than
                # the trainer's autocast) samples another distribution: old log-probs are the trainer's
                old_logp="recompute" if args.mode in ("fastest", "bf16-base") else "rollout",
                tis_cap=2.0 if args.mode in ("fastest", "bf16-base") else None,
            ),
            optim=OptimConfig(
                lr=LR, schedule="constant", grad_clip=1.0, weight_decay=0.01, betas=[0.9, 0.999]
            ),
            train=TrainConfig(
                steps=total,
                tasks_per_step=PROMPTS,
                micro_batch_size=args.micro_batch,
                mini_batches=1,
                ppo_epochs=1,
                bf16=args.mode != "fp32",  # explicit: "auto" would autocast on a CPU with native bf16
                heap="keep" if args.heap == "keep" else "trim",
            ),
            run=RunConfig(dir=out, seed=SEED, tensorboard=False, progress=False),
        )
        task, log = ArithmeticTask(), []
        workflow = FixedLengthSingleTurn(task, log)
        policy = build_policy(cfg, workflow.roles)
        if cfg.train.heap == "keep":
            keep_freed_memory()  # as `rolerl.train.rl.train` does
        after_load = rss_mb()
        params = policy.trainable()
        assert {p.dtype for p in params} == {torch.float32}
        optimizer = policy_optimizer(policy, cfg.optim)  # AdamW, lr LR, betas (0.9, 0.999), weight decay 0.01
        # rolerl's engines as training builds them (rollout.dtype, rollout.kernels)
        backend = LockstepBackend(build_engines(cfg, policy, None, {}, cfg.rollout.max_batch))
        after_init = rss_mb()
        times, counts = [], []
        try:
            for step in range(1, total + 1):
                log.clear()
                t0 = time.perf_counter()
                metrics = train_step(cfg, step, policy, params, optimizer, backend, task, workflow)
                times.append(time.perf_counter() - t0)
                counts.append(
                    {
                        "completions": len(log),
                        "completion_tokens": sum(c for _, _, c in log),
                        "prompt_tokens": sum(p for _, p, _ in log),
                        "prompts": digest(sorted({q for q, _, _ in log})),
                        "reward_std": metrics["reward/std"],
                        "threads": torch.get_num_threads(),
                        "rss_mb": round(rss_mb()),
                        "rollout_s": round(metrics["time/rollout"], 2),  # where the step's time went
                        "update_s": round(metrics["time/update"], 2),
                    }
                )
        finally:
            backend.close()
    return result("rolerl", args, times, counts, sum(p.numel() for p in params), after_load, after_init)


def result(
    side: str,
    args: argparse.Namespace,
    times: list,
    counts: list,
    trainable: int,
    after_load: float,
    after_init: float,
) -> dict:
    timed = times[args.warmup :]
    return {
        "side": side,
        "step_s": statistics.median(timed),
        "steps_s": [round(t, 3) for t in timed],
        "warmup_s": [round(t, 3) for t in times[: args.warmup]],
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "rss_after_load_mb": after_load,  # imports + model (rolerl: + adapters, one call)
        "rss_after_init_mb": after_init,  # + adapters, trainer / engine
        "trainable_params": trainable,
        "per_step": counts,
    }


def run_side(side: str, beta: float, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--side", side, "--betas", repr(beta), "--model", args.model]
    cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup), "--threads", str(args.threads)]
    cmd += ["--max-new-tokens", str(args.max_new_tokens), "--micro-batch", str(args.micro_batch)]
    cmd += ["--mode", args.mode, "--heap", args.heap]
    threads = str(args.threads)
    env = os.environ | {
        "OMP_NUM_THREADS": threads,
        "MKL_NUM_THREADS": threads,
        "TOKENIZERS_PARALLELISM": "false",
    }
    out = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"side {side} (beta {beta}) failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def check(runs: list[dict]) -> dict:
    """Per-step counts of one side (identical across rounds, or the lists show it)."""
    steps = [s for r in runs for s in r["per_step"]]
    return {
        "completions": sorted({s["completions"] for s in steps}),
        "completion_tokens": sorted({s["completion_tokens"] for s in steps}),
        "prompt_tokens": [s["prompt_tokens"] for s in runs[0]["per_step"]],
        "prompts": [s["prompts"] for s in runs[0]["per_step"]],
        "reward_std": [round(s["reward_std"], 3) for s in runs[0]["per_step"]],
        "threads": sorted({s["threads"] for s in steps}),
        "rss_mb_after_steps": [s["rss_mb"] for s in runs[0]["per_step"]],
        # rolerl's rollout / update seconds per step, every round's steps (warm-up included)
        "rollout_update_s": [
            [s["rollout_s"], s["update_s"]] for r in runs for s in r["per_step"] if "rollout_s" in s
        ],
        "rss_after_init_mb": round(runs[0]["rss_after_init_mb"]),
        "trainable_params": runs[0]["trainable_params"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=5, help="timed steps per side and round (median over all)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps at the start of each child")
    p.add_argument("--rounds", type=int, default=1, help="rounds of both sides, alternating")
    p.add_argument("--betas", nargs="+", type=float, default=[0.0, 0.04])
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--model", default="default", help="'default' or 'tiny:llama' (smoke)")
    p.add_argument("--micro-batch", type=int, default=8, choices=[1, 2, 4, 8, 16], help="both sides")
    p.add_argument("--threads", type=int, default=int(os.environ.get("BENCH_THREADS", "2")))
    p.add_argument(
        "--mode",
        default="fp32",
        choices=["fp32", "bf16", "fastest", "bf16-base"],
        help="fp32: no autocast on either side; bf16: TRL bf16=True, rolerl train.bf16 (autocast); "
        "fastest: TRL bf16=True vs rolerl bf16 rollout copy + bf16 autocast + recomputed old log-probs + TIS; "
        "bf16-base: both sides' frozen base weights in bf16 (adapters fp32) + bf16 autocast, rolerl "
        "sampling from that model with recomputed old log-probs + TIS",
    )
    p.add_argument(
        "--heap",
        default="keep",
        choices=["keep", "default"],
        help="keep: both sides keep freed memory for reuse (rolerl.heap; rolerl's train.heap=keep); "
        "default: glibc's defaults on both sides",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--side", choices=["trl", "rolerl"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.side:
        child = trl_child if args.side == "trl" else rolerl_child
        print(json.dumps(child(args, args.betas[0])))
        return

    import torch
    import transformers
    import trl

    from rolerl.hardware import describe

    summary: dict = {
        "model": args.model,
        "dtype": base_dtype(args.mode),  # the base weights; adapters are fp32 on both sides
        "mode": args.mode,
        "heap": args.heap,
        "group_size": GROUP,
        "prompts_per_step": PROMPTS,
        "max_new_tokens": args.max_new_tokens,
        "micro_batch": args.micro_batch,
        "steps": args.steps,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "threads": args.threads,
        "machine": describe(),  # every figure says which CPU it came from
        "loss": "token-mean (TRL loss_type=dapo)",
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "trl": trl.__version__,
        },
    }
    order = ["trl", "rolerl"]
    for beta in args.betas:
        runs: dict[str, list[dict]] = {"trl": [], "rolerl": []}
        for _ in range(args.rounds):
            for side in order:
                r = run_side(side, beta, args)
                runs[side].append(r)
                print(
                    f"[beta {beta:g}] {side:6s} {r['step_s']:7.2f} s/step  peak RSS {r['peak_rss_mb']:6.0f} MB  "
                    f"steps {r['steps_s']}  warm-up {r['warmup_s']}",
                    flush=True,
                )
            order.reverse()  # the side that ran second goes first next time
        res = {
            side: {
                "step_s": statistics.median(t for r in rs for t in r["steps_s"]),
                "peak_rss_mb": max(r["peak_rss_mb"] for r in rs),
                "rss_after_load_mb": max(r["rss_after_load_mb"] for r in rs),
            }
            for side, rs in runs.items()
        }
        checks = {side: check(rs) for side, rs in runs.items()}
        same = {
            k: checks["trl"][k] == checks["rolerl"][k]
            for k in ("completions", "completion_tokens", "prompts")
        }
        same["prompt_tokens"] = checks["trl"]["prompt_tokens"] == checks["rolerl"]["prompt_tokens"]
        summary[f"beta={beta:g}"] = {
            "trl_step_s": round(res["trl"]["step_s"], 3),
            "rolerl_step_s": round(res["rolerl"]["step_s"], 3),
            "time_ratio": round(res["rolerl"]["step_s"] / res["trl"]["step_s"], 3),
            "trl_peak_rss_mb": round(res["trl"]["peak_rss_mb"]),
            "rolerl_peak_rss_mb": round(res["rolerl"]["peak_rss_mb"]),
            "mem_ratio": round(res["rolerl"]["peak_rss_mb"] / res["trl"]["peak_rss_mb"], 3),
            "trl_rss_after_load_mb": round(res["trl"]["rss_after_load_mb"]),
            "rolerl_rss_after_load_mb": round(res["rolerl"]["rss_after_load_mb"]),
            "trl_steps_s": [t for r in runs["trl"] for t in r["steps_s"]],
            "rolerl_steps_s": [t for r in runs["rolerl"] for t in r["steps_s"]],
            "same_work": same,
            "check": checks,
        }
        print(
            f"beta={beta:g}", {k: v for k, v in summary[f"beta={beta:g}"].items() if k != "check"}, flush=True
        )
    print(json.dumps(summary) if args.json else json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
