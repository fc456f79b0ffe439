"""Tools the model can call: a `Tool` takes an argument string and returns a `ToolResult`.

Build tools by name through `build_tools`, the one place every entry point (train, generate, demo) uses:

    tools = build_tools(["python"])                                  # {"python": PythonSandbox(...)}
    tools = build_tools(["python"], python={"timeout_s": 5})         # options for one tool, by its name
    engine = Engine(model, tokenizer, tools=tools)

`TOOLS` maps each name to its factory; register a new tool there. A tool that cannot work on this machine
raises here (the sandbox without root: `SandboxError`, saying what to do), so a run fails at start.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable

from rolerl.tools.base import Tool, ToolResult
from rolerl.tools.python_sandbox import Isolation, PythonSandbox, SandboxConfig, SandboxError, SandboxSession

__all__ = [
    "TOOLS",
    "Isolation",
    "PythonSandbox",
    "SandboxConfig",
    "SandboxError",
    "SandboxSession",
    "Tool",
    "ToolResult",
    "build_tools",
]

PRIVILEGE_ENV = "ROLERL_SANDBOX_PRIVILEGE"  # "unprivileged": opt into the weaker non-root sandbox


def python_tool(**options: object) -> PythonSandbox:
    """The `python` tool. `options` are `SandboxConfig` fields; `privilege` defaults to the environment
    variable ROLERL_SANDBOX_PRIVILEGE (an explicit choice for the CLI), else "root"."""
    options.setdefault("privilege", os.environ.get(PRIVILEGE_ENV) or "root")
    return PythonSandbox(SandboxConfig(**options))  # type: ignore[arg-type]


def search(**options: object) -> Tool:
    """The `search` tool: BM25 over a local corpus (`corpus=PATH`) or a retrieval server (`url=...`)."""
    from rolerl.tools.search import search_tool

    return search_tool(**options)  # type: ignore[arg-type]


TOOLS: dict[str, Callable[..., Tool]] = {"python": python_tool, "search": search}


def build_tools(names: Iterable[str], **options: dict[str, object]) -> dict[str, Tool]:
    """Build each named tool once: `{name: tool}`. `options[name]` holds keyword arguments for that
    tool's factory in `TOOLS`. Raises ValueError for an unknown name or options for a tool not built, and
    the tool's own error (e.g. SandboxError) if it cannot work here; tools built before it are closed."""
    names = list(dict.fromkeys(names))
    if unknown := [n for n in names if n not in TOOLS]:
        raise ValueError(f"unknown tool(s) {unknown}; known: {sorted(TOOLS)}")
    if stray := sorted(set(options) - set(names)):
        raise ValueError(f"options given for tool(s) {stray} that are not built (names: {names})")
    tools: dict[str, Tool] = {}
    try:
        for name in names:
            tools[name] = TOOLS[name](**options.get(name, {}))
    except BaseException:
        for tool in tools.values():
            close = getattr(tool, "close", None)
            if callable(close):
                close()
        raise
    return tools
