"""The import layering of DESIGN.md, checked by parsing every module's imports.

platform -> trainers -> sharding -> models -> batch, trainers -> ingestion -> batch; every
layer may use the layer-neutral ``storage`` and ``_logs`` modules;
ingestion and sharding never import each other; only ingestion, platform and trainers/_ray.py
import ray.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "raydlrm"
COMMON = {"batch", "_config", "_versions", "_errors", "storage", "_logs"}
ALLOWED = {
    "batch": {"_config", "_versions"},
    "storage": {"_config"},
    "_logs": set(),
    "models": COMMON,
    "sharding": COMMON | {"models"},
    "ingestion": COMMON,
    "trainers": COMMON | {"models", "sharding", "ingestion"},
    "platform": COMMON | {"models", "sharding", "ingestion", "trainers"},
}


def _layer(path: Path) -> str:
    rel = path.relative_to(SRC)
    return rel.parts[0].removesuffix(".py") if len(rel.parts) > 1 else rel.stem


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


MODULES = sorted(p for p in SRC.rglob("*.py") if _layer(p) in ALLOWED)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(SRC)))
def test_imports_follow_layers(path: Path) -> None:
    layer = _layer(path)
    for name in _imports(path):
        parts = name.split(".")
        if parts[0] == "raydlrm" and len(parts) > 1 and parts[1] != layer:
            assert parts[1] in ALLOWED[layer], f"{path.name} ({layer}) imports {name}"
        if parts[0] == "ray":
            ok = layer in ("ingestion", "platform") or path.name == "_ray.py"
            assert ok, (
                f"{path.relative_to(SRC)} imports ray; only ingestion, platform and "
                "trainers/_ray.py may"
            )


def test_every_layer_has_modules() -> None:
    assert {_layer(p) for p in MODULES} >= set(ALLOWED)
