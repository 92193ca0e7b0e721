"""Building blocks the dense arches share: MLPs and DCNv2's low-rank cross layers."""

from __future__ import annotations

import itertools

import torch
from torch import nn

__all__ = ["CrossNet", "mlp"]


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
