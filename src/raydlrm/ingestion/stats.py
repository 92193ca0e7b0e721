"""Statistics computed once over a data set before training (dense standardization, bucket
boundaries)."""

from __future__ import annotations

import pyarrow.dataset as pads

from raydlrm.ingestion.config import DataConfig
from raydlrm.ingestion.preprocess import compute_bucket_boundaries, compute_dense_stats
from raydlrm.storage import list_files

__all__ = ["bucket_boundaries_of", "dense_stats_of"]


def _batches(path: str, config: DataConfig, columns: list[str]):
    """Record batches of ``columns`` of the data at ``path``, streamed."""
    filesystem, files = list_files(path, config.storage, config.partitions)
    dataset = pads.dataset(files, format="parquet", filesystem=filesystem)
    return dataset.to_batches(columns=columns)


def dense_stats_of(path: str, config: DataConfig) -> dict[str, tuple[float, float]]:
    """Mean and standard deviation of every standardized dense column of the data at ``path``.

    Reads only those columns, streaming record batches (one pass, constant memory).

    Args:
        path: Parquet file or directory, local or a URI.
        config: the data config (which columns are standardized, their clipping).

    Returns:
        Column -> ``(mean, std)``, as :func:`~raydlrm.ingestion.preprocess.compute_dense_stats`.
    """
    columns = config.standardized_columns()
    if not columns:
        return {}
    return compute_dense_stats(_batches(path, config, columns), config)


def bucket_boundaries_of(path: str, config: DataConfig) -> dict[str, list[float]]:
    """The bucket boundaries of every bucketized dense column of the data at ``path`` (one
    streamed pass over those columns), as
    :func:`~raydlrm.ingestion.preprocess.compute_bucket_boundaries`."""
    columns = config.bucketized_columns()
    if not columns:
        return {}
    return compute_bucket_boundaries(_batches(path, config, columns), config)
