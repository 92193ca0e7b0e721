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
whose rows are its ids (:func:`position_classes`): every distinct id of its features in a
rank's batch becomes a bag of one id of a single *position feature* (:func:`position_feature`),
so a rank's rows of the class are the distinct ids its samples look up in the table, in
ascending order. Its lookups pool bags of one id (the rows themselves), travel through the same
all-to-alls as the pooled classes, and come out as the class's own columns, a row per distinct
id, never padded. A row-split table (row-wise or table-row-wise, not managed) is a class per
row shard instead, each with a position feature that only its shard looks up: a rank sends
each shard only the ids it owns and receives only their rows (as a table-wise shard would),
and the shards' rows, in row order, are again its distinct ids' rows in ascending order. (One
class for all shards would send each shard every id, and have every shard send back a row,
zero for the ids it does not own: ``k`` times the rows.)

On each rank, units are ordered by (batch class, replicated, kernel pooling mode, weights
precision, placement, row cache, table, feature): within a class the sharded units come first
(their pooled output goes through the output all-to-all) and the data-parallel ones last (their
output stays local), and units looked up by the same fbgemm TBE (one batch class, pooling mode,
weights precision, placement and row cache or none, so one batch size) are contiguous.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
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


def position_feature(table: str, shard: int | None = None) -> str:
    """The feature through which the ids of per-position table ``table`` are looked up (a name
    no data column can have); of a row-split one, one per row shard (``shard``: its index in
    row order)."""
    return f"{table}/positions" if shard is None else f"{table}/positions/{shard}"


@dataclass(frozen=True)
class PositionClasses:
    """The tables as the sharded collection looks them up, and each feature's batch class.

    Attributes:
        tables: the tables, each per-position table with its :func:`position_feature` (one
            per row shard of a row-split table), pooled as sums of one id.
        class_of: every looked-up feature's batch class.
        num_classes: the plain class, the dedup groups', then one per per-position table (or
            row shard).
        tables_of_class: batch class -> the per-position table (its real features) it looks up.
        classes_of_table: per-position table name -> its classes, in row order.
        row_starts: per-position table split into a class per row shard -> each class's
            shard's first row.
        shard_of_feature: per-shard position feature -> the first row of the only shard
            that looks it up.
    """

    tables: list[EmbeddingBagConfig]
    class_of: dict[str, int]
    num_classes: int
    tables_of_class: dict[int, EmbeddingBagConfig]
    classes_of_table: dict[str, list[int]] = field(default_factory=dict)
    row_starts: dict[str, list[int]] = field(default_factory=dict)
    shard_of_feature: dict[str, int] = field(default_factory=dict)


def position_classes(
    tables: Sequence[EmbeddingBagConfig],
    dedup_groups: Sequence[Sequence[str]],
    plan: ShardingPlan | None = None,
) -> PositionClasses:
    """The batch classes of ``tables`` (:func:`batch_classes`), each per-position table a class
    of its own after the dedup groups', or, row-split in ``plan`` (and not managed: its raw
    ids are not rows), a class per row shard. A dedup group's per-position features are looked
    up in their table's classes on the group's unique rows (the classes' rows are ids,
    wherever they come from) and expanded to the batch after the exchange.

    Raises:
        ValueError: as :func:`batch_classes`.
    """
    per_position = {f for t in tables if not t.pooled for f in t.feature_names}
    class_of = batch_classes(
        [t for t in tables if t.pooled],
        [[f for f in group if f not in per_position] for group in dedup_groups],
    )
    lookup: list[EmbeddingBagConfig] = []
    tables_of_class: dict[int, EmbeddingBagConfig] = {}
    classes_of_table: dict[str, list[int]] = {}
    row_starts: dict[str, list[int]] = {}
    shard_of_feature: dict[str, int] = {}
    num_classes = len(dedup_groups) + 1
    for table in tables:
        if table.pooled:
            lookup.append(table)
            continue
        starts = _row_shard_starts(table, plan)
        if starts:
            row_starts[table.name] = starts
            names = [position_feature(table.name, i) for i in range(len(starts))]
            shard_of_feature.update(zip(names, starts, strict=True))
        else:
            names = [position_feature(table.name)]
        lookup.append(replace(table, feature_names=tuple(names), pooling="sum"))
        classes_of_table[table.name] = list(range(num_classes, num_classes + len(names)))
        for c, name in zip(classes_of_table[table.name], names, strict=True):
            class_of[name] = c
            tables_of_class[c] = table
        num_classes += len(names)
    return PositionClasses(
        tables=lookup,
        class_of=class_of,
        num_classes=num_classes,
        tables_of_class=tables_of_class,
        classes_of_table=classes_of_table,
        row_starts=row_starts,
        shard_of_feature=shard_of_feature,
    )


def _row_shard_starts(table: EmbeddingBagConfig, plan: ShardingPlan | None) -> list[int]:
    """The first row of each row shard of per-position ``table``, in row order, when it has a
    class per row shard (row-split in ``plan`` into several shards, not managed); else []."""
    if plan is None or table.managed is not None:
        return []
    table_plan = plan.table(table.name)
    if table_plan.sharding_type not in ROW_SPLIT_TYPES or len(table_plan.shards) < 2:
        return []
    return sorted(s.row_start for s in table_plan.shards)


def rank_units(
    tables: list[EmbeddingBagConfig],
    plan: ShardingPlan,
    config: ShardingConfig | None = None,
    class_of: dict[str, int] | None = None,
    shard_of_feature: dict[str, int] | None = None,
) -> list[list[LookupUnit]]:
    """The units of every rank, in that rank's lookup order (see the module docstring);
    ``config`` gives each table's weights precision and whether it trains through a row cache
    (default: fp32, none), ``class_of`` each feature's batch class (default: all plain),
    ``shard_of_feature`` the features that only one shard looks up (its first row; default:
    none, every shard looks up every feature of its table)."""
    config = config or ShardingConfig()
    class_of = class_of or {}
    only = shard_of_feature or {}
    units: list[list[LookupUnit]] = [[] for _ in range(plan.world_size)]
    feature_index = 0
    for table_index, table in enumerate(tables):
        table_plan = plan.table(table.name)
        for feature in table.feature_names:
            for shard in table_plan.shards:
                if feature in only and shard.row_start != only[feature]:
                    continue
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
