"""The `rolerl` command (also `python -m rolerl`).

Each subcommand is a `(configure, run)` pair registered in `COMMANDS`; heavy imports happen inside `run`
so `rolerl --help` answers instantly.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
import time
from collections.abc import Callable

EPILOG = """examples:
  rolerl demo                                  base eval -> imitation -> GRPO -> eval (~4 min on 2 cores)
  rolerl demo --quick                          a ~2 minute pipeline check of every stage
  rolerl generate --prompt "What is 2**10?" --tools python --greedy --json
  rolerl adapters --model default --names reason tool --rank 8 --out adapters/
  rolerl configs list                          the example configs that ship with rolerl, by name
  rolerl train smoke --set train.steps=5 run.dir=runs/smoke
  rolerl train my.yaml --set run.dir=runs/mine    your own (rolerl configs copy voting my.yaml to start)
  rolerl train --resume runs/smoke             continue a run from its newest checkpoint
  rolerl sft smoke --set sft.data=demos.jsonl run.dir=runs/sft
  rolerl eval --task arithmetic --model tiny:llama --limit 8 --out runs/eval
  rolerl collect --task gsm8k --workflow tir --n 8 --out demos.jsonl    correct rollouts as SFT data
  rolerl demos gsm8k --format tir --out demos.jsonl    GSM8K's train solutions as tool-call SFT data
  rolerl demos voting --task gsm8k --out voting.jsonl  a warm start for every role of a workflow
  rolerl recipe gsm8k-tir --limit 100 --steps 10    demos -> imitation -> GRPO, evaluated before and after
  rolerl diagnose grad-conflict --task synthetic --workflow tir --run runs/demo/rl --limit 8 --out runs/gc
  rolerl report runs/a runs/b --out runs/report          one offline HTML page comparing runs
"""


def _add_model_args(p: argparse.ArgumentParser, dtype: str = "float32", run_decides: bool = False) -> None:
    """`--model` and `--dtype`; `run_decides`: a `--run` names both (they stay None unless given)."""
    after = "; with --run, the run's" if run_decides else ""
    p.add_argument(
        "--model",
        default=None if run_decides else "default",
        help="'default' (SmolLM2-135M-Instruct), 'tiny:llama', a HF id, a directory or a .gguf file "
        f"(default: default{after})",
    )
    p.add_argument(
        "--dtype",
        default=None if run_decides else dtype,
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weights dtype; auto = bfloat16 where the device has native bf16 (a GPU, or a CPU with "
        f"AVX512-BF16 or AMX), else float32 (default: {dtype}{after})",
    )


def _load(spec: str, dtype: str):
    """`(model, tokenizer)` for the CLI: the tiny test models too, dtype 'auto' resolved (and logged)."""
    import rolerl
    from rolerl.hardware import resolve_precision
    from rolerl.models.load import resolve_dtype

    name = resolve_precision(dtype, "cpu", "--dtype")
    if spec.startswith("tiny:"):
        from rolerl.models.tiny import tiny_from_spec

        return tiny_from_spec(spec, dtype=resolve_dtype(name))
    return rolerl.load_model(spec, dtype=name)


def _configure_demo(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", default="default", help="'default' (SmolLM2-135M-Instruct), 'tiny:llama', a HF id..."
    )
    p.add_argument(
        "--run-dir", default=None, help="output directory (default runs/demo-DATE-TIME): runs, results, plot"
    )
    p.add_argument("--seed", type=int, default=0, help="seeds the problems, adapters and sampling")
    p.add_argument(
        "--quick",
        action="store_true",
        help="a ~2 minute pipeline check of every stage (fewer problems, 2 RL steps: too few to show a gain)",
    )
    p.add_argument(
        "--steps", type=int, default=None, help="GRPO steps (default: rolerl/configs/demo.yaml, 10)"
    )
    p.add_argument("--demos", type=int, default=None, help="imitation demonstrations (default 256)")
    p.add_argument("--eval-rl", type=int, default=None, help="held-out RL-family problems (default 256)")
    p.add_argument(
        "--eval-format", type=int, default=None, help="held-out format-family problems (default 64)"
    )
    p.add_argument("--probe", type=int, default=0, metavar="K", help="also measure the warm start's pass@K")
    p.add_argument(
        "--set",
        action="extend",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="config overrides, e.g. --set optim.lr=5e-5 train.bf16=false (repeatable)",
    )
    p.add_argument("--json", action="store_true", help="print results.json's content as the last line")


def _run_demo(args: argparse.Namespace) -> int:
    """Base eval -> imitation warm start -> GRPO -> eval, on the built-in word problems (rolerl/demo.py)."""
    from rolerl.demo import DemoSettings, run_demo

    given = {
        "model": args.model, "run_dir": args.run_dir, "seed": args.seed, "rl_steps": args.steps,
        "demos": args.demos, "eval_rl": args.eval_rl, "eval_format": args.eval_format,
        "probe_k": args.probe, "overrides": tuple(args.set),
    }  # fmt: skip
    given = {k: v for k, v in given.items() if v is not None}
    settings = DemoSettings.quick_check(**given) if args.quick else DemoSettings(**given)
    results = run_demo(settings, log=(lambda *a: print(*a, file=sys.stderr)) if args.json else print)
    if args.json:
        print(json.dumps(results))
    return 0


def _configure_recipe(p: argparse.ArgumentParser) -> None:
    from rolerl.recipe import RECIPES, TEST_SIZE

    p.formatter_class = argparse.RawDescriptionHelpFormatter  # the epilog's lines as written
    p.description = textwrap.fill(" ".join((p.description or "").split()), 100)
    p.epilog = (
        "recipes:\n"
        + "".join(
            f"  {name:<12} {r.about} (config {r.config}; --topology {' or '.join(r.topologies)})\n"
            for name, r in RECIPES.items()
        )
        + (
            "\nexamples:\n"
            "  rolerl recipe gsm8k-tir                          the whole pipeline, default model, full test set\n"
            "  rolerl recipe gsm8k-tir --limit 100 --steps 5 --demos 500 --out runs/tir-check    a short check\n"
            "  rolerl recipe gsm8k-tir --topology dart --seed 1 --out runs/gsm8k-tir-dart-s1\n"
            "  rolerl recipe gsm8k-tir --topology dart --warm-from runs/gsm8k-tir --out runs/gsm8k-tir-dart-rl\n"
            "                                                   DART's GRPO from the shared warm start\n"
            "  rolerl recipe gsm8k-msarl --set sft.epochs=2 train.steps=200\n"
            "  rolerl report runs/gsm8k-tir runs/gsm8k-tir-dart-s1    compare finished recipes"
        )
    )
    p.add_argument("name", metavar="RECIPE", help=f"one of: {', '.join(RECIPES)}")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="the recipe's directory: every stage's outputs; rerun the same command to continue "
                        "(default: runs/RECIPE)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0,
                   help="seeds the adapters, GRPO's sampling and shuffling; the test problems stay the same "
                        "(default: %(default)s)")  # fmt: skip
    p.add_argument("--model", default=None,
                   help="'default' (SmolLM2-135M-Instruct), 'tiny:llama', a HF id or a directory (default: the "
                        "config's)")  # fmt: skip
    p.add_argument("--topology", default=None, help="adapters.preset: which adapter each token trains (default: "
                   "the config's; the recipes list their choices below)")  # fmt: skip
    p.add_argument("--steps", type=int, default=None,
                   help="GRPO steps; 0 = stop after the warm start (default: the config's train.steps)")  # fmt: skip
    p.add_argument("--limit", type=int, default=None, metavar="N",
                   help=f"evaluate on N test problems, the first N of a fixed shuffle (default: all {TEST_SIZE})")  # fmt: skip
    p.add_argument("--demos", type=int, default=None, metavar="N",
                   help="build demonstrations from the first N train rows (default: all 7473)")  # fmt: skip
    p.add_argument("--data", default=None, metavar="DIR",
                   help="the data root holding gsm8k/train.jsonl and gsm8k/test.jsonl (default: the shared data, "
                        "$ROLERL_SHARED_DATA)")  # fmt: skip
    p.add_argument("--set", action="extend", nargs="+", default=[], metavar="KEY=VALUE",
                   help="config overrides, applied last, e.g. --set sft.epochs=2 rollout.n=4 (repeatable)")  # fmt: skip
    p.add_argument("--warm-from", default=None, metavar="DIR",
                   help="start GRPO from another run of this recipe's finished warm start (its demos, sft and "
                        "base/warm evaluations are copied, not rerun): a second --seed of an RL arm costs only "
                        "the RL and its evaluation. Its flags must match this run's but --seed, --steps and the "
                        "--set entries only GRPO reads (train.tasks_per_step, rollout.n/temperature/top_p, "
                        "optim.lr, task.max_difficulty, algorithm.*, MSARL's task.workflow_options.coder_samples and "
                        "sibling_groups); --topology too where DIR's warm start has one "
                        "adapter (shared): each adapter of this run's topology (dart: reason, tool) starts from "
                        "it")  # fmt: skip
    p.add_argument("--pass-k", type=int, default=None, metavar="N",
                   help="also sample the final adapters N times a test problem at the training temperature "
                        "(rollout.temperature): pass@k for k = 1, 2, 4 ... N and maj@k; ~N times a greedy "
                        "evaluation's time")  # fmt: skip
    p.add_argument("--no-progress", action="store_true", help="no progress bars (the stage lines stay)")
    p.add_argument("--json", action="store_true", help="print results.json's content as the last line")


def _run_recipe(args: argparse.Namespace) -> int:
    """A benchmark's whole pipeline in one command: demonstrations from GSM8K train (rolerl demos), the base
    model on the test set, an imitation warm start (rolerl sft), the warm start on the test set, GRPO on GSM8K
    train with the Python sandbox (rolerl train), the adapters after RL on the test set (greedy pass@1 with
    its standard error), results.json and the report (rolerl report). Each finished stage is marked in
    OUT/stages/: rerunning the same command skips what is done and continues what was cut short."""
    from rolerl.eval.harness import EvalInterrupted
    from rolerl.recipe import RecipeSettings, run_recipe
    from rolerl.train.checkpoint import TrainingInterrupted

    settings = RecipeSettings(
        args.name, out=args.out, seed=args.seed, model=args.model, topology=args.topology, steps=args.steps,
        limit=args.limit, demos=args.demos, data=args.data, overrides=tuple(args.set), warm_from=args.warm_from,
        pass_k=args.pass_k, progress=not args.no_progress,
    )  # fmt: skip
    try:
        results = run_recipe(settings, log=(lambda *a: print(*a, file=sys.stderr)) if args.json else print)
    except TrainingInterrupted as e:  # the stage's trainer kept its last step: the recipe is what to rerun
        raise KeyboardInterrupt(
            f"{e.why} at step {e.step} of {e.run_dir} ({e.kept}); rerun the same command to continue"
        ) from e
    except EvalInterrupted as e:  # the evaluation kept its finished chunks: the rerun continues them
        raise KeyboardInterrupt(
            f"{e.why} after {e.kept} of {e.total} samples of {e.out}; rerun the same command to continue"
        ) from e
    if args.json:
        print(json.dumps(results))
    return 0


def _configure_adapters(p: argparse.ArgumentParser) -> None:
    _add_model_args(p)
    p.add_argument("--names", nargs="+", required=True, help="adapter names, e.g. reason tool")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank of each adapter")
    p.add_argument("--alpha", type=float, default=None, help="LoRA alpha (default 2 * rank)")
    p.add_argument(
        "--target-modules",
        nargs="+",
        default=None,
        help="module names or one regex (default: all decoder linears)",
    )
    p.add_argument(
        "--out", required=True, help="directory; each adapter is written as a PEFT directory OUT/<name>"
    )


def _run_adapters(args: argparse.Namespace) -> int:
    """Create fresh (identity) adapters and write them in PEFT format, e.g. to start a run from."""
    from pathlib import Path

    import rolerl

    model, _ = _load(args.model, args.dtype)
    targets = (
        args.target_modules[0]
        if args.target_modules and len(args.target_modules) == 1
        else args.target_modules
    )
    rolerl.add_adapters(model, args.names, rank=args.rank, alpha=args.alpha, target_modules=targets)
    for name in args.names:
        print(rolerl.save_adapter(model, name, Path(args.out) / name))
    return 0


# `generate --tools python`: the tags that open a tool call, and the default system prompt that explains them.
# `xml` is rolerl's own (the TIR workflow, the demo, SFT data); `markdown` is what instruction-tuned models
# write by habit (a ```python block), so an untrained model calls the tool with it.
TOOL_TAGS = {
    "xml": ("<code>", "</code>", "<output>", "</output>"),
    "markdown": ("```python\n", "```", "\n```output", "```\n"),  # output tags must differ from the call's
}
TOOL_SYSTEM = {
    "xml": "You can run Python. Write code between <code> and </code>; its printed output then appears between "
    "<output> and </output>. Use Python for every calculation, then give the final answer between <answer> "
    "and </answer>.",
    "markdown": "You can run Python: write a ```python code block; its printed output then appears in an "
    "```output block. Use Python for calculations, then give the final answer between <answer> and </answer>.",
}


def _configure_generate(p: argparse.ArgumentParser) -> None:
    _add_model_args(p, dtype="auto")
    p.add_argument("--prompt", required=True, help="user message (wrapped in the chat template unless --raw)")
    p.add_argument(
        "--raw", action="store_true", help="feed the prompt as plain text, without the chat template"
    )
    p.add_argument(
        "--system",
        default=None,
        help="system message (default: none; with --tools, what the tool's tags mean: TOOL_SYSTEM in "
        "rolerl/cli.py; --system '' sends none)",
    )
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=128,
        help="sampled tokens, tool output not counted (default: 128)",
    )
    p.add_argument(
        "--max-len",
        type=int,
        default=None,
        help="prompt + completion positions (default: the model's maximum)",
    )
    p.add_argument(
        "--greedy", action="store_true", help="argmax decoding (ignores temperature, top-p, top-k)"
    )
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default: 1.0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass; 1 = off (default: 1.0)")
    p.add_argument(
        "--top-k", type=int, default=0, help="sample from the k most likely tokens; 0 = off (default)"
    )
    p.add_argument("--seed", type=int, default=0, help="sampling seed: same seed, same text (default: 0)")
    p.add_argument("--tools", nargs="*", default=[], choices=["python"], help="tools the model may call")
    p.add_argument(
        "--tags",
        default="auto",
        choices=["auto", "xml", "markdown"],
        help="how a tool call is written: xml = <code>...</code> (what rolerl trains: the demo, TIR, SFT "
        "data), markdown = a ```python block (what an untrained instruct model writes); auto = xml with "
        "--adapter, markdown without (default: auto)",
    )
    p.add_argument("--adapter", default=None, help="a PEFT LoRA directory; every token is routed to it")
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object (text, kinds, routes, log-probs, tool calls)",
    )


def _run_generate(args: argparse.Namespace) -> int:
    """Generate one completion with the rollout engine. The text is coloured by token kind (tool calls,
    tool output, answer), with each kind's token count and the route (adapter) of every kind after it;
    --json gives the per-token kinds, routes and log-probs."""
    import math

    import rolerl
    from rolerl.roles import KINDS, Tags
    from rolerl.rollout.engine import Engine, GenerationRequest
    from rolerl.rollout.sampling import SamplingParams
    from rolerl.tools import build_tools

    model, tokenizer = _load(args.model, args.dtype)
    route_of = None
    if args.adapter:
        rolerl.load_adapter(model, "adapter", args.adapter)
        route_of = dict.fromkeys(KINDS, 0)
    style = args.tags if args.tags != "auto" else ("xml" if args.adapter else "markdown")
    tags = Tags(*TOOL_TAGS[style])
    system = args.system if args.system is not None else (TOOL_SYSTEM[style] if args.tools else "")
    if args.raw:
        prompt_ids = tokenizer.encode(args.prompt, add_special_tokens=False)
    else:
        chat = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": args.prompt}
        ]
        prompt_ids = list(
            tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=True)["input_ids"]
        )
    tools = build_tools(args.tools)  # fails here, with what to do, if a tool cannot work on this machine
    sampling = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
        greedy=args.greedy,
    )
    engine = Engine(model, tokenizer, max_batch=1, max_len=args.max_len, tools=tools)
    tool = args.tools[0] if args.tools else None
    request = GenerationRequest(prompt_ids, sampling, route_of=route_of, tags=tags, tool=tool)
    t0 = time.perf_counter()
    try:
        turn = engine.generate([request])[0]
    finally:
        engine.close()
        for t in tools.values():
            t.close()
    elapsed = time.perf_counter() - t0
    text = tokenizer.decode(turn.completion_ids, skip_special_tokens=True)
    routes = turn.routes[len(prompt_ids) - 1 : -1] if len(turn.routes) >= len(prompt_ids) else []
    if args.json:
        print(json.dumps({
            "text": text,
            "completion_ids": turn.completion_ids,
            "kinds": turn.kinds,
            "routes": routes,
            "logprobs": [None if math.isnan(x) else round(x, 6) for x in turn.logprobs],
            "finish_reason": turn.finish_reason,
            "tool_calls": [{"args": c.args, "output": c.output, "error": c.error} for c in turn.tool_calls],
            "seconds": round(elapsed, 3),
        }))  # fmt: skip
        return 0
    _print_by_kind(tokenizer, turn, routes, "adapter" if args.adapter else None)
    print(
        f"[{len(turn.completion_ids)} tokens, {turn.finish_reason}, {len(turn.tool_calls)} tool calls, "
        f"{elapsed:.1f}s]"
    )
    return 0


def _print_by_kind(tokenizer, turn, routes: list[int], adapter: str | None) -> None:
    """The completion coloured by kind (plain text when not a terminal), then one line per kind: its
    colour, token count and the route (adapter or base) its tokens were computed with."""
    from collections import Counter

    from rich.console import Console
    from rich.text import Text

    from rolerl.roles import ANSWER, REASONING, TOOL_CALL, TOOL_OUTPUT

    style = {REASONING: "", TOOL_CALL: "bold cyan", TOOL_OUTPUT: "yellow", ANSWER: "bold green"}
    console = Console(highlight=False)
    out = Text()
    start = 0
    for i in range(1, len(turn.kinds) + 1):  # one span per run of equal kinds, decoded whole (no split bytes)
        if i == len(turn.kinds) or turn.kinds[i] != turn.kinds[start]:
            piece = tokenizer.decode(turn.completion_ids[start:i], skip_special_tokens=True)
            out.append(piece, style=style.get(turn.kinds[start], ""))
            start = i
    console.print(out, soft_wrap=True)
    counts = Counter(turn.kinds)
    legend = Text("[kinds: ")
    for n, kind in enumerate(k for k in style if counts[k]):
        legend.append(", " if n else "")
        route_ids = {r for r, k in zip(routes, turn.kinds, strict=False) if k == kind}
        where = "base" if route_ids <= {-1} else (adapter or f"adapter {sorted(route_ids)}")
        legend.append(kind, style=style[kind] or None)
        legend.append(f" {counts[kind]} ({where})")
    legend.append("]")
    console.print(legend, soft_wrap=True)


def _add_config_args(p: argparse.ArgumentParser, resume: bool) -> None:
    p.add_argument(
        "config",
        nargs="?",
        default=None,
        help="a YAML file, or the name of an example shipped with rolerl (`rolerl configs list`)"
        + (" (default: RUN_DIR/config.yaml)" if resume else ""),
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="extend",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="override a field, e.g. --set train.steps=10 optim.lr=1e-4 (values parsed as YAML)",
    )


def _config_and_overrides(args: argparse.Namespace) -> tuple[str | None, list[str]]:
    """`rolerl train --set k=v CONFIG.yaml` (or an example's name) puts the config among the overrides
    (argparse's nargs): take it back out. Anything else without '=' is an error that says what an override
    looks like."""
    from rolerl import configs

    config, overrides = args.config, []
    for item in args.overrides:
        if "=" not in item and config is None and (item.endswith((".yaml", ".yml")) or configs.path_of(item)):
            config = item
        elif "=" not in item:
            raise ValueError(
                f"--set {item!r}: an override looks like section.field=value (e.g. train.steps=10); "
                "give the config file before --set or as CONFIG.yaml"
            )
        else:
            overrides.append(item)
    return config, overrides


def _config_or_resume(args: argparse.Namespace) -> tuple[str, list[str]]:
    """The config to load and its overrides for `rolerl train` and `rolerl sft`: CONFIG, or with --resume
    RUN_DIR that run's own config.yaml (unless a CONFIG is given) and run.dir=RUN_DIR."""
    from pathlib import Path

    config, overrides = _config_and_overrides(args)
    path = config or (str(Path(args.resume) / "config.yaml") if args.resume else None)
    if path is None:
        raise ValueError("give a CONFIG (a YAML file or an example's name, e.g. smoke) or --resume RUN_DIR")
    return path, [*overrides, *([f"run.dir={args.resume}"] if args.resume else [])]


def _configure_train(p: argparse.ArgumentParser) -> None:
    _add_config_args(p, resume=True)
    p.add_argument(
        "--resume",
        default=None,
        metavar="RUN_DIR",
        help="continue RUN_DIR from its newest readable checkpoint (a run stopped before its first "
        "checkpoint starts again from step 0); a larger --set train.steps=N extends it",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the run in run.dir: deletes its checkpoints, adapters, metrics, TensorBoard logs and "
        "config.yaml",
    )


def _run_train(args: argparse.Namespace) -> int:
    """RL-train the adapters (docs/TRAINING.md): writes config.yaml, metrics.jsonl, TensorBoard logs and
    checkpoints/step_N/ (PEFT adapters + optimizer and RNG state) into run.dir. Ctrl-C checkpoints the
    last completed step and says how to continue. Several GPUs or nodes: `torchrun --nproc_per_node N -m
    rolerl train CONFIG.yaml`, one data-parallel rank per process (docs/DISTRIBUTED.md)."""

    from rolerl.config import load_config
    from rolerl.progress import is_rank_zero
    from rolerl.train.rl import train

    path, overrides = _config_or_resume(args)
    cfg = load_config(path, overrides)
    run_dir = train(cfg, resume=args.resume is not None, overwrite=args.overwrite)
    if not is_rank_zero():  # under torchrun, rank 0 reports the run
        return 0
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    last = json.loads(lines[-1]) if lines else {}
    keys = ("step", "reward/mean", "accuracy", "loss/total", "entropy", "logp_mismatch/max_abs")
    print(json.dumps({"run_dir": str(run_dir), **{k: last[k] for k in keys if k in last}}))
    return 0


def _configure_sft(p: argparse.ArgumentParser) -> None:
    _add_config_args(p, resume=True)
    p.add_argument("--data", default=None, help="demonstrations JSONL (overrides sft.data)")
    p.add_argument(
        "--resume",
        default=None,
        metavar="RUN_DIR",
        help="continue RUN_DIR from its newest checkpoint (every run.checkpoint_every steps, and where Ctrl-C "
        "or SIGTERM stopped it), on the same data and settings",
    )
    p.add_argument(
        "--overwrite", action="store_true", help="replace the adapters and metrics already in run.dir"
    )


def _run_sft(args: argparse.Namespace) -> int:
    """Imitation warm-start of the adapters on role-labelled demonstrations (JSONL of chat messages, or the
    token rows `rolerl collect` writes);
    writes run.dir/adapters/<name> as PEFT directories, to start RL from with adapters.init. Ctrl-C
    checkpoints the last completed step and says how to continue (--resume)."""

    from rolerl.config import load_config
    from rolerl.train.sft import sft

    path, overrides = _config_or_resume(args)
    cfg = load_config(path, [*overrides, *([f"sft.data={args.data}"] if args.data else [])])
    if not cfg.sft.data:
        raise ValueError("sft.data is empty: pass --data FILE.jsonl or --set sft.data=FILE.jsonl")
    adapters = sft(cfg, overwrite=args.overwrite, resume=args.resume is not None)
    print(json.dumps({"adapters": str(adapters)}))
    return 0


def _add_rollout_args(p: argparse.ArgumentParser, split: str, n: int, temperature: float) -> None:
    """What `eval` and `collect` share: the task, the workflow, the policy and how it samples."""
    p.add_argument(
        "--task", required=True, help="a benchmark (gsm8k, math500, humaneval, hotpotqa ...) or built-in task"
    )
    p.add_argument(
        "--data", default=None, help="the benchmark's file or directory, or a Hugging Face dataset id"
    )
    p.add_argument("--split", default=split, help="(default: %(default)s)")
    p.add_argument(
        "--workflow", default="single_turn", help="single_turn, tir, search_agent, ... or pkg.module:Class"
    )
    p.add_argument(
        "--option", dest="workflow_options", action="append", default=[], metavar="KEY=VALUE",
        help="a workflow setting, e.g. --option voters=5 (values parsed as YAML); repeatable",
    )  # fmt: skip
    _add_model_args(p, run_decides=True)
    p.add_argument("--adapters", default=None, metavar="DIR", help="PEFT adapters to load, one directory per name "
                   "(e.g. RUN/checkpoints/step_N/adapters or an sft run's adapters/)")  # fmt: skip
    p.add_argument("--preset", default=None, help="the topology of --adapters (default: shared)")
    p.add_argument("--table", default=None, metavar="YAML", type=_yaml_mapping,
                   help="a routing table instead of --preset or the run's topology (adapters.table), e.g. "
                        "'{policy: {tool_call: policy, default: null}}': tool calls on the adapter, the rest "
                        "on the base model")  # fmt: skip
    p.add_argument(
        "--run",
        dest="run_dir",
        default=None,
        metavar="RUN_DIR",
        help="a training run: its config and newest checkpoint",
    )
    p.add_argument("--n", "--samples", type=int, default=n, help="samples per example (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=temperature, help="0 = greedy (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=512, help="(default: %(default)s)")
    p.add_argument("--tool", default=None, help="python, search or none (default: the workflow's)")
    p.add_argument("--max-tool-calls", type=int, default=4)
    p.add_argument("--corpus", default=None, help="--tool search: BM25 over this passage file")
    p.add_argument(
        "--search-url", default=None, help="--tool search: a Search-R1-style /retrieve URL instead"
    )
    p.add_argument("--limit", type=int, default=None, help="this many examples (default: the whole split)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-batch", type=int, default=32, help="rows decoded at once (default: %(default)s)")


def _yaml_mapping(text: str) -> dict:
    import yaml

    value = yaml.safe_load(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a YAML mapping, e.g. '{{policy: reason}}'; got {text!r}")
    return value


def _rollout_spec(args: argparse.Namespace, out: str | None, resume: bool):
    from rolerl.eval.harness import EvalSpec

    return EvalSpec(
        task=args.task, data=args.data, split=args.split, workflow=args.workflow, model=args.model,
        dtype=args.dtype, adapters=args.adapters, run=args.run_dir, preset=args.preset, table=args.table, n=args.n,
        temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.max_new_tokens, tool=args.tool,
        max_tool_calls=args.max_tool_calls, limit=args.limit, seed=args.seed, out=out, resume=resume,
        max_batch=args.max_batch,
        tool_options={k: v for k, v in {"corpus": args.corpus, "url": args.search_url}.items() if v},
        workflow_options=_options(args.workflow_options),
    )  # fmt: skip


def _configure_eval(p: argparse.ArgumentParser) -> None:
    _add_rollout_args(p, split="test", n=1, temperature=0.0)
    p.add_argument("--out", default=None, metavar="DIR", help="write results.json and samples.jsonl here")
    p.add_argument("--resume", action="store_true", help="skip the samples already in OUT/samples.jsonl")
    p.add_argument("--json", action="store_true", help="print results.json's content as the last line")


def _options(items: list[str]) -> dict:
    """`KEY=VALUE` strings into a dict, the values parsed as YAML (`voters=5` is the integer 5)."""
    import yaml

    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--option {item!r}: give KEY=VALUE, e.g. --option voters=5")
        out[key] = yaml.safe_load(value)
    return out


def _run_eval(args: argparse.Namespace) -> int:
    """Evaluate a model (and adapters) on a task through a workflow: pass@1 (mean@n), pass@k, maj@k, the
    task's scores (EM/F1...), tool and length statistics; every sample into OUT/samples.jsonl."""
    from rolerl.eval.harness import run_eval

    results = run_eval(_rollout_spec(args, args.out, args.resume))
    if args.json:
        print(json.dumps(results))
    return 0


def _configure_collect(p: argparse.ArgumentParser) -> None:
    _add_rollout_args(p, split="train", n=4, temperature=1.0)
    p.add_argument(
        "--out", required=True, metavar="FILE", help="the demonstrations JSONL (rolerl sft --data FILE)"
    )
    p.add_argument("--resume", action="store_true", help="continue FILE: skip the examples in FILE.done")
    p.add_argument("--keep", default="correct", choices=["correct", "all"],
                   help="episodes kept: correct = the outcome is correct (default: %(default)s)")  # fmt: skip
    p.add_argument("--roles", default="", metavar="R1,R2", help="keep only these roles' calls (default: all)")
    p.add_argument("--min-reward", type=float, default=None, metavar="X",
                   help="keep a call only if its own reward (Turn.reward, else its role's, else the "
                        "outcome) is at least X, e.g. 1.0 for coder samples that ran in solved episodes")  # fmt: skip
    p.add_argument("--max-per-example", type=int, default=None, metavar="K",
                   help="keep at most K episodes per example (default: every kept one)")  # fmt: skip


def _run_collect(args: argparse.Namespace) -> int:
    """Role-labelled demonstrations by rejection sampling: run a workflow N times per example (train split)
    and write the calls of the episodes kept (correct ones by default) as token ids for `rolerl sft`,
    e.g. to warm-start a tool agent on its successful calls before RL (MSARL)."""
    from rolerl.train.collect import Keep, collect

    keep = Keep(episodes=args.keep, roles=tuple(r for r in args.roles.split(",") if r),
                min_reward=args.min_reward, max_per_example=args.max_per_example)  # fmt: skip
    print(json.dumps(collect(_rollout_spec(args, None, False), args.out, keep, resume=args.resume)))
    return 0


def _configure_demos(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter  # the epilog's lines as written
    p.description = textwrap.fill(" ".join((p.description or "").split()), 100)
    p.epilog = (
        "sources:\n"
        "  gsm8k         GSM8K's train solutions as tool calls (--format tir | msarl), checked in the sandbox\n"
        "  voting        voters' answers and the aggregator's \\boxed{i} choice of a right solution\n"
        "  eval-opt      the generator's answers and the evaluator's \\boxed{Correct|Incorrect} verdicts\n"
        "  orch-workers  the orchestrator's 'Strategy k:' plan, a worker's and the synthesizer's answers\n"
        "  msarl         reasoner_tools' reasoner and coder (= gsm8k --format msarl)\n"
        "Every role of the workflow gets rows, from the task's train split only (docs/WORKFLOWS.md 'Warm start').\n"
        "\nexamples:\n"
        "  rolerl demos voting --task gsm8k --limit 300 --out voting-demos.jsonl\n"
        "  rolerl sft voting --data voting-demos.jsonl --set run.dir=runs/voting-sft\n"
        "  rolerl eval --task gsm8k --workflow voting --adapters runs/voting-sft/adapters --preset isolated\n"
        "  rolerl demos orch-workers --task synthetic --limit 200 --option workers=2 --out ow.jsonl\n"
        "  rolerl demos gsm8k --format tir --out tir-demos.jsonl"
    )
    p.add_argument(
        "source",
        choices=["gsm8k", "voting", "eval-opt", "orch-workers", "msarl"],
        help="a benchmark's solutions (gsm8k) or a workflow whose every role gets demonstrations",
    )
    p.add_argument("--format", dest="fmt", default=None, choices=["tir", "msarl"],
                   help="gsm8k: tir = the tir workflow's policy; msarl = reasoner_tools' reasoner and coder")  # fmt: skip
    p.add_argument(
        "--out", required=True, metavar="FILE", help="the demonstrations JSONL (rolerl sft --data FILE)"
    )
    p.add_argument("--task", default="gsm8k",
                   help="a workflow's task: gsm8k (worked solutions), synthetic ... (default: %(default)s)")  # fmt: skip
    p.add_argument("--data", default=None, metavar="DIR",
                   help="the data root, the gsm8k folder or its train.jsonl (default: the shared data)")  # fmt: skip
    p.add_argument("--limit", type=int, default=None, metavar="N",
                   help="gsm8k: the first N rows; a workflow: N train examples (default: all; 256 for a "
                        "generated task)")  # fmt: skip
    p.add_argument("--option", dest="workflow_options", action="append", default=[], metavar="KEY=VALUE",
                   help="a workflow setting, e.g. --option voters=5 (as in the config's "
                        "task.workflow_options); repeatable")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="the examples' draw and each row's order (default: 0)")
    p.add_argument("--samples", type=int, default=0, metavar="N",
                   help="a workflow: roles the task data gives no row get rejection-sampled ones, N "
                        "rollouts per example with --model (rolerl collect --roles); 0 = none (default)")  # fmt: skip
    _add_model_args(p)
    p.add_argument("--max-new-tokens", type=int, default=256, help="--samples' calls (default: %(default)s)")
    p.add_argument("--max-calls", type=int, default=None, metavar="K",
                   help="gsm8k: drop solutions with more than K computations (tool calls or requests)")  # fmt: skip
    p.add_argument(
        "--workers", type=int, default=8, help="gsm8k: rows checked at once (default: %(default)s)"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _run_demos(args: argparse.Namespace) -> int:
    """Demonstrations for `rolerl sft` from a task's train split, never its test split. gsm8k: each GSM8K
    calculator annotation becomes a Python call (TIR) or a reasoner request and the coder's code (MSARL),
    run in the sandbox and checked against the annotation and the gold answer. voting, eval-opt,
    orch-workers: every role of the workflow, each row the prompt the workflow sends that role and a reply
    that follows its protocol, built from the task's worked solutions and gold answers (a right voter's
    index, the grader's verdict, a plan that parses); a summary says how many rows each role got and why
    examples gave none."""
    if args.source in ("gsm8k", "msarl"):
        return _run_gsm8k_demos(args, "msarl" if args.source == "msarl" else args.fmt)
    if args.fmt is not None:
        raise ValueError(f"--format is for gsm8k; {args.source} writes every role of its workflow")
    from rolerl.demos.roles import SPLIT, WARM_STARTS, build, collect_roles, summary_lines
    from rolerl.eval.harness import EvalSpec, spec_examples
    from rolerl.tasks import load_task
    from rolerl.workflows import load_workflow

    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit {args.limit}; allowed: an integer >= 1")
    if args.samples < 0:
        raise ValueError(f"--samples {args.samples}; allowed: an integer >= 0")
    t0 = time.perf_counter()
    name = WARM_STARTS[args.source][0]
    task = load_task(args.task, args.data)
    workflow = load_workflow(name, task, _options(args.workflow_options))
    limit = args.limit if args.limit is not None or callable(getattr(task, "size", None)) else 256
    spec = EvalSpec(task=args.task, data=args.data, split=SPLIT, workflow=name, model=args.model, dtype=args.dtype,
                    workflow_options=_options(args.workflow_options), n=max(args.samples, 1), temperature=0.7,
                    max_new_tokens=args.max_new_tokens, limit=limit, seed=args.seed,
                    progress=not args.no_progress)  # fmt: skip
    report = build(
        workflow, spec_examples(task, spec), args.out, seed=args.seed, progress=not args.no_progress
    )
    missing = report.missing(workflow.roles)
    if missing and args.samples:
        collect_roles(spec, args.out, missing, report)
    for line in summary_lines(report, workflow.roles, args.out):
        print(line, file=sys.stderr)
    if report.missing(workflow.roles):
        print(f"  no demonstrations for {report.missing(workflow.roles)}: give --samples N to collect them "
              "from the model's correct rollouts", file=sys.stderr)  # fmt: skip
    print(json.dumps({"out": args.out, **report.summary(), "wall_s": round(time.perf_counter() - t0, 1)}))
    return 0


def _run_gsm8k_demos(args: argparse.Namespace, fmt: str | None) -> int:
    from rolerl.demos.gsm8k import build, summary_lines

    if fmt is None:
        raise ValueError("rolerl demos gsm8k needs --format tir or --format msarl")
    if args.task != "gsm8k":
        raise ValueError(
            f"--task {args.task}: {args.source} demonstrations come from GSM8K's train solutions"
        )
    t0 = time.perf_counter()
    report = build(fmt, args.out, data=args.data, limit=args.limit, max_calls=args.max_calls,
                   workers=args.workers, progress=not args.no_progress)  # fmt: skip
    for line in summary_lines(report, args.out, fmt):
        print(line, file=sys.stderr)
    print(json.dumps({"out": args.out, **report.summary(), "wall_s": round(time.perf_counter() - t0, 1)}))
    return 0


def _configure_diagnose(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="diagnostic", metavar="DIAGNOSTIC", required=True)
    g = sub.add_parser(
        "grad-conflict",
        help="angles between token kinds' (or roles') partial gradients, per module and layer",
        description=_run_grad_conflict.__doc__,
    )
    _add_rollout_args(g, split="train", n=16, temperature=1.0)
    g.add_argument("--out", required=True, metavar="DIR", help="CSVs, summary.json and angles.png")
    g.add_argument("--params", default="adapters", help="adapters (every LoRA parameter), an adapter's name, "
                   "or all (every weight: small models) (default: %(default)s)")  # fmt: skip
    g.add_argument("--groups", default="kind", choices=["kind", "role"],
                   help="partial gradients per token kind or per role (default: %(default)s)")  # fmt: skip
    g.add_argument("--max-memory-gb", type=float, default=8.0,
                   help="refuse a measurement whose gradients need more (default: %(default)s)")  # fmt: skip
    g.set_defaults(run=_run_grad_conflict)
    i = sub.add_parser(
        "interaction",
        help="LEAS interaction coefficients of reasoning and tool use from trained variants",
        description=_run_interaction.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_rollout_args(i, split="test", n=50, temperature=1.0)
    for flag, what in [("--joint", "trained on every kind (adapters.preset shared)"),
                       ("--reasoning-only", "trained on reasoning tokens only (masked, train_kinds [reasoning, answer])"),
                       ("--tool-only", "trained on tool-call tokens only (masked, train_kinds [tool_call])")]:  # fmt: skip
        i.add_argument(flag, required=True, metavar="RUN", help=f"a run {what}, or a dir of its eval samples")
    i.add_argument("--base", default=None, metavar="RUN|MODEL|EVAL", help="the base variant (default: the "
                   "joint run's base model without adapters)")  # fmt: skip
    i.add_argument("--hybrids", action="store_true", help="also evaluate the two inference-time hybrids "
                   "(one kind on a trained adapter, the rest on the base) and solve the full 6x6 system")  # fmt: skip
    i.add_argument("--budget", type=int, default=None, metavar="EPISODES",
                   help="cap the episodes per variant: questions = min(--limit, EPISODES // --samples)")  # fmt: skip
    i.add_argument(
        "--out", required=True, metavar="DIR", help="each variant's eval, interaction.csv/.png/.json"
    )
    i.set_defaults(run=_run_interaction)


def _run_diagnose(args: argparse.Namespace) -> int:
    """Interference diagnostics: `rolerl diagnose grad-conflict --help`."""
    raise AssertionError("a diagnostic's own parser sets `run`")  # argparse: sub-parser defaults win


def _run_grad_conflict(args: argparse.Namespace) -> int:
    """DART's gradient-angle measurement: --samples trajectories per query, each trajectory's
    partial gradient per token kind (the mean NLL of that kind's tokens, one backward each), and the angles
    between the same kind across trajectories and between kinds within one, overall, per layer and per
    module (with the share of modules in conflict)."""
    from rolerl.diagnostics.measure import grad_conflict

    spec = _rollout_spec(args, None, False)
    grad_conflict(spec, args.out, params=args.params, group_by=args.groups, max_memory_gb=args.max_memory_gb)
    return 0


def _run_interaction(args: argparse.Namespace) -> int:
    """LEAS / CEA (the DART paper): per question, the success rate of each variant from --samples samples,
    smoothed as (k + 0.5) / (n + 1) and taken to logits z; the interaction of reasoning and tool use is
    l23 = z_joint - z_tool - z_reas + z_base (with --hybrids, the full 6x6 solve of z = X l as well).
    l23 < 0: the two capabilities interfere when trained together; > 0: they help each other. Questions
    no variant ever solves are dropped. Writes OUT/interaction.csv, .png and .json."""
    from rolerl.diagnostics.measure import measure_interaction

    if args.budget is not None:
        if args.budget < args.n:
            raise ValueError(f"--budget {args.budget} is below --samples {args.n}: not one question fits")
        args.limit = min(args.limit or args.budget // args.n, args.budget // args.n)
    spec = _rollout_spec(args, None, False)
    measure_interaction(spec, args.out, joint=args.joint, reas=args.reasoning_only, tool=args.tool_only, base=args.base,
                        hybrids=args.hybrids)  # fmt: skip
    return 0


def _configure_serve_retriever(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "corpus", help="passages: JSONL of {id, title, text} or a JSON list of {title, text} (.gz too)"
    )
    p.add_argument("--host", default="127.0.0.1", help="(default: %(default)s; 0.0.0.0 serves other hosts)")
    p.add_argument("--port", type=int, default=8000, help="(default: %(default)s)")
    p.add_argument("--k", type=int, default=3, help="passages per query when a request gives no topk")
    p.add_argument(
        "--cache-dir", default=None, help="where the BM25 index is cached (default $ROLERL_CACHE/bm25)"
    )
    p.add_argument(
        "--workers",
        type=int,
        default=16,
        help="threads that answer requests; connections beyond them wait their turn. 0: a thread "
        "per connection (the stdlib's way, unbounded) (default: %(default)s)",
    )
    p.add_argument(
        "--backlog",
        type=int,
        default=1024,
        help="connections the kernel queues before the server accepts them: the stdlib's 5 resets "
        "clients from ~32 at once; Linux caps it at net.core.somaxconn (default: %(default)s)",
    )


def _run_serve_retriever(args: argparse.Namespace) -> int:
    """Serve BM25 retrieval over CORPUS with Search-R1's protocol (POST /retrieve {"queries": [...],
    "topk": k, "return_scores": true}), for `rollout.tool: search` with `url` on other hosts. --port 0
    picks a free port (the log line "serving retrieval at URL" names it)."""
    from rolerl.tools.retrieval_http import serve_retriever
    from rolerl.tools.search import CACHE_DIR, BM25Retriever

    retriever = BM25Retriever(args.corpus, cache_dir=args.cache_dir or CACHE_DIR)
    serve_retriever(
        retriever, args.host, args.port, default_k=args.k, workers=args.workers, backlog=args.backlog
    )
    return 0


def _configure_configs(p: argparse.ArgumentParser) -> None:
    acts = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    acts.add_parser("list", help="each example's name and what it runs")
    show = acts.add_parser("show", help="print an example's YAML")
    show.add_argument("name", metavar="NAME")
    copy = acts.add_parser("copy", help="write an example to a file to edit (default ./NAME.yaml)")
    copy.add_argument("name", metavar="NAME")
    copy.add_argument(
        "dest", nargs="?", default=None, metavar="DEST", help="a file, or a directory for NAME.yaml"
    )
    copy.add_argument("--force", action="store_true", help="replace DEST if it exists")


def _run_configs(args: argparse.Namespace) -> int:
    """The example configs that ship with rolerl. Any command that takes a CONFIG takes an example's name
    (`rolerl train voting --set run.dir=runs/voting`); a file of that name in the working directory wins."""
    from pathlib import Path

    from rolerl import configs

    if args.action == "list":
        width = max(map(len, configs.names()))
        for name in configs.names():
            print(f"{name:<{width}}  {configs.describe(name)}")
        return 0
    path = configs.path_of(args.name)
    if path is None:
        raise ValueError(f"no example config named {args.name!r}; the examples: {', '.join(configs.names())}")
    if args.action == "show":
        print(path.read_text(), end="")
        return 0
    dest = Path(args.dest or f"{path.stem}.yaml")
    dest = dest / path.name if dest.is_dir() else dest
    if dest.exists() and not args.force:
        raise ValueError(f"{str(dest)!r} exists; pass --force to replace it")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.tmp")
    tmp.write_text(path.read_text())
    tmp.replace(dest)
    print(dest)
    return 0


def _configure_report(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs", nargs="+", metavar="RUN_DIR",
                   help="run directories (each with metrics.jsonl), or `rolerl demo` directories (results.json: "
                        "their before/after table and their GRPO run)")  # fmt: skip
    p.add_argument("--out", default=None, metavar="DIR",
                   help="where report.html and the PNGs go (default: the first RUN_DIR's report/)")  # fmt: skip


def _run_report(args: argparse.Namespace) -> int:
    """One self-contained HTML page of one or more runs (overlaid, one colour per run), viewable offline:
    reward and accuracy, eval curves, role loss shares and adapter gradient norms, entropy, tools, gradient
    conflict, the seesaw of tool use against accuracy, each run's config and their differences; plus a PNG
    per figure. A demo directory adds its held-out before/after table per family. Prints the page's path."""
    from rolerl.report.html import write_report

    print(write_report(args.runs, args.out))
    return 0


def _configure_failures(p: argparse.ArgumentParser) -> None:
    p.add_argument("evals", nargs="+", metavar="DIR",
                   help="evaluation directories (`rolerl eval --out`: samples.jsonl and results.json), or a recipe's "
                        "--out directory (its base, warm and rl evaluations, and the sampled one of --pass-k)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print the counts as JSON instead of the table")


def _run_failures(args: argparse.Namespace) -> int:
    """Where a math evaluation's answers go wrong: every sample in one class (correct, truncated, tool_limit,
    format, tool_error, not_reported, arithmetic, reasoning; docs/EVALUATION.md), counted per evaluation, side by
    side, from its samples.jsonl and the task's gold answers; then the right samples per difficulty of their
    problem (GSM8K: the solution's steps; MATH: its level)."""
    from pathlib import Path

    from rolerl.eval.failures import analyze, table
    from rolerl.recipe import EVAL_DIRS

    named = []
    for d in args.evals:
        path = Path(d)
        stages = [path / "eval" / s for s in EVAL_DIRS] if (path / "recipe.json").is_file() else [path]
        for stage in (s for s in stages if s == path or (s / "samples.jsonl").is_file()):
            parts = stage.parts
            name = "/".join(parts[-3::2]) if len(parts) >= 3 and parts[-2] == "eval" else stage.name
            named.append((name, analyze(stage)))
    print(json.dumps(dict(named), indent=1) if args.json else table(named))
    return 0


COMMANDS: dict[str, tuple[str, Callable, Callable]] = {
    "generate": (
        "generate with the rollout engine (tools, routes, log-probs)",
        _configure_generate,
        _run_generate,
    ),
    "demo": (
        "tool-integrated RL on built-in word problems: base -> imitation -> GRPO -> eval",
        _configure_demo,
        _run_demo,
    ),
    "recipe": (
        "a benchmark's whole pipeline, resumable: GSM8K demos -> imitation -> GRPO, evaluated before and after",
        _configure_recipe,
        _run_recipe,
    ),
    "adapters": (
        "create fresh routed adapters and save them as PEFT directories",
        _configure_adapters,
        _run_adapters,
    ),
    "train": ("RL-train adapters from a YAML config (GRPO family)", _configure_train, _run_train),
    "sft": ("imitation warm-start of adapters on demonstrations", _configure_sft, _run_sft),
    "serve-retriever": (
        "serve BM25 retrieval over a passage corpus (Search-R1's HTTP protocol)",
        _configure_serve_retriever,
        _run_serve_retriever,
    ),
    "eval": (
        "evaluate a model and adapters on a benchmark (pass@k, maj@k, EM/F1)",
        _configure_eval,
        _run_eval,
    ),
    "diagnose": (
        "interference diagnostics: gradient conflict, interaction coefficients (LEAS)",
        _configure_diagnose,
        _run_diagnose,
    ),
    "collect": (
        "demonstrations from a workflow's correct rollouts (rejection sampling), for sft",
        _configure_collect,
        _run_collect,
    ),
    "demos": (
        "SFT demonstrations: GSM8K's train solutions as tool calls (TIR, MSARL), or every role of a workflow "
        "(voting, eval-opt, orch-workers)",
        _configure_demos,
        _run_demos,
    ),
    "failures": (
        "classify a math evaluation's wrong answers (truncated, format, tool error, arithmetic, reasoning ...)",
        _configure_failures,
        _run_failures,
    ),
    "configs": (
        "the example configs shipped with rolerl: list, show, copy (any CONFIG argument takes their names)",
        _configure_configs,
        _run_configs,
    ),
    "report": (
        "an offline HTML report (and PNGs) of one or more runs' metrics and configs",
        _configure_report,
        _run_report,
    ),
}


def build_parser() -> argparse.ArgumentParser:
    from rolerl import __version__

    parser = argparse.ArgumentParser(
        prog="rolerl",
        description="Train tool-using LLM agents and multi-role workflows with RL, choosing per role and per token "
        "which parameters learn.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"rolerl {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (help_text, configure, run) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=run.__doc__)
        configure(p)
        p.set_defaults(run=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    import logging

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if getattr(args, "no_progress", False):
        _no_library_bars()
    try:
        return args.run(args)
    except KeyboardInterrupt as e:  # a run that can continue says how (checkpoint.TrainingInterrupted)
        print(f"rolerl {args.command}: {str(e) or 'interrupted'}", file=sys.stderr)
        return 130
    except _user_errors() as e:
        message = e.args[0] if isinstance(e, KeyError) and e.args else e  # KeyError's str() adds quotes
        print(f"rolerl {args.command}: error: {message}", file=sys.stderr)
        return 2


def _no_library_bars() -> None:
    """`--no-progress` silences the libraries' bars too: transformers' "Loading weights" and the hub's
    downloads would otherwise write their carriage-return frames into the logs that flag is chosen for. The
    variable reaches a library imported later (each reads its bar state at import); one already imported is
    told directly."""
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    if "huggingface_hub" in sys.modules:
        from huggingface_hub import utils as hub_utils

        hub_utils.disable_progress_bars()


def _user_errors() -> tuple[type[BaseException], ...]:
    """Errors that describe a mistake in the input or the machine, printed as one line (others are bugs:
    they keep their traceback). The sandbox's error is one: it says what to do without root."""
    errors: list[type[BaseException]] = [ValueError, KeyError, OSError]
    try:
        from rolerl.tools._sandbox_host import SandboxError

        errors.append(SandboxError)
    except ImportError:  # pragma: no cover
        pass
    return tuple(errors)


if __name__ == "__main__":
    raise SystemExit(main())
