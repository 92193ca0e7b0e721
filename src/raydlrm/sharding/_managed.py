"""The managed tables of a sharded collection's rank: an id map per managed shard
(:class:`~raydlrm.models.managed_ids.IdMap`), applied between the input all-to-all and the
kernels.

A managed table's features carry raw ids. The input distribution routes each id to the shard
holding its bucket (:func:`route_rows`: the bucket's first row stands for the id when
bucketizing) and sends the id itself; the shard's map turns it into a shard-local row here, so one
rank decides every id's row and nothing is broadcast. Column shards of a table each receive the
same ids in the same order and keep identical maps. A row the map gives to a new id is reset
before the kernel reads it: fresh weights (:func:`~raydlrm.models.managed_ids.fresh_rows`, salted
with the step) and zero optimizer state.

The maps' state is row-indexed like the weights (see :mod:`raydlrm.models.managed_ids`); the
step counter (training lookups so far, the maps' clock) is saved with it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from raydlrm.ids import clock
from raydlrm.models.embedding import EmbeddingBagConfig
from raydlrm.models.managed_ids import IdMap, bucket_of, fresh_rows, mix_ids
from raydlrm.sharding._layout import TbeGroup
from raydlrm.sharding.config import QUANTIZED
from raydlrm.sharding.delta import ModifiedRows
from raydlrm.sharding.plan import Shard

__all__ = ["ManagedShards", "route_rows"]


def route_rows(ids: torch.Tensor, buckets: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The first row of each raw id's bucket (what the input distribution routes it by):
    ``buckets`` and ``rows`` are each id's table's bucket count and rows."""
    return bucket_of(mix_ids(ids), buckets) * rows // buckets


@dataclass
class _Piece:
    """A managed table of a TBE group: its TBE table index, its units, its map."""

    table_index: int
    first_unit: int
    last_unit: int
    table: EmbeddingBagConfig
    shard: Shard
    id_map: IdMap


class ManagedShards:
    """The id maps of a rank's managed shards.

    Args:
        groups: the rank's TBE groups.
        seed: the run's seed (fresh values of reset rows).
        device: where the maps live.
        keeps_clock: count steps (the collection has managed tables, on this rank or not: every
            rank keeps the same clock, so any rank's saved clock is the run's).

    Attributes:
        step: training lookups so far; with ``day`` (the data's day, days since 1970-01-01, set
            from ``data.data_date``) the maps' clock (:func:`raydlrm.ids.clock`).
    """

    def __init__(
        self, groups: list[TbeGroup], *, seed: int, device: torch.device, keeps_clock: bool
    ) -> None:
        self.seed = seed
        self.step = 0
        self.day = 0
        self._clock = keeps_clock
        self.maps: dict[str, IdMap] = {}
        self._pieces: list[list[_Piece]] = []
        for group in groups:
            pieces = []
            for j, (table, shard) in enumerate(group.shards):
                if table.managed is None:
                    continue
                if group.precision in QUANTIZED or group.placement == "ssd":
                    raise ValueError(
                        f"table {table.name}: a managed table is not yet supported with "
                        f"{group.precision} weights or on ssd (its rows live behind a row cache)"
                    )
                units = [u for u, t in enumerate(group.feature_table_map) if t == j]
                id_map = IdMap(
                    table.managed,
                    table=table.name,
                    num_embeddings=table.num_embeddings,
                    row_start=shard.row_start,
                    row_end=shard.row_end,
                    device=device,
                )
                self.maps[table.name] = id_map
                pieces.append(_Piece(j, units[0], units[-1] + 1, table, shard, id_map))
            self._pieces.append(pieces)

    def __bool__(self) -> bool:
        return bool(self.maps)

    def has(self, group: int) -> bool:
        return bool(self._pieces[group])

    def begin(self, training: bool) -> None:
        """A lookup of every group starts: a training one advances the maps' clock."""
        if training and self._clock:
            self.step += 1

    def rows(
        self,
        group: int,
        tbe: torch.nn.Module,
        indices: torch.Tensor,
        unit_offsets: torch.Tensor,
        *,
        training: bool,
        modified: ModifiedRows | None,
    ) -> torch.Tensor:
        """The group's ``indices`` (units one after another, unit ``u``'s ids from
        ``unit_offsets[u]``) with each managed table's raw ids replaced by their shard-local
        rows; rows given to new ids are reset in ``tbe`` first."""
        bounds = unit_offsets.tolist()
        indices = indices.clone()
        for piece in self._pieces[group]:
            lo, hi = bounds[piece.first_unit], bounds[piece.last_unit]
            now = clock(self.step, self.day)
            out = piece.id_map.assign(indices[lo:hi], now=now, training=training)
            indices[lo:hi] = out.rows
            if out.reset.numel():
                self._reset(tbe, piece, out.reset)
            if modified is not None and out.counted.numel():
                modified.mark_table(group, piece.table_index, out.counted)
        return indices

    @torch.no_grad()
    def _reset(self, tbe: torch.nn.Module, piece: _Piece, rows: torch.Tensor) -> None:
        """Fresh weights and zero optimizer state for shard-local ``rows`` of ``piece``."""
        shard = piece.shard
        weight = tbe.split_embedding_weights()[piece.table_index]
        values = fresh_rows(
            rows + shard.row_start,
            table=piece.table.name,
            num_embeddings=piece.table.num_embeddings,
            seed=self.seed,
            salt=self.step,
            col_start=shard.col_start,
            cols=shard.col_end - shard.col_start,
        )
        weight[rows] = values.to(device=weight.device, dtype=weight.dtype)
        states = tbe.split_optimizer_states()
        if states:
            for state in states[piece.table_index]:
                state[rows] = 0

    def stats(self) -> dict[str, dict[str, int]]:
        """Table name -> its shard's map counters (:meth:`IdMap.stats`)."""
        return {name: m.stats() for name, m in self.maps.items()}
