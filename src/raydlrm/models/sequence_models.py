"""The sequence models' dense sides as a :class:`~raydlrm.models.dlrm.RecModel` runs them.

DIN (:class:`~raydlrm.models.din.DINDense`) reads ``(dense, pooled, sequences)`` and returns
click logits like every pooled arch. SASRec is a retrieval model: :class:`SASRecTask` wraps
its encoder (:class:`~raydlrm.models.sasrec.SASRecDense`) so that one module call is what data
parallelism (DDP) wraps: in training it returns the batch's sampled softmax loss (the history
rows, the target rows and the sampled negatives' rows given), otherwise the user vectors a
retrieval ranks the item table with.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from raydlrm.batch import JaggedTensor, KeyedJaggedTensor
from raydlrm.models.config import ModelConfig
from raydlrm.models.din import DINDense
from raydlrm.models.sasrec import SASRecDense

__all__ = ["RetrievalFeatures", "RetrievalRows", "SASRecTask", "sequence_dense"]


@dataclass
class RetrievalRows:
    """The item rows a training step's loss needs (the embeddings come from the lookup).

    Attributes:
        history: the history's item rows, ``(N,)``.
        target: each sample's target item row, ``(B,)``.
        negatives: the sampled negatives' rows, ``(K,)``.
    """

    history: torch.Tensor
    target: torch.Tensor
    negatives: torch.Tensor


@dataclass(frozen=True)
class RetrievalFeatures:
    """The features a retrieval model's loss and evaluation read.

    Attributes:
        history: the history's item feature.
        target: the example's target item feature.
        negatives: the feature the sampled negatives are looked up through (in the item table;
            no data column has its name).
        item_table: the item table (the catalogue a retrieval ranks).
    """

    history: str
    target: str
    negatives: str
    item_table: str

    def with_negatives(self, sparse: KeyedJaggedTensor, rows: torch.Tensor) -> KeyedJaggedTensor:
        """``sparse`` with the item rows ``rows`` as the negatives feature (all in the first
        sample's bag: looked up per position, the bags only say whose rows they are)."""
        b = sparse.batch_size
        lengths = torch.zeros(b, dtype=torch.int64, device=sparse.values.device)
        if b:
            lengths[0] = rows.numel()
        else:
            rows = rows[:0]
        negatives = KeyedJaggedTensor(
            keys=[self.negatives],
            values=rows.to(sparse.values.dtype),
            lengths=lengths,
            batch_size=b,
            weights=None if sparse.weights is None else rows.new_ones(rows.numel()).float(),
        )
        return KeyedJaggedTensor.concat([sparse, negatives])


class SASRecTask(nn.Module):
    """SASRec behind the dense-module interface: ``forward(dense, pooled, sequences, rows)``.

    Args:
        encoder: the SASRec encoder.
        negatives: the feature through which the sampled negatives are looked up.
    """

    retrieval = True

    def __init__(self, encoder: SASRecDense, *, negatives: str):
        super().__init__()
        self.encoder = encoder
        self.negatives = negatives

    def forward(
        self,
        dense: torch.Tensor,
        pooled: torch.Tensor,
        sequences: dict[str, JaggedTensor],
        rows: RetrievalRows | None = None,
    ) -> torch.Tensor:
        """The mean next-item loss of the batch (0-d) when ``rows`` is given, else each
        sample's user vector ``(B, D)`` (``dense`` and ``pooled`` are not read)."""
        del dense, pooled
        history = {k: v for k, v in sequences.items() if k != self.negatives}
        if rows is None:
            return self.encoder.user_vectors(history)
        return self.encoder.loss(
            self.encoder(history),
            sequences=history,
            history_rows=rows.history,
            target_rows=rows.target,
            negative_embeddings=sequences[self.negatives].values,
            negative_rows=rows.negatives,
        )


def sequence_dense(
    config: ModelConfig,
    *,
    num_dense: int,
    pooled_features: Sequence[str],
    history: Sequence[str],
    max_length: int,
    negatives: str | None,
) -> nn.Module:
    """The dense side of ``config.arch`` (``din`` or ``sasrec``) over the pooled features
    ``pooled_features`` and the history columns ``history`` (``max_length`` events)."""
    if config.arch == "din":
        return DINDense(
            num_dense=num_dense,
            num_sparse=len(pooled_features),
            embedding_dim=config.embedding_dim,
            bottom_mlp=config.bottom_mlp,
            top_mlp=config.top_mlp,
            pooled_features=list(pooled_features),
            history=list(history),
            candidate=list(config.candidate),
            attention_mlp=config.din_attention_mlp,
            attention_normalization=config.din_attention_normalization,
            activation=config.din_activation,
        )
    assert config.arch == "sasrec" and negatives is not None, config.arch
    encoder = SASRecDense(
        embedding_dim=config.embedding_dim,
        history=history[0],
        target=config.candidate[0],
        max_length=max_length,
        num_blocks=config.sasrec_num_blocks,
        num_heads=config.sasrec_num_heads,
        dropout=config.sasrec_dropout,
        temperature=config.sasrec_temperature,
    )
    return SASRecTask(encoder, negatives=negatives)
