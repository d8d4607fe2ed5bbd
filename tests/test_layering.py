"""The structure the code relies on: `common` imports nothing from `client` or `server`, those two never
import each other (they plug their commands into `fedla` through entry points instead), no module imports
itself back through others, and no module outgrows one sitting."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import typer.main

from common.cli.app import app

ROOT = Path(__file__).resolve().parent.parent


def _imported_modules(tree: ast.AST) -> list[str]:
    """Every module an `import` or `from ... import` names, anywhere in the file (inside functions too)."""
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return names


FORBIDDEN = {"common": {"client", "server"}, "client": {"server"}, "server": {"client"}}
PRODUCT = ("common", "client", "server", "simulations")
MAX_LINES = 400


def _modules() -> dict[str, Path]:
    """Dotted name -> file of every module of the product (a package by its __init__.py)."""
    found = {}
    for top in PRODUCT:
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_package_imports_a_layer_it_must_not(package: str) -> None:
    files = sorted((ROOT / package).rglob("*.py"))
    assert len(files) > 10  # the walk found the package
    wrong = [
        (str(path.relative_to(ROOT)), name)
        for path in files
        for name in _imported_modules(ast.parse(path.read_text(), str(path)))
        if name.split(".")[0] in FORBIDDEN[package]
    ]
    assert wrong == []


def _import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the product modules it imports (`from a.b import c` names a.b.c when that is a module)."""
    graph = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets |= {f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules}
                targets.add(node.module)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_circles() -> None:
    assert _circles(_import_graph(_modules())) == []


def test_the_circle_finder_finds_a_circle() -> None:
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_is_longer_than_one_sitting() -> None:
    long = {
        str(path.relative_to(ROOT)): n
        for path in _modules().values()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}, f"split these by job (at most {MAX_LINES} lines each)"


def test_the_import_walk_sees_lazy_imports() -> None:
    source = "def f():\n    from server.dashboard import serve\n    import client.daemon\n"
    assert _imported_modules(ast.parse(source)) == ["server.dashboard", "client.daemon"]


def test_client_and_server_commands_are_plugged_in() -> None:
    commands = typer.main.get_command(app).commands
    assert {"bootstrap", "train-heads", "generate", "bench-decode"} <= set(commands)  # common's own
    assert {"dashboard", "dashboard-screenshot", "server"} <= set(commands)  # server/cli.py
    assert {"serve", "reset-ledger"} <= set(commands["client"].commands)  # client/cli.py, under `fedla client`
