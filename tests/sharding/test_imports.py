"""Layering: raydlrm.sharding never imports ray or raydlrm.ingestion."""

from __future__ import annotations

import ast
from pathlib import Path

import raydlrm.sharding

FORBIDDEN = ("ray", "raydlrm.ingestion", "raydlrm.trainers", "raydlrm.platform")


def _imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_sharding_imports_neither_ray_nor_ingestion() -> None:
    files = sorted(Path(raydlrm.sharding.__file__).parent.glob("*.py"))
    assert len(files) >= 6
    for path in files:
        for name in _imported_modules(path):
            assert not any(name == f or name.startswith(f + ".") for f in FORBIDDEN), (
                f"{path.name} imports {name}"
            )
