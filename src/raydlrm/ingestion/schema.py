"""Checks a Parquet data set against the data config before any training starts.

:func:`validate_data` reads only Parquet footers (file metadata), never the data: it checks that
the path exists, that it holds Parquet files with at least one row, and that every file has the
label, every dense and every sparse column with a usable type. Each error names the path, the
file and the column, so a wrong data set stops the job at submission, not hours into a run.

A session-clustered data set (:mod:`raydlrm.ingestion.layout`) is checked as the pairs of files
it is made of: each samples file needs its sessions file, with as many row groups and no more
sessions than samples in each, the per-session columns in the sessions file and the others in
the samples file. Its summary's schema is the training schema (the samples' columns and the
per-session ones, marked with the layout) and each row group names its sessions file. Whether
every sample's session has a row is checked when the row group is read (it needs the data).

With ``data.time_column`` set, each training row group's time is the column's minimum in it,
from the footer's statistics (:func:`_row_group_times`): what ``data.order = "time"`` deals the
row groups by, still without reading the data.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from raydlrm.ingestion._arrow import decoded_type, is_list, is_string
from raydlrm.ingestion.badinput import quarantine_source
from raydlrm.ingestion.config import DataConfig
from raydlrm.ingestion.layout import (
    ClusteredLayout,
    layout_of,
    read_layout,
    sessions_file_of,
    with_layout,
)
from raydlrm.storage import StorageError, filesystem_for, list_files

__all__ = [
    "SAMPLE_ID_COLUMN",
    "DataSummary",
    "DataValidationError",
    "RowGroup",
    "check_id_kinds",
    "id_kinds_of",
    "validate_data",
]

SAMPLE_ID_COLUMN = "sample_id"
"""Optional int64 column of globally unique sample ids; carried into batches when present."""


class DataValidationError(ValueError):
    """A data set does not match the data config (missing path, file, rows or column)."""


@dataclass(frozen=True)
class RowGroup:
    """One row group of one Parquet file: the unit the readers are given.

    Attributes:
        file: the file's path as its filesystem names it (``bucket/key`` for S3).
        index: the row group's index in the file.
        num_rows: its rows (from the footer).
        sessions_file: in a session-clustered data set, the sessions file whose row group
            ``index`` holds the sessions of this one; None for sample-level data.
        time: the minimum of ``data.time_column`` in it (footer statistics): seconds since
            1970 for a timestamp or date, else the value; None without a time column (or
            outside the training data).
    """

    file: str
    index: int
    num_rows: int
    sessions_file: str | None = None
    time: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class DataSummary:
    """What :func:`validate_data` found.

    Attributes:
        path: the data set's path, as given.
        num_rows: rows over all files (from the Parquet footers).
        num_files: number of Parquet files.
        schema: the Arrow schema of the first file (of a session-clustered data set, its
            training schema: the samples' columns and the per-session ones, marked with the
            layout, see :func:`~raydlrm.ingestion.layout.layout_of`).
        list_columns: the sparse columns that hold id lists (the others hold one id per row).
        row_groups: every row group of the files that passed (the unit of reading).
        quarantined_files: files set aside under ``data.bad_input = "quarantine"``.
    """

    path: str
    num_rows: int
    num_files: int
    schema: pa.Schema
    list_columns: list[str]
    row_groups: list[RowGroup] = field(default_factory=list)
    quarantined_files: list[str] = field(default_factory=list)


def _is_id(type_: pa.DataType) -> bool:
    """Integer or string (binary) ids."""
    return pa.types.is_integer(type_) or is_string(type_)


def id_kinds_of(schema: pa.Schema, config: DataConfig) -> dict[str, str]:
    """The kind of ids (``integer`` or ``string``) of each sparse column of ``schema``."""
    kinds = {}
    for column in config.sparse_columns:
        if column not in schema.names:
            continue
        type_ = decoded_type(schema.field(column).type)
        value_type = type_.value_type if is_list(type_) else type_
        kinds[column] = "string" if is_string(value_type) else "integer"
    return kinds


def check_id_kinds(schema: pa.Schema, config: DataConfig, *, what: str) -> None:
    """Checks that the sparse columns of ``schema`` hold the kind of ids ``config.id_kinds``
    records (columns it does not record pass).

    Raises:
        DataValidationError: naming ``what`` (the data), the column and both kinds.
    """
    for column, kind in id_kinds_of(schema, config).items():
        expected = config.id_kinds.get(column)
        if expected is not None and kind != expected:
            raise DataValidationError(
                f"{what}: sparse column {column!r} holds {kind} ids "
                f"({schema.field(column).type}), the model was trained on {expected} ids "
                f"(data.id_kinds.{column}): integers and strings hash to different rows, so "
                "every lookup would read another row; convert the column to "
                f"{expected}s"
            )


def _is_number(type_: pa.DataType) -> bool:
    return pa.types.is_integer(type_) or pa.types.is_floating(type_)


def _check_type(column: str, type_: pa.DataType, *, kind: str, file: str) -> None:
    stored = type_
    type_ = decoded_type(type_)  # dictionary-encoded columns are checked by their values
    if kind == "label":
        ok = pa.types.is_integer(type_) or pa.types.is_floating(type_) or pa.types.is_boolean(type_)
        expected = "integer, float or bool"
    elif kind == "dense":
        ok = _is_number(type_)
        expected = "integer or float"
    elif kind == "weight":
        ok = _is_number(type_) or (is_list(type_) and _is_number(type_.value_type))
        expected = "float or list of floats"
    elif kind == "sequence value":
        ok = is_list(type_) and _is_number(decoded_type(type_.value_type))
        expected = "a list of numbers (one per event)"
    else:
        ok = _is_id(type_) or (is_list(type_) and _is_id(type_.value_type))
        expected = "integer or string ids, or a list of either"
    if not ok:
        raise DataValidationError(
            f"{kind} column {column!r} in {file} has type {stored}, expected {expected}"
        )


def validate_data(path: str, config: DataConfig, *, role: str = "train") -> DataSummary:
    """Checks that ``path`` holds Parquet data with the columns ``config`` names.

    Args:
        path: a Parquet file or a directory of them, local or a URI (``s3://...``).
        config: the data config naming the label, dense and sparse columns.
        role: what the data is for (``"train"``, ``"eval"``), used in error messages.

    Returns:
        The row and file counts and the schema.

    Raises:
        DataValidationError: naming the path, file and column of the first problem found.
    """
    try:
        layout = read_layout(path, config.storage)
    except ValueError as exc:
        raise DataValidationError(f"{role} data: {exc}") from exc
    fragments = _fragments(path, config=config, role=role)
    scan = _scan(fragments, config=config, role=role, layout=layout, path=path)
    schema = _schema_of_rows(scan, path=path, role=role)
    _check_weight_shapes(schema, config=config, role=role)
    _check_unhashed_ids(schema, config=config, role=role)
    _check_sequences(schema, config=config, role=role)
    return DataSummary(
        path=path,
        num_rows=scan.num_rows,
        num_files=len(fragments) - len(scan.quarantined),
        schema=schema,
        list_columns=[c for c in config.sparse_columns if is_list(schema.field(c).type)],
        row_groups=scan.row_groups,
        quarantined_files=scan.quarantined,
    )


@dataclass
class _Scan:
    """What the footers of a data set's files gave, over the files that passed."""

    num_rows: int = 0
    schema: pa.Schema | None = None  # the first passing file's
    row_groups: list[RowGroup] = field(default_factory=list)
    quarantined: list[str] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)  # of each quarantined file


@dataclass(frozen=True)
class _Footer:
    """One file's Parquet footer and Arrow schema (of a clustered data set's samples file: the
    training schema, and its sessions file)."""

    metadata: pq.FileMetaData
    schema: pa.Schema
    sessions_file: str | None = None


def _fragments(path: str, *, config: DataConfig, role: str) -> list[pads.ParquetFileFragment]:
    """The Parquet files of the data set (the partitions of ``role``), unread."""
    try:
        filesystem, files = list_files(path, config.storage, config.partitions_for(role), role=role)
    except StorageError as exc:
        raise DataValidationError(str(exc)) from exc
    parquet = pads.ParquetFileFormat()
    # Fragments read nothing until asked: an unreadable file is reported (or quarantined) when
    # _scan reads its footer.
    return [parquet.make_fragment(f, filesystem=filesystem) for f in files]


def _expected_columns(config: DataConfig) -> list[tuple[str, str]]:
    """``(column, kind)`` of every column a file must have: label, dense, sparse, weights,
    sequence values."""
    weights = (config.weight_column_of(c) for c in config.sparse_columns)
    return [
        *((c, "label") for c in config.label_columns()),
        *((c, "dense") for c in config.dense_columns),
        *((c, "sparse") for c in config.sparse_columns),
        *((w, "weight") for w in weights if w is not None),
        *((c, "sequence value") for c in config.value_columns()),
    ]


def _scan(
    fragments: list[pads.ParquetFileFragment],
    *,
    config: DataConfig,
    role: str,
    layout: ClusteredLayout | None,
    path: str,
) -> _Scan:
    """Checks every file's footer (of a clustered data set, every pair of files); a bad file
    fails the check, or is set aside under ``data.bad_input = "quarantine"``. The training
    data's row groups get their times (``data.time_column``), which no policy sets aside: a
    file without them is a config to change, not bad input."""
    expected = _expected_columns(config)
    time_column = config.time_column if role == "train" else None
    root = filesystem_for(path, config.storage)[1]
    scan = _Scan()
    for fragment in fragments:
        try:
            if layout is None:
                footer = _check_file(fragment, expected, role=role)
            else:
                footer = _check_pair(fragment, expected, role=role, layout=layout, root=root)
        except DataValidationError as exc:
            if config.bad_input == "fail":
                raise
            # Quarantine: the file is set aside whole and recorded with its rows (when its
            # footer could be read), and the rest of the data set goes on.
            quarantine_source(
                config, file=fragment.path, reason=str(exc), num_rows=_footer_rows(fragment)
            )
            scan.quarantined.append(fragment.path)
            scan.reasons.append(str(exc))
            continue
        scan.schema = scan.schema or footer.schema
        scan.num_rows += footer.metadata.num_rows
        metadata = footer.metadata
        times: list[float | None] = [None] * metadata.num_row_groups
        if time_column is not None:
            times = [*_row_group_times(metadata, column=time_column, file=fragment.path, role=role)]
        scan.row_groups.extend(
            RowGroup(fragment.path, i, metadata.row_group(i).num_rows, footer.sessions_file, t)
            for i, t in enumerate(times)
        )
    return scan


_SECONDS_PER = {"milliseconds": 1e-3, "microseconds": 1e-6, "nanoseconds": 1e-9}
_TIME_FIX = "write the files with statistics, or unset data.time_column to use the file order"


def _time_scale(column: pq.ColumnSchema) -> float | None:
    """What a raw (physical) statistic of a time column is multiplied by: seconds per tick of
    a timestamp, per day of a date; 1 for an integer or a float; None for other types."""
    logical = column.logical_type
    if logical.type == "TIMESTAMP":
        return _SECONDS_PER[json.loads(logical.to_json())["timeUnit"]]
    if logical.type == "DATE":
        return 86_400.0
    numeric = column.physical_type in ("INT32", "INT64", "FLOAT", "DOUBLE")
    return 1.0 if numeric and logical.type in ("NONE", "INT") else None


def _row_group_times(
    metadata: pq.FileMetaData, *, column: str, file: str, role: str
) -> list[float]:
    """Each row group's minimum of the time ``column``, from the footer's statistics:
    seconds since 1970 for a timestamp or a date, else the number.

    Raises:
        DataValidationError: the file lacks the column, has it of another type, or has a row
            group without a minimum of it (no statistics written, or only nulls), naming the
            file, the row group and the column.
    """
    schema = metadata.schema
    index = next((j for j in range(len(schema)) if schema.column(j).path == column), None)
    if index is None:
        raise DataValidationError(
            f"{role} data file {file} has no time column {column!r} (data.time_column): "
            "name a column of the data, or unset data.time_column to use the file order"
        )
    scale = _time_scale(schema.column(index))
    if scale is None:
        found = schema.column(index)
        raise DataValidationError(
            f"time column {column!r} (data.time_column) in {file} has type "
            f"{found.logical_type} ({found.physical_type}), expected a timestamp, date, "
            "integer or float"
        )
    times = []
    for i in range(metadata.num_row_groups):
        stats = metadata.row_group(i).column(index).statistics
        if stats is None or not stats.has_min_max:
            raise DataValidationError(
                f"{role} data: row group {i} of {file} has no statistics (minimum) for time "
                f"column {column!r} (data.time_column; or only nulls): {_TIME_FIX}"
            )
        times.append(float(stats.min_raw) * scale)
    return times


def _schema_of_rows(scan: _Scan, *, path: str, role: str) -> pa.Schema:
    """The data set's schema, after checking that some file passed and that it has rows."""
    if scan.schema is None:
        raise DataValidationError(
            f"{role} data at {path!r}: every file was quarantined ({len(scan.quarantined)} "
            f"files; the first: {scan.reasons[0]})"
        )
    if scan.num_rows == 0:
        raise DataValidationError(f"{role} data set at {path!r} is empty (0 rows)")
    return scan.schema


def _check_weight_shapes(schema: pa.Schema, *, config: DataConfig, role: str) -> None:
    """Id lists need lists of weights, single ids single weights."""
    for column in config.sparse_columns:
        weight = config.weight_column_of(column)
        if weight is None:
            continue
        ids, weights = schema.field(column).type, schema.field(weight).type
        if is_list(ids) != is_list(weights):
            raise DataValidationError(
                f"{role} data: weight column {weight!r} ({weights}) does not match sparse "
                f"column {column!r} ({ids}): id lists need lists of weights, single ids single "
                "weights"
            )


def _check_sequences(schema: pa.Schema, *, config: DataConfig, role: str) -> None:
    """A sequence's id columns hold lists (one per row, of its events), read per sample: a
    session-clustered data set may not store them per session."""
    layout = layout_of(schema)
    for name, spec in config.sequences.items():
        for column in spec.columns:
            type_ = schema.field(column).type
            if not is_list(decoded_type(type_)):
                raise DataValidationError(
                    f"{role} data: sparse column {column!r} of sequence {name!r} "
                    f"(data.sequences.{name}) has type {type_}, expected a list of ids (one "
                    "list of events per row)"
                )
        stored = [c for c in spec.all_columns if layout and c in layout.session_columns]
        if stored:
            raise DataValidationError(
                f"{role} data: the session-clustered data set stores columns {stored} of "
                f"sequence {name!r} per session; a sequence's columns are read per sample in "
                "this version (cluster the data without them)"
            )


def _check_unhashed_ids(schema: pa.Schema, *, config: DataConfig, role: str) -> None:
    """Columns that are not hashed (``hash = false``) must hold integer row numbers."""
    for column, spec in config.sparse_specs.items():
        type_ = schema.field(column).type
        value_type = type_.value_type if is_list(type_) else type_
        if not spec.hash and not pa.types.is_integer(value_type):
            raise DataValidationError(
                f"{role} data: sparse column {column!r} has type {type_}, but "
                f"data.sparse_specs.{column}.hash = false needs integer row numbers"
            )


def _check_file(
    fragment: pads.ParquetFileFragment, expected: list[tuple[str, str]], *, role: str
) -> _Footer:
    """The footer and schema of one file, after checking its columns.

    Raises:
        DataValidationError: naming the file (unreadable, truncated) or the column (missing,
            wrong type).
    """
    try:
        footer = _Footer(metadata=fragment.metadata, schema=fragment.physical_schema)
    except (pa.ArrowInvalid, OSError) as exc:
        raise DataValidationError(
            f"{role} data file {fragment.path} is not readable Parquet: {exc}"
        ) from exc
    for column, kind in expected:
        index = footer.schema.get_field_index(column)
        if index < 0:
            raise DataValidationError(
                f"{role} data file {fragment.path} has no {kind} column {column!r} "
                f"(has {footer.schema.names})"
            )
        _check_type(column, footer.schema.field(index).type, kind=kind, file=fragment.path)
    return footer


def _check_pair(
    fragment: pads.ParquetFileFragment,
    expected: list[tuple[str, str]],
    *,
    role: str,
    layout: ClusteredLayout,
    root: str,
) -> _Footer:
    """The footer of a clustered data set's samples file, with the training schema, after
    checking it and its sessions file: columns where they belong, as many row groups, no more
    sessions than samples in each row group.

    Raises:
        DataValidationError: naming the file (missing, unreadable) or the column.
    """
    per_session = set(layout.session_columns)
    key = (layout.session_column, "session")
    samples = _check_file(
        fragment, [key, *((c, k) for c, k in expected if c not in per_session)], role=role
    )
    path = sessions_file_of(fragment.path, root=root)
    sessions_fragment = pads.ParquetFileFormat().make_fragment(path, filesystem=fragment.filesystem)
    if fragment.filesystem.get_file_info(path).type != pafs.FileType.File:
        raise DataValidationError(
            f"{role} data file {fragment.path} has no sessions file {path} (clustered data set)"
        )
    sessions = _check_file(
        sessions_fragment, [key, *((c, k) for c, k in expected if c in per_session)], role=role
    )
    both = sorted(per_session & set(samples.schema.names))
    if both:
        raise DataValidationError(
            f"{role} data file {fragment.path} has per-session columns {both}, which belong in "
            f"its sessions file {path} only"
        )
    groups = samples.metadata.num_row_groups
    if sessions.metadata.num_row_groups != groups:
        raise DataValidationError(
            f"{role} data: sessions file {path} has {sessions.metadata.num_row_groups} row "
            f"groups, its samples file {fragment.path} {groups}: row group i of each must hold "
            "the same sessions"
        )
    for i in range(groups):
        num_samples = samples.metadata.row_group(i).num_rows
        num_sessions = sessions.metadata.row_group(i).num_rows
        if num_sessions > num_samples or (num_samples and not num_sessions):
            raise DataValidationError(
                f"{role} data: row group {i} of sessions file {path} has {num_sessions} "
                f"sessions for the {num_samples} samples of row group {i} of {fragment.path}"
            )
    extra = [sessions.schema.field(c) for c in layout.session_columns if c in sessions.schema.names]
    schema = pa.schema([*samples.schema, *extra])
    return _Footer(
        metadata=samples.metadata, schema=with_layout(schema, layout), sessions_file=path
    )


def _footer_rows(fragment: pads.ParquetFileFragment) -> int:
    """Rows of a file by its footer; 0 when the footer cannot be read."""
    try:
        return fragment.metadata.num_rows
    except (pa.ArrowInvalid, OSError):
        return 0
