"""Statistics computed once over the training data before training: the mean and deviation of
standardized dense columns and the bucket boundaries of bucketized ones.

Both are taken over the finite values (a NaN or infinite value is a bad row, which training
does not see either), null-filled with 0 and clipped, as the preprocessor reads them. The
driver computes them in one streamed pass (:func:`training_statistics`) and stores them in the
config, so the workers, checkpoints and logged models carry them.

Bucket boundaries need the distinct values of a column. A column with more than
:data:`MAX_DISTINCT` of them keeps a sample whose membership depends on the value alone (its
hash: kept when its low ``k`` bits are 0, ``k`` raised until the sample fits), so the sample,
and the quantiles of it, do not depend on the order of the rows.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads

from raydlrm.ingestion.config import DataConfig
from raydlrm.ingestion.preprocess import clip_dense, dense_values, mix64
from raydlrm.storage import list_files

__all__ = [
    "MAX_DISTINCT",
    "bucket_boundaries_of",
    "compute_bucket_boundaries",
    "compute_dense_stats",
    "dense_stats_of",
    "training_statistics",
]

MAX_DISTINCT = 1 << 20
"""Distinct values of a column kept for its bucket boundaries (beyond: a sample of them)."""


def _finite(batch: pa.RecordBatch | pa.Table, column: str, config: DataConfig) -> np.ndarray:
    """The finite values of dense ``column`` in ``batch`` as float64: null-filled, clipped."""
    x = dense_values(batch, column)
    clip_dense(x, column, config)
    return x[np.isfinite(x)].astype(np.float64)


class _Moments:
    """Running count, sum and sum of squares of each standardized column."""

    def __init__(self, config: DataConfig):
        self.config = config
        self.columns = config.standardized_columns()
        self.count = np.zeros(len(self.columns))
        self.sums = np.zeros(len(self.columns))
        self.squares = np.zeros(len(self.columns))

    def add(self, batch: pa.RecordBatch | pa.Table) -> None:
        for j, column in enumerate(self.columns):
            x = _finite(batch, column, self.config)
            self.count[j] += x.size
            self.sums[j] += x.sum()
            self.squares[j] += np.square(x).sum()

    def result(self) -> dict[str, tuple[float, float]]:
        stats = {}
        for j, column in enumerate(self.columns):
            if not self.count[j]:
                raise ValueError(
                    f"cannot compute the mean of standardized dense column {column!r}: the "
                    "data set has no finite value of it"
                )
            mean = self.sums[j] / self.count[j]
            std = float(np.sqrt(max(self.squares[j] / self.count[j] - mean * mean, 0.0)))
            stats[column] = (float(mean), std if std > 0 else 1.0)
        return stats


class _Distinct:
    """The distinct finite values of each bucketized column (a value-hash sample beyond
    :data:`MAX_DISTINCT`)."""

    def __init__(self, config: DataConfig):
        self.config = config
        self.columns = config.bucketized_columns()
        self.kept = {c: np.empty(0) for c in self.columns}
        self.pending: dict[str, list[np.ndarray]] = {c: [] for c in self.columns}
        self.pending_size = dict.fromkeys(self.columns, 0)
        self.bits = dict.fromkeys(self.columns, 0)  # a value is kept when its hash's low bits are 0

    def add(self, batch: pa.RecordBatch | pa.Table) -> None:
        for column in self.columns:
            x = self._sampled(np.unique(_finite(batch, column, self.config)), column)
            self.pending[column].append(x)
            self.pending_size[column] += x.size
            if self.pending_size[column] > MAX_DISTINCT:
                self._merge(column)

    def _sampled(self, values: np.ndarray, column: str) -> np.ndarray:
        if not self.bits[column]:
            return values
        mask = np.uint64((1 << self.bits[column]) - 1)
        return values[(mix64(values.view(np.int64)) & mask) == 0]

    def _merge(self, column: str) -> None:
        merged = np.unique(np.concatenate([self.kept[column], *self.pending[column]]))
        while merged.size > MAX_DISTINCT:
            self.bits[column] += 1
            merged = self._sampled(merged, column)
        self.kept[column], self.pending[column], self.pending_size[column] = merged, [], 0

    def result(self) -> dict[str, list[float]]:
        for column in self.columns:
            self._merge(column)
        return {c: _boundaries(self.kept[c], self.config.buckets_of(c)) for c in self.columns}


def _boundaries(values: np.ndarray, buckets: int) -> list[float]:
    """Boundaries of at most ``buckets`` buckets over the sorted distinct ``values``: one bucket
    per value when they are few enough (boundaries halfway), else quantiles of the values."""
    if values.size <= 1:
        return []
    if values.size <= buckets:
        return ((values[1:] + values[:-1]) / 2).tolist()
    quantiles = np.quantile(values, np.linspace(0.0, 1.0, buckets + 1)[1:-1])
    return np.unique(quantiles).tolist()


def compute_dense_stats(
    batches: Iterable[pa.RecordBatch | pa.Table], config: DataConfig
) -> dict[str, tuple[float, float]]:
    """Mean and standard deviation of each standardized dense column over ``batches`` (their
    finite values, null-filled and clipped), accumulated in float64 in one pass.

    Returns:
        Column -> ``(mean, std)`` (``std`` is 1 for a constant column).

    Raises:
        ValueError: a standardized column with no finite value, naming it.
    """
    moments = _Moments(config)
    for batch in batches:
        moments.add(batch)
    return moments.result()


def compute_bucket_boundaries(
    batches: Iterable[pa.RecordBatch | pa.Table], config: DataConfig
) -> dict[str, list[float]]:
    """The bucket boundaries of each bucketized dense column over ``batches`` (see
    ``DataConfig.bucket_boundaries``).

    Returns:
        Column -> ascending finite boundaries, fewer than its buckets (none for a column of
        one value, or of no finite value).
    """
    distinct = _Distinct(config)
    for batch in batches:
        distinct.add(batch)
    return distinct.result()


def training_statistics(
    path: str, config: DataConfig, *, dense: bool = True, buckets: bool = True
) -> tuple[dict[str, tuple[float, float]], dict[str, list[float]]]:
    """The dense statistics (``dense``) and bucket boundaries (``buckets``) of the data at
    ``path`` (Parquet file or directory, local or a URI), in one streamed pass over the columns
    they need.

    Returns:
        ``(dense_stats, bucket_boundaries)``, as :func:`compute_dense_stats` and
        :func:`compute_bucket_boundaries` (empty when not asked for).
    """
    moments = _Moments(config) if dense else None
    distinct = _Distinct(config) if buckets else None
    columns = sorted(
        {*(moments.columns if moments else []), *(distinct.columns if distinct else [])}
    )
    if columns:
        filesystem, files = list_files(path, config.storage, config.partitions)
        dataset = pads.dataset(files, format="parquet", filesystem=filesystem)
        for batch in dataset.to_batches(columns=columns):
            for accumulator in (moments, distinct):
                if accumulator is not None:
                    accumulator.add(batch)
    return (
        moments.result() if moments else {},
        distinct.result() if distinct else {},
    )


def dense_stats_of(path: str, config: DataConfig) -> dict[str, tuple[float, float]]:
    """The dense statistics of the data at ``path`` (see :func:`training_statistics`)."""
    return training_statistics(path, config, buckets=False)[0]


def bucket_boundaries_of(path: str, config: DataConfig) -> dict[str, list[float]]:
    """The bucket boundaries of the data at ``path`` (see :func:`training_statistics`)."""
    return training_statistics(path, config, dense=False)[1]
