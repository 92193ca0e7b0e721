"""Storage: Parquet on S3 for real (moto's S3 server on loopback, read through s3fs by pyarrow and
Ray Data), hive partitions with selection, errors naming the path or key, credentials redacted."""

from __future__ import annotations

import logging
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raydlrm.ingestion import DataConfig, DataValidationError, validate_data
from raydlrm.ingestion.reader import WorkerSource
from raydlrm.ingestion.stats import dense_stats_of
from raydlrm.ingestion.synthetic import SyntheticConfig, generate_synthetic
from raydlrm.platform.config import flatten, load_config
from raydlrm.storage import StorageConfig, StorageError, list_files, redact
from tests.conftest import S3_SECRET as SECRET

DAYS = ["2026-11-18", "2026-11-19", "2026-11-20"]


@pytest.fixture(scope="module")
def s3(s3_server, tmp_path_factory: pytest.TempPathFactory):
    """An S3 server on loopback holding the synthetic train split and a partitioned data set;
    returns (storage config, local root)."""
    import s3fs

    storage = s3_server("data")
    fs = s3fs.S3FileSystem(**storage.s3fs_kwargs())
    root = tmp_path_factory.mktemp("s3data")
    generate_synthetic(
        SyntheticConfig(
            num_train_rows=900, num_eval_rows=0, rows_per_file=300, max_cardinality=200, seed=8
        ),
        out_dir=root / "synthetic",
    )
    fs.put(str(root / "synthetic" / "train"), "data/train", recursive=True)
    train = pq.read_table(root / "synthetic" / "train")
    for i, day in enumerate(DAYS):
        part = root / "daily" / f"date={day}"
        part.mkdir(parents=True)
        pq.write_table(train.slice(i * 300, 300), part / "part-0.parquet")
    fs.put(str(root / "daily"), "data/daily", recursive=True)
    return storage, root


def _config(storage: StorageConfig, **kw) -> DataConfig:
    return DataConfig(table_size=500, eval_path=None, storage=storage, **kw)


def test_s3_validation_and_stats_match_local(s3) -> None:
    storage, root = s3
    local = validate_data(str(root / "synthetic" / "train"), _config(storage))
    remote = validate_data("s3://data/train", _config(storage))
    assert remote.num_rows == local.num_rows == 900
    assert [(g.index, g.num_rows) for g in remote.row_groups] == [
        (g.index, g.num_rows) for g in local.row_groups
    ]
    assert remote.row_groups[0].file.startswith("data/train/")
    config = _config(storage, dense_transform="standardize")
    remote_stats = dense_stats_of("s3://data/train", config)
    local_stats = dense_stats_of(str(root / "synthetic" / "train"), config)
    assert remote_stats == local_stats  # the same bytes, the same sums


@pytest.mark.ray
def test_workers_read_s3_through_ray_data(s3, ray_cluster) -> None:
    storage, root = s3
    config = _config(storage)
    summary = validate_data("s3://data/train", config)
    source = WorkerSource(
        summary.row_groups,
        config,
        source_path="s3://data/train",
        rank=0,
        world_size=1,
        seed=0,
        shuffle=False,
        num_actors=1,
        schema=summary.schema,
    )
    tables = list(source.iter_batches(batch_size=256, batch_format="pyarrow"))
    ids = [i for t in tables for i in t.column("sample_id").to_pylist()]
    local = pq.read_table(root / "synthetic" / "train", columns=["sample_id"])
    assert ids == local.column("sample_id").to_pylist()  # same rows, file order
    assert tables[0].column("C1").type == pa.int64()  # preprocessed (hashed) on the way


@pytest.mark.parametrize("where", ["local", "s3"])
@pytest.mark.parametrize(
    ("selection", "days"),
    [
        ({"date": {"values": ["2026-11-19"]}}, ["2026-11-19"]),
        ({"date": {"min": "2026-11-19"}}, ["2026-11-19", "2026-11-20"]),
        ({"date": {"min": "2026-11-18", "max": "2026-11-19"}}, ["2026-11-18", "2026-11-19"]),
    ],
)
def test_partition_selection_reads_exactly_the_selected_partitions(
    s3, where: str, selection: dict, days: list[str]
) -> None:
    storage, root = s3
    path = str(root / "daily") if where == "local" else "s3://data/daily"
    config = _config(storage, partitions=selection)
    summary = validate_data(path, config)
    assert summary.num_rows == 300 * len(days)
    _, files = list_files(path, storage, config.partitions)
    assert sorted(f.split("date=")[1].split("/")[0] for f in files) == days
    selected = pa.concat_tables(
        pq.read_table(root / "daily" / f"date={d}" / "part-0.parquet") for d in days
    )
    fs, _ = list_files(path, storage, {})
    read = pa.concat_tables(pq.read_table(f, filesystem=fs) for f in files)
    assert read.column("sample_id").to_pylist() == selected.column("sample_id").to_pylist()


@pytest.mark.parametrize(
    ("path", "partitions", "message"),
    [
        ("s3://no-such-bucket/train", {}, "'s3://no-such-bucket/train' does not exist"),
        ("s3://data/nothing-here", {}, "'s3://data/nothing-here' does not exist"),
        ("s3://data/daily", {"region": {"values": ["eu"]}}, r"no partition key \['region'\]"),
        (
            "s3://data/daily",
            {"date": {"min": "2027-01-01"}},
            r"selects no files.*'2026-11-18', '2026-11-19', '2026-11-20'",
        ),
        ("gs://data/train", {}, "unsupported storage scheme"),
    ],
)
def test_bad_paths_and_selections_are_named(s3, path, partitions, message) -> None:
    storage, _ = s3
    with pytest.raises(DataValidationError, match=message):
        validate_data(path, _config(storage, partitions=partitions))


def test_a_selector_needs_a_value_or_a_bound() -> None:
    with pytest.raises(ValueError, match="needs values, min or max"):
        DataConfig(partitions={"date": {}})
    with pytest.raises(StorageError, match="single file"):
        list_files(
            __file__,
            StorageConfig(),
            {"date": DataConfig(partitions={"date": {"values": [1]}}).partitions["date"]},
        )


def test_credentials_are_never_logged_or_tracked(s3, caplog) -> None:
    storage, _ = s3
    caplog.set_level(logging.DEBUG)
    validate_data("s3://data/train", _config(storage))
    assert SECRET not in caplog.text
    assert SECRET not in repr(storage)
    job = load_config(
        {"data": {"storage": {"secret_access_key": SECRET, "access_key_id": "AKIA123"}}}
    )
    params = redact(flatten(job.to_dict()))
    assert params["data.storage.secret_access_key"] == "***"
    assert params["data.storage.access_key_id"] == "***"
    assert SECRET not in str(redact(job.to_dict()))
    assert job.data.storage.secret_access_key == SECRET  # the job itself still has them


def test_uri_helpers() -> None:
    from raydlrm.storage import is_remote, join, scheme_of, with_scheme

    assert scheme_of("s3://b/runs") == "s3" and is_remote("s3://b/runs")
    assert scheme_of("file:///tmp/x") is None and not is_remote("/tmp/x")
    assert scheme_of("models:/name/1") is None  # an MLflow URI is not a storage path
    assert join("s3://b/runs/", "r1", "quarantine") == "s3://b/runs/r1/quarantine"
    assert join("file:///tmp/runs", "r1") == "/tmp/runs/r1"
    assert with_scheme("b/runs/checkpoint_1", "s3") == "s3://b/runs/checkpoint_1"
    assert with_scheme("/tmp/runs/checkpoint_1", None) == "/tmp/runs/checkpoint_1"
    assert with_scheme("s3://b/c", "s3") == "s3://b/c"


def test_local_directory_downloads_a_remote_directory(s3, tmp_path) -> None:
    from raydlrm.storage import local_directory

    storage, root = s3
    with local_directory("s3://data/train", storage) as directory:
        names = sorted(p.name for p in directory.glob("*.parquet"))
        assert names == sorted(p.name for p in (root / "synthetic" / "train").glob("*.parquet"))
    assert not directory.exists()  # the copy is removed
    with local_directory(str(tmp_path), storage) as directory:
        assert directory == tmp_path  # local: itself
    with (
        pytest.raises(FileNotFoundError, match="s3://data/nothing does not exist"),
        local_directory("s3://data/nothing", storage),
    ):
        pass
    with (
        pytest.raises(StorageError, match="unsupported storage scheme"),
        local_directory("gs://data/train", storage),
    ):
        pass


def test_resume_check_of_a_run_on_s3(s3) -> None:
    """Before Ray starts, a run whose storage is on S3 is checked for an intact checkpoint: a new
    run has no directory there yet and passes; a run whose only checkpoint is damaged is refused,
    naming it."""
    import s3fs

    from raydlrm.platform.config import ConfigError
    from raydlrm.platform.preflight import check_resumable as _check_resumable

    storage, _ = s3
    from dataclasses import asdict

    job = load_config({"run": {"storage_path": "s3://data/runs", "storage": asdict(storage)}})
    _check_resumable(job, "new-run")  # nothing there: a new run
    fs = s3fs.S3FileSystem(**storage.s3fs_kwargs())
    fs.pipe("data/runs/broken/checkpoint_2026-11-27_10-00-00.000000/model/rank_0.bin", b"x")
    with pytest.raises(ConfigError, match=r"run broken cannot resume: .*checkpoint_2026-11-27_10"):
        _check_resumable(job, "broken")


def test_scratch_of_a_killed_process_is_removed_by_the_next(tmp_path) -> None:
    """A process killed inside a scratch block (a worker lost while it checkpoints, a driver
    stopped while it logs a model) leaves its directory: the next scratch directory made on the
    machine removes those whose process is gone, and nothing else: not a running process's, and
    not one made in another PID namespace or on another host sharing the temporary directory
    (its process id means nothing here: a live job's checkpoint staging was removed)."""
    import os
    import subprocess

    from raydlrm.storage import remove_orphaned_scratch, scratch_directory, scratch_origin

    gone = subprocess.Popen(["true"])
    gone.wait()
    here = scratch_origin()
    elsewhere = f"{(int(here, 16) + 1) % 2**32:08x}"
    dead = tmp_path / f"raydlrm-export-{gone.pid}-{here}-abcd_123"
    live = tmp_path / f"raydlrm-export-{os.getpid()}-{here}-abcd_123"
    foreign = tmp_path / f"raydlrm-ckpt-{gone.pid}-{elsewhere}-abcd_123"
    older = tmp_path / f"raydlrm-ckpt-{gone.pid}-abcd_123"  # an earlier release's: no origin
    other = tmp_path / "raydlrm-kill-resume-2x3lfs81"  # a benchmark's working dir: not scratch
    for path in (dead, live, foreign, older, other):
        (path / "checkpoint").mkdir(parents=True)
    assert remove_orphaned_scratch(tmp_path) == [dead]
    assert not dead.exists() and all(p.exists() for p in (live, foreign, older, other))
    with scratch_directory("export") as tmp:
        assert Path(tmp).name.startswith(f"raydlrm-export-{os.getpid()}-{here}-")
    assert not Path(tmp).exists()
    with pytest.raises(ValueError, match="lower-case letters only"), scratch_directory("a-b"):
        pass
