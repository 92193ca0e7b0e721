"""Records that reading the data leaves under ``data.quarantine_path``: how raw rows are tagged
with where they come from, and how a record is named after its source and its pass.

Two kinds of records use them: the bad rows and unreadable sources that
:mod:`~raydlrm.ingestion.badinput` sets aside, and the counts of histories cut to their
sequence's ``max_length`` (:mod:`~raydlrm.ingestion.sequence_rows`). A record written while
training reads the data is named after its source (file, row group) and its pass
(``<run>.<role>-e<epoch>``, :func:`run_tag`): a row group read again after a restart overwrites
its own record instead of adding one, so a crash and resume never counts a row twice.
"""

from __future__ import annotations

import os
import re
import uuid
import zlib

import pyarrow as pa
import pyarrow.fs as pafs

from raydlrm.ingestion.config import DataConfig
from raydlrm.storage import filesystem_for

__all__ = [
    "FILE_COLUMN",
    "ROW_COLUMN",
    "ROW_GROUP_COLUMN",
    "quarantine_fs",
    "record_name",
    "run_tag",
    "source_name",
    "table_source",
]

FILE_COLUMN = "__file"
"""Column the reader adds: the file a row came from."""
ROW_GROUP_COLUMN = "__row_group"
"""Column the reader adds: the row group of the file a row came from."""
ROW_COLUMN = "__row"
"""Column the reader adds: the row's position in its row group."""


def source_name(file: str, row_group: int | None) -> str:
    """A record's name for a source: the file's stem, a hash of its whole path (two data sets
    may both hold ``part-0.parquet``) and the row group."""
    where = "file" if row_group is None else f"rg{row_group}"
    stem = os.path.basename(file).removesuffix(".parquet")
    return f"{stem}-{zlib.crc32(file.encode()):08x}.{where}"


def run_tag(run: str, role: str) -> str:
    """The tag of a run's passes over one data set, ``<run>.<role>`` (the run name made
    file-name safe); pass ``epoch`` of it is tagged ``<run>.<role>-e<epoch>``."""
    return f"{re.sub(r'[^A-Za-z0-9_-]', '_', run)}.{role}"


def record_name(source: str, tag: str | None, suffix: str) -> str:
    """``<source>.<tag><suffix>``; without a pass (a batch of the Ray Data path), each write
    is kept apart (a random tag)."""
    return f"{source}.{tag if tag else uuid.uuid4().hex[:12]}{suffix}"


def table_source(table: pa.Table, tag: str | None) -> tuple[str, str | None]:
    """The source of a tagged raw table's rows (``batch`` untagged or empty) and the pass to
    name its record with: None when the rows come from several row groups (not one source's
    record)."""
    if FILE_COLUMN not in table.column_names or not table.num_rows:
        return "batch", tag
    groups = table.column(ROW_GROUP_COLUMN)
    source = source_name(table.column(FILE_COLUMN)[0].as_py(), groups[0].as_py())
    if len(groups.unique()) > 1 or len(table.column(FILE_COLUMN).unique()) > 1:
        return source, None
    return source, tag


def quarantine_fs(config: DataConfig) -> tuple[pafs.FileSystem, str]:
    """The filesystem and root of ``data.quarantine_path``.

    Raises:
        ValueError: it is not set.
    """
    path = config.quarantine_path
    if path is None:
        raise ValueError("data.quarantine_path must be set with data.bad_input = 'quarantine'")
    return filesystem_for(path, config.storage)
