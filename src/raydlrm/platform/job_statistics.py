"""The statistics a job's model means: dense statistics, fill values, bucket boundaries and id
kinds, taken in one order. A checkpoint the run resumes was trained with them, then the warm
start's, then the training data's, for the columns still without: a model's features keep
their meaning."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any

from raydlrm.ingestion import check_id_kinds, id_kinds_of
from raydlrm.ingestion.stats import training_statistics
from raydlrm.platform.config import JobConfig

if TYPE_CHECKING:
    from raydlrm.platform.job_data import JobData

__all__ = ["data_id_kinds", "with_id_kinds", "with_recorded_statistics", "with_statistics"]

logger = logging.getLogger(__name__)


def data_id_kinds(job: JobConfig, data: JobData) -> dict[str, str]:
    """The id kinds of the training data, checked against those the job already records (a
    warm start's, the config's), and the held-out data's against them."""
    check_id_kinds(data.train.schema, job.data, what=f"training data {data.train.path}")
    kinds = {**id_kinds_of(data.train.schema, job.data), **job.data.id_kinds}
    if data.evaluation is not None:
        recorded = dataclasses.replace(job.data, id_kinds=kinds)
        check_id_kinds(data.evaluation.schema, recorded, what=f"eval data {data.evaluation.path}")
    return kinds


def with_id_kinds(job: JobConfig, kinds: dict[str, str]) -> JobConfig:
    """``job`` with ``kinds`` for the sparse columns it records none for."""
    new = {c: k for c, k in kinds.items() if c not in job.data.id_kinds}
    if not new:
        return job
    merged = {**job.data.id_kinds, **new}
    return dataclasses.replace(job, data=dataclasses.replace(job.data, id_kinds=merged))


def with_recorded_statistics(
    job: JobConfig, *, resumed: dict[str, Any] | None, warm: dict[str, Any] | None
) -> JobConfig:
    """``job`` with the dense statistics, fill values and bucket boundaries its model means, in
    one order:
    the checkpoint the run resumes (``resumed``, its state) was trained with them, then the
    warm start's (``warm``), then the training data's for the columns still without (a
    model's features keep their meaning; the first that holds a column's wins)."""
    for state in (resumed, warm):
        if state is not None:
            job = with_statistics(job, state["spec"]["data"])
    return with_statistics(job, _training_statistics(job))


def with_statistics(job: JobConfig, recorded: dict[str, Any]) -> JobConfig:
    """``job`` with the dense statistics, fill values and bucket boundaries of ``recorded`` (a
    data config as a dict: a warm start's, a resumed run's, the training data's) for the
    columns it holds none for: those the job already has win, so a model's features keep
    their meaning. A recorded fill value counts only where ``recorded`` fills the column with
    the same statistic (a mean is no median)."""
    data = job.data
    stats = recorded.get("dense_stats") or {}
    fills = recorded.get("dense_fill_values") or {}
    bounds = recorded.get("bucket_boundaries") or {}
    new_stats = {
        c: tuple(stats[c])
        for c in data.standardized_columns()
        if c not in data.dense_stats and c in stats
    }
    new_fills = {
        c: float(fills[c])
        for c in data.computed_fill_columns()
        if c not in data.dense_fill_values
        and c in fills
        and _recorded_fill(recorded, c) in (None, data.dense_fill_of(c))
    }
    new_bounds = {
        c: list(bounds[c])
        for c in data.bucketized_columns()
        if c not in data.bucket_boundaries and c in bounds
    }
    if not new_stats and not new_fills and not new_bounds:
        return job
    return dataclasses.replace(
        job,
        data=dataclasses.replace(
            data,
            dense_stats={**new_stats, **data.dense_stats},
            dense_fill_values={**new_fills, **data.dense_fill_values},
            bucket_boundaries={**new_bounds, **data.bucket_boundaries},
        ),
    )


def _recorded_fill(recorded: dict[str, Any], column: str) -> str | None:
    """The fill policy of dense ``column`` in a recorded data config (a dict); None when it
    does not say (the training data's statistics: computed for the job's own policy)."""
    if "dense_fill" not in recorded:
        return None
    spec = (recorded.get("dense_specs") or {}).get(column) or {}
    return spec.get("fill") or recorded["dense_fill"]


def _training_statistics(job: JobConfig) -> dict[str, Any]:
    """The dense statistics, fill values and bucket boundaries over the training data that the
    config does not hold yet, computed once in one pass; they travel in the config to the
    workers, the checkpoint and the logged model."""
    data = job.data
    stats = [c for c in data.standardized_columns() if c not in data.dense_stats]
    fills = [c for c in data.computed_fill_columns() if c not in data.dense_fill_values]
    bounds = [c for c in data.bucketized_columns() if c not in data.bucket_boundaries]
    if not stats and not fills and not bounds:
        return {}
    started = time.perf_counter()
    computed = training_statistics(
        data.train_path, data, dense=bool(stats), fills=bool(fills), buckets=bool(bounds)
    )
    logger.info(
        "statistics of the dense columns over %s in %.1fs: mean and deviation %s; fill %s; "
        "buckets %s",
        data.train_path,
        time.perf_counter() - started,
        {c: (round(m, 4), round(s, 4)) for c, (m, s) in computed.dense_stats.items()},
        {c: round(v, 4) for c, v in computed.dense_fill_values.items()},
        {c: len(b) + 1 for c, b in computed.bucket_boundaries.items()},
    )
    return dataclasses.asdict(computed)
