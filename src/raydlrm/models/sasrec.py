"""SASRec (Kang & McAuley, 2018, "Self-Attentive Sequential Recommendation"), written
unsharded: causal self-attention over a user's history of items, trained to predict the next
item, and the user vector a retrieval ranks the catalogue with.

As in the paper's official code (kang205/SASRec):

* input: the history's item embeddings scaled by ``sqrt(D)``, plus a learned positional
  embedding, then dropout. The official code left-pads every history to ``max_length``, so
  the newest event always sits at the last slot; the position here is counted the same way,
  from the newest event (0 = newest, ``max_length - 1`` = the oldest a history can keep), which
  needs no padding. A history longer than ``max_length`` is an error (the data keeps the most
  recent events).
* ``L`` blocks, each ``Q = LN(x); x = Q + Attention(Q W_Q, x W_K, x W_V)`` (queries from the
  normalized input, keys and values from the raw one, no output projection, dropout on the
  attention weights) then ``y = LN(x); x = y + FFN(y)`` (two position-wise linear layers with a
  ReLU, dropout after each); a final layer norm. Attention is causal, over each history's own
  positions (:func:`~raydlrm.models.sequence_ops.causal_attention`: memory grows with the
  positions, not with ``B x max_length^2``).
* the state at position ``t`` predicts the item at ``t + 1``; the last position's next item is
  the example's target item. The user vector is the last position's state; a score is its dot
  product with an item embedding (of the same, shared, item table).

Training uses a sampled softmax over the next item (:func:`sampled_softmax_loss`) rather than
the official code's one-negative binary cross-entropy: each position's state scores its true
next item against the other positions' next items in the local batch (in-batch negatives) and
``K`` uniformly sampled items shared by the batch, with a temperature.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from raydlrm.batch import JaggedTensor
from raydlrm.models.sequence_ops import causal_attention, single_rows

__all__ = ["NextItems", "SASRecBlock", "SASRecDense", "next_items", "sampled_softmax_loss"]

_LN_EPS = 1e-8  # the official code's layer norm epsilon


class SASRecBlock(nn.Module):
    """One self-attention block (see the module docstring), on the ``(N, D)`` rows of a batch
    of histories.

    Args:
        dim: ``D``.
        num_heads: attention heads; must divide ``dim``.
        dropout: dropout rate of the attention weights and the feed-forward layers.
    """

    def __init__(self, dim: int, *, num_heads: int, dropout: float):
        super().__init__()
        self.num_heads, self.dropout = num_heads, dropout
        self.attention_norm = nn.LayerNorm(dim, eps=_LN_EPS)
        self.query = nn.Linear(dim, dim)
        self.key = nn.Linear(dim, dim)
        self.value = nn.Linear(dim, dim)
        self.ffn_norm = nn.LayerNorm(dim, eps=_LN_EPS)
        self.ffn = nn.Sequential(
            nn.Linear(dim, dim),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(dim, dim),
            nn.Dropout(dropout),
        )

    def forward(self, x: torch.Tensor, *, lengths: torch.Tensor) -> torch.Tensor:
        """``(N, D)`` rows of histories of ``lengths`` -> ``(N, D)``."""
        n, dim = x.shape
        heads = (n, self.num_heads, dim // self.num_heads)
        q = self.attention_norm(x)
        attended = causal_attention(
            self.query(q).view(heads),
            key=self.key(x).view(heads),
            value=self.value(x).view(heads),
            lengths=lengths,
            dropout_p=self.dropout if self.training else 0.0,
        )
        x = q + attended.reshape(n, dim)
        y = self.ffn_norm(x)
        return y + self.ffn(y)


class SASRecDense(nn.Module):
    """The SASRec encoder over the item embeddings of a history.

    Args:
        embedding_dim: ``D``, the item table's width and the model's.
        history: the sequence feature of the history's items.
        target: the feature of the example's target item: a one-position sequence feature
            looked up in the same item table.
        max_length: the most events a history keeps (the positional embeddings).
        num_blocks: self-attention blocks.
        num_heads: heads per block; must divide ``embedding_dim``.
        dropout: dropout rate (embeddings, attention weights, feed-forward layers).
        temperature: the sampled softmax's logits are scores divided by it.

    Raises:
        ValueError: naming the setting that is out of range.
    """

    def __init__(
        self,
        *,
        embedding_dim: int,
        history: str,
        target: str,
        max_length: int,
        num_blocks: int,
        num_heads: int,
        dropout: float,
        temperature: float,
    ):
        super().__init__()
        if num_heads <= 0 or embedding_dim % num_heads:
            raise ValueError(
                f"SASRec num_heads ({num_heads}) must be positive and divide embedding_dim "
                f"({embedding_dim})"
            )
        if max_length <= 0 or num_blocks < 0 or not 0.0 <= dropout < 1.0 or temperature <= 0:
            raise ValueError(
                f"SASRec needs max_length > 0, num_blocks >= 0, dropout in [0, 1) and "
                f"temperature > 0; got {max_length}, {num_blocks}, {dropout}, {temperature}"
            )
        self.history, self.target = history, target
        self.embedding_dim, self.max_length = embedding_dim, max_length
        self.temperature = temperature
        self.positions = nn.Embedding(max_length, embedding_dim)
        nn.init.xavier_normal_(self.positions.weight)
        self.input_dropout = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(
            SASRecBlock(embedding_dim, num_heads=num_heads, dropout=dropout)
            for _ in range(num_blocks)
        )
        self.final_norm = nn.LayerNorm(embedding_dim, eps=_LN_EPS)

    def forward(self, sequences: dict[str, JaggedTensor]) -> JaggedTensor:
        """Every history position's state, ``(N, D)`` rows with the history's lengths.

        Args:
            sequences: per-position embeddings; ``sequences[history]`` is read (the others,
                such as the target, are the loss's).

        Raises:
            ValueError: naming the history feature when it is missing or a history is longer
                than ``max_length``.
        """
        if self.history not in sequences:
            raise ValueError(
                f"SASRec reads the sequence feature {self.history!r}; got {sorted(sequences)}"
            )
        history = sequences[self.history]
        lengths = history.lengths
        longest = int(lengths.max()) if lengths.numel() else 0
        if longest > self.max_length:
            raise ValueError(
                f"feature {self.history!r}: a history has {longest} events, more than the "
                f"model's max_length {self.max_length}"
            )
        newest_first = lengths.index_select(0, history.segment_ids()) - 1 - history.positions()
        x = history.values * self.embedding_dim**0.5 + self.positions(newest_first)
        x = self.input_dropout(x)
        for block in self.blocks:
            x = block(x, lengths=lengths)
        return JaggedTensor(values=self.final_norm(x), lengths=lengths)

    def user_vectors(self, sequences: dict[str, JaggedTensor]) -> torch.Tensor:
        """The retrieval query of each sample, ``(B, D)``: its last position's state (zeros
        for an empty history). An item's score is its embedding's dot product with it."""
        return self(sequences).last()

    def loss(
        self,
        states: JaggedTensor,
        *,
        sequences: dict[str, JaggedTensor],
        history_rows: torch.Tensor,
        target_rows: torch.Tensor,
        negative_embeddings: torch.Tensor,
        negative_rows: torch.Tensor,
    ) -> torch.Tensor:
        """The next-item sampled softmax loss of a batch (see :func:`sampled_softmax_loss`).

        Args:
            states: this model's output for ``sequences``.
            sequences: the per-position embeddings (the history's and the target's).
            history_rows: the item table rows of the history's positions, ``(N,)``.
            target_rows: the target item's row per sample, ``(B,)``.
            negative_embeddings: ``(K, D)`` sampled items' embeddings.
            negative_rows: their rows, ``(K,)``.

        Returns:
            The mean loss over the ``N`` positions (a scalar).
        """
        nxt = next_items(
            sequences[self.history],
            history_rows=history_rows,
            target_embeddings=single_rows(self.target, jagged=sequences[self.target]),
            target_rows=target_rows,
        )
        return sampled_softmax_loss(
            states.values,
            next_embeddings=nxt.embeddings,
            next_rows=nxt.rows,
            negative_embeddings=negative_embeddings,
            negative_rows=negative_rows,
            temperature=self.temperature,
        )


@dataclass
class NextItems:
    """The item each history position predicts.

    Attributes:
        embeddings: ``(N, D)``.
        rows: their item table rows, ``(N,)``.
    """

    embeddings: torch.Tensor
    rows: torch.Tensor


def next_items(
    history: JaggedTensor,
    *,
    history_rows: torch.Tensor,
    target_embeddings: torch.Tensor,
    target_rows: torch.Tensor,
) -> NextItems:
    """The next item of every position: the history's item at ``t + 1``, the target item at a
    history's last position.

    Args:
        history: the history's item embeddings, ``(N, D)`` rows.
        history_rows: their rows, ``(N,)``.
        target_embeddings: ``(B, D)``.
        target_rows: ``(B,)``.
    """
    n = history.values.shape[0]
    segments = history.segment_ids()
    last = history.positions() == history.lengths.index_select(0, segments) - 1
    following = torch.arange(1, n + 1, device=segments.device).clamp(max=max(n - 1, 0))
    return NextItems(
        embeddings=torch.where(
            last.unsqueeze(1),
            target_embeddings.index_select(0, segments),
            history.values.index_select(0, following),
        ),
        rows=torch.where(
            last, target_rows.index_select(0, segments), history_rows.index_select(0, following)
        ),
    )


def sampled_softmax_loss(
    states: torch.Tensor,
    *,
    next_embeddings: torch.Tensor,
    next_rows: torch.Tensor,
    negative_embeddings: torch.Tensor,
    negative_rows: torch.Tensor,
    temperature: float,
    max_logits: int = 1 << 22,
) -> torch.Tensor:
    """Next-item sampled softmax: position ``i``'s logits are its state's dot products, over
    ``temperature``, with its true next item, every other position's next item (in-batch
    negatives) and the ``K`` sampled items; a candidate that is the same item (row) as
    position ``i``'s true next item is masked out, so an item is never its own negative. A
    negative that occurs several times counts as often in the softmax's denominator.

    Computed exactly so with one column per distinct item (items repeat in a batch): its logit
    plus ``log(occurrences)``. A repeated negative's gradient lands on its first occurrence;
    per item row (what a lookup sums) it is the same. The ``(N, items)`` logits are computed
    ``max_logits`` at a time, past one chunk recomputed in the backward pass (checkpointing).

    Args:
        states: ``(N, D)``.
        next_embeddings: ``(N, D)``, the true next items.
        next_rows: ``(N,)``, their item rows.
        negative_embeddings: ``(K, D)``.
        negative_rows: ``(K,)``.
        temperature: divides the scores.
        max_logits: logits computed at once.

    Returns:
        The mean cross-entropy over the ``N`` positions (0, with a gradient, when ``N = 0``).
    """
    n = states.shape[0]
    if n == 0:
        return states.sum() * 0.0
    candidates, inverse, log_counts = _distinct(
        torch.cat([next_rows, negative_rows]),
        embeddings=torch.cat([next_embeddings, negative_embeddings]),
    )
    positives = (states * next_embeddings).sum(dim=1) / temperature
    own = inverse[:n]
    chunk = max(1, max_logits // candidates.shape[0])
    total = states.new_zeros(())
    for start in range(0, n, chunk):
        args = (
            states[start : start + chunk],
            positives[start : start + chunk],
            own[start : start + chunk],
            candidates,
            log_counts,
            temperature,
        )
        total = total + (
            _chunk_loss(*args)
            if chunk >= n
            else checkpoint(_chunk_loss, *args, use_reentrant=False)
        )
    return total / n


def _distinct(
    rows: torch.Tensor, *, embeddings: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The distinct items of ``rows`` ``(M,)``: the embedding of each one's first occurrence
    ``(U, D)``, each occurrence's item ``(M,)`` and ``log(occurrences)`` ``(U,)``."""
    items, inverse, counts = torch.unique(rows, return_inverse=True, return_counts=True)
    occurrence = torch.arange(rows.numel(), device=rows.device)
    first = torch.full_like(items, rows.numel()).scatter_reduce(0, inverse, occurrence, "amin")
    return embeddings.index_select(0, first), inverse, counts.to(embeddings.dtype).log()


def _chunk_loss(
    states: torch.Tensor,
    positives: torch.Tensor,
    own: torch.Tensor,
    candidates: torch.Tensor,
    log_counts: torch.Tensor,
    temperature: float,
) -> torch.Tensor:
    """The summed cross-entropy of some positions: ``positives`` their true items' logits,
    ``own`` their true items' columns among the distinct ``candidates``."""
    logits = states @ candidates.T / temperature + log_counts
    logits = logits.scatter(1, own.unsqueeze(1), float("-inf"))
    normalizer = torch.logsumexp(torch.cat([positives.unsqueeze(1), logits], dim=1), dim=1)
    return (normalizer - positives).sum()
