"""Building blocks the dense arches share: MLPs, DCNv2's low-rank cross layers, and the
vectors Wukong and DHEN interact."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
from torch import nn

__all__ = ["CrossNet", "FeatureVectors", "mlp"]


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


class FeatureVectors(nn.Module):
    """The dense features through the bottom MLP, cut into ``dim``-wide vectors, then the
    pooled embeddings: ``(B, n, dim)`` with ``n = bottom_mlp[-1] / dim + num_sparse``.

    Raises:
        ValueError: ``bottom_mlp[-1]`` is not a multiple of ``dim`` (naming ``model``, the arch).
    """

    def __init__(
        self, *, model: str, num_dense: int, num_sparse: int, dim: int, bottom_mlp: list[int]
    ):
        super().__init__()
        if bottom_mlp[-1] % dim:
            raise ValueError(
                f"{model}'s bottom MLP must end at a multiple of embedding_dim={dim}, "
                f"got {bottom_mlp}"
            )
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

    Args:
        model: the arch's name (for errors).
        num_dense: dense input features.
        num_sparse: ``F``, pooled embeddings per sample.
        embedding_dim: ``D``; ``bottom_mlp[-1]`` must be a multiple of it.
        bottom_mlp: bottom MLP sizes (without the input size).
        top_mlp: top MLP hidden sizes (a 1-unit logit layer is appended).
        make_layers: the vectors' count ``n`` -> the layers and the count they end with.
    """

    def __init__(
        self,
        *,
        model: str,
        num_dense: int,
        num_sparse: int,
        embedding_dim: int,
        bottom_mlp: list[int],
        top_mlp: list[int],
        make_layers: Callable[[int], tuple[list[nn.Module], int]],
    ):
        super().__init__()
        self.vectors = FeatureVectors(
            model=model,
            num_dense=num_dense,
            num_sparse=num_sparse,
            dim=embedding_dim,
            bottom_mlp=bottom_mlp,
        )
        layers, count = make_layers(self.vectors.count)
        self.layers = nn.Sequential(*layers)
        self.top = mlp([count * embedding_dim, *top_mlp, 1], final_activation=False)

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        """Logits of shape ``(B,)`` from dense ``B x num_dense`` and pooled ``B x (F * D)``."""
        return self.top(self.layers(self.vectors(dense, pooled)).flatten(1)).squeeze(1)
