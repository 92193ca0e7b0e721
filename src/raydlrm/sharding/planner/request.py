"""A planning request: the arguments of :func:`~raydlrm.sharding.planner.planners.plan_sharding`,
checked against each other, with their defaults filled in; and the error of a plan that does not
fit the memory budget."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

from raydlrm.models.embedding import EmbeddingBagConfig
from raydlrm.sharding.config import ShardingConfig
from raydlrm.sharding.plan import MemoryBudget
from raydlrm.sharding.planner.cost import CostConstants

if TYPE_CHECKING:
    from raydlrm.sharding.planner.learned_cost import LearnedCostModel, TableStats

__all__ = [
    "DEFAULT_BATCH_SIZE",
    "BudgetError",
    "PlanRequest",
    "check_arguments",
    "check_table_names",
]

DEFAULT_BATCH_SIZE = 512
"""Global samples per step the planner's costs assume unless told."""


class BudgetError(ValueError):
    """The tables do not fit the memory budget (the message names a table, a rank and the
    shortfall)."""


@dataclasses.dataclass(frozen=True)
class PlanRequest:
    """The arguments of a :func:`~raydlrm.sharding.planner.planners.plan_sharding` call,
    checked, with their defaults filled in."""

    tables: Sequence[EmbeddingBagConfig]
    world_size: int
    config: ShardingConfig
    pooling_factors: dict[str, float]
    batch_size: int
    constants: CostConstants
    search: Literal["greedy", "refine"]
    memory_budget: MemoryBudget | None
    dedup_ratios: dict[str, float]
    learned: LearnedCostModel | None = None
    table_stats: dict[str, TableStats] = dataclasses.field(default_factory=dict)
    max_bag_sizes: dict[str, int] = dataclasses.field(default_factory=dict)

    def rows(self, table: str) -> float:
        """Rows a step looks ``table`` up for: samples, or unique rows of a dedup group."""
        return self.batch_size / self.dedup_ratios.get(table, 1.0)

    def step_rows(self, table: str) -> int:
        """The most rows of ``table`` a step can look up (0: unknown)."""
        return self.batch_size * self.max_bag_sizes.get(table, 0)


def check_table_names(
    tables: Sequence[EmbeddingBagConfig],
    *,
    config: ShardingConfig,
    pooling_factors: dict[str, float] | None = None,
    dedup_ratios: dict[str, float] | None = None,
) -> None:
    """Checks that the per-table settings of ``config`` (and ``pooling_factors``,
    ``dedup_ratios``) name tables.

    Raises:
        ValueError: naming the dotted key and its unknown tables.
    """
    names = {t.name for t in tables}
    for what, keys in (
        ("sharding.pinned_ranks", config.pinned_ranks),
        ("sharding.pinned_types", config.pinned_types),
        ("sharding.weights_precision_per_table", config.weights_precision_per_table),
        ("sharding.cache_load_factor_per_table", config.cache_load_factor_per_table),
        ("sharding.placement", config.placement),
        ("pooling_factors", pooling_factors or {}),
        ("dedup_ratios", dedup_ratios or {}),
    ):
        unknown = sorted(set(keys) - names)
        if unknown:
            raise ValueError(f"{what} names unknown tables {unknown} (tables: {sorted(names)})")


def check_arguments(request: PlanRequest) -> None:
    """The checks of :func:`~raydlrm.sharding.planner.planners.plan_sharding`'s arguments
    against each other (see its ``Raises``)."""
    tables, world_size, config = request.tables, request.world_size, request.config
    if world_size <= 0:
        raise ValueError(f"world_size must be positive, got {world_size}")
    check_table_names(
        tables,
        config=config,
        pooling_factors=request.pooling_factors,
        dedup_ratios=request.dedup_ratios,
    )
    low = {k: v for k, v in request.dedup_ratios.items() if not v >= 1}
    if low:
        raise ValueError(f"dedup_ratios below 1 (samples per unique row): {low}")
    for name, ranks in config.pinned_ranks.items():
        bad = [r for r in ranks if r >= world_size]
        if bad:
            raise ValueError(f"sharding.pinned_ranks.{name}: ranks {bad} not in [0, {world_size})")
        if config.pinned_types.get(name, config.default_type) == "data_parallel" and sorted(
            set(ranks)
        ) != list(range(world_size)):
            raise ValueError(
                f"sharding.pinned_ranks.{name}: a data_parallel table is on every rank, "
                f"cannot pin it to {ranks}"
            )
    for t in tables:
        if t.managed is not None and config.pinned_types.get(t.name, config.default_type) == (
            "data_parallel"
        ):
            raise ValueError(
                f"table {t.name!r} is managed (data.managed_ids) and cannot be data_parallel "
                "(each replica would decide rows for its own ids): set sharding.pinned_types."
                f"{t.name} to another type"
            )
    group_size = config.group_size or world_size
    if world_size % group_size:
        raise ValueError(
            f"sharding.group_size {group_size} does not divide the world size {world_size}"
        )
