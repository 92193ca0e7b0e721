"""Input distribution: sends every id to the shards that look it up, in one all-to-all.

The input is one jagged tensor per *batch class* (:mod:`raydlrm.sharding._layout`): the plain
features with a bag per sample, and each dedup group's features with a bag per unique row, so
a feature's batch size is that of its class (a variable-batch input, as fbgemm's VBE and
TorchRec's variable-batch KJT have). They are routed together: one lengths, one ids and one
weights all-to-all per batch, whatever the number of classes.

An id of feature ``f`` goes to one unit per *column group* of ``f``: a column range of its
table (one for table-wise and row-wise tables, one per column shard for column-wise ones), or a
replica (one per rank for data-parallel tables). Inside a column group the rows are split into
contiguous ranges, one per unit; the id goes to the unit owning its row, with that unit's first
row subtracted (bucketization). All of this is vectorized over the batch:

Plans without row-split shards skip steps 1-3: every unit reads all its feature's bags, so one
bag permutation repeats and orders them unit by unit.

The bags are numbered feature after feature, classes in order (class 0's features, then class
1's, ...; within a class in collection order), feature ``f`` holding its class's batch size of
bags.

1. repeat each id once per column group of its feature (``fanout``);
2. find each copy's unit with one ``searchsorted`` over the keys ``group * stride + row_start``
   of all units (``stride`` exceeds every table's size, so groups never overlap);
3. stable-sort the copies by unit (each unit reads one feature, so the copies of a unit stay
   in bag order), count them per (unit, sample) into bag lengths;
4. all-to-all lengths, ids and weights: every rank receives its units' bags for every rank's
   samples (unique rows for a dedup class), ``(source rank, unit, sample)``, and permutes them
   to the ``(unit, global sample)`` layout TBE reads with a second bag permutation.

The bag permutations are fbgemm's ``permute_2D_sparse_data`` (one class) /
``permute_1D_sparse_data`` with ``sharding.kernel = "fbgemm"``, else :func:`permute_bags`
(PyTorch operators, the same output).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed import ProcessGroup

from raydlrm.batch import KeyedJaggedTensor, lengths_to_offsets
from raydlrm.sharding._comm import CommBytes, all_gather_ints, all_to_all
from raydlrm.sharding._layout import LookupUnit
from raydlrm.sharding._managed import route_rows

__all__ = ["InputDistributor", "LocalBags", "permute_bags"]


def permute_bags(
    bags: torch.Tensor,
    lengths: torch.Tensor,
    values: torch.Tensor,
    weights: torch.Tensor | None,
    *,
    num_values: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The bags ``bags`` (indices into ``lengths``, repeats allowed) of a jagged tensor, in
    that order: their lengths, ids and weights.

    Args:
        bags: ``(N,)`` bag indices.
        lengths: ``(M,)`` bag lengths of ``values``.
        values: ids, bag after bag.
        weights: per-id weights (or None).
        num_values: the ids of the result, when known (saves a host synchronization).
    """
    new_lengths = lengths[bags]
    starts = lengths_to_offsets(lengths)[:-1][bags]
    new_starts = lengths_to_offsets(new_lengths)
    if num_values is None:
        num_values = int(new_starts[-1])
    shift = torch.repeat_interleave(starts - new_starts[:-1], new_lengths, output_size=num_values)
    source = torch.arange(num_values, device=values.device) + shift
    return new_lengths, values[source], None if weights is None else weights[source]


@dataclass
class LocalBags:
    """This rank's units over the global batch, unit-major.

    Attributes:
        lengths: ``(sum over units of the unit's class's global batch,)`` bag lengths.
        values: ids, local to each unit's shard (row offset subtracted).
        weights: per-id weights or None.
        batch_sizes: ``batch_sizes[c][r]``, the bags of batch class ``c`` on rank ``r``.
    """

    lengths: torch.Tensor
    values: torch.Tensor
    weights: torch.Tensor | None
    batch_sizes: list[list[int]]


@dataclass
class _Jagged:
    """Bags of several features with a batch size per feature (a variable-batch KJT)."""

    lengths: torch.Tensor
    values: torch.Tensor
    weights: torch.Tensor | None

    @classmethod
    def concat(cls, kjts: list[KeyedJaggedTensor | None]) -> _Jagged:
        """The KJTs' bags one after the other (None: no features); unweighted ones get weights
        of 1 when any KJT is weighted (what an unweighted id counts for)."""
        present = [k for k in kjts if k is not None]
        if len(present) == 1:
            return cls(present[0].lengths, present[0].values, present[0].weights)
        weights = None
        weighted = [k.weights for k in present if k.weights is not None]
        if weighted:
            weights = torch.cat(
                [
                    k.weights
                    if k.weights is not None
                    else k.values.new_ones(k.values.shape, dtype=weighted[0].dtype)
                    for k in present
                ]
            )
        return cls(
            torch.cat([k.lengths for k in present]), torch.cat([k.values for k in present]), weights
        )


def _exclusive_cumsum(x: torch.Tensor) -> torch.Tensor:
    return lengths_to_offsets(x)[:-1]


def _gather_bags(counts: torch.Tensor, starts: torch.Tensor, *, total: int) -> torch.Tensor:
    """The bag indices ``starts[i], ..., starts[i] + counts[i] - 1`` for every ``i``, in order."""
    shift = torch.repeat_interleave(starts - _exclusive_cumsum(counts), counts, output_size=total)
    return torch.arange(total, device=counts.device) + shift


class InputDistributor:
    """Routes the ids of a collection's features to the units of every rank.

    Args:
        units: every rank's units (from :func:`~raydlrm.sharding._layout.rank_units`).
        feature_classes: the batch class of each of the collection's features, in collection
            order.
        rank: this rank.
        device: where the routing tensors live.
        pg: process group.
        comm_bytes: counts the ``input`` bytes sent to other ranks.
        fbgemm: permute bags with fbgemm's operators (else :func:`permute_bags`).
    """

    def __init__(
        self,
        units: list[list[LookupUnit]],
        *,
        feature_classes: list[int],
        rank: int,
        device: torch.device,
        pg: ProcessGroup | None,
        comm_bytes: CommBytes,
        fbgemm: bool = False,
    ):
        self._pg, self._rank, self._device = pg, rank, device
        self._fbgemm = fbgemm
        self._comm_bytes = comm_bytes
        self._num_units = [len(us) for us in units]
        self._num_classes = max(feature_classes, default=0) + 1
        # Bag order: by class, then collection order (the module docstring).
        order = sorted(range(len(feature_classes)), key=lambda f: (feature_classes[f], f))
        position = {f: p for p, f in enumerate(order)}
        flat = [u for us in units for u in us]
        self._stride = max(u.table.num_embeddings for u in flat) + 1 if flat else 1
        self._routing_keys(flat, order)

        def tensor(values: list[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        self._position_class = tensor([feature_classes[f] for f in order])
        self._unit_position = tensor([position[u.feature_index] for u in flat])
        self._unit_class = tensor([u.batch_class for u in flat])
        self._unit_row_start = tensor([u.shard.row_start for u in flat])
        self._unit_rank = tensor([u.shard.rank for u in flat])
        self._local_class = tensor([u.batch_class for u in units[rank]])
        # units of each class on each rank: the bags sent to (and received from) a rank
        self._class_units = [
            [sum(u.batch_class == c for u in us) for c in range(self._num_classes)] for us in units
        ]
        # Without row-split shards every unit reads all the ids of its feature: the send buffer
        # is the features' bags repeated and reordered unit by unit, one fbgemm permute.
        self._whole_rows = all(
            u.shard.row_start == 0 and u.shard.row_end == u.table.num_embeddings for u in flat
        )
        self._unit_feature = tensor([position[u.feature_index] for u in flat], torch.int32)
        # Managed tables' features (raw ids): routed by their bucket's first row, sent as they
        # are (:mod:`raydlrm.sharding._managed`).
        table_of = {u.feature_index: u.table for u in flat}
        managed = [table_of.get(f) for f in order]
        managed = [t if t is not None and t.managed is not None else None for t in managed]
        self._any_managed = any(t is not None for t in managed)
        self._position_buckets = tensor(
            [0 if t is None else t.managed.buckets_for(t.num_embeddings) for t in managed]
        )
        self._position_rows = tensor([0 if t is None else t.num_embeddings for t in managed])

    def _routing_keys(self, flat: list[LookupUnit], order: list[int]) -> None:
        """The column groups of every feature (in bag order) and the bucketization keys of
        their units (see the module docstring)."""
        fanout, group_base, seg_keys, seg_units = [], [], [], []
        index = {id(u): i for i, u in enumerate(flat)}
        num_groups = 0
        for f in order:
            feature_units = [u for u in flat if u.feature_index == f]
            if feature_units and feature_units[0].replicated:
                groups = [[u] for u in feature_units]
            else:
                columns = sorted({(u.shard.col_start, u.shard.col_end) for u in feature_units})
                groups = [
                    sorted(
                        (u for u in feature_units if (u.shard.col_start, u.shard.col_end) == c),
                        key=lambda u: u.shard.row_start,
                    )
                    for c in columns
                ]
            fanout.append(len(groups))
            group_base.append(num_groups)
            for group in groups:
                for u in group:
                    seg_keys.append(num_groups * self._stride + u.shard.row_start)
                    seg_units.append(index[id(u)])
                num_groups += 1
        device = self._device
        self._fanout = torch.tensor(fanout, dtype=torch.int64, device=device)
        self._group_base = torch.tensor(group_base, dtype=torch.int64, device=device)
        self._seg_keys = torch.tensor(seg_keys, dtype=torch.int64, device=device)
        self._seg_units = torch.tensor(seg_units, dtype=torch.int64, device=device)

    def _bucketize(
        self, kjt: _Jagged, local_batch: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, list[int]]:
        """Send buffers: lengths (every unit's bags, rank-major), ids, weights, ids per rank.

        Args:
            kjt: every feature's bags, in bag order (one batch size per class).
            local_batch: this rank's bags per feature of each class.
        """
        device = self._device
        batch = torch.tensor(local_batch, dtype=torch.int64, device=device)
        unit_bags = batch[self._unit_class]  # bags of each unit, rank-major
        total_bags = sum(
            n * b for us in self._class_units for n, b in zip(us, local_batch, strict=True)
        )
        if self._whole_rows:
            return self._repeat_bags(kjt, local_batch, unit_bags, total_bags)
        num_ids = kjt.values.numel()
        position_bags = batch[self._position_class]
        bag_start = _exclusive_cumsum(position_bags)
        bag = torch.repeat_interleave(
            torch.arange(kjt.lengths.numel(), device=device), kjt.lengths, output_size=num_ids
        )
        feature = torch.repeat_interleave(
            torch.arange(position_bags.numel(), device=device),
            position_bags,
            output_size=kjt.lengths.numel(),
        )[bag]
        sample = bag - bag_start[feature]
        fanout = self._fanout[feature]
        num_copies = int(fanout.sum())
        source = torch.repeat_interleave(
            torch.arange(num_ids, device=device), fanout, output_size=num_copies
        )
        first_copy = torch.repeat_interleave(
            _exclusive_cumsum(fanout), fanout, output_size=num_copies
        )
        group = self._group_base[feature[source]] + (
            torch.arange(num_copies, device=device) - first_copy
        )
        ids = kjt.values[source].to(torch.int64)
        route, managed = self._routing_rows(ids, feature[source])
        segment = torch.searchsorted(self._seg_keys, group * self._stride + route, right=True) - 1
        unit, order = torch.sort(self._seg_units[segment], stable=True)
        shift = self._unit_row_start[unit]
        if managed is not None:  # a raw id goes as it is
            shift = torch.where(managed[order], 0, shift)
        values = ids[order] - shift
        source = source[order]
        weights = None if kjt.weights is None else kjt.weights[source]
        lengths = torch.bincount(
            _exclusive_cumsum(unit_bags)[unit] + sample[source], minlength=total_bags
        )
        ids_per_rank = torch.bincount(self._unit_rank[unit], minlength=len(self._num_units))
        return lengths, values, weights, ids_per_rank.tolist()

    def _routing_rows(
        self, ids: torch.Tensor, position: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The row each id is routed by (its own; a managed table's raw id: its bucket's first
        row) and which ids are managed (None: no managed table)."""
        if not self._any_managed:
            return ids, None
        buckets = self._position_buckets[position]
        managed = buckets > 0
        routed = route_rows(ids, buckets.clamp(min=1), self._position_rows[position])
        return torch.where(managed, routed, ids), managed

    def _repeat_bags(
        self, kjt: _Jagged, local_batch: list[int], unit_bags: torch.Tensor, total_bags: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, list[int]]:
        """:meth:`_bucketize` when every unit reads all its feature's ids."""
        if self._num_classes == 1:  # one batch size: a 2-D permutation of (feature, sample)
            rows = local_batch[0]
            if self._fbgemm:
                lengths, values, weights = torch.ops.fbgemm.permute_2D_sparse_data(
                    self._unit_feature,
                    kjt.lengths.view(len(self._fanout), rows),
                    kjt.values,
                    kjt.weights,
                    None,
                )
            else:
                bags = self._unit_feature.to(torch.int64).unsqueeze(1) * rows
                bags = bags + torch.arange(rows, device=self._device)
                lengths, values, weights = permute_bags(
                    bags.reshape(-1), kjt.lengths, kjt.values, kjt.weights
                )
            lengths = lengths.reshape(-1)
        else:
            position_bags = unit_bags.new_tensor(local_batch)[self._position_class]
            bags = _gather_bags(
                unit_bags, _exclusive_cumsum(position_bags)[self._unit_position], total=total_bags
            )
            if self._fbgemm:
                lengths, values, weights = torch.ops.fbgemm.permute_1D_sparse_data(
                    bags.int(), kjt.lengths, kjt.values, kjt.weights, None
                )
            else:
                lengths, values, weights = permute_bags(bags, kjt.lengths, kjt.values, kjt.weights)
        rank_of_bag = torch.repeat_interleave(
            self._unit_rank, unit_bags, output_size=lengths.numel()
        )
        ids_per_rank = torch.zeros(
            len(self._num_units), dtype=lengths.dtype, device=self._device
        ).index_add_(0, rank_of_bag, lengths)
        return lengths, values, weights, ids_per_rank.tolist()

    def _count_bytes(
        self,
        send_bags: list[int],
        send_ids: list[int],
        *,
        lengths: torch.Tensor,
        values: torch.Tensor,
        weights: torch.Tensor | None,
    ) -> None:
        """Counts the ``input`` bytes sent to other ranks."""
        sent_ids = sum(send_ids) - send_ids[self._rank]
        sent_bags = sum(send_bags) - send_bags[self._rank]
        self._comm_bytes.add("input", "lengths", sent_bags * lengths.element_size())
        self._comm_bytes.add("input", "ids", sent_ids * values.element_size())
        if weights is not None:
            self._comm_bytes.add("input", "weights", sent_ids * weights.element_size())

    def _bag_permutation(self, batch_sizes: list[list[int]], total: int) -> torch.Tensor:
        """Bag index mapping ``(unit, global sample)`` order to the received
        ``(source rank, unit, sample)`` order (``total`` bags), int64."""
        sizes = torch.tensor(batch_sizes, dtype=torch.int64, device=self._device)
        counts = sizes[self._local_class]  # (local units, source ranks)
        received_start = _exclusive_cumsum(counts.t().reshape(-1)).view(counts.t().shape).t()
        counts = counts.reshape(-1)
        return _gather_bags(counts, received_start.reshape(-1), total=total)

    def __call__(
        self,
        kjts: list[KeyedJaggedTensor | None],
        local_batch: list[int],
        *,
        pg: ProcessGroup | None = None,
    ) -> LocalBags:
        """Sends this rank's samples' ids to their units; returns this rank's units' bags.

        Args:
            kjts: one per batch class, holding exactly that class's features in collection
                order (a bag per sample, or per unique row of a dedup class), ids already
                checked against their tables; None for a class without features.
            local_batch: this rank's bags per feature of each class.
            pg: the process group to exchange them on (default: the collection's; a
                pipeline's background thread passes its own).
        """
        lengths, values, weights, send_ids = self._bucketize(_Jagged.concat(kjts), local_batch)
        world_size = len(self._num_units)
        if world_size == 1:
            return LocalBags(lengths, values, weights, [[b] for b in local_batch])
        pg = pg or self._pg
        # One exchange of every rank's batch sizes and ids per destination: the splits of all
        # three all-to-alls are then known, and they proceed together.
        gathered = all_gather_ints(local_batch + send_ids, device=self._device, pg=pg)
        classes = len(local_batch)
        batch_sizes, recv_ids = gathered[:classes], gathered[classes + self._rank]
        local = self._class_units[self._rank]
        recv_bags = [
            sum(n * batch_sizes[c][s] for c, n in enumerate(local)) for s in range(world_size)
        ]
        send_bags = [
            sum(n * b for n, b in zip(us, local_batch, strict=True)) for us in self._class_units
        ]
        self._count_bytes(send_bags, send_ids, lengths=lengths, values=values, weights=weights)
        exchanges = [
            all_to_all(t, input_splits=send, output_splits=recv, pg=pg, async_op=True)
            for t, send, recv in (
                (lengths, send_bags, recv_bags),
                (values, send_ids, recv_ids),
                (weights, send_ids, recv_ids),
            )
            if t is not None
        ]
        for _, work in exchanges:
            work.wait()
        lengths, values = exchanges[0][0], exchanges[1][0]
        weights = exchanges[2][0] if weights is not None else None
        permutation = self._bag_permutation(batch_sizes, sum(recv_bags))
        if self._fbgemm:
            lengths, values, weights = torch.ops.fbgemm.permute_1D_sparse_data(
                permutation.int(), lengths, values, weights, values.numel()
            )
        else:
            lengths, values, weights = permute_bags(
                permutation, lengths, values, weights, num_values=values.numel()
            )
        return LocalBags(lengths, values, weights, batch_sizes)
