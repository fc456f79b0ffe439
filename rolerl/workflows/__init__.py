"""Workflows: the `Workflow` Protocol, `Context`, and the name -> constructor registry (`task.workflow`)."""

from __future__ import annotations

from collections.abc import Callable

from rolerl.tasks.base import Task
from rolerl.workflows.base import Context, RoleCalls, Workflow, derive_seed
from rolerl.workflows.search_agent import SearchAgent
from rolerl.workflows.single_turn import SingleTurn
from rolerl.workflows.tir import TIR

WORKFLOWS: dict[str, Callable[[Task], Workflow]] = {
    "single_turn": SingleTurn,
    "tir": TIR,
    "search_agent": SearchAgent,
}

__all__ = ["WORKFLOWS", "Context", "RoleCalls", "SearchAgent", "SingleTurn", "TIR", "Workflow", "derive_seed"]
