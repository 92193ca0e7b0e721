"""What the driver settles before Ray starts: the resolved job, its data, its plan, and checks.

Everything here runs on the driver alone, in order, and stops a job that cannot run with one
line naming the key, before Ray starts or an MLflow run opens:

1. :func:`resolve_job`: the job config once, with a caller's Ray ``ScalingConfig`` and the
   run's quarantine path applied (never edited afterwards: each later step returns a new one);
2. :func:`validate_job_data`: the synthetic data generated if asked for, the training and
   held-out data checked (paths, rows, columns), a warning per order of the training data's
   files that the reader does not mix (:mod:`raydlrm.ingestion.order`);
3. :func:`make_plan`: the sharding plan within each worker's memory budget;
4. :func:`preflight`: the SSD tier's disk space, the warm start's checkpoint (and its dense
   statistics), the dense statistics of the training data, a write to the run storage.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import ray.train
from ray.train import ScalingConfig

from raydlrm.ingestion import (
    DataConfig,
    DataSummary,
    DataValidationError,
    check_id_kinds,
    generate_synthetic,
    id_kinds_of,
    validate_data,
)
from raydlrm.ingestion.order import OrderFinding, order_findings
from raydlrm.ingestion.reader import WINDOW_COPIES, default_num_actors, window_bytes
from raydlrm.ingestion.stats import training_statistics
from raydlrm.platform.config import (
    BASE_DIR_ENV,
    ConfigError,
    JobConfig,
    base_dir,
    default_tracking_uri,
    replaced,
)
from raydlrm.platform.ray_init import ray_address
from raydlrm.platform.tracking import check_tracking_of, registered_checkpoint
from raydlrm.sharding import MemoryBudget, ShardingPlan, load_constants
from raydlrm.sharding.plan import format_bytes
from raydlrm.sharding.planner import plan_sharding
from raydlrm.sharding.tiers import TierError, check_space, ssd_directory
from raydlrm.storage import filesystem_for, is_remote, join
from raydlrm.trainers.checkpoints import (
    STATE_FILE,
    check_intact,
    check_state_matches,
    resume_blocker,
)

__all__ = [
    "DataShape",
    "JobData",
    "Preflight",
    "data_shape",
    "make_plan",
    "preflight",
    "prepare_data",
    "resolve_dedup_groups",
    "resolve_job",
    "resolve_paths",
    "resolve_towers",
    "run_storage",
    "validate_job_data",
    "worker_memory",
    "worker_memory_budget",
]

if TYPE_CHECKING:
    from raydlrm.sharding.learned_cost import LearnedCostModel, TableStats

logger = logging.getLogger(__name__)


def resolve_job(
    job: JobConfig, *, run_name: str, scaling_config: ScalingConfig | None = None
) -> JobConfig:
    """``job`` with what the call decides applied: a Ray ``scaling_config`` replaces
    ``[scaling]`` (the plan and the memory budget depend on it), and quarantined data goes
    under the run's storage unless ``data.quarantine_path`` names a place."""
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
    if job.data.bad_input == "quarantine" and job.data.quarantine_path is None:
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


def prepare_data(config: JobConfig) -> None:
    """Generates the configured synthetic data set if ``data.synthetic.generate =
    "if_missing"`` and ``data.train_path`` does not exist (locally: never on an object store).

    Raises:
        DataValidationError: ``data.train_path`` is a local path that does not exist (and is
            not to be generated), naming the key, the resolved path and how to make the
            synthetic data set the config describes, if it describes one.
    """
    data = config.data
    synthetic = data.synthetic
    if (
        synthetic is not None
        and synthetic.generate == "if_missing"
        and not is_remote(data.train_path)
        and not Path(data.train_path).exists()
    ):
        root = Path(data.train_path).parent
        logger.info("generating synthetic data into %s (data.synthetic.generate)", root)
        generate_synthetic(synthetic, out_dir=root)
    _check_exists(config, "data.train_path", data.train_path)


def _check_exists(config: JobConfig, key: str, path: str | None) -> None:
    if path and not is_remote(path) and not Path(path).exists():
        raise DataValidationError(f"{key}: {path} does not exist{_missing_hint(config)}")


def _missing_hint(config: JobConfig) -> str:
    """What a missing data path's error adds: where relative paths went, and how to write the
    synthetic data set the config describes."""
    hint = ""
    if BASE_DIR_ENV in os.environ:
        hint += f" (relative paths are under {BASE_DIR_ENV}={os.environ[BASE_DIR_ENV]})"
    if config.data.synthetic is not None:
        hint += (
            "; the config's [data.synthetic] describes a synthetic data set: `raydlrm data "
            "generate` with the same config writes it there (or set data.synthetic.generate "
            '= "if_missing")'
        )
    return hint


@dataclass(frozen=True)
class JobData:
    """The job's validated data sets."""

    train: DataSummary
    evaluation: DataSummary | None


def validate_job_data(job: JobConfig) -> JobData:
    """The training and held-out data, generated if synthetic and checked (paths, rows,
    columns) before anything starts; the training data's file order is sampled for what it is
    correlated with (a warning each, never an error).

    Raises:
        DataValidationError: missing or malformed data, named.
    """
    prepare_data(job)
    _check_exists(job, "data.eval_path", job.data.eval_path)
    data = job.data
    train = validate_data(data.train_path, data, role="train")
    check_shuffle_window(job, train)
    _warn_file_order(train, config=data)
    return JobData(
        train=train,
        evaluation=validate_data(data.eval_path, data, role="eval") if data.eval_path else None,
    )


def _warn_file_order(summary: DataSummary, *, config: DataConfig) -> None:
    """A warning per way the training data's file order is correlated with its content (runs
    of ids, label drift, time) that the reader, as configured, does not mix away, naming the
    column and the setting; one that it mixes is logged as information. A bounded sample: it
    reads at most a few tens of row groups' first rows."""
    alike: dict[tuple[str, str, bool], list[OrderFinding]] = {}
    for finding in order_findings(summary, config):
        key = (finding.kind, finding.suggestion, finding.mixed)
        alike.setdefault(key, []).append(finding)
    # Findings of one kind with one remedy (every user column of data sorted by user) are one
    # line: the first one's statistic, every column named.
    for (_, suggestion, mixed), findings in alike.items():
        first = findings[0]
        columns = ", ".join(f.column for f in findings)
        more = f" (the first; {len(findings)} columns alike)" if len(findings) > 1 else ""
        log = logger.info if mixed else logger.warning
        log("training data order: %s: %s%s; %s", columns, first.statistic, more, suggestion)


def resolve_dedup_groups(job: JobConfig, data: JobData) -> JobConfig:
    """``job`` with the dedup group that ``data.dedup = "infer"`` asks for, when
    ``data.dedup_groups`` is empty: a session-clustered training set's per-session columns, or
    the sparse columns constant within the sessions of a sample-level one's first rows
    (:func:`raydlrm.ingestion.dedup.infer_dedup_groups`). Stored in ``data.dedup_groups``, so
    the plan, the workers, the checkpoints and the model see it: call it after
    :func:`validate_job_data` and before :func:`make_plan`.

    Raises:
        ConfigError: nothing to infer (no session column, too few repeated sessions, no
            constant column), naming ``data.dedup``.
    """
    from raydlrm.ingestion.dedup import infer_dedup_groups

    if job.data.dedup != "infer" or job.data.dedup_groups:
        return job
    try:
        groups = infer_dedup_groups(data.train, job.data)
        return dataclasses.replace(job, data=dataclasses.replace(job.data, dedup_groups=groups))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


@dataclass(frozen=True)
class DataShape:
    """What the planner's cost model reads off the training data's first rows."""

    rows: int
    """Rows read."""
    pooling_factors: dict[str, float]
    """Table name -> the mean ids per bag of its features."""
    dedup_ratios: dict[str, float]
    """Table name -> its dedup group's samples per unique row in a batch (tables of
    ``data.dedup_groups`` only)."""
    table_stats: dict[str, TableStats] = dataclasses.field(default_factory=dict)
    """Table name -> the ids per sample and access histogram of the first batch, for the
    learned cost model (``sharding.cost_model`` other than ``analytic`` only)."""
    max_bag_sizes: dict[str, int] = dataclasses.field(default_factory=dict)
    """Table name -> the most ids one sample looks up in it: one per single-id feature, per
    id-list feature its ``data.sparse_specs.<c>.max_length`` (a longer list is bad input),
    else the longest list of the rows read. The planner sizes row caches by it, so that a
    step's rows fit a cache."""


def data_shape(job: JobConfig, data: JobData) -> DataShape:
    """The pooling factor of every table and the dedup ratio of every deduplicated one
    (:func:`~raydlrm.ingestion.dedup.group_row_ratio` in batches of ``data.batch_size``), read
    off the training data's first rows (four batches, at least 10,000 rows, at most 100,000):
    the planner costs lookups and bytes with them. Call it after
    :func:`resolve_dedup_groups`."""
    from raydlrm.ingestion.clustered import read_rows
    from raydlrm.ingestion.dedup import group_row_ratio

    config = job.data
    table = read_rows(
        data.train.path,
        config,
        columns=list(config.sparse_columns),
        max_rows=min(max(10_000, 4 * config.batch_size), 100_000),
    )
    lengths = {
        c: _mean_length(table.column(c)) for c in config.sparse_columns if c in table.column_names
    }
    pooling = {
        name: sum(lengths.get(c, 1.0) for c in columns) / len(columns)
        for name, columns in config.table_columns().items()
    }
    ratios = {}
    for group in config.dedup_groups:
        ratio = group_row_ratio(table, columns=list(group), batch_size=config.batch_size)
        logger.info("dedup group %s: %.2f samples per unique row in a batch", group, ratio)
        ratios.update(
            (name, ratio)
            for name, columns in config.table_columns().items()
            if set(columns) <= set(group)
        )
    stats = {}
    if job.sharding.cost_model != "analytic":
        stats = table_stats(job, table.slice(0, job.global_batch_size()))
    declared = {c: s.max_length for c, s in config.sparse_specs.items() if s.max_length}
    longest = {
        c: declared[c] if c in declared else _max_length(table.column(c))
        for c in config.sparse_columns
        if c in declared or c in table.column_names
    }
    bags = {
        name: sum(longest.get(c, 1) for c in columns)
        for name, columns in config.table_columns().items()
    }
    return DataShape(
        rows=table.num_rows,
        pooling_factors=pooling,
        dedup_ratios=ratios,
        table_stats=stats,
        max_bag_sizes=bags,
    )


def table_stats(job: JobConfig, batch: pa.Table) -> dict[str, TableStats]:
    """Each table's :class:`~raydlrm.sharding.learned_cost.TableStats` in one batch of rows:
    the ids of its features per row, and how often each distinct id is looked up (raw ids: the
    hashing into the table's rows merges few of them). A bucket table is not in the raw batch:
    the planner takes it as looked up uniformly (at most its buckets' rows)."""
    from raydlrm.sharding.learned_cost import TableStats, histogram_of_counts

    tables = {t.name: t for t in job.worker_spec().tables()}
    out = {}
    for name, columns in job.data.table_columns().items():
        present = [c for c in columns if c in batch.column_names]
        if not present or not batch.num_rows:
            continue
        ids = [_flat_ids(batch.column(c)) for c in present]
        if len({a.type for a in ids}) > 1:
            ids = [a.cast(pa.string()) for a in ids]
        values = pa.concat_arrays(ids).drop_null()
        counts = pc.value_counts(values).field("counts").to_numpy()
        t = tables[name]
        out[name] = TableStats(
            t.num_embeddings,
            t.embedding_dim,
            len(values) / batch.num_rows,
            histogram_of_counts(counts),
        )
    return out


def _flat_ids(column: pa.ChunkedArray) -> pa.Array:
    """A sparse column's ids, its lists flattened."""
    array = column.combine_chunks()
    if pa.types.is_list(array.type) or pa.types.is_large_list(array.type):
        return array.flatten()
    return array


def _max_length(column: pa.ChunkedArray) -> int:
    """Most ids in one row of a sparse column: its longest list, 1 for single ids."""
    if not (pa.types.is_list(column.type) or pa.types.is_large_list(column.type)):
        return 1
    longest = pc.max(pc.list_value_length(column)).as_py()
    return max(1, longest or 0)


def _mean_length(column: pa.ChunkedArray) -> float:
    """Mean ids per row of a sparse column: its lists' mean length (a null list is empty), 1
    for single ids."""
    if not (pa.types.is_list(column.type) or pa.types.is_large_list(column.type)):
        return 1.0
    if column.length() == 0:
        return 1.0
    lengths = pc.fill_null(pc.list_value_length(column), 0)
    return float(pc.mean(lengths).as_py())


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
    if scaling.use_gpu:
        return _no_budget(
            "the tables live in the workers' GPU memory, which the driver does not know: set "
            "sharding.device_memory_bytes"
        )
    known = worker_memory(job)
    if known is None:
        return _no_budget(
            f"the workers run on the Ray cluster at {ray_address(job)}, whose memory the driver "
            "does not know: set sharding.device_memory_bytes or scaling.resources_per_worker.memory"
        )
    memory, source = known
    overhead = sharding.worker_overhead_bytes
    source = f"{source} - {format_bytes(overhead)} overhead"
    if memory - overhead <= 0:
        raise ConfigError(
            f"sharding.memory_budget: no memory left for embedding tables ({source}); lower "
            "sharding.worker_overhead_bytes or scaling.num_workers, set "
            "sharding.device_memory_bytes, or sharding.memory_budget = 'off' to plan for other "
            "machines"
        )
    return MemoryBudget(memory - overhead, source)


def worker_memory(job: JobConfig) -> tuple[int, str] | None:
    """A worker's memory as the driver knows it, and how it was derived: its Ray ``memory``
    resource (``scaling.resources_per_worker``), else this machine's memory shared by all
    ``scaling.num_workers`` workers (a local Ray cluster runs them all here); None on a remote
    cluster, whose nodes' memory is unknown here."""
    scaling = job.scaling
    if "memory" in scaling.resources_per_worker:
        memory = int(scaling.resources_per_worker["memory"])
        return memory, f"{format_bytes(memory)} scaling.resources_per_worker.memory"
    if ray_address(job) != "local":
        return None
    node = psutil.virtual_memory().total
    return node // scaling.num_workers, (
        f"{format_bytes(node)} node memory / {scaling.num_workers} workers"
    )


def check_shuffle_window(job: JobConfig, train: DataSummary) -> None:
    """Refuses a shuffle window (``data.shuffle_window_rows``) whose preprocessing actors
    would hold over half a worker's memory (:func:`worker_memory`): each actor of a worker's
    pool reads one window at a time (:func:`~raydlrm.ingestion.reader.window_bytes`).

    Raises:
        ConfigError: naming the key, the memory it needs and the largest window that fits.
    """
    memory = worker_memory(job)
    if memory is None:
        return
    need = window_bytes(train, job.data)  # a footer read: only when there is a budget
    if not need:
        return
    actors = job.data.num_preprocess_actors or default_num_actors()
    budget, source = memory
    if need * actors <= budget // 2:
        return
    rows = job.data.shuffle_window_rows
    fits = int(min(rows, train.num_rows) * (budget // 2) / (need * actors))
    raise ConfigError(
        f"data.shuffle_window_rows = {rows}: {actors} preprocessing actor(s) per worker would "
        f"each hold about {format_bytes(need)} of window rows ({WINDOW_COPIES} copies of the "
        f"rows of {train.path} it mixes), over half a worker's memory ({source}); set it to "
        f"at most {fits} (0: off), or lower data.num_preprocess_actors"
    )


def _no_budget(why: str) -> None:
    logger.warning(
        "no memory budget for the embedding tables: %s (or sharding.memory_budget = 'off')", why
    )


def make_plan(config: JobConfig, *, shape: DataShape | None = None) -> ShardingPlan:
    """The sharding plan of the job's tables over ``scaling.num_workers`` ranks within
    :func:`worker_memory_budget`, costed with the calibrated constants at
    ``sharding.cost_constants_path`` when that file exists, and with the data's pooling
    factors and dedup ratios (``shape``, from :func:`data_shape`; without it every bag is
    taken to hold one id and nothing to be deduplicated), at the global batch (every worker's
    samples: what a rank's kernel looks up of a table-wise table).

    Raises:
        ConfigError: sharding settings that cannot be planned, e.g. a table that does not fit
            the budget (naming the table, the rank, the shortfall and the budget's source).
    """
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
    planner = {
        "config": config.sharding,
        "batch_size": config.global_batch_size(),  # what a rank's kernel looks up
        "constants": constants,
        "memory_budget": budget,
        "pooling_factors": None if shape is None else shape.pooling_factors,
        "dedup_ratios": None if shape is None else shape.dedup_ratios,
        "learned": learned,
        "table_stats": None if shape is None else shape.table_stats,
        "max_bag_sizes": None if shape is None else shape.max_bag_sizes,
    }
    hosts = config.scaling.num_hosts()
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
            return _plan_towers(config, spec.tables(), hosts, planner)
        return plan_sharding(spec.tables(), world_size=config.scaling.num_workers, **planner)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _plan_towers(
    config: JobConfig, tables: list, hosts: int, planner: dict[str, Any]
) -> ShardingPlan:
    """Each host's towers planned over its workers (:func:`raydlrm.sharding.towers.plan_towers`,
    which names the host and its towers when they cannot be planned)."""
    from raydlrm.sharding.tower_spec import model_towers
    from raydlrm.sharding.towers import Topology, plan_towers

    towers = model_towers(config.model.towers, hosts)
    try:
        return plan_towers(
            tables, towers, Topology(hosts, config.scaling.ranks_per_host), **planner
        )
    except ValueError as e:
        raise ValueError(f"model.towers: {e}") from None


def resolve_towers(
    job: JobConfig, data: JobData, shape: DataShape, *, run_name: str | None
) -> JobConfig:
    """``model.towers = "auto"`` resolved (:mod:`raydlrm.platform.auto_towers`: the towers of
    the checkpoint run ``run_name`` resumes from, else a warm-up on the training data, with
    its dense statistics); any other job as it is. Call it after :func:`data_shape`, before
    :func:`make_plan`."""
    if job.model.towers != "auto":
        return job
    from raydlrm.platform.auto_towers import resolve_towers as resolve

    resumed = None if run_name is None else _resumed_state(job, run_name)
    warm = _warm_start_state(job) if job.run.warm_start else None
    job = _with_recorded_statistics(
        job,
        resumed=None if resumed is None else resumed[1],
        warm=None if warm is None else warm.state,
    )
    recorded = resumed[1] if resumed is not None else None if warm is None else warm.state
    return resolve(job, data, shape, recorded=recorded)


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
    from raydlrm.sharding.learned_cost import CostModelError, LearnedCostModel

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


@dataclass(frozen=True)
class Preflight:
    """What the checks before Ray starts settle."""

    job: JobConfig
    """The job with its dense statistics, bucket boundaries and id kinds."""
    warm_start: ray.train.Checkpoint | None
    """The ``run.warm_start`` checkpoint, checked, or None."""


def preflight(job: JobConfig, plan: ShardingPlan, *, data: JobData, run_name: str) -> Preflight:
    """The checks and statistics before Ray starts: the SSD tier's space, the warm start's
    checkpoint (whose dense statistics, bucket boundaries and id kinds the job keeps), the kind
    of every sparse column's ids, the run storage, the checkpoint a resumed run continues
    (whose statistics it keeps, and whose settings must match), the dense statistics and bucket
    boundaries of the training data (those still missing) and the MLflow tracking server.
    Returns the job with its statistics and id kinds, and the warm start.

    Raises:
        ConfigError: naming the key whose setting cannot work (and why).
        DataValidationError: a sparse column holds ids of another kind than the model's.
    """
    _check_ssd_space(job, plan)
    _check_run_storage(job, run_name)
    _check_resumable(job, run_name)
    resumed = _resumed_state(job, run_name)
    warm_start = _warm_start_checkpoint(job, plan) if job.run.warm_start else None
    job = _with_recorded_statistics(
        job,
        resumed=None if resumed is None else resumed[1],
        warm=None if warm_start is None else warm_start.state,
    )
    if warm_start is not None:
        job = _with_id_kinds(job, warm_start.data.get("id_kinds") or {})
    job = _with_id_kinds(job, _data_id_kinds(job, data))
    if resumed is not None:
        _check_resume(job, plan, run_name, resumed)
    check_tracking_of(job)
    return Preflight(job=job, warm_start=None if warm_start is None else warm_start.checkpoint)


def _data_id_kinds(job: JobConfig, data: JobData) -> dict[str, str]:
    """The id kinds of the training data, checked against those the job already records (a
    warm start's, the config's), and the held-out data's against them."""
    check_id_kinds(data.train.schema, job.data, what=f"training data {data.train.path}")
    kinds = {**id_kinds_of(data.train.schema, job.data), **job.data.id_kinds}
    if data.evaluation is not None:
        recorded = dataclasses.replace(job.data, id_kinds=kinds)
        check_id_kinds(data.evaluation.schema, recorded, what=f"eval data {data.evaluation.path}")
    return kinds


def _with_id_kinds(job: JobConfig, kinds: dict[str, str]) -> JobConfig:
    """``job`` with ``kinds`` for the sparse columns it records none for."""
    new = {c: k for c, k in kinds.items() if c not in job.data.id_kinds}
    if not new:
        return job
    merged = {**job.data.id_kinds, **new}
    return dataclasses.replace(job, data=dataclasses.replace(job.data, id_kinds=merged))


def _with_recorded_statistics(
    job: JobConfig, *, resumed: dict[str, Any] | None, warm: dict[str, Any] | None
) -> JobConfig:
    """``job`` with the dense statistics, fill values and bucket boundaries its model means, in
    one order:
    the checkpoint the run resumes (``resumed``, its state) was trained with them, then the
    warm start's (``warm``), then the training data's for the columns still without (a
    model's features keep their meaning; the first that holds a column's wins)."""
    for state in (resumed, warm):
        if state is not None:
            job = _with_statistics(job, state["spec"]["data"])
    return _with_statistics(job, _training_statistics(job))


def _with_statistics(job: JobConfig, recorded: dict[str, Any]) -> JobConfig:
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


def run_storage(job: JobConfig) -> tuple[str, pafs.FileSystem | None]:
    """Ray Train's ``storage_path`` and ``storage_filesystem`` for ``run.storage_path``: an
    absolute local path, or an object-store path (no scheme) with its filesystem, which carries
    the endpoint and credentials of ``[run.storage]`` (or ``[data.storage]``)."""
    path = job.run.storage_path
    if not is_remote(path):
        return str(Path(path.removeprefix("file://")).resolve()), None
    filesystem, resolved = filesystem_for(path, job.run.storage_or(job.data.storage))
    return resolved, filesystem


def _check_resumable(job: JobConfig, run_name: str) -> None:
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


def _check_run_storage(job: JobConfig, run_name: str) -> None:
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


def _resumed_state(job: JobConfig, run_name: str) -> tuple[str, dict[str, Any]] | None:
    """The newest checkpoint of the run with a readable state (``trainer_state.json``): its
    path and state; None when the run has none (it starts afresh)."""
    root, filesystem = run_storage(job)
    filesystem = filesystem or pafs.LocalFileSystem()
    selector = pafs.FileSelector(f"{root.rstrip('/')}/{run_name}", allow_not_found=True)
    checkpoints = sorted(
        (
            i.path
            for i in filesystem.get_file_info(selector)
            if i.type == pafs.FileType.Directory and i.base_name.startswith("checkpoint_")
        ),
        reverse=True,
    )
    for path in checkpoints:
        try:
            with filesystem.open_input_stream(f"{path}/{STATE_FILE}") as f:
                return path, json.loads(f.read())
        except (OSError, ValueError):
            continue  # a damaged or partial checkpoint: the workers pass it over too
    return None


def _check_resume(
    job: JobConfig, plan: ShardingPlan, run_name: str, resumed: tuple[str, dict[str, Any]]
) -> None:
    """A run that resumes from ``resumed`` (its newest readable checkpoint: path and state)
    must keep the model and features that checkpoint was trained with.

    Raises:
        ConfigError: naming the run, the checkpoint and every setting that differs, with both
            values.
    """
    path, state = resumed
    differences = resume_differences(state, job=job, plan=plan)
    if differences:
        raise ConfigError(
            f"run {run_name} would resume from {path}, trained with other settings: "
            f"{'; '.join(differences)} (keep the checkpoint's settings to resume, or "
            "start a new run with another run.name)"
        )


def resume_differences(state: dict[str, Any], *, job: JobConfig, plan: ShardingPlan) -> list[str]:
    """What a checkpoint's ``trainer_state.json`` (``state``) and the job disagree on that a
    resume cannot change: the model, the dense and sparse columns and their statistics (what
    a standardized value and a bucket mean), the fused optimizer, the tables (names and
    shapes; tables that differ alike are named together); one phrase each, with both values."""
    spec = state["spec"]
    settings = _model_settings(spec, job=job)
    for key in ("dense_columns", "sparse_columns"):
        settings[f"data.{key}"] = (spec["data"][key], getattr(job.data, key))
    for key in ("dense_stats", "dense_fill_values", "bucket_boundaries"):  # older: may lack
        settings[f"data.{key}"] = (spec["data"].get(key, {}), getattr(job.data, key))
    settings.update(_indicator_settings(spec, job=job))
    settings["sharding.optimizer"] = (spec["sharding"]["optimizer"], job.sharding.optimizer)
    out = [
        f"{key}: {theirs!r} in the checkpoint, {mine!r} in the config"
        for key, (theirs, mine) in settings.items()
        if _plain(theirs) != _plain(mine)
    ]
    saved = {t["name"]: (t["num_embeddings"], t["embedding_dim"]) for t in state["plan"]["tables"]}
    ours = {t.name: (t.num_embeddings, t.embedding_dim) for t in plan.tables}
    gone = [n for n in saved if n not in ours]
    new = [n for n in ours if n not in saved]
    if gone:
        out.append(f"{_names(gone)} {_are(gone)} in the checkpoint but not in the config")
    if new:
        out.append(f"{_names(new)} {_are(new)} in the config but not in the checkpoint")
    reshaped: dict[tuple, list[str]] = {}
    for n in ours:
        if n in saved and saved[n] != ours[n]:
            reshaped.setdefault((saved[n], ours[n]), []).append(n)
    for ((rows, dim), (rows2, dim2)), names in reshaped.items():
        out.append(
            f"{_names(names)}: {rows} x {dim} in the checkpoint, {rows2} x {dim2} in the config"
        )
    return out


def _indicator_settings(spec: dict[str, Any], *, job: JobConfig) -> dict[str, tuple[Any, Any]]:
    """The dense columns with a missing indicator (the model's dense input is one wider per
    column): (the checkpoint's, the job's); a checkpoint of a release before them has none."""
    data = spec.get("data") or {}
    specs = data.get("dense_specs") or {}
    default = data.get("dense_missing_indicator", False)
    own = {c: (specs.get(c) or {}).get("missing_indicator") for c in data.get("dense_columns", [])}
    theirs = [c for c, flag in own.items() if (default if flag is None else flag)]
    mine = job.data.missing_indicator_columns()
    return {"data.dense_missing_indicator (columns)": (theirs, mine)}


def _model_settings(
    spec: dict[str, Any], *, job: JobConfig, skip: tuple[str, ...] = ()
) -> dict[str, tuple[Any, Any]]:
    """``model.<key>``: (the checkpoint's value, the job's) for the model keys both know."""
    return {
        f"model.{k}": (v, getattr(job.model, k))
        for k, v in spec["model"].items()
        if hasattr(job.model, k) and k not in skip  # a knob of an older release: not compared
    }


def model_differences(
    state: dict[str, Any], *, job: JobConfig, skip: tuple[str, ...] = ()
) -> list[str]:
    """The model settings (but ``skip``) that a checkpoint's state and the job disagree on,
    one phrase each with both values."""
    return [
        f"{key}: {theirs!r} in the checkpoint, {mine!r} in the config"
        for key, (theirs, mine) in {
            **_model_settings(state["spec"], job=job, skip=skip),
            **_indicator_settings(state["spec"], job=job),
        }.items()
        if _plain(theirs) != _plain(mine)
    ]


def _names(names: list[str], most: int = 4) -> str:
    shown = ", ".join(names[:most])
    return shown if len(names) <= most else f"{shown} and {len(names) - most} more tables"


def _are(names: list[str]) -> str:
    return "is" if len(names) == 1 else "are"


def _plain(value: Any) -> Any:
    """A config value as JSON has it (tuples as lists), for comparing with a stored one."""
    return json.loads(json.dumps(value))


@dataclass(frozen=True)
class _WarmStart:
    uri: str
    """The checkpoint (a registered model's run's, for ``models:/``)."""
    filesystem: pafs.FileSystem
    path: str
    state: dict[str, Any]
    """Its ``trainer_state.json``."""

    @property
    def data(self) -> dict[str, Any]:
        """The data config its model was trained with, as stored (statistics, id kinds)."""
        return self.state["spec"]["data"]

    @property
    def checkpoint(self) -> ray.train.Checkpoint:
        if isinstance(self.filesystem, pafs.LocalFileSystem):
            return ray.train.Checkpoint(self.path)
        return ray.train.Checkpoint(self.path, filesystem=self.filesystem)


def _warm_start_state(job: JobConfig) -> _WarmStart:
    """The ``run.warm_start`` checkpoint and its state, read (not yet checked).

    Raises:
        ConfigError: naming the checkpoint when it cannot be read.
    """
    uri = job.run.warm_start
    assert uri is not None
    if uri.startswith("models:/"):  # a registered model: its run's final checkpoint
        try:
            uri = registered_checkpoint(uri, default_tracking_uri(job.tracking))
        except ConfigError as exc:
            raise ConfigError(f"run.warm_start: {exc}") from None
    try:
        filesystem, path = filesystem_for(uri, job.run.storage_or(job.data.storage))
        with filesystem.open_input_stream(f"{path}/{STATE_FILE}") as f:
            state = json.loads(f.read())
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"run.warm_start: {uri} is not a readable training checkpoint ({exc})"
        ) from None
    return _WarmStart(uri=uri, filesystem=filesystem, path=path, state=state)


# Settings of the tower partitioner, not of the model: the towers it made are compared.
_PARTITIONER_KEYS = ("num_towers", "tower_warmup_steps")


def _warm_start_checkpoint(job: JobConfig, plan: ShardingPlan) -> _WarmStart:
    """The ``run.warm_start`` checkpoint for the workers, checked against the job first (it
    must exist, be intact, hold the job's tables, names and shapes, and fused optimizer, and
    have been trained with the job's model: its architecture, layers and towers).

    Raises:
        ConfigError: naming the checkpoint and what does not match.
    """
    warm = _warm_start_state(job)
    try:
        check_state_matches(warm.state, plan, job.sharding.optimizer, source=warm.uri)
        check_intact(warm.path, filesystem=warm.filesystem)
    except ValueError as exc:  # CheckpointDamagedError too
        raise ConfigError(f"run.warm_start: {exc}") from None
    differences = model_differences(warm.state, job=job, skip=_PARTITIONER_KEYS)
    if differences:
        raise ConfigError(
            f"run.warm_start: {warm.uri} was trained with another model: "
            f"{'; '.join(differences)} (its weights would load into other layers: warm-start "
            "from a checkpoint of this model, or train from scratch)"
        )
    state = warm.state
    logger.info(
        "warm start from %s (step %d, %d workers)", warm.uri, state["step"], state["world_size"]
    )
    return warm


def _check_ssd_space(job: JobConfig, plan: ShardingPlan) -> None:
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
