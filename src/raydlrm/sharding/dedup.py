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
feature outside its group is an error (the data config checks the same). The planner balances
each feature set on its own (:func:`~raydlrm.sharding.planner.plan_feature_sets`).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed import ProcessGroup

from raydlrm.batch import DedupGroup, KeyedJaggedTensor, KeyedTensor
from raydlrm.models.embedding import EmbeddingBagCollection, EmbeddingBagConfig
from raydlrm.sharding.config import ShardingConfig
from raydlrm.sharding.embedding import ShardedEmbeddingBagCollection
from raydlrm.sharding.plan import Shard, ShardingPlan
from raydlrm.sharding.planner import feature_sets
from raydlrm.sharding.types import Routed, ShardedTables

__all__ = ["DedupShardedEmbeddingBagCollection"]


@dataclass
class _DedupRouted:
    """A batch routed to every feature set (a :class:`~raydlrm.sharding.types.Routed`).

    Attributes:
        features: the batch's plain features it was made for.
        groups: the batch's dedup groups (their inverse indices expand the pooled rows).
        parts: each feature set's routing, in the order of the collection's parts.
    """

    features: KeyedJaggedTensor
    groups: list[DedupGroup]
    parts: list[Routed]

    def tensors(self) -> Iterator[torch.Tensor | None]:
        for part in self.parts:
            yield from part.tensors()


def _sub_collection(
    ebc: EmbeddingBagCollection, tables: list[EmbeddingBagConfig]
) -> EmbeddingBagCollection:
    """A collection over ``tables`` sharing ``ebc``'s weight tensors (no copy)."""
    sub = EmbeddingBagCollection(tables, device="meta", seed=ebc.seed)
    for t in tables:
        sub.weights[t.name] = ebc.weights[t.name]
    return sub


class DedupShardedEmbeddingBagCollection(ShardedTables):
    """A sharded collection whose dedup groups are looked up on their unique rows.

    Same inputs and outputs as :class:`ShardedEmbeddingBagCollection` plus the dedup groups
    (see the module docstring); both implement :class:`~raydlrm.sharding.types.ShardedTables`.

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

    def input_dist(
        self,
        features: KeyedJaggedTensor,
        dedup_groups: Sequence[DedupGroup] = (),
        *,
        pg: ProcessGroup | None = None,
    ) -> _DedupRouted:
        """Routes every feature set of a batch: the plain features, and each dedup group's
        unique rows (see :meth:`ShardedTables.input_dist
        <raydlrm.sharding.types.ShardedTables.input_dist>`).

        Raises:
            ValueError: if the batch's dedup groups are not the declared ones, or naming the
                table of an id outside ``[0, num_embeddings)``.
        """
        declared = [sorted(g) for g in self.dedup_groups]
        given = [sorted(g.keys) for g in dedup_groups]
        if given != declared:
            raise ValueError(
                f"the batch has dedup groups {given}, the collection was built for {declared}"
            )
        return _DedupRouted(
            features=features,
            groups=list(dedup_groups),
            parts=[
                part.input_dist(features if set_id == 0 else dedup_groups[set_id - 1].unique, pg=pg)
                for set_id, part in zip(self._set_ids, self.parts, strict=True)
            ],
        )

    def compute_and_output_dist(self, routed: _DedupRouted) -> KeyedTensor:
        """Pooled embeddings of every feature, ``B x sum(D_f)`` in ``feature_names`` order: each
        group's unique rows pooled, exchanged, then expanded to the batch by its inverse."""
        values = []
        for set_id, part, part_routed in zip(self._set_ids, self.parts, routed.parts, strict=True):
            pooled = part.compute_and_output_dist(part_routed).values
            if set_id != 0:
                group = routed.groups[set_id - 1]
                self._count(set_id, group, part)
                pooled = pooled.index_select(0, group.inverse)
            values.append(pooled)
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

    # -- the state of ShardedTables: the parts' merged ------------------------------------

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
