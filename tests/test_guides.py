"""The guides under docs/guides/ run as written: their commands, files and configs are the test's input.

The convention (what a guide author writes, and what this file does with it):

- A fenced ```` ```bash ```` block is commands. Each guide's bash blocks, in document order, make one
  script that runs under `bash -euo pipefail` in a fresh empty directory, with the venv's `bin` first on
  PATH (the installed `rolerl`), as a reader would type them one after the other (a `cd` carries over).
- A bash block titled `long...` (```` ```bash title="long: about 2 minutes" ````) is not run: only the
  quick tour's `rolerl demo --quick` is one. A bash block titled `setup...` (installing rolerl from a
  checkout) is not run either; its `make` targets must exist in the Makefile.
- A fenced block of any other language with a file name as its title (```` ```python title="my_task.py"
  ````) is that file: the script writes it (a quoted heredoc) where the block stands, in the current
  directory. Files can also be written by the commands themselves (`cat > data.jsonl <<'EOF'`).
- Every ```` ```yaml ```` block is a run configuration: it must load with rolerl's config loader, and
  when it names a built-in workflow, its topology must build for that workflow's roles (the topology
  guide's snippets), so a snippet with a wrong key, value or table fails here.
- Links between docs pages must point at an existing page and heading; nothing may link out of docs/
  (mkdocs builds the docs in strict mode: code and configs are named in code spans instead).

The runs are tiny (2 steps, short generations) but use the real default model, so the command tests are
`slow` (CI runs them with `make test-all`).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GUIDES = ROOT / "docs" / "guides"
NAMES = ("quick-tour", "topology", "own-workflow")
FENCE = re.compile(
    r"^```(?P<lang>[\w-]*)(?P<info>[^\n]*)\n(?P<body>.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL
)
TITLE = re.compile(r'title="([^"]*)"')


@dataclass(frozen=True)
class Block:
    lang: str
    title: str  # "" when the block has none
    body: str
    line: int  # where the block starts in the guide (for messages)


def blocks(name: str) -> list[Block]:
    text = (GUIDES / f"{name}.md").read_text()
    out = []
    for m in FENCE.finditer(text):
        title = TITLE.search(m["info"])
        out.append(
            Block(m["lang"], title.group(1) if title else "", m["body"], text.count("\n", 0, m.start()) + 1)
        )
    return out


def is_file_block(b: Block) -> bool:
    return b.lang != "bash" and bool(b.title) and "/" not in b.title and "." in b.title


def script(name: str) -> str:
    """The guide's commands and files as one bash script (see the module docstring)."""
    parts = []
    for b in blocks(name):
        if b.lang == "bash" and not b.title.startswith(("long", "setup")):
            parts.append(f"echo {shlex.quote(f'--- {name}.md line {b.line}')}\n{b.body}")
        elif is_file_block(b):
            assert "ROLERL_GUIDE_EOF" not in b.body
            parts.append(f"cat > {shlex.quote(b.title)} <<'ROLERL_GUIDE_EOF'\n{b.body}ROLERL_GUIDE_EOF")
    return "\n".join(parts) + "\n"


def run_guide(name: str, tmp_path: Path) -> float:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("PYTHONPATH", None)  # the guide's own modules must import as a user's would: from the directory
    start = time.perf_counter()
    proc = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script(name)], cwd=tmp_path, env=env, capture_output=True,
        text=True, timeout=1800,
    )  # fmt: skip
    took = time.perf_counter() - start
    assert proc.returncode == 0, (
        f"{name}.md failed after {took:.0f} s:\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
    )
    return took


def test_every_guide_has_commands_and_only_the_demo_is_skipped():
    skipped = [
        (n, b.body) for n in NAMES for b in blocks(n) if b.lang == "bash" and b.title.startswith("long")
    ]
    # the demo, and the report of the directory it writes
    assert skipped == [
        ("quick-tour", "rolerl demo --quick --run-dir runs/demo-quick\nrolerl report runs/demo-quick\n")
    ]
    for name in NAMES:
        assert any(b.lang == "bash" and not b.title for b in blocks(name)), f"{name}.md runs no command"


def test_setup_blocks_name_makefile_targets():
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([\w-]+):", makefile, re.MULTILINE))
    setup = [b for n in NAMES for b in blocks(n) if b.lang == "bash" and b.title.startswith("setup")]
    assert setup, "the quick tour shows how to install"
    named = {t for b in setup for t in re.findall(r"^make ([\w-]+)", b.body, re.MULTILINE)}
    assert named and named <= targets, f"make targets {sorted(named - targets)} are not in the Makefile"


def yaml_blocks() -> list:
    return [pytest.param(b, id=f"{n}.md:{b.line}") for n in NAMES for b in blocks(n) if b.lang == "yaml"]


@pytest.mark.parametrize("block", yaml_blocks())
def test_guide_configs_load_and_their_topologies_build(tmp_path, block):
    from rolerl.config import load_config
    from rolerl.workflows import WORKFLOWS

    try:
        from rolerl.run.policy import build_topology
    except ImportError:  # before the shared assembly code moved below train/ and eval/
        from rolerl.train.policy import build_topology

    path = tmp_path / "config.yaml"
    path.write_text(block.body)
    cfg = load_config(path)  # a ConfigError names the field
    if cfg.task.workflow in WORKFLOWS:
        topology = build_topology(cfg, WORKFLOWS[cfg.task.workflow].roles)
        assert topology.preset == cfg.adapters.preset
        assert set(topology.roles) == set(WORKFLOWS[cfg.task.workflow].roles)


def test_topology_guide_has_a_snippet_per_preset(tmp_path):
    from rolerl.config import load_config

    found = {}
    for b in blocks("topology"):
        if b.lang == "yaml" and b.title:
            (tmp_path / b.title).write_text(b.body)
            found[b.title] = load_config(tmp_path / b.title).adapters.preset
    presets = ("shared", "dart", "isolated", "masked", "separate", "custom")
    assert found == {f"{p}.yaml": p for p in presets}


def _slug(heading: str) -> str:
    """Python-Markdown's toc anchor of a heading (code spans and links rendered to their text)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def test_guide_links_stay_in_docs_and_point_at_headings():
    docs = (ROOT / "docs").resolve()
    for name in NAMES:
        text = (GUIDES / f"{name}.md").read_text()
        prose = FENCE.sub("", text)
        for target in re.findall(r"\]\(([^)\s]+)\)", prose):
            if target.startswith(("http://", "https://")):
                continue
            page, _, anchor = target.partition("#")
            path = (GUIDES / page).resolve() if page else GUIDES / f"{name}.md"
            assert path.is_relative_to(docs), f"{name}.md links out of docs/: {target} (use a code span)"
            assert path.is_file(), f"{name}.md links to a missing page: {target}"
            if anchor:
                headings = re.findall(r"^#+ (.+)$", FENCE.sub("", path.read_text()), re.MULTILINE)
                assert anchor in {_slug(h) for h in headings}, f"{name}.md: no heading #{anchor} in {page}"


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_guide_runs_as_written(tmp_path, name):
    took = run_guide(name, tmp_path)
    print(f"{name}.md ran in {took:.1f} s")
