"""A row cache of a TBE group's ``ssd`` or quantized tables: fp32 slots the kernel trains, in
front of the tables' mapped files or quantized rows.

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

The same cache trains ``int8`` / ``int4`` tables (:mod:`raydlrm.sharding.quantized`), in DRAM,
on a GPU or in mapped files: their rows are read in dequantized to fp32 and written back
quantized with stochastic rounding, so the kernels only ever train fp32 slots. A quantized
table's cache finds its rows through a sorted copy of the slots' rows (``C`` entries) rather
than a slot number per row of the table (4 bytes per row, as much as the row-wise Adagrad
state), since a small cache in front of small rows is the point of quantizing.

Only rows a training step looked up (with autograd on) are written back: an evaluation's rows
leave the cache as they came, so evaluating never re-rounds a quantized row.

The same cache in GPU memory trains ``host`` tables (``sharding.placement``): the rows and
their optimizer state live in the host's pinned memory, the slots and the bookkeeping on the
GPU. A step's missed rows are gathered on the host into a pinned staging buffer and copied in
asynchronously (the host goes on launching the step's kernels; the GPU's stream orders the copy
before the lookup); evicted rows come back with one copy per table and step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from raydlrm.sharding.quantized import QuantizedRows
from raydlrm.sharding.tiers import TierError

__all__ = ["RowCache"]


def _stamp(step: int, slots: torch.Tensor, capacity: int) -> torch.Tensor:
    """The LRU stamps of ``slots`` looked up at ``step`` (0: empty; steps count from 1) in a
    cache of ``capacity`` slots: ``step * capacity + slot``, distinct, ordered by step, then by
    slot. Distinct because among equal keys, which ones ``topk`` picks (and in which order)
    differs between a CPU and a GPU, whose caches (and so their stochastic roundings of
    quantized rows) would then part ways."""
    return slots.to(torch.int64) + step * capacity


@dataclass
class _Table:
    """One table of the group: its slots in the TBE and its rows in the files (or quantized)."""

    name: str
    too_small: str  # the keys that sized the cache, for the error of a step that overflows it
    slots: torch.Tensor  # (C, D) the TBE's weights of this table: the cache
    slot_state: torch.Tensor | None  # (C,) or (C, D): the TBE's optimizer state
    rows: torch.Tensor | QuantizedRows  # (N, D): the table
    row_state: torch.Tensor | None  # (N,) DRAM or (N, D) mapped: the optimizer state
    slot_of: torch.Tensor | None  # (N,) int32: the slot holding each row, -1 if none
    row_of: torch.Tensor  # (C,) int64: the row each slot holds, -1 if none
    last_used: torch.Tensor  # (C,) int64: see _stamp
    dirty: torch.Tensor  # (C,) bool: the slot's row was looked up by a training step
    sorted_rows: torch.Tensor | None = None  # without slot_of: row_of sorted ...
    sorted_slots: torch.Tensor | None = None  # ... and the slot of each
    hits: int = 0  # distinct ids of the steps so far found in the cache
    misses: int = 0  # distinct ids of the steps so far read in from the file
    written: int = 0  # rows written back so far
    staging: _Staging | None = None  # rows in another memory (host) than the slots (GPU)

    @property
    def home(self) -> torch.device:
        """Where the rows (and their state) are: the host's memory for a ``host`` table, else
        the slots' device."""
        return self.rows.device

    def gather(self, source: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """``source[rows]`` (``rows`` on the slots' device) on the slots' device: through the
        pinned staging buffer when ``source`` is in the host's memory."""
        if self.staging is None:
            return source[rows]
        role = "state" if source is self.row_state else "rows"
        return self.staging.copy_in(source, rows.to(self.home), role=role)

    def scatter(self, target: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
        """``target[rows] = values`` (``rows`` and ``values`` on the slots' device)."""
        if self.staging is None:
            target[rows] = values
        else:
            target[rows.to(self.home)] = values.to(self.home)

    def find(self, rows: torch.Tensor) -> torch.Tensor:
        """The slot of each of ``rows`` (int64), -1 for a row not in the cache."""
        if self.slot_of is not None:
            return self.slot_of[rows].to(torch.int64)
        if self.sorted_rows is None:
            self.sorted_rows, self.sorted_slots = torch.sort(self.row_of)
        at = torch.searchsorted(self.sorted_rows, rows).clamp_(max=self.row_of.numel() - 1)
        held = self.sorted_rows[at] == rows
        return torch.where(held, self.sorted_slots[at], -1)

    def unmap(self, rows: torch.Tensor) -> None:
        """Forgets the slots of ``rows`` (their slots are refilled or emptied)."""
        if self.slot_of is not None:
            self.slot_of[rows] = -1
        self.sorted_rows = None

    def map(self, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Records ``rows`` as held by ``slots``."""
        if self.slot_of is not None:
            self.slot_of[rows] = slots.to(torch.int32)
        self.row_of[slots] = rows
        self.sorted_rows = None

    def write_back(self, slots: torch.Tensor) -> None:
        """Writes the dirty ones of ``slots`` to their rows (and state), in row order."""
        slots = slots[self.dirty[slots]]
        if not slots.numel():
            return
        rows, order = torch.sort(self.row_of[slots])  # in row order: the file is written in order
        slots = slots[order]
        self.scatter(self.rows, rows, self.slots[slots])
        if self.row_state is not None:
            self.scatter(self.row_state, rows, self.slot_state[slots])
        self.dirty[slots] = False
        self.written += int(rows.numel())


class _Staging:
    """Pinned host buffers that a ``host`` table's missed rows are gathered into and copied to
    the GPU from, asynchronously: a buffer is reused once the copy out of it is done (an
    event), so the host never overwrites rows still in flight."""

    def __init__(self, device: torch.device):
        self.device = device
        self._buffers: dict[tuple[str, torch.dtype, tuple[int, ...]], torch.Tensor] = {}
        self._events: dict[tuple[str, torch.dtype, tuple[int, ...]], torch.cuda.Event] = {}

    def copy_in(self, source: torch.Tensor, rows: torch.Tensor, *, role: str) -> torch.Tensor:
        """``source[rows]`` on the device, through the buffer of ``role`` (rows, state: each its
        own, so neither waits for the other's copy)."""
        key = (role, source.dtype, tuple(source.shape[1:]))
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape[0] < rows.numel():
            size = max(rows.numel(), 2 * (0 if buffer is None else buffer.shape[0]))
            pin = self.device.type == "cuda"
            buffer = torch.empty((size, *key[2]), dtype=source.dtype, pin_memory=pin)
            self._buffers[key] = buffer
        elif key in self._events:
            self._events[key].synchronize()  # the last copy out of it is done
        part = buffer[: rows.numel()]
        torch.index_select(source, 0, rows, out=part)
        if self.device.type != "cuda":
            return part.to(self.device, copy=True)
        values = part.to(self.device, non_blocking=True)
        self._events.setdefault(key, torch.cuda.Event()).record()
        return values


class RowCache:
    """The cache of one TBE group's ``ssd`` or quantized tables.

    Args:
        names: the group's tables, in TBE order.
        slots: the TBE's per-table weights (``split_embedding_weights()``), the cache.
        slot_states: the TBE's per-table optimizer state (first state of
            ``split_optimizer_states()``), or None for SGD.
        rows: per table, the full shard's weights: mapped from a file, or
            :class:`~raydlrm.sharding.quantized.QuantizedRows`.
        row_states: per table, the full shard's optimizer state, or None for SGD.
        unit_tables: the table of each of the group's units (features), in lookup order.
        too_small: per table, the keys that sized its cache (with their values), named by
            the error of a step whose distinct rows of the table outnumber its slots.
    """

    def __init__(
        self,
        names: list[str],
        *,
        slots: list[torch.Tensor],
        slot_states: list[torch.Tensor] | None,
        rows: list[torch.Tensor | QuantizedRows],
        row_states: list[torch.Tensor] | None,
        unit_tables: list[int],
        too_small: list[str],
    ):
        self._unit_tables = unit_tables
        self._units_of = [
            [u for u, t in enumerate(unit_tables) if t == i] for i in range(len(names))
        ]
        self._tables = []
        for i, name in enumerate(names):
            n, c, device = rows[i].shape[0], slots[i].shape[0], slots[i].device
            dense = not isinstance(rows[i], QuantizedRows)
            elsewhere = dense and rows[i].device != device
            self._tables.append(
                _Table(
                    name=name,
                    too_small=too_small[i],
                    slots=slots[i],
                    slot_state=None if slot_states is None else slot_states[i],
                    rows=rows[i],
                    row_state=None if row_states is None else row_states[i],
                    slot_of=torch.full((n,), -1, dtype=torch.int32, device=device)
                    if dense
                    else None,
                    row_of=torch.full((c,), -1, dtype=torch.int64, device=device),
                    last_used=_stamp(0, torch.arange(c, device=device), c),
                    dirty=torch.zeros(c, dtype=torch.bool, device=device),
                    staging=_Staging(device) if elsewhere else None,
                )
            )
        self._step = 0

    def rows(self) -> dict[str, torch.Tensor | QuantizedRows]:
        """Table name -> the shard's rows in the file (or quantized), as they are (without the
        cached updates: :meth:`flush` first for the table's values)."""
        return {t.name: t.rows for t in self._tables}

    def row_states(self) -> dict[str, list[torch.Tensor]]:
        """Table name -> the shard's optimizer state (``[]`` for SGD), as it is (:meth:`flush`
        first for its values)."""
        return {t.name: [] if t.row_state is None else [t.row_state] for t in self._tables}

    def prefetch(
        self, indices: torch.Tensor, ids_per_unit: torch.Tensor, *, training: bool
    ) -> torch.Tensor:
        """Brings every row ``indices`` looks up into the cache; returns the slot of each id.
        In a training step (``training``: the step's optimizer updates them) the rows' slots
        become dirty.

        Args:
            indices: the group's ids (rows of their tables), int64, unit by unit.
            ids_per_unit: how many of ``indices`` each unit has.
            training: the lookup is a training step's (the collection's ``training`` mode).

        Raises:
            TierError: a step looks up more distinct rows of a table than its cache has slots
                (naming the table and the settings that size the cache).
        """
        with torch.no_grad():
            return self._prefetch(indices, ids_per_unit, training=training)

    def _prefetch(
        self, indices: torch.Tensor, ids_per_unit: torch.Tensor, *, training: bool
    ) -> torch.Tensor:
        self._step += 1
        # The group's ids unit by unit; a table's units (its features) looked up together.
        pieces = indices.split(ids_per_unit.tolist())
        slots: list[torch.Tensor] = list(pieces)
        for t, units in zip(self._tables, self._units_of, strict=True):
            if not units:
                continue
            unique, inverse = torch.unique(
                torch.cat([pieces[u] for u in units]), return_inverse=True
            )
            if unique.numel() > t.row_of.numel():
                raise TierError(
                    f"table {t.name!r}: a step looks up {unique.numel()} distinct rows of "
                    f"its shard but its cache holds {t.row_of.numel()} (the planner sizes it for "
                    "the longest id lists of the data's first rows: a longer list came, or "
                    "the plan was made without the data); set "
                    f"data.sparse_specs.<column>.max_length, or raise {t.too_small}"
                )
            held = t.find(unique)
            hit = held >= 0
            t.last_used[held[hit]] = _stamp(self._step, held[hit], t.slots.shape[0])
            if training:
                t.dirty[held[hit]] = True
            missing = unique[~hit]
            t.hits += int(unique.numel() - missing.numel())
            t.misses += int(missing.numel())
            if missing.numel():
                held[~hit] = self._fill(t, missing, dirty=training)
            # Each id's slot, through the distinct rows' (no second search).
            parts = held[inverse].split([pieces[u].numel() for u in units])
            for u, part in zip(units, parts, strict=True):
                slots[u] = part
        return torch.cat(slots) if slots else indices.clone()

    def _fill(self, t: _Table, missing: torch.Tensor, *, dirty: bool) -> torch.Tensor:
        """Gives the rows ``missing`` (sorted) the least recently used slots not used this
        step, and returns them: evicted rows are written back first (those a training step
        looked up)."""
        # Empty slots (step 0) go first; this step's slots (the largest stamps) never
        # qualify, as the distinct rows of the step fit the cache. The stamps are distinct and
        # the victims sorted, so every device picks the same slots and gives them the same
        # (sorted) rows.
        victims = torch.topk(t.last_used, missing.numel(), largest=False, sorted=True).indices
        evicted = t.row_of[victims]
        valid = evicted >= 0
        if bool(valid.any()):
            t.write_back(victims[valid])
            t.unmap(evicted[valid])
        t.slots[victims] = t.gather(t.rows, missing).to(t.slots.dtype)
        if t.row_state is not None:
            t.slot_state[victims] = t.gather(t.row_state, missing)
        t.map(missing, victims)
        t.last_used[victims] = _stamp(self._step, victims, t.slots.shape[0])
        t.dirty[victims] = dirty
        return victims

    def slot_count(self, table: int) -> int:
        """Slots of table ``table``'s cache (the group's TBE order)."""
        return self._tables[table].slots.shape[0]

    @torch.no_grad()
    def read(self, table: int, rows: torch.Tensor) -> torch.Tensor:
        """The current fp32 values of rows ``rows`` of table ``table`` (the group's TBE order):
        a cached row's slot, else the row (dequantized)."""
        t = self._tables[table]
        rows = rows.to(t.row_of.device)
        slots = t.find(rows)
        values = t.gather(t.rows, rows).to(dtype=torch.float32)
        cached = slots >= 0
        values[cached] = t.slots[slots[cached]].float()
        return values

    @torch.no_grad()
    def overwrite(self, table: int, rows: torch.Tensor, values: torch.Tensor) -> None:
        """Writes ``values`` (fp32; rounded to the rows' precision) into rows ``rows`` of table
        ``table`` (the group's TBE order) and zeroes their optimizer state: a managed table's
        rows given to new ids. Their cached copies are dropped unwritten (the next lookup reads
        the new rows in)."""
        t = self._tables[table]
        rows = rows.to(t.row_of.device)
        slots = t.find(rows)
        held = slots >= 0
        cached = slots[held]
        if cached.numel():
            t.unmap(rows[held])
            t.row_of[cached] = -1
            t.dirty[cached] = False
            t.last_used[cached] = _stamp(0, cached, t.slots.shape[0])
        dtype = t.rows.dtype if isinstance(t.rows, torch.Tensor) else torch.float32
        t.scatter(t.rows, rows, values.to(device=t.row_of.device, dtype=dtype))
        if t.row_state is not None:
            shape = (rows.numel(), *t.row_state.shape[1:])
            zeros = torch.zeros(shape, dtype=t.row_state.dtype, device=t.row_of.device)
            t.scatter(t.row_state, rows, zeros)

    @torch.no_grad()
    def flush(self) -> None:
        """Writes every cached row (and its optimizer state) a training step looked up back
        and empties the cache."""
        for t in self._tables:
            cached = torch.nonzero(t.row_of >= 0).flatten()
            if cached.numel():
                t.write_back(cached)
                t.unmap(t.row_of[cached])
            t.row_of.fill_(-1)  # changes row_of only where unmap dropped the sorted index
            t.last_used.copy_(
                _stamp(0, torch.arange(t.slots.shape[0], device=t.slots.device), t.slots.shape[0])
            )

    def memory_bytes(self, *, rows_in_memory: bool) -> int:
        """Bytes the cache holds beyond the TBE's slots: its bookkeeping, the rows' optimizer
        state in memory, and (``rows_in_memory``: quantized rows not in a mapped file) the
        rows themselves."""
        total = 0
        for t in self._tables:
            parts = [t.row_of, t.last_used, t.dirty, t.slot_of, t.sorted_rows, t.sorted_slots]
            state = t.row_state  # row-wise Adagrad's is always in memory (a host table's: host)
            here = state is not None and state.device == t.slots.device
            if here and (rows_in_memory or state.dim() == 1):
                parts.append(state)
            total += sum(x.numel() * x.element_size() for x in parts if x is not None)
            if rows_in_memory:
                rows = t.rows
                total += rows.nbytes() if isinstance(rows, QuantizedRows) else 0
        return total

    def written_rows(self) -> dict[str, int]:
        """Table name -> rows written back (evicted or flushed after training) so far."""
        return {t.name: t.written for t in self._tables}

    def hit_rates(self) -> dict[str, tuple[int, int]]:
        """Table name -> (hits, lookups) of distinct ids per step, so far."""
        return {t.name: (t.hits, t.hits + t.misses) for t in self._tables}
