"""Each host's part of towers pinned to hosts (:mod:`raydlrm.sharding.towers`): its tables, its
config, and its part of a plan over every rank. The planner
(:mod:`raydlrm.sharding.planner.tower_plan`) plans each host's tables with them; the collection
(:class:`~raydlrm.sharding.towers.ShardedTowerCollection`) builds each host's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from raydlrm.models.embedding import EmbeddingBagConfig
from raydlrm.sharding.config import ShardingConfig
from raydlrm.sharding.plan import ShardingPlan
from raydlrm.sharding.topology import Topology
from raydlrm.sharding.tower_spec import Tower

__all__ = ["host_config", "host_plan", "host_tables", "only_tables"]


def host_tables(
    tables: Sequence[EmbeddingBagConfig], towers: Sequence[Tower], host: int
) -> list[EmbeddingBagConfig]:
    """The tables looked up by the towers of ``host``, in ``tables`` order."""
    features = {f for t in towers if t.host == host for f in t.features}
    return [t for t in tables if features & set(t.feature_names)]


def only_tables(value: Any, names: set[str]) -> Any:
    """A dict keyed by table names restricted to ``names``; anything else as it is."""
    if isinstance(value, dict):
        return {k: v for k, v in value.items() if k in names}
    return value


def host_config(
    config: ShardingConfig, names: set[str], topology: Topology, host: int
) -> ShardingConfig:
    """``config`` for the collection of ``host``'s tables ``names``: its per-table settings
    restricted to them, their pinned ranks numbered inside the host.

    Raises:
        ValueError: a pinned rank of one of them not on ``host``, naming the table.
    """
    ranks = topology.host_ranks(host)
    pinned = {}
    for name, pins in config.pinned_ranks.items():
        if name not in names:
            continue
        outside = [r for r in pins if r not in ranks]
        if outside:
            raise ValueError(
                f"sharding.pinned_ranks.{name}: ranks {outside} are not on host {host} "
                f"(ranks {ranks[0]}..{ranks[-1]}), where its tower is"
            )
        pinned[name] = [r - ranks[0] for r in pins]
    changes = {
        f.name: only_tables(getattr(config, f.name), names)
        for f in dataclasses.fields(config)
        if f.name.endswith("_per_table") or f.name in ("pinned_types", "placement")
    }
    # Inside a host, a table_row_wise group is the host: every one of its ranks.
    return dataclasses.replace(config, pinned_ranks=pinned, group_size=None, **changes)


def host_plan(plan: ShardingPlan, topology: Topology, host: int) -> ShardingPlan:
    """The part of a plan over every rank
    (:func:`~raydlrm.sharding.planner.tower_plan.plan_towers`) on ``host``'s ranks, numbered
    from 0 inside the host.

    Raises:
        ValueError: naming a table whose shards are on more than one host.
    """
    ranks = topology.host_ranks(host)
    tables = []
    for t in plan.tables:
        hosts = sorted({topology.host(s.rank) for s in t.shards})
        if len(hosts) > 1:
            raise ValueError(f"table {t.name} has shards on hosts {hosts}: towers need one host")
        if hosts == [host]:
            shards = [dataclasses.replace(s, rank=s.rank - ranks[0]) for s in t.shards]
            tables.append(dataclasses.replace(t, shards=shards))
    return dataclasses.replace(
        plan, world_size=topology.ranks_per_host, tables=tables, predicted_seconds=None
    )
