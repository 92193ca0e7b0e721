"""The planner's placement by a learned cost model (NeuroShard, :mod:`.neural_search`): the
tables it can place are placed by its search around the others, which the greedy placement
(:mod:`.placement`) puts first; the plan records each rank's predicted seconds.

The learned model (:mod:`raydlrm.sharding.planner.learned_cost`) costs a rank's set of tables
from their features (:meth:`LearnedPlacement._features`: the data's statistics, else ids looked
up uniformly); the all-to-all is its communication model's when it has one, else the analytic
model's.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from raydlrm.sharding.config import QUANTIZED
from raydlrm.sharding.plan import Shard, TablePlan, format_bytes
from raydlrm.sharding.planner.placement import Placement
from raydlrm.sharding.planner.request import BudgetError
from raydlrm.sharding.sizes import wire_bytes_per_vector

if TYPE_CHECKING:
    from raydlrm.sharding.planner.learned_cost import LearnedCostModel, TableStats
    from raydlrm.sharding.planner.neural_search import SearchResult

__all__ = ["LearnedPlacement"]

_SEARCH_TYPES = ("auto", "table_wise", "column_wise")


class LearnedPlacement:
    """Places the tables of ``placement`` with the learned cost model ``learned``."""

    def __init__(self, placement: Placement, learned: LearnedCostModel) -> None:
        self.placement = placement
        self.learned = learned
        self._uniform: dict[str, TableStats] = {}  # assumed stats of tables without data

    def _searchable(self, p: TablePlan) -> bool:
        """Whether the learned search places ``p``: not pinned (rank or type), in DRAM at fp32
        or fp16 (what the model was measured on), ``default_type`` ``auto``, ``table_wise``
        or ``column_wise``, and small enough for one rank's budget (an ``auto`` table that is
        not goes row-wise, as in step 1)."""
        config, capacity = self.placement.config, self.placement.capacity
        return (
            config.default_type in _SEARCH_TYPES
            and p.name not in config.pinned_types
            and p.name not in config.pinned_ranks
            and p.placement == "dram"
            and config.weights_precision_of(p.name) not in QUANTIZED
            and (capacity is None or p.memory_bytes <= capacity)
        )

    def place(self) -> list[float]:
        """Places the tables :meth:`_searchable` keeps by NeuroShard's search (column halvings
        unless ``default_type`` is ``table_wise``) around the others, placed first by step 1.
        Returns each rank's predicted seconds (lookups plus transfer)."""
        from raydlrm.sharding.planner.neural_search import NeuralSearch

        placement, learned = self.placement, self.learned
        free = [p for p in placement.order if self._searchable(p)]
        names = {p.name for p in free}
        placement.greedy([p for p in placement.order if p.name not in names])
        latents, dims = self._rank_load(learned)
        search = NeuralSearch(
            latent=lambda dim: learned.latents([self._features(p, dim) for p in free]),
            head=learned.head_seconds,
            transfer=lambda sums: self._transfer(learned, sums),
            dims=[p.embedding_dim for p in free],
            memory=[p.memory_bytes for p in free],
            base_latent=latents,
            base_dims=dims,
            room=placement.room(),
        )
        if free:
            splits = placement.config.default_type != "table_wise"
            result = search.column_wise() if splits else search.table_wise()
            if result is None:
                largest = max(free, key=lambda p: (p.memory_bytes, p.name))
                assert placement.budget is not None  # without a budget every piece fits
                raise BudgetError(
                    f"the learned search found no placement of {len(free)} tables in the "
                    f"memory left on the ranks (the largest, {largest.name!r}, takes "
                    f"{format_bytes(largest.memory_bytes)}); {placement.budget.describe()}"
                )
            self._take(free, result, learned)
        sizes = [len(placement.tables_on(r)) for r in range(placement.world_size)]
        learned.warn_outside(
            {p.name: self._features(p, p.embedding_dim) for p in free},
            world_size=placement.world_size,
            set_sizes=sizes,
        )
        latents, dims = self._rank_load(learned)
        compute = learned.head_seconds(latents) * (np.array(sizes) > 0)
        return (compute + self._transfer(learned, dims[None])[0]).tolist()

    def _take(self, free: list[TablePlan], result: SearchResult, learned: LearnedCostModel) -> None:
        """Places ``free`` as the search's ``result`` has it: a table's pieces on one rank are
        one shard there; a table on one rank is table-wise, else column-wise. Its cost: the
        learned model's of the table alone."""
        alone = learned.head_seconds(
            learned.latents([self._features(p, p.embedding_dim) for p in free])
        )
        for i, p in enumerate(free):
            widths: dict[int, int] = {}
            for piece, rank in zip(result.pieces, result.ranks, strict=True):
                if piece.table == i:
                    widths[rank] = widths.get(rank, 0) + piece.dim
            ranks = sorted(widths)
            starts = np.cumsum([0, *(widths[r] for r in ranks)])
            p.shards = [
                Shard(r, 0, p.num_embeddings, int(lo), int(lo) + widths[r])
                for r, lo in zip(ranks, starts, strict=False)
            ]
            p.sharding_type = "table_wise" if len(p.shards) == 1 else "column_wise"
            p.cost = float(alone[i])
            self.placement.apply(p, +1)

    def _stats(self, p: TablePlan) -> TableStats:
        """The table's statistics: the data's, else its ids looked up uniformly with its
        pooling factor (ids per sample over its features) in a batch."""
        from raydlrm.sharding.planner.learned_cost import TableStats

        request = self.placement.request
        stats = request.table_stats.get(p.name) or self._uniform.get(p.name)
        if stats is None:
            features = len(self.placement.configs[p.name].feature_names)
            pooling = request.pooling_factors.get(p.name, 1.0) * features
            stats = TableStats.uniform(
                rows=p.num_embeddings,
                dim=p.embedding_dim,
                pooling=pooling,
                bags=request.batch_size,
            )
            self._uniform[p.name] = stats
        return stats

    def _features(
        self, p: TablePlan, dim: int, *, rows: int | None = None, share: float = 1.0
    ) -> list[float]:
        """The learned model's features of ``p`` (or of its shard of ``rows`` rows looked up
        by ``share`` of its ids) at width ``dim``; a dedup group's table is looked up on a
        step's unique rows."""
        stats = self._stats(p)
        pooling = stats.pooling * share / self.placement.request.dedup_ratios.get(p.name, 1.0)
        rows = p.num_embeddings if rows is None else rows
        return [math.log10(max(rows, 1)), float(dim), pooling, *stats.histogram]

    def _rank_load(self, learned: LearnedCostModel) -> tuple[np.ndarray, np.ndarray]:
        """The placed shards' latent sums ``(W, L)`` and all-to-all dim sums ``(W,)`` per rank
        (a row-wise shard sends partial sums of the whole width; a replica sends nothing)."""
        world_size = self.placement.world_size
        features: list[list[list[float]]] = [[] for _ in range(world_size)]
        dims = np.zeros(world_size)
        for p in self.placement.plans.values():
            for s in p.shards:
                rows = s.row_end - s.row_start
                share = {"data_parallel": 1 / world_size}.get(
                    p.sharding_type, rows / p.num_embeddings
                )
                width = s.col_end - s.col_start
                features[s.rank].append(self._features(p, width, rows=rows, share=share))
                dims[s.rank] += 0 if p.sharding_type == "data_parallel" else width
        size = learned.net.head[0].in_features
        latents = np.stack(
            [learned.latents(f).sum(axis=0) if f else np.zeros(size) for f in features]
        )
        return latents, dims

    def _transfer(self, learned: LearnedCostModel, dim_sums: np.ndarray) -> np.ndarray:
        """Predicted all-to-all transfer seconds ``(K, W)`` of layouts of dim sums ``(K, W)``,
        forward plus backward, at ``comm_precision``: the learned model's when it has one,
        else the analytic model's (the larger of the bytes a rank sends and receives, over the
        calibrated rate)."""
        world_size, request = self.placement.world_size, self.placement.request
        if world_size == 1:
            return np.zeros(dim_sums.shape)
        precision = self.placement.config.comm_precision
        scale = wire_bytes_per_vector(128, precision=precision) / (128 * 4)
        dims = np.asarray(dim_sums, dtype=np.float64) * scale
        if learned.comm is not None:
            return learned.comm.predict(dims)
        batch = request.batch_size
        values = np.maximum(batch * dims, batch / world_size * dims.sum(axis=1, keepdims=True))
        return 2 * 4 * values / request.constants.comm_bytes_per_s
