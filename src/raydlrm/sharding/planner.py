"""The planner: greedy placement, then refinement moves, swaps and splits.

Each table gets a cost (estimated seconds per step from :mod:`raydlrm.sharding.cost`) and a
memory size (weights plus fused optimizer state); a shard is charged ``1 / k`` of its table's
cost. The search, deterministic for the same inputs (tables are ordered by cost, then name):

1. **Greedy**: tables largest cost first (pinned-rank tables before the rest) on the least-loaded
   allowed rank(s) with room in the memory budget (``memory_budget``, else
   ``sharding.device_memory_bytes``; each table's weights counted at its weights precision).
   A table's sharding type (``config.default_type`` unless pinned) decides its shards:

   - ``table_wise``: one shard on the least-loaded allowed rank;
   - ``data_parallel``: a full replica on every rank (pinning its ranks is an error);
   - ``column_wise``: ``min(allowed ranks, dim / 4)`` column shards, widths multiples of 4 as
     even as possible, on the least-loaded allowed ranks;
   - ``row_wise``: contiguous, near-equal row ranges over the allowed ranks in rank order;
   - ``table_row_wise``: row-wise over the least-loaded group of ``group_size`` consecutive
     ranks whose ranks are all allowed.

   With ``default_type = "auto"`` an unpinned table starts table-wise; one too large for any
   rank is split row-wise over the fewest ranks that hold it.
2. **Refinement** (``search="refine"``): while the most-loaded rank has a table-wise table
   (without pinned ranks) whose move to another rank, or swap with a cheaper table there,
   lowers the pair's maximum below the current maximum, do the best such move. Candidates are
   scored with numpy over all ranks and tables at once.
3. **Splitting** (``default_type = "auto"`` only): the unpinned table-wise tables on the
   most-loaded rank are tried row-wise and column-wise over 2, 4, 8, ... of the least-loaded
   ranks; the split that lowers the maximum of the ranks it touches the most (below the
   current maximum) is kept, then refinement runs again.

The maximum per-rank cost never increases after the greedy placement.

Tables placed ``auto`` start in DRAM and go to the SSD tier one by one while the plan does not
fit the memory budget. A table of a dedup group (RecD) is costed on the unique rows of a step,
``batch_size / dedup_ratios[table]``: deduplicated and plain features share the same collectives,
so one balance over all tables is what every step waits for.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

import numpy as np

from raydlrm.models.embedding import EmbeddingBagConfig
from raydlrm.sharding.config import QUANTIZED, ShardingConfig
from raydlrm.sharding.cost import (
    CostConstants,
    cache_rows,
    estimate_table_cost,
    expected_distinct_rows,
    quantized_cache_rows,
    table_disk_bytes,
    table_memory_bytes,
    wire_bytes_per_vector,
)
from raydlrm.sharding.plan import MemoryBudget, Shard, ShardingPlan, TablePlan, format_bytes

if TYPE_CHECKING:
    from raydlrm.sharding.learned_cost import LearnedCostModel, TableStats
    from raydlrm.sharding.neural_search import SearchResult

__all__ = [
    "DEFAULT_BATCH_SIZE",
    "BudgetError",
    "check_table_names",
    "page_cache_hit",
    "plan_sharding",
    "table_cost",
]

logger = logging.getLogger(__name__)

DEFAULT_BATCH_SIZE = 512
"""Global samples per step the planner's costs assume unless told."""
_SPLIT_TYPES = ("row_wise", "column_wise")
_SEARCH_TYPES = ("auto", "table_wise", "column_wise")


def table_cost(
    table: EmbeddingBagConfig,
    *,
    pooling_factor: float = 1.0,
    batch_size: int = DEFAULT_BATCH_SIZE,
    constants: CostConstants | None = None,
) -> float:
    """Estimated seconds per step of ``table`` placed table-wise (see :mod:`.cost`).

    Args:
        table: the table.
        pooling_factor: average ids per bag of each of the table's features.
        batch_size: global samples per step.
        constants: cost-model constants (defaults if None).
    """
    return estimate_table_cost(
        table,
        sharding_type="table_wise",
        num_shards=1,
        world_size=1,
        batch_size=batch_size,
        pooling_factor=pooling_factor,
        constants=constants,
    ).seconds


def check_table_names(
    tables: Sequence[EmbeddingBagConfig],
    *,
    config: ShardingConfig,
    pooling_factors: dict[str, float] | None = None,
    dedup_ratios: dict[str, float] | None = None,
) -> None:
    """Checks that the per-table settings of ``config`` (and ``pooling_factors``,
    ``dedup_ratios``) name tables.

    Raises:
        ValueError: naming the dotted key and its unknown tables.
    """
    names = {t.name for t in tables}
    for what, keys in (
        ("sharding.pinned_ranks", config.pinned_ranks),
        ("sharding.pinned_types", config.pinned_types),
        ("sharding.weights_precision_per_table", config.weights_precision_per_table),
        ("sharding.cache_load_factor_per_table", config.cache_load_factor_per_table),
        ("sharding.placement", config.placement),
        ("pooling_factors", pooling_factors or {}),
        ("dedup_ratios", dedup_ratios or {}),
    ):
        unknown = sorted(set(keys) - names)
        if unknown:
            raise ValueError(f"{what} names unknown tables {unknown} (tables: {sorted(names)})")


class BudgetError(ValueError):
    """The tables do not fit the memory budget (the message names a table, a rank and the
    shortfall)."""


def plan_sharding(
    tables: Sequence[EmbeddingBagConfig],
    *,
    world_size: int,
    config: ShardingConfig,
    pooling_factors: dict[str, float] | None = None,
    batch_size: int = DEFAULT_BATCH_SIZE,
    constants: CostConstants | None = None,
    search: Literal["greedy", "refine"] = "refine",
    memory_budget: MemoryBudget | None = None,
    dedup_ratios: dict[str, float] | None = None,
    learned: LearnedCostModel | None = None,
    table_stats: dict[str, TableStats] | None = None,
    max_bag_sizes: dict[str, int] | None = None,
) -> ShardingPlan:
    """Places every table on ranks, balancing the per-rank cost within the memory budget.

    Args:
        tables: the model's tables.
        world_size: number of ranks.
        config: sharding types, pinned ranks, capacity, precisions and the optimizer.
        pooling_factors: table name -> average ids per bag (default 1.0 for every table).
        batch_size: global samples per step the costs assume.
        constants: cost-model constants (defaults if None).
        search: ``greedy`` placement only, or ``refine`` it (moves, swaps, splits).
        memory_budget: bytes a rank may hold; default: ``config.device_memory_bytes``, if set.
        dedup_ratios: table name -> samples per unique row of its dedup group in a batch
            (RecD; default 1.0): its lookups and bytes are counted on ``batch_size / ratio``.
        learned: a learned cost model: the tables it can place (:meth:`_Planner.neural`)
            are placed by NeuroShard's search (:mod:`.neural_search`), not steps 1-3.
        table_stats: table name -> its :class:`~.learned_cost.TableStats` for ``learned``
            (default: its ids looked up uniformly, ``pooling_factors`` a bag).
        max_bag_sizes: table name -> the most ids a sample looks up in it (``step_rows``).

    Returns:
        A validated plan for ``tables`` on ``world_size`` ranks, recording the budget.

    Raises:
        ValueError: a non-positive world size; or naming a per-table setting of an unknown
            table, a ratio below 1, a pinned rank ``>= world_size``, a ``group_size`` not
            dividing it, or a table that does not fit the budget (rank, shortfall, source).
    """
    if memory_budget is None and config.device_memory_bytes is not None:
        memory_budget = MemoryBudget(config.device_memory_bytes, "sharding.device_memory_bytes")
    request = _Request(
        tables=tables,
        world_size=world_size,
        config=config,
        pooling_factors=pooling_factors or {},
        batch_size=batch_size,
        constants=constants or CostConstants(),
        search=search,
        memory_budget=memory_budget,
        dedup_ratios=dedup_ratios or {},
        learned=learned,
        table_stats=table_stats or {},
        max_bag_sizes=max_bag_sizes or {},
    )
    _check_arguments(request)
    return _placed(_plan_spilling(request), request)


def _placed(plan: ShardingPlan, request: _Request) -> ShardingPlan:
    """``plan`` with the most rows a step looks each table up for, once warned of the caches
    that hold whole tables or may be short of a step's rows."""
    for table in plan.tables:
        table.step_rows = request.step_rows(table.name)
    _warn_whole_table_caches(plan, request.config)
    _warn_small_quantized_caches(plan, request)
    return plan


def _warn_small_quantized_caches(plan: ShardingPlan, request: _Request) -> None:
    """Warns, in one line, of the quantized tables planned without the most rows a step can
    look up (:attr:`~.plan.TablePlan.step_rows`, from the data) whose fp32 cache is smaller
    than the distinct rows a step would look up in a shard were its ids uniform (the most it
    can touch; skewed ids touch fewer): a step that does need more slots stops with an error
    naming the table."""
    config = request.config
    configs = {t.name: t for t in request.tables}
    short = []  # (shortfall, table, distinct rows, shard rows, slots)
    for table in plan.tables:
        if config.weights_precision_of(table.name) not in QUANTIZED or table.step_rows:
            continue  # a cache of the most rows a step looks up holds every step
        t = configs[table.name]
        ids = request.rows(t.name) * request.pooling_factors.get(t.name, 1.0)
        ids *= len(t.feature_names)
        for s in table.shards:
            rows = s.row_end - s.row_start
            touched = expected_distinct_rows(rows, ids * rows / t.num_embeddings)
            slots = quantized_cache_rows(rows, load_factor=config.cache_load_factor_of(t.name))
            if touched > slots:
                short.append((touched / slots, t.name, touched, rows, slots))
                break
    if short:
        _, name, touched, rows, slots = max(short)
        logger.warning(
            "quantized tables %s: a step may look up more distinct rows of a shard than their "
            "fp32 cache holds if the ids are uniform (table %s: about %d of a %d-row shard, "
            "%d slots); a step that needs more stops with an error: raise "
            "sharding.cache_load_factor (or cache_load_factor_per_table) unless the ids are "
            "skewed",
            sorted(n for _, n, *_ in short),
            name,
            touched,
            rows,
            slots,
        )


def _warn_whole_table_caches(plan: ShardingPlan, config: ShardingConfig) -> None:
    """Warns of ``ssd`` tables whose DRAM row cache holds every row of a shard: such a table
    takes more memory than in DRAM (the cache plus the mapped file), for nothing."""
    for table in plan.tables:
        if table.placement != "ssd" or config.weights_precision_of(table.name) in QUANTIZED:
            continue
        rows = min(s.row_end - s.row_start for s in table.shards)
        cached = cache_rows(
            rows, load_factor=config.ssd_cache_load_factor, min_rows=config.ssd_cache_min_rows
        )
        if cached >= rows:
            logger.warning(
                "table %s on ssd: its DRAM row cache holds all %d rows of a shard "
                "(sharding.ssd_cache_min_rows = %d, ssd_cache_load_factor = %g), so it takes "
                "more memory than in DRAM; lower sharding.ssd_cache_min_rows, or keep the "
                "table in DRAM",
                table.name,
                rows,
                config.ssd_cache_min_rows,
                config.ssd_cache_load_factor,
            )


@dataclasses.dataclass(frozen=True)
class _Request:
    """The arguments of a :func:`plan_sharding` call, checked, with their defaults filled in."""

    tables: Sequence[EmbeddingBagConfig]
    world_size: int
    config: ShardingConfig
    pooling_factors: dict[str, float]
    batch_size: int
    constants: CostConstants
    search: Literal["greedy", "refine"]
    memory_budget: MemoryBudget | None
    dedup_ratios: dict[str, float]
    learned: LearnedCostModel | None = None
    table_stats: dict[str, TableStats] = dataclasses.field(default_factory=dict)
    max_bag_sizes: dict[str, int] = dataclasses.field(default_factory=dict)

    def rows(self, table: str) -> float:
        """Rows a step looks ``table`` up for: samples, or unique rows of a dedup group."""
        return self.batch_size / self.dedup_ratios.get(table, 1.0)

    def step_rows(self, table: str) -> int:
        """The most rows of ``table`` a step can look up (0: unknown)."""
        return self.batch_size * self.max_bag_sizes.get(table, 0)


def _check_arguments(request: _Request) -> None:
    """The checks of :func:`plan_sharding`'s arguments against each other (see its ``Raises``)."""
    tables, world_size, config = request.tables, request.world_size, request.config
    if world_size <= 0:
        raise ValueError(f"world_size must be positive, got {world_size}")
    check_table_names(
        tables,
        config=config,
        pooling_factors=request.pooling_factors,
        dedup_ratios=request.dedup_ratios,
    )
    low = {k: v for k, v in request.dedup_ratios.items() if not v >= 1}
    if low:
        raise ValueError(f"dedup_ratios below 1 (samples per unique row): {low}")
    for name, ranks in config.pinned_ranks.items():
        bad = [r for r in ranks if r >= world_size]
        if bad:
            raise ValueError(f"sharding.pinned_ranks.{name}: ranks {bad} not in [0, {world_size})")
        if config.pinned_types.get(name, config.default_type) == "data_parallel" and sorted(
            set(ranks)
        ) != list(range(world_size)):
            raise ValueError(
                f"sharding.pinned_ranks.{name}: a data_parallel table is on every rank, "
                f"cannot pin it to {ranks}"
            )
    group_size = config.group_size or world_size
    if world_size % group_size:
        raise ValueError(
            f"sharding.group_size {group_size} does not divide the world size {world_size}"
        )


def _plan_spilling(request: _Request) -> ShardingPlan:
    """The plan of ``request`` with its ``auto`` tables in DRAM or, while that does not fit the
    budget, with one more of them on SSD at a time, in :func:`_spill_order`."""
    config = request.config
    placement = {t.name: config.placement_of(t.name) for t in request.tables}
    auto = [t for t in request.tables if placement[t.name] == "auto"]
    placement.update(dict.fromkeys((t.name for t in auto), "dram"))
    spill = _spill_order(auto, request=request)
    while True:
        placed = dataclasses.replace(config, default_placement="dram", placement=placement)
        try:
            return _plan(request, config=placed)
        except BudgetError:
            if request.memory_budget is None or not spill:
                raise
            placement = {**placement, spill.pop(0).name: "ssd"}


def _spill_order(
    tables: Sequence[EmbeddingBagConfig], *, request: _Request
) -> list[EmbeddingBagConfig]:
    """The order in which ``tables`` (placed ``auto``) go to SSD: those whose steps touch the
    fewest rows on disk per byte of memory freed first (the least disk time per byte)."""
    config = request.config
    keyed = []
    for t in tables:
        step_rows = request.step_rows(t.name)
        freed = _memory_bytes(t, config, "dram", step_rows) - _memory_bytes(
            t, config, "ssd", step_rows
        )
        if freed <= 0:  # smaller than its row cache: it would take more memory on SSD
            continue
        disk_rows = estimate_table_cost(
            t,
            sharding_type="table_wise",
            num_shards=1,
            world_size=request.world_size,
            batch_size=request.rows(t.name),
            pooling_factor=request.pooling_factors.get(t.name, 1.0),
            placement="ssd",
            cache_rows=table_cache_rows(t, config, step_rows=step_rows),
        ).disk_rows
        keyed.append(((disk_rows / freed, t.name), t))
    return [t for _, t in sorted(keyed, key=lambda pair: pair[0])]


def table_cache_rows(
    table: EmbeddingBagConfig, config: ShardingConfig, *, step_rows: int = 0
) -> int:
    """Rows of ``table``'s cache (counted on the whole table): the fp32 cache of a quantized
    table (``cache_load_factor``), else the DRAM row cache it would have on the ``ssd`` tier
    (each shard's has at least ``ssd_cache_min_rows``); either at least ``step_rows``, the
    most rows a step can look up."""
    if config.weights_precision_of(table.name) in QUANTIZED:
        return quantized_cache_rows(
            table.num_embeddings,
            load_factor=config.cache_load_factor_of(table.name),
            step_rows=step_rows,
        )
    return cache_rows(
        table.num_embeddings,
        load_factor=config.ssd_cache_load_factor,
        min_rows=config.ssd_cache_min_rows,
        step_rows=step_rows,
    )


def _memory_bytes(
    t: EmbeddingBagConfig, config: ShardingConfig, placement: str, step_rows: int = 0
) -> int:
    """Worker memory of ``t`` placed ``placement`` (with its row cache on ``ssd``)."""
    return table_memory_bytes(
        t,
        optimizer=config.optimizer,
        weights_precision=config.weights_precision_of(t.name),
        placement=placement,
        cache_rows=table_cache_rows(t, config, step_rows=step_rows),
    )


def _disk_bytes(t: EmbeddingBagConfig, config: ShardingConfig) -> int:
    """Local disk of ``t`` as ``config`` places it (0 in DRAM)."""
    if config.placement_of(t.name) != "ssd":
        return 0
    return table_disk_bytes(
        t, optimizer=config.optimizer, weights_precision=config.weights_precision_of(t.name)
    )


def page_cache_hit(
    tables: Sequence[EmbeddingBagConfig],
    *,
    config: ShardingConfig,
    world_size: int,
    memory_budget: MemoryBudget | None,
) -> float:
    """The fraction of the ``ssd`` tables' touched rows the cost model assumes the page cache
    holds: the budget the ranks leave unused by the tables in DRAM (and the state of the ``ssd``
    ones), over the ``ssd`` tables' bytes on disk, at most 1; with ids drawn uniformly that is
    the chance a row is cached (skewed ids hit more). 0 without a budget (nothing is known of
    the memory), 1 without ``ssd`` tables."""
    on_disk, in_memory = 0, 0
    for t in tables:
        kind = config.pinned_types.get(t.name, config.default_type)
        copies = world_size if kind == "data_parallel" else 1
        on_disk += copies * _disk_bytes(t, config)
        in_memory += copies * _memory_bytes(t, config, config.placement_of(t.name))
    if not on_disk:
        return 1.0
    if memory_budget is None:
        return 0.0
    spare = world_size * memory_budget.bytes_per_rank - in_memory
    return min(max(spare / on_disk, 0.0), 1.0)


def _plan(request: _Request, *, config: ShardingConfig) -> ShardingPlan:
    """The plan of ``request`` with ``config`` (``request.config`` with every table's placement
    decided), or a :class:`BudgetError`."""
    tables, world_size, budget = request.tables, request.world_size, request.memory_budget
    hit = page_cache_hit(tables, config=config, world_size=world_size, memory_budget=budget)
    planner = _Planner(
        request,
        config=config,
        group_size=config.group_size or world_size,
        budget=budget,
        page_cache_hit=hit,
    )
    predicted = None
    if request.learned is not None:
        predicted = planner.neural(request.learned)
    else:
        planner.greedy(planner.order)
        if request.search == "refine":
            planner.refine()
            if config.default_type == "auto":
                planner.split()
    plan = ShardingPlan(
        world_size=world_size,
        tables=[planner.plans[t.name] for t in tables],
        memory_budget=budget,
        page_cache_hit=hit if any(p.placement == "ssd" for p in planner.plans.values()) else None,
        cost_model="analytic" if predicted is None else "learned",
        predicted_seconds=predicted,
    )
    plan.validate(tables)
    return plan


class _Planner:
    """Per-rank cost and memory while tables are placed, moved and split."""

    def __init__(
        self,
        request: _Request,
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
        self._uniform: dict[str, TableStats] = {}  # assumed stats of tables without data
        for t in tables:
            kind = config.pinned_types.get(t.name, config.default_type)
            self.plans[t.name] = TablePlan(
                name=t.name,
                sharding_type="table_wise" if kind == "auto" else kind,
                num_embeddings=t.num_embeddings,
                embedding_dim=t.embedding_dim,
                shards=[],
                memory_bytes=_memory_bytes(
                    t, config, config.placement_of(t.name), request.step_rows(t.name)
                ),
                placement=config.placement_of(t.name),
                disk_bytes=_disk_bytes(t, config),
            )
        for p in self.plans.values():
            p.cost = self._cost(p, "table_wise", 1)
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

    def _cost(self, p: TablePlan, sharding_type: str, num_shards: int) -> float:
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

    def _room(self) -> np.ndarray:
        if self.capacity is None:
            return np.full(self.world_size, np.iinfo(np.int64).max // 2, dtype=np.int64)
        return self.capacity - self.memory

    def _apply(self, p: TablePlan, sign: int) -> None:
        for s in p.shards:
            self.load[s.rank] += sign * p.cost / len(p.shards)
            self.memory[s.rank] += sign * p.shard_memory(s)

    def _too_large(self, p: TablePlan, shards: list[Shard]) -> BudgetError:
        """The error of ``p`` whose ``shards`` do not all fit: names the rank short the most."""
        assert self.budget is not None
        room = self._room()
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
        """Places ``plans`` (in :attr:`order`) one by one (step 1 of the module)."""
        self._check_fits_somewhere(plans)
        for p in plans:
            allowed = sorted(set(self.config.pinned_ranks.get(p.name, range(self.world_size))))
            room = self._room()
            by_load = sorted(allowed, key=lambda r: (self.load[r], self.memory[r], r))
            if p.sharding_type in ("table_wise", "column_wise"):
                parts = 1 if p.sharding_type == "table_wise" else p.embedding_dim // 4
                need = -(-p.memory_bytes // min(parts, len(allowed)))
                fitting = [r for r in by_load if room[r] >= need]
                if p.name in self.auto and not fitting:
                    p.sharding_type, p.shards = "row_wise", self._rows_by_memory(p, by_load)
                    p.cost = self._cost(p, "row_wise", len(p.shards))
                    self._apply(p, +1)
                    continue
                by_load = fitting or by_load
            p.shards = _shards(
                p, by_load=by_load, world_size=self.world_size, group_size=self.group_size
            )
            if p.sharding_type != "table_wise" or len(p.shards) > 1:
                p.cost = self._cost(p, p.sharding_type, len(p.shards))
            if any(p.shard_memory(s) > room[s.rank] for s in p.shards):
                raise self._too_large(p, p.shards)
            self._apply(p, +1)

    def _rows_by_memory(self, p: TablePlan, by_load: list[int]) -> list[Shard]:
        """Row-wise over the fewest ranks (most free memory first) that can hold ``p``."""
        room = self._room()
        freest = sorted(by_load, key=lambda r: (-room[r], r))
        for parts in range(2, min(len(freest), p.num_embeddings) + 1):
            shards = _row_shards(p, freest[:parts])
            if all(p.shard_memory(s) <= room[s.rank] for s in shards):
                return shards
        raise self._too_large(p, _row_shards(p, freest[: min(len(freest), p.num_embeddings)]))

    def _movable(self) -> list[TablePlan]:
        return [
            p
            for p in self.order
            if p.sharding_type == "table_wise" and p.name not in self.config.pinned_ranks
        ]

    def refine(self) -> None:
        """Moves and swaps of table-wise tables off the most-loaded rank while it gets lighter."""
        movable = self._movable()
        if not movable or self.world_size == 1:
            return
        cost = np.array([p.cost for p in movable])
        mem = np.array([p.memory_bytes for p in movable], dtype=np.int64)
        owner = np.array([p.shards[0].rank for p in movable])
        ranks = np.arange(self.world_size)
        for _ in range(20 * len(movable)):
            top = int(np.argmax(self.load))
            peak = self.load[top]
            tol = 1e-12 * peak
            mine = np.flatnonzero(owner == top)
            if mine.size == 0:
                break
            room = self._room()
            # Moves: table i of the top rank to rank r.
            moved = np.maximum(peak - cost[mine, None], self.load[None, :] + cost[mine, None])
            moved[(mem[mine, None] > room[None, :]) | (ranks[None, :] == top)] = np.inf
            i_move, r_move = np.unravel_index(int(np.argmin(moved)), moved.shape)
            best_move = moved[i_move, r_move]
            # Swaps: table i of the top rank with a cheaper table j elsewhere.
            others = np.flatnonzero(owner != top)
            best_swap = np.inf
            if others.size:
                delta = cost[mine, None] - cost[None, others]
                dmem = mem[mine, None] - mem[None, others]
                swapped = np.maximum(peak - delta, self.load[owner[others]][None, :] + delta)
                bad = (delta <= 0) | (dmem > room[owner[others]][None, :]) | (-dmem > room[top])
                swapped[bad] = np.inf
                i_swap, j_swap = np.unravel_index(int(np.argmin(swapped)), swapped.shape)
                best_swap = swapped[i_swap, j_swap]
            if min(best_move, best_swap) >= peak - tol:
                break
            if best_move <= best_swap:
                self._move(movable[mine[i_move]], int(r_move))
                owner[mine[i_move]] = r_move
            else:
                a, b = mine[i_swap], others[j_swap]
                rank_b = int(owner[b])
                self._move(movable[a], rank_b)
                self._move(movable[b], top)
                owner[a], owner[b] = rank_b, top

    def _move(self, p: TablePlan, rank: int) -> None:
        self._apply(p, -1)
        p.shards = [Shard(rank, 0, p.num_embeddings, 0, p.embedding_dim)]
        self._apply(p, +1)

    def split(self) -> None:
        """Splits unpinned table-wise tables of the most-loaded rank while that lowers the max."""
        for _ in range(len(self.auto)):
            top = int(np.argmax(self.load))
            peak = self.load[top]
            candidates = [
                p for p in self._movable() if p.name in self.auto and p.shards[0].rank == top
            ]
            best: tuple[float, int, int, str, TablePlan, list[Shard], float] | None = None
            for p in candidates:
                for kind in _SPLIT_TYPES:
                    limit = p.num_embeddings if kind == "row_wise" else p.embedding_dim // 4
                    parts = 2
                    while parts <= min(limit, self.world_size):
                        trial = self._try_split(p, kind, parts)
                        if trial is not None:
                            new_max, shards, cost = trial
                            key = (new_max, parts, _SPLIT_TYPES.index(kind))
                            if best is None or key < best[:3]:
                                best = (*key, kind, p, shards, cost)
                        parts *= 2
            if best is None or best[0] >= peak * (1 - 1e-12):
                return
            _, _, _, kind, p, shards, cost = best
            self._apply(p, -1)
            p.sharding_type, p.shards, p.cost = kind, shards, cost
            self._apply(p, +1)
            self.refine()

    def _try_split(
        self, p: TablePlan, kind: str, parts: int
    ) -> tuple[float, list[Shard], float] | None:
        """(max cost of the ranks it touches, shards, table cost) of ``p`` split ``kind`` over
        ``parts`` ranks, or None if they have no room."""
        load, room = self.load.copy(), self._room()
        rank = p.shards[0].rank
        load[rank] -= p.cost
        room = room.copy()
        room[rank] += p.memory_bytes
        order = np.lexsort((np.arange(self.world_size), load))
        need = -(-p.memory_bytes // parts)
        ranks = [int(r) for r in order if room[r] >= need][:parts]
        if len(ranks) < parts:
            return None
        trial = TablePlan(p.name, kind, p.num_embeddings, p.embedding_dim, [], 0.0, p.memory_bytes)
        trial.shards = _shards(trial, by_load=ranks, world_size=self.world_size, group_size=1)
        cost = self._cost(p, kind, len(trial.shards))
        for s in trial.shards:
            load[s.rank] += cost / len(trial.shards)
        # The ranks the split changes (other ranks may tie the max and are split next).
        touched = [rank, *(s.rank for s in trial.shards)]
        return float(load[touched].max()), trial.shards, cost

    # --- the learned cost model (NeuroShard) ----------------------------------------------

    def _searchable(self, p: TablePlan) -> bool:
        """Whether the learned search places ``p``: not pinned (rank or type), in DRAM at fp32
        or fp16 (what the model was measured on), ``default_type`` ``auto``, ``table_wise``
        or ``column_wise``, and small enough for one rank's budget (an ``auto`` table that is
        not goes row-wise, as in step 1)."""
        return (
            self.config.default_type in _SEARCH_TYPES
            and p.name not in self.config.pinned_types
            and p.name not in self.config.pinned_ranks
            and p.placement == "dram"
            and self.config.weights_precision_of(p.name) not in QUANTIZED
            and (self.capacity is None or p.memory_bytes <= self.capacity)
        )

    def neural(self, learned: LearnedCostModel) -> list[float]:
        """Places the tables :meth:`_searchable` keeps by NeuroShard's search (column halvings
        unless ``default_type`` is ``table_wise``) around the others, placed first by step 1.
        Returns each rank's predicted seconds (lookups plus transfer)."""
        from raydlrm.sharding.neural_search import NeuralSearch

        free = [p for p in self.order if self._searchable(p)]
        names = {p.name for p in free}
        self.greedy([p for p in self.order if p.name not in names])
        latents, dims = self._rank_load(learned)
        search = NeuralSearch(
            latent=lambda dim: learned.latents([self._features(p, dim) for p in free]),
            head=learned.head_seconds,
            transfer=lambda sums: self._transfer(learned, sums),
            dims=[p.embedding_dim for p in free],
            memory=[p.memory_bytes for p in free],
            base_latent=latents,
            base_dims=dims,
            room=self._room(),
        )
        if free:
            splits = self.config.default_type != "table_wise"
            result = search.column_wise() if splits else search.table_wise()
            if result is None:
                largest = max(free, key=lambda p: (p.memory_bytes, p.name))
                assert self.budget is not None  # without a budget every piece fits
                raise BudgetError(
                    f"the learned search found no placement of {len(free)} tables in the "
                    f"memory left on the ranks (the largest, {largest.name!r}, takes "
                    f"{format_bytes(largest.memory_bytes)}); {self.budget.describe()}"
                )
            self._take(free, result, learned)
        sizes = [len(self.tables_on(r)) for r in range(self.world_size)]
        learned.warn_outside(
            {p.name: self._features(p, p.embedding_dim) for p in free},
            world_size=self.world_size,
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
            self._apply(p, +1)

    def tables_on(self, rank: int) -> list[str]:
        """The tables with a shard on ``rank`` so far."""
        return [p.name for p in self.plans.values() if rank in p.ranks]

    def _stats(self, p: TablePlan) -> TableStats:
        """The table's statistics: the data's, else its ids looked up uniformly with its
        pooling factor (ids per sample over its features) in a batch."""
        from raydlrm.sharding.learned_cost import TableStats

        stats = self.request.table_stats.get(p.name) or self._uniform.get(p.name)
        if stats is None:
            features = len(self.configs[p.name].feature_names)
            pooling = self.request.pooling_factors.get(p.name, 1.0) * features
            stats = TableStats.uniform(
                rows=p.num_embeddings,
                dim=p.embedding_dim,
                pooling=pooling,
                bags=self.request.batch_size,
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
        pooling = stats.pooling * share / self.request.dedup_ratios.get(p.name, 1.0)
        rows = p.num_embeddings if rows is None else rows
        return [math.log10(max(rows, 1)), float(dim), pooling, *stats.histogram]

    def _rank_load(self, learned: LearnedCostModel) -> tuple[np.ndarray, np.ndarray]:
        """The placed shards' latent sums ``(W, L)`` and all-to-all dim sums ``(W,)`` per rank
        (a row-wise shard sends partial sums of the whole width; a replica sends nothing)."""
        features: list[list[list[float]]] = [[] for _ in range(self.world_size)]
        dims = np.zeros(self.world_size)
        for p in self.plans.values():
            for s in p.shards:
                rows = s.row_end - s.row_start
                share = {"data_parallel": 1 / self.world_size}.get(
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
        if self.world_size == 1:
            return np.zeros(dim_sums.shape)
        scale = wire_bytes_per_vector(128, precision=self.config.comm_precision) / (128 * 4)
        dims = np.asarray(dim_sums, dtype=np.float64) * scale
        if learned.comm is not None:
            return learned.comm.predict(dims)
        batch = self.request.batch_size
        values = np.maximum(batch * dims, batch / self.world_size * dims.sum(axis=1, keepdims=True))
        return 2 * 4 * values / self.request.constants.comm_bytes_per_s


def _even_split(total: int, parts: int) -> list[int]:
    """``parts`` sizes summing to ``total``, the first ``total % parts`` one larger."""
    return [total // parts + (i < total % parts) for i in range(parts)]


def _row_shards(p: TablePlan, ranks: list[int]) -> list[Shard]:
    ranks = sorted(ranks)[: p.num_embeddings]
    bounds = [0]
    for size in _even_split(p.num_embeddings, len(ranks)):
        bounds.append(bounds[-1] + size)
    return [
        Shard(r, lo, hi, 0, p.embedding_dim)
        for r, lo, hi in zip(ranks, bounds[:-1], bounds[1:], strict=True)
    ]


def _shards(p: TablePlan, *, by_load: list[int], world_size: int, group_size: int) -> list[Shard]:
    """The shards of ``p`` by its sharding type; ``by_load``: allowed ranks, least loaded first."""
    rows, dim = p.num_embeddings, p.embedding_dim
    if p.sharding_type == "table_wise":
        return [Shard(by_load[0], 0, rows, 0, dim)]
    if p.sharding_type == "data_parallel":
        return [Shard(r, 0, rows, 0, dim) for r in range(world_size)]
    if p.sharding_type == "column_wise":
        widths = [4 * w for w in _even_split(dim // 4, min(len(by_load), dim // 4))]
        starts = [sum(widths[:i]) for i in range(len(widths))]
        return [
            Shard(r, 0, rows, c, c + w) for r, c, w in zip(by_load, starts, widths, strict=False)
        ]
    if p.sharding_type == "row_wise":
        return _row_shards(p, by_load)
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
    return _row_shards(p, group)
