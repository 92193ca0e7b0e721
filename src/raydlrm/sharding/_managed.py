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

Tables admitting at the first lookup (``admit_after = 1``) have fallback rows no training lookup
reads; :meth:`ManagedShards.refresh_fallbacks` sets them to the mean of their buckets' rows
when the step moved since the last time: before an evaluation's lookups and before a
checkpoint, an export or a delta reads the rows. Training never reads them, so when this
happens does not change what training computes (a resumed run trains as the saving one did).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from raydlrm.ids import clock
from raydlrm.models.embedding import EmbeddingBagConfig
from raydlrm.models.managed_ids import IdMap, bucket_of, fresh_rows, mix_ids
from raydlrm.sharding._layout import TbeGroup
from raydlrm.sharding.delta import ModifiedRows
from raydlrm.sharding.plan import Shard
from raydlrm.sharding.row_cache import RowCache
from raydlrm.sharding.sizes import refresh_chunk_rows

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
        self._refreshed: int | None = None
        self.maps: dict[str, IdMap] = {}
        self._pieces: list[list[_Piece]] = []
        for group in groups:
            pieces = []
            for j, (table, shard) in enumerate(group.shards):
                if table.managed is None:
                    continue
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
        cache: RowCache | None = None,
    ) -> torch.Tensor:
        """The group's ``indices`` (units one after another, unit ``u``'s ids from
        ``unit_offsets[u]``) with each managed table's raw ids replaced by their shard-local
        rows; rows given to new ids are reset first, in ``tbe`` or, for a group behind a row
        cache (int8/int4 weights, the ssd tier), in the rows behind ``cache``."""
        bounds = unit_offsets.tolist()
        indices = indices.clone()
        for piece in self._pieces[group]:
            lo, hi = bounds[piece.first_unit], bounds[piece.last_unit]
            now = clock(self.step, self.day)
            out = piece.id_map.assign(indices[lo:hi], now=now, training=training)
            indices[lo:hi] = out.rows
            if out.reset.numel():
                self._reset(tbe, cache, piece, out.reset)
            if modified is not None and out.counted.numel():
                modified.mark_table(group, piece.table_index, out.counted)
        return indices

    @torch.no_grad()
    def _reset(
        self, tbe: torch.nn.Module, cache: RowCache | None, piece: _Piece, rows: torch.Tensor
    ) -> None:
        """Fresh weights and zero optimizer state for shard-local ``rows`` of ``piece``."""
        shard = piece.shard
        values = fresh_rows(
            rows + shard.row_start,
            table=piece.table.name,
            num_embeddings=piece.table.num_embeddings,
            seed=self.seed,
            salt=self.step,
            col_start=shard.col_start,
            cols=shard.col_end - shard.col_start,
        )
        if cache is not None:
            cache.overwrite(piece.table_index, rows, values)
            return
        weight = tbe.split_embedding_weights()[piece.table_index]
        weight[rows] = values.to(device=weight.device, dtype=weight.dtype)
        states = tbe.split_optimizer_states()
        if states:
            for state in states[piece.table_index]:
                state[rows] = 0

    @torch.no_grad()
    def refresh_fallbacks(
        self,
        tbes: list[torch.nn.Module],
        caches: list[RowCache | None],
        modified: ModifiedRows | None,
    ) -> None:
        """Sets the fallback rows of the tables admitting at the first lookup to their buckets'
        mean rows, in each group's TBE ``tbes[group]`` or behind its row cache
        ``caches[group]``, unless done at this step already; marks them modified. Each shard is
        read in chunks through its tier (:func:`~raydlrm.sharding.sizes.refresh_chunk_rows`;
        behind a cache, through the cache, a chunk at most its slots), in its precision: the
        pass's peak is a chunk, not the shard (:func:`~raydlrm.sharding.sizes.refresh_bytes`)."""
        if self._refreshed == self.step:
            return
        self._refreshed = self.step
        for group, pieces in enumerate(self._pieces):
            cache = caches[group]
            for piece in pieces:
                if piece.id_map.policy.admit_after > 1:
                    continue
                dim = piece.shard.col_end - piece.shard.col_start
                if cache is not None:
                    i = piece.table_index
                    chunk = refresh_chunk_rows(dim, cache_rows=cache.slot_count(i))
                    rows, means = piece.id_map.bucket_means(
                        lambda r, c=cache, i=i: c.read(i, r), chunk_rows=chunk
                    )
                    if rows.numel():
                        cache.overwrite(i, rows, means)
                else:
                    weight = tbes[group].split_embedding_weights()[piece.table_index]
                    rows, means = piece.id_map.bucket_means(
                        lambda r, w=weight: w[r.to(w.device)], chunk_rows=refresh_chunk_rows(dim)
                    )
                    weight[rows.to(weight.device)] = means.to(weight.device, weight.dtype)
                if modified is not None and rows.numel():
                    modified.mark_table(group, piece.table_index, rows)

    def stats(self) -> dict[str, dict[str, int]]:
        """Table name -> its shard's map counters (:meth:`IdMap.stats`)."""
        return {name: m.stats() for name, m in self.maps.items()}
