"""A job's data, read before Ray starts: present (or generated), valid, its file order sampled,
its dedup groups inferred, and its shape (what the planner costs lookups with)."""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from raydlrm.ingestion import (
    DataConfig,
    DataSummary,
    DataValidationError,
    generate_synthetic,
    validate_data,
)
from raydlrm.ingestion.order import OrderFinding, order_findings
from raydlrm.ingestion.validation_split import carve_validation
from raydlrm.platform.config import BASE_DIR_ENV, ConfigError, JobConfig
from raydlrm.storage import is_remote

__all__ = [
    "DataShape",
    "JobData",
    "data_shape",
    "prepare_data",
    "resolve_dedup_groups",
    "table_stats",
    "validate_job_data",
    "warn_file_order",
]

if TYPE_CHECKING:
    from raydlrm.sharding.planner.learned_cost import TableStats

logger = logging.getLogger(__name__)


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
    validation: DataSummary | None = None
    """The validation set (``data.valid_path``, or carved out of the training data by
    ``data.valid_split``: then ``train`` is what is left to train on)."""


def validate_job_data(job: JobConfig) -> JobData:
    """The training and held-out data, generated if synthetic and checked (paths, rows,
    columns) before anything starts; the training data's file order is sampled for what it is
    correlated with (a warning each, never an error). Its shuffle window is checked by the
    caller (:func:`~raydlrm.platform.memory.check_shuffle_window`: a resumed run's may differ).

    Raises:
        DataValidationError: missing or malformed data, named.
    """
    prepare_data(job)
    _check_exists(job, "data.eval_path", job.data.eval_path)
    _check_exists(job, "data.valid_path", job.data.valid_path)
    data = job.data
    train = validate_data(data.train_path, data, role="train")
    warn_file_order(train, config=data)
    validation = None
    if data.valid_path:
        validation = validate_data(data.valid_path, data, role="valid")
    elif data.valid_split != "none":
        train, validation = carve_validation(train, data)
        logger.info(
            "validation: %d rows in %d row groups of %s held out by data.valid_split = %r",
            validation.num_rows,
            len(validation.row_groups),
            data.train_path,
            data.valid_split,
        )
    return JobData(
        train=train,
        evaluation=validate_data(data.eval_path, data, role="eval") if data.eval_path else None,
        validation=validation,
    )


def warn_file_order(summary: DataSummary, *, config: DataConfig) -> None:
    """A warning per way the training data's file order is correlated with its content (runs
    of ids, label drift, time) that the reader, as configured, does not handle as advised
    (:func:`~raydlrm.ingestion.order.order_findings`: runs mixed by the shuffle window, a
    trend through the files read in time order), naming the column and what to try; one that
    it handles is logged as information. A bounded sample: it reads at most a few tens of row
    groups' first rows."""
    alike: dict[tuple[str, str, bool], list[OrderFinding]] = {}
    for finding in order_findings(summary, config):
        key = (finding.kind, finding.suggestion, finding.handled)
        alike.setdefault(key, []).append(finding)
    # Findings of one kind with one remedy (every user column of data sorted by user) are one
    # line: the first one's statistic, every column named.
    for (_, suggestion, handled), findings in alike.items():
        first = findings[0]
        columns = ", ".join(f.column for f in findings)
        more = f" (the first; {len(findings)} columns alike)" if len(findings) > 1 else ""
        log = logger.info if handled else logger.warning
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
    id-list feature its ``data.sparse_specs.<c>.max_length`` (a longer list is bad input) or
    its sequence's ``data.sequences.<name>.max_length`` (a longer list is cut), else the
    longest list of the rows read. The planner sizes row caches by it, so that a
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
    check_managed_capacity(job, table, where=data.train.path)
    # A sequence's rows are cut to its max_length: that many ids at most are looked up.
    cut = {c: config.max_length_of(c) for c in config.sparse_columns if config.sequence_of(c)}
    lengths = {
        c: _mean_length(table.column(c), cap=cut.get(c))
        for c in config.sparse_columns
        if c in table.column_names
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
    declared = {c: n for c in config.sparse_columns if (n := config.max_length_of(c))}
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


def check_managed_capacity(job: JobConfig, sample: pa.Table, *, where: str) -> None:
    """What a managed table must hold, checked against the data's first rows (``sample``, of
    the data set ``where``) before Ray starts; beyond them, a training step that finds no row
    stops with an error naming the table.

    - Without eviction, every distinct id of the data: refused when the sample already holds
      more distinct ids than the table's rows give (its size less a fallback row per bucket).
    - With eviction and ``admit_after = 1`` (every id looked up takes a row), one step's
      distinct ids: a row looked up in a step cannot be evicted in it
      (:func:`_check_step_ids`).
    - ``ttl_days`` needs the data's date.

    Raises:
        ConfigError: naming the table, the counts and what to change.
    """
    config = job.data
    for name, columns in config.table_columns().items():
        policy = config.managed_of(name)
        if policy is not None and policy.ttl_days and config.data_date is None:
            raise ConfigError(
                f"data.managed_ids.{name}.ttl_days counts days of data time: set data.data_date "
                "(raydlrm retrain sets it from date partitions), or use ttl_steps"
            )
        present = [c for c in columns if c in sample.column_names]
        if policy is None or not present:
            continue
        if policy.eviction != "none":
            if policy.admit_after == 1:
                _check_step_ids(job, sample, table=name, columns=present, where=where)
            continue
        rows = config.table_size_of(columns[0])
        capacity = rows - policy.buckets_for(rows)
        ids = [_flat_ids(sample.column(c)) for c in present]
        if len({a.type for a in ids}) > 1:
            ids = [a.cast(pa.string()) for a in ids]
        distinct = pc.count_distinct(pa.concat_arrays(ids)).as_py()
        if distinct > capacity:
            raise ConfigError(
                f"data.managed_ids.{name}: table {name!r} holds {capacity:,} ids ({rows:,} rows "
                f"less a fallback row per bucket), but the first {sample.num_rows:,} rows of "
                f"{where} already have {distinct:,} distinct ids in {present}, and eviction is "
                f"'none': raise data.table_sizes.{name} or set an eviction policy"
            )


def _check_step_ids(
    job: JobConfig, sample: pa.Table, *, table: str, columns: list[str], where: str
) -> None:
    """Refuses a managed table that one training step's distinct ids outnumber: every id a
    step looks up takes a row (``admit_after = 1``) that no other id of the step may take, so
    the step would stop whatever the eviction policy and ``probe_window``. A step's ids are
    measured on the sample's rows drawn in a random order (training shuffles): ``k`` rows of
    a step (the global batch, or the whole sample when it is smaller: a lower bound) hold
    ``D`` distinct ids, at most ``min(k x ids per sample, the data's distinct ids)``.

    Raises:
        ConfigError: naming the table, the step's ids against its capacity, and the table
            size and batch size that would hold them.
    """
    config = job.data
    rows = config.table_size_of(config.table_columns()[table][0])
    policy = config.managed_of(table)
    assert policy is not None
    capacity = rows - policy.buckets_for(rows)
    first = _first_draws(sample, columns=columns, seed=job.training.seed)
    step = job.global_batch_size()
    drawn = min(step, sample.num_rows)
    distinct = int(np.searchsorted(first, drawn))
    if distinct <= capacity:
        return
    # The first first[capacity] rows drawn hold `capacity` distinct ids: a step that fits.
    fits = max(1, int(first[capacity]) // job.scaling.num_workers)
    raise ConfigError(
        f"data.managed_ids.{table}: one training step looks up more distinct ids of table "
        f"{table!r} than the {capacity:,} it holds ({rows:,} rows less a fallback row per "
        f"bucket): {drawn:,} rows drawn at random from the first {sample.num_rows:,} of {where} "
        f"hold {distinct:,} (a step trains {step:,}: data.batch_size {config.batch_size:,} x "
        f"{job.scaling.num_workers} workers), and a row looked up in a step cannot be given to "
        "another id in it, whatever the eviction policy or probe_window: raise "
        f"data.table_sizes.{table} well above {distinct:,} (a fallback row per bucket more, and "
        f"room for buckets that fill unevenly), or lower data.batch_size to at most {fits:,}"
    )


def _first_draws(sample: pa.Table, *, columns: list[str], seed: int) -> np.ndarray:
    """For each distinct id of ``columns`` (id lists flattened, nulls left out), the position
    of the first row holding it when the rows of ``sample`` are drawn in a random order
    (``seed``), ascending: the first ``k`` rows drawn hold ``searchsorted(result, k)`` distinct
    ids."""
    position = np.empty(sample.num_rows, dtype=np.int64)
    position[np.random.default_rng(seed).permutation(sample.num_rows)] = np.arange(sample.num_rows)
    values, parents = [], []
    for column in columns:
        array = sample.column(column).combine_chunks()
        if pa.types.is_list(array.type) or pa.types.is_large_list(array.type):
            parents.append(pc.list_parent_indices(array).to_numpy(zero_copy_only=False))
            array = array.flatten()
        else:
            parents.append(np.arange(len(array)))
        values.append(array)
    if len({a.type for a in values}) > 1:
        values = [a.cast(pa.string()) for a in values]
    codes = pc.dictionary_encode(pa.concat_arrays(values)).indices.fill_null(-1)
    codes = codes.to_numpy(zero_copy_only=False)
    drawn_at = position[np.concatenate(parents)][codes >= 0]
    codes = codes[codes >= 0]
    order = np.argsort(drawn_at, kind="stable")
    _, firsts = np.unique(codes[order], return_index=True)
    return np.sort(drawn_at[order][firsts])


def table_stats(job: JobConfig, batch: pa.Table) -> dict[str, TableStats]:
    """Each table's :class:`~raydlrm.sharding.planner.learned_cost.TableStats` in one batch of rows:
    the ids of its features per row, and how often each distinct id is looked up (raw ids: the
    hashing into the table's rows merges few of them). A bucket table is not in the raw batch:
    the planner takes it as looked up uniformly (at most its buckets' rows)."""
    from raydlrm.sharding.planner.learned_cost import TableStats, histogram_of_counts

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


def _mean_length(column: pa.ChunkedArray, *, cap: int | None = None) -> float:
    """Mean ids per row of a sparse column: its lists' mean length (a null list is empty; a
    list longer than ``cap`` counts ``cap``), 1 for single ids."""
    if not (pa.types.is_list(column.type) or pa.types.is_large_list(column.type)):
        return 1.0
    if column.length() == 0:
        return 1.0
    lengths = pc.fill_null(pc.list_value_length(column), 0)
    if cap is not None:
        lengths = pc.min_element_wise(lengths, cap)
    return float(pc.mean(lengths).as_py())
