"""A worker's data, epoch by epoch, exactly once: which worker reads what, in which order.

The unit of reading is a Parquet row group (:class:`RowGroup`, listed from the footers by the
driver). Every epoch, :func:`assign_row_groups` puts the row groups in the epoch's order and
deals them to the workers, each to the worker with the fewest rows so far: every row group,
hence every row, goes to exactly one worker per epoch, the split is as even as row groups
allow, and the same seed gives the same assignment and order on every run. The order is
``data.order``'s: ``shuffled``, a permutation seeded by ``(training.seed, epoch)``; ``time``,
the row groups' time order (:func:`time_order`), the same every epoch, so the workers advance
through time together and a shuffle window spans consecutive row groups in time.

Each worker then streams its row groups through its own Ray Data pipeline
(:class:`WorkerSource`): a dataset of *shuffle windows* (:func:`assign_windows`: consecutive row
groups of the worker's, at most ``data.shuffle_window_rows`` rows each) mapped by a row-group
reader on an actor pool (``raydlrm.ingestion.row_group_reader``: it reads, shuffles and
preprocesses each window's rows, in a uniformly random order drawn from the seed, and cuts
session-clustered data into training batches itself). Output order is preserved, so a worker's
batches are reproducible too. Under ``time`` without a window (0), each row group is read in its
file order.

A worker that runs out of rows before the others keeps stepping with empty batches (see
``raydlrm.trainers.loop``) instead of the others dropping their last rows.

Data position (exactly-once resume): every output row carries the id of its row group (its
index in the data set's list) and the row group's row count after preprocessing. The trainer
counts, per row group, the rows it has trained on (:class:`EpochProgress`); a checkpoint holds
those counts of every worker. On resume, :func:`assign_windows` leaves out the finished row
groups and tells each reader how many leading rows of a started one to skip (its rows come in
the same order every time: the shuffle and the merge keys are seeded by the row group, not the
worker, and a window's trained rows are a head of each of its row groups). With the world size
of the checkpoint each worker keeps its own windows, so the run continues with exactly the
batches it would have had; with another world size the remaining rows are dealt and cut into
windows anew, still each row once.

A resumed epoch is dealt from the list of files it began with (:attr:`EpochProgress.files`,
:mod:`raydlrm.ingestion.epoch_files`): files added to the data set since are read from the next
epoch on. It is read with the shuffle window it began with, or with a smaller
``data.shuffle_window_rows`` (:func:`resumed_window`): any cut into windows reads every
remaining row once (a row group's merge keys are its own and its trained rows a head of its
order), only the rest of the epoch then comes in other batches than it would have. Its order
(``data.order``, ``data.time_column``) cannot change: the driver refuses such a resume.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from raydlrm.ingestion._shuffle import epoch_rng
from raydlrm.ingestion.config import DataConfig
from raydlrm.ingestion.epoch_files import FileList, epoch_groups, file_list
from raydlrm.ingestion.layout import layout_of
from raydlrm.ingestion.row_group_reader import (
    RG_ID_COLUMN,
    RG_ROWS_COLUMN,
    read_columns,
    reader_class,
)
from raydlrm.ingestion.schema import DataSummary, RowGroup
from raydlrm.storage import filesystem_for

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = [
    "PREPROCESS_ACTOR_CPUS",
    "WINDOW_COPIES",
    "EpochProgress",
    "WorkerSource",
    "assign_row_groups",
    "assign_windows",
    "default_num_actors",
    "resumed_window",
    "time_order",
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


class EpochProgress:
    """Rows trained on per row group in the current epoch, by one worker or merged over all.

    ``consumed[id]`` counts the rows of row group ``id`` trained on so far (including rows
    skipped because an earlier run trained on them); ``totals[id]`` is its row count after
    preprocessing, known once one of its rows was seen; ``window_rows`` is the shuffle window
    the epoch is read with (see :func:`resumed_window`); ``files`` the list of files the epoch
    is dealt from, which the ids index (:func:`~raydlrm.ingestion.epoch_files.file_list`; None:
    not known, as in a checkpoint of an earlier release: the data set's current list).
    """

    def __init__(
        self,
        epoch: int = 0,
        consumed: dict | None = None,
        totals: dict | None = None,
        *,
        window_rows: int = 0,
        files: FileList | None = None,
    ):
        self.epoch = epoch
        self.window_rows = window_rows
        self.files = files
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

    def to_dict(self, *, files: bool = True) -> dict[str, Any]:
        """As JSON; without the list of files unless ``files`` (the same on every worker: the
        workers' counts are gathered without it)."""
        out: dict[str, Any] = {
            "epoch": self.epoch,
            "window_rows": self.window_rows,
            "consumed": {str(k): v for k, v in sorted(self.consumed.items())},
            "totals": {str(k): v for k, v in sorted(self.totals.items())},
        }
        if files and self.files is not None:
            out["files"] = self.files
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EpochProgress:
        # A checkpoint made before shuffle windows read its epoch without one.
        return cls(
            d["epoch"],
            d.get("consumed"),
            d.get("totals"),
            window_rows=d.get("window_rows", 0),
            files=d.get("files"),
        )

    @classmethod
    def merged(cls, parts: list[EpochProgress], *, files: FileList | None = None) -> EpochProgress:
        """The progress of all workers (each row group is read by one worker per epoch; a
        worker may also hold an older count of another's row group, from the checkpoint it
        resumed: the largest count wins), with ``files`` (default: the first part's)."""
        first = parts[0] if parts else cls()
        out = cls(
            first.epoch,
            window_rows=first.window_rows,
            files=first.files if files is None else files,
        )
        for p in parts:
            for i, n in p.consumed.items():
                out.consumed[i] = max(out.consumed.get(i, 0), n)
            out.totals.update(p.totals)
        return out


def resumed_window(saved: int, *, configured: int) -> int:
    """The shuffle window the rest of an epoch begun with ``saved`` rows is read with, when
    ``data.shuffle_window_rows`` is now ``configured``: the one it began with, unless the
    configured one is smaller (a window whose actors ran out of memory can be lowered). Every
    remaining row is still read once (see the module docstring), only in other batches than the
    interrupted run's. A larger configured window applies from the next epoch; an epoch begun
    without a window (0) goes on without one; one begun with a window and resumed with 0 is
    read one row group per window (1), each in the order it had (0 would read them in
    another)."""
    if saved == 0 or saved <= configured:
        return saved
    return max(configured, 1)


def time_order(groups: list[RowGroup]) -> list[int]:
    """The indices of ``groups`` in time order: by :attr:`RowGroup.time` (``data.time_column``'s
    minimum in each), ties and no time at all in list order (the data set's file order: sorted
    paths, then row group index).

    Raises:
        ValueError: some row groups have a time and others not, naming one without.
    """
    timed = [g.time is not None for g in groups]
    if any(timed) and not all(timed):
        lacking = groups[timed.index(False)]
        raise ValueError(
            f"row group {lacking.index} of {lacking.file} has no time, other row groups have "
            "one: all or none must (data.time_column)"
        )
    return sorted(range(len(groups)), key=lambda i: (groups[i].time or 0.0, i))


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
    order: Literal["shuffled", "time"] = "shuffled",
    resume: EpochProgress | None = None,
    resume_world_size: int | None = None,
) -> list[list[tuple[int, int]]]:
    """Deals the row groups of one epoch to the workers.

    Args:
        groups: every row group of the data set.
        world_size: number of workers.
        seed: the job's seed.
        epoch: the epoch (a different order every epoch when ``shuffle`` and ``shuffled``).
        shuffle: put the row groups in the training ``order`` first; keep the file order
            otherwise (eval).
        order: the training order (``data.order``): ``shuffled`` (seeded by ``seed`` and
            ``epoch``) or ``time`` (:func:`time_order`, the same every epoch).
        resume: the progress of this epoch saved by a checkpoint, merged over its workers.
        resume_world_size: the world size that made ``resume``.

    Returns:
        For each worker, ``(row group id, rows to skip)`` in reading order. Every row group
        appears exactly once (finished ones of ``resume`` not at all); each goes to the worker
        with the fewest rows so far (ties: the lowest rank). With ``resume`` from the same world
        size, each worker keeps the row groups it had.
    """
    dealt = list(range(len(groups)))
    if shuffle and order == "time":
        dealt = time_order(groups)
    elif shuffle:
        dealt = epoch_rng(seed, epoch).permutation(len(groups)).tolist()
    if resume is None or resume.epoch != epoch:
        return _deal(groups, dealt, world_size, {})
    finished = resume.finished()
    skip = {i: n for i, n in resume.consumed.items() if i not in finished}
    if resume_world_size == world_size:
        return [
            [(i, skip.get(i, 0)) for i, _ in mine if i not in finished]
            for mine in _deal(groups, dealt, world_size, {})
        ]
    return _deal(groups, [i for i in dealt if i not in finished], world_size, skip)


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
    order: Literal["shuffled", "time"] = "shuffled",
    resume: EpochProgress | None = None,
    resume_world_size: int | None = None,
) -> list[list[list[tuple[int, int]]]]:
    """The row groups of one epoch dealt to the workers in ``order`` (:func:`assign_row_groups`),
    each worker's cut into shuffle windows of at most ``window_rows`` rows; one row group per
    window when not shuffling or ``window_rows`` is 0. Under ``time`` a window holds
    consecutive row groups of the worker's in time order: a bounded span of time.

    Resuming with the checkpoint's world size, the windows are those of the epoch as it began,
    less the finished row groups, each started one skipping its trained rows: a window's rows
    then come in the order they had, less the trained ones (see :class:`RowGroupReader`). With
    another world size, the remaining rows are dealt and cut into windows anew.
    """
    resumed = resume is not None and resume.epoch == epoch
    deal = {
        "world_size": world_size,
        "seed": seed,
        "epoch": epoch,
        "shuffle": shuffle,
        "order": order,
    }
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


class WorkerSource:
    """One worker's data, one epoch per :meth:`iter_batches` call (a ``DataIterator``-like).

    Args:
        groups: every row group of the data set.
        config: the data config.
        source_path: the data set's path.
        rank: this worker.
        world_size: number of workers.
        seed: the job's seed.
        shuffle: training: the row groups in ``config.order`` every epoch, rows mixed in the
            shuffle window; else (eval) the file order, rows in their order.
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
        self.epoch_groups = groups  # the list the next epoch is dealt from

    def start(
        self, epoch: int, *, resume: EpochProgress | None, world_size: int | None
    ) -> EpochProgress:
        """Makes the next :meth:`iter_batches` read ``epoch``, resuming a checkpoint's progress
        in it (made by ``world_size`` workers) when given; returns the progress to count its
        trained rows in: the checkpoint's when resuming (its files, its window or a smaller
        configured one, :func:`resumed_window`), else a fresh one of the data set's files.

        Raises:
            ValueError: a file of the resumed epoch is gone or changed, named (the driver
                refuses such a resume before Ray starts).
        """
        configured = self.config.shuffle_window_rows if self.shuffle else 0
        root = filesystem_for(self.source_path, self.config.storage)[1]
        if resume is None or resume.epoch != epoch:
            files = file_list(self.groups, root=root)
            self.epoch, self.resume, self.resume_world_size = epoch, None, None
            self.epoch_groups = self.groups
            return EpochProgress(epoch, window_rows=configured, files=files)
        window = resumed_window(resume.window_rows, configured=configured)
        if resume.files is None:  # a checkpoint of an earlier release: today's list
            files, self.epoch_groups = file_list(self.groups, root=root), self.groups
        else:
            files = resume.files
            self.epoch_groups = epoch_groups(files, self.groups, root=root)
        progress = EpochProgress.merged([resume], files=files)
        progress.window_rows = window
        self.epoch, self.resume, self.resume_world_size = epoch, progress, world_size
        # A copy: the caller counts its batches in the progress returned.
        return EpochProgress.merged([progress])

    def window_rows(self, epoch: int) -> int:
        """The shuffle window ``epoch`` is read with: ``data.shuffle_window_rows``, or the
        resumed epoch's (:meth:`start`; 0 when not shuffling)."""
        if not self.shuffle:
            return 0
        if self.resume is not None and self.resume.epoch == epoch:
            return self.resume.window_rows
        return self.config.shuffle_window_rows

    def windows(self, epoch: int) -> list[list[tuple[int, int]]]:
        """This worker's shuffle windows of ``epoch``, each its ``(row group id, rows to
        skip)``, in reading order (:func:`assign_windows`); ids index :attr:`epoch_groups`."""
        return assign_windows(
            self.epoch_groups,
            world_size=self.world_size,
            seed=self.seed,
            epoch=epoch,
            shuffle=self.shuffle,
            window_rows=self.window_rows(epoch),
            order=self.config.order,
            resume=self.resume,
            resume_world_size=self.resume_world_size,
        )[self.rank]

    def window_items(self, epoch: int) -> list[dict[str, Any]]:
        """This worker's windows of ``epoch`` as its readers take them, one item each:
        ``{"window": [{"group", "id", "skip"}, ...]}`` (see ``RowGroupReader``)."""
        groups = self.epoch_groups
        return [
            {
                "window": [
                    {"group": groups[i].to_dict(), "id": i, "skip": skip} for i, skip in window
                ]
            }
            for window in self.windows(epoch)
        ]

    def empty_table(self) -> pa.Table:
        """A preprocessed table of 0 rows (the structure of this data's batches)."""
        return reader_class(self.schema)(self.config, **self._reader_kwargs(0)).empty_table()

    def _reader_kwargs(self, epoch: int) -> dict[str, Any]:
        window = self.window_rows(epoch)
        # Time order without a window reads each row group in its file order: its sessions
        # are not shuffled either.
        in_order = self.config.order == "time" and window == 0
        return {
            "source_path": self.source_path,
            "columns": self.columns,
            "schema": self.schema,
            "seed": self.seed,
            "epoch": epoch,
            "shuffle": self.shuffle and not in_order,
            "tag": None if self.quarantine_tag is None else f"{self.quarantine_tag}-e{epoch}",
            "window_rows": window,
        }

    def dataset(self, epoch: int) -> Any:
        """The lazy Ray dataset of this worker's preprocessed rows in ``epoch`` (None when the
        worker has no row groups in it)."""
        import ray.data

        items = self.window_items(epoch)
        if not items:
            return None
        # Windows come out in the order they were dealt, so a run is reproducible.
        ray.data.DataContext.get_current().execution_options.preserve_order = True
        refs = ray.data.from_items(items, override_num_blocks=len(items))
        return refs.map_batches(
            reader_class(self.schema),
            fn_constructor_kwargs={"config": self.config, **self._reader_kwargs(epoch)},
            batch_size=1,
            batch_format="pyarrow",
            compute=ray.data.ActorPoolStrategy(
                min_size=1, max_size=max(1, min(self.num_actors, len(items))), initial_size=1
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
        # A checkpoint's progress and list of files apply to its own epoch only.
        self.resume, self.epoch_groups = None, self.groups
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
