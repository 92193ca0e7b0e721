"""Operations on jagged sequences (:class:`~raydlrm.batch.JaggedTensor`) that the sequence
models (DIN, SASRec) are built from, with memory that grows with the sum of the lengths.

A batch of ``B`` histories has ``L_b`` positions each, ``N = sum L_b`` rows in all, stored back to
back (oldest first). Nothing here pads the whole batch to its longest history:

* :func:`segment_sum` and :func:`segment_softmax` reduce over each sample's positions with
  segmented reductions (``torch.segment_reduce``; deterministic, unlike an atomic
  ``index_add`` on a GPU): ``O(N)`` memory.
* :func:`causal_attention` groups the samples into length buckets (lengths in ``(2^(j-1),
  2^j]``), pads each bucket only to its own longest sample and runs
  ``torch.nn.functional.scaled_dot_product_attention`` once per bucket. Every sample is padded
  to less than twice its length, so a bucket costs at most 2x its own positions (and, in a kernel
  that materializes the scores, 4x the sum of its ``L_b^2``), never ``B x max_L^2``; the
  buckets are at most ``log2(max_L) + 1`` kernel calls. Samples are padded at the end, so the
  causal mask alone keeps every real position from seeing padding.

:func:`single_rows` reads the ``(B, D)`` rows of a one-position sequence feature that a model
takes as a single vector (DIN's candidate, SASRec's target).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from raydlrm.batch import JaggedTensor, is_debug

__all__ = ["causal_attention", "segment_softmax", "segment_sum", "single_rows"]


def segment_sum(jagged: JaggedTensor) -> torch.Tensor:
    """Each sample's rows summed.

    Args:
        jagged: rows ``(N, ...)`` of ``B`` samples.

    Returns:
        ``(B, ...)``; zeros for a sample without positions (and for an empty batch, a rank
        whose data ran out while others train, ``(0, ...)``).
    """
    if not jagged.batch_size:  # segment_reduce refuses no segments
        # Still from the values: the layers before stay in the graph (zero gradients), as
        # data parallelism needs of a rank whose batch is empty.
        return jagged.values.sum(dim=0, keepdim=True)[:0]
    return torch.segment_reduce(jagged.values, "sum", lengths=jagged.lengths, axis=0)


def segment_softmax(jagged: JaggedTensor) -> JaggedTensor:
    """Softmax of each sample's scores over its own positions.

    Args:
        jagged: scores ``(N,)`` or ``(N, H)`` (``H`` independent softmaxes, e.g. heads).

    Returns:
        The weights, same shape and lengths; each sample's weights sum to 1 (per head).
    """
    scores, lengths = jagged.values, jagged.lengths
    if not jagged.batch_size:
        return jagged
    segments = jagged.segment_ids()
    # The shift only keeps exp() finite; softmax does not depend on it, so no gradient.
    peak = torch.segment_reduce(scores.detach(), "max", lengths=lengths, axis=0)
    z = torch.exp(scores - peak.index_select(0, segments))
    total = torch.segment_reduce(z, "sum", lengths=lengths, axis=0)
    return JaggedTensor(values=z / total.index_select(0, segments), lengths=lengths)


def causal_attention(
    query: torch.Tensor,
    *,
    key: torch.Tensor,
    value: torch.Tensor,
    lengths: torch.Tensor,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Causal multi-head attention inside each sample: position ``t`` attends to the positions
    ``0..t`` of its own sample (oldest first), scaled by ``1 / sqrt(D_h)``.

    Args:
        query: ``(N, H, D_h)``, ``N = sum(lengths)``.
        key: ``(N, H, D_h)``.
        value: ``(N, H, D_v)``.
        lengths: positions per sample, int64, ``(B,)``.
        dropout_p: dropout on the attention weights (pass 0 in evaluation).

    Returns:
        ``(N, H, D_v)``, in the rows' order.
    """
    outputs, rows = [], []
    for bucket in _length_buckets(lengths, device=query.device):
        out = F.scaled_dot_product_attention(
            bucket.pad(query),
            bucket.pad(key),
            bucket.pad(value),
            dropout_p=dropout_p,
            is_causal=True,
        )
        outputs.append(bucket.unpad(out))
        rows.append(bucket.sources)
    if not outputs:  # no position (an empty batch, or empty histories only)
        # Zeros still made of the inputs: their layers get (zero) gradients, as data
        # parallelism needs of every rank, whatever its batch.
        return value + 0.0 * (query.sum() + key.sum())
    order = torch.cat(rows)
    gathered = torch.cat(outputs)
    # Back to the rows' order: every row is in exactly one bucket.
    return gathered.new_empty(gathered.shape).index_copy(0, order, gathered)


@dataclass
class _Bucket:
    """Samples of similar lengths, padded together to ``(count, width)`` positions.

    Attributes:
        sources: the rows of the bucket's positions, ``(n_pos,)``, sample by sample, oldest
            first.
        targets: where each goes in the ``count * width`` padded rows.
        count: samples.
        width: positions of the longest.
    """

    sources: torch.Tensor
    targets: torch.Tensor
    count: int
    width: int

    def pad(self, rows: torch.Tensor) -> torch.Tensor:
        """``(N, H, D)`` rows -> ``(count, H, width, D)``, zeros after each sample's end."""
        padded = rows.new_zeros(self.count * self.width, *rows.shape[1:])
        padded = padded.index_copy(0, self.targets, rows.index_select(0, self.sources))
        return padded.view(self.count, self.width, *rows.shape[1:]).transpose(1, 2)

    def unpad(self, padded: torch.Tensor) -> torch.Tensor:
        """``(count, H, width, D)`` -> the ``(n_pos, H, D)`` rows of the real positions."""
        flat = padded.transpose(1, 2).reshape(self.count * self.width, *padded.shape[1:2], -1)
        return flat.index_select(0, self.targets)


def _length_buckets(lengths: torch.Tensor, *, device: torch.device) -> list[_Bucket]:
    """The samples grouped by ``ceil(log2(L))``; samples without positions are in none."""
    host = lengths.detach().to("cpu", torch.int64)  # one synchronization, small (B,)
    starts = torch.cumsum(host, 0) - host
    present = torch.nonzero(host > 0).flatten()
    keys = torch.ceil(torch.log2(host[present].double())).long()
    buckets = []
    for key in torch.unique(keys).tolist():
        samples = present[keys == key]
        lens = host[samples]
        slot = torch.repeat_interleave(torch.arange(samples.numel()), lens)
        within = torch.arange(int(lens.sum())) - torch.repeat_interleave(
            torch.cumsum(lens, 0) - lens, lens
        )
        sources = torch.repeat_interleave(starts[samples], lens) + within
        width = int(lens.max())
        buckets.append(
            _Bucket(
                sources=sources.to(device),
                targets=(slot * width + within).to(device),
                count=samples.numel(),
                width=width,
            )
        )
    return buckets


def single_rows(name: str, *, jagged: JaggedTensor) -> torch.Tensor:
    """The ``(B, D)`` rows of a sequence feature that has one position per sample (a feature
    read as one vector whose table is looked up per position, such as a candidate item that
    shares the item table with the history).

    Args:
        name: the feature (for the error).
        jagged: its per-position rows ``(B, D)``, lengths all 1.

    Raises:
        ValueError: naming the feature when a sample has other than one position (checked by
            the row count; sample by sample too in debug mode).
    """
    if jagged.values.shape[0] != jagged.batch_size or (
        is_debug() and bool((jagged.lengths != 1).any())
    ):
        raise ValueError(
            f"feature {name!r} must have exactly one id per sample to be read as one vector, "
            f"got {jagged.values.shape[0]} ids for {jagged.batch_size} samples"
        )
    return jagged.values
