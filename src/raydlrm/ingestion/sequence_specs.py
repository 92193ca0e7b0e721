"""Configuration of a sequence feature (a user's history, read position by position):
:class:`SequenceSpec`, the ``[data.sequences.<name>]`` table of
:class:`~raydlrm.ingestion.config.DataConfig`.

A sequence is one or more parallel id list columns (the first one is its main column, e.g. the
items) and optionally parallel numeric list columns (timestamps, ratings, action weights): every
column of a row holds the same number of events, oldest first. The id columns stay ordinary
sparse features (``data.sparse_columns``, their tables and hashing as any other); the value
columns reach the training batch as ``Batch.sequence_values``.
"""

from __future__ import annotations

import re
from dataclasses import field

from raydlrm._config import config_dataclass

__all__ = ["SEQUENCE_NAME", "SequenceSpec"]

SEQUENCE_NAME = re.compile(r"[A-Za-z0-9_-]+")
"""What a sequence's name may be made of: it is a dotted config key (``--set
data.sequences.<name>.max_length=50``) and part of a metric's name."""


@config_dataclass
class SequenceSpec:
    """One sequence feature (``[data.sequences.<name>]``).

    Reading keeps each row's last ``max_length`` events (the most recent: lists are oldest
    first) in every column of the sequence alike, so that they stay aligned; how many rows were
    cut is counted (``data/sequences/<name>/rows_truncated``). A row whose columns hold lists of
    different lengths, a null list, or a null, NaN or infinite value is bad input
    (``data.bad_input``).
    """

    columns: list[str]
    """The id list columns of the sequence, parallel (the same length in every row), the first
    one its main column (e.g. the items); each is also one of ``data.sparse_columns`` (its
    table, hashing and ``hash = false`` range check apply), outside any dedup group."""
    max_length: int
    """The most events kept per row: the last (most recent) ``max_length`` of each list."""
    value_columns: list[str] = field(default_factory=list)
    """Numeric list columns parallel to the ids (timestamps, ratings, action weights), read
    as float32 (an integer timestamp of today's magnitude keeps about 2 minutes of precision:
    give times relative to a recent origin where it matters); not dense or sparse columns."""
    min_length: int = 0
    """The fewest events a row may hold (default 0: an empty history is normal, a user's first
    event); a shorter row is bad input. It replaces ``data.sparse_specs.<column>.min_length``
    for the sequence's id columns."""

    def __post_init__(self) -> None:
        if not self.columns:
            raise ValueError("columns must name at least one id list column")
        if self.max_length <= 0:
            raise ValueError(f"max_length must be positive, got {self.max_length}")
        if self.min_length < 0:
            raise ValueError(f"min_length must be >= 0, got {self.min_length}")
        if self.min_length > self.max_length:
            raise ValueError(f"min_length {self.min_length} is above max_length {self.max_length}")
        named = [*self.columns, *self.value_columns]
        twice = sorted({c for c in named if named.count(c) > 1})
        if twice:
            raise ValueError(f"columns {twice} are named more than once")

    @property
    def all_columns(self) -> list[str]:
        """The id columns, then the value columns: every column a row's events are in."""
        return [*self.columns, *self.value_columns]
