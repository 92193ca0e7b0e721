"""Statistics computed once over a data set before training (dense standardization)."""

from __future__ import annotations

import pyarrow.dataset as pads

from raydlrm.ingestion.config import DataConfig
from raydlrm.ingestion.preprocess import compute_dense_stats
from raydlrm.storage import list_files

__all__ = ["dense_stats_of"]


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
    filesystem, files = list_files(path, config.storage, config.partitions)
    dataset = pads.dataset(files, format="parquet", filesystem=filesystem)
    return compute_dense_stats(dataset.to_batches(columns=columns), config)
