"""Embedding kernels: fbgemm's table-batched embedding (TBE), or the same contract in PyTorch.

``sharding.kernel`` picks the kernel every rank's collection looks up and trains with:

- ``fbgemm``: fbgemm-gpu's ``SplitTableBatchedEmbeddingBagsCodegen`` (the fast path; needs the
  ``cpu`` or ``gpu`` extra, whose fbgemm release must match torch's, see
  :mod:`raydlrm._versions`);
- ``torch``: :class:`TorchTableBatchedEmbedding`, written with PyTorch operators only, so it
  runs wherever torch runs (any torch release raydlrm supports, CPU or CUDA, no fbgemm);
- ``auto``: fbgemm when it imports and matches torch, else torch with a one-line warning.

The contract both honour (what :class:`~raydlrm.sharding.embedding.ShardedEmbeddingBagCollection`,
its row cache and the checkpoint code use):

- many tables in one module; features map to tables (``feature_table_map``); a lookup takes the
  ids of every feature's bags (``indices``, feature-major, ``offsets`` of ``F * B + 1``) and
  optional per-id weights, and returns ``(B, sum of the features' dims)`` pooled by ``sum`` or
  ``mean``, in fp32 (fp16 weights are pooled in fp32);
- the optimizer is fused into the backward: the rows are updated there and no gradient is
  kept. Updates are *exact*: the gradients of an id that occurs several times in a batch (in
  one feature or in several features of the same table) are summed first and the row updated
  once. SGD ``w -= lr g``; Adagrad ``m += g^2``, ``w -= lr g / (sqrt(m) + eps)`` per element;
  row-wise Adagrad ``m += mean(g^2)`` per row, ``w -= lr g / (sqrt(m) + eps)``;
- fp16 weights keep their optimizer state in fp32; an updated row is computed in fp32 and
  rounded to fp16 (fbgemm rounds stochastically with its own generator, this kernel to
  nearest, so fp16 rows of the two kernels differ by up to one fp16 ulp per update);
- ``split_embedding_weights()``: a ``(rows, dim)`` view of each table; ``split_optimizer_states()``:
  per table ``[momentum]`` (``(rows,)`` row-wise Adagrad, ``(rows, dim)`` Adagrad), nothing for
  SGD. The layouts are the same, so checkpoints move between kernels;
- ``preallocated_host_buffers``: the flat weights (and Adagrad's flat state) may be given, e.g.
  mapped files (:mod:`raydlrm.sharding.tiers`).
"""

from __future__ import annotations

import functools
import itertools
import logging
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from raydlrm._versions import fbgemm_problem, import_fbgemm
from raydlrm.sharding.config import Kernel

__all__ = [
    "Kernel",
    "TableSpec",
    "TorchTableBatchedEmbedding",
    "build_tbe",
    "resolve_kernel",
]

logger = logging.getLogger(__name__)

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16}


@functools.cache
def _warn_fallback(problem: str) -> None:
    logger.warning("sharding.kernel 'auto': using the torch kernel (%s)", problem)


def resolve_kernel(kernel: Kernel) -> Literal["fbgemm", "torch"]:
    """The kernel ``sharding.kernel = kernel`` runs with on this machine.

    Raises:
        ImportError: ``fbgemm`` was asked for and fbgemm-gpu is missing, does not import, or
            does not match torch (the message says which and how to fix it).
    """
    if kernel == "torch":
        return "torch"
    problem = fbgemm_problem()
    if problem is None:
        return "fbgemm"
    if kernel == "fbgemm":
        import_fbgemm()  # raises with the full explanation
    _warn_fallback(problem)
    return "torch"


@dataclass(frozen=True)
class TableSpec:
    """One table of a TBE: ``rows`` x ``dim``."""

    rows: int
    dim: int


def build_tbe(
    kernel: Literal["fbgemm", "torch"],
    *,
    tables: list[TableSpec],
    feature_table_map: list[int],
    optimizer: str,
    learning_rate: float,
    eps: float,
    pooling: Literal["sum", "mean"],
    precision: Literal["fp32", "fp16"],
    device: torch.device,
    buffers: dict[str, torch.Tensor] | None = None,
) -> nn.Module:
    """A TBE of the resolved ``kernel`` (see the module docstring for the contract).

    Args:
        tables: the tables, in TBE order.
        feature_table_map: the table of each feature.
        optimizer: ``rowwise_adagrad``, ``adagrad`` or ``sgd``.
        pooling: ``sum`` or ``mean``.
        precision: the weights' precision.
        buffers: preallocated flat host buffers: ``weights`` and (Adagrad) ``momentum1``.
    """
    if kernel == "torch":
        return TorchTableBatchedEmbedding(
            tables=tables,
            feature_table_map=feature_table_map,
            optimizer=optimizer,
            learning_rate=learning_rate,
            eps=eps,
            pooling=pooling,
            dtype=_DTYPES[precision],
            device=device,
            buffers=buffers,
        )
    import_fbgemm()
    from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
        BoundsCheckMode,
        EmbeddingLocation,
        PoolingMode,
    )
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    if device.type == "cuda":
        location, compute = EmbeddingLocation.DEVICE, ComputeDevice.CUDA
    else:
        location, compute = EmbeddingLocation.HOST, ComputeDevice.CPU
    optimizers = {
        "rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        "adagrad": EmbOptimType.EXACT_ADAGRAD,
        "sgd": EmbOptimType.EXACT_SGD,
    }
    return SplitTableBatchedEmbeddingBagsCodegen(
        preallocated_host_buffers=buffers,
        embedding_specs=[(t.rows, t.dim, location, compute) for t in tables],
        feature_table_map=feature_table_map,
        optimizer=optimizers[optimizer],
        # fp16 tables: fbgemm keeps the optimizer state in fp32 and rounds each updated row to
        # fp16 (its stochastic_rounding default); the result does not depend on torch's seed,
        # so replicas and reruns agree bit for bit (the parity tests check).
        weights_precision=SparseType.FP16 if precision == "fp16" else SparseType.FP32,
        learning_rate=learning_rate,
        eps=eps,
        pooling_mode={"sum": PoolingMode.SUM, "mean": PoolingMode.MEAN}[pooling],
        # Ids are checked (and errors name the table) before the input all-to-all, so fbgemm's
        # own per-step bounds check would only repeat the work.
        bounds_check_mode=BoundsCheckMode.NONE,
        device=device,
    )


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


class TorchTableBatchedEmbedding(nn.Module):
    """fbgemm's TBE contract (see the module docstring) in PyTorch operators.

    The weights of all tables are one flat buffer, table after table (fbgemm's host layout);
    tables of equal dim next to each other form a *run*, looked up as one matrix. A lookup is
    one ``embedding_bag`` per segment of consecutive features in one run; its backward sums the
    gradient rows of each run's distinct ids and applies the optimizer to those rows.

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
    """

    def __init__(
        self,
        *,
        tables: list[TableSpec],
        feature_table_map: list[int],
        optimizer: str,
        learning_rate: float,
        eps: float,
        pooling: Literal["sum", "mean"],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        buffers: dict[str, torch.Tensor] | None = None,
    ):
        super().__init__()
        if optimizer not in ("rowwise_adagrad", "adagrad", "sgd"):
            raise ValueError(f"unknown embedding optimizer {optimizer!r}")
        if pooling not in ("sum", "mean"):
            raise ValueError(f"unknown pooling mode {pooling!r}")
        if any(not 0 <= t < len(tables) for t in feature_table_map):
            raise ValueError(f"feature_table_map {feature_table_map} names a table out of range")
        device = torch.device(device)
        self.tables = list(tables)
        self.feature_table_map = list(feature_table_map)
        self.optimizer, self.learning_rate, self.eps = optimizer, learning_rate, eps
        self.pooling = pooling
        buffers = buffers or {}
        numel = sum(t.rows * t.dim for t in tables)
        self.weights = self._storage(buffers.get("weights"), numel, dtype, device, "weights")
        num_rows = sum(t.rows for t in tables)
        if optimizer == "rowwise_adagrad":
            self.momentum = torch.zeros(num_rows, device=device)
        elif optimizer == "adagrad":
            self.momentum = self._storage(
                buffers.get("momentum1"), numel, torch.float32, device, "momentum1"
            )
        else:
            self.momentum = None

        self._runs: list[_Run] = []
        self._table_run: list[int] = []
        self._table_row_in_run: list[int] = []
        elem = row = 0
        for table in tables:
            if not self._runs or self._runs[-1].dim != table.dim:
                self._runs.append(_Run(table.dim, elem, row))
            run = self._runs[-1]
            self._table_run.append(len(self._runs) - 1)
            self._table_row_in_run.append(run.rows)
            run.rows += table.rows
            elem += table.rows * table.dim
            row += table.rows
        self._segments: list[_Segment] = []
        col = 0
        for f, t in enumerate(feature_table_map):
            run = self._table_run[t]
            last = self._segments[-1] if self._segments else None
            if last is not None and last.run == run and last.end_feature == f:
                self._segments[-1] = _Segment(run, last.first_feature, f + 1, last.col_start)
            else:
                self._segments.append(_Segment(run, f, f + 1, col))
            col += tables[t].dim
        self.output_dim = col
        # Row of each feature's table inside its run.
        self._feature_row_base = torch.tensor(
            [self._table_row_in_run[t] for t in feature_table_map], dtype=torch.int64, device=device
        )
        # Makes the lookup part of the autograd graph, so that its backward (the fused update)
        # runs; it never receives a gradient.
        self._anchor = torch.zeros((), device=device, requires_grad=True)

    @staticmethod
    def _storage(
        given: torch.Tensor | None, numel: int, dtype: torch.dtype, device: torch.device, name: str
    ) -> torch.Tensor:
        if given is None:
            return torch.zeros(numel, dtype=dtype, device=device)
        if given.numel() != numel or given.dtype != dtype or given.dim() != 1:
            raise ValueError(
                f"preallocated buffer {name!r}: expected {numel} {dtype} values (1-D), got "
                f"{tuple(given.shape)} {given.dtype}"
            )
        return given

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
        batch: int,
        ids_range: tuple[int, int],
        indices: torch.Tensor,
        offsets: torch.Tensor,
        per_sample_weights: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
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
                segment, batch, ids_range, indices, offsets, per_sample_weights
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
        batch = grad_output.shape[0]
        # Per run: its ids' rows, bag (into the run's stacked bag gradients), scale; the bags'
        # gradients.
        per_run: dict[int, list[list[torch.Tensor | None]]] = {}
        for segment, (rows, bag_offsets, weights) in zip(self._segments, inputs, strict=True):
            run = self._runs[segment.run]
            count = segment.end_feature - segment.first_feature
            grad = grad_output[:, segment.col_start : segment.col_start + count * run.dim]
            grad = grad.float().reshape(batch, count, run.dim).transpose(0, 1).reshape(-1, run.dim)
            lengths = bag_offsets.diff()
            parts = per_run.setdefault(segment.run, [[], [], [], []])
            first_bag = sum(g.shape[0] for g in parts[3])
            bag = torch.arange(first_bag, first_bag + lengths.numel(), device=lengths.device)
            bag = torch.repeat_interleave(bag, lengths, output_size=rows.numel())
            scale = weights
            if self.pooling == "mean":
                inverse = 1.0 / lengths.clamp(min=1).to(torch.float32)
                inverse = torch.repeat_interleave(inverse, lengths, output_size=rows.numel())
                scale = inverse if scale is None else scale * inverse
            for part, value in zip(parts, (rows, bag, scale, grad), strict=True):
                part.append(value)
        for index, (rows, bags, scales, grads) in per_run.items():
            self._apply(
                self._runs[index],
                torch.cat(rows),
                torch.cat(bags),
                _cat_scales(scales, rows),
                torch.cat(grads),
            )

    def _apply(
        self,
        run: _Run,
        rows: torch.Tensor,
        bags: torch.Tensor,
        scales: torch.Tensor | None,
        bag_grads: torch.Tensor,
    ) -> None:
        """Sums the gradients of each distinct row (``scales * bag_grads[bags]`` over its ids),
        then updates those rows once."""
        if rows.numel() == 0:
            return
        distinct, inverse = torch.unique(rows, return_inverse=True)
        per_id = bag_grads.index_select(0, bags)
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
