"""What a data set holds, seen through a config: ``raydlrm data inspect``.

:func:`inspect_data` checks the footers (:func:`~raydlrm.ingestion.schema.validate_data`: files,
rows, row groups, schema) and reads a sample of rows (the first ``max_rows``, in file order) to
report the rows training would reject (bad input); per sparse column the null count, the
distinct raw ids, the table rows those ids hash to and the mean id-list length; per dense
column the null and non-finite counts; the label rate; and per dedup group the dedup ratio
inside batches of ``data.batch_size`` consecutive rows (the data is read session by session,
as training reads it).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from raydlrm.ingestion._arrow import decode_dictionaries, is_list
from raydlrm.ingestion.badinput import find_bad_rows
from raydlrm.ingestion.config import DataConfig
from raydlrm.ingestion.preprocess import DEDUP_PREFIX, Preprocessor
from raydlrm.ingestion.schema import validate_data
from raydlrm.storage import filesystem_for

__all__ = ["inspect_data"]


def _sample(path: str, *, data: DataConfig, files: list[str], max_rows: int) -> pa.Table:
    """The first ``max_rows`` rows of ``files`` (in order), the input columns only."""
    filesystem = filesystem_for(path, data.storage)[0]
    columns = data.input_columns()
    tables, rows = [], 0
    for file in files:
        with filesystem.open_input_file(file) as f:
            reader = pq.ParquetFile(f)
            for batch in reader.iter_batches(batch_size=65_536, columns=columns):
                # Files may differ in encoding (dictionary) and width (int32/int64,
                # string/large_string), as training accepts: one type per column here too.
                tables.append(decode_dictionaries(pa.Table.from_batches([batch])))
                rows += batch.num_rows
                if rows >= max_rows:
                    return _concat(tables).slice(0, max_rows)
    return _concat(tables)


def _concat(tables: list[pa.Table]) -> pa.Table:
    return pa.concat_tables(tables, promote_options="permissive")


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
        column) and ``dedup`` (per group).

    Raises:
        DataValidationError: the data set is missing or does not match the config.
    """
    config = _inspecting(data)
    summary = validate_data(path, config, role="inspected")
    files = list(dict.fromkeys(g.file for g in summary.row_groups))
    sample = _sample(path, data=data, files=files, max_rows=max_rows)
    bad, _ = find_bad_rows(sample, data)
    processed = Preprocessor(config)(sample.filter(pa.array(~bad)))
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
        "dense": {column: _dense_report(sample.column(column)) for column in data.dense_columns},
        "dedup": _dedup_report(processed, data=data),
    }


def _inspecting(data: DataConfig) -> DataConfig:
    """``data`` as inspection reads with it: failing on a broken file, with any dense stats."""
    # Inspecting writes nothing: a broken file is reported (``fail``), not quarantined. Dense
    # statistics do not matter here (dedup keys and hashed ids do not depend on them).
    stats = {c: data.dense_stats.get(c, (0.0, 1.0)) for c in data.standardized_columns()}
    return dataclasses.replace(data, bad_input="fail", dense_stats={**data.dense_stats, **stats})


def _label_rate(sample: pa.Table, *, data: DataConfig) -> float:
    if not sample.num_rows:
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
