"""`rolerl collect`: role-labelled demonstrations from a workflow's own rollouts (rejection sampling), for
`rolerl sft` to warm-start each role's adapter before RL, as MSARL trains its tool agents by imitation.

The workflow runs `n` times per example of a split (the train split by default) with a model and
adapters, exactly as `rolerl eval` runs it; an episode is kept by `--keep` (`correct`: its outcome is
correct; `all`), and a kept episode's calls by role (`--roles`) and by their own reward (`--min-reward`:
the call's `Turn.reward`, else its role's, else the outcome: a coder sample whose code failed in a solved
episode is not worth imitating). `--max-per-example` caps the kept episodes of one example so easy
problems do not dominate the data.

One line per kept model call, token ids as the engine produced them (no chat template is re-applied and
no text re-tokenised, so SFT imitates exactly the sequences the workflow produces, follow-up prompts and
spliced tool output included):

    {"role": "coder", "prompt_ids": [...], "completion_ids": [...], "kinds": ["reasoning", ...],
     "versions": [[0, 57]], "vocab": 49152, "example": "gsm8k/17", "sample": 2, "reward": 1.0, "text": "<code>..."}

`versions` are the sampling adapters' versions per completion token, run-length encoded (`Turn.versions`;
rows written before them have none, read as version 0); `text` is for reading; `vocab` (the tokenizer's size) guards against training a model with another
vocabulary on the ids. Rows are appended chunk by chunk with the examples done in `OUT.done`, so
`--resume` continues an interrupted collection.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from rolerl.eval.harness import EvalSpec, append_lines, rollouts, spec_examples, spec_policy
from rolerl.types import Episode, Turn, versions_to_runs


@dataclass(frozen=True)
class Keep:
    """Which calls become demonstrations."""

    episodes: Literal["correct", "all"] = "correct"
    roles: tuple[str, ...] = ()  # () = every role
    min_reward: float | None = None  # a call's own reward must be at least this
    max_per_example: int | None = None  # kept episodes per example (the first ones, in sample order)

    def __post_init__(self) -> None:
        if self.episodes not in ("correct", "all"):
            raise ValueError(f"--keep {self.episodes!r}; allowed: 'correct', 'all'")
        if self.max_per_example is not None and self.max_per_example < 1:
            raise ValueError(f"--max-per-example={self.max_per_example}; allowed: an integer >= 1")


def kept_calls(episodes: Sequence[Episode], keep: Keep) -> list[tuple[int, Turn]]:
    """`(sample index, call)` of the calls `keep` keeps among one example's episodes."""
    out, kept = [], 0
    for j, episode in enumerate(episodes):
        if keep.episodes == "correct" and not episode.metadata.get("correct", episode.reward >= 1.0):
            continue
        if keep.max_per_example is not None and kept == keep.max_per_example:
            break
        calls = [t for t in episode.turns if not keep.roles or t.role in keep.roles]
        calls = [t for t in calls if keep.min_reward is None or episode.own_reward(t) >= keep.min_reward]
        if calls:
            kept += 1
            out += [(j, t) for t in calls]
    return out


def collect(
    spec: EvalSpec,
    out: str | Path,
    keep: Keep,
    *,
    resume: bool = False,
    log_line: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Write the demonstrations of `spec`'s rollouts that `keep` keeps to `out` (JSONL); returns counts.
    `resume` continues an interrupted collection into the same `out`."""
    from rolerl.progress import ProgressBar
    from rolerl.tasks import load_task
    from rolerl.workflows import load_workflow

    out = Path(out)
    done_file = out.with_name(out.name + ".done")
    if out.exists() and not resume:
        raise ValueError(f"{out} exists: continue it with --resume, or choose another --out")
    if not resume:
        done_file.unlink(missing_ok=True)  # a stale record of another collection into this path
    task = load_task(spec.task, spec.data)
    workflow = load_workflow(spec.workflow, task, spec.workflow_options)
    unknown = set(keep.roles) - set(workflow.roles)
    if unknown:
        raise ValueError(
            f"--roles {sorted(unknown)} are not roles of {spec.workflow}: {list(workflow.roles)}"
        )
    examples = spec_examples(task, spec)
    done = _resume(out, done_file) if resume else set()
    out.parent.mkdir(parents=True, exist_ok=True)
    policy, cfg, _ = spec_policy(spec, workflow.roles)
    todo = [i for i, ex in enumerate(examples) if ex.id not in done]
    counts = {"examples": len(done), "episodes": 0, "kept_episodes": 0, "calls": 0}
    total = len(examples) * spec.n
    with ProgressBar("collect", total, completed=len(done) * spec.n, enabled=spec.progress) as bar:
        for chunk, episodes in rollouts(spec, workflow, policy, cfg, examples, todo, bar, len(done) * spec.n):
            rows = []
            for example, eps in zip(chunk, episodes, strict=True):
                calls = kept_calls(eps, keep)
                counts["episodes"] += len(eps)
                counts["kept_episodes"] += len({j for j, _ in calls})
                rows += [_row(policy, example.id, j, eps[j], t) for j, t in calls]
            counts["examples"] += len(chunk)
            counts["calls"] += len(rows)
            append_lines(
                out, [json.dumps(r) for r in rows]
            )  # rows first: `_resume` drops a chunk not marked done
            append_lines(done_file, [ex.id for ex in chunk])
            bar.update(counts["examples"] * spec.n, f"{counts['calls']} calls kept")
    out.touch()
    log_line(
        f"{out}: {counts['calls']} calls from {counts['kept_episodes']} of {counts['episodes']} episodes "
        f"(keep {keep.episodes}{', roles ' + ','.join(keep.roles) if keep.roles else ''}"
        f"{f', own reward >= {keep.min_reward}' if keep.min_reward is not None else ''})"
    )
    return counts


def _row(policy, example_id: str, sample: int, episode: Episode, turn: Turn) -> dict[str, Any]:
    tokenizer = policy.tokenizer_of(turn.role)
    return {
        "role": turn.role,
        "prompt_ids": turn.prompt_ids,
        "completion_ids": turn.completion_ids,
        "kinds": turn.kinds,
        "versions": versions_to_runs(turn.version_list()),  # [[version, count], ...] (`Turn.versions`)
        "vocab": len(tokenizer),
        "example": example_id,
        "sample": sample,
        "reward": episode.own_reward(turn),
        "text": tokenizer.decode(turn.completion_ids, skip_special_tokens=False),
    }


def _resume(out: Path, done_file: Path) -> set[str]:
    """The examples done; rows of any other example (a chunk cut short by a kill) are dropped from `out`."""
    done = set(done_file.read_text().split("\n")) - {""} if done_file.exists() else set()
    if out.exists():
        lines = out.read_text().split("\n")
        keep = []
        for line in lines:
            try:
                row = json.loads(line) if line.strip() else None
            except json.JSONDecodeError:
                row = None  # a line cut short by a kill
            if row is not None and row.get("example") in done:
                keep.append(line)
        if len(keep) != sum(bool(x.strip()) for x in lines):
            tmp = out.with_name(out.name + ".tmp")
            tmp.write_text("".join(line + "\n" for line in keep))
            tmp.replace(out)
    return done
