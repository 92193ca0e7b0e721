"""Session-clustered data sets (RecD): their files written, their rows read back, their size.

The layout (:mod:`raydlrm.ingestion.layout`) stores the columns constant within a session (the
user features, e.g. long user-history id lists) once per session, in ``sessions/`` files beside
the ``samples/`` files that hold everything else. That is where RecD's storage saving comes
from, and what lets training preprocess those columns once per session and carry them as
unique values plus an inverse index (``raydlrm.ingestion.row_group_reader.SessionGroupReader``).
A sample-level data set becomes a clustered one with
:func:`~raydlrm.ingestion.clustering.cluster_data`; a synthetic one is written clustered
directly (``SyntheticConfig.layout``); both split their rows with :func:`split_sessions`.

A clustered set's files are written with pyarrow's default Parquet settings (snappy
compression, dictionary encoding) but a 64 MiB dictionary page limit (:data:`WRITE_OPTIONS`;
pyarrow's default is 1 MiB): a sessions file's id lists hold many distinct ids, whose dictionary
outgrows 1 MiB, and the column then falls back to plain 8-byte values. A sample-level set keeps
whatever its writer chose; :func:`data_bytes` counts bytes on disk.

:func:`read_rows` reads a data set's first rows as sample-level rows in either layout (the
per-session columns joined back): what inspection, inference and example rows need.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from raydlrm.ingestion._arrow import decode_dictionaries
from raydlrm.ingestion.badinput import BadInputError
from raydlrm.ingestion.config import DataConfig
from raydlrm.ingestion.layout import ClusteredLayout, read_layout, sessions_file_of
from raydlrm.ingestion.schema import DataValidationError
from raydlrm.ingestion.sessions import session_rows, session_starts
from raydlrm.storage import CLUSTERED_MARKER, filesystem_for, list_files

__all__ = [
    "WRITE_OPTIONS",
    "SessionSplit",
    "data_bytes",
    "file_row_groups",
    "read_rows",
    "split_sessions",
]

logger = logging.getLogger(__name__)

WRITE_OPTIONS = {"dictionary_pagesize_limit": 64 << 20}
"""Parquet writer options of a clustered data set's files (see the module docstring)."""


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
