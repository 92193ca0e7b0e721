"""The PyTorch embedding kernel (``sharding.kernel = "torch"``): fbgemm's TBE contract (see
:mod:`raydlrm.sharding.kernel`) written with PyTorch operators only, for any device and any
torch release raydlrm supports.

The weights of all tables are one flat buffer, table after table (fbgemm's host layout), so
checkpoints and preallocated (mapped) buffers are shared with fbgemm. Tables of equal dim next
to each other form a *run*, looked up as one ``(rows, dim)`` matrix; features next to each other
whose tables are in one run form a *segment*, pooled by one ``embedding_bag``. The optimizer is
fused into the backward of an autograd function: it sums the gradient rows of each run's distinct
ids and updates those rows once.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from raydlrm.sharding.config import EmbeddingOptimizer

__all__ = ["TableSpec", "TorchTableBatchedEmbedding"]


@dataclass(frozen=True)
class TableSpec:
    """One table of a TBE (of either kernel): ``rows`` x ``dim``."""

    rows: int
    dim: int


@dataclass
class _Run:
    """Consecutive tables of one dim, stored back to back: one ``(rows, dim)`` matrix."""

    dim: int
    elem_start: int  # of the run in the flat weights
    row_start: int  # of the run in the flat per-row state
    rows: int = 0


# A segment's ids as rows of its run's matrix, its bags' offsets (from 0), its per-id weights.
_SegmentInputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


@dataclass(frozen=True)
class _Segment:
    """Consecutive features whose tables are in one run: one pooled lookup."""

    run: int
    first_feature: int
    end_feature: int
    col_start: int  # of the segment's output columns


@dataclass(frozen=True)
class _Layout:
    """Where the tables' rows and the features' output columns are."""

    runs: list[_Run]
    segments: list[_Segment]
    feature_row_base: list[int]
    """Row of each feature's table inside its run."""
    output_dim: int
    """Columns of a lookup's output: the sum of the features' dims."""


@dataclass
class _RunGrads:
    """One run's share of a lookup's backward, a part per segment in the run."""

    rows: list[torch.Tensor] = field(default_factory=list)
    """The segment's ids as rows of the run's matrix."""
    bags: list[torch.Tensor] = field(default_factory=list)
    """The bag of each id, counted over the run's stacked bag gradients."""
    scales: list[torch.Tensor | None] = field(default_factory=list)
    """Each id's gradient scale (its per-sample weight, over the bag's length for ``mean``);
    None: all 1."""
    grads: list[torch.Tensor] = field(default_factory=list)
    """The gradients of the segment's bags, ``(bags, dim)``."""

    @property
    def num_bags(self) -> int:
        """Bags of the parts so far."""
        return sum(g.shape[0] for g in self.grads)


class TorchTableBatchedEmbedding(nn.Module):
    """fbgemm's TBE contract (see :mod:`raydlrm.sharding.kernel`) in PyTorch operators.

    A lookup is one ``embedding_bag`` per segment of consecutive features in one run (see the
    module docstring); its backward applies the optimizer to the rows it read.

    Args:
        tables: the tables, in order.
        feature_table_map: the table of each feature.
        optimizer: ``rowwise_adagrad``, ``adagrad`` or ``sgd``.
        learning_rate: the optimizer's learning rate.
        eps: (row-wise) Adagrad's epsilon.
        pooling: ``sum`` or ``mean`` (divided by the bag's length; empty bags pool to zeros).
        dtype: the weights' dtype (fp32 or fp16; optimizer state is fp32).
        device: where the weights and state live.
        buffers: preallocated flat ``weights`` (and, for Adagrad, ``momentum1``) to use as
            storage, e.g. mapped files; their contents are kept.

    Raises:
        ValueError: ``feature_table_map`` names a table out of range, or a preallocated buffer
            has the wrong size or dtype.
    """

    def __init__(
        self,
        *,
        tables: list[TableSpec],
        feature_table_map: list[int],
        optimizer: EmbeddingOptimizer,
        learning_rate: float,
        eps: float,
        pooling: Literal["sum", "mean"],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        buffers: dict[str, torch.Tensor] | None = None,
    ):
        super().__init__()
        if any(not 0 <= t < len(tables) for t in feature_table_map):
            raise ValueError(f"feature_table_map {feature_table_map} names a table out of range")
        device = torch.device(device)
        self.tables = list(tables)
        self.feature_table_map = list(feature_table_map)
        self.optimizer, self.learning_rate, self.eps = optimizer, learning_rate, eps
        self.pooling = pooling
        buffers = buffers or {}
        numel = sum(t.rows * t.dim for t in tables)
        self.weights = _storage(
            buffers.get("weights"), numel=numel, dtype=dtype, device=device, name="weights"
        )
        if optimizer == "rowwise_adagrad":
            self.momentum = torch.zeros(sum(t.rows for t in tables), device=device)
        elif optimizer == "adagrad":
            self.momentum = _storage(
                buffers.get("momentum1"),
                numel=numel,
                dtype=torch.float32,
                device=device,
                name="momentum1",
            )
        else:  # SGD keeps no state
            self.momentum = None
        layout = _layout(self.tables, feature_table_map=self.feature_table_map)
        self._runs, self._segments = layout.runs, layout.segments
        self.output_dim = layout.output_dim
        self._feature_row_base = torch.tensor(
            layout.feature_row_base, dtype=torch.int64, device=device
        )
        # Makes the lookup part of the autograd graph, so that its backward (the fused update)
        # runs; it never receives a gradient.
        self._anchor = torch.zeros((), device=device, requires_grad=True)

    def _run_matrix(self, run: _Run) -> torch.Tensor:
        return self.weights[run.elem_start : run.elem_start + run.rows * run.dim].view(
            run.rows, run.dim
        )

    def split_embedding_weights(self) -> list[torch.Tensor]:
        """A ``(rows, dim)`` view of each table's weights."""
        views, start = [], 0
        for t in self.tables:
            views.append(self.weights[start : start + t.rows * t.dim].view(t.rows, t.dim))
            start += t.rows * t.dim
        return views

    def split_optimizer_states(self) -> list[list[torch.Tensor]]:
        """Per table ``[momentum]`` (views): ``(rows,)`` row-wise Adagrad, ``(rows, dim)``
        Adagrad; an empty list for SGD."""
        if self.momentum is None:
            return []
        states, elem, row = [], 0, 0
        for t in self.tables:
            if self.optimizer == "rowwise_adagrad":
                states.append([self.momentum[row : row + t.rows]])
            else:
                states.append([self.momentum[elem : elem + t.rows * t.dim].view(t.rows, t.dim)])
            elem += t.rows * t.dim
            row += t.rows
        return states

    def forward(
        self,
        indices: torch.Tensor,
        offsets: torch.Tensor,
        per_sample_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Pooled lookups ``(B, output_dim)`` of ``F * B`` bags (feature-major ``offsets``)."""
        num_features = len(self.feature_table_map)
        if (offsets.numel() - 1) % max(num_features, 1):
            raise ValueError(
                f"offsets of {offsets.numel() - 1} bags do not hold {num_features} features' bags"
            )
        return _FusedLookup.apply(self._anchor, self, indices, offsets, per_sample_weights)

    def _id_ranges(self, offsets: torch.Tensor, batch: int) -> list[tuple[int, int]]:
        """Each segment's range of ids, read from ``offsets`` in one transfer (on a GPU, one
        synchronization per lookup rather than one per segment)."""
        bounds = [s.first_feature * batch for s in self._segments]
        bounds.append(self._segments[-1].end_feature * batch if self._segments else 0)
        at = offsets[torch.tensor(bounds, device=offsets.device)].tolist()
        # The segments split the features in order: one ends where the next starts.
        return list(itertools.pairwise(at))

    def _segment_inputs(
        self,
        segment: _Segment,
        *,
        batch: int,
        ids_range: tuple[int, int],
        indices: torch.Tensor,
        offsets: torch.Tensor,
        per_sample_weights: torch.Tensor | None,
    ) -> _SegmentInputs:
        """Rows in the run's matrix of the segment's ids, their bags' offsets (from 0) and
        weights."""
        first, end = segment.first_feature * batch, segment.end_feature * batch
        bag_offsets = offsets[first : end + 1]
        lo, hi = ids_range
        ids = indices[lo:hi].to(torch.int64)
        feature_ids = bag_offsets[::batch].diff()
        base = torch.repeat_interleave(
            self._feature_row_base[segment.first_feature : segment.end_feature],
            feature_ids,
            output_size=hi - lo,
        )
        weights = None if per_sample_weights is None else per_sample_weights[lo:hi].float()
        return ids + base, (bag_offsets - lo).to(torch.int64), weights

    def lookup(
        self, indices: torch.Tensor, offsets: torch.Tensor, per_sample_weights: torch.Tensor | None
    ) -> tuple[torch.Tensor, list[_SegmentInputs]]:
        """The forward pass without autograd: the pooled output and each segment's inputs
        (which the backward's update reuses rather than derives again)."""
        num_features = len(self.feature_table_map)
        batch = (offsets.numel() - 1) // max(num_features, 1)
        out = torch.empty(batch, self.output_dim, device=self.weights.device)
        if batch == 0:
            return out, []
        inputs = []
        ranges = self._id_ranges(offsets, batch)
        for segment, ids_range in zip(self._segments, ranges, strict=True):
            run = self._runs[segment.run]
            rows, bag_offsets, weights = self._segment_inputs(
                segment,
                batch=batch,
                ids_range=ids_range,
                indices=indices,
                offsets=offsets,
                per_sample_weights=per_sample_weights,
            )
            inputs.append((rows, bag_offsets, weights))
            matrix = self._run_matrix(run)
            if matrix.dtype != torch.float32:  # pool in fp32: gather the distinct rows first
                distinct, rows = torch.unique(rows, return_inverse=True)
                matrix = matrix.index_select(0, distinct).float()
            pooled = F.embedding_bag(
                rows,
                matrix,
                bag_offsets,
                mode="sum",
                per_sample_weights=weights,
                include_last_offset=True,
            )
            if self.pooling == "mean":  # (weighted) sum over the bag's length, as fbgemm does
                pooled = pooled / bag_offsets.diff().clamp(min=1).unsqueeze(1).to(pooled.dtype)
            count = segment.end_feature - segment.first_feature
            out[:, segment.col_start : segment.col_start + count * run.dim] = (
                pooled.view(count, batch, run.dim).transpose(0, 1).reshape(batch, count * run.dim)
            )
        return out, inputs

    @torch.no_grad()
    def update(self, grad_output: torch.Tensor, inputs: list[_SegmentInputs]) -> None:
        """The fused optimizer step for the output gradient ``grad_output`` ``(B, output_dim)``
        of a lookup whose segments' inputs were ``inputs``."""
        if not inputs:  # a batch of no samples
            return
        per_run: dict[int, _RunGrads] = {}
        for segment, segment_inputs in zip(self._segments, inputs, strict=True):
            self._add_segment(
                per_run.setdefault(segment.run, _RunGrads()),
                segment=segment,
                grad_output=grad_output,
                inputs=segment_inputs,
            )
        for index, grads in per_run.items():
            self._apply(self._runs[index], grads=grads)

    def _add_segment(
        self,
        run_grads: _RunGrads,
        *,
        segment: _Segment,
        grad_output: torch.Tensor,
        inputs: _SegmentInputs,
    ) -> None:
        """Adds ``segment``'s ids, their bags, their scales and the bags' gradients (its columns
        of ``grad_output``) to its run's ``run_grads``."""
        rows, bag_offsets, weights = inputs
        batch = grad_output.shape[0]
        run = self._runs[segment.run]
        count = segment.end_feature - segment.first_feature
        grad = grad_output[:, segment.col_start : segment.col_start + count * run.dim]
        grad = grad.float().reshape(batch, count, run.dim).transpose(0, 1).reshape(-1, run.dim)
        lengths = bag_offsets.diff()
        first_bag = run_grads.num_bags
        bag = torch.arange(first_bag, first_bag + lengths.numel(), device=lengths.device)
        bag = torch.repeat_interleave(bag, lengths, output_size=rows.numel())
        scale = weights
        if self.pooling == "mean":
            inverse = 1.0 / lengths.clamp(min=1).to(torch.float32)
            inverse = torch.repeat_interleave(inverse, lengths, output_size=rows.numel())
            scale = inverse if scale is None else scale * inverse
        run_grads.rows.append(rows)
        run_grads.bags.append(bag)
        run_grads.scales.append(scale)
        run_grads.grads.append(grad)

    def _apply(self, run: _Run, *, grads: _RunGrads) -> None:
        """Sums the gradients of each distinct row of ``run`` (each id's scale times its bag's
        gradient), then updates those rows once."""
        rows = torch.cat(grads.rows)
        if rows.numel() == 0:
            return
        distinct, inverse = torch.unique(rows, return_inverse=True)
        per_id = torch.cat(grads.grads).index_select(0, torch.cat(grads.bags))
        scales = _cat_scales(grads.scales, grads.rows)
        if scales is not None:
            per_id.mul_(scales.unsqueeze(1))
        grad = torch.zeros(distinct.numel(), run.dim, device=rows.device)
        grad.index_add_(0, inverse, per_id)
        matrix = self._run_matrix(run)
        if self.optimizer == "sgd":
            step = grad.mul_(self.learning_rate)
        elif self.optimizer == "rowwise_adagrad":
            state = self.momentum[run.row_start : run.row_start + run.rows]
            total = state[distinct] + grad.square().mean(dim=1)
            state[distinct] = total
            step = grad.mul_((self.learning_rate / (total.sqrt() + self.eps)).unsqueeze(1))
        else:
            state = self.momentum[run.elem_start : run.elem_start + run.rows * run.dim].view(
                run.rows, run.dim
            )
            total = state.index_select(0, distinct).add_(grad.square())
            state.index_copy_(0, distinct, total)
            step = grad.mul_(self.learning_rate).div_(total.sqrt_().add_(self.eps))
        # (index_select / index_add_ / index_copy_: advanced indexing of a large matrix was
        # several times slower here.)
        if matrix.dtype == torch.float32:  # w + (-s) == w - s exactly: update in place
            matrix.index_add_(0, distinct, step.neg_())
        else:  # computed in fp32, rounded once
            updated = matrix.index_select(0, distinct).float().sub_(step)
            matrix.index_copy_(0, distinct, updated.to(matrix.dtype))


def _storage(
    given: torch.Tensor | None,
    *,
    numel: int,
    dtype: torch.dtype,
    device: torch.device,
    name: str,
) -> torch.Tensor:
    """``given`` (the preallocated buffer ``name``) checked against ``numel`` values of
    ``dtype``, or zeros on ``device`` when None."""
    if given is None:
        return torch.zeros(numel, dtype=dtype, device=device)
    if given.numel() != numel or given.dtype != dtype or given.dim() != 1:
        raise ValueError(
            f"preallocated buffer {name!r}: expected {numel} {dtype} values (1-D), got "
            f"{tuple(given.shape)} {given.dtype}"
        )
    return given


def _layout(tables: list[TableSpec], *, feature_table_map: list[int]) -> _Layout:
    """The runs of ``tables`` and the segments of the features that look them up."""
    runs: list[_Run] = []
    table_run, table_row_in_run = [], []
    elem = row = 0
    for table in tables:
        if not runs or runs[-1].dim != table.dim:
            runs.append(_Run(table.dim, elem, row))
        table_run.append(len(runs) - 1)
        table_row_in_run.append(runs[-1].rows)
        runs[-1].rows += table.rows
        elem += table.rows * table.dim
        row += table.rows
    segments: list[_Segment] = []
    col = 0
    for f, t in enumerate(feature_table_map):
        run = table_run[t]
        last = segments[-1] if segments else None
        if last is not None and last.run == run and last.end_feature == f:
            segments[-1] = _Segment(run, last.first_feature, f + 1, last.col_start)
        else:
            segments.append(_Segment(run, f, f + 1, col))
        col += tables[t].dim
    return _Layout(
        runs=runs,
        segments=segments,
        feature_row_base=[table_row_in_run[t] for t in feature_table_map],
        output_dim=col,
    )


def _cat_scales(scales: list[torch.Tensor | None], rows: list[torch.Tensor]) -> torch.Tensor | None:
    """The ids' gradient scales of a run's segments, one tensor; None when all are 1."""
    if all(s is None for s in scales):
        return None
    return torch.cat(
        [
            torch.ones(r.numel(), device=r.device) if s is None else s
            for s, r in zip(scales, rows, strict=True)
        ]
    )


class _FusedLookup(torch.autograd.Function):
    """Pooled lookup whose backward applies the fused optimizer (and returns no gradient)."""

    @staticmethod
    def forward(ctx, anchor, tbe, indices, offsets, per_sample_weights):
        out, ctx.inputs = tbe.lookup(indices, offsets, per_sample_weights)
        ctx.tbe = tbe
        return out

    @staticmethod
    def backward(ctx, grad_output):
        ctx.tbe.update(grad_output, ctx.inputs)
        ctx.inputs = None
        return None, None, None, None, None
