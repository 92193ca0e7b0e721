"""Planning towers pinned to hosts (:mod:`raydlrm.sharding.towers`): each host's tables
planned over the host's ranks, as one plan over every rank (each host's part of it:
:mod:`raydlrm.sharding.tower_hosts`).

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
from raydlrm.sharding.planner.planners import plan_sharding
from raydlrm.sharding.topology import Topology
from raydlrm.sharding.tower_hosts import host_config, host_tables, only_tables
from raydlrm.sharding.tower_spec import Tower, check_towers

__all__ = ["plan_towers"]


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
                **{k: only_tables(v, names) for k, v in planner.items()},
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
