"""Deep Interest Network (Zhou et al., 2018, "Deep Interest Network for Click-Through Rate
Prediction"), written unsharded: the dense side of a sequence ranking model.

A user's interest in a candidate item is read from the history by *target attention*: every
history position ``h_j`` gets the weight ``w_j = a(h_j, c)`` of an activation unit, an MLP over
``[h_j, c, h_j - c, h_j * c]`` (the official code's input; the paper's figure draws an outer
product) ending in one unit. The history is pooled as ``sum_j w_j h_j``. As the paper argues
(section 4.3), the weights are **not** normalized by a softmax by default, so that the pooled
vector's size keeps how strongly the history relates to the candidate; ``softmax`` (what the
official code ended up doing) is a choice. The activations are the paper's Dice (eq. 8) or
PReLU, in the activation unit and the MLP.

A position's vector is the concatenation of the history's parallel sequence features (items,
categories, ...), and the candidate's is the concatenation of its features in the same order,
so both have ``k * D`` columns. The MLP reads the bottom MLP's output of the dense features,
the pooled history, the candidate and the other pooled features, and ends in one logit.

Memory grows with the positions of the batch (``N = sum L``): the activation unit runs on
``(N, 4 k D)`` rows and the pooling is a segmented sum (:mod:`raydlrm.models.sequence_ops`).
An empty history pools to zeros.
"""

from __future__ import annotations

import itertools
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from raydlrm.batch import JaggedTensor
from raydlrm.models.layers import mlp
from raydlrm.models.sequence_ops import segment_softmax, segment_sum, single_rows

__all__ = ["DINDense", "Dice", "TargetAttention"]

Activation = Literal["dice", "prelu"]


class Dice(nn.Module):
    """Dice (Zhou et al., 2018, eq. 8): ``f(s) = p(s) s + (1 - p(s)) alpha s`` with ``p(s) =
    sigmoid((s - E[s]) / sqrt(Var[s] + eps))``, per feature; ``E`` and ``Var`` are the batch's
    in training and running averages in evaluation (a batch norm without scale and shift).

    Args:
        num_features: width of the input ``(n, num_features)``.
    """

    def __init__(self, num_features: int):
        super().__init__()
        self.norm = nn.BatchNorm1d(num_features, affine=False, eps=1e-8)
        self.alpha = nn.Parameter(torch.zeros(num_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A batch norm cannot take statistics of fewer than two rows: such a batch (a last
        # batch of one, a batch whose histories are all empty) uses the running ones.
        use_batch = self.training and x.shape[0] > 1
        normalized = F.batch_norm(
            x,
            self.norm.running_mean,
            self.norm.running_var,
            training=use_batch,
            momentum=self.norm.momentum,
            eps=self.norm.eps,
        )
        p = torch.sigmoid(normalized)
        return p * x + (1 - p) * self.alpha * x


def _activated_mlp(sizes: list[int], *, activation: Activation) -> nn.Sequential:
    """Linear layers ``sizes[i] -> sizes[i+1]``, ``activation`` after each but the last."""
    layers: list[nn.Module] = []
    for n_in, n_out in itertools.pairwise(sizes):
        layers.append(nn.Linear(n_in, n_out))
        layers.append(Dice(n_out) if activation == "dice" else nn.PReLU(n_out))
    return nn.Sequential(*layers[:-1])


class TargetAttention(nn.Module):
    """DIN's activation unit and the weighted pooling of the history.

    Args:
        dim: width of a position's (and the candidate's) vector.
        hidden: the activation unit's hidden sizes.
        normalization: ``none`` (the paper: raw weights) or ``softmax`` over each history.
        activation: ``dice`` or ``prelu``.
    """

    def __init__(
        self,
        dim: int,
        *,
        hidden: list[int],
        normalization: Literal["none", "softmax"],
        activation: Activation,
    ):
        super().__init__()
        self.normalization = normalization
        self.unit = _activated_mlp([4 * dim, *hidden, 1], activation=activation)

    def weights(self, history: JaggedTensor, candidate: torch.Tensor) -> JaggedTensor:
        """One weight per history position, ``(N,)``: how it relates to its sample's
        candidate (``candidate``: ``(B, dim)``; ``history``: ``(N, dim)`` rows)."""
        h = history.values
        c = candidate.index_select(0, history.segment_ids())
        w = self.unit(torch.cat([h, c, h - c, h * c], dim=1)).squeeze(1)
        weights = JaggedTensor(values=w, lengths=history.lengths)
        return segment_softmax(weights) if self.normalization == "softmax" else weights

    def forward(self, history: JaggedTensor, candidate: torch.Tensor) -> torch.Tensor:
        """The history pooled by its weights, ``(B, dim)``; zeros for an empty history."""
        w = self.weights(history, candidate).values
        return segment_sum(
            JaggedTensor(values=w.unsqueeze(1) * history.values, lengths=history.lengths)
        )


class DINDense(nn.Module):
    """The dense side of DIN: bottom MLP over the dense features, target attention of the
    candidate over the history, an MLP over ``[bottom, pooled history, candidate, other pooled
    features]`` to one logit.

    Args:
        num_dense: dense input features.
        num_sparse: ``F``, pooled embeddings per sample (``len(pooled_features)``).
        embedding_dim: ``D``, every table's width.
        bottom_mlp: bottom MLP sizes (without the input size).
        top_mlp: the MLP's hidden sizes (a 1-unit logit layer is appended).
        pooled_features: the pooled features, in the column order of ``pooled``.
        history: the sequence features whose per-position rows are concatenated into a
            position's vector (items, then e.g. categories).
        candidate: the candidate's features, one per ``history`` feature in the same order: a
            pooled feature, or a sequence feature of one position per sample.
        attention_mlp: the activation unit's hidden sizes.
        attention_normalization: ``none`` (the paper) or ``softmax``.
        activation: ``dice`` (the paper) or ``prelu``, in the activation unit and the MLP.

    Raises:
        ValueError: naming the features that do not fit together.
    """

    def __init__(
        self,
        *,
        num_dense: int,
        num_sparse: int,
        embedding_dim: int,
        bottom_mlp: list[int],
        top_mlp: list[int],
        pooled_features: list[str],
        history: list[str],
        candidate: list[str],
        attention_mlp: list[int],
        attention_normalization: Literal["none", "softmax"],
        activation: Activation,
    ):
        super().__init__()
        _check_features(
            num_sparse=num_sparse,
            pooled_features=pooled_features,
            history=history,
            candidate=candidate,
        )
        self.embedding_dim = embedding_dim
        self.pooled_features = list(pooled_features)
        self.history, self.candidate = list(history), list(candidate)
        width = len(history) * embedding_dim
        self.bottom = mlp([num_dense, *bottom_mlp], final_activation=True)
        self.attention = TargetAttention(
            width,
            hidden=attention_mlp,
            normalization=attention_normalization,
            activation=activation,
        )
        # The pooled columns that are not the candidate's (it joins the MLP's input once).
        others = [i for i, f in enumerate(pooled_features) if f not in candidate]
        columns = [i * embedding_dim + j for i in others for j in range(embedding_dim)]
        self.register_buffer("_others", torch.tensor(columns, dtype=torch.int64), persistent=False)
        n_in = bottom_mlp[-1] + 2 * width + len(columns)
        self.top = _activated_mlp([n_in, *top_mlp, 1], activation=activation)

    def forward(
        self, dense: torch.Tensor, pooled: torch.Tensor, sequences: dict[str, JaggedTensor]
    ) -> torch.Tensor:
        """Logits ``(B,)`` from dense ``(B, num_dense)``, pooled ``(B, F * D)`` and the
        per-position embeddings of the history (and of a one-position candidate).

        Raises:
            ValueError: naming a missing or unexpected sequence feature, or parallel history
                features of different lengths.
        """
        history = self.history_rows(sequences)
        candidate = self.candidate_rows(pooled, sequences)
        interest = self.attention(history, candidate)
        x = torch.cat(
            [self.bottom(dense), interest, candidate, pooled.index_select(1, self._others)], dim=1
        )
        return self.top(x).squeeze(1)

    def history_rows(self, sequences: dict[str, JaggedTensor]) -> JaggedTensor:
        """The history's per-position vectors, ``(N, k * D)``: the parallel features
        concatenated."""
        unexpected = sorted(set(sequences) - set(self.history) - set(self.candidate))
        missing = [f for f in self.history if f not in sequences]
        if unexpected or missing:
            raise ValueError(
                f"DIN reads the sequence features {self.history} (history) and "
                f"{self.candidate} (candidate): got unexpected {unexpected}, missing {missing}"
            )
        parts = [sequences[f] for f in self.history]
        rows = {f: p.values.shape[0] for f, p in zip(self.history, parts, strict=True)}
        if len(set(rows.values())) != 1:
            raise ValueError(f"DIN history features have different lengths (ids: {rows})")
        return JaggedTensor(
            values=torch.cat([p.values for p in parts], dim=1), lengths=parts[0].lengths
        )

    def candidate_rows(
        self, pooled: torch.Tensor, sequences: dict[str, JaggedTensor]
    ) -> torch.Tensor:
        """The candidate's vector, ``(B, k * D)``: its features concatenated, each a column of
        ``pooled`` or a one-position sequence feature."""
        parts = []
        for f in self.candidate:
            if f in sequences:
                parts.append(single_rows(f, jagged=sequences[f]))
            elif f in self.pooled_features:
                start = self.pooled_features.index(f) * self.embedding_dim
                parts.append(pooled[:, start : start + self.embedding_dim])
            else:
                raise ValueError(
                    f"DIN candidate feature {f!r} is neither a pooled feature "
                    f"{self.pooled_features} nor a sequence feature {sorted(sequences)}"
                )
        return torch.cat(parts, dim=1)


def _check_features(
    *, num_sparse: int, pooled_features: list[str], history: list[str], candidate: list[str]
) -> None:
    """Raises ``ValueError`` naming the features when DIN's history and candidate do not fit."""
    if num_sparse != len(pooled_features):
        raise ValueError(
            f"DIN got num_sparse={num_sparse} but {len(pooled_features)} pooled features "
            f"{pooled_features}"
        )
    if not history or len(history) != len(candidate):
        raise ValueError(
            f"DIN needs one candidate feature per history feature, got history {history} and "
            f"candidate {candidate}"
        )
    for names, what in ((history, "history"), (candidate, "candidate")):
        if len(set(names)) != len(names):
            raise ValueError(f"DIN {what} features repeat: {names}")
    pooled_history = [f for f in history if f in pooled_features]
    if pooled_history or set(history) & set(candidate):
        raise ValueError(
            f"DIN history features {history} must be sequence features, apart from the "
            f"candidate {candidate} and the pooled features {pooled_features}"
        )
