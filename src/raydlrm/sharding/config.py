"""Configuration of how embedding tables are sharded and optimized."""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Literal

from raydlrm._config import config_dataclass

ShardingType = Literal["table_wise", "data_parallel", "row_wise", "column_wise", "table_row_wise"]
"""How a table is placed.

- ``table_wise``: the whole table on one rank.
- ``data_parallel``: the table replicated on every rank; each rank looks up its own samples.
- ``row_wise``: contiguous row ranges over all (or the pinned) ranks; partial sums reduced.
- ``column_wise``: the embedding dim split into column shards (multiples of 4, possibly uneven),
  each placed like a table-wise table; outputs concatenated.
- ``table_row_wise``: row-wise inside one group of ``group_size`` consecutive ranks (a node),
  table-wise across groups.
"""

Kernel = Literal["auto", "fbgemm", "torch"]
"""``sharding.kernel``: the embedding kernels (see :mod:`raydlrm.sharding.kernel`)."""

EmbeddingOptimizer = Literal["rowwise_adagrad", "adagrad", "sgd"]

CommPrecision = Literal["fp32", "fp16", "bf16", "fp8", "int8", "mx4"]
"""Precision of the pooled embeddings and their gradients on the wire (see
:mod:`raydlrm.sharding.codecs`): ``fp32`` is uncompressed; ``mx4`` is OCP MX FP4 (4-bit values,
an 8-bit power-of-two scale per 32)."""

Placement = Literal["dram", "ssd", "host"]
"""Where a table's weights live (see :mod:`raydlrm.sharding.tiers`):

- ``dram``: in the worker's memory (a GPU worker's: its GPU memory).
- ``ssd``: in a file on local disk (``sharding.ssd_path``), read and updated in place through
  the operating system's page cache: DRAM holds the hot rows, the disk the rest (CPU workers).
- ``host``: a GPU worker's table in its host's pinned memory, trained through a row cache in
  GPU memory (``sharding.cache_load_factor`` of its rows; :mod:`raydlrm.sharding.row_cache`):
  the "UVM caching" tier of the Neo paper, for tables larger than the GPU's memory. On a CPU
  job (no ``scaling.use_gpu``) a ``host`` table is planned ``dram``, with a warning.
"""

WeightsPrecision = Literal["fp32", "fp16", "int8", "int4"]
"""Precision of the embedding table weights held by each rank; the kernels train ``fp16``
weights with fp32 optimizer state. ``int8`` / ``int4`` rows are stored row-wise quantized
(:mod:`raydlrm.sharding.quantized`) and trained in fp32 through a cache of the rows in use
(``sharding.cache_load_factor``; :mod:`raydlrm.sharding.row_cache`)."""

QUANTIZED: tuple[str, ...] = ("int8", "int4")
"""The quantized weights precisions (trained through an fp32 cache; their bits:
:data:`raydlrm.models.quantized.QUANTIZED_BITS`). This module imports no torch, so that a config
is checked before torch loads."""


CacheKind = Literal["quantized", "host", "ssd"]
"""The kinds of table that train through a row cache (:meth:`ShardingConfig.cache_kind`)."""

RETIRED_KEYS: dict[str, str] = {
    "ssd_cache_load_factor": (
        "sharding.cache_load_factor (per table: sharding.cache_load_factor_per_table)"
    ),
    "ssd_cache_min_rows": "sharding.cache_min_rows",
}
"""``[sharding]`` keys a release retired -> the keys that replaced them. A config that sets one
is refused, naming its replacement (``raydlrm.platform.config``); a config stored before (a
model's or checkpoint's ``spec.json``) is read without them
(:meth:`raydlrm.trainers.spec.WorkerSpec.stored`). The ``ssd`` row cache keys became the one
family that sizes every row cache (``ssd``, ``host``, quantized)."""

CACHE_DEFAULTS: dict[str, tuple[float, int]] = {
    "quantized": (0.05, 1),
    "host": (0.05, 1),
    "ssd": (0.2, 65536),
}
"""Kind -> (``cache_load_factor``, ``cache_min_rows``) of its row caches when the keys are
unset. An fp32 / fp16 ``ssd`` cache is in DRAM, where 65,536 rows cost little; the other caches
are in GPU memory (``host``) or beside rows a quarter or an eighth their size (quantized), and
already hold the most rows a step looks up when the data says it."""

_CACHE_KIND_NAMES = {
    "quantized": "int8 / int4 tables",
    "host": "host tables",
    "ssd": "fp32 / fp16 ssd tables",
}


@dataclasses.dataclass(frozen=True)
class CacheSizing:
    """How one table's row cache is sized (:meth:`ShardingConfig.cache_sizing`)."""

    load_factor: float
    """Share of each shard's rows the cache holds (0: no cache)."""
    min_rows: int
    """Fewest rows of each shard's cache."""
    keys: str
    """The keys that set them, with their values, for an error or a warning about this cache."""


def _no_cache_error(key: str, who: str, kind: str) -> ValueError:
    return ValueError(
        f"{key} = 0 (no row cache) is for fp32 / fp16 ssd tables; {who} train"
        f"{'s' if who.startswith('table ') else ''} through a row cache "
        f"({_CACHE_KIND_NAMES[kind]}): set it in (0, 1]"
    )


@config_dataclass
class ShardingConfig:
    """Sharding plan inputs and the fused sparse optimizer."""

    default_type: ShardingType | Literal["auto"] = "table_wise"
    """Sharding type of every table not pinned in ``pinned_types``; ``auto`` starts table-wise and
    lets the planner split hot or large tables row-wise or column-wise."""
    pinned_types: dict[str, ShardingType] = field(default_factory=dict)
    """Table name -> sharding type, overriding the planner."""
    pinned_ranks: dict[str, list[int]] = field(default_factory=dict)
    """Table name -> ranks the table must be placed on."""
    group_size: int | None = None
    """Ranks per group (node) for ``table_row_wise`` tables; None means all ranks are one group.
    In a job it is the topology's host (``scaling.ranks_per_host``, the same concept): the job
    sets it from :meth:`raydlrm.platform.config.JobConfig.topology`."""
    device_memory_bytes: int | None = None
    """Bytes of embedding weights plus optimizer state one rank may hold (the planner rejects a
    plan that does not fit); None: as ``memory_budget`` says."""
    memory_budget: Literal["auto", "off"] = "auto"
    """The per-rank memory budget when ``device_memory_bytes`` is unset. ``auto``: the job
    (``raydlrm train``, ``raydlrm plan``) derives it from what each worker has:
    ``scaling.resources_per_worker.memory`` when set, else the planning machine's memory divided
    by ``scaling.num_workers`` (a local Ray cluster runs every worker there), less
    ``worker_overhead_bytes``; GPU workers and a remote cluster (``ray.address``,
    ``$RAY_ADDRESS``) get no derived budget, with a warning. ``off``: no budget (then
    ``device_memory_bytes`` must be unset)."""
    worker_overhead_bytes: int = 2**30
    """Bytes of each worker's memory the ``auto`` budget keeps from the embedding tables: the
    dense model and its optimizer, batches in flight, the Ray and torch runtime."""
    cost_constants_path: str = "~/.cache/raydlrm/cost_constants.json"
    """Cost-model constants written by ``raydlrm plan --calibrate``; used when the file exists."""
    cost_samples_path: str = "~/.cache/raydlrm/cost_samples"
    """Directory of the measured cost samples ``raydlrm plan --collect N`` adds to (one Parquet
    file a collection; see :mod:`raydlrm.sharding.planner.learned_cost`)."""
    learned_cost_path: str = "~/.cache/raydlrm/learned_cost.json"
    """The learned cost model ``raydlrm plan --train-cost-model`` writes (and a ``.safetensors``
    file beside it)."""
    cost_model: Literal["analytic", "neural", "auto"] = "analytic"
    """The cost model the planner searches with. ``analytic``: a rank's cost is the sum of its
    tables' (:mod:`raydlrm.sharding.planner.cost`, with ``cost_constants_path``). ``neural``: the
    learned model at ``learned_cost_path`` (NeuroShard: a rank's set of tables costed at once,
    from the data's pooling factors and access histograms; greedy-grid and beam search, see
    :mod:`raydlrm.sharding.planner.neural_search`); an error when it is missing or was trained for
    another kernel or batch size. ``auto``: the learned model when it can be used, else the
    analytic one with a warning naming why."""
    kernel: Kernel = "auto"
    """Embedding kernels (see :mod:`raydlrm.sharding.kernel`): ``fbgemm`` (fbgemm-gpu's
    table-batched embeddings, the fast path; needs the ``cpu`` or ``gpu`` extra), ``torch``
    (the same lookups and fused optimizers in PyTorch operators: any device, no fbgemm) or
    ``auto`` (fbgemm when it imports and matches torch, else torch with a warning)."""
    optimizer: EmbeddingOptimizer = "rowwise_adagrad"
    """Fused optimizer applied to embedding rows in the backward pass."""
    learning_rate: float = 0.05
    """Learning rate of the fused embedding optimizer."""
    eps: float = 1e-8
    """Epsilon of the (row-wise) Adagrad update."""
    comm_precision: CommPrecision = "fp32"
    """Codec of the pooled-output all-to-all, forward and backward, of every table."""
    comm_precision_per_table: dict[str, CommPrecision] = field(default_factory=dict)
    """Table name -> codec, overriding ``comm_precision`` for that table."""
    weights_precision: WeightsPrecision = "fp32"
    """Precision of the embedding table weights (optimizer state stays fp32)."""
    weights_precision_per_table: dict[str, WeightsPrecision] = field(default_factory=dict)
    """Table name -> weights precision, overriding ``weights_precision`` for that table."""
    cache_load_factor: float | None = None
    """Share of each cached table shard's rows its row cache holds (see
    :mod:`raydlrm.sharding.row_cache`; at least ``cache_min_rows`` and the most rows a step
    looks up, at most the whole shard). Three kinds of table train through such a cache: an
    ``int8`` / ``int4`` table (any placement) through an fp32 cache in its tier's memory, into
    which a looked-up row is dequantized and from which it is quantized back (stochastic
    rounding) when evicted; a ``host`` table through a cache in GPU memory in front of its rows
    in host memory; an fp32 / fp16 ``ssd`` table through a DRAM cache in front of its file. The
    kernels train on the cache, which evicts the least recently used rows. One step's distinct
    rows of a shard must fit. ``0``: no cache, for fp32 / fp16 ``ssd`` tables only (the
    kernels update the mapped file in place, the page cache alone keeps the hot rows). Unset:
    per kind, :data:`CACHE_DEFAULTS` (0.05 for ``int8`` / ``int4`` and ``host`` tables, 0.2
    for ``ssd`` ones)."""
    cache_load_factor_per_table: dict[str, float] = field(default_factory=dict)
    """Table name -> ``cache_load_factor`` for that table."""
    cache_min_rows: int | None = None
    """Fewest rows of each cached table shard's row cache (at most the whole shard). Unset:
    per kind, :data:`CACHE_DEFAULTS` (65,536 for fp32 / fp16 ``ssd`` tables, 1 for ``int8`` /
    ``int4`` and ``host`` ones)."""
    default_placement: Placement | Literal["auto"] = "dram"
    """Where every table not named in ``placement`` lives (see :data:`Placement`). ``auto``:
    in DRAM (a GPU worker's memory) while the plan fits the memory budget; when it does not,
    the planner moves tables to ``spill_placement`` until it fits, first those whose steps cost
    the least tier time per byte of memory moved (disk time, or copies between host and GPU;
    from the pooling factors, features, batch size and rows), and costs them with that time
    (without a budget: DRAM)."""
    placement: dict[str, Placement | Literal["auto"]] = field(default_factory=dict)
    """Table name -> ``dram``, ``ssd``, ``host`` or ``auto``, overriding
    ``default_placement``."""
    host_memory_bytes: int | None = None
    """Bytes of host memory each worker's ``host`` tables may take (weights and optimizer
    state). Default: the worker's Ray ``memory`` resource, else this machine's memory shared by
    the workers of a local Ray cluster, less ``worker_overhead_bytes`` (unknown on a remote
    cluster: not checked, with a warning). The planner refuses a plan over it, naming the
    table."""
    spill_placement: Literal["auto", "ssd", "host"] = "auto"
    """Where ``auto`` tables go when the plan does not fit the memory budget: ``ssd`` (CPU
    workers' local disk) or ``host`` (GPU workers' host memory, behind their GPU caches);
    ``auto``: ``host`` for a job with ``scaling.use_gpu``, else ``ssd`` (the planner on its
    own, without a job: ``ssd``)."""
    ssd_path: str | None = None
    """Directory of the ``ssd`` tables' files on each worker (local disk; created if missing).
    Default: ``raydlrm-ssd`` in the worker's temporary directory. The files are removed as soon
    as they are mapped, so nothing is left behind, even by a killed worker."""

    def _check_host_tables(self) -> None:
        """Refuses ``host`` tables stored ``int8`` / ``int4``: their rows are already small,
        behind an fp32 cache of their own."""
        names = ["", *self.placement, *self.weights_precision_per_table]
        for name in names:
            placement = self.placement_of(name) if name else self.default_placement
            precision = self.weights_precision_of(name) if name else self.weights_precision
            if placement == "host" and precision in QUANTIZED:
                key = f"placement.{name}" if name in self.placement else "default_placement"
                raise ValueError(
                    f"sharding.{key} = 'host' with {precision} weights"
                    + (f" (table {name!r})" if name else "")
                    + ": quantized tables keep their rows in GPU memory behind their own fp32 "
                    "cache; place them 'dram', or store them fp32 / fp16"
                )

    def spill_tier(self) -> Placement:
        """Where ``auto`` tables go when the plan does not fit (``spill_placement``; ``auto``
        is ``ssd`` here, a GPU job resolves it to ``host``)."""
        return "ssd" if self.spill_placement == "auto" else self.spill_placement

    def placement_of(self, table_name: str) -> Placement | Literal["auto"]:
        """The placement of table ``table_name`` (``auto``: the planner's choice)."""
        return self.placement.get(table_name, self.default_placement)

    def weights_precision_of(self, table_name: str) -> WeightsPrecision:
        """The weights precision of table ``table_name``."""
        return self.weights_precision_per_table.get(table_name, self.weights_precision)

    def cache_kind(self, table_name: str, placement: str | None = None) -> CacheKind | None:
        """Which row cache table ``table_name`` trains through when placed ``placement``
        (default: as configured): ``quantized`` (``int8`` / ``int4``, any placement), ``host``,
        ``ssd`` (fp32 / fp16), or None (in DRAM, or ``auto`` before the planner places it)."""
        if self.weights_precision_of(table_name) in QUANTIZED:
            return "quantized"
        placement = placement or self.placement_of(table_name)
        return placement if placement in ("host", "ssd") else None

    def row_cache(self, table_name: str, placement: str) -> bool:
        """Whether table ``table_name`` placed ``placement`` trains through a row cache: a
        quantized or ``host`` table always, an fp32 / fp16 ``ssd`` one unless its load factor
        is 0."""
        kind = self.cache_kind(table_name, placement)
        return kind is not None and self.cache_sizing(table_name, kind).load_factor > 0

    def cache_sizing(self, table_name: str, kind: CacheKind) -> CacheSizing:
        """How the row cache of table ``table_name`` of kind ``kind`` is sized: its
        ``cache_load_factor`` (the table's own, else the family's, else the kind's default) and
        ``cache_min_rows``, with the keys that set them.

        Raises:
            ValueError: a load factor of 0 (no cache) for a kind that needs a cache, naming the
                key.
        """
        default_factor, default_min = CACHE_DEFAULTS[kind]
        unset = f"unset: {{}} for {_CACHE_KIND_NAMES[kind]}"
        own = self.cache_load_factor_per_table.get(table_name)
        if own is not None:
            factor, key = own, f"sharding.cache_load_factor_per_table.{table_name}"
            factor_keys = f"{key} = {own:g}"
        else:
            factor, key = self.cache_load_factor, "sharding.cache_load_factor"
            if factor is None:
                factor, value = default_factor, unset.format(f"{default_factor:g}")
            else:
                value = f"= {factor:g}"
            factor_keys = f"{key} ({value}; or cache_load_factor_per_table.{table_name})"
        if factor == 0 and kind != "ssd":
            raise _no_cache_error(key, f"table {table_name!r}", kind)
        min_rows = default_min if self.cache_min_rows is None else self.cache_min_rows
        min_keys = "sharding.cache_min_rows " + (
            f"({unset.format(min_rows)})" if self.cache_min_rows is None else f"= {min_rows}"
        )
        return CacheSizing(factor, min_rows, f"{factor_keys} or {min_keys}")

    def _check_caches(self) -> None:
        """Checks the row-cache keys' ranges, and refuses a load factor of 0 (no cache) for the
        tables this config alone says train through a cache that must exist (quantized,
        ``host``; those the planner places are checked as it sizes their caches)."""
        factors = [("cache_load_factor", self.cache_load_factor)]
        factors += [
            (f"cache_load_factor_per_table.{t}", f)
            for t, f in self.cache_load_factor_per_table.items()
        ]
        for key, factor in factors:
            if factor is not None and not 0.0 <= factor <= 1.0:
                raise ValueError(f"sharding.{key} must be in [0, 1], got {factor}")
        if self.cache_min_rows is not None and self.cache_min_rows < 1:
            raise ValueError(f"sharding.cache_min_rows must be positive, got {self.cache_min_rows}")
        kind = "quantized" if self.weights_precision in QUANTIZED else self.default_placement
        if self.cache_load_factor == 0 and kind in ("quantized", "host"):
            raise _no_cache_error("sharding.cache_load_factor", "the tables by default", kind)
        named = {*self.placement, *self.weights_precision_per_table}
        for name in sorted(named | set(self.cache_load_factor_per_table)):
            kind = self.cache_kind(name)
            if kind is not None:
                self.cache_sizing(name, kind)

    def __post_init__(self) -> None:
        if self.learning_rate <= 0:
            raise ValueError(f"sharding.learning_rate must be positive, got {self.learning_rate}")
        if self.eps <= 0:
            raise ValueError(f"sharding.eps must be positive, got {self.eps}")
        if self.group_size is not None and self.group_size <= 0:
            raise ValueError(f"sharding.group_size must be positive, got {self.group_size}")
        if self.device_memory_bytes is not None and self.device_memory_bytes <= 0:
            raise ValueError(
                f"sharding.device_memory_bytes must be positive, got {self.device_memory_bytes}"
            )
        if self.device_memory_bytes is not None and self.memory_budget == "off":
            raise ValueError(
                "sharding.device_memory_bytes is a budget but sharding.memory_budget is 'off': "
                "unset one of them"
            )
        if self.host_memory_bytes is not None and self.host_memory_bytes <= 0:
            raise ValueError(
                f"sharding.host_memory_bytes must be positive, got {self.host_memory_bytes}"
            )
        self._check_host_tables()
        self._check_caches()
        if self.worker_overhead_bytes < 0:
            raise ValueError(
                f"sharding.worker_overhead_bytes must be >= 0, got {self.worker_overhead_bytes}"
            )
        for table, ranks in self.pinned_ranks.items():
            if not ranks or any(r < 0 for r in ranks):
                raise ValueError(f"sharding.pinned_ranks.{table} must be non-negative ranks")
