"""Worker side of ingestion: preprocessed Arrow batches become :class:`raydlrm.batch.Batch`.

The conversion copies as little as it can. Dense features, labels and sample ids are NumPy views
of the Arrow buffers wrapped by ``torch.from_numpy`` (no copy); the sparse ids of all features
are concatenated once into the feature-major ``values`` array the embedding kernels read, and
lengths come from the Arrow list offsets (ones for single-id columns). Because tensors may share
the Arrow batch's read-only memory, consumers must not modify a batch's tensors in place; moving
a batch to a device (or ``.clone()``) gives writable tensors.

The loader receives the Ray ``DataIterator`` (what ``ray.train.get_dataset_shard`` returns) from
its caller; it does not talk to Ray Train itself.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import torch

from raydlrm.batch import Batch, KeyedJaggedTensor
from raydlrm.ingestion.config import DataConfig
from raydlrm.ingestion.schema import SAMPLE_ID_COLUMN

if TYPE_CHECKING:
    from ray.data import DataIterator, Dataset

__all__ = ["arrow_to_batch", "iter_train_batches"]


def _array(table: pa.Table, column: str) -> pa.Array:
    chunked = table.column(column)
    if chunked.num_chunks == 1:
        return chunked.chunk(0)
    if chunked.num_chunks == 0:
        return pa.array([], type=chunked.type)
    return pa.concat_arrays(chunked.chunks)


def _numpy(array: pa.Array) -> np.ndarray:
    """A NumPy view of a primitive Arrow array without nulls (copies only if it must)."""
    return array.to_numpy(zero_copy_only=False)


def _tensor(array: np.ndarray) -> torch.Tensor:
    # Arrow buffers are read-only; torch warns about that once per process. The loader's
    # contract (module docstring) is that batch tensors are not modified in place.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)


def arrow_to_batch(table: pa.Table, *, config: DataConfig) -> Batch:
    """Converts one preprocessed Arrow batch (output of ``Preprocessor``) to a ``Batch``.

    Args:
        table: ``B`` rows with ``label`` (float32), ``dense`` (``FixedSizeList<float32>[D]``),
            each of ``config.sparse_columns`` (int64 or ``list<int64>``, already hashed) and
            optionally ``sample_id`` (int64). May be sliced or chunked.
        config: the data config; its ``sparse_columns`` give the KJT keys, in order.

    Returns:
        A ``Batch`` with dense ``(B, D)`` float32, labels ``(B,)`` float32, a KJT over
        ``config.sparse_columns`` with lengths ``(F * B,)`` and values ``(sum L,)`` int64, and
        ``sample_ids`` ``(B,)`` when the table has them.
    """
    b = table.num_rows
    labels = _numpy(_array(table, config.label_column).cast(pa.float32()))
    dense_array = _array(table, "dense")
    num_dense = dense_array.type.list_size
    dense = _numpy(dense_array.flatten()).reshape(b, num_dense)

    keys = list(config.sparse_columns)
    lengths = np.empty(len(keys) * b, dtype=np.int64)
    feature_values: list[np.ndarray] = []
    for f, column in enumerate(keys):
        ids = _array(table, column)
        if pa.types.is_list(ids.type) or pa.types.is_large_list(ids.type):
            lengths[f * b : (f + 1) * b] = _numpy(ids.value_lengths())
            feature_values.append(_numpy(ids.flatten()))
        else:
            lengths[f * b : (f + 1) * b] = 1
            feature_values.append(_numpy(ids))
    values = np.concatenate(feature_values) if feature_values else np.empty(0, np.int64)

    sample_ids = None
    if SAMPLE_ID_COLUMN in table.column_names:
        sample_ids = _tensor(_numpy(_array(table, SAMPLE_ID_COLUMN)))
    sparse = KeyedJaggedTensor(
        keys=keys,
        values=torch.from_numpy(values.astype(np.int64, copy=False)),
        lengths=torch.from_numpy(lengths),
        batch_size=b,
    )
    return Batch(
        dense=_tensor(dense),
        sparse=sparse,
        labels=_tensor(labels),
        sample_ids=sample_ids,
    )


def iter_train_batches(iterator: DataIterator | Dataset, *, config: DataConfig) -> Iterator[Batch]:
    """Yields ``Batch`` es from a Ray Data iterator over preprocessed rows.

    Args:
        iterator: a ``ray.data.DataIterator`` (e.g. from ``ray.train.get_dataset_shard``) or a
            ``ray.data.Dataset`` over the output of ``build_dataset``.
        config: the data config (``batch_size``, ``prefetch_batches``, column names).

    Yields:
        Batches of ``config.batch_size`` samples; the last one may be smaller.
    """
    for table in iterator.iter_batches(
        batch_size=config.batch_size,
        batch_format="pyarrow",
        prefetch_batches=config.prefetch_batches,
    ):
        yield arrow_to_batch(table, config=config)
