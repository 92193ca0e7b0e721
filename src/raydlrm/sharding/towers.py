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
from raydlrm.models.embedding import EmbeddingBagCollection, check_id_range
from raydlrm.models.layers import autocast_fp32
from raydlrm.models.managed_ids import IdMap
from raydlrm.models.towers import TowerDense, run_towers
from raydlrm.sharding._comm import CommBytes, all_to_all, rank_and_world_size
from raydlrm.sharding.config import ShardingConfig
from raydlrm.sharding.embedding import ShardedEmbeddingBagCollection
from raydlrm.sharding.plan import Shard, ShardingPlan
from raydlrm.sharding.quantized import QuantizedRows
from raydlrm.sharding.topology import Topology, TopologyGroups, topology_groups
from raydlrm.sharding.tower_hosts import host_config, host_plan, host_tables
from raydlrm.sharding.tower_spec import Tower, check_towers
from raydlrm.sharding.types import EmbeddingCut, ShardedTables

__all__ = ["ShardedTowerCollection", "TowerOutputsDense", "shard_tower_model"]


class _HostTowers(nn.Module):
    """The tower modules of one host: each tower's pooled features (in the tower's feature
    order) through its module, the outputs side by side."""

    def __init__(self, towers: list[Tower], modules: Mapping[str, nn.Module | None]):
        super().__init__()
        self.towers = towers
        self.blocks = nn.ModuleDict(
            {t.name: modules[t.name] for t in towers if modules.get(t.name) is not None}
        )
        self.dense_dtype: torch.dtype | None = None
        """Autocast the tower modules to this type (``training.precision``; None: fp32); their
        outputs come back in fp32."""

    def forward(self, pooled: dict[str, torch.Tensor]) -> torch.Tensor:
        inputs = [torch.cat([pooled[f] for f in t.features], dim=1) for t in self.towers]
        blocks = dict(self.blocks.items())
        modules = [blocks.get(t.name) for t in self.towers]
        dtype = self.dense_dtype if blocks else None  # identity towers compute nothing
        return autocast_fp32(dtype, inputs[0].device.type, run_towers, inputs, modules)


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


class _ReplicaGradients:
    """The gradients of tower modules that every rank holds (``replicated``): after a backward
    pass, each module's gradient summed over every rank (zeros from the ranks of other hosts,
    which did not run it) and divided by the ranks of a host, the average data parallelism
    inside the host would give; every rank then holds it for every tower, and the same
    optimizer step keeps the replicas equal. One all-reduce over every rank, on a process group
    of its own (its order never meets the dense side's DDP), when the backward pass is done:
    the hook on the collection's output queues it on autograd's engine, as DDP queues its own
    end of backward."""

    def __init__(self, params: list[nn.Parameter], ranks_per_host: int):
        self.params, self.ranks_per_host = params, ranks_per_host
        # Every rank builds the collection at the same point: the group is made on every rank.
        self.pg = dist.new_group(backend=dist.get_backend())
        self._queued = False

    @classmethod
    def of(cls, modules: list[nn.Module], *, ranks_per_host: int) -> _ReplicaGradients | None:
        """The replicas' gradient sync (None: nothing to sync, or one rank)."""
        params = [p for m in modules for p in m.parameters() if p.requires_grad]
        if not params or not dist.is_initialized() or dist.get_world_size() == 1:
            return None
        return cls(params, ranks_per_host)

    def on_output_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """The output's gradient hook: queues the sync once per backward pass."""
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._all_reduce)
        return grad

    def _all_reduce(self) -> None:
        self._queued = False
        flat = torch.cat(
            [(torch.zeros_like(p) if p.grad is None else p.grad).reshape(-1) for p in self.params]
        )
        dist.all_reduce(flat, group=self.pg)
        flat /= self.ranks_per_host
        sizes = [p.numel() for p in self.params]
        for p, g in zip(self.params, torch.split(flat, sizes), strict=True):
            p.grad = g.view_as(p)


class ShardedTowerCollection(ShardedTables):
    """An :class:`EmbeddingBagCollection` split into towers pinned to hosts (see the module
    docstring), a :class:`~raydlrm.sharding.types.ShardedTables` whose plan covers every rank
    (:func:`~raydlrm.sharding.planner.tower_plan.plan_towers`): checkpoints save and load its
    shards as any collection's.

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
        plan: where every table lives, over every rank
            (:func:`~raydlrm.sharding.planner.tower_plan.plan_towers`).
        config: as for :class:`ShardedEmbeddingBagCollection`.
        device: ``cpu`` or a CUDA device.
        groups: this rank's :class:`TopologyGroups`.
        replicated: every rank holds every tower's module (the model's dense side does, for
            checkpoints and exports): no data parallelism inside the host; after each backward
            pass their gradients are summed over every rank instead (:class:`_ReplicaGradients`,
            a hook of this collection's output).
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
            managed_clock=any(t.managed is not None for t in ebc.tables),
        )
        self.kernel = self.host_tables.kernel
        # Managed tables' features carry raw ids (their host's maps turn them into rows).
        self._rows = {
            f: t.num_embeddings for t in ebc.tables if t.managed is None for f in t.feature_names
        }
        self._table_of = {f: t.name for t in ebc.tables for f in t.feature_names}
        self._layout(ebc, modules, output_widths)
        host_towers = _HostTowers([t for t in towers if t.host == groups.host], modules)
        host_towers = host_towers.to(self._device)
        # Every tower's module, in tower order, when every rank holds them all.
        self._replicas = _ReplicaGradients.of(
            [modules[t.name] for t in towers if replicated and modules.get(t.name) is not None],
            ranks_per_host=topology.ranks_per_host,
        )
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
        if self._replicas is not None and outputs.requires_grad:
            outputs.register_hook(self._replicas.on_output_grad)
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
        """Raises ValueError naming the table of the first id outside its table
        (:func:`~raydlrm.models.embedding.check_id_range`)."""
        limits = torch.tensor(
            [self._rows.get(k, torch.iinfo(torch.int64).max) for k in features.keys],
            device=features.values.device,
        )
        check_id_range(features, limits, table_of=self._table_of)

    # -- the rest of ShardedTables: this host's collection, shards named by global rank ------

    def cut_embeddings(self, cut: EmbeddingCut | None) -> None:
        """The cut of the host collection's pooled rows, before the tower modules: their
        parameters are trained by the dense optimizer, so their backward belongs to the part
        of the step above the lookups."""
        self.host_tables.cut_embeddings(cut)

    def comm_bytes(self) -> dict[str, dict[str, int]]:
        """Bytes this rank sent to other ranks: inside its host (the host collection's
        directions) and to other hosts (``cross_input``, ``cross_forward``,
        ``cross_backward``)."""
        return {**self.host_tables.comm_bytes(), **self._cross_bytes.as_dict()}

    def local_tables(self) -> dict[str, torch.Tensor | QuantizedRows]:
        return self.host_tables.local_tables()

    def id_maps(self) -> dict[str, IdMap]:
        return self.host_tables.id_maps()

    @property
    def managed_clock(self) -> tuple[int, int]:
        return self.host_tables.managed_clock

    @managed_clock.setter
    def managed_clock(self, clock: tuple[int, int]) -> None:
        self.host_tables.managed_clock = clock

    @property
    def managed_day(self) -> int:
        return self.host_tables.managed_day

    @managed_day.setter
    def managed_day(self, day: int) -> None:
        self.host_tables.managed_day = day

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

    def host_bytes(self) -> int:
        return self.host_tables.host_bytes()

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


class TowerOutputsDense(nn.Module):
    """``model.dense`` of a model sharded with towers on several hosts: the tower collection
    already ran the tower modules (its output is the towers'), so this runs the dense
    architecture (``TowerDense.inner``) on their outputs. It registers ``inner`` alone as its
    module, so that DDP around it syncs the architecture and leaves the tower modules, which
    every rank holds and the collection syncs, alone; :attr:`towers_dense` is the model's own
    :class:`~raydlrm.models.towers.TowerDense`, which checkpoints and exports hold."""

    def __init__(self, dense: TowerDense):
        super().__init__()
        self.inner = dense.inner
        self.__dict__["towers_dense"] = dense  # not a submodule: see the class docstring

    def forward(self, dense: torch.Tensor, towers: torch.Tensor) -> torch.Tensor:
        """Logits ``(B,)`` from dense ``B x num_dense`` and the towers' outputs."""
        return self.inner(dense, towers)


def shard_tower_model(
    model: nn.Module,
    *,
    plan: ShardingPlan,
    config: ShardingConfig,
    device: torch.device,
    topology: Topology,
) -> nn.Module:
    """:func:`~raydlrm.sharding.shard_model`'s path for a model with towers
    (:class:`~raydlrm.models.towers.TowerDense`) on the hosts of ``topology``, in place: the
    collection becomes a :class:`ShardedTowerCollection` that runs the tower modules (which
    the model's ``TowerDense`` keeps, replicated on every rank), and ``model.dense`` becomes a
    :class:`TowerOutputsDense`, data-parallel over every rank.

    Raises:
        TypeError: if ``model.dense`` has no towers.
    """
    from raydlrm.sharding.tower_spec import model_towers

    dense = model.dense
    if not isinstance(dense, TowerDense):
        raise TypeError(f"{type(dense).__name__} has no towers (model.towers) to place on hosts")
    towers = model_towers(dense.towers, topology.num_hosts)
    dense = dense.to(device)
    model.embedding_bags = ShardedTowerCollection(
        model.embedding_bags,
        towers=towers,
        modules=dict(dense.blocks.items()),
        output_widths={name: b.proj.out_features for name, b in dense.blocks.items()},
        plan=plan,
        config=config,
        device=device,
        groups=topology_groups(topology),
        replicated=True,
    )
    upstream: nn.Module = TowerOutputsDense(dense)
    if topology.world_size > 1:
        upstream = DistributedDataParallel(
            upstream, device_ids=[device.index] if device.type == "cuda" else None
        )
    model.dense = upstream
    return model
