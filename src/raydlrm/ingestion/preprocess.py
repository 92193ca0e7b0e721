"""Row preprocessing on the Ray Data actor pool: raw Parquet columns in, model-ready columns out.

:class:`Preprocessor` is a callable class for ``Dataset.map_batches(..., batch_format="pyarrow")``.
It turns a table of raw columns into

- ``label``: float32, shape ``(B,)``;
- ``dense``: ``FixedSizeList<float32>[DataConfig.num_dense_inputs()]``: each dense column's
  missing values filled (``DataConfig.dense_fill``: 0, or the stored mean or median,
  ``DataConfig.dense_fill_values``), clipped (``DenseSpec.clip``), then transformed:
  ``log1p(max(x, 0))``, ``(x - mean) / std`` with the stored statistics
  (``DataConfig.dense_stats``), or unchanged; then a 1.0/0.0 "was missing" input per column
  with a missing indicator (``DataConfig.missing_indicator_columns()``, in that order);
- one column per sparse feature: int64 (single-valued) or ``list<int64>`` (id lists), every raw id
  (integer or string) hashed into ``[0, table_size_of(column))``;
- ``<column>_bucket`` for a bucketized dense column: int64, the bucket of its filled,
  clipped value (the number of ``DataConfig.bucket_boundaries`` at or below it);
- ``weight:<column>`` for a sparse column with a weight column: float32 (or ``list<float32>``
  aligned with the id list);
- ``dedup:<i>`` for dedup group ``i``: an int64 key per row, a hash of the group's hashed ids;
  rows with equal keys are deduplicated by the loader (which checks they are equal);
- ``value:<column>`` for each value column of a sequence (``DataConfig.sequences``):
  ``list<float32>`` aligned with the sequence's id lists. A sequence's columns are first cut to
  each row's last ``max_length`` events (:mod:`~raydlrm.ingestion.sequence_rows`);
- ``sample_id`` (int64), passed through when the input has it.

Session-clustered data (``raydlrm.ingestion.clustered``; :meth:`Preprocessor.sessions`) is
preprocessed where it is stored: the per-session columns (the user features) are checked,
hashed and weighted once per session, on the sessions file's rows, and reach the training batch
as dictionary arrays (:class:`SessionRows`): the dictionary holds the batch's sessions' hashed
ids, the indices each sample's session, i.e. the unique values and the inverse index RecD
looks up and sends. A dedup group made of per-session columns alone needs no ``dedup:<i>``
keys: the loader takes its unique rows and inverse index from the dictionaries.

Integer ids are hashed with the splitmix64 finalizer on unsigned 64-bit integers, string ids with
64-bit FNV-1a over their UTF-8 bytes followed by the same finalizer, in NumPy: the mapping is the
same in every process and on every machine (Python's ``hash()`` is salted per process and would
scatter one id over different rows on different workers). Everything is vectorized over Arrow
buffers: list columns are processed as one flat values array plus offsets, string columns as one
bytes buffer plus offsets (one NumPy pass per byte position), never per row.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from raydlrm.ingestion._arrow import decode_dictionaries, int64_bits, is_list, is_string
from raydlrm.ingestion.badinput import (
    apply_policy,
    apply_session_policy,
    drop_tagging_columns,
)
from raydlrm.ingestion.config import DataConfig
from raydlrm.ingestion.schema import SAMPLE_ID_COLUMN
from raydlrm.ingestion.sequence_rows import truncate_sequences, value_lists
from raydlrm.ingestion.sessions import session_rows

__all__ = [
    "DEDUP_PREFIX",
    "VALUE_PREFIX",
    "WEIGHT_PREFIX",
    "Preprocessor",
    "SessionRows",
    "bucket_of",
    "clip_dense",
    "dense_values",
    "hash_ids",
    "hash_strings",
    "managed_ids",
    "missing_values",
    "mix64",
    "transform_dense",
]

WEIGHT_PREFIX = "weight:"
"""Output column ``weight:<column>``: the per-id weights of sparse ``column``."""
DEDUP_PREFIX = "dedup:"
"""Output column ``dedup:<i>``: the row key of dedup group ``i``."""
VALUE_PREFIX = "value:"
"""Output column ``value:<column>``: the values of a sequence's value column, per event."""

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


def managed_ids(values: pa.Array) -> np.ndarray:
    """The ids of a managed table's column as the embedding collection receives them (int64,
    non-negative): integers as they are (bad input, :mod:`~raydlrm.ingestion.badinput`, keeps
    negative ones out), strings as their 63-bit hash (:func:`hash_strings`, top bit cleared)."""
    if is_string(values.type):
        return (hash_strings(values) & np.uint64((1 << 63) - 1)).view(np.int64)
    return int64_bits(values)


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


@dataclass
class _Outputs:
    """Output columns in order, and the row keys of the sparse ones that need them."""

    names: list[str] = field(default_factory=list)
    arrays: list[pa.Array] = field(default_factory=list)
    keys: dict[str, np.ndarray] = field(default_factory=dict)  # uint64 per row, by column

    def add(self, name: str, array: pa.Array) -> None:
        self.names.append(name)
        self.arrays.append(array)

    def table(self) -> pa.Table:
        return pa.Table.from_arrays(self.arrays, names=self.names)


@dataclass
class _Processed:
    outputs: _Outputs  # the per-sample columns
    names: list[str]  # every output column, per-session ones included, in batch order


@dataclass
class SessionRows:
    """A row group of session-clustered data, preprocessed; :meth:`batch` cuts it into
    training batches whose per-session columns are dictionary-encoded.

    Attributes:
        samples: the per-sample output columns of the ``N`` samples (as :class:`Preprocessor`
            makes them, without the per-session columns).
        sessions: the per-session output columns of the row group's ``S`` sessions: the hashed
            ids of each per-session sparse column and its ``weight:<column>`` column.
        session_of: int64, shape ``(N,)``: each sample's row of ``sessions``.
        names: the batches' columns, in order.
    """

    samples: pa.Table
    sessions: pa.Table
    session_of: np.ndarray
    names: list[str]

    @property
    def num_rows(self) -> int:
        return self.samples.num_rows

    def batch(self, start: int, stop: int) -> pa.Table:
        """Samples ``[start, stop)`` as one table of single-chunk columns: the per-sample
        columns sliced (no copy), each per-session column a dictionary array whose dictionary
        holds the batch's sessions (in order of their first sample) and whose int32 indices
        give each sample's.

        A session is one run of equal ``session_of`` values; a session the batch boundary cuts
        is in both batches' dictionaries.
        """
        runs = self.session_of[start:stop]
        new_run = np.empty(runs.size, dtype=bool)
        new_run[:1] = True
        np.not_equal(runs[1:], runs[:-1], out=new_run[1:])
        indices = pa.array(np.cumsum(new_run, dtype=np.int32) - 1)
        rows = pa.array(runs[new_run])
        arrays = []
        for name in self.names:
            if name in self.sessions.column_names:
                dictionary = _single_array(self.sessions.column(name)).take(rows)
                arrays.append(pa.DictionaryArray.from_arrays(indices, dictionary))
            else:
                arrays.append(_single_array(self.samples.column(name)).slice(start, stop - start))
        return pa.Table.from_arrays(arrays, names=self.names)


def _used_sessions(sessions: pa.Table, session_of: np.ndarray) -> tuple[pa.Table, np.ndarray]:
    """The sessions that have samples (those of set-aside samples are not preprocessed), and
    each sample's row among them."""
    used = np.bincount(session_of, minlength=sessions.num_rows) > 0
    if used.all():
        return sessions, session_of
    return sessions.filter(pa.array(used)), (np.cumsum(used) - 1)[session_of]


class Preprocessor:
    """Turns raw columns into model-ready columns (see the module docstring for the output).

    Args:
        config: the data config naming the label, dense and sparse columns, their specs, the
            table sizes, the dense statistics and the dedup groups.
        quarantine_tag: the pass whose bad rows this preprocessor quarantines
            (``<run>.<role>-e<epoch>``; None: each batch's record is kept apart).

    Raises:
        ValueError: a standardized dense column without statistics in ``config.dense_stats``,
            a mean- or median-filled one without ``config.dense_fill_values``, a bucketized
            one without ``config.bucket_boundaries``.
    """

    def __init__(self, config: DataConfig, *, quarantine_tag: str | None = None) -> None:
        self.config = config
        self.quarantine_tag = quarantine_tag
        missing = [c for c in config.standardized_columns() if c not in config.dense_stats]
        if missing:
            raise ValueError(
                f"standardized dense columns {missing} have no data.dense_stats (mean, std); "
                "compute them with raydlrm.ingestion.stats.compute_dense_stats"
            )
        missing = [c for c in config.computed_fill_columns() if c not in config.dense_fill_values]
        if missing:
            raise ValueError(
                f"dense columns {missing} filled with their mean or median have no "
                "data.dense_fill_values; compute them with "
                "raydlrm.ingestion.stats.compute_dense_fill_values"
            )
        missing = [c for c in config.bucketized_columns() if c not in config.bucket_boundaries]
        if missing:
            raise ValueError(
                f"bucketized dense columns {missing} have no data.bucket_boundaries; compute "
                "them with raydlrm.ingestion.stats.compute_bucket_boundaries"
            )

    def __call__(self, table: pa.Table) -> pa.Table:
        """Preprocesses one batch.

        Args:
            table: raw columns of ``B`` rows (label, dense, sparse, weight and sequence value
                columns, optionally ``sample_id``).

        Returns:
            A table of ``B`` rows with ``label``, ``dense``, the sparse columns, their
            ``weight:<column>`` columns, the sequences' ``value:<column>`` columns, the
            ``dedup:<i>`` keys and, if the input has it, ``sample_id``.

        Bad rows (:mod:`raydlrm.ingestion.badinput`) are first set aside or raise, by
        ``data.bad_input``.

        Raises:
            BadInputError: a bad row under the ``fail`` policy, named.
            ValueError: naming a weight column misaligned with its ids.
            KeyError: naming a configured column that the table lacks.
        """
        return self.process(self.clean(table))

    def clean(self, table: pa.Table) -> pa.Table:
        """The good rows of a raw batch (dictionaries decoded; ``data.bad_input`` applied to
        the rest), still raw and tagged: what :meth:`process` takes."""
        return apply_policy(decode_dictionaries(table), self.config, tag=self.quarantine_tag)

    def process(self, table: pa.Table) -> pa.Table:
        """Preprocesses the good rows of a raw batch (:meth:`clean`'s output), in order."""
        return self._per_sample(self._untagged(table)).outputs.table()

    def _untagged(self, table: pa.Table) -> pa.Table:
        """Good raw rows, tagged, with their sequences cut to ``max_length`` (the rows cut are
        recorded by their source), less the reader's tags."""
        cut = truncate_sequences(table, self.config, tag=self.quarantine_tag)
        return drop_tagging_columns(cut)

    def sessions(
        self,
        samples: pa.Table,
        sessions: pa.Table,
        *,
        session_column: str,
        session_columns: list[str],
    ) -> SessionRows:
        """Preprocesses one row group of session-clustered data: the per-session columns once
        per session (hashing, weights, their bad-input checks), the others per sample.

        Args:
            samples: raw columns of the ``N`` samples (label, dense, the per-sample sparse and
                weight columns, ``session_column``, optionally ``sample_id``), each session's
                samples contiguous, tagged with their file, row group and row for messages.
            sessions: raw columns of the ``S`` sessions: ``session_column`` and the
                per-session columns, tagged likewise.
            session_column: the column naming each sample's session (in both tables).
            session_columns: the columns stored per session (sparse columns, their weights).

        Returns:
            The preprocessed rows (bad ones set aside or raising, by ``data.bad_input``),
            which :meth:`SessionRows.batch` cuts into training batches.

        Raises:
            BadInputError: under ``fail``, a bad sample, a bad session or a sample whose
                session has no row, named.
        """
        samples, sessions = decode_dictionaries(samples), decode_dictionaries(sessions)
        session_of = session_rows(samples.column(session_column), sessions.column(session_column))
        keep = apply_session_policy(
            samples,
            sessions,
            session_of=session_of,
            session_column=session_column,
            session_columns=session_columns,
            config=self.config,
            tag=self.quarantine_tag,
        )
        if not keep.all():
            samples, session_of = samples.filter(pa.array(keep)), session_of[keep]
        sessions, session_of = _used_sessions(sessions, session_of)
        # Row keys of per-session columns are only needed by dedup groups that also hold
        # per-sample columns; a group of per-session columns alone travels as dictionaries.
        mixed = {
            c for g in self.config.dedup_groups if not set(g) <= set(session_columns) for c in g
        }
        per_session = _Outputs()
        for column in self.config.sparse_columns:
            if column in session_columns:
                self._add_sparse(per_session, sessions, column, key=column in mixed)
        processed = self._per_sample(
            self._untagged(samples), per_session=per_session, session_of=session_of
        )
        return SessionRows(
            samples=processed.outputs.table(),
            sessions=per_session.table(),
            session_of=session_of,
            names=processed.names,
        )

    def _add_sparse(self, out: _Outputs, table: pa.Table, column: str, *, key: bool) -> None:
        """Adds sparse ``column`` of ``table`` (hashed) and its weights to ``out``, and its row
        keys when ``key``."""
        ids, keys = self._sparse(table, column, key=key)
        out.add(column, ids)
        if keys is not None:
            out.keys[column] = keys
        weight = self.config.weight_column_of(column)
        if weight is not None:
            out.add(WEIGHT_PREFIX + column, self._weights(table, column, weight))

    def _per_sample(
        self,
        table: pa.Table,
        *,
        per_session: _Outputs | None = None,
        session_of: np.ndarray | None = None,
    ) -> _Processed:
        """The per-sample output columns of ``table``; the columns of ``per_session`` (made
        from the sessions' rows, ``session_of`` giving each sample's) are left to the batches,
        and a dedup group made of them alone needs no row keys."""
        cfg = self.config
        outputs = _Outputs()
        outputs.add(cfg.label_output, self._label(table))
        outputs.add("dense", self._dense(table))
        names = [cfg.label_output, "dense"]
        shared = per_session.keys if per_session is not None else {}
        grouped = {c for g in cfg.dedup_groups for c in g}
        for column in cfg.sparse_columns:
            if per_session is None or column not in per_session.names:
                self._add_sparse(outputs, table, column, key=column in grouped)
            weight = [WEIGHT_PREFIX + column] if cfg.weight_column_of(column) is not None else []
            names += [column, *weight]
        for column in cfg.value_columns():
            outputs.add(VALUE_PREFIX + column, value_lists(table, column))
            names.append(VALUE_PREFIX + column)
        for column in cfg.bucketized_columns():
            feature = cfg.bucket_feature(column)
            values = dense_values(table, column, fill=cfg.fill_value_of(column))
            outputs.add(feature, pa.array(bucket_of(values, column, cfg)))
            names.append(feature)
        for i, group in enumerate(cfg.dedup_groups):
            if per_session is not None and all(c in per_session.names for c in group):
                continue  # its batches carry it deduplicated (dictionary-encoded)
            key = np.zeros(table.num_rows, dtype=np.uint64)
            with np.errstate(over="ignore"):
                for position, column in enumerate(group):
                    column_key = outputs.keys.get(column)
                    if column_key is None:
                        column_key = shared[column][session_of]
                    key = mix64(key ^ (column_key + np.uint64(position)))
            outputs.add(f"{DEDUP_PREFIX}{i}", pa.array(key.view(np.int64)))
            names.append(f"{DEDUP_PREFIX}{i}")
        if SAMPLE_ID_COLUMN in table.column_names:
            outputs.add(
                SAMPLE_ID_COLUMN, _single_array(table.column(SAMPLE_ID_COLUMN)).cast(pa.int64())
            )
            names.append(SAMPLE_ID_COLUMN)
        return _Processed(outputs=outputs, names=names)

    def _label(self, table: pa.Table) -> pa.Array:
        column = self.config.label_column
        if column is None:  # a retrieval model's data: no label to read
            return pa.array(np.zeros(table.num_rows, dtype=np.float32))
        labels = _single_array(table.column(column))
        if labels.null_count:
            raise ValueError(f"label column {column!r} has {labels.null_count} null values")
        return labels.cast(pa.float32())

    def _dense(self, table: pa.Table) -> pa.Array:
        cfg = self.config
        columns = cfg.dense_columns
        out = np.empty((table.num_rows, cfg.num_dense_inputs()), dtype=np.float32)
        for j, column in enumerate(columns):
            out[:, j] = dense_values(table, column, fill=cfg.fill_value_of(column))
            transform_dense(out[:, j], column, cfg)
        for j, column in enumerate(cfg.missing_indicator_columns(), start=len(columns)):
            out[:, j] = missing_values(table, column)
        if not out.shape[1]:  # no dense input (a retrieval model's data): empty lists
            empty = np.zeros(table.num_rows + 1, dtype=np.int32)
            return pa.ListArray.from_arrays(pa.array(empty), pa.array([], pa.float32()))
        return pa.FixedSizeListArray.from_arrays(pa.array(out.reshape(-1)), out.shape[1])

    def _sparse(
        self, table: pa.Table, column: str, *, key: bool
    ) -> tuple[pa.Array, np.ndarray | None]:
        """The hashed ids of ``column`` and, with ``key``, a uint64 key per row of its ids (for
        dedup; None without)."""
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
        elif self.config.managed_of(self.config.table_of(column)) is not None:
            hashed = managed_ids(values)
        else:
            hashed = (_raw_hash(values) % np.uint64(size)).view(np.int64)
        if offsets is None:
            return pa.array(hashed), hashed.view(np.uint64) if key else None
        list_offsets = pa.array(offsets.astype(np.int32))
        lists = pa.ListArray.from_arrays(list_offsets, pa.array(hashed))
        if not key:
            return lists, None
        # Row key of a list: its length and its ids in order (position-salted sum).
        positions = np.arange(hashed.size, dtype=np.int64) - np.repeat(
            offsets[:-1], np.diff(offsets)
        )
        salted = mix64(hashed.view(np.uint64) ^ mix64(positions))
        with np.errstate(over="ignore"):
            row_keys = _segment_sums(salted, offsets) + mix64(np.diff(offsets))
        return lists, row_keys

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
        floats = values.cast(pa.float32(), safe=False)
        if offsets is None:
            return floats
        return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), floats)


def dense_values(table: pa.Table | pa.RecordBatch, column: str, *, fill: float = 0.0) -> np.ndarray:
    """The float32 values of dense ``column``, nulls filled with ``fill`` (a writable copy)."""
    # safe=False: integers beyond float32's exact range (a timestamp) are rounded, not refused.
    values = _single_array(table.column(column)).cast(pa.float32(), safe=False)
    values = pc.fill_null(values, fill)
    return values.to_numpy(zero_copy_only=False).copy()


def missing_values(table: pa.Table | pa.RecordBatch, column: str) -> np.ndarray:
    """Whether each value of dense ``column`` is missing (null): bool, shape ``(B,)``."""
    return _single_array(table.column(column)).is_null().to_numpy(zero_copy_only=False)


def bucket_of(values: np.ndarray, column: str, config: DataConfig) -> np.ndarray:
    """The bucket (int64) of each filled value of bucketized dense ``column``: clipped,
    then the number of its boundaries at or below it (compared in float64, as computed)."""
    values = values.copy()
    clip_dense(values, column, config)
    bounds = np.asarray(config.bucket_boundaries[column], dtype=np.float64)
    return np.searchsorted(bounds, values.astype(np.float64), side="right").astype(np.int64)


def transform_dense(values: np.ndarray, column: str, config: DataConfig) -> None:
    """Clips and transforms the (filled) float32 values of dense ``column`` in place."""
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
