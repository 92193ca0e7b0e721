"""Checks a Parquet data set against the data config before any training starts.

:func:`validate_data` reads only Parquet footers (file metadata), never the data: it checks that
the path exists, that it holds Parquet files with at least one row, and that every file has the
label, every dense and every sparse column with a usable type. Each error names the path, the
file and the column, so a wrong data set stops the job at submission, not hours into a run.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq

from raydlrm.ingestion._arrow import decoded_type, is_list, is_string
from raydlrm.ingestion.badinput import quarantine_source
from raydlrm.ingestion.config import DataConfig
from raydlrm.storage import StorageError, list_files

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
    """

    file: str
    index: int
    num_rows: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class DataSummary:
    """What :func:`validate_data` found.

    Attributes:
        path: the data set's path, as given.
        num_rows: rows over all files (from the Parquet footers).
        num_files: number of Parquet files.
        schema: the Arrow schema of the first file.
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
    fragments = _fragments(path, config=config, role=role)
    scan = _scan(fragments, config=config, role=role)
    schema = _schema_of_rows(scan, path=path, role=role)
    _check_weight_shapes(schema, config=config, role=role)
    _check_unhashed_ids(schema, config=config, role=role)
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
    """One file's Parquet footer and Arrow schema."""

    metadata: pq.FileMetaData
    schema: pa.Schema


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
    """``(column, kind)`` of every column a file must have: label, dense, sparse, weights."""
    weights = (config.weight_column_of(c) for c in config.sparse_columns)
    return [
        (config.label_column, "label"),
        *((c, "dense") for c in config.dense_columns),
        *((c, "sparse") for c in config.sparse_columns),
        *((w, "weight") for w in weights if w is not None),
    ]


def _scan(fragments: list[pads.ParquetFileFragment], *, config: DataConfig, role: str) -> _Scan:
    """Checks every file's footer; a bad file fails the check, or is set aside under
    ``data.bad_input = "quarantine"``."""
    expected = _expected_columns(config)
    scan = _Scan()
    for fragment in fragments:
        try:
            footer = _check_file(fragment, expected, role=role)
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
        scan.row_groups.extend(
            RowGroup(fragment.path, i, footer.metadata.row_group(i).num_rows)
            for i in range(footer.metadata.num_row_groups)
        )
    return scan


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


def _footer_rows(fragment: pads.ParquetFileFragment) -> int:
    """Rows of a file by its footer; 0 when the footer cannot be read."""
    try:
        return fragment.metadata.num_rows
    except (pa.ArrowInvalid, OSError):
        return 0
