"""Disaggregated Multi-Tower (DMT; Luo et al., MLSys 2024): embedding towers pinned to hosts.

A flat :class:`~raydlrm.sharding.embedding.ShardedEmbeddingBagCollection` sends every pooled
embedding through one all-to-all over every rank. Datacenter networks are two-level (fast links
inside a host, slower ones between hosts), so DMT splits the features into *towers*, each
looked up inside one host, and sends only a compressed form of each tower's output across
hosts. Rank ``r`` is rank ``i = r % L`` of host ``h = r // L`` (:class:`Topology`); a forward
pass of :class:`ShardedTowerCollection` on rank ``(a, i)``, holding ``B`` samples:

1. sends the ids of the features of host ``h``'s towers to rank ``(h, i)``: one all-to-all
   among the ranks of local index ``i`` (the *cross-host* group), which is the only id traffic
   between hosts;
2. rank ``(h, i)`` now holds the ids of its host's features for the samples of every rank
   ``(a, i)``; the host's own sharded collection, sharded over the host's ranks only (the
   *intra-host* group, any sharding type), looks them up: its all-to-alls stay inside the host;
3. each tower's module (data-parallel over the host's ranks) turns the tower's pooled
   embeddings of those samples into the tower's output (a projection to a smaller width
   compresses it; ``None`` is the identity);
4. the tower outputs go back to the ranks whose samples they are (the reverse cross-host
   all-to-all), and are returned in tower order.

With identity tower modules the output holds each sample's pooled embeddings, as the flat
collection's (columns in tower order), and training updates the tables as the flat collection
does.

Gradient scale: a flat collection over ``W`` ranks divides the gradient reaching its pooled
output by ``W`` (as data-parallel training averages the dense gradients over ``W``). Here the
host's collection divides by the host's ``L`` ranks and the tower modules' data parallelism
averages over ``L``, while the samples come from ``H = W / L`` hosts: the backward of step 4
divides the tower outputs' gradient by ``H``, so both updates are those of the flat model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.nn.parallel import DistributedDataParallel

from raydlrm.batch import DedupGroup, KeyedJaggedTensor, KeyedTensor
from raydlrm.models.embedding import EmbeddingBagCollection, EmbeddingBagConfig
from raydlrm.sharding._comm import CommBytes, all_to_all, rank_and_world_size
from raydlrm.sharding.config import ShardingConfig
from raydlrm.sharding.embedding import ShardedEmbeddingBagCollection
from raydlrm.sharding.plan import Shard, ShardingPlan, TablePlan
from raydlrm.sharding.planner import plan_sharding
from raydlrm.sharding.quantized import QuantizedRows
from raydlrm.sharding.tower_spec import Tower, check_towers
from raydlrm.sharding.types import ShardedTables

__all__ = [
    "ShardedTowerCollection",
    "Topology",
    "TopologyGroups",
    "Tower",
    "check_towers",
    "host_config",
    "host_plan",
    "host_tables",
    "plan_towers",
    "shard_tower_model",
    "topology_groups",
]


@dataclass(frozen=True)
class Topology:
    """``num_hosts`` hosts of ``ranks_per_host`` ranks each; rank ``r`` is on host
    ``r // ranks_per_host`` (ranks are numbered host by host, as Ray Train numbers a node's
    workers together)."""

    num_hosts: int
    ranks_per_host: int

    def __post_init__(self) -> None:
        if self.num_hosts < 1 or self.ranks_per_host < 1:
            raise ValueError(f"a topology needs at least one host and rank, got {self}")

    @property
    def world_size(self) -> int:
        return self.num_hosts * self.ranks_per_host

    def host(self, rank: int) -> int:
        return rank // self.ranks_per_host

    def host_ranks(self, host: int) -> list[int]:
        """The ranks of ``host`` (the intra-host group, in local-index order)."""
        return [host * self.ranks_per_host + i for i in range(self.ranks_per_host)]

    def peer_ranks(self, local: int) -> list[int]:
        """The ranks of local index ``local`` on every host (a cross-host group, in host
        order)."""
        return [h * self.ranks_per_host + local for h in range(self.num_hosts)]


@dataclass(frozen=True)
class TopologyGroups:
    """This rank's place in a :class:`Topology` and its two process groups."""

    topology: Topology
    host: int
    intra: ProcessGroup | None
    """The ranks of this rank's host (their rank in it is the local index)."""
    cross: ProcessGroup | None
    """The ranks of this rank's local index on every host (their rank in it is the host)."""


def topology_groups(topology: Topology) -> TopologyGroups:
    """Creates the intra-host and cross-host process groups of ``topology`` (every rank must
    call it: each group is created on every rank, in the same order).

    Raises:
        ValueError: if the topology's world size is not torch.distributed's.
    """
    rank, world_size = rank_and_world_size(None)
    if topology.world_size != world_size:
        raise ValueError(
            f"topology of {topology.num_hosts} hosts x {topology.ranks_per_host} ranks does not "
            f"match the {world_size} ranks of the process group"
        )
    if world_size == 1:
        return TopologyGroups(topology, host=0, intra=None, cross=None)
    intra = cross = None
    for h in range(topology.num_hosts):
        group = dist.new_group(topology.host_ranks(h))
        intra = group if topology.host(rank) == h else intra
    for i in range(topology.ranks_per_host):
        group = dist.new_group(topology.peer_ranks(i))
        cross = group if rank % topology.ranks_per_host == i else cross
    return TopologyGroups(topology, host=topology.host(rank), intra=intra, cross=cross)


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
    return dataclasses.replace(config, pinned_ranks=pinned, **changes)


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


class _HostTowers(nn.Module):
    """The tower modules of one host: each tower's pooled features (in the tower's feature
    order) through its module, the outputs side by side."""

    def __init__(self, towers: list[Tower], modules: Mapping[str, nn.Module | None]):
        super().__init__()
        self.towers = towers
        self.blocks = nn.ModuleDict(
            {t.name: modules[t.name] for t in towers if modules.get(t.name) is not None}
        )

    def forward(self, pooled: dict[str, torch.Tensor]) -> torch.Tensor:
        outs = []
        for tower in self.towers:
            x = torch.cat([pooled[f] for f in tower.features], dim=1)
            outs.append(self.blocks[tower.name](x) if tower.name in self.blocks else x)
        return torch.cat(outs, dim=1)


class _CrossHostOutputs(torch.autograd.Function):
    """The reverse cross-host all-to-all of the tower outputs: rows ``[start_a, start_a + b_a)``
    of this host's ``(N, C_h)`` outputs go back to host ``a``; this rank receives ``(B, C_g)``
    from every host ``g`` (side by side, in host order). The backward sends the gradients the
    other way, divided by the number of hosts (see the module docstring)."""

    @staticmethod
    def forward(
        ctx: Any,
        values: torch.Tensor,
        source_batches: list[int],
        widths: list[int],
        batch_size: int,
        pg: ProcessGroup | None,
        comm: CommBytes,
    ) -> torch.Tensor:
        ctx.meta = (source_batches, widths, batch_size, pg, comm)
        width = values.shape[1]
        received = all_to_all(
            values.contiguous().view(-1),
            input_splits=[b * width for b in source_batches],
            output_splits=[batch_size * w for w in widths],
            pg=pg,
        )
        rank, _ = rank_and_world_size(pg)
        sent = sum(b for a, b in enumerate(source_batches) if a != rank) * width
        comm.add(
            "cross_forward", str(values.dtype).removeprefix("torch."), sent * values.element_size()
        )
        blocks = torch.split(received, [batch_size * w for w in widths])
        return torch.cat([b.view(batch_size, w) for b, w in zip(blocks, widths, strict=True)], 1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        source_batches, widths, batch_size, pg, comm = ctx.meta
        rank, num_hosts = rank_and_world_size(pg)
        width = widths[rank]
        send = torch.cat([g.contiguous().view(-1) for g in torch.split(grad, widths, dim=1)])
        received = all_to_all(
            send,
            input_splits=[batch_size * w for w in widths],
            output_splits=[b * width for b in source_batches],
            pg=pg,
        )
        sent = sum(w for g, w in enumerate(widths) if g != rank) * batch_size
        comm.add(
            "cross_backward", str(grad.dtype).removeprefix("torch."), sent * grad.element_size()
        )
        return received.view(-1, width) / num_hosts, None, None, None, None, None


def _cat_batches(kjts: list[KeyedJaggedTensor]) -> KeyedJaggedTensor:
    """KJTs of the same keys concatenated along the batch (samples of ``kjts[0]`` first)."""
    if len(kjts) == 1:
        return kjts[0]
    num_keys = len(kjts[0].keys)
    starts = [k.offset_per_key().tolist() for k in kjts]

    def feature_major(tensors: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(
            [
                t[s[f] : s[f + 1]]
                for f in range(num_keys)
                for t, s in zip(tensors, starts, strict=True)
            ]
        )

    lengths = torch.cat([k.lengths.view(num_keys, k.batch_size) for k in kjts], dim=1)
    weighted = kjts[0].weights is not None
    return KeyedJaggedTensor(
        keys=list(kjts[0].keys),
        values=feature_major([k.values for k in kjts]),
        lengths=lengths.reshape(-1),
        batch_size=sum(k.batch_size for k in kjts),
        weights=feature_major([k.weights for k in kjts]) if weighted else None,
    )


@dataclass
class _TowerRouted:
    """A batch's ids routed to the towers (a :class:`~raydlrm.sharding.types.Routed`): the
    host collection's routing of every host's samples, and the batch size from each host."""

    features: KeyedJaggedTensor
    batches: list[int]
    inner: Any

    def tensors(self) -> Iterator[torch.Tensor | None]:
        yield from self.inner.tensors()


class ShardedTowerCollection(ShardedTables):
    """An :class:`EmbeddingBagCollection` split into towers pinned to hosts (see the module
    docstring), a :class:`~raydlrm.sharding.types.ShardedTables` whose plan covers every rank
    (:func:`plan_towers`): checkpoints save and load its shards as any collection's.

    Input: a KJT of this rank's ``B`` samples (``B`` may differ across ranks) holding every
    feature of every table (a batch's dedup groups are expanded into it). Output: a
    :class:`KeyedTensor` of shape ``B x sum(C_t)``, the towers in ``towers`` order: an identity
    tower's keys are its features (their pooled embeddings), a tower with a module is one key,
    its name, of the module's output width (:attr:`feature_names`, :attr:`feature_dims`).

    Args:
        ebc: the unsharded collection (every rank builds it with the same seed); the tables of
            this rank's host are sharded over the host's ranks.
        towers: the towers (:func:`check_towers`).
        modules: tower name -> its module (``None`` or absent: identity); every rank builds
            every module with the same seed (the ranks of a tower's host keep it, under data
            parallelism over the host).
        output_widths: tower name -> its module's output width (a tower with a module).
        plan: where every table lives, over every rank (:func:`plan_towers`).
        config: as for :class:`ShardedEmbeddingBagCollection`.
        device: ``cpu`` or a CUDA device.
        groups: this rank's :class:`TopologyGroups`.
        replicated: every rank holds every tower's module (the model's dense side does, for
            checkpoints and exports): no data parallelism inside the host;
            :meth:`finish_backward` sums their gradients over every rank instead.
    """

    def __init__(
        self,
        ebc: EmbeddingBagCollection,
        *,
        towers: Sequence[Tower],
        modules: Mapping[str, nn.Module | None],
        output_widths: Mapping[str, int],
        plan: ShardingPlan,
        config: ShardingConfig,
        device: torch.device | str,
        groups: TopologyGroups,
        replicated: bool = False,
    ):
        super().__init__()
        topology = groups.topology
        check_towers(towers, ebc.tables, topology.num_hosts)
        self.towers, self.topology, self.plan = list(towers), topology, plan
        self.tables = list(ebc.tables)
        self._groups = groups
        self._device = torch.device(device)
        self._cross_bytes = CommBytes()
        self._precisions = {t.name: config.weights_precision_of(t.name) for t in self.tables}
        self._offset = topology.host_ranks(groups.host)[0]
        mine = host_tables(ebc.tables, towers, groups.host)
        self.host_tables = ShardedEmbeddingBagCollection(
            _subcollection(ebc, mine),
            plan=host_plan(plan, topology, groups.host),
            config=host_config(config, {t.name for t in mine}, topology, groups.host),
            device=self._device,
            pg=groups.intra,
        )
        self.kernel = self.host_tables.kernel
        self._rows = {f: t.num_embeddings for t in ebc.tables for f in t.feature_names}
        self._layout(ebc, modules, output_widths)
        host_towers = _HostTowers([t for t in towers if t.host == groups.host], modules)
        host_towers = host_towers.to(self._device)
        # Every tower's module, in tower order, when every rank holds them all.
        self._replicated = [
            modules[t.name] for t in towers if replicated and modules.get(t.name) is not None
        ]
        trained = any(p.requires_grad for p in host_towers.parameters())
        if not replicated and topology.ranks_per_host > 1 and trained:
            host_towers = DistributedDataParallel(
                host_towers,
                device_ids=None if self._device.index is None else [self._device.index],
                process_group=groups.intra,
            )
        self.tower_modules = host_towers

    def _layout(
        self,
        ebc: EmbeddingBagCollection,
        modules: Mapping[str, nn.Module | None],
        output_widths: Mapping[str, int],
    ) -> None:
        """Each host's features and output width, the output's keys and dims, and the column
        order from the received host blocks (host order) to the towers' order."""
        dims = dict(zip(ebc.feature_names, ebc.feature_dims, strict=True))
        identity = {t.name: modules.get(t.name) is None for t in self.towers}
        widths = {
            t.name: sum(dims[f] for f in t.features) if identity[t.name] else output_widths[t.name]
            for t in self.towers
        }
        by_host = [[t for t in self.towers if t.host == h] for h in range(self.topology.num_hosts)]
        self._host_features = [[f for t in ts for f in t.features] for ts in by_host]
        self._host_widths = [sum(widths[t.name] for t in ts) for ts in by_host]
        start, col = {}, 0
        for t in (t for ts in by_host for t in ts):
            start[t.name], col = col, col + widths[t.name]
        order = [start[t.name] + c for t in self.towers for c in range(widths[t.name])]
        self._column_order = (
            None if order == list(range(col)) else torch.tensor(order, device=self._device)
        )
        self.feature_names = [
            k for t in self.towers for k in (t.features if identity[t.name] else (t.name,))
        ]
        self.feature_dims = [
            d
            for t in self.towers
            for d in ([dims[f] for f in t.features] if identity[t.name] else [widths[t.name]])
        ]

    # -- the forward pass: ids across hosts, the host's lookups, tower modules, back --------

    def input_dist(
        self,
        features: KeyedJaggedTensor,
        dedup_groups: Sequence[DedupGroup] = (),
        *,
        pg: ProcessGroup | None = None,
    ) -> _TowerRouted:
        """Steps 1 and 2's routing: the ids of each host's towers to the rank of this local
        index there, then the host collection's routing of them (see
        :meth:`ShardedTables.input_dist <raydlrm.sharding.types.ShardedTables.input_dist>`;
        towers route on their own groups, a pipeline's ``pg`` is refused)."""
        if pg is not None:
            raise ValueError("towers route on their own process groups: no pipeline's pg")
        expanded = features
        if dedup_groups:
            expanded = KeyedJaggedTensor.concat([features, *(g.expand() for g in dedup_groups)])
        merged, batches = self._exchange_ids(expanded)
        # The routing names the features it was made for (a prefetched batch is found by them).
        return _TowerRouted(features, batches, self.host_tables.input_dist(merged))

    def compute_and_output_dist(self, routed: _TowerRouted) -> KeyedTensor:
        """The host's lookups, its tower modules, the tower outputs back to their samples'
        ranks, in tower order."""
        pooled = self.host_tables.compute_and_output_dist(routed.inner).to_dict()
        outputs = self.tower_modules(pooled)
        width = self._host_widths[self._groups.host]
        if outputs.shape[1] != width:
            raise ValueError(
                f"the tower modules of host {self._groups.host} output {outputs.shape[1]} "
                f"columns, their output_widths say {width}"
            )
        if self.topology.num_hosts > 1:
            outputs = _CrossHostOutputs.apply(
                outputs,
                routed.batches,
                self._host_widths,
                routed.features.batch_size,
                self._groups.cross,
                self._cross_bytes,
            )
        if self._column_order is not None:
            outputs = outputs.index_select(1, self._column_order)
        return KeyedTensor(
            keys=list(self.feature_names), dims=list(self.feature_dims), values=outputs
        )

    def _exchange_ids(self, features: KeyedJaggedTensor) -> tuple[KeyedJaggedTensor, list[int]]:
        """Step 1: each host's features to the rank of this local index on that host; the
        received KJTs concatenated in host order, and the batch size from each host."""
        self._check_ids(features)  # here, on the rank whose batch it is
        sends = [features.select(names) for names in self._host_features]
        if len(sends) == 1:
            return sends[0], [features.batch_size]
        pg, mine = self._groups.cross, self._groups.host
        has_weights = int(features.weights is not None)
        counts = torch.tensor(
            [n for k in sends for n in (k.batch_size, k.values.numel(), has_weights)],
            device=features.values.device,
        )
        received = all_to_all(
            counts, input_splits=[3] * len(sends), output_splits=[3] * len(sends), pg=pg
        )
        batches, numels, flags = received.view(len(sends), 3).t().tolist()
        # Every rank of the group receives every flag: all agree whether weights travel (a
        # rank without them, e.g. an empty batch, sends weights of 1).
        weighted = any(flags)
        width = len(self._host_features[mine])

        def exchange(parts: list[torch.Tensor], output_splits: list[int]) -> list[torch.Tensor]:
            out = all_to_all(
                torch.cat(parts),
                input_splits=[p.numel() for p in parts],
                output_splits=output_splits,
                pg=pg,
            )
            return list(torch.split(out, output_splits))

        lengths = exchange([k.lengths for k in sends], [width * b for b in batches])
        values = exchange([k.values for k in sends], numels)
        weights = [None] * len(sends)
        if weighted:
            weights = exchange(
                [
                    torch.ones(k.values.shape, device=k.values.device)
                    if k.weights is None
                    else k.weights
                    for k in sends
                ],
                numels,
            )
        for h, k in enumerate(sends):
            if h != mine:
                self._cross_bytes.add("cross_input", "lengths", k.lengths.numel() * 8)
                ids = k.values.numel() * k.values.element_size()
                self._cross_bytes.add("cross_input", "ids", ids)
                if weighted:
                    self._cross_bytes.add("cross_input", "weights", k.values.numel() * 4)
        keys = self._host_features[mine]
        parts = [
            KeyedJaggedTensor.from_lengths(keys, v, n, weights=w)
            for n, v, w in zip(lengths, values, weights, strict=True)
        ]
        return _cat_batches(parts), batches

    def _check_ids(self, features: KeyedJaggedTensor) -> None:
        """Raises ValueError naming the table of the first id outside its table (one pass over
        the ids, one host sync)."""
        values = features.values
        limits = torch.tensor(
            [self._rows.get(k, torch.iinfo(torch.int64).max) for k in features.keys],
            device=values.device,
        )
        per_id = torch.repeat_interleave(
            limits, features.length_per_key(), output_size=values.numel()
        )
        bad = (values < 0) | (values >= per_id)
        if not bool(bad.any()):
            return
        pos = int(torch.nonzero(bad)[0, 0])
        key = features.keys[int(torch.searchsorted(features.offset_per_key(), pos, right=True)) - 1]
        table = next(t.name for t in self.tables if key in t.feature_names)
        rows = self._rows[key]
        raise ValueError(
            f"table {table!r} (feature {key!r}): id {int(values[pos])} not in [0, {rows})"
        )

    def finish_backward(self) -> None:
        """With ``replicated`` modules: each tower module's gradient, summed over every rank
        (zeros from the ranks of other hosts, which did not run it) and divided by the ranks of
        a host, the average data parallelism inside the host would give; every rank then holds
        it for every tower, and the same optimizer step keeps the replicas equal. One
        all-reduce over every rank."""
        params = [p for m in self._replicated for p in m.parameters() if p.requires_grad]
        if not params or not dist.is_initialized() or dist.get_world_size() == 1:
            return
        flat = torch.cat(
            [(torch.zeros_like(p) if p.grad is None else p.grad).reshape(-1) for p in params]
        )
        dist.all_reduce(flat)
        flat /= self.topology.ranks_per_host
        for p, g in zip(params, torch.split(flat, [p.numel() for p in params]), strict=True):
            p.grad = g.view_as(p)

    # -- the rest of ShardedTables: this host's collection, shards named by global rank ------

    def comm_bytes(self) -> dict[str, dict[str, int]]:
        """Bytes this rank sent to other ranks: inside its host (the host collection's
        directions) and to other hosts (``cross_input``, ``cross_forward``,
        ``cross_backward``)."""
        return {**self.host_tables.comm_bytes(), **self._cross_bytes.as_dict()}

    def local_tables(self) -> dict[str, torch.Tensor | QuantizedRows]:
        return self.host_tables.local_tables()

    def local_shards(self) -> dict[str, Shard]:
        return {
            name: dataclasses.replace(s, rank=s.rank + self._offset)
            for name, s in self.host_tables.local_shards().items()
        }

    def weight_precisions(self) -> dict[str, str]:
        return dict(self._precisions)

    def memory_bytes(self) -> int:
        return self.host_tables.memory_bytes()

    def cache_hit_rates(self) -> dict[str, tuple[int, int]]:
        return self.host_tables.cache_hit_rates()

    def optimizer_states(self) -> dict[str, list[torch.Tensor]]:
        return self.host_tables.optimizer_states()

    def track_modified_rows(self) -> None:
        self.host_tables.track_modified_rows()

    def modified_rows(self) -> dict[str, torch.Tensor]:
        return self.host_tables.modified_rows()

    def clear_modified_rows(self) -> None:
        self.host_tables.clear_modified_rows()

    def ssd_tables(self) -> dict[str, tuple[torch.Tensor, tuple[int, int] | None]]:
        return self.host_tables.ssd_tables()


def _subcollection(ebc: EmbeddingBagCollection, tables: list) -> EmbeddingBagCollection:
    """A collection of ``tables`` out of ``ebc``, sharing its weights (or, on the meta device,
    its seed: the sharded collection then creates the shards with the same values)."""
    sub = EmbeddingBagCollection(tables, device="meta", seed=ebc.seed)
    for t in tables:
        weight = ebc.weights[t.name]
        if weight.device.type != "meta":
            sub.weights[t.name] = weight
    return sub


def shard_tower_model(
    model: nn.Module,
    *,
    plan: ShardingPlan,
    config: ShardingConfig,
    device: torch.device | str,
    groups: TopologyGroups,
) -> nn.Module:
    """:func:`~raydlrm.sharding.shard_model` for a model with towers
    (:class:`~raydlrm.models.towers.TowerDense`) on the hosts of ``groups``, in place: the
    collection becomes a :class:`ShardedTowerCollection` that runs the tower modules (which
    ``model.dense`` keeps, replicated on every rank), and the rest of ``model.dense`` is
    data-parallel over every rank.

    Raises:
        TypeError: if ``model.dense`` has no towers.
    """
    from raydlrm.models.towers import TowerDense
    from raydlrm.sharding.tower_spec import model_towers

    dense = model.dense
    if not isinstance(dense, TowerDense):
        raise TypeError(f"{type(dense).__name__} has no towers (model.towers) to place on hosts")
    device = torch.device(device)
    towers = model_towers(dense.towers, groups.topology.num_hosts)
    dense = dense.to(device)
    model.embedding_bags = ShardedTowerCollection(
        model.embedding_bags,
        towers=towers,
        modules=dict(dense.blocks.items()),
        output_widths={name: b.proj.out_features for name, b in dense.blocks.items()},
        plan=plan,
        config=config,
        device=device,
        groups=groups,
        replicated=True,
    )
    dense.upstream = True
    if groups.topology.world_size > 1:
        ignored = [f"blocks.{name}" for name, _ in dense.blocks.named_parameters()]
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(dense, ignored)
        dense = DistributedDataParallel(
            dense, device_ids=[device.index] if device.type == "cuda" else None
        )
    model.dense = dense
    return model
