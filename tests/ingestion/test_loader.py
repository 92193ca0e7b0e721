"""Tests of the worker-side conversion of preprocessed Arrow batches to ``Batch``."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from raydlrm.ingestion import DataConfig, Preprocessor, arrow_to_batch

DENSE = ["I1", "I2", "I3"]
SPARSE = ["C1", "C2", "C3", "C4"]  # C2 and C4 are lists


def _config() -> DataConfig:
    return DataConfig(dense_columns=DENSE, sparse_columns=SPARSE, table_size=50, batch_size=8)


def _preprocessed(num_rows: int = 30) -> pa.Table:
    rng = np.random.default_rng(1)
    columns = {
        "sample_id": pa.array(np.arange(num_rows, dtype=np.int64)),
        "label": pa.array(rng.integers(0, 2, num_rows)),
    }
    for name in DENSE:
        columns[name] = pa.array(rng.exponential(5, num_rows).astype(np.float32))
    for name in SPARSE:
        if name in ("C2", "C4"):
            offsets = np.concatenate([[0], np.cumsum(rng.integers(1, 5, num_rows))])
            columns[name] = pa.ListArray.from_arrays(
                pa.array(offsets.astype(np.int32)), pa.array(rng.integers(0, 10**9, offsets[-1]))
            )
        else:
            columns[name] = pa.array(rng.integers(0, 10**9, num_rows))
    return Preprocessor(_config())(pa.table(columns))


def _reference(table: pa.Table) -> dict[str, torch.Tensor]:
    """A plain, row-by-row conversion to compare against."""
    rows = table.to_pylist()
    lengths, values = [], []
    for name in SPARSE:
        for row in rows:
            ids = row[name] if isinstance(row[name], list) else [row[name]]
            lengths.append(len(ids))
            values.extend(ids)
    return {
        "dense": torch.tensor([row["dense"] for row in rows], dtype=torch.float32).reshape(-1, 3),
        "labels": torch.tensor([row["label"] for row in rows], dtype=torch.float32),
        "lengths": torch.tensor(lengths, dtype=torch.int64),
        "values": torch.tensor(values, dtype=torch.int64),
        "sample_ids": torch.tensor([row["sample_id"] for row in rows], dtype=torch.int64),
    }


def _assert_matches(batch, table: pa.Table) -> None:
    expected = _reference(table)
    batch.validate()
    assert batch.batch_size == table.num_rows
    assert batch.sparse.keys == SPARSE
    assert batch.dense.dtype == torch.float32 and batch.dense.shape == (table.num_rows, 3)
    torch.testing.assert_close(batch.dense, expected["dense"])
    torch.testing.assert_close(batch.labels, expected["labels"])
    assert batch.sparse.values.dtype == torch.int64
    torch.testing.assert_close(batch.sparse.lengths, expected["lengths"])
    torch.testing.assert_close(batch.sparse.values, expected["values"])
    torch.testing.assert_close(batch.sample_ids, expected["sample_ids"])


def test_matches_reference_conversion():
    table = _preprocessed()
    batch = arrow_to_batch(table, config=_config())
    _assert_matches(batch, table)
    # Single-id features have one id per sample; list features vary.
    lengths = batch.sparse.lengths.view(4, 30)
    assert torch.all(lengths[0] == 1) and torch.all(lengths[2] == 1)
    assert lengths[1].max() > 1


@pytest.mark.parametrize(("start", "length"), [(5, 11), (29, 1), (0, 0)])
def test_sliced_table(start, length):
    table = _preprocessed()
    sliced = table.slice(start, length)
    _assert_matches(arrow_to_batch(sliced, config=_config()), sliced)


def test_chunked_table():
    table = _preprocessed()
    chunked = pa.concat_tables([table.slice(0, 7), table.slice(7, 10), table.slice(17)])
    assert chunked.column("C2").num_chunks == 3
    _assert_matches(arrow_to_batch(chunked, config=_config()), chunked)


def test_dense_and_labels_share_arrow_memory():
    table = _preprocessed()
    batch = arrow_to_batch(table, config=_config())
    dense_buffer = table.column("dense").chunk(0).values.buffers()[1]
    assert batch.dense.data_ptr() == dense_buffer.address
    label_buffer = table.column("label").chunk(0).buffers()[1]
    assert batch.labels.data_ptr() == label_buffer.address
