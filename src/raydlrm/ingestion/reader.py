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
from raydlrm.ingestion.preprocess import Preprocessor
from raydlrm.ingestion.schema import SAMPLE_ID_COLUMN, RowGroup
from raydlrm.ingestion.storage import filesystem_for

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = [
    "RowGroupReader",
    "WorkerSource",
    "assign_row_groups",
    "empty_raw_table",
    "epoch_rng",
    "read_columns",
]

logger = logging.getLogger(__name__)

_ACTOR_NUM_CPUS = 0.5


def epoch_rng(seed: int, epoch: int, *salt: int) -> np.random.Generator:
    """The random stream of ``(seed, epoch, *salt)``: the same on every machine and run."""
    return np.random.default_rng([seed, epoch, *salt])


def assign_row_groups(
    groups: list[RowGroup], *, world_size: int, seed: int, epoch: int, shuffle: bool
) -> list[list[RowGroup]]:
    """Deals the row groups of one epoch to the workers.

    Args:
        groups: every row group of the data set.
        world_size: number of workers.
        seed: the job's seed.
        epoch: the epoch (a different order every epoch when ``shuffle``).
        shuffle: shuffle the row groups first (training); keep file order otherwise (eval).

    Returns:
        For each worker, its row groups in reading order. Every row group appears exactly once;
        each goes to the worker with the fewest rows so far (ties: the lowest rank).
    """
    order = list(range(len(groups)))
    if shuffle:
        order = epoch_rng(seed, epoch).permutation(len(groups)).tolist()
    assigned: list[list[RowGroup]] = [[] for _ in range(world_size)]
    rows = [0] * world_size
    for i in order:
        rank = min(range(world_size), key=lambda r: (rows[r], r))
        assigned[rank].append(groups[i])
        rows[rank] += groups[i].num_rows
    return assigned


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
    ) -> None:
        self.config = config
        self.columns = columns
        self.schema = schema
        self.seed, self.epoch, self.shuffle = seed, epoch, shuffle
        self.filesystem = filesystem_for(source_path, config.storage)[0]
        self.preprocess = Preprocessor(config)

    def __call__(self, refs: pa.Table) -> pa.Table:
        tables = []
        for ref in refs.to_pylist():
            table = self._read(RowGroup(**ref))
            if table is not None and table.num_rows:
                tables.append(self.preprocess(table))
        if not tables:
            return self.preprocess(empty_raw_table(self.schema, self.columns))
        return pa.concat_tables(tables) if len(tables) > 1 else tables[0]

    def _read(self, group: RowGroup) -> pa.Table | None:
        try:
            with self.filesystem.open_input_file(group.file) as f:
                table = pq.ParquetFile(f).read_row_group(group.index, columns=self.columns)
        except (OSError, pa.ArrowException) as exc:
            reason = f"row group {group.index} of {group.file} is not readable: {exc}"
            if self.config.bad_input == "fail":
                raise BadInputError(reason) from exc
            quarantine_source(
                self.config,
                file=group.file,
                row_group=group.index,
                num_rows=group.num_rows,
                reason=reason,
            )
            return None
        n = table.num_rows
        table = table.append_column(FILE_COLUMN, pa.array([group.file] * n, pa.string()))
        table = table.append_column(ROW_GROUP_COLUMN, pa.array(np.full(n, group.index)))
        table = table.append_column(ROW_COLUMN, pa.array(np.arange(n)))
        session = self.config.session_column
        if self.shuffle and session is not None and session in table.column_names:
            salt = zlib.crc32(group.file.encode())
            rng = epoch_rng(self.seed, self.epoch, salt, group.index)
            table = table.take(pa.array(_session_order(table, session, rng)))
        return table


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
    ) -> None:
        self.groups, self.config, self.source_path = groups, config, source_path
        self.rank, self.world_size, self.seed, self.shuffle = rank, world_size, seed, shuffle
        self.num_actors, self.schema = num_actors, schema
        self.columns = read_columns(config, schema)
        self.epoch = 0

    def row_groups(self, epoch: int) -> list[RowGroup]:
        """This worker's row groups in ``epoch``, in reading order."""
        return assign_row_groups(
            self.groups,
            world_size=self.world_size,
            seed=self.seed,
            epoch=epoch,
            shuffle=self.shuffle,
        )[self.rank]

    def empty_table(self) -> pa.Table:
        """A preprocessed table of 0 rows (the structure of this data's batches)."""
        return Preprocessor(self.config)(empty_raw_table(self.schema, self.columns))

    def dataset(self, epoch: int) -> Any:
        """The lazy Ray dataset of this worker's preprocessed rows in ``epoch`` (None when the
        worker has no row groups in it)."""
        import ray.data

        mine = self.row_groups(epoch)
        if not mine:
            return None
        # Row groups come out in the order they were dealt, so a run is reproducible.
        ray.data.DataContext.get_current().execution_options.preserve_order = True
        refs = ray.data.from_items([g.to_dict() for g in mine], override_num_blocks=len(mine))
        return refs.map_batches(
            RowGroupReader,
            fn_constructor_kwargs={
                "config": self.config,
                "source_path": self.source_path,
                "columns": self.columns,
                "schema": self.schema,
                "seed": self.seed,
                "epoch": epoch,
                "shuffle": self.shuffle,
            },
            batch_size=1,
            batch_format="pyarrow",
            compute=ray.data.ActorPoolStrategy(
                min_size=1, max_size=max(1, min(self.num_actors, len(mine))), initial_size=1
            ),
            num_cpus=_ACTOR_NUM_CPUS,
        )

    def iter_batches(self, **kwargs: Any) -> Iterator[pa.Table]:
        """This worker's batches of the next epoch (arguments as ``Dataset.iter_batches``)."""
        epoch, self.epoch = self.epoch, self.epoch + 1
        dataset = self.dataset(epoch)
        if dataset is not None:
            yield from dataset.iter_batches(**kwargs)
