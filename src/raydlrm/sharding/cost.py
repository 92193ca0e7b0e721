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
  row-wise and table-row-wise ``k`` partial sums of each, data-parallel none but an all-reduce of
  the table's gradient (``2 (W - 1) N D 4`` bytes);
- memory: ``N * D`` weights at their precision (4 bytes fp32, 2 bytes fp16) plus the fp32
  optimizer state (row-wise Adagrad one float per row, Adagrad one per weight, SGD none); an
  ``int8`` / ``int4`` table holds ``D`` (``D / 2``) bytes of codes and 4 of scale and bias per
  row, its optimizer state, and its fp32 cache (``cache_load_factor`` of the rows, each with
  its state and :data:`CACHE_SLOT_BYTES` of bookkeeping). Its lookups read the fp32 cache
  (compute as fp32); the cache's fills and evictions are not modelled.

Its estimated time is ``compute / lookup_bytes_per_s + comm / comm_bytes_per_s + k *
collective_latency_s`` (each shard takes part in the collectives). A table on the ``ssd`` tier
adds its disk time: each distinct row a step touches (``N (1 - exp(-ids / N))`` of ``ids``
lookups drawn uniformly: the most a step can touch; skewed ids touch fewer) misses the page
cache with probability ``1 - page_cache_hit`` and is then read from disk, and every updated
row's page is written back once (``ssd_row_reads_per_s``, ``ssd_row_writes_per_s``: random 4
KiB pages through a mapped file). Column-wise shards each touch every distinct row;
data-parallel replicas each touch their own samples' rows. The constants come from
:class:`CostConstants`: defaults, or :func:`~raydlrm.sharding.calibration.calibrate` on this
machine (saved as JSON).
The planner charges each shard ``1 / k`` of the table's time.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from raydlrm.models.embedding import EmbeddingBagConfig
from raydlrm.models.quantized import QUANTIZED_BITS, code_bytes_per_row

__all__ = [
    "CostConstants",
    "TableCost",
    "cache_rows",
    "estimate_table_cost",
    "expected_distinct_rows",
    "load_constants",
    "quantized_cache_rows",
    "quantized_row_bytes",
    "save_constants",
    "table_memory_bytes",
    "wire_bytes_per_vector",
]

_FP32_BYTES = 4
_WEIGHT_BYTES = {"fp32": 4, "fp16": 2, "int8": 4, "int4": 4}  # quantized: lookups of the fp32 cache
_QUANTIZED_PARAM_BYTES = 4  # an fp16 scale and bias per row
CACHE_SLOT_BYTES = 33
"""Bookkeeping of one slot of a quantized table's cache: its row and last step (int64 each),
its dirty flag, and the sorted index of the slots' rows (two int64)."""
_SSD_CACHE_SLOT_BYTES = 16  # its row and last step; the slot of each row is counted per row
_ID_BYTES = 8
_LENGTH_BYTES = 4
# (bytes per value, bytes per row, bytes per block of _WIRE_BLOCK values) on the wire of each
# codec in :mod:`raydlrm.sharding.codecs` (a row's values round up to whole bytes; mx4: 4-bit
# codes and an exponent byte per 32 values); kept here so a dry-run plan does not import torch.
_WIRE = {
    "fp32": (4, 0, 0),
    "fp16": (2, 0, 0),
    "bf16": (2, 0, 0),
    "fp8": (1, 4, 0),
    "int8": (1, 8, 0),
    "mx4": (0.5, 0, 1),
}
_WIRE_BLOCK = 32


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
        source: where the numbers come from (``default`` or a calibration note).
        device: where the lookups were timed: ``cpu``, or ``cuda`` (GPU workers' tables).
    """

    lookup_bytes_per_s: float = 8e8
    comm_bytes_per_s: float = 5e8
    collective_latency_s: float = 1e-4
    ssd_row_reads_per_s: float = 5e4
    ssd_row_writes_per_s: float = 2e4
    source: str = "default"
    device: str = "cpu"

    def __post_init__(self) -> None:
        for name in (
            "lookup_bytes_per_s",
            "comm_bytes_per_s",
            "ssd_row_reads_per_s",
            "ssd_row_writes_per_s",
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
    """The part of ``seconds`` spent reading and writing back those rows."""


def wire_bytes_per_vector(dim: int, *, precision: str = "fp32") -> int:
    """Bytes of one pooled ``dim``-vector on the wire with codec ``precision``."""
    per_value, per_row, per_block = _WIRE[precision]
    return math.ceil(dim * per_value) + per_row + per_block * -(-dim // _WIRE_BLOCK)


def cache_rows(rows: int, *, load_factor: float, min_rows: int, step_rows: int = 0) -> int:
    """Rows of the DRAM cache of an ``ssd`` table (shard) of ``rows`` rows: ``load_factor``
    of them, at least ``min_rows`` and the most rows a step can look up (``step_rows``,
    :attr:`~raydlrm.sharding.plan.TablePlan.step_rows`), at most all; 0 when ``load_factor``
    is 0 (no cache) (``sharding.ssd_cache_load_factor``, ``ssd_cache_min_rows``)."""
    if load_factor <= 0:
        return 0
    return min(rows, max(math.ceil(load_factor * rows), min_rows, step_rows))


def quantized_cache_rows(rows: int, *, load_factor: float, step_rows: int = 0) -> int:
    """Rows of the fp32 cache of an ``int8`` / ``int4`` table (shard) of ``rows`` rows:
    ``load_factor`` of them (``sharding.cache_load_factor``), at least one, and at least the
    most rows a step can look up (``step_rows``, at most all: every step fits)."""
    return max(1, math.ceil(load_factor * rows), min(rows, step_rows))


def quantized_row_bytes(dim: int, precision: str) -> int:
    """Bytes of one stored ``int8`` / ``int4`` row: its codes and its scale and bias."""
    return code_bytes_per_row(dim, precision) + _QUANTIZED_PARAM_BYTES


def stored_row_bytes(dim: int, *, precision: str, optimizer: str) -> int:
    """Bytes of one row's weights at ``precision`` (a quantized row: its codes, scale and
    bias) plus its fused optimizer state (always fp32)."""
    state = {"rowwise_adagrad": _FP32_BYTES, "adagrad": dim * _FP32_BYTES, "sgd": 0}[optimizer]
    if precision in QUANTIZED_BITS:
        return quantized_row_bytes(dim, precision) + state
    return dim * _WEIGHT_BYTES[precision] + state


def table_memory_bytes(
    table: EmbeddingBagConfig,
    *,
    optimizer: str,
    weights_precision: str = "fp32",
    placement: str = "dram",
    cache_rows: int = 0,
) -> int:
    """Bytes of worker memory the table takes: its weights plus its fused optimizer state
    (always fp32); for an ``ssd`` table only what stays in memory: row-wise Adagrad's one float
    per row (a per-weight state goes to disk with the weights) and, with a DRAM row cache of
    ``cache_rows`` rows, the cached rows with their state, plus 4 bytes per row and 16 per
    cached row of bookkeeping. A quantized table: its rows (codes, scale and bias; on disk for
    ``ssd``), its optimizer state as above, and its fp32 cache of ``cache_rows`` rows with
    their state and :data:`CACHE_SLOT_BYTES` each.

    Args:
        table: the table.
        optimizer: ``rowwise_adagrad`` (one float per row), ``adagrad`` (one per weight) or
            ``sgd`` (no state).
        weights_precision: ``fp32`` (4 bytes per weight), ``fp16`` (2), ``int8`` or ``int4``.
        placement: ``dram`` or ``ssd``.
        cache_rows: rows of an ``ssd`` table's DRAM cache (:func:`cache_rows`), or of a
            quantized table's fp32 cache (:func:`quantized_cache_rows`).
    """
    rows, dim = table.num_embeddings, table.embedding_dim
    state_per_row = {"rowwise_adagrad": _FP32_BYTES, "adagrad": dim * _FP32_BYTES, "sgd": 0}
    state = state_per_row[optimizer]
    row_state_in_memory = rows * _FP32_BYTES if optimizer == "rowwise_adagrad" else 0
    if weights_precision in QUANTIZED_BITS:
        cache = cache_rows * (dim * _FP32_BYTES + state + CACHE_SLOT_BYTES)
        if placement == "ssd":
            return row_state_in_memory + cache
        return (
            rows * stored_row_bytes(dim, precision=weights_precision, optimizer=optimizer) + cache
        )
    row_bytes = stored_row_bytes(dim, precision=weights_precision, optimizer=optimizer)
    if placement != "ssd":
        return rows * row_bytes
    in_memory = row_state_in_memory
    if cache_rows:
        in_memory += rows * _FP32_BYTES + cache_rows * (row_bytes + _SSD_CACHE_SLOT_BYTES)
    return in_memory


def table_disk_bytes(
    table: EmbeddingBagConfig, *, optimizer: str, weights_precision: str = "fp32"
) -> int:
    """Bytes of local disk an ``ssd`` table takes: its weights (a quantized table's codes,
    scales and biases), and a per-weight optimizer state (Adagrad's) beside them."""
    weights = table.num_embeddings * table.embedding_dim
    state = weights * _FP32_BYTES if optimizer == "adagrad" else 0
    if weights_precision in QUANTIZED_BITS:
        stored = table.num_embeddings * quantized_row_bytes(table.embedding_dim, weights_precision)
        return stored + state
    return weights * _WEIGHT_BYTES[weights_precision] + state


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
        placement: ``dram`` or ``ssd`` (adds the disk time of the rows a step touches).
        page_cache_hit: for ``ssd``, the fraction of touched rows the page cache holds.
        cache_rows: for ``ssd``, rows of its DRAM row cache (0: none): with ids drawn
            uniformly, ``cache_rows / rows`` of the touched rows are there, cost no disk time,
            and each other one is read in and evicts one row, written back.

    Returns:
        The table's compute, communication, disk, memory and estimated seconds per step.
    """
    step = _Step(table, sharding_type, num_shards, world_size, batch_size, pooling_factor)
    constants = constants or CostConstants()
    compute = step.ids * table.embedding_dim * _WEIGHT_BYTES[weights_precision]
    comm = _comm_bytes(step, comm_precision=comm_precision)
    disk_rows = _disk_rows(step, cache_rows=cache_rows) if placement == "ssd" else 0.0
    disk_seconds = disk_rows * ssd_seconds_per_row(constants, page_cache_hit=page_cache_hit)
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
        """Bags looked up: one per feature and sample (unique row, deduplicated)."""
        return len(self.table.feature_names) * self.batch_size

    @property
    def ids(self) -> float:
        """Ids looked up: ``pooling_factor`` per bag."""
        return self.bags * self.pooling_factor


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
        outputs = 2.0 * (step.world_size - 1) * step.table.num_embeddings * dim * _FP32_BYTES
        return _CommBytes(inputs=0.0, outputs=outputs)
    if step.sharding_type == "column_wise":
        # Each column shard sends its slice; the slices add up to one vector (plus per-row
        # scales for the row-wise codecs, once per shard, and for mx4 at most one more
        # partial block of 32 per shard).
        per_row = _WIRE[comm_precision][1] + _WIRE[comm_precision][2]
        return _CommBytes(
            inputs=num_shards * (ids * _ID_BYTES + bags * _LENGTH_BYTES),
            outputs=vectors + (num_shards - 1) * bags * per_row,
        )
    if step.sharding_type in ("row_wise", "table_row_wise"):
        return _CommBytes(
            inputs=ids * _ID_BYTES + num_shards * bags * _LENGTH_BYTES,
            outputs=num_shards * vectors,
        )
    assert step.sharding_type == "table_wise", step.sharding_type
    return _CommBytes(inputs=ids * _ID_BYTES + bags * _LENGTH_BYTES, outputs=vectors)


def _disk_rows(step: _Step, *, cache_rows: int) -> float:
    """Distinct rows of an ``ssd`` table that ``step`` touches outside its DRAM row cache, all
    shards: each column shard touches every one, each data-parallel replica its own samples'."""
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
