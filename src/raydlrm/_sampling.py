"""Random draws shared by the synthetic data (ingestion) and the cost samples (sharding)."""

from __future__ import annotations

import numpy as np

__all__ = ["zipf_ranks"]


def zipf_ranks(
    rng: np.random.Generator, *, size: int | tuple[int, ...], cardinality: int, s: float
) -> np.ndarray:
    """Ranks in ``[0, cardinality)`` with P(rank) ~ (rank + 1) ** -s (inverse CDF, continuous)."""
    u = rng.random(size)
    n = cardinality + 1.0
    if abs(s - 1.0) < 1e-6:
        return np.minimum((n**u).astype(np.int64) - 1, cardinality - 1)
    x = ((n ** (1.0 - s) - 1.0) * u + 1.0) ** (1.0 / (1.0 - s))
    return np.minimum(x.astype(np.int64) - 1, cardinality - 1)
