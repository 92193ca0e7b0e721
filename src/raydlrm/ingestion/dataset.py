"""The Ray Data pipeline from Parquet to preprocessed rows.

:func:`build_dataset` validates the data set's footers (:func:`validate_data`), reads only the
columns the model needs with ``ray.data.read_parquet`` and preprocesses them with
:class:`Preprocessor` on an actor pool (actors keep their state between batches and let the pool
size be bounded independently of the number of read tasks). The result is lazy: nothing runs until
it is iterated. Training does not use it (each worker reads its own row groups:
``raydlrm.ingestion.reader``); it is the plain Ray Data path for batch jobs over a data set
(``benchmarks/ingest_startup.py``).
"""

from __future__ import annotations

import logging
import math

import ray
import ray.data

from raydlrm.ingestion.config import DataConfig
from raydlrm.ingestion.preprocess import Preprocessor
from raydlrm.ingestion.reader import PREPROCESS_ACTOR_CPUS, default_num_actors
from raydlrm.ingestion.schema import SAMPLE_ID_COLUMN, validate_data
from raydlrm.storage import list_files

__all__ = ["build_dataset"]

logger = logging.getLogger(__name__)


def build_dataset(
    path: str, config: DataConfig, *, num_actors: int | None = None, role: str = "train"
) -> ray.data.Dataset:
    """A lazy Ray dataset of preprocessed rows (see ``Preprocessor`` for the columns).

    Args:
        path: Parquet file or directory, local or a URI (``s3://...``).
        config: the data config (columns, table sizes, actor pool size).
        num_actors: size of the preprocessing actor pool; defaults to
            ``config.num_preprocess_actors``, or :func:`default_num_actors` when that is 0.
        role: what the data is for (``"train"``, ``"eval"``), used in error messages.

    Returns:
        A ``ray.data.Dataset`` of preprocessed rows; ``sample_id`` is kept when the files have it.

    Raises:
        DataValidationError: the path, its files or its columns do not match ``config``.
    """
    summary = validate_data(path, config, role=role)
    columns = config.input_columns()
    if SAMPLE_ID_COLUMN in summary.schema.names:
        columns.append(SAMPLE_ID_COLUMN)
    size = num_actors or config.num_preprocess_actors or default_num_actors()
    # More actors than preprocessing batches would never get work (an 8k-row eval set is one
    # batch); every pass over the data starts a fresh pool, so idle actors only cost start-up.
    max_size = max(1, min(size, math.ceil(summary.num_rows / config.preprocess_batch_size)))
    logger.info(
        "%s data %s: %d rows in %d files; preprocessing on 1 to %d actors",
        role,
        path,
        summary.num_rows,
        summary.num_files,
        max_size,
    )
    filesystem, files = list_files(path, config.storage, config.partitions_for(role), role=role)
    return ray.data.read_parquet(files, filesystem=filesystem, columns=columns).map_batches(
        Preprocessor,
        fn_constructor_kwargs={"config": config},
        batch_format="pyarrow",
        batch_size=config.preprocess_batch_size,
        compute=_actor_pool(max_size),
        num_cpus=PREPROCESS_ACTOR_CPUS,
    )


def _actor_pool(max_size: int) -> ray.data.ActorPoolStrategy:
    """The preprocessing pool of one pass: starts with one actor and grows to ``max_size``.

    Ray Data starts a new pool on every execution, i.e. on every epoch and every evaluation pass,
    and the first batch waits for the pool's initial actors (each a fresh worker process). One
    initial actor is enough to start the stream; the pool's autoscaler adds actors while blocks
    queue up, up to ``max_size``.
    """
    return ray.data.ActorPoolStrategy(min_size=1, max_size=max_size, initial_size=1)
