"""The `rolerl` command (also `python -m rolerl`).

Each subcommand is a `(configure, run)` pair registered in `COMMANDS`; heavy imports happen inside `run`
so `rolerl --help` answers instantly.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable

EPILOG = """examples:
  rolerl demo                                  base eval -> imitation -> GRPO -> eval (~15 min on CPU)
  rolerl demo --quick                          the same in ~3 minutes
  rolerl generate --prompt "What is 2**10?" --tools python --greedy --json
  rolerl adapters --model default --names reason tool --rank 8 --out adapters/
  rolerl train configs/smoke.yaml --set train.steps=5 run.dir=runs/smoke
  rolerl train --resume runs/smoke             continue a run from its newest checkpoint
  rolerl sft configs/smoke.yaml --set sft.data=demos.jsonl run.dir=runs/sft
"""


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default="default",
        help="'default' (SmolLM2-135M-Instruct), a HF id, a directory or a .gguf file",
    )
    p.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="weights dtype"
    )


def _configure_demo(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", default="default", help="'default' (SmolLM2-135M-Instruct), 'tiny:llama', a HF id..."
    )
    p.add_argument(
        "--run-dir", default=None, help="output directory (default runs/demo-DATE-TIME): runs, results, plot"
    )
    p.add_argument("--seed", type=int, default=0, help="seeds the problems, adapters and sampling")
    p.add_argument("--quick", action="store_true", help="a ~3 minute version (fewer problems, 2 RL steps)")
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
        "--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides, e.g. optim.lr=5e-5"
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
    settings = DemoSettings.quick(**given) if args.quick else DemoSettings(**given)
    results = run_demo(settings, log=(lambda *a: print(*a, file=sys.stderr)) if args.json else print)
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

    model, _ = rolerl.load_model(args.model, dtype=args.dtype)
    targets = (
        args.target_modules[0]
        if args.target_modules and len(args.target_modules) == 1
        else args.target_modules
    )
    rolerl.add_adapters(model, args.names, rank=args.rank, alpha=args.alpha, target_modules=targets)
    for name in args.names:
        print(rolerl.save_adapter(model, name, Path(args.out) / name))
    return 0


def _configure_generate(p: argparse.ArgumentParser) -> None:
    _add_model_args(p)
    p.add_argument("--prompt", required=True, help="user message (wrapped in the chat template unless --raw)")
    p.add_argument(
        "--raw", action="store_true", help="feed the prompt as plain text, without the chat template"
    )
    p.add_argument("--system", default=None, help="system message")
    p.add_argument("--max-new-tokens", type=int, default=128, help="sampled tokens (tool output not counted)")
    p.add_argument("--greedy", action="store_true", help="argmax decoding")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tools", nargs="*", default=[], choices=["python"], help="tools the model may call")
    p.add_argument("--adapter", default=None, help="a PEFT LoRA directory; every token is routed to it")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")


def _run_generate(args: argparse.Namespace) -> int:
    """Generate one completion with the rollout engine and show each token's kind and route."""
    import math

    import rolerl
    from rolerl.rollout.engine import Engine, GenerationRequest
    from rolerl.rollout.sampling import SamplingParams

    model, tokenizer = rolerl.load_model(args.model, dtype=args.dtype)
    route_of = None
    if args.adapter:
        rolerl.load_adapter(model, "adapter", args.adapter)
        route_of = dict.fromkeys(("prompt", "reasoning", "tool_call", "tool_output", "answer"), 0)
    if args.raw:
        prompt_ids = tokenizer.encode(args.prompt, add_special_tokens=False)
    else:
        chat = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": args.prompt}
        ]
        prompt_ids = list(
            tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=True)["input_ids"]
        )
    tools = {}
    if "python" in args.tools:
        from rolerl.tools.python_sandbox import PythonSandbox

        tools["python"] = PythonSandbox()
    sampling = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
        greedy=args.greedy,
    )
    engine = Engine(model, tokenizer, max_batch=1, tools=tools)
    request = GenerationRequest(prompt_ids, sampling, route_of=route_of, tool="python" if tools else None)
    t0 = time.perf_counter()
    try:
        turn = engine.generate([request])[0]
    finally:
        engine.close()
        for tool in tools.values():
            tool.close()
    elapsed = time.perf_counter() - t0
    text = tokenizer.decode(turn.completion_ids, skip_special_tokens=True)
    result = {
        "text": text,
        "completion_ids": turn.completion_ids,
        "kinds": turn.kinds,
        "routes": turn.routes[len(prompt_ids) - 1 : -1] if len(turn.routes) >= len(prompt_ids) else [],
        "logprobs": [None if math.isnan(x) else round(x, 6) for x in turn.logprobs],
        "finish_reason": turn.finish_reason,
        "tool_calls": [{"args": c.args, "output": c.output, "error": c.error} for c in turn.tool_calls],
        "seconds": round(elapsed, 3),
    }
    if not args.json:
        print(text)
        print(
            f"[{len(turn.completion_ids)} tokens, {turn.finish_reason}, {len(turn.tool_calls)} tool calls, {elapsed:.1f}s]"
        )
    print(json.dumps(result) if args.json else "")
    return 0


def _add_config_args(p: argparse.ArgumentParser, resume: bool) -> None:
    p.add_argument(
        "config",
        nargs="?",
        default=None,
        help="YAML config" + (" (default: RUN_DIR/config.yaml)" if resume else ""),
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


def _configure_train(p: argparse.ArgumentParser) -> None:
    _add_config_args(p, resume=True)
    p.add_argument(
        "--resume", default=None, metavar="RUN_DIR", help="continue RUN_DIR from its newest checkpoint"
    )


def _run_train(args: argparse.Namespace) -> int:
    """RL-train the adapters (docs/TRAINING.md): writes config.yaml, metrics.jsonl, TensorBoard logs and
    checkpoints/step_N/ (PEFT adapters + optimizer, scheduler, RNG) into run.dir."""
    from pathlib import Path

    from rolerl.config import load_config
    from rolerl.train.rl import train

    path = args.config or (str(Path(args.resume) / "config.yaml") if args.resume else None)
    if path is None:
        raise ValueError("give a CONFIG.yaml (e.g. configs/smoke.yaml) or --resume RUN_DIR")
    overrides = [*args.overrides, *([f"run.dir={args.resume}"] if args.resume else [])]
    cfg = load_config(path, overrides)
    run_dir = train(cfg, resume=args.resume is not None)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    last = json.loads(lines[-1]) if lines else {}
    keys = ("step", "reward/mean", "accuracy", "loss/total", "entropy", "logp_mismatch/max_abs")
    print(json.dumps({"run_dir": str(run_dir), **{k: last[k] for k in keys if k in last}}))
    return 0


def _configure_sft(p: argparse.ArgumentParser) -> None:
    _add_config_args(p, resume=False)
    p.add_argument("--data", default=None, help="demonstrations JSONL (overrides sft.data)")


def _run_sft(args: argparse.Namespace) -> int:
    """Imitation warm-start of the adapters on role-labelled demonstrations (JSONL of chat messages);
    writes run.dir/adapters/<name> as PEFT directories, to start RL from with adapters.init."""
    from rolerl.config import load_config
    from rolerl.train.sft import sft

    if args.config is None:
        raise ValueError("give a CONFIG.yaml (e.g. configs/smoke.yaml)")
    cfg = load_config(args.config, [*args.overrides, *([f"sft.data={args.data}"] if args.data else [])])
    if not cfg.sft.data:
        raise ValueError("sft.data is empty: pass --data FILE.jsonl or --set sft.data=FILE.jsonl")
    print(json.dumps({"adapters": str(sft(cfg))}))
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
    "adapters": (
        "create fresh routed adapters and save them as PEFT directories",
        _configure_adapters,
        _run_adapters,
    ),
    "train": ("RL-train adapters from a YAML config (GRPO family)", _configure_train, _run_train),
    "sft": ("imitation warm-start of adapters on demonstrations", _configure_sft, _run_sft),
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
    try:
        return args.run(args)
    except (ValueError, KeyError, FileNotFoundError) as e:
        print(f"rolerl {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
