"""RecD on the data side: which columns to deduplicate, and how much deduplication pays.

:func:`infer_dedup_groups` gives ``data.dedup = "infer"`` its group: a session-clustered data
set's per-session sparse columns, or the sparse columns constant within the sessions of a
sample-level data set's first rows. :func:`batch_dedup_factor` measures what deduplication
inside a batch saves: id occurrences per distinct ``(feature, id)`` pair in batches of
consecutive rows (Meta's open DLRM traces show 6.9-12.7 over all sparse features).
:func:`group_row_ratio` measures what the planner needs: a group's samples per unique row in a
batch, the factor by which its lookups and all-to-all bytes shrink.
"""

from __future__ import annotations

import logging

import numpy as np
import pyarrow as pa

from raydlrm.ingestion._arrow import is_list
from raydlrm.ingestion.clustered import read_rows
from raydlrm.ingestion.config import DataConfig
from raydlrm.ingestion.layout import layout_of
from raydlrm.ingestion.schema import DataSummary
from raydlrm.ingestion.sessions import changed_rows, constant_columns

__all__ = ["batch_dedup_factor", "group_row_ratio", "id_occurrences", "infer_dedup_groups"]

logger = logging.getLogger(__name__)


def infer_dedup_groups(
    summary: DataSummary, config: DataConfig, *, max_rows: int = 200_000
) -> list[list[str]]:
    """The dedup groups ``data.dedup = "infer"`` gives the data set of ``summary``: one group.

    For a session-clustered data set, its per-session sparse columns (its marker states
    them); for a sample-level one, the sparse columns constant within the sessions of its
    first ``max_rows`` rows (:func:`~raydlrm.ingestion.sessions.constant_columns`, files in
    order). Columns sharing a table with a column outside the group are left out (a table's
    columns are deduplicated together), and so are the sequences' columns (not deduplicated
    in this version).

    Args:
        summary: the validated data set (:func:`~raydlrm.ingestion.schema.validate_data`).
        config: the data config (sparse columns, tables, weights, ``session_column``).
        max_rows: rows read from a sample-level data set.

    Returns:
        ``[[column, ...]]``, the columns in ``data.sparse_columns`` order.

    Raises:
        ValueError: naming ``data.dedup`` (or ``data.session_column``) when nothing can be
            inferred: no session column in the data, too few samples repeating a session, or
            no column to deduplicate.
    """
    layout = layout_of(summary.schema)
    if layout is not None:
        found = [c for c in config.sparse_columns if c in layout.session_columns]
        where = f"the per-session columns of the clustered data set {summary.path}"
    else:
        session = config.session_column
        if session is None or session not in summary.schema.names:
            raise ValueError(
                f"data.dedup = 'infer' needs sessions: data.session_column ({session!r}) is "
                f"not a column of {summary.path}; name the groups in data.dedup_groups"
            )
        weights = [w for c in config.sparse_columns if (w := config.weight_column_of(c))]
        table = read_rows(
            summary.path,
            config,
            columns=[session, *config.sparse_columns, *weights],
            max_rows=max_rows,
        )
        found = constant_columns(
            table, session_column=session, columns=config.sparse_columns, config=config
        )
        where = f"the columns constant within sessions in {table.num_rows} rows of {summary.path}"
    group = _whole_tables(found, config)
    if not group:
        raise ValueError(
            f"data.dedup = 'infer': no sparse column to deduplicate ({where}: {found}, less "
            "those sharing a table with other columns); set data.dedup = 'groups'"
        )
    logger.info("dedup group inferred from %s: %s", where, group)
    return [group]


def _whole_tables(columns: list[str], config: DataConfig) -> list[str]:
    """``columns`` less the sequences' and those whose table is shared with a column not among
    them."""
    chosen = {c for c in columns if config.sequence_of(c) is None}
    for table_columns in config.table_columns().values():
        if not set(table_columns) <= chosen:
            chosen -= set(table_columns)
    return [c for c in config.sparse_columns if c in chosen]


def id_occurrences(table: pa.Table, column: str) -> tuple[np.ndarray, np.ndarray]:
    """The ids of ``column`` of ``table`` and each one's row, both int64, flat."""
    array = table.column(column).combine_chunks()
    if not is_list(array.type):
        return array.to_numpy(zero_copy_only=False), np.arange(len(array))
    lengths = array.value_lengths().fill_null(0).to_numpy(zero_copy_only=False)
    return array.flatten().to_numpy(zero_copy_only=False), np.repeat(np.arange(len(array)), lengths)


def batch_dedup_factor(table: pa.Table, *, columns: list[str], batch_size: int) -> float:
    """The mean, over batches of ``batch_size`` consecutive rows (the last one may be
    smaller), of the id occurrences of ``columns`` per distinct ``(column, id)`` pair in the
    batch; 1.0 without ids.

    Args:
        table: rows with the sparse ``columns`` (ids or id lists; hashed ids measure the
            lookups, raw ids the data).
        columns: the sparse columns counted.
        batch_size: rows per batch.
    """
    num_batches = -(-table.num_rows // batch_size)
    occurrences = np.zeros(num_batches, dtype=np.int64)
    distinct = np.zeros(num_batches, dtype=np.int64)
    for column in columns:
        ids, rows = id_occurrences(table, column)
        batch = rows // batch_size
        order = np.lexsort((ids, batch))
        ids, batch = ids[order], batch[order]
        new = np.ones(ids.size, dtype=bool)
        new[1:] = (ids[1:] != ids[:-1]) | (batch[1:] != batch[:-1])
        occurrences += np.bincount(batch, minlength=num_batches)
        distinct += np.bincount(batch[new], minlength=num_batches)
    used = distinct > 0
    return float(np.mean(occurrences[used] / distinct[used])) if used.any() else 1.0


def group_row_ratio(table: pa.Table, *, columns: list[str], batch_size: int) -> float:
    """The mean, over batches of ``batch_size`` consecutive rows (the last one may be smaller),
    of the rows per unique row of ``columns`` (a dedup group) in the batch, counting a row equal
    to the one before it as not new: sessions are contiguous in a batch, so this is the batch's
    unique rows, or (when two sessions of a batch hold equal rows) a few more: a lower bound of
    the ratio the loader's deduplication reaches. 1.0 for an empty table.

    Args:
        table: rows in the order the batches take them, with the group's ``columns``.
        columns: the group's columns.
        batch_size: rows per batch.
    """
    if table.num_rows == 0:
        return 1.0
    new = np.zeros(table.num_rows, dtype=bool)
    for column in columns:
        new |= changed_rows(table.column(column))
    new[::batch_size] = True  # a batch's first row is always new to it
    batch = np.arange(table.num_rows) // batch_size
    rows = np.bincount(batch)
    return float(np.mean(rows / np.bincount(batch, weights=new)))
