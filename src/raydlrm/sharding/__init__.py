"""Sharding of embedding tables: plans, the planner, and the sharded embedding collection.

Tables are placed on ranks by a :class:`ShardingPlan` (made by :func:`plan_sharding`), looked up
with table-batched embedding kernels and fused optimizers (fbgemm's, or their PyTorch
equivalent: ``sharding.kernel``) by :class:`ShardedEmbeddingBagCollection`, and a whole model is
sharded by :func:`shard_model`. Every sharded collection implements
:class:`~raydlrm.sharding.types.ShardedTables`.
"""

from raydlrm.sharding.calibration import calibrate
from raydlrm.sharding.config import ShardingConfig
from raydlrm.sharding.cost import CostConstants, load_constants, save_constants
from raydlrm.sharding.embedding import ShardedEmbeddingBagCollection
from raydlrm.sharding.parallelize import shard_model
from raydlrm.sharding.plan import MemoryBudget, Shard, ShardingPlan, TablePlan
from raydlrm.sharding.planner import plan_sharding

__all__ = [
    "CostConstants",
    "MemoryBudget",
    "Shard",
    "ShardedEmbeddingBagCollection",
    "ShardingConfig",
    "ShardingPlan",
    "TablePlan",
    "calibrate",
    "load_constants",
    "plan_sharding",
    "save_constants",
    "shard_model",
]
