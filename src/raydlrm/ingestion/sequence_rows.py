"""Sequence features on the data path: their bad rows, their cut to ``max_length``, and the
counts of rows cut.

Every column of a sequence (:class:`~raydlrm.ingestion.sequence_specs.SequenceSpec`) holds one
list of events per row, oldest first, all of a row's lists equally long. A row is bad input
(:func:`flag_bad_sequences`, one of the checks of
:func:`~raydlrm.ingestion.badinput.find_bad_rows`) when a column's list is null (an empty list
is not), when the lists of its columns differ in length (the reason names the column and both
lengths), or when a value list holds a null, NaN, infinite or beyond-float32 value. The id
columns are sparse columns and checked as such too: null ids, ``hash = false`` ranges, the
sequence's ``min_length``.

The good rows then keep their last ``max_length`` events in every column of the sequence
alike (:func:`truncate_sequences`), vectorized over the list offsets: no padding, the lists
stay jagged. How many rows each sequence cut is recorded per source and pass under
``data.quarantine_path`` (``truncated/``), named as the quarantine's records are
(:mod:`~raydlrm.ingestion._records`): a row group read again after a restart overwrites its
record, and the driver sums a run's records (:func:`truncated_counts`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs

from raydlrm.ingestion._arrow import beyond_float32, flat_values, is_list, not_finite, rows_with
from raydlrm.ingestion._records import quarantine_fs, record_name, table_source
from raydlrm.ingestion.config import DataConfig

__all__ = [
    "TRUNCATED_DIR",
    "flag_bad_sequences",
    "truncate_sequences",
    "truncated_counts",
    "value_lists",
]

TRUNCATED_DIR = "truncated"
"""Sub-directory of ``data.quarantine_path`` holding the counts of rows cut (JSON records)."""

Flag = Callable[[np.ndarray, "str | np.ndarray"], None]
"""Flags the rows of a mask as bad with a reason (one for all, or one per row)."""


def _list_array(table: pa.Table, column: str, *, name: str) -> pa.Array:
    chunked = table.column(column)
    array = chunked.combine_chunks() if chunked.num_chunks != 1 else chunked.chunk(0)
    if not is_list(array.type):
        raise ValueError(
            f"sequence {name!r}: column {column!r} has type {array.type}, expected a list (one "
            "list of events per row)"
        )
    return array


def _lengths(array: pa.Array) -> np.ndarray:
    """The length of each row's list, int64 (0 for a null list)."""
    return array.value_lengths().fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)


def flag_bad_sequences(table: pa.Table, config: DataConfig, flag: Flag) -> None:
    """Flags the rows of raw ``table`` whose sequences training cannot use (see the module
    docstring): null lists, lists of unequal lengths, null or non-finite values.

    Raises:
        ValueError: a sequence's column is not a list column (naming it).
    """
    for name, spec in config.sequences.items():
        first = spec.columns[0]
        base = _lengths(_list_array(table, first, name=name))
        for column in spec.all_columns:
            array = _list_array(table, column, name=name)
            where = f"sequence {name!r} column {column!r}"
            if array.null_count:
                flag(np.asarray(array.is_null()), f"{where}: null list")
            own = _lengths(array)
            differ = own != base
            if differ.any():
                at = np.flatnonzero(differ)
                reasons = np.full(own.size, None, dtype=object)
                reasons[at] = np.char.add(
                    np.char.add(f"{where}: list of length ", own[at].astype(str)),
                    np.char.add(f", column {first!r} of length ", base[at].astype(str)),
                )
                flag(differ, reasons)
            if column in spec.value_columns:
                values, offsets = flat_values(array)
                bad = not_finite(values) | beyond_float32(values)
                if values.null_count:
                    bad |= np.asarray(values.is_null())
                flag(rows_with(offsets, bad), f"{where}: null, NaN, infinite or beyond float32")


def truncate_sequences(table: pa.Table, config: DataConfig, *, tag: str | None = None) -> pa.Table:
    """``table`` (raw good rows, tagged with their source) with each row's sequences cut to
    their last ``max_length`` events, in every column of a sequence alike; the rows cut are
    recorded for the pass ``tag`` (see the module docstring; nothing without a tag, or
    without ``data.quarantine_path``).

    Args:
        table: rows whose sequences passed :func:`flag_bad_sequences`.
        config: the data config.
        tag: the pass, ``<run>.<role>-e<epoch>``.

    Returns:
        The table, the cut columns as new list arrays of the same value types.
    """
    cut: dict[str, int] = {}
    for name, spec in config.sequences.items():
        lengths = _lengths(_list_array(table, spec.columns[0], name=name))
        kept = np.minimum(lengths, spec.max_length)
        cut[name] = int((lengths > kept).sum())
        if not cut[name]:
            continue
        offsets = np.zeros(kept.size + 1, dtype=np.int64)
        np.cumsum(kept, out=offsets[1:])
        # The last kept[r] events of row r: from its end (old offsets) back.
        ends = np.cumsum(lengths)
        index = np.repeat(ends - kept - offsets[:-1], kept) + np.arange(offsets[-1])
        for column in spec.all_columns:
            array = _list_array(table, column, name=name)
            values, old = flat_values(array)
            assert old is not None and np.array_equal(np.diff(old), lengths), "cleaned rows"
            lists = pa.LargeListArray if pa.types.is_large_list(array.type) else pa.ListArray
            width = np.int64 if lists is pa.LargeListArray else np.int32
            out = lists.from_arrays(pa.array(offsets.astype(width)), values.take(pa.array(index)))
            table = table.set_column(table.column_names.index(column), column, out)
    _record(table, cut, config, tag=tag)
    return table


def value_lists(table: pa.Table, column: str) -> pa.Array:
    """Value column ``column`` of ``table`` as ``list<float32>`` (its offsets from 0)."""
    chunked = table.column(column)
    array = chunked.combine_chunks() if chunked.num_chunks != 1 else chunked.chunk(0)
    values, offsets = flat_values(array)
    assert offsets is not None, "a value column is a list column (checked with the schema)"
    floats = values.cast(pa.float32(), safe=False)
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), floats)


def _record(table: pa.Table, cut: dict[str, int], config: DataConfig, *, tag: str | None) -> None:
    """Writes the rows each sequence cut in ``table`` (one source's rows) as a JSON record of
    its source and the pass ``tag``, when any was cut."""
    if tag is None or config.quarantine_path is None or not any(cut.values()):
        return
    filesystem, root = quarantine_fs(config)
    filesystem.create_dir(f"{root}/{TRUNCATED_DIR}", recursive=True)
    source, tag = table_source(table, tag)
    record = {"source": source, "rows_truncated": cut}
    path = f"{root}/{TRUNCATED_DIR}/{record_name(source, tag, '.json')}"
    with filesystem.open_output_stream(path) as stream:
        stream.write(json.dumps(record).encode())


def truncated_counts(config: DataConfig, *, tag: str, once: bool = False) -> dict[str, int]:
    """The rows each sequence cut to its ``max_length`` in the passes of a run over a data set
    (``tag``, :func:`~raydlrm.ingestion._records.run_tag`), every epoch; with ``once``, each
    source's records of all epochs count once (what one pass cut, as for the held-out set,
    which every evaluation reads again).

    Returns:
        Sequence name -> rows cut (0 for each sequence without a record).
    """
    counts = dict.fromkeys(config.sequences, 0)
    if config.quarantine_path is None:
        return counts
    filesystem, root = quarantine_fs(config)
    selector = pafs.FileSelector(f"{root}/{TRUNCATED_DIR}", allow_not_found=True)
    seen: set[str] = set()
    for info in filesystem.get_file_info(selector):
        if info.type != pafs.FileType.File or f".{tag}-e" not in info.base_name:
            continue
        source = re.sub(r"-e\d+(?=\.json$)", "", info.base_name)
        if once and source in seen:
            continue
        seen.add(source)
        with filesystem.open_input_stream(info.path) as f:
            record = json.loads(f.read())
        for name, rows in record["rows_truncated"].items():
            counts[name] = counts.get(name, 0) + int(rows)
    return counts
