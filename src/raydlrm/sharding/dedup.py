"""Deduplicated lookups (RecD): one sharded collection per feature set.

Features declared as a dedup group (e.g. the user features, identical over a session's samples)
reach the model as a :class:`~raydlrm.batch.DedupGroup`: the group's unique rows in the batch
(``U`` of them) and an inverse index. :class:`DedupShardedEmbeddingBagCollection` splits the
tables into *feature sets* (the plain features, and one set per dedup group) and shards each set
as its own :class:`~raydlrm.sharding.embedding.ShardedEmbeddingBagCollection` with the same plan:
a group's input all-to-all, TBE lookups and output all-to-all then move ``U`` rows instead of
``B``. The pooled unique rows are expanded to the batch with the inverse index (a row gather
whose backward sums the gradients of duplicate samples, so the fused optimizer's update equals
that of the plain path up to float summation order), and every set's columns are put in the
collection's feature order.

A table belongs to one feature set: a table looked up both by a deduplicated feature and by a
feature outside its group is an error (the data config checks the same).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed import ProcessGroup

from raydlrm.batch import DedupGroup, KeyedJaggedTensor, KeyedTensor
from raydlrm.models.embedding import EmbeddingBagCollection, EmbeddingBagConfig
from raydlrm.sharding.config import ShardingConfig
from raydlrm.sharding.embedding import ShardedEmbeddingBagCollection
from raydlrm.sharding.plan import Shard, ShardingPlan

__all__ = ["DedupShardedEmbeddingBagCollection", "feature_sets", "plan_feature_sets"]


def feature_sets(
    tables: list[EmbeddingBagConfig], dedup_groups: Sequence[Sequence[str]]
) -> dict[int, list[EmbeddingBagConfig]]:
    """Tables by feature set: 0 for the plain features, ``g + 1`` for dedup group ``g``.

    Raises:
        ValueError: naming a table whose features straddle a group boundary, or a group
            feature no table looks up.
    """
    group_of = {f: g + 1 for g, features in enumerate(dedup_groups) for f in features}
    known = {f for t in tables for f in t.feature_names}
    unknown = sorted(set(group_of) - known)
    if unknown:
        raise ValueError(f"dedup groups name features {unknown} that no table looks up")
    sets: dict[int, list[EmbeddingBagConfig]] = defaultdict(list)
    for table in tables:
        ids = {group_of.get(f, 0) for f in table.feature_names}
        if len(ids) > 1:
            raise ValueError(
                f"table {table.name!r} is looked up by features {list(table.feature_names)} that "
                "are not all in the same dedup group"
            )
        sets[ids.pop()].append(table)
    return dict(sorted(sets.items()))


def plan_feature_sets(
    tables: list[EmbeddingBagConfig],
    dedup_groups: Sequence[Sequence[str]],
    *,
    world_size: int,
    config: ShardingConfig,
    **kwargs,
) -> ShardingPlan:
    """A plan that balances every feature set on its own.

    Each feature set runs its own collectives, so every rank waits for the slowest rank once per
    set: balancing the whole collection can leave each set lopsided (one rank holding most of
    the user tables, the other most of the rest) and every set then waits. Each set is planned
    with :func:`~raydlrm.sharding.planner.plan_sharding` (``kwargs`` passed on) within the
    memory budget; the sets together are then checked against it.

    Raises:
        ValueError: as :func:`~raydlrm.sharding.planner.plan_sharding`, or naming a rank whose
            sets together exceed the memory budget.
    """
    from raydlrm.sharding.planner import check_table_names, plan_sharding

    if not dedup_groups:
        return plan_sharding(tables, world_size=world_size, config=config, **kwargs)
    # Each set sees only its own tables' entries: an unknown name would pass unnoticed.
    check_table_names(tables, config=config, pooling_factors=kwargs.get("pooling_factors"))
    planned, hits = {}, []
    for set_tables in feature_sets(tables, dedup_groups).values():
        names = {t.name for t in set_tables}
        set_config = dataclasses.replace(
            config,
            pinned_types={k: v for k, v in config.pinned_types.items() if k in names},
            pinned_ranks={k: v for k, v in config.pinned_ranks.items() if k in names},
            comm_precision_per_table={
                k: v for k, v in config.comm_precision_per_table.items() if k in names
            },
            weights_precision_per_table={
                k: v for k, v in config.weights_precision_per_table.items() if k in names
            },
            placement={k: v for k, v in config.placement.items() if k in names},
        )
        plan = plan_sharding(set_tables, world_size=world_size, config=set_config, **kwargs)
        planned.update({t.name: t for t in plan.tables})
        hits += [] if plan.page_cache_hit is None else [plan.page_cache_hit]
    combined = ShardingPlan(
        world_size=world_size,
        tables=[planned[t.name] for t in tables],
        memory_budget=plan.memory_budget,
        page_cache_hit=min(hits, default=None),  # each set counted the whole budget as its own
    )
    combined.check_memory_budget()
    return combined


def _sub_collection(
    ebc: EmbeddingBagCollection, tables: list[EmbeddingBagConfig]
) -> EmbeddingBagCollection:
    """A collection over ``tables`` sharing ``ebc``'s weight tensors (no copy)."""
    sub = EmbeddingBagCollection(tables, device="meta", seed=ebc.seed)
    for t in tables:
        sub.weights[t.name] = ebc.weights[t.name]
    return sub


class DedupShardedEmbeddingBagCollection(nn.Module):
    """A sharded collection whose dedup groups are looked up on their unique rows.

    Same inputs and outputs as :class:`ShardedEmbeddingBagCollection` plus the dedup groups
    (see the module docstring), and the same state API (``gather_full_tables`` and so on).

    Args:
        ebc: the unsharded collection.
        plan: where each table lives.
        config: optimizer and codecs.
        device: ``cpu`` or a CUDA device.
        pg: process group.
        dedup_groups: the feature names of each dedup group.

    Raises:
        ValueError: a table shared across a group boundary, an unknown group feature.
    """

    def __init__(
        self,
        ebc: EmbeddingBagCollection,
        *,
        plan: ShardingPlan,
        config: ShardingConfig,
        device: torch.device | str,
        pg: ProcessGroup | None = None,
        dedup_groups: Sequence[Sequence[str]],
    ):
        super().__init__()
        plan.validate(ebc.tables)
        self.tables = list(ebc.tables)
        self.feature_names = ebc.feature_names
        self.feature_dims = ebc.feature_dims
        self.plan = plan
        self.dedup_groups = [list(g) for g in dedup_groups]
        self._set_ids: list[int] = []
        parts = []
        sets = feature_sets(self.tables, self.dedup_groups)
        position = {t.name: i for i, t in enumerate(self.tables)}
        # Parts in the order of their first table: when each set's tables are contiguous (e.g.
        # the user features first), the parts' columns are already in feature order and no
        # column permutation pass is needed.
        for set_id, tables in sorted(sets.items(), key=lambda kv: position[kv[1][0].name]):
            names = {t.name for t in tables}
            part_config = dataclasses.replace(
                config,
                comm_precision_per_table={
                    k: v for k, v in config.comm_precision_per_table.items() if k in names
                },
            )
            parts.append(
                ShardedEmbeddingBagCollection(
                    _sub_collection(ebc, tables),
                    plan=ShardingPlan(
                        world_size=plan.world_size, tables=[plan.table(t.name) for t in tables]
                    ),
                    config=part_config,
                    device=device,
                    pg=pg,
                )
            )
            self._set_ids.append(set_id)
        self.parts = nn.ModuleList(parts)
        order = [f for part in parts for f in part.feature_names]
        dims = dict(zip(self.feature_names, self.feature_dims, strict=True))
        start = {}
        column = 0
        for f in order:
            start[f] = column
            column += dims[f]
        perm = torch.cat([torch.arange(start[f], start[f] + dims[f]) for f in self.feature_names])
        self._in_order = torch.equal(perm, torch.arange(perm.numel()))
        self.register_buffer("_perm", perm.to(device), persistent=False)
        self._rows: defaultdict[int, list[int]] = defaultdict(lambda: [0, 0])  # set -> [B, U]
        self._ids_saved: defaultdict[str, int] = defaultdict(int)

    @property
    def kernel(self) -> str:
        """The kernel the feature sets run (``sharding.kernel`` resolved; the same for all)."""
        return self.parts[0].kernel

    def prefetch(
        self,
        features: KeyedJaggedTensor,
        dedup_groups: Sequence[DedupGroup] = (),
        *,
        pg: ProcessGroup | None = None,
    ) -> None:
        """Runs every feature set's input distribution of a coming batch now, on ``pg`` (see
        :meth:`ShardedEmbeddingBagCollection.prefetch`)."""
        for set_id, part in zip(self._set_ids, self.parts, strict=True):
            part.prefetch(features if set_id == 0 else dedup_groups[set_id - 1].unique, pg=pg)

    def discard_prefetched(self) -> None:
        """Drops every feature set's unconsumed prefetched input distributions."""
        for part in self.parts:
            part.discard_prefetched()

    def forward(
        self, features: KeyedJaggedTensor, dedup_groups: Sequence[DedupGroup] = ()
    ) -> KeyedTensor:
        """Pooled embeddings of every feature, ``B x sum(D_f)`` in ``feature_names`` order.

        Raises:
            ValueError: if the batch's dedup groups are not the declared ones.
        """
        declared = [sorted(g) for g in self.dedup_groups]
        given = [sorted(g.keys) for g in dedup_groups]
        if given != declared:
            raise ValueError(
                f"the batch has dedup groups {given}, the collection was built for {declared}"
            )
        values = []
        for set_id, part in zip(self._set_ids, self.parts, strict=True):  # every rank, in order
            if set_id == 0:
                values.append(part(features).values)
                continue
            group = dedup_groups[set_id - 1]
            pooled = part(group.unique).values
            self._count(set_id, group, part)
            values.append(pooled.index_select(0, group.inverse))
        out = values[0] if len(values) == 1 else torch.cat(values, dim=1)
        if not self._in_order:
            out = out.index_select(1, self._perm)
        return KeyedTensor(keys=list(self.feature_names), dims=list(self.feature_dims), values=out)

    def _count(self, set_id: int, group: DedupGroup, part: ShardedEmbeddingBagCollection) -> None:
        batch, unique = group.inverse.numel(), group.unique.batch_size
        rows = self._rows[set_id]
        rows[0] += batch
        rows[1] += unique
        kjt = group.unique
        lengths = kjt.lengths.view(len(kjt.keys), unique)
        expanded = lengths.index_select(1, group.inverse).sum(dim=1)
        saved = (expanded - lengths.sum(dim=1)).tolist()
        table_of = {f: t.name for t in part.tables for f in t.feature_names}
        for key, n in zip(kjt.keys, saved, strict=True):
            if key in table_of:
                self._ids_saved[table_of[key]] += int(n)

    def dedup_stats(self) -> dict[str, dict[str, float]]:
        """Per deduplicated table, cumulative since construction (this rank's batches):
        ``ratio`` (samples / unique rows), ``lookups_saved`` (ids not looked up) and
        ``a2a_bytes_saved`` (bytes the plain path would have sent in the pooled output
        all-to-all and its gradient beyond what was sent, estimated from the bytes sent and the
        ratio)."""
        stats: dict[str, dict[str, float]] = {}
        for set_id, part in zip(self._set_ids, self.parts, strict=True):
            if set_id == 0 or set_id not in self._rows:
                continue
            batch, unique = self._rows[set_id]
            ratio = batch / max(unique, 1)
            sent = part.comm_bytes()
            output = sum(sum(sent.get(d, {}).values()) for d in ("forward", "backward"))
            dims = {t.name: t.embedding_dim * len(t.feature_names) for t in part.tables}
            for t in part.tables:
                share = dims[t.name] / max(sum(dims.values()), 1)
                stats[t.name] = {
                    "ratio": ratio,
                    "lookups_saved": float(self._ids_saved[t.name]),
                    "a2a_bytes_saved": output * (ratio - 1) * share,
                }
        return stats

    # -- the state API of ShardedEmbeddingBagCollection, over the parts -------------------

    def comm_bytes(self) -> dict[str, dict[str, int]]:
        total: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        for part in self.parts:
            for direction, kinds in part.comm_bytes().items():
                for kind, n in kinds.items():
                    total[direction][kind] += n
        return {d: dict(k) for d, k in total.items()}

    def local_tables(self) -> dict[str, torch.Tensor]:
        return {k: v for part in self.parts for k, v in part.local_tables().items()}

    def ssd_tables(self) -> dict[str, tuple[torch.Tensor, tuple[int, int] | None]]:
        return {k: v for part in self.parts for k, v in part.ssd_tables().items()}

    def local_shards(self) -> dict[str, Shard]:
        return {k: v for part in self.parts for k, v in part.local_shards().items()}

    def weight_dtypes(self) -> dict[str, torch.dtype]:
        return {k: v for part in self.parts for k, v in part.weight_dtypes().items()}

    def optimizer_states(self) -> dict[str, list[torch.Tensor]]:
        return {k: v for part in self.parts for k, v in part.optimizer_states().items()}

    def _ordered(self, parts: list[dict | None]) -> dict | None:
        if any(p is None for p in parts):
            return None
        merged = {k: v for p in parts for k, v in p.items()}
        return {t.name: merged[t.name] for t in self.tables}

    @torch.no_grad()
    def gather_full_tables(self, dst: int = 0) -> dict[str, torch.Tensor] | None:
        return self._ordered([part.gather_full_tables(dst) for part in self.parts])

    @torch.no_grad()
    def gather_full_optimizer_states(self, dst: int = 0) -> dict[str, list[torch.Tensor]] | None:
        return self._ordered([part.gather_full_optimizer_states(dst) for part in self.parts])

    @torch.no_grad()
    def load_full_tables(self, tables: dict[str, torch.Tensor]) -> None:
        for part in self.parts:
            part.load_full_tables({t.name: tables[t.name] for t in part.tables if t.name in tables})
