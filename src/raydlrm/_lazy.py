"""Lazy package exports (PEP 562): a package names its public names once, by the submodule that
defines them, and imports that submodule on the first use of one of them.

Importing any module of a package runs the package's ``__init__``: with eager re-exports, the
config of the command line (``raydlrm --help``, ``config show``) or a Ray Data actor that
unpickles a preprocessor would import torch, Ray and MLflow first, seconds each time.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str, exports: dict[str, tuple[str, ...]], namespace: dict[str, Any]
) -> tuple[list[str], Callable[[str], Any], Callable[[], list[str]]]:
    """``__all__``, ``__getattr__`` and ``__dir__`` of ``package`` (its ``__name__``), whose
    public names are ``exports`` (submodule -> names) and whose globals are ``namespace``.

    Example::

        __all__, __getattr__, __dir__ = lazy_exports(__name__, {"config": ("X",)}, globals())
    """
    module_of = {name: module for module, names in exports.items() for name in names}

    def getattr_(name: str) -> Any:
        module = module_of.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        namespace[name] = value  # later look-ups skip this function
        return value

    def dir_() -> list[str]:
        return sorted({*namespace, *module_of})

    return sorted(module_of), getattr_, dir_
