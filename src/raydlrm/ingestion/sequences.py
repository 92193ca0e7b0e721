"""User histories from an interaction log: :func:`write_sequences` (``raydlrm data sequences``).

The log is Parquet (a file or a directory, local or ``s3://``) of (user, item, time[, extras])
rows in any order. A Ray Data job turns it into examples, one row per target event with the
user's earlier events as its history (:class:`~raydlrm.ingestion.sequences_config.
SequenceBuildConfig`, ``[data.sequence_build]``, says which), and never holds the log in one
process:

1. the footers are checked on the driver: every file has the columns, of usable types;
2. with ``split = "time"`` and no ``cutoff_time``, the time column alone is sorted (Ray Data)
   and the cuts read at the ``eval_fraction`` quantiles;
3. the item column alone is grouped by id (Ray Data): the catalogue, every item of the log
   (those of eval events only included: full ranking ranks them all), sorted by id; it is the
   one thing the driver and each task hold whole (ids, not events);
4. the events are hash-partitioned by user (``num_partitions`` groups) and each group is built
   by one task (``groupby(...).map_groups``): its events sorted by (user, time, log row), the
   splits and histories computed vectorized (:mod:`raydlrm.ingestion._histories`) and written
   a row group at a time.

Order and ties: a user's events are ordered by time, then by their row in the log (the files in
path order, then the rows in file order). An example's history is the user's events before it
in that order (the most recent ``max_length``): every event earlier in time, and the events of
the same time that come earlier in the log. No example holds an event after it in that order;
an eval example's history holds the user's earlier events whatever their split (they are in
its past). Under ``split = "time"`` events at a cut's time belong to the later split.

Output (``out``), written by the tasks, then ``items.parquet`` and, last, ``metadata.json``
(a directory without it is incomplete):

- ``train/``, ``valid/``, ``test/``: ``part-<partition>.parquet`` per partition with examples
  of that split (a split without examples has no directory), rows sorted by user, then time,
  in row groups of ``row_group_rows``. Columns: the target event's user, item (its dense row,
  int64, with ``item_ids = "rows"``), time and extra columns under their log names; ``label``
  (int64 0/1, with ``label_column``); ``hist_<item>`` (``list<int64>`` of rows, oldest first)
  and ``hist_<extra>`` per extra column (lists of the same lengths);
- ``items.parquet`` (``item_ids = "rows"``): ``row`` int64, the item id under the log's item
  column name, ``events`` (its events in the log);
- ``metadata.json``: the options, the numbers of events, users and items, rows, users and
  short-history events per split, the time cuts, the partitions and the columns.

Bad input (a missing column, a column of an unusable type, a null, a NaN time or label) stops
the build with an error naming the file (and row group, row) and column: a history with a
hole would be wrong for every later example of the user, so nothing is quarantined.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from raydlrm.ingestion._histories import SEQ_COLUMN, Cutoffs, build_examples, write_partition
from raydlrm.ingestion.badinput import BadInputError, bad_input_in
from raydlrm.ingestion.preprocess import hash_strings, mix64
from raydlrm.ingestion.schema import DataValidationError
from raydlrm.ingestion.sequences_config import SPLITS, SequenceBuildConfig
from raydlrm.storage import StorageConfig, filesystem_for, list_files

__all__ = ["ITEMS_FILE", "METADATA_FILE", "SequenceInfo", "write_sequences"]

logger = logging.getLogger(__name__)

METADATA_FILE = "metadata.json"
ITEMS_FILE = "items.parquet"
_FORMAT_VERSION = 1
_PART_COLUMN = "_partition"
_EVENTS_PER_PARTITION = 1_000_000
_KEY = "data.sequence_build"


@dataclass(frozen=True)
class SequenceInfo:
    """What :func:`write_sequences` wrote.

    Attributes:
        out: the output directory.
        rows: examples per split (``train``, ``valid``, ``test``).
        users: users with an example, per split.
        short: per split, the events that would be examples but whose history is shorter
            than ``min_history`` (not written).
        num_events: events in the log.
        num_users: distinct users in the log.
        num_items: distinct items in the log (the item table's rows, ``item_ids = "rows"``).
        cutoffs: of a time split, the cut times ``test`` and ``valid`` (JSON values; None
            where there is none); None for leave-last-out.
        num_partitions: the user partitions (files per split at most).
        seconds: the build's wall time.
    """

    out: str
    rows: dict[str, int]
    users: dict[str, int]
    short: dict[str, int]
    num_events: int
    num_users: int
    num_items: int
    cutoffs: dict[str, Any] | None
    num_partitions: int
    seconds: float


@dataclass(frozen=True)
class _Log:
    """The log's files and row groups, from their footers."""

    path: str
    storage: StorageConfig
    files: list[str]
    groups: list[tuple[int, int, int]]  # (file index, row group, the log row of its first row)
    schema: pa.Schema  # the columns read, with the first file's types
    num_rows: int


def _column_keys(config: SequenceBuildConfig) -> dict[str, str]:
    """Each log column the build reads -> the config key naming it (for messages)."""
    keys = {c: f"{_KEY}.extra_columns" for c in config.extra_columns}
    if config.label_column is not None:
        keys[config.label_column] = f"{_KEY}.label_column"
    for name in ("user_column", "item_column", "time_column"):
        keys[getattr(config, name)] = f"{_KEY}.{name}"
    return keys


def _type_problem(column: str, kind: pa.DataType, config: SequenceBuildConfig) -> str | None:
    """Why ``kind`` does not do for log column ``column``, or None."""
    types = pa.types
    if column in (config.user_column, config.item_column):
        ok = types.is_integer(kind) or types.is_string(kind) or types.is_large_string(kind)
        return None if ok else "ids must be integers or strings"
    if column == config.time_column:
        ok = types.is_integer(kind) or types.is_floating(kind) or types.is_temporal(kind)
        return None if ok else "times must be integers, floats, timestamps or dates"
    if column == config.label_column and not (types.is_integer(kind) or types.is_floating(kind)):
        return "the label column must be numeric"
    if types.is_nested(kind) or types.is_dictionary(kind):
        return "extra columns must be of a plain type (not lists, structs or dictionaries)"
    return None


def _scan(log: str, storage: StorageConfig, config: SequenceBuildConfig) -> _Log:
    """The log's files and row groups, every footer checked against ``config``.

    Raises:
        DataValidationError: a file lacks a column, or holds one of an unusable type (naming
            the file, the column and its config key), or the log holds no events.
    """
    filesystem, files = list_files(log, storage, {}, role="interaction log")
    keys = _column_keys(config)
    columns = config.log_columns()
    groups: list[tuple[int, int, int]] = []
    schema, num_rows = None, 0
    for index, path in enumerate(files):
        with filesystem.open_input_file(path) as f:
            footer = pq.read_metadata(f)
        found = footer.schema.to_arrow_schema()
        for column in columns:
            if column not in found.names:
                raise DataValidationError(
                    f"interaction log file {path} has no column {column!r} ({keys[column]}); "
                    f"its columns: {found.names}"
                )
            problem = _type_problem(column, found.field(column).type, config)
            if problem is not None:
                raise DataValidationError(
                    f"interaction log file {path}: column {column!r} ({keys[column]}) is "
                    f"{found.field(column).type}: {problem}"
                )
        if schema is None:
            schema = pa.schema([found.field(c) for c in columns])
        for group in range(footer.num_row_groups):
            groups.append((index, group, num_rows))
            num_rows += footer.row_group(group).num_rows
    if schema is None or not num_rows:
        raise DataValidationError(f"interaction log {log!r} holds no events")
    return _Log(log, storage, files, groups, schema, num_rows)


def _checked(table: pa.Table, *, path: str, group: int, config: SequenceBuildConfig) -> None:
    """Raises :class:`BadInputError` at the first null (or NaN time or label) of ``table``."""
    keys = _column_keys(config)
    for column in table.column_names:
        values = table.column(column)
        bad = values.is_null()
        what = "null"
        if column in (config.time_column, config.label_column) and pa.types.is_floating(
            values.type
        ):
            bad, what = pc.or_(bad, pc.is_nan(values)), "null or NaN"
        rows = np.flatnonzero(bad.to_numpy(zero_copy_only=False))
        if rows.size:
            raise BadInputError(
                f"bad input in {path}, row group {group}, row {int(rows[0])}: column {column!r} "
                f"({keys[column]}) is {what} ({rows.size} such rows in this row group)"
            )


def _partition_of(users: pa.Array, num_partitions: int) -> np.ndarray:
    """Each user's partition ``(n,)`` int64: a stable hash of its id, modulo the partitions."""
    if pa.types.is_integer(users.type):
        hashed = mix64(users.cast(pa.int64()).to_numpy())
    else:
        hashed = hash_strings(users)
    return (hashed % np.uint64(num_partitions)).astype(np.int64)


def _read_row_groups(
    batch: pa.Table, *, log: _Log, columns: list[str], config: SequenceBuildConfig, parts: int
) -> pa.Table:
    """A Ray Data task: the row groups of ``batch`` (file, group, first row), ``columns`` cast
    to the log's types and checked, with each event's log row and (``parts``) partition."""
    filesystem = filesystem_for(log.path, log.storage)[0]
    schema = pa.schema([log.schema.field(c) for c in columns])
    tables = []
    rows = zip(*(batch.column(c).to_pylist() for c in ("file", "group", "first")), strict=True)
    for index, group, first in rows:
        path = log.files[index]
        with filesystem.open_input_file(path) as f:
            table = pq.ParquetFile(f).read_row_group(group, columns=columns)
        try:
            table = table.select(columns).cast(schema)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
            raise BadInputError(
                f"bad input in {path}, row group {group}: its columns do not cast to the first "
                f"file's types {schema}: {e}"
            ) from None
        _checked(table, path=path, group=group, config=config)
        table = table.append_column(
            SEQ_COLUMN, pa.array(np.arange(first, first + table.num_rows, dtype=np.int64))
        )
        if parts:
            users = table.column(config.user_column).combine_chunks()
            table = table.append_column(_PART_COLUMN, pa.array(_partition_of(users, parts)))
        tables.append(table)
    return pa.concat_tables(tables)


def _events(log: _Log, *, config: SequenceBuildConfig, columns: list[str], parts: int = 0):
    """The lazy Ray dataset of the log's events (``columns``, the log row, the partition)."""
    import ray.data

    groups = ray.data.from_items([{"file": f, "group": g, "first": r} for f, g, r in log.groups])
    kwargs = {"log": log, "columns": columns, "config": config, "parts": parts}
    return groups.map_batches(
        _read_row_groups, fn_kwargs=kwargs, batch_size=1, batch_format="pyarrow"
    )


def _cut(value: Any, kind: pa.DataType, key: str) -> pa.Scalar:
    """A configured cut time as a scalar comparable with a time column of type ``kind``."""
    try:
        if pa.types.is_temporal(kind):
            return pa.scalar(value).cast(kind)
        if isinstance(value, str):
            raise ValueError("a string cut needs a timestamp or date column")
        return pa.scalar(value)
    except (ValueError, pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
        raise ValueError(
            f"{key} = {value!r} does not fit the time column of type {kind}: {e}"
        ) from None


def _cutoffs(log: _Log, config: SequenceBuildConfig) -> Cutoffs:
    """The time split's cuts: configured, or at the ``eval_fraction`` quantiles of the times."""
    kind = log.schema.field(config.time_column).type
    if config.cutoff_time is not None:
        valid = config.valid_cutoff_time
        return Cutoffs(
            test=_cut(config.cutoff_time, kind, f"{_KEY}.cutoff_time"),
            valid=None if valid is None else _cut(valid, kind, f"{_KEY}.valid_cutoff_time"),
        )
    held = max(1, round(config.eval_fraction * log.num_rows))
    if 2 * held >= log.num_rows:
        raise ValueError(
            f"{_KEY}.eval_fraction = {config.eval_fraction}: {log.num_rows} events leave no "
            "training events after the validation and test events"
        )
    column = config.time_column
    times = _events(log, config=config, columns=[column]).select_columns([column]).sort(column)
    parts = times.split_at_indices([log.num_rows - 2 * held, log.num_rows - held])
    valid, test = (pa.scalar(p.take(1)[0][column], type=kind) for p in parts[1:])
    return Cutoffs(test=test, valid=valid)


def _catalogue(log: _Log, config: SequenceBuildConfig, *, parts: int) -> pa.Table:
    """The log's distinct items, sorted: ``row``, the item column, ``events``."""
    column = config.item_column
    items = _events(log, config=config, columns=[column]).select_columns([column])
    counted = items.groupby(column, num_partitions=parts).count()
    batches = list(counted.iter_batches(batch_format="pyarrow", batch_size=None))
    table = pa.concat_tables(batches).sort_by(column)
    return pa.table(
        {
            "row": pa.array(np.arange(table.num_rows, dtype=np.int64)),
            column: table.column(column),
            "events": table.column(table.column_names[1]).cast(pa.int64()),
        }
    )


def _build_group(
    events: pa.Table,
    *,
    config: SequenceBuildConfig,
    cutoffs: Cutoffs | None,
    catalogue: Any,
    out: tuple[str, StorageConfig],
) -> pa.Table:
    """A Ray Data task: builds and writes one partition's examples; returns its counts."""
    import ray

    partition = int(events.column(_PART_COLUMN)[0].as_py())
    built = build_examples(
        events.drop_columns([_PART_COLUMN]),
        config=config,
        cutoffs=cutoffs,
        catalogue=None if catalogue is None else ray.get(catalogue),
    )
    filesystem, root = filesystem_for(*out)
    counts = write_partition(
        built, config=config, partition=partition, filesystem=filesystem, root=root
    )
    return pa.table({"partition": [partition], **{k: [v] for k, v in counts.items()}})


def _build(
    log: _Log,
    *,
    config: SequenceBuildConfig,
    cutoffs: Cutoffs | None,
    catalogue: pa.Table,
    out: tuple[str, StorageConfig],
    parts: int,
) -> list[dict[str, int]]:
    """Runs the partitions' tasks; their counts."""
    import ray

    ref = None
    if config.item_ids == "rows":  # put once, read by every task
        ref = ray.put(catalogue.column(config.item_column).combine_chunks())
    events = _events(log, config=config, columns=config.log_columns(), parts=parts)
    kwargs = {"config": config, "cutoffs": cutoffs, "catalogue": ref, "out": out}
    built = events.groupby(_PART_COLUMN, num_partitions=parts).map_groups(
        _build_group, fn_kwargs=kwargs, batch_format="pyarrow"
    )
    return built.take_all()


def _clear_output(filesystem: pafs.FileSystem, root: str, *, out: str, overwrite: bool) -> None:
    """Removes an earlier build from ``root`` (``metadata.json`` first) when ``overwrite``.

    Raises:
        FileExistsError: ``root`` holds a build's files and ``overwrite`` is False.
    """
    names = [METADATA_FILE, ITEMS_FILE, *SPLITS]
    infos = [filesystem.get_file_info(f"{root}/{name}") for name in names]
    found = [info for info in infos if info.type != pafs.FileType.NotFound]
    if found and not overwrite:
        listed = [info.base_name for info in found]
        raise FileExistsError(f"{out} holds {listed}: overwrite (--overwrite) replaces them")
    for info in found:
        if info.type == pafs.FileType.Directory:
            filesystem.delete_dir(info.path)
        else:
            filesystem.delete_file(info.path)


def _json_value(scalar: pa.Scalar | None) -> Any:
    """A cut time as a JSON value (timestamps and dates as ISO strings)."""
    if scalar is None:
        return None
    value = scalar.as_py()
    return value.isoformat() if hasattr(value, "isoformat") else value


def _summed(counts: list[dict[str, int]], prefix: str) -> dict[str, int]:
    return {s: sum(c[f"{prefix}_{s}"] for c in counts) for s in SPLITS}


@dataclass(frozen=True)
class _Built:
    """What the Ray Data passes found and wrote."""

    cutoffs: Cutoffs | None
    catalogue: pa.Table
    counts: list[dict[str, int]]  # per partition


def _run(
    log: _Log, *, config: SequenceBuildConfig, out: tuple[str, StorageConfig], parts: int
) -> _Built:
    """The Ray Data passes; a task's bad-input error is raised as itself (Ray Data re-raises
    it as a wrapper that keeps only its text)."""
    try:
        cutoffs = _cutoffs(log, config) if config.split == "time" else None
        catalogue = _catalogue(log, config, parts=parts)
        counts = _build(
            log, config=config, cutoffs=cutoffs, catalogue=catalogue, out=out, parts=parts
        )
    except Exception as exc:
        cause = bad_input_in(exc)
        if cause is None:
            raise
        raise cause from None
    return _Built(cutoffs, catalogue, counts)


def _info(built: _Built, *, log: _Log, out: str, parts: int, seconds: float) -> SequenceInfo:
    cutoffs = built.cutoffs
    return SequenceInfo(
        out=out,
        rows=_summed(built.counts, "rows"),
        users=_summed(built.counts, "users"),
        short=_summed(built.counts, "short"),
        num_events=log.num_rows,
        num_users=sum(c["users"] for c in built.counts),
        num_items=built.catalogue.num_rows,
        cutoffs=None
        if cutoffs is None
        else {"test": _json_value(cutoffs.test), "valid": _json_value(cutoffs.valid)},
        num_partitions=parts,
        seconds=seconds,
    )


def _write_metadata(
    filesystem: pafs.FileSystem, root: str, *, info: SequenceInfo, config: SequenceBuildConfig
) -> None:
    """Writes ``metadata.json`` last: its presence marks the build complete."""
    meta = {
        "format_version": _FORMAT_VERSION,
        "options": dataclasses.asdict(config),
        **{k: v for k, v in dataclasses.asdict(info).items() if k not in ("out", "seconds")},
        "columns": config.output_columns(),
        "item_map": ITEMS_FILE if config.item_ids == "rows" else None,
    }
    with filesystem.open_output_stream(f"{root}/{METADATA_FILE}") as f:
        f.write(json.dumps(meta, indent=2).encode() + b"\n")


def write_sequences(
    log: str,
    *,
    out: str,
    config: SequenceBuildConfig,
    storage: StorageConfig | None = None,
    overwrite: bool = False,
    connect: Callable[[], None] | None = None,
) -> SequenceInfo:
    """Builds the examples of the interaction log ``log`` into ``out`` (see the module
    docstring) with Ray Data, on the Ray instance this process is connected to (a local one
    started by Ray Data when there is none).

    Args:
        log: the interaction log, a Parquet file or directory (local or ``s3://``).
        out: the output directory (local or ``s3://``).
        config: columns, split, examples, lengths and output layout (its ``log_path`` is
            not read).
        storage: object-store access of ``log`` and ``out``.
        overwrite: replace an earlier build in ``out``.
        connect: called once the footers and ``out`` are checked, before the first Ray Data
            pass (to start or join a Ray instance only for a build that can go ahead).

    Returns:
        The counts of the build.

    Raises:
        DataValidationError: a log file lacks a column or holds one of an unusable type.
        BadInputError: a null, or a NaN time or label (naming file, row group, row, column).
        FileExistsError: ``out`` holds a build and ``overwrite`` is False.
        ValueError: a cut time that does not fit the time column, too few events for
            ``eval_fraction``.
    """
    started = time.perf_counter()
    storage = storage or StorageConfig()
    config = dataclasses.replace(config, log_path=log)  # as metadata.json records it
    scanned = _scan(log, storage, config)
    filesystem, root = filesystem_for(out, storage)
    _clear_output(filesystem, root, out=out, overwrite=overwrite)
    if connect is not None:
        connect()
    parts = max(1, config.num_partitions or math.ceil(scanned.num_rows / _EVENTS_PER_PARTITION))
    built = _run(scanned, config=config, out=(out, storage), parts=parts)
    if config.item_ids == "rows":
        with filesystem.open_output_stream(f"{root}/{ITEMS_FILE}") as f:
            pq.write_table(built.catalogue, f)
    info = _info(built, log=scanned, out=out, parts=parts, seconds=time.perf_counter() - started)
    _write_metadata(filesystem, root, info=info, config=config)
    logger.debug("built %s from %s in %.1fs", info.rows, log, info.seconds)
    return info
