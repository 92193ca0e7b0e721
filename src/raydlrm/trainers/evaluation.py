"""When the training loop evaluates on held-out data, and how.

:class:`Evaluator` evaluates every ``training.eval_every_steps`` steps (on its own cadence,
whether or not the step is a log step) and once at the end. Every rank evaluates its share of
the held-out data in lock-step with the others (the model's forward pass is a collective) and
the metrics are computed over all ranks. A worker keeps its share of the held-out batches in
memory after the first whole pass, up to ``training.held_out_cache_mib``
(:class:`~raydlrm.trainers.sources.HeldOutCache`): later evaluations then only run the model.
A retrieval model (``sasrec``) is evaluated by HR@K and NDCG@K of each example's target
against every item (:mod:`raydlrm.trainers.retrieval`). A reading error of the held-out data in
the final
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
from raydlrm.trainers.retrieval import RetrievalBuffer, item_shard
from raydlrm.trainers.sources import BatchSource, HeldOutCache, empty_batch_of
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
        self._cache: HeldOutCache | None = None  # of ``data``, made at its first evaluation

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
        limit = self.spec.training.max_eval_batches
        stream = Lockstep(device=self.device, rank=self.rank)
        if getattr(self.model, "retrieval", None) is not None:  # HR@K, NDCG@K, every item
            ranked = RetrievalBuffer(self.spec.model.retrieval_k)
            items = item_shard(self.model)
            for i, batch in enumerate(stream(batches, empty, errors)):
                ranked.add(self.model, batch, items=items)
                if limit is not None and i + 1 >= limit:
                    break
            return ranked.compute(device=self.device, prefix=self.prefix)
        buffer = PredictionBuffer()
        for i, batch in enumerate(stream(batches, empty, errors)):
            buffer.add(self.model(batch), batch.labels)
            if limit is not None and i + 1 >= limit:
                break
        return buffer.compute().to_dict(self.prefix)

    def _batches(self) -> Iterable[Batch]:
        assert self.data is not None
        if self._cache is None or self._cache.source is not self.data:
            budget = self.spec.training.held_out_cache_mib << 20
            self._cache = HeldOutCache(self.data, budget_bytes=budget)
        return iter_train_batches(self._cache, config=self.spec.data)
