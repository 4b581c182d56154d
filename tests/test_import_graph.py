"""The package's modules form layers: no import cycle, whether the imports run when a module is loaded or
only when a function runs (a deferred import), counting the package `__init__.py` files that an import runs
on the way; no cycle between its first-level packages either; and the pipeline's stages are layered: the
prompt sources reach none of the later stages, and the target never imports the feature capture built on
it. The graph is read from the source with `ast`, so the test does not depend on the order in which modules
happen to be imported."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.paths import REPO

PACKAGE = REPO / "dflash_train"


def module_files(package: Path = PACKAGE) -> dict[str, Path]:
    """Every module of `package` by dotted name (a package by its own name, for its __init__.py)."""
    modules = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, top_level_only: bool) -> Iterator[ast.Import | ast.ImportFrom]:
    """Import statements, skipping `if TYPE_CHECKING:` blocks (never run) and, if asked, function bodies."""
    for child in ast.iter_child_nodes(tree):
        if isinstance(child, ast.If) and _is_type_checking(child):
            continue
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        elif not (top_level_only and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))):
            yield from _imports(child, top_level_only)


def _imported_names(module: str, is_package: bool, node: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:  # relative: resolved against the importing module's package
        package = module.split(".") if is_package else module.split(".")[:-1]
        base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
    # `from a import b` loads `a`, and `a.b` too when b is a submodule.
    return [base] + [f"{base}.{alias.name}" for alias in node.names]


def import_graph(top_level_only: bool, with_parents: bool, package: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the package's modules it imports. `with_parents` adds the packages whose __init__.py an
    import runs on the way (importing a.b.c runs a and a.b first)."""
    modules = module_files(package)
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        targets: set[str] = set()
        for node in _imports(tree, top_level_only):
            for name in _imported_names(module, path.name == "__init__.py", node):
                parts = name.split(".")
                prefixes = [".".join(parts[:k]) for k in range(1, len(parts) + 1)] if with_parents else [name]
                targets.update(prefixes)
        # A module's own packages are loaded before it: not edges out of it.
        graph[module] = {t for t in targets if t in modules and t != module and not module.startswith(t + ".")}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as [a, b, ..., a], or None (depth-first search, iterative)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    for root in sorted(graph):
        if root in state:
            continue
        path, stack = [root], [iter(sorted(graph[root]))]
        state[root] = 1
        while stack:
            successor = next(stack[-1], None)
            if successor is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(successor) == 1:
                return path[path.index(successor):] + [successor]
            elif successor not in state:
                state[successor] = 1
                path.append(successor)
                stack.append(iter(sorted(graph[successor])))
    return None


def package_of(module: str) -> str:
    """The first-level package (or top-level module) of `module`: dflash_train.data.chat -> dflash_train.data."""
    return ".".join(module.split(".")[:2])


def package_graph(graph: dict[str, set[str]], root: str = "dflash_train") -> dict[str, set[str]]:
    """`graph` collapsed per first-level package: X -> Y when a module of X imports one of Y (X != Y). The
    root package itself (its __init__.py, which every import runs) is no node."""
    packages: dict[str, set[str]] = {}
    for module, targets in graph.items():
        if module == root:
            continue
        edges = packages.setdefault(package_of(module), set())
        edges.update(package_of(t) for t in targets if t != root)
    for package, edges in packages.items():
        edges.discard(package)
    return packages


def reachable(graph: dict[str, set[str]], start: str) -> dict[str, list[str]]:
    """Every node reachable from `start`, with one path to it ([start, ..., node])."""
    paths, stack = {start: [start]}, [start]
    while stack:
        node = stack.pop()
        for successor in sorted(graph.get(node, ())):
            if successor not in paths:
                paths[successor] = [*paths[node], successor]
                stack.append(successor)
    return paths


# package -> the packages it must not reach, even through others (the pipeline's layers)
FORBIDDEN = {
    "dflash_train.prompts": {"dflash_train.data", "dflash_train.regeneration", "dflash_train.features",
                             "dflash_train.eval", "dflash_train.training"},
    "dflash_train.target": {"dflash_train.features"},
}


def test_find_cycle_sees_a_cycle_and_a_layering() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_relative_and_from_imports_resolve_to_modules() -> None:
    node = ast.parse("from ..data import prepared").body[0]
    assert isinstance(node, ast.ImportFrom)
    names = _imported_names("dflash_train.commands.eval", False, node)
    assert names == ["dflash_train.data", "dflash_train.data.prepared"]


def test_the_graph_sees_deferred_imports() -> None:
    # demo.py imports what loads torch inside functions (after setting its environment); a graph without
    # deferred imports would miss those edges.
    deferred = import_graph(top_level_only=False, with_parents=False)["dflash_train.demo"]
    top = import_graph(top_level_only=True, with_parents=False)["dflash_train.demo"]
    assert "dflash_train.data.prepared" in deferred - top


def test_no_cycle_among_top_level_imports() -> None:
    """What runs when a module is loaded, package __init__ files included: a cycle here fails at import time
    depending on which module is imported first."""
    cycle = find_cycle(import_graph(top_level_only=True, with_parents=True))
    assert cycle is None, f"import cycle at load time: {' -> '.join(cycle or [])}"


def test_the_graph_sees_a_cycle_through_a_package_init(tmp_path: Path) -> None:
    """A deferred import of `pkg.ckpt.weights` runs `pkg/ckpt/__init__.py` first, and that leads back to the
    importer: a cycle that only the edges to parent packages show."""
    sources = {
        "__init__.py": "",
        "loader.py": "def load():\n    from pkg.ckpt.weights import damaged\n",
        "ckpt/__init__.py": "from pkg.ckpt.check import check\n",
        "ckpt/check.py": "from pkg.ckpt.info import facts\n",
        "ckpt/info.py": "def facts():\n    from pkg.loader import load\n",
        "ckpt/weights.py": "damaged = None\n",
    }
    for name, text in sources.items():
        (tmp_path / "pkg" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "pkg" / name).write_text(text)
    assert find_cycle(import_graph(top_level_only=False, with_parents=False, package=tmp_path / "pkg")) is None
    cycle = find_cycle(import_graph(top_level_only=False, with_parents=True, package=tmp_path / "pkg"))
    assert cycle == ["pkg.ckpt", "pkg.ckpt.check", "pkg.ckpt.info", "pkg.loader", "pkg.ckpt"]


def test_no_cycle_through_deferred_imports() -> None:
    """A module that imports a module importing it back, if only inside a function, or through the
    `__init__.py` of a package on the way, has no layer of its own: move what both need into a module below
    them both."""
    cycle = find_cycle(import_graph(top_level_only=False, with_parents=True))
    assert cycle is None, f"import cycle (deferred imports and package __init__ files included): {' -> '.join(cycle or [])}"


def test_package_graph_collapses_modules_into_their_packages() -> None:
    graph = {"dflash_train": {"dflash_train.a"}, "dflash_train.a.x": {"dflash_train.a.y", "dflash_train.b.z"},
             "dflash_train.a.y": {"dflash_train"}, "dflash_train.b.z": {"dflash_train.c"}, "dflash_train.c": set()}
    packages = package_graph(graph)
    assert packages == {"dflash_train.a": {"dflash_train.b"}, "dflash_train.b": {"dflash_train.c"},
                        "dflash_train.c": set()}
    assert reachable(packages, "dflash_train.a")["dflash_train.c"] == ["dflash_train.a", "dflash_train.b",
                                                                       "dflash_train.c"]


def test_no_cycle_between_packages() -> None:
    """Packages (and top-level modules) form layers too: a package that imports another that imports it
    back, however deep in either, has no place in the pipeline's order."""
    cycle = find_cycle(package_graph(import_graph(top_level_only=False, with_parents=False)))
    assert cycle is None, f"package cycle: {' -> '.join(cycle or [])}"


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_the_stages_are_layered(package: str) -> None:
    """prompts/ is the first stage: it reaches none of regeneration, data, features, eval or training; the
    target package never imports features/, which is built on it."""
    paths = reachable(package_graph(import_graph(top_level_only=False, with_parents=False)), package)
    reached = sorted(FORBIDDEN[package] & set(paths))
    assert not reached, f"{package} reaches {reached}: " + "; ".join(" -> ".join(paths[r]) for r in reached)


def test_every_module_imports_in_a_fresh_interpreter() -> None:
    names = sorted(module_files())
    script = "import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module(name)\n"
    done = subprocess.run([sys.executable, "-c", script, *names], capture_output=True, text=True,
                          cwd=PACKAGE.parent, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
