"""rolerl: RL for tool-using LLM agents and multi-role workflows, with per-role, per-token control of
which parameters learn.

The public names are imported lazily so that `rolerl --help` does not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "load_model": "rolerl.models.load",
    "tiny_model": "rolerl.models.tiny",
    "add_adapters": "rolerl.models.lora",
    "routes": "rolerl.models.lora",
    "RoutedLoRALinear": "rolerl.models.lora",
    "save_adapter": "rolerl.models.adapters_io",
    "load_adapter": "rolerl.models.adapters_io",
}

__all__ = [
    "RoutedLoRALinear",
    "__version__",
    "add_adapters",
    "load_adapter",
    "load_model",
    "routes",
    "save_adapter",
    "tiny_model",
]

if TYPE_CHECKING:  # pragma: no cover
    from rolerl.models.adapters_io import load_adapter, save_adapter
    from rolerl.models.load import load_model
    from rolerl.models.lora import RoutedLoRALinear, add_adapters, routes
    from rolerl.models.tiny import tiny_model


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'rolerl' has no attribute {name!r}")
