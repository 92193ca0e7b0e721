"""Sequence features in the data (``data.sequences``): config errors named by key, bad input
(ragged parallel columns, null lists and values, ids out of range) under both policies, empty
histories, the cut to the last ``max_length`` events in every column, counted once per pass,
and the values that reach ``Batch.sequence_values``."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from typer.testing import CliRunner

from raydlrm.batch import Batch
from raydlrm.ingestion import DataConfig, DataValidationError, Preprocessor, validate_data
from raydlrm.ingestion.badinput import (
    FILE_COLUMN,
    ROW_COLUMN,
    ROW_GROUP_COLUMN,
    BadInputError,
    quarantine_counts,
    run_tag,
)
from raydlrm.ingestion.inspect import inspect_data
from raydlrm.ingestion.loader import arrow_to_batch
from raydlrm.ingestion.preprocess import hash_strings
from raydlrm.ingestion.row_group_reader import RowGroupReader, read_columns
from raydlrm.ingestion.sequence_rows import truncated_counts
from raydlrm.platform.cli import app
from raydlrm.platform.config import ConfigError, load_config
from raydlrm.trainers.pipeline import emptied

N = 6
ITEMS = [[], [3], [1, 2], [4, 5, 6, 7, 8], [9], [10, 11, 12]]
"""Each row's history, oldest first: row 0 is a user's first event, row 3 is cut to 3."""


def _parallel(values: list) -> list[list]:
    """A list per row as long as that row of ``ITEMS``, from a flat list of ``values``."""
    flat = iter(values)
    return [[next(flat) for _ in row] for row in ITEMS]


def _config(tmp_path: Path, policy: str = "fail", **sequence) -> DataConfig:
    spec = {
        "columns": ["H_item", "H_cat"],
        "value_columns": ["H_time", "H_rating"],
        "max_length": 3,
        **sequence,
    }
    return DataConfig(
        dense_columns=["I1"],
        sparse_columns=["C1", "H_item", "H_cat"],
        table_size=100,
        sparse_specs={"H_item": {"hash": False}},
        sequences={"hist": spec},
        bad_input=policy,
        quarantine_path=str(tmp_path / "quarantine"),
    )


def _raw(**changes) -> pa.Table:
    """A valid raw table of N rows (with sample ids); ``changes`` replace columns."""
    total = sum(map(len, ITEMS))
    columns = {
        "label": pa.array([0, 1, 0, 1, 1, 0]),
        "I1": pa.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0]),
        "C1": pa.array([f"u{i}" for i in range(N)]),
        "H_item": pa.array(ITEMS, pa.list_(pa.int64())),
        "H_cat": pa.array(_parallel([f"c{i}" for i in range(total)]), pa.list_(pa.string())),
        "H_time": pa.array(_parallel(list(range(1000, 1000 + total))), pa.list_(pa.int64())),
        "H_rating": pa.array(_parallel([0.5 * i for i in range(total)]), pa.list_(pa.float64())),
        "sample_id": pa.array(np.arange(N, dtype=np.int64)),
    }
    columns.update(changes)
    return pa.table(columns)


def _tagged(table: pa.Table) -> pa.Table:
    """``table`` tagged as the reader tags a row group's rows (file, row group 3, row)."""
    table = table.append_column(FILE_COLUMN, pa.array(["data/part-7.parquet"] * N))
    table = table.append_column(ROW_GROUP_COLUMN, pa.array([3] * N))
    return table.append_column(ROW_COLUMN, pa.array(np.arange(N)))


def _row2(column: str, value: list | None, type_: pa.DataType) -> dict[str, pa.Array]:
    """The change of row 2 of ``column`` to ``value``."""
    rows = _raw().column(column).to_pylist()
    rows[2] = value
    return {column: pa.array(rows, type_)}


INTS, FLOATS = pa.list_(pa.int64()), pa.list_(pa.float64())
BAD_ROW_2 = {
    "ragged ids": (
        _row2("H_cat", ["x"], pa.list_(pa.string())),
        "sequence 'hist' column 'H_cat': list of length 1, column 'H_item' of length 2",
    ),
    "ragged values": (
        _row2("H_time", [1, 2, 3], INTS),
        "sequence 'hist' column 'H_time': list of length 3, column 'H_item' of length 2",
    ),
    "null value list": (_row2("H_time", None, INTS), "sequence 'hist' column 'H_time': null list"),
    "null value": (_row2("H_rating", [1.0, None], FLOATS), "column 'H_rating': null, NaN"),
    "NaN value": (_row2("H_rating", [float("nan"), 1.0], FLOATS), "column 'H_rating': null, NaN"),
    "infinite value": (_row2("H_rating", [1.0, float("inf")], FLOATS), "'H_rating': null, NaN"),
    "id out of range (hash = false)": (
        _row2("H_item", [1, 100], INTS),
        "sparse column 'H_item': id not below the table size 100",
    ),
    "negative id (hash = false)": (
        _row2("H_item", [-1, 2], INTS),
        "sparse column 'H_item': negative id",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_ROW_2))
def test_bad_sequence_row_fails_naming_file_row_group_row_and_column(
    tmp_path: Path, case: str
) -> None:
    changes, reason = BAD_ROW_2[case]
    with pytest.raises(BadInputError, match=r"part-7\.parquet, row group 3, row 2: ") as info:
        Preprocessor(_config(tmp_path))(_tagged(_raw(**changes)))
    assert reason in str(info.value)
    assert "(1 bad rows" in str(info.value)


@pytest.mark.parametrize("case", ["ragged ids", "ragged values", "null value"])
def test_bad_sequence_row_is_quarantined_and_counted(tmp_path: Path, case: str) -> None:
    changes, reason = BAD_ROW_2[case]
    config = _config(tmp_path, "quarantine")
    out = Preprocessor(config)(_tagged(_raw(**changes)))
    assert out.column("sample_id").to_pylist() == [0, 1, 3, 4, 5]
    (written,) = (tmp_path / "quarantine").glob("*.parquet")
    bad = pq.read_table(written)
    assert bad.column(ROW_COLUMN).to_pylist() == [2]
    assert reason in bad.column("_reason")[0].as_py()
    assert quarantine_counts(config)["bad_rows"] == 1


def test_empty_histories_pass_unless_the_sequence_needs_events(tmp_path: Path) -> None:
    """Row 0's empty history is a user's first event (no ``min_length`` to set on the
    sparse column); ``min_length = 1`` makes it bad input."""
    out = Preprocessor(_config(tmp_path))(_tagged(_raw()))
    assert out.num_rows == N and out.column("H_item")[0].as_py() == []
    assert out.column("value:H_time")[0].as_py() == []
    with pytest.raises(BadInputError, match=r"row 0: sparse column 'H_item': id list shorter"):
        Preprocessor(_config(tmp_path, min_length=1))(_tagged(_raw()))


def _events(batch: Batch) -> dict[int, tuple[list, list, list, list]]:
    """Each sample's history in a batch: its items, categories (hashed), times, ratings."""
    sparse, b = batch.sparse, batch.batch_size
    bags = sparse.offsets.tolist()
    times, ratings = batch.jagged_values("H_time"), batch.jagged_values("H_rating")
    out = {}
    for row, sample in enumerate(batch.sample_ids.tolist()):
        item, cat = (sparse.keys.index(k) * b + row for k in ("H_item", "H_cat"))
        s, e = times.offsets[row], times.offsets[row + 1]
        out[sample] = (
            sparse.values[bags[item] : bags[item + 1]].tolist(),
            sparse.values[bags[cat] : bags[cat + 1]].tolist(),
            times.values[s:e].tolist(),
            ratings.values[s:e].tolist(),
        )
    return out


def _read(tmp_path: Path, config: DataConfig, *, tag: str, window: int) -> pa.Table:
    """The preprocessed rows of the Parquet data set under ``tmp_path / "data"`` (two row
    groups), read by a training reader as pass ``tag``."""
    root = tmp_path / "data"
    summary = validate_data(str(root), config)
    reader = RowGroupReader(
        config,
        source_path=str(root),
        columns=read_columns(config, summary.schema),
        schema=summary.schema,
        seed=0,
        epoch=0,
        shuffle=bool(window),
        tag=tag,
        window_rows=window,
    )
    refs = [{"group": g.to_dict(), "id": i, "skip": 0} for i, g in enumerate(summary.row_groups)]
    windows = [refs] if window else [[ref] for ref in refs]
    return reader(pa.Table.from_pylist([{"window": w} for w in windows]))


@pytest.mark.parametrize("window", [0, 10**6])
def test_a_long_history_keeps_its_last_events_in_every_column_counted_once(
    tmp_path: Path, window: int
) -> None:
    """Read from Parquet into a ``Batch``: row 3's 5 events become its last 3 in the ids,
    the second id column and both value columns alike, the others stay whole (jagged, not
    padded); the row cut is counted per pass, once however often a restart re-reads it."""
    (tmp_path / "data").mkdir()
    pq.write_table(_raw(), tmp_path / "data" / "part-0.parquet", row_group_size=3)
    config = _config(tmp_path)
    tag = run_tag("job", "train")
    batch = arrow_to_batch(_read(tmp_path, config, tag=f"{tag}-e0", window=window), config=config)
    batch.validate()
    cats = _raw().column("H_cat").to_pylist()
    times, ratings = _raw().column("H_time").to_pylist(), _raw().column("H_rating").to_pylist()
    keep = [slice(-3, None) if len(row) > 3 else slice(None) for row in ITEMS]
    expected = {
        i: (
            ITEMS[i][keep[i]],
            (hash_strings(pa.array(cats[i][keep[i]], pa.string())) % np.uint64(100)).tolist(),
            [float(t) for t in times[i][keep[i]]],
            ratings[i][keep[i]],
        )
        for i in range(N)
    }
    assert _events(batch) == expected
    assert expected[3][0] == [6, 7, 8]
    assert batch.sequence_of == {"H_time": "H_item", "H_rating": "H_item"}
    assert batch.sequence_values["H_time"].dtype == torch.float32
    jagged = batch.jagged_values("H_rating")
    assert sorted(jagged.lengths.tolist()) == [0, 1, 1, 2, 3, 3]
    assert truncated_counts(config, tag=tag) == {"hist": 1}
    _read(tmp_path, config, tag=f"{tag}-e0", window=window)  # a restart reads it again
    assert truncated_counts(config, tag=tag) == {"hist": 1}
    _read(tmp_path, config, tag=f"{tag}-e1", window=window)
    assert truncated_counts(config, tag=tag) == {"hist": 2}
    assert truncated_counts(config, tag=tag, once=True) == {"hist": 1}
    assert quarantine_counts(config)["rows"] == 0  # the counts are no quarantined rows


def test_batch_carries_and_checks_sequence_values(tmp_path: Path) -> None:
    config = _config(tmp_path)
    batch = arrow_to_batch(Preprocessor(config)(_tagged(_raw())), config=config)
    moved = batch.to("cpu")
    assert moved.sequence_of == batch.sequence_of
    assert torch.equal(moved.sequence_values["H_rating"], batch.sequence_values["H_rating"])
    empty = emptied(batch)
    empty.validate()
    assert empty.sequence_values["H_time"].shape == (0,)
    values = {**batch.sequence_values, "H_time": torch.zeros(3)}
    with pytest.raises(ValueError, match=r"'H_time' has 3 values, its feature 'H_item' 10 ids"):
        dataclasses.replace(batch, sequence_values=values).validate()
    with pytest.raises(ValueError, match="name other value columns"):
        dataclasses.replace(batch, sequence_of={}).validate()


def _data(**sequences) -> dict:
    return {
        "data": {
            "dense_columns": ["I1"],
            "sparse_columns": ["C1", "H_item", "H_cat"],
            "sequences": sequences,
        }
    }


HIST = {"columns": ["H_item"], "max_length": 5}
CONFIG_ERRORS = {
    "column in two sequences": (
        _data(a=HIST, b={**HIST, "columns": ["H_cat", "H_item"]}),
        r"data\.sequences\.b: column 'H_item' is also a column of sequence 'a'",
    ),
    "value column in two sequences": (
        _data(
            a={**HIST, "value_columns": ["t"]},
            b={"columns": ["H_cat"], "max_length": 2, "value_columns": ["t"]},
        ),
        r"data\.sequences\.b: column 't' is also a column of sequence 'a'",
    ),
    "not a sparse column": (
        _data(a={**HIST, "columns": ["H_x"]}),
        r"data\.sequences\.a\.columns: 'H_x' is not one of data\.sparse_columns",
    ),
    "in a dedup group": (
        {"data": {**_data(a=HIST)["data"], "dedup_groups": [["C1", "H_item"]]}},
        r"data\.sequences\.a\.columns: 'H_item' is in data\.dedup_groups\[0\]; a sequence's "
        r"columns cannot be deduplicated in this version",
    ),
    "value column is a dense column": (
        _data(a={**HIST, "value_columns": ["I1"]}),
        r"data\.sequences\.a\.value_columns: 'I1' is already the label, a dense, sparse",
    ),
    "value column is a sparse column": (
        _data(a={**HIST, "value_columns": ["H_cat"]}),
        r"data\.sequences\.a\.value_columns: 'H_cat' is already",
    ),
    "sparse max_length on a sequence column": (
        {"data": {**_data(a=HIST)["data"], "sparse_specs": {"H_item": {"max_length": 9}}}},
        r"data\.sparse_specs\.H_item\.max_length: 'H_item' is a column of sequence 'a'.*use "
        r"data\.sequences\.a\.max_length",
    ),
    "weight column on a sequence column": (
        {"data": {**_data(a=HIST)["data"], "sparse_specs": {"H_item": {"weight_column": "w"}}}},
        r"data\.sparse_specs\.H_item\.weight_column: .*use data\.sequences\.a\.value_columns",
    ),
    "column named twice": (
        _data(a={**HIST, "columns": ["H_item", "H_item"]}),
        r"data\.sequences\.a: columns \['H_item'\] are named more than once",
    ),
    "no max_length": (_data(a={"columns": ["H_item"]}), r"data\.sequences\.a\.max_length"),
    "max_length 0": (_data(a={**HIST, "max_length": 0}), r"max_length must be positive, got 0"),
    "min_length above max_length": (
        _data(a={**HIST, "min_length": 6}),
        r"data\.sequences\.a: min_length 6 is above max_length 5",
    ),
    "name with a dot": (_data(**{"a.b": HIST}), r"data\.sequences\.a\.b: a sequence's name is"),
}


@pytest.mark.parametrize("case", sorted(CONFIG_ERRORS))
def test_sequence_config_errors_name_the_key(case: str) -> None:
    tree, message = CONFIG_ERRORS[case]
    with pytest.raises(ConfigError, match=message):
        load_config(tree)


def test_sequence_keys_are_set_from_the_command_line() -> None:
    spec = 'data.sequences.hist={ columns = ["C1"], value_columns = ["t"], max_length = 5 }'
    job = load_config(overrides=[spec, "data.sequences.hist.max_length=50"])
    assert job.data.sequences["hist"].max_length == 50
    assert job.data.input_columns()[-1] == "t"
    result = CliRunner().invoke(app, ["train", "--set", spec, "--set=data.dense_columns=['t']"])
    assert result.exit_code == 2
    (line,) = [ln for ln in result.stderr.splitlines() if ln.startswith("error:")]
    assert "data.sequences.hist.value_columns: 't' is already" in line


def test_sequence_columns_of_the_wrong_type_are_refused_with_the_schema(tmp_path: Path) -> None:
    root = tmp_path / "data"
    root.mkdir()
    config = _config(tmp_path)
    flat = _raw(H_cat=pa.array([f"c{i}" for i in range(N)]))
    pq.write_table(flat, root / "part-0.parquet")
    with pytest.raises(DataValidationError, match=r"'H_cat' of sequence 'hist' .* list of ids"):
        validate_data(str(root), config)
    words = _raw(H_rating=pa.array(_parallel(["x"] * 12), pa.list_(pa.string())))
    pq.write_table(words, root / "part-0.parquet")
    with pytest.raises(DataValidationError, match=r"sequence value column 'H_rating' .*numbers"):
        validate_data(str(root), config)


def test_inspect_reports_the_events_per_row(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    pq.write_table(_raw(), tmp_path / "data" / "part-0.parquet")
    report = inspect_data(str(tmp_path / "data"), _config(tmp_path))["sequences"]["hist"]
    assert report["longest"] == 5 and report["mean_length"] == pytest.approx(12 / 6)
    assert report["empty_share"] == pytest.approx(1 / 6)
    assert report["truncated_share"] == pytest.approx(1 / 6)
    assert json.dumps(report)  # JSON-ready, as `raydlrm data inspect --json` prints it


def test_a_resume_with_another_sequence_spec_is_refused() -> None:
    """What a checkpoint's rows were cut to (and which columns make a history) cannot change
    on resume; a checkpoint of a release before sequences resumes a job without them."""
    from raydlrm.platform.recorded import resume_differences
    from raydlrm.sharding import plan_sharding

    sequence = 'data.sequences.hist={ columns = ["C1"], max_length = 5 }'
    job = load_config(overrides=[sequence])
    spec = job.worker_spec()
    plan = plan_sharding(spec.tables(), world_size=1, config=spec.sharding)
    state = {"spec": spec.to_dict(), "plan": json.loads(plan.to_json())}
    assert resume_differences(state, job=job, plan=plan) == []
    longer = load_config(overrides=[sequence, "data.sequences.hist.max_length=9"])
    (line,) = resume_differences(state, job=longer, plan=plan)
    assert line.startswith("data.sequences: {'hist': {'columns': ['C1'], 'max_length': 5,")
    assert line.endswith("'max_length': 9, 'value_columns': [], 'min_length': 0}} in the config")
    data = {k: v for k, v in state["spec"]["data"].items() if k != "sequences"}
    earlier = {**state, "spec": {**state["spec"], "data": data}}
    assert resume_differences(earlier, job=load_config(), plan=plan) == []
    assert resume_differences(earlier, job=job, plan=plan) != []


def test_a_job_records_the_rows_cut_in_its_run_directory_and_logs_them(tmp_path: Path) -> None:
    """Under ``fail`` too, a job with sequences gets a quarantine path (its run directory's)
    for the counts, which the driver turns into per-sequence metrics."""
    from raydlrm.platform.launch import _truncated_rows
    from raydlrm.platform.preflight import resolve_job

    data = {**dataclasses.asdict(_config(tmp_path)), "quarantine_path": None}
    job = load_config({"data": data, "run": {"storage_path": str(tmp_path / "runs")}})
    job = resolve_job(job, run_name="r")
    assert job.data.quarantine_path == str(tmp_path / "runs" / "r" / "quarantine")
    (tmp_path / "data").mkdir()
    pq.write_table(_raw(), tmp_path / "data" / "part-0.parquet", row_group_size=3)
    _read(tmp_path, job.data, tag=f"{run_tag('r', 'train')}-e0", window=0)
    assert _truncated_rows(job, run_name="r") == {
        "data/sequences/hist/rows_truncated": 1,
        "data/sequences/hist/eval_rows_truncated": 0,
    }


def test_the_planner_sees_histories_as_cut(tmp_path: Path) -> None:
    """The tables of a sequence's columns are costed with the ids left after the cut: the
    mean per row and, for the row caches, at most ``max_length`` a row."""
    from raydlrm.platform.job_data import data_shape, validate_job_data

    (tmp_path / "data").mkdir()
    pq.write_table(_raw(), tmp_path / "data" / "part-0.parquet")
    data = {**dataclasses.asdict(_config(tmp_path)), "train_path": str(tmp_path / "data")}
    job = load_config({"data": {**data, "eval_path": None}})
    shape = data_shape(job, validate_job_data(job))
    assert shape.pooling_factors["t_H_item"] == pytest.approx(10 / 6)
    assert shape.max_bag_sizes["t_H_item"] == shape.max_bag_sizes["t_H_cat"] == 3


def test_a_sequence_is_read_per_sample_in_session_data(tmp_path: Path) -> None:
    """Histories constant within sessions are not taken for a dedup group or for per-session
    columns; a clustered data set that stores one per session is refused, naming it."""
    from raydlrm.ingestion import cluster_data, infer_dedup_groups

    table = _raw().take([0, 0, 2, 2, 3, 3] * 50).drop_columns(["sample_id"])
    table = table.append_column("session_id", pa.array(np.arange(300) // 2))
    (tmp_path / "data").mkdir()
    pq.write_table(table, tmp_path / "data" / "part-0.parquet")
    source, config = str(tmp_path / "data"), _config(tmp_path, value_columns=[])
    assert infer_dedup_groups(validate_data(source, config), config) == [["C1"]]
    with pytest.raises(ValueError, match=r"session columns \['H_item'\] are sequence columns"):
        cluster_data(source, config, out=str(tmp_path / "c1"), session_columns=["H_item"])
    plain = dataclasses.replace(config, sequences={})
    cluster_data(source, plain, out=str(tmp_path / "c2"), session_columns=["H_item"])
    with pytest.raises(DataValidationError, match=r"stores columns \['H_item'\] of sequence"):
        validate_data(str(tmp_path / "c2"), config)
