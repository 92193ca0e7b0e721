"""The planner's storage reservations: the memory and local disk a table takes where it is
placed (weights, optimizer state, row caches), the page cache the ``ssd`` tier is assumed to
get, the order in which ``auto`` tables go to SSD, and the warnings of caches planned too large
or maybe too small.

Tables placed ``auto`` start in DRAM and go to the SSD tier one by one, in :func:`spill_order`,
while the plan does not fit the memory budget
(:func:`~raydlrm.sharding.planner.planners.plan_sharding`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from raydlrm.models.embedding import EmbeddingBagConfig
from raydlrm.sharding.config import ShardingConfig
from raydlrm.sharding.plan import MemoryBudget, ShardingPlan
from raydlrm.sharding.planner.cost import estimate_table_cost, expected_distinct_rows
from raydlrm.sharding.planner.request import PlanRequest
from raydlrm.sharding.sizes import (
    cache_rows,
    table_disk_bytes,
    table_host_bytes,
    table_memory_bytes,
)

__all__ = [
    "disk_bytes",
    "host_bytes",
    "memory_bytes",
    "page_cache_hit",
    "spill_order",
    "table_cache_rows",
    "warn_cache_sizes",
]

logger = logging.getLogger(__name__)


def table_cache_rows(
    table: EmbeddingBagConfig,
    config: ShardingConfig,
    *,
    step_rows: int = 0,
    placement: str | None = None,
) -> int:
    """Rows of ``table``'s row cache placed ``placement`` (default: as configured), counted on
    the whole table (:meth:`~raydlrm.sharding.config.ShardingConfig.cache_sizing`: the
    ``sharding.cache_load_factor`` family, by the cache's kind; a table in DRAM: the cache it
    would have on the ``ssd`` tier), at least ``step_rows``, the most rows a step can look up.

    Raises:
        ValueError: a load factor of 0 for a table that needs a cache (quantized, ``host``).
    """
    kind = config.cache_kind(table.name, placement) or "ssd"
    sizing = config.cache_sizing(table.name, kind)
    return cache_rows(
        table.num_embeddings,
        load_factor=sizing.load_factor,
        min_rows=sizing.min_rows,
        step_rows=step_rows,
    )


def memory_bytes(
    t: EmbeddingBagConfig, config: ShardingConfig, placement: str, step_rows: int = 0
) -> int:
    """Worker memory of ``t`` placed ``placement`` (with its row cache on ``ssd``)."""
    return table_memory_bytes(
        t,
        optimizer=config.optimizer,
        weights_precision=config.weights_precision_of(t.name),
        placement=placement,
        cache_rows=table_cache_rows(t, config, step_rows=step_rows, placement=placement),
    )


def host_bytes(t: EmbeddingBagConfig, config: ShardingConfig) -> int:
    """Host memory of ``t`` as ``config`` places it (0 unless ``host``)."""
    if config.placement_of(t.name) != "host":
        return 0
    return table_host_bytes(
        t, optimizer=config.optimizer, weights_precision=config.weights_precision_of(t.name)
    )


def disk_bytes(t: EmbeddingBagConfig, config: ShardingConfig) -> int:
    """Local disk of ``t`` as ``config`` places it (0 in DRAM)."""
    if config.placement_of(t.name) != "ssd":
        return 0
    return table_disk_bytes(
        t, optimizer=config.optimizer, weights_precision=config.weights_precision_of(t.name)
    )


def page_cache_hit(
    tables: Sequence[EmbeddingBagConfig],
    *,
    config: ShardingConfig,
    world_size: int,
    memory_budget: MemoryBudget | None,
) -> float:
    """The fraction of the ``ssd`` tables' touched rows the cost model assumes the page cache
    holds: the budget the ranks leave unused by the tables in DRAM (and the state of the ``ssd``
    ones), over the ``ssd`` tables' bytes on disk, at most 1; with ids drawn uniformly that is
    the chance a row is cached (skewed ids hit more). 0 without a budget (nothing is known of
    the memory), 1 without ``ssd`` tables."""
    on_disk, in_memory = 0, 0
    for t in tables:
        kind = config.pinned_types.get(t.name, config.default_type)
        copies = world_size if kind == "data_parallel" else 1
        on_disk += copies * disk_bytes(t, config)
        in_memory += copies * memory_bytes(t, config, config.placement_of(t.name))
    if not on_disk:
        return 1.0
    if memory_budget is None:
        return 0.0
    spare = world_size * memory_budget.bytes_per_rank - in_memory
    return min(max(spare / on_disk, 0.0), 1.0)


def spill_order(
    tables: Sequence[EmbeddingBagConfig], *, request: PlanRequest
) -> list[EmbeddingBagConfig]:
    """The order in which ``tables`` (placed ``auto``) go to the spill tier
    (``sharding.spill_placement``: ``ssd`` or ``host``): those whose steps cost the least tier
    time (disk time, or copies between host and GPU) per byte of memory freed first."""
    config = request.config
    tier = config.spill_tier()
    keyed = []
    for t in tables:
        step_rows = request.step_rows(t.name)
        freed = memory_bytes(t, config, "dram", step_rows) - memory_bytes(
            t, config, tier, step_rows
        )
        if freed <= 0:  # smaller than its row cache: it would take more memory there
            continue
        seconds = estimate_table_cost(
            t,
            sharding_type="table_wise",
            num_shards=1,
            world_size=request.world_size,
            batch_size=request.rows(t.name),
            pooling_factor=request.pooling_factors.get(t.name, 1.0),
            optimizer=config.optimizer,
            weights_precision=config.weights_precision_of(t.name),
            constants=request.constants,
            placement=tier,
            cache_rows=table_cache_rows(t, config, step_rows=step_rows, placement=tier),
        ).disk_seconds
        keyed.append(((seconds / freed, t.name), t))
    return [t for _, t in sorted(keyed, key=lambda pair: pair[0])]


def warn_cache_sizes(plan: ShardingPlan, request: PlanRequest) -> None:
    """Warns of the caches of ``plan`` that hold whole tables or may be short of a step's
    rows."""
    _warn_whole_table_caches(plan, request.config)
    _warn_small_quantized_caches(plan, request)


def _warn_small_quantized_caches(plan: ShardingPlan, request: PlanRequest) -> None:
    """Warns, in one line, of the quantized (and ``host``) tables planned without the most rows
    a step can look up (:attr:`~.plan.TablePlan.step_rows`, from the data) whose cache is smaller
    than the distinct rows a step would look up in a shard were its ids uniform (the most it
    can touch; skewed ids touch fewer): a step that does need more slots stops with an error
    naming the table."""
    config = request.config
    configs = {t.name: t for t in request.tables}
    short = []  # (shortfall, table, distinct rows, shard rows, slots)
    for table in plan.tables:
        kind = config.cache_kind(table.name, table.placement)
        if kind not in ("quantized", "host") or table.step_rows:
            continue  # a cache of the most rows a step looks up holds every step
        t, sizing = configs[table.name], config.cache_sizing(table.name, kind)
        ids = request.rows(t.name) * request.pooling_factors.get(t.name, 1.0)
        ids *= len(t.feature_names)
        for s in table.shards:
            rows = s.row_end - s.row_start
            touched = expected_distinct_rows(rows, ids * rows / t.num_embeddings)
            slots = cache_rows(rows, load_factor=sizing.load_factor, min_rows=sizing.min_rows)
            if touched > slots:
                short.append((touched / slots, t.name, touched, rows, slots, sizing.keys))
                break
    if short:
        _, name, touched, rows, slots, keys = max(short)
        logger.warning(
            "quantized or host tables %s: a step may look up more distinct rows of a shard "
            "than their cache holds if the ids are uniform (table %s: about %d of a %d-row shard, "
            "%d slots); a step that needs more stops with an error: raise %s unless the ids are "
            "skewed",
            sorted(n for _, n, *_ in short),
            name,
            touched,
            rows,
            slots,
            keys,
        )


def _warn_whole_table_caches(plan: ShardingPlan, config: ShardingConfig) -> None:
    """Warns of fp32 / fp16 ``ssd`` tables whose DRAM row cache holds every row of a shard:
    such a table takes more memory than in DRAM (the cache plus the mapped file), for
    nothing."""
    for table in plan.tables:
        if config.cache_kind(table.name, table.placement) != "ssd":
            continue
        rows = min(s.row_end - s.row_start for s in table.shards)
        sizing = config.cache_sizing(table.name, "ssd")
        cached = cache_rows(rows, load_factor=sizing.load_factor, min_rows=sizing.min_rows)
        if cached >= rows:
            logger.warning(
                "table %s on ssd: its DRAM row cache holds all %d rows of a shard, so it takes "
                "more memory than in DRAM; lower %s, or keep the table in DRAM",
                table.name,
                rows,
                sizing.keys,
            )
