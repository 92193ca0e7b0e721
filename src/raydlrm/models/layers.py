"""Building blocks the dense arches share: MLPs, DCNv2's low-rank cross layers, the linear
compress block (Wukong, DHEN) and the stack of layers over embedding-wide vectors that Wukong and
DHEN are built from; and how they run in a lower precision (:func:`autocast_fp32`)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = [
    "CrossNet",
    "FeatureVectors",
    "LinearCompressBlock",
    "VectorStack",
    "autocast_fp32",
    "mlp",
]


def autocast_fp32(
    dtype: torch.dtype | None, device_type: str, fn: Callable[..., torch.Tensor], *args: Any
) -> torch.Tensor:
    """``fn(*args)`` autocast to ``dtype`` (``training.precision``) on ``device_type``, its
    result back in fp32; None: ``fn(*args)`` as it is (fp32)."""
    if dtype is None:
        return fn(*args)
    with torch.autocast(device_type, dtype=dtype):
        return fn(*args).float()


def mlp(sizes: list[int], *, final_activation: bool) -> nn.Sequential:
    """Linear layers of ``sizes[i] -> sizes[i+1]`` with ReLU between them (and after the last
    one when ``final_activation``)."""
    layers: list[nn.Module] = []
    for i, (n_in, n_out) in enumerate(itertools.pairwise(sizes)):
        layers.append(nn.Linear(n_in, n_out))
        if final_activation or i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class CrossNet(nn.Module):
    """Low-rank cross layers (DCNv2): ``x_{l+1} = x_0 * (U_l (V_l x_l) + b_l) + x_l``.

    Args:
        in_features: width of ``x_0``.
        num_layers: cross layers.
        low_rank: rank of each layer's ``U_l V_l`` factorization.
    """

    def __init__(self, *, in_features: int, num_layers: int, low_rank: int):
        super().__init__()
        self.down = nn.ModuleList(
            nn.Linear(in_features, low_rank, bias=False) for _ in range(num_layers)
        )
        self.up = nn.ModuleList(nn.Linear(low_rank, in_features) for _ in range(num_layers))

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        x = x0
        for down, up in zip(self.down, self.up, strict=True):
            x = x0 * up(down(x)) + x
        return x


class LinearCompressBlock(nn.Module):
    """``n_out`` learned linear combinations of ``n_in`` vectors: ``(B, n_in, D) -> (B, n_out,
    D)``."""

    def __init__(self, n_in: int, *, n_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_out, n_in))
        nn.init.xavier_uniform_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("on,bnd->bod", self.weight, x)


class FeatureVectors(nn.Module):
    """The dense features through the bottom MLP, cut into ``dim``-wide vectors, then the
    pooled embeddings: ``(B, n, dim)`` with ``n = bottom_mlp[-1] / dim + num_sparse``.

    Args:
        num_dense: dense input features.
        num_sparse: ``F``, pooled embeddings per sample.
        dim: ``D``; ``bottom_mlp[-1]`` must be a multiple of it (``ModelConfig`` checks it).
        bottom_mlp: bottom MLP sizes (without the input size).
    """

    def __init__(self, *, num_dense: int, num_sparse: int, dim: int, bottom_mlp: list[int]):
        super().__init__()
        self.dim = dim
        self.count = bottom_mlp[-1] // dim + num_sparse
        self.bottom = mlp([num_dense, *bottom_mlp], final_activation=True)

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        vectors = torch.cat([self.bottom(dense), pooled], dim=1)
        return vectors.view(dense.shape[0], self.count, self.dim)


class VectorStack(nn.Module):
    """The dense side of the models that interact embedding-wide vectors (Wukong, DHEN): the
    :class:`FeatureVectors` (``n`` of them), a stack of layers, each ``(B, n_i, D) -> (B,
    n_{i+1}, D)``, and a top MLP on the flattened last vectors to the logit.

    The caller creates the parts in this order (vectors, layers, top), which is the order a
    seeded initialization draws their weights in.

    Args:
        vectors: the input vectors.
        layers: the stack, applied in order.
        top: the top MLP, from the flattened last ``n_L * D`` to one logit.
    """

    def __init__(self, vectors: FeatureVectors, *, layers: list[nn.Module], top: nn.Module):
        super().__init__()
        self.vectors = vectors
        self.layers = nn.Sequential(*layers)
        self.top = top

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        """Logits of shape ``(B,)`` from dense ``B x num_dense`` and pooled ``B x (F * D)``."""
        return self.top(self.layers(self.vectors(dense, pooled)).flatten(1)).squeeze(1)
