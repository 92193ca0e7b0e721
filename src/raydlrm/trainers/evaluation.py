"""When the training loop evaluates on held-out data, and how.

:class:`Evaluator` evaluates every ``training.eval_every_steps`` steps (on its own cadence,
whether or not the step is a log step) and once at the end. Every rank evaluates its share of
the held-out data in lock-step with the others (the model's forward pass is a collective) and
the metrics are computed over all ranks. A reading error of the held-out data in the final
evaluation ends it on every rank alike and is reported as ``eval/error`` (the first rank's
error line), so that the trained model, already checkpointed, is kept.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from raydlrm.batch import Batch
from raydlrm.ingestion.loader import iter_train_batches
from raydlrm.trainers._dist import all_gather_object
from raydlrm.trainers.metrics import PredictionBuffer
from raydlrm.trainers.pipeline import Lockstep
from raydlrm.trainers.sources import BatchSource, empty_batch_of
from raydlrm.trainers.spec import WorkerSpec

__all__ = ["EVAL_STEP", "VALID_STEP", "Evaluator"]

EVAL_STEP = "eval/step"
"""Reported with the ``eval/*`` metrics of a periodic evaluation: its step (every later
report carries the last evaluation's metrics; this says which one they come from)."""
VALID_STEP = "valid/step"
"""The same for the ``valid/*`` metrics of an evaluation on the validation set."""


class Evaluator:
    """Evaluates the model on one worker's share of the held-out data.

    Args:
        model: the (sharded) model.
        data: the held-out data (None: no evaluation).
        spec: the worker config (``training.max_eval_batches``, the data config).
        device: the worker's device.
        rank: this worker's rank.
        prefix: of the metrics' names: ``eval/`` (the held-out data), ``valid/`` (validation).
        every: evaluate every this many steps (0: not periodically; default:
            ``training.eval_every_steps``).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        data: BatchSource | None,
        spec: WorkerSpec,
        device: torch.device,
        rank: int,
        prefix: str = "eval/",
        every: int | None = None,
    ) -> None:
        self.model = model
        self.data = data
        self.spec = spec
        self.device = device
        self.rank = rank
        self.prefix = prefix
        self.every = spec.training.eval_every_steps if every is None else every

    def should_evaluate(self, step: int) -> bool:
        return self.data is not None and self.every > 0 and step % self.every == 0

    def run(self) -> dict[str, float]:
        """``eval/*`` metrics over all ranks (a collective); a reading error is raised."""
        assert self.data is not None
        return self.evaluate(self._batches(), empty_batch_of(self.data, config=self.spec.data))

    def final(self) -> dict[str, float | str]:
        """The final evaluation's metrics; if reading the held-out data failed on any rank,
        ``{"eval/error": <the first rank's error line>}`` instead, on every rank."""
        assert self.data is not None
        errors: list[str] = []
        metrics = self.evaluate(
            self._batches(), empty_batch_of(self.data, config=self.spec.data), errors
        )
        failed = [e for rank_errors in all_gather_object(errors) for e in rank_errors]
        if failed:
            return {"eval/error": failed[0]}
        return metrics

    @torch.no_grad()
    def evaluate(
        self,
        batches: Iterable[Batch],
        empty: Batch | None = None,
        errors: list[str] | None = None,
    ) -> dict[str, float]:
        """Metrics of the model on ``batches`` over all ranks (named ``<prefix><metric>``);
        ``empty`` is an empty batch for a rank without data, ``errors`` collects reading errors
        instead of raising them (see :class:`~raydlrm.trainers.pipeline.Lockstep`)."""
        self.model.eval()
        buffer = PredictionBuffer()
        limit = self.spec.training.max_eval_batches
        stream = Lockstep(device=self.device, rank=self.rank)
        for i, batch in enumerate(stream(batches, empty, errors)):
            buffer.add(self.model(batch), batch.labels)
            if limit is not None and i + 1 >= limit:
                break
        return buffer.compute().to_dict(self.prefix)

    def _batches(self) -> Iterable[Batch]:
        assert self.data is not None
        return iter_train_batches(self.data, config=self.spec.data)
