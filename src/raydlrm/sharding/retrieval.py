"""Retrieval evaluation over the whole item catalogue with the item table sharded: each query's
rank of its target item, the top-K items per query, HR@K and NDCG@K.

A retrieval model (SASRec) gives a query vector per example; an item's score is its dot product
with the item's embedding row. Ranking "against every item" would need the whole table in one
place; here no rank ever holds more than its own shard plus one chunk of rows:

1. every rank's queries (a different count per rank) and target rows are all-gathered;
2. each rank scores a disjoint part of the catalogue's rows, ``max_scores`` scores at a time:
   its own rows when it holds whole rows (table-wise, row-wise, table-row-wise); a
   ``1 / replicas`` share of the rows when the table is replicated (data-parallel); and when
   the columns are split (column-wise), the ranks holding the same rows split those rows among
   themselves and exchange their column pieces of one chunk at a time (an all-to-all), so each
   scores whole rows. Moving the rows costs ``rows x dim`` values per evaluation, where
   summing partial scores across the column shards would move ``queries x rows``;
3. a rank counts, for every query, its rows scoring strictly higher than the query's target
   (:func:`target_ranks`), or keeps its best ``K`` (:func:`top_k`); the counts are summed over
   the ranks (an all-reduce), the top-K lists merged on the query's owner (an all-to-all).

Ties: an item whose score equals the target's does not count against it (the rank is the
number of items scoring strictly higher; the target itself never counts, whatever rounding
does to its score). In :func:`top_k` equal scores are ordered by row, the lower first, so the
lists are reproducible. Scores are fp32 dot products: two items within rounding of the
target's score may fall on either side of it, as in any fp32 ranking. A query whose scores all
tie (a zero vector) ranks its target first: evaluate only examples whose model has something
to go on (a non-empty history).

Rows are read in their own precision (fp32, fp16, bf16, or int8/int4 :class:`QuantizedRows`,
dequantized a chunk at a time, the values the model looks up); raw quantized codes are
refused. Everything is a collective over ``pg``: every rank calls with its own queries (maybe
none) and its part of the table (maybe none); bad input raises the same ``ValueError`` on
every rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from raydlrm.sharding._comm import all_to_all, rank_and_world_size
from raydlrm.sharding.plan import Shard
from raydlrm.sharding.quantized import QuantizedRows

__all__ = ["ItemShard", "TopK", "retrieval_metrics", "target_ranks", "top_k"]

DEFAULT_KS = (10, 50, 200)
"""The cut-offs of :func:`retrieval_metrics`."""


@dataclass
class ItemShard:
    """What this rank holds of the item table.

    Attributes:
        table: the table's name (for errors).
        weights: this rank's rows of it, ``(shard.row_end - shard.row_start, shard.col_end -
            shard.col_start)`` (a data-parallel table's full replica); None when the rank
            holds none of the table.
        shard: the rectangle ``weights`` is; None with ``weights``.
        num_embeddings: the table's rows (the catalogue).
        embedding_dim: its columns (the query's width).
    """

    table: str
    weights: torch.Tensor | QuantizedRows | None
    shard: Shard | None
    num_embeddings: int
    embedding_dim: int


@dataclass
class TopK:
    """The best items of each query, best first (equal scores: the lower row first).

    Attributes:
        scores: ``(B, K)`` fp32.
        rows: ``(B, K)`` int64 item rows.
    """

    scores: torch.Tensor
    rows: torch.Tensor


def retrieval_metrics(
    ranks: torch.Tensor, *, ks: tuple[int, ...] = DEFAULT_KS
) -> dict[str, torch.Tensor]:
    """HR@K and NDCG@K of each query, from the rank of its one target item (0 = first).

    ``hr_at_K = 1 if rank < K else 0``; ``ndcg_at_K = 1 / log2(rank + 2) if rank < K else 0``
    (one relevant item, so the ideal DCG is 1). Averaging over the queries is the caller's
    (sum and count, across batches and ranks).

    Args:
        ranks: ``(B,)`` int64, from :func:`target_ranks`.
        ks: the cut-offs.

    Returns:
        ``hr_at_K`` and ``ndcg_at_K`` for each ``K``: ``(B,)`` float64 each.
    """
    ranks = ranks.to(torch.float64)
    out = {}
    for k in ks:
        hit = ranks < k
        out[f"hr_at_{k}"] = hit.to(torch.float64)
        out[f"ndcg_at_{k}"] = torch.where(hit, 1.0 / torch.log2(ranks + 2.0), 0.0)
    return out


def target_ranks(
    queries: torch.Tensor,
    *,
    targets: torch.Tensor,
    items: ItemShard,
    pg: ProcessGroup | None = None,
    max_scores: int = 1 << 24,
) -> torch.Tensor:
    """The rank of each of this rank's queries' target among all the catalogue's items: how
    many items score strictly higher than it (see the module docstring for ties).

    Args:
        queries: this rank's queries, ``(B_local, D)`` (``B_local`` may differ across ranks,
            or be 0), on the device the process group communicates on.
        targets: their target item rows, int64, ``(B_local,)``.
        items: this rank's part of the item table.
        pg: process group (None: the default one).
        max_scores: scores computed at once (memory: 4 bytes each).

    Returns:
        ``(B_local,)`` int64, each in ``[0, num_embeddings)``.

    Raises:
        ValueError: naming the table (on every rank) for rows that cannot be ranked (raw
            quantized codes, a shard that does not match its rectangle, shards that do not
            tile the table), a query of the wrong width or not finite, a target out of range.
    """
    ctx = _setup(queries, targets=targets, items=items, pg=pg)
    if ctx.num_queries == 0:
        return torch.zeros(0, dtype=torch.int64, device=queries.device)
    all_queries, all_targets = ctx.gather(queries, targets)
    target_scores = _target_scores(all_queries, all_targets, items=items, ctx=ctx)
    if not bool(torch.isfinite(target_scores).all()):
        raise ValueError(f"table {items.table!r}: a target item's score is not finite")
    higher = torch.zeros(ctx.num_queries, dtype=torch.int64, device=queries.device)
    for start, rows in _row_chunks(items, ctx=ctx, max_scores=max_scores):
        scores = all_queries @ rows.T  # (B, c)
        ids = torch.arange(start, start + rows.shape[0], device=queries.device)
        above = (scores > target_scores.unsqueeze(1)) & (ids != all_targets.unsqueeze(1))
        higher += above.sum(dim=1)
    ctx.all_reduce(higher)
    return ctx.own(higher)


def top_k(
    queries: torch.Tensor,
    *,
    k: int,
    items: ItemShard,
    pg: ProcessGroup | None = None,
    max_scores: int = 1 << 24,
) -> TopK:
    """The ``k`` best items of each of this rank's queries, over the whole catalogue: each
    rank's best among the rows it scores, merged on the query's rank.

    Args:
        queries: this rank's queries, ``(B_local, D)``, on the process group's device.
        k: items per query, at most the catalogue's size.
        items: this rank's part of the item table.
        pg: process group (None: the default one).
        max_scores: scores computed at once.

    Returns:
        The best ``k`` per query, ``(B_local, k)``, best first.

    Raises:
        ValueError: as :func:`target_ranks`, and for ``k`` out of ``[1, num_embeddings]``.
    """
    if not 1 <= k <= items.num_embeddings:
        raise ValueError(
            f"table {items.table!r}: top_k needs k in [1, {items.num_embeddings}], got {k}"
        )
    targets = torch.zeros(queries.shape[0], dtype=torch.int64, device=queries.device)
    ctx = _setup(queries, targets=targets, items=items, pg=pg)
    if ctx.num_queries == 0:
        empty = torch.zeros(0, k, device=queries.device)
        return TopK(scores=empty, rows=empty.to(torch.int64))
    all_queries, _ = ctx.gather(queries, targets)
    best_scores = all_queries.new_zeros(ctx.num_queries, 0)
    best_rows = torch.zeros(ctx.num_queries, 0, dtype=torch.int64, device=queries.device)
    for start, rows in _row_chunks(items, ctx=ctx, max_scores=max_scores):
        ids = torch.arange(start, start + rows.shape[0], device=queries.device)
        # The kept best (lower rows, scored earlier) then the chunk: ascending rows throughout.
        # A NaN score (a row of a diverged table) never makes the list before a number.
        scores = torch.nan_to_num(all_queries @ rows.T, nan=-math.inf)
        best_scores = torch.cat([best_scores, scores], dim=1)
        best_rows = torch.cat([best_rows, ids.expand(ctx.num_queries, -1)], dim=1)
        best_scores, best_rows = _select_top(best_scores, best_rows, k=k)
    missing = k - best_scores.shape[1]  # a rank that scores fewer than k rows
    best_scores = torch.nn.functional.pad(best_scores, (0, missing), value=-math.inf)
    best_rows = torch.nn.functional.pad(best_rows, (0, missing), value=items.num_embeddings)
    scores, rows = ctx.to_owners(best_scores), ctx.to_owners(best_rows)
    # Every rank's candidates side by side, in ascending rows (the padding, past every row,
    # last), so that _select_top keeps the lower row of equal scores.
    order = torch.argsort(rows, dim=1, stable=True)
    scores, rows = _select_top(scores.gather(1, order), rows.gather(1, order), k=k)
    order = torch.argsort(scores, dim=1, descending=True, stable=True)
    return TopK(scores=scores.gather(1, order), rows=rows.gather(1, order))


def _select_top(
    scores: torch.Tensor, rows: torch.Tensor, *, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` highest of each row of ``scores`` ``(B, M)`` (columns in ascending item rows),
    equal scores the lower rows; kept in column order. All of them when ``M <= k``."""
    if scores.shape[1] <= k:
        return scores, rows
    kth = scores.topk(k, dim=1).values[:, -1:]
    above = scores > kth
    tied = scores == kth
    room = k - above.sum(dim=1, keepdim=True)
    keep = above | (tied & (torch.cumsum(tied, dim=1) <= room))
    # Exactly k per row (finite scores): their columns, in order.
    columns = torch.nonzero(keep)[:, 1].view(scores.shape[0], k)
    return scores.gather(1, columns), rows.gather(1, columns)


@dataclass
class _Member:
    """A rank holding columns ``[col_start, col_end)`` of a group's rows; its shard starts at
    table row ``shard_row``."""

    rank: int
    col_start: int
    col_end: int
    shard_row: int


@dataclass
class _Group:
    """Rows ``[row_start, row_end)`` of the table, whole, or in column pieces (members sorted
    by column). A single member scores the rows from its own shard; several split the rows
    evenly (:meth:`split`) and exchange their pieces."""

    row_start: int
    row_end: int
    members: list[_Member]

    def split(self, j: int) -> tuple[int, int]:
        """The rows member ``j`` scores."""
        n, k = self.row_end - self.row_start, len(self.members)
        return self.row_start + j * n // k, self.row_start + (j + 1) * n // k


@dataclass
class _Context:
    """The collective state of one call: who has which queries and which rows."""

    pg: ProcessGroup | None
    rank: int
    sizes: list[int]  # queries per rank
    groups: list[_Group]
    device: torch.device

    @property
    def num_queries(self) -> int:
        return sum(self.sizes)

    def membership(self) -> tuple[_Group, int] | None:
        """This rank's group and its index among the members; None when it scores no rows."""
        for group in self.groups:
            for j, m in enumerate(group.members):
                if m.rank == self.rank:
                    return group, j
        return None

    def gather(
        self, queries: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every rank's queries ``(B, D)`` (fp32) and targets ``(B,)``, in rank order."""
        return self._gather(queries.float()), self._gather(targets.to(torch.int64))

    def _gather(self, local: torch.Tensor) -> torch.Tensor:
        if len(self.sizes) == 1:
            return local
        widest = max(self.sizes)
        padded = local.new_zeros(widest, *local.shape[1:])
        padded[: local.shape[0]] = local
        parts = [torch.empty_like(padded) for _ in self.sizes]
        dist.all_gather(parts, padded, group=self.pg)
        return torch.cat([p[:n] for p, n in zip(parts, self.sizes, strict=True)])

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sums ``tensor`` over the ranks, in place."""
        if len(self.sizes) > 1:
            dist.all_reduce(tensor, group=self.pg)

    def own(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's queries' rows of ``tensor`` ``(B, ...)``."""
        start = sum(self.sizes[: self.rank])
        return tensor[start : start + self.sizes[self.rank]]

    def to_owners(self, tensor: torch.Tensor) -> torch.Tensor:
        """``(B, k)`` on every rank -> ``(B_local, world * k)``: every rank's columns of this
        rank's queries, side by side in rank order."""
        if len(self.sizes) == 1:
            return tensor
        k = tensor.shape[1]
        received = all_to_all(
            tensor.reshape(-1),
            input_splits=[n * k for n in self.sizes],
            output_splits=[self.sizes[self.rank] * k] * len(self.sizes),
            pg=self.pg,
        )
        mine = self.sizes[self.rank]
        return (
            received.view(len(self.sizes), mine, k)
            .permute(1, 0, 2)
            .reshape(mine, len(self.sizes) * k)
        )


_PROBLEMS = {
    1: "its rows are raw quantized codes, not values (pass the shard's QuantizedRows)",
    2: "the weights' shape is not its shard's rectangle",
    3: "a query's width is not the table's embedding_dim",
    4: "a query is not finite",
    5: "a target row is out of range",
}


def _local_problem(queries: torch.Tensor, targets: torch.Tensor, items: ItemShard) -> int:
    """A code of :data:`_PROBLEMS` for this rank's input, 0 when there is none."""
    w, s = items.weights, items.shard
    if isinstance(w, torch.Tensor) and not w.dtype.is_floating_point:
        return 1
    if (w is None) != (s is None) or (
        w is not None and tuple(w.shape) != (s.row_end - s.row_start, s.col_end - s.col_start)
    ):
        return 2
    if queries.dim() != 2 or queries.shape[1] != items.embedding_dim:
        return 3
    if not bool(torch.isfinite(queries).all()):
        return 4
    if targets.numel() and not (
        int(targets.min()) >= 0 and int(targets.max()) < items.num_embeddings
    ):
        return 5
    return 0


def _setup(
    queries: torch.Tensor, *, targets: torch.Tensor, items: ItemShard, pg: ProcessGroup | None
) -> _Context:
    """Exchanges every rank's query count, rectangle and input problems; raises the same
    error on every rank, or returns the call's context."""
    rank, world_size = rank_and_world_size(pg)
    s = items.shard
    rect = [0, 0, 0, 0, 0] if s is None else [1, s.row_start, s.row_end, s.col_start, s.col_end]
    local = [queries.shape[0], *rect, _local_problem(queries, targets, items)]
    if world_size == 1:
        gathered = [[v] for v in local]
    else:
        mine = torch.tensor(local, dtype=torch.int64, device=queries.device)
        parts = [torch.empty_like(mine) for _ in range(world_size)]
        dist.all_gather(parts, mine, group=pg)
        gathered = torch.stack(parts, dim=1).tolist()
    sizes, held, problems = gathered[0], gathered[1], gathered[6]
    for r, code in enumerate(problems):
        if code:
            raise ValueError(f"table {items.table!r}: rank {r}: {_PROBLEMS[code]}")
    rects = [(r, *(gathered[i][r] for i in range(2, 6))) for r in range(world_size) if held[r]]
    groups = _groups(items, rects=rects)
    return _Context(pg=pg, rank=rank, sizes=sizes, groups=groups, device=queries.device)


def _groups(items: ItemShard, *, rects: list[tuple[int, int, int, int, int]]) -> list[_Group]:
    """The table's rows as groups (see :class:`_Group`), from every rank's ``(rank, row_start,
    row_end, col_start, col_end)``: the replicas of a data-parallel table split its rows; other
    shards must tile the table, whole rows or column pieces of the same rows.

    Raises:
        ValueError: naming the table when the shards neither tile nor replicate it.
    """
    n, d = items.num_embeddings, items.embedding_dim
    rects = [r for r in rects if r[2] > r[1] and r[4] > r[3]]
    if rects and all(r[1:] == (0, n, 0, d) for r in rects):
        k = len(rects)
        return [
            _Group(i * n // k, (i + 1) * n // k, [_Member(r[0], 0, d, 0)])
            for i, r in enumerate(rects)
        ]
    by_rows: dict[tuple[int, int], list[_Member]] = {}
    for rank, r0, r1, c0, c1 in rects:
        by_rows.setdefault((r0, r1), []).append(_Member(rank, c0, c1, r0))
    groups, next_row = [], 0
    for (r0, r1), members in sorted(by_rows.items()):
        members.sort(key=lambda m: m.col_start)
        columns = [(m.col_start, m.col_end) for m in members]
        whole = [c for pair in columns for c in pair][1:-1]
        if r0 != next_row or columns[0][0] != 0 or columns[-1][1] != d or whole[::2] != whole[1::2]:
            break
        groups.append(_Group(r0, r1, members))
        next_row = r1
    if next_row != n or len(groups) != len(by_rows):
        shapes = [f"rank {r}: rows [{a}, {b}) cols [{c}, {e})" for r, a, b, c, e in rects]
        raise ValueError(
            f"table {items.table!r}: its shards ({'; '.join(shapes) or 'none'}) do not tile its "
            f"{n} x {d} rows and columns: cannot rank its items"
        )
    return groups


def _read(weights: torch.Tensor | QuantizedRows, start: int, end: int, device) -> torch.Tensor:
    """Rows ``[start, end)`` of a shard as fp32 on ``device``."""
    rows = (
        weights.dequantize(start, end) if isinstance(weights, QuantizedRows) else weights[start:end]
    )
    return rows.to(device=device, dtype=torch.float32)


def _target_scores(
    queries: torch.Tensor, targets: torch.Tensor, *, items: ItemShard, ctx: _Context
) -> torch.Tensor:
    """Each query's score of its target, ``(B,)``: the target's group adds it up, each
    member its columns' part."""
    scores = queries.new_zeros(queries.shape[0])
    mine = ctx.membership()
    if mine is not None:
        group, j = mine
        m = group.members[j]
        hit = torch.nonzero((targets >= group.row_start) & (targets < group.row_end)).flatten()
        local = (targets.index_select(0, hit) - m.shard_row).to(items.weights.device)
        rows = items.weights[local].to(device=ctx.device, dtype=torch.float32)
        part = queries.index_select(0, hit)[:, m.col_start : m.col_end]
        scores[hit] = (part * rows).sum(dim=1)
    ctx.all_reduce(scores)
    return scores


def _row_chunks(items: ItemShard, *, ctx: _Context, max_scores: int):
    """The rows this rank scores, whole and in ascending order: ``(first row, (c, D) fp32)``
    chunks of at most ``max_scores / B`` rows. Every rank goes through the same number of
    exchange rounds (all-to-alls), whatever it holds."""
    chunk = max(1, max_scores // max(ctx.num_queries, 1))
    mine = ctx.membership()
    if mine is not None and len(mine[0].members) == 1:
        group, m = mine[0], mine[0].members[0]
        for lo in range(group.row_start, group.row_end, chunk):
            hi = min(lo + chunk, group.row_end)
            yield lo, _read(items.weights, lo - m.shard_row, hi - m.shard_row, ctx.device)
    spans = [
        g.split(j)[1] - g.split(j)[0]
        for g in ctx.groups
        if len(g.members) > 1
        for j in range(len(g.members))
    ]
    for r in range(-(-max(spans, default=0) // chunk)):
        got = _exchange(items, ctx=ctx, lo_offset=r * chunk, chunk=chunk)
        if got is not None:
            yield got


def _exchange(
    items: ItemShard, *, ctx: _Context, lo_offset: int, chunk: int
) -> tuple[int, torch.Tensor] | None:
    """One round of the column pieces' exchange: each member of a column-split group sends
    every member its columns of that member's next chunk of rows, and gets the others' columns
    of its own. Returns this rank's whole rows, or None (not in such a group, or done)."""
    world_size = len(ctx.sizes)
    send = [torch.zeros(0, device=ctx.device)] * world_size
    out_splits = [0] * world_size
    mine = ctx.membership()
    split = mine is not None and len(mine[0].members) > 1
    if split:
        group, me = mine
        spans = [group.split(j) for j in range(len(group.members))]
        spans = [(min(a + lo_offset, b), min(a + lo_offset + chunk, b)) for a, b in spans]
        sender = group.members[me]
        for (lo, hi), dst in zip(spans, group.members, strict=True):
            piece = _read(items.weights, lo - sender.shard_row, hi - sender.shard_row, ctx.device)
            send[dst.rank] = piece.reshape(-1)
        lo, hi = spans[me]
        for src in group.members:
            out_splits[src.rank] = (hi - lo) * (src.col_end - src.col_start)
    received = all_to_all(
        torch.cat(send),
        input_splits=[t.numel() for t in send],
        output_splits=out_splits,
        pg=ctx.pg,
    )
    if not split or hi == lo:
        return None
    pieces = received.split(out_splits)
    rows = torch.cat([pieces[m.rank].view(hi - lo, -1) for m in group.members], dim=1)
    return lo, rows
