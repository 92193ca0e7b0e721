"""The model side of Disaggregated Multi-Tower (``model.towers``): tower modules in front of
the dense architecture.

:class:`TowerDense` is a dense module (``RecModel.dense``) that regroups the pooled embeddings
into towers, passes each tower through its :class:`TowerModule` (or leaves it as it is with
``model.tower_dim = 0``), and feeds the towers' outputs, cut into ``embedding_dim``-wide vectors,
to the architecture's dense side in place of the features. Written unsharded, it is the whole
model in one process (export, scoring, one host). Sharded over several hosts
(:func:`raydlrm.sharding.shard_model`), the tower collection runs the modules on each tower's
host (:func:`run_towers`, the same forward) and the sharded model's dense side runs ``inner``
on their outputs; the modules stay in this module's state on every rank, so checkpoints and
exports hold them as any dense weight.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from raydlrm.models.config import tower_name

__all__ = ["TowerDense", "TowerModule", "run_towers", "tower_vectors"]


class TowerModule(nn.Module):
    """A tower's compression: its ``n`` pooled embeddings (``B x n*D``) and their
    ``n(n-1)/2`` pairwise dot products (the interactions inside the tower), projected to
    ``out`` columns."""

    def __init__(self, num_features: int, embedding_dim: int, out: int):
        super().__init__()
        self.num_features, self.embedding_dim = num_features, embedding_dim
        rows, cols = torch.triu_indices(num_features, num_features, offset=1)
        self.register_buffer("_triu", rows * num_features + cols, persistent=False)
        pairs = num_features * (num_features - 1) // 2
        self.proj = nn.Linear(num_features * embedding_dim + pairs, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.num_features > 1:
            v = x.view(-1, self.num_features, self.embedding_dim)
            dots = torch.bmm(v, v.transpose(1, 2)).flatten(1).index_select(1, self._triu)
            x = torch.cat([x, dots], dim=1)
        return self.proj(x)


def tower_vectors(towers: Sequence[Sequence[str]], *, embedding_dim: int, tower_dim: int) -> int:
    """The ``embedding_dim``-wide vectors the towers give the dense architecture: one per
    feature with identity towers (``tower_dim`` 0), ``tower_dim / embedding_dim`` per tower
    otherwise."""
    if tower_dim == 0:
        return sum(len(t) for t in towers)
    return len(towers) * (tower_dim // embedding_dim)


def run_towers(inputs: Sequence[torch.Tensor], blocks: Sequence[nn.Module | None]) -> torch.Tensor:
    """The towers' outputs side by side: each tower's input (its pooled features side by side,
    ``B x n*D``) through its module (None: as it is). The one tower forward, for the unsharded
    model and for a sharded tower collection, which runs it on each tower's host."""
    return torch.cat([x if b is None else b(x) for x, b in zip(inputs, blocks, strict=True)], 1)


class TowerDense(nn.Module):
    """Towers, then the dense architecture ``inner``.

    Args:
        towers: each tower's features (``model.towers``).
        feature_names: the embedding collection's features, in the order of its pooled output.
        embedding_dim: ``D``, every feature's width.
        tower_dim: each tower module's output width (0: identity towers, no modules).
        inner: the dense architecture, built for :func:`tower_vectors` sparse vectors.
    """

    def __init__(
        self,
        *,
        towers: Sequence[Sequence[str]],
        feature_names: Sequence[str],
        embedding_dim: int,
        tower_dim: int,
        inner: nn.Module,
    ):
        super().__init__()
        self.towers = [tuple(t) for t in towers]
        self.embedding_dim = embedding_dim
        self.blocks = nn.ModuleDict(
            {
                tower_name(i): TowerModule(len(t), embedding_dim, tower_dim)
                for i, t in enumerate(self.towers)
            }
            if tower_dim
            else {}
        )
        position = {f: i for i, f in enumerate(feature_names)}
        columns = [
            position[f] * embedding_dim + c
            for t in self.towers
            for f in t
            for c in range(embedding_dim)
        ]
        self.register_buffer("_columns", torch.tensor(columns), persistent=False)
        self.inner = inner

    def tower_outputs(self, pooled: torch.Tensor) -> torch.Tensor:
        """The towers' outputs side by side, in tower order, from the pooled features
        (``B x F*D`` in ``feature_names`` order)."""
        x = pooled.index_select(1, self._columns)
        if not self.blocks:
            return x
        parts = torch.split(x, [len(t) * self.embedding_dim for t in self.towers], dim=1)
        return run_towers(parts, list(self.blocks.values()))

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        """Logits ``(B,)`` from dense ``B x num_dense`` and the pooled features."""
        return self.inner(dense, self.tower_outputs(pooled))
