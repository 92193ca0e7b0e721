"""The planner's placement of tables into ranks: per-rank cost and memory while tables are
placed, moved and split, and the greedy placement (step 1 of the search).

Each table gets a cost (estimated seconds per step from :mod:`raydlrm.sharding.planner.cost`)
and a memory size (weights plus fused optimizer state, :mod:`.storage`); a shard is charged
``1 / k`` of its table's cost. **Greedy**: tables largest cost first (pinned-rank tables before
the rest; name breaks ties) on the least-loaded allowed rank(s) with room in the memory budget
(``memory_budget``, else ``sharding.device_memory_bytes``; each table's weights counted at its
weights precision). A table's sharding type (``config.default_type`` unless pinned) decides its
shards (:mod:`.shards`; pinning a ``data_parallel`` table's ranks is an error). With
``default_type = "auto"`` an unpinned table starts table-wise; one too large for any rank is
split row-wise over the fewest ranks that hold it.
"""

from __future__ import annotations

import numpy as np

from raydlrm.sharding.config import ShardingConfig
from raydlrm.sharding.plan import MemoryBudget, Shard, TablePlan, format_bytes
from raydlrm.sharding.planner.cost import estimate_table_cost
from raydlrm.sharding.planner.request import BudgetError, PlanRequest
from raydlrm.sharding.planner.shards import row_shards, table_shards
from raydlrm.sharding.planner.storage import (
    disk_bytes,
    host_bytes,
    memory_bytes,
    table_cache_rows,
)

__all__ = ["Placement"]


class Placement:
    """Per-rank cost and memory while tables are placed, moved and split."""

    def __init__(
        self,
        request: PlanRequest,
        *,
        config: ShardingConfig,
        group_size: int,
        budget: MemoryBudget | None,
        page_cache_hit: float,
    ) -> None:
        tables, world_size = request.tables, request.world_size
        self.world_size, self.config, self.group_size = world_size, config, group_size
        self.page_cache_hit = page_cache_hit
        self.request = request
        self.budget = budget
        self.capacity = None if budget is None else budget.bytes_per_rank
        self.configs = {t.name: t for t in tables}
        self.load = np.zeros(world_size)
        self.memory = np.zeros(world_size, dtype=np.int64)
        self.plans: dict[str, TablePlan] = {}
        for t in tables:
            kind = config.pinned_types.get(t.name, config.default_type)
            self.plans[t.name] = TablePlan(
                name=t.name,
                sharding_type="table_wise" if kind == "auto" else kind,
                num_embeddings=t.num_embeddings,
                embedding_dim=t.embedding_dim,
                shards=[],
                memory_bytes=memory_bytes(
                    t, config, config.placement_of(t.name), request.step_rows(t.name)
                ),
                placement=config.placement_of(t.name),
                disk_bytes=disk_bytes(t, config),
                host_bytes=host_bytes(t, config),
                buckets=t.managed.buckets_for(t.num_embeddings) if t.managed is not None else 0,
                probe_window=t.managed.probe_window if t.managed is not None else 0,
            )
        for p in self.plans.values():
            p.cost = self.cost(p, "table_wise", 1)
        # Pinned tables first (they are constrained), then the rest; largest cost first, name
        # breaks ties so the result does not depend on the input order.
        self.order = sorted(
            self.plans.values(),
            key=lambda p: (p.name not in config.pinned_ranks, -p.cost, -p.memory_bytes, p.name),
        )
        self.auto = {
            p.name
            for p in self.plans.values()
            if config.default_type == "auto"
            and p.name not in config.pinned_types
            and p.name not in config.pinned_ranks
        }

    def cost(self, p: TablePlan, sharding_type: str, num_shards: int) -> float:
        """Estimated seconds per step of ``p`` as ``sharding_type`` in ``num_shards`` shards."""
        precision = self.config.comm_precision_per_table.get(p.name, self.config.comm_precision)
        return estimate_table_cost(
            self.configs[p.name],
            sharding_type=sharding_type,
            num_shards=num_shards,
            world_size=self.world_size,
            batch_size=self.request.rows(p.name),
            pooling_factor=self.request.pooling_factors.get(p.name, 1.0),
            optimizer=self.config.optimizer,
            weights_precision=self.config.weights_precision_of(p.name),
            comm_precision=precision,
            constants=self.request.constants,
            placement=p.placement,
            page_cache_hit=self.page_cache_hit,
            cache_rows=table_cache_rows(
                self.configs[p.name], self.config, step_rows=self.request.step_rows(p.name)
            ),
        ).seconds

    def room(self) -> np.ndarray:
        """Free bytes of each rank's budget (without a budget: as good as unbounded)."""
        if self.capacity is None:
            return np.full(self.world_size, np.iinfo(np.int64).max // 2, dtype=np.int64)
        return self.capacity - self.memory

    def apply(self, p: TablePlan, sign: int) -> None:
        """Adds (``sign = +1``) or removes (``-1``) the cost and memory of ``p``'s shards."""
        for s in p.shards:
            self.load[s.rank] += sign * p.cost / len(p.shards)
            self.memory[s.rank] += sign * p.shard_memory(s)

    def too_large(self, p: TablePlan, shards: list[Shard]) -> BudgetError:
        """The error of ``p`` whose ``shards`` do not all fit: names the rank short the most."""
        assert self.budget is not None
        room = self.room()
        worst = max(shards, key=lambda s: (p.shard_memory(s) - room[s.rank], -s.rank))
        need, free = p.shard_memory(worst), int(room[worst.rank])
        return BudgetError(
            f"table {p.name!r} ({p.sharding_type}, {p.memory_bytes} bytes of weights and "
            f"optimizer state) does not fit on rank {worst.rank}: its shard needs {need} bytes, "
            f"{free} bytes of the budget are free there, short by {need - free} bytes "
            f"({format_bytes(need - free)}); {self.budget.describe()}"
        )

    def _check_fits_somewhere(self, plans: list[TablePlan]) -> None:
        """Names every table of ``plans`` whose smallest possible shard exceeds the budget of
        a rank."""
        if self.budget is None:
            return
        misfits = []
        for p in plans:
            ranks = len(self.config.pinned_ranks.get(p.name, range(self.world_size)))
            if p.name in self.auto or p.sharding_type == "row_wise":
                parts = min(ranks, p.num_embeddings)
            elif p.sharding_type == "table_row_wise":
                parts = min(self.group_size, p.num_embeddings)
            elif p.sharding_type == "column_wise":
                parts = min(ranks, p.embedding_dim // 4)
            else:
                parts = 1
            short = -(-p.memory_bytes // parts) - self.capacity
            if short > 0:
                misfits.append(
                    f"table {p.name!r} ({p.memory_bytes} bytes in at most {parts} shard(s)) is "
                    f"short by {short} bytes ({format_bytes(short)}) on any rank"
                )
        if misfits:
            raise BudgetError(
                f"{'; '.join(misfits)}: cannot fit anywhere, {self.budget.describe()}"
            )

    def greedy(self, plans: list[TablePlan]) -> None:
        """Places ``plans`` (in :attr:`order`) one by one (see the module)."""
        self._check_fits_somewhere(plans)
        for p in plans:
            allowed = sorted(set(self.config.pinned_ranks.get(p.name, range(self.world_size))))
            room = self.room()
            by_load = sorted(allowed, key=lambda r: (self.load[r], self.memory[r], r))
            if p.sharding_type in ("table_wise", "column_wise"):
                parts = 1 if p.sharding_type == "table_wise" else p.embedding_dim // 4
                need = -(-p.memory_bytes // min(parts, len(allowed)))
                fitting = [r for r in by_load if room[r] >= need]
                if p.name in self.auto and not fitting:
                    p.sharding_type, p.shards = "row_wise", self._rows_by_memory(p, by_load)
                    p.cost = self.cost(p, "row_wise", len(p.shards))
                    self.apply(p, +1)
                    continue
                by_load = fitting or by_load
            p.shards = table_shards(
                p, by_load=by_load, world_size=self.world_size, group_size=self.group_size
            )
            if p.sharding_type != "table_wise" or len(p.shards) > 1:
                p.cost = self.cost(p, p.sharding_type, len(p.shards))
            if any(p.shard_memory(s) > room[s.rank] for s in p.shards):
                raise self.too_large(p, p.shards)
            self.apply(p, +1)

    def _rows_by_memory(self, p: TablePlan, by_load: list[int]) -> list[Shard]:
        """Row-wise over the fewest ranks (most free memory first) that can hold ``p``."""
        room = self.room()
        freest = sorted(by_load, key=lambda r: (-room[r], r))
        for parts in range(2, min(len(freest), p.num_embeddings) + 1):
            shards = row_shards(p, freest[:parts])
            if all(p.shard_memory(s) <= room[s.rank] for s in shards):
                return shards
        raise self.too_large(p, row_shards(p, freest[: min(len(freest), p.num_embeddings)]))

    def movable(self) -> list[TablePlan]:
        """The table-wise tables without pinned ranks, in :attr:`order` (what refinement
        moves)."""
        return [
            p
            for p in self.order
            if p.sharding_type == "table_wise" and p.name not in self.config.pinned_ranks
        ]

    def move(self, p: TablePlan, rank: int) -> None:
        """Moves the table-wise ``p`` to ``rank``."""
        self.apply(p, -1)
        p.shards = [Shard(rank, 0, p.num_embeddings, 0, p.embedding_dim)]
        self.apply(p, +1)

    def tables_on(self, rank: int) -> list[str]:
        """The tables with a shard on ``rank`` so far."""
        return [p.name for p in self.plans.values() if rank in p.ranks]
