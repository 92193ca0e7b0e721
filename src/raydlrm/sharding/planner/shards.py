"""The shards of a table by its sharding type (the planner's enumeration of a layout):

- ``table_wise``: one shard on the least-loaded allowed rank;
- ``data_parallel``: a full replica on every rank;
- ``column_wise``: ``min(allowed ranks, dim / 4)`` column shards, widths multiples of 4 as even
  as possible, on the least-loaded allowed ranks;
- ``row_wise``: contiguous, near-equal row ranges over the allowed ranks in rank order;
- ``table_row_wise``: row-wise over the least-loaded group of ``group_size`` consecutive ranks
  whose ranks are all allowed.
"""

from __future__ import annotations

from raydlrm.ids import bucket_bounds
from raydlrm.sharding.plan import Shard, TablePlan

__all__ = ["even_split", "row_shards", "table_shards"]


def even_split(total: int, parts: int) -> list[int]:
    """``parts`` sizes summing to ``total``, the first ``total % parts`` one larger."""
    return [total // parts + (i < total % parts) for i in range(parts)]


def row_shards(p: TablePlan, ranks: list[int]) -> list[Shard]:
    """Contiguous, near-equal row ranges of ``p`` over ``ranks`` in rank order (at most one
    per row; for a managed table, near-equal runs of whole buckets, at most one per bucket)."""
    if p.buckets:  # a managed table: runs of whole id-map buckets
        ranks = sorted(ranks)[: p.buckets]
        rows = bucket_bounds(p.num_embeddings, p.buckets)
        bounds = [0]
        for size in even_split(p.buckets, len(ranks)):
            bounds.append(bounds[-1] + size)
        bounds = [rows[b] for b in bounds]
    else:
        ranks = sorted(ranks)[: p.num_embeddings]
        bounds = [0]
        for size in even_split(p.num_embeddings, len(ranks)):
            bounds.append(bounds[-1] + size)
    return [
        Shard(r, lo, hi, 0, p.embedding_dim)
        for r, lo, hi in zip(ranks, bounds[:-1], bounds[1:], strict=True)
    ]


def table_shards(
    p: TablePlan, *, by_load: list[int], world_size: int, group_size: int
) -> list[Shard]:
    """The shards of ``p`` by its sharding type; ``by_load``: allowed ranks, least loaded first."""
    rows, dim = p.num_embeddings, p.embedding_dim
    if p.sharding_type == "table_wise":
        return [Shard(by_load[0], 0, rows, 0, dim)]
    if p.sharding_type == "data_parallel":
        return [Shard(r, 0, rows, 0, dim) for r in range(world_size)]
    if p.sharding_type == "column_wise":
        widths = [4 * w for w in even_split(dim // 4, min(len(by_load), dim // 4))]
        starts = [sum(widths[:i]) for i in range(len(widths))]
        return [
            Shard(r, 0, rows, c, c + w) for r, c, w in zip(by_load, starts, widths, strict=False)
        ]
    if p.sharding_type == "row_wise":
        return row_shards(p, by_load)
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
    return row_shards(p, group)
