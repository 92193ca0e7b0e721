"""DHEN (Zhang et al., 2022, "DHEN: A Deep and Hierarchical Ensemble Network for Large-Scale
Click-Through Rate Prediction"), written unsharded (the dense side of a :class:`RecModel`).

As in Wukong, the bottom MLP's output is cut into ``embedding_dim``-wide vectors and joins the
pooled embeddings: ``X_0`` of shape ``n x D`` per sample. Each DHEN layer runs an ensemble of
interaction modules on ``X_i``, each returning ``n x D``, and keeps the shape::

    X_{i+1} = LayerNorm(Ensemble(M_1(X_i), ..., M_m(X_i)) + X_i)

with ``Ensemble`` the sum of the modules' outputs (``sum``) or their concatenation along the
vector axis followed by a learned linear map back to ``n`` vectors (``concat``). Stacking layers
makes the ensemble hierarchical: layer ``i + 1``'s modules interact the outputs of all of layer
``i``'s. The modules (``model.dhen_layers`` names each layer's):

- ``dot``: the pairwise dot products of the vectors (DLRM's interaction, the upper triangle with
  the diagonal), mapped linearly to ``n x D``;
- ``cross``: one low-rank DCNv2 cross layer over the flattened vectors (rank
  ``model.dcn_low_rank``);
- ``attention``: multi-head self-attention over the vectors (``model.dhen_attention_heads``);
- ``linear``: a linear map of the flattened vectors;
- ``conv``: a 1-D convolution along the embedding dimension, the vectors as channels (kernel 3).

The top MLP maps the flattened last ``X_L`` to the logit.
"""

from __future__ import annotations

import torch
from torch import nn

from raydlrm.models.config import DhenModule
from raydlrm.models.layers import CrossNet, FeatureVectors, LinearCompressBlock, VectorStack, mlp

__all__ = ["DHENDense", "DHENLayer"]


class _Dot(nn.Module):
    def __init__(self, n: int, dim: int, **_):
        super().__init__()
        rows, cols = torch.triu_indices(n, n)
        self.register_buffer("_triu", rows * n + cols, persistent=False)  # flat positions
        self.out = nn.Linear(rows.numel(), n * dim)
        self.n, self.dim = n, dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dots = torch.bmm(x, x.transpose(1, 2)).flatten(1).index_select(1, self._triu)
        return self.out(dots).view(-1, self.n, self.dim)


class _Cross(nn.Module):
    def __init__(self, n: int, dim: int, *, low_rank: int, **_):
        super().__init__()
        self.cross = CrossNet(in_features=n * dim, num_layers=1, low_rank=low_rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.cross(x.flatten(1)).view_as(x)


class _Attention(nn.Module):
    def __init__(self, n: int, dim: int, *, heads: int, **_):
        super().__init__()
        self.attention = nn.MultiheadAttention(dim, heads, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attention(x, x, x, need_weights=False)[0]


class _Linear(nn.Module):
    def __init__(self, n: int, dim: int, **_):
        super().__init__()
        self.linear = nn.Linear(n * dim, n * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.flatten(1)).view_as(x)


class _Conv(nn.Module):
    def __init__(self, n: int, dim: int, **_):
        super().__init__()
        self.conv = nn.Conv1d(n, n, kernel_size=3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


_MODULE_CLASSES: dict[DhenModule, type[nn.Module]] = {
    "dot": _Dot,
    "cross": _Cross,
    "attention": _Attention,
    "linear": _Linear,
    "conv": _Conv,
}


class DHENLayer(nn.Module):
    """One DHEN layer over ``n`` vectors of dimension ``dim`` (see the module docstring).

    Args:
        n: vectors per sample.
        dim: their dimension.
        modules: the ensemble's module names.
        ensemble: ``concat`` or ``sum``.
        low_rank: rank of the ``cross`` module.
        heads: attention heads of the ``attention`` module.
    """

    def __init__(
        self,
        *,
        n: int,
        dim: int,
        modules: list[DhenModule],
        ensemble: str,
        low_rank: int,
        heads: int,
    ):
        super().__init__()
        self.blocks = nn.ModuleList(
            _MODULE_CLASSES[name](n, dim, low_rank=low_rank, heads=heads) for name in modules
        )
        self.combine = (
            LinearCompressBlock(n * len(modules), n_out=n)
            if ensemble == "concat" and len(modules) > 1
            else None
        )
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outputs = [block(x) for block in self.blocks]
        if self.combine is not None:
            mixed = self.combine(torch.cat(outputs, dim=1))
        else:
            mixed = torch.stack(outputs).sum(0)
        return self.norm(mixed + x)


class DHENDense(VectorStack):
    """The dense side of DHEN: bottom MLP to ``bottom_mlp[-1] / D`` vectors, the pooled
    embeddings as ``F`` more, one :class:`DHENLayer` per entry of ``layers``, top MLP.

    Args:
        num_dense: dense input features.
        num_sparse: ``F``, pooled embeddings per sample.
        embedding_dim: ``D``; ``bottom_mlp[-1]`` must be a multiple of it.
        bottom_mlp: bottom MLP sizes (without the input size).
        top_mlp: top MLP hidden sizes (a 1-unit logit layer is appended).
        layers: each layer's module names.
        ensemble: ``concat`` or ``sum``.
        low_rank: rank of the ``cross`` modules.
        heads: attention heads of the ``attention`` modules (must divide ``D``).
    """

    def __init__(
        self,
        *,
        num_dense: int,
        num_sparse: int,
        embedding_dim: int,
        bottom_mlp: list[int],
        top_mlp: list[int],
        layers: list[list[DhenModule]],
        ensemble: str,
        low_rank: int,
        heads: int,
    ):
        vectors = FeatureVectors(
            num_dense=num_dense, num_sparse=num_sparse, dim=embedding_dim, bottom_mlp=bottom_mlp
        )
        # A DHEN layer keeps its input's shape: every layer and the top MLP see n vectors.
        n = vectors.count
        super().__init__(
            vectors,
            layers=[
                DHENLayer(
                    n=n,
                    dim=embedding_dim,
                    modules=modules,
                    ensemble=ensemble,
                    low_rank=low_rank,
                    heads=heads,
                )
                for modules in layers
            ],
            top=mlp([n * embedding_dim, *top_mlp, 1], final_activation=False),
        )
