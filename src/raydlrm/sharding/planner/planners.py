"""The planner's entry point: :func:`plan_sharding` places every table on ranks, balancing the
per-rank cost within the memory budget.

It checks the request (:mod:`.request`), decides the tier of the ``auto`` tables (DRAM, or SSD
one table at a time while the plan does not fit the budget: :mod:`.storage`), places the tables
greedily (:mod:`.placement`), then refines and splits the placement (:mod:`.refine`), or lets
a learned cost model's search place them (:mod:`.learned_placement`); the plan is validated and
records the most rows a step looks each table up for. The search is deterministic for the same
inputs (tables are ordered by cost, then name).

A table of a dedup group (RecD) is costed on the unique rows of a step,
``batch_size / dedup_ratios[table]``: deduplicated and plain features share the same
collectives, so one balance over all tables is what every step waits for.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

from raydlrm.models.embedding import EmbeddingBagConfig
from raydlrm.sharding.config import ShardingConfig
from raydlrm.sharding.plan import MemoryBudget, ShardingPlan
from raydlrm.sharding.planner.cost import CostConstants, estimate_table_cost
from raydlrm.sharding.planner.learned_placement import LearnedPlacement
from raydlrm.sharding.planner.placement import Placement
from raydlrm.sharding.planner.refine import refine, split
from raydlrm.sharding.planner.request import (
    DEFAULT_BATCH_SIZE,
    BudgetError,
    PlanRequest,
    check_arguments,
)
from raydlrm.sharding.planner.storage import page_cache_hit, spill_order, warn_cache_sizes

if TYPE_CHECKING:
    from raydlrm.sharding.planner.learned_cost import LearnedCostModel, TableStats

__all__ = ["plan_sharding", "table_cost"]


def plan_sharding(
    tables: Sequence[EmbeddingBagConfig],
    *,
    world_size: int,
    config: ShardingConfig,
    pooling_factors: dict[str, float] | None = None,
    batch_size: int = DEFAULT_BATCH_SIZE,
    constants: CostConstants | None = None,
    search: Literal["greedy", "refine"] = "refine",
    memory_budget: MemoryBudget | None = None,
    dedup_ratios: dict[str, float] | None = None,
    learned: LearnedCostModel | None = None,
    table_stats: dict[str, TableStats] | None = None,
    max_bag_sizes: dict[str, int] | None = None,
) -> ShardingPlan:
    """Places every table on ranks, balancing the per-rank cost within the memory budget.

    Args:
        tables: the model's tables.
        world_size: number of ranks.
        config: sharding types, pinned ranks, capacity, precisions and the optimizer.
        pooling_factors: table name -> average ids per bag (default 1.0 for every table).
        batch_size: global samples per step the costs assume.
        constants: cost-model constants (defaults if None).
        search: ``greedy`` placement only, or ``refine`` it (moves, swaps, splits).
        memory_budget: bytes a rank may hold; default: ``config.device_memory_bytes``, if set.
        dedup_ratios: table name -> samples per unique row of its dedup group in a batch
            (RecD; default 1.0): its lookups and bytes are counted on ``batch_size / ratio``.
        learned: a learned cost model: the tables it can place (:mod:`.learned_placement`)
            are placed by NeuroShard's search (:mod:`.neural_search`), not steps 1-3.
        table_stats: table name -> its :class:`~.learned_cost.TableStats` for ``learned``
            (default: its ids looked up uniformly, ``pooling_factors`` a bag).
        max_bag_sizes: table name -> the most ids a sample looks up in it (``step_rows``).

    Returns:
        A validated plan for ``tables`` on ``world_size`` ranks, recording the budget.

    Raises:
        ValueError: a non-positive world size; or naming a per-table setting of an unknown
            table, a ratio below 1, a pinned rank ``>= world_size``, a ``group_size`` not
            dividing it, or a table that does not fit the budget (rank, shortfall, source).
    """
    if memory_budget is None and config.device_memory_bytes is not None:
        memory_budget = MemoryBudget(config.device_memory_bytes, "sharding.device_memory_bytes")
    request = PlanRequest(
        tables=tables,
        world_size=world_size,
        config=config,
        pooling_factors=pooling_factors or {},
        batch_size=batch_size,
        constants=constants or CostConstants(),
        search=search,
        memory_budget=memory_budget,
        dedup_ratios=dedup_ratios or {},
        learned=learned,
        table_stats=table_stats or {},
        max_bag_sizes=max_bag_sizes or {},
    )
    check_arguments(request)
    return _placed(_plan_spilling(request), request)


def _placed(plan: ShardingPlan, request: PlanRequest) -> ShardingPlan:
    """``plan`` with the most rows a step looks each table up for, once warned of the caches
    that hold whole tables or may be short of a step's rows."""
    for table in plan.tables:
        table.step_rows = request.step_rows(table.name)
    warn_cache_sizes(plan, request)
    return plan


def _plan_spilling(request: PlanRequest) -> ShardingPlan:
    """The plan of ``request`` with its ``auto`` tables in DRAM or, while that does not fit the
    budget, with one more of them on the spill tier (``ssd`` or ``host``) at a time, in
    :func:`~.storage.spill_order`."""
    config = request.config
    placement = {t.name: config.placement_of(t.name) for t in request.tables}
    auto = [t for t in request.tables if placement[t.name] == "auto"]
    placement.update(dict.fromkeys((t.name for t in auto), "dram"))
    spill = spill_order(auto, request=request)
    while True:
        placed = dataclasses.replace(config, default_placement="dram", placement=placement)
        try:
            return _plan(request, config=placed)
        except BudgetError:
            if request.memory_budget is None or not spill:
                raise
            placement = {**placement, spill.pop(0).name: config.spill_tier()}


def _plan(request: PlanRequest, *, config: ShardingConfig) -> ShardingPlan:
    """The plan of ``request`` with ``config`` (``request.config`` with every table's placement
    decided), or a :class:`BudgetError`."""
    tables, world_size, budget = request.tables, request.world_size, request.memory_budget
    hit = page_cache_hit(tables, config=config, world_size=world_size, memory_budget=budget)
    placement = Placement(
        request,
        config=config,
        group_size=config.group_size or world_size,
        budget=budget,
        page_cache_hit=hit,
    )
    predicted = None
    if request.learned is not None:
        predicted = LearnedPlacement(placement, request.learned).place()
    else:
        placement.greedy(placement.order)
        if request.search == "refine":
            refine(placement)
            if config.default_type == "auto":
                split(placement)
    plan = ShardingPlan(
        world_size=world_size,
        tables=[placement.plans[t.name] for t in tables],
        memory_budget=budget,
        page_cache_hit=hit if any(p.placement == "ssd" for p in placement.plans.values()) else None,
        cost_model="analytic" if predicted is None else "learned",
        predicted_seconds=predicted,
    )
    plan.validate(tables)
    return plan


def table_cost(
    table: EmbeddingBagConfig,
    *,
    pooling_factor: float = 1.0,
    batch_size: int = DEFAULT_BATCH_SIZE,
    constants: CostConstants | None = None,
) -> float:
    """Estimated seconds per step of ``table`` placed table-wise (see :mod:`.cost`).

    Args:
        table: the table.
        pooling_factor: average ids per bag of each of the table's features.
        batch_size: global samples per step.
        constants: cost-model constants (defaults if None).
    """
    return estimate_table_cost(
        table,
        sharding_type="table_wise",
        num_shards=1,
        world_size=1,
        batch_size=batch_size,
        pooling_factor=pooling_factor,
        constants=constants,
    ).seconds
