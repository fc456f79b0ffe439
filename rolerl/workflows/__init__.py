"""Workflows: the `Workflow` Protocol, `Context`, and the name -> constructor registry (`task.workflow`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from rolerl.plugins import import_object
from rolerl.roles import Tags
from rolerl.tasks.base import Task
from rolerl.workflows.base import Context, RoleCalls, Workflow, derive_seed
from rolerl.workflows.eval_opt import EvalOpt
from rolerl.workflows.orch_workers import OrchWorkers
from rolerl.workflows.reasoner_tools import ReasonerTools
from rolerl.workflows.search_agent import SearchAgent
from rolerl.workflows.single_turn import SingleTurn
from rolerl.workflows.tir import TIR
from rolerl.workflows.voting import Voting

WORKFLOWS: dict[str, Callable[..., Workflow]] = {
    "single_turn": SingleTurn,
    "tir": TIR,
    "search_agent": SearchAgent,
    "voting": Voting,
    "eval_opt": EvalOpt,
    "orch_workers": OrchWorkers,
    "reasoner_tools": ReasonerTools,
}


def load_workflow(name: str, task: Task, options: Mapping[str, Any] | None = None) -> Workflow:
    """The workflow `name` for `task`: a key of `WORKFLOWS`, or `package.module:Class` (any importable
    class or factory taking the task and keyword options: a user's own workflow, no rolerl edit needed).
    `options` are the workflow's settings (`task.workflow_options`: rounds, voters, caps ...)."""
    options = dict(options or {})
    factory = _factory(name)
    try:
        workflow = factory(task, **options)
    except TypeError as e:
        raise ValueError(f"workflow {name!r} does not take options {sorted(options)}: {e}") from None
    if not getattr(workflow, "roles", None):
        raise ValueError(f"workflow {name!r} has no `roles` (the roles it calls ctx.generate with)")
    return workflow


def _factory(name: str) -> Callable[..., Workflow]:
    if name in WORKFLOWS:
        return WORKFLOWS[name]
    if ":" in name:
        return import_object(name, "task.workflow")
    raise ValueError(f"unknown workflow {name!r}; built-in: {sorted(WORKFLOWS)}, or package.module:Class")


def role_tags(name: str) -> dict[str, Tags]:
    """The tags each role of workflow `name` calls the model with, where they are not `Tags()` (the
    workflow class's `role_tags`: the search agent's `<search>`, the reasoner's `<request>`), read without
    building the workflow. Demonstrations are cut with them (`rolerl sft`), so imitation sees the kinds a
    rollout records: a query is a tool call, retrieved passages are tool output and carry no loss."""
    tags = getattr(_factory(name), "role_tags", None) or {}
    if not isinstance(tags, Mapping) or not all(isinstance(t, Tags) for t in tags.values()):
        raise ValueError(
            f"workflow {name!r}: role_tags must map role names to rolerl.roles.Tags; got {tags!r}"
        )
    return dict(tags)


__all__ = [
    "WORKFLOWS",
    "load_workflow",
    "role_tags",
    "Context",
    "RoleCalls",
    "SearchAgent",
    "SingleTurn",
    "TIR",
    "Workflow",
    "derive_seed",
]
