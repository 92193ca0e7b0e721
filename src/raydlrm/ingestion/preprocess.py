"""Row preprocessing on the Ray Data actor pool: raw Parquet columns in, model-ready columns out.

:class:`Preprocessor` is a callable class for ``Dataset.map_batches(..., batch_format="pyarrow")``.
It turns a table of raw columns into

- ``label``: float32, shape ``(B,)``;
- ``dense``: ``FixedSizeList<float32>[num_dense]``, missing values filled with 0, then
  ``log1p(max(x, 0))`` when ``dense_transform == "log1p"``;
- one column per sparse feature: int64 (single-valued) or ``list<int64>`` (id lists), every raw id
  hashed into ``[0, table_size_of(column))``;
- ``sample_id`` (int64), passed through when the input has it.

Ids are hashed with the splitmix64 finalizer on unsigned 64-bit integers, in NumPy: the mapping is
the same in every process and on every machine (Python's ``hash()`` is salted per process and
would scatter one id over different rows on different workers). Everything is vectorized over
Arrow buffers: list columns are processed as one flat values array plus offsets, never per row.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from raydlrm.ingestion.config import DataConfig
from raydlrm.ingestion.schema import SAMPLE_ID_COLUMN

__all__ = ["Preprocessor", "hash_ids", "mix64"]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MUL1 = np.uint64(0xBF58476D1CE4E5B9)
_MUL2 = np.uint64(0x94D049BB133111EB)


def mix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finalizer, a bijection on 64-bit integers with good avalanche.

    Args:
        x: integer array of any shape; int64 values are reinterpreted as uint64 (no copy).

    Returns:
        uint64 array of the same shape.
    """
    z = np.asarray(x)
    z = z.view(np.uint64) if z.dtype == np.int64 else z.astype(np.uint64)
    with np.errstate(over="ignore"):
        z = z + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _MUL1
        z = (z ^ (z >> np.uint64(27))) * _MUL2
    return z ^ (z >> np.uint64(31))


def hash_ids(ids: np.ndarray, *, table_size: int) -> np.ndarray:
    """Maps raw ids to embedding rows with a stable hash.

    Args:
        ids: integer ids of any shape.
        table_size: number of embedding rows.

    Returns:
        int64 array of the same shape, each value in ``[0, table_size)``.
    """
    return (mix64(ids) % np.uint64(table_size)).view(np.int64)


def _single_array(column: pa.ChunkedArray | pa.Array) -> pa.Array:
    """One contiguous array for a column (no copy when it already has one chunk)."""
    if isinstance(column, pa.ChunkedArray):
        if column.num_chunks == 1:
            return column.chunk(0)
        if column.num_chunks == 0:
            return pa.array([], type=column.type)
        return pa.concat_arrays(column.chunks)
    return column


class Preprocessor:
    """Turns raw columns into model-ready columns (see the module docstring for the output).

    Args:
        config: the data config naming the label, dense and sparse columns and the table sizes.
    """

    def __init__(self, config: DataConfig) -> None:
        self.config = config

    def __call__(self, table: pa.Table) -> pa.Table:
        """Preprocesses one batch.

        Args:
            table: raw columns of ``B`` rows (label, dense, sparse, optionally ``sample_id``).

        Returns:
            A table of ``B`` rows with ``label``, ``dense``, the sparse columns and, if the
            input has it, ``sample_id``.

        Raises:
            ValueError: naming a column with null labels or null ids.
            KeyError: naming a configured column that the table lacks.
        """
        cfg = self.config
        names: list[str] = [cfg.label_column, "dense"]
        arrays: list[pa.Array] = [self._label(table), self._dense(table)]
        for column in cfg.sparse_columns:
            names.append(column)
            arrays.append(self._sparse(table, column))
        if SAMPLE_ID_COLUMN in table.column_names:
            names.append(SAMPLE_ID_COLUMN)
            arrays.append(_single_array(table.column(SAMPLE_ID_COLUMN)).cast(pa.int64()))
        return pa.Table.from_arrays(arrays, names=names)

    def _label(self, table: pa.Table) -> pa.Array:
        column = self.config.label_column
        labels = _single_array(table.column(column))
        if labels.null_count:
            raise ValueError(f"label column {column!r} has {labels.null_count} null values")
        return labels.cast(pa.float32())

    def _dense(self, table: pa.Table) -> pa.Array:
        columns = self.config.dense_columns
        out = np.empty((table.num_rows, len(columns)), dtype=np.float32)
        for j, column in enumerate(columns):
            values = pc.fill_null(_single_array(table.column(column)).cast(pa.float32()), 0.0)
            out[:, j] = values.to_numpy(zero_copy_only=False)
        if self.config.dense_transform == "log1p":
            np.maximum(out, 0.0, out=out)
            np.log1p(out, out=out)
        return pa.FixedSizeListArray.from_arrays(pa.array(out.reshape(-1)), len(columns))

    def _sparse(self, table: pa.Table, column: str) -> pa.Array:
        size = self.config.table_size_of(column)
        ids = _single_array(table.column(column))
        if ids.null_count:
            raise ValueError(f"sparse column {column!r} has {ids.null_count} null ids")
        if pa.types.is_list(ids.type) or pa.types.is_large_list(ids.type):
            # flatten() honours slicing; offsets are made relative to the first row.
            values = ids.flatten()
            if values.null_count:
                raise ValueError(f"sparse column {column!r} has {values.null_count} null ids")
            offsets = ids.offsets.to_numpy()
            offsets = (offsets - offsets[0]).astype(np.int32)
            hashed = hash_ids(values.cast(pa.int64()).to_numpy(), table_size=size)
            return pa.ListArray.from_arrays(pa.array(offsets), pa.array(hashed))
        return pa.array(hash_ids(ids.cast(pa.int64()).to_numpy(), table_size=size))
