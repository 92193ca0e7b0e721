"""Managed tables' id maps in checkpoints (DCP), with resharding, and in deltas.

A managed table's map is row-indexed state (:mod:`raydlrm.models.managed_ids`), saved beside its
weights as ``embedding.<table>.id_map``, a ``(rows, 4)`` int64 tensor (id, last step, lookups,
admission counter per row) sharded like the table's rows: each row range is written once, by
the shard of its first column block (a table's column shards hold the same map). Since a shard
of a managed table is whole buckets and an id lives in its bucket, a map loads into any plan
(another world size or sharding type) by rows, exactly as the weights do. The maps' clock (the
step their ``last`` column counts in, and the seed of reset rows' fresh values) is
``embedding.managed_ids.step``.

A delta (:mod:`raydlrm.sharding.delta`) holds the map rows of the rows it holds, as the part
``id_map`` of each piece: the rows a step looked up, gave to a new id or counted an admission in
(the collection flags all of them).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from raydlrm.sharding.embedding_checkpoint import _row_window, _sharded
from raydlrm.sharding.plan import ShardingPlan
from raydlrm.sharding.types import ShardedTables

__all__ = ["STEP_KEY", "id_map_key", "id_map_state_dict", "load_id_maps", "managed_tables"]

STEP_KEY = "embedding.managed_ids.step"
_COLUMNS = 4


def id_map_key(table: str) -> str:
    return f"embedding.{table}.id_map"


def managed_tables(plan: ShardingPlan) -> list[str]:
    """The plan's managed tables (planned with id-map buckets)."""
    return [t.name for t in plan.tables if t.buckets]


def id_map_state_dict(
    collection: ShardedTables, *, plan: ShardingPlan, rank: int
) -> dict[str, Any]:
    """This rank's part of the id maps and their clock (empty without managed tables)."""
    names = managed_tables(plan)
    if not names:
        return {}
    maps, shards = collection.id_maps(), collection.local_shards()
    single = not (dist.is_available() and dist.is_initialized())
    out: dict[str, Any] = {STEP_KEY: torch.tensor(collection.managed_clock, dtype=torch.int64)}
    for name in names:
        table = plan.table(name)
        m = maps.get(name)
        writes = m is not None and shards[name].col_start == 0
        local = m.state.t().contiguous() if writes else None
        if single:
            out[id_map_key(name)] = local
            continue
        firsts = [s for s in table.shards if s.col_start == 0]
        out[id_map_key(name)] = _sharded(
            local,
            rank=rank,
            shards=[(s, [s.row_start, 0], [s.row_end - s.row_start, _COLUMNS]) for s in firsts],
            size=[table.num_embeddings, _COLUMNS],
            device=m.device if m is not None else torch.device("cpu"),
            dtype=torch.int64,
        )
    return out


def load_id_maps(collection: ShardedTables, *, plan: ShardingPlan, rank: int, load: Any) -> None:
    """Fills this rank's id maps and their clock from a checkpoint written by any plan
    (``load``: ``torch.distributed.checkpoint.load`` bound to it; every rank calls)."""
    names = managed_tables(plan)
    if not names:
        return
    shards = collection.local_shards()
    step = torch.zeros(2, dtype=torch.int64)
    target: dict[str, Any] = {STEP_KEY: step}
    buffers = {}
    for name, m in collection.id_maps().items():
        buffers[name] = torch.empty(m.rows, _COLUMNS, dtype=torch.int64, device=m.device)
        target[id_map_key(name)] = _row_window(
            buffers[name],
            rank=rank,
            row_start=shards[name].row_start,
            size=[plan.table(name).num_embeddings, _COLUMNS],
        )
    load(target)
    for name, m in collection.id_maps().items():
        m.state.copy_(buffers[name].t())
    collection.managed_clock = tuple(step.tolist())
