"""Training progress on the driver: log lines (not a terminal) follow the run's metrics as the
Train controller writes them to MLflow; a terminal gets a bar."""

from __future__ import annotations

import io
import threading
import time
from pathlib import Path

from mlflow import MlflowClient
from mlflow.entities import Metric
from rich.console import Console

from raydlrm.platform.progress import TrainingProgress, progress_mode


def _run(tmp_path: Path) -> tuple[MlflowClient, str]:
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.create_experiment("progress")
    return client, client.create_run(experiment).info.run_id


def test_lines_follow_the_runs_metrics(tmp_path: Path) -> None:
    client, run_id = _run(tmp_path)

    def report() -> None:  # what the controller's MLflow callback writes, step by step
        for step in range(1, 5):
            # One batch a step, as raydlrm's tracking logs a report (two calls would let a
            # poll see a step's samples without its loss: a race of the test, not the product).
            now = int(time.time() * 1000)
            metrics = [
                Metric("samples_seen", 250 * step, now, step),
                Metric("train/loss", 1.0 / step, now, step),
            ]
            client.log_batch(run_id, metrics=metrics)
            time.sleep(0.3)

    progress = TrainingProgress(
        client, run_id, total_samples=1000, mode="lines", poll_s=0.1, line_interval_s=0.2
    )
    with progress:
        writer = threading.Thread(target=report)
        writer.start()
        writer.join()
    assert progress.lines, "no progress line"
    seen = [int(line.split()[1].split("/")[0]) for line in progress.lines]
    assert seen == sorted(seen) and len(set(seen)) == len(seen)  # only when something moved
    assert progress.lines[-1].startswith("training: 1000/1000 samples (100.0%), epoch 0, loss 0.25")


def test_off_polls_nothing_and_auto_is_lines_without_a_terminal(tmp_path: Path) -> None:
    client, run_id = _run(tmp_path)
    client.log_metric(run_id, "samples_seen", 10)
    with TrainingProgress(client, run_id, total_samples=10, mode="off") as progress:
        pass
    assert progress.lines == []
    assert progress_mode("auto") == "lines"  # pytest captures stderr: not a TTY
    assert progress_mode("bar") == "bar"


def test_bar_shows_samples(tmp_path: Path, monkeypatch) -> None:
    client, run_id = _run(tmp_path)
    out = io.StringIO()
    import rich.progress

    original = rich.progress.Progress.__init__

    def to_buffer(self, *args, **kwargs):
        original(self, *args, console=Console(file=out, force_terminal=True, width=120), **kwargs)

    monkeypatch.setattr(rich.progress.Progress, "__init__", to_buffer)
    with TrainingProgress(client, run_id, total_samples=1000, mode="bar", poll_s=0.05):
        client.log_metric(run_id, "samples_seen", 600)  # a report of the job
        time.sleep(0.2)
    assert "600/1000" in out.getvalue() and "training" in out.getvalue()


def test_lines_move_between_reports_with_the_workers_progress_file(tmp_path: Path) -> None:
    """No metrics report lands (they are barriers, minutes apart in a large job): the lines
    follow the progress file rank 0 writes, at the stated cadence, with samples, epoch and a
    labelled rate."""
    import pyarrow.fs as pafs

    from raydlrm.trainers.hooks import PROGRESS_FILE, ProgressBeacon

    client, run_id = _run(tmp_path)
    beacon = ProgressBeacon(str(tmp_path), storage=None, world_size=2, every_s=0.1)
    batch = type("B", (), {"batch_size": 50})()

    def train() -> None:  # rank 0's steps; rank 1 (not shown) trains as many samples
        for step in range(1, 11):
            beacon("step", rank=0, step=step, epoch=step // 6, batch=batch)
            beacon("step", rank=1, step=step, epoch=step // 6, batch=batch)  # writes nothing
            time.sleep(0.15)

    progress = TrainingProgress(
        client,
        run_id,
        total_samples=1000,
        mode="lines",
        progress_file=(pafs.LocalFileSystem(), str(tmp_path / PROGRESS_FILE)),
        poll_s=0.05,
        line_interval_s=0.25,
    )
    with progress:
        worker = threading.Thread(target=train)
        worker.start()
        worker.join()
    assert len(progress.lines) >= 2, progress.lines
    seen = [int(line.split()[1].split("/")[0]) for line in progress.lines]
    assert seen == sorted(seen) and seen[-1] == 1000
    assert "epoch 1" in progress.lines[-1] and "samples/s since the start" in progress.lines[-1]


def test_a_resumed_jobs_rate_counts_only_the_samples_it_trained(tmp_path: Path) -> None:
    """A job that resumes from a checkpoint of 5,000 samples trains 1,000 more in >= 1.5 s: its
    lines show the run's count (6,000) and a rate of this job's samples (at most ~660/s; the
    restored ones would make it thousands). The previous job's progress file is not read."""
    import json

    import pyarrow.fs as pafs

    from raydlrm.trainers.hooks import PROGRESS_FILE, ProgressBeacon

    client, run_id = _run(tmp_path)
    stale = {"step": 60, "epoch": 0, "samples": 5_400, "restored": 0, "time": 0.0}
    (tmp_path / PROGRESS_FILE).write_text(json.dumps(stale))
    beacon = ProgressBeacon(str(tmp_path), storage=None, world_size=2, every_s=0.1)
    batch = type("B", (), {"batch_size": 50})()

    def train() -> None:
        for step in range(51, 61):
            beacon("step", rank=0, step=step, epoch=0, batch=batch, samples_seen=5_000)
            time.sleep(0.15)

    progress = TrainingProgress(
        client,
        run_id,
        total_samples=10_000,
        mode="lines",
        progress_file=(pafs.LocalFileSystem(), str(tmp_path / PROGRESS_FILE)),
        poll_s=0.05,
        line_interval_s=0.25,
    )
    with progress:
        time.sleep(0.3)  # the stale file, were it read, would give a line now
        worker = threading.Thread(target=train)
        worker.start()
        worker.join()
    seen = [int(line.split()[1].split("/")[0]) for line in progress.lines]
    assert seen and all(5_000 < s <= 6_000 for s in seen) and seen[-1] == 6_000, progress.lines
    assert "(5000 restored)" in progress.lines[-1]
    rates = [float(line.split(" samples/s")[0].rsplit(" ", 1)[1]) for line in progress.lines]
    assert 0 < rates[-1] < 1_000, progress.lines


def _file_progress(
    client, run_id: str, directory: Path, *, total_samples: int
) -> tuple[TrainingProgress, Path]:
    """Progress lines of run ``run_id`` fed by a progress file in ``directory`` (the file's
    path), polled every 50 ms, a line at every change."""
    import pyarrow.fs as pafs

    from raydlrm.trainers.hooks import PROGRESS_FILE

    path = directory / PROGRESS_FILE
    progress = TrainingProgress(
        client,
        run_id,
        total_samples=total_samples,
        mode="lines",
        progress_file=(pafs.LocalFileSystem(), str(path)),
        poll_s=0.05,
        line_interval_s=0.0,
    )
    return progress, path


def test_a_resumed_job_shows_no_figure_of_the_previous_submission(tmp_path: Path) -> None:
    """The job continues its run's MLflow run, whose metrics are the previous submission's
    (5,000 samples; its last checkpoint held 4,800): no line before this job trains, then
    this job's count, not the old one (and no rate made of it)."""
    client, run_id = _run(tmp_path)
    earlier = [("samples_seen", 5_000), ("epoch", 1), ("train/loss", 0.25)]
    client.log_batch(run_id, metrics=[Metric(k, v, 0, 40) for k, v in earlier])
    progress, path = _file_progress(client, run_id, tmp_path, total_samples=10_000)
    with progress:
        time.sleep(0.3)  # the workers start: nothing trained yet
        assert progress.lines == []
        path.write_text('{"step": 39, "epoch": 1, "samples": 4900, "restored": 4800}')
        time.sleep(0.3)
    assert progress.lines, "no line once this job trained"
    assert all(line.startswith("training: 4900/10000 samples") for line in progress.lines)
    assert "loss" not in progress.lines[-1]  # the old loss is not this job's either


def test_no_line_before_this_job_trains_a_sample(tmp_path: Path) -> None:
    """Neither a line of 0 samples nor one of only the restored samples."""
    client, run_id = _run(tmp_path)
    progress, path = _file_progress(client, run_id, tmp_path, total_samples=1000)
    with progress:
        time.sleep(0.2)  # no record, no metrics: 0 samples
        path.write_text('{"step": 5, "epoch": 0, "samples": 500, "restored": 500}')
        time.sleep(0.2)  # only the restored samples
    assert progress.lines == []


def test_a_recovered_worker_failure_is_one_line(tmp_path: Path) -> None:
    """The Train controller's callback tags the run with each worker failure; the driver tells
    each one Ray Train recovers from once, and not the last, which is the job's error."""
    import json

    client, run_id = _run(tmp_path)
    progress = TrainingProgress(client, run_id, total_samples=10, mode="lines", max_failures=1)
    record = {
        "submission": 1,
        "failures": 1,
        "ranks": [1],
        "cause": "rank 1: OSError: disk",
        "checkpoint": "/r/ck_1",
    }
    client.set_tag(run_id, "raydlrm.worker_failure", json.dumps(record))
    progress._poll(final=False)
    progress._poll(final=False)
    assert progress.lines == [
        "workers failed (rank 1: OSError: disk): restarting the workers from /r/ck_1 "
        "(failure 1 of run.max_failures = 1)"
    ]
    record.update(failures=2, checkpoint=None)
    client.set_tag(run_id, "raydlrm.worker_failure", json.dumps(record))
    progress._poll(final=False)
    assert len(progress.lines) == 1  # beyond max_failures: the job fails with its error


def test_a_later_submission_does_not_repeat_an_earlier_ones_failure(tmp_path: Path) -> None:
    """The run's tag still holds the first submission's failure when the run is submitted
    again: the second tells only its own."""
    import json

    client, run_id = _run(tmp_path)
    record = {"submission": 1, "failures": 1, "ranks": [1], "cause": "rank 1: killed"}
    client.set_tag(run_id, "raydlrm.worker_failure", json.dumps(record | {"checkpoint": None}))
    progress = TrainingProgress(
        client, run_id, total_samples=10, mode="lines", max_failures=3, submission=2
    )
    progress._poll(final=False)
    assert progress.lines == []
    record.update(submission=2, checkpoint="/r/ck_2")
    client.set_tag(run_id, "raydlrm.worker_failure", json.dumps(record))
    progress._poll(final=False)
    assert progress.lines == [
        "workers failed (rank 1: killed): restarting the workers from /r/ck_2 "
        "(failure 1 of run.max_failures = 3)"
    ]
