"""What a data set holds, seen through a config: ``raydlrm data inspect``.

:func:`inspect_data` checks the footers (:func:`~raydlrm.ingestion.schema.validate_data`: files,
rows, row groups, schema) and reads a sample of rows (the first ``max_rows``, in file order; of a
session-clustered data set, each sample joined with its session's columns) to report the rows
training would reject (bad input); per sparse column the null count, the distinct raw ids, the
table rows those ids hash to and the mean id-list length; per dense column the null and
non-finite counts, the missing share and whether the fill dominates the column's spread (a
flag, see :data:`COLLAPSED_SPREAD`); per sequence the events per row and the share of rows its
``max_length`` cuts; the label rate; per dedup group the dedup ratio inside
batches of ``data.batch_size`` consecutive rows (the data is read session by session, as
training reads it); and what RecD would gain: the sparse columns constant within sessions
(``data.session_column``), the dedup factor over all sparse features (id lookups per distinct
``(feature, id)`` pair in a batch) and the user features' share of the lookups; and what the
file order is correlated with (:mod:`raydlrm.ingestion.order`: runs of ids, label drift, time).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from raydlrm.ingestion._arrow import is_list
from raydlrm.ingestion.badinput import find_bad_rows
from raydlrm.ingestion.clustered import read_rows
from raydlrm.ingestion.config import DataConfig
from raydlrm.ingestion.dedup import batch_dedup_factor, id_occurrences
from raydlrm.ingestion.layout import layout_of
from raydlrm.ingestion.order import order_findings
from raydlrm.ingestion.preprocess import DEDUP_PREFIX, Preprocessor
from raydlrm.ingestion.schema import DataSummary, validate_data
from raydlrm.ingestion.sessions import constant_columns
from raydlrm.ingestion.stats import compute_dense_fill_values

__all__ = ["COLLAPSED_SPREAD", "inspect_data"]

COLLAPSED_SPREAD = 0.25
"""A dense column with missing values is flagged when its present values' standard deviation,
as the model sees them (filled, clipped, transformed), is below this share of the whole
column's: the fill sits so far from them that it dominates the column's spread (and a
standardization over filled values would squeeze the present ones together)."""


def _flat(column: pa.ChunkedArray) -> pa.Array:
    array = column.combine_chunks()
    return pc.list_flatten(array) if is_list(array.type) else array


def inspect_data(path: str, data: DataConfig, *, max_rows: int = 200_000) -> dict[str, Any]:
    """Summarizes a data set as the config reads it.

    Args:
        path: the data set (a file or directory, local or ``s3://``).
        data: the data config (columns, tables, dedup groups, storage, partitions).
        max_rows: rows to read for the column statistics (the footers give the totals).

    Returns:
        A JSON-ready dict: ``path``, ``files``, ``rows``, ``row_groups``, ``sampled_rows``,
        ``bad_rows_in_sample``, ``schema``, ``label_rate``, ``sparse`` and ``dense`` (per
        column), ``sequences`` (per sequence: its events per row), ``dedup`` (per group) and
        ``recd`` (``layout``, ``session_column``, ``session_constant_columns``,
        ``user_columns`` and where they come from, ``dedup_factor``, ``user_lookup_share``)
        and ``file_order`` (what the file order is correlated with,
        :func:`~raydlrm.ingestion.order.order_findings`).

    Raises:
        DataValidationError: the data set is missing or does not match the config.
    """
    config = _inspecting(data)
    summary = validate_data(path, config, role="inspected")
    session = _session_column(summary, data=data)
    columns = [*data.input_columns(), *([session] if session else [])]
    sample = read_rows(path, config, columns=columns, max_rows=max_rows, role="inspected")
    bad, _ = find_bad_rows(sample, data)
    good = sample.filter(pa.array(~bad))
    config = _with_sample_fills(config, good)
    processed = Preprocessor(config)(good)
    return {
        "path": path,
        "files": summary.num_files,
        "rows": summary.num_rows,
        "row_groups": len(summary.row_groups),
        "sampled_rows": sample.num_rows,
        "bad_rows_in_sample": int(bad.sum()),
        "schema": {f.name: str(f.type) for f in summary.schema},
        "label_rate": _label_rate(sample, data=data),
        "sparse": {
            column: _sparse_report(column, data=data, sample=sample, processed=processed)
            for column in data.sparse_columns
        },
        "dense": _dense_reports(config, sample=sample, good=good, processed=processed),
        "sequences": {
            name: _sequence_report(name, data=data, sample=good) for name in data.sequences
        },
        "dedup": _dedup_report(processed, data=data),
        "recd": _recd_report(summary, data=data, sample=good, processed=processed, session=session),
        "file_order": [f.to_dict() for f in order_findings(summary, data)],
    }


def _session_column(summary: DataSummary, *, data: DataConfig) -> str | None:
    """The data set's session column: a clustered set's, else ``data.session_column`` when
    the data has it."""
    layout = layout_of(summary.schema)
    if layout is not None:
        return layout.session_column
    column = data.session_column
    return column if column is not None and column in summary.schema.names else None


def _recd_report(
    summary: DataSummary,
    *,
    data: DataConfig,
    sample: pa.Table,
    processed: pa.Table,
    session: str | None,
) -> dict[str, Any]:
    """What RecD gains on the sample: the dedup factor over all sparse features (hashed ids,
    as looked up, in batches of ``data.batch_size`` consecutive rows) and the user features'
    share of the lookups; the user features are the dedup groups' columns, else a clustered
    set's per-session columns, else the sparse columns constant within sessions."""
    layout = layout_of(summary.schema)
    constant, why = None, None
    if session is None:
        why = f"no session column (data.session_column = {data.session_column!r})"
    else:
        try:
            constant = constant_columns(
                sample, session_column=session, columns=data.sparse_columns, config=data
            )
        except ValueError as exc:
            why = str(exc)
    grouped = [c for g in data.dedup_groups for c in g]
    if grouped:
        user, source = grouped, "data.dedup_groups"
    elif layout is not None:
        user = [c for c in data.sparse_columns if c in layout.session_columns]
        source = "per-session columns of the clustered layout"
    else:
        user, source = constant or [], "constant within sessions"
    # Every feature's lookups, the bucket features' (one a sample) too.
    counts = {c: id_occurrences(processed, c)[0].size for c in data.feature_columns()}
    total = sum(counts.values())
    return {
        "layout": "samples" if layout is None else "clustered",
        "session_column": session,
        "session_constant_columns": constant,
        "session_constant_unknown_because": why,
        "user_columns": user,
        "user_columns_from": source,
        "dedup_factor": batch_dedup_factor(
            processed, columns=data.sparse_columns, batch_size=max(1, data.batch_size)
        ),
        "user_lookup_share": sum(counts[c] for c in user) / total if total else 0.0,
    }


def _inspecting(data: DataConfig) -> DataConfig:
    """``data`` as inspection reads with it: failing on a broken file, with any dense stats
    and bucket boundaries."""
    # Inspecting writes nothing: a broken file is reported (``fail``), not quarantined. Dense
    # statistics and buckets do not matter here (dedup keys and hashed ids do not depend on
    # them).
    stats = {c: data.dense_stats.get(c, (0.0, 1.0)) for c in data.standardized_columns()}
    bounds = {c: data.bucket_boundaries.get(c, []) for c in data.bucketized_columns()}
    return dataclasses.replace(
        data, bad_input="fail", dense_stats={**data.dense_stats, **stats}, bucket_boundaries=bounds
    )


def _label_rate(sample: pa.Table, *, data: DataConfig) -> float:
    if not sample.num_rows or data.label_column is None:
        return 0.0
    return float(pc.mean(sample.column(data.label_column).cast(pa.float64())).as_py())


def _sparse_report(
    column: str, *, data: DataConfig, sample: pa.Table, processed: pa.Table
) -> dict[str, Any]:
    """Nulls, distinct raw ids, table rows they hash to and mean list length of ``column``."""
    raw = sample.column(column)
    flat = _flat(raw)
    hashed = _flat(processed.column(column))
    lengths = pc.list_value_length(raw.combine_chunks()) if is_list(raw.type) else None
    return {
        "table": data.table_of(column),
        "nulls": raw.null_count + (flat.null_count if lengths is not None else 0),
        "distinct_ids": pc.count_distinct(flat).as_py(),
        "table_rows_used": pc.count_distinct(hashed).as_py(),
        "table_size": data.table_size_of(column),
        "mean_length": float(pc.mean(lengths).as_py() or 0.0) if lengths is not None else 1.0,
    }


def _sequence_report(name: str, *, data: DataConfig, sample: pa.Table) -> dict[str, Any]:
    """The events per row of sequence ``name`` in the good rows of the sample (as read, before
    the cut to ``max_length``): mean, median, 99th percentile and most, and the shares of
    empty rows and of rows the cut shortens."""
    spec = data.sequences[name]
    raw = sample.column(spec.columns[0]).combine_chunks()
    lengths = raw.value_lengths().fill_null(0).to_numpy(zero_copy_only=False)
    if not lengths.size:
        lengths = np.zeros(1, dtype=np.int64)  # no good row: all zeros, reported as such
    return {
        "columns": spec.all_columns,
        "max_length": spec.max_length,
        "mean_length": float(lengths.mean()),
        "median_length": float(np.median(lengths)),
        "p99_length": float(np.percentile(lengths, 99)),
        "longest": int(lengths.max()),
        "empty_share": float((lengths == 0).mean()),
        "truncated_share": float((lengths > spec.max_length).mean()),
    }


def _with_sample_fills(config: DataConfig, good: pa.Table) -> DataConfig:
    """``config`` with the sample's mean or median for the columns filled with one that it has
    no fill value for (0 for a column with no present value in the sample: reported, not an
    error)."""
    lacking = [c for c in config.computed_fill_columns() if c not in config.dense_fill_values]
    if not lacking:
        return config
    empty = {c: 0.0 for c in lacking if good.column(c).null_count == good.num_rows}
    config = dataclasses.replace(config, dense_fill_values={**config.dense_fill_values, **empty})
    fills = compute_dense_fill_values([good], config)
    return dataclasses.replace(config, dense_fill_values={**config.dense_fill_values, **fills})


def _dense_reports(
    config: DataConfig, *, sample: pa.Table, good: pa.Table, processed: pa.Table
) -> dict[str, dict[str, Any]]:
    """Per dense column: its nulls and non-finite values in ``sample``, its missing share, the
    spread of its present values in ``processed`` (the preprocessed ``good`` rows) relative to
    the whole column's (None without both present and missing values, or when the present
    values are constant) and, when that spread is below :data:`COLLAPSED_SPREAD`, a flag."""
    dense = processed.column("dense").combine_chunks().flatten().to_numpy(zero_copy_only=False)
    dense = dense.reshape(processed.num_rows, config.num_dense_inputs())
    reports = {}
    for j, column in enumerate(config.dense_columns):
        report: dict[str, Any] = _dense_report(sample.column(column))
        share = report["nulls"] / sample.num_rows if sample.num_rows else 0.0
        missing = good.column(column).is_null().to_numpy(zero_copy_only=False)
        spread = None
        if missing.any() and not missing.all():
            present, whole = np.std(dense[~missing, j]), np.std(dense[:, j])
            spread = float(present / whole) if present > 0 else None
        flag = None
        if spread is not None and spread < COLLAPSED_SPREAD:
            flag = (
                f"dense column {column!r} is {share:.1%} missing, filled with "
                f"{config.dense_fill_of(column)} ({config.fill_key_of(column)}): its present "
                f"values spread over {spread:.2f} of the column's standard deviation, the fill "
                'dominates it; set data.dense_fill = "median" (or '
                f"data.dense_specs.{column}.fill) and data.dense_missing_indicator = true"
            )
        reports[column] = {**report, "missing_share": share, "present_spread": spread}
        reports[column]["flag"] = flag
    return reports


def _dense_report(column: pa.ChunkedArray) -> dict[str, int]:
    """Null and non-finite (NaN, infinite) counts of a dense column."""
    values = column.cast(pa.float64()).combine_chunks()
    finite = pc.is_finite(values)
    return {
        "nulls": values.null_count,
        "non_finite": int(pc.sum(pc.invert(finite.fill_null(True))).as_py() or 0),
    }


def _dedup_report(processed: pa.Table, *, data: DataConfig) -> list[dict[str, Any]]:
    """Per dedup group, the mean ratio of rows to unique rows over batches of
    ``data.batch_size`` consecutive rows."""
    batch = max(1, data.batch_size)
    out = []
    for i, group in enumerate(data.dedup_groups):
        keys = processed.column(f"{DEDUP_PREFIX}{i}").to_numpy()
        ratios = [
            len(chunk) / len(np.unique(chunk))
            for chunk in (keys[s : s + batch] for s in range(0, len(keys), batch))
            if len(chunk)
        ]
        out.append({"columns": list(group), "ratio": float(np.mean(ratios)) if ratios else 1.0})
    return out
