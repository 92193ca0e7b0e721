"""A table as the learned cost model sees it: :data:`NUM_FEATURES` features of its shape and
of how a batch looks it up (:class:`TableStats`); and :class:`CostModelError`, which samples and
models that cannot be used raise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = [
    "HISTOGRAM_BINS",
    "NUM_FEATURES",
    "CostModelError",
    "TableStats",
    "access_histogram",
    "histogram_of_counts",
]

HISTOGRAM_BINS = 17
NUM_FEATURES = 3 + HISTOGRAM_BINS


class CostModelError(ValueError):
    """Cost samples or a learned model that cannot be used (missing, another kernel or machine,
    malformed), naming the file and what is wrong."""


@dataclass(frozen=True)
class TableStats:
    """What the learned model knows of a table: its shape and how a batch looks it up."""

    rows: int
    dim: int
    pooling: float
    """Mean ids per bag."""
    histogram: tuple[float, ...]
    """:func:`access_histogram` of a batch's ids."""

    def features(self) -> list[float]:
        """The table's :data:`NUM_FEATURES` features (before normalisation)."""
        return [math.log10(max(self.rows, 1)), float(self.dim), self.pooling, *self.histogram]

    @classmethod
    def of_batch(cls, *, rows: int, dim: int, ids: np.ndarray, bags: int) -> TableStats:
        """The statistics of one batch of ``bags`` bags whose ids are ``ids``."""
        return cls(rows, dim, len(ids) / max(bags, 1), access_histogram(ids))

    @classmethod
    def uniform(cls, *, rows: int, dim: int, pooling: float, bags: int) -> TableStats:
        """The statistics of ``bags`` bags of ``pooling`` ids each drawn uniformly from
        ``rows`` rows (what the planner assumes of a table the data says nothing of)."""
        ids = np.random.default_rng(0).integers(0, rows, size=max(1, round(bags * pooling)))
        return cls(rows, dim, pooling, access_histogram(ids))


def access_histogram(ids: np.ndarray) -> tuple[float, ...]:
    """Fractions of a batch's distinct ids by how often each is looked up: bin ``b`` holds
    those looked up ``2^b`` to ``2^(b+1) - 1`` times (the last bin: ``2^16`` or more). All
    zeros for an empty batch."""
    if len(ids) == 0:
        return (0.0,) * HISTOGRAM_BINS
    return histogram_of_counts(np.unique(ids, return_counts=True)[1])


def histogram_of_counts(counts: np.ndarray) -> tuple[float, ...]:
    """:func:`access_histogram` of the look-up counts of a batch's distinct ids."""
    counts = np.asarray(counts)
    if len(counts) == 0:
        return (0.0,) * HISTOGRAM_BINS
    bins = np.minimum(np.log2(counts).astype(np.int64), HISTOGRAM_BINS - 1)
    hist = np.bincount(bins, minlength=HISTOGRAM_BINS) / len(counts)
    return tuple(float(v) for v in hist)
