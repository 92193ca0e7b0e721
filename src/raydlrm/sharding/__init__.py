"""Sharding of embedding tables: plans, the planner, and the sharded embedding collection.

Two sides, as in TorchRec: the planner (the subpackage :mod:`raydlrm.sharding.planner`: the
search, its cost models and their calibration) makes a plan (:mod:`raydlrm.sharding.plan`,
read by both sides; :mod:`raydlrm.sharding.sizes`, the storage sizes both count); the sharded
collection (the other modules of this package) runs it, and imports nothing of the planner.

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
    "config": ("ShardingConfig",),
    "embedding": ("ShardedEmbeddingBagCollection",),
    "parallelize": ("shard_model",),
    "plan": (
        "MemoryBudget",
        "Shard",
        "ShardingPlan",
        "TablePlan",
    ),
    "planner.calibration": ("calibrate",),
    "planner.cost": (
        "CostConstants",
        "load_constants",
        "save_constants",
    ),
    "planner.planners": ("plan_sharding",),
    "retrieval": (
        "ItemShard",
        "TopK",
        "retrieval_metrics",
        "target_ranks",
        "top_k",
    ),
    "topology": ("Topology",),
}
__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
