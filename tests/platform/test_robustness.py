"""Failures a user meets, each named in one line: a run already running, an unreachable MLflow
server, a resume with another model or feature list, a worker's bad-input error behind Ray
Train's cut-short message, a full disk while checkpointing."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from typer.testing import CliRunner

from raydlrm.platform.cli import app
from raydlrm.platform.config import load_config
from raydlrm.platform.run_lock import LOCK_FILE, STALE_AFTER_S, RunLock, RunLockedError
from raydlrm.sharding import plan_sharding
from raydlrm.trainers.checkpoints import save_training_state
from raydlrm.trainers.loop import Trainer

runner = CliRunner()


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from raydlrm.ingestion import SyntheticConfig, generate_synthetic

    root = tmp_path_factory.mktemp("data")
    generate_synthetic(
        SyntheticConfig(
            num_train_rows=600, num_eval_rows=200, rows_per_file=300, max_cardinality=500
        ),
        out_dir=root,
    )
    return root


def _train_args(tiny_data: Path, tmp_path: Path, *extra: str) -> list[str]:
    sets = [
        f"data.train_path={tiny_data / 'train'}",
        f"data.eval_path={tiny_data / 'eval'}",
        f"run.storage_path={tmp_path / 'runs'}",
        "run.name=the-run",
        f"tracking.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
        *extra,
    ]
    return ["train", *(a for s in sets for a in ("--set", s))]


def _error_line(result) -> str:
    lines = [ln for ln in result.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.fixture
def no_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(job) -> None:
        raise AssertionError("Ray started before the job was refused")

    monkeypatch.setattr("raydlrm.platform.launch.init_ray", refuse)


def test_a_second_job_on_a_running_run_is_refused_naming_its_holder(
    tiny_data: Path, tmp_path: Path, no_ray: None
) -> None:
    """Two jobs with one run name and storage would train side by side into one run: the
    second stops at once (exit 2), naming the run and who holds it."""
    lock = RunLock(_local(), str(tmp_path / "runs" / "the-run"), run_name="the-run")
    with lock:
        started = time.monotonic()
        result = runner.invoke(app, _train_args(tiny_data, tmp_path))
        assert result.exit_code == 2, result.output
        line = _error_line(result)
        assert "run the-run is already running" in line
        assert f"pid {os.getpid()} on {socket.gethostname()}" in line
        assert time.monotonic() - started < 30
    assert not (tmp_path / "runs" / "the-run" / LOCK_FILE).exists()  # released
    assert not (tmp_path / "mlflow.db").exists()  # no MLflow run was opened


def _local():
    import pyarrow.fs as pafs

    return pafs.LocalFileSystem()


def test_a_dead_holders_lock_is_taken_over(tmp_path: Path) -> None:
    """A holder killed with SIGKILL leaves its lock: on its host, taken over at once (its pid
    is gone); from another host, taken over once its heartbeat is older than the limit."""
    run = tmp_path / "runs" / "r"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time, pyarrow.fs as fs\n"
            "from raydlrm.platform.run_lock import RunLock\n"
            f"RunLock(fs.LocalFileSystem(), {str(run)!r}, run_name='r').acquire()\n"
            "print('held', flush=True)\ntime.sleep(600)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(RunLockedError, match=rf"pid {holder.pid} on"):
        RunLock(_local(), str(run), run_name="r").acquire()
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    with RunLock(_local(), str(run), run_name="r"):  # its pid is gone: taken over
        pass
    elsewhere = {"token": "t", "host": "another-host", "pid": 1, "started": time.time()}
    (run / LOCK_FILE).write_text(json.dumps({**elsewhere, "heartbeat": time.time()}))
    with pytest.raises(RunLockedError, match="another-host"):
        RunLock(_local(), str(run), run_name="r").acquire()
    stale = time.time() - STALE_AFTER_S - 1
    (run / LOCK_FILE).write_text(json.dumps({**elsewhere, "heartbeat": stale}))
    with RunLock(_local(), str(run), run_name="r"):
        pass


def test_the_lock_works_on_an_object_store(s3_server) -> None:
    storage = s3_server("locks")
    from raydlrm.storage import filesystem_for

    filesystem, path = filesystem_for("s3://locks/runs/r", storage)
    first = RunLock(filesystem, path, run_name="r")
    with first:
        with pytest.raises(RunLockedError, match="run r is already running"):
            RunLock(filesystem, path, run_name="r").acquire()
        assert first.read().token == first.holder.token
    assert first.read() is None


def test_an_unreachable_tracking_server_stops_the_job_in_seconds(
    tiny_data: Path, tmp_path: Path, no_ray: None, monkeypatch
) -> None:
    started = time.monotonic()
    result = runner.invoke(
        app, _train_args(tiny_data, tmp_path, "tracking.tracking_uri=http://127.0.0.1:9/")
    )
    assert result.exit_code == 2, result.output
    line = _error_line(result)
    assert "tracking.tracking_uri" in line and "http://127.0.0.1:9/" in line
    assert time.monotonic() - started < 30
    # From $MLFLOW_TRACKING_URI (the config sets none): the variable is named, not a key the
    # user did not set.
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9/")
    args = _train_args(tiny_data, tmp_path)
    at = args.index(f"tracking.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}")
    result = runner.invoke(app, args[: at - 1] + args[at + 1 :])  # without that --set
    assert result.exit_code == 2, result.output
    line = _error_line(result)
    assert "$MLFLOW_TRACKING_URI" in line and "tracking.tracking_uri" not in line


def test_resuming_with_another_model_or_features_is_refused_before_ray_starts(
    tiny_data: Path, tmp_path: Path, no_ray: None
) -> None:
    """The run's checkpoint was trained with ``embedding_dim`` 8 and 26 sparse columns: a
    resume with 16, or without ``C26``, is refused naming each setting with both values."""
    job = load_config(overrides=_train_args(tiny_data, tmp_path)[2::2] + _small_model(8))
    spec = job.worker_spec()
    plan = plan_sharding(spec.tables(), world_size=1, config=spec.sharding)
    trainer = Trainer(spec, plan=plan, rank=0, device=torch.device("cpu"))
    save_training_state(
        tmp_path / "runs" / "the-run" / "checkpoint_2026-11-24_10-00-00.000000",
        parts=trainer.parts(),
        loop_state=trainer.state_dict(),
        position={"epoch": 0, "consumed": {}, "totals": {}},
    )
    wider = runner.invoke(app, _train_args(tiny_data, tmp_path, *_small_model(16)))
    assert wider.exit_code == 2, wider.output
    line = _error_line(wider)
    assert "run the-run would resume from" in line
    assert "model.embedding_dim: 8 in the checkpoint, 16 in the config" in line
    assert "t_C1, t_C2, t_C3, t_C4 and 22 more tables: 500 x 8 in the checkpoint, 500 x 16" in line
    columns = [f"C{i}" for i in range(1, 26)]
    fewer = runner.invoke(
        app,
        _train_args(
            tiny_data, tmp_path, *_small_model(8), f"data.sparse_columns={json.dumps(columns)}"
        ),
    )
    assert fewer.exit_code == 2, fewer.output
    assert "t_C26 is in the checkpoint but not in the config" in _error_line(fewer)
    assert not (tmp_path / "mlflow.db").exists()  # no run, no tags from a refused attempt


def _saved_position(tiny_data: Path) -> tuple[list, object]:
    """The training data's list of files, as a checkpoint's position records it, and its
    summary."""
    from raydlrm.ingestion import DataConfig, validate_data
    from raydlrm.ingestion.epoch_files import file_list

    summary = validate_data(str(tiny_data / "train"), DataConfig())
    return file_list(summary.row_groups, root=str(tiny_data / "train")), summary


def test_resuming_with_another_data_order_is_refused_before_ray_starts(
    tiny_data: Path, tmp_path: Path, no_ray: None
) -> None:
    """A checkpoint's data position counts the rows trained per row group of the files its
    epoch began with, a head of each row group's order: a resume with another seed, session
    column, bad-row rule under quarantine, or with a file of that epoch gone or rewritten, is
    refused in one line naming each (the order mode too, and under ``time`` its column)."""
    job = load_config(overrides=_train_args(tiny_data, tmp_path)[2::2] + _small_model(8))
    spec = job.worker_spec()
    plan = plan_sharding(spec.tables(), world_size=1, config=spec.sharding)
    trainer = Trainer(spec, plan=plan, rank=0, device=torch.device("cpu"))
    (first, rows), (second, _) = _saved_position(tiny_data)[0]
    files = [[first, rows], ["gone.parquet", [10]], [second, [200, 100]]]
    save_training_state(
        tmp_path / "runs" / "the-run" / "checkpoint_2026-11-24_10-00-00.000000",
        parts=trainer.parts(),
        loop_state=trainer.state_dict(),
        position={"epoch": 0, "consumed": {"0": 5}, "totals": {"0": 300}, "files": files},
    )
    changes = [
        "training.seed=5",
        "data.order=time",
        "data.session_column=C1",
        "data.bad_input=quarantine",
        "data.sparse_specs={ C2 = { max_length = 3 } }",
    ]
    result = runner.invoke(app, _train_args(tiny_data, tmp_path, *_small_model(8), *changes))
    assert result.exit_code == 2, result.output
    line = _error_line(result)
    assert "run the-run would resume from" in line
    assert "training.seed: 0 in the checkpoint, 5 in the config" in line
    assert "data.order: 'shuffled' in the checkpoint, 'time' in the config" in line
    assert "data.session_column: 'session_id' in the checkpoint, 'C1' in the config" in line
    assert "data.sparse_specs.C2.max_length: None in the checkpoint, 3 in the config" in line
    assert "file gone.parquet is gone" in line
    assert (
        f"file {second} has 1 row group (300 rows) now, 2 row groups (200, 100 rows) in the "
        "checkpoint's epoch" in line
    )
    assert "data.bad_input:" not in line  # fail to quarantine: how a stopped run goes on
    assert not (tmp_path / "mlflow.db").exists()


def test_a_time_ordered_resume_keeps_its_time_column(tiny_data: Path) -> None:
    """Under ``data.order = "time"`` the time column orders the epoch's row groups: another
    one is refused; a checkpoint of an earlier release (no ``data.order``) read shuffled. A
    validation split's settings, which decide the row groups that train, are kept alike."""
    from raydlrm.platform.recorded import data_order_differences

    _, summary = _saved_position(tiny_data)
    data = {"session_column": "session_id", "order": "time", "time_column": "day"}
    state = {"spec": {"training": {"seed": 0}, "data": data}, "position": {}}

    def job(*overrides: str):
        return load_config(overrides=[f"data.train_path={tiny_data / 'train'}", *overrides])

    assert data_order_differences(
        state, job=job("data.order=time", "data.time_column=ts"), train=summary
    ) == [
        "data.time_column: 'day' in the checkpoint, 'ts' in the config (it orders the "
        "epoch's row groups)"
    ]
    assert (
        data_order_differences(
            state, job=job("data.order=time", "data.time_column=day"), train=summary
        )
        == []
    )
    earlier = {"spec": {"training": {"seed": 0}, "data": {"session_column": "session_id"}}}
    assert data_order_differences(earlier, job=job(), train=summary) == []
    # A validation split decides which row groups train: another split or share is refused.
    carved = {**data, "order": "shuffled", "valid_split": "time", "valid_fraction": 0.1}
    assert data_order_differences(
        {**state, "spec": {"training": {"seed": 0}, "data": carved}},
        job=job("data.valid_split=time", "data.valid_fraction=0.2", "data.time_column=day"),
        train=summary,
    ) == [
        "data.valid_fraction: 0.1 in the checkpoint, 0.2 in the config (it decides which row "
        "groups train)"
    ]
    assert data_order_differences(earlier, job=job("data.valid_split=random"), train=summary) == [
        "data.valid_split: 'none' in the checkpoint, 'random' in the config (it decides which "
        "row groups train)"
    ]


def test_a_resume_logs_what_its_epoch_reads_otherwise(
    tiny_data: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Files added since the epoch began are read from the next epoch on (or by no epoch of
    the run), a smaller shuffle window is taken for the rest of the epoch and a larger one
    waits for the next, each said in one line; a checkpoint of an earlier release, without its
    list of files, resumes with a warning that it could not be checked."""
    import logging

    from raydlrm.platform.recorded import check_resume

    files, summary = _saved_position(tiny_data)
    job = load_config(overrides=[f"data.train_path={tiny_data / 'train'}", "data.eval_path=null"])
    spec = job.worker_spec()
    plan = plan_sharding(spec.tables(), world_size=1, config=spec.sharding)

    def resume(position: dict) -> str:
        state = {"spec": spec.to_dict(), "plan": json.loads(plan.to_json()), "position": position}
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="raydlrm.platform.recorded"):
            check_resume(job, plan, "r", ("ckpt", state), train=summary)
        return caplog.text

    began = {"epoch": 0, "consumed": {}, "totals": {}, "window_rows": 1000}
    text = resume({**began, "files": files[:1]})
    assert f"1 file(s) added to data.train_path since epoch 0 began ({files[1][0]})" in text
    assert "not read by this run (training.num_epochs = 1)" in text
    assert "epoch 0 keeps the shuffle window it began with (1000 rows)" in text
    assert "without the list of its files" in resume(began)
    smaller = resume({**began, "window_rows": 10**6, "files": files})
    assert "epoch 0 resumes with data.shuffle_window_rows = 262144, smaller than the 1000000" in (
        smaller
    )
    assert "added" not in smaller


def test_a_resumed_or_warm_started_run_keeps_the_statistics_its_model_was_trained_with() -> None:
    """Dense statistics and bucket boundaries recorded by a checkpoint (a resumed run's, a warm
    start's) win over the training data's, a config's own win over both, and a resume whose
    config sets other boundaries is refused naming them."""
    from raydlrm.platform.job_statistics import with_statistics as _with_statistics
    from raydlrm.platform.recorded import resume_differences

    overrides = ['data.dense_specs={ I1 = { buckets = 4, transform = "standardize" } }']
    job = load_config(overrides=overrides)
    recorded = {"dense_stats": {"I1": [1.0, 2.0]}, "bucket_boundaries": {"I1": [0.5, 1.5]}}
    data = {"dense_stats": {"I1": [9.0, 9.0]}, "bucket_boundaries": {"I1": [7.0]}}
    kept = _with_statistics(_with_statistics(job, recorded), data)
    assert kept.data.dense_stats == {"I1": (1.0, 2.0)}
    assert kept.data.bucket_boundaries == {"I1": [0.5, 1.5]}
    own = load_config(overrides=[*overrides, "data.bucket_boundaries={ I1 = [3.0] }"])
    assert _with_statistics(own, recorded).data.bucket_boundaries == {"I1": [3.0]}
    spec = kept.worker_spec()
    plan = plan_sharding(spec.tables(), world_size=1, config=spec.sharding)
    state = {"spec": spec.to_dict(), "plan": json.loads(plan.to_json())}
    assert resume_differences(state, job=kept, plan=plan) == []
    (line,) = resume_differences(state, job=_with_statistics(own, recorded), plan=plan)
    assert line == (
        "data.bucket_boundaries: {'I1': [0.5, 1.5]} in the checkpoint, {'I1': [3.0]} in the config"
    )


def test_fill_values_and_missing_indicators_travel_with_the_model() -> None:
    """A model's dense fill values are stored in its spec (checkpoint, model directory, logged
    model: a JSON round trip; a spec of an earlier release loads without them), win over the
    training data's when resumed or warm-started (only where the model filled the column with
    the same statistic), and a resume with other fill values or missing indicators, or a warm
    start with other indicators, is refused naming them."""
    import dataclasses

    from raydlrm.platform.job_statistics import with_statistics as _with_statistics
    from raydlrm.platform.recorded import model_differences, resume_differences
    from raydlrm.trainers.spec import WorkerSpec

    overrides = [
        "data.dense_fill=median",
        "data.dense_specs.I2.fill=mean",
        "data.dense_missing_indicator=true",
        "data.dense_specs.I3.missing_indicator=false",
    ]
    job = load_config(overrides=overrides)
    assert job.data.dense_fill_of("I2") == "mean" and job.data.num_dense_inputs() == 13 + 12
    recorded = {**dataclasses.asdict(job.data), "dense_fill_values": {"I1": 4.0, "I2": 7.0}}
    data = {"dense_fill_values": {"I1": 9.0, "I3": 3.0}}
    kept = _with_statistics(_with_statistics(job, recorded), data)
    assert kept.data.dense_fill_values == {"I1": 4.0, "I2": 7.0, "I3": 3.0}
    as_mean = {**recorded, "dense_fill": "mean"}  # I1 was filled with its mean: not a median
    assert _with_statistics(job, as_mean).data.dense_fill_values == {"I2": 7.0}
    spec = kept.worker_spec()
    stored = json.loads(json.dumps(spec.to_dict()))
    assert WorkerSpec(**stored).data == kept.data
    earlier = {k: v for k, v in stored["data"].items() if not k.startswith("dense_fill")}
    earlier.pop("dense_missing_indicator")
    assert WorkerSpec(**{**stored, "data": earlier}).data.num_dense_inputs() == 13
    plan = plan_sharding(spec.tables(), world_size=1, config=spec.sharding)
    state = {"spec": stored, "plan": json.loads(plan.to_json())}
    assert resume_differences(state, job=kept, plan=plan) == []
    other = _with_statistics(job, {**recorded, "dense_fill_values": {"I1": 5.0, "I2": 7.0}})
    other = _with_statistics(other, data)
    (line,) = resume_differences(state, job=other, plan=plan)
    assert line == (
        f"data.dense_fill_values: {kept.data.dense_fill_values!r} in the checkpoint, "
        f"{other.data.dense_fill_values!r} in the config"
    )
    assert other.data.dense_fill_values["I1"] == 5.0
    plain = load_config(overrides=[*overrides[:2], "data.dense_fill_values={ I1 = 4.0 }"])
    indicators = [c for c in kept.data.dense_columns if c != "I3"]
    expected = (
        f"data.dense_missing_indicator (columns): {indicators!r} in the checkpoint, [] in the "
        "config"
    )
    assert expected in resume_differences(state, job=plain, plan=plan)
    assert model_differences(state, job=plain) == [expected]


def _small_model(dim: int) -> list[str]:
    return [f"model.embedding_dim={dim}", f"model.bottom_mlp=[16, {dim}]", "data.table_size=500"]


def test_a_full_disk_while_checkpointing_names_the_checkpoint_and_storage(
    tiny_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The checkpoint is staged in the worker's temporary directory: on a full disk (a tmpfs
    of 64 KiB) the error names the step, that directory and the run storage, not only
    ``[Errno 28] No space left on device``."""
    import tempfile

    from raydlrm.ingestion import Preprocessor

    full = tmp_path / "full"
    full.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(full)])
    if mounted.returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (not root)")
    try:
        monkeypatch.setattr(tempfile, "tempdir", str(full))
        job = load_config(overrides=_train_args(tiny_data, tmp_path)[2::2] + _small_model(8))
        spec = job.worker_spec()
        spec.checkpoint.every_steps = 1
        plan = plan_sharding(spec.tables(), world_size=1, config=spec.sharding)
        trainer = Trainer(
            spec,
            plan=plan,
            rank=0,
            device=torch.device("cpu"),
            report=lambda metrics, checkpoint_dir: None,
            storage="s3://bucket/runs/the-run",
        )
        table = Preprocessor(spec.data)(pq.read_table(tiny_data / "train"))

        class Rows:
            def iter_batches(self, **_):
                yield table.slice(0, spec.data.batch_size)

        with pytest.raises(OSError, match="No space left") as error:
            trainer.fit(train_data=Rows(), eval_data=None)
        message = str(error.value)
        assert "checkpoint of step 1" in message and str(full) in message
        assert "s3://bucket/runs/the-run (run.storage_path)" in message
    finally:
        subprocess.run(["umount", str(full)], check=True)


def test_a_workers_error_is_read_whole_behind_ray_trains_cut_message() -> None:
    """Ray Train quotes each worker's error cut to its first and last 500 characters: the
    bad-input error in the middle of a long traceback is lost from the message, and read from
    the error's ``worker_failures`` instead."""
    from ray.train import WorkerGroupError

    from raydlrm._errors import cause_line

    cause = (
        "raydlrm.ingestion.badinput.BadInputError: /data/" + "deep/" * 100 + "part-0.parquet, "
        "row group 0, row 7: label column 'label': label outside [0, 1]"
    )
    full = "Traceback (most recent call last):\n" + "  frame\n" * 200 + cause + "\n\n"
    full += "The above exception was the direct cause of the following exception:\n"
    full += "  frame\n" * 200 + "ray.exceptions.UserCodeException: UDF failed\n"
    cut = full[:500] + "...\n... (Output truncated) ...\n" + full[-500:]
    error = WorkerGroupError(cut, {0: RuntimeError(full), 1: RuntimeError(full)})
    assert "BadInputError" not in str(error)
    assert cause_line(error).startswith("BadInputError: /data/deep/deep/")
    # A worker's exception arrives as the object (its text without its name), chained.
    full_disk = OSError(28, "no space left on device for the checkpoint of step 98")
    full_disk.__cause__ = OSError(28, "Error writing bytes to file")
    error = WorkerGroupError("Training failed due to worker errors:\n...", {0: full_disk})
    assert cause_line(error) == (
        "OSError: [Errno 28] no space left on device for the checkpoint of step 98"
    )


@pytest.mark.ray
@pytest.mark.slow
def test_a_bad_row_under_fail_is_the_last_line_however_deep_its_path(
    tiny_data: Path, tmp_path: Path, ray_cluster
) -> None:
    """A label of 2 in data under a deep path: Ray Train's message cuts the worker's traceback
    to its ends, where the bad-input error is not; the CLI's last line still names the file,
    row group, row and column."""
    import shutil

    deep = tmp_path.joinpath(*["a-rather-long-directory-name-for-the-data"] * 8, "train")
    shutil.copytree(tiny_data / "train", deep)
    bad = sorted(deep.glob("*.parquet"))[0]
    table = pq.read_table(bad)
    labels = table.column("label").to_pylist()
    labels[3] = 2
    index = table.schema.get_field_index("label")
    pq.write_table(
        table.set_column(index, "label", pa.array(labels, table.schema.field(index).type)), bad
    )
    args = _train_args(tiny_data, tmp_path, f"data.train_path={deep}", *_small_model(8))
    result = runner.invoke(app, args)
    assert result.exit_code == 1, result.output
    line = _error_line(result)
    assert line.startswith("error: training failed: BadInputError: "), line
    assert f"{bad.name}, row group 0, row 3: label column 'label'" in line, line
