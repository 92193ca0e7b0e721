"""Configuration of ``raydlrm data sequences`` (``[data.sequence_build]``): how an interaction
log becomes training examples with user histories.

:class:`SequenceBuildConfig` is a field of :class:`~raydlrm.ingestion.config.DataConfig`
(``data.sequence_build``); the builder itself is :mod:`raydlrm.ingestion.sequences`.
"""

from __future__ import annotations

from dataclasses import field
from typing import Literal

from raydlrm._config import config_dataclass

__all__ = ["LABEL_COLUMN", "SPLITS", "SequenceBuildConfig", "history_column"]

LABEL_COLUMN = "label"
"""The output column of the label (``label_column >= label_min``), when there is one."""
SPLITS = ("train", "valid", "test")
"""The output splits, in time order: their directories under the output directory."""
_HISTORY_PREFIX = "hist_"


def history_column(column: str) -> str:
    """The output list column holding the history of log column ``column``."""
    return _HISTORY_PREFIX + column


@config_dataclass
class SequenceBuildConfig:
    """How an interaction log of (user, item, time[, extras]) rows becomes examples: one row per
    target event with the user's earlier events as its history (see
    :mod:`raydlrm.ingestion.sequences` for the output)."""

    log_path: str | None = None
    """The interaction log: a Parquet file or directory, local or ``s3://`` (``data.storage``).
    ``raydlrm data sequences --log`` overrides it."""
    user_column: str = "user_id"
    """The log's user column (integer or string ids)."""
    item_column: str = "item_id"
    """The log's item column (integer or string ids)."""
    time_column: str = "timestamp"
    """The log's event time column (integer, float, timestamp or date)."""
    extra_columns: list[str] = field(default_factory=list)
    """Log columns copied per event (e.g. ``rating``, an action type): the target's value in a
    column of the same name, the history's in the parallel list ``hist_<column>``. The time
    column may be one of them (then ``hist_<time>`` holds the history's times)."""
    max_length: int = 200
    """The longest history: the most recent ``max_length`` earlier events are kept."""
    min_history: int = 1
    """Examples whose history holds fewer events (a user's first events) are not written, and
    counted in ``metadata.json``; 0 writes them with an empty history."""
    examples: Literal["all", "last"] = "all"
    """``all``: one example per event, its history the user's events before it (ranking data,
    DIN-style). ``last``: one example per user and split, the user's last event of the split
    with every earlier event as its history (next-item data, SASRec-style)."""
    split: Literal["leave_last_out", "time"] = "leave_last_out"
    """``leave_last_out``: per user, the last event is the test event, the second last the
    validation event, the others train (users with fewer than 3 events: all train), the
    SASRec protocol. ``time``: a global cut, ``cutoff_time`` or ``eval_fraction``."""
    cutoff_time: int | float | str | None = None
    """``split = "time"``: events at or after this time are test events, in the time column's
    units (a number, or an ISO date/time string for a timestamp or date column). Unset: the
    cut comes from ``eval_fraction``."""
    valid_cutoff_time: int | float | str | None = None
    """``split = "time"`` with ``cutoff_time``: events at or after this time and before
    ``cutoff_time`` are validation events. Unset: no validation split."""
    eval_fraction: float = 0.1
    """``split = "time"`` without ``cutoff_time``: the latest ``eval_fraction`` of the events
    are test events and the ``eval_fraction`` before them validation events (events of the
    cut's time all go to the later split, so a split may hold slightly more)."""
    label_column: str | None = None
    """A numeric log column that makes a 0/1 ``label`` column: 1 where the target's value is at
    least ``label_min`` (e.g. ``rating`` >= 4 is a click). Unset: no label column (next-item
    data holds positives only; a constant label would let a ranking model learn nothing)."""
    label_min: float | None = None
    """The threshold of ``label_column`` (set both or neither)."""
    item_ids: Literal["rows", "raw"] = "rows"
    """``rows``: item ids become dense rows ``0..num_items-1`` in ascending id order (the item
    table then has exactly ``num_items`` rows, and full ranking ranks the whole catalogue);
    ``items.parquet`` maps row -> id. ``raw``: the log's ids as they are."""
    num_partitions: int = 0
    """Users are hash-partitioned into this many groups, each built by one Ray task and
    written as one file per split; 0: one per million events of the log."""
    row_group_rows: int = 8192
    """Rows per Parquet row group of the output (the unit the training readers deal)."""

    def __post_init__(self) -> None:
        key = "data.sequence_build"
        for name in ("max_length", "row_group_rows"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{key}.{name} must be positive, got {getattr(self, name)}")
        for name in ("min_history", "num_partitions"):
            if getattr(self, name) < 0:
                raise ValueError(f"{key}.{name} must be >= 0, got {getattr(self, name)}")
        if self.row_group_rows * self.max_length >= 2**31:
            raise ValueError(
                f"{key}.row_group_rows * {key}.max_length must be below 2^31 (a row group's "
                f"history values), got {self.row_group_rows} * {self.max_length}"
            )
        if self.min_history > self.max_length:
            raise ValueError(
                f"{key}.min_history ({self.min_history}) exceeds max_length ({self.max_length})"
            )
        if not 0 < self.eval_fraction < 0.5:
            raise ValueError(f"{key}.eval_fraction must be in (0, 0.5), got {self.eval_fraction}")
        if (self.label_column is None) != (self.label_min is None):
            raise ValueError(f"{key}.label_column and {key}.label_min: set both or neither")
        if self.split != "time" and (self.cutoff_time, self.valid_cutoff_time) != (None, None):
            raise ValueError(f"{key}.cutoff_time applies to split = 'time' only")
        if self.valid_cutoff_time is not None and self.cutoff_time is None:
            raise ValueError(f"{key}.valid_cutoff_time needs {key}.cutoff_time")
        self._check_columns(key)

    def _check_columns(self, key: str) -> None:
        """Distinct key columns; no output column named twice."""
        keys = [self.user_column, self.item_column, self.time_column]
        if len(set(keys)) < 3 or not all(keys):
            raise ValueError(
                f"{key}: user_column, item_column and time_column must be three distinct "
                f"columns, got {keys}"
            )
        for column in self.extra_columns:
            if column in (self.user_column, self.item_column):
                raise ValueError(
                    f"{key}.extra_columns: {column!r} is the user or item column (always written)"
                )
        if len(set(self.extra_columns)) < len(self.extra_columns):
            raise ValueError(f"{key}.extra_columns: a column is listed twice")
        outputs = self.output_columns()
        clashes = sorted({c for c in outputs if outputs.count(c) > 1})
        if clashes:
            raise ValueError(f"{key}: output columns {clashes} would be written twice")

    def target_columns(self) -> list[str]:
        """The log columns written as they are for the target event: user, item, time, the
        extras (the time column once)."""
        keys = [self.user_column, self.item_column, self.time_column]
        return keys + [c for c in self.extra_columns if c != self.time_column]

    def history_columns(self) -> list[str]:
        """The log columns whose history is written: the item column, then the extras."""
        return [self.item_column, *self.extra_columns]

    def log_columns(self) -> list[str]:
        """The log columns the builder reads."""
        columns = self.target_columns()
        if self.label_column is not None and self.label_column not in columns:
            columns.append(self.label_column)
        return columns

    def output_columns(self) -> list[str]:
        """The output columns, in order: the target's columns, ``label`` (with a label
        column), then the history lists."""
        label = [LABEL_COLUMN] if self.label_column is not None else []
        return self.target_columns() + label + [history_column(c) for c in self.history_columns()]
