"""rolerl's packages import one another in one direction: evaluation imports nothing of training, and no
circle runs between packages. Imports inside functions count too (deferring an import hides a circle from
Python, not from the design)."""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "rolerl"
# Circles not removed yet, as the import that closes each (importer -> imported, why). The check ignores these
# edges and fails on any other circle, and on an entry here once its imports are gone (then delete it).
KNOWN: dict[tuple[str, str], str] = {}  # none now: rolerl's packages import one way


def imported(path: Path, root: Path = ROOT) -> Iterator[tuple[str, int]]:
    """Every module name `path` imports, anywhere in the file, with its line; `from x import a` names `x.a`
    (so `from rolerl import gemm` is the module `rolerl.gemm`), relative imports made absolute."""
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    package = parts[:-1]  # an __init__'s package is its directory, like any module's
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + (node.module.split(".") if node.module else []))
            for alias in node.names:
                yield f"{module}.{alias.name}", node.lineno


def units(root: Path = ROOT) -> set[str]:
    """The layers: each subpackage and each top-level module of `root`."""
    names = {p.stem for p in root.iterdir() if p.suffix == ".py" or (p / "__init__.py").is_file()}
    return names - {"__init__"}


def unit_of(module: str, names: set[str], top: str = "rolerl") -> str | None:
    """The unit `module` lies in; `top` for the package's own names (`rolerl.__version__`); None outside."""
    parts = module.split(".")
    if parts[0] != top:
        return None
    return parts[1] if len(parts) > 1 and parts[1] in names else top


def graph(root: Path = ROOT) -> dict[str, dict[str, list[str]]]:
    """unit -> imported unit -> where (`path:line`), over every `.py` file under `root`."""
    names = units(root)
    edges: dict[str, dict[str, list[str]]] = {}
    for path in sorted(root.rglob("*.py")):
        src = unit_of(".".join(path.relative_to(root.parent).with_suffix("").parts), names, root.name)
        for module, line in imported(path, root):
            dst = unit_of(module, names, root.name)
            if dst is not None and dst != src:
                where = f"{path.relative_to(root.parent)}:{line}"
                edges.setdefault(src, {}).setdefault(dst, []).append(where)
    return edges


def find_cycle(edges: Mapping[str, Mapping[str, object]]) -> list[str] | None:
    """A circle of `edges` as its nodes, the first repeated at the end; None when the graph is acyclic."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, {})):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return None


def describe(cycle: list[str], edges: Mapping[str, Mapping[str, list[str]]]) -> str:
    """Each edge of `cycle` with (up to three of) the imports that make it."""
    steps = zip(cycle, cycle[1:], strict=False)
    return "; ".join(f"{a} -> {b} ({', '.join(list(dict.fromkeys(edges[a][b]))[:3])})" for a, b in steps)


def test_eval_imports_nothing_of_training():
    found = [
        f"{path.relative_to(ROOT.parent)}:{line} imports {module}"
        for path in sorted((ROOT / "eval").rglob("*.py"))
        for module, line in imported(path, ROOT)
        if module == "rolerl.train" or module.startswith("rolerl.train.")
    ]
    assert not found, "evaluation must not import training (training uses evaluation):\n" + "\n".join(found)


def test_packages_import_one_way():
    edges = graph(ROOT)
    gone = [f"{a} -> {b}" for a, b in KNOWN if b not in edges.get(a, {})]
    assert not gone, f"no longer imported: delete {gone} from KNOWN"
    rest = {a: {b: where for b, where in out.items() if (a, b) not in KNOWN} for a, out in edges.items()}
    cycle = find_cycle(rest)
    assert cycle is None, f"an import circle between rolerl's packages: {describe(cycle, edges)}"


def test_the_check_sees_circles_through_imports_inside_functions(tmp_path):
    """The checker itself: a circle closed by an import inside a function, a relative import and a
    `from pkg import module` is found; without it, none is."""
    pkg = tmp_path / "pkg"
    for d in ("a", "b", "c"):
        (pkg / d).mkdir(parents=True)
        (pkg / d / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("__version__ = '0'\n")
    (pkg / "a" / "x.py").write_text("from pkg.b.y import f\nfrom pkg import __version__\n")
    (pkg / "b" / "y.py").write_text("from ..c import z\n\ndef f():\n    return z\n")
    (pkg / "c" / "z.py").write_text("def g():\n    from pkg import a\n    return a\n")
    edges = graph(pkg)
    assert edges == {
        "a": {"b": ["pkg/a/x.py:1"], "pkg": ["pkg/a/x.py:2"]},
        "b": {"c": ["pkg/b/y.py:1"]},
        "c": {"a": ["pkg/c/z.py:2"]},
    }
    assert find_cycle(edges) == ["a", "b", "c", "a"]
    (pkg / "c" / "z.py").write_text("def g():\n    return 1\n")
    assert find_cycle(graph(pkg)) is None
