"""The sharding plan: which rank holds which part of which embedding table.

A plan is plain data (dataclasses of ints, floats and strings) so it can be written to JSON,
stored in every checkpoint, printed as a per-rank table and compared in tests. The planner
(:mod:`raydlrm.sharding.planner`) produces it; :class:`ShardedEmbeddingBagCollection` consumes it.
A plan records the per-rank :class:`MemoryBudget` it was made under, so printing it shows each
rank's memory against the budget.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import get_args

from raydlrm._text import text_table
from raydlrm.ids import bucket_bounds
from raydlrm.models.embedding import EmbeddingBagConfig
from raydlrm.sharding.config import Placement, ShardingType

__all__ = ["MemoryBudget", "Shard", "ShardingPlan", "TablePlan", "format_bytes"]

_SHARDING_TYPES: tuple[str, ...] = get_args(ShardingType)
_ROW_SPLIT_TYPES = ("row_wise", "table_row_wise")


@dataclass(frozen=True)
class Shard:
    """A rectangle ``[row_start, row_end) x [col_start, col_end)`` of a table on one rank."""

    rank: int
    row_start: int
    row_end: int
    col_start: int
    col_end: int


@dataclass
class TablePlan:
    """How one table is sharded.

    Attributes:
        name: table name.
        sharding_type: how the table is split (see :data:`~raydlrm.sharding.config.ShardingType`).
        num_embeddings: rows of the table.
        embedding_dim: columns of the table.
        shards: the pieces of the table and their ranks, at most one per rank; for
            ``data_parallel`` one full-table replica per rank.
        cost: estimated seconds per step of the table's lookups and communication, all shards
            together (see :mod:`raydlrm.sharding.planner.cost`).
        memory_bytes: worker memory of its weights plus fused optimizer state, in bytes (for
            an ``ssd`` table, the optimizer state kept in memory only).
        placement: where its weights live: ``dram``, ``ssd`` (a file on each worker's
            local disk, through the page cache; see :mod:`raydlrm.sharding.tiers`) or ``host``
            (a GPU worker's host memory, behind a row cache in GPU memory).
        disk_bytes: bytes of local disk an ``ssd`` table takes (its weights, and Adagrad's
            per-weight state); 0 in DRAM.
        host_bytes: bytes of host memory a ``host`` table takes (its weights and optimizer
            state; :attr:`memory_bytes` is then its GPU row cache); 0 elsewhere.
        step_rows: the most rows of the table a step can look up (the global batch times
            the most ids one sample looks up in it); a row cache (quantized or ``ssd``
            tables) holds at least that many of a shard's rows, so every step fits it. 0:
            unknown (a plan made without the data).
        buckets: a managed table's buckets (:meth:`raydlrm.ids.ManagedIds.buckets_for`): its
            row-split shards are runs of whole buckets; 0: a hashed table.
        probe_window: a managed table's probe window (``ManagedIds.probe_window``): its ids
            sit within that many rows of their home rows; 0: a hashed table, or a plan
            written before it was recorded.
    """

    name: str
    sharding_type: ShardingType
    num_embeddings: int
    embedding_dim: int
    shards: list[Shard]
    cost: float = 0.0
    memory_bytes: int = 0
    placement: Placement = "dram"
    disk_bytes: int = 0
    host_bytes: int = 0
    step_rows: int = 0
    buckets: int = 0
    probe_window: int = 0

    @property
    def ranks(self) -> list[int]:
        """Ranks holding a shard of this table, in shard order."""
        return [s.rank for s in self.shards]

    def shard_memory(self, shard: Shard) -> int:
        """Bytes of weights plus optimizer state of ``shard`` (its share of the table's area)."""
        return self._share(self.memory_bytes, shard)

    def shard_disk(self, shard: Shard) -> int:
        """Bytes of local disk of ``shard`` (its share of the table's area)."""
        return self._share(self.disk_bytes, shard)

    def shard_host(self, shard: Shard) -> int:
        """Bytes of host memory of ``shard`` (its share of the table's area)."""
        return self._share(self.host_bytes, shard)

    def _share(self, total: int, shard: Shard) -> int:
        area = (shard.row_end - shard.row_start) * (shard.col_end - shard.col_start)
        return total * area // (self.num_embeddings * self.embedding_dim)


@dataclass(frozen=True)
class MemoryBudget:
    """Bytes of embedding weights plus optimizer state each rank may hold.

    Attributes:
        bytes_per_rank: the budget of every rank.
        source: how it was set, e.g. ``sharding.device_memory_bytes`` or
            ``23.54 GiB node memory / 2 workers - 1.00 GiB overhead``.
    """

    bytes_per_rank: int
    source: str

    def __post_init__(self) -> None:
        if self.bytes_per_rank <= 0:
            raise ValueError(
                f"memory budget must be positive, got {self.bytes_per_rank} bytes ({self.source})"
            )

    def describe(self) -> str:
        """``budget <size> per worker = <source>``, for messages."""
        return f"budget {format_bytes(self.bytes_per_rank)} per worker = {self.source}"


@dataclass
class ShardingPlan:
    """Placement of every embedding table on ``world_size`` ranks.

    Attributes:
        world_size: number of ranks the plan is for.
        tables: one :class:`TablePlan` per table.
        memory_budget: the per-rank budget the planner kept to; None if it had none.
        page_cache_hit: the share of the ``ssd`` tables' touched rows the planner's costs
            assume the page cache holds (see
            :func:`raydlrm.sharding.planner.storage.page_cache_hit`); None without ``ssd``
            tables.
        cost_model: the cost model the planner searched with: ``analytic`` (a rank's cost is
            the sum of its tables') or ``learned`` (NeuroShard's, a rank's set of tables at
            once; :mod:`raydlrm.sharding.planner.neural_search`).
        predicted_seconds: with the learned model, each rank's predicted step seconds (its
            fused lookups, forward and backward, plus its all-to-all transfer); None otherwise.
    """

    world_size: int
    tables: list[TablePlan] = field(default_factory=list)
    memory_budget: MemoryBudget | None = None
    page_cache_hit: float | None = None
    cost_model: str = "analytic"
    predicted_seconds: list[float] | None = None

    def table(self, name: str) -> TablePlan:
        """The plan of table ``name``.

        Raises:
            KeyError: if the plan has no such table.
        """
        for t in self.tables:
            if t.name == name:
                return t
        raise KeyError(f"table {name!r} is not in the sharding plan")

    def tables_on_rank(self, rank: int) -> list[str]:
        """Names of the tables with a shard on ``rank``, in plan order."""
        return [t.name for t in self.tables if rank in t.ranks]

    def per_rank_cost(self) -> list[float]:
        """Estimated cost per rank: the learned model's :attr:`predicted_seconds`, else the sum
        of the rank's tables' costs (a table's cost is split evenly over its shards)."""
        if self.predicted_seconds is not None:
            return list(self.predicted_seconds)
        costs = [0.0] * self.world_size
        for t in self.tables:
            for s in t.shards:
                costs[s.rank] += t.cost / len(t.shards)
        return costs

    def per_rank_memory(self) -> list[int]:
        """Bytes of weights plus optimizer state per rank (split over shards by area)."""
        return self._per_rank(TablePlan.shard_memory)

    def per_rank_disk(self) -> list[int]:
        """Bytes of local disk per rank: its ``ssd`` shards' files."""
        return self._per_rank(TablePlan.shard_disk)

    def per_rank_host(self) -> list[int]:
        """Bytes of host memory per rank: its ``host`` shards' rows and optimizer state."""
        return self._per_rank(TablePlan.shard_host)

    def _per_rank(self, bytes_of: Callable[[TablePlan, Shard], int]) -> list[int]:
        total = [0] * self.world_size
        for t in self.tables:
            for s in t.shards:
                total[s.rank] += bytes_of(t, s)
        return total

    def check_memory_budget(self) -> None:
        """Checks every rank's memory against :attr:`memory_budget` (if any).

        Raises:
            ValueError: naming the rank furthest over the budget, its largest table and the
                shortfall in bytes.
        """
        if self.memory_budget is not None:
            self._check_budget(TablePlan.shard_memory, self.memory_budget, "tables")

    def check_host_memory(self, budget: MemoryBudget) -> None:
        """Checks every rank's ``host`` tables against ``budget`` (host memory per worker).

        Raises:
            ValueError: naming the rank furthest over it, its largest ``host`` table and the
                shortfall in bytes.
        """
        self._check_budget(TablePlan.shard_host, budget, "host-memory tables")

    def _check_budget(
        self, bytes_of: Callable[[TablePlan, Shard], int], budget: MemoryBudget, what: str
    ) -> None:
        memory = self._per_rank(bytes_of)
        rank = max(range(self.world_size), key=lambda r: memory[r])
        short = memory[rank] - budget.bytes_per_rank
        if short <= 0:
            return
        largest = max(
            (bytes_of(t, s), t.name) for t in self.tables for s in t.shards if s.rank == rank
        )[1]
        raise ValueError(
            f"rank {rank} holds {memory[rank]} bytes of {what} (the largest {largest!r}), "
            f"short by {short} bytes ({format_bytes(short)}); {budget.describe()}"
        )

    def validate(self, tables: Sequence[EmbeddingBagConfig]) -> None:
        """Checks that the plan places exactly ``tables`` on ``world_size`` ranks.

        Args:
            tables: the tables the plan must cover.

        Raises:
            ValueError: naming the table that is missing, planned twice, unknown, of the wrong
                shape, not covered exactly by its shards, or placed on a rank ``>= world_size``.
        """
        if self.world_size <= 0:
            raise ValueError(f"sharding plan world_size must be positive, got {self.world_size}")
        seen: set[str] = set()
        for t in self.tables:
            if t.name in seen:
                raise ValueError(f"table {t.name!r} is planned more than once")
            seen.add(t.name)
        configs = {t.name: t for t in tables}
        for name in configs:
            if name not in seen:
                raise ValueError(f"table {name!r} is not covered by the sharding plan")
        for t in self.tables:
            if t.name not in configs:
                raise ValueError(f"table {t.name!r} in the sharding plan is not a model table")
            cfg = configs[t.name]
            if (t.num_embeddings, t.embedding_dim) != (cfg.num_embeddings, cfg.embedding_dim):
                raise ValueError(
                    f"table {t.name!r}: planned shape ({t.num_embeddings}, {t.embedding_dim}) != "
                    f"model shape ({cfg.num_embeddings}, {cfg.embedding_dim})"
                )
            _check_managed(t, cfg)
            if t.sharding_type not in _SHARDING_TYPES:
                raise ValueError(
                    f"table {t.name!r}: sharding_type {t.sharding_type!r} not in {_SHARDING_TYPES}"
                )
            for s in t.shards:
                if not 0 <= s.rank < self.world_size:
                    raise ValueError(
                        f"table {t.name!r}: shard rank {s.rank} not in [0, {self.world_size})"
                    )
            _check_coverage(t, self.world_size)

    def to_json(self) -> str:
        """The plan as a JSON string (see :meth:`from_json`)."""
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> ShardingPlan:
        """Reads a plan written by :meth:`to_json`."""
        data = json.loads(text)
        tables = [
            TablePlan(**{**t, "shards": [Shard(**s) for s in t["shards"]]}) for t in data["tables"]
        ]
        budget = data.get("memory_budget")  # absent from plans written before budgets
        return cls(
            world_size=data["world_size"],
            tables=tables,
            memory_budget=None if budget is None else MemoryBudget(**budget),
            page_cache_hit=data.get("page_cache_hit"),
            cost_model=data.get("cost_model", "analytic"),
            predicted_seconds=data.get("predicted_seconds"),
        )

    def _memory_cells(self) -> tuple[str, list[str]]:
        """The memory column's header and one cell per rank (against the budget, if any)."""
        memory = [format_bytes(m) for m in self.per_rank_memory()]
        if self.memory_budget is None:
            return "memory", memory
        budget = format_bytes(self.memory_budget.bytes_per_rank)
        return "memory / budget", [f"{m} / {budget}" for m in memory]

    def format_table(self) -> str:
        """A readable per-rank summary: rank, tables, estimated cost and memory (against the
        budget, whose source is the last line, if the plan has one)."""
        costs = self.per_rank_cost()
        memory_header, memory = self._memory_cells()
        tiers = {t.name: t.placement for t in self.tables}
        managed = {t.name for t in self.tables if t.buckets}

        def named(table: str) -> str:
            tags = [tiers[table]] if tiers[table] != "dram" else []
            tags += ["managed"] if table in managed else []
            return f"{table} ({', '.join(tags)})" if tags else table

        disk, host = self.per_rank_disk(), self.per_rank_host()
        rows = [
            (
                str(r),
                ", ".join(named(t) for t in self.tables_on_rank(r)) or "-",
                f"{costs[r]:.4g}",
                memory[r],
                *([format_bytes(host[r])] if any(host) else []),
                *([format_bytes(disk[r])] if any(disk) else []),
            )
            for r in range(self.world_size)
        ]
        cost_header = "est. cost" if self.predicted_seconds is None else "predicted s"
        header = (
            "rank",
            "tables",
            cost_header,
            memory_header,
            *(["host"] if any(host) else []),
            *(["ssd"] if any(disk) else []),
        )
        lines = text_table(header, rows)
        if self.memory_budget is not None:
            lines.append(f"memory {self.memory_budget.describe()}")
        lines.extend(self._tier_lines())
        lines.extend(self._managed_lines())
        return "\n".join(lines)

    def _managed_lines(self) -> list[str]:
        managed = [t for t in self.tables if t.buckets]
        if not managed:
            return []
        tables = ", ".join(
            f"{t.name} ({t.num_embeddings - t.buckets:,} ids in {t.buckets} buckets)"
            for t in managed
        )
        return [
            f"managed ids (a row per id, 32 bytes of id map a row in the memory above): {tables}"
        ]

    def _tier_lines(self) -> list[str]:
        if self.page_cache_hit is None:
            return []
        return [
            f"ssd tables' est. cost includes their disk time, assuming the page cache holds "
            f"{100 * self.page_cache_hit:.0f}% of the rows they touch"
        ]

    def imbalance(self) -> float:
        """Max over mean of the per-rank cost (1.0 is perfectly balanced; the slowest rank sets
        the step time)."""
        costs = self.per_rank_cost()
        mean = sum(costs) / len(costs)
        return max(costs) / mean if mean else 1.0

    def format_summary(self) -> str:
        """A compact summary for many ranks: cost and memory spread, sharding types."""
        costs, memory = self.per_rank_cost(), self.per_rank_memory()
        mean = sum(costs) / len(costs)
        types: dict[str, int] = {}
        for t in self.tables:
            types[t.sharding_type] = types.get(t.sharding_type, 0) + 1
        return "\n".join(
            [
                f"{len(self.tables)} tables on {self.world_size} ranks",
                f"{'est. cost' if self.predicted_seconds is None else 'predicted s'} per rank: "
                f"max {max(costs):.4g}, mean {mean:.4g}, min {min(costs):.4g}"
                f" (max/mean {self.imbalance():.3f})",
                f"memory per rank: max {format_bytes(max(memory))}, mean "
                f"{format_bytes(sum(memory) // len(memory))}, min {format_bytes(min(memory))}",
                *self._budget_lines(max(memory)),
                "tables by sharding type: "
                + ", ".join(f"{k} {v}" for k, v in sorted(types.items())),
                f"shards: {sum(len(t.shards) for t in self.tables)}",
                *self._tier_lines(),
            ]
        )

    def _budget_lines(self, peak: int) -> list[str]:
        if self.memory_budget is None:
            return []
        budget = self.memory_budget.bytes_per_rank
        return [
            f"memory / budget: max {format_bytes(peak)} / {format_bytes(budget)} "
            f"({100 * peak / budget:.1f}%); {self.memory_budget.describe()}"
        ]


def format_bytes(num_bytes: float) -> str:
    """``num_bytes`` in binary units, e.g. ``42.15 MiB``, ``10.77 GiB``."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(num_bytes) >= scale:
            return f"{num_bytes / scale:.2f} {unit}"
    return f"{num_bytes:.0f} B"


def _replica_ranks(ranks: list[int], world_size: int) -> bool:
    """Sorted ``ranks`` are every rank, or the ranks of one host of a topology with hosts of
    ``len(ranks)`` ranks (``raydlrm.sharding.towers``: ``h * L`` to ``(h + 1) * L - 1``)."""
    size = len(ranks)
    return (
        size > 0
        and world_size % size == 0
        and ranks[0] % size == 0
        and ranks == list(range(ranks[0], ranks[0] + size))
    )


def managed_mismatches(saved: ShardingPlan, ours: ShardingPlan) -> list[str]:
    """What a resume or warm start from a checkpoint planned ``saved`` cannot change about
    managed tables: a table hashed there and managed here or the reverse (hashed rows hold no
    ids; a managed table's rows are not where the hash puts ids), another bucket layout, or a
    smaller probe window (the ids placed past it would not be found: they would take fresh
    rows, their learned ones lost)."""
    theirs = {t.name: t for t in saved.tables}
    out = []
    for t in ours.tables:
        old = theirs.get(t.name)
        if old is not None and old.buckets and t.buckets and _probed(t) < _probed(old):
            out.append(
                f"table {t.name!r} placed its ids within probe windows of {_probed(old)} rows "
                f"in the checkpoint, data.managed_ids.{t.name}.probe_window is "
                f"{t.probe_window}: the ids placed past it would not be found (they would take "
                f"fresh rows); keep it at {_probed(old)} or more"
            )
        buckets = None if old is None else old.buckets
        if buckets is None or buckets == t.buckets:
            continue
        if not buckets:
            out.append(
                f"table {t.name!r} is hashed in the checkpoint but managed (data.managed_ids) in "
                "the config: its rows hold no ids to carry over; train it from scratch or keep "
                "it hashed"
            )
        elif not t.buckets:
            out.append(
                f"table {t.name!r} is managed in the checkpoint but hashed in the config (add "
                f"data.managed_ids.{t.name})"
            )
        else:
            out.append(
                f"table {t.name!r} is managed with {buckets} id-map buckets in the checkpoint, "
                f"{t.buckets} in the config (data.managed_ids.{t.name}.buckets)"
            )
    return out


def _probed(t: TablePlan) -> int:
    """Rows of a managed table's buckets an id may sit in from its home row: its probe window,
    at most its largest bucket's slots (a wider window wraps around the bucket)."""
    return min(t.probe_window, -(-t.num_embeddings // t.buckets) - 1)


def _check_managed(t: TablePlan, cfg: EmbeddingBagConfig) -> None:
    """A managed table is planned with its buckets, never replicated, and its shards' rows
    fall on bucket bounds (so one rank decides each id's row)."""
    buckets = cfg.managed.buckets_for(cfg.num_embeddings) if cfg.managed is not None else 0
    if t.buckets != buckets:
        raise ValueError(
            f"table {t.name!r}: planned with {t.buckets} id-map buckets, the table has {buckets} "
            "(0: hashed); plan it again"
        )
    if not buckets:
        return
    if t.sharding_type == "data_parallel":
        raise ValueError(
            f"table {t.name!r}: a managed table cannot be data_parallel (each replica would "
            "decide rows for its own ids); pin another sharding type"
        )
    bounds = set(bucket_bounds(t.num_embeddings, buckets))
    for s in t.shards:
        if s.row_start not in bounds or s.row_end not in bounds:
            raise ValueError(
                f"table {t.name!r}: shard rows [{s.row_start}, {s.row_end}) do not fall on the "
                f"bounds of its {buckets} id-map buckets"
            )


def _check_coverage(t: TablePlan, world_size: int) -> None:
    """Every cell of the table is owned by exactly one shard (or, for data-parallel, every rank
    holds a full replica), in the shape the sharding type implies."""
    full = (0, t.num_embeddings, 0, t.embedding_dim)
    rects = [(s.row_start, s.row_end, s.col_start, s.col_end) for s in t.shards]
    ranks = [s.rank for s in t.shards]
    if t.sharding_type == "data_parallel":
        if not _replica_ranks(sorted(ranks), world_size) or any(r != full for r in rects):
            raise ValueError(
                f"table {t.name!r}: data_parallel needs one full-table shard on every rank "
                f"0..{world_size - 1} (or on every rank of one host, for towers), got shards "
                f"{t.shards}"
            )
        return
    if t.sharding_type == "table_wise" and len(t.shards) != 1:
        raise ValueError(
            f"table {t.name!r}: table_wise needs exactly one shard, got {len(t.shards)} "
            "(covered twice or not at all)"
        )
    if not t.shards:
        raise ValueError(f"table {t.name!r}: {t.sharding_type} has no shards (not covered)")
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"table {t.name!r}: more than one shard on one rank: {ranks}")
    for s in t.shards:
        if not (0 <= s.row_start < s.row_end <= t.num_embeddings) or not (
            0 <= s.col_start < s.col_end <= t.embedding_dim
        ):
            raise ValueError(
                f"table {t.name!r}: shard rows [{s.row_start}, {s.row_end}) x cols "
                f"[{s.col_start}, {s.col_end}) is empty or outside the table {full}"
            )
        if (s.col_end - s.col_start) % 4:
            raise ValueError(
                f"table {t.name!r}: shard columns [{s.col_start}, {s.col_end}) are not a "
                "multiple of 4 wide"
            )
    if t.sharding_type != "column_wise" and any(
        (s.col_start, s.col_end) != (0, t.embedding_dim) for s in t.shards
    ):
        raise ValueError(
            f"table {t.name!r}: {t.sharding_type} shards must span all columns "
            "(so the shards do not cover the table as the type requires)"
        )
    if t.sharding_type not in _ROW_SPLIT_TYPES and any(
        (s.row_start, s.row_end) != (0, t.num_embeddings) for s in t.shards
    ):
        raise ValueError(
            f"table {t.name!r}: {t.sharding_type} shards must span all rows "
            "(so the shards do not cover the table as the type requires)"
        )
    # Column ranges tile [0, D); inside each, row ranges tile [0, N).
    columns = sorted({(s.col_start, s.col_end) for s in t.shards})
    _check_tiling(t.name, "columns", columns, t.embedding_dim)
    for lo, hi in columns:
        rows = sorted(
            (s.row_start, s.row_end) for s in t.shards if (s.col_start, s.col_end) == (lo, hi)
        )
        _check_tiling(t.name, f"rows of columns [{lo}, {hi})", rows, t.num_embeddings)


def _check_tiling(name: str, what: str, ranges: list[tuple[int, int]], size: int) -> None:
    end = 0
    for lo, hi in ranges:
        if lo != end:
            problem = "covered twice" if lo < end else "not covered"
            raise ValueError(
                f"table {name!r}: {what} [{min(lo, end)}, {max(lo, end)}) {problem}; "
                f"the shards do not cover the table exactly"
            )
        end = hi
    if end != size:
        raise ValueError(
            f"table {name!r}: {what} [{end}, {size}) not covered; the shards do not cover the table"
        )
