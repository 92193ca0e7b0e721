"""Managed ids: the per-table policy of a collision-free id -> row map (``[data.managed_ids]``).

A table is *hashed* by default: its column's raw ids are hashed into its rows when the data is
preprocessed, and ids that hash alike share a row (and its optimizer state). A *managed* table
keeps the raw ids (integers as they are, strings as a 63-bit hash) up to the embedding
collection, where the rank that owns an id's rows gives each id a row of its own
(:mod:`raydlrm.models.managed_ids`). This module holds only the policy, so that a config is
checked before torch loads; the data config (preprocessing), the tables
(:class:`~raydlrm.models.embedding.EmbeddingBagConfig`) and the planner all read it.
"""

from __future__ import annotations

from typing import Literal

from raydlrm._config import config_dataclass

__all__ = [
    "DAY_SHIFT",
    "MAP_BYTES_PER_ROW",
    "Eviction",
    "ManagedIds",
    "auto_buckets",
    "bucket_bounds",
    "clock",
]

DAY_SHIFT = 40
"""A managed table's clock is ``(day << DAY_SHIFT) + step``: the data's day (days since
1970-01-01, ``data.data_date``; 0 without one) above the training step, so it grows with both:
LRU compares whole clocks, ``ttl_days`` the days, ``ttl_steps`` the steps."""


def clock(step: int, day: int) -> int:
    """The clock value of training step ``step`` on data day ``day``."""
    return (day << DAY_SHIFT) + step


MAP_BYTES_PER_ROW = 32
"""Bytes of map state per row of a managed table (four int64 values: the id holding the row,
its last lookup step, its lookups, an admission counter), on every shard holding the row."""

Eviction = Literal["none", "lru", "lfu", "ttl"]
"""What happens when an admitted id finds no free row in its probe window:

- ``none``: nothing is evicted; the step stops with an error naming the table (size the table
  for its ids);
- ``lru``: the row of the window least recently looked up is given to the new id;
- ``lfu``: the row looked up least often (ties: least recently);
- ``ttl``: rows not looked up for ``ttl_steps`` training steps, or ``ttl_days`` days of data
  time (``data.data_date``, which ``raydlrm retrain`` sets to the slot's training day), are free
  for new ids; when none in the window is, the least recently used row is evicted as with
  ``lru``.

An evicted row's weights are drawn afresh and its optimizer state zeroed: the new id inherits
nothing of the old one."""


@config_dataclass
class ManagedIds:
    """One managed table's policy (``[data.managed_ids.<table>]``; the table's rows,
    ``data.table_sizes``, are its capacity)."""

    admit_after: int = 1
    """Times an id must be seen (in training batches) before it gets a row of its own; until
    then it reads its bucket's fallback row, which then trains (on the ids below the
    threshold). 1: at once; no training lookup reads a fallback row, which instead holds the
    mean of its bucket's rows whenever the model is evaluated, checkpointed or exported (an id
    the map does not know is scored as the bucket's average id). Counts are kept in a sketch of one
    counter pair per row (they may over-count, so an id is admitted early, never late). A
    column in a RecD dedup group (``data.dedup_groups``) is looked up once per unique row of a
    batch: its lookups (admission and LFU counts) count those."""
    eviction: Eviction = "lru"
    """See :data:`Eviction`."""
    ttl_steps: int = 0
    """``eviction = "ttl"``: steps after its last lookup at which an id's row becomes free."""
    ttl_days: int = 0
    """``eviction = "ttl"``: days of data time (``data.data_date``) after its last lookup at
    which an id's row becomes free (instead of ``ttl_steps``)."""
    reset_on_evict: bool = True
    """An evicted row's weights are drawn afresh and its optimizer state zeroed for the new id
    (default). ``false``: the new id inherits them, as a hashed table's colliding ids do (for
    comparison; Meta's MPZCH measured resetting better)."""
    export_rows: int = 0
    """``raydlrm export`` cuts the table to this many rows (0: keeps it whole), keeping its
    ``export_keep`` ids; ``--max-rows`` overrides it (:mod:`raydlrm.trainers.model_prune`)."""
    export_keep: Literal["recent", "frequent"] = "recent"
    """The ids a pruned export keeps: the most recently looked up, or the most often."""
    probe_window: int = 128
    """Rows an id may occupy, from its home row on (linear probing, wrapping inside its bucket):
    where an id is looked for and inserted, and among which a victim is chosen."""
    buckets: int = 0
    """The table's rows are split into this many buckets, fixed for the table's life: an id
    belongs to one bucket (by hash), a bucket to one shard, and a row-wise shard is a run of
    whole buckets, so checkpoints reshard without moving an id. Each bucket's first row is
    its fallback row. 0: :func:`auto_buckets`."""

    def __post_init__(self) -> None:
        if self.admit_after < 1:
            raise ValueError(f"admit_after must be at least 1, got {self.admit_after}")
        if self.eviction == "ttl" and (self.ttl_steps >= 1) == (self.ttl_days >= 1):
            raise ValueError("eviction = 'ttl' needs one of ttl_steps and ttl_days >= 1")
        if self.eviction != "ttl" and (self.ttl_steps or self.ttl_days):
            raise ValueError(
                f"ttl_steps and ttl_days are only read with eviction = 'ttl' (got "
                f"{self.eviction!r})"
            )
        if self.probe_window < 1:
            raise ValueError(f"probe_window must be at least 1, got {self.probe_window}")
        if self.buckets < 0:
            raise ValueError(f"buckets must be >= 0 (0: auto), got {self.buckets}")

    def buckets_for(self, rows: int) -> int:
        """The table's bucket count for ``rows`` rows (at least 2 rows per bucket)."""
        buckets = self.buckets or auto_buckets(rows)
        if rows < 2 * buckets:
            raise ValueError(
                f"{buckets} buckets need at least {2 * buckets} rows (a fallback row and one "
                f"id each), the table has {rows}"
            )
        return buckets


def bucket_bounds(rows: int, buckets: int) -> list[int]:
    """The first row of each of ``buckets`` buckets of a ``rows``-row table, and ``rows``."""
    return [b * rows // buckets for b in range(buckets + 1)]


def auto_buckets(rows: int) -> int:
    """The default bucket count of a managed table of ``rows`` rows: 240 (divisible by every
    worker count up to 6 and by 8, 10, 12, 15, 16, ...) while buckets keep at least 256 rows,
    fewer for small tables (at least one)."""
    return max(1, min(240, rows // 256))
