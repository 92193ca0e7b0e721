"""The import layering, checked by parsing every module's imports.

platform -> trainers -> sharding -> models -> batch, trainers -> ingestion -> batch; every
layer may use the layer-neutral root modules (``batch``, ``storage``, ``ids``, ``_config``,
``_logs``, ...); ingestion and sharding never import each other; only ingestion, platform and
trainers/_ray.py import ray at run time (a type-only import under ``TYPE_CHECKING`` is allowed);
no module imports the root package ``raydlrm`` itself or another package's private
(``_``-prefixed) module; and no modules import each other in a circle (type-only imports
count: they are edges a reader follows).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "raydlrm"
COMMON = {
    "batch",
    "_config",
    "_versions",
    "_errors",
    "storage",
    "ids",
    "_logs",
    "_lazy",
    "_sampling",
    "_text",
}
ALLOWED = {
    "_lazy": set(),
    "_config": set(),
    "_errors": set(),
    "_versions": set(),
    "_ray_setup": set(),
    "batch": {"_config", "_versions"},
    "storage": {"_config"},
    "ids": {"_config"},
    "_logs": set(),
    "_sampling": set(),
    "_text": set(),
    "models": COMMON,
    "sharding": COMMON | {"models"},
    "ingestion": COMMON,
    "trainers": COMMON | {"models", "sharding", "ingestion"},
    "platform": COMMON | {"models", "sharding", "ingestion", "trainers"},
}


def _layer(path: Path) -> str:
    rel = path.relative_to(SRC)
    return rel.parts[0].removesuffix(".py") if len(rel.parts) > 1 else rel.stem


def _module(path: Path) -> str:
    parts = ("raydlrm", *path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and ast.unparse(node.test) in (
        "TYPE_CHECKING",
        "typing.TYPE_CHECKING",
    )


def _imports(path: Path) -> dict[str, bool]:
    """Every absolute import of the module -> whether it is type-only (under TYPE_CHECKING);
    ``from a.b import c`` counts as ``a.b.c``, which is a module or a name in ``a.b``."""
    names: dict[str, bool] = {}

    def visit(nodes: list[ast.AST], type_only: bool) -> None:
        for child in nodes:
            if isinstance(child, ast.Import):
                for a in child.names:
                    names[a.name] = names.get(a.name, True) and type_only
            elif isinstance(child, ast.ImportFrom) and child.module:
                assert child.level == 0, f"{path.name}: a relative import (use the dotted name)"
                for a in child.names:
                    name = f"{child.module}.{a.name}"
                    names[name] = names.get(name, True) and type_only
            if _is_type_checking(child):  # only its body is type-only, not an else branch
                visit(child.body, True)
                visit(child.orelse, type_only)
            else:
                visit(list(ast.iter_child_nodes(child)), type_only)

    visit(list(ast.parse(path.read_text()).body), False)
    return names


MODULES = sorted(p for p in SRC.rglob("*.py") if _layer(p) in ALLOWED)
ALL_MODULES = {_module(p): p for p in SRC.rglob("*.py")}


def _problems(path: Path, imports: dict[str, bool]) -> list[str]:
    """What breaks the layering among ``imports`` (name -> type-only) of the module ``path``."""
    layer, own = _layer(path), _module(path)
    package = own if path.name == "__init__.py" else own.rpartition(".")[0]
    problems = []
    for name, type_only in imports.items():
        parts = name.split(".")
        if parts[0] == "raydlrm":
            if f"raydlrm.{parts[1:2][0] if parts[1:] else ''}" not in ALL_MODULES:
                problems.append(f"imports the root package ({name})")
                continue
            if parts[1] != layer and parts[1] not in ALLOWED[layer]:
                problems.append(f"({layer}) imports {name}")
            for i in range(2, len(parts)):
                module = ".".join(parts[: i + 1])
                if parts[i].startswith("_") and module in ALL_MODULES:
                    owner = ".".join(parts[:i])
                    if owner != package:
                        problems.append(f"imports {name}, a private module of {owner}")
                    break
        seam = layer in ("ingestion", "platform") or path == SRC / "trainers" / "_ray.py"
        if parts[0] == "ray" and not type_only and not seam:
            problems.append("imports ray; only ingestion, platform and trainers/_ray.py may")
    return problems


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(SRC)))
def test_imports_follow_layers(path: Path) -> None:
    assert _problems(path, _imports(path)) == []


def _edges() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for module, path in ALL_MODULES.items():
        targets = set()
        for name in _imports(path):
            while name and name not in ALL_MODULES:
                name = name.rpartition(".")[0]
            # A package's __init__ re-exporting its own modules is not a circle of its own.
            if name and name != module and not module.startswith(name + "."):
                targets.add(name)
        edges[module] = targets
    return edges


def _circles(edges: dict[str, set[str]]) -> list[str]:
    """The modules of ``edges`` (module -> modules it imports) that import themselves through
    others."""
    circles = []
    for start in edges:
        # Modules reachable from ``start`` that reach it back.
        seen, stack = set(), [start]
        while stack:
            for nxt in edges[stack.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
        if start in seen:
            circles.append(start)
    return sorted(circles)


def test_no_import_circles() -> None:
    assert _circles(_edges()) == [], "modules in import circles"


def test_the_checks_can_fail(tmp_path: Path) -> None:
    """Each rule sees its kind of forbidden import (a type-only ray import passes)."""
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import raydlrm\nfrom raydlrm.trainers._ray import report\n"
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import ray.train\n"
    )
    names = _imports(bad)
    assert names == {
        "raydlrm": False,
        "raydlrm.trainers._ray.report": False,
        "typing.TYPE_CHECKING": False,
        "ray.train": True,
    }
    platform, sharding = SRC / "platform" / "x.py", SRC / "sharding" / "x.py"
    assert _problems(platform, names) == [
        "imports the root package (raydlrm)",
        "imports raydlrm.trainers._ray.report, a private module of raydlrm.trainers",
    ]
    assert _problems(platform, {"raydlrm.platform._reaper": False, "raydlrm._logs": False}) == []
    assert _problems(sharding, {"ray": False, "raydlrm.trainers.loop.Trainer": False}) == [
        "imports ray; only ingestion, platform and trainers/_ray.py may",
        "(sharding) imports raydlrm.trainers.loop.Trainer",
    ]
    assert _problems(sharding, {"ray.train": True}) == []
    assert _problems(platform, {"raydlrm.train": False}) == [
        "imports the root package (raydlrm.train)"
    ]
    # Only trainers/_ray.py is the seam, not any _ray.py; only a TYPE_CHECKING body is
    # type-only.
    assert _problems(SRC / "sharding" / "_ray.py", {"ray": False}) != []
    branches = tmp_path / "branches.py"
    branches.write_text("if TYPE_CHECKING:\n    import ray\nelse:\n    import ray.data\n")
    assert _imports(branches) == {"ray": True, "ray.data": False}
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c"]


def test_every_layer_has_modules() -> None:
    assert {_layer(p) for p in MODULES} >= set(ALLOWED)
