"""Session-clustered data sets (RecD): converting to them, reading their rows, their size.

The layout (:mod:`raydlrm.ingestion.layout`) stores the columns constant within a session (the
user features, e.g. long user-history id lists) once per session, in ``sessions/`` files beside
the ``samples/`` files that hold everything else. That is where RecD's storage saving comes
from, and what lets training preprocess those columns once per session and carry them as
unique values plus an inverse index (``raydlrm.ingestion.reader.SessionGroupReader``).

:func:`cluster_data` converts a sample-level data set, file by file (one file in memory at a
time), keeping its relative paths (hive partitions) and its row groups: row group ``i`` of a
samples file is the source file's row group ``i`` less its per-session columns, row group ``i``
of its sessions file one row per session of it. Before writing it checks, exactly, that every
session is contiguous in its file (else it stops naming the file) and that each per-session
column is constant within every session (else it stops naming the column and the first session
where it differs or, under ``data.bad_input = "quarantine"``, sets the session's samples aside
with the reason and counts them). A clustered set's files are written with pyarrow's default
Parquet settings (snappy compression, dictionary encoding) but a 64 MiB dictionary page limit
(:data:`WRITE_OPTIONS`; pyarrow's default is 1 MiB): a sessions file's id lists hold many
distinct ids, whose dictionary outgrows 1 MiB, and the column then falls back to plain 8-byte
values. A sample-level set keeps whatever its writer chose; :func:`data_bytes` counts bytes on
disk.

:func:`read_rows` reads a data set's first rows as sample-level rows in either layout (the
per-session columns joined back): what inspection, inference and example rows need.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import posixpath
from collections.abc import Iterator
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
    BadInputError,
    quarantine_rows,
)
from raydlrm.ingestion.config import DataConfig
from raydlrm.ingestion.layout import (
    ClusteredLayout,
    read_layout,
    relative_path,
    sessions_file_of,
    write_layout,
)
from raydlrm.ingestion.schema import DataSummary, DataValidationError, validate_data
from raydlrm.ingestion.sessions import (
    changed_rows,
    constant_columns,
    session_rows,
    session_starts,
)
from raydlrm.storage import (
    CLUSTERED_MARKER,
    SAMPLES_DIR,
    SESSIONS_DIR,
    filesystem_for,
    join,
    list_files,
)

__all__ = [
    "WRITE_OPTIONS",
    "ClusterResult",
    "SessionSplit",
    "cluster_data",
    "data_bytes",
    "file_row_groups",
    "read_rows",
    "split_sessions",
]

logger = logging.getLogger(__name__)

WRITE_OPTIONS = {"dictionary_pagesize_limit": 64 << 20}
"""Parquet writer options of a clustered data set's files (see the module docstring)."""
INFER_ROWS = 200_000
"""Rows read to find the columns constant within sessions, when none are named."""
QUARANTINE_TAG = "cluster"
"""The pass that names the quarantine records of a conversion (a conversion run again
overwrites them)."""


@dataclass(frozen=True)
class SessionSplit:
    """Rows split into the two files of the clustered layout.

    Attributes:
        samples: every column but the per-session ones, one row per sample.
        sessions: the session column and the per-session columns, one row per session (per
            run of the session column), in order of the sessions' first samples.
    """

    samples: pa.Table
    sessions: pa.Table


def split_sessions(
    table: pa.Table, *, session_column: str, session_columns: list[str]
) -> SessionSplit:
    """Splits sample-level rows whose ``session_columns`` are constant within each session
    (each run of ``session_column``; not checked here) into samples and sessions."""
    ids = table.column(session_column).to_numpy(zero_copy_only=False)
    starts = pa.array(session_starts(ids))
    return SessionSplit(
        samples=table.drop_columns(session_columns),
        sessions=table.select([session_column, *session_columns]).filter(starts),
    )


@dataclass(frozen=True)
class ClusterResult:
    """What :func:`cluster_data` wrote.

    Attributes:
        out: the clustered data set's directory.
        session_columns: the columns stored per session.
        num_files: samples files written (each with its sessions file).
        num_samples: samples written.
        num_sessions: session rows written (a session cut by a row-group boundary counts in
            each row group).
        quarantined_sessions: sessions set aside (a per-session column not constant in them).
        quarantined_samples: their samples.
        source_bytes: the source data set's bytes on disk.
        clustered_bytes: the clustered data set's bytes on disk.
    """

    out: str
    session_columns: list[str]
    num_files: int
    num_samples: int
    num_sessions: int
    quarantined_sessions: int
    quarantined_samples: int
    source_bytes: int
    clustered_bytes: int


def cluster_data(
    source: str,
    config: DataConfig,
    *,
    out: str,
    session_columns: list[str] | None = None,
    role: str = "train",
) -> ClusterResult:
    """Converts the sample-level data set at ``source`` into a session-clustered one at
    ``out`` (see the module docstring), every file of it (``data.partitions`` does not apply).

    Args:
        source: the data set (local or a URI), checked against ``config`` first.
        config: the data config (``quarantine_path`` defaults to ``<out>/_quarantine``).
        out: the new data set's directory (local or a URI); must not hold files yet.
        session_columns: the sparse columns to store per session, with their weights.
            Default: the ``data.dedup_groups`` columns, else the sparse columns constant
            within the sessions of the first rows (:func:`infer_dedup_groups`).
        role: what the data is for, in messages.

    Returns:
        The counts and bytes of both layouts.

    Raises:
        DataValidationError: ``source`` does not match the config, or a session is not
            contiguous in its file (naming the file and the session), or, under ``fail``, a
            per-session column differs within a session (naming the column, the first such
            session and the file).
        ValueError: ``source`` is already clustered, no session column, or a named column
            that is not a sparse column (naming the key or argument).
        FileExistsError: ``out`` holds files.
    """
    config, summary = _checked_source(source, config, out=out, role=role)
    session = config.session_column
    columns = _session_columns(session_columns, summary=summary, config=config)
    filesystem, out_root = filesystem_for(out, config.storage)
    written = _Written()
    try:
        _cluster_files(
            source,
            summary,
            config,
            out=(filesystem, out_root),
            columns=(session, columns),
            written=written,
        )
    except BaseException:
        _remove_partial(filesystem, out_root)  # a rerun into ``out`` starts from nothing
        raise
    write_layout(ClusteredLayout(session, columns), filesystem=filesystem, root=out_root)
    result = written.result(
        out, columns, sizes=(data_bytes(source, config), data_bytes(out, config))
    )
    logger.debug("clustered %s into %s: %s", source, out, result)
    return result


def _cluster_files(
    source: str,
    summary: DataSummary,
    config: DataConfig,
    *,
    out: tuple[pafs.FileSystem, str],
    columns: tuple[str, list[str]],
    written: _Written,
) -> None:
    """Clusters each file of ``source`` into the samples and sessions files of the same
    relative path under ``out`` (filesystem, root)."""
    filesystem, out_root = out
    source_fs, source_root = filesystem_for(source, config.storage)
    for file in dict.fromkeys(g.file for g in summary.row_groups):
        relative = relative_path(file, source_root)
        _cluster_file(
            file,
            filesystems=(source_fs, filesystem),
            paths=(
                f"{out_root}/{SAMPLES_DIR}/{relative}",
                f"{out_root}/{SESSIONS_DIR}/{relative}",
            ),
            columns=columns,
            config=config,
            written=written,
        )


def _checked_source(
    source: str, config: DataConfig, *, out: str, role: str
) -> tuple[DataConfig, DataSummary]:
    """The config to cluster ``source`` with (every file; the quarantine under ``out`` by
    default) and ``source``'s summary, after checking that ``source`` is sample-level data
    that matches the config and has the session column, and that ``out`` holds no files."""
    if read_layout(source, config.storage) is not None:
        raise ValueError(f"{source} is already a session-clustered data set")
    session = config.session_column
    if session is None:
        raise ValueError("data.session_column must name the session column to cluster by")
    filesystem, out_root = filesystem_for(out, config.storage)
    _, source_root = filesystem_for(source, config.storage)
    local = isinstance(filesystem, pafs.LocalFileSystem)
    if _within(out_root, source_root, local=local) or _within(source_root, out_root, local=local):
        raise ValueError(
            f"the clustered data set {out} and the data set {source} are inside one another: "
            "its files would become part of the data they are made from; give --out a "
            "directory outside it"
        )
    _check_empty(filesystem, out_root, out=out)
    config = dataclasses.replace(config, partitions={}, eval_partitions=None)
    if config.bad_input == "quarantine" and config.quarantine_path is None:
        config = dataclasses.replace(config, quarantine_path=join(out, "_quarantine"))
    summary = validate_data(source, config, role=role)
    if session not in summary.schema.names:
        raise DataValidationError(
            f"{role} data at {source!r} has no session column {session!r} (data.session_column)"
        )
    return config, summary


def _session_columns(
    named: list[str] | None, *, summary: DataSummary, config: DataConfig
) -> list[str]:
    """The per-session columns: the sparse ones named (by default the dedup groups', else
    those constant within the sessions of the data's first rows), and their weights.

    Raises:
        ValueError: a named column that is not a sparse column, or none found.
    """
    if named is None:
        named = [c for group in config.dedup_groups for c in group]
    if not named:
        assert config.session_column is not None
        weights = [w for c in config.sparse_columns if (w := config.weight_column_of(c))]
        table = read_rows(
            summary.path,
            config,
            columns=[config.session_column, *config.sparse_columns, *weights],
            max_rows=INFER_ROWS,
        )
        named = constant_columns(
            table,
            session_column=config.session_column,
            columns=config.sparse_columns,
            config=config,
        )
        if not named:
            raise ValueError(
                f"no sparse column of {summary.path} is constant within sessions "
                f"(data.session_column = {config.session_column!r}) in its first "
                f"{table.num_rows} rows: nothing to store per session"
            )
        logger.info("per-session columns (constant within sessions): %s", named)
    unknown = [c for c in named if c not in config.sparse_columns]
    if unknown:
        raise ValueError(f"session columns {unknown} are not sparse columns (data.sparse_columns)")
    weights = [config.weight_column_of(c) for c in named]
    return [*named, *(w for w in weights if w is not None)]


def _within(path: str, parent: str, *, local: bool) -> bool:
    """Whether ``path`` is ``parent`` or inside it (as a filesystem names them: resolved on the
    local disk, ``bucket/key`` as they are on an object store)."""
    if local:
        path, parent = os.path.realpath(path), os.path.realpath(parent)
    path, parent = path.rstrip("/"), parent.rstrip("/")
    return path == parent or path.startswith(f"{parent}/")


# What an unfinished conversion leaves in ``out``: the marker is written last.
_PARTIAL = {SAMPLES_DIR, SESSIONS_DIR, "_quarantine"}


def _remove_partial(filesystem: pafs.FileSystem, root: str) -> None:
    """Removes what a conversion wrote under ``root`` before it stopped (its directories)."""
    for name in _PARTIAL:
        if filesystem.get_file_info(f"{root}/{name}").type == pafs.FileType.Directory:
            filesystem.delete_dir(f"{root}/{name}")


def _check_empty(filesystem: pafs.FileSystem, root: str, *, out: str) -> None:
    """``out`` must hold no files; the partial output of a conversion that did not finish (no
    marker yet, only its directories) is removed first, so that it can be run again."""
    info = filesystem.get_file_info(root)
    if info.type == pafs.FileType.File:
        raise FileExistsError(f"{out} is a file, not a directory for the clustered data set")
    if info.type == pafs.FileType.Directory:
        top = filesystem.get_file_info(pafs.FileSelector(root))
        if top and all(i.base_name in _PARTIAL for i in top):
            logger.info("%s holds the partial output of an unfinished conversion: removed", out)
            _remove_partial(filesystem, root)
        inside = filesystem.get_file_info(pafs.FileSelector(root, recursive=True))
        if any(i.type == pafs.FileType.File for i in inside):
            raise FileExistsError(f"{out} already holds files; give an empty or new directory")


@dataclass
class _Written:
    files: int = 0
    samples: int = 0
    sessions: int = 0
    bad_sessions: int = 0
    bad_samples: int = 0

    def result(self, out: str, columns: list[str], *, sizes: tuple[int, int]) -> ClusterResult:
        """The result of clustering into ``out``; ``sizes`` are the source's and ``out``'s
        bytes."""
        return ClusterResult(
            out=out,
            session_columns=columns,
            num_files=self.files,
            num_samples=self.samples,
            num_sessions=self.sessions,
            quarantined_sessions=self.bad_sessions,
            quarantined_samples=self.bad_samples,
            source_bytes=sizes[0],
            clustered_bytes=sizes[1],
        )


def _cluster_file(
    file: str,
    *,
    filesystems: tuple[pafs.FileSystem, pafs.FileSystem],
    paths: tuple[str, str],
    columns: tuple[str, list[str]],
    config: DataConfig,
    written: _Written,
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


def read_rows(
    path: str,
    config: DataConfig,
    *,
    columns: list[str],
    max_rows: int,
    role: str = "train",
) -> pa.Table:
    """The first ``max_rows`` rows of a data set (its files in order, the partitions of
    ``role``), as sample-level rows of ``columns`` (those the data has), dictionary-encoded
    columns decoded: of a session-clustered data set, each sample with its session's columns.

    A file that cannot be read is passed over (these rows are a sample: the bad-input policy
    of the job that reads the data decides about the file).

    Raises:
        DataValidationError: a sample whose session has no row in its sessions file (naming
            the file and the session).
        BadInputError: no file can be read (naming the first files and their errors).
        StorageError: the path holds no data (see :func:`~raydlrm.storage.list_files`).
    """
    layout = read_layout(path, config.storage)
    filesystem, files = list_files(path, config.storage, config.partitions_for(role))
    root = filesystem_for(path, config.storage)[1]
    tables, rows, errors = [], 0, []
    for file in files:
        try:
            for table in file_row_groups(
                file, filesystem=filesystem, root=root, layout=layout, columns=columns
            ):
                tables.append(decode_dictionaries(table))
                rows += table.num_rows
                if rows >= max_rows:
                    return _concat(tables).slice(0, max_rows)
        except (OSError, pa.ArrowException) as exc:
            logger.debug("passing over %s: %s", file, exc)
            errors.append(f"{file}: {exc}")
    if not tables:
        raise BadInputError(f"no readable rows under {path}: " + "; ".join(errors[:3]))
    return _concat(tables)


def _concat(tables: list[pa.Table]) -> pa.Table:
    # Files may differ in width (int32/int64, string/large_string), as training accepts.
    try:
        return pa.concat_tables(tables, promote_options="permissive")
    except pa.ArrowInvalid:
        # uint64 ids of 2**63 and more beside signed ones: ids are hashed by their 64 bits, so
        # the same bits as int64 keep every id distinct.
        return pa.concat_tables([_signed_ids(t) for t in tables], promote_options="permissive")


def _signed_ids(table: pa.Table) -> pa.Table:
    """``table`` with its uint64 (and list<uint64>) columns as int64 of the same bits."""
    for i, field in enumerate(table.schema):
        kind = field.type.value_type if pa.types.is_list(field.type) else field.type
        if pa.types.is_uint64(kind):
            target = pa.list_(pa.int64()) if pa.types.is_list(field.type) else pa.int64()
            column = table.column(i).cast(target, safe=False)
            table = table.set_column(i, field.name, column)
    return table


def file_row_groups(
    file: str,
    *,
    filesystem: pafs.FileSystem,
    root: str,
    layout: ClusteredLayout | None,
    columns: list[str],
) -> Iterator[pa.Table]:
    """The rows of one file of a data set (``root``), a row group at a time, as ``columns``
    (those present): of a session-clustered set (``layout``), a samples file's rows with their
    sessions' columns."""
    with filesystem.open_input_file(file) as f:
        samples = pq.ParquetFile(f)
        names = [c for c in columns if c in samples.schema_arrow.names]
        if layout is None:
            for i in range(samples.num_row_groups):
                yield samples.read_row_group(i, columns=names)
            return
        per_session = [c for c in columns if c in layout.session_columns]
        key = layout.session_column
        sessions_path = sessions_file_of(file, root=root)
        with filesystem.open_input_file(sessions_path) as g:
            sessions = pq.ParquetFile(g)
            for i in range(samples.num_row_groups):
                part = samples.read_row_group(i, columns=list(dict.fromkeys([*names, key])))
                own = sessions.read_row_group(i, columns=[key, *per_session])
                at = session_rows(part.column(key), own.column(key))
                if (at < 0).any():
                    missing = part.column(key)[int(np.flatnonzero(at < 0)[0])].as_py()
                    raise DataValidationError(
                        f"session {missing} of {file} (row group {i}) has no row in {sessions_path}"
                    )
                joined = own.select(per_session).take(pa.array(at))
                for name in per_session:
                    part = part.append_column(name, joined.column(name))
                yield part.select([c for c in columns if c in part.column_names])


def data_bytes(path: str, config: DataConfig) -> int:
    """Bytes on disk of a data set's files: its Parquet files and, when session-clustered,
    its sessions files and marker."""
    layout = read_layout(path, config.storage)
    filesystem, files = list_files(path, config.storage, {})
    if layout is not None:
        root = filesystem_for(path, config.storage)[1]
        files = [
            *files,
            *(sessions_file_of(f, root=root) for f in files),
            f"{root}/{CLUSTERED_MARKER}",
        ]
    return sum(info.size for info in filesystem.get_file_info(files))
