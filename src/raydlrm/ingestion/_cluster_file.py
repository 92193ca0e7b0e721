"""Clustering one file: its checks (contiguous sessions, constant per-session columns) and writes.

Part of :func:`~raydlrm.ingestion.clustering.cluster_data`. Before writing a file it checks,
exactly, that every session is contiguous in the file (else it stops naming the file) and that
each per-session column is constant within every session (else it stops naming the column and
the first session where it differs or, under ``data.bad_input = "quarantine"``, sets the
session's samples aside with the reason and counts them). Row group ``i`` of the samples file is
the source file's row group ``i`` less its per-session columns, row group ``i`` of its sessions
file one row per session of it; both are written with
:data:`~raydlrm.ingestion.clustered.WRITE_OPTIONS`.
"""

from __future__ import annotations

import itertools
import posixpath
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from raydlrm.ingestion._arrow import decode_dictionaries
from raydlrm.ingestion.badinput import (
    FILE_COLUMN,
    ROW_COLUMN,
    ROW_GROUP_COLUMN,
    quarantine_rows,
)
from raydlrm.ingestion.clustered import WRITE_OPTIONS, split_sessions
from raydlrm.ingestion.config import DataConfig
from raydlrm.ingestion.schema import DataValidationError
from raydlrm.ingestion.sessions import changed_rows, session_starts

__all__ = ["QUARANTINE_TAG", "Written", "cluster_file"]

QUARANTINE_TAG = "cluster"
"""The pass that names the quarantine records of a conversion (a conversion run again
overwrites them)."""


@dataclass
class Written:
    """What a conversion has written so far, over its files."""

    files: int = 0
    samples: int = 0
    sessions: int = 0
    bad_sessions: int = 0
    bad_samples: int = 0


def cluster_file(
    file: str,
    *,
    filesystems: tuple[pafs.FileSystem, pafs.FileSystem],
    paths: tuple[str, str],
    columns: tuple[str, list[str]],
    config: DataConfig,
    written: Written,
) -> None:
    """Checks one source file and writes its samples and sessions files (``paths``), row group
    by row group (none when every session was set aside). ``filesystems`` are the source's and
    the output's; ``columns`` the session column and the per-session columns."""
    source_fs, filesystem = filesystems
    samples_path, sessions_path = paths
    session_column, session_columns = columns
    with source_fs.open_input_file(file) as f:
        parquet = pq.ParquetFile(f)
        sizes = [parquet.metadata.row_group(i).num_rows for i in range(parquet.num_row_groups)]
        table = parquet.read()
    ids = table.column(session_column).to_numpy(zero_copy_only=False)
    starts = session_starts(ids)
    _check_contiguous(ids, starts, file=file)
    run = np.cumsum(starts) - 1
    bad_runs = _varying_sessions(
        table, ids=ids, starts=starts, run=run, file=file, columns=session_columns, config=config
    )
    writers: dict[str, pq.ParquetWriter] = {}
    try:
        bounds = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64).tolist()
        for index, (lo, hi) in enumerate(itertools.pairwise(bounds)):
            part = table.slice(lo, hi - lo)
            bad = bad_runs.reasons[run[lo:hi]] != None  # noqa: E711 (element-wise)
            if bad.any():
                _quarantine(
                    part,
                    bad,
                    reasons=bad_runs.reasons[run[lo:hi]],
                    file=file,
                    row_group=index,
                    config=config,
                )
                part = part.filter(pa.array(~bad))
            if not part.num_rows:
                continue
            split = split_sessions(
                part, session_column=session_column, session_columns=session_columns
            )
            for path, rows in ((samples_path, split.samples), (sessions_path, split.sessions)):
                _write_row_group(writers, path, rows, filesystem=filesystem)
            written.samples += split.samples.num_rows
            written.sessions += split.sessions.num_rows
    finally:
        for writer in writers.values():
            writer.close()
    written.files += bool(writers)
    written.bad_sessions += bad_runs.count
    written.bad_samples += int((bad_runs.reasons[run] != None).sum())  # noqa: E711


def _write_row_group(
    writers: dict[str, pq.ParquetWriter],
    path: str,
    rows: pa.Table,
    *,
    filesystem: pafs.FileSystem,
) -> None:
    """Writes ``rows`` as one row group of the file at ``path`` (its writer opened on first
    use and kept in ``writers``)."""
    if path not in writers:
        filesystem.create_dir(posixpath.dirname(path), recursive=True)
        writers[path] = pq.ParquetWriter(path, rows.schema, filesystem=filesystem, **WRITE_OPTIONS)
    writers[path].write_table(rows, row_group_size=max(1, rows.num_rows))


def _check_contiguous(ids: np.ndarray, starts: np.ndarray, *, file: str) -> None:
    """Each session is one run of rows in its file.

    Raises:
        DataValidationError: naming the file, the first session seen again and its rows.
    """
    runs = ids[starts]
    _, first = np.unique(runs, return_index=True)
    if first.size == runs.size:
        return
    again = np.setdiff1d(np.arange(runs.size), first)[0]
    session = runs[again]
    rows = np.flatnonzero(ids == session)
    gap = rows[np.flatnonzero(np.diff(rows) > 1)[0] + 1]
    raise DataValidationError(
        f"sessions are not contiguous in {file}: session {session} has rows {rows[0]} and "
        f"{gap} with other sessions between them; write each session's samples together "
        "(sort the file by session) before clustering"
    )


@dataclass(frozen=True)
class _Varying:
    reasons: np.ndarray  # object, per run of the file: why it is set aside, None if kept
    count: int  # runs set aside


def _varying_sessions(
    table: pa.Table,
    *,
    ids: np.ndarray,
    starts: np.ndarray,
    run: np.ndarray,
    file: str,
    columns: list[str],
    config: DataConfig,
) -> _Varying:
    """The sessions (runs) of ``table`` in which a per-session column is not constant.

    Raises:
        DataValidationError: under ``fail``, naming the column, the first such session (in file
            order) and the file.
    """
    plain = decode_dictionaries(table.select(columns))
    reasons = np.full(int(starts.sum()), None, dtype=object)
    first: tuple[int, str] | None = None
    for column in columns:
        rows = np.flatnonzero(changed_rows(plain.column(column)) & ~starts)
        if not rows.size:
            continue
        if first is None or rows[0] < first[0]:
            first = (int(rows[0]), column)
        fresh = reasons[run[rows]] == None  # noqa: E711
        reasons[run[rows][fresh]] = f"per-session column {column!r} differs within the session"
    if first is None:
        return _Varying(reasons=reasons, count=0)
    row, column = first
    if config.bad_input == "fail":
        raise DataValidationError(
            f"user column {column!r} is not constant within session {ids[row]} in {file} (rows "
            f"{row - 1} and {row} differ): it cannot be stored once per session; leave it out "
            "of the session columns, or set data.bad_input = 'quarantine' to set such sessions "
            "aside"
        )
    return _Varying(reasons=reasons, count=int((reasons != None).sum()))  # noqa: E711


def _quarantine(
    part: pa.Table,
    bad: np.ndarray,
    *,
    reasons: np.ndarray,
    file: str,
    row_group: int,
    config: DataConfig,
) -> None:
    """Writes one row group's samples of varying sessions to the quarantine."""
    rows = part.filter(pa.array(bad))
    n = rows.num_rows
    rows = rows.append_column(FILE_COLUMN, pa.array([file] * n, pa.string()))
    rows = rows.append_column(ROW_GROUP_COLUMN, pa.array(np.full(n, row_group)))
    rows = rows.append_column(ROW_COLUMN, pa.array(np.flatnonzero(bad)))
    quarantine_rows(rows, reasons[bad], config, tag=QUARANTINE_TAG)
