"""The planner's proposer: better placements than the greedy one, by refinement moves, swaps
and splits (steps 2 and 3 of the search; the maximum per-rank cost never increases).

2. **Refinement** (``search="refine"``): while the most-loaded rank has a table-wise table
   (without pinned ranks) whose move to another rank, or swap with a cheaper table there,
   lowers the pair's maximum below the current maximum, do the best such move. Candidates are
   scored with numpy over all ranks and tables at once.
3. **Splitting** (``default_type = "auto"`` only): the unpinned table-wise tables on the
   most-loaded rank are tried row-wise and column-wise over 2, 4, 8, ... of the least-loaded
   ranks; the split that lowers the maximum of the ranks it touches the most (below the
   current maximum) is kept, then refinement runs again.
"""

from __future__ import annotations

import numpy as np

from raydlrm.sharding.plan import Shard, TablePlan
from raydlrm.sharding.planner.placement import Placement
from raydlrm.sharding.planner.shards import table_shards

__all__ = ["refine", "split"]

_SPLIT_TYPES = ("row_wise", "column_wise")


def refine(placement: Placement) -> None:
    """Moves and swaps of table-wise tables off the most-loaded rank while it gets lighter."""
    movable = placement.movable()
    if not movable or placement.world_size == 1:
        return
    cost = np.array([p.cost for p in movable])
    mem = np.array([p.memory_bytes for p in movable], dtype=np.int64)
    owner = np.array([p.shards[0].rank for p in movable])
    ranks = np.arange(placement.world_size)
    for _ in range(20 * len(movable)):
        top = int(np.argmax(placement.load))
        peak = placement.load[top]
        tol = 1e-12 * peak
        mine = np.flatnonzero(owner == top)
        if mine.size == 0:
            break
        room = placement.room()
        # Moves: table i of the top rank to rank r.
        moved = np.maximum(peak - cost[mine, None], placement.load[None, :] + cost[mine, None])
        moved[(mem[mine, None] > room[None, :]) | (ranks[None, :] == top)] = np.inf
        i_move, r_move = np.unravel_index(int(np.argmin(moved)), moved.shape)
        best_move = moved[i_move, r_move]
        # Swaps: table i of the top rank with a cheaper table j elsewhere.
        others = np.flatnonzero(owner != top)
        best_swap = np.inf
        if others.size:
            delta = cost[mine, None] - cost[None, others]
            dmem = mem[mine, None] - mem[None, others]
            swapped = np.maximum(peak - delta, placement.load[owner[others]][None, :] + delta)
            bad = (delta <= 0) | (dmem > room[owner[others]][None, :]) | (-dmem > room[top])
            swapped[bad] = np.inf
            i_swap, j_swap = np.unravel_index(int(np.argmin(swapped)), swapped.shape)
            best_swap = swapped[i_swap, j_swap]
        if min(best_move, best_swap) >= peak - tol:
            break
        if best_move <= best_swap:
            placement.move(movable[mine[i_move]], int(r_move))
            owner[mine[i_move]] = r_move
        else:
            a, b = mine[i_swap], others[j_swap]
            rank_b = int(owner[b])
            placement.move(movable[a], rank_b)
            placement.move(movable[b], top)
            owner[a], owner[b] = rank_b, top


def split(placement: Placement) -> None:
    """Splits unpinned table-wise tables of the most-loaded rank while that lowers the max."""
    for _ in range(len(placement.auto)):
        top = int(np.argmax(placement.load))
        peak = placement.load[top]
        candidates = [
            p for p in placement.movable() if p.name in placement.auto and p.shards[0].rank == top
        ]
        best: tuple[float, int, int, str, TablePlan, list[Shard], float] | None = None
        for p in candidates:
            for kind in _SPLIT_TYPES:
                rows = p.buckets or p.num_embeddings  # a managed table splits by buckets
                limit = rows if kind == "row_wise" else p.embedding_dim // 4
                parts = 2
                while parts <= min(limit, placement.world_size):
                    trial = _try_split(placement, p, kind, parts)
                    if trial is not None:
                        new_max, shards, cost = trial
                        key = (new_max, parts, _SPLIT_TYPES.index(kind))
                        if best is None or key < best[:3]:
                            best = (*key, kind, p, shards, cost)
                    parts *= 2
        if best is None or best[0] >= peak * (1 - 1e-12):
            return
        _, _, _, kind, p, shards, cost = best
        placement.apply(p, -1)
        p.sharding_type, p.shards, p.cost = kind, shards, cost
        placement.apply(p, +1)
        refine(placement)


def _try_split(
    placement: Placement, p: TablePlan, kind: str, parts: int
) -> tuple[float, list[Shard], float] | None:
    """(max cost of the ranks it touches, shards, table cost) of ``p`` split ``kind`` over
    ``parts`` ranks, or None if they have no room."""
    load, room = placement.load.copy(), placement.room()
    rank = p.shards[0].rank
    load[rank] -= p.cost
    room = room.copy()
    room[rank] += p.memory_bytes
    order = np.lexsort((np.arange(placement.world_size), load))
    need = -(-p.memory_bytes // parts)
    ranks = [int(r) for r in order if room[r] >= need][:parts]
    if len(ranks) < parts:
        return None
    trial = TablePlan(
        p.name, kind, p.num_embeddings, p.embedding_dim, [], 0.0, p.memory_bytes, buckets=p.buckets
    )
    trial.shards = table_shards(trial, by_load=ranks, world_size=placement.world_size, group_size=1)
    cost = placement.cost(p, kind, len(trial.shards))
    for s in trial.shards:
        load[s.rank] += cost / len(trial.shards)
    # The ranks the split changes (other ranks may tie the max and are split next).
    touched = [rank, *(s.rank for s in trial.shards)]
    return float(load[touched].max()), trial.shards, cost
