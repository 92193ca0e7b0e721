"""A worker's data sources as the training loop and the evaluator see them.

A :class:`BatchSource` streams preprocessed Arrow batches (a Ray ``DataIterator`` is one; the
tests pass plain objects); an :class:`EpochSource` also knows epochs (it deals each epoch's
row groups, resuming from a data position) and can make an empty batch of its schema, for a
rank whose data ends before the others' (``raydlrm.ingestion.reader.WorkerSource``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

import pyarrow as pa

from raydlrm.batch import Batch
from raydlrm.ingestion.config import DataConfig
from raydlrm.ingestion.loader import arrow_to_batch
from raydlrm.ingestion.reader import EpochProgress

__all__ = ["BatchSource", "EpochSource", "HeldOutCache", "empty_batch_of"]


@runtime_checkable
class BatchSource(Protocol):
    """A worker's stream of preprocessed Arrow batches."""

    def iter_batches(self, **kwargs: Any) -> Iterator[pa.Table]: ...


@runtime_checkable
class EpochSource(BatchSource, Protocol):
    """A source that knows epochs and can make empty batches of its schema: :meth:`start`
    deals an epoch (resuming a checkpoint's progress in it) and returns the progress its
    trained rows are counted in (``raydlrm.ingestion.reader.WorkerSource.start``)."""

    def start(
        self, epoch: int, *, resume: EpochProgress | None, world_size: int | None
    ) -> EpochProgress: ...

    def empty_table(self) -> pa.Table: ...


def empty_batch_of(source: BatchSource, *, config: DataConfig) -> Batch | None:
    """An empty batch of ``source``'s structure, if the source can make one."""
    if not isinstance(source, EpochSource):
        return None
    return arrow_to_batch(source.empty_table(), config=config)


class HeldOutCache:
    """A held-out source's batches kept in memory after its first whole pass, when they fit
    ``budget_bytes`` (Arrow bytes): the evaluations after it read no file and start no
    preprocessing actors. Held-out data is read in file order, unshuffled, so every pass is the
    same batches. A pass cut short (``training.max_eval_batches``, an error) or over the budget
    keeps nothing, and the source is streamed again the next time."""

    def __init__(self, source: BatchSource, *, budget_bytes: int) -> None:
        self.source = source
        self.budget_bytes = budget_bytes
        self.tables: list[pa.Table] | None = None  # a whole pass, once one fit

    def iter_batches(self, **kwargs: Any) -> Iterator[pa.Table]:
        if self.tables is not None:
            yield from self.tables
            return
        kept: list[pa.Table] | None = [] if self.budget_bytes > 0 else None
        held = 0
        for table in self.source.iter_batches(**kwargs):
            if kept is not None:
                held += table.nbytes
                if held <= self.budget_bytes:
                    kept.append(table)
                else:
                    kept = None  # over the budget: this share is streamed every time
            yield table
        self.tables = kept  # reached only at the end of a whole pass
