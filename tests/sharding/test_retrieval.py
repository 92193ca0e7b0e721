"""Retrieval evaluation with the item table sharded: each query's target rank and top-K equal a
brute-force ranking of the whole table, for every sharding type on 1-4 gloo ranks (a rank
without queries, a rank without rows, chunks and exchange rounds of a few rows); HR@K and
NDCG@K by hand; every row scored once, whole, a chunk at a time; and the errors, raised
alike on every rank.

The table and the queries hold small integers, so every score is exact in fp32 whatever the
summation order, and ties are frequent: the tie rules are checked too (an equal score does not
count against the target; equal scores list the lower row first).
"""

from __future__ import annotations

import math

import pytest
import torch

from raydlrm.sharding.plan import Shard
from raydlrm.sharding.quantized import QuantizedRows
from raydlrm.sharding.retrieval import (
    ItemShard,
    _row_chunks,
    _setup,
    retrieval_metrics,
    target_ranks,
    top_k,
)
from tests._multiprocess import run_distributed

N, D, K = 37, 12, 5
KINDS = ["table_wise", "row_wise", "column_wise", "data_parallel", "int8_row_wise"]


def _table() -> torch.Tensor:
    return torch.randint(-3, 4, (N, D), generator=torch.Generator().manual_seed(7)).float()


def _queries(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s queries and targets; rank 1 has none."""
    gen = torch.Generator().manual_seed(100 + rank)
    b = [4, 0, 6, 3][rank]
    return torch.randint(-2, 3, (b, D), generator=gen).float(), torch.randint(
        0, N, (b,), generator=gen
    )


def _rect(kind: str, rank: int, world_size: int) -> tuple[int, int, int, int] | None:
    """Rank ``rank``'s rows and columns of the table, None when it holds none."""
    if kind == "table_wise":
        return (0, N, 0, D) if rank == world_size - 1 else None
    if kind == "data_parallel":
        return (0, N, 0, D)
    if kind == "column_wise":  # pieces of 4 columns on at most 3 ranks, the first the widest
        cuts = {1: [0, 12], 2: [0, 8, 12]}.get(world_size, [0, 4, 8, 12])
        return (0, N, cuts[rank], cuts[rank + 1]) if rank + 1 < len(cuts) else None
    # row-wise, uneven, one shard of fewer than K rows
    cuts = {1: [0, N], 2: [0, 3, N], 3: [0, 20, 23, N]}.get(world_size, [0, 9, 12, 30, N])
    return (cuts[rank], cuts[rank + 1], 0, D)


def _items(kind: str, rank: int, world_size: int) -> ItemShard:
    rect = _rect(kind, rank, world_size)
    if rect is None:
        return ItemShard("items", weights=None, shard=None, num_embeddings=N, embedding_dim=D)
    r0, r1, c0, c1 = rect
    weights = _table()[r0:r1, c0:c1]
    if kind.startswith("int8"):
        # Codes 0..7 with scale 1 and bias -3: the same small integers, dequantized exactly.
        params = torch.tensor([[1.0, -3.0]], dtype=torch.float16).expand(r1 - r0, 2).clone()
        codes = (weights + 3).to(torch.uint8)
        weights = QuantizedRows(codes, params, precision="int8", dim=c1 - c0, key=0, row_start=r0)
    shard = Shard(rank=rank, row_start=r0, row_end=r1, col_start=c0, col_end=c1)
    return ItemShard("items", weights=weights, shard=shard, num_embeddings=N, embedding_dim=D)


def _rank_all_kinds(rank: int, world_size: int) -> dict[str, tuple[torch.Tensor, ...]]:
    queries, targets = _queries(rank)
    total = sum(_queries(r)[0].shape[0] for r in range(world_size))
    out = {}
    for kind in KINDS:
        items = _items(kind, rank, world_size)
        # 4 rows a chunk: several chunks per rank, several exchange rounds.
        ranks = target_ranks(queries, targets=targets, items=items, max_scores=4 * total)
        best = top_k(queries, k=K, items=items, max_scores=4 * total)
        ctx = _setup(queries, targets=targets, items=items, pg=None)
        chunks = [
            (start, rows) for start, rows in _row_chunks(items, ctx=ctx, max_scores=4 * total)
        ]
        out[kind] = (ranks, best.scores, best.rows, chunks)
    return out


def _brute_force(queries: torch.Tensor, targets: torch.Tensor):
    scores = queries.double() @ _table().double().T
    ranks = (scores > scores.gather(1, targets.view(-1, 1))).sum(1)
    rows = torch.arange(N).expand_as(scores)
    # Best first; equal scores: the lower row first (a stable sort of the rows, ascending).
    order = torch.argsort(-scores, dim=1, stable=True)[:, :K]
    return ranks, scores.gather(1, order).float(), rows.gather(1, order)


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_ranks_and_top_k_equal_brute_force(world_size: int) -> None:
    results = run_distributed(_rank_all_kinds, world_size=world_size)
    for rank, per_kind in enumerate(results):
        want_ranks, want_scores, want_rows = _brute_force(*_queries(rank))
        for kind, (ranks, scores, rows, _) in per_kind.items():
            assert torch.equal(ranks, want_ranks), (kind, rank)
            assert torch.equal(scores, want_scores), (kind, rank)
            assert torch.equal(rows, want_rows), (kind, rank)
    # Every row is scored once, whole, by one rank, at most 4 at a time (no rank holds more
    # than its shard and one chunk).
    for kind in KINDS:
        chunks = [c for per_kind in results for c in per_kind[kind][3]]
        assert all(rows.shape[0] <= 4 for _, rows in chunks), kind
        scored = sorted(start + i for start, rows in chunks for i in range(rows.shape[0]))
        assert scored == list(range(N)), kind
        for start, rows in chunks:
            assert torch.equal(rows, _table()[start : start + rows.shape[0]]), kind


def test_the_brute_force_reference_has_ties() -> None:
    """The tie rules are exercised: a target ties with another item, a top-K list holds equal
    scores."""
    queries, targets = _queries(0)
    scores = queries @ _table().T
    assert bool((scores == scores.gather(1, targets.view(-1, 1))).sum(1).gt(1).any())
    assert bool((_brute_force(queries, targets)[1].diff(dim=1) == 0).any())


def _bad_target(rank: int, world_size: int) -> str:
    queries, targets = _queries(rank)
    if rank == 1:
        queries, targets = queries.new_zeros(1, D), torch.tensor([N])
    try:
        target_ranks(queries, targets=targets, items=_items("row_wise", rank, world_size))
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.distributed
def test_bad_input_on_one_rank_raises_on_every_rank() -> None:
    messages = run_distributed(_bad_target, world_size=2)
    assert messages == ["table 'items': rank 1: a target row is out of range"] * 2


def test_refuses_rows_it_cannot_rank_naming_the_table() -> None:
    queries, targets = _queries(0)
    shard = Shard(rank=0, row_start=0, row_end=N, col_start=0, col_end=D)
    codes = ItemShard("items", torch.zeros(N, D, dtype=torch.uint8), shard, N, D)
    with pytest.raises(ValueError, match="table 'items': rank 0: its rows are raw quantized codes"):
        target_ranks(queries, targets=targets, items=codes)
    part = Shard(rank=0, row_start=0, row_end=30, col_start=0, col_end=D)
    short = ItemShard("items", _table()[:30], part, N, D)
    with pytest.raises(ValueError, match=r"table 'items': its shards \(rank 0: rows \[0, 30\)"):
        top_k(queries, k=K, items=short)
    with pytest.raises(ValueError, match=r"table 'items': top_k needs k in \[1, 37\], got 38"):
        top_k(queries, k=N + 1, items=ItemShard("items", _table(), shard, N, D))


def test_hit_rate_and_ndcg_by_hand() -> None:
    metrics = retrieval_metrics(torch.tensor([0, 3, 9, 10, 49, 50, 199, 200]), ks=(10, 50, 200))
    assert metrics["hr_at_10"].tolist() == [1, 1, 1, 0, 0, 0, 0, 0]
    assert metrics["hr_at_50"].tolist() == [1, 1, 1, 1, 1, 0, 0, 0]
    assert metrics["hr_at_200"].tolist() == [1, 1, 1, 1, 1, 1, 1, 0]
    ndcg = [1.0, 1 / math.log2(5), 1 / math.log2(11)] + [0.0] * 5
    assert metrics["ndcg_at_10"].tolist() == pytest.approx(ndcg, rel=1e-15)
    assert metrics["ndcg_at_200"][6].item() == pytest.approx(1 / math.log2(201), rel=1e-15)
    assert metrics["ndcg_at_200"][7].item() == 0.0
