"""Arrow type predicates and array checks shared by the schema checks, the preprocessor and the
bad-input checks."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

__all__ = [
    "beyond_float32",
    "decode_dictionaries",
    "decoded_type",
    "flat_values",
    "int64_bits",
    "is_list",
    "is_string",
    "not_finite",
    "rows_with",
]


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


def decoded_type(type_: pa.DataType) -> pa.DataType:
    """The logical type of a column: a dictionary-encoded column (what Spark and pandas
    categoricals write) as its values' type, also inside a list."""
    if pa.types.is_dictionary(type_):
        return decoded_type(type_.value_type)
    if is_list(type_) and pa.types.is_dictionary(type_.value_type):
        inner = decoded_type(type_.value_type)
        return pa.large_list(inner) if pa.types.is_large_list(type_) else pa.list_(inner)
    return type_


def decode_dictionaries(table: pa.Table) -> pa.Table:
    """``table`` with every dictionary-encoded column (or list of them) decoded to plain values:
    the checks and the preprocessing see one physical type per logical type."""
    for i, field in enumerate(table.schema):
        plain = decoded_type(field.type)
        if plain != field.type:
            table = table.set_column(i, field.name, table.column(i).cast(plain))
    return table


def int64_bits(values: pa.Array) -> np.ndarray:
    """The ids of a flat integer array as an int64 array (nulls as 0): the values as they are,
    except uint64 ids, whose 64 bits are taken as they are (an id of 2**63 or more becomes the
    negative int64 of the same bits; a cast would refuse it). Hashing mixes the 64 bits, so
    every id hashes alike whatever the column's integer width or signedness."""
    values = values.fill_null(0)
    if pa.types.is_uint64(values.type):
        return values.to_numpy(zero_copy_only=False).view(np.int64)
    return values.cast(pa.int64()).to_numpy(zero_copy_only=False)


def flat_values(array: pa.Array) -> tuple[pa.Array, np.ndarray | None]:
    """The flat values of a (possibly sliced) column and, for a list column, its offsets
    relative to its first row (int64, ``(B + 1,)``); None for a column of single values."""
    if is_list(array.type):
        offsets = array.offsets.to_numpy().astype(np.int64)
        return array.flatten(), offsets - offsets[0]
    return array, None


def rows_with(offsets: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Rows (of a list column with ``offsets``) holding at least one element where ``mask``."""
    rows = np.zeros(offsets.size - 1, dtype=bool)
    hits = np.flatnonzero(mask)
    if hits.size:
        rows[np.searchsorted(offsets, hits, side="right") - 1] = True
    return rows


def not_finite(array: pa.Array) -> np.ndarray:
    """Non-null values that are NaN or infinite (False for nulls and integers)."""
    if not pa.types.is_floating(array.type):
        return np.zeros(len(array), dtype=bool)
    values = array.to_numpy(zero_copy_only=False)
    bad = ~np.isfinite(values)
    if array.null_count:
        bad &= ~np.asarray(array.is_null())
    return bad


_FLOAT32_MAX = float(np.finfo(np.float32).max)


def beyond_float32(array: pa.Array) -> np.ndarray:
    """Finite, non-null values that training's float32 cast would turn infinite (a float64
    1e308 is finite in the file but not in the model)."""
    if not pa.types.is_floating(array.type) or array.type.bit_width <= 32:
        return np.zeros(len(array), dtype=bool)
    values = np.abs(array.to_numpy(zero_copy_only=False))
    with np.errstate(invalid="ignore"):
        bad = np.isfinite(values) & (values > _FLOAT32_MAX)
    if array.null_count:
        bad &= ~np.asarray(array.is_null())
    return bad
