"""Tools the model can call: a `Tool` takes an argument string and returns a `ToolResult`."""

from rolerl.tools.base import Tool, ToolResult
from rolerl.tools.python_sandbox import Isolation, PythonSandbox, SandboxConfig, SandboxError, SandboxSession

__all__ = [
    "Isolation",
    "PythonSandbox",
    "SandboxConfig",
    "SandboxError",
    "SandboxSession",
    "Tool",
    "ToolResult",
]
