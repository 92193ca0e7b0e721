"""Statistics computed once over the training data before training: the mean and deviation of
standardized dense columns, the fill of dense columns filled with their mean or median, and the
bucket boundaries of bucketized ones.

All are taken over a column's present values, clipped, as the preprocessor reads them: a null
is missing and counts in none of them (whatever the fill, so that missing values never squeeze
the present ones into a sliver of the standardized range), and a NaN or infinite value is a bad
row, which training does not see either. Only the bucket boundaries count a column's fill as
one more of its values when it has missing ones, since the bucketizer sees it. The driver
computes them in one streamed pass (:func:`training_statistics`) and stores them in the config,
so the workers, checkpoints and logged models carry them.

Bucket boundaries and medians need the distinct values of a column (with how often each
occurs, for a median). A column with more than :data:`MAX_DISTINCT` of them keeps a sample
whose membership depends on the value alone (its hash: kept when its low ``k`` bits are 0,
``k`` raised until the sample fits), so the sample, and the quantiles of it, do not depend on
the order of the rows.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads

from raydlrm.ingestion.config import DataConfig
from raydlrm.ingestion.preprocess import clip_dense, mix64
from raydlrm.storage import list_files

__all__ = [
    "MAX_DISTINCT",
    "TrainingStatistics",
    "bucket_boundaries_of",
    "compute_bucket_boundaries",
    "compute_dense_fill_values",
    "compute_dense_stats",
    "dense_stats_of",
    "training_statistics",
]

MAX_DISTINCT = 1 << 20
"""Distinct values of a column kept for its bucket boundaries or median (beyond: a sample)."""


@dataclass
class TrainingStatistics:
    """What :func:`training_statistics` computes (each empty when not asked for)."""

    dense_stats: dict[str, tuple[float, float]] = field(default_factory=dict)
    """``DataConfig.dense_stats``: ``(mean, std)`` of each standardized dense column."""
    dense_fill_values: dict[str, float] = field(default_factory=dict)
    """``DataConfig.dense_fill_values``: the fill of each mean- or median-filled column."""
    bucket_boundaries: dict[str, list[float]] = field(default_factory=dict)
    """``DataConfig.bucket_boundaries``: the boundaries of each bucketized column."""


def _present(batch: pa.RecordBatch | pa.Table, column: str, config: DataConfig) -> np.ndarray:
    """The present (non-null) finite values of dense ``column`` in ``batch`` as float64, read as
    the preprocessor reads them (float32) and clipped."""
    # safe=False: an int64 column (a timestamp) is read at float32 precision, not refused.
    x = pc.drop_null(batch.column(column)).cast(pa.float32(), safe=False)
    x = x.to_numpy(zero_copy_only=False).copy()
    clip_dense(x, column, config)
    return x[np.isfinite(x)].astype(np.float64)


class _Moments:
    """Running count, sum and sum of squares of the present values of each of ``columns``."""

    def __init__(self, config: DataConfig, columns: list[str]):
        self.config = config
        self.columns = columns
        self.count = np.zeros(len(columns))
        self.sums = np.zeros(len(columns))
        self.squares = np.zeros(len(columns))

    def add(self, batch: pa.RecordBatch | pa.Table) -> None:
        for j, column in enumerate(self.columns):
            x = _present(batch, column, self.config)
            self.count[j] += x.size
            self.sums[j] += x.sum()
            self.squares[j] += np.square(x).sum()

    def mean_std(self, column: str) -> tuple[float, float] | None:
        """Mean and standard deviation (1 for a constant column); None without a value."""
        j = self.columns.index(column)
        if not self.count[j]:
            return None
        mean = self.sums[j] / self.count[j]
        std = float(np.sqrt(max(self.squares[j] / self.count[j] - mean * mean, 0.0)))
        return float(mean), std if std > 0 else 1.0


class _Distinct:
    """The distinct present values of each of ``columns`` and how often each occurs (a
    value-hash sample beyond :data:`MAX_DISTINCT`), and whether the column has missing ones."""

    def __init__(self, config: DataConfig, columns: list[str]):
        self.config = config
        self.columns = columns
        self.kept = {c: (np.empty(0), np.empty(0, dtype=np.int64)) for c in columns}
        self.pending: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {c: [] for c in columns}
        self.pending_size = dict.fromkeys(columns, 0)
        self.bits = dict.fromkeys(columns, 0)  # a value is kept when its hash's low bits are 0
        self.missing = dict.fromkeys(columns, False)

    def add(self, batch: pa.RecordBatch | pa.Table) -> None:
        for column in self.columns:
            self.missing[column] |= batch.column(column).null_count > 0
            values, counts = np.unique(_present(batch, column, self.config), return_counts=True)
            keep = self._sampled(values, column)
            self.pending[column].append((values[keep], counts[keep]))
            self.pending_size[column] += int(keep.sum())
            if self.pending_size[column] > MAX_DISTINCT:
                self._merge(column)

    def _sampled(self, values: np.ndarray, column: str) -> np.ndarray:
        """Which of ``values`` the sample keeps (bool)."""
        if not self.bits[column]:
            return np.ones(values.size, dtype=bool)
        mask = np.uint64((1 << self.bits[column]) - 1)
        return (mix64(values.view(np.int64)) & mask) == 0

    def _merge(self, column: str) -> None:
        parts = [self.kept[column], *self.pending[column]]
        values, inverse = np.unique(np.concatenate([v for v, _ in parts]), return_inverse=True)
        counts = np.bincount(
            inverse, weights=np.concatenate([n for _, n in parts]), minlength=values.size
        ).astype(np.int64)
        while values.size > MAX_DISTINCT:
            self.bits[column] += 1
            keep = self._sampled(values, column)
            values, counts = values[keep], counts[keep]
        self.kept[column], self.pending[column], self.pending_size[column] = (values, counts), [], 0

    def median(self, column: str) -> float | None:
        """The median of the column's (sampled) values; None without a value."""
        self._merge(column)
        values, counts = self.kept[column]
        if not values.size:
            return None
        cumulative = np.cumsum(counts)
        total = int(cumulative[-1])
        # The middle value, or the mean of the two middle ones (as numpy.median).
        low, high = np.searchsorted(cumulative, [(total - 1) // 2, total // 2], side="right")
        return float((values[low] + values[high]) / 2)

    def boundaries(self, column: str, *, fill: float) -> list[float]:
        """The bucket boundaries of the column's values, its (clipped) ``fill`` among them when
        it has missing values."""
        self._merge(column)
        values = self.kept[column][0]
        if self.missing[column]:
            filled = np.array([fill], dtype=np.float32)
            clip_dense(filled, column, self.config)
            filled = filled.astype(np.float64)
            values = np.union1d(values, filled[self._sampled(filled, column)])
        return _boundaries(values, self.config.buckets_of(column))


def _boundaries(values: np.ndarray, buckets: int) -> list[float]:
    """Boundaries of at most ``buckets`` buckets over the sorted distinct ``values``: one bucket
    per value when they are few enough (boundaries halfway), else quantiles of the values."""
    if values.size <= 1:
        return []
    if values.size <= buckets:
        return ((values[1:] + values[:-1]) / 2).tolist()
    quantiles = np.quantile(values, np.linspace(0.0, 1.0, buckets + 1)[1:-1])
    return np.unique(quantiles).tolist()


class _Pass:
    """The accumulators of one pass over the data for the statistics asked for: moments of the
    standardized and mean-filled columns, distinct values of the bucketized and median-filled
    ones (the fill values the config lacks: those asked for, those the boundaries need)."""

    def __init__(self, config: DataConfig, *, dense: bool, fills: bool, buckets: bool):
        self.config = config
        self.standardized = config.standardized_columns() if dense else []
        self.bucketized = config.bucketized_columns() if buckets else []
        self.filled = [
            c
            for c in config.computed_fill_columns()
            if (fills or c in self.bucketized) and c not in config.dense_fill_values
        ]
        self.fills = fills
        means = {c for c in self.filled if config.dense_fill_of(c) == "mean"}
        self.moments = _Moments(
            config, [c for c in config.dense_columns if c in self.standardized or c in means]
        )
        self.distinct = _Distinct(
            config,
            [
                c
                for c in config.dense_columns
                if c in self.bucketized or (c in self.filled and c not in means)
            ],
        )

    @property
    def columns(self) -> list[str]:
        """The columns the pass reads."""
        return sorted({*self.moments.columns, *self.distinct.columns})

    def add(self, batch: pa.RecordBatch | pa.Table) -> None:
        self.moments.add(batch)
        self.distinct.add(batch)

    def result(self, *, source: str = "the data") -> TrainingStatistics:
        """The statistics of the batches added; ``source`` names them in an error."""
        config = self.config
        stats = {}
        for column in self.standardized:
            stats[column] = self.moments.mean_std(column)
            if stats[column] is None:
                raise ValueError(
                    f"cannot compute the mean of standardized dense column {column!r}: "
                    f"{source} has no present (non-null), finite value of it"
                )
        fill_values = {c: self._fill_value(c, source=source) for c in self.filled}
        fill_of = {**fill_values, **config.dense_fill_values}
        return TrainingStatistics(
            dense_stats=stats,
            dense_fill_values=fill_values if self.fills else {},
            bucket_boundaries={
                c: self.distinct.boundaries(c, fill=fill_of.get(c, 0.0)) for c in self.bucketized
            },
        )

    def _fill_value(self, column: str, *, source: str) -> float:
        policy = self.config.dense_fill_of(column)
        if policy == "mean":
            moments = self.moments.mean_std(column)
            value = None if moments is None else moments[0]
        else:
            value = self.distinct.median(column)
        if value is None:
            raise ValueError(
                f"{self.config.fill_key_of(column)} = {policy!r}: dense column {column!r} has "
                f"no present (non-null, finite) value in {source} to take the {policy} of; "
                'fill it with "zero" or leave the column out'
            )
        return value


def _computed(
    batches: Iterable[pa.RecordBatch | pa.Table],
    config: DataConfig,
    *,
    dense: bool = False,
    fills: bool = False,
    buckets: bool = False,
) -> TrainingStatistics:
    accumulators = _Pass(config, dense=dense, fills=fills, buckets=buckets)
    for batch in batches:
        accumulators.add(batch)
    return accumulators.result()


def compute_dense_stats(
    batches: Iterable[pa.RecordBatch | pa.Table], config: DataConfig
) -> dict[str, tuple[float, float]]:
    """Mean and standard deviation of each standardized dense column over ``batches`` (their
    present, finite values, clipped), accumulated in float64 in one pass.

    Returns:
        Column -> ``(mean, std)`` (``std`` is 1 for a constant column).

    Raises:
        ValueError: a standardized column with no present, finite value, naming it.
    """
    return _computed(batches, config, dense=True).dense_stats


def compute_dense_fill_values(
    batches: Iterable[pa.RecordBatch | pa.Table], config: DataConfig
) -> dict[str, float]:
    """The fill of each dense column filled with its ``mean`` or ``median`` over ``batches``:
    that statistic of its present, finite values, clipped, in raw units (see
    ``DataConfig.dense_fill_values``), in one pass.

    Returns:
        Column -> fill value, for the columns ``config.dense_fill_values`` lacks.

    Raises:
        ValueError: a mean- or median-filled column with no present, finite value, naming it
            and the key that sets its fill.
    """
    return _computed(batches, config, fills=True).dense_fill_values


def compute_bucket_boundaries(
    batches: Iterable[pa.RecordBatch | pa.Table], config: DataConfig
) -> dict[str, list[float]]:
    """The bucket boundaries of each bucketized dense column over ``batches`` (see
    ``DataConfig.bucket_boundaries``; a mean- or median-filled column's fill is taken from
    ``config.dense_fill_values``, or computed in the same pass).

    Returns:
        Column -> ascending finite boundaries, fewer than its buckets (none for a column of
        one value, or of no finite value).
    """
    return _computed(batches, config, buckets=True).bucket_boundaries


def training_statistics(
    path: str,
    config: DataConfig,
    *,
    dense: bool = True,
    fills: bool = True,
    buckets: bool = True,
) -> TrainingStatistics:
    """The dense statistics (``dense``), fill values (``fills``: those the config lacks) and
    bucket boundaries (``buckets``) of the data at ``path`` (Parquet file or directory, local
    or a URI), in one streamed pass over the columns they need.

    Returns:
        What was asked for, as :func:`compute_dense_stats`, :func:`compute_dense_fill_values`
        and :func:`compute_bucket_boundaries` compute it.

    Raises:
        ValueError: a column with no present value to take a statistic of, naming it.
    """
    accumulators = _Pass(config, dense=dense, fills=fills, buckets=buckets)
    if accumulators.columns:
        filesystem, files = list_files(path, config.storage, config.partitions)
        dataset = pads.dataset(files, format="parquet", filesystem=filesystem)
        for batch in dataset.to_batches(columns=accumulators.columns):
            accumulators.add(batch)
    return accumulators.result(source=f"the data at {path}")


def dense_stats_of(path: str, config: DataConfig) -> dict[str, tuple[float, float]]:
    """The dense statistics of the data at ``path`` (see :func:`training_statistics`)."""
    return training_statistics(path, config, fills=False, buckets=False).dense_stats


def bucket_boundaries_of(path: str, config: DataConfig) -> dict[str, list[float]]:
    """The bucket boundaries of the data at ``path`` (see :func:`training_statistics`)."""
    return training_statistics(path, config, dense=False, fills=False).bucket_boundaries
