"""The state of a sharded collection's rank: its shards' weights (views of the kernels' rows,
or of the rows behind their caches), their fused optimizer state, what memory they hold, the
``ssd`` shards and their caches' hit rates, the rows training steps modified, and the shards'
first values (copied from the unsharded tables, or created shard by shard).

*Column-wise row-wise Adagrad.* Row-wise Adagrad keeps one momentum per row, the mean of the
row's squared gradients. A column shard only sees its columns, so each shard keeps the momentum
of its own row segment (as TorchRec does): the column-wise update is exactly row-wise Adagrad
with each shard's row segment as the "row". It equals the unsharded update only when the table
has a single column shard. Adagrad and SGD are per element and exact. The width-weighted mean
of the segments' momenta is the unsharded definition (mean over the whole row) of the
accumulated squared gradients: what a resharded checkpoint loads
(:mod:`raydlrm.sharding.embedding_checkpoint`).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed import ProcessGroup

from raydlrm.models.embedding import EmbeddingBagCollection, EmbeddingBagConfig, init_rows_
from raydlrm.models.managed_ids import IdMap
from raydlrm.sharding._layout import TbeGroup
from raydlrm.sharding._managed import ManagedShards
from raydlrm.sharding.config import QUANTIZED
from raydlrm.sharding.delta import ModifiedRows
from raydlrm.sharding.plan import Shard, ShardingPlan
from raydlrm.sharding.quantized import QuantizedRows
from raydlrm.sharding.row_cache import RowCache

__all__ = ["LocalState"]

_INIT_CHUNK_ROWS = 65536
"""Rows of a quantized shard initialized at once (fp32 rows in memory while it is filled)."""


class LocalState:
    """The local state of :class:`~raydlrm.sharding.embedding.ShardedEmbeddingBagCollection`
    (a base class of it): the :class:`~raydlrm.sharding.types.ShardedTables` methods that read
    or change this rank's shards."""

    tables: list[EmbeddingBagConfig]
    plan: ShardingPlan
    tbes: nn.ModuleList
    _groups: list[TbeGroup]
    _caches: list[RowCache | None]
    _pieces: list[tuple[EmbeddingBagConfig, Shard]]
    _precisions: dict[str, str]
    _modified: ModifiedRows | None
    _managed: ManagedShards
    _device: torch.device
    _pg: ProcessGroup | None

    @torch.no_grad()
    def _init_weights(self, ebc: EmbeddingBagCollection) -> None:
        """Fills this rank's shards: copied from ``ebc``'s tables, or, for tables on the meta
        device, created from ``ebc.seed`` block by block (:func:`init_rows_`), so no rank ever
        holds more than its shards and every rank's rows equal the unsharded ones. Quantized
        shards are filled :data:`_INIT_CHUNK_ROWS` rows at a time, rounded to nearest."""
        shards = self.local_shards()
        configs = {t.name: t for t in self.tables}

        def fill(target: torch.Tensor, name: str, row_start: int, col_start: int) -> None:
            source = ebc.weights[name]
            if source.device.type == "meta":
                init_rows_(
                    target,
                    table=configs[name],
                    seed=ebc.seed,
                    row_start=row_start,
                    col_start=col_start,
                )
            else:
                rows, cols = target.shape
                target.copy_(
                    source.detach()[row_start : row_start + rows, col_start : col_start + cols]
                )

        for name, weight in self.local_tables().items():
            s = shards[name]
            if not isinstance(weight, QuantizedRows):
                fill(weight, name, s.row_start, s.col_start)
                continue
            for lo in range(0, weight.shape[0], _INIT_CHUNK_ROWS):
                chunk = torch.empty(min(_INIT_CHUNK_ROWS, weight.shape[0] - lo), weight.dim)
                fill(chunk, name, s.row_start + lo, s.col_start)
                weight.assign(chunk, start=lo)

    def local_tables(self) -> dict[str, torch.Tensor]:
        """Views of this rank's shard of each of its tables (one shard per table per rank).

        Returns:
            Table name -> ``(row_end - row_start, col_end - col_start)`` weights of the shard
            (see :meth:`local_shards`); a data-parallel table's full replica. Managed tables'
            fallback rows are refreshed first (see :mod:`raydlrm.sharding._managed`).
        """
        self._managed.refresh_fallbacks(list(self.tbes), self._caches, self._modified)
        tables = {}
        for group, tbe, cache in zip(self._groups, self.tbes, self._caches, strict=True):
            if cache is not None:  # the whole shard is in the file once the cache is flushed
                cache.flush()
                tables.update(cache.rows())
            else:
                tables.update(
                    (t.name, w)
                    for (t, _), w in zip(group.shards, tbe.split_embedding_weights(), strict=True)
                )
        return tables

    def ssd_tables(self) -> dict[str, tuple[torch.Tensor, tuple[int, int] | None]]:
        """This rank's ``ssd`` shards, as they are (no flush): table name -> (the rows in the
        file, (distinct ids found in the DRAM cache, distinct ids looked up) so far, or None
        for a table without a cache)."""
        out = {}
        for group, tbe, cache in zip(self._groups, self.tbes, self._caches, strict=True):
            if cache is not None and group.placement == "ssd":
                hits = cache.hit_rates()
                out.update(
                    (name, (rows.codes if isinstance(rows, QuantizedRows) else rows, hits[name]))
                    for name, rows in cache.rows().items()
                )
            elif group.placement == "ssd":
                views = tbe.split_embedding_weights()
                out.update(
                    (t.name, (w, None)) for (t, _), w in zip(group.shards, views, strict=True)
                )
        return out

    def id_maps(self) -> dict[str, IdMap]:
        """Table name -> the id map of this rank's shard, each managed table it holds
        (:mod:`raydlrm.sharding._managed`)."""
        return dict(self._managed.maps)

    @property
    def managed_clock(self) -> tuple[int, int]:
        """See :attr:`ShardedTables.managed_clock <raydlrm.sharding.types.ShardedTables>`."""
        return self._managed.step, self._managed.seed

    @managed_clock.setter
    def managed_clock(self, clock: tuple[int, int]) -> None:
        self._managed.step, self._managed.seed = int(clock[0]), int(clock[1])

    @property
    def managed_day(self) -> int:
        """The data's day (days since 1970-01-01) the managed tables' lookups happen on."""
        return self._managed.day

    @managed_day.setter
    def managed_day(self, day: int) -> None:
        self._managed.day = int(day)

    def local_shards(self) -> dict[str, Shard]:
        """Table name -> the :class:`Shard` this rank holds, for each of its tables."""
        return {t.name: s for t, s in self._pieces}

    def weight_precisions(self) -> dict[str, str]:
        """Table name -> its ``sharding.weights_precision``, every table."""
        return dict(self._precisions)

    def memory_bytes(self) -> int:
        """Bytes of memory (DRAM or the device's) this rank's tables hold: the kernels'
        weights and optimizer state (the slots of a cache), quantized rows with their scales,
        caches' bookkeeping and the rows' state in memory; not what lives in mapped files, nor
        a ``host`` table's rows in the host's memory (:meth:`host_bytes`)."""
        total = 0
        for group, tbe, cache in zip(self._groups, self.tbes, self._caches, strict=True):
            in_files = group.placement == "ssd" and cache is None
            if not in_files:
                tensors = list(tbe.split_embedding_weights())
                tensors += [x for states in tbe.split_optimizer_states() for x in states]
                total += sum(x.numel() * x.element_size() for x in tensors)
            if cache is not None:
                total += cache.memory_bytes(rows_in_memory=group.placement == "dram")
        return total

    def host_bytes(self) -> int:
        """Bytes of the host's memory this rank's ``host`` tables hold: their rows and their
        optimizer state."""
        total = 0
        for group, cache in zip(self._groups, self._caches, strict=True):
            if cache is None or group.placement != "host":
                continue
            states = cache.row_states()
            for name, rows in cache.rows().items():
                total += sum(x.numel() * x.element_size() for x in [rows, *states[name]])
        return total

    def cache_hit_rates(self) -> dict[str, tuple[int, int]]:
        """Per quantized or ``host`` table of this rank: (distinct ids found in its fp32 or
        GPU cache, distinct ids looked up) so far."""
        out = {}
        for group, cache in zip(self._groups, self._caches, strict=True):
            if cache is not None and (group.precision in QUANTIZED or group.placement == "host"):
                out.update(cache.hit_rates())
        return out

    def optimizer_states(self) -> dict[str, list[torch.Tensor]]:
        """Fused optimizer state of this rank's shards (views).

        Returns:
            Table name -> state tensors of the local shard: row-wise Adagrad one ``(rows,)``
            tensor (the momentum of the shard's row segments), Adagrad one ``(rows, cols)``
            tensor, SGD none.
        """
        states: dict[str, list[torch.Tensor]] = {}
        for group, tbe, cache in zip(self._groups, self.tbes, self._caches, strict=True):
            if cache is not None:
                cache.flush()
                states.update(cache.row_states())
                continue
            split = tbe.split_optimizer_states() or [[] for _ in group.shards]
            states.update({t.name: list(s) for (t, _), s in zip(group.shards, split, strict=True)})
        return states

    def track_modified_rows(self) -> None:
        """Starts flagging the rows training steps look up (one byte per row of the rank's
        shards; differential checkpoints, :mod:`raydlrm.sharding.delta`)."""
        if self._modified is None:
            self._modified = ModifiedRows(self._groups, self._device)

    def modified_rows(self) -> dict[str, torch.Tensor]:
        """Table name -> the shard-local rows training steps looked up since
        :meth:`clear_modified_rows` (a data-parallel table's: on any rank); every rank must
        call."""
        if self._modified is None:
            raise RuntimeError("modified rows are not tracked: call track_modified_rows() first")
        self._managed.refresh_fallbacks(list(self.tbes), self._caches, self._modified)
        replicated = {t.name for t in self.plan.tables if t.sharding_type == "data_parallel"}
        return self._modified.rows(replicated=replicated, pg=self._pg)

    def clear_modified_rows(self) -> None:
        if self._modified is not None:
            self._modified.clear()
