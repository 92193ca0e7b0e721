"""Sizes of an embedding table's storage: bytes in memory and on disk, rows of its caches, and
bytes of a pooled vector on the wire.

What the planner charges (:mod:`raydlrm.sharding.planner.cost`) and what the sharded collection
allocates (:mod:`raydlrm.sharding.embedding`) read the same numbers from here. Memory: ``N * D``
weights at their precision (4 bytes fp32, 2 bytes fp16) plus the fp32 optimizer state
(row-wise Adagrad one float per row, Adagrad one per weight, SGD none); an ``int8`` / ``int4``
table holds ``D`` (``D / 2``) bytes of codes and 4 of scale and bias per row, its optimizer
state, and its fp32 cache (``cache_load_factor`` of the rows, each with its state and
:data:`CACHE_SLOT_BYTES` of bookkeeping).
"""

from __future__ import annotations

import math

from raydlrm.ids import MAP_BYTES_PER_ROW, auto_buckets
from raydlrm.models.embedding import EmbeddingBagConfig
from raydlrm.models.quantized import QUANTIZED_BITS, code_bytes_per_row

__all__ = [
    "CACHE_SLOT_BYTES",
    "FP32_BYTES",
    "LOOKUP_BYTES",
    "REFRESH_CHUNK_BYTES",
    "cache_rows",
    "quantized_row_bytes",
    "refresh_bytes",
    "refresh_chunk_rows",
    "stored_row_bytes",
    "table_disk_bytes",
    "table_host_bytes",
    "table_memory_bytes",
    "wire_bytes_per_vector",
    "wire_row_overhead",
]

FP32_BYTES = 4
"""Bytes of an fp32 value (optimizer state is always fp32)."""
LOOKUP_BYTES = {"fp32": 4, "fp16": 2, "int8": 4, "int4": 4}
"""Bytes a lookup reads per weight, by weights precision (quantized: lookups of the fp32 cache)."""
_QUANTIZED_PARAM_BYTES = 4  # an fp16 scale and bias per row
CACHE_SLOT_BYTES = 33
"""Bookkeeping of one slot of a quantized table's cache: its row and last step (int64 each),
its dirty flag, and the sorted index of the slots' rows (two int64)."""
REFRESH_CHUNK_BYTES = 4 << 20
"""Bytes of the float64 values of one chunk of a whole-shard pass over a managed table's rows
(its fallback rows' refresh, :meth:`~raydlrm.models.managed_ids.IdMap.bucket_means`): the
pass holds one chunk at a time, whatever the shard's size."""
_SSD_CACHE_SLOT_BYTES = 16  # its row and last step; the slot of each row is counted per row
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


def wire_bytes_per_vector(dim: int, *, precision: str = "fp32") -> int:
    """Bytes of one pooled ``dim``-vector on the wire with codec ``precision``."""
    per_value, per_row, per_block = _WIRE[precision]
    return math.ceil(dim * per_value) + per_row + per_block * -(-dim // _WIRE_BLOCK)


def wire_row_overhead(precision: str) -> int:
    """Bytes a row coded ``precision`` carries beyond its values' on the wire: its per-row
    scales, plus at most one more partial block's for the block codecs (mx4)."""
    return _WIRE[precision][1] + _WIRE[precision][2]


def cache_rows(rows: int, *, load_factor: float, min_rows: int, step_rows: int = 0) -> int:
    """Rows of the row cache of a table (shard) of ``rows`` rows, of any kind (an fp32 / fp16
    ``ssd`` table's DRAM cache, a quantized table's fp32 cache, a ``host`` table's GPU cache):
    ``load_factor`` of them, at least ``min_rows`` and the most rows a step can look up
    (``step_rows``, :attr:`~raydlrm.sharding.plan.TablePlan.step_rows`), at most all; 0 when
    ``load_factor`` is 0 (no cache: ``ssd`` only). ``sharding.cache_load_factor`` and
    ``cache_min_rows`` (:meth:`~raydlrm.sharding.config.ShardingConfig.cache_sizing`)."""
    if load_factor <= 0:
        return 0
    return min(rows, max(math.ceil(load_factor * rows), min_rows, step_rows))


def quantized_row_bytes(dim: int, precision: str) -> int:
    """Bytes of one stored ``int8`` / ``int4`` row: its codes and its scale and bias."""
    return code_bytes_per_row(dim, precision) + _QUANTIZED_PARAM_BYTES


def stored_row_bytes(dim: int, *, precision: str, optimizer: str) -> int:
    """Bytes of one row's weights at ``precision`` (a quantized row: its codes, scale and
    bias) plus its fused optimizer state (always fp32)."""
    state = {"rowwise_adagrad": FP32_BYTES, "adagrad": dim * FP32_BYTES, "sgd": 0}[optimizer]
    if precision in QUANTIZED_BITS:
        return quantized_row_bytes(dim, precision) + state
    return dim * LOOKUP_BYTES[precision] + state


def table_memory_bytes(
    table: EmbeddingBagConfig,
    *,
    optimizer: str,
    weights_precision: str = "fp32",
    placement: str = "dram",
    cache_rows: int = 0,
) -> int:
    """Bytes of worker memory the table takes: its weights plus its fused optimizer state
    (always fp32); for a ``host`` table only what it takes of the GPU's memory: its row cache
    of ``cache_rows`` rows with their state, 16 bytes per cached row and 4 per row of
    bookkeeping (the rows and their state are in host memory, :func:`table_host_bytes`);
    for an ``ssd`` table only what stays in memory: row-wise Adagrad's one float
    per row (a per-weight state goes to disk with the weights) and, with a DRAM row cache of
    ``cache_rows`` rows, the cached rows with their state, plus 4 bytes per row and 16 per
    cached row of bookkeeping. A quantized table: its rows (codes, scale and bias; on disk for
    ``ssd``), its optimizer state as above, and its fp32 cache of ``cache_rows`` rows with
    their state and :data:`CACHE_SLOT_BYTES` each. A managed table adds its id map,
    :data:`~raydlrm.ids.MAP_BYTES_PER_ROW` a row, and the peak of its fallback refresh
    (:func:`refresh_bytes`).

    Args:
        table: the table.
        optimizer: ``rowwise_adagrad`` (one float per row), ``adagrad`` (one per weight) or
            ``sgd`` (no state).
        weights_precision: ``fp32`` (4 bytes per weight), ``fp16`` (2), ``int8`` or ``int4``.
        placement: ``dram``, ``ssd`` or ``host``.
        cache_rows: rows of its row cache (:func:`cache_rows`): an ``ssd`` table's DRAM
            cache, a quantized table's fp32 cache or a ``host`` table's GPU cache.
    """
    id_map = table.num_embeddings * MAP_BYTES_PER_ROW if table.managed is not None else 0
    return (
        id_map
        + refresh_bytes(table)
        + _table_memory_bytes(
            table,
            optimizer=optimizer,
            weights_precision=weights_precision,
            placement=placement,
            cache_rows=cache_rows,
        )
    )


def _table_memory_bytes(
    table: EmbeddingBagConfig,
    *,
    optimizer: str,
    weights_precision: str,
    placement: str,
    cache_rows: int,
) -> int:
    """:func:`table_memory_bytes` without a managed table's id map."""
    rows, dim = table.num_embeddings, table.embedding_dim
    state_per_row = {"rowwise_adagrad": FP32_BYTES, "adagrad": dim * FP32_BYTES, "sgd": 0}
    state = state_per_row[optimizer]
    row_state_in_memory = rows * FP32_BYTES if optimizer == "rowwise_adagrad" else 0
    if weights_precision in QUANTIZED_BITS:
        cache = cache_rows * (dim * FP32_BYTES + state + CACHE_SLOT_BYTES)
        if placement == "ssd":
            return row_state_in_memory + cache
        return (
            rows * stored_row_bytes(dim, precision=weights_precision, optimizer=optimizer) + cache
        )
    row_bytes = stored_row_bytes(dim, precision=weights_precision, optimizer=optimizer)
    if placement == "host":  # the GPU row cache: its slots with their state, the slot of each row
        return rows * FP32_BYTES + cache_rows * (row_bytes + _SSD_CACHE_SLOT_BYTES)
    if placement != "ssd":
        return rows * row_bytes
    in_memory = row_state_in_memory
    if cache_rows:
        in_memory += rows * FP32_BYTES + cache_rows * (row_bytes + _SSD_CACHE_SLOT_BYTES)
    return in_memory


def refresh_chunk_rows(dim: int, *, cache_rows: int = 0) -> int:
    """Rows of one chunk of a managed shard's fallback refresh for rows of ``dim`` columns
    (:data:`REFRESH_CHUNK_BYTES`); behind a row cache of ``cache_rows`` rows, at most that many,
    so a ``host`` table's pinned staging buffer never grows past what a step's misses need."""
    rows = max(1, REFRESH_CHUNK_BYTES // (8 * dim))
    return min(rows, cache_rows) if cache_rows else rows


def refresh_bytes(table: EmbeddingBagConfig) -> int:
    """The peak memory of a managed table's fallback refresh (``admit_after = 1``; else 0):
    six times a chunk's float64 values (the chunk read at up to fp32, its float64 copy, its
    indices, and what the allocator keeps of the chunks before: 4-5.5x measured on CPU,
    ``benchmarks/refresh_memory.py``), and the buckets' float64 sums and means."""
    managed = table.managed
    if managed is None or managed.admit_after > 1:
        return 0
    dim = table.embedding_dim
    chunk = min(table.num_embeddings, refresh_chunk_rows(dim))
    buckets = managed.buckets or auto_buckets(table.num_embeddings)
    return 6 * chunk * dim * 8 + buckets * dim * 8 * 2


def table_host_bytes(
    table: EmbeddingBagConfig, *, optimizer: str, weights_precision: str = "fp32"
) -> int:
    """Bytes of host memory a ``host`` table takes: its rows' weights and optimizer state."""
    row = stored_row_bytes(table.embedding_dim, precision=weights_precision, optimizer=optimizer)
    return table.num_embeddings * row


def table_disk_bytes(
    table: EmbeddingBagConfig, *, optimizer: str, weights_precision: str = "fp32"
) -> int:
    """Bytes of local disk an ``ssd`` table takes: its weights (a quantized table's codes,
    scales and biases), and a per-weight optimizer state (Adagrad's) beside them."""
    weights = table.num_embeddings * table.embedding_dim
    state = weights * FP32_BYTES if optimizer == "adagrad" else 0
    if weights_precision in QUANTIZED_BITS:
        stored = table.num_embeddings * quantized_row_bytes(table.embedding_dim, weights_precision)
        return stored + state
    return weights * LOOKUP_BYTES[weights_precision] + state
