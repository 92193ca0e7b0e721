"""What a sharded collection reports about itself: bytes on the wire, kernels, tiers, dedup.

:func:`local_counters` reads one rank's counters, all of them sums over ranks by nature; the
caller adds them up over the ranks (``raydlrm.trainers._dist.sum_over_ranks``) and
:func:`metrics_of` turns the sums into metrics (fractions, rates, means). Keeping the
collective out of here keeps this module free of any process group.

Metrics:

- ``comm/<direction>_<kind>_bytes``: bytes all ranks sent each other through the embedding
  all-to-alls, by direction (``input``, ``forward``, ``backward``) and codec;
- ``sharding/torch_kernel_ranks``: ranks that run the torch kernel (``sharding.kernel = "auto"``
  resolves per worker);
- for tables on the SSD tier (none: no metrics): ``tier/<table>/resident_fraction``, the share of
  the table's rows (all ranks' shards) in its files that the page cache holds now;
  ``tier/<table>/cache_hit_rate``, for a table with a DRAM row cache, the share of the distinct
  ids looked up so far that were in it; ``tier/major_page_faults``, the reads from disk the
  workers waited for so far (the page cache's misses);
- ``memory/embedding_bytes``: the bytes of memory the tables hold on all ranks (weights, optimizer
  state, quantized rows and scales, caches; not mapped files);
- per ``int8`` / ``int4`` table: ``cache/<table>/cache_hit_rate``, the share of the distinct ids
  looked up so far that were in its fp32 cache;
- per deduplicated table: ``dedup/<table>/ratio`` (samples per unique row, the mean over ranks),
  ``lookups_saved`` and ``a2a_bytes_saved``;
- per managed table (:mod:`raydlrm.models.managed_ids`), since the worker started:
  ``managed/<table>/occupancy`` (the share of its id rows holding an id), ``ids`` (ids holding
  a row), ``lookups`` (training lookups), ``admissions`` (ids given a row), ``rejections``
  (lookups of ids below ``admit_after``, which read the fallback row), ``evictions`` (rows
  taken from another id), ``unknown`` (evaluation lookups of ids the map does not hold, which
  read the fallback row), ``max_probe`` (the longest probe, slots, on any rank) and
  ``collisions`` (ids given a row another id holds: always 0; the map raises before that).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Literal

from raydlrm.sharding.tiers import major_page_faults, resident_bytes
from raydlrm.sharding.types import ShardedTables

__all__ = ["Family", "local_counters", "metrics_of"]

Family = Literal["comm", "kernel", "tier", "dedup", "managed"]

# Counters that metrics_of turns into a ratio: numerator, denominator -> metric.
_RATIOS = {
    ("resident_bytes", "bytes"): "resident_fraction",
    ("cache_hits", "cache_lookups"): "cache_hit_rate",
    ("occupied", "capacity"): "occupancy",
}
_MAX = "@rank"
"""A counter named ``<name>@rank<r>`` is rank ``r``'s value; the metric ``<name>`` is their
maximum."""


def local_counters(tables: ShardedTables, *, families: Collection[Family]) -> dict[str, float]:
    """This rank's counters of the given families (each a sum over ranks)."""
    counters: dict[str, float] = {}
    if "comm" in families:
        for direction, by_kind in tables.comm_bytes().items():
            for kind, n in by_kind.items():
                counters[f"comm/{direction}_{kind}_bytes"] = float(n)
    if "kernel" in families:
        counters["sharding/torch_kernel_ranks"] = float(tables.kernel == "torch")
    if "tier" in families and any(t.placement == "ssd" for t in tables.plan.tables):
        counters.update(_tier_counters(tables))
    if "tier" in families:  # memory held, quantized and host tables' caches
        counters["memory/embedding_bytes"] = float(tables.memory_bytes())
        if any(t.placement == "host" for t in tables.plan.tables):
            counters["memory/host_embedding_bytes"] = float(tables.host_bytes())
        for name, (hits, lookups) in tables.cache_hit_rates().items():
            counters[f"cache/{name}/cache_hits"] = float(hits)
            counters[f"cache/{name}/cache_lookups"] = float(lookups)
    if "dedup" in families:
        for table, stats in tables.dedup_stats().items():
            for name, value in stats.items():
                counters[f"dedup/{table}/{name}"] = float(value)
    if "managed" in families:
        counters.update(_managed_counters(tables))
    return counters


def _managed_counters(tables: ShardedTables) -> dict[str, float]:
    """The managed tables' map counters of this rank's shards (a column-sharded table's maps
    are alike: its first column block's count)."""
    counters: dict[str, float] = {}
    shards = tables.local_shards()
    for name, id_map in tables.id_maps().items():
        if shards[name].col_start:
            continue
        stats = id_map.stats()
        rank = shards[name].rank
        counters[f"managed/{name}/max_probe{_MAX}{rank}"] = float(stats.pop("max_probe"))
        counters[f"managed/{name}/ids"] = float(stats["occupied"])
        counters[f"managed/{name}/collisions"] = 0.0
        counters.update((f"managed/{name}/{k}", float(v)) for k, v in stats.items())
    return counters


def _tier_counters(tables: ShardedTables) -> dict[str, float]:
    counters = {"tier/major_page_faults": float(major_page_faults())}
    for name, (rows, hits) in tables.ssd_tables().items():
        counters[f"tier/{name}/resident_bytes"] = float(resident_bytes(rows))
        counters[f"tier/{name}/bytes"] = float(rows.numel() * rows.element_size())
        if hits is not None:
            counters[f"tier/{name}/cache_hits"] = float(hits[0])
            counters[f"tier/{name}/cache_lookups"] = float(hits[1])
    return counters


def metrics_of(sums: dict[str, float], *, world_size: int) -> dict[str, float]:
    """The metrics of counters summed over ``world_size`` ranks (see the module docstring)."""
    metrics: dict[str, float] = {}
    for name, value in sums.items():
        if _MAX in name:
            name = name.partition(_MAX)[0]
            metrics[name] = max(metrics.get(name, 0.0), value)
            continue
        prefix, _, counter = name.rpartition("/")
        ratio = next(((num, den) for num, den in _RATIOS if counter == num), None)
        if ratio is not None:
            metrics[f"{prefix}/{_RATIOS[ratio]}"] = value / max(sums[f"{prefix}/{ratio[1]}"], 1)
        elif any(counter == den for _, den in _RATIOS):
            continue  # a denominator: only its ratio is reported
        elif name.startswith("dedup/") and counter == "ratio":
            metrics[name] = value / world_size  # the ranks' batches are alike: their mean
        else:
            metrics[name] = value
    return metrics
