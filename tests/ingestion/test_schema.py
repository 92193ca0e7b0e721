"""Tests of the data set checks that run before training."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raydlrm.ingestion import DataConfig, DataValidationError, validate_data


def _config() -> DataConfig:
    return DataConfig(dense_columns=["I1", "I2"], sparse_columns=["C1", "C2"])


def _table(num_rows: int = 5, **replace) -> pa.Table:
    columns = {
        "label": pa.array(np.zeros(num_rows, dtype=np.int64)),
        "I1": pa.array(np.ones(num_rows, dtype=np.float32)),
        "I2": pa.array(np.ones(num_rows, dtype=np.int32)),
        "C1": pa.array(np.arange(num_rows, dtype=np.int64)),
        "C2": pa.array([[1, 2]] * num_rows, pa.list_(pa.int64())),
    }
    columns.update(replace)
    return pa.table({k: v for k, v in columns.items() if v is not None})


def test_valid_directory(tmp_path):
    pq.write_table(_table(5), tmp_path / "a.parquet")
    pq.write_table(_table(7), tmp_path / "b.parquet")
    summary = validate_data(str(tmp_path), _config())
    assert summary.num_rows == 12 and summary.num_files == 2
    assert summary.list_columns == ["C2"]
    assert summary.schema.names == ["label", "I1", "I2", "C1", "C2"]
    assert validate_data(str(tmp_path / "a.parquet"), _config()).num_rows == 5


def test_missing_path_names_it(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(DataValidationError, match=r"eval data path .*nope.* does not exist"):
        validate_data(missing, _config(), role="eval")


def test_directory_without_parquet(tmp_path):
    with pytest.raises(DataValidationError, match="no Parquet files"):
        validate_data(str(tmp_path), _config())


def test_empty_data_set_names_path(tmp_path):
    pq.write_table(_table(0), tmp_path / "empty.parquet")
    with pytest.raises(DataValidationError, match=f"{tmp_path}.*empty"):
        validate_data(str(tmp_path), _config())


def test_missing_column_names_column_and_file(tmp_path):
    pq.write_table(_table(3), tmp_path / "a.parquet")
    pq.write_table(_table(3, I2=None), tmp_path / "b.parquet")
    with pytest.raises(DataValidationError, match=r"b\.parquet has no dense column 'I2'"):
        validate_data(str(tmp_path), _config())


@pytest.mark.parametrize(
    ("column", "array", "message"),
    [
        ("C1", pa.array([1.5] * 3), "sparse column 'C1'.*double"),
        ("C2", pa.array([[1.0]] * 3, pa.list_(pa.float64())), "sparse column 'C2'"),
        ("I1", pa.array(["1"] * 3), "dense column 'I1'"),
        ("label", pa.array(["yes"] * 3), "label column 'label'"),
    ],
)
def test_wrong_types(tmp_path, column, array, message):
    pq.write_table(_table(3, **{column: array}), tmp_path / "a.parquet")
    with pytest.raises(DataValidationError, match=message):
        validate_data(str(tmp_path), _config())


def test_not_parquet(tmp_path):
    (tmp_path / "a.parquet").write_text("not parquet")
    with pytest.raises(DataValidationError, match="not readable Parquet"):
        validate_data(str(tmp_path), _config())


@pytest.mark.parametrize(
    ("array", "seconds"),
    [
        (pa.array([30, 10, 20, 40, 50], pa.timestamp("s")), [10.0, 20.0, 50.0]),
        (pa.array([3, 1, 2, 4, 5], pa.timestamp("ns", tz="UTC")), [1e-9, 2e-9, 5e-9]),
        (pa.array([3, 1, 2, 4, 5], pa.date32()), [86_400.0, 172_800.0, 432_000.0]),
        (pa.array([3, 1, 2, 4, 5], pa.int32()), [1.0, 2.0, 5.0]),
        (pa.array([3.5, 1.5, 2.5, 4.5, 5.5]), [1.5, 2.5, 5.5]),
    ],
)
def test_row_group_times_are_the_time_columns_minimum_from_the_footer(tmp_path, array, seconds):
    pq.write_table(_table(5, ts=array), tmp_path / "a.parquet", row_group_size=2)
    config = DataConfig(dense_columns=["I1", "I2"], sparse_columns=["C1", "C2"], time_column="ts")
    summary = validate_data(str(tmp_path), config)
    assert [g.time for g in summary.row_groups] == pytest.approx(seconds, rel=1e-12)
    # Only training data is dealt in time order; without a time column there is no time.
    assert {g.time for g in validate_data(str(tmp_path), config, role="eval").row_groups} == {None}
    assert {g.time for g in validate_data(str(tmp_path), _config()).row_groups} == {None}


def test_a_time_column_missing_or_without_statistics_is_named(tmp_path):
    config = DataConfig(dense_columns=["I1", "I2"], sparse_columns=["C1", "C2"], time_column="ts")
    ts = pa.array(np.arange(4), pa.timestamp("s"))
    pq.write_table(_table(4, ts=ts), tmp_path / "a.parquet", row_group_size=2)
    pq.write_table(_table(4), tmp_path / "b.parquet")
    with pytest.raises(
        DataValidationError,
        match=r"train data file .*b\.parquet has no time column 'ts' \(data\.time_column\): .*"
        "unset data.time_column to use the file order",
    ):
        validate_data(str(tmp_path), config)
    (tmp_path / "b.parquet").unlink()
    # Written without statistics for the column: refused (a quarantine would drop good rows).
    pq.write_table(
        _table(4, ts=ts), tmp_path / "c.parquet", row_group_size=2, write_statistics=["label"]
    )
    quarantine = DataConfig(
        dense_columns=["I1", "I2"],
        sparse_columns=["C1", "C2"],
        time_column="ts",
        bad_input="quarantine",
        quarantine_path=str(tmp_path / "q"),
    )
    with pytest.raises(
        DataValidationError,
        match=r"row group 0 of .*c\.parquet has no statistics \(minimum\) for time column 'ts' "
        r"\(data\.time_column; or only nulls\): write the files with statistics, or unset "
        "data.time_column",
    ):
        validate_data(str(tmp_path), quarantine)
    pq.write_table(_table(4, ts=pa.array(["a", "b", "c", "d"])), tmp_path / "c.parquet")
    with pytest.raises(DataValidationError, match=r"time column 'ts' .* expected a timestamp"):
        validate_data(str(tmp_path), config)
