"""Row-group reading with exactly-once epochs: which worker reads what, in which order.

The unit of reading is a Parquet row group (:class:`RowGroup`, listed from the footers by the
driver). Every epoch, :func:`assign_row_groups` shuffles the row groups with a seed derived from
``(training.seed, epoch)`` and deals them to the workers, each to the worker with the fewest rows
so far: every row group, hence every row, goes to exactly one worker per epoch, the split is
as even as row groups allow, and the same seed gives the same assignment and order on every run.

Each worker then streams its row groups through its own Ray Data pipeline
(:class:`WorkerSource`): a dataset of row-group references mapped by :class:`RowGroupReader` on an
actor pool, which reads one row group (only the needed columns), tags the rows with their file,
row group and position (for bad-input messages), shuffles the row group's *sessions* (samples of
one session stay together, so deduplication inside a batch keeps paying; the order of sessions
changes every epoch), applies the bad-input policy and preprocesses. Output order is preserved,
so a worker's batches are reproducible too.

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
those counts of every worker. On resume, :func:`assign_row_groups` leaves out the finished row
groups and tells each reader how many leading rows of a started one to skip (its rows come in
the same order every time: the session shuffle is seeded by the row group, not the worker). With
the world size of the checkpoint each worker keeps its own remaining row groups, so the run
continues with exactly the batches it would have had; with another world size the remaining
row groups are dealt anew, still each row once.
"""

from __future__ import annotations

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
from raydlrm.ingestion.schema import SAMPLE_ID_COLUMN, RowGroup
from raydlrm.storage import filesystem_for

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = [
    "PREPROCESS_ACTOR_CPUS",
    "RG_ID_COLUMN",
    "RG_ROWS_COLUMN",
    "EpochProgress",
    "RowGroupReader",
    "SessionGroupReader",
    "WorkerSource",
    "assign_row_groups",
    "default_num_actors",
    "empty_raw_table",
    "epoch_rng",
    "read_columns",
    "reader_class",
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
    preprocessing, known once one of its rows was seen.
    """

    def __init__(self, epoch: int = 0, consumed: dict | None = None, totals: dict | None = None):
        self.epoch = epoch
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
            "consumed": {str(k): v for k, v in sorted(self.consumed.items())},
            "totals": {str(k): v for k, v in sorted(self.totals.items())},
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EpochProgress:
        return cls(d["epoch"], d.get("consumed"), d.get("totals"))

    @classmethod
    def merged(cls, parts: list[EpochProgress]) -> EpochProgress:
        """The progress of all workers (each row group is read by one worker per epoch; a
        worker may also hold an older count of another's row group, from the checkpoint it
        resumed: the largest count wins)."""
        out = cls(parts[0].epoch if parts else 0)
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


def _session_order(table: pa.Table, column: str, rng: np.random.Generator) -> np.ndarray:
    """Row order with the sessions (runs of equal ``column`` values) permuted, each kept whole."""
    sessions = table.column(column).to_numpy()
    if sessions.size == 0:
        return np.arange(0)
    starts = np.flatnonzero(np.concatenate([[True], sessions[1:] != sessions[:-1]]))
    ends = np.append(starts[1:], sessions.size)
    perm = rng.permutation(starts.size)
    lengths = (ends - starts)[perm]
    # Row indices of the permuted sessions, vectorized: each session's start repeated over its
    # length, plus the position inside the session.
    first = np.repeat(starts[perm], lengths)
    offsets = np.repeat(np.cumsum(lengths) - lengths, lengths)
    return first + (np.arange(lengths.sum()) - offsets)


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

    def shuffled(self, table: pa.Table, *, group: RowGroup, column: str | None) -> pa.Table:
        """``table`` with its sessions (runs of ``column``) in this epoch's order, when
        shuffling and the data has the column."""
        if not self.shuffle or column is None or column not in table.column_names:
            return table
        # Seeded by the file's path inside the data set, not where the data set lies: the
        # same data copied elsewhere trains to the same model.
        salt = zlib.crc32(relative_path(group.file, self.root).encode())
        rng = epoch_rng(self.seed, self.epoch, salt, group.index)
        return table.take(pa.array(_session_order(table, column, rng)))


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
    ) -> None:
        self.config = config
        self.columns = columns
        self.schema = schema
        self.files = _RowGroupFiles(
            config, source_path=source_path, seed=seed, epoch=epoch, shuffle=shuffle, tag=tag
        )
        self.preprocess = Preprocessor(config, quarantine_tag=tag)

    def __call__(self, refs: pa.Table) -> pa.Table:
        tables = []
        for ref in refs.to_pylist():
            group = RowGroup(**ref["group"])
            table = self.files.read(group, file=group.file, columns=self.columns)
            if table is not None and table.num_rows:
                table = self.files.shuffled(table, group=group, column=self.config.session_column)
                out = self.preprocess(table)
                total = out.num_rows
                out = out.slice(min(ref["skip"], total))
                tables.append(_with_position(out, ref["id"], total))
        if not tables:
            return self.empty_table()
        return pa.concat_tables(tables) if len(tables) > 1 else tables[0]

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
        for ref in refs.to_pylist():
            rows = self._rows(RowGroup(**ref["group"]))
            if rows is None:
                continue
            total = rows.num_rows
            for start in range(min(ref["skip"], total), total, self.config.batch_size):
                stop = min(start + self.config.batch_size, total)
                yield _with_position(rows.batch(start, stop), ref["id"], total)
                empty = False
        if empty:
            yield self.empty_table()

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

    def row_groups(self, epoch: int) -> list[tuple[int, int]]:
        """This worker's ``(row group id, rows to skip)`` in ``epoch``, in reading order."""
        return assign_row_groups(
            self.groups,
            world_size=self.world_size,
            seed=self.seed,
            epoch=epoch,
            shuffle=self.shuffle,
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
        }

    def dataset(self, epoch: int) -> Any:
        """The lazy Ray dataset of this worker's preprocessed rows in ``epoch`` (None when the
        worker has no row groups in it)."""
        import ray.data

        mine = self.row_groups(epoch)
        if not mine:
            return None
        # Row groups come out in the order they were dealt, so a run is reproducible.
        ray.data.DataContext.get_current().execution_options.preserve_order = True
        refs = ray.data.from_items(
            [{"group": self.groups[i].to_dict(), "id": i, "skip": skip} for i, skip in mine],
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
