"""Turns an unsharded model into its sharded, data-parallel form, in one function.

Models carry no parallelism (the torchtitan convention): ``model.embedding_bags`` is an
:class:`~raydlrm.models.embedding.EmbeddingBagCollection` and ``model.dense`` holds every dense
parameter. :func:`shard_model` swaps the collection for its sharded form and wraps
the dense part in DistributedDataParallel. The TBE weights stay out of DDP: their gradients are
applied by the fused optimizer in the backward pass, and each rank owns different tables.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.nn.parallel import DistributedDataParallel

from raydlrm.models.embedding import EmbeddingBagCollection
from raydlrm.sharding._comm import rank_and_world_size
from raydlrm.sharding.config import ShardingConfig
from raydlrm.sharding.embedding import ShardedEmbeddingBagCollection
from raydlrm.sharding.plan import ShardingPlan

__all__ = ["shard_model", "unwrap_dense"]


def shard_model(
    model: nn.Module,
    *,
    plan: ShardingPlan,
    config: ShardingConfig,
    device: torch.device | str,
    pg: ProcessGroup | None = None,
    dedup_groups: Sequence[Sequence[str]] = (),
) -> nn.Module:
    """Shards ``model.embedding_bags`` by ``plan`` and wraps ``model.dense`` in DDP, in place.

    Args:
        model: a model with an ``embedding_bags`` EmbeddingBagCollection and a ``dense`` module;
            its dense part is moved to ``device``.
        plan: where each table lives.
        config: the fused embedding optimizer.
        device: ``cpu`` or a CUDA device.
        pg: process group (default: torch.distributed's default group).
        dedup_groups: feature names of each dedup group (RecD); when given, each group is
            looked up on its unique rows (see :mod:`raydlrm.sharding.embedding`).

    Returns:
        ``model``, modified.

    Raises:
        TypeError: if the model does not follow the ``embedding_bags``/``dense`` convention.
    """
    ebc = getattr(model, "embedding_bags", None)
    dense = getattr(model, "dense", None)
    if not isinstance(ebc, EmbeddingBagCollection) or not isinstance(dense, nn.Module):
        raise TypeError(
            f"{type(model).__name__} needs an `embedding_bags` EmbeddingBagCollection and a "
            "`dense` nn.Module to be sharded"
        )
    device = torch.device(device)
    model.embedding_bags = ShardedEmbeddingBagCollection(
        ebc, plan=plan, config=config, device=device, pg=pg, dedup_groups=dedup_groups
    )
    dense = dense.to(device)
    _, world_size = rank_and_world_size(pg)
    if world_size > 1 and any(p.requires_grad for p in dense.parameters()):
        dense = DistributedDataParallel(
            dense,
            device_ids=[device.index] if device.type == "cuda" else None,
            process_group=pg,
        )
    model.dense = dense
    return model


def unwrap_dense(model: nn.Module) -> nn.Module:
    """``model.dense`` without the DDP wrapper :func:`shard_model` may have put around it (its
    parameters keep the unsharded model's names)."""
    dense = model.dense
    return dense.module if isinstance(dense, DistributedDataParallel) else dense
