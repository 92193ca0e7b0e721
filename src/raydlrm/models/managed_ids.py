"""A collision-free id -> row map over a managed table's rows, with admission and eviction.

The map lives in the table's rows: row ``r`` of a managed table has, beside its weights, four
int64 values (:class:`IdMap` ``state``, 32 bytes a row): the id holding it (:data:`EMPTY` if no
id ever did, :data:`FALLBACK` for a bucket's fallback row), the step it was last looked up in
training, how often it was looked up, and an admission counter. Because the map is per-row
state, it is sharded, checkpointed, resharded and tracked for differential checkpoints exactly
as the rows are.

Layout (fixed for the table's life, independent of the sharding):

- the rows are split into ``B`` *buckets* (:meth:`raydlrm.ids.ManagedIds.buckets_for`), bucket
  ``b`` holding rows ``[b R // B, (b + 1) R // B)``; an id belongs to bucket :func:`bucket_of`
  its ``mix(id)`` (``mix``: the splitmix64 finalizer), and a shard holds whole buckets;
- a bucket's first row is its *fallback row*: ids not yet admitted (``admit_after``) read it in
  training, and ids the map does not know read it in evaluation and scoring. With
  ``admit_after > 1`` it trains like any row: it learns the ids below the threshold. With
  ``admit_after = 1`` no training lookup reads it, so it does not train; instead it is set to
  the mean of the rows of its bucket's ids (:meth:`IdMap.bucket_means`) before an evaluation's
  lookups and before a checkpoint or export reads the rows (:mod:`raydlrm.sharding._managed`):
  an unknown id is scored as the average known id of its bucket, not by random initial values;
- the other rows are the bucket's slots. An id's *window* is ``probe_window`` slots from its home
  slot on (a hash of the id), wrapping inside the bucket. An id is only ever placed in its
  window, and slots never become empty again, so looking an id up probes its window up to the
  first empty slot (linear probing, vectorized: every unresolved id advances one slot per round).

An admitted id not in the map takes the first empty slot of its window (or, with ``ttl``
eviction, the first expired one). With none, a victim is chosen in the window by the eviction
policy among the rows not looked up in this step; its weights are drawn afresh and its optimizer
state zeroed by the caller (the rows :meth:`IdMap.assign` returns as ``reset``). Ids racing for
one slot in one call: the smallest id wins, the others probe again, so the result is a pure
function of the state and the *set* of ids with their counts, not of their order: replicas that
see the same ids (a table's column shards) hold the same map without talking, and the map of a
table is the same however it is sharded (one map over the whole table equals its shards' maps).

Admission counts live in the rows too: an id not in the map adds its lookups to two counters of
its bucket (chosen by two more hashes) and is admitted once the smaller of the two reaches
``admit_after`` (a count-min sketch: it can over-count, never under-count).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from raydlrm.ids import DAY_SHIFT, ManagedIds, bucket_bounds

__all__ = [
    "EMPTY",
    "FALLBACK",
    "IdMap",
    "IdMaps",
    "ManagedIdsError",
    "bucket_of",
    "fresh_rows",
    "mix_ids",
]

EMPTY = -1
"""The id column of a row no id ever held."""
FALLBACK = -2
"""The id column of a bucket's fallback row."""
ID, LAST, COUNT, SEEN = range(4)
"""Columns of :attr:`IdMap.state`."""
COUNTERS = ("lookups", "admissions", "rejections", "evictions", "unknown", "max_probe")
"""What :attr:`IdMap.counters` counts, since the map was made (this shard): id lookups in
training; ids given a row; lookups of ids below ``admit_after`` (read the fallback row);
rows taken from another id; lookups outside training of ids the map does not hold (read the
fallback row); the longest probe (slots)."""

_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_MUL1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MUL2 = 0x94D049BB133111EB - (1 << 64)
_SKETCH_SALT = 0x5851F42D4C957F2D
_NEVER = (1 << 63) - 1
_ROUNDS = 4
"""Probe rounds one slot at a time (most ids resolve in the first); then the rest of the
windows of the ids left are read at once."""


class ManagedIdsError(RuntimeError):
    """A managed table could not place an admitted id (eviction off and its window full, or
    every row of its window taken in the same step)."""


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 ``x`` (torch's ``>>`` is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def mix_ids(ids: torch.Tensor) -> torch.Tensor:
    """The splitmix64 finalizer on int64 ``ids`` (wrapping arithmetic), the same bits as
    :func:`raydlrm.ingestion.preprocess.mix64` on their uint64 view."""
    z = ids.to(torch.int64) + _GOLDEN
    z = (z ^ _shr(z, 30)) * _MUL1
    z = (z ^ _shr(z, 27)) * _MUL2
    return z ^ _shr(z, 31)


def bucket_of(mixed: torch.Tensor, buckets: torch.Tensor | int) -> torch.Tensor:
    """The bucket of ids whose :func:`mix_ids` are ``mixed``, of ``buckets`` (a multiply-shift
    of the low 32 bits: no division)."""
    return ((mixed & 0xFFFFFFFF) * buckets) >> 32


def fresh_rows(
    rows: torch.Tensor,
    *,
    table: str,
    num_embeddings: int,
    seed: int,
    salt: int,
    col_start: int,
    cols: int,
) -> torch.Tensor:
    """Fresh values of table rows ``rows`` (global indices), columns ``[col_start, col_start +
    cols)``: uniform in ``±sqrt(1 / num_embeddings)`` like the first values, drawn from a
    counter-based generator of (seed, table, salt, row, column), so every shard of a row (and
    every device) draws the same values, and a row reset at another ``salt`` (step) others."""
    digest = hashlib.blake2b(f"{seed}/{table}/reset/{salt}".encode(), digest_size=8).digest()
    key = int.from_bytes(digest, "little") & _NEVER
    columns = torch.arange(col_start, col_start + cols, device=rows.device)
    counter = rows.to(torch.int64).unsqueeze(1) * (1 << 20) + columns
    bits = _shr(mix_ids(counter ^ key), 11).to(torch.float64)
    unit = bits * (2.0**-53)
    bound = math.sqrt(1.0 / num_embeddings)
    return ((2.0 * unit - 1.0) * bound).to(torch.float32)


@dataclass
class _Probe:
    """The ids a probe left unresolved: their indices, ids, buckets' first slot rows and ends,
    the rows they probe next, and the free rows found so far."""

    active: torch.Tensor
    ids: torch.Tensor
    first: torch.Tensor
    end: torch.Tensor
    row: torch.Tensor
    free: torch.Tensor


@dataclass
class Assignment:
    """What :meth:`IdMap.assign` decided for a batch of ids.

    Attributes:
        rows: the shard-local row of each id (its own, or its bucket's fallback row).
        reset: shard-local rows given to a new id in this call (with ``reset_on_evict`` off:
            only those no id held before); the caller draws their weights afresh and zeroes
            their optimizer state.
        counted: shard-local rows whose admission counters changed (with ``rows`` and ``reset``,
            every row whose map state this call changed).
    """

    rows: torch.Tensor
    reset: torch.Tensor
    counted: torch.Tensor


class IdMap:
    """The id -> row map of one shard of a managed table: rows ``[row_start, row_end)``, whole
    buckets (see the module docstring).

    Args:
        policy: the table's :class:`~raydlrm.ids.ManagedIds`.
        table: its name (errors name it).
        num_embeddings: rows of the whole table.
        row_start, row_end: this shard's rows.
        device: where the state lives.
        state: the ``(4, rows)`` state to work on (a view, e.g. of a restored model's buffer);
            default: a new, empty map.

    Attributes:
        state: ``(4, row_end - row_start)`` int64: per row its id, last step, lookups and admission
            counter (rows ``[ID]``, ``[LAST]``, ``[COUNT]``, ``[SEEN]``).
        counters: ``(len(COUNTERS),)`` int64 on ``device`` (see :data:`COUNTERS`).
    """

    def __init__(
        self,
        policy: ManagedIds,
        *,
        table: str,
        num_embeddings: int,
        row_start: int,
        row_end: int,
        device: torch.device | str = "cpu",
        state: torch.Tensor | None = None,
    ):
        self.policy, self.table = policy, table
        self.num_buckets = policy.buckets_for(num_embeddings)
        bounds = bucket_bounds(num_embeddings, self.num_buckets)
        if row_start not in bounds or row_end not in bounds or row_end <= row_start:
            raise ValueError(
                f"table {table}: managed shard rows [{row_start}, {row_end}) do not fall on its "
                f"{self.num_buckets} bucket bounds"
            )
        self.first_bucket = bounds.index(row_start)
        local = [b - row_start for b in bounds[self.first_bucket : bounds.index(row_end) + 1]]
        self.row_start, self.rows = row_start, row_end - row_start
        self.device = torch.device(device)
        self.counters = torch.zeros(len(COUNTERS), dtype=torch.int64, device=self.device)
        self._lo = torch.tensor(local[:-1], dtype=torch.int64, device=self.device)
        self._slots = torch.tensor(local[1:], dtype=torch.int64, device=self.device) - self._lo - 1
        if state is not None:  # a view of state held elsewhere (a restored model's buffer)
            self.state = state
            return
        self.state = torch.zeros(4, self.rows, dtype=torch.int64, device=self.device)
        self.state[ID] = EMPTY
        self.state[ID, self._lo] = FALLBACK

    def stats(self) -> dict[str, int]:
        """:data:`COUNTERS` and ``occupied`` (rows holding an id) and ``capacity`` (slots) of
        this shard (one host synchronization)."""
        values = self.counters.tolist()
        out = dict(zip(COUNTERS, values, strict=True))
        out["occupied"] = int((self.state[ID] >= 0).sum())
        out["capacity"] = self.rows - int(self._lo.numel())
        return out

    def bucket_means(
        self, read: Callable[[torch.Tensor], torch.Tensor], *, chunk_rows: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The fallback rows (shard-local) of the buckets holding ids, and the mean of the rows
        of each one's ids (float64, on the map's device).

        The rows are read in chunks, in row order: ``read(rows)`` gets the held ones of at most
        ``chunk_rows`` consecutive rows (shard-local, any columns, in the table's precision),
        so the pass holds one chunk (and its float64 copy) and the buckets' sums, never the
        shard. Summed in float64 in row order: the same values on any sharding and any chunk
        size (a column shard's means are the columns of the whole rows')."""
        sums: torch.Tensor | None = None
        counts = torch.zeros(self._lo.numel(), dtype=torch.int64, device=self.device)
        for start in range(0, self.rows, chunk_rows):
            ids = self.state[ID, start : start + chunk_rows]
            held = (ids >= 0).nonzero().squeeze(1) + start
            if held.numel() == 0:
                continue
            bucket = torch.searchsorted(self._lo, held, right=True) - 1
            values = read(held).to(self.device, torch.float64)
            if sums is None:
                sums = values.new_zeros(self._lo.numel(), values.shape[1])
            sums.index_add_(0, bucket, values)
            counts += torch.bincount(bucket, minlength=self._lo.numel())
        if sums is None:  # no id held: no rows, of the table's width
            return self._lo[:0], read(self._lo[:0]).to(self.device, torch.float64)
        some = (counts > 0).nonzero().squeeze(1)
        return self._lo[some], sums[some] / counts[some].unsqueeze(1)

    def _home(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each id's bucket's fallback row, slot count, and home slot (0-based in the bucket)."""
        m = mix_ids(ids)
        bucket = bucket_of(m, self.num_buckets) - self.first_bucket
        bad = (bucket < 0) | (bucket >= self._lo.numel())
        if bool(bad.any()):
            raise ValueError(
                f"table {self.table}: ids routed to the shard of rows [{self.row_start}, "
                f"{self.row_start + self.rows}) belong to other buckets (e.g. id "
                f"{int(ids[bad][0])}); the ids were routed with another bucket layout"
            )
        slots = self._slots.index_select(0, bucket)
        return self._lo.index_select(0, bucket), slots, (_shr(m, 32) * slots) >> 32

    def _probe(
        self, ids: torch.Tensor, lo: torch.Tensor, slots: torch.Tensor, home: torch.Tensor, now: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each id's row if the map holds it (else -1), and the row it may take (the first
        expired row of its window with ``ttl``, else the first empty one; -1: none)."""
        expired_at = self._expired if self.policy.eviction == "ttl" else None
        held_ids, last = self.state[ID], self.state[LAST]
        # Round 0 on every id, then the unresolved ids compacted together each round: index,
        # id, the bucket's first slot row and end, the row probed, the free row found so far.
        row = lo + 1 + home
        held = held_ids.index_select(0, row)
        hit = held == ids
        never = held == EMPTY
        found = torch.where(hit, row, -1)
        free = torch.where(never, row, -1)
        if expired_at is not None:
            expired = (held >= 0) & ~hit & expired_at(last.index_select(0, row), now)
            free = torch.where(expired, row, free)
        keep = ~(hit | never) & (slots > 1)
        active = keep.nonzero().squeeze(1)
        a_ids, a_first = ids.index_select(0, active), lo.index_select(0, active) + 1
        a_end = a_first + slots.index_select(0, active)
        row, a_free = row.index_select(0, active) + 1, free.index_select(0, active)
        window = self.policy.probe_window
        for k in range(1, min(window, _ROUNDS)):
            if active.numel() == 0:
                self.counters[5] = max(int(self.counters[5]), k)
                return found, free
            row = torch.where(row == a_end, a_first, row)
            held = held_ids.index_select(0, row)
            hit = held == a_ids
            never = held == EMPTY
            take = never & (a_free < 0)
            if expired_at is not None:
                expired = (held >= 0) & ~hit & expired_at(last.index_select(0, row), now)
                take |= expired & (a_free < 0)
            a_free = torch.where(take, row, a_free)
            free.index_copy_(0, active, a_free)
            found.index_copy_(0, active, torch.where(hit, row, -1))
            keep = ~(hit | never) & (k + 1 < a_end - a_first)
            index = keep.nonzero().squeeze(1)
            active, a_ids = active.index_select(0, index), a_ids.index_select(0, index)
            a_first, a_end = a_first.index_select(0, index), a_end.index_select(0, index)
            row, a_free = row.index_select(0, index) + 1, a_free.index_select(0, index)
        if active.numel() == 0 or window <= _ROUNDS:
            self.counters[5] = max(int(self.counters[5]), min(window, _ROUNDS))
            return found, free
        self.counters[5] = max(int(self.counters[5]), _ROUNDS)
        probe = _Probe(active, a_ids, a_first, a_end, row, a_free)
        self._probe_blocks(probe, found, free, now)
        return found, free

    def _probe_blocks(
        self, probe: _Probe, found: torch.Tensor, free: torch.Tensor, now: int
    ) -> None:
        """:meth:`_probe` for the ids ``probe`` holds, left unresolved by its single-slot
        rounds (long runs, full windows): blocks of their windows, twice as wide each time, read
        in one gather; each id's first hit, and first empty (or expired) row, taken by argmax
        (in place in ``found`` and ``free``)."""
        active, a_ids, a_first, a_end = probe.active, probe.ids, probe.first, probe.end
        row, a_free = probe.row, probe.free
        expired_at = self._expired if self.policy.eviction == "ttl" else None
        held_ids, last, window = self.state[ID], self.state[LAST], self.policy.probe_window
        k, width = _ROUNDS, _ROUNDS
        while active.numel() and k < window:
            width = min(width, window - k)
            offsets = torch.arange(width, device=self.device)
            span = (a_end - a_first).unsqueeze(1)
            rows = a_first.unsqueeze(1) + (row.unsqueeze(1) - a_first.unsqueeze(1) + offsets) % span
            valid = offsets + k < span
            held = held_ids[rows]
            hit = (held == a_ids.unsqueeze(1)) & valid
            never = (held == EMPTY) & valid
            take = never
            if expired_at is not None:
                take = never | ((held >= 0) & ~hit & valid & expired_at(last[rows], now))
            first = rows.gather(1, take.int().argmax(dim=1, keepdim=True))[:, 0]
            a_free = torch.where(take.any(dim=1) & (a_free < 0), first, a_free)
            free.index_copy_(0, active, a_free)
            at = rows.gather(1, hit.int().argmax(dim=1, keepdim=True))[:, 0]
            found.index_copy_(0, active, torch.where(hit.any(dim=1), at, -1))
            done = (hit | never).any(dim=1) | ~valid[:, -1]
            stop = torch.where(hit | never, offsets + 1, width).amin(dim=1)
            self.counters[5] = max(int(self.counters[5]), k + int(stop.max()))
            index = (~done).nonzero().squeeze(1)
            active, a_ids = active.index_select(0, index), a_ids.index_select(0, index)
            a_first, a_end = a_first.index_select(0, index), a_end.index_select(0, index)
            row, a_free = row.index_select(0, index) + width, a_free.index_select(0, index)
            k, width = k + width, 2 * width

    def _expired(self, last: torch.Tensor, now: int) -> torch.Tensor:
        """Whether rows last looked up at ``last`` have expired at ``now`` (``ttl``: by days
        or by steps, :data:`~raydlrm.ids.DAY_SHIFT`)."""
        if self.policy.ttl_days:
            return (now >> DAY_SHIFT) - (last >> DAY_SHIFT) > self.policy.ttl_days
        steps = (1 << DAY_SHIFT) - 1
        return (now & steps) - (last & steps) > self.policy.ttl_steps

    def assign(self, ids: torch.Tensor, *, now: int, training: bool) -> Assignment:
        """The rows of ``ids`` (int64 raw ids of this shard's buckets); in training, admits and
        places new ids and records the lookups (``now``: the clock, :func:`raydlrm.ids.clock`
        of the training step and the data's day).

        Raises:
            ManagedIdsError: an admitted id found no row (see :class:`ManagedIdsError`).
        """
        ids = ids.to(torch.int64)
        empty = ids.new_empty(0)
        if ids.numel() == 0:
            return Assignment(ids, empty, empty)
        lo, slots, home = self._home(ids)
        found, free = self._probe(ids, lo, slots, home, now)
        missing = found < 0
        rows = torch.where(missing, lo, found)
        if not training:
            self.counters[4] += missing.sum()
            return Assignment(rows, empty, empty)
        self.counters[0] += ids.numel()
        hits = found.index_select(0, (~missing).nonzero().squeeze(1))
        self.state[LAST].index_fill_(0, hits, now)
        self.state[COUNT].index_add_(0, hits, torch.ones_like(hits))
        index = missing.nonzero().squeeze(1)
        counted = self._count_seen(ids[index], lo[index], slots[index])
        admitted = index[self._admitted(ids[index], lo[index], slots[index])]
        self.counters[2] += index.numel() - admitted.numel()
        reset = self._place(ids, admitted, rows, free, lo=lo, slots=slots, home=home, now=now)
        self._check(ids[admitted], rows[admitted])
        return Assignment(rows, reset, counted)

    def _sketch(self, ids: torch.Tensor, lo: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """``(n, 2)`` rows of each id's two admission counters (in its bucket's slots)."""
        m = mix_ids(ids ^ _SKETCH_SALT)
        first = lo + 1 + (m & 0x7FFFFFFF) % slots
        second = lo + 1 + _shr(m, 33) % slots
        return torch.stack([first, second], dim=1)

    def _count_seen(self, ids: torch.Tensor, lo: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Adds one lookup to the admission counters of ``ids`` (not in the map); their rows."""
        if self.policy.admit_after <= 1 or ids.numel() == 0:
            return ids.new_empty(0)
        counters = self._sketch(ids, lo, slots).reshape(-1)
        self.state[SEEN].index_add_(0, counters, torch.ones_like(counters))
        return counters

    def _admitted(self, ids: torch.Tensor, lo: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Whether each id (not in the map, already counted) may take a row."""
        if self.policy.admit_after <= 1:
            return torch.ones(ids.numel(), dtype=torch.bool, device=self.device)
        seen = self.state[SEEN][self._sketch(ids, lo, slots)].amin(dim=1)
        return seen >= self.policy.admit_after

    def _place(
        self,
        ids: torch.Tensor,
        pending: torch.Tensor,
        rows: torch.Tensor,
        free: torch.Tensor,
        *,
        lo: torch.Tensor,
        slots: torch.Tensor,
        home: torch.Tensor,
        now: int,
    ) -> torch.Tensor:
        """Gives each admitted id of ``pending`` (indices into ``ids``) a row, in place in
        ``rows``; returns the rows taken (to be reset)."""
        taken: list[torch.Tensor] = []
        while pending.numel():
            target = free[pending]
            need = target < 0
            if bool(need.any()):
                target = target.clone()
                target[need] = self._victims(pending[need], lo=lo, slots=slots, home=home, now=now)
            # The smallest id racing for a row wins it, so the map does not depend on the
            # order of the ids (any sharding of the batch builds the same map).
            contested, which = torch.unique(target, return_inverse=True)
            claim = ids[pending]
            owner = torch.full_like(contested, _NEVER)
            owner.scatter_reduce_(0, which, claim, reduce="amin")
            evicted = self.state[ID][contested] >= 0
            self.counters[3] += evicted.sum()
            self.counters[1] += contested.numel()
            self.state[ID][contested] = owner
            self.state[LAST][contested] = now
            self.state[COUNT][contested] = 0
            win = owner[which] == claim  # the winners and the repeats of their ids
            self.state[COUNT].index_add_(0, target[win], torch.ones_like(target[win]))
            rows[pending[win]] = target[win]
            taken.append(contested if self.policy.reset_on_evict else contested[~evicted])
            pending = pending[~win]
            if pending.numel() == 0:
                break
            found, again = self._probe(
                ids[pending], lo[pending], slots[pending], home[pending], now
            )
            done = found >= 0
            rows[pending[done]] = found[done]
            free = free.clone()
            free[pending] = again
            pending = pending[~done]
        return torch.cat(taken) if taken else ids.new_empty(0)

    def _victims(
        self,
        pending: torch.Tensor,
        *,
        lo: torch.Tensor,
        slots: torch.Tensor,
        home: torch.Tensor,
        now: int,
    ) -> torch.Tensor:
        """The row each id of ``pending`` (window full) evicts, by the policy."""
        if self.policy.eviction == "none":
            raise ManagedIdsError(
                f"table {self.table}: an admitted id found no free row in its probe window of "
                f"{self.policy.probe_window} and eviction is 'none': the table's rows (its "
                "capacity, data.table_sizes) are too few for its ids; raise them or set "
                f"data.managed_ids.{self.table}.eviction"
            )
        width = min(self.policy.probe_window, int(slots[pending].max()))
        offsets = torch.arange(width, device=self.device)
        within = offsets < slots[pending].unsqueeze(1)
        rows = (
            lo[pending].unsqueeze(1)
            + 1
            + (home[pending].unsqueeze(1) + offsets) % slots[pending].unsqueeze(1)
        )
        last = self.state[LAST][rows]
        score = last
        if self.policy.eviction == "lfu":
            score = self.state[COUNT][rows].clamp(max=(1 << 30)) * (1 << 32) + last
        usable = within & (last < now)
        score = torch.where(usable, score, torch.full_like(score, _NEVER))
        best = score.argmin(dim=1)
        stuck = ~usable.any(dim=1)
        if bool(stuck.any()):
            raise self._full_window(int(slots[pending][stuck].min()))
        return rows.gather(1, best.unsqueeze(1)).squeeze(1)

    def _full_window(self, slots: int) -> ManagedIdsError:
        """The error of an id whose window (in a bucket of ``slots`` slots) holds only rows
        looked up in this step: a wider window helps only while it is narrower than the
        bucket; more rows or a smaller batch always help."""
        window, table = self.policy.probe_window, self.table
        if window >= slots:
            where = f"every row of an id's bucket ({slots} slots, all in its probe window)"
            wider = ""
        else:
            where = f"every row in an id's probe window ({window} of its bucket's {slots} slots)"
            wider = f"data.managed_ids.{table}.probe_window (up to {slots}), "
        return ManagedIdsError(
            f"table {table}: {where} was looked up in this step, none can be evicted: this "
            f"step's ids outnumber the rows they may take; raise {wider}data.table_sizes.{table} "
            "(the table's rows), or lower data.batch_size"
        )

    def _check(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Every id given a row in this call holds it (the collision counter, always 0; an id
        found holds its row by the lookup's definition)."""
        wrong = self.state[ID].index_select(0, rows) != ids
        if bool(wrong.any()):
            raise ManagedIdsError(
                f"table {self.table}: {int(wrong.sum())} ids were given rows held by other ids "
                "(a collision); this is a bug"
            )


class IdMaps(nn.Module):
    """The id maps of an unsharded collection's managed tables: buffer ``<table>``, ``(rows,
    4)`` (the checkpoint's layout: a restored model loads its map with its weights), and their
    lookups, which never insert: an id the map does not hold reads its bucket's fallback row
    and is counted (:meth:`unknown`).

    Args:
        tables: the managed tables (``EmbeddingBagConfig`` with ``managed`` set).
        device: where the maps live (``meta``: filled by a state dict).
    """

    def __init__(self, tables: list, *, device: torch.device | str = "cpu"):
        super().__init__()
        self._tables = {t.name: t for t in tables}
        self._maps: dict[str, IdMap] = {}
        for t in tables:
            state = torch.empty(t.num_embeddings, 4, dtype=torch.int64, device=device)
            if state.device.type != "meta":
                state.copy_(self._fresh(t.name).state.t())
            self.register_buffer(t.name, state)

    def _fresh(self, name: str, state: torch.Tensor | None = None) -> IdMap:
        t = self._tables[name]
        return IdMap(
            t.managed,
            table=name,
            num_embeddings=t.num_embeddings,
            row_start=0,
            row_end=t.num_embeddings,
            device="cpu" if state is None else state.device,
            state=state,
        )

    def map(self, name: str) -> IdMap:
        """Table ``name``'s map over its buffer (rebuilt when a state dict replaced it)."""
        buffer = getattr(self, name)
        cached = self._maps.get(name)
        if cached is None or cached.state.data_ptr() != buffer.data_ptr():
            self._maps[name] = cached = self._fresh(name, buffer.t())
        return cached

    def rows(self, name: str, ids: torch.Tensor) -> torch.Tensor:
        """The rows of raw ``ids`` of table ``name`` (unknown ids: their fallback rows)."""
        return self.map(name).assign(ids, now=0, training=False).rows

    def unknown(self) -> dict[str, int]:
        """Table -> lookups of ids its map does not hold, since the model was restored."""
        return {name: int(self.map(name).counters[4]) for name in self._tables}
