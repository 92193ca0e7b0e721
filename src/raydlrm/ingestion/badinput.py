"""Bad input: finding broken rows, and the ``fail`` / ``quarantine`` policy for them.

Training data written by a logging pipeline is occasionally broken. Row-level problems are found
by :func:`find_bad_rows`, vectorized over the raw Arrow columns of a batch (no per-row Python):

- a null or non-finite label, or a label outside ``[0, 1]``;
- a NaN or infinite dense value (a null dense value is *missing*, filled with 0, not bad);
- a null id (a null row or a null element of an id list);
- for a column read without hashing (``sparse_specs.<col>.hash = false``): a negative id or an
  id not below its table's size; for a managed table's column (``data.managed_ids``): a negative
  integer id;
- an id list shorter than ``min_length`` (by default: an empty list) or longer than
  ``max_length``;
- a null or non-finite per-id weight;
- a sequence's (``data.sequences``) null list, lists of unequal lengths in one row, or a null
  or non-finite value (:mod:`~raydlrm.ingestion.sequence_rows`).

File-level problems (an unreadable or truncated file, a column of the wrong type) are found when
the footers are checked (:func:`~raydlrm.ingestion.schema.validate_data`) or when a row group is
read.

Policy (``data.bad_input``): ``fail`` stops with a :class:`BadInputError` naming the file, row
group, row, column and reason; ``quarantine`` removes the bad rows from training and writes them,
with the reason, file, row group and row, as Parquet under ``data.quarantine_path`` (for an
unreadable file or row group, one record naming it and its row count). The driver counts what
was quarantined there (:func:`quarantine_counts`), so rows read = rows trained + rows
quarantined (+ rows an uneven split left out, counted separately), and logs the counts.

Session-clustered data (``raydlrm.ingestion.clustered``) is checked where it is stored
(:func:`apply_session_policy`): the per-session columns once per session, on the sessions
file's rows, the others per sample. A sample is bad when its own columns are, when its
session's are (the message names the sessions file, row group, row and session), or when its
session has no row in the sessions file; a bad session sets all its samples aside.

Scoring takes every row, whatever the policy: a scoring actor names the file of the first
bad row of its batch (:func:`first_unscorable_row`), and the driver finds its row group and row
in that file again (:func:`locate_unscorable_row`).

Records written while training reads the data are named after their source (file, row group)
and their pass (``<run>.<role>-e<epoch>``, :func:`run_tag`): a row group read again after a
restart (a resumed epoch re-reads the row groups it had not finished) overwrites its own record
instead of adding one, so a crash and resume never counts a bad row twice, and a run's records
are counted by their tag.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from raydlrm.ingestion._arrow import (
    beyond_float32,
    decode_dictionaries,
    flat_values,
    not_finite,
    rows_with,
)
from raydlrm.ingestion._records import (
    FILE_COLUMN,
    ROW_COLUMN,
    ROW_GROUP_COLUMN,
    quarantine_fs,
    record_name,
    run_tag,
    source_name,
    table_source,
)
from raydlrm.ingestion.column_specs import SparseSpec
from raydlrm.ingestion.config import DataConfig
from raydlrm.ingestion.sequence_rows import TRUNCATED_DIR, flag_bad_sequences

__all__ = [
    "FILE_COLUMN",
    "ROW_COLUMN",
    "ROW_GROUP_COLUMN",
    "BadInputError",
    "apply_policy",
    "apply_session_policy",
    "bad_input_in",
    "bad_row_rules",
    "drop_tagging_columns",
    "find_bad_ids",
    "find_bad_rows",
    "first_unscorable_row",
    "locate_unscorable_row",
    "quarantine_counts",
    "quarantine_rows",
    "quarantine_source",
    "run_tag",
]

_REASON_COLUMN = "_reason"
_SOURCES = "sources"  # sub-directory of unreadable files and row groups (JSON records)


class BadInputError(ValueError):
    """Bad input under the ``fail`` policy; the message names file, row group, column, row."""


def _array(table: pa.Table, column: str) -> pa.Array:
    chunked = table.column(column)
    return chunked.combine_chunks() if chunked.num_chunks != 1 else chunked.chunk(0)


class _Reasons:
    """The first problem found in each row of a batch."""

    def __init__(self, num_rows: int) -> None:
        self.reasons = np.full(num_rows, None, dtype=object)

    def flag(self, mask: np.ndarray, reason: str | np.ndarray) -> None:
        """Flags the rows of ``mask`` not flagged yet, with ``reason`` (or ``reason[row]``)."""
        new = mask & (self.reasons == None)  # noqa: E711 (element-wise comparison)
        self.reasons[new] = reason if isinstance(reason, str) else reason[new]

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        return self.reasons != None, self.reasons  # noqa: E711


def find_bad_rows(
    table: pa.Table,
    config: DataConfig,
    *,
    sparse_columns: list[str] | None = None,
    labelled: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """The rows of a raw batch that training cannot use, and why.

    Args:
        table: raw columns (label, dense, sparse, weight columns).
        config: the data config (column roles, hashing, list lengths, table sizes).
        sparse_columns: the sparse columns to check (with their weight columns); default: all
            of ``config.sparse_columns``.
        labelled: whether the label is checked (scoring reads no label: it may be absent).

    Returns:
        ``bad``: bool array, one per row; ``reasons``: object array of the same length, the
        first problem of each bad row (``"<kind> column '<name>': <problem>"``), None elsewhere.
    """
    table = decode_dictionaries(table)
    reasons = _Reasons(table.num_rows)
    flag = reasons.flag
    if labelled and config.label_column is not None:
        _check_label(_array(table, config.label_column), config.label_column, flag)
    for column in config.dense_columns:
        dense = _array(table, column)
        flag(not_finite(dense), f"dense column {column!r}: NaN or infinite value")
        flag(
            beyond_float32(dense),
            f"dense column {column!r}: value outside float32's range (infinite in training)",
        )
    for column in config.sparse_columns if sparse_columns is None else sparse_columns:
        _check_sparse(table, column, config, flag)
    flag_bad_sequences(table, config, flag)
    return reasons.result()


_RULES = {
    f.name: f.default
    for f in dataclasses.fields(SparseSpec)
    if f.name in ("hash", "min_length", "max_length", "weight_column")
}
"""The keys of a sparse column's spec that :func:`find_bad_rows` judges its ids by, with
their defaults."""


def bad_row_rules(data: dict[str, Any]) -> dict[str, Any]:
    """What :func:`find_bad_rows` judges a row by, but the columns and the tables' sizes and
    kinds: the label column and each sparse column's id rule, list lengths and weight column,
    by dotted config key (``data.sparse_specs.C1.max_length``), from a data config as a dict
    (``dataclasses.asdict``, or as a checkpoint stores it)."""
    specs = data.get("sparse_specs") or {}
    rules: dict[str, Any] = {"data.label_column": data["label_column"]}
    for column in data["sparse_columns"]:
        spec = specs.get(column) or {}
        rules.update((f"data.sparse_specs.{column}.{k}", spec.get(k, d)) for k, d in _RULES.items())
    return rules


def _check_label(label: pa.Array, column: str, flag) -> None:
    """Flags null, NaN, infinite and out-of-[0, 1] labels."""
    if label.null_count:
        flag(np.asarray(label.is_null()), f"label column {column!r}: null label")
    if pa.types.is_floating(label.type) or pa.types.is_integer(label.type):
        flag(not_finite(label), f"label column {column!r}: NaN or infinite label")
        values = label.cast(pa.float64()).fill_null(0.0).to_numpy(zero_copy_only=False)
        flag((values < 0) | (values > 1), f"label column {column!r}: label outside [0, 1]")


def find_bad_ids(
    table: pa.Table, config: DataConfig, *, columns: list[str]
) -> tuple[np.ndarray, np.ndarray]:
    """The rows of ``table`` whose sparse ``columns`` (or their weight columns) training cannot
    use, and why: :func:`find_bad_rows`'s checks of those columns alone (e.g. on the rows of a
    sessions file).

    Returns:
        ``bad`` and ``reasons`` per row, as :func:`find_bad_rows`.
    """
    table = decode_dictionaries(table)
    reasons = _Reasons(table.num_rows)
    for column in columns:
        _check_sparse(table, column, config, reasons.flag)
    return reasons.result()


def _check_sparse(table: pa.Table, column: str, config: DataConfig, flag) -> None:
    spec = config.sparse_specs.get(column)
    ids = _array(table, column)
    where = f"sparse column {column!r}"
    if ids.null_count:
        flag(np.asarray(ids.is_null()), f"{where}: null id")
    values, offsets = flat_values(ids)

    def rows(mask: np.ndarray) -> np.ndarray:
        return mask if offsets is None else rows_with(offsets, mask)

    if values.null_count:
        flag(rows(np.asarray(values.is_null())), f"{where}: null id")
    if spec is not None and not spec.hash and pa.types.is_integer(values.type):
        # In the column's own integer type: a uint64 id of 2**63 or more is too large, not
        # negative.
        raw = values.fill_null(0).to_numpy(zero_copy_only=False)
        if pa.types.is_signed_integer(values.type):
            flag(rows(raw < 0), f"{where}: negative id")
        size = config.table_size_of(column)
        flag(rows(raw >= size), f"{where}: id not below the table size {size}")
    elif config.managed_of(config.table_of(column)) and pa.types.is_integer(values.type):
        # Managed ids are kept as they are, as int64: negative ones (and uint64 ids of 2**63 or
        # more) are not ids the map can hold.
        raw = values.fill_null(0).to_numpy(zero_copy_only=False)
        limit = np.iinfo(np.int64).max
        bad = raw < 0 if pa.types.is_signed_integer(values.type) else raw > limit
        flag(rows(bad), f"{where}: managed id negative or above 2**63 - 1")
    if offsets is not None:
        lengths = np.diff(offsets)
        valid = ~np.asarray(ids.is_null()) if ids.null_count else np.ones(lengths.size, bool)
        min_length = config.min_length_of(column)
        if min_length:
            flag(valid & (lengths < min_length), f"{where}: id list shorter than {min_length}")
        if spec is not None and spec.max_length is not None:
            flag(lengths > spec.max_length, f"{where}: id list longer than {spec.max_length}")
    weight = config.weight_column_of(column)
    if weight is not None:
        weights = _array(table, weight)
        if weights.null_count:
            flag(np.asarray(weights.is_null()), f"weight column {weight!r}: null weight")
        flat, weight_offsets = flat_values(weights)
        bad = np.asarray(flat.is_null()) if flat.null_count else np.zeros(len(flat), bool)
        bad |= not_finite(flat) | beyond_float32(flat)
        if weight_offsets is not None:
            bad = rows_with(weight_offsets, bad)
        flag(bad, f"weight column {weight!r}: null, NaN, infinite or beyond float32 weight")


def quarantine_rows(
    table: pa.Table, reasons: np.ndarray, config: DataConfig, *, tag: str | None = None
) -> None:
    """Writes bad rows (all their columns, plus ``_reason``) as one Parquet file under
    ``data.quarantine_path``, named after their source file and row group and the pass ``tag``
    (the same source and pass overwrite their record)."""
    filesystem, root = quarantine_fs(config)
    filesystem.create_dir(root, recursive=True)
    source, tag = table_source(table, tag)
    out = table.append_column(_REASON_COLUMN, pa.array(list(reasons), pa.string()))
    with filesystem.open_output_stream(f"{root}/{record_name(source, tag, '.parquet')}") as stream:
        pq.write_table(out, stream)


def quarantine_source(
    config: DataConfig,
    *,
    file: str,
    reason: str,
    num_rows: int,
    row_group: int | None = None,
    tag: str | None = None,
) -> None:
    """Records an unreadable file (or row group) and its row count under the quarantine path.
    A file set aside when the footers are checked has one record (checked again, it is
    overwritten); a row group gets one per pass ``tag``."""
    filesystem, root = quarantine_fs(config)
    filesystem.create_dir(f"{root}/{_SOURCES}", recursive=True)
    record = {"file": file, "row_group": row_group, "num_rows": num_rows, "reason": reason}
    source = source_name(file, row_group)
    name = f"{source}.json" if row_group is None else record_name(source, tag, ".json")
    with filesystem.open_output_stream(f"{root}/{_SOURCES}/{name}") as stream:
        stream.write(json.dumps(record).encode())


def quarantine_counts(
    config: DataConfig, *, tag: str | None = None, once: bool = False
) -> dict[str, int]:
    """What the quarantine path holds (with a :func:`run_tag` ``tag``: only the records
    written by that run's passes over that data set, every epoch; with ``once``, each source's
    records of all epochs count once: what one pass over the data set set aside, as for the
    held-out set, which every epoch reads again).

    Returns:
        ``bad_rows`` (bad rows written), ``row_groups`` and ``row_group_rows`` (unreadable row
        groups met while reading, and their rows), ``files`` and ``file_rows`` (files set aside
        when the footers were checked, and their rows when known), and ``rows`` (all of those
        rows); zeros when nothing was quarantined.
    """
    keys = ("rows", "bad_rows", "row_groups", "row_group_rows", "files", "file_rows")
    counts = dict.fromkeys(keys, 0)
    if config.quarantine_path is None:
        return counts
    filesystem, root = quarantine_fs(config)
    if filesystem.get_file_info(root).type == pafs.FileType.NotFound:
        return counts
    seen: set[str] = set()
    truncated = f"{root.rstrip('/')}/{TRUNCATED_DIR}/"
    for info in filesystem.get_file_info(pafs.FileSelector(root, recursive=True)):
        if info.type != pafs.FileType.File or info.path.startswith(truncated):
            continue  # not a quarantine record: the counts of histories cut
        if tag is not None and f".{tag}-e" not in info.base_name:
            continue
        if once:
            source = re.sub(r"-e\d+(?=\.(parquet|json)$)", "", info.base_name)
            if source in seen:
                continue
            seen.add(source)
        if info.path.endswith(".parquet"):
            with filesystem.open_input_file(info.path) as f:
                counts["bad_rows"] += pq.ParquetFile(f).metadata.num_rows
        elif info.path.endswith(".json"):
            with filesystem.open_input_stream(info.path) as f:
                record = json.loads(f.read())
            kind = "files" if record["row_group"] is None else "row_groups"
            counts[kind] += 1
            counts[f"{kind.rstrip('s')}_rows"] += int(record["num_rows"])
    counts["rows"] = counts["bad_rows"] + counts["row_group_rows"] + counts["file_rows"]
    return counts


def drop_tagging_columns(table: pa.Table) -> pa.Table:
    """The table without the reader's file, row group and row columns."""
    keep = [c for c in table.column_names if c not in (FILE_COLUMN, ROW_GROUP_COLUMN, ROW_COLUMN)]
    return table.select(keep)


def apply_policy(table: pa.Table, config: DataConfig, *, tag: str | None = None) -> pa.Table:
    """Applies ``data.bad_input`` to a raw batch: returns the good rows (all of them when there
    are none bad), after writing the bad ones to the quarantine (as the pass ``tag``), or
    raises.

    Raises:
        BadInputError: under ``fail``, naming the file, row group, row, column and reason of
            the first bad row and how many rows are bad.
    """
    bad, reasons = find_bad_rows(table, config)
    if not bad.any():
        return table
    if config.bad_input == "fail":
        first = int(np.flatnonzero(bad)[0])
        where = "a batch"
        if FILE_COLUMN in table.column_names:
            file = table.column(FILE_COLUMN)[first].as_py()
            group = table.column(ROW_GROUP_COLUMN)[first].as_py()
            row = table.column(ROW_COLUMN)[first].as_py()
            where = f"{file}, row group {group}, row {row}"
        raise BadInputError(
            f"bad input in {where}: {reasons[first]} ({int(bad.sum())} bad rows in this batch; "
            "set data.bad_input = 'quarantine' to set them aside and continue)"
        )
    quarantine_rows(table.filter(pa.array(bad)), reasons[bad], config, tag=tag)
    return table.filter(pa.array(~bad))


def _where(table: pa.Table, row: int) -> str:
    """``<file>, row group <g>, row <r>`` of a tagged raw row (``a batch`` untagged)."""
    if FILE_COLUMN not in table.column_names:
        return "a batch"
    file = table.column(FILE_COLUMN)[row].as_py()
    group = table.column(ROW_GROUP_COLUMN)[row].as_py()
    return f"{file}, row group {group}, row {table.column(ROW_COLUMN)[row].as_py()}"


def _session_reasons(
    sessions: pa.Table, bad: np.ndarray, reasons: np.ndarray, *, session_column: str
) -> np.ndarray:
    """Each bad session's reason with the session and where it is (None for good ones),
    written once per session and given to each of its samples."""
    session_ids = sessions.column(session_column).to_numpy(zero_copy_only=False)
    out = np.full(len(bad), None, dtype=object)
    for at in np.flatnonzero(bad):
        out[at] = f"{reasons[at]} (session {session_ids[at]}, {_where(sessions, int(at))})"
    return out


def _first_bad_sample(
    samples: pa.Table,
    sessions: pa.Table,
    reasons: np.ndarray,
    *,
    session_reasons: np.ndarray,
    flags: tuple[np.ndarray, np.ndarray, np.ndarray],
    session_of: np.ndarray,
    ids: np.ndarray,
) -> BadInputError:
    """The error naming the first bad sample of a row group of session-clustered data:
    ``flags`` are the masks of all bad samples, of those bad by their session and of those
    whose session is missing (see :func:`apply_session_policy`)."""
    all_bad, inherited, lost = flags
    first = int(np.flatnonzero(all_bad)[0])
    where, reason = _where(samples, first), reasons[first]
    if inherited[first]:
        at = int(session_of[first])
        where, reason = _where(sessions, at), f"{session_reasons[at]} (session {ids[first]})"
    elif lost[first]:
        file = sessions.column(FILE_COLUMN)[0].as_py() if sessions.num_rows else None
        reason = f"session {ids[first]} has no row in the sessions file {file or ''}".strip()
    return BadInputError(
        f"bad input in {where}: {reason} ({int(all_bad.sum())} bad rows in this row "
        "group; set data.bad_input = 'quarantine' to set them aside and continue)"
    )


def apply_session_policy(
    samples: pa.Table,
    sessions: pa.Table,
    *,
    session_of: np.ndarray,
    session_column: str,
    session_columns: list[str],
    config: DataConfig,
    tag: str | None = None,
) -> np.ndarray:
    """Applies ``data.bad_input`` to a row group of session-clustered data.

    ``samples`` and ``sessions`` (``session_column`` and the per-session ``session_columns``)
    are raw columns tagged with their file, row group and row; ``session_of`` (int64) is each
    sample's row of ``sessions``, -1 when its session has none; ``tag`` names the pass whose
    quarantine records these are (see :func:`quarantine_rows`).

    Returns the mask of the samples to keep; under ``quarantine`` the others were written to
    the quarantine with their session's columns and the reason.

    Raises:
        BadInputError: under ``fail``, naming the first bad sample (file, row group, row,
            column, reason) or bad session (sessions file, row group, row, session).
    """
    per_sample = [c for c in config.sparse_columns if c not in session_columns]
    per_session = [c for c in config.sparse_columns if c in session_columns]
    bad, reasons = find_bad_rows(samples, config, sparse_columns=per_sample)
    session_bad, session_reasons = find_bad_ids(sessions, config, columns=per_session)
    missing = session_of < 0
    inherited = ~bad & ~missing & np.append(session_bad, False)[session_of]
    all_bad = bad | missing | inherited
    if not all_bad.any():
        return ~all_bad
    ids = samples.column(session_column).to_numpy(zero_copy_only=False)
    reasons = reasons.copy()
    lost = missing & ~bad
    reasons[lost] = np.char.add(
        np.char.add("session ", ids[lost].astype(str)), " has no row in the sessions file"
    )
    per_session = _session_reasons(
        sessions, session_bad, session_reasons, session_column=session_column
    )
    reasons[inherited] = per_session[session_of[inherited]]
    if config.bad_input == "fail":
        raise _first_bad_sample(
            samples,
            sessions,
            reasons,
            session_reasons=session_reasons,
            flags=(all_bad, inherited, missing & ~bad),
            session_of=session_of,
            ids=ids,
        )
    at = session_of[all_bad]
    user = sessions.select(session_columns).take(pa.array(np.maximum(at, 0), mask=at < 0))
    rows = samples.filter(pa.array(all_bad))
    names = [*rows.schema.names, *user.schema.names]
    rows = pa.Table.from_arrays([*rows.columns, *user.columns], names)
    quarantine_rows(rows, reasons[all_bad], config, tag=tag)
    return ~all_bad


def bad_input_in(exc: BaseException) -> BadInputError | None:
    """The :class:`BadInputError` behind an error of Ray Data's actors, if any. Ray Data
    re-raises a UDF's error as a ``UserCodeException`` that keeps only its text, so the error
    is found by its name in the message and made again with its own message."""
    marker = f"{BadInputError.__name__}: "
    for line in str(exc).splitlines():
        if marker in line:
            return BadInputError(line.split(marker, 1)[1].strip())
    return None


def first_unscorable_row(table: pa.Table, config: DataConfig) -> tuple[int, str] | None:
    """The index and reason of the first row of raw ``table`` that cannot be scored (its label
    is not scored, so not checked), or None."""
    bad, reasons = find_bad_rows(table, config, labelled=False)
    if not bad.any():
        return None
    first = int(np.flatnonzero(bad)[0])
    return first, str(reasons[first])


def locate_unscorable_row(
    cause: BadInputError,
    *,
    files: list[str],
    row_groups: Callable[[str], Iterable[pa.Table]],
    config: DataConfig,
) -> BadInputError:
    """The bad row a scoring actor named by its file (``<file>: <reason>``), with its row
    group and row, found by reading that file's row groups (``row_groups(file)``) again;
    ``cause`` as it is when it names none of ``files``. Scoring refuses bad rows whatever
    ``data.bad_input`` says (it applies to training), so the message suggests no quarantine."""
    file = next((p for p in files if str(cause).startswith(f"{p}: ")), None)
    if file is None:
        return cause
    for group, table in enumerate(row_groups(file)):
        found = first_unscorable_row(table, config)
        if found is not None:
            row, reason = found
            return BadInputError(
                f"bad input in {file}, row group {group}, row {row}: {reason} (scoring "
                "takes every row: fix or remove it)"
            )
    return cause
