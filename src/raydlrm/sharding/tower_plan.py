"""Planning towers pinned to hosts (:mod:`raydlrm.sharding.towers`): each host's tables
planned over the host's ranks, as one plan over every rank, and each host's part of it.

The planner's side of Disaggregated Multi-Tower; the collection that runs such a plan is
:class:`~raydlrm.sharding.towers.ShardedTowerCollection`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from raydlrm.models.embedding import EmbeddingBagConfig
from raydlrm.sharding.config import ShardingConfig
from raydlrm.sharding.plan import ShardingPlan, TablePlan
from raydlrm.sharding.planner import plan_sharding
from raydlrm.sharding.topology import Topology
from raydlrm.sharding.tower_spec import Tower, check_towers

__all__ = ["host_config", "host_plan", "host_tables", "plan_towers"]


def host_tables(
    tables: Sequence[EmbeddingBagConfig], towers: Sequence[Tower], host: int
) -> list[EmbeddingBagConfig]:
    """The tables looked up by the towers of ``host``, in ``tables`` order."""
    features = {f for t in towers if t.host == host for f in t.features}
    return [t for t in tables if features & set(t.feature_names)]


def plan_towers(
    tables: Sequence[EmbeddingBagConfig],
    towers: Sequence[Tower],
    topology: Topology,
    *,
    config: ShardingConfig,
    **planner: Any,
) -> ShardingPlan:
    """Plans each host's tables over the host's ranks (:func:`~raydlrm.sharding.plan_sharding`
    with ``planner``'s arguments and a world of ``ranks_per_host``) and returns one plan over
    every rank: host ``h``'s local rank ``i`` is rank ``h * ranks_per_host + i``.

    Raises:
        ValueError: bad towers (:func:`check_towers`), or a host's tables that cannot be
            planned (naming the host and its towers).
    """
    check_towers(towers, tables, topology.num_hosts)
    planned: dict[str, TablePlan] = {}
    plans = []
    for h in range(topology.num_hosts):
        mine = host_tables(tables, towers, h)
        names = {t.name for t in mine}
        try:
            plan = plan_sharding(
                mine,
                world_size=topology.ranks_per_host,
                config=host_config(config, names, topology, h),
                **{k: _only(v, names) for k, v in planner.items()},
            )
        except ValueError as e:  # e.g. a table beyond the host's workers' memory
            here = [t.name for t in towers if t.host == h]
            raise ValueError(f"host {h} (towers {here}): {e}") from None
        offset = topology.host_ranks(h)[0]
        for t in plan.tables:
            shards = [dataclasses.replace(s, rank=s.rank + offset) for s in t.shards]
            planned[t.name] = dataclasses.replace(t, shards=shards)
        plans.append(plan)
    return ShardingPlan(
        world_size=topology.world_size,
        tables=[planned[t.name] for t in tables],
        memory_budget=plans[0].memory_budget,
        page_cache_hit=plans[0].page_cache_hit,
        cost_model=plans[0].cost_model,
    )


def _only(value: Any, names: set[str]) -> Any:
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
        f.name: _only(getattr(config, f.name), names)
        for f in dataclasses.fields(config)
        if f.name.endswith("_per_table") or f.name in ("pinned_types", "placement")
    }
    # Inside a host, a table_row_wise group is the host: every one of its ranks.
    return dataclasses.replace(config, pinned_ranks=pinned, group_size=None, **changes)


def host_plan(plan: ShardingPlan, topology: Topology, host: int) -> ShardingPlan:
    """The part of a plan over every rank (:func:`plan_towers`) on ``host``'s ranks, numbered
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
