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
from raydlrm.models.towers import TowerDense
from raydlrm.sharding._comm import rank_and_world_size
from raydlrm.sharding.config import ShardingConfig
from raydlrm.sharding.embedding import ShardedEmbeddingBagCollection
from raydlrm.sharding.plan import ShardingPlan
from raydlrm.sharding.topology import Topology

__all__ = ["shard_model", "unwrap_dense"]


def shard_model(
    model: nn.Module,
    *,
    plan: ShardingPlan,
    config: ShardingConfig,
    device: torch.device | str,
    topology: Topology | None = None,
    pg: ProcessGroup | None = None,
    dedup_groups: Sequence[Sequence[str]] = (),
) -> nn.Module:
    """Shards ``model.embedding_bags`` by ``plan`` and wraps ``model.dense`` in DDP, in place.

    A model with towers (``model.towers``) on a topology of several hosts gets its towers
    placed on their hosts (:func:`raydlrm.sharding.towers.shard_tower_model`: each tower's
    tables sharded inside its host, its module run there); any other model, and a model with
    towers on one host, gets one collection sharded over every rank (the tower modules then
    run in its dense part). The caller does not need to know which it gets.

    Args:
        model: a model with an ``embedding_bags`` EmbeddingBagCollection and a ``dense`` module;
            its dense part is moved to ``device``.
        plan: where each table lives.
        config: the fused embedding optimizer.
        device: ``cpu`` or a CUDA device.
        topology: the hosts of the ranks (None: one host); towers need the default group.
        pg: process group (default: torch.distributed's default group).
        dedup_groups: feature names of each dedup group (RecD); when given, each group is
            looked up on its unique rows (see :mod:`raydlrm.sharding.embedding`).

    Returns:
        ``model``, modified.

    Raises:
        TypeError: if the model does not follow the ``embedding_bags``/``dense`` convention.
    """
    ebc, dense = _parts(model)
    device = torch.device(device)
    if topology is not None and topology.num_hosts > 1 and isinstance(dense, TowerDense):
        _check_towers_alone(pg, dedup_groups)
        from raydlrm.sharding.towers import shard_tower_model

        return shard_tower_model(model, plan=plan, config=config, device=device, topology=topology)
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


def _parts(model: nn.Module) -> tuple[EmbeddingBagCollection, nn.Module]:
    """The model's unsharded collection and dense part (the torchtitan convention)."""
    ebc = getattr(model, "embedding_bags", None)
    dense = getattr(model, "dense", None)
    if not isinstance(ebc, EmbeddingBagCollection) or not isinstance(dense, nn.Module):
        raise TypeError(
            f"{type(model).__name__} needs an `embedding_bags` EmbeddingBagCollection and a "
            "`dense` nn.Module to be sharded"
        )
    return ebc, dense


def _check_towers_alone(pg: ProcessGroup | None, dedup_groups: Sequence[Sequence[str]]) -> None:
    """Towers on several hosts route every sample's ids on their own process groups."""
    if dedup_groups or pg is not None:
        raise ValueError(
            "towers on several hosts look up every sample's ids on their own process groups: "
            "no dedup groups (data.dedup_groups) and no process group"
        )


def unwrap_dense(model: nn.Module) -> nn.Module:
    """``model.dense`` without the wrappers :func:`shard_model` may have put around it (DDP; with
    towers on hosts, the module that runs only the architecture): the unsharded model's dense
    part, whose parameters keep their names."""
    dense = model.dense
    dense = dense.module if isinstance(dense, DistributedDataParallel) else dense
    return getattr(dense, "towers_dense", dense)
