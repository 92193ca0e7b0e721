"""A greedy table-wise planner.

Each table gets a cost (estimated bytes touched per sample: the lookup reads ``pooling factor x
dim`` floats per feature, the output all-to-all sends ``dim`` floats per feature) and a memory
size (weights plus fused optimizer state). Tables are placed largest cost first on the
least-loaded rank (ties broken by memory, then by rank), which is deterministic and within one
table's cost of the best balance. Pinned tables are placed first, on the least-loaded of their
allowed ranks.
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
        rank = min(allowed, key=lambda r: (load[r], memory[r], r))
        p.shards = [Shard(rank, 0, t.num_embeddings, 0, t.embedding_dim)]
        load[rank] += p.cost
        memory[rank] += p.memory_bytes
    plan = ShardingPlan(world_size=world_size, tables=[plans[t.name] for t in tables])
    plan.validate(tables)
    return plan
