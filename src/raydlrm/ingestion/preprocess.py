"""Row preprocessing on the Ray Data actor pool: raw Parquet columns in, model-ready columns out.

:class:`Preprocessor` is a callable class for ``Dataset.map_batches(..., batch_format="pyarrow")``.
It turns a table of raw columns into

- ``label``: float32, shape ``(B,)``;
- ``dense``: ``FixedSizeList<float32>[num_dense]``: missing values filled with 0, clipped
  (``DenseSpec.clip``), then transformed: ``log1p(max(x, 0))``, ``(x - mean) / std`` with the
  stored statistics (``DataConfig.dense_stats``), or unchanged;
- one column per sparse feature: int64 (single-valued) or ``list<int64>`` (id lists), every raw id
  (integer or string) hashed into ``[0, table_size_of(column))``;
- ``weight:<column>`` for a sparse column with a weight column: float32 (or ``list<float32>``
  aligned with the id list);
- ``dedup:<i>`` for dedup group ``i``: an int64 key per row, a hash of the group's hashed ids;
  rows with equal keys are deduplicated by the loader (which checks they are equal);
- ``sample_id`` (int64), passed through when the input has it.

Integer ids are hashed with the splitmix64 finalizer on unsigned 64-bit integers, string ids with
64-bit FNV-1a over their UTF-8 bytes followed by the same finalizer, in NumPy: the mapping is the
same in every process and on every machine (Python's ``hash()`` is salted per process and would
scatter one id over different rows on different workers). Everything is vectorized over Arrow
buffers: list columns are processed as one flat values array plus offsets, string columns as one
bytes buffer plus offsets (one NumPy pass per byte position), never per row.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from raydlrm.ingestion._arrow import decode_dictionaries, int64_bits, is_list, is_string
from raydlrm.ingestion.badinput import apply_policy, drop_tagging_columns
from raydlrm.ingestion.config import DataConfig
from raydlrm.ingestion.schema import SAMPLE_ID_COLUMN

__all__ = [
    "DEDUP_PREFIX",
    "WEIGHT_PREFIX",
    "Preprocessor",
    "compute_dense_stats",
    "hash_ids",
    "hash_strings",
    "mix64",
    "transform_dense",
]

WEIGHT_PREFIX = "weight:"
"""Output column ``weight:<column>``: the per-id weights of sparse ``column``."""
DEDUP_PREFIX = "dedup:"
"""Output column ``dedup:<i>``: the row key of dedup group ``i``."""

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MUL1 = np.uint64(0xBF58476D1CE4E5B9)
_MUL2 = np.uint64(0x94D049BB133111EB)
_FNV_OFFSET = np.uint64(0xCBF29CE484222325)
_FNV_PRIME = np.uint64(0x100000001B3)


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


def hash_strings(array: pa.Array) -> np.ndarray:
    """Stable 64-bit hashes of string (or binary) ids: FNV-1a over the bytes, then splitmix64.

    Args:
        array: a ``string``, ``large_string``, ``binary`` or ``large_binary`` array without
            nulls.

    Returns:
        uint64 array, one hash per string.
    """
    if pa.types.is_large_string(array.type) or pa.types.is_large_binary(array.type):
        offset_type = np.int64
    else:
        offset_type = np.int32
    n = len(array)
    buffers = array.buffers()
    offsets = np.frombuffer(buffers[1], dtype=offset_type)[array.offset : array.offset + n + 1]
    data = np.empty(0, np.uint8)
    if buffers[2] is not None:
        data = np.frombuffer(buffers[2], dtype=np.uint8)
    starts = offsets[:-1].astype(np.int64)
    lengths = (offsets[1:] - offsets[:-1]).astype(np.int64)
    hashes = np.full(n, _FNV_OFFSET, dtype=np.uint64)
    # One pass per byte position, over the strings at least that long (longest last).
    order = np.argsort(lengths, kind="stable")
    sorted_lengths = lengths[order]
    with np.errstate(over="ignore"):
        for j in range(int(sorted_lengths[-1]) if n else 0):
            active = order[np.searchsorted(sorted_lengths, j, side="right") :]
            byte = data[starts[active] + j].astype(np.uint64)
            hashes[active] = (hashes[active] ^ byte) * _FNV_PRIME
    return mix64(hashes)


def _raw_hash(values: pa.Array) -> np.ndarray:
    """uint64 hash of every id (integer or string) of a flat array."""
    if is_string(values.type):
        return hash_strings(values)
    return mix64(int64_bits(values))


def _flat(ids: pa.Array) -> tuple[pa.Array, np.ndarray | None]:
    """The flat values of a (possibly sliced) column and, for a list column, its offsets
    relative to the first row (int64, ``(B + 1,)``); None for a single-id column."""
    if not is_list(ids.type):
        return ids, None
    offsets = ids.offsets.to_numpy().astype(np.int64)
    return ids.flatten(), offsets - offsets[0]


def _segment_sums(values: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Sum (mod 2**64) of ``values`` over each segment ``[offsets[i], offsets[i + 1])``."""
    cumulative = np.zeros(values.size + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        np.cumsum(values, out=cumulative[1:])
        return cumulative[offsets[1:]] - cumulative[offsets[:-1]]


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
        config: the data config naming the label, dense and sparse columns, their specs, the
            table sizes, the dense statistics and the dedup groups.
        quarantine_tag: the pass whose bad rows this preprocessor quarantines
            (``<run>.<role>-e<epoch>``; None: each batch's record is kept apart).

    Raises:
        ValueError: a standardized dense column without statistics in ``config.dense_stats``.
    """

    def __init__(self, config: DataConfig, *, quarantine_tag: str | None = None) -> None:
        self.config = config
        self.quarantine_tag = quarantine_tag
        missing = [c for c in config.standardized_columns() if c not in config.dense_stats]
        if missing:
            raise ValueError(
                f"standardized dense columns {missing} have no data.dense_stats (mean, std); "
                "compute them with raydlrm.ingestion.compute_dense_stats"
            )

    def __call__(self, table: pa.Table) -> pa.Table:
        """Preprocesses one batch.

        Args:
            table: raw columns of ``B`` rows (label, dense, sparse, weight columns, optionally
                ``sample_id``).

        Returns:
            A table of ``B`` rows with ``label``, ``dense``, the sparse columns, their
            ``weight:<column>`` columns, the ``dedup:<i>`` keys and, if the input has it,
            ``sample_id``.

        Bad rows (:mod:`raydlrm.ingestion.badinput`) are first set aside or raise, by
        ``data.bad_input``.

        Raises:
            BadInputError: a bad row under the ``fail`` policy, named.
            ValueError: naming a weight column misaligned with its ids.
            KeyError: naming a configured column that the table lacks.
        """
        cfg = self.config
        table = decode_dictionaries(table)
        table = drop_tagging_columns(apply_policy(table, cfg, tag=self.quarantine_tag))
        names: list[str] = [cfg.label_column, "dense"]
        arrays: list[pa.Array] = [self._label(table), self._dense(table)]
        row_keys: dict[str, np.ndarray] = {}
        for column in cfg.sparse_columns:
            ids, key = self._sparse(table, column)
            names.append(column)
            arrays.append(ids)
            row_keys[column] = key
            weight = cfg.weight_column_of(column)
            if weight is not None:
                names.append(WEIGHT_PREFIX + column)
                arrays.append(self._weights(table, column, weight))
        for i, group in enumerate(cfg.dedup_groups):
            key = np.zeros(table.num_rows, dtype=np.uint64)
            with np.errstate(over="ignore"):
                for position, column in enumerate(group):
                    key = mix64(key ^ (row_keys[column] + np.uint64(position)))
            names.append(f"{DEDUP_PREFIX}{i}")
            arrays.append(pa.array(key.view(np.int64)))
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
            transform_dense(out[:, j], column, self.config)
        return pa.FixedSizeListArray.from_arrays(pa.array(out.reshape(-1)), len(columns))

    def _sparse(self, table: pa.Table, column: str) -> tuple[pa.Array, np.ndarray]:
        """The hashed ids of ``column`` and a uint64 key per row of its ids (for dedup)."""
        size = self.config.table_size_of(column)
        ids = _single_array(table.column(column))
        if ids.null_count:
            raise ValueError(f"sparse column {column!r} has {ids.null_count} null ids")
        values, offsets = _flat(ids)
        if values.null_count:
            raise ValueError(f"sparse column {column!r} has {values.null_count} null ids")
        spec = self.config.sparse_specs.get(column)
        if spec is not None and not spec.hash:
            hashed = int64_bits(values)
        else:
            hashed = (_raw_hash(values) % np.uint64(size)).view(np.int64)
        if offsets is None:
            return pa.array(hashed), hashed.view(np.uint64)
        # Row key of a list: its length and its ids in order (position-salted sum).
        positions = np.arange(hashed.size, dtype=np.int64) - np.repeat(
            offsets[:-1], np.diff(offsets)
        )
        salted = mix64(hashed.view(np.uint64) ^ mix64(positions))
        with np.errstate(over="ignore"):
            key = _segment_sums(salted, offsets) + mix64(np.diff(offsets))
        list_offsets = pa.array(offsets.astype(np.int32))
        return pa.ListArray.from_arrays(list_offsets, pa.array(hashed)), key

    def _weights(self, table: pa.Table, column: str, weight: str) -> pa.Array:
        """The per-id weights of ``column`` from ``weight``, aligned with its ids."""
        ids = _single_array(table.column(column))
        weights = _single_array(table.column(weight))
        if weights.null_count:
            raise ValueError(f"weight column {weight!r} has {weights.null_count} null values")
        values, offsets = _flat(weights)
        _, id_offsets = _flat(ids)
        if (offsets is None) != (id_offsets is None) or (
            offsets is not None and not np.array_equal(offsets, id_offsets)
        ):
            raise ValueError(
                f"weight column {weight!r} is not aligned with sparse column {column!r}: "
                "a list column needs a list of weights of the same length per row, a single-id "
                "column one weight per row"
            )
        floats = values.cast(pa.float32())
        if offsets is None:
            return floats
        return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), floats)


def transform_dense(values: np.ndarray, column: str, config: DataConfig) -> None:
    """Clips and transforms the (null-filled) float32 values of dense ``column`` in place."""
    clip_dense(values, column, config)
    transform = config.dense_transform_of(column)
    if transform == "log1p":
        np.maximum(values, 0.0, out=values)
        np.log1p(values, out=values)
    elif transform == "standardize":
        mean, std = config.dense_stats[column]
        values -= np.float32(mean)
        values /= np.float32(std)


def clip_dense(values: np.ndarray, column: str, config: DataConfig) -> None:
    """Clips the values of dense ``column`` in place into its ``DenseSpec.clip`` range."""
    spec = config.dense_specs.get(column)
    if spec is not None and spec.clip is not None:
        np.clip(values, spec.clip[0], spec.clip[1], out=values)


def compute_dense_stats(
    batches: Iterable[pa.RecordBatch | pa.Table], config: DataConfig
) -> dict[str, tuple[float, float]]:
    """Mean and standard deviation of each standardized dense column, over all ``batches``.

    Values are null-filled with 0 and clipped first, as the preprocessor does before
    standardizing. Sums are accumulated in float64, one pass.

    Args:
        batches: the training data's raw columns (at least the standardized ones).
        config: the data config.

    Returns:
        Column -> ``(mean, std)`` (``std`` is 1 for a constant column).

    Raises:
        ValueError: if ``batches`` hold no rows.
    """
    columns = config.standardized_columns()
    count = 0
    sums = np.zeros(len(columns))
    squares = np.zeros(len(columns))
    for batch in batches:
        count += batch.num_rows
        for j, column in enumerate(columns):
            values = pc.fill_null(_single_array(batch.column(column)).cast(pa.float32()), 0.0)
            x = values.to_numpy(zero_copy_only=False).copy()
            clip_dense(x, column, config)
            x64 = x.astype(np.float64)
            sums[j] += x64.sum()
            squares[j] += np.square(x64).sum()
    if columns and count == 0:
        raise ValueError("cannot compute dense statistics of an empty data set")
    stats = {}
    for j, column in enumerate(columns):
        mean = sums[j] / count
        var = max(squares[j] / count - mean * mean, 0.0)
        std = float(np.sqrt(var))
        stats[column] = (float(mean), std if std > 0 else 1.0)
    return stats
