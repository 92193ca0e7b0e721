"""Arrow type predicates shared by the schema checks, the preprocessor and the bad-input checks."""

from __future__ import annotations

import pyarrow as pa

__all__ = ["is_list", "is_string"]


def is_list(type_: pa.DataType) -> bool:
    """A list (or large list) column: one id list per row."""
    return pa.types.is_list(type_) or pa.types.is_large_list(type_)


def is_string(type_: pa.DataType) -> bool:
    """String or binary ids (hashed by their bytes)."""
    return (
        pa.types.is_string(type_)
        or pa.types.is_large_string(type_)
        or pa.types.is_binary(type_)
        or pa.types.is_large_binary(type_)
    )
