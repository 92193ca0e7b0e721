"""Wukong (Zhang et al., 2024, "Wukong: Towards a Scaling Law for Large-Scale Recommendation"):
stacked factorization machines, written unsharded (the dense side of a :class:`RecModel`).

The dense features go through the bottom MLP, whose output is cut into ``embedding_dim``-wide
vectors: with the pooled embeddings, ``n`` vectors of dimension ``D`` per sample, ``X_0`` of
shape ``n x D``. Each of the ``L`` Wukong layers maps ``X_i`` (``n_i x D``) to ``X_{i+1}``
(``(n_F + n_L) x D``)::

    X_{i+1} = LayerNorm(concat(FMB(X_i), LCB(X_i)) + residual(X_i))

- the factorization machine block, ``FMB(X) = reshape(MLP(LayerNorm(flatten(X (X^T Y)))))``:
  the pairwise dot products of the vectors, ``X X^T``, projected to rank ``k`` by a learned
  ``Y`` (``n_i x k``) so that it costs ``O(n k D)`` rather than ``O(n^2 D)``, then an MLP to
  ``n_F`` vectors;
- the linear compress block, ``LCB(X) = W X``: ``n_L`` learned linear combinations of the
  vectors;
- the residual is ``X_i`` itself when ``n_i = n_F + n_L``, else a learned linear map of its
  vectors to ``n_F + n_L`` (the paper's projection).

The top MLP maps the flattened last ``X_L`` to the logit. Stacking layers raises the order of
the interactions captured (layer ``i`` reaches order ``2^i``), which is what the paper scales.
"""

from __future__ import annotations

import torch
from torch import nn

from raydlrm.models.layers import FeatureVectors, LinearCompressBlock, VectorStack, mlp

__all__ = ["FactorizationMachineBlock", "WukongDense", "WukongLayer"]


class FactorizationMachineBlock(nn.Module):
    """Low-rank pairwise interactions of ``n_in`` vectors, then an MLP to ``n_out`` vectors.

    Args:
        n_in: vectors in.
        n_out: vectors out (``n_F``).
        dim: their dimension ``D``.
        rank: ``k``, the rank of the projection of ``X X^T``.
        hidden: the MLP's hidden sizes.
    """

    def __init__(self, *, n_in: int, n_out: int, dim: int, rank: int, hidden: list[int]):
        super().__init__()
        self.n_out, self.dim = n_out, dim
        self.projection = nn.Parameter(torch.empty(n_in, rank))
        nn.init.xavier_uniform_(self.projection)
        self.norm = nn.LayerNorm(n_in * rank)
        self.mlp = mlp([n_in * rank, *hidden, n_out * dim], final_activation=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # X (X^T Y): (B, n, D) x ((B, D, n) x (n, k)) -> (B, n, k), without forming X X^T.
        compressed = torch.einsum("bnd,nk->bdk", x, self.projection)
        interactions = torch.bmm(x, compressed)
        out = self.mlp(self.norm(interactions.flatten(1)))
        return out.view(-1, self.n_out, self.dim)


class WukongLayer(nn.Module):
    """One Wukong layer: ``(B, n_in, D) -> (B, n_F + n_L, D)`` (see the module docstring)."""

    def __init__(
        self, *, n_in: int, dim: int, num_fm: int, num_lc: int, rank: int, fm_mlp: list[int]
    ):
        super().__init__()
        n_out = num_fm + num_lc
        self.fmb = FactorizationMachineBlock(
            n_in=n_in, n_out=num_fm, dim=dim, rank=rank, hidden=fm_mlp
        )
        self.lcb = LinearCompressBlock(n_in, n_out=num_lc)
        self.residual = None if n_in == n_out else LinearCompressBlock(n_in, n_out=n_out)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x if self.residual is None else self.residual(x)
        return self.norm(torch.cat([self.fmb(x), self.lcb(x)], dim=1) + shortcut)


class WukongDense(VectorStack):
    """The dense side of Wukong: bottom MLP to ``bottom_mlp[-1] / D`` vectors, the pooled
    embeddings as ``F`` more, ``num_layers`` Wukong layers, top MLP.

    Args:
        num_dense: dense input features.
        num_sparse: ``F``, pooled embeddings per sample.
        embedding_dim: ``D``; ``bottom_mlp[-1]`` must be a multiple of it.
        bottom_mlp: bottom MLP sizes (without the input size).
        top_mlp: top MLP hidden sizes (a 1-unit logit layer is appended).
        num_layers: Wukong layers ``L``.
        num_fm: ``n_F``, vectors out of each factorization machine block.
        num_lc: ``n_L``, vectors out of each linear compress block.
        rank: ``k``, rank of the factorization machine's projection.
        fm_mlp: hidden sizes of the factorization machine block's MLP.
    """

    def __init__(
        self,
        *,
        num_dense: int,
        num_sparse: int,
        embedding_dim: int,
        bottom_mlp: list[int],
        top_mlp: list[int],
        num_layers: int,
        num_fm: int,
        num_lc: int,
        rank: int,
        fm_mlp: list[int],
    ):
        vectors = FeatureVectors(
            num_dense=num_dense, num_sparse=num_sparse, dim=embedding_dim, bottom_mlp=bottom_mlp
        )
        layers: list[nn.Module] = []
        n = vectors.count
        for _ in range(num_layers):
            layers.append(
                WukongLayer(
                    n_in=n,
                    dim=embedding_dim,
                    num_fm=num_fm,
                    num_lc=num_lc,
                    rank=rank,
                    fm_mlp=fm_mlp,
                )
            )
            n = num_fm + num_lc
        super().__init__(
            vectors,
            layers=layers,
            top=mlp([n * embedding_dim, *top_mlp, 1], final_activation=False),
        )
