"""The example configs that ship inside the package, found by name.

`rolerl train voting`, `rolerl configs list`, `rolerl configs copy voting my.yaml`: a name is a file's stem
here (`voting` or `voting.yaml`). A path that exists always wins over a name, so a user's own `voting.yaml`
in the working directory is the one read.
"""

from __future__ import annotations

from pathlib import Path

DIR = Path(__file__).parent


def names() -> list[str]:
    """Every example's name, sorted."""
    return sorted(p.stem for p in DIR.glob("*.yaml"))


def path_of(name: str) -> Path | None:
    """The example called `name` (`voting` or `voting.yaml`), or None."""
    stem = name.removesuffix(".yaml")
    path = DIR / f"{stem}.yaml"
    return path if "/" not in name and "\\" not in name and stem in names() else None


def describe(name: str) -> str:
    """The first sentence of the example's leading comment, on one line."""
    path = path_of(name)
    if path is None:
        raise KeyError(name)
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    text = " ".join(lines)
    end = text.find(". ")
    return text if end < 0 else text[: end + 1]


def resolve(spec: str | Path) -> Path:
    """`spec` as a path when something is there (a missing file or a directory is the caller's error to
    name), else the example of that name; a path that is neither is returned as given."""
    path = Path(spec)
    if path.exists():
        return path
    return path_of(str(spec)) or path
