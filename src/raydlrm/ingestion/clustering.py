"""Converting a sample-level data set into a session-clustered one (RecD): :func:`cluster_data`.

:func:`cluster_data` converts a sample-level data set, file by file (one file in memory at a
time), keeping its relative paths (hive partitions) and its row groups
(``raydlrm.ingestion._cluster_file``: each file's checks and writes). It checks the source (it
matches the config, is not clustered yet, has the session column) and the output directory (it
holds no files, is not inside the source nor the source inside it) first, picks the
per-session columns (named, the dedup groups', or those constant within the sessions of the
first rows), and writes the layout's marker (:mod:`raydlrm.ingestion.layout`) last: a conversion
that stops leaves no data set, and one run again into the same directory starts from nothing.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass

import pyarrow.fs as pafs

from raydlrm.ingestion._cluster_file import Written, cluster_file
from raydlrm.ingestion.clustered import data_bytes, read_rows
from raydlrm.ingestion.config import DataConfig
from raydlrm.ingestion.layout import ClusteredLayout, read_layout, relative_path, write_layout
from raydlrm.ingestion.schema import DataSummary, DataValidationError, validate_data
from raydlrm.ingestion.sessions import constant_columns
from raydlrm.storage import SAMPLES_DIR, SESSIONS_DIR, filesystem_for, join

__all__ = ["INFER_ROWS", "ClusterResult", "cluster_data"]

logger = logging.getLogger(__name__)

INFER_ROWS = 200_000
"""Rows read to find the columns constant within sessions, when none are named."""


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
    written = Written()
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
    result = _result(
        written, out, columns, sizes=(data_bytes(source, config), data_bytes(out, config))
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
    written: Written,
) -> None:
    """Clusters each file of ``source`` into the samples and sessions files of the same
    relative path under ``out`` (filesystem, root)."""
    filesystem, out_root = out
    source_fs, source_root = filesystem_for(source, config.storage)
    for file in dict.fromkeys(g.file for g in summary.row_groups):
        relative = relative_path(file, source_root)
        cluster_file(
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
    those constant within the sessions of the data's first rows but the sequences'), and
    their weights.

    Raises:
        ValueError: a named column that is not a sparse column or is a sequence's, or none
            found.
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
            columns=[c for c in config.sparse_columns if config.sequence_of(c) is None],
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
    sequences = [c for c in named if config.sequence_of(c) is not None]
    if sequences:
        raise ValueError(
            f"session columns {sequences} are sequence columns (data.sequences), which are read "
            "per sample in this version"
        )
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


def _result(
    written: Written, out: str, columns: list[str], *, sizes: tuple[int, int]
) -> ClusterResult:
    """The result of clustering into ``out``; ``sizes`` are the source's and ``out``'s
    bytes."""
    return ClusterResult(
        out=out,
        session_columns=columns,
        num_files=written.files,
        num_samples=written.samples,
        num_sessions=written.sessions,
        quarantined_sessions=written.bad_sessions,
        quarantined_samples=written.bad_samples,
        source_bytes=sizes[0],
        clustered_bytes=sizes[1],
    )
