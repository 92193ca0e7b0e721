"""What a preprocessing actor does with a worker's shuffle windows: read, shuffle, preprocess.

:class:`RowGroupReader` (a Ray Data ``map_batches`` callable class, run on the worker's actor
pool, see ``raydlrm.ingestion.reader.WorkerSource``) reads each row group of a window (only the
needed columns), tags the rows with their file, row group and position (for bad-input
messages), applies the bad-input policy, shuffles its units (sessions of
``data.session_column``, so deduplication inside a batch keeps paying; else rows),
preprocesses, and merges the window's row groups by random keys
(:func:`~raydlrm.ingestion._shuffle.unit_keys`): a uniformly random order of the window's rows,
so that data written sorted (by user, by time) is mixed across row groups. Without a window
(0), each row group is a window of its own and only its sessions are shuffled. Every output row
carries its row group's id and row count (:data:`RG_ID_COLUMN`, :data:`RG_ROWS_COLUMN`): the
data position the trainer counts (``raydlrm.ingestion.reader.EpochProgress``).

Session-clustered data (``raydlrm.ingestion.clustered``; the schema says so) is read by
:class:`SessionGroupReader`: a samples row group with its sessions row group, the per-session
columns (user features) checked and hashed once per session. It cuts the training batches
itself, ``data.batch_size`` samples inside one row group (the last one smaller), and gives each
its per-session columns as Arrow dictionary arrays holding exactly that batch's sessions: the
unique values and inverse index RecD looks up and sends. Arrow cannot unify dictionaries of
lists, so batches must never be merged: each is yielded as its own table, which Ray Data keeps as
one chunk (record batch) of the output block, and ``WorkerSource.iter_batches`` hands the
chunks on one by one (``iter_batches(batch_size=None)``: blocks pass through unchanged). A block
that Ray Data slices to its size limit (rows of a row group beyond ~128 MB) splits a batch in
two, each still whole in itself.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from raydlrm.ingestion._shuffle import (
    KEYS_SALT,
    RowGroupFiles,
    merge_order,
    run_lengths,
    unit_keys,
)
from raydlrm.ingestion.badinput import FILE_COLUMN, ROW_COLUMN, ROW_GROUP_COLUMN
from raydlrm.ingestion.config import DataConfig
from raydlrm.ingestion.layout import layout_of
from raydlrm.ingestion.preprocess import Preprocessor, SessionRows
from raydlrm.ingestion.schema import SAMPLE_ID_COLUMN, RowGroup

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = [
    "RG_ID_COLUMN",
    "RG_ROWS_COLUMN",
    "RowGroupReader",
    "SessionGroupReader",
    "empty_raw_table",
    "read_columns",
    "reader_class",
]

RG_ID_COLUMN = "__rg_id"
"""Index of the row's row group in the data set's list of row groups."""
RG_ROWS_COLUMN = "__rg_rows"
"""Rows of the row's row group after preprocessing (bad rows quarantined)."""


class RowGroupReader:
    """Reads, tags, shuffles and preprocesses row groups (a ``map_batches`` callable class).

    Args:
        config: the data config.
        source_path: the data set's path (local or a URI; picks the filesystem).
        columns: the raw columns to read (projection pushed into the Parquet reader).
        schema: the data set's raw schema (gives an empty batch its types).
        seed: the job's seed.
        epoch: the epoch (seeds the session shuffle).
        shuffle: shuffle each row group's sessions.
        tag: the pass, ``<run>.<role>-e<epoch>``, that names its quarantine records (a row
            group read again after a restart overwrites its record; None: records kept apart).
        window_rows: the shuffle window (``data.shuffle_window_rows``; 0: off).

    Each call reads a table of windows (column ``window``: a list of ``{group, id, skip}``
    refs, :func:`~raydlrm.ingestion.reader.assign_windows`). Without a shuffle window, each row
    group's rows are preprocessed in its order of sessions and the head of ``skip`` rows left
    out. With one, the rows of a window's row groups are merged in a uniformly random order,
    drawn from the seed, the epoch and each row group
    (:func:`~raydlrm.ingestion._shuffle.unit_keys`).
    """

    def __init__(
        self,
        config: DataConfig,
        *,
        source_path: str,
        columns: list[str],
        schema: pa.Schema,
        seed: int,
        epoch: int,
        shuffle: bool,
        tag: str | None = None,
        window_rows: int = 0,
    ) -> None:
        self.config = config
        self.columns = columns
        self.schema = schema
        self.window_rows = window_rows if shuffle else 0
        self.files = RowGroupFiles(
            config, source_path=source_path, seed=seed, epoch=epoch, shuffle=shuffle, tag=tag
        )
        self.preprocess = Preprocessor(config, quarantine_tag=tag)

    def __call__(self, refs: pa.Table) -> pa.Table:
        tables = []
        for window in refs.column("window").to_pylist():
            if self.window_rows:
                tables.extend(self._mixed(window))
            else:
                tables.extend(t for ref in window if (t := self._alone(ref)) is not None)
        if not tables:
            return self.empty_table()
        return pa.concat_tables(tables) if len(tables) > 1 else tables[0]

    def _alone(self, ref: dict[str, Any]) -> pa.Table | None:
        """A row group read without a shuffle window: its sessions in this epoch's order,
        preprocessed and tagged with their position, less the skipped head; None when it is
        unreadable or empty."""
        group = RowGroup(**ref["group"])
        table = self.files.read(group, file=group.file, columns=self.columns)
        if table is None or not table.num_rows:
            return None
        table = self.files.shuffled(table, group=group, column=self.config.session_column)
        out = self.preprocess(table)
        total = out.num_rows
        return _with_position(out, ref["id"], total).slice(min(ref["skip"], total))

    def _mixed(self, window: list[dict[str, Any]]) -> list[pa.Table]:
        """A window's rows, merged in their random order (none, or one table)."""
        parts = [part for ref in window if (part := self._part(ref)) is not None]
        if not parts:
            return []
        table = pa.concat_tables([t for t, _ in parts]) if len(parts) > 1 else parts[0][0]
        return [table.take(pa.array(merge_order([k for _, k in parts])))]

    def _part(self, ref: dict[str, Any]) -> tuple[pa.Table, np.ndarray] | None:
        """One row group of a window: its good rows preprocessed, in this epoch's order of its
        units and tagged with their position, less the skipped head, and their merge keys;
        None when it is unreadable or empty."""
        group = RowGroup(**ref["group"])
        table = self.files.read(group, file=group.file, columns=self.columns)
        if table is None or not table.num_rows:
            return None
        # Bad rows first: the keys are drawn for the rows that are trained on.
        table = self.preprocess.clean(table)
        order, keys = self.files.units(table, group=group, column=self.config.session_column)
        out = self.preprocess.process(table.take(pa.array(order)))
        total = out.num_rows
        skip = min(ref["skip"], total)
        return _with_position(out, ref["id"], total).slice(skip), keys[skip:]

    def empty_table(self) -> pa.Table:
        """A preprocessed table of 0 rows (the structure of this data's batches)."""
        return _with_position(self.preprocess(empty_raw_table(self.schema, self.columns)), -1, 0)


class SessionGroupReader(RowGroupReader):
    """:class:`RowGroupReader` for session-clustered data (a ``map_batches`` callable class
    whose calls are generators): reads a samples row group with its sessions row group,
    shuffles the sessions, preprocesses the per-session columns once per session and yields
    training batches of ``data.batch_size`` samples (a row group's last one smaller), each a
    table whose per-session columns are dictionary arrays of exactly its sessions.

    Each yielded table stays one chunk (record batch) of its Ray Data block, and the worker's
    :class:`~raydlrm.ingestion.reader.WorkerSource` hands the chunks on one by one, so no two
    batches' dictionaries meet (Arrow cannot unify dictionaries of lists). A resumed row
    group's skipped rows are whole batches (training counts whole batches), so its batches are
    cut as before.
    Arguments as :class:`RowGroupReader`; ``schema`` is the marked training schema.
    """

    def __init__(self, config: DataConfig, *, columns: list[str], **kwargs: Any) -> None:
        super().__init__(config, columns=columns, **kwargs)
        layout = layout_of(self.schema)
        assert layout is not None, "a clustered data set's schema is marked with its layout"
        self.layout = layout
        per_session = set(layout.session_columns)
        self.sample_columns = [c for c in columns if c not in per_session]
        if layout.session_column not in self.sample_columns:
            self.sample_columns.append(layout.session_column)
        self.session_columns = [c for c in columns if c in per_session]

    def __call__(self, refs: pa.Table) -> Iterator[pa.Table]:
        empty = True
        size = self.config.batch_size
        for window in refs.column("window").to_pylist():
            for rows, start in self._window_rows(window):
                for first in range(start, rows.num_rows, size):
                    yield rows.batch(first, min(first + size, rows.num_rows))
                    empty = False
        if empty:
            yield self.empty_table()

    def _window_rows(self, window: list[dict[str, Any]]) -> list[tuple[SessionRows, int]]:
        """A window's rows, tagged with their position, each with the row its batches start
        at: without a shuffle window, each row group's rows after its skipped head; with one,
        the window's rows merged in their random order, sessions whole."""
        parts = []
        for ref in window:
            group = RowGroup(**ref["group"])
            rows = self._rows(group)
            if rows is None or not rows.num_rows:
                continue
            total = rows.num_rows
            parts.append((_positioned(rows, ref["id"], total), min(ref["skip"], total), group))
        if not self.window_rows:
            return [(rows, skip) for rows, skip, _ in parts]
        if not parts:
            return []
        keys = [
            unit_keys(run_lengths(rows.session_of), self.files.rng(group, KEYS_SALT))[skip:]
            for rows, skip, group in parts
        ]
        return [(_merged_sessions([(rows, skip) for rows, skip, _ in parts], keys), 0)]

    def _rows(self, group: RowGroup) -> SessionRows | None:
        """The row group's samples and sessions, preprocessed; None when unreadable."""
        assert group.sessions_file is not None, "a clustered data set's row groups have one"
        samples = self.files.read(group, file=group.file, columns=self.sample_columns)
        if samples is None:
            return None
        sessions = self.files.read(
            group,
            file=group.sessions_file,
            columns=[self.layout.session_column, *self.session_columns],
        )
        if sessions is None:
            return None
        samples = self.files.shuffled(samples, group=group, column=self.layout.session_column)
        return self._preprocess(samples, sessions)

    def _preprocess(self, samples: pa.Table, sessions: pa.Table) -> SessionRows:
        return self.preprocess.sessions(
            samples,
            sessions,
            session_column=self.layout.session_column,
            session_columns=self.session_columns,
        )

    def empty_table(self) -> pa.Table:
        """A preprocessed batch of 0 rows (the structure of this data's batches)."""
        samples = empty_raw_table(self.schema, self.sample_columns)
        sessions = empty_raw_table(self.schema, [self.layout.session_column, *self.session_columns])
        return _with_position(self._preprocess(samples, sessions).batch(0, 0), -1, 0)


def _positioned(rows: SessionRows, group_id: int, total: int) -> SessionRows:
    """``rows`` whose batches carry the row-group columns (:func:`_with_position`)."""
    return dataclasses.replace(
        rows,
        samples=_with_position(rows.samples, group_id, total),
        names=[*rows.names, RG_ID_COLUMN, RG_ROWS_COLUMN],
    )


def _merged_sessions(parts: list[tuple[SessionRows, int]], keys: list[np.ndarray]) -> SessionRows:
    """The rows of a window's row groups (each less its skipped head) in the order of their
    merge ``keys``, as one :class:`SessionRows` (its sessions: all of theirs)."""
    offsets = np.cumsum([0, *(rows.sessions.num_rows for rows, _ in parts[:-1])])
    session_of = np.concatenate(
        [rows.session_of[skip:] + o for (rows, skip), o in zip(parts, offsets, strict=True)]
    )
    order = merge_order(keys)
    samples = pa.concat_tables([rows.samples.slice(skip) for rows, skip in parts])
    return SessionRows(
        samples=samples.take(pa.array(order)).combine_chunks(),
        sessions=pa.concat_tables([rows.sessions for rows, _ in parts]).combine_chunks(),
        session_of=session_of[order],
        names=parts[0][0].names,
    )


def reader_class(schema: pa.Schema) -> type[RowGroupReader]:
    """The row-group reader of a data set of this (marked) training schema: a
    :class:`SessionGroupReader` for a session-clustered set, else a :class:`RowGroupReader`."""
    return SessionGroupReader if layout_of(schema) is not None else RowGroupReader


def _with_position(table: pa.Table, group_id: int, total: int) -> pa.Table:
    n = table.num_rows
    table = table.append_column(RG_ID_COLUMN, pa.array(np.full(n, group_id, dtype=np.int64)))
    return table.append_column(RG_ROWS_COLUMN, pa.array(np.full(n, total, dtype=np.int64)))


def empty_raw_table(schema: pa.Schema, columns: list[str]) -> pa.Table:
    """A table of 0 rows with the given columns of ``schema`` (and the reader's tags)."""
    table = schema.empty_table().select(columns)
    table = table.append_column(FILE_COLUMN, pa.array([], pa.string()))
    table = table.append_column(ROW_GROUP_COLUMN, pa.array([], pa.int64()))
    return table.append_column(ROW_COLUMN, pa.array([], pa.int64()))


def read_columns(config: DataConfig, schema: pa.Schema) -> list[str]:
    """The raw columns to read: the config's inputs, the session column and ``sample_id`` when
    the data has them."""
    columns = config.input_columns()
    for extra in (config.session_column, SAMPLE_ID_COLUMN):
        if extra is not None and extra in schema.names and extra not in columns:
            columns.append(extra)
    return columns
