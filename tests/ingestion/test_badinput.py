"""Bad input under both policies: every case is named under ``fail`` and set aside and counted
under ``quarantine``; a quarantining training job accounts for every row."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from mlflow.tracking import MlflowClient

import raydlrm
from raydlrm.ingestion import DataConfig, DataValidationError, Preprocessor, validate_data
from raydlrm.ingestion.badinput import (
    FILE_COLUMN,
    ROW_COLUMN,
    ROW_GROUP_COLUMN,
    BadInputError,
    quarantine_counts,
    run_tag,
)
from raydlrm.ingestion.row_group_reader import RowGroupReader, read_columns

N = 6


def _config(tmp_path: Path, policy: str) -> DataConfig:
    return DataConfig(
        dense_columns=["I1"],
        sparse_columns=["C1", "C2", "C3"],
        table_size=100,
        sparse_specs={
            "C2": {"hash": False},
            "C3": {"max_length": 3, "weight_column": "W3"},
        },
        bad_input=policy,
        quarantine_path=str(tmp_path / "quarantine"),
    )


def _table(**changes) -> pa.Table:
    """A valid raw table of N rows, tagged as the reader tags them; ``changes`` replace
    columns."""
    columns = {
        "label": pa.array([0, 1, 0, 1, 1, 0]),
        "I1": pa.array([1.0, None, 3.0, 4.0, 5.0, 6.0]),
        "C1": pa.array([f"u{i}" for i in range(N)]),
        "C2": pa.array([0, 5, 99, 7, 8, 9]),
        "C3": pa.array([[1], [2, 3], [4, 5, 6], [7], [8], [9]], pa.list_(pa.int64())),
        "W3": pa.array([[1.0], [1.0, 2.0], [1.0, 1.0, 1.0], [2.0], [3.0], [4.0]]),
    }
    columns.update(changes)
    table = pa.table(columns)
    table = table.append_column(FILE_COLUMN, pa.array(["data/part-7.parquet"] * N))
    table = table.append_column(ROW_GROUP_COLUMN, pa.array([3] * N))
    return table.append_column(ROW_COLUMN, pa.array(np.arange(N)))


ROW_CASES = {
    "null label": ({"label": pa.array([0, 1, None, 1, 1, 0])}, "label column 'label': null"),
    "label outside [0, 1]": ({"label": pa.array([0, 1, 2, 1, 1, 0])}, "outside"),
    "NaN dense": ({"I1": pa.array([1.0, 2.0, float("nan"), 4.0, 5.0, 6.0])}, "'I1': NaN"),
    "inf dense": ({"I1": pa.array([1.0, 2.0, float("inf"), 4.0, 5.0, 6.0])}, "'I1': NaN or inf"),
    # Finite as float64, infinite once cast to the model's float32.
    "dense beyond float32": (
        {"I1": pa.array([1.0, 2.0, 1e308, 4.0, 5.0, 6.0])},
        "'I1': value outside float32's range",
    ),
    "weight beyond float32": (
        {"W3": pa.array([[1.0], [1.0, 2.0], [1.0, -1e39, 1.0], [2.0], [3.0], [4.0]])},
        "weight column 'W3'",
    ),
    "null id": ({"C1": pa.array(["a", "b", None, "d", "e", "f"])}, "'C1': null id"),
    "null id in a list": (
        {"C3": pa.array([[1], [2, 3], [4, None], [7], [8], [9]], pa.list_(pa.int64()))},
        "'C3': null id",
    ),
    "negative id": ({"C2": pa.array([0, 5, -1, 7, 8, 9])}, "'C2': negative id"),
    "id out of range": ({"C2": pa.array([0, 5, 100, 7, 8, 9])}, "'C2': id not below"),
    # A row number of 2**63 or more is too large, not negative (no cast error either).
    "uint64 row number above 2**63": (
        {"C2": pa.array([0, 5, 2**63 + 5, 7, 8, 9], pa.uint64())},
        "'C2': id not below the table size 100",
    ),
    "empty list": (
        {
            "C3": pa.array([[1], [2, 3], [], [7], [8], [9]], pa.list_(pa.int64())),
            "W3": pa.array([[1.0], [1.0, 2.0], [], [2.0], [3.0], [4.0]]),
        },
        "'C3': id list shorter than 1",
    ),
    "oversized list": (
        {
            "C3": pa.array([[1], [2, 3], [4, 5, 6, 7], [7], [8], [9]], pa.list_(pa.int64())),
            "W3": pa.array([[1.0], [1.0, 2.0], [1.0] * 4, [2.0], [3.0], [4.0]]),
        },
        "'C3': id list longer than 3",
    ),
    "null weight": (
        {"W3": pa.array([[1.0], [1.0, 2.0], [1.0, None, 1.0], [2.0], [3.0], [4.0]])},
        "weight column 'W3'",
    ),
}


@pytest.mark.parametrize("case", sorted(ROW_CASES))
def test_bad_row_fails_naming_file_row_group_row_and_column(tmp_path: Path, case: str) -> None:
    changes, reason = ROW_CASES[case]
    with pytest.raises(BadInputError, match=r"part-7\.parquet, row group 3, row 2: .*") as info:
        Preprocessor(_config(tmp_path, "fail"))(_table(**changes))
    assert reason in str(info.value)
    assert "1 bad rows" in str(info.value)


@pytest.mark.parametrize("case", sorted(ROW_CASES))
def test_bad_row_is_quarantined_with_its_reason_and_counted(tmp_path: Path, case: str) -> None:
    changes, reason = ROW_CASES[case]
    config = _config(tmp_path, "quarantine")
    out = Preprocessor(config)(_table(**changes))
    assert out.num_rows == N - 1  # the other rows go on
    (written,) = (tmp_path / "quarantine").glob("*.parquet")
    assert written.name.startswith("part-7-") and ".rg3." in written.name
    bad = pq.read_table(written)
    assert bad.num_rows == 1
    assert bad.column(ROW_COLUMN).to_pylist() == [2]
    assert reason in bad.column("_reason")[0].as_py()
    counts = quarantine_counts(config)
    assert counts["bad_rows"] == counts["rows"] == 1


def test_valid_rows_pass_and_empty_lists_can_be_allowed(tmp_path: Path) -> None:
    assert Preprocessor(_config(tmp_path, "fail"))(_table()).num_rows == N
    config = DataConfig(
        dense_columns=["I1"],
        sparse_columns=["C1", "C2", "C3"],
        table_size=100,
        sparse_specs={"C3": {"min_length": 0}},
    )
    changes, _ = ROW_CASES["empty list"]
    assert Preprocessor(config)(_table(**changes)).num_rows == N


def _write_files(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    good = _table().drop_columns([FILE_COLUMN, ROW_GROUP_COLUMN, ROW_COLUMN])
    pq.write_table(good, root / "a.parquet")
    pq.write_table(good, root / "b.parquet")
    return root


def test_truncated_file_fails_or_is_quarantined_whole(tmp_path: Path) -> None:
    root = _write_files(tmp_path / "data")
    blob = (root / "b.parquet").read_bytes()
    (root / "b.parquet").write_bytes(blob[: len(blob) // 2])
    with pytest.raises(DataValidationError, match=r"b\.parquet is not readable Parquet"):
        validate_data(str(root), _config(tmp_path, "fail"))
    config = _config(tmp_path, "quarantine")
    summary = validate_data(str(root), config)
    assert summary.num_rows == N and summary.num_files == 1
    assert [Path(f).name for f in summary.quarantined_files] == ["b.parquet"]
    counts = quarantine_counts(config)
    assert counts["files"] == 1 and counts["file_rows"] == 0  # footer lost: rows unknown


def test_wrong_column_type_fails_or_quarantines_the_file_with_its_rows(tmp_path: Path) -> None:
    root = _write_files(tmp_path / "data")
    broken = _table(I1=pa.array(["x"] * N)).drop_columns(
        [FILE_COLUMN, ROW_GROUP_COLUMN, ROW_COLUMN]
    )
    pq.write_table(broken, root / "b.parquet")
    with pytest.raises(DataValidationError, match=r"dense column 'I1' in .*b\.parquet"):
        validate_data(str(root), _config(tmp_path, "fail"))
    config = _config(tmp_path, "quarantine")
    summary = validate_data(str(root), config)
    assert summary.num_rows == N
    counts = quarantine_counts(config)
    assert counts["files"] == 1 and counts["file_rows"] == N


def _file_with_unreadable_row_group(root: Path, bad_dense: bool = False) -> None:
    """``root/a.parquet``: 3 row groups of 100 rows, row group 1 corrupt (its footer intact);
    with ``bad_dense``, row 0 of every row group has a NaN dense value."""
    root.mkdir()
    good = _table().drop_columns([FILE_COLUMN, ROW_GROUP_COLUMN, ROW_COLUMN])
    if bad_dense:
        good = good.set_column(1, "I1", pa.array([np.nan, 2.0, 3.0, 4.0, 5.0, 6.0]))
    path = root / "a.parquet"
    table = pa.concat_tables([good] * 50).slice(0, 300)
    if bad_dense:
        dense = np.tile([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], 50)
        dense[[0, 100, 200]] = np.nan
        table = table.set_column(1, "I1", pa.array(dense))
    pq.write_table(table, path, row_group_size=100, compression="none")
    meta = pq.ParquetFile(path).metadata.row_group(1)
    start = meta.column(0).data_page_offset
    blob = bytearray(path.read_bytes())
    blob[start : start + 64] = b"\xff" * 64
    path.write_bytes(bytes(blob))


def _reader(
    config: DataConfig, root: Path, summary, tag: str | None = None, *, window: int = 0
) -> RowGroupReader:
    """A reader of ``summary``'s row groups in file order, or shuffled in a ``window``."""
    return RowGroupReader(
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


def _refs(summary, skip: int = 0, *, window: int = 0) -> pa.Table:
    """Every row group, each a window of its own, or all in one ``window``."""
    refs = [{"group": g.to_dict(), "id": i, "skip": skip} for i, g in enumerate(summary.row_groups)]
    windows = [refs] if window else [[ref] for ref in refs]
    return pa.Table.from_pylist([{"window": w} for w in windows])


def test_unreadable_row_group_fails_or_is_quarantined(tmp_path: Path) -> None:
    root = tmp_path / "data"
    _file_with_unreadable_row_group(root)
    for policy in ("fail", "quarantine"):
        config = _config(tmp_path, policy)
        summary = validate_data(str(root), config)
        reader = _reader(config, root, summary)
        if policy == "fail":
            with pytest.raises(BadInputError, match=r"row group 1 of .*a\.parquet"):
                reader(_refs(summary))
            continue
        out = reader(_refs(summary))
        assert out.num_rows == 300 - 100
        counts = quarantine_counts(config)
        assert counts["row_groups"] == 1 and counts["row_group_rows"] == 100


@pytest.mark.parametrize("window", [0, 10**6])
def test_row_groups_read_again_after_a_restart_are_quarantined_once(
    tmp_path: Path, window: int
) -> None:
    """A resumed epoch reads its unfinished row groups again: their quarantine records are
    overwritten, not added, so the run's counts stay exact; each epoch and each run keeps its
    own records. The same in a shuffle window."""
    root = tmp_path / "data"
    _file_with_unreadable_row_group(root, bad_dense=True)
    config = _config(tmp_path, "quarantine")
    summary = validate_data(str(root), config)
    tag = run_tag("job/a b", "train")
    assert tag == "job_a_b.train"

    def read(tag: str, skip: int = 0) -> pa.Table:
        return _reader(config, root, summary, tag, window=window)(
            _refs(summary, skip, window=window)
        )

    read(f"{tag}-e0")
    # The restarted run re-reads epoch 0's row groups (part of them already trained).
    out = read(f"{tag}-e0", skip=10)
    assert out.num_rows == 2 * (99 - 10)
    epoch0 = quarantine_counts(config, tag=tag)
    assert epoch0["bad_rows"] == 2 and epoch0["row_groups"] == 1
    assert epoch0["row_group_rows"] == 100
    read(f"{tag}-e1")
    read(f"{run_tag('other', 'train')}-e0")
    both = quarantine_counts(config, tag=tag)
    assert both["bad_rows"] == 4 and both["row_groups"] == 2
    assert quarantine_counts(config)["bad_rows"] == 6
    # A record names its source (file, row group) and its pass.
    names = sorted(p.name for p in (tmp_path / "quarantine").glob("*.parquet"))
    assert len(names) == 6 and names[0].startswith("a-") and ".rg0.job_a_b.train-e0." in names[0]


@pytest.mark.ray
@pytest.mark.slow
def test_quarantining_job_accounts_for_every_row(tmp_path: Path, ray_cluster) -> None:
    root = tmp_path / "data" / "train"
    raydlrm.ingestion.generate_synthetic(
        raydlrm.ingestion.SyntheticConfig(
            num_train_rows=1200, num_eval_rows=400, rows_per_file=400, max_cardinality=300, seed=2
        ),
        out_dir=tmp_path / "data",
    )
    # Two bad held-out rows: set aside by the evaluation of each epoch, counted once.
    held_out = tmp_path / "data" / "eval" / "part-00000.parquet"
    table = pq.read_table(held_out)
    dense = table.column("I2").fill_null(0.0).to_numpy().copy()
    dense[[3, 30]] = np.nan
    pq.write_table(
        table.set_column(table.schema.get_field_index("I2"), "I2", pa.array(dense)), held_out
    )
    # Three bad rows in one file, and one truncated file.
    path = root / "part-00001.parquet"
    table = pq.read_table(path)
    # (to_numpy would turn the column's nulls, which are legitimate missing values, into NaN)
    dense = table.column("I2").fill_null(0.0).to_numpy().copy()
    dense[[5, 17, 300]] = np.nan
    pq.write_table(
        table.set_column(table.schema.get_field_index("I2"), "I2", pa.array(dense)), path
    )
    blob = (root / "part-00002.parquet").read_bytes()
    (root / "part-00002.parquet").write_bytes(blob[:100])
    # uint64 ids of 2**63 and more (hashed by their 64 bits: valid rows, nothing set aside).
    path = root / "part-00000.parquet"
    table = pq.read_table(path)
    high = pa.array(table.column("C1").to_numpy().astype(np.uint64) + np.uint64(2**63))
    pq.write_table(table.set_column(table.schema.get_field_index("C1"), "C1", high), path)
    config = {
        "data": {
            "train_path": str(root),
            "eval_path": str(held_out.parent),
            "batch_size": 100,
            "table_size": 300,
            "bad_input": "quarantine",
        },
        "model": {"embedding_dim": 8, "bottom_mlp": [16, 8], "top_mlp": [16]},
        "training": {"num_epochs": 2, "log_every_steps": 2, "eval_every_steps": 4},
        "run": {"storage_path": str(tmp_path / "runs"), "name": "bad-run"},
        "tracking": {
            "tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}",
            "experiment_name": "bad",
            "registered_model_name": None,
        },
    }
    result = raydlrm.train(config)
    m = result.metrics
    assert m["data/files_quarantined"] == 1
    assert m["data/rows_read"] == 2 * 800  # two epochs of the two readable files
    assert m["data/rows_quarantined"] == 2 * 3  # the NaN rows, once per epoch
    assert m["data/rows_trained"] == 2 * 797
    assert m["rows_unaccounted"] == 0
    assert m["data/eval_rows_quarantined"] == 2
    assert m["eval/num_samples"] == 398
    quarantine = tmp_path / "runs" / "bad-run" / "quarantine"
    assert len(list(quarantine.glob("*.train-e*.parquet"))) == 2
    # One record: the first whole evaluation read the held-out data (and set its bad rows
    # aside); the later ones read the batches it kept (training.held_out_cache_mib).
    assert len(list(quarantine.glob("*.eval-e*.parquet"))) == 1
    logged = MlflowClient(config["tracking"]["tracking_uri"]).get_run(result.run_id).data.metrics
    assert logged["data/rows_quarantined"] == 6 and logged["data/files_quarantined"] == 1


def test_dictionary_encoded_and_drifting_columns_are_accepted(tmp_path: Path) -> None:
    """Dictionary-encoded ids, dense and label columns (what Spark and pandas categoricals
    write) and int32/int64 drift validate under both policies, quarantine nothing, preprocess
    like the plain columns, and `data inspect` reads them as training does."""
    from raydlrm.ingestion.inspect import inspect_data

    root = _write_files(tmp_path / "data")
    plain = _table().drop_columns([FILE_COLUMN, ROW_GROUP_COLUMN, ROW_COLUMN])
    encoded = plain
    for name in ("label", "C1", "C2"):
        i = encoded.schema.get_field_index(name)
        encoded = encoded.set_column(i, name, encoded.column(name).dictionary_encode())
    lists = encoded.column("C3").combine_chunks()
    i = encoded.schema.get_field_index("C3")
    encoded = encoded.set_column(
        i, "C3", pa.ListArray.from_arrays(lists.offsets, lists.values.dictionary_encode())
    )
    i = encoded.schema.get_field_index("I1")
    encoded = encoded.set_column(i, "I1", encoded.column("I1").dictionary_encode())
    assert pa.types.is_dictionary(encoded.schema.field("C1").type)
    pq.write_table(encoded, root / "b.parquet")
    pq.write_table(
        plain.set_column(3, "C2", plain.column("C2").cast(pa.int32())), root / "c.parquet"
    )
    for policy in ("fail", "quarantine"):
        config = _config(tmp_path, policy)
        assert validate_data(str(root), config).num_rows == 3 * N
        assert quarantine_counts(config)["files"] == 0
    config = _config(tmp_path, "fail")
    expected = Preprocessor(config)(_table())
    read = pq.read_table(root / "b.parquet")
    tagged = _table(**{name: read.column(name) for name in read.column_names})
    assert Preprocessor(config)(tagged).equals(expected)
    report = inspect_data(str(root), _config(tmp_path, "fail"))
    assert report["rows"] == 3 * N and report["sampled_rows"] == 3 * N


def test_every_file_quarantined_names_the_reason(tmp_path: Path) -> None:
    """A typo'd column under quarantine sets every file aside: the error says why."""
    root = _write_files(tmp_path / "data")
    config = dataclasses.replace(_config(tmp_path, "quarantine"), dense_columns=["I1_typo"])
    with pytest.raises(
        DataValidationError,
        match=r"every file was quarantined \(2 files; the "
        r"first: .*has no dense column 'I1_typo'",
    ):
        validate_data(str(root), config)


def test_held_out_rows_read_every_epoch_count_once(tmp_path: Path) -> None:
    """The held-out set is read again every epoch: its bad rows are set aside each time (one
    record per epoch) and counted once per row."""
    config = _config(tmp_path, "quarantine")
    bad = _table(I1=pa.array([1.0, 2.0, float("nan"), 4.0, 5.0, 6.0]))
    for epoch in range(3):
        Preprocessor(config, quarantine_tag=f"{run_tag('r', 'eval')}-e{epoch}")(bad)
    tag = run_tag("r", "eval")
    assert quarantine_counts(config, tag=tag)["bad_rows"] == 3
    assert quarantine_counts(config, tag=tag, once=True)["bad_rows"] == 1
