"""The MLflow callback keeps training going when the tracking server is unreachable, and
catches up (or counts what it lost) when it answers again."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from raydlrm.platform.tracking import MLflowReportCallback


def test_unreachable_server_then_catch_up(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    store = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run_id = store.create_run(store.create_experiment("t")).info.run_id
    # Nothing listens on port 9 of loopback: every call fails at once.
    callback = MLflowReportCallback(tracking_uri="http://127.0.0.1:9", run_id=run_id, max_pending=5)
    for step in (1, 2, 3):  # 2 metrics per report: 6 > 5 kept, so the oldest is lost
        callback.after_report(None, [{"step": step, "train/loss": 0.5 / step, "epoch": step}], None)
    assert len(callback._pending) == 5 and callback._lost == 1
    callback._client = store  # the server answers again
    callback.after_report(None, [{"step": 4, "train/loss": 0.1, "epoch": 4}], None)
    assert callback._pending == []
    history = {m.step: m.value for m in store.get_metric_history(run_id, "train/loss")}
    # Reports log (train/loss, epoch): the lost value was step 1's loss, the oldest.
    assert history == {2: 0.25, 3: pytest.approx(0.5 / 3), 4: 0.1}
    assert [m.value for m in store.get_metric_history(run_id, "tracking/metrics_lost")] == [1.0]


def test_repeated_values_are_logged_once(tmp_path: Path) -> None:
    store = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run_id = store.create_run(store.create_experiment("t")).info.run_id
    callback = MLflowReportCallback(
        tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", run_id=run_id
    )
    # A checkpoint-only report at step 4 carries step 2's loss along; the final report at step
    # 4 carries step 4's loss again.
    for step, loss in ((2, 0.5), (4, 0.5), (4, 0.25), (4, 0.25)):
        callback.after_report(None, [{"step": step, "train/loss": loss}], None)
    history = [(m.step, m.value) for m in store.get_metric_history(run_id, "train/loss")]
    assert sorted(history) == [(2, 0.5), (4, 0.25)]


def test_new_experiments_keep_artifacts_beside_the_sqlite_store(tmp_path: Path, monkeypatch):
    """A job in Ray's temporary copy of its working directory (``ray job submit``) creates its
    experiment with the artifacts next to ``mlflow.db`` under ``RAYDLRM_BASE_DIR``, not under
    MLflow's default ``./mlruns`` of the working directory, which Ray deletes."""
    from raydlrm.platform.config import load_config
    from raydlrm.platform.export import set_experiment
    from raydlrm.platform.tracking import start_run

    base, elsewhere = tmp_path / "base", tmp_path / "ray-copy"
    base.mkdir()
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.setenv("RAYDLRM_BASE_DIR", str(base))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    job = load_config({"tracking": {"experiment_name": "team/ctr model"}})
    tracked = start_run(job, run_name="r")
    client = MlflowClient(tracked.tracking_uri)
    location = client.get_experiment(tracked.experiment_id).artifact_location
    assert location == str(base / "mlruns" / "team_ctr_model")
    assert client.get_run(tracked.run_id).info.artifact_uri.startswith(location)
    # The export's experiment alike, and an existing experiment is found, not created again.
    relative = "sqlite:///../base/mlflow.db"
    exported = set_experiment("raydlrm-export", tracking_uri=relative)
    assert exported.artifact_location == str(base / "mlruns" / "raydlrm-export")
    again = set_experiment("team/ctr model", tracking_uri=relative)
    assert again.experiment_id == tracked.experiment_id
    assert not (elsewhere / "mlruns").exists()
    # Elsewhere (a tracking server) MLflow's server decides: nothing is made up here.
    from raydlrm.platform.export import _local_artifact_root

    assert _local_artifact_root("http://mlflow:5000") is None


def test_model_weights_by_reference_where_the_registry_can_read_them(caplog) -> None:
    """``tracking.model_weights = "auto"`` references a checkpoint in an object store, and one
    on this machine for a tracking store here (SQLite, a file store, a server on loopback);
    for a tracking server elsewhere it copies, saying why in one line (no credentials)."""
    from raydlrm.platform.export import weights_by_reference

    local, remote = "/data/runs/r/checkpoint_1", "s3://bucket/runs/r/checkpoint_1"
    here = ("sqlite:////data/mlflow.db", "file:///data/mlruns", "http://127.0.0.1:5000")
    with caplog.at_level(logging.INFO, logger="raydlrm.platform.export"):
        assert all(weights_by_reference("auto", local, uri) for uri in here)
        assert weights_by_reference("auto", remote, "https://mlflow.example.com")
        assert not caplog.records
        assert not weights_by_reference("auto", local, "https://user:pw@mlflow.example.com")
    (line,) = [r.getMessage() for r in caplog.records]
    assert not weights_by_reference("auto", local, "databricks")
    assert f"logged by copy: the checkpoint {local} is on this machine's disk" in line
    assert "https://mlflow.example.com" in line and "pw" not in line
    assert not weights_by_reference("copy", remote, "http://127.0.0.1:5000")
    assert weights_by_reference("reference", local, "https://mlflow.example.com")


def test_a_model_whose_referenced_checkpoint_is_gone_names_it(tmp_path: Path) -> None:
    """A model registered by reference whose checkpoint was deleted: loading or writing it out
    names the checkpoint and how to keep a standalone copy."""
    from raydlrm.trainers.model_dir import REFERENCE_FILE, write_model_dir

    model, gone = tmp_path / "model", tmp_path / "runs" / "r" / "checkpoint_1"
    model.mkdir()
    (model / REFERENCE_FILE).write_text(json.dumps({"checkpoint": str(gone)}))
    with pytest.raises(FileNotFoundError, match=rf"training checkpoint {gone}.*raydlrm export"):
        write_model_dir(model, tmp_path / "out")
