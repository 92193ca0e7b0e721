"""Embedding kernels: fbgemm's table-batched embedding (TBE), or the same contract in PyTorch.

``sharding.kernel`` picks the kernel every rank's collection looks up and trains with:

- ``fbgemm``: fbgemm-gpu's ``SplitTableBatchedEmbeddingBagsCodegen`` (the fast path; needs the
  ``cpu`` or ``gpu`` extra, whose fbgemm release must match torch's, see
  :mod:`raydlrm._versions`);
- ``torch``: :class:`~raydlrm.sharding.torch_tbe.TorchTableBatchedEmbedding`, written with
  PyTorch operators only, so it runs wherever torch runs (any torch release raydlrm supports,
  CPU or CUDA, no fbgemm);
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
  rounded to fp16 (fbgemm rounds stochastically with its own generator, the torch kernel to
  nearest, so fp16 rows of the two kernels differ by up to one fp16 ulp per update);
- ``split_embedding_weights()``: a ``(rows, dim)`` view of each table; ``split_optimizer_states()``:
  per table ``[momentum]`` (``(rows,)`` row-wise Adagrad, ``(rows, dim)`` Adagrad), nothing for
  SGD. The layouts are the same, so checkpoints move between kernels;
- ``preallocated_host_buffers``: the flat weights (and Adagrad's flat state) may be given, e.g.
  mapped files (:mod:`raydlrm.sharding.tiers`).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from raydlrm._versions import fbgemm_problem, import_fbgemm
from raydlrm.sharding.config import EmbeddingOptimizer, Kernel, WeightsPrecision
from raydlrm.sharding.torch_tbe import TableSpec, TorchTableBatchedEmbedding

__all__ = [
    "WEIGHT_DTYPES",
    "Kernel",
    "TableSpec",
    "build_tbe",
    "resolve_kernel",
]

logger = logging.getLogger(__name__)

WEIGHT_DTYPES: dict[WeightsPrecision, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16}
"""The torch dtype of the weights of each ``sharding.weights_precision``."""


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


def build_tbe(
    kernel: Literal["fbgemm", "torch"],
    *,
    tables: list[TableSpec],
    feature_table_map: list[int],
    optimizer: EmbeddingOptimizer,
    learning_rate: float,
    eps: float,
    pooling: Literal["sum", "mean"],
    precision: WeightsPrecision,
    device: torch.device,
    buffers: dict[str, torch.Tensor] | None = None,
) -> nn.Module:
    """A TBE of the resolved ``kernel`` (see the module docstring for the contract).

    Args:
        kernel: ``fbgemm`` or ``torch``, as :func:`resolve_kernel` resolved it.
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
            dtype=WEIGHT_DTYPES[precision],
            device=device,
            buffers=buffers,
        )
    import_fbgemm()
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    modes = _fbgemm_modes(device=device, optimizer=optimizer, precision=precision, pooling=pooling)
    return SplitTableBatchedEmbeddingBagsCodegen(
        preallocated_host_buffers=buffers,
        embedding_specs=[(t.rows, t.dim, modes.location, modes.compute) for t in tables],
        feature_table_map=feature_table_map,
        optimizer=modes.optimizer,
        weights_precision=modes.weights_precision,
        learning_rate=learning_rate,
        eps=eps,
        pooling_mode=modes.pooling,
        bounds_check_mode=modes.bounds_check,
        device=device,
    )


@dataclass(frozen=True)
class _FbgemmModes:
    """fbgemm's enum values for the settings of one TBE (typed ``object``: fbgemm is imported
    only when a TBE of it is built)."""

    location: object
    compute: object
    optimizer: object
    weights_precision: object
    pooling: object
    bounds_check: object


def _fbgemm_modes(
    *,
    device: torch.device,
    optimizer: EmbeddingOptimizer,
    precision: WeightsPrecision,
    pooling: Literal["sum", "mean"],
) -> _FbgemmModes:
    """The fbgemm enums of a TBE's device, optimizer, weights precision and pooling (fbgemm
    imports only after :func:`~raydlrm._versions.import_fbgemm` has checked it)."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
        BoundsCheckMode,
        EmbeddingLocation,
        PoolingMode,
    )
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import ComputeDevice

    cuda = device.type == "cuda"
    optimizers = {
        "rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        "adagrad": EmbOptimType.EXACT_ADAGRAD,
        "sgd": EmbOptimType.EXACT_SGD,
    }
    return _FbgemmModes(
        location=EmbeddingLocation.DEVICE if cuda else EmbeddingLocation.HOST,
        compute=ComputeDevice.CUDA if cuda else ComputeDevice.CPU,
        optimizer=optimizers[optimizer],
        # fp16 tables: fbgemm keeps the optimizer state in fp32 and rounds each updated row to
        # fp16 (its stochastic_rounding default); the result does not depend on torch's seed,
        # so replicas and reruns agree bit for bit (the parity tests check).
        weights_precision=SparseType.FP16 if precision == "fp16" else SparseType.FP32,
        pooling={"sum": PoolingMode.SUM, "mean": PoolingMode.MEAN}[pooling],
        # Ids are checked (and errors name the table) before the input all-to-all, so fbgemm's
        # own per-step bounds check would only repeat the work.
        bounds_check=BoundsCheckMode.NONE,
    )
