"""How batches reach the training step, in lock-step over the ranks, with or without pipelining.

Sharded embeddings make every step a collective, so all ranks run the same number of steps: a
rank whose data ended steps with an empty batch until every rank is done, which means each
step starts by asking whether any rank still has a batch.

- :class:`Lockstep` (``training.pipeline = "none"``): before each step, that question (an
  all-reduce), then the batch copied to the device (on a GPU from pinned memory, without
  blocking the host); the step's forward pass then routes the batch's ids to their shards (the
  input all-to-all).
- :class:`SparseDistPipeline` (``"sparse_dist"``, as TorchRec's ``TrainPipelineSparseDist``):
  batch ``i + 1`` is prepared ahead of its step: the any-rank question, the copy to the device
  and the input all-to-all, on a process group of its own so that its exchanges overlap the
  step's. On CPU a background thread does it while step ``i`` runs forward, backward and
  optimizer. On a GPU the training thread issues it on a CUDA stream of its own (from pinned
  memory) before step ``i``, and the device overlaps it with the steps' kernels: NCCL needs
  the collectives of its communicators issued in the same order on every rank, which two
  threads cannot promise. The step then starts from the routed ids. The work is the same as
  unpipelined and independent of the model's state, so the results are bit-identical; the
  data position a checkpoint records counts a batch only once its step ran
  (``Batch.row_groups``), so a batch read ahead is trained after a resume, not lost.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from raydlrm._errors import cause_line
from raydlrm.batch import Batch, DedupGroup
from raydlrm.sharding.types import ShardedTables
from raydlrm.trainers._dist import distributed

__all__ = ["Lockstep", "SparseDistPipeline", "any_rank_has", "emptied"]

logger = logging.getLogger(__name__)


def any_rank_has(has_batch: bool, device: torch.device, pg: ProcessGroup | None = None) -> bool:
    """True if any rank has a batch (a MAX all-reduce of a flag on ``pg``)."""
    if not distributed():
        return has_batch
    flag = torch.tensor([1 if has_batch else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=pg)
    return bool(flag.item())


def emptied(batch: Batch) -> Batch:
    """A batch of 0 samples with the structure (features, dedup groups, sequence values) of
    ``batch``."""
    none = torch.zeros(0, dtype=torch.int64)
    return Batch(
        dense=batch.dense[:0],
        sparse=batch.sparse.index_rows(none),
        labels=batch.labels[:0],
        dedup_groups=[
            DedupGroup(unique=g.unique.index_rows(none), inverse=none) for g in batch.dedup_groups
        ],
        sample_ids=None if batch.sample_ids is None else batch.sample_ids[:0],
        sequence_values={c: v[:0] for c, v in batch.sequence_values.items()},
        sequence_of=batch.sequence_of,
    )


class _Reader:
    """This rank's batches, then ``None``; remembers an empty batch of their structure."""

    def __init__(
        self,
        batches: Iterable[Batch],
        *,
        rank: int,
        empty: Batch | None,
        errors: list[str] | None,
    ):
        self._iterator = iter(batches)
        self._rank = rank
        self.template = empty
        self._errors = errors

    def next(self) -> Batch | None:
        try:
            batch = next(self._iterator, None)
        except Exception as exc:
            if self._errors is None:
                raise
            logger.error("rank %d: reading evaluation data failed", self._rank, exc_info=exc)
            self._errors.append(cause_line(exc))
            self._iterator, batch = iter(()), None
        if batch is not None and self.template is None:
            self.template = emptied(batch)
        return batch

    def or_empty(self, batch: Batch | None) -> Batch:
        """``batch``, or an empty one for a rank whose data ended while others still step."""
        if batch is not None:
            return batch
        if self.template is None:
            raise RuntimeError(
                f"rank {self._rank} has no data at all while other ranks do, and no empty "
                "batch to step with"
            )
        return self.template


class Lockstep:
    """Batches while any rank has one, copied to ``device`` (see the module docstring).

    Args:
        device: the worker's device.
        rank: this worker's rank (for messages).
    """

    def __init__(self, *, device: torch.device, rank: int):
        self.device = device
        self.rank = rank

    def __call__(
        self,
        batches: Iterable[Batch],
        empty: Batch | None = None,
        errors: list[str] | None = None,
    ) -> Iterator[Batch]:
        """Yields this rank's batches, then empty ones, while any rank has a batch.

        Args:
            batches: this rank's batches.
            empty: an empty batch of the right structure, for a rank with no batch at all
                (otherwise the rank's first batch, emptied, is used).
            errors: if given, an error while reading this rank's batches (bad input) is
                appended here (one line naming the culprit) and the rank goes on as if its data
                had ended, so the other ranks' collectives still complete; else it is raised.
        """
        reader = _Reader(batches, rank=self.rank, empty=empty, errors=errors)
        while True:
            batch = reader.next()
            if not any_rank_has(batch is not None, self.device):
                return
            batch = reader.or_empty(batch)
            if self.device.type == "cuda":  # from page-locked memory, without blocking the host
                yield batch.pin_memory().to(self.device, non_blocking=True)
            else:
                yield batch.to(self.device)

    def close(self) -> None:
        """Nothing to release."""


class SparseDistPipeline(Lockstep):
    """Prepares the next batch (any-rank question, copy, input all-to-all) in a background
    thread while the current step runs (see the module docstring).

    Every rank must construct it at the same point (it makes a process group, a collective)
    and iterate it over the same number of steps.

    Args:
        model: the sharded model (its ``embedding_bags`` is a
            :class:`~raydlrm.sharding.types.ShardedTables`).
        device: the worker's device.
        rank: this worker's rank.
    """

    def __init__(self, model: Any, *, device: torch.device, rank: int):
        super().__init__(device=device, rank=rank)
        self._collection: ShardedTables = model.embedding_bags
        # Its own process group: its collectives never interleave with the step's.
        self._pg = dist.new_group(backend=dist.get_backend()) if distributed() else None
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # A thread on CPU; on a GPU the stream overlaps, and one thread keeps NCCL's order.
        self._executor = (
            None
            if self._stream is not None
            else ThreadPoolExecutor(max_workers=1, thread_name_prefix="raydlrm-pipe")
        )

    def _submit(self, batch: Batch | None, reader: _Reader) -> Future:
        """Prepares ``batch`` in the background thread, or (GPU) now on the pipeline's stream."""
        if self._executor is not None:
            return self._executor.submit(self._prepare, batch, reader)
        done: Future = Future()
        try:
            done.set_result(self._prepare(batch, reader))
        except Exception as exc:
            done.set_exception(exc)
        return done

    def _prepare(self, batch: Batch | None, reader: _Reader) -> Batch | None:
        """In the thread: None when no rank has a batch; else this rank's batch (or an empty
        one) on the device with its ids routed to their shards."""
        if not any_rank_has(batch is not None, self.device, self._pg):
            return None
        batch = reader.or_empty(batch)
        if self._stream is not None:
            with torch.cuda.stream(self._stream):
                batch = batch.pin_memory().to(self.device, non_blocking=True)
                self._collection.prefetch(batch.sparse, batch.dedup_groups, pg=self._pg)
            return batch
        batch = batch.to(self.device)
        self._collection.prefetch(batch.sparse, batch.dedup_groups, pg=self._pg)
        return batch

    def __call__(
        self,
        batches: Iterable[Batch],
        empty: Batch | None = None,
        errors: list[str] | None = None,
    ) -> Iterator[Batch]:
        reader = _Reader(batches, rank=self.rank, empty=empty, errors=errors)
        future: Future | None = self._submit(reader.next(), reader)
        try:
            while True:
                batch = future.result()
                future = None
                if batch is None:
                    return
                if self._stream is not None:
                    # The step's stream waits for the copy and the routing, and the batch's
                    # memory is not reused while the step may still read it.
                    current = torch.cuda.current_stream(self.device)
                    current.wait_stream(self._stream)
                    _record_stream(batch, current)
                # Read the next batch here (the data iterator stays on this thread), then
                # prepare it while the caller trains on this one.
                future = self._submit(reader.next(), reader)
                yield batch
        finally:
            if future is not None:
                # Stopped early (max_steps, an error): every rank stops at the same step, so
                # every rank's pending preparation completes its exchanges; wait for it.
                try:
                    future.result()
                except Exception:  # the caller's own error (if any) is the one that matters
                    logger.debug("rank %d: a batch prepared ahead failed", self.rank, exc_info=True)
            # A batch routed ahead but never trained (stopped early): drop its routing.
            self._collection.discard_prefetched()

    def close(self) -> None:
        """Stops the background thread and releases the pipeline's process group."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        if self._pg is not None:
            dist.destroy_process_group(self._pg)
            self._pg = None


def _record_stream(batch: Batch, stream: torch.cuda.Stream) -> None:
    tensors = [batch.dense, batch.labels, batch.sample_ids]
    for kjt in [batch.sparse, *(g.unique for g in batch.dedup_groups)]:
        tensors += [kjt.values, kjt.lengths, kjt.weights]
    tensors += [g.inverse for g in batch.dedup_groups]
    for t in tensors:
        if t is not None and t.device.type == "cuda":
            t.record_stream(stream)
