"""An epoch's seeded row orders: row groups read tagged, sessions shuffled, windows merged.

Every random order of an epoch is drawn from ``(training.seed, epoch, ...)`` (:func:`epoch_rng`),
so the same seed gives the same order on every machine and run. A row group's stream is seeded
by its file's path inside the data set and its index (:meth:`RowGroupFiles.rng`), not by the
worker that reads it: its rows come in the same order whoever reads it, which is what lets a
resumed run skip the rows it has trained on.

Inside a row group the *units* are shuffled: the sessions of ``data.session_column`` (runs of
equal values, each kept whole, so deduplication inside a batch keeps paying), else the rows
(:func:`session_units`). A shuffle window's row groups are then merged by random keys
(:func:`unit_keys`, :func:`merge_order`): a uniformly random order of the window's rows, so that
data written sorted (by user, by time) is mixed across row groups.
"""

from __future__ import annotations

import zlib

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
from raydlrm.ingestion.layout import relative_path
from raydlrm.ingestion.schema import RowGroup
from raydlrm.ingestion.sessions import session_starts
from raydlrm.storage import filesystem_for

__all__ = [
    "KEYS_SALT",
    "RowGroupFiles",
    "epoch_rng",
    "merge_order",
    "run_lengths",
    "session_order",
    "session_units",
    "unit_keys",
]

KEYS_SALT = 1
"""Salt of a row group's stream of merge keys (apart from its shuffle's)."""


def epoch_rng(seed: int, epoch: int, *salt: int) -> np.random.Generator:
    """The random stream of ``(seed, epoch, *salt)``: the same on every machine and run."""
    return np.random.default_rng([seed, epoch, *salt])


def session_units(
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


def session_order(table: pa.Table, column: str, rng: np.random.Generator) -> np.ndarray:
    """Row order with the sessions (runs of equal ``column`` values) permuted, each kept whole."""
    return session_units(table, column, rng)[0]


def unit_keys(lengths: np.ndarray, rng: np.random.Generator) -> np.ndarray:
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


def merge_order(keys: list[np.ndarray]) -> np.ndarray:
    """The order of a window's rows (its row groups' rows concatenated) by their keys."""
    return np.argsort(np.concatenate(keys), kind="stable")


def run_lengths(values: np.ndarray) -> np.ndarray:
    """The lengths of the runs of equal adjacent ``values``, in order."""
    return np.diff(np.append(np.flatnonzero(session_starts(values)), values.size))


class RowGroupFiles:
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
        return table.take(pa.array(session_order(table, column, self.rng(group))))

    def units(
        self, table: pa.Table, *, group: RowGroup, column: str | None
    ) -> tuple[np.ndarray, np.ndarray]:
        """For a shuffle window: the row order of ``table`` with its units (sessions of
        ``column`` when the data has it, else rows) permuted, and each row's merge key
        (:func:`unit_keys`)."""
        rng = self.rng(group)
        if column is not None and column in table.column_names:
            order, lengths = session_units(table, column, rng)
        else:
            order, lengths = rng.permutation(table.num_rows), np.ones(table.num_rows, np.int64)
        return order, unit_keys(lengths, self.rng(group, KEYS_SALT))
