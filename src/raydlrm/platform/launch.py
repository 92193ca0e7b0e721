"""Launching a training job: the driver side of ``raydlrm train`` and ``raydlrm.train``.

In order: resolve the config; make the synthetic data set if the config asks for one and it is
not there; validate the data (paths, rows, columns) before anything starts; plan the sharding
within each worker's memory budget (a plan that does not fit stops here, before Ray starts);
connect to Ray (or start it locally); open the job's MLflow run; start Ray Train's
``TorchTrainer`` over Ray Data streams; log and register the final model. A failure after the
run was opened marks the run failed.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pyarrow as pa
import pyarrow.fs as pafs
import ray
from ray.train import CheckpointConfig as RayCheckpointConfig
from ray.train import FailureConfig, LoggingConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

from raydlrm._logs import library_level, quiet_libraries, worker_level
from raydlrm.ingestion import (
    DataSummary,
    default_num_actors,
    generate_synthetic,
    validate_data,
)
from raydlrm.ingestion.badinput import quarantine_counts, run_tag
from raydlrm.ingestion.stats import dense_stats_of
from raydlrm.platform import _reaper
from raydlrm.platform.config import ConfigError, JobConfig, load_config
from raydlrm.platform.export import example_rows, log_model
from raydlrm.platform.progress import TrainingProgress, progress_mode
from raydlrm.platform.tracking import TrackedRun, start_run
from raydlrm.sharding import MemoryBudget, ShardingPlan, load_constants
from raydlrm.sharding.dedup import plan_feature_sets
from raydlrm.sharding.plan import format_bytes
from raydlrm.sharding.tiers import TierError, check_space, ssd_directory
from raydlrm.storage import filesystem_for, is_remote, join, scheme_of, with_scheme
from raydlrm.trainers._ray import latest_checkpoint
from raydlrm.trainers.checkpoint import model_metrics
from raydlrm.trainers.loop import train_loop_per_worker
from raydlrm.trainers.spec import SourceDescription, WorkerJob
from raydlrm.trainers.state import STATE_FILE, check_state_matches, verify_checkpoint

__all__ = [
    "EvaluationError",
    "TrainResult",
    "make_plan",
    "prepare_data",
    "train",
    "worker_memory_budget",
]

logger = logging.getLogger(__name__)


@dataclass
class TrainResult:
    """What a finished training job produced."""

    metrics: dict[str, float]
    """Final metrics: ``train/*`` over the last epoch, ``eval/*`` on the held-out data."""
    checkpoint_path: str
    """The final checkpoint (unsharded model, config, plan)."""
    run_id: str
    """The job's MLflow run."""
    tracking_uri: str
    """Where the MLflow run lives."""
    model_uri: str
    """The logged MLflow model (``models:/...``)."""
    registered_model_name: str | None
    registered_model_version: str | None
    plan: ShardingPlan = field(repr=False)
    """The sharding plan the job ran with."""


def prepare_data(config: JobConfig) -> None:
    """Generates the configured synthetic data set if ``data.train_path`` does not exist."""
    data = config.data
    if data.synthetic is None or is_remote(data.train_path) or Path(data.train_path).exists():
        return  # synthetic data is generated locally only
    root = Path(data.train_path).parent
    logger.info("generating synthetic data into %s", root)
    generate_synthetic(data.synthetic, out_dir=root)


def _ray_address(job: JobConfig) -> str:
    """The Ray cluster the job runs on: ``ray.address``, else ``$RAY_ADDRESS``, else ``local``
    (a new Ray instance on this machine)."""
    return job.ray.address or os.environ.get("RAY_ADDRESS") or "local"


def worker_memory_budget(job: JobConfig) -> MemoryBudget | None:
    """The bytes of embedding tables each worker may hold (see ``sharding.memory_budget``).

    ``sharding.device_memory_bytes`` when set. Otherwise, with ``sharding.memory_budget =
    "auto"``: the worker's Ray ``memory`` resource (``scaling.resources_per_worker``), else this
    machine's memory shared by all ``scaling.num_workers`` workers (a local Ray cluster runs
    them all here), less ``sharding.worker_overhead_bytes``.

    Returns:
        The budget and how it was derived; None when the budget is ``off``, or cannot be derived
        here: GPU workers (tables live in GPU memory) and a remote cluster (its nodes' memory
        is unknown to this machine), each with a warning.

    Raises:
        ConfigError: if the derived budget is not positive.
    """
    sharding, scaling = job.sharding, job.scaling
    if sharding.device_memory_bytes is not None:
        return MemoryBudget(sharding.device_memory_bytes, "sharding.device_memory_bytes")
    if sharding.memory_budget == "off":
        return None
    overhead = sharding.worker_overhead_bytes
    unknown = None
    if scaling.use_gpu:
        unknown = (
            "the tables live in the workers' GPU memory, which the driver does not know: set "
            "sharding.device_memory_bytes"
        )
    elif "memory" in scaling.resources_per_worker:
        memory = int(scaling.resources_per_worker["memory"])
        source = f"{format_bytes(memory)} scaling.resources_per_worker.memory"
    elif _ray_address(job) != "local":
        unknown = (
            f"the workers run on the Ray cluster at {_ray_address(job)}, whose memory the driver "
            "does not know: set sharding.device_memory_bytes or scaling.resources_per_worker.memory"
        )
    else:
        node = psutil.virtual_memory().total
        memory = node // scaling.num_workers
        source = f"{format_bytes(node)} node memory / {scaling.num_workers} workers"
    if unknown is not None:
        logger.warning(
            "no memory budget for the embedding tables: %s (or sharding.memory_budget = 'off')",
            unknown,
        )
        return None
    source = f"{source} - {format_bytes(overhead)} overhead"
    if memory - overhead <= 0:
        raise ConfigError(
            f"sharding.memory_budget: no memory left for embedding tables ({source}); lower "
            "sharding.worker_overhead_bytes or scaling.num_workers, set "
            "sharding.device_memory_bytes, or sharding.memory_budget = 'off' to plan for other "
            "machines"
        )
    return MemoryBudget(memory - overhead, source)


def make_plan(config: JobConfig) -> ShardingPlan:
    """The sharding plan of the job's tables over ``scaling.num_workers`` ranks within
    :func:`worker_memory_budget`, costed with the calibrated constants at
    ``sharding.cost_constants_path`` when that file exists.

    Raises:
        ConfigError: sharding settings that cannot be planned, e.g. a table that does not fit
            the budget (naming the table, the rank, the shortfall and the budget's source).
    """
    spec = config.worker_spec()
    constants_path = Path(config.sharding.cost_constants_path).expanduser()
    constants = load_constants(constants_path) if constants_path.exists() else None
    budget = worker_memory_budget(config)
    try:
        # With dedup groups each feature set runs its own collectives: balance each set.
        return plan_feature_sets(
            spec.tables(),
            config.data.dedup_groups,
            world_size=config.scaling.num_workers,
            config=config.sharding,
            batch_size=config.data.batch_size,
            constants=constants,
            memory_budget=budget,
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None


# Environment of a new local Ray instance (its raylet and worker processes inherit the
# driver's).
# Ray Data's Parquet reader starts RAY_DATA_PARQUET_FOOTER_NUM_ACTORS (default 32) footer-reading
# actors, each a fresh worker process, on every pass over a data set: on a small machine that is
# most of the time before the first batch of every epoch and evaluation. Local files need one.
# Ray Train's preemption watcher (an actor per run that watches for nodes about to be
# preempted) has nothing to watch on one local machine. Ray Train's controller polls its workers
# every RAY_TRAIN_HEALTH_CHECK_INTERVAL_S (Ray's default 2 s); the poll paces the start of a
# run, every report (a barrier the controller releases) and the end: 0.5 s takes about 2 s off a
# small run (benchmarks/train_overhead.py). A value already in the environment wins.
LOCAL_RAY_ENV = {
    "RAY_DATA_PARQUET_FOOTER_NUM_ACTORS": "1",
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
}
# CPUs a local instance keeps beyond the training workers: a preprocessing actor, read tasks.
_LOCAL_DATA_CPUS = 3


def _local_num_cpus(job: JobConfig) -> int:
    """Logical CPUs of a new local Ray instance: at least the machine's, and enough that the
    training workers, a preprocessing actor and Ray Data's read tasks (1 CPU each) can all be
    scheduled at once. On a 2-core machine the default (2) leaves Ray Data no CPU for its read
    tasks once two 0.5-CPU workers and an actor hold theirs, and the job waits forever."""
    per_worker = job.scaling.resources_per_worker.get("CPU", 1.0)
    training = job.scaling.num_workers * per_worker
    return max(os.cpu_count() or 1, math.ceil(training) + _LOCAL_DATA_CPUS)


def _init_ray(job: JobConfig) -> None:
    if ray.is_initialized():
        return
    config = job.ray
    address = _ray_address(job)
    kwargs: dict[str, Any] = {}
    if address == "local":
        for name, value in LOCAL_RAY_ENV.items():
            os.environ.setdefault(name, value)
        kwargs = {
            "num_cpus": config.num_cpus or _local_num_cpus(job),
            "object_store_memory": config.object_store_memory,
            "include_dashboard": config.include_dashboard,
        }
        port = _pin_state_api()
        quiet_libraries()  # Ray's start-up notices (a Python API call may not have set them)
        if config.include_dashboard is False:
            # Nothing listens on the pinned port: the State API fails (and is quiet) rather
            # than asking another instance.
            kwargs["runtime_env"] = {
                "worker_process_setup_hook": "raydlrm._ray_setup.without_dashboard"
            }
        else:
            kwargs["dashboard_port"] = port
    elif address != "auto":
        _check_reachable(address, source="ray.address" if config.address else "$RAY_ADDRESS")
    kwargs["log_to_driver"] = config.log_to_driver
    kwargs["logging_level"] = library_level()  # "Started a local Ray instance" and the like
    ray.init(address=address, **{k: v for k, v in kwargs.items() if v is not None})
    if address == "local":
        _reaper.start()


# The State API address this process pinned for the local instance it started (None: none).
_pinned_state_api: str | None = None


def _pin_state_api() -> int | None:
    """Points the State API of a new local instance at its own dashboard: returns the dashboard
    port to start it on (None: the user's ``$RAY_API_SERVER_ADDRESS`` stands).

    Without an address the State API asks the newest Ray instance on the machine
    (``/tmp/ray/ray_current_cluster``). Ray Train's placement-group cleaner asks it whether the
    run's controller is alive: with another Ray instance on the machine (another user's job, a
    test suite) that instance answers "no such actor", and the cleaner removes the live run's
    placement group, killing its workers. Every Ray process inherits the driver's environment."""
    global _pinned_state_api
    current = os.environ.get("RAY_API_SERVER_ADDRESS")
    if current is not None and current != _pinned_state_api:
        return None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _pinned_state_api = os.environ["RAY_API_SERVER_ADDRESS"] = f"http://127.0.0.1:{port}"
    return port


# How long to wait for a TCP connection to a cluster's address before calling it unreachable.
_CONNECT_TIMEOUT_S = 5.0


def _check_reachable(address: str, *, source: str) -> None:
    """Raises :class:`ConfigError` unless a TCP connection to ``address`` (``host:port`` or
    ``ray://host:port``) opens: ``ray.init`` retries an unreachable GCS for many minutes
    instead of failing."""
    scheme, sep, rest = address.rpartition("://")
    if sep and scheme != "ray":
        return  # another client scheme (e.g. anyscale://): ray.init resolves it
    host, _, port = rest.rpartition(":")
    if not port.isdigit():
        raise ConfigError(f"{source}: {address!r} is not host:port")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=_CONNECT_TIMEOUT_S).close()
    except OSError as e:
        raise ConfigError(f"no Ray cluster reachable at {address} ({source}): {e}") from None


def train(
    config: str | Path | dict[str, Any] | JobConfig | None = None,
    *,
    overrides: list[str] | tuple[str, ...] = (),
    scaling_config: ScalingConfig | None = None,
    run_config: RunConfig | None = None,
) -> TrainResult:
    """Runs a training job end to end.

    Args:
        config: a TOML path, a dict of sections, a :class:`JobConfig`, or None (defaults).
        overrides: ``section.key=value`` strings applied on top of ``config``.
        scaling_config: a Ray ``ScalingConfig`` replacing the ``[scaling]`` section.
        run_config: a Ray ``RunConfig`` replacing the ``[run]`` section (its callbacks are kept
            and the MLflow callback is added).

    Returns:
        The final metrics, checkpoint, MLflow run and registered model.

    Raises:
        ConfigError: an invalid config, before anything runs.
        DataValidationError: missing or malformed data, before any training starts.
    """
    job = load_config(config, overrides=overrides)
    quiet_libraries()
    if scaling_config is not None:  # what the plan and the memory budget depend on
        job.scaling.num_workers = scaling_config.num_workers
        job.scaling.use_gpu = scaling_config.use_gpu
        if scaling_config.resources_per_worker is not None:
            job.scaling.resources_per_worker = dict(scaling_config.resources_per_worker)
    run_name = run_config.name if run_config and run_config.name else job.run_name()
    if job.data.bad_input == "quarantine" and job.data.quarantine_path is None:
        job.data.quarantine_path = join(job.run.storage_path, run_name, "quarantine")
    quarantined_before = quarantine_counts(job.data)
    prepare_data(job)
    train_summary = validate_data(job.data.train_path, job.data, role="train")
    eval_summary = (
        validate_data(job.data.eval_path, job.data, role="eval") if job.data.eval_path else None
    )
    plan = make_plan(job)
    logger.debug("sharding plan:\n%s", plan.format_table())  # the summary shows it
    _check_ssd_space(job, plan)
    # Before the statistics: a warm start keeps the dense statistics its model was trained with.
    warm_start = _warm_start_checkpoint(job, plan) if job.run.warm_start else None
    _fill_dense_stats(job)
    _check_run_storage(job, run_name)

    _init_ray(job)
    tracked = start_run(job, run_name=run_name, run_key=join(job.run.storage_path, run_name))
    try:
        tracked.log_plan(plan)
        tracked.log_params(
            {
                "data.train_rows": train_summary.num_rows,
                "data.eval_rows": eval_summary.num_rows if eval_summary else 0,
            }
        )
        result = _fit(
            job,
            plan=plan,
            tracked=tracked,
            run_name=run_name,
            scaling_config=scaling_config,
            run_config=run_config,
            train=train_summary,
            evaluation=eval_summary,
            warm_start=warm_start,
        )
        _account_rows(
            result,
            job=job,
            train=train_summary,
            run_name=run_name,
            quarantined_before=quarantined_before,
            tracked=tracked,
        )
    except BaseException:
        tracked.finish(failed=True)
        raise
    tracked.finish()
    return result


def _source(
    summary: DataSummary, job: JobConfig, *, run_name: str, role: str, num_workers: int
) -> SourceDescription:
    """What the workers need to read a validated data set (see ``raydlrm.ingestion.reader``)."""
    actors = job.data.num_preprocess_actors or default_num_actors()
    return SourceDescription(
        path=summary.path,
        row_groups=[g.to_dict() for g in summary.row_groups],
        schema=summary.schema,
        shuffle=role == "train",
        num_actors=max(1, actors // num_workers),
        quarantine_tag=run_tag(run_name, role),
    )


def _run_storage(job: JobConfig) -> tuple[str, pafs.FileSystem | None]:
    """Ray Train's ``storage_path`` and ``storage_filesystem`` for ``run.storage_path``: an
    absolute local path, or an object-store path (no scheme) with its filesystem, which carries
    the endpoint and credentials of ``[run.storage]`` (or ``[data.storage]``)."""
    path = job.run.storage_path
    if not is_remote(path):
        return str(Path(path.removeprefix("file://")).resolve()), None
    filesystem, resolved = filesystem_for(path, job.run.storage_or(job.data.storage))
    return resolved, filesystem


class EvaluationError(RuntimeError):
    """The final evaluation failed (bad held-out data) after training finished; the message
    says where the trained model was kept."""


def _check_run_storage(job: JobConfig, run_name: str) -> None:
    """Writes and removes a probe file in the run's storage directory, so that a storage path
    that cannot be written (read-only, no permission, an unreachable or denied bucket) stops
    the job before Ray starts and before an MLflow run is opened, naming the key.

    Raises:
        ConfigError: naming ``run.storage_path``, the directory and the storage's error.
    """
    root, filesystem = _run_storage(job)
    filesystem = filesystem or pafs.LocalFileSystem()
    directory = f"{root.rstrip('/')}/{run_name}"
    probe = f"{directory}/.raydlrm-write-check-{os.getpid()}"
    try:
        filesystem.create_dir(directory, recursive=True)
        with filesystem.open_output_stream(probe) as f:
            f.write(b"ok\n")
        filesystem.delete_file(probe)
    except (OSError, pa.ArrowException) as exc:
        raise ConfigError(
            f"run.storage_path: cannot write checkpoints to {job.run.storage_path} "
            f"({directory}): {exc}"
        ) from exc


def _warm_start_checkpoint(job: JobConfig, plan: ShardingPlan) -> ray.train.Checkpoint:
    """The ``run.warm_start`` checkpoint for the workers, checked against the job first: it
    must exist and hold the job's tables (names and shapes) and fused optimizer.

    Raises:
        ConfigError: naming the checkpoint and what does not match.
    """
    uri = job.run.warm_start
    assert uri is not None
    storage = job.run.storage_or(job.data.storage)
    try:
        filesystem, path = filesystem_for(uri, storage)
        with filesystem.open_input_stream(f"{path}/{STATE_FILE}") as f:
            state = json.loads(f.read())
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"run.warm_start: {uri} is not a readable training-state checkpoint ({exc})"
        ) from None
    try:
        check_state_matches(state, plan, job.sharding.optimizer, source=uri)
    except ValueError as exc:
        raise ConfigError(f"run.warm_start: {exc}") from None
    saved_stats = state["spec"]["data"].get("dense_stats") or {}
    for column in job.data.standardized_columns():
        if column not in job.data.dense_stats and column in saved_stats:
            job.data.dense_stats[column] = tuple(saved_stats[column])
    logger.info("warm start from %s (step %d, %d workers)", uri, state["step"], state["world_size"])
    if isinstance(filesystem, pafs.LocalFileSystem):
        return ray.train.Checkpoint(path)
    return ray.train.Checkpoint(path, filesystem=filesystem)


def _check_ssd_space(job: JobConfig, plan: ShardingPlan) -> None:
    """For a local Ray instance (every worker on this machine): the ``ssd`` tables' directory
    can be written and holds all the ranks' files, checked before Ray starts. (Each worker
    checks its own files again when it maps them, on any cluster.)

    Raises:
        ConfigError: naming the tables, ``sharding.ssd_path`` and the shortfall.
    """
    per_rank = plan.per_rank_disk()
    if not any(per_rank) or _ray_address(job) != "local":
        return
    tables = [t.name for t in plan.tables if t.placement == "ssd"]
    try:
        check_space(ssd_directory(job.sharding.ssd_path), sum(per_rank), tables=tables)
    except TierError as exc:
        raise ConfigError(str(exc)) from None


def _fill_dense_stats(job: JobConfig) -> None:
    """Computes the statistics of standardized dense columns over the training data, once,
    when the config does not already hold them; they travel in the config to the workers, the
    checkpoint and the logged model."""
    data = job.data
    missing = [c for c in data.standardized_columns() if c not in data.dense_stats]
    if not missing:
        return
    started = time.perf_counter()
    stats = dense_stats_of(data.train_path, data)
    data.dense_stats = {**stats, **data.dense_stats}
    logger.info(
        "dense statistics of %s over %s in %.1fs: %s",
        missing,
        data.train_path,
        time.perf_counter() - started,
        {c: (round(m, 4), round(s, 4)) for c, (m, s) in stats.items()},
    )


def _account_rows(
    result: TrainResult,
    *,
    job: JobConfig,
    train: DataSummary,
    run_name: str,
    quarantined_before: dict[str, int],
    tracked: TrackedRun,
) -> None:
    """Checks and logs where every training row went: rows read (every epoch, from the files
    that passed validation) = rows trained + rows quarantined while reading (bad rows,
    unreadable row groups; the run's records over all its submissions, each once). Files set
    aside at validation by this submission are counted apart, with their rows when their
    footers could be read."""
    now = quarantine_counts(job.data)
    q = {k: now[k] - quarantined_before.get(k, 0) for k in now}
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
    if job.training.max_steps is None:
        read = train.num_rows * job.training.num_epochs
        trained = int(result.metrics.get("samples_seen", 0))
        unaccounted = read - trained - metrics["data/rows_quarantined"]
        metrics.update(
            {"data/rows_read": read, "data/rows_trained": trained, "rows_unaccounted": unaccounted}
        )
        if unaccounted:
            logger.error(
                "%d training rows are unaccounted for: %d read (over %d epochs), %d trained, "
                "%d quarantined",
                unaccounted,
                read,
                job.training.num_epochs,
                trained,
                metrics["data/rows_quarantined"],
            )
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


def _fit(
    job: JobConfig,
    *,
    plan: ShardingPlan,
    tracked: TrackedRun,
    run_name: str,
    scaling_config: ScalingConfig | None,
    run_config: RunConfig | None,
    train: DataSummary,
    evaluation: DataSummary | None,
    warm_start: ray.train.Checkpoint | None,
) -> TrainResult:
    scaling = scaling_config or ScalingConfig(
        num_workers=job.scaling.num_workers,
        use_gpu=job.scaling.use_gpu,
        resources_per_worker=dict(job.scaling.resources_per_worker),
    )
    scheme = scheme_of(job.run.storage_path)
    callbacks = [*(run_config.callbacks or [] if run_config else []), tracked.callback(scheme)]
    ckpt = job.checkpoint
    if run_config is None:
        storage_path, storage_filesystem = _run_storage(job)
        run_config = RunConfig(
            name=run_name,
            storage_path=storage_path,
            storage_filesystem=storage_filesystem,
            failure_config=FailureConfig(max_failures=job.run.max_failures),
            checkpoint_config=RayCheckpointConfig(
                num_to_keep=ckpt.num_to_keep,
                checkpoint_score_attribute=ckpt.score_metric,
                checkpoint_score_order=ckpt.score_order,
            ),
            callbacks=callbacks,
            # Ray Train's own console lines (worker group start, each report, each checkpoint).
            logging_config=LoggingConfig(log_level=logging.getLevelName(library_level())),
        )
    else:
        run_config.callbacks = callbacks
    # The injected fault fires once per run: its marker lives with the run.
    fault_marker = None
    if job.fault.at_step is not None:
        fault_marker = join(job.run.storage_path, run_name, "fault-injected")

    def source(summary: DataSummary, role: str) -> SourceDescription:
        return _source(summary, job, run_name=run_name, role=role, num_workers=scaling.num_workers)

    worker_job = WorkerJob(
        spec=job.worker_spec(),
        plan=plan.to_json(),
        train_source=source(train, "train"),
        eval_source=None if evaluation is None else source(evaluation, "eval"),
        log_level=worker_level(),
        library_log_level=library_level(),
        fault_marker=fault_marker,
        fault_storage=job.run.storage,
        warm_start=warm_start,
    )
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"job": worker_job},
        scaling_config=scaling,
        run_config=run_config,
    )
    if job.training.max_steps is not None:
        total = job.training.max_steps * job.data.batch_size * scaling.num_workers
        total = min(total, train.num_rows * job.training.num_epochs)
    else:
        total = train.num_rows * job.training.num_epochs
    with TrainingProgress(
        tracked.client, tracked.run_id, total_samples=total, mode=progress_mode(job.run.progress)
    ):
        result = trainer.fit()
    if result.checkpoint is None:
        raise RuntimeError(f"training run {run_name} finished without a final checkpoint")
    if job.data.eval_path:
        example = example_rows(job.data.eval_path, job.data, role="eval")
    else:
        example = example_rows(job.data.train_path, job.data)
    # The run's newest intact checkpoint, as the workers resume from: a worker that died in
    # the final evaluation may have kept Ray Train from registering the final checkpoint.
    newest = latest_checkpoint(lambda d: verify_checkpoint(d, checksums=False), result.checkpoint)
    with newest as (checkpoint_dir, checkpoint):
        checkpoint_uri = with_scheme(checkpoint.path, scheme)
        tracked.set_tags({"raydlrm.checkpoint": checkpoint_uri})
        # The final checkpoint precedes the final evaluation, whose metrics it holds apart.
        final = {**result.metrics, **model_metrics(checkpoint_dir)}
        eval_error = final.get("eval/error")
        info = log_model(
            run_id=tracked.run_id,
            checkpoint_dir=checkpoint_dir,
            example=example,
            # A model whose final evaluation failed is kept (logged), not registered.
            registered_model_name=None if eval_error else job.tracking.registered_model_name,
        )
    if eval_error:
        tracked.set_tags({"raydlrm.eval_error": eval_error[:5000]})
        raise EvaluationError(
            f"final evaluation failed: {eval_error}; the trained model is kept: logged as "
            f"{info.model_uri}, checkpoint {checkpoint_uri} (raydlrm export {checkpoint_uri} "
            "--register <name> registers it)"
        )
    version = info.registered_model_version
    return TrainResult(
        metrics={k: v for k, v in final.items() if isinstance(v, int | float)},
        checkpoint_path=checkpoint_uri,
        run_id=tracked.run_id,
        tracking_uri=tracked.tracking_uri,
        model_uri=info.model_uri,
        registered_model_name=job.tracking.registered_model_name,
        registered_model_version=None if version is None else str(version),
        plan=plan,
    )
