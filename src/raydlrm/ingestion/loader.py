"""Worker side of ingestion: preprocessed Arrow batches become :class:`raydlrm.batch.Batch`.

The conversion copies as little as it can. Dense features, labels and sample ids are NumPy views
of the Arrow buffers wrapped by ``torch.from_numpy`` (no copy); the sparse ids of all features
are concatenated once into the feature-major ``values`` array the embedding kernels read, and
lengths come from the Arrow list offsets (ones for single-id columns).

Deduplication (RecD): the preprocessor gives every row a key per dedup group (a hash of the
group's ids); here, per training batch, ``np.unique`` over the keys gives the unique rows and the
inverse index of a :class:`~raydlrm.batch.DedupGroup`, after checking that rows sharing a key
really hold the same ids. Dedup only pays inside a batch, so the batch is where it is done: the
preprocessing batches of the actor pool are re-sliced into training batches on the way.
Session-clustered data arrives already deduplicated: its reader makes every training batch (one
Arrow record batch) with the per-session columns dictionary-encoded, and a dedup group of those
columns is the dictionaries (unique rows) and their indices (inverse index), taken as they are.

Because tensors may share the Arrow batch's read-only memory, consumers must not modify a
batch's tensors in place; moving a batch to a device (or ``.clone()``) gives writable tensors.

The loader receives its rows from its caller (in training, the worker's own row-group reader,
``raydlrm.ingestion.reader.WorkerSource``); it does not talk to Ray Train itself.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import torch

from raydlrm.batch import Batch, DedupGroup, KeyedJaggedTensor
from raydlrm.ingestion.config import DataConfig
from raydlrm.ingestion.preprocess import DEDUP_PREFIX, VALUE_PREFIX, WEIGHT_PREFIX
from raydlrm.ingestion.schema import SAMPLE_ID_COLUMN

if TYPE_CHECKING:
    from ray.data import DataIterator, Dataset

    from raydlrm.ingestion.reader import WorkerSource

__all__ = ["arrow_to_batch", "iter_train_batches"]


def _array(table: pa.Table, column: str) -> pa.Array:
    """One array of ``column``'s rows; a dictionary column decoded (its values per row)."""
    chunked = table.column(column)
    if pa.types.is_dictionary(chunked.type):
        dictionary, indices = _dictionary(chunked)
        return dictionary.take(pa.array(indices))
    if chunked.num_chunks == 1:
        return chunked.chunk(0)
    if chunked.num_chunks == 0:
        return pa.array([], type=chunked.type)
    return pa.concat_arrays(chunked.chunks)


def _dictionary(chunked: pa.ChunkedArray) -> tuple[pa.Array, np.ndarray]:
    """A dictionary column as one dictionary and int64 indices into it, shape ``(B,)``:
    chunks' dictionaries are appended, not unified (Arrow cannot unify list dictionaries), so
    a value may appear more than once."""
    if chunked.num_chunks == 1:
        chunk = chunked.chunk(0)
        return chunk.dictionary, _numpy(chunk.indices).astype(np.int64)
    if chunked.num_chunks == 0:
        return pa.array([], type=chunked.type.value_type), np.empty(0, np.int64)
    sizes = np.array([len(c.dictionary) for c in chunked.chunks], dtype=np.int64)
    starts = np.cumsum(sizes) - sizes
    indices = [
        _numpy(c.indices).astype(np.int64) + s for c, s in zip(chunked.chunks, starts, strict=True)
    ]
    dictionary = pa.concat_arrays([c.dictionary for c in chunked.chunks])
    return dictionary, np.concatenate(indices)


def _numpy(array: pa.Array) -> np.ndarray:
    """A NumPy view of a primitive Arrow array without nulls (copies only if it must)."""
    return array.to_numpy(zero_copy_only=False)


def _tensor(array: np.ndarray) -> torch.Tensor:
    # Arrow buffers are read-only; torch warns about that once per process. The loader's
    # contract (module docstring) is that batch tensors are not modified in place.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)


def _jagged(
    table: pa.Table, column: str, rows: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Lengths, ids and weights (or None) of sparse ``column``, of ``rows`` (default: all)."""
    ids = _array(table, column)
    weight_name = WEIGHT_PREFIX + column
    weights = _array(table, weight_name) if weight_name in table.column_names else None
    if rows is not None:
        ids = ids.take(pa.array(rows))
        weights = None if weights is None else weights.take(pa.array(rows))
    if pa.types.is_list(ids.type) or pa.types.is_large_list(ids.type):
        lengths = _numpy(ids.value_lengths()).astype(np.int64, copy=False)
        values = _numpy(ids.flatten())
        flat_weights = None if weights is None else _numpy(weights.flatten())
    else:
        lengths = np.ones(len(ids), dtype=np.int64)
        values = _numpy(ids)
        flat_weights = None if weights is None else _numpy(weights)
    return lengths, values, flat_weights


def _kjt(
    table: pa.Table, keys: list[str], rows: np.ndarray | None = None, *, weighted: bool = False
) -> KeyedJaggedTensor:
    """A KJT over ``keys`` of ``rows`` of ``table``; with ``weighted``, weights of 1 for the
    unweighted features (every KJT of a batch is weighted when any feature is, so that they
    concatenate)."""
    parts = [_jagged(table, column, rows) for column in keys]
    batch = table.num_rows if rows is None else len(rows)
    lengths = np.concatenate([p[0] for p in parts]) if parts else np.empty(0, np.int64)
    values = np.concatenate([p[1] for p in parts]) if parts else np.empty(0, np.int64)
    weights = None
    if weighted or any(p[2] is not None for p in parts):
        weights = np.concatenate(
            [
                p[2].astype(np.float32, copy=False)
                if p[2] is not None
                else np.ones(p[1].size, np.float32)
                for p in parts
            ]
        )
    return KeyedJaggedTensor(
        keys=list(keys),
        values=torch.from_numpy(values.astype(np.int64, copy=False)),
        lengths=torch.from_numpy(lengths),
        weights=None if weights is None else _tensor(weights),
        batch_size=batch,
    )


def _dedup_group(
    table: pa.Table, keys: list[str], row_keys: np.ndarray, *, weighted: bool
) -> DedupGroup:
    """The unique rows of the group's features and the inverse index, from the row keys.

    Rows with equal keys are checked to hold equal ids; if a hash collision made two
    different rows share a key, the group is not deduplicated in this batch (every row is its
    own unique row), so a collision can cost speed but never change results.
    """
    _, first, inverse = np.unique(row_keys, return_index=True, return_inverse=True)
    representative = first[inverse]
    for column in keys:
        lengths, values, weights = _jagged(table, column)
        rep_lengths, rep_values, rep_weights = _jagged(table, column, representative)
        same = np.array_equal(lengths, rep_lengths) and np.array_equal(values, rep_values)
        if weights is not None:
            same = same and np.array_equal(weights, rep_weights)
        if not same:
            warnings.warn(
                f"dedup group {keys}: row-key collision in a batch; not deduplicated",
                stacklevel=2,
            )
            first, inverse = np.arange(table.num_rows), np.arange(table.num_rows)
            break
    return DedupGroup(
        unique=_kjt(table, keys, first, weighted=weighted),
        inverse=torch.from_numpy(inverse.astype(np.int64, copy=False)),
    )


def _dictionary_group(table: pa.Table, keys: list[str], *, weighted: bool) -> DedupGroup:
    """A dedup group whose columns (and weights) are dictionary arrays sharing their indices
    (session-clustered data): the dictionaries are the unique rows, the indices the inverse
    index; no row keys, no ``np.unique``.

    Raises:
        ValueError: the group's columns do not share one index (naming the group).
    """
    columns = [c for key in keys for c in (key, WEIGHT_PREFIX + key) if c in table.column_names]
    parts = {c: _dictionary(table.column(c)) for c in columns}
    inverse = parts[keys[0]][1]
    if any(not np.array_equal(indices, inverse) for _, indices in parts.values()):
        raise ValueError(f"dedup group {keys}: its dictionary columns have different indices")
    unique = pa.table({c: dictionary for c, (dictionary, _) in parts.items()})
    return DedupGroup(
        unique=_kjt(unique, keys, weighted=weighted), inverse=torch.from_numpy(inverse)
    )


def _is_dictionary(table: pa.Table, column: str) -> bool:
    return pa.types.is_dictionary(table.schema.field(column).type)


def arrow_to_batch(table: pa.Table, *, config: DataConfig) -> Batch:
    """Converts one preprocessed Arrow batch (output of ``Preprocessor``) to a ``Batch``.

    Args:
        table: ``B`` rows with ``label`` (float32), ``dense`` (``FixedSizeList<float32>[D]``),
            each of ``config.feature_columns()`` (int64 or ``list<int64>``, already hashed), their
            ``weight:<column>`` columns, the ``dedup:<i>`` row keys of the dedup groups and
            optionally ``sample_id`` (int64), and the sequences' ``value:<column>`` columns
            (``list<float32>``). May be sliced or chunked. A sparse column (and
            its weights) may be a dictionary array (session-clustered data): a dedup group of
            such columns, sharing one index, is built from the dictionaries (unique rows) and
            the indices (inverse index) and needs no ``dedup:<i>`` column; elsewhere such a
            column is decoded.
        config: the data config; its ``feature_columns()`` give the KJT keys, in order.

    Returns:
        A ``Batch`` with dense ``(B, D)`` float32, labels ``(B,)`` float32, a KJT over the
        sparse columns outside dedup groups (lengths ``(F * B,)``, values ``(sum L,)`` int64,
        float32 weights when any feature is weighted), one :class:`DedupGroup` per dedup group
        (its unique rows in this batch and the inverse index), ``sample_ids`` ``(B,)`` when
        the table has them, and each sequence value column's values ``(sum L,)`` float32
        (``sequence_values``, aligned with the ids of ``sequence_of``'s feature).
    """
    b = table.num_rows
    labels = _numpy(_array(table, config.label_output).cast(pa.float32()))
    dense_array = _array(table, "dense")
    fixed = pa.types.is_fixed_size_list(dense_array.type)
    num_dense = dense_array.type.list_size if fixed else 0  # else empty lists: none
    dense = _numpy(dense_array.flatten()).reshape(b, num_dense)

    grouped = {c for g in config.dedup_groups for c in g}
    weighted = any(config.weight_column_of(c) is not None for c in config.sparse_columns)
    features = [c for c in config.feature_columns() if c not in grouped]
    sparse = _kjt(table, features, weighted=weighted)
    dedup_groups = [
        _dictionary_group(table, list(group), weighted=weighted)
        if all(_is_dictionary(table, c) for c in group)
        else _dedup_group(
            table, list(group), _numpy(_array(table, f"{DEDUP_PREFIX}{i}")), weighted=weighted
        )
        for i, group in enumerate(config.dedup_groups)
    ]
    sample_ids = None
    if SAMPLE_ID_COLUMN in table.column_names:
        sample_ids = _tensor(_numpy(_array(table, SAMPLE_ID_COLUMN)))
    values = {
        c: _tensor(_numpy(_array(table, VALUE_PREFIX + c).flatten()))
        for c in config.value_columns()
    }
    return Batch(
        dense=_tensor(dense),
        sparse=sparse,
        labels=_tensor(labels),
        dedup_groups=dedup_groups,
        sample_ids=sample_ids,
        sequence_values=values,
        sequence_of={c: s.columns[0] for s in config.sequences.values() for c in s.value_columns},
    )


def iter_train_batches(
    iterator: DataIterator | Dataset | WorkerSource,
    *,
    config: DataConfig,
    track_rows: bool = False,
) -> Iterator[Batch]:
    """Yields ``Batch`` es from a Ray Data iterator over preprocessed rows.

    Args:
        iterator: a worker's :class:`WorkerSource` (training), a ``ray.data.DataIterator`` or a
            ``ray.data.Dataset`` of preprocessed rows.
        config: the data config (``batch_size``, ``prefetch_batches``, column names).
        track_rows: give each batch its rows per row group (``Batch.row_groups``, from the
            row-group columns, see ``raydlrm.ingestion.reader``), which the trainer counts as
            trained when it steps on the batch.

    Yields:
        Batches of ``config.batch_size`` samples; the last one may be smaller.
    """
    from raydlrm.ingestion.reader import EpochProgress

    for table in iterator.iter_batches(
        batch_size=config.batch_size,
        batch_format="pyarrow",
        prefetch_batches=config.prefetch_batches,
    ):
        batch = arrow_to_batch(table, config=config)
        if track_rows:
            batch.row_groups = EpochProgress.rows_of(table)
        yield batch
