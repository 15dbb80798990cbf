"""The import drawing (shared/DESIGN.md): `gpt_jax` below `inference` below `training`, no
module imported back by one it imports, and command modules imported by no library.

Every module of gpt_jax/, inference/ and training/ is parsed with `ast` (nothing is
imported), every import statement counted, also those inside functions: an import made
lazily still ties the two modules together."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("gpt_jax", "inference", "training")
DISPATCHER = "gpt_jax.cli"  # `gpt-jax`: imports each command lazily (its docstring)


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    """Every module of the three packages, by dotted name (a package by its own name)."""
    return {module_name(p): p for package in PACKAGES
            for p in sorted((ROOT / package).rglob("*.py"))}


def imported(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of `known` that module `name` (at `path`) imports: `from a import b` is
    a.b when that is a module, else a; `import a.b` is a.b (the most specific known)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, `level - 1` floors up
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                       for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import a.b.c` of a non-module c
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imported(name, path, set(mods)) for name, path in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of two or more modules (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) >= 2:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def floor(name: str) -> str:
    return name.split(".")[0]


def test_the_graph_sees_imports_of_every_form():
    graph = import_graph()
    assert "inference.engine" in graph["inference.llm"]  # from inference.engine import Engine
    assert "gpt_jax.checkpoint" in graph["inference.load"]  # from gpt_jax import checkpoint
    assert DISPATCHER in graph and "training.train" in graph[DISPATCHER]  # inside a function
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_points_up():
    """gpt_jax (but its dispatcher) imports neither inference nor training; inference does
    not import training."""
    above = {"gpt_jax": {"inference", "training"}, "inference": {"training"}, "training": set()}
    upward = sorted((name, target) for name, targets in import_graph().items()
                    if name != DISPATCHER for target in targets
                    if floor(target) in above[floor(name)])
    assert upward == []


def test_no_import_cycle():
    assert cycles(import_graph()) == []


@pytest.mark.parametrize("package", PACKAGES)
def test_no_module_but_the_dispatcher_imports_from_a_command_module(package):
    """The issue's acceptance: `grep -rn "from gpt_jax.cli\\|from inference.cli" gpt_jax
    inference training` finds nothing outside the dispatcher (models load through
    inference/load.py; process helpers are in training/process.py)."""
    pattern = re.compile(r"from gpt_jax.cli|from inference.cli")
    hits = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
            for path in sorted((ROOT / package).rglob("*")) if path.is_file()
            and "__pycache__" not in path.parts and path != ROOT / "gpt_jax" / "cli.py"
            for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
            if pattern.search(line)]
    assert hits == []
