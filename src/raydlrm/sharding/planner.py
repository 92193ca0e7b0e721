"""A greedy planner for every sharding type.

Each table gets a cost (estimated bytes touched per sample: the lookup reads ``pooling factor x
dim`` floats per feature, the output all-to-all sends ``dim`` floats per feature) and a memory
size (weights plus fused optimizer state). Tables are placed largest cost first on the
least-loaded rank (ties broken by memory, then by rank), which is deterministic and within one
table's cost of the best balance. Pinned tables are placed first, on the least-loaded of their
allowed ranks. A table's sharding type (``config.default_type`` unless pinned) decides its shards:

- ``table_wise``: one shard on the least-loaded allowed rank;
- ``data_parallel``: a full replica on every rank (pinning its ranks is an error);
- ``column_wise``: ``min(allowed ranks, dim / 4)`` column shards, widths multiples of 4 as even as
  possible (so uneven when they cannot be equal), on the least-loaded allowed ranks;
- ``row_wise``: contiguous, near-equal row ranges over the allowed ranks in rank order;
- ``table_row_wise``: row-wise over the least-loaded group of ``group_size`` consecutive ranks
  whose ranks are all allowed.

A table's cost is split evenly over its shards.
"""

from __future__ import annotations

from collections.abc import Sequence

from raydlrm.models.embedding import EmbeddingBagConfig
from raydlrm.sharding.config import ShardingConfig
from raydlrm.sharding.plan import Shard, ShardingPlan, TablePlan

__all__ = ["plan_sharding", "table_cost", "table_memory_bytes"]

_FP32_BYTES = 4


def table_cost(table: EmbeddingBagConfig, *, pooling_factor: float = 1.0) -> float:
    """Estimated bytes moved per sample for ``table``: lookups plus pooled output communication.

    Args:
        table: the table.
        pooling_factor: average ids per bag of each of the table's features.
    """
    per_feature = (pooling_factor + 1.0) * table.embedding_dim * _FP32_BYTES
    return per_feature * len(table.feature_names)


def table_memory_bytes(table: EmbeddingBagConfig, *, optimizer: str) -> int:
    """Bytes of the table's fp32 weights plus its fused optimizer state.

    Args:
        table: the table.
        optimizer: ``rowwise_adagrad`` (one float per row), ``adagrad`` (one per weight) or
            ``sgd`` (no state).
    """
    weights = table.num_embeddings * table.embedding_dim * _FP32_BYTES
    state = {
        "rowwise_adagrad": table.num_embeddings * _FP32_BYTES,
        "adagrad": weights,
        "sgd": 0,
    }[optimizer]
    return weights + state


def plan_sharding(
    tables: Sequence[EmbeddingBagConfig],
    *,
    world_size: int,
    config: ShardingConfig,
    pooling_factors: dict[str, float] | None = None,
) -> ShardingPlan:
    """Places every table on a rank.

    Args:
        tables: the model's tables.
        world_size: number of ranks.
        config: sharding types, pinned ranks and the optimizer (for memory estimates).
        pooling_factors: table name -> average ids per bag (default 1.0 for every table).

    Returns:
        A validated plan for ``tables`` on ``world_size`` ranks.

    Raises:
        ValueError: for a non-positive world size, or naming a pinned or pooling-factor table
            that is not among ``tables``, or a pinned rank ``>= world_size``.
    """
    if world_size <= 0:
        raise ValueError(f"world_size must be positive, got {world_size}")
    pooling_factors = pooling_factors or {}
    names = {t.name for t in tables}
    for what, keys in (
        ("sharding.pinned_ranks", config.pinned_ranks),
        ("sharding.pinned_types", config.pinned_types),
        ("pooling_factors", pooling_factors),
    ):
        unknown = sorted(set(keys) - names)
        if unknown:
            raise ValueError(f"{what} names unknown tables {unknown} (tables: {sorted(names)})")
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
    group_size = config.group_size or world_size
    if world_size % group_size:
        raise ValueError(
            f"sharding.group_size {group_size} does not divide the world size {world_size}"
        )

    plans = {
        t.name: TablePlan(
            name=t.name,
            sharding_type=config.pinned_types.get(t.name, config.default_type),
            num_embeddings=t.num_embeddings,
            embedding_dim=t.embedding_dim,
            shards=[],
            cost=table_cost(t, pooling_factor=pooling_factors.get(t.name, 1.0)),
            memory_bytes=table_memory_bytes(t, optimizer=config.optimizer),
        )
        for t in tables
    }
    load = [0.0] * world_size
    memory = [0] * world_size
    # Pinned tables first (they are constrained), then the rest; largest cost first, name breaks
    # ties so the result does not depend on the input order.
    order = sorted(
        tables,
        key=lambda t: (t.name not in config.pinned_ranks, -plans[t.name].cost, t.name),
    )
    for t in order:
        p = plans[t.name]
        allowed = sorted(set(config.pinned_ranks.get(t.name, range(world_size))))
        by_load = sorted(allowed, key=lambda r: (load[r], memory[r], r))
        p.shards = _shards(p, by_load=by_load, world_size=world_size, group_size=group_size)
        area = t.num_embeddings * t.embedding_dim
        for shard in p.shards:
            load[shard.rank] += p.cost / len(p.shards)
            shard_area = (shard.row_end - shard.row_start) * (shard.col_end - shard.col_start)
            memory[shard.rank] += p.memory_bytes * shard_area // area
    plan = ShardingPlan(world_size=world_size, tables=[plans[t.name] for t in tables])
    plan.validate(tables)
    return plan


def _even_split(total: int, parts: int) -> list[int]:
    """``parts`` sizes summing to ``total``, the first ``total % parts`` one larger."""
    return [total // parts + (i < total % parts) for i in range(parts)]


def _row_shards(p: TablePlan, ranks: list[int]) -> list[Shard]:
    ranks = sorted(ranks)[: p.num_embeddings]
    bounds = [0]
    for size in _even_split(p.num_embeddings, len(ranks)):
        bounds.append(bounds[-1] + size)
    return [
        Shard(r, lo, hi, 0, p.embedding_dim)
        for r, lo, hi in zip(ranks, bounds[:-1], bounds[1:], strict=True)
    ]


def _shards(p: TablePlan, *, by_load: list[int], world_size: int, group_size: int) -> list[Shard]:
    """The shards of ``p`` by its sharding type; ``by_load``: allowed ranks, least loaded first."""
    rows, dim = p.num_embeddings, p.embedding_dim
    if p.sharding_type == "table_wise":
        return [Shard(by_load[0], 0, rows, 0, dim)]
    if p.sharding_type == "data_parallel":
        return [Shard(r, 0, rows, 0, dim) for r in range(world_size)]
    if p.sharding_type == "column_wise":
        widths = [4 * w for w in _even_split(dim // 4, min(len(by_load), dim // 4))]
        starts = [sum(widths[:i]) for i in range(len(widths))]
        return [
            Shard(r, 0, rows, c, c + w) for r, c, w in zip(by_load, starts, widths, strict=False)
        ]
    if p.sharding_type == "row_wise":
        return _row_shards(p, by_load)
    assert p.sharding_type == "table_row_wise", p.sharding_type
    allowed = set(by_load)
    position = {r: i for i, r in enumerate(by_load)}
    groups = [
        list(range(g, g + group_size))
        for g in range(0, world_size, group_size)
        if allowed.issuperset(range(g, g + group_size))
    ]
    if not groups:
        raise ValueError(
            f"table {p.name!r}: table_row_wise needs a whole group of {group_size} ranks among "
            f"its allowed ranks {sorted(allowed)}"
        )
    # The group whose least-loaded rank comes first in the load order (ties: lowest group).
    group = min(groups, key=lambda g: (min(position[r] for r in g), g[0]))
    return _row_shards(p, group)
