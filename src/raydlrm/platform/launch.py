"""Launching a training job: the driver side of ``raydlrm train`` and ``raydlrm.train``.

:func:`train` is a sequence of named steps: plan the job before Ray starts (resolve it,
validate its data, its statistics, towers and sharding plan, and every check that can run
there: :func:`raydlrm.platform.planning.plan_job`), connect to Ray
(:mod:`raydlrm.platform.ray_init`), open the job's MLflow run, run Ray Train's
``TorchTrainer`` (:func:`_run`), log and register the final model, and account for every
training row. A failure after the run was opened marks the run failed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import signal
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import ray.train
from ray.train import CheckpointConfig as RayCheckpointConfig
from ray.train import (
    FailureConfig,
    LoggingConfig,
    RunConfig,
    ScalingConfig,
    TrainingFailedError,
    UserCallback,
)
from ray.train.torch import TorchTrainer

from raydlrm._logs import configure_api, library_level, quiet_libraries, worker_level
from raydlrm.ingestion import DataSummary, default_num_actors
from raydlrm.ingestion.badinput import quarantine_counts, run_tag
from raydlrm.ingestion.sequence_rows import truncated_counts
from raydlrm.platform.config import JobConfig, load_config
from raydlrm.platform.export import (
    example_rows,
    log_model,
    run_model_dir,
    tagged_version,
    weights_by_reference,
)
from raydlrm.platform.job_data import JobData
from raydlrm.platform.planning import PlannedJob, plan_job
from raydlrm.platform.preflight import resolve_job, run_storage
from raydlrm.platform.progress import TrainingProgress, progress_mode
from raydlrm.platform.ray_init import init_ray
from raydlrm.platform.run_lock import run_lock
from raydlrm.platform.run_snapshot import drop_deleted_checkpoints
from raydlrm.platform.tracking import TAG_CHECKPOINT, TrackedRun, start_run
from raydlrm.platform.worker_failure import fatal_worker_failure
from raydlrm.sharding import ShardingPlan
from raydlrm.storage import join, scheme_of, with_scheme
from raydlrm.trainers.checkpoints import newest_intact_stored
from raydlrm.trainers.hooks import PROGRESS_FILE
from raydlrm.trainers.loop import STOPPED_EARLY
from raydlrm.trainers.model_dir import model_metrics
from raydlrm.trainers.spec import SourceDescription, WorkerJob
from raydlrm.trainers.worker_entry import train_loop_per_worker

__all__ = ["TAG_STOP_REASON", "EvaluationError", "TrainResult", "stop_reason", "train"]

TAG_STOP_REASON = "raydlrm.stop_reason"
"""The MLflow tag that says why a run's training ended (:func:`stop_reason`)."""

logger = logging.getLogger(__name__)


@dataclass
class TrainResult:
    """What a finished training job produced."""

    metrics: dict[str, float]
    """Final metrics: ``train/*`` over the last epoch, ``eval/*`` on the held-out data."""
    checkpoint_path: str
    """The final checkpoint (its shards are the model's weights; config, plan, metrics)."""
    run_id: str
    """The job's MLflow run."""
    tracking_uri: str
    """Where the MLflow run lives."""
    model_uri: str
    """The logged MLflow model (``models:/m-<model id>``, MLflow's id of the logged model)."""
    registered_model_name: str | None
    registered_model_version: str | None
    plan: ShardingPlan = field(repr=False)
    """The sharding plan the job ran with."""
    stop_reason: str = ""
    """Why training ended (:func:`stop_reason`: early stopping and the step whose weights the
    model holds, ``training.max_steps`` or ``training.num_epochs``)."""

    @property
    def registered_model_uri(self) -> str | None:
        """The registered version (``models:/<name>/<version>``), or None when the model was
        not registered."""
        if self.registered_model_name is None or self.registered_model_version is None:
            return None
        return f"models:/{self.registered_model_name}/{self.registered_model_version}"


class EvaluationError(RuntimeError):
    """The final evaluation failed (bad held-out data) after training finished; the message
    says where the trained model was kept."""


def train(
    config: str | Path | dict[str, Any] | JobConfig | None = None,
    *,
    overrides: list[str] | tuple[str, ...] = (),
    scaling_config: ScalingConfig | None = None,
    run_config: RunConfig | None = None,
    callbacks: Sequence[UserCallback] = (),
) -> TrainResult:
    """Runs a training job end to end.

    Args:
        config: a TOML path, a dict of sections, a :class:`JobConfig`, or None (defaults).
        overrides: ``section.key=value`` strings applied on top of ``config``.
        scaling_config: a Ray ``ScalingConfig`` replacing the ``[scaling]`` section.
        run_config: a Ray ``RunConfig`` replacing the ``[run]`` section (its callbacks are kept
            and the MLflow callback is added; the object given is not changed).
        callbacks: Ray Train callbacks added to the run's (e.g. Tune's report of a trial).

    Returns:
        The final metrics, checkpoint, MLflow run and registered model.

    Raises:
        ConfigError: an invalid config, before anything runs.
        DataValidationError: missing or malformed data, before any training starts.
        WorkerDiedError: a worker's process died (or hung) and ended the run: the rank, the
            process, why it was fatal and the checkpoint a re-submission resumes from.
    """
    job = load_config(config, overrides=overrides)
    configure_api()
    quiet_libraries()
    run_name = run_config.name if run_config and run_config.name else job.run_name()
    # What the quarantine held before this run's validation (resolving is idempotent: the
    # planning pipeline resolves the job again, to the same).
    job = resolve_job(job, run_name=run_name, scaling_config=scaling_config)
    quarantined_before = quarantine_counts(job.data)
    planned = plan_job(job, run_name=run_name, scaling_config=scaling_config)
    logger.debug("sharding plan:\n%s", planned.plan.format_table())  # the summary shows it
    with run_lock(planned.job, run_name):  # one job per run, from here to the registered model
        return _tracked_run(
            planned,
            run_name=run_name,
            quarantined_before=quarantined_before,
            scaling_config=scaling_config,
            run_config=run_config,
            callbacks=callbacks,
        )


def _tracked_run(
    planned: PlannedJob,
    *,
    run_name: str,
    quarantined_before: dict[str, int],
    scaling_config: ScalingConfig | None,
    run_config: RunConfig | None,
    callbacks: Sequence[UserCallback],
) -> TrainResult:
    """Ray, the job's MLflow run, Ray Train's run, the final model and the row accounting;
    a failure marks the MLflow run failed."""
    job, plan, data = planned.job, planned.plan, planned.data
    assert data is not None  # a run's plan validated its data
    root, filesystem = run_storage(job)
    drop_deleted_checkpoints(f"{root}/{run_name}", filesystem or pafs.LocalFileSystem())
    init_ray(job)
    tracked = start_run(job, run_name=run_name, run_key=join(job.run.storage_path, run_name))
    try:
        worker_job = _worker_job(
            job, plan=plan, data=data, run_name=run_name, warm_start=planned.warm_start
        )
        trainer = TorchTrainer(
            train_loop_per_worker,
            train_loop_config={"job": worker_job},
            scaling_config=scaling_config or _scaling(job),
            run_config=_run_config(
                job, run_name=run_name, tracked=tracked, given=run_config, extra=callbacks
            ),
        )
        result = _run(trainer, job=job, data=data, tracked=tracked, plan=plan, run_name=run_name)
        _account_rows(
            result,
            job=job,
            data=data,
            run_name=run_name,
            before=quarantined_before,
            tracked=tracked,
        )
    except BaseException:
        tracked.finish(failed=True)
        raise
    tracked.finish()
    return result


def _scaling(job: JobConfig) -> ScalingConfig:
    return ScalingConfig(
        num_workers=job.scaling.num_workers,
        use_gpu=job.scaling.use_gpu,
        resources_per_worker=dict(job.scaling.resources_per_worker),
    )


def _run_config(
    job: JobConfig,
    *,
    run_name: str,
    tracked: TrackedRun,
    given: RunConfig | None,
    extra: Sequence[UserCallback] = (),
) -> RunConfig:
    """Ray Train's ``RunConfig``: the caller's (copied, with the MLflow callback and ``extra``
    added), or one made from ``[run]`` and ``[checkpoint]``."""
    callbacks = [tracked.callback(scheme_of(job.run.storage_path)), *extra]
    if given is not None:
        return dataclasses.replace(given, callbacks=[*(given.callbacks or []), *callbacks])
    storage_path, storage_filesystem = run_storage(job)
    ckpt = job.checkpoint
    return RunConfig(
        name=run_name,
        storage_path=storage_path,
        storage_filesystem=storage_filesystem,
        failure_config=FailureConfig(max_failures=job.run.max_failures),
        checkpoint_config=RayCheckpointConfig(
            # A chain of differential checkpoints, and early stopping's best checkpoint, are
            # kept by the workers' retention, which knows which baselines the kept deltas need
            # and which checkpoint is the best.
            num_to_keep=(
                None if ckpt.differential or job.training.stopping() else ckpt.num_to_keep
            ),
            checkpoint_score_attribute=ckpt.score_metric,
            checkpoint_score_order=ckpt.score_order,
        ),
        callbacks=callbacks,
        # Ray Train's own console lines (worker group start, each report, each checkpoint).
        logging_config=LoggingConfig(log_level=logging.getLevelName(library_level())),
    )


def _worker_job(
    job: JobConfig,
    *,
    plan: ShardingPlan,
    data: JobData,
    run_name: str,
    warm_start: ray.train.Checkpoint | None,
) -> WorkerJob:
    """What every worker gets: its config, the plan, the data sets to read, logging, drills."""
    num_workers = job.scaling.num_workers
    actors = max(1, (job.data.num_preprocess_actors or default_num_actors()) // num_workers)

    def source(summary: DataSummary, role: str) -> SourceDescription:
        return SourceDescription(
            path=summary.path,
            row_groups=list(summary.row_groups),
            schema=summary.schema,
            shuffle=role == "train",
            num_actors=actors,
            quarantine_tag=run_tag(run_name, role),
        )

    return WorkerJob(
        spec=job.worker_spec(),
        plan=plan,
        train_source=source(data.train, "train"),
        eval_source=None if data.evaluation is None else source(data.evaluation, "eval"),
        valid_source=None if data.validation is None else source(data.validation, "valid"),
        log_level=worker_level(),
        library_log_level=library_level(),
        # The injected fault fires once per run: its marker lives with the run.
        fault_marker=(
            join(job.run.storage_path, run_name, "fault-injected")
            if job.fault.at_step is not None
            else None
        ),
        run_storage=job.run.storage_or(job.data.storage),
        warm_start=warm_start,
        run_directory=join(job.run.storage_path, run_name),
        topology=job.topology(),
    )


def _run(
    trainer: TorchTrainer,
    *,
    job: JobConfig,
    data: JobData,
    tracked: TrackedRun,
    plan: ShardingPlan,
    run_name: str,
) -> TrainResult:
    """Trains (with the driver's progress line), then logs the final model."""
    tracked.log_plan(plan)
    tracked.log_params(
        {
            "data.train_rows": data.train.num_rows,
            "data.eval_rows": data.evaluation.num_rows if data.evaluation else 0,
            "data.valid_rows": data.validation.num_rows if data.validation else 0,
        }
    )
    total = data.train.num_rows * job.training.num_epochs
    if job.training.max_steps is not None:
        per_step = job.data.batch_size * job.scaling.num_workers
        total = min(total, job.training.max_steps * per_step)
    root, filesystem = run_storage(job)
    progress_file = (filesystem or pafs.LocalFileSystem(), f"{root}/{run_name}/{PROGRESS_FILE}")
    with TrainingProgress(
        tracked.client,
        tracked.run_id,
        total_samples=total,
        mode=progress_mode(job.run.progress),
        progress_file=progress_file,
        max_failures=job.run.max_failures,
        submission=tracked.submission,
    ):
        result = _fit(trainer, job=job, run_name=run_name)
    if result.checkpoint is None:
        raise RuntimeError(f"training run {run_name} finished without a final checkpoint")
    return _log_final_model(job, result=result, tracked=tracked, plan=plan)


def _fit(trainer: TorchTrainer, *, job: JobConfig, run_name: str) -> ray.train.Result:
    """``trainer.fit()``; a run that a dead or hung worker ended raises
    :class:`~raydlrm.platform.worker_failure.WorkerDiedError` (rank, process, why, where a
    re-submission resumes) from Ray Train's error."""
    try:
        with _sigint_restored():
            return trainer.fit()
    except TrainingFailedError as error:
        root, filesystem = run_storage(job)
        died = fatal_worker_failure(
            error,
            max_failures=trainer.run_config.failure_config.max_failures,
            run_directory=f"{root}/{run_name}",
            filesystem=filesystem or pafs.LocalFileSystem(),
            scheme=scheme_of(job.run.storage_path),
        )
        if died is None:
            raise
        raise died from error


@contextlib.contextmanager
def _sigint_restored() -> Iterator[None]:
    """Puts back the SIGINT handler that was in place before Ray Train's ``fit`` (main thread
    only). Ray Train's (Ctrl-C aborts the run) stays installed after ``fit`` returns, and its
    closure holds the run's controller actor: the controller outlived the run, idle, until the
    next ``fit`` replaced the handler or Ray shut down, and so ended with the cluster rather
    than with its run (the test session's leftover check once found one still running 30 s
    after ``ray.shutdown()``). A Ctrl-C after the run (a notebook, a script going on) was
    swallowed twice, the third ending the process with status 0."""
    if threading.current_thread() is not threading.main_thread():
        yield  # fit sets no handler there
        return
    previous = signal.getsignal(signal.SIGINT)
    try:
        yield
    finally:
        if previous is not None:  # None: set outside Python, not restorable from here
            signal.signal(signal.SIGINT, previous)


def _log_final_model(
    job: JobConfig, *, result: ray.train.Result, tracked: TrackedRun, plan: ShardingPlan
) -> TrainResult:
    """Logs (and, unless its final evaluation failed, registers) the model of the run's newest
    intact checkpoint, as the workers resume from: a worker that died in the final evaluation
    may have kept Ray Train from registering the final checkpoint.

    Raises:
        EvaluationError: the final evaluation failed; the model is logged, not registered.
    """
    checkpoint = newest_intact_stored(result.checkpoint)
    checkpoint_uri = with_scheme(checkpoint.path, scheme_of(job.run.storage_path))
    by_reference = weights_by_reference(
        job.tracking.model_weights, checkpoint_uri, tracked.tracking_uri
    )
    tracked.set_tags(
        {
            TAG_CHECKPOINT: checkpoint_uri,
            "raydlrm.model_weights": "reference" if by_reference else "copy",
        }
    )
    with run_model_dir(checkpoint, checkpoint_uri, by_reference=by_reference) as model_dir:
        # The final checkpoint precedes the final evaluation, whose metrics it holds apart.
        final = {**result.metrics, **model_metrics(model_dir)}
        reason = stop_reason(job, final)
        tracked.set_tags({TAG_STOP_REASON: reason})
        eval_error = final.get("eval/error")
        model_uri, version = _logged_model(
            job,
            tracked,
            model_dir=model_dir,
            checkpoint_uri=checkpoint_uri,
            # A model whose final evaluation failed is kept (logged), not registered.
            register=not eval_error,
        )
    if eval_error:
        tracked.set_tags({"raydlrm.eval_error": eval_error[:5000]})
        raise EvaluationError(
            f"final evaluation failed: {eval_error}; the trained model is kept: logged as "
            f"{model_uri}, checkpoint {checkpoint_uri} (raydlrm export {checkpoint_uri} "
            "--register <name> registers it)"
        )
    return TrainResult(
        metrics={k: v for k, v in final.items() if isinstance(v, int | float)},
        checkpoint_path=checkpoint_uri,
        run_id=tracked.run_id,
        tracking_uri=tracked.tracking_uri,
        model_uri=model_uri,
        registered_model_name=job.tracking.registered_model_name,
        registered_model_version=None if version is None else str(version),
        plan=plan,
        stop_reason=reason,
    )


def _logged_model(
    job: JobConfig, tracked: TrackedRun, *, model_dir: Path, checkpoint_uri: str, register: bool
) -> tuple[str, str | int | None]:
    """The model URI and registered version of the run's final checkpoint: the version that a
    previous submission of this finished run registered from it (a scheduler's retry ends at
    the checkpoint it ended at, and no second version is made), else the model logged now."""
    name = job.tracking.registered_model_name
    tags = {TAG_CHECKPOINT: checkpoint_uri}
    done = name and tagged_version(name, run_id=tracked.run_id, tags=tags, client=tracked.client)
    if done:
        logger.info(
            "%s version %s holds this run's final checkpoint %s already: registered once",
            name,
            done.version,
            checkpoint_uri,
        )
        return done.source, done.version
    data = job.data
    if data.eval_path:
        example = example_rows(data.eval_path, data, role="eval")
    else:
        example = example_rows(data.train_path, data)
    info = log_model(
        run_id=tracked.run_id,
        model_dir=model_dir,
        example=example,
        registered_model_name=name if register else None,
        tags=tags,
    )
    return info.model_uri, info.registered_model_version


def stop_reason(job: JobConfig, final: dict[str, Any]) -> str:
    """Why a run's training ended, in words (the ``raydlrm.stop_reason`` tag): early stopping
    (where, on what, and the best step whose weights the model holds), ``training.max_steps``
    or ``training.num_epochs``."""
    stopping = job.training.stopping()
    stopped = final.get("early_stopping/stopped_step")
    if stopping is not None and stopped is not None and final.get(STOPPED_EARLY):
        return (
            f"early stopping at step {int(stopped)}: {stopping.metric} did not improve by more "
            f"than {stopping.min_delta:g} in {stopping.patience} evaluations; the model is "
            f"step {int(final.get('early_stopping/best_step', stopped))}'s (best "
            f"{stopping.metric} {final.get('early_stopping/best', float('nan')):.6f})"
        )
    step = int(final.get("step", 0))
    if job.training.max_steps is not None and step >= job.training.max_steps:
        reason = f"training.max_steps = {job.training.max_steps} reached"
    else:
        reason = f"training.num_epochs = {job.training.num_epochs} done"
    if stopping is not None and "early_stopping/best_step" in final:
        best = int(final["early_stopping/best_step"])
        if best != step:
            reason += f"; the model is step {best}'s, the best {stopping.metric}"
    return reason


def _account_rows(
    result: TrainResult,
    *,
    job: JobConfig,
    data: JobData,
    run_name: str,
    before: dict[str, int],
    tracked: TrackedRun,
) -> None:
    """Checks and logs where every training row went: rows read (every epoch, from the files
    that passed validation) = rows trained + rows quarantined while reading (bad rows,
    unreadable row groups; the run's records over all its submissions, each once). Files set
    aside at validation by this submission are counted apart, with their rows when their
    footers could be read. The rows whose histories were cut (``data.sequences``) are
    counted too; they are trained."""
    now = quarantine_counts(job.data)
    q = {k: now[k] - before.get(k, 0) for k in now}
    run = quarantine_counts(job.data, tag=run_tag(run_name, "train"))
    held_out = quarantine_counts(job.data, tag=run_tag(run_name, "eval"), once=True)
    metrics = {
        "data/files_quarantined": q["files"],
        "data/rows_in_quarantined_files": q["file_rows"],
        "data/rows_quarantined": run["bad_rows"] + run["row_group_rows"],
        "data/row_groups_unreadable": run["row_groups"],
        # Bad held-out rows, set aside by the evaluations (each row once).
        "data/eval_rows_quarantined": held_out["bad_rows"] + held_out["row_group_rows"],
    }
    metrics.update(_trained_rows(result, job=job, data=data, quarantined=metrics))
    metrics.update(_truncated_rows(job, run_name=run_name))
    result.metrics.update({k: float(v) for k, v in metrics.items()})
    tracked.log_metrics(metrics, step=int(result.metrics.get("step", 0)))
    if metrics["data/eval_rows_quarantined"]:
        logger.warning(
            "quarantined %d held-out rows: the evaluation metrics leave them out (under %s)",
            metrics["data/eval_rows_quarantined"],
            job.data.quarantine_path,
        )
    if metrics["data/rows_quarantined"] or q["files"]:
        logger.warning(
            "quarantined %d rows while reading and %d files when checking them under %s",
            metrics["data/rows_quarantined"],
            q["files"],
            job.data.quarantine_path,
        )


def _truncated_rows(job: JobConfig, *, run_name: str) -> dict[str, int]:
    """Rows whose history each sequence cut to its ``max_length``: while training (every
    epoch) and in the held-out set (once), logged when any."""
    train = truncated_counts(job.data, tag=run_tag(run_name, "train"))
    held_out = truncated_counts(job.data, tag=run_tag(run_name, "eval"), once=True)
    for name, rows in train.items():
        if rows or held_out[name]:
            logger.info(
                "sequence %s: %d training rows (over all epochs) and %d held-out rows kept "
                "their last %d events (data.sequences.%s.max_length)",
                name,
                rows,
                held_out[name],
                job.data.sequences[name].max_length,
                name,
            )
    return {
        **{f"data/sequences/{n}/rows_truncated": rows for n, rows in train.items()},
        **{f"data/sequences/{n}/eval_rows_truncated": rows for n, rows in held_out.items()},
    }


def _trained_rows(
    result: TrainResult, *, job: JobConfig, data: JobData, quarantined: dict[str, int]
) -> dict[str, int]:
    """Rows trained; and read and unaccounted for when the run read every epoch whole (not
    cut by ``training.max_steps`` or by early stopping before its last step): an unaccounted
    row is logged as an error."""
    trained = int(result.metrics.get("samples_seen", 0))
    if job.training.max_steps is not None or result.metrics.get(STOPPED_EARLY):
        return {"data/rows_trained": trained}
    read = data.train.num_rows * job.training.num_epochs
    unaccounted = read - trained - quarantined["data/rows_quarantined"]
    if unaccounted:
        logger.error(
            "%d training rows are unaccounted for: %d read (over %d epochs), %d trained, "
            "%d quarantined",
            unaccounted,
            read,
            job.training.num_epochs,
            trained,
            quarantined["data/rows_quarantined"],
        )
    return {"data/rows_read": read, "data/rows_trained": trained, "rows_unaccounted": unaccounted}
