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
  rolerl demo                                  load the default model and sample from it
  rolerl demo --model Qwen/Qwen3-0.6B --prompt "What is 17 * 23?"
  rolerl adapters --model default --names reason tool --rank 8 --out adapters/
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
    _add_model_args(p)
    p.add_argument("--prompt", default="Explain in one sentence what a LoRA adapter is.", help="user message")
    p.add_argument("--max-new-tokens", type=int, default=48, help="tokens to generate")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")


def _run_demo(args: argparse.Namespace) -> int:
    """Until the RL demo lands: load the model, add two routed adapters, and greedily answer a prompt."""
    import torch

    import rolerl

    t0 = time.perf_counter()
    model, tokenizer = rolerl.load_model(args.model, dtype=args.dtype)
    load_s = time.perf_counter() - t0
    rolerl.add_adapters(model, ["reason", "tool"], rank=8)
    enc = tokenizer.apply_chat_template(
        [{"role": "user", "content": args.prompt}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    t0 = time.perf_counter()
    with torch.no_grad(), rolerl.routes(model, "reason"):  # fresh adapters: identical to the base model
        out = model.generate(**enc, max_new_tokens=args.max_new_tokens, do_sample=False)
    gen_s = time.perf_counter() - t0
    new = out[0, enc["input_ids"].shape[1] :]
    text = tokenizer.decode(new, skip_special_tokens=True)
    if args.json:
        print(
            json.dumps(
                {
                    "model": str(args.model),
                    "text": text,
                    "new_tokens": len(new),
                    "load_s": round(load_s, 2),
                    "generate_s": round(gen_s, 2),
                }
            )
        )
    else:
        print(
            f"model: {args.model} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, loaded in {load_s:.1f}s)"
        )
        print(f"user: {args.prompt}\nassistant: {text}")
        print(f"({len(new)} tokens in {gen_s:.1f}s; the RL demo arrives with the demo issue)")
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


COMMANDS: dict[str, tuple[str, Callable, Callable]] = {
    "demo": ("run the main demo (for now: load a model and sample from it)", _configure_demo, _run_demo),
    "adapters": (
        "create fresh routed adapters and save them as PEFT directories",
        _configure_adapters,
        _run_adapters,
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
    try:
        return args.run(args)
    except (ValueError, KeyError, FileNotFoundError) as e:
        print(f"rolerl {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
