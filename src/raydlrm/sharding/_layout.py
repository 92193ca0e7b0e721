"""Static layout of a sharded collection: which rank looks up which feature in which shard.

The unit of routing is a :class:`LookupUnit`: one feature looked up in one shard of its table.
A table-wise table gives one unit per feature, a column-wise table one per feature and column
shard, a row-wise table one per feature and row shard, a data-parallel table one per feature and
rank. Every rank derives the same layout from the plan, so senders and receivers agree on the
order of what they exchange without talking.

Every feature has a *batch class*: 0 for the plain features, looked up for each of the batch's
``B`` samples, and ``g + 1`` for the features of dedup group ``g`` (RecD), looked up for each of
the group's ``U_g`` unique rows (:func:`batch_classes`). A table belongs to one class.

A table looked up per position (``pooling = "none"``: sequence features) is a class of its own
whose rows are its ids (:func:`position_classes`): every id of its features becomes a bag of
one id of a single *position feature* (:func:`position_feature`), so a rank's rows of the class
are the ids its samples look up in the table, one feature's after another. Its lookups pool
bags of one id (the rows themselves), travel through the same all-to-alls as the pooled
classes (row shards send zeros for the ids they do not own, which the receiver adds), and come
out as the class's own columns, a row per id, never padded.

On each rank, units are ordered by (batch class, replicated, kernel pooling mode, weights
precision, placement, row cache, table, feature): within a class the sharded units come first
(their pooled output goes through the output all-to-all) and the data-parallel ones last (their
output stays local), and units looked up by the same fbgemm TBE (one batch class, pooling mode,
weights precision, placement and row cache or none, so one batch size) are contiguous.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import groupby
from typing import Literal

from raydlrm.models.embedding import EmbeddingBagConfig
from raydlrm.sharding.config import ShardingConfig
from raydlrm.sharding.plan import Shard, ShardingPlan

__all__ = [
    "LookupUnit",
    "PositionClasses",
    "TbeGroup",
    "batch_classes",
    "position_classes",
    "position_feature",
    "rank_units",
    "tbe_groups",
]

ROW_SPLIT_TYPES = ("row_wise", "table_row_wise")


@dataclass(frozen=True)
class LookupUnit:
    """One feature looked up in one shard of its table.

    Attributes:
        feature: feature name.
        feature_index: position of the feature in the collection's ``feature_names``.
        table: the feature's table.
        table_index: position of the table in the collection.
        shard: the shard looked up (its rank is where the lookup runs).
        sharding_type: the table's sharding type.
        precision: the table's weights precision (``fp32`` or ``fp16``).
        placement: where the table's weights live (``dram``, ``ssd`` or ``host``).
        batch_class: 0 for a plain feature, ``g + 1`` for a feature of dedup group ``g``.
        row_cache: the table trains through a row cache (quantized, ``host``, and ``ssd``
            unless its ``sharding.cache_load_factor`` is 0).
    """

    feature: str
    feature_index: int
    table: EmbeddingBagConfig
    table_index: int
    shard: Shard
    sharding_type: str
    precision: str = "fp32"
    placement: str = "dram"
    batch_class: int = 0
    row_cache: bool = False

    @property
    def replicated(self) -> bool:
        """Data-parallel: the rank looks up its own samples and keeps the result."""
        return self.sharding_type == "data_parallel"

    @property
    def row_split(self) -> bool:
        """The unit pools a partial sum over its rows; partial sums are added on the receiver."""
        return self.sharding_type in ROW_SPLIT_TYPES

    @property
    def kernel_pooling(self) -> Literal["sum", "mean"]:
        """Pooling mode of the TBE kernel. A row-split mean table pools sums: the mean is taken
        on the receiver, with the bag's true length, after adding the partial sums."""
        return "sum" if self.row_split else self.table.pooling

    @property
    def dim(self) -> int:
        return self.shard.col_end - self.shard.col_start


@dataclass(frozen=True)
class TbeGroup:
    """Contiguous units of one rank looked up by one TBE.

    Attributes:
        pooling: the TBE's pooling mode.
        shards: ``(table, shard)`` of each TBE table, in TBE order.
        feature_table_map: TBE table of each unit.
        precision: the weights precision of the TBE's tables.
        placement: where the TBE's weights live (``dram``, ``ssd`` or ``host``).
        batch_class: the batch class of its units (one batch size per TBE).
        row_cache: the TBE's tables train through a row cache (the TBE's rows are its slots).
        num_units: units (TBE features) of the group.
    """

    pooling: Literal["sum", "mean"]
    shards: list[tuple[EmbeddingBagConfig, Shard]]
    feature_table_map: list[int]
    precision: str = "fp32"
    placement: str = "dram"
    batch_class: int = 0
    row_cache: bool = False

    @property
    def num_units(self) -> int:
        return len(self.feature_table_map)


def batch_classes(
    tables: Sequence[EmbeddingBagConfig], dedup_groups: Sequence[Sequence[str]]
) -> dict[str, int]:
    """Feature name -> batch class (0 plain, ``g + 1`` in dedup group ``g``), every feature of
    ``tables``.

    Raises:
        ValueError: naming a table whose features are not all in one class, or group features
            no table looks up.
    """
    group_of = {f: g + 1 for g, features in enumerate(dedup_groups) for f in features}
    unknown = sorted(set(group_of) - {f for t in tables for f in t.feature_names})
    if unknown:
        raise ValueError(f"dedup groups name features {unknown} that no table looks up")
    classes = {}
    for table in tables:
        ids = {group_of.get(f, 0) for f in table.feature_names}
        if len(ids) > 1:
            raise ValueError(
                f"table {table.name!r} is looked up by features {list(table.feature_names)} that "
                "are not all in the same dedup group"
            )
        classes.update((f, group_of.get(f, 0)) for f in table.feature_names)
    return classes


def position_feature(table: str) -> str:
    """The single feature through which the ids of per-position table ``table`` are looked
    up (a name no data column can have)."""
    return f"{table}/positions"


@dataclass(frozen=True)
class PositionClasses:
    """The tables as the sharded collection looks them up, and each feature's batch class.

    Attributes:
        tables: the tables, each per-position table with one feature, its
            :func:`position_feature`, pooled as sums of one id.
        class_of: every looked-up feature's batch class.
        num_classes: the plain class, the dedup groups', then one per per-position table.
        tables_of_class: batch class -> the per-position table (its real features) it looks up.
    """

    tables: list[EmbeddingBagConfig]
    class_of: dict[str, int]
    num_classes: int
    tables_of_class: dict[int, EmbeddingBagConfig]


def position_classes(
    tables: Sequence[EmbeddingBagConfig], dedup_groups: Sequence[Sequence[str]]
) -> PositionClasses:
    """The batch classes of ``tables`` (:func:`batch_classes`), each per-position table a class
    of its own after the dedup groups'. A dedup group's per-position features are looked up
    in their table's class on the group's unique rows (the class's rows are ids, wherever
    they come from) and expanded to the batch after the exchange.

    Raises:
        ValueError: as :func:`batch_classes`.
    """
    per_position = {f for t in tables if not t.pooled for f in t.feature_names}
    lookup = [
        t if t.pooled else replace(t, feature_names=(position_feature(t.name),), pooling="sum")
        for t in tables
    ]
    class_of = batch_classes(
        [t for t in tables if t.pooled],
        [[f for f in group if f not in per_position] for group in dedup_groups],
    )
    first = len(dedup_groups) + 1
    tables_of_class = {first + i: t for i, t in enumerate(t for t in tables if not t.pooled)}
    for c, table in tables_of_class.items():
        class_of[position_feature(table.name)] = c
    return PositionClasses(
        tables=lookup,
        class_of=class_of,
        num_classes=first + len(tables_of_class),
        tables_of_class=tables_of_class,
    )


def rank_units(
    tables: list[EmbeddingBagConfig],
    plan: ShardingPlan,
    config: ShardingConfig | None = None,
    class_of: dict[str, int] | None = None,
) -> list[list[LookupUnit]]:
    """The units of every rank, in that rank's lookup order (see the module docstring);
    ``config`` gives each table's weights precision and whether it trains through a row cache
    (default: fp32, none), ``class_of`` each feature's batch class (default: all plain)."""
    config = config or ShardingConfig()
    class_of = class_of or {}
    units: list[list[LookupUnit]] = [[] for _ in range(plan.world_size)]
    feature_index = 0
    for table_index, table in enumerate(tables):
        table_plan = plan.table(table.name)
        for feature in table.feature_names:
            for shard in table_plan.shards:
                units[shard.rank].append(
                    LookupUnit(
                        feature=feature,
                        feature_index=feature_index,
                        table=table,
                        table_index=table_index,
                        shard=shard,
                        sharding_type=table_plan.sharding_type,
                        precision=config.weights_precision_of(table.name),
                        placement=table_plan.placement,
                        batch_class=class_of.get(feature, 0),
                        row_cache=config.row_cache(table.name, table_plan.placement),
                    )
                )
            feature_index += 1
    return [
        sorted(
            us,
            key=lambda u: (
                u.batch_class,
                u.replicated,
                u.kernel_pooling != "sum",
                u.precision,
                u.placement,
                u.row_cache,
                u.table_index,
                u.feature_index,
            ),
        )
        for us in units
    ]


def tbe_groups(units: list[LookupUnit]) -> list[TbeGroup]:
    """Splits one rank's units into TBEs: one per (batch class, replicated, kernel pooling,
    precision, placement, row cache) run."""
    groups = []
    runs = groupby(
        units,
        key=lambda u: (
            u.batch_class,
            u.replicated,
            u.kernel_pooling,
            u.precision,
            u.placement,
            u.row_cache,
        ),
    )
    for (batch_class, _, pooling, precision, placement, row_cache), run in runs:
        run = list(run)
        names = list(dict.fromkeys(u.table.name for u in run))
        shards = {u.table.name: (u.table, u.shard) for u in run}
        groups.append(
            TbeGroup(
                pooling=pooling,
                shards=[shards[n] for n in names],
                feature_table_map=[names.index(u.table.name) for u in run],
                precision=precision,
                placement=placement,
                batch_class=batch_class,
                row_cache=row_cache,
            )
        )
    return groups
