"""A DRAM cache of an ``ssd`` TBE group's rows, in front of their mapped files.

Without it, fbgemm's kernels update an ``ssd`` table's rows in place in the mapped file: every
updated row dirties its 4 KiB page, and once the dirty pages reach the kernel's dirty limits
the kernel holds training back to the disk's write-back rate (0.13 of DRAM's speed on 4.8 GB
of tables, 0.71 with the cache, in ``benchmarks/RESULTS.md``), however much of the table the
page cache holds. With
it, the TBE trains on a few cache slots per table in ordinary memory, and the file only sees
the rows the cache evicts, in id order: hot rows stay in DRAM and are written once, when they
leave.

Each step, before the lookup, :meth:`RowCache.prefetch` finds for every table the distinct ids
of the batch; the ids without a slot take the least recently used slots not needed by this
batch: their rows (and optimizer state) are written back to the file, the missing rows are
read in, and the batch's ids are rewritten as slot numbers. The TBE then looks up and updates
slots exactly as it would rows (same values, same duplicate-id handling, same fused update):
training equals the uncached table bit for bit (tested).

The optimizer state moves with the rows: row-wise Adagrad's one float per row lives in a DRAM
array of the whole shard, Adagrad's per-weight state in its own mapped file. Whoever reads or
writes the shard as a whole (checkpoints, resuming, resharding, export) calls :meth:`flush`
first: every cached row is written back and the cache emptied, so the file is the table and
the next step reads the rows it needs again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from raydlrm.sharding.tiers import TierError

__all__ = ["RowCache"]


@dataclass
class _Table:
    """One table of the group: its slots in the TBE and its rows in the files."""

    name: str
    slots: torch.Tensor  # (C, D) the TBE's weights of this table: the cache
    slot_state: torch.Tensor | None  # (C,) or (C, D): the TBE's optimizer state
    rows: torch.Tensor  # (N, D) mapped: the table
    row_state: torch.Tensor | None  # (N,) DRAM or (N, D) mapped: the optimizer state
    slot_of: torch.Tensor  # (N,) int32: the slot holding each row, -1 if none
    row_of: torch.Tensor  # (C,) int64: the row each slot holds, -1 if none
    last_used: torch.Tensor  # (C,) int64: step each slot was last looked up, -1 if never
    hits: int = 0  # distinct ids of the steps so far found in the cache
    misses: int = 0  # distinct ids of the steps so far read in from the file


class RowCache:
    """The DRAM cache of one TBE group's ``ssd`` tables.

    Args:
        names: the group's tables, in TBE order.
        slots: the TBE's per-table weights (``split_embedding_weights()``), the cache.
        slot_states: the TBE's per-table optimizer state (first state of
            ``split_optimizer_states()``), or None for SGD.
        rows: per table, the full shard's weights (mapped from a file).
        row_states: per table, the full shard's optimizer state, or None for SGD.
        unit_tables: the table of each of the group's units (features), in lookup order.
    """

    def __init__(
        self,
        names: list[str],
        *,
        slots: list[torch.Tensor],
        slot_states: list[torch.Tensor] | None,
        rows: list[torch.Tensor],
        row_states: list[torch.Tensor] | None,
        unit_tables: list[int],
    ):
        self._unit_tables = unit_tables
        self._units_of = [
            [u for u, t in enumerate(unit_tables) if t == i] for i in range(len(names))
        ]
        self._tables = []
        for i, name in enumerate(names):
            n, c = rows[i].shape[0], slots[i].shape[0]
            self._tables.append(
                _Table(
                    name=name,
                    slots=slots[i],
                    slot_state=None if slot_states is None else slot_states[i],
                    rows=rows[i],
                    row_state=None if row_states is None else row_states[i],
                    slot_of=torch.full((n,), -1, dtype=torch.int32),
                    row_of=torch.full((c,), -1, dtype=torch.int64),
                    last_used=torch.full((c,), -1, dtype=torch.int64),
                )
            )
        self._step = 0

    def rows(self) -> dict[str, torch.Tensor]:
        """Table name -> the shard's rows in the file, as they are (without the cached
        updates: :meth:`flush` first for the table's values)."""
        return {t.name: t.rows for t in self._tables}

    def row_states(self) -> dict[str, list[torch.Tensor]]:
        """Table name -> the shard's optimizer state (``[]`` for SGD), as it is (:meth:`flush`
        first for its values)."""
        return {t.name: [] if t.row_state is None else [t.row_state] for t in self._tables}

    @torch.no_grad()
    def prefetch(self, indices: torch.Tensor, ids_per_unit: torch.Tensor) -> torch.Tensor:
        """Brings every row ``indices`` looks up into the cache; returns the slot of each id.

        Args:
            indices: the group's ids (rows of their tables), int64, unit by unit.
            ids_per_unit: how many of ``indices`` each unit has.

        Raises:
            TierError: a step looks up more distinct rows of a table than its cache has slots
                (naming the table and ``sharding.ssd_cache_min_rows``).
        """
        self._step += 1
        # The group's ids unit by unit; a table's units (its features) looked up together.
        pieces = indices.split(ids_per_unit.tolist())
        for t, units in zip(self._tables, self._units_of, strict=True):
            if not units:
                continue
            unique = torch.unique(torch.cat([pieces[u] for u in units]))
            if unique.numel() > t.row_of.numel():
                raise TierError(
                    f"ssd table {t.name!r}: a step looks up {unique.numel()} distinct rows of "
                    f"its shard but its DRAM cache holds {t.row_of.numel()}; raise "
                    "sharding.ssd_cache_min_rows (or ssd_cache_load_factor)"
                )
            held = t.slot_of[unique].to(torch.int64)
            hit = held >= 0
            t.last_used[held[hit]] = self._step
            missing = unique[~hit]
            t.hits += int(unique.numel() - missing.numel())
            t.misses += int(missing.numel())
            if missing.numel():
                self._fill(t, missing)
        slots = [
            self._tables[table].slot_of[p]
            for p, table in zip(pieces, self._unit_tables, strict=True)
        ]
        return torch.cat(slots).to(torch.int64) if slots else indices.clone()

    def _fill(self, t: _Table, missing: torch.Tensor) -> None:
        """Gives the rows ``missing`` (sorted) the least recently used slots not used this
        step: evicted rows are written back first."""
        # Empty slots (-1) go first; this step's slots (the largest stamp) never qualify, as
        # the distinct rows of the step fit the cache.
        victims = torch.topk(t.last_used, missing.numel(), largest=False, sorted=False).indices
        evicted = t.row_of[victims]
        valid = evicted >= 0
        if bool(valid.any()):
            old, order = torch.sort(evicted[valid])  # in row order: the file is written in order
            from_slots = victims[valid][order]
            t.rows[old] = t.slots[from_slots]
            if t.row_state is not None:
                t.row_state[old] = t.slot_state[from_slots]
            t.slot_of[old] = -1
        t.slots[victims] = t.rows[missing]
        if t.row_state is not None:
            t.slot_state[victims] = t.row_state[missing]
        t.slot_of[missing] = victims.to(torch.int32)
        t.row_of[victims] = missing
        t.last_used[victims] = self._step

    @torch.no_grad()
    def flush(self) -> None:
        """Writes every cached row (and its optimizer state) back and empties the cache."""
        for t in self._tables:
            cached = torch.nonzero(t.row_of >= 0).flatten()
            if cached.numel():
                rows, order = torch.sort(t.row_of[cached])
                slots = cached[order]
                t.rows[rows] = t.slots[slots]
                if t.row_state is not None:
                    t.row_state[rows] = t.slot_state[slots]
                t.slot_of[rows] = -1
            t.row_of.fill_(-1)
            t.last_used.fill_(-1)

    def hit_rates(self) -> dict[str, tuple[int, int]]:
        """Table name -> (hits, lookups) of distinct ids per step, so far."""
        return {t.name: (t.hits, t.hits + t.misses) for t in self._tables}
