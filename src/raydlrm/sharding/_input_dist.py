"""Input distribution: sends every id to the shards that look it up.

An id of feature ``f`` goes to one unit per *column group* of ``f``: a column range of its
table (one for table-wise and row-wise tables, one per column shard for column-wise ones), or a
replica (one per rank for data-parallel tables). Inside a column group the rows are split into
contiguous ranges, one per unit; the id goes to the unit owning its row, with that unit's first
row subtracted (bucketization). All of this is vectorized over the batch:

Plans without row-split shards skip steps 1-3: every unit reads all its feature's bags, so one
bag permutation repeats and orders them unit by unit.

1. repeat each id once per column group of its feature (``fanout``);
2. find each copy's unit with one ``searchsorted`` over the keys ``group * stride + row_start``
   of all units (``stride`` exceeds every table's size, so groups never overlap);
3. stable-sort the copies by unit (each unit reads one feature, so the copies of a unit stay
   in bag order), count them per (unit, sample) into bag lengths;
4. all-to-all lengths, ids and weights: every rank receives its units' bags for every rank's
   samples, ``(source rank, unit, sample)``, and permutes them to the ``(unit, global sample)``
   layout TBE reads with a second bag permutation.

The bag permutations are fbgemm's ``permute_2D_sparse_data`` / ``permute_1D_sparse_data`` with
``sharding.kernel = "fbgemm"``, else :func:`permute_bags` (PyTorch operators, the same output).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed import ProcessGroup

from raydlrm.batch import KeyedJaggedTensor, lengths_to_offsets
from raydlrm.sharding._comm import CommBytes, all_gather_ints, all_to_all
from raydlrm.sharding._layout import LookupUnit

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
        lengths: ``(U_local * sum(batch_sizes),)`` bag lengths.
        values: ids, local to each unit's shard (row offset subtracted).
        weights: per-id weights or None.
        batch_sizes: samples of every rank.
    """

    lengths: torch.Tensor
    values: torch.Tensor
    weights: torch.Tensor | None
    batch_sizes: list[int]


class InputDistributor:
    """Routes the ids of a collection's features to the units of every rank.

    Args:
        units: every rank's units (from :func:`~raydlrm.sharding._layout.rank_units`).
        num_features: features of the collection (the KJT given to :meth:`__call__` holds
            exactly these, in collection order).
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
        num_features: int,
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
        flat = [u for us in units for u in us]
        index = {id(u): i for i, u in enumerate(flat)}
        self._stride = max(u.table.num_embeddings for u in flat) + 1 if flat else 1
        fanout, group_base, seg_keys, seg_units = [0] * num_features, [0] * num_features, [], []
        num_groups = 0
        for f in range(num_features):
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
            fanout[f], group_base[f] = len(groups), num_groups
            for group in groups:
                for u in group:
                    seg_keys.append(num_groups * self._stride + u.shard.row_start)
                    seg_units.append(index[id(u)])
                num_groups += 1

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        self._fanout, self._group_base = tensor(fanout), tensor(group_base)
        self._seg_keys, self._seg_units = tensor(seg_keys), tensor(seg_units)
        self._unit_row_start = tensor([u.shard.row_start for u in flat])
        self._unit_rank = tensor([u.shard.rank for u in flat])
        # Without row-split shards every unit reads all the ids of its feature: the send buffer
        # is the features' bags repeated and reordered unit by unit, one fbgemm permute.
        self._whole_rows = all(
            u.shard.row_start == 0 and u.shard.row_end == u.table.num_embeddings for u in flat
        )
        self._unit_feature = torch.tensor(
            [u.feature_index for u in flat], dtype=torch.int32, device=device
        )

    def _bucketize(
        self, kjt: KeyedJaggedTensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, list[int]]:
        """Send buffers: lengths ``(U_total * B,)`` rank-major, ids, weights, ids per rank."""
        if self._whole_rows:
            if self._fbgemm:
                lengths, values, weights = torch.ops.fbgemm.permute_2D_sparse_data(
                    self._unit_feature,
                    kjt.lengths.view(len(kjt.keys), kjt.batch_size),
                    kjt.values,
                    kjt.weights,
                    None,
                )
            else:
                batch = kjt.batch_size
                bags = self._unit_feature.to(torch.int64).unsqueeze(1) * batch + torch.arange(
                    batch, device=self._device
                )
                lengths, values, weights = permute_bags(
                    bags.reshape(-1), kjt.lengths, kjt.values, kjt.weights
                )
                lengths = lengths.view(self._unit_feature.numel(), batch)
            ids_per_unit = lengths.sum(dim=1)
            ids_per_rank = torch.zeros(
                len(self._num_units), dtype=ids_per_unit.dtype, device=self._device
            ).index_add_(0, self._unit_rank, ids_per_unit)
            return lengths.reshape(-1), values, weights, ids_per_rank.tolist()
        device, batch = self._device, kjt.batch_size
        num_ids = kjt.values.numel()
        num_bags = kjt.lengths.numel()
        bag = torch.repeat_interleave(
            torch.arange(num_bags, device=device), kjt.lengths, output_size=num_ids
        )
        feature, sample = bag // batch, bag % batch
        fanout = self._fanout[feature]
        num_copies = int(fanout.sum())
        source = torch.repeat_interleave(
            torch.arange(num_ids, device=device), fanout, output_size=num_copies
        )
        first_copy = torch.repeat_interleave(
            lengths_to_offsets(fanout)[:-1], fanout, output_size=num_copies
        )
        group = self._group_base[feature[source]] + (
            torch.arange(num_copies, device=device) - first_copy
        )
        ids = kjt.values[source].to(torch.int64)
        segment = torch.searchsorted(self._seg_keys, group * self._stride + ids, right=True) - 1
        unit, order = torch.sort(self._seg_units[segment], stable=True)
        values = ids[order] - self._unit_row_start[unit]
        source = source[order]
        weights = None if kjt.weights is None else kjt.weights[source]
        total_bags = sum(self._num_units) * batch
        lengths = torch.bincount(unit * batch + sample[source], minlength=total_bags)
        ids_per_rank = torch.bincount(self._unit_rank[unit], minlength=len(self._num_units))
        return lengths, values, weights, ids_per_rank.tolist()

    def _bag_permutation(self, batch_sizes: list[int]) -> torch.Tensor:
        """Bag index mapping ``(unit, global sample)`` order to the received
        ``(source rank, unit, sample)`` order, int32, shape ``(U_local * sum(B),)``."""
        device = self._device
        num_units = self._num_units[self._rank]
        sizes = torch.tensor(batch_sizes, dtype=torch.int64, device=device)
        total = int(sum(batch_sizes))
        starts = lengths_to_offsets(sizes)[:-1]
        source = torch.repeat_interleave(
            torch.arange(len(batch_sizes), device=device), sizes, output_size=total
        )
        sample = torch.arange(total, device=device) - starts[source]
        base = num_units * starts[source] + sample
        unit = torch.arange(num_units, device=device).unsqueeze(1)
        return (base.unsqueeze(0) + unit * sizes[source].unsqueeze(0)).reshape(-1).int()

    def __call__(self, kjt: KeyedJaggedTensor, *, pg: ProcessGroup | None = None) -> LocalBags:
        """Sends this rank's samples' ids to their units; returns this rank's units' bags.

        Args:
            kjt: shape ``(F, B, L[f][b])``, the collection's features in collection order,
                ids already checked against their tables.
            pg: the process group to exchange them on (default: the collection's; a
                pipeline's background thread passes its own).
        """
        lengths, values, weights, send_ids = self._bucketize(kjt)
        world_size = len(self._num_units)
        if world_size == 1:
            return LocalBags(lengths, values, weights, [kjt.batch_size])
        pg, local_units = pg or self._pg, self._num_units[self._rank]
        batch_sizes = all_gather_ints(kjt.batch_size, device=self._device, pg=pg)
        recv_bags = [local_units * b for b in batch_sizes]
        send_bags = [n * kjt.batch_size for n in self._num_units]
        sent_ids = sum(send_ids) - send_ids[self._rank]
        self._comm_bytes.add(
            "input", "lengths", (sum(send_bags) - send_bags[self._rank]) * lengths.element_size()
        )
        self._comm_bytes.add("input", "ids", sent_ids * values.element_size())
        if weights is not None:
            self._comm_bytes.add("input", "weights", sent_ids * weights.element_size())
        lengths = all_to_all(lengths, input_splits=send_bags, output_splits=recv_bags, pg=pg)
        recv_ids = torch.stack([x.sum() for x in lengths.split(recv_bags)]).tolist()
        values = all_to_all(values, input_splits=send_ids, output_splits=recv_ids, pg=pg)
        if weights is not None:
            weights = all_to_all(weights, input_splits=send_ids, output_splits=recv_ids, pg=pg)
        if self._fbgemm:
            lengths, values, weights = torch.ops.fbgemm.permute_1D_sparse_data(
                self._bag_permutation(batch_sizes), lengths, values, weights, values.numel()
            )
        else:
            lengths, values, weights = permute_bags(
                self._bag_permutation(batch_sizes).to(torch.int64),
                lengths,
                values,
                weights,
                num_values=values.numel(),
            )
        return LocalBags(lengths, values, weights, batch_sizes)
