"""Sharding of embedding tables: plans, the planner, and the sharded embedding collection.

Tables are placed on ranks by a :class:`ShardingPlan` (made by :func:`plan_sharding`), looked up
with table-batched embedding kernels and fused optimizers (fbgemm's, or their PyTorch
equivalent: ``sharding.kernel``) by :class:`ShardedEmbeddingBagCollection`, and a whole model is
sharded by :func:`shard_model`. Every sharded collection implements
:class:`~raydlrm.sharding.types.ShardedTables`. The names load lazily (``raydlrm._lazy``).
"""

from __future__ import annotations

from raydlrm._lazy import lazy_exports

# The public names by the submodule that defines them (imported on first use).
_EXPORTS: dict[str, tuple[str, ...]] = {
    "calibration": ("calibrate",),
    "config": ("ShardingConfig",),
    "cost": (
        "CostConstants",
        "load_constants",
        "save_constants",
    ),
    "embedding": ("ShardedEmbeddingBagCollection",),
    "parallelize": ("shard_model",),
    "plan": (
        "MemoryBudget",
        "Shard",
        "ShardingPlan",
        "TablePlan",
    ),
    "planner": ("plan_sharding",),
    "topology": ("Topology",),
}
__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
