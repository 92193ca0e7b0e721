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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.nn.parallel import DistributedDataParallel

from raydlrm.batch import KeyedJaggedTensor, KeyedTensor
from raydlrm.models.embedding import EmbeddingBagCollection
from raydlrm.sharding._comm import CommBytes, all_to_all, rank_and_world_size
from raydlrm.sharding.config import ShardingConfig
from raydlrm.sharding.embedding import ShardedEmbeddingBagCollection
from raydlrm.sharding.plan import ShardingPlan

__all__ = [
    "ShardedTowerCollection",
    "Topology",
    "TopologyGroups",
    "Tower",
    "check_towers",
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


@dataclass(frozen=True)
class Tower:
    """Features looked up together on one host.

    Attributes:
        name: the tower's name (its output's key when it has a module).
        features: the features it looks up (every feature of a table is in the same tower).
        host: the host whose ranks hold its tables and run its module.
    """

    name: str
    features: tuple[str, ...]
    host: int


def check_towers(towers: Sequence[Tower], ebc: EmbeddingBagCollection, num_hosts: int) -> None:
    """Every feature of ``ebc`` in exactly one tower, every table's features in one tower, each
    tower on one of the hosts.

    Raises:
        ValueError: naming the tower and the feature, table or host.
    """
    seen: dict[str, str] = {}
    for tower in towers:
        if not 0 <= tower.host < num_hosts:
            raise ValueError(f"tower {tower.name}: host {tower.host} is not in 0..{num_hosts - 1}")
        if not tower.features:
            raise ValueError(f"tower {tower.name}: no features")
        for f in tower.features:
            if f in seen:
                raise ValueError(f"feature {f} is in towers {seen[f]} and {tower.name}")
            seen[f] = tower.name
    missing = [f for f in ebc.feature_names if f not in seen]
    if missing:
        raise ValueError(f"features {missing} are in no tower")
    unknown = [f for f in seen if f not in ebc.feature_names]
    if unknown:
        raise ValueError(f"towers {sorted({seen[f] for f in unknown})}: unknown features {unknown}")
    for table in ebc.tables:
        owners = sorted({seen[f] for f in table.feature_names})
        if len(owners) > 1:
            raise ValueError(
                f"table {table.name} is looked up by features of towers {owners}: a table's "
                "features must be in one tower"
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


class ShardedTowerCollection(nn.Module):
    """An :class:`EmbeddingBagCollection` split into towers pinned to hosts (see the module
    docstring).

    Input: a KJT of this rank's ``B`` samples (``B`` may differ across ranks) holding every
    feature of every table. Output: a :class:`KeyedTensor` of shape ``B x sum(C_t)``, the towers
    in ``towers`` order: an identity tower's keys are its features (their pooled embeddings), a
    tower with a module is one key, its name, of the module's output width.

    Args:
        ebc: the unsharded collection (every rank builds it with the same seed); the tables of
            this rank's host are sharded over the host's ranks.
        towers: the towers (:func:`check_towers`).
        modules: tower name -> its module (``None`` or absent: identity); every rank builds
            every module with the same seed (the ranks of a tower's host keep it, under data
            parallelism over the host).
        output_widths: tower name -> its module's output width (a tower with a module).
        plan: where the tables of this rank's host live among the host's ranks (world size
            ``ranks_per_host``).
        config: as for :class:`ShardedEmbeddingBagCollection`.
        device: ``cpu`` or a CUDA device.
        groups: this rank's :class:`TopologyGroups`.
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
    ):
        super().__init__()
        topology = groups.topology
        check_towers(towers, ebc, topology.num_hosts)
        self.towers = list(towers)
        self.topology = topology
        self._groups = groups
        self._device = torch.device(device)
        self._cross_bytes = CommBytes()
        dims = dict(zip(ebc.feature_names, ebc.feature_dims, strict=True))
        widths = {
            t.name: output_widths[t.name]
            if modules.get(t.name) is not None
            else sum(dims[f] for f in t.features)
            for t in self.towers
        }
        by_host = [[t for t in self.towers if t.host == h] for h in range(topology.num_hosts)]
        self._host_features = [[f for t in ts for f in t.features] for ts in by_host]
        self._host_widths = [sum(widths[t.name] for t in ts) for ts in by_host]
        mine = by_host[groups.host]
        if not mine:
            raise ValueError(f"host {groups.host} has no tower: every host needs one")
        features = set(self._host_features[groups.host])
        tables = [t for t in ebc.tables if set(t.feature_names) & features]
        self.host_tables = ShardedEmbeddingBagCollection(
            _subcollection(ebc, tables),
            plan=plan,
            config=config,
            device=self._device,
            pg=groups.intra,
        )
        host_towers = _HostTowers(mine, modules).to(self._device)
        if topology.ranks_per_host > 1 and any(p.requires_grad for p in host_towers.parameters()):
            host_towers = DistributedDataParallel(
                host_towers,
                device_ids=[self._device.index] if self._device.type == "cuda" else None,
                process_group=groups.intra,
            )
        self.tower_modules = host_towers
        # Output columns: host blocks side by side (host order) -> towers in `towers` order.
        host_order = [t for ts in by_host for t in ts]
        start = {}
        col = 0
        for t in host_order:
            start[t.name] = col
            col += widths[t.name]
        self.register_buffer(
            "_column_order",
            torch.tensor(
                [start[t.name] + c for t in self.towers for c in range(widths[t.name])],
                dtype=torch.int64,
                device=self._device,
            ),
            persistent=False,
        )
        self._identity_columns = bool(torch.equal(self._column_order.cpu(), torch.arange(col)))
        self.output_keys: list[str] = []
        self.output_dims: list[int] = []
        for t in self.towers:
            if modules.get(t.name) is None:
                self.output_keys += list(t.features)
                self.output_dims += [dims[f] for f in t.features]
            else:
                self.output_keys.append(t.name)
                self.output_dims.append(widths[t.name])

    def _exchange_ids(self, features: KeyedJaggedTensor) -> tuple[KeyedJaggedTensor, list[int]]:
        """Step 1: each host's features to the rank of this local index on that host; the
        received KJTs concatenated in host order, and the batch size from each host."""
        pg = self._groups.cross
        sends = [features.select(names) for names in self._host_features]
        num_hosts = len(sends)
        mine = self._groups.host
        if num_hosts == 1:
            return sends[0], [features.batch_size]
        device = features.values.device
        counts = torch.tensor(
            [n for k in sends for n in (k.batch_size, k.values.numel())], device=device
        )
        received = all_to_all(
            counts, input_splits=[2] * num_hosts, output_splits=[2] * num_hosts, pg=pg
        )
        batches, numels = received.view(num_hosts, 2).t().tolist()
        width = len(self._host_features[mine])
        lengths = all_to_all(
            torch.cat([k.lengths for k in sends]),
            input_splits=[k.lengths.numel() for k in sends],
            output_splits=[width * b for b in batches],
            pg=pg,
        )
        values = all_to_all(
            torch.cat([k.values for k in sends]),
            input_splits=[k.values.numel() for k in sends],
            output_splits=numels,
            pg=pg,
        )
        weights = None
        if features.weights is not None:
            weights = all_to_all(
                torch.cat([k.weights for k in sends]),
                input_splits=[k.values.numel() for k in sends],
                output_splits=numels,
                pg=pg,
            )
        for h, k in enumerate(sends):
            if h != mine:
                ids = k.lengths.numel() * 8 + k.values.numel() * k.values.element_size()
                self._cross_bytes.add("cross_input", "ids", ids)
                if k.weights is not None:
                    self._cross_bytes.add("cross_input", "weights", k.weights.numel() * 4)
        keys = self._host_features[mine]
        parts = []
        for lens, vals, wts in zip(
            torch.split(lengths, [width * b for b in batches]),
            torch.split(values, numels),
            torch.split(weights, numels) if weights is not None else [None] * num_hosts,
            strict=True,
        ):
            parts.append(KeyedJaggedTensor.from_lengths(keys, vals, lens, weights=wts))
        return _cat_batches(parts), batches

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        merged, batches = self._exchange_ids(features)
        pooled = self.host_tables(merged).to_dict()
        outputs = self.tower_modules(pooled)
        if self.topology.num_hosts > 1:
            outputs = _CrossHostOutputs.apply(
                outputs,
                batches,
                self._host_widths,
                features.batch_size,
                self._groups.cross,
                self._cross_bytes,
            )
        if not self._identity_columns:
            outputs = outputs.index_select(1, self._column_order)
        return KeyedTensor(keys=list(self.output_keys), dims=list(self.output_dims), values=outputs)

    def comm_bytes(self) -> dict[str, dict[str, int]]:
        """Bytes this rank sent to other ranks: inside its host (the host collection's
        directions) and to other hosts (``cross_input``, ``cross_forward``,
        ``cross_backward``)."""
        return {**self.host_tables.comm_bytes(), **self._cross_bytes.as_dict()}


def _subcollection(ebc: EmbeddingBagCollection, tables: list) -> EmbeddingBagCollection:
    """A collection of ``tables`` out of ``ebc``, sharing its weights (or, on the meta device,
    its seed: the sharded collection then creates the shards with the same values)."""
    sub = EmbeddingBagCollection(tables, device="meta", seed=ebc.seed)
    for t in tables:
        weight = ebc.weights[t.name]
        if weight.device.type != "meta":
            sub.weights[t.name] = weight
    return sub
