"""Order diagnostics: is a data set's file order correlated with what should not be ordered?

Real logs are written sorted by user and time. :func:`order_findings` reads a bounded sample of
the file order (``max_row_groups`` row groups spread evenly over the files, the first rows of
each, ``max_rows`` in all: seconds on any data set, S3 too) and reports, as
:class:`OrderFinding`:

- ``runs``: a sparse column whose equal ids come in runs far longer than a random order of
  the same ids would give (e.g. data sorted by ``user_id``). With a session column
  (``data.session_column``) in the data, a session is one unit: sessions stay whole anyway.
- ``label_drift``: a positive rate that differs between row groups far beyond chance
  (chi-square dispersion test against the binomial) and by a material amount.
- ``trend``: a numeric or time column outside the features' ids (a ``timestamp``, also one
  the config does not name) that rises or falls through the files (Spearman rank correlation
  with the position in file order) or inside the row groups (nearly every step goes one way).

Each finding says whether the reader, as configured, handles it and, if not, what to try
(never as settled: the eval metric decides). Sorted by user and sorted by time are different
orders and want different treatment:

- runs of one id (sorted by user): mix them, ``data.shuffle_window_rows`` (a window mixes the
  rows of consecutive row groups; with the window off only sessions move inside a row group);
- a trend through the files (Spearman over file position: logs written in time order), or a
  timestamp rising inside row groups of files that are not in time order: try
  ``data.order = "time"`` with ``data.time_column`` naming it, and a time-split validation, the
  window then mixing only nearby rows; under ``time`` (by that column, for the latter) it is
  handled;
- a trend only inside row groups while ids come in runs (sorted by user, then by time inside
  each user's history): the window that mixes the runs mixes it too; time order is not what to
  try, since the files are not in time order.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq
from scipy import stats

from raydlrm.ingestion._arrow import decoded_type, is_string
from raydlrm.ingestion.config import DataConfig
from raydlrm.ingestion.layout import layout_of
from raydlrm.ingestion.schema import SAMPLE_ID_COLUMN, DataSummary, RowGroup
from raydlrm.ingestion.sessions import session_starts
from raydlrm.storage import filesystem_for

__all__ = ["OrderFinding", "order_findings"]

logger = logging.getLogger(__name__)

RUN_Z = 5.0
"""A column has runs when its run count is this many standard deviations below a random
order's (the significance: a random order's ratio below is 1 give or take ``1/sqrt(units)``)..."""
RUN_RATIO = 1.5
"""...and its mean run is at least this many times what a random order gives (the minimum
effect: a large sample makes a trivial order significant). Data sorted by a user whose sessions
stay whole has runs of about the sessions a user has: 1.85 is common, and is found."""
MIN_UNITS = 200
"""Rows (or sessions) a check needs in the sample to say anything."""
RUN_SHARE = 0.01
"""A run is mixed when it is at most this share of the rows mixed together (so a batch draws
from about a hundred ids' runs, not a few)."""
DRIFT_P_VALUE = 1e-6
"""The label rate drifts when a constant rate is this unlikely (chi-square)..."""
DRIFT_SHARE = 0.1
"""...and the rate's spread over row groups, beyond chance, is this share of the rarer class's
rate."""
TREND_RHO = 0.9
"""A column rises (falls) through the files at this Spearman correlation with file position..."""
TREND_STEPS = 0.75
"""...or inside the row groups when this share of its changes between adjacent rows go one
way (a random order: half, give or take 0.035 over the ``MIN_UNITS`` changes a check needs;
rows sorted by user and time: ``1 - 1/L`` for users of ``L`` rows)."""
DRIFT_ROW_GROUPS = 16
"""Row groups a window needs to mix a drift across row groups (its spread shrinks by the
square root: 4 times)."""
_READ_BUFFER = 1 << 20
_NUM_READERS = 8
_DEFAULT_WINDOW = next(
    f.default for f in dataclasses.fields(DataConfig) if f.name == "shuffle_window_rows"
)


@dataclass(frozen=True)
class OrderFinding:
    """One way the file order of a data set is correlated with its content.

    Attributes:
        kind: ``runs`` (equal ids in long runs), ``label_drift`` (the positive rate differs
            between row groups) or ``trend`` (a column rises or falls through the file order).
        column: the column it was measured on.
        value: the measured statistic: the ratio of mean run lengths (``runs``), the rate's
            spread over row groups beyond chance (``label_drift``), the rank correlation with
            file position or the share of steps that go one way (``trend``).
        statistic: what was measured, in words.
        handled: whether the reader, as configured, treats it as advised (mixes it away, or
            reads it in time order); training warns about the others.
        suggestion: what to try (or why nothing is needed).
    """

    kind: Literal["runs", "label_drift", "trend"]
    column: str
    value: float
    statistic: str
    handled: bool
    suggestion: str

    @property
    def message(self) -> str:
        """The finding in one line: column, statistic, suggestion."""
        return f"{self.column}: {self.statistic}; {self.suggestion}"

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "message": self.message}


@dataclass(frozen=True)
class _Group:
    """The first rows of one sampled row group, and where they lie in the file order."""

    table: pa.Table
    position: int  # of its first row, over all rows of the data set in file order
    starts: np.ndarray  # where each unit (a session, else a row) begins


@dataclass(frozen=True)
class _Mixing:
    """What the reader mixes, as configured."""

    order: Literal["shuffled", "time"]  # data.order
    time_column: str | None  # data.time_column
    window_rows: int  # data.shuffle_window_rows (0: off)
    group_rows: int  # a typical (median) row group's rows
    groups_per_window: int  # row groups one window holds (1 when off)
    span_rows: int  # rows mixed together: a window, or a row group's sessions, or none
    total_rows: int
    total_groups: int


def order_findings(
    summary: DataSummary,
    config: DataConfig,
    *,
    max_row_groups: int = 16,
    max_rows: int = 32_768,
) -> list[OrderFinding]:
    """What the file order of a data set is correlated with, from a bounded sample.

    Args:
        summary: the data set, as :func:`~raydlrm.ingestion.schema.validate_data` found it.
        config: the data config (columns, ``session_column``, ``shuffle_window_rows``).
        max_row_groups: row groups read, spread evenly over the file order.
        max_rows: rows read in all (the first rows of each sampled row group).

    Returns:
        The findings (runs, label drift, trends), empty when the order looks random.
    """
    session = _session_column(summary, config=config)
    trend_columns = _trend_columns(summary.schema, config=config, session=session)
    run_columns = [c for c in config.sparse_columns if _is_scalar_id(summary.schema, column=c)]
    columns = [
        *config.label_columns(),
        *run_columns,
        *trend_columns,
        *([session] if session else []),
    ]
    groups = _read_sample(
        summary,
        config=config,
        columns=columns,
        session=session,
        max_row_groups=max_row_groups,
        max_rows=max_rows,
    )
    mixing = _mixing(summary, config=config, sessions=session is not None)
    findings = [f for c in run_columns if (f := _runs_finding(groups, column=c, mixing=mixing))]
    label = (
        None
        if config.label_column is None
        else _drift_finding(groups, column=config.label_column, mixing=mixing)
    )
    findings += [label] if label else []
    runs = any(f.kind == "runs" for f in findings)
    for column in trend_columns:
        time = _is_time(_field_type(summary.schema, column=column))
        trend = _trend_finding(groups, column=column, mixing=mixing, runs=runs, time=time)
        findings += [trend] if trend else []
    return findings


def _field_type(schema: pa.Schema, *, column: str) -> pa.DataType | None:
    index = schema.get_field_index(column)
    return decoded_type(schema.field(index).type) if index >= 0 else None


def _is_scalar_id(schema: pa.Schema, *, column: str) -> bool:
    """One integer or string id per row (id lists have no runs to speak of)."""
    type_ = _field_type(schema, column=column)
    return type_ is not None and (pa.types.is_integer(type_) or is_string(type_))


def _session_column(summary: DataSummary, *, config: DataConfig) -> str | None:
    """A clustered data set's session column, else ``data.session_column`` when the data has
    it (as single ids)."""
    layout = layout_of(summary.schema)
    column = layout.session_column if layout is not None else config.session_column
    return column if column is not None and _is_scalar_id(summary.schema, column=column) else None


def _is_ordered(type_: pa.DataType) -> bool:
    """Numbers and times: the types a trend is measured on."""
    return (
        pa.types.is_integer(type_)
        or pa.types.is_floating(type_)
        or pa.types.is_timestamp(type_)
        or pa.types.is_date(type_)
        or pa.types.is_duration(type_)
    )


def _is_time(type_: pa.DataType | None) -> bool:
    """Timestamps and dates: a trend in them is time for sure (a number may be anything)."""
    return type_ is not None and (pa.types.is_timestamp(type_) or pa.types.is_date(type_))


def _trend_columns(schema: pa.Schema, *, config: DataConfig, session: str | None) -> list[str]:
    """Numeric and time columns except the label and ids (the sparse features', the sessions',
    ``sample_id``: ids written in order say nothing about the content)."""
    skip = {config.label_column, SAMPLE_ID_COLUMN, session, *config.sparse_columns}
    return [f.name for f in schema if f.name not in skip and _is_ordered(decoded_type(f.type))]


def _read_sample(
    summary: DataSummary,
    *,
    config: DataConfig,
    columns: list[str],
    session: str | None,
    max_row_groups: int,
    max_rows: int,
) -> list[_Group]:
    """The first rows of row groups spread evenly over the file order, read concurrently
    (object stores answer each read after a round trip); a row group that cannot be read is
    left out."""
    row_groups = summary.row_groups
    if not row_groups:
        return []
    positions = np.concatenate([[0], np.cumsum([g.num_rows for g in row_groups])])
    count = max(1, min(max_row_groups, len(row_groups)))
    picks = np.unique(np.linspace(0, len(row_groups) - 1, count).round().astype(int))
    filesystem = filesystem_for(summary.path, config.storage)[0]
    read = functools.partial(
        _read_group,
        filesystem=filesystem,
        columns=list(dict.fromkeys(columns)),
        num_rows=max(1, max_rows // len(picks)),
    )
    with ThreadPoolExecutor(max_workers=_NUM_READERS) as pool:
        tables = list(pool.map(lambda i: read(row_groups[i]), picks))
    return [
        _group(table, position=int(positions[i]), session=session)
        for i, table in zip(picks, tables, strict=True)
        if table is not None
    ]


def _read_group(
    group: RowGroup, *, filesystem: pafs.FileSystem, columns: list[str], num_rows: int
) -> pa.Table | None:
    """The first ``num_rows`` rows of the ``columns`` of a row group that the file has
    (dictionaries decoded); None when it cannot be read."""
    try:
        with _open(filesystem, file=group.file) as f:
            # Buffered, not pre-buffered: the first pages of each column chunk are read, not
            # the whole chunks.
            parquet = pq.ParquetFile(f, buffer_size=_READ_BUFFER, pre_buffer=False)
            wanted = [c for c in columns if c in parquet.schema_arrow.names]
            batches = parquet.iter_batches(
                batch_size=num_rows, row_groups=[group.index], columns=wanted
            )
            batch = next(batches, None)
    except (OSError, pa.ArrowException) as exc:
        logger.debug("order sample: skipping row group %d of %s: %s", group.index, group.file, exc)
        return None
    table = pa.Table.from_batches([batch]) if batch is not None else pa.table({})
    for i, field in enumerate(table.schema):
        if decoded_type(field.type) != field.type:
            table = table.set_column(i, field.name, table.column(i).cast(decoded_type(field.type)))
    return table


def _open(filesystem: pafs.FileSystem, *, file: str) -> Any:
    """``file`` opened for reading a few pages: through fsspec (S3) reading just what is asked
    (its default read-ahead, tens of MiB a read, would fetch whole files to sample them)."""
    if isinstance(filesystem, pafs.PyFileSystem) and isinstance(
        filesystem.handler, pafs.FSSpecHandler
    ):
        return filesystem.handler.fs.open(file, "rb", cache_type="none")
    return filesystem.open_input_file(file)


def _group(table: pa.Table, *, position: int, session: str | None) -> _Group:
    """A sampled row group with its units: the runs of the session column, else the rows."""
    if session is not None and session in table.column_names and table.num_rows:
        codes = _codes(table.column(session))
        starts = np.flatnonzero(session_starts(codes))
    else:
        starts = np.arange(table.num_rows)
    return _Group(table=table, position=position, starts=starts)


def _codes(column: pa.ChunkedArray) -> np.ndarray:
    """Equal values to equal integers (nulls to one code of their own)."""
    indices = pc.dictionary_encode(column.combine_chunks()).indices
    return indices.fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64) + 1


def _mixing(summary: DataSummary, *, config: DataConfig, sessions: bool) -> _Mixing:
    """What the reader mixes: a window of consecutive row groups (at least one) in a random
    row order; with the window off, a row group's sessions (none without a session column, or
    under time order, which reads each row group in its file order)."""
    window = config.shuffle_window_rows
    group_rows = max(1, int(np.median([g.num_rows for g in summary.row_groups] or [1])))
    per_window = max(1, window // group_rows) if window else 1
    shuffled = sessions and config.order == "shuffled"
    span = per_window * group_rows if window else (group_rows if shuffled else 0)
    return _Mixing(
        order=config.order,
        time_column=config.time_column,
        window_rows=window,
        group_rows=group_rows,
        groups_per_window=per_window,
        span_rows=span,
        total_rows=summary.num_rows,
        total_groups=len(summary.row_groups),
    )


_TRY = "what to try, not settled: compare the eval metric both ways"


def _advice(mixing: _Mixing, *, mixed: bool, needed_rows: int) -> str:
    """The suggestion: nothing (and why), turning the window on, or a larger one."""
    window = mixing.window_rows
    if mixed and window:
        return f"data.shuffle_window_rows = {window} mixes it"
    if mixed:
        return "sessions (data.session_column) are shuffled inside row groups, which mixes it"
    whole_groups = -(-needed_rows // mixing.group_rows) * mixing.group_rows
    rows = _round_up(max(whole_groups, window + 1 if window else _DEFAULT_WINDOW))
    if not window:
        return f"turn on data.shuffle_window_rows (e.g. {rows}); {_TRY}"
    return (
        f"raise data.shuffle_window_rows to {rows} (now {window}) or pre-shuffle the files; {_TRY}"
    )


def _in_time_order(mixing: _Mixing) -> str:
    """What ``data.order = "time"`` does, in words."""
    by = f'data.time_column = "{mixing.time_column}"' if mixing.time_column else "the file order"
    window = mixing.window_rows
    mixes = f"mixing {window} rows at a time" if window else "each row group in its file order"
    return f'data.order = "time" reads the row groups in time order ({by}), {mixes}'


def _trend_advice(
    mixing: _Mixing, *, column: str, through_files: bool, runs: bool, time: bool
) -> tuple[bool, str]:
    """Whether the reader handles a trend as advised, and the suggestion. Inside row groups
    while ids come in runs (sorted by id, then by the column): the window, not time order.
    Through the files (logs written in time order), or a time inside row groups: time order
    by the column. Another column inside row groups: the window."""
    if runs and not through_files:
        sorted_by_id = f"sorted by id, then by {column} inside each id's rows"
        if mixing.order == "time":
            return False, (
                f"{sorted_by_id}: the row groups are not in time order; try data.order = "
                f'"shuffled" with the shuffle window, which mixes the runs and this; {_TRY}'
            )
        mixed = mixing.span_rows > 0
        advice = _advice(mixing, mixed=mixed, needed_rows=mixing.group_rows)
        return mixed, f"{sorted_by_id}: time order is not what to try here; {advice}"
    if mixing.order == "time" and (through_files or column == mixing.time_column):
        return True, _in_time_order(mixing)
    if mixing.order == "time" and time:
        return False, (
            f"{column} rises inside row groups, not through the files: try data.time_column = "
            f'"{column}", which deals the row groups by it; {_TRY}'
        )
    if through_files or time:
        if_time = "" if time else f"if {column} is a time, "
        return False, (
            f'{if_time}try data.order = "time" with data.time_column = "{column}" (the row '
            "groups in its order, the shuffle window then mixing only nearby rows) and a "
            "validation and eval split by time (the latest rows held out), against the "
            f"shuffled order; {_TRY}"
        )
    mixed = mixing.span_rows > 0
    return mixed, _advice(mixing, mixed=mixed, needed_rows=mixing.group_rows)


def _round_up(rows: int) -> int:
    """The next power of two (the default window is one: 2**18)."""
    return 1 << max(0, math.ceil(math.log2(max(1, rows))))


def _runs_finding(groups: list[_Group], *, column: str, mixing: _Mixing) -> OrderFinding | None:
    """Runs of equal ids over the units (sessions or rows) of each sampled row group, against
    the runs a random order of the same ids gives: ``E[runs] = 1 + (n^2 - S2) / n`` and
    ``Var[runs] = (S2 (S2 + n (n + 1)) - 2 n S3 - n^3) / (n^2 (n - 1))`` for ``n`` units of
    which ``c_k`` hold id ``k``, ``S2 = sum_k c_k^2``, ``S3 = sum_k c_k^3`` (the runs test of
    several categories; row groups add up as independent)."""
    units = runs = expected = variance = 0.0
    lengths = []  # rows of each run
    for group in groups:
        if column not in group.table.column_names or len(group.starts) < 2:
            continue
        values = _codes(group.table.column(column))[group.starts]
        n = len(values)
        counts = np.bincount(values)
        change = values[1:] != values[:-1]
        units, runs = units + n, runs + 1 + change.sum()
        s2, s3 = np.sum(counts**2.0), np.sum(counts**3.0)
        expected += 1 + (n * n - s2) / n
        variance += (s2 * (s2 + n * (n + 1.0)) - 2.0 * n * s3 - n**3.0) / (n * n * (n - 1.0))
        rows = np.diff(np.append(group.starts, group.table.num_rows))
        lengths.append(np.bincount(np.cumsum(np.append(0, change)), weights=rows))
    if units < MIN_UNITS or runs == 0:
        return None
    ratio, z = expected / runs, (expected - runs) / math.sqrt(max(variance, 1e-12))
    if z < RUN_Z or ratio < RUN_RATIO:
        return None
    lengths = np.concatenate(lengths)
    typical = float(np.sum(lengths**2) / np.sum(lengths))  # the run a row is in, on average
    needed = min(int(typical / RUN_SHARE), mixing.total_rows)
    mixed = mixing.span_rows >= needed
    what = "sessions" if any(len(g.starts) < g.table.num_rows for g in groups) else "rows"
    return OrderFinding(
        kind="runs",
        column=column,
        value=ratio,
        statistic=(
            f"equal ids come in runs of {units / runs:.1f} {what} on average "
            f"({units / expected:.2f} in a random order, {z:.1f} standard deviations away; a "
            f"row's run holds {typical:.0f} rows on average, the longest seen {lengths.max():.0f})"
        ),
        handled=mixed,
        suggestion=_advice(mixing, mixed=mixed, needed_rows=needed),
    )


def _drift_finding(groups: list[_Group], *, column: str, mixing: _Mixing) -> OrderFinding | None:
    """The label's positive rate per sampled row group against one rate for all: a
    chi-square dispersion test (binomial counts), and the spread beyond chance."""
    sizes, positives = [], []
    for group in groups:
        if column not in group.table.column_names:
            continue
        labels = _numbers(group.table.column(column))
        labels = labels[np.isfinite(labels)]
        if len(labels) and (labels.min() < 0 or labels.max() > 1):
            return None  # not a click label: no binomial to test against
        sizes.append(len(labels))
        positives.append(labels.sum())
    n, k = np.asarray(sizes, dtype=float), np.asarray(positives, dtype=float)
    rate = k.sum() / n.sum() if n.sum() else 0.0
    if len(n) < 2 or n.sum() < MIN_UNITS or not 0 < rate < 1 or n.min() == 0:
        return None
    chi2 = float(np.sum((k - n * rate) ** 2 / (n * rate * (1 - rate))))
    p_value = float(stats.chi2.sf(chi2, df=len(n) - 1))
    rates = k / n
    spread = np.sum(n * (rates - rate) ** 2) / n.sum() - (len(n) - 1) * rate * (1 - rate) / n.sum()
    spread = math.sqrt(max(0.0, spread))
    if p_value >= DRIFT_P_VALUE or spread < DRIFT_SHARE * min(rate, 1 - rate):
        return None
    needed = min(DRIFT_ROW_GROUPS, mixing.total_groups)
    mixed = mixing.window_rows > 0 and mixing.groups_per_window >= needed
    suggestion = _advice(mixing, mixed=mixed, needed_rows=needed * mixing.group_rows)
    if mixing.order == "time":
        # Read in time order on purpose: a rate that drifts over time is trained in order.
        suggestion = f"{_in_time_order(mixing)}: a drift over time is kept by design"
    return OrderFinding(
        kind="label_drift",
        column=column,
        value=spread,
        statistic=(
            f"positive rate {rates.min():.3f} to {rates.max():.3f} over {len(n)} row groups "
            f"(overall {rate:.3f}; spread {spread:.3f} beyond chance, chi-square {chi2:.0f} on "
            f"{len(n) - 1} df)"
        ),
        handled=mixed or mixing.order == "time",
        suggestion=suggestion,
    )


def _numbers(column: pa.ChunkedArray) -> np.ndarray:
    """A numeric or time column as float64 (nulls as NaN; times as their integer ticks)."""
    array = column.combine_chunks()
    if not (pa.types.is_integer(array.type) or pa.types.is_floating(array.type)):
        array = array.cast(pa.int64())  # timestamps, dates, durations, booleans
    return array.cast(pa.float64()).to_numpy(zero_copy_only=False)


def _trend_finding(
    groups: list[_Group], *, column: str, mixing: _Mixing, runs: bool, time: bool
) -> OrderFinding | None:
    """The rank correlation of the column with file position over the sample (a trend through
    the files), and the share of steps between adjacent units (sessions, else rows) that go
    one way inside the row groups (sorted inside row groups). A unit is its first row: order
    inside a session (e.g. a position in it) is kept by design. ``runs``: some id comes in
    runs (sorted by user); ``time``: the column is a timestamp or date."""
    positions, values, up, down = [], [], 0, 0
    for group in groups:
        if column not in group.table.column_names:
            continue
        try:
            numbers = _numbers(group.table.column(column))[group.starts]
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            return None  # a type that does not convert: skipped
        finite = np.isfinite(numbers)
        steps = np.diff(numbers[finite])
        up, down = up + int(np.sum(steps > 0)), down + int(np.sum(steps < 0))
        positions.append(group.position + group.starts[finite])
        values.append(numbers[finite])
    values = np.concatenate(values) if values else np.empty(0)
    if len(values) < MIN_UNITS or np.ptp(values) == 0:
        return None
    rho = float(stats.spearmanr(np.concatenate(positions), values).statistic)
    one_way = max(up, down) / (up + down) if up + down >= MIN_UNITS else 0.0
    direction = "rises" if (rho if abs(rho) >= TREND_RHO else up - down) > 0 else "falls"
    through_files = abs(rho) >= TREND_RHO
    if not through_files and one_way < TREND_STEPS:
        return None
    handled, suggestion = _trend_advice(
        mixing, column=column, through_files=through_files, runs=runs, time=time
    )
    return OrderFinding(
        kind="trend",
        column=column,
        value=rho if through_files else one_way,
        statistic=(
            f"{direction} {'through the files' if through_files else 'inside row groups'} "
            f"(Spearman {rho:.2f} with file position; {one_way:.0%} of changes between "
            "adjacent rows go one way)"
        ),
        handled=handled,
        suggestion=suggestion,
    )
