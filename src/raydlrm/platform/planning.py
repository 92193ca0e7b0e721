"""The one planning pipeline: what the driver settles about a job before Ray starts, in a fixed
order. ``train``, ``tune``, ``plan`` and ``retrain`` (which trains through ``train``) all call
:func:`plan_job`, so no caller can run the steps in another order.

1. the job resolved (a caller's ``ScalingConfig``, paths, the quarantine path);
2. its data present, valid and its file order sampled;
3. for a run: its storage writable, and a run with checkpoints resumable;
4. what the run continues from: the checkpoint it resumes (and the shuffle window it reads
   with), the warm start's;
5. the statistics its model means, in one order: the resumed checkpoint's, then the warm
   start's, then the training data's
   (:func:`~raydlrm.platform.job_statistics.with_recorded_statistics`);
6. the dedup groups ``data.dedup = "infer"`` asks for, and the data's shape;
7. ``model.towers = "auto"`` resolved (the recorded checkpoint's towers, else a warm-up);
8. the sharding plan;
9. the checks that need the plan (SSD space, the warm start's tables, a resume's settings and
   what its epoch's order depends on), the id kinds of every sparse column, and the tracking
   server.

A dry plan (``raydlrm plan``: no run) stops after step 8 and skips what needs a run or the whole
data's statistics.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray.train
from ray.train import ScalingConfig

from raydlrm.ingestion import DataValidationError
from raydlrm.platform.config import ConfigError, JobConfig
from raydlrm.platform.job_data import (
    DataShape,
    JobData,
    data_shape,
    resolve_dedup_groups,
    validate_job_data,
)
from raydlrm.platform.job_statistics import data_id_kinds, with_id_kinds, with_recorded_statistics
from raydlrm.platform.memory import check_shuffle_window
from raydlrm.platform.preflight import (
    check_dense_precision,
    check_resumable,
    check_run_storage,
    check_ssd_space,
    make_plan,
    resolve_job,
    resolve_paths,
)
from raydlrm.platform.recorded import (
    WarmStart,
    check_resume,
    check_warm_start,
    resumed_state,
    warm_start_state,
)
from raydlrm.platform.tracking import check_tracking_of
from raydlrm.sharding import ShardingPlan
from raydlrm.storage import is_remote

__all__ = ["PlannedJob", "plan_job"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PlannedJob:
    """A job as the driver settled it before Ray starts."""

    job: JobConfig
    """The job with its statistics, id kinds, dedup groups and towers written in."""
    plan: ShardingPlan
    data: JobData | None
    """The validated data sets (None: a dry plan of a job whose data is not there yet)."""
    shape: DataShape | None
    """What the planner read off the training data's first rows."""
    warm_start: ray.train.Checkpoint | None
    """The ``run.warm_start`` checkpoint, checked, or None."""
    resumed: tuple[str, dict[str, Any]] | None
    """The checkpoint the run resumes from (path, ``trainer_state.json``), checked, or None."""


def plan_job(
    job: JobConfig,
    *,
    run_name: str | None,
    scaling_config: ScalingConfig | None = None,
) -> PlannedJob:
    """The job planned in the module docstring's order; ``run_name`` None: a dry plan.

    Every ``ValueError`` of the pipeline (bad input, by the project's convention: a statistic
    the data cannot give, a plan over the budget, ...) leaves as a :class:`ConfigError`, with
    its message, unless it is a ``DataValidationError``: nothing has run yet, and a caller (the
    command line: exit 2 and one line) tells bad input apart by these two types.

    Raises:
        ConfigError: naming the key whose setting cannot work (and why), or any other bad
            input found before Ray starts (the original error chained).
        DataValidationError: missing or malformed data, named.
    """
    try:
        return _dry_plan(job) if run_name is None else _planned(job, run_name, scaling_config)
    except (ConfigError, DataValidationError):
        raise
    except ValueError as exc:
        logger.debug("planning the job failed", exc_info=exc)  # with -v: where it came from
        raise ConfigError(str(exc)) from exc


def _planned(job: JobConfig, run_name: str, scaling_config: ScalingConfig | None) -> PlannedJob:
    """A run's plan (see :func:`plan_job`)."""
    job = resolve_job(job, run_name=run_name, scaling_config=scaling_config)
    check_dense_precision(job)
    data = validate_job_data(job)
    check_run_storage(job, run_name)
    check_resumable(job, run_name)
    resumed = resumed_state(job, run_name)
    check_shuffle_window(job, data.train, resumed=_state(resumed))
    warm = warm_start_state(job) if job.run.warm_start else None
    job = with_recorded_statistics(job, resumed=_state(resumed), warm=_state(warm))
    job = resolve_dedup_groups(job, data)
    shape = data_shape(job, data)
    job = _resolve_towers(job, data, shape, recorded=_state(resumed) or _state(warm))
    plan = make_plan(job, shape=shape)
    check_ssd_space(job, plan)
    if warm is not None:
        check_warm_start(warm, job=job, plan=plan)
        job = with_id_kinds(job, warm.data.get("id_kinds") or {})
    job = with_id_kinds(job, data_id_kinds(job, data))
    if resumed is not None:
        check_resume(job, plan, run_name, resumed, train=data.train)
    check_tracking_of(job)
    return PlannedJob(
        job=job,
        plan=plan,
        data=data,
        shape=shape,
        warm_start=None if warm is None else warm.checkpoint,
        resumed=resumed,
    )


def _dry_plan(job: JobConfig) -> PlannedJob:
    """The plan training would make of ``job`` without a run: with the training data's shape
    (and auto towers) when the data is there, else every bag taken to hold one id."""
    job = resolve_paths(job)
    data = shape = None
    if is_remote(job.data.train_path) or Path(job.data.train_path).exists():
        data = validate_job_data(job)
        check_shuffle_window(job, data.train)
        job = resolve_dedup_groups(job, data)
        shape = data_shape(job, data)
        if job.model.towers == "auto":
            warm = warm_start_state(job) if job.run.warm_start else None
            job = with_recorded_statistics(job, resumed=None, warm=_state(warm))
            job = _resolve_towers(job, data, shape, recorded=_state(warm))
    plan = make_plan(job, shape=shape)
    return PlannedJob(job=job, plan=plan, data=data, shape=shape, warm_start=None, resumed=None)


def _state(recorded: tuple[str, dict[str, Any]] | WarmStart | None) -> dict[str, Any] | None:
    """A recorded checkpoint's ``trainer_state.json``."""
    if recorded is None:
        return None
    return recorded.state if isinstance(recorded, WarmStart) else recorded[1]


def _resolve_towers(
    job: JobConfig, data: JobData, shape: DataShape, *, recorded: dict[str, Any] | None
) -> JobConfig:
    """``model.towers = "auto"`` resolved (:mod:`raydlrm.platform.auto_towers`: the towers of
    ``recorded``, the checkpoint the run resumes or warm-starts from, else a warm-up on the
    training data); any other job as it is."""
    if job.model.towers != "auto":
        return job
    from raydlrm.platform.auto_towers import resolve_towers

    return resolve_towers(job, data, shape, recorded=recorded)
