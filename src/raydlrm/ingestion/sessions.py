"""Sessions: where they start, which columns are constant within them, a sample's session row.

A session is a run of equal values of the session column (``data.session_column``): a user's
visit, whose samples share the user's features. RecD stores and looks those features up once
per session; this module finds them. :func:`changed_rows` compares each row with the one before
it, exactly and vectorized (an id list by its length and its ids, nulls equal to nulls), so a
column is constant within its sessions when no row but a session's first differs from the row
before (:func:`constant_columns`). :func:`session_rows` finds each sample's row in a table of
sessions (a hash lookup).
"""

from __future__ import annotations

import logging

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from raydlrm.ingestion._arrow import decode_dictionaries, is_list
from raydlrm.ingestion.config import DataConfig

__all__ = [
    "MIN_REPEATS",
    "changed_rows",
    "constant_columns",
    "session_rows",
    "session_starts",
]

logger = logging.getLogger(__name__)

MIN_REPEATS = 100
"""Rows that repeat their session (a session's second sample on) a sample needs before columns
are called constant within sessions: with fewer, constancy is not evidence."""
NEARLY_CONSTANT = 0.01
"""A column that changes within sessions at no more than this share of the samples repeating a
session (at least at one) is named in a warning: a per-session column with a few bad values
is more likely than one that changes so rarely."""


def session_starts(sessions: np.ndarray) -> np.ndarray:
    """bool, shape ``(N,)``: where a session (a run of equal values) starts."""
    starts = np.ones(sessions.size, dtype=bool)
    np.not_equal(sessions[1:], sessions[:-1], out=starts[1:])
    return starts


def _unequal(a: pa.Array, b: pa.Array) -> np.ndarray:
    """Element-wise ``a != b`` as bool, a null equal to a null only."""
    equal = pc.fill_null(pc.equal(a, b), False).to_numpy(zero_copy_only=False)
    if a.null_count or b.null_count:
        equal |= np.asarray(a.is_null()) & np.asarray(b.is_null())
    return ~equal


def changed_rows(array: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """bool, shape ``(N,)``: whether each row differs from the row before it (row 0: False).

    Exact: single values compare as values; id lists by their length, then id by id (nulls,
    of a list or an id, equal only to nulls). Vectorized: one comparison over the ids of all
    rows as long as the row before.
    """
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    n = len(array)
    changed = np.zeros(n, dtype=bool)
    if n < 2:
        return changed
    if not is_list(array.type):
        changed[1:] = _unequal(array.slice(1), array.slice(0, n - 1))
        return changed
    valid = np.asarray(array.is_valid())
    lengths = pc.fill_null(pc.list_value_length(array), 0).to_numpy(zero_copy_only=False)
    lengths = lengths.astype(np.int64)
    changed[1:] = (valid[1:] != valid[:-1]) | (lengths[1:] != lengths[:-1])
    rows = np.flatnonzero(~changed & (lengths > 0))
    rows = rows[rows > 0]
    if rows.size:
        offsets = array.offsets.to_numpy().astype(np.int64)
        values = array.values
        counts = lengths[rows]
        here = np.repeat(offsets[rows], counts) + (
            np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
        )
        before = here - np.repeat(counts, counts)
        differs = _unequal(values.take(pa.array(here)), values.take(pa.array(before)))
        changed[rows] = np.add.reduceat(differs, np.cumsum(counts) - counts) > 0
    return changed


def constant_columns(
    table: pa.Table, *, session_column: str, columns: list[str], config: DataConfig
) -> list[str]:
    """The sparse ``columns`` of ``table`` constant within every session: their ids, and
    their weights when weighted, never change inside a run of the session column.

    Raises:
        ValueError: fewer than :data:`MIN_REPEATS` rows repeat a session (naming
            ``data.session_column``).
    """
    table = decode_dictionaries(table)
    repeats = ~session_starts(table.column(session_column).to_numpy(zero_copy_only=False))
    if repeats.sum() < MIN_REPEATS:
        raise ValueError(
            f"data.session_column: {session_column!r} has {int(repeats.sum())} samples that "
            f"repeat a session in the {table.num_rows} rows read, too few (< {MIN_REPEATS}) to "
            "tell which columns are constant within sessions"
        )
    out = []
    sessions = table.column(session_column)
    for column in columns:
        parts = [column, config.weight_column_of(column)]
        changed = np.zeros(table.num_rows, dtype=bool)
        for c in (c for c in parts if c):
            changed |= changed_rows(table.column(c)) & repeats
        count = int(changed.sum())
        if not count:
            out.append(column)
        elif count <= max(1, NEARLY_CONSTANT * repeats.sum()):
            first = int(np.flatnonzero(changed)[0])
            logger.warning(
                "sparse column %r is constant within the sessions of the %d rows read but at %d "
                "samples (the first: session %s, row %d): it is not taken as a per-session "
                "column; "
                "if it is one with bad values, name it (data.dedup_groups, or --column of "
                "raydlrm data cluster) and those sessions are stopped at or set aside "
                "(data.bad_input)",
                column,
                table.num_rows,
                count,
                sessions[first].as_py(),
                first,
            )
    return out


def session_rows(
    sample_sessions: pa.ChunkedArray | pa.Array, sessions: pa.ChunkedArray | pa.Array
) -> np.ndarray:
    """Each sample's row in a table of sessions: int64, shape ``(len(sample_sessions),)``, -1
    for a session without a row (a hash lookup, vectorized)."""
    if isinstance(sessions, pa.ChunkedArray):
        sessions = sessions.combine_chunks()
    rows = pc.index_in(sample_sessions, value_set=sessions.cast(sample_sessions.type))
    if isinstance(rows, pa.ChunkedArray):
        rows = rows.combine_chunks()
    return rows.fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64)
