"""Your own code, named in a config by import path (`package.module:Name`): a workflow (`task.workflow`) or
a task (`task.name`). Nothing in rolerl needs editing to use either."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any


def import_object(spec: str, field: str) -> Any:
    """The object `spec` (`package.module:Name`) names; `field` is the config field that gave it (for errors).

    A module in the working directory is found, as `python -m rolerl` finds it: the `rolerl` script's own
    `sys.path` starts at its bin directory, so `my_workflow.py` beside the config would otherwise not
    import. The directory goes last, so a stray `math.py` there never shadows a real module."""
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"{field}={spec!r}: give package.module:Name (e.g. my_workflow:SolveCheck)")
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{field}={spec!r}: cannot import {attr!r} from {module!r} ({e})") from None
