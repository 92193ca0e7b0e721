"""A cost model of one embedding table under one sharding type.

Per training step of ``B`` samples, a table of ``N`` rows and ``D`` columns looked up by ``F``
features with ``L`` ids per bag (the pooling factor), split into ``k`` shards on ``W`` ranks:

- lookup compute: ``F * B * L * D * w`` bytes of rows read, ``w`` the weights' bytes (4 fp32, 2
  fp16; the backward pass touches the same rows; the calibrated throughput, measured on fp32
  rows, covers forward plus backward and is taken as the same for fp16: lookups are
  memory-bound);
- input communication (the ids, 8 bytes each, plus one 4-byte length per bag and shard):
  table-wise sends each id to its one owner, row-wise and table-row-wise to the one row owner
  (lengths go to every shard), column-wise one copy of every id per column shard, data-parallel
  none (each rank looks up its own samples);
- output communication (pooled vectors, each of ``D`` values, at the comm precision, counted
  once: the backward gradients are the same size): table-wise and column-wise ``F * B`` vectors,
  row-wise and table-row-wise ``k`` partial sums of each (looked up per position: each id's one
  row, from its shard), data-parallel none but an all-reduce of the table's gradient
  (``2 (W - 1) N D 4`` bytes);
- memory: weights plus optimizer state, and the caches (:mod:`raydlrm.sharding.sizes`). A
  quantized table's lookups read its fp32 cache (compute as fp32); the cache's fills and
  evictions are not modelled.

Its estimated time is ``compute / lookup_bytes_per_s + comm / comm_bytes_per_s + k *
collective_latency_s`` (each shard takes part in the collectives). A table on the ``ssd`` tier
adds its disk time: each distinct row a step touches (``N (1 - exp(-ids / N))`` of ``ids``
lookups drawn uniformly: the most a step can touch; skewed ids touch fewer) misses the page
cache with probability ``1 - page_cache_hit`` and is then read from disk, and every updated
row's page is written back once (``ssd_row_reads_per_s``, ``ssd_row_writes_per_s``: random 4
KiB pages through a mapped file). Column-wise shards each touch every distinct row;
data-parallel replicas each touch their own samples' rows. The constants come from
:class:`CostConstants`: defaults, or :func:`~raydlrm.sharding.planner.calibration.calibrate` on this
machine (saved as JSON).
The planner charges each shard ``1 / k`` of the table's time.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from raydlrm.models.embedding import EmbeddingBagConfig
from raydlrm.sharding.sizes import (
    FP32_BYTES,
    LOOKUP_BYTES,
    stored_row_bytes,
    table_memory_bytes,
    wire_bytes_per_vector,
    wire_row_overhead,
)

__all__ = [
    "CostConstants",
    "TableCost",
    "estimate_table_cost",
    "expected_distinct_rows",
    "load_constants",
    "save_constants",
    "ssd_seconds_per_row",
]

_ID_BYTES = 8
_LENGTH_BYTES = 4


@dataclass(frozen=True)
class CostConstants:
    """Throughputs and latency that turn bytes into seconds.

    Attributes:
        lookup_bytes_per_s: fp32 embedding bytes read per second by a fused lookup, forward
            plus backward with the optimizer update.
        comm_bytes_per_s: bytes per second of an all-to-all between ranks.
        collective_latency_s: fixed seconds per collective a shard takes part in.
        ssd_row_reads_per_s: rows of an ``ssd`` table read per second when the page cache
            misses them (random 4 KiB pages faulted in from the disk).
        ssd_row_writes_per_s: updated rows of an ``ssd`` table written back per second
            (random dirty 4 KiB pages synced to the disk).
        host_copy_bytes_per_s: bytes per second a ``host`` table's row cache copies between
            host and GPU memory (its misses in, its evictions out; PCIe 4.0 x16 moves about
            25 GB/s each way, a gathered copy less).
        source: where the numbers come from (``default`` or a calibration note).
        device: where the lookups were timed: ``cpu``, or ``cuda`` (GPU workers' tables).
    """

    lookup_bytes_per_s: float = 8e8
    comm_bytes_per_s: float = 5e8
    collective_latency_s: float = 1e-4
    ssd_row_reads_per_s: float = 5e4
    ssd_row_writes_per_s: float = 2e4
    host_copy_bytes_per_s: float = 1e10
    source: str = "default"
    device: str = "cpu"

    def __post_init__(self) -> None:
        for name in (
            "lookup_bytes_per_s",
            "comm_bytes_per_s",
            "ssd_row_reads_per_s",
            "ssd_row_writes_per_s",
            "host_copy_bytes_per_s",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(
                    f"CostConstants.{name} must be positive, got {getattr(self, name)}"
                )
        if self.collective_latency_s < 0:
            raise ValueError(
                f"CostConstants.collective_latency_s must be >= 0, got {self.collective_latency_s}"
            )


@dataclass(frozen=True)
class TableCost:
    """Estimated work of one table under one sharding type, per training step (all shards)."""

    compute_bytes: float
    """Embedding bytes read by the lookups."""
    input_comm_bytes: float
    """Ids and lengths sent to the shards' owners."""
    output_comm_bytes: float
    """Pooled vectors (or, for data-parallel, the gradient all-reduce) on the wire."""
    memory_bytes: int
    """Weights plus optimizer state of one copy of the table."""
    seconds: float
    """Estimated step time of the table, summed over its shards."""
    disk_rows: float = 0.0
    """Distinct rows the step touches on the ``ssd`` tier (0 in DRAM), all shards."""
    disk_seconds: float = 0.0
    """The part of ``seconds`` spent reading and writing back those rows (a ``host`` table's:
    copying the rows its GPU cache misses in and out)."""


def expected_distinct_rows(num_rows: int, lookups: float) -> float:
    """Expected distinct rows among ``lookups`` ids drawn uniformly from ``num_rows`` rows:
    ``N (1 - exp(-ids / N))``, the most a step can touch (skewed ids touch fewer)."""
    if num_rows <= 0 or lookups <= 0:
        return 0.0
    return num_rows * -math.expm1(-lookups / num_rows)


def ssd_seconds_per_row(constants: CostConstants, *, page_cache_hit: float) -> float:
    """Disk seconds per distinct row an ``ssd`` table's step touches: a read when the page
    cache misses it, and one write-back of its page."""
    miss = 1.0 - min(max(page_cache_hit, 0.0), 1.0)
    return miss / constants.ssd_row_reads_per_s + 1.0 / constants.ssd_row_writes_per_s


def estimate_table_cost(
    table: EmbeddingBagConfig,
    *,
    sharding_type: str,
    num_shards: int,
    world_size: int,
    batch_size: float,
    pooling_factor: float = 1.0,
    optimizer: str = "rowwise_adagrad",
    weights_precision: str = "fp32",
    comm_precision: str = "fp32",
    constants: CostConstants | None = None,
    placement: str = "dram",
    page_cache_hit: float = 0.0,
    cache_rows: int = 0,
) -> TableCost:
    """The cost of ``table`` sharded as ``sharding_type`` in ``num_shards`` shards.

    Args:
        table: the table.
        sharding_type: one of :data:`~raydlrm.sharding.config.ShardingType`.
        num_shards: shards of the table (``world_size`` for data-parallel).
        world_size: ranks in the job.
        batch_size: global samples per step (unique rows per step for a table of a dedup
            group: its lookups, ids and pooled vectors shrink with them).
        pooling_factor: average ids per bag of each of the table's features.
        optimizer: the fused optimizer (for the state's memory).
        weights_precision: precision of the weights (their memory and the bytes a lookup reads).
        comm_precision: codec of the pooled vectors on the wire.
        constants: throughputs and latency (defaults if None).
        placement: ``dram``, ``ssd`` or ``host``, whose time :func:`_tier_time` adds.
        page_cache_hit: for ``ssd``, the fraction of touched rows the page cache holds.
        cache_rows: for ``ssd`` and ``host``, rows of its row cache (0: none).

    Returns:
        The table's compute, communication, disk, memory and estimated seconds per step.
    """
    step = _Step(table, sharding_type, num_shards, world_size, batch_size, pooling_factor)
    constants = constants or CostConstants()
    dim = table.embedding_dim
    compute = step.ids * dim * LOOKUP_BYTES[weights_precision]
    comm = _comm_bytes(step, comm_precision=comm_precision)
    row_bytes = stored_row_bytes(dim, precision=weights_precision, optimizer=optimizer)
    tier = _tier_time(step, placement, cache_rows, row_bytes, constants, page_cache_hit)
    disk_rows, disk_seconds = tier
    return TableCost(
        compute_bytes=compute,
        input_comm_bytes=comm.inputs,
        output_comm_bytes=comm.outputs,
        memory_bytes=table_memory_bytes(
            table,
            optimizer=optimizer,
            weights_precision=weights_precision,
            placement=placement,
            cache_rows=cache_rows,
        ),
        seconds=_seconds(step, constants=constants, compute=compute, comm=comm, disk=disk_seconds),
        disk_rows=disk_rows,
        disk_seconds=disk_seconds,
    )


@dataclass(frozen=True)
class _Step:
    """One training step's lookups of a table as sharded: what each term of its cost counts."""

    table: EmbeddingBagConfig
    sharding_type: str
    num_shards: int
    world_size: int
    batch_size: float
    pooling_factor: float

    @property
    def bags(self) -> float:
        """Bags looked up: one per feature and sample (unique row, deduplicated); for a table
        looked up per position (a sequence's), one per id: each id's row is an output row,
        so its output, its gradient and their communication grow with the sequence length."""
        bags = len(self.table.feature_names) * self.batch_size
        return bags if self.table.pooled else bags * self.pooling_factor

    @property
    def ids(self) -> float:
        """Ids looked up: ``pooling_factor`` per bag (one per bag per position)."""
        return self.bags * self.pooling_factor if self.table.pooled else self.bags


@dataclass(frozen=True)
class _CommBytes:
    """Bytes a step of a table puts on the wire, all shards."""

    inputs: float
    """Ids and lengths sent to the shards' owners."""
    outputs: float
    """Pooled vectors (or, for data-parallel, the gradient all-reduce)."""


def _comm_bytes(step: _Step, *, comm_precision: str) -> _CommBytes:
    """The input and output communication of ``step``, the vectors coded ``comm_precision``."""
    bags, ids, num_shards = step.bags, step.ids, step.num_shards
    dim = step.table.embedding_dim
    vectors = bags * wire_bytes_per_vector(dim, precision=comm_precision)
    if step.sharding_type == "data_parallel":
        outputs = 2.0 * (step.world_size - 1) * step.table.num_embeddings * dim * FP32_BYTES
        return _CommBytes(inputs=0.0, outputs=outputs)
    if step.sharding_type == "column_wise":
        # Each column shard sends its slice; the slices add up to one vector (plus per-row
        # scales for the row-wise codecs, once per shard, and for mx4 at most one more
        # partial block of 32 per shard).
        per_row = wire_row_overhead(comm_precision)
        return _CommBytes(
            inputs=num_shards * (ids * _ID_BYTES + bags * _LENGTH_BYTES),
            outputs=vectors + (num_shards - 1) * bags * per_row,
        )
    if step.sharding_type in ("row_wise", "table_row_wise") and (
        step.table.pooled or step.table.managed is not None
    ):
        return _CommBytes(
            inputs=ids * _ID_BYTES + num_shards * bags * _LENGTH_BYTES,
            outputs=num_shards * vectors,
        )
    # Table-wise; and a row-split table looked up per position (unless managed), whose ids go
    # each to its one row shard and come back as its one row (a class per row shard,
    # raydlrm.sharding._layout).
    assert step.sharding_type in ("table_wise", "row_wise", "table_row_wise"), step.sharding_type
    return _CommBytes(inputs=ids * _ID_BYTES + bags * _LENGTH_BYTES, outputs=vectors)


def _tier_time(
    step: _Step,
    placement: str,
    cache_rows: int,
    row_bytes: int,
    constants: CostConstants,
    page_cache_hit: float,
) -> tuple[float, float]:
    """The rows a step of a table touches on disk and the seconds its tier adds, from the
    distinct rows it touches outside its row cache of ``cache_rows`` rows (with ids drawn
    uniformly, ``cache_rows / rows`` of the touched rows are cached): an ``ssd`` table reads
    each (when the page cache misses it too) and evicts one row, written back; a ``host``
    table copies each in from host memory with its state (``row_bytes``) and one evicted row
    out, at ``constants.host_copy_bytes_per_s``. (0, 0) in ``dram``."""
    if placement == "ssd":
        rows = _missed_rows(step, cache_rows=cache_rows)
        return rows, rows * ssd_seconds_per_row(constants, page_cache_hit=page_cache_hit)
    if placement == "host":
        missed = _missed_rows(step, cache_rows=cache_rows)
        return 0.0, 2 * missed * row_bytes / constants.host_copy_bytes_per_s
    return 0.0, 0.0


def _missed_rows(step: _Step, *, cache_rows: int) -> float:
    """Distinct rows of an ``ssd`` or ``host`` table that ``step`` touches outside its row
    cache (with uniform ids), all shards: each column shard touches every one, each
    data-parallel replica its own samples'."""
    rows = step.table.num_embeddings
    if step.sharding_type == "data_parallel":
        touched = step.world_size * expected_distinct_rows(rows, step.ids / step.world_size)
    else:
        copies = step.num_shards if step.sharding_type == "column_wise" else 1
        touched = expected_distinct_rows(rows, step.ids) * copies
    return touched * (1.0 - min(cache_rows / rows, 1.0))


def _seconds(
    step: _Step, *, constants: CostConstants, compute: float, comm: _CommBytes, disk: float
) -> float:
    """The step's time: lookups, bytes on the wire, one collective latency per shard, disk."""
    return (
        compute / constants.lookup_bytes_per_s
        + (comm.inputs + comm.outputs) / constants.comm_bytes_per_s
        + step.num_shards * constants.collective_latency_s
        + disk
    )


def save_constants(constants: CostConstants, path: str | Path) -> Path:
    """Writes ``constants`` as JSON to ``path`` (``~`` expanded, parents created)."""
    target = Path(path).expanduser()
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(asdict(constants), indent=2) + "\n")
    return target


def load_constants(path: str | Path) -> CostConstants:
    """Reads constants written by :func:`save_constants`.

    Raises:
        FileNotFoundError: if ``path`` does not exist.
        ValueError: if the file is not a constants JSON object.
    """
    target = Path(path).expanduser()
    data = json.loads(target.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{target}: cost constants must be a JSON object, got {data!r}")
    try:
        return CostConstants(**data)
    except TypeError as e:
        raise ValueError(f"{target}: not a cost constants file ({e})") from e
