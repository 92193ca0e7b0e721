"""A retrieval model's evaluation: HR@K and NDCG@K of every held-out example's target item,
ranked against every row of the item table with the table sharded
(:mod:`raydlrm.sharding.retrieval`), and the top-K items ``raydlrm score`` writes.

An example whose history is empty has no query to rank with (its user vector is zero: every
item would tie); it is left out of the metrics and counted (``<prefix>empty_histories``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from raydlrm.batch import Batch
from raydlrm.models.dlrm import RecModel
from raydlrm.sharding.plan import Shard
from raydlrm.sharding.retrieval import ItemShard, TopK, retrieval_metrics, target_ranks, top_k

__all__ = [
    "TARGET_RANK_COLUMN",
    "TOP_ITEMS_COLUMN",
    "TOP_SCORES_COLUMN",
    "RetrievalBuffer",
    "item_shard",
    "retrieve",
]

TOP_ITEMS_COLUMN = "top_items"
"""A retrieval model's output: the item table rows of the best ``K`` items, best first."""
TOP_SCORES_COLUMN = "top_scores"
"""Their scores (the user vector's dot products with the items' embeddings)."""
TARGET_RANK_COLUMN = "target_rank"
"""The rank of the row's target item among every item (0: first; items scoring strictly
higher); -1 where the history is empty (no query to rank with)."""


def item_shard(model: RecModel) -> ItemShard:
    """What this rank holds of a retrieval model's item table: its shard of a sharded model's
    (maybe none), the whole table of an unsharded one's."""
    features = model.retrieval
    assert features is not None, "not a retrieval model"
    collection = model.embedding_bags
    name = features.item_table
    table = next(t for t in collection.tables if t.name == name)
    local_shards = getattr(collection, "local_shards", None)
    if local_shards is not None:
        weights = collection.local_tables().get(name)
        shard = local_shards().get(name)
    else:
        quantized = collection.quantized
        weights = quantized[name] if name in quantized else collection.weights[name].detach()
        shard = Shard(0, 0, table.num_embeddings, 0, table.embedding_dim)
    return ItemShard(
        table=name,
        weights=weights,
        shard=shard,
        num_embeddings=table.num_embeddings,
        embedding_dim=table.embedding_dim,
    )


def _queries(model: RecModel, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The samples' queries, target rows, and which samples have a history."""
    features = model.retrieval
    assert features is not None
    every = batch.all_sparse()
    history = every.select([features.history]).lengths > 0
    target = every.select([features.target]).values
    return model.user_vectors(batch), target, history


class RetrievalBuffer:
    """Sums a worker's HR@K and NDCG@K over held-out batches; computes them over all ranks.

    Args:
        ks: the cut-offs (``model.retrieval_k``).
    """

    def __init__(self, ks: list[int]) -> None:
        self.ks = tuple(ks)
        self._sums: dict[str, float] = {}
        self._count = 0
        self._empty = 0

    def add(self, model: RecModel, batch: Batch, *, items: ItemShard) -> None:
        """Ranks the targets of ``batch`` (a collective: every rank calls, maybe with an empty
        batch)."""
        queries, targets, has_history = _queries(model, batch)
        ranks = target_ranks(
            queries[has_history],
            targets=targets[has_history],
            items=items,
            pg=getattr(model.embedding_bags, "_pg", None),
        )
        for name, values in retrieval_metrics(ranks, ks=self.ks).items():
            self._sums[name] = self._sums.get(name, 0.0) + float(values.sum())
        self._count += int(has_history.sum())
        self._empty += int((~has_history).sum())

    def compute(self, *, device: torch.device, prefix: str) -> dict[str, float]:
        """The metrics over every rank's examples (a collective: every rank calls)."""
        names = [f"{m}_at_{k}" for k in self.ks for m in ("hr", "ndcg")]
        totals = torch.tensor(
            [self._sums.get(n, 0.0) for n in names] + [self._count, self._empty],
            dtype=torch.float64,
            device=device,
        )
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(totals)
        count = float(totals[-2])
        out = {
            f"{prefix}{n}": float(totals[i]) / count if count else float("nan")
            for i, n in enumerate(names)
        }
        out[f"{prefix}num_samples"] = count
        out[f"{prefix}empty_histories"] = float(totals[-1])
        return out


def retrieve(model: RecModel, batch: Batch, *, k: int, items: ItemShard) -> TopK:
    """The ``k`` best items of each sample of ``batch`` (a collective), best first."""
    return top_k(
        model.user_vectors(batch), k=k, items=items, pg=getattr(model.embedding_bags, "_pg", None)
    )
