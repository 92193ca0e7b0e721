"""What the driver settles about a job before Ray starts, step by step; the order the steps run
in is :func:`raydlrm.platform.planning.plan_job`'s.

- :func:`resolve_job`: the job config once, with a caller's Ray ``ScalingConfig`` and the run's
  quarantine path applied (never edited afterwards: each later step returns a new one);
- :func:`make_plan`: the sharding plan within each worker's memory budget
  (:mod:`raydlrm.platform.memory`), costed by the analytic or learned cost model;
- the checks that stop a job that cannot run with one line naming the key: the run storage can
  be written, a run with checkpoints has an intact one, the SSD tier's disk space.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.fs as pafs
from ray.train import ScalingConfig

from raydlrm.platform.config import (
    BASE_DIR_ENV,
    ConfigError,
    JobConfig,
    base_dir,
    default_tracking_uri,
    replaced,
)
from raydlrm.platform.memory import host_memory_budget, worker_memory_budget
from raydlrm.platform.ray_init import ray_address
from raydlrm.sharding import ShardingPlan, Topology, load_constants
from raydlrm.sharding.planner.planners import plan_sharding
from raydlrm.sharding.tiers import TierError, check_space, ssd_directory
from raydlrm.storage import filesystem_for, is_remote, join
from raydlrm.trainers.checkpoints import resume_blocker

__all__ = [
    "check_dense_precision",
    "check_resumable",
    "check_run_storage",
    "check_ssd_space",
    "learned_cost_model",
    "make_plan",
    "resolve_job",
    "resolve_paths",
    "run_storage",
]

if TYPE_CHECKING:
    from raydlrm.platform.job_data import DataShape
    from raydlrm.sharding.planner.learned_cost import LearnedCostModel

logger = logging.getLogger(__name__)


def resolve_job(
    job: JobConfig, *, run_name: str, scaling_config: ScalingConfig | None = None
) -> JobConfig:
    """``job`` with what the call decides applied: a Ray ``scaling_config`` replaces
    ``[scaling]`` (the plan and the memory budget depend on it), and quarantined data (and
    the counts of histories cut to their sequence's ``max_length``) goes under the run's
    storage unless ``data.quarantine_path`` names a place."""
    if scaling_config is not None:
        resources = scaling_config.resources_per_worker
        job = dataclasses.replace(
            job,
            scaling=replaced(
                job.scaling,
                num_workers=scaling_config.num_workers,
                use_gpu=scaling_config.use_gpu,
                resources_per_worker=(
                    job.scaling.resources_per_worker if resources is None else dict(resources)
                ),
            ),
        )
    job = resolve_paths(job)
    # Reading also records there how many histories it cut (data.sequences).
    recorded = job.data.bad_input == "quarantine" or job.data.sequences
    if recorded and job.data.quarantine_path is None:
        path = join(job.run.storage_path, run_name, "quarantine")
        job = dataclasses.replace(job, data=dataclasses.replace(job.data, quarantine_path=path))
    return job


def _in_ray_working_dir_copy() -> bool:
    """This process runs in the temporary copy of a working directory that a Ray runtime env
    uploaded (``ray job submit --working-dir``): Ray deletes it with its session."""
    return {"runtime_resources", "working_dir_files"} <= set(Path.cwd().parts)


def resolve_paths(job: JobConfig) -> JobConfig:
    """``job`` with its relative local paths resolved against :func:`base_dir`, and the
    tracking URI made absolute (the Ray Train controller runs elsewhere).

    Raises:
        ConfigError: a relative path (or the default ``mlflow.db``) in a job that runs in Ray's
            temporary copy of its working directory without :data:`BASE_DIR_ENV`, naming the key.
    """
    keys = {
        "data.train_path": job.data.train_path,
        "data.eval_path": job.data.eval_path,
        "data.quarantine_path": job.data.quarantine_path,
        "run.storage_path": job.run.storage_path,
        "run.warm_start": job.run.warm_start,
    }
    relative = {
        k: v
        for k, v in keys.items()
        if v and not is_remote(v) and not Path(v).is_absolute() and not v.startswith("models:/")
    }
    tracking = _relative_tracking(job)
    if tracking is not None:
        relative["tracking.tracking_uri"] = tracking
    if relative and _in_ray_working_dir_copy() and BASE_DIR_ENV not in os.environ:
        key, value = next(iter(relative.items()))
        raise ConfigError(
            f"{key}: {value!r} is relative, and this job runs in Ray's temporary copy of its "
            f"working directory ({Path.cwd()}), which Ray deletes: set {BASE_DIR_ENV} in the "
            "job's runtime env (env_vars) to the directory relative paths mean, or give "
            "absolute paths (s3:// for a cluster)"
        )
    base = base_dir()
    resolved = {k: str(base / v) for k, v in relative.items() if k != "tracking.tracking_uri"}
    return dataclasses.replace(
        job,
        data=dataclasses.replace(
            job.data,
            train_path=resolved.get("data.train_path", job.data.train_path),
            eval_path=resolved.get("data.eval_path", job.data.eval_path),
            quarantine_path=resolved.get("data.quarantine_path", job.data.quarantine_path),
        ),
        run=dataclasses.replace(
            job.run,
            storage_path=resolved.get("run.storage_path", job.run.storage_path),
            warm_start=resolved.get("run.warm_start", job.run.warm_start),
        ),
        tracking=dataclasses.replace(job.tracking, tracking_uri=default_tracking_uri(job.tracking)),
    )


def _relative_tracking(job: JobConfig) -> str | None:
    """The job's tracking URI when it is a local path relative to the working directory (or
    the default ``mlflow.db`` there), else None."""
    uri = job.tracking.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        return "(default: mlflow.db)"
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        return uri
    return None


def make_plan(config: JobConfig, *, shape: DataShape | None = None) -> ShardingPlan:
    """The sharding plan of the job's tables over ``scaling.num_workers`` ranks within
    :func:`worker_memory_budget`, costed with the calibrated constants at
    ``sharding.cost_constants_path`` when that file exists, and with the data's pooling
    factors and dedup ratios (``shape``, from :func:`data_shape`; without it every bag is
    taken to hold one id and nothing to be deduplicated), at the global batch (every worker's
    samples: what a rank's kernel looks up of a table-wise table).

    Memory tiers are settled for the workers (:func:`_tiers_for_workers`); the ``host``
    tables of a GPU job must fit :func:`host_memory_budget`.

    Raises:
        ConfigError: sharding settings that cannot be planned, e.g. a table that does not fit
            the budget (naming the table, the rank, the shortfall and the budget's source).
    """
    config = _tiers_for_workers(config)
    plan = _make_plan(config, shape=shape)
    hosted = any(t.placement == "host" for t in plan.tables)
    budget = host_memory_budget(config) if hosted else None
    if budget is not None:
        try:
            plan.check_host_memory(budget)
        except ValueError as e:
            raise ConfigError(f"sharding.placement = 'host': {e}") from None
    return plan


def _tiers_for_workers(job: JobConfig) -> JobConfig:
    """``job`` with its memory tiers settled for its workers: on GPU workers ``auto`` tables
    spill to ``host`` (``sharding.spill_placement = "auto"``) and ``ssd`` is refused; on CPU
    workers ``host`` tables are planned ``dram`` (their memory is the host's), with a warning,
    and a ``host`` spill is refused.

    Raises:
        ConfigError: an ``ssd`` table or spill on GPU workers, a ``host`` spill on CPU ones.
    """
    sharding = job.sharding
    placements = {sharding.default_placement, *sharding.placement.values()}
    if job.scaling.use_gpu:
        if "ssd" in placements or sharding.spill_placement == "ssd":
            raise ConfigError(
                "sharding.placement 'ssd' (or spill_placement) is for CPU workers; GPU workers "
                "(scaling.use_gpu) keep large tables in host memory: 'host'"
            )
        if sharding.spill_placement == "auto":
            sharding = dataclasses.replace(sharding, spill_placement="host")
        return dataclasses.replace(job, sharding=sharding)
    if sharding.spill_placement == "host":
        raise ConfigError(
            "sharding.spill_placement = 'host' is for GPU workers (scaling.use_gpu): set it to "
            "'ssd' or 'auto'"
        )
    if "host" not in placements:
        return job
    logger.warning(
        "sharding.placement 'host' is for GPU workers (scaling.use_gpu): the tables of this "
        "CPU job are in the workers' memory, planned 'dram'"
    )
    placement = {t: "dram" if p == "host" else p for t, p in sharding.placement.items()}
    default = "dram" if sharding.default_placement == "host" else sharding.default_placement
    return dataclasses.replace(
        job,
        sharding=dataclasses.replace(sharding, default_placement=default, placement=placement),
    )


def _make_plan(config: JobConfig, *, shape: DataShape | None) -> ShardingPlan:
    """:func:`make_plan` of a job whose ``host`` tables are settled."""
    spec = config.worker_spec()
    constants_path = Path(config.sharding.cost_constants_path).expanduser()
    constants = load_constants(constants_path) if constants_path.exists() else None
    if constants is not None and constants.device != config.table_device():
        logger.warning(
            "the cost constants at %s were calibrated on %s, the job's tables are on %s "
            "(scaling.use_gpu): the plan's costs may not hold (raydlrm plan --calibrate there)",
            constants_path,
            constants.device,
            config.table_device(),
        )
    budget = worker_memory_budget(config)
    learned = learned_cost_model(config)
    topology = config.topology()
    # A table_row_wise group is a host's workers (the one topology; the planner's own key).
    sharding = replaced(config.sharding, group_size=topology.ranks_per_host)
    planner = {
        "config": sharding,
        "batch_size": config.global_batch_size(),  # what a rank's kernel looks up
        "constants": constants,
        "memory_budget": budget,
        "pooling_factors": None if shape is None else shape.pooling_factors,
        "dedup_ratios": None if shape is None else shape.dedup_ratios,
        "learned": learned,
        "table_stats": None if shape is None else shape.table_stats,
        "max_bag_sizes": None if shape is None else shape.max_bag_sizes,
    }
    hosts = topology.num_hosts
    if config.model.towers == "auto":
        raise ConfigError(
            "model.towers = 'auto' is resolved from the training data before planning "
            f"(resolve_towers), and there is none at {config.data.train_path}"
        )
    if config.model.towers is not None and hosts == 1:
        logger.warning(
            "model.towers on one host (scaling.ranks_per_host unset or = scaling.num_workers): "
            "the tower modules run, the tables are sharded over every worker as without towers"
        )
    try:
        if config.model.towers is not None and hosts > 1:
            return _plan_towers(config, spec.tables(), topology, planner)
        return plan_sharding(spec.tables(), world_size=config.scaling.num_workers, **planner)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _plan_towers(
    config: JobConfig, tables: list, topology: Topology, planner: dict[str, Any]
) -> ShardingPlan:
    """Each host's towers planned over its workers (:func:`raydlrm.sharding.towers.plan_towers`,
    which names the host and its towers when they cannot be planned)."""
    from raydlrm.sharding.planner.tower_plan import plan_towers
    from raydlrm.sharding.tower_spec import model_towers

    towers = model_towers(config.model.towers, topology.num_hosts)
    try:
        return plan_towers(tables, towers, topology, **planner)
    except ValueError as e:
        raise ValueError(f"model.towers: {e}") from None


def learned_cost_model(job: JobConfig) -> LearnedCostModel | None:
    """The learned cost model ``sharding.cost_model`` asks for (None: ``analytic``, or
    ``auto`` without a usable one, with a warning naming why).

    Raises:
        ConfigError: ``neural`` and the model at ``sharding.learned_cost_path`` is missing,
            malformed, or trained for another kernel, device or batch size (naming it).
    """
    choice = job.sharding.cost_model
    if choice == "analytic":
        return None
    from raydlrm.sharding.kernel import resolve_kernel
    from raydlrm.sharding.planner.learned_cost import CostModelError, LearnedCostModel

    path = job.sharding.learned_cost_path
    try:
        model = LearnedCostModel.load(
            path, kernel=resolve_kernel(job.sharding.kernel), device=job.table_device()
        )
        if model.batch_size != job.global_batch_size():
            raise CostModelError(
                f"learned cost model {path} was measured at batch size {model.batch_size}, "
                f"the job's is {job.global_batch_size()} (data.batch_size x "
                "scaling.num_workers): collect samples and train at it"
            )
    except CostModelError as exc:
        if choice == "neural":
            raise ConfigError(f"sharding.cost_model = 'neural': {exc}") from None
        logger.warning("sharding.cost_model = 'auto': planning with the analytic model: %s", exc)
        return None
    return model


def run_storage(job: JobConfig) -> tuple[str, pafs.FileSystem | None]:
    """Ray Train's ``storage_path`` and ``storage_filesystem`` for ``run.storage_path``: an
    absolute local path, or an object-store path (no scheme) with its filesystem, which carries
    the endpoint and credentials of ``[run.storage]`` (or ``[data.storage]``)."""
    path = job.run.storage_path
    if not is_remote(path):
        return str(Path(path.removeprefix("file://")).resolve()), None
    filesystem, resolved = filesystem_for(path, job.run.storage_or(job.data.storage))
    return resolved, filesystem


def check_dense_precision(job: JobConfig) -> None:
    """Refuses ``training.precision = "bf16"`` on GPU workers when this machine's GPU (the
    driver's: a local cluster runs the workers here) has no bf16 units
    (:func:`~raydlrm.trainers.precision.bf16_refusal`), before Ray starts. Without a GPU here
    (a remote cluster's nodes) each worker checks its own.

    Raises:
        ConfigError: naming the key and the GPU.
    """
    if job.training.precision != "bf16" or not job.scaling.use_gpu:
        return
    refusal = bf16_refusal_here()
    if refusal is not None:
        raise ConfigError(refusal)


def bf16_refusal_here() -> str | None:
    """:func:`~raydlrm.trainers.precision.bf16_refusal` of this machine's first GPU (None
    without one), asked in a child process, so that the driver holds no CUDA context of its
    own on the GPU its local workers train on. A child that fails answers None: each worker
    checks again."""
    code = (
        "import torch\n"
        "from raydlrm.trainers.precision import bf16_refusal\n"
        "print((torch.cuda.is_available() and bf16_refusal(0)) or '')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    if done.returncode != 0:
        logger.debug("the bf16 check's child process failed: %s", done.stderr.strip())
        return None
    return done.stdout.strip() or None


def check_resumable(job: JobConfig, run_name: str) -> None:
    """A run that has checkpoints must have an intact one to resume from.

    Raises:
        ConfigError: naming the run and each damaged or missing checkpoint once (how many
            chains need it), before Ray starts rather than after, checkpoint by checkpoint.
    """
    root, filesystem = run_storage(job)
    blocker = resume_blocker(f"{root.rstrip('/')}/{run_name}", filesystem or pafs.LocalFileSystem())
    if blocker is not None:
        raise ConfigError(
            f"run {run_name} cannot resume: {blocker} (restore it, or start a new run with "
            "another run.name)"
        )


def check_run_storage(job: JobConfig, run_name: str) -> None:
    """Writes and removes a probe file in the run's storage directory, so that a storage path
    that cannot be written (read-only, no permission, an unreachable or denied bucket) stops
    the job before Ray starts and before an MLflow run is opened, naming the key.

    Raises:
        ConfigError: naming ``run.storage_path``, the directory and the storage's error.
    """
    root, filesystem = run_storage(job)
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


def check_ssd_space(job: JobConfig, plan: ShardingPlan) -> None:
    """For a local Ray instance (every worker on this machine): the ``ssd`` tables' directory
    can be written and holds all the ranks' files, checked before Ray starts. (Each worker
    checks its own files again when it maps them, on any cluster.)

    Raises:
        ConfigError: naming the tables, ``sharding.ssd_path`` and the shortfall.
    """
    per_rank = plan.per_rank_disk()
    if not any(per_rank) or ray_address(job) != "local":
        return
    tables = [t.name for t in plan.tables if t.placement == "ssd"]
    try:
        check_space(ssd_directory(job.sharding.ssd_path), sum(per_rank), tables=tables)
    except TierError as exc:
        raise ConfigError(str(exc)) from None
