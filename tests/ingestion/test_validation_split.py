"""A validation set carved out of the training row groups (``data.valid_split``): the latest
row groups by time, or seeded random ones, never shared with training, in file order."""

from __future__ import annotations

import pyarrow as pa
import pytest

from raydlrm.ingestion import DataConfig
from raydlrm.ingestion.schema import DataSummary, DataValidationError, RowGroup
from raydlrm.ingestion.validation_split import carve_validation


def _summary(times: list[float | None], rows: int = 100) -> DataSummary:
    groups = [RowGroup(f"f{i // 2}.parquet", i % 2, rows, time=t) for i, t in enumerate(times)]
    return DataSummary(
        path="logs",
        num_rows=rows * len(groups),
        num_files=len({g.file for g in groups}),
        schema=pa.schema([]),
        list_columns=[],
        row_groups=groups,
    )


def test_a_time_split_holds_out_the_latest_row_groups() -> None:
    """By the time column's minimum (files out of time order), whole row groups until the
    share is reached; both parts keep the file order; without times, the last files."""
    summary = _summary([5.0, 1.0, 9.0, 3.0, 7.0, 2.0, 8.0, 4.0, 6.0, 0.0])
    config = DataConfig(valid_split="time", valid_fraction=0.25)  # 250 rows: 3 row groups
    train, valid = carve_validation(summary, config)
    assert [g.time for g in valid.row_groups] == [9.0, 7.0, 8.0]
    assert valid.num_rows == 300 and train.num_rows == 700
    assert not {id(g) for g in train.row_groups} & {id(g) for g in valid.row_groups}
    order = summary.row_groups
    assert train.row_groups == [g for g in order if g not in valid.row_groups]
    _, last = carve_validation(_summary([None] * 4), config)
    assert last.row_groups == _summary([None] * 4).row_groups[3:]


def test_a_random_split_is_seeded_apart_from_training() -> None:
    summary = _summary([None] * 20)
    config = DataConfig(valid_split="random", valid_fraction=0.2)
    train, valid = carve_validation(summary, config)
    assert len(valid.row_groups) == 4 and len(train.row_groups) == 16
    assert carve_validation(summary, config)[1] == valid  # the same split every time
    assert valid.row_groups != summary.row_groups[-4:]


def test_too_few_row_groups_are_named() -> None:
    with pytest.raises(DataValidationError, match=r"'logs' has 1 row group.*write smaller"):
        carve_validation(_summary([None]), DataConfig(valid_split="random"))
    with pytest.raises(ValueError, match=r"data\.valid_path and data\.valid_split"):
        DataConfig(valid_split="time", valid_path="v")
