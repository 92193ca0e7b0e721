"""Building blocks the dense arches share: MLPs, DCNv2's low-rank cross layers, and the
vectors Wukong and DHEN interact."""

from __future__ import annotations

import itertools

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
