"""What a training step minimizes: a click model's log loss (plus the embeddings' l2), or a
retrieval model's next-item sampled softmax; and a sequence model's seeded draws.

The loss is the mean over the rank's own samples (the ranks' gradients are averaged, see
:mod:`raydlrm.sharding._output_dist`), written so that an empty batch (a rank that ran dry
while others still train) has loss 0 and zero gradients rather than NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from raydlrm.batch import Batch
from raydlrm.models.dlrm import RecModel
from raydlrm.trainers.spec import WorkerSpec

__all__ = ["Objective", "objective", "step_draws"]


@dataclass
class Objective:
    """One step's forward pass.

    Attributes:
        loss: this rank's mean loss (what the metrics report), 0-d.
        minimized: what the backward pass starts from (the loss plus any regularization).
        logits: the click logits ``(B,)``; None for a retrieval model.
    """

    loss: torch.Tensor
    minimized: torch.Tensor
    logits: torch.Tensor | None


def step_draws(seed: int, *, step: int, rank: int) -> torch.Generator:
    """A sequence model's draws of step ``step`` on ``rank`` (dropout, sampled negatives):
    seeded from the run's ``seed``, the step and the rank, so that a resumed run draws what
    it would have. Also seeds torch's global generator, which dropout draws from."""
    mixed = (seed * 1_000_003 + step) * 1_009 + rank
    torch.manual_seed(mixed)
    return torch.Generator().manual_seed(mixed)


def objective(
    model: RecModel, batch: Batch, *, spec: WorkerSpec, draws: torch.Generator | None
) -> Objective:
    """The forward pass of a training step on ``batch`` and what it minimizes.

    Args:
        model: the (sharded) model, in training mode.
        batch: this rank's batch.
        spec: the worker config (``training.embedding_l2``, the sampled negatives).
        draws: this step's generator (:func:`step_draws`; a retrieval model's negatives).
    """
    if model.retrieval is not None:
        # Next-item loss against the batch's other next items and sasrec_num_negatives item
        # rows drawn uniformly.
        assert draws is not None, "a retrieval model's step draws its negatives"
        table = model.retrieval.item_table
        rows = next(t.num_embeddings for t in spec.tables() if t.name == table)
        negatives = torch.randint(rows, (spec.model.sasrec_num_negatives,), generator=draws)
        loss = model.retrieval_loss(batch, negatives.to(batch.labels.device))
        return Objective(loss=loss, minimized=loss, logits=None)
    logits, pooled = model.forward_pooled(batch)
    samples = max(batch.batch_size, 1)
    loss = (
        torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels, reduction="sum")
        / samples
    )
    minimized = loss
    if l2 := spec.training.embedding_l2:
        # Gradient l2 * pooled to each looked-up row (the row itself for a one-id bag),
        # through every kernel, tier and sharding type; the metrics keep the log loss.
        minimized = loss + 0.5 * l2 * pooled.float().square().sum() / samples
    return Objective(loss=loss, minimized=minimized, logits=logits)
