"""The package's layout: ``client/`` and ``server/`` never import each other (they meet in ``stage_api.py``)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import lightning_swarm

PACKAGE = Path(lightning_swarm.__file__).parent


def imported(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth of its code."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


@pytest.mark.parametrize(("side", "other"), [("client", "server"), ("server", "client")])
def test_client_and_server_do_not_import_each_other(side, other):
    files = sorted((PACKAGE / side).glob("*.py"))
    assert files
    crossing = {
        f"{path.name} imports {name}"
        for path in files
        for name in imported(path)
        if name == f"lightning_swarm.{other}" or name.startswith(f"lightning_swarm.{other}.")
    }
    assert not crossing, crossing
