"""The examples of one partition of users, vectorized: what each Ray task of
:mod:`raydlrm.ingestion.sequences` runs on the events of the users hashed to its partition.

A partition's events are sorted by (user, time, log row): an event's history is the run of the
user's events just before it in that order, so each example's history is a slice
``[row - length, row)`` of the sorted events, gathered for every example of a row group at once
(no per-user or per-row Python loop). Everything here is plain pyarrow and NumPy (no Ray), so
the tests compare it with a plain Python reference directly.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from raydlrm.ingestion.sequences_config import (
    LABEL_COLUMN,
    SPLITS,
    SequenceBuildConfig,
    history_column,
)

__all__ = ["SEQ_COLUMN", "Cutoffs", "PartitionExamples", "build_examples", "write_partition"]

SEQ_COLUMN = "_seq"
"""The event's row in the log (files in path order, then rows in file order): the tie-break of
events of one user at the same time."""
_TRAIN, _VALID, _TEST = range(3)


@dataclass(frozen=True)
class Cutoffs:
    """The times of a time split: events at or after ``test`` are test events, those at or
    after ``valid`` (and before ``test``) validation events; ``valid`` None: none."""

    test: pa.Scalar
    valid: pa.Scalar | None = None


@dataclass(frozen=True)
class PartitionExamples:
    """A partition's events, sorted, and its examples.

    Attributes:
        events: the events, sorted by (user, time, log row); items as rows when remapped.
        split: ``(n,)`` int8, each event's split (0 train, 1 valid, 2 test).
        lengths: ``(n,)`` int64, the history length of each event as a target.
        user_start: ``(n,)`` int64, the index of the user's first event.
        examples: per split, the example events' indices, ascending.
        short: per split, the events that would be examples but have a history shorter than
            ``min_history``.
    """

    events: pa.Table
    split: np.ndarray
    lengths: np.ndarray
    user_start: np.ndarray
    examples: list[np.ndarray]
    short: list[int]


def _array(column: pa.ChunkedArray | pa.Array) -> pa.Array:
    return column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column


def _numpy(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    return _array(column).to_numpy(zero_copy_only=False)


def _sorted(events: pa.Table, config: SequenceBuildConfig) -> pa.Table:
    keys = [(config.user_column, "ascending"), (config.time_column, "ascending")]
    order = pc.sort_indices(events, sort_keys=[*keys, (SEQ_COLUMN, "ascending")])
    return events.take(order).combine_chunks()


def _remapped(events: pa.Table, config: SequenceBuildConfig, catalogue: pa.Array | None):
    """``events`` with the item column as dense rows (``catalogue``: the sorted distinct ids)."""
    if catalogue is None:
        return events
    column = config.item_column
    rows = pc.index_in(events.column(column), value_set=catalogue)
    assert rows.null_count == 0, "an item id outside the catalogue"
    index = events.column_names.index(column)
    return events.set_column(index, column, rows.cast(pa.int64()))


def _splits(
    events: pa.Table,
    config: SequenceBuildConfig,
    *,
    cutoffs: Cutoffs | None,
    position: np.ndarray,
    counts: np.ndarray,
) -> np.ndarray:
    """Each event's split, ``(n,)`` int8: monotone along each user's events."""
    if config.split == "leave_last_out":
        from_end = counts - 1 - position
        split = np.where(from_end == 0, _TEST, np.where(from_end == 1, _VALID, _TRAIN))
        return np.where(counts >= 3, split, _TRAIN).astype(np.int8)
    assert cutoffs is not None
    times = events.column(config.time_column)
    split = np.where(_numpy(pc.greater_equal(times, cutoffs.test)), _TEST, _TRAIN)
    if cutoffs.valid is not None:
        valid = _numpy(pc.greater_equal(times, cutoffs.valid)) & (split == _TRAIN)
        split[valid] = _VALID
    return split.astype(np.int8)


def build_examples(
    events: pa.Table,
    *,
    config: SequenceBuildConfig,
    cutoffs: Cutoffs | None = None,
    catalogue: pa.Array | None = None,
) -> PartitionExamples:
    """The examples of a partition: whole users' events (the log columns and
    :data:`SEQ_COLUMN`, no nulls).

    Args:
        events: every event of the partition's users, in any order.
        config: the build (columns, split, examples, lengths).
        cutoffs: the times of a time split (``split = "time"``).
        catalogue: the sorted distinct item ids (``item_ids = "rows"``): an item's row is its
            index in it; None keeps the ids.

    Returns:
        The sorted events and, per split, the examples.
    """
    events = _sorted(_remapped(events, config, catalogue), config)
    n = events.num_rows
    users = events.column(config.user_column)
    new_user = np.ones(n, dtype=bool)
    if n > 1:
        new_user[1:] = ~_numpy(pc.equal(users.slice(1), users.slice(0, n - 1)))
    first = np.flatnonzero(new_user)
    counts = np.diff(np.append(first, n))
    user_start = np.repeat(first, counts)
    position = np.arange(n) - user_start
    split = _splits(
        events, config, cutoffs=cutoffs, position=position, counts=np.repeat(counts, counts)
    )
    candidate = np.ones(n, dtype=bool)
    if config.examples == "last":  # the last event of each run of a user's split
        candidate[:-1] = new_user[1:] | (split[1:] != split[:-1])
    lengths = np.minimum(position, config.max_length)
    long_enough = lengths >= config.min_history
    examples = [np.flatnonzero(candidate & long_enough & (split == s)) for s in range(3)]
    short = [int((candidate & ~long_enough & (split == s)).sum()) for s in range(3)]
    return PartitionExamples(
        events=events,
        split=split,
        lengths=lengths,
        user_start=user_start,
        examples=examples,
        short=short,
    )


def example_tables(
    built: PartitionExamples, split: int, *, config: SequenceBuildConfig
) -> Iterator[pa.Table]:
    """The examples of ``split`` (0 train, 1 valid, 2 test), ``config.row_group_rows`` at a
    time: the target's columns, ``label``, then the histories (oldest event first)."""
    events = built.events
    chosen = built.examples[split]
    for begin in range(0, chosen.size, config.row_group_rows):
        rows = chosen[begin : begin + config.row_group_rows]
        lengths = built.lengths[rows]
        offsets = np.zeros(rows.size + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        # Index of every history event: the example's first history event, plus its position.
        starts = np.repeat(rows - lengths, lengths)
        within = np.arange(offsets[-1]) - np.repeat(offsets[:-1], lengths)
        gather = pa.array(starts + within)
        take = pa.array(rows)
        columns = {c: _array(events.column(c)).take(take) for c in config.target_columns()}
        if config.label_column is not None:
            scores = _array(events.column(config.label_column)).take(take)
            columns[LABEL_COLUMN] = pc.greater_equal(scores, config.label_min).cast(pa.int64())
        list_offsets = pa.array(offsets.astype(np.int32))
        for c in config.history_columns():
            values = _array(events.column(c)).take(gather)
            columns[history_column(c)] = pa.ListArray.from_arrays(list_offsets, values)
        yield pa.table(columns)


def write_partition(
    built: PartitionExamples,
    *,
    config: SequenceBuildConfig,
    partition: int,
    filesystem: pafs.FileSystem,
    root: str,
) -> dict[str, int]:
    """Writes the partition's examples, ``<root>/<split>/part-<partition>.parquet`` per split
    that has any (a rerun of the task writes the same files), and returns its counts: events,
    users, and per split ``rows_<split>``, ``users_<split>``, ``short_<split>``."""
    counts = {"events": built.events.num_rows, "users": int(np.unique(built.user_start).size)}
    for code, name in enumerate(SPLITS):
        rows = built.examples[code]
        counts[f"rows_{name}"] = int(rows.size)
        counts[f"users_{name}"] = int(np.unique(built.user_start[rows]).size)
        counts[f"short_{name}"] = built.short[code]
        if not rows.size:
            continue
        filesystem.create_dir(f"{root}/{name}", recursive=True)
        path = f"{root}/{name}/part-{partition:05d}.parquet"
        writer = None
        with filesystem.open_output_stream(path) as sink:
            for table in example_tables(built, code, config=config):
                if writer is None:
                    writer = pq.ParquetWriter(sink, table.schema)
                writer.write_table(table, row_group_size=config.row_group_rows)
            writer.close()
    return counts
