"""``model.towers = "auto"``: the tower partitioner run by the driver before Ray starts.

A short warm-up trains the flat model (no towers) in the driver process on the training data's
first batches (the workers' own step: :class:`~raydlrm.trainers.loop.Trainer` on one rank), then
measures the pairwise interaction strength of the features on the next batch
(:func:`~raydlrm.sharding.planner.tower_partition.interaction_strength`) and groups the tables into
``model.num_towers`` towers (one per host by default) that keep the most strength inside, each
within 10% of the mean lookups per step
(:func:`~raydlrm.sharding.planner.tower_partition.partition_towers`). The job continues with the
towers written out, so the run's config, checkpoints and MLflow parameters name them. A run that
resumes, or warm-starts (every ``raydlrm retrain`` slot after the first), takes its checkpoint's
towers and warms up nothing: its model's tower weights belong to those features.

The scale rule holds: the driver never trains the model's tables when they do not fit half of
its available memory. The warm-up then runs on a sample-sized model: each large table gets
:data:`WARMUP_ROWS_PER_ID` rows per distinct id of the warm-up's rows (``tower_warmup_steps + 1``
batches), its ids hashed into them, which holds every id the warm-up sees; the interactions it
measures are those of the sample, as they would be on the full tables.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from raydlrm.platform.config import ConfigError, JobConfig, replaced

__all__ = ["resolve_towers"]

logger = logging.getLogger(__name__)

SLACK = 0.1
"""A tower's lookups may exceed the mean by this fraction."""
DRIVER_MEMORY_SHARE = 0.5
"""The warm-up's tables may take this share of the driver's available memory."""
WARMUP_ROWS_PER_ID = 16
"""Rows per distinct id of its sample that a table too large for the driver gets in the
warm-up (its ids hashed into them: few of the sample's ids share a row)."""


def resolve_towers(
    job: JobConfig, data: Any, shape: Any, *, recorded: dict[str, Any] | None
) -> JobConfig:
    """The job with ``model.towers = "auto"`` replaced by the partitioner's towers (or those of
    ``recorded``, the state of the checkpoint the run resumes or warm-starts from); any other
    job as it is.
    ``data`` and ``shape`` are the job's validated data sets and their shape (``JobData`` and
    ``DataShape`` of :mod:`raydlrm.platform.job_data`; :mod:`raydlrm.platform.planning` calls this).

    Raises:
        ConfigError: the tables do not fit the driver's memory for the warm-up, or the data
            has fewer rows than the warm-up needs (naming the key to change).
    """
    model = job.model
    if model.towers != "auto":
        return job
    if recorded is not None and isinstance(recorded["spec"]["model"].get("towers"), list):
        towers = recorded["spec"]["model"]["towers"]
        logger.info("model.towers = 'auto': the checkpoint's towers %s", towers)
        return replaced(job, model=replaced(model, towers=towers))
    started = time.perf_counter()
    strength, features, batches = _warm_up_strength(job, data)
    tables = job.data.table_columns()
    position = {f: i for i, f in enumerate(features)}
    units = [[position[c] for c in columns] for columns in tables.values()]
    loads = [shape.pooling_factors.get(name, 1.0) * len(cols) for name, cols in tables.items()]
    from raydlrm.sharding.planner.tower_partition import inside_strength, partition_towers

    num_towers = model.num_towers or job.topology().num_hosts
    groups = partition_towers(
        strength, units=units, loads=loads, num_towers=num_towers, slack=SLACK
    )
    tower_loads = [
        sum(load for u, load in zip(units, loads, strict=True) if u[0] in g) for g in groups
    ]
    order = host_order(tower_loads, job.topology().num_hosts)
    groups, tower_loads = [groups[i] for i in order], [tower_loads[i] for i in order]
    towers = [[features[i] for i in g] for g in groups]
    kept = inside_strength(strength, groups)  # a share of the total
    logger.info(
        "model.towers = 'auto': %d towers from %d warm-up steps in %.1fs, %.0f%% of the "
        "features' interaction strength inside towers, lookups per sample %s: %s",
        num_towers,
        batches,
        time.perf_counter() - started,
        100 * kept,
        [round(x, 1) for x in tower_loads],
        towers,
    )
    return replaced(job, model=replaced(model, towers=towers))


def host_order(loads: list[float], hosts: int) -> list[int]:
    """An order of the towers (by index into ``loads``) whose position ``i`` goes to host
    ``i % hosts`` (``model.towers``' placement) that balances the hosts' loads: the heaviest
    tower first, each to the lightest host that has a position left, then swaps of two towers
    between two hosts while a swap lowers the heavier one's load."""
    slots = [len(range(h, len(loads), hosts)) for h in range(hosts)]
    host_load, placed = [0.0] * hosts, [[] for _ in range(hosts)]
    for t in sorted(range(len(loads)), key=lambda t: (-loads[t], t)):
        h = min((h for h in range(hosts) if len(placed[h]) < slots[h]), key=lambda h: host_load[h])
        placed[h].append(t)
        host_load[h] += loads[t]
    swapped = True
    while swapped:
        swapped = False
        for a, b in ((a, b) for a in range(hosts) for b in range(hosts) if a != b):
            for i, x in enumerate(placed[a]):
                for j, y in enumerate(placed[b]):
                    delta = loads[x] - loads[y]
                    if delta > 1e-9 and host_load[b] + delta < host_load[a] - 1e-9:
                        placed[a][i], placed[b][j] = y, x
                        host_load[a] -= delta
                        host_load[b] += delta
                        swapped = True
    return [placed[i % hosts][i // hosts] for i in range(len(loads))]


def _warm_up_strength(job: JobConfig, data: Any) -> tuple[Any, list[str], int]:
    """Trains the flat model ``model.tower_warmup_steps`` steps on one rank in this process and
    returns the features' interaction strength on the next batch, the features in the pooled
    output's order, and the steps trained."""
    import psutil
    import torch

    from raydlrm.ingestion import Preprocessor
    from raydlrm.ingestion.clustered import read_rows
    from raydlrm.ingestion.loader import arrow_to_batch
    from raydlrm.sharding import plan_sharding
    from raydlrm.sharding.parallelize import unwrap_dense
    from raydlrm.sharding.planner.tower_partition import interaction_strength
    from raydlrm.trainers.loop import Trainer

    spec = job.worker_spec()
    spec = replaced(spec, model=replaced(spec.model, towers=None, tower_dim=0))
    steps, size = job.model.tower_warmup_steps, job.data.batch_size
    raw = read_rows(
        data.train.path, job.data, columns=job.data.input_columns(), max_rows=(steps + 1) * size
    )
    if raw.num_rows < 2 * size:
        raise ConfigError(
            f"model.towers = 'auto': the training data has {raw.num_rows} rows, fewer than two "
            f"batches of data.batch_size = {size} for the warm-up and the measurement"
        )
    spec = _fitted_to_driver(spec, raw, psutil.virtual_memory().available * DRIVER_MEMORY_SHARE)
    tables = spec.tables()
    table = Preprocessor(spec.data)(raw)
    batches = [
        arrow_to_batch(table.slice(i, size), config=spec.data)
        for i in range(0, table.num_rows - size + 1, size)
    ]
    torch.manual_seed(spec.training.seed)
    plan = plan_sharding(tables, world_size=1, config=spec.sharding)
    threads = torch.get_num_threads()
    trainer = Trainer(
        spec, plan=plan, rank=0, device=torch.device("cpu"), hooks=[], report=_no_report
    )
    torch.set_num_threads(threads)  # the trainer sets the workers' count
    for batch in batches[:-1]:
        trainer.train_step(batch)
    held = batches[-1]
    trainer.model.eval()
    with torch.no_grad():
        pooled = trainer.model.embedding_bags(held.sparse, held.dedup_groups)
    dense = unwrap_dense(trainer.model)
    strength = interaction_strength(
        dense, held.dense, pooled.values, list(pooled.dims), seed=spec.training.seed
    )
    return strength, list(pooled.keys), len(batches) - 1


def _fitted_to_driver(spec: Any, raw: Any, budget: float) -> Any:
    """``spec`` (a worker spec) for a warm-up whose tables fit ``budget`` bytes of the driver:
    as it is when the model's tables do; else each table over :data:`WARMUP_ROWS_PER_ID` rows
    per distinct id of the warm-up's rows (``raw``) gets that many, its ids hashed into them
    (the scale rule: the driver never holds the model's tables). The interactions are then
    measured on those tables, which hold every id of the sample.

    Raises:
        ConfigError: even those do not fit, naming the sizes and ``model.towers``.
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    from raydlrm.ingestion.column_specs import SparseSpec

    tables = spec.tables()
    full = sum(t.num_embeddings * t.embedding_dim * 4 for t in tables)
    if full <= budget:
        return spec
    data, sizes, specs = spec.data, {}, dict(spec.data.sparse_specs)
    for t in tables:
        columns = [c for c in t.feature_names if c in raw.column_names]
        if not columns:
            continue  # a bucket table: its buckets, few rows
        ids = [raw.column(c).combine_chunks() for c in columns]
        ids = [a.flatten() if pa.types.is_list(a.type) else a for a in ids]
        if len({a.type for a in ids}) > 1:
            ids = [a.cast(pa.string()) for a in ids]
        distinct = pc.count_distinct(pa.chunked_array(ids)).as_py()
        rows = min(t.num_embeddings, max(1, WARMUP_ROWS_PER_ID * distinct))
        if rows < t.num_embeddings:
            sizes[t.name] = rows
            specs.update((c, replaced(specs.get(c) or SparseSpec(), hash=True)) for c in columns)
    fitted = sum(sizes.get(t.name, t.num_embeddings) * t.embedding_dim * 4 for t in tables)
    if fitted > budget:
        raise ConfigError(
            f"model.towers = 'auto': the warm-up's tables take {fitted / 2**30:.2f} GiB even at "
            f"{WARMUP_ROWS_PER_ID} rows per id of its sample (the model's: "
            f"{full / 2**30:.2f} GiB), over half the driver's available memory "
            f"({budget / 2**30:.2f} GiB): lower model.tower_warmup_steps or "
            "data.batch_size, or list the towers in model.towers"
        )
    logger.info(
        "model.towers = 'auto': the model's tables (%.2f GiB) do not fit the driver's share of "
        "memory (%.2f GiB); the warm-up trains them at %d rows per id of its %d rows (%.2f "
        "GiB, ids hashed into them: %s) and measures the interactions there",
        full / 2**30,
        budget / 2**30,
        WARMUP_ROWS_PER_ID,
        raw.num_rows,
        fitted / 2**30,
        sizes,
    )
    kept = {k: v for k, v in data.table_sizes.items() if k not in _table_keys(data, sizes)}
    data = replaced(data, table_sizes={**kept, **sizes}, sparse_specs=specs)
    return replaced(spec, data=data)


def _table_keys(data: Any, tables: dict[str, int]) -> set[str]:
    """The ``data.table_sizes`` keys that size ``tables``: their names and their columns."""
    columns = data.table_columns()
    return {k for name in tables for k in (name, *columns[name])}


def _no_report(metrics: dict[str, Any], *, checkpoint_dir: str | None = None) -> None:
    """The warm-up reports nowhere."""
