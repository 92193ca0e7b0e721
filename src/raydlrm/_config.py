"""The decorator every layer's config dataclass uses.

Configs are typed dataclasses validated by pydantic: wrong types, unknown keys (``extra="forbid"``)
and values outside a ``Literal`` are rejected with the field's dotted name. Each config may add
its own checks in ``__post_init__`` and raise ``ValueError`` naming the field.
"""

from __future__ import annotations

from typing import TypeVar

from pydantic import ConfigDict
from pydantic.dataclasses import dataclass

T = TypeVar("T")

_CONFIG = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)


def config_dataclass(cls: type[T]) -> type[T]:
    """Makes ``cls`` a validated config dataclass that rejects unknown keys."""
    return dataclass(config=_CONFIG)(cls)
