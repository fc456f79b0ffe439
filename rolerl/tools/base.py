"""What every tool is: a named callable from an argument string to a `ToolResult`.

Workflows call tools through `ctx.tool(name, args)`; the rollout engine splices `ToolResult.text()` into
the sequence as `tool_output` tokens. Tools must be safe to call from many threads at once (the engine
calls them from a thread pool while other rows decode).
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass
class ToolResult:
    """The outcome of one tool call. `stdout`/`stderr` are already cut to the tool's output budget."""

    stdout: str = ""
    stderr: str = ""
    exit_code: int = 0  # 0 ok; > 0 the program's exit status; < 0 killed by that signal (as subprocess)
    timed_out: bool = False  # the wall-clock limit killed it (exit_code is then -SIGKILL)
    truncated: bool = False  # stdout or stderr was longer than the budget; the head is kept
    wall_s: float = 0.0  # from the moment the tool got the call to its result
    tool_failed: bool = False  # the tool itself failed (a dead retriever), not the model's call

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    def text(self) -> str:
        """What the model sees: stdout, then stderr, then one line per abnormal ending."""
        parts = [self.stdout]
        if self.stderr:
            parts.append(self.stderr)
        if self.truncated:
            parts.append("[output truncated]\n")
        if self.timed_out:
            parts.append(f"[timed out after {self.wall_s:.1f} s]\n")
        elif self.exit_code < 0:
            try:
                name = signal.Signals(-self.exit_code).name
            except ValueError:
                name = f"signal {-self.exit_code}"
            parts.append(f"[killed by {name}]\n")
        return "".join(p if not p or p.endswith("\n") else p + "\n" for p in parts)


@runtime_checkable
class Tool(Protocol):
    """A tool: `name` is what the model writes to call it, `description` goes into the system prompt."""

    name: str
    description: str

    def run(self, args: str) -> ToolResult: ...
