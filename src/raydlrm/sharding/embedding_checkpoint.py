"""Sharded embedding state for ``torch.distributed.checkpoint`` (DCP), with resharding.

:func:`embedding_state_dict` describes this rank's embedding shards and fused optimizer state as
tensors keyed by *table*, not by rank: a sharded table's weight is a ``ShardedTensor`` of the
table's global shape whose local shard is this rank's rectangle (a view of the kernel's weights, so
saving copies nothing); a data-parallel table is a plain tensor (DCP writes one replica). Since
DCP stores every tensor as chunks with their offsets in the global tensor, a checkpoint written
with one plan loads into any other plan (another world size, another sharding type): each rank
reads the chunks that overlap its new rectangles (:func:`load_embedding_state`).

Fused optimizer state:

* Adagrad's per-element sum has the weight's shape and is saved and resharded like it.
* Row-wise Adagrad keeps one value per row *per shard*: a column-sharded table has one momentum
  per column block. It is saved as a ``(rows, K)`` tensor, column ``k`` holding the momentum of
  the ``k``-th column block of the saving plan (``K = 1`` unless column-sharded). A loading shard
  takes the width-weighted mean of the saved blocks its columns overlap: exactly the saved value
  when the layouts match, exactly the whole-row momentum (the mean over the row of the
  accumulated squared gradients) when a column-sharded table becomes row- or table-wise, and the
  whole-row value for each block when a whole-row table becomes column-sharded.
* SGD has no state.

Weights are saved in their precision (``sharding.weights_precision``: fp32 or fp16; the DCP
metadata records the dtype); optimizer state is always fp32. Loading casts to the loading
plan's precision, so a checkpoint moves between fp32 and fp16 tables (fp32 -> fp16 rounds to
nearest).

Quantized tables (``int8`` / ``int4``; their caches flushed first) are saved as they are held
(:mod:`raydlrm.sharding.quantized`), with no weight tensor: ``<table>.codes``, ``(rows, dim *
bits / 8)`` uint8, each column block's codes at its own byte columns, and ``<table>.qparams``,
``(rows, 2 K)`` fp16, block ``k``'s scale and bias at columns ``2k, 2k + 1`` (``K`` column
blocks of the saving plan, as the momentum). A table loads them byte for byte when its
precision and column blocks are the saved ones (a resume, any row resharding); otherwise
(another precision: ``--set sharding.weights_precision=...`` at resume; other column blocks)
each rank reads the saved rows of its shard and converts them once: dequantized, or quantized
rounding to nearest, with one log line per table.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard as TensorShard
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import (
    ShardedTensorMetadata,
    TensorProperties,
)

from raydlrm.models.quantized import (
    block_code_columns,
    code_bytes_per_row,
    dequantize_blocks,
    quantized_precision,
)
from raydlrm.sharding.config import QUANTIZED
from raydlrm.sharding.kernel import WEIGHT_DTYPES
from raydlrm.sharding.plan import Shard, ShardingPlan, TablePlan
from raydlrm.sharding.quantized import QuantizedRows
from raydlrm.sharding.types import ShardedTables

logger = logging.getLogger(__name__)

__all__ = [
    "checkpoint_precision",
    "codes_key",
    "column_blocks",
    "embedding_state_dict",
    "load_embedding_state",
    "momentum_key",
    "qparams_key",
    "saved_precisions",
    "state_key",
    "weight_key",
]

_PREFIX = "embedding"
_CONVERT_ROWS = 1 << 18
"""Rows made fp32 at a time when a table is converted while loading (64 MiB at 64 columns)."""


def weight_key(table: str) -> str:
    return f"{_PREFIX}.{table}.weight"


def state_key(table: str) -> str:
    """Adagrad's per-element sum of squared gradients."""
    return f"{_PREFIX}.{table}.sum"


def momentum_key(table: str) -> str:
    """Row-wise Adagrad's per-row momentum, one column per column block."""
    return f"{_PREFIX}.{table}.momentum"


def codes_key(table: str) -> str:
    """A quantized table's codes."""
    return f"{_PREFIX}.{table}.codes"


def qparams_key(table: str) -> str:
    """A quantized table's scale and bias per row, two columns per column block."""
    return f"{_PREFIX}.{table}.qparams"


def saved_precisions(plan: ShardingPlan, metadata: dict[str, Any]) -> dict[str, str]:
    """Table name -> the weights precision a checkpoint holds it in, from its DCP
    ``metadata`` (``state_dict_metadata``)."""
    out = {}
    for t in plan.tables:
        codes = metadata.get(codes_key(t.name))
        if codes is not None:
            out[t.name] = quantized_precision(t.embedding_dim, codes.size[1])
        else:
            dtype = metadata[weight_key(t.name)].properties.dtype
            out[t.name] = "fp16" if dtype == torch.float16 else "fp32"
    return out


def column_blocks(table: TablePlan) -> list[tuple[int, int]]:
    """The distinct column ranges of a table's shards, in column order."""
    return sorted({(s.col_start, s.col_end) for s in table.shards})


def _placement(rank: int, device: torch.device) -> str:
    return f"rank:{rank}/{device}"


def _sharded(
    local: torch.Tensor | None,
    *,
    rank: int,
    shards: list[tuple[Shard, list[int], list[int]]],
    size: list[int],
    device: torch.device,
    dtype: torch.dtype,
) -> ShardedTensor:
    """A ShardedTensor of global ``size`` over ``(shard, offsets, sizes)`` pieces, holding
    ``local`` as this rank's piece (None when this rank holds none)."""
    metadata = [
        ShardMetadata(
            shard_offsets=offsets, shard_sizes=sizes, placement=_placement(s.rank, device)
        )
        for s, offsets, sizes in shards
    ]
    local_shards = [
        TensorShard(local, m)
        for (s, _, _), m in zip(shards, metadata, strict=True)
        if s.rank == rank
    ]
    if local is None:
        local_shards = []
    global_metadata = ShardedTensorMetadata(
        shards_metadata=metadata,
        size=torch.Size(size),
        tensor_properties=TensorProperties(dtype=dtype, requires_grad=False),
    )
    return ShardedTensor._init_from_local_shards_and_global_metadata(local_shards, global_metadata)


def _weight_pieces(table: TablePlan) -> list[tuple[Shard, list[int], list[int]]]:
    return [
        (s, [s.row_start, s.col_start], [s.row_end - s.row_start, s.col_end - s.col_start])
        for s in table.shards
    ]


def _momentum_pieces(table: TablePlan) -> list[tuple[Shard, list[int], list[int]]]:
    blocks = column_blocks(table)
    return [
        (s, [s.row_start, blocks.index((s.col_start, s.col_end))], [s.row_end - s.row_start, 1])
        for s in table.shards
    ]


def _row_window(
    local: torch.Tensor, *, rank: int, row_start: int, size: list[int]
) -> torch.Tensor | ShardedTensor:
    """A load target for rows ``[row_start, row_start + len(local))`` of a tensor of global
    ``size``, filled into ``local``: DCP reads only the saved chunks overlapping those rows, so a
    rank never allocates more than its own rows. The rest of the tensor is described as pieces
    held elsewhere (they are not read); without a process group ``local`` must be whole."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        assert row_start == 0 and local.shape[0] == size[0], "one process holds whole tables"
        return local
    world = dist.get_world_size()
    other = (rank + 1) % world
    rows, cols = local.shape[0], size[1]
    pieces = [(row_start, rows, rank)]
    if row_start > 0:
        pieces.append((0, row_start, other))
    if row_start + rows < size[0]:
        pieces.append((row_start + rows, size[0] - row_start - rows, other))
    metadata = [
        ShardMetadata(
            shard_offsets=[start, 0], shard_sizes=[n, cols], placement=_placement(r, local.device)
        )
        for start, n, r in pieces
    ]
    global_metadata = ShardedTensorMetadata(
        shards_metadata=metadata,
        size=torch.Size(size),
        tensor_properties=TensorProperties(dtype=local.dtype, requires_grad=False),
    )
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        [TensorShard(local, metadata[0])], global_metadata
    )


def _shard_rows(
    local: torch.Tensor, *, table: TablePlan, shard: Shard, rank: int
) -> torch.Tensor | ShardedTensor:
    """A :func:`_row_window` load target for ``shard``'s rows of a saved ``(rows of the table,
    local.shape[1])`` tensor of ``table``, filled into ``local``."""
    return _row_window(
        local,
        rank=rank,
        row_start=shard.row_start,
        size=[table.num_embeddings, local.shape[1]],
    )


def checkpoint_precision(held: str, wanted: str) -> str:
    """The precision a checkpoint holds a table in: its own (``held``), or ``wanted``
    (``checkpoint.embedding_precision``: ``fp32``, ``fp16`` or ``int8``) where that is lower;
    an ``int8`` / ``int4`` table is always saved as held."""
    order = ["fp32", "fp16", "int8"]
    if held in QUANTIZED or order.index(wanted) <= order.index(held):
        return held
    return wanted


def _rounded(weight: torch.Tensor, precision: str, chunk_rows: int = 1 << 16) -> Any:
    """A float shard's weights rounded to a checkpoint's lower ``precision`` (to nearest): an
    fp16 copy, or ``int8`` rows quantized ``chunk_rows`` at a time (no fp32 copy)."""
    if precision == "fp16":
        return weight.half()
    n, dim = weight.shape
    rows = QuantizedRows(
        torch.empty(n, code_bytes_per_row(dim, precision), dtype=torch.uint8),
        torch.empty(n, 2, dtype=torch.float16),
        precision=precision,
        dim=dim,
        key=0,
    )
    rows.assign(weight, chunk_rows=chunk_rows)
    return rows


def embedding_state_dict(
    collection: ShardedTables,
    *,
    plan: ShardingPlan,
    rank: int,
    optimizer: str,
    precisions: dict[str, str] | None = None,
) -> dict[str, Any]:
    """This rank's part of the embedding state, keyed by table (see the module docstring).

    Args:
        collection: a sharded collection.
        plan: its plan.
        rank: this rank.
        optimizer: the fused optimizer (``rowwise_adagrad``, ``adagrad`` or ``sgd``).
        precisions: table name -> the precision to save it in (:func:`checkpoint_precision`;
            default: as held). A lower one rounds a copy of the shard to nearest.
    """
    local = collection.local_tables()
    held = collection.weight_precisions()
    precisions = precisions or held
    states = collection.optimizer_states() if optimizer != "sgd" else {}
    out: dict[str, Any] = {}
    # Without a process group (one process) every table is whole here: plain tensors.
    single = not (dist.is_available() and dist.is_initialized())
    for table in plan.tables:
        weight = local.get(table.name)
        device = weight.device if weight is not None else torch.device("cpu")
        replicated = single or table.sharding_type == "data_parallel"
        precision = precisions[table.name]
        if weight is not None and precision != held[table.name]:
            weight = _rounded(weight, precision)
        if precision in QUANTIZED:
            out.update(
                _quantized_entries(
                    table, weight, rank=rank, replicated=replicated, precision=precision
                )
            )
        else:
            out[weight_key(table.name)] = (
                weight
                if replicated
                else _float_entry(table, weight, rank=rank, device=device, precision=precision)
            )
        if optimizer != "sgd":
            state = states[table.name][0] if weight is not None else None
            out.update(
                _optimizer_entry(
                    table,
                    state,
                    rank=rank,
                    optimizer=optimizer,
                    replicated=replicated,
                    device=device,
                )
            )
    # A replicated table is a plain tensor on the ranks that hold it and absent elsewhere.
    return {k: v for k, v in out.items() if v is not None}


def _float_entry(
    table: TablePlan,
    weight: torch.Tensor | None,
    *,
    rank: int,
    device: torch.device,
    precision: str,
) -> ShardedTensor:
    """An fp32 or fp16 sharded table's weight (this rank's shard ``weight``, or None)."""
    return _sharded(
        weight,
        rank=rank,
        shards=_weight_pieces(table),
        size=[table.num_embeddings, table.embedding_dim],
        device=device,
        dtype=WEIGHT_DTYPES[precision],
    )


def _quantized_entries(
    table: TablePlan,
    rows: QuantizedRows | None,
    *,
    rank: int,
    replicated: bool,
    precision: str,
) -> dict[str, Any]:
    """A quantized table's codes and scales (this rank's shard ``rows``, or None)."""
    if replicated:
        return {
            codes_key(table.name): None if rows is None else rows.codes,
            qparams_key(table.name): None if rows is None else rows.params,
        }
    blocks = column_blocks(table)
    code_pieces, param_pieces = [], []
    for s in table.shards:
        lo, hi = block_code_columns(s.col_start, s.col_end, precision)
        n = s.row_end - s.row_start
        code_pieces.append((s, [s.row_start, lo], [n, hi - lo]))
        param_pieces.append((s, [s.row_start, 2 * blocks.index((s.col_start, s.col_end))], [n, 2]))
    device = rows.device if rows is not None else torch.device("cpu")
    width = code_bytes_per_row(table.embedding_dim, precision)
    return {
        codes_key(table.name): _sharded(
            None if rows is None else rows.codes,
            rank=rank,
            shards=code_pieces,
            size=[table.num_embeddings, width],
            device=device,
            dtype=torch.uint8,
        ),
        qparams_key(table.name): _sharded(
            None if rows is None else rows.params,
            rank=rank,
            shards=param_pieces,
            size=[table.num_embeddings, 2 * len(blocks)],
            device=device,
            dtype=torch.float16,
        ),
    }


def _optimizer_entry(
    table: TablePlan,
    state: torch.Tensor | None,
    *,
    rank: int,
    optimizer: str,
    replicated: bool,
    device: torch.device,
) -> dict[str, Any]:
    """The fused optimizer state of one table (this rank's shard ``state``, or None): row-wise
    Adagrad's momentum as ``(rows, column blocks)``, Adagrad's sum as the weight's shape."""
    if optimizer == "rowwise_adagrad":
        column = None if state is None else state.view(-1, 1)
        if replicated:
            return {momentum_key(table.name): column}
        return {
            momentum_key(table.name): _sharded(
                column,
                rank=rank,
                shards=_momentum_pieces(table),
                size=[table.num_embeddings, len(column_blocks(table))],
                device=device,
                dtype=torch.float32,
            )
        }
    if replicated:
        return {state_key(table.name): state}
    return {
        state_key(table.name): _sharded(
            state,
            rank=rank,
            shards=_weight_pieces(table),
            size=[table.num_embeddings, table.embedding_dim],
            device=device,
            dtype=torch.float32,
        )
    }


def load_embedding_state(
    collection: ShardedTables,
    *,
    plan: ShardingPlan,
    rank: int,
    optimizer: str,
    load: Any,
    saved_blocks: dict[str, list[tuple[int, int]]],
    saved_precisions: dict[str, str] | None = None,
) -> None:
    """Loads a checkpoint's embedding state into this rank's shards of ``plan`` (in place).

    Args:
        collection: the sharded collection to fill.
        plan: its plan (may differ from the saving plan in world size and sharding types).
        rank: this rank.
        optimizer: the fused optimizer; the checkpoint must hold its state.
        load: ``load(state_dict)`` fills the tensors of ``state_dict`` from the checkpoint
            (``torch.distributed.checkpoint.load`` bound to the checkpoint; every rank calls it).
        saved_blocks: table name -> the column blocks of the saving plan (row-wise Adagrad,
            quantized tables).
        saved_precisions: table name -> the precision the checkpoint holds it in
            (:func:`saved_precisions`); None: the collection's own.
    """
    target = embedding_state_dict(collection, plan=plan, rank=rank, optimizer=optimizer)
    momenta: dict[str, torch.Tensor] = {}
    if optimizer == "rowwise_adagrad":
        momenta = _momentum_targets(
            collection, plan=plan, rank=rank, target=target, saved_blocks=saved_blocks
        )
    conversions = _conversions(
        collection,
        plan=plan,
        rank=rank,
        target=target,
        saved_blocks=saved_blocks,
        saved_precisions=saved_precisions or collection.weight_precisions(),
    )
    load(target)
    _load_converted(collection, conversions, rank=rank, load=load, saved_blocks=saved_blocks)
    if not momenta:
        return
    states = collection.optimizer_states()
    shards = collection.local_shards()
    with torch.no_grad():
        for name, saved in momenta.items():
            s = shards[name]
            blocks = saved_blocks[name]
            weights = torch.tensor(
                [max(0, min(b, s.col_end) - max(a, s.col_start)) for a, b in blocks],
                dtype=torch.float32,
            )
            states[name][0].copy_((saved * weights).sum(dim=1) / weights.sum())


def _momentum_targets(
    collection: ShardedTables,
    *,
    plan: ShardingPlan,
    rank: int,
    target: dict[str, Any],
    saved_blocks: dict[str, list[tuple[int, int]]],
) -> dict[str, torch.Tensor]:
    """Replaces in ``target`` row-wise Adagrad's momenta by windows of the saved momenta of
    every block, for the rows of this rank's shards only; returns them by table."""
    shards = collection.local_shards()
    momenta = {}
    for table in plan.tables:
        key = momentum_key(table.name)
        target.pop(key, None)
        if table.name in shards:
            s = shards[table.name]
            blocks = saved_blocks[table.name]
            momenta[table.name] = torch.zeros(s.row_end - s.row_start, len(blocks))
            target[key] = _shard_rows(momenta[table.name], table=table, shard=s, rank=rank)
    return momenta


def _needs_conversion(table: TablePlan, *, ours: str, saved: str, blocks: list) -> bool:
    """Whether a table cannot load as saved: quantized on one side and not the same
    precision and column blocks on the other (fp32 and fp16 load into each other by DCP's
    cast)."""
    if ours not in QUANTIZED and saved not in QUANTIZED:
        return False
    return ours != saved or column_blocks(table) != blocks


def _conversions(
    collection: ShardedTables,
    *,
    plan: ShardingPlan,
    rank: int,
    target: dict[str, Any],
    saved_blocks: dict[str, list[tuple[int, int]]],
    saved_precisions: dict[str, str],
) -> list[tuple[TablePlan, str]]:
    """Removes from ``target`` the weights of the tables to convert (see the module docstring);
    returns those tables with their saved precision, in the plan's order (the same on every
    rank)."""
    ours = collection.weight_precisions()
    out = []
    for table in plan.tables:
        name = table.name
        saved = saved_precisions[name]
        blocks = saved_blocks.get(name, column_blocks(table))
        if not _needs_conversion(table, ours=ours[name], saved=saved, blocks=blocks):
            continue
        for key in (weight_key(name), codes_key(name), qparams_key(name)):
            target.pop(key, None)
        if rank == 0:
            logger.info(
                "table %s: the checkpoint holds it in %s (column blocks %s), the plan in %s "
                "(%s): converted once while loading",
                name,
                saved,
                blocks,
                ours[name],
                column_blocks(table),
            )
        out.append((table, saved))
    return out


def _load_converted(
    collection: ShardedTables,
    conversions: list[tuple[TablePlan, str]],
    *,
    rank: int,
    load: Any,
    saved_blocks: dict[str, list[tuple[int, int]]],
) -> None:
    """Reads the saved rows of each table to convert and writes them into this rank's shard in
    its precision, one table at a time (every rank reads each table in turn, holding that
    table's saved rows only; fp32 rows made ``_CONVERT_ROWS`` at a time): tables larger than
    memory (the SSD tier) load from an int8 or fp16 checkpoint."""
    local = collection.local_tables()
    shards = collection.local_shards()
    for table, saved in conversions:
        name = table.name
        s = shards.get(name)
        if s is None:
            load({})  # collective: this rank holds none of it
            continue
        n, dim = s.row_end - s.row_start, table.embedding_dim
        if saved in QUANTIZED:
            blocks = len(saved_blocks[name])
            windows = {
                codes_key(name): torch.empty(n, code_bytes_per_row(dim, saved), dtype=torch.uint8),
                qparams_key(name): torch.empty(n, 2 * blocks, dtype=torch.float16),
            }
        else:
            windows = {weight_key(name): torch.empty(n, dim, dtype=WEIGHT_DTYPES[saved])}
        load({k: _shard_rows(w, table=table, shard=s, rank=rank) for k, w in windows.items()})
        weight = local[name]
        if isinstance(weight, QuantizedRows):
            rows = _saved_rows(name, windows, saved, saved_blocks[name], slice(None))
            weight.assign(rows[:, s.col_start : s.col_end])
            continue
        for start in range(0, n, _CONVERT_ROWS):
            rows = _saved_rows(
                name, windows, saved, saved_blocks[name], slice(start, start + _CONVERT_ROWS)
            )
            weight[start : start + _CONVERT_ROWS].copy_(rows[:, s.col_start : s.col_end])


def _saved_rows(
    name: str,
    windows: dict[str, torch.Tensor],
    saved: str,
    blocks: list[tuple[int, int]],
    rows: slice,
) -> torch.Tensor:
    """The rows ``rows`` of a table's saved windows, as fp32 (every saved column)."""
    if saved in QUANTIZED:
        return dequantize_blocks(
            windows[codes_key(name)][rows],
            windows[qparams_key(name)][rows],
            blocks=blocks,
            precision=saved,
        )
    return windows[weight_key(name)][rows].float()
