"""Tests of the preprocessor: hashing, dense transform, list columns, bad input."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pyarrow as pa
import pytest

from raydlrm.ingestion import DataConfig, Preprocessor, hash_ids

DENSE = ["I1", "I2"]
SPARSE = ["C1", "C2", "C3"]


def _config(**overrides) -> DataConfig:
    fields = {"dense_columns": DENSE, "sparse_columns": SPARSE, "table_size": 97}
    return DataConfig(**{**fields, **overrides})


def _raw_table(num_rows: int = 6, seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 4, size=num_rows)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return pa.table(
        {
            "sample_id": pa.array(np.arange(num_rows, dtype=np.int64) + 100),
            "label": pa.array(rng.integers(0, 2, num_rows)),
            "I1": pa.array(
                rng.uniform(-2, 50, num_rows).astype(np.float32), mask=np.arange(num_rows) % 3 == 0
            ),
            "I2": pa.array(rng.integers(0, 1000, num_rows)),
            "C1": pa.array(rng.integers(-(2**62), 2**62, num_rows)),
            "C2": pa.array(rng.integers(0, 10, num_rows).astype(np.int32)),
            "C3": pa.ListArray.from_arrays(
                pa.array(offsets), pa.array(rng.integers(-(2**62), 2**62, int(offsets[-1])))
            ),
        }
    )


def test_output_columns_ranges_and_types():
    config = _config(table_sizes={"C2": 5})
    raw = _raw_table(num_rows=500)
    out = Preprocessor(config)(raw)
    assert out.column_names == ["label", "dense", "C1", "C2", "C3", "sample_id"]
    assert out.schema.field("label").type == pa.float32()
    assert out.schema.field("dense").type == pa.list_(pa.float32(), 2)
    assert out.schema.field("C1").type == pa.int64()
    assert out.schema.field("C3").type == pa.list_(pa.int64())
    for column, size in (("C1", 97), ("C2", 5)):
        ids = out.column(column).to_numpy()
        assert ids.min() >= 0 and ids.max() < size
        assert len(np.unique(ids)) > min(size, 10) // 2  # spreads over the table
    flat = out.column("C3").combine_chunks().flatten().to_numpy()
    assert flat.min() >= 0 and flat.max() < 97
    np.testing.assert_array_equal(out.column("sample_id").to_numpy(), np.arange(500) + 100)
    np.testing.assert_array_equal(out.column("label").to_numpy(), raw.column("label").to_numpy())


def test_dense_nulls_filled_then_log1p():
    raw = _raw_table(num_rows=9)
    i1 = raw.column("I1").to_numpy(zero_copy_only=False)
    i2 = raw.column("I2").to_numpy().astype(np.float32)
    filled = np.nan_to_num(i1, nan=0.0)
    out = Preprocessor(_config())(raw)
    dense = out.column("dense").combine_chunks().flatten().to_numpy().reshape(9, 2)
    expected = np.log1p(np.maximum(np.stack([filled, i2], axis=1), 0))
    np.testing.assert_allclose(dense, expected, rtol=1e-6)
    assert np.all(dense[::3, 0] == 0)  # nulls (rows 0, 3, 6) -> 0 -> log1p(0)
    plain = Preprocessor(_config(dense_transform="none"))(raw)
    dense = plain.column("dense").combine_chunks().flatten().to_numpy().reshape(9, 2)
    np.testing.assert_allclose(dense, np.stack([filled, i2], axis=1))


def test_list_columns_keep_lengths_and_hash_every_id():
    raw = _raw_table(num_rows=50)
    out = Preprocessor(_config())(raw)
    raw_c3, out_c3 = raw.column("C3").combine_chunks(), out.column("C3").combine_chunks()
    np.testing.assert_array_equal(out_c3.value_lengths(), raw_c3.value_lengths())
    np.testing.assert_array_equal(
        out_c3.flatten().to_numpy(), hash_ids(raw_c3.flatten().to_numpy(), table_size=97)
    )


def test_sliced_and_chunked_input_matches_whole():
    raw = _raw_table(num_rows=40)
    whole = Preprocessor(_config())(raw)
    sliced = Preprocessor(_config())(raw.slice(7, 20))
    assert sliced.equals(whole.slice(7, 20).combine_chunks())
    chunked = pa.concat_tables([raw.slice(0, 13), raw.slice(13)])
    assert Preprocessor(_config())(chunked).equals(whole)


def test_uint64_ids_hash_by_their_bits(tmp_path):
    """uint64 ids hash as the int64 of the same 64 bits: ids below 2**63 as the same values
    in any integer type, ids of 2**63 and more without the cast error a conversion would
    raise; ``data inspect`` reads them too."""
    config = DataConfig(dense_columns=["I1"], sparse_columns=["C1"], table_size=1000)
    ids = [5, 2**63, 2**64 - 1]

    def hashed(column: pa.Array) -> list[int]:
        table = pa.table({"label": [0, 1, 0], "I1": [1.0, 2.0, 3.0], "C1": column})
        return Preprocessor(config)(table).column("C1").to_pylist()

    unsigned = hashed(pa.array(ids, pa.uint64()))
    signed = hashed(pa.array(np.array(ids, np.uint64).view(np.int64)))
    assert unsigned == signed and unsigned[0] == hashed(pa.array([5, 0, 0], pa.int32()))[0]
    assert len(set(unsigned)) == 3
    import pyarrow.parquet as pq

    from raydlrm.ingestion.inspect import inspect_data

    table = pa.table({"label": [0, 1, 0], "I1": [1.0, 2.0, 3.0], "C1": pa.array(ids, pa.uint64())})
    pq.write_table(table, tmp_path / "part-0.parquet")
    report = inspect_data(str(tmp_path), config)
    assert report["sparse"]["C1"]["distinct_ids"] == 3


def test_hash_is_stable_across_processes():
    ids = np.array([0, 1, -1, 2**62, -(2**63), 123456789], dtype=np.int64)
    here = hash_ids(ids, table_size=1_000_003).tolist()
    code = (
        "import numpy as np; from raydlrm.ingestion.preprocess import hash_ids; "
        f"print(hash_ids(np.array({ids.tolist()}, dtype=np.int64), table_size=1_000_003).tolist())"
    )
    other = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "12345"},
    )
    assert other.stdout.strip() == str(here)
    assert len(set(here)) == len(here)


def test_null_ids_and_labels_are_errors_naming_the_column():
    raw = _raw_table()
    bad = raw.set_column(
        raw.schema.get_field_index("C1"), "C1", pa.array([1, None, 3, 4, 5, 6], pa.int64())
    )
    with pytest.raises(ValueError, match="'C1'"):
        Preprocessor(_config())(bad)
    bad_list = raw.set_column(
        raw.schema.get_field_index("C3"),
        "C3",
        pa.array([[1], [2, None], [3], [4], [5], [6]], pa.list_(pa.int64())),
    )
    with pytest.raises(ValueError, match="'C3'"):
        Preprocessor(_config())(bad_list)
    bad_label = raw.set_column(
        raw.schema.get_field_index("label"), "label", pa.array([1, 0, None, 0, 1, 0], pa.int64())
    )
    with pytest.raises(ValueError, match="'label'"):
        Preprocessor(_config())(bad_label)


def test_a_managed_tables_ids_stay_raw_and_negative_ones_are_bad_input():
    """Managed tables (data.managed_ids) take raw ids: integers as they are, strings as their
    63-bit hash; a negative integer id is bad input naming the column."""
    from raydlrm.ids import ManagedIds
    from raydlrm.ingestion.badinput import find_bad_rows
    from raydlrm.ingestion.preprocess import hash_strings

    config = _config(managed_ids={"C2": ManagedIds(), "t_C3": ManagedIds()})
    raw = _raw_table(num_rows=30)
    raw = raw.set_column(
        raw.schema.get_field_index("C3"), "C3", raw.column("C3").cast(pa.list_(pa.string()))
    )
    out = Preprocessor(config)(raw)
    np.testing.assert_array_equal(out.column("C2").to_numpy(), raw.column("C2").to_numpy())
    strings = raw.column("C3").combine_chunks().flatten()
    hashed = (hash_strings(strings) & np.uint64(2**63 - 1)).view(np.int64)
    np.testing.assert_array_equal(out.column("C3").combine_chunks().flatten().to_numpy(), hashed)
    assert out.column("C1").to_numpy().max() < 97  # hashed as before
    negative = raw.set_column(
        raw.schema.get_field_index("C2"), "C2", pa.array(np.arange(30, dtype=np.int32) - 1)
    )
    bad = find_bad_rows(negative, config)
    assert bad is not None and "sparse column 'C2': managed id negative" in str(bad)
    with pytest.raises(ValueError, match=r"data\.managed_ids\.nope: not a table"):
        _config(managed_ids={"nope": ManagedIds()})
    with pytest.raises(ValueError, match="hash = false"):
        _config(managed_ids={"C2": ManagedIds()}, sparse_specs={"C2": {"hash": False}})
    with pytest.raises(ValueError, match=r"data.managed_ids.C2: 64 buckets need at least 128"):
        _config(managed_ids={"C2": ManagedIds(buckets=64)})
