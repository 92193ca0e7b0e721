"""Configuration of how embedding tables are sharded and optimized."""

from __future__ import annotations

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
    cache_load_factor: float = 0.05
    """Share of each ``int8`` / ``int4`` table shard's rows held in fp32 in the cache the
    kernels train (at least one row): a looked-up row is dequantized into it, trained there in
    fp32 with its optimizer state, and quantized back (stochastic rounding) when the cache
    evicts it, least recently used first. One step's distinct rows of the shard must fit. An
    ``ssd`` quantized table uses this cache in front of its file (not
    ``ssd_cache_load_factor``). A ``host`` table's GPU row cache holds this share of its rows
    (at least the most rows a step looks up) in front of its rows in host memory."""
    cache_load_factor_per_table: dict[str, float] = field(default_factory=dict)
    """Table name -> ``cache_load_factor`` for that table."""
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
    ssd_cache_load_factor: float = 0.2
    """Share of each ``ssd`` table shard's rows held in a DRAM cache in front of its file
    (at least ``ssd_cache_min_rows``, at most the whole shard; see
    :mod:`raydlrm.sharding.row_cache`): the kernels train on the cache, and the file sees only
    the rows the cache evicts (least recently used first). ``0``: no cache; the kernels update
    the mapped file in place and the page cache alone keeps the hot rows."""
    ssd_cache_min_rows: int = 65536
    """Fewest rows of an ``ssd`` table shard's DRAM cache: the distinct ids one step looks up
    in the shard must fit (a step that needs more stops with an error naming the table)."""
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

    def cache_load_factor_of(self, table_name: str) -> float:
        """The ``cache_load_factor`` of table ``table_name`` (used when it is quantized)."""
        return self.cache_load_factor_per_table.get(table_name, self.cache_load_factor)

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
        if not 0.0 <= self.ssd_cache_load_factor <= 1.0:
            raise ValueError(
                "sharding.ssd_cache_load_factor must be in [0, 1], got "
                f"{self.ssd_cache_load_factor}"
            )
        for key, factor in [
            ("cache_load_factor", self.cache_load_factor),
            *(
                (f"cache_load_factor_per_table.{t}", f)
                for t, f in self.cache_load_factor_per_table.items()
            ),
        ]:
            if not 0.0 < factor <= 1.0:
                raise ValueError(f"sharding.{key} must be in (0, 1], got {factor}")
        if self.host_memory_bytes is not None and self.host_memory_bytes <= 0:
            raise ValueError(
                f"sharding.host_memory_bytes must be positive, got {self.host_memory_bytes}"
            )
        self._check_host_tables()
        if self.ssd_cache_min_rows < 1:
            raise ValueError(
                f"sharding.ssd_cache_min_rows must be positive, got {self.ssd_cache_min_rows}"
            )
        if self.worker_overhead_bytes < 0:
            raise ValueError(
                f"sharding.worker_overhead_bytes must be >= 0, got {self.worker_overhead_bytes}"
            )
        for table, ranks in self.pinned_ranks.items():
            if not ranks or any(r < 0 for r in ranks):
                raise ValueError(f"sharding.pinned_ranks.{table} must be non-negative ranks")
