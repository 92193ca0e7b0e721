"""Differential checkpoints (Check-N-Run): the embedding rows modified since the last checkpoint.

A training step's fused optimizer updates only the rows its batch looked up, so a collection
that tracks them (:class:`ModifiedRows`: one flag per row of each local shard, set by every
lookup made with autograd on; evaluation does not set it) knows which rows changed since it was
last cleared. A *delta* holds those rows only, per table and per saving rank ("piece"):

* ``delta.<table>.rank<r>.rows``: int64 global rows of the table;
* ``delta.<table>.rank<r>.weight``: their weights in the shard's columns (fp32 or fp16), or
  ``.codes`` (uint8) and ``.qparams`` (fp16 scale and bias per row) for a table held quantized
  or checkpointed at ``int8``;
* ``delta.<table>.rank<r>.momentum`` (row-wise Adagrad, ``(n,)``) or ``.sum`` (Adagrad,
  ``(n, cols)``), always fp32;
* ``delta.<table>.rank<r>.id_map``: a managed table's map rows, ``(n, 4)`` int64
  (:mod:`raydlrm.sharding.id_map_checkpoint`), and the maps' clock.

The piece's columns are those of rank ``r``'s shard in the saving plan. A data-parallel table's
replicas update every rank's looked-up rows (their gradients are all-gathered), so its flags are
the union over ranks and rank 0 writes its piece, the whole table's columns.

:func:`apply_delta` writes a delta into any plan's shards (another world size or sharding
type): each rank reads the pieces overlapping its rectangle, assembles their rows of its
columns (weights and Adagrad's sum by column, row-wise Adagrad's momentum as the
width-weighted mean of the saved blocks, as a full load does) and writes them over the rows it
holds; a quantized piece of the same precision and column block is copied byte for byte.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from raydlrm.models.quantized import block_code_columns, dequantize_rows, quantize_rows
from raydlrm.sharding._layout import TbeGroup
from raydlrm.sharding.config import QUANTIZED
from raydlrm.sharding.embedding_checkpoint import column_blocks
from raydlrm.sharding.id_map_checkpoint import STEP_KEY
from raydlrm.sharding.plan import Shard, ShardingPlan, TablePlan
from raydlrm.sharding.quantized import QuantizedRows
from raydlrm.sharding.types import ShardedTables

__all__ = [
    "DeltaError",
    "ModifiedRows",
    "apply_delta",
    "delta_key",
    "delta_state_dict",
    "delta_tables",
    "patch_model_tensor",
    "saved_pieces",
]

ReadFn = Callable[[list[str]], dict[str, torch.Tensor]]
"""``read(keys)``: the delta's tensors ``keys``, read whole."""


class DeltaError(ValueError):
    """A delta that does not fit the checkpoint it is applied to (rows or columns missing)."""


def delta_key(table: str, rank: int, part: str) -> str:
    """The key of ``part`` (``rows``, ``weight``, ``codes``, ``qparams``, ``momentum``,
    ``sum``) of rank ``rank``'s piece of ``table``."""
    return f"delta.{table}.rank{rank}.{part}"


class ModifiedRows:
    """One flag per row of each of a rank's TBE groups, set by the lookups of training steps.

    Args:
        groups: the rank's TBE groups (the collection's ``_groups``).
        device: where the lookups' ids are.
    """

    def __init__(self, groups: list[TbeGroup], device: torch.device) -> None:
        self._flags: list[torch.Tensor] = []
        self._unit_starts: list[torch.Tensor] = []
        self._pieces: list[list[tuple[str, int, int]]] = []
        self._table_starts: list[list[int]] = []
        for group in groups:
            starts = [0]
            for _, s in group.shards:
                starts.append(starts[-1] + s.row_end - s.row_start)
            self._table_starts.append(starts)
            self._flags.append(torch.zeros(starts[-1], dtype=torch.bool, device=device))
            self._unit_starts.append(
                torch.tensor([starts[j] for j in group.feature_table_map], device=device)
            )
            self._pieces.append(
                [(t.name, starts[j], starts[j + 1]) for j, (t, _) in enumerate(group.shards)]
            )

    def mark(self, group: int, indices: torch.Tensor, ids_per_unit: torch.Tensor) -> None:
        """Flags the rows ``indices`` (shard-local, the group's units one after another,
        ``ids_per_unit`` of each) of TBE group ``group``."""
        starts = torch.repeat_interleave(
            self._unit_starts[group], ids_per_unit, output_size=indices.numel()
        )
        self._flags[group][indices + starts] = True

    def mark_table(self, group: int, table: int, rows: torch.Tensor) -> None:
        """Flags shard-local ``rows`` of TBE table ``table`` of group ``group`` (rows whose
        managed-id map state a step changed without looking them up)."""
        self._flags[group][rows + self._table_starts[group][table]] = True

    def rows(self, *, replicated: set[str], pg: Any = None) -> dict[str, torch.Tensor]:
        """Table name -> the sorted shard-local rows flagged since :meth:`clear` (CPU int64),
        every table of the rank; a ``replicated`` (data-parallel) table's are the union over
        the ranks of ``pg`` (every rank must call)."""
        flags = {
            name: flags[lo:hi]
            for flags, pieces in zip(self._flags, self._pieces, strict=True)
            for name, lo, hi in pieces
        }
        shared = sorted(n for n in flags if n in replicated)
        if shared and dist.is_available() and dist.is_initialized():
            union = torch.cat([flags[n] for n in shared]).to(torch.uint8)
            if dist.get_world_size(pg) > 1:
                dist.all_reduce(union, op=dist.ReduceOp.MAX, group=pg)
            for name, part in zip(
                shared, union.split([flags[n].numel() for n in shared]), strict=False
            ):
                flags[name] = part.bool()
        return {name: torch.nonzero(f).flatten().cpu() for name, f in flags.items()}

    def clear(self) -> None:
        for flags in self._flags:
            flags.zero_()


def _weight_rows(
    weight: torch.Tensor | QuantizedRows, index: torch.Tensor, precision: str
) -> dict[str, torch.Tensor]:
    """Rows ``index`` of a shard's weights as a piece stores them, checkpointed at
    ``precision`` (a table's own precision, or a lower one it is rounded to)."""
    if isinstance(weight, QuantizedRows):
        return {"codes": weight.codes[index], "qparams": weight.params[index]}
    rows = weight[index]
    if precision in QUANTIZED:
        codes, params = quantize_rows(rows, precision=precision)
        return {"codes": codes, "qparams": params}
    return {"weight": rows.half() if precision == "fp16" else rows}


def delta_state_dict(
    collection: ShardedTables,
    *,
    plan: ShardingPlan,
    rank: int,
    optimizer: str,
    rows: dict[str, torch.Tensor],
    precisions: dict[str, str],
) -> dict[str, torch.Tensor]:
    """This rank's pieces of a delta: the ``rows`` (shard-local, by table, from
    :meth:`ModifiedRows.rows`) of each of its tables, their weights at ``precisions`` (table
    -> the precision the checkpoint holds it in) and their fused optimizer state."""
    local = collection.local_tables()
    states = collection.optimizer_states() if optimizer != "sgd" else {}
    shards = collection.local_shards()
    maps = collection.id_maps()
    out: dict[str, torch.Tensor] = {}
    if maps or any(t.buckets for t in plan.tables):
        out[STEP_KEY] = torch.tensor(collection.managed_clock, dtype=torch.int64)
    for table in plan.tables:
        name = table.name
        if name not in rows or (
            table.sharding_type == "data_parallel" and rank != table.shards[0].rank
        ):
            continue
        weight = local[name]
        index = rows[name].to(weight.device)
        piece = {"rows": rows[name] + shards[name].row_start}
        piece.update(_weight_rows(weight, index, precisions[name]))
        if optimizer != "sgd":
            part = "momentum" if optimizer == "rowwise_adagrad" else "sum"
            piece[part] = states[name][0][index]
        if name in maps:
            piece["id_map"] = maps[name].state[:, index.to(maps[name].device)].t()
        out.update({delta_key(name, rank, k): v for k, v in piece.items()})
    return out


def saved_pieces(table: TablePlan) -> list[Shard]:
    """The pieces a delta holds of ``table`` in its saving plan: each rank's shard, or the whole
    table from its first replica's rank for a data-parallel table (rank 0 but for towers, whose
    replicas are on their host's ranks)."""
    if table.sharding_type == "data_parallel":
        return [Shard(table.shards[0].rank, 0, table.num_embeddings, 0, table.embedding_dim)]
    return list(table.shards)


def delta_tables(metadata: dict[str, Any]) -> set[str]:
    """The tables a delta's DCP ``metadata`` holds pieces of."""
    return {key.split(".")[1] for key in metadata if key.startswith("delta.")}


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> int:
    return max(0, min(a[1], b[1]) - max(a[0], b[0]))


def _piece_floats(piece: dict[str, torch.Tensor], precision: str) -> torch.Tensor:
    """A piece's weights as fp32 rows."""
    if "codes" in piece:
        return dequantize_rows(piece["codes"], piece["qparams"], precision=precision)
    return piece["weight"].float()


class _Patch:
    """The rows a delta holds in one rank's rectangle of one table, assembled from the
    pieces that overlap it."""

    def __init__(self, shard: Shard, pieces: list[tuple[Shard, dict[str, torch.Tensor]]]):
        self.shard = shard
        inside = [(p["rows"] >= shard.row_start) & (p["rows"] < shard.row_end) for _, p in pieces]
        self.rows = torch.unique(
            torch.cat([p["rows"][m] for (_, p), m in zip(pieces, inside, strict=True)])
        )
        self.pieces = [
            (s, {k: v[m] for k, v in p.items()}, torch.searchsorted(self.rows, p["rows"][m]))
            for (s, p), m in zip(pieces, inside, strict=True)
        ]

    def columns(self, part: str, precision: str) -> torch.Tensor:
        """The rows' values of the shard's columns, ``(rows, cols)`` fp32, from ``part``
        (``weight``: dequantized as needed; ``sum``)."""
        lo, hi = self.shard.col_start, self.shard.col_end
        out = torch.empty(self.rows.numel(), hi - lo)
        covered = torch.zeros(self.rows.numel(), dtype=torch.int64)
        for s, piece, pos in self.pieces:
            a, b = max(lo, s.col_start), min(hi, s.col_end)
            if a >= b:
                continue
            values = _piece_floats(piece, precision) if part == "weight" else piece[part]
            out[pos, a - lo : b - lo] = values[:, a - s.col_start : b - s.col_start].float()
            covered[pos] += b - a
        if bool((covered != hi - lo).any()):
            raise DeltaError(f"its pieces do not cover columns [{lo}, {hi}) of every row they hold")
        return out

    def momentum(self) -> torch.Tensor:
        """Row-wise Adagrad's momentum of the rows: the width-weighted mean over the saved
        column blocks overlapping the shard's columns (the saved value itself for one)."""
        cols = (self.shard.col_start, self.shard.col_end)
        parts = [
            (pos, piece["momentum"], _overlap(cols, (s.col_start, s.col_end)))
            for s, piece, pos in self.pieces
            if _overlap(cols, (s.col_start, s.col_end))
        ]
        out = torch.empty(self.rows.numel())
        if len({s.col_start for s, _, _ in self.pieces}) == 1:  # one block: as saved
            for pos, value, _ in parts:
                out[pos] = value
            return out
        num, den = torch.zeros(self.rows.numel()), torch.zeros(self.rows.numel())
        for pos, value, width in parts:
            num.index_add_(0, pos, value * width)
            den.index_add_(0, pos, torch.full_like(value, float(width)))
        return num / den


@torch.no_grad()
def apply_delta(
    collection: ShardedTables,
    *,
    plan: ShardingPlan,
    rank: int,
    optimizer: str,
    saved_plan: ShardingPlan,
    saved_precisions: dict[str, str],
    metadata: dict[str, Any],
    read: ReadFn,
) -> None:
    """Writes a delta over this rank's shards of ``plan`` (any plan; see the module
    docstring), table by table.

    Args:
        collection: the sharded collection, holding the delta's baseline (and earlier deltas).
        plan: its plan.
        rank: this rank.
        optimizer: the fused optimizer.
        saved_plan: the plan that wrote the delta.
        saved_precisions: table name -> the precision the delta holds it in.
        metadata: the delta's DCP ``state_dict_metadata`` (which pieces it has).
        read: reads the delta's tensors.

    Raises:
        DeltaError: naming the table whose pieces do not cover the rows they hold.
    """
    local = collection.local_tables()
    states = collection.optimizer_states() if optimizer != "sgd" else {}
    shards = collection.local_shards()
    saved_tables = {t.name: t for t in saved_plan.tables}
    wanted = {  # table -> the saved pieces overlapping this rank's rectangle
        name: [s for s in saved_pieces(saved_tables[name]) if _wanted(s, shard, metadata, name)]
        for name, shard in shards.items()
    }
    maps = collection.id_maps()
    for name, pieces in _read_pieces(wanted, metadata, read).items():
        try:
            patch = _Patch(shards[name], pieces)
            _write_patch(
                patch,
                local[name],
                states.get(name, [None])[0],
                optimizer=optimizer,
                precision=saved_precisions[name],
            )
        except DeltaError as exc:
            raise DeltaError(f"table {name!r}: {exc}") from exc
        if name in maps:
            _write_id_map(patch, maps[name].state)
    if STEP_KEY in metadata:
        collection.managed_clock = tuple(read([STEP_KEY])[STEP_KEY].tolist())


def _write_id_map(patch: _Patch, state: torch.Tensor) -> None:
    """A delta's map rows of a managed table over the shard's map (``(4, rows)``)."""
    for _, piece, pos in patch.pieces:
        if "id_map" in piece:
            index = (patch.rows[pos] - patch.shard.row_start).to(state.device)
            state[:, index] = piece["id_map"].t().to(state.device)


def _read_pieces(
    wanted: dict[str, list[Shard]], metadata: dict[str, Any], read: ReadFn
) -> dict[str, list[tuple[Shard, dict[str, torch.Tensor]]]]:
    """Table -> its ``wanted`` pieces with their tensors by part, read in one pass over the
    delta's files; tables with none are left out."""
    prefixes = {(name, s): delta_key(name, s.rank, "") for name, ss in wanted.items() for s in ss}
    keys = [k for p in prefixes.values() for k in metadata if k.startswith(p)]
    tensors = read(keys) if keys else {}
    out: dict[str, list[tuple[Shard, dict[str, torch.Tensor]]]] = {}
    for (name, s), prefix in prefixes.items():
        parts = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
        out.setdefault(name, []).append((s, parts))
    return out


def _wanted(saved: Shard, shard: Shard, metadata: dict[str, Any], name: str) -> bool:
    """Whether the delta holds a piece ``saved`` of table ``name`` overlapping ``shard``."""
    return (
        delta_key(name, saved.rank, "rows") in metadata
        and _overlap((saved.row_start, saved.row_end), (shard.row_start, shard.row_end)) > 0
        and _overlap((saved.col_start, saved.col_end), (shard.col_start, shard.col_end)) > 0
    )


def _write_patch(
    patch: _Patch,
    weight: torch.Tensor | QuantizedRows,
    state: torch.Tensor | None,
    *,
    optimizer: str,
    precision: str,
) -> None:
    if patch.rows.numel() == 0:
        return
    index = (patch.rows - patch.shard.row_start).to(weight.device)
    cols = (patch.shard.col_start, patch.shard.col_end)
    same = [
        (piece, pos)
        for s, piece, pos in patch.pieces
        if (s.col_start, s.col_end) == cols and "codes" in piece
    ]
    if (
        isinstance(weight, QuantizedRows)
        and precision == weight.precision
        and len(same) == len(patch.pieces)
    ):  # the saved codes of the shard's own column block: copied
        for piece, pos in same:
            weight.codes[index[pos]] = piece["codes"].to(weight.device)
            weight.params[index[pos]] = piece["qparams"].to(weight.device)
    elif isinstance(weight, QuantizedRows):
        codes, params = quantize_rows(
            patch.columns("weight", precision), precision=weight.precision
        )
        weight.codes[index], weight.params[index] = (
            codes.to(weight.device),
            params.to(weight.device),
        )
    else:
        weight[index] = patch.columns("weight", precision).to(weight.device, weight.dtype)
    if optimizer == "rowwise_adagrad":
        state[index] = patch.momentum().to(state.device)
    elif optimizer == "adagrad":
        state[index] = patch.columns("sum", precision).to(state.device)


@torch.no_grad()
def patch_model_tensor(
    tensor: torch.Tensor,
    *,
    table: TablePlan,
    part: str,
    precision: str,
    metadata: dict[str, Any],
    read: ReadFn,
) -> None:
    """Writes a delta's rows of ``table`` over a whole table's tensor as a checkpoint of the
    same plan holds it (unsharding a chain in one process): ``part`` ``weight`` ``(N, D)``,
    ``id_map`` ``(N, 4)`` (a managed table's map), ``codes`` ``(N, code bytes)`` or
    ``qparams`` ``(N, 2 K)`` (column block ``k`` at ``2k``),
    the delta holding the table at ``precision``."""
    blocks = column_blocks(table)
    for s in saved_pieces(table):
        keys = [delta_key(table.name, s.rank, "rows"), delta_key(table.name, s.rank, part)]
        if keys[0] not in metadata:
            continue
        got = read(keys)
        rows, values = got[keys[0]], got[keys[1]]
        if part == "weight":
            tensor[rows, s.col_start : s.col_end] = values.to(tensor.dtype)
        elif part == "id_map":  # a managed table's (rows, 4) map
            tensor[rows] = values
        elif part == "codes":
            lo, hi = block_code_columns(s.col_start, s.col_end, precision)
            tensor[rows, lo:hi] = values
        else:
            k = blocks.index((s.col_start, s.col_end))
            tensor[rows, 2 * k : 2 * k + 2] = values
