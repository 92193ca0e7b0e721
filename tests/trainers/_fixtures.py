"""Helpers of the trainer tests."""

from __future__ import annotations

import torch

from raydlrm.sharding.parallelize import unwrap_dense
from raydlrm.trainers.loop import Trainer
from tests.sharding._fixtures import gather_full_tables, gather_id_maps


def unsharded_state_dict(trainer: Trainer) -> dict[str, torch.Tensor] | None:
    """The full, unsharded model state on rank 0 (None elsewhere); all ranks must call. Keys
    are those of the unsharded ``RecModel``: ``embedding_bags.weights.<table>``,
    ``embedding_bags.id_maps.<table>`` (managed tables, ``(rows, 4)``), ``dense.*``.
    Every table is gathered whole onto rank 0: for small models and tests only."""
    tables = gather_full_tables(trainer.model.embedding_bags, dst=0)
    maps = gather_id_maps(trainer.model.embedding_bags)
    if trainer.rank != 0:
        return None
    state = {f"embedding_bags.weights.{name}": t.cpu() for name, t in tables.items()}
    state.update((f"embedding_bags.id_maps.{name}", m.t().contiguous()) for name, m in maps.items())
    dense = unwrap_dense(trainer.model).state_dict()
    state.update({f"dense.{k}": v.detach().cpu() for k, v in dense.items()})
    return state
