"""Row-group reading with exactly-once epochs: which worker reads what, in which order.

The unit of reading is a Parquet row group (:class:`RowGroup`, listed from the footers by the
driver). Every epoch, :func:`assign_row_groups` shuffles the row groups with a seed derived from
``(training.seed, epoch)`` and deals them to the workers, each to the worker with the fewest rows
so far: every row group, hence every row, goes to exactly one worker per epoch, the split is
as even as row groups allow, and the same seed gives the same assignment and order on every run.

Each worker then streams its row groups through its own Ray Data pipeline
(:class:`WorkerSource`): a dataset of *shuffle windows* (:func:`assign_windows`: consecutive row
groups of the worker's, at most ``data.shuffle_window_rows`` rows each) mapped by
:class:`RowGroupReader` on an actor pool. The reader reads each row group (only the needed
columns), tags the rows with their file, row group and position (for bad-input messages),
applies the bad-input policy, shuffles its units (sessions of ``data.session_column``, so
deduplication inside a batch keeps paying; else rows), preprocesses, and merges the window's row
groups by random keys (:func:`_unit_keys`): a uniformly random order of the window's rows, so
that data written sorted (by user, by time) is mixed across row groups. Without a window (0),
each row group is a window of its own and only its sessions are shuffled. Output order is
preserved, so a worker's batches are reproducible too.

A worker that runs out of rows before the others keeps stepping with empty batches (see
``raydlrm.trainers.loop``) instead of the others dropping their last rows.

Session-clustered data (``raydlrm.ingestion.clustered``; the schema says so) is read by
:class:`SessionGroupReader`: a samples row group with its sessions row group, the per-session
columns (user features) checked and hashed once per session. It cuts the training batches
itself, ``data.batch_size`` samples inside one row group (the last one smaller), and gives each
its per-session columns as Arrow dictionary arrays holding exactly that batch's sessions: the
unique values and inverse index RecD looks up and sends. Arrow cannot unify dictionaries of
lists, so batches must never be merged: each is yielded as its own table, which Ray Data keeps as
one chunk (record batch) of the output block, and :meth:`WorkerSource.iter_batches` hands the
chunks on one by one (``iter_batches(batch_size=None)``: blocks pass through unchanged). A block
that Ray Data slices to its size limit (rows of a row group beyond ~128 MB) splits a batch in
two, each still whole in itself.

Data position (exactly-once resume): every output row carries the id of its row group (its
index in the data set's list) and the row group's row count after preprocessing. The trainer
counts, per row group, the rows it has trained on (:class:`EpochProgress`); a checkpoint holds
those counts of every worker. On resume, :func:`assign_windows` leaves out the finished row
groups and tells each reader how many leading rows of a started one to skip (its rows come in
the same order every time: the shuffle and the merge keys are seeded by the row group, not the
worker, and a window's trained rows are a head of each of its row groups). With the world size
of the checkpoint each worker keeps its own windows, so the run continues with exactly the
batches it would have had; with another world size the remaining rows are dealt and cut into
windows anew, still each row once. A resumed epoch is read with the window it began with
(:attr:`EpochProgress.window_rows`).
"""

from __future__ import annotations

import dataclasses
import logging
import zlib
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from raydlrm.ingestion.badinput import (
    FILE_COLUMN,
    ROW_COLUMN,
    ROW_GROUP_COLUMN,
    BadInputError,
    quarantine_source,
)
from raydlrm.ingestion.config import DataConfig
from raydlrm.ingestion.layout import layout_of, relative_path
from raydlrm.ingestion.preprocess import Preprocessor, SessionRows
from raydlrm.ingestion.schema import SAMPLE_ID_COLUMN, DataSummary, RowGroup
from raydlrm.ingestion.sessions import session_starts
from raydlrm.storage import filesystem_for

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = [
    "PREPROCESS_ACTOR_CPUS",
    "RG_ID_COLUMN",
    "RG_ROWS_COLUMN",
    "WINDOW_COPIES",
    "EpochProgress",
    "RowGroupReader",
    "SessionGroupReader",
    "WorkerSource",
    "assign_row_groups",
    "assign_windows",
    "default_num_actors",
    "empty_raw_table",
    "epoch_rng",
    "read_columns",
    "reader_class",
    "window_bytes",
]

logger = logging.getLogger(__name__)

PREPROCESS_ACTOR_CPUS = 0.5
"""Ray ``num_cpus`` of a preprocessing (or scoring) actor: on a small machine two of them share
a core, leaving CPU for Ray Data's read tasks and the training workers."""
_MAX_AUTO_ACTORS = 4


def default_num_actors() -> int:
    """Preprocessing actors for this cluster: half its CPUs, between 1 and 4."""
    import os

    import ray

    if ray.is_initialized():
        cpus = int(ray.cluster_resources().get("CPU", 1))
    else:
        cpus = os.cpu_count() or 1
    return max(1, min(_MAX_AUTO_ACTORS, cpus // 2))


RG_ID_COLUMN = "__rg_id"
"""Index of the row's row group in the data set's list of row groups."""
RG_ROWS_COLUMN = "__rg_rows"
"""Rows of the row's row group after preprocessing (bad rows quarantined)."""


class EpochProgress:
    """Rows trained on per row group in the current epoch, by one worker or merged over all.

    ``consumed[id]`` counts the rows of row group ``id`` trained on so far (including rows
    skipped because an earlier run trained on them); ``totals[id]`` is its row count after
    preprocessing, known once one of its rows was seen; ``window_rows`` is the shuffle window
    the epoch is read with (``data.shuffle_window_rows`` when it started: a resumed epoch
    keeps it, so that its rows keep their order).
    """

    def __init__(
        self,
        epoch: int = 0,
        consumed: dict | None = None,
        totals: dict | None = None,
        *,
        window_rows: int = 0,
    ):
        self.epoch = epoch
        self.window_rows = window_rows
        self.consumed: dict[int, int] = {int(k): int(v) for k, v in (consumed or {}).items()}
        self.totals: dict[int, int] = {int(k): int(v) for k, v in (totals or {}).items()}

    @staticmethod
    def rows_of(table: pa.Table) -> dict[int, tuple[int, int]]:
        """The rows of a batch (a table with the row-group columns) per row group:
        ``{id: (rows in the batch, the row group's total rows)}``; empty without the columns."""
        if RG_ID_COLUMN not in table.column_names or not table.num_rows:
            return {}
        ids = table.column(RG_ID_COLUMN).to_numpy()
        totals = table.column(RG_ROWS_COLUMN).to_numpy()
        unique, first, counts = np.unique(ids, return_index=True, return_counts=True)
        return {
            i: (n, int(totals[f]))
            for i, f, n in zip(unique.tolist(), first.tolist(), counts.tolist(), strict=True)
        }

    def add(self, rows: dict[int, tuple[int, int]]) -> None:
        """Counts a batch's rows (:meth:`rows_of`) as trained."""
        for i, (n, total) in rows.items():
            self.consumed[i] = self.consumed.get(i, 0) + n
            self.totals[i] = total

    def finished(self) -> set[int]:
        return {i for i, n in self.consumed.items() if n >= self.totals.get(i, n + 1)}

    def to_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "window_rows": self.window_rows,
            "consumed": {str(k): v for k, v in sorted(self.consumed.items())},
            "totals": {str(k): v for k, v in sorted(self.totals.items())},
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EpochProgress:
        # A checkpoint made before shuffle windows read its epoch without one.
        return cls(
            d["epoch"], d.get("consumed"), d.get("totals"), window_rows=d.get("window_rows", 0)
        )

    @classmethod
    def merged(cls, parts: list[EpochProgress]) -> EpochProgress:
        """The progress of all workers (each row group is read by one worker per epoch; a
        worker may also hold an older count of another's row group, from the checkpoint it
        resumed: the largest count wins)."""
        out = cls(parts[0].epoch if parts else 0, window_rows=parts[0].window_rows if parts else 0)
        for p in parts:
            for i, n in p.consumed.items():
                out.consumed[i] = max(out.consumed.get(i, 0), n)
            out.totals.update(p.totals)
        return out


def epoch_rng(seed: int, epoch: int, *salt: int) -> np.random.Generator:
    """The random stream of ``(seed, epoch, *salt)``: the same on every machine and run."""
    return np.random.default_rng([seed, epoch, *salt])


def _deal(
    groups: list[RowGroup], order: list[int], world_size: int, skip: dict[int, int]
) -> list[list[tuple[int, int]]]:
    assigned: list[list[tuple[int, int]]] = [[] for _ in range(world_size)]
    rows = [0] * world_size
    for i in order:
        rank = min(range(world_size), key=lambda r: (rows[r], r))
        assigned[rank].append((i, skip.get(i, 0)))
        rows[rank] += max(groups[i].num_rows - skip.get(i, 0), 0)
    return assigned


def assign_row_groups(
    groups: list[RowGroup],
    *,
    world_size: int,
    seed: int,
    epoch: int,
    shuffle: bool,
    resume: EpochProgress | None = None,
    resume_world_size: int | None = None,
) -> list[list[tuple[int, int]]]:
    """Deals the row groups of one epoch to the workers.

    Args:
        groups: every row group of the data set.
        world_size: number of workers.
        seed: the job's seed.
        epoch: the epoch (a different order every epoch when ``shuffle``).
        shuffle: shuffle the row groups first (training); keep file order otherwise (eval).
        resume: the progress of this epoch saved by a checkpoint, merged over its workers.
        resume_world_size: the world size that made ``resume``.

    Returns:
        For each worker, ``(row group id, rows to skip)`` in reading order. Every row group
        appears exactly once (finished ones of ``resume`` not at all); each goes to the worker
        with the fewest rows so far (ties: the lowest rank). With ``resume`` from the same world
        size, each worker keeps the row groups it had.
    """
    order = list(range(len(groups)))
    if shuffle:
        order = epoch_rng(seed, epoch).permutation(len(groups)).tolist()
    if resume is None or resume.epoch != epoch:
        return _deal(groups, order, world_size, {})
    finished = resume.finished()
    skip = {i: n for i, n in resume.consumed.items() if i not in finished}
    if resume_world_size == world_size:
        return [
            [(i, skip.get(i, 0)) for i, _ in mine if i not in finished]
            for mine in _deal(groups, order, world_size, {})
        ]
    return _deal(groups, [i for i in order if i not in finished], world_size, skip)


def _in_windows(
    groups: list[RowGroup], items: list[tuple[int, int]], window_rows: int
) -> list[list[tuple[int, int]]]:
    """``items`` (row group, rows to skip) cut into windows of consecutive items holding at
    most ``window_rows`` rows to read (at least one item each)."""
    windows: list[list[tuple[int, int]]] = []
    held = 0
    for i, skip in items:
        rows = max(groups[i].num_rows - skip, 0)
        if not windows or held + rows > window_rows:
            windows.append([])
            held = 0
        windows[-1].append((i, skip))
        held += rows
    return windows


def assign_windows(
    groups: list[RowGroup],
    *,
    world_size: int,
    seed: int,
    epoch: int,
    shuffle: bool,
    window_rows: int,
    resume: EpochProgress | None = None,
    resume_world_size: int | None = None,
) -> list[list[list[tuple[int, int]]]]:
    """The row groups of one epoch dealt to the workers (:func:`assign_row_groups`), each
    worker's cut into shuffle windows of at most ``window_rows`` rows; one row group per window
    when not shuffling or ``window_rows`` is 0.

    Resuming with the checkpoint's world size, the windows are those of the epoch as it began,
    less the finished row groups, each started one skipping its trained rows: a window's rows
    then come in the order they had, less the trained ones (see :class:`RowGroupReader`). With
    another world size, the remaining rows are dealt and cut into windows anew.
    """
    resumed = resume is not None and resume.epoch == epoch
    deal = {"world_size": world_size, "seed": seed, "epoch": epoch, "shuffle": shuffle}
    off = not shuffle or window_rows == 0
    if off or (resumed and resume_world_size != world_size):
        dealt = assign_row_groups(
            groups, **deal, resume=resume, resume_world_size=resume_world_size
        )
        if off:
            return [[[item] for item in worker] for worker in dealt]
        return [_in_windows(groups, worker, window_rows) for worker in dealt]
    whole = [_in_windows(groups, w, window_rows) for w in assign_row_groups(groups, **deal)]
    if not resumed:
        return whole
    assert resume is not None
    finished = resume.finished()
    out: list[list[list[tuple[int, int]]]] = []
    for worker in whole:
        left = [[(i, resume.consumed.get(i, 0)) for i, _ in w if i not in finished] for w in worker]
        out.append([window for window in left if window])
    return out


WINDOW_COPIES = 4
"""Copies of a shuffle window's rows a preprocessing actor holds at its peak: the raw rows,
the preprocessed ones, their concatenation and the reordered window."""


def window_bytes(summary: DataSummary, config: DataConfig) -> int:
    """The memory one preprocessing actor needs for a shuffle window of ``summary``'s rows:
    :data:`WINDOW_COPIES` times the window's rows (at most the data set's) at the bytes per row
    of the first file's first row group, uncompressed (one footer read); 0 when off."""
    rows = min(config.shuffle_window_rows, summary.num_rows)
    if not rows or not summary.row_groups:
        return 0
    first = summary.row_groups[0]
    filesystem, _ = filesystem_for(summary.path, config.storage)
    with filesystem.open_input_file(first.file) as f:
        metadata = pq.ParquetFile(f).metadata.row_group(first.index)
    per_row = metadata.total_byte_size / max(1, metadata.num_rows)
    return int(WINDOW_COPIES * rows * per_row)


def _session_units(
    table: pa.Table, column: str, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Row order with the sessions (runs of equal ``column`` values) permuted, each kept whole,
    and the sessions' lengths in that order."""
    sessions = table.column(column).to_numpy()
    if sessions.size == 0:
        return np.arange(0), np.arange(0)
    starts = np.flatnonzero(session_starts(sessions))
    ends = np.append(starts[1:], sessions.size)
    perm = rng.permutation(starts.size)
    lengths = (ends - starts)[perm]
    # Row indices of the permuted sessions, vectorized: each session's start repeated over its
    # length, plus the position inside the session.
    first = np.repeat(starts[perm], lengths)
    offsets = np.repeat(np.cumsum(lengths) - lengths, lengths)
    return first + (np.arange(lengths.sum()) - offsets), lengths


def _session_order(table: pa.Table, column: str, rng: np.random.Generator) -> np.ndarray:
    """Row order with the sessions (runs of equal ``column`` values) permuted, each kept whole."""
    return _session_units(table, column, rng)[0]


def _unit_keys(lengths: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Each row's key in a window's merge: one key per unit (a session, or a row), ascending
    over the units in their order, repeated over the unit's rows.

    Merging the row groups of a window by these keys (ties: the row group read first) gives a
    uniformly random interleaving of their units; with each row group's units in a uniformly
    random order, the window's order is uniformly random. A unit's rows share its key, so a
    session stays whole; and the rows a run has trained on are a head of each row group's order
    (those below the last trained key), so a resumed window skips them and merges the rest as
    it did.
    """
    return np.repeat(np.sort(rng.random(lengths.size)), lengths)


class _RowGroupFiles:
    """Reading one row group of a file, tagged, and shuffling its sessions: what both readers
    do before preprocessing."""

    def __init__(
        self,
        config: DataConfig,
        *,
        source_path: str,
        seed: int,
        epoch: int,
        shuffle: bool,
        tag: str | None,
    ) -> None:
        self.config = config
        self.seed, self.epoch, self.shuffle, self.tag = seed, epoch, shuffle, tag
        self.filesystem, self.root = filesystem_for(source_path, config.storage)

    def read(self, group: RowGroup, *, file: str, columns: list[str]) -> pa.Table | None:
        """Row group ``group.index`` of ``file`` (the group's file, or its sessions file),
        tagged with file, row group and row; None when it is unreadable and was quarantined
        (recorded as the group's, with its rows)."""
        try:
            with self.filesystem.open_input_file(file) as f:
                table = pq.ParquetFile(f).read_row_group(group.index, columns=columns)
        except (OSError, pa.ArrowException) as exc:
            reason = f"row group {group.index} of {file} is not readable: {exc}"
            if self.config.bad_input == "fail":
                raise BadInputError(reason) from exc
            quarantine_source(
                self.config,
                file=group.file,
                row_group=group.index,
                num_rows=group.num_rows,
                reason=reason,
                tag=self.tag,
            )
            return None
        n = table.num_rows
        table = table.append_column(FILE_COLUMN, pa.array([file] * n, pa.string()))
        table = table.append_column(ROW_GROUP_COLUMN, pa.array(np.full(n, group.index)))
        return table.append_column(ROW_COLUMN, pa.array(np.arange(n)))

    def rng(self, group: RowGroup, *salt: int) -> np.random.Generator:
        """The random stream of a row group in this epoch."""
        # Seeded by the file's path inside the data set, not where the data set lies: the
        # same data copied elsewhere trains to the same model.
        path = zlib.crc32(relative_path(group.file, self.root).encode())
        return epoch_rng(self.seed, self.epoch, path, group.index, *salt)

    def shuffled(self, table: pa.Table, *, group: RowGroup, column: str | None) -> pa.Table:
        """``table`` with its sessions (runs of ``column``) in this epoch's order, when
        shuffling and the data has the column."""
        if not self.shuffle or column is None or column not in table.column_names:
            return table
        return table.take(pa.array(_session_order(table, column, self.rng(group))))

    def units(
        self, table: pa.Table, *, group: RowGroup, column: str | None
    ) -> tuple[np.ndarray, np.ndarray]:
        """For a shuffle window: the row order of ``table`` with its units (sessions of
        ``column`` when the data has it, else rows) permuted, and each row's merge key
        (:func:`_unit_keys`)."""
        rng = self.rng(group)
        if column is not None and column in table.column_names:
            order, lengths = _session_units(table, column, rng)
        else:
            order, lengths = rng.permutation(table.num_rows), np.ones(table.num_rows, np.int64)
        return order, _unit_keys(lengths, self.rng(group, _KEYS))


_KEYS = 1
"""Salt of a row group's stream of merge keys (apart from its shuffle's)."""


def _merge_order(keys: list[np.ndarray]) -> np.ndarray:
    """The order of a window's rows (its row groups' rows concatenated) by their keys."""
    return np.argsort(np.concatenate(keys), kind="stable")


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
    refs, :func:`assign_windows`). Without a shuffle window, each row group's rows are
    preprocessed in its order of sessions and the head of ``skip`` rows left out. With one, the
    rows of a window's row groups are merged in a uniformly random order, drawn from the seed,
    the epoch and each row group (:func:`_unit_keys`).
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
        self.files = _RowGroupFiles(
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
        return [table.take(pa.array(_merge_order([k for _, k in parts])))]

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
    :class:`WorkerSource` hands the chunks on one by one, so no two batches' dictionaries
    meet (Arrow cannot unify dictionaries of lists). A resumed row group's skipped rows are
    whole batches (training counts whole batches), so its batches are cut as before.
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
            _unit_keys(_run_lengths(rows.session_of), self.files.rng(group, _KEYS))[skip:]
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


def _run_lengths(values: np.ndarray) -> np.ndarray:
    """The lengths of the runs of equal adjacent ``values``, in order."""
    return np.diff(np.append(np.flatnonzero(session_starts(values)), values.size))


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
    order = _merge_order(keys)
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


class WorkerSource:
    """One worker's data, one epoch per :meth:`iter_batches` call (a ``DataIterator``-like).

    Args:
        groups: every row group of the data set.
        config: the data config.
        source_path: the data set's path.
        rank: this worker.
        world_size: number of workers.
        seed: the job's seed.
        shuffle: shuffle row groups and sessions every epoch (training).
        num_actors: size of the preprocessing actor pool of each epoch.
        schema: the data set's raw schema.
        quarantine_tag: the run's tag for this data set
            (:func:`~raydlrm.ingestion.badinput.run_tag`); epoch ``e``'s quarantine records
            are tagged ``<quarantine_tag>-e<e>``.
    """

    def __init__(
        self,
        groups: list[RowGroup],
        config: DataConfig,
        *,
        source_path: str,
        rank: int,
        world_size: int,
        seed: int,
        shuffle: bool,
        num_actors: int,
        schema: pa.Schema,
        quarantine_tag: str | None = None,
    ) -> None:
        self.groups, self.config, self.source_path = groups, config, source_path
        self.quarantine_tag = quarantine_tag
        self.rank, self.world_size, self.seed, self.shuffle = rank, world_size, seed, shuffle
        self.num_actors, self.schema = num_actors, schema
        self.columns = read_columns(config, schema)
        self.clustered = layout_of(schema) is not None
        self.epoch = 0
        self.resume: EpochProgress | None = None
        self.resume_world_size: int | None = None

    def start(self, epoch: int, *, resume: EpochProgress | None, world_size: int | None) -> None:
        """Makes the next :meth:`iter_batches` read ``epoch``, resuming a checkpoint's progress
        in it (made by ``world_size`` workers) when given."""
        self.epoch, self.resume, self.resume_world_size = epoch, resume, world_size

    def window_rows(self, epoch: int) -> int:
        """The shuffle window ``epoch`` is read with: ``data.shuffle_window_rows``, or the
        window of the checkpoint's progress when resuming in it (0 when not shuffling)."""
        if not self.shuffle:
            return 0
        if self.resume is not None and self.resume.epoch == epoch:
            return self.resume.window_rows
        return self.config.shuffle_window_rows

    def windows(self, epoch: int) -> list[list[tuple[int, int]]]:
        """This worker's shuffle windows of ``epoch``, each its ``(row group id, rows to
        skip)``, in reading order (:func:`assign_windows`)."""
        return assign_windows(
            self.groups,
            world_size=self.world_size,
            seed=self.seed,
            epoch=epoch,
            shuffle=self.shuffle,
            window_rows=self.window_rows(epoch),
            resume=self.resume,
            resume_world_size=self.resume_world_size,
        )[self.rank]

    def empty_table(self) -> pa.Table:
        """A preprocessed table of 0 rows (the structure of this data's batches)."""
        return reader_class(self.schema)(self.config, **self._reader_kwargs(0)).empty_table()

    def _reader_kwargs(self, epoch: int) -> dict[str, Any]:
        return {
            "source_path": self.source_path,
            "columns": self.columns,
            "schema": self.schema,
            "seed": self.seed,
            "epoch": epoch,
            "shuffle": self.shuffle,
            "tag": None if self.quarantine_tag is None else f"{self.quarantine_tag}-e{epoch}",
            "window_rows": self.window_rows(epoch),
        }

    def dataset(self, epoch: int) -> Any:
        """The lazy Ray dataset of this worker's preprocessed rows in ``epoch`` (None when the
        worker has no row groups in it)."""
        import ray.data

        mine = self.windows(epoch)
        if not mine:
            return None
        # Windows come out in the order they were dealt, so a run is reproducible.
        ray.data.DataContext.get_current().execution_options.preserve_order = True
        refs = ray.data.from_items(
            [
                {
                    "window": [
                        {"group": self.groups[i].to_dict(), "id": i, "skip": skip}
                        for i, skip in window
                    ]
                }
                for window in mine
            ],
            override_num_blocks=len(mine),
        )
        return refs.map_batches(
            reader_class(self.schema),
            fn_constructor_kwargs={"config": self.config, **self._reader_kwargs(epoch)},
            batch_size=1,
            batch_format="pyarrow",
            compute=ray.data.ActorPoolStrategy(
                min_size=1, max_size=max(1, min(self.num_actors, len(mine))), initial_size=1
            ),
            num_cpus=PREPROCESS_ACTOR_CPUS,
        )

    def iter_batches(self, **kwargs: Any) -> Iterator[pa.Table]:
        """This worker's batches of the next epoch (arguments as ``Dataset.iter_batches``).

        Session-clustered data: the readers' training batches, one table per record batch of
        each block (``batch_size`` is ignored: the readers cut batches of ``data.batch_size``
        inside each row group; a batch is never merged with another, whose per-session
        dictionaries could not be unified). Batches of 0 rows are left out.
        """
        epoch, self.epoch = self.epoch, self.epoch + 1
        dataset = self.dataset(epoch)
        self.resume = None  # a checkpoint's progress applies to its own epoch only
        if dataset is None:
            return
        if not self.clustered:
            yield from dataset.iter_batches(**kwargs)
            return
        blocks = dataset.iter_batches(**{**kwargs, "batch_size": None, "batch_format": "pyarrow"})
        for block in blocks:
            for batch in block.to_batches():
                if batch.num_rows:
                    yield pa.Table.from_batches([batch])
