"""The layering the code relies on: `common` imports nothing from `client` or `server`, and those two
plug their commands into `fedla` through entry points instead."""

from __future__ import annotations

import ast
from pathlib import Path

import typer.main

from common.cli.app import app

ROOT = Path(__file__).resolve().parent.parent
UPPER = ("client", "server")


def _imported_modules(tree: ast.AST) -> list[str]:
    """Every module an `import` or `from ... import` names, anywhere in the file (inside functions too)."""
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return names


def test_common_imports_neither_client_nor_server() -> None:
    files = sorted((ROOT / "common").rglob("*.py"))
    assert len(files) > 10  # the walk found the package
    upward = [
        (str(path.relative_to(ROOT)), name)
        for path in files
        for name in _imported_modules(ast.parse(path.read_text(), str(path)))
        if name.split(".")[0] in UPPER
    ]
    assert upward == []


def test_the_import_walk_sees_lazy_imports() -> None:
    source = "def f():\n    from server.dashboard import serve\n    import client.daemon\n"
    assert _imported_modules(ast.parse(source)) == ["server.dashboard", "client.daemon"]


def test_client_and_server_commands_are_plugged_in() -> None:
    commands = typer.main.get_command(app).commands
    assert {"bootstrap", "train-heads", "generate", "bench-decode"} <= set(commands)  # common's own
    assert {"dashboard", "dashboard-screenshot", "server"} <= set(commands)  # server/cli.py
    assert {"serve", "reset-ledger"} <= set(commands["client"].commands)  # client/cli.py, under `fedla client`
