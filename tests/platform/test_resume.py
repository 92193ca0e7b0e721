"""Fault tolerance end to end on the local Ray cluster: a worker killed mid-epoch (``os._exit``)
is restarted from the latest checkpoint and the job ends with the weights of a run that was
never interrupted, bit for bit, every sample trained once per epoch (with checkpoints on local
disk and on the loopback S3 server); a job whose worker dies while writing a checkpoint and that
is submitted again under the same name resumes from the previous checkpoint and continues the
same MLflow run."""

from __future__ import annotations

import json
import logging
import re
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import mlflow
import numpy as np
import pandas as pd
import pytest
import torch
from mlflow.tracking import MlflowClient
from typer.testing import CliRunner

import raydlrm
from raydlrm.platform.cli import app
from raydlrm.platform.worker_failure import WorkerDiedError
from raydlrm.trainers.checkpoints import local_checkpoint, read_state_file
from raydlrm.trainers.model_dir import ModelWeights

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ROWS = 2048
EPOCHS = 2


def _config(root: Path, name: str, *, max_failures: int = 0) -> dict:
    return {
        "data": {
            "train_path": str(root / "data" / "train"),
            "eval_path": None,
            "batch_size": 128,
            "table_size": 500,
            "synthetic": {
                "generate": "if_missing",
                "num_train_rows": ROWS,
                "num_eval_rows": 0,
                "rows_per_file": 512,
                "max_cardinality": 400,
            },
        },
        # DHEN: its dense side (attention, convolution, cross, ...) resumes exactly too.
        "model": {
            "arch": "dhen",
            "embedding_dim": 8,
            "bottom_mlp": [16, 8],
            "top_mlp": [16],
            "dhen_layers": [["dot", "cross", "attention", "linear", "conv"]],
            "dcn_low_rank": 8,
        },
        "training": {
            "num_epochs": EPOCHS,
            "log_every_steps": 2,
            "sample_log_dir": str(root / "samples" / name),
        },
        "checkpoint": {"every_steps": 3},
        "run": {"storage_path": str(root / "runs"), "name": name, "max_failures": max_failures},
        "tracking": {
            "tracking_uri": f"sqlite:///{root / 'mlflow.db'}",
            "experiment_name": "resume",
            "registered_model_name": None,
        },
    }


def _weights(checkpoint: str | Path) -> dict[str, torch.Tensor]:
    return dict(ModelWeights(checkpoint).items())


def _sample_log(root: Path, name: str) -> dict[str, np.ndarray]:
    return {
        p.name: np.load(p, allow_pickle=False)
        for p in sorted(Path(root, "samples", name).glob("*.npy"))
    }


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory, ray_cluster):
    root = tmp_path_factory.mktemp("resume")
    return root, raydlrm.train(_config(root, "clean"))


def _assert_same_run(
    root: Path, clean: raydlrm.TrainResult, result, name: str, checkpoint: Path | None = None
) -> None:
    a, b = _weights(clean.checkpoint_path), _weights(checkpoint or result.checkpoint_path)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert result.metrics["step"] == clean.metrics["step"]
    # Every sample once per epoch, and the very same batches as the uninterrupted run.
    log, reference = _sample_log(root, name), _sample_log(root, "clean")
    assert log.keys() == reference.keys()
    assert all(np.array_equal(log[k], reference[k]) for k in log)
    counts = Counter(np.concatenate(list(log.values())).tolist())
    assert len(counts) == ROWS and set(counts.values()) == {EPOCHS}


def _assert_restored_from(result: raydlrm.TrainResult, step: int) -> None:
    client = MlflowClient(result.tracking_uri)
    history = client.get_metric_history(result.run_id, "restore/from_step")
    assert history and {m.value for m in history} == {step}
    assert min(m.step for m in history) > step


def test_worker_killed_mid_epoch_resumes_exactly(uninterrupted, monkeypatch) -> None:
    """Also: every table on the SSD tier (the uninterrupted run's are in DRAM), and pipelined
    steps (the next batch read and routed ahead: it is not in the checkpoint): the same bits,
    every sample once per epoch."""
    root, clean = uninterrupted
    # Step 11 is in the second epoch, two steps after the checkpoint of step 9.
    monkeypatch.setenv("RAYDLRM_FAULT", "rank=1,step=11")
    config = _config(root, "killed", max_failures=1)
    config["sharding"] = {"default_placement": "ssd", "ssd_path": str(root / "ssd")}
    config["training"]["pipeline"] = "sparse_dist"
    result = raydlrm.train(config)
    assert {t.placement for t in result.plan.tables} == {"ssd"}
    assert not list((root / "ssd").iterdir())  # the tables' files are gone with the workers
    assert Path(root, "runs", "killed", "fault-injected.rank1.step11.step").is_file()
    _assert_same_run(root, clean, result, "killed")
    assert result.metrics["samples_seen"] == ROWS * EPOCHS
    # Resumed from the checkpoint of step 9, not from scratch.
    _assert_restored_from(result, 9)
    # The failure is on the run, for the driver's one line: rank, cause, checkpoint.
    tags = MlflowClient(result.tracking_uri).get_run(result.run_id).data.tags
    failure = json.loads(tags["raydlrm.worker_failure"])
    assert failure["failures"] == 1 and 1 in failure["ranks"] and "rank 1" in failure["cause"]
    assert failure["submission"] == 1  # a later submission does not tell it again
    assert failure["checkpoint"] and failure["checkpoint"] != result.checkpoint_path


def _differential(config: dict) -> dict:
    """Differential checkpoints every 3 steps: baselines at steps 3, 9, 15, deltas between
    (these tables are small and batches touch most rows: deltas up to a whole baseline's
    bytes), only the newest checkpoint and its chain kept: step 9's baseline deletes steps 3
    and 6."""
    config["checkpoint"].update(
        differential=True, baseline_every=2, baseline_fraction=1.0, num_to_keep=1
    )
    return config


def test_kill_while_checkpointing_then_resubmit(uninterrupted, monkeypatch, caplog) -> None:
    """A differential run whose retention deleted checkpoints behind Ray Train (which still
    lists them in its run snapshot) fails and is submitted again: it resumes from its newest
    intact checkpoint, ends with the uninterrupted run's weights, and continues the same MLflow
    run; finished, it is given a third epoch and goes on from its final checkpoint. The failed
    submission's error names the dead rank and its process, why it was fatal and the
    checkpoint the next submission resumes from; the next does not tell that failure again."""
    root, clean = uninterrupted
    monkeypatch.setenv("RAYDLRM_FAULT", "rank=0,step=12,during=checkpoint")
    with pytest.raises(WorkerDiedError) as failed:
        raydlrm.train(_differential(_config(root, "resubmitted")))
    # The checkpoint being written at step 12 never became the latest: step 9's is, and
    # retention deleted steps 3 and 6 (Ray Train's snapshot still names them).
    run_dir = Path(root, "runs", "resubmitted")
    complete = [p for p in run_dir.glob("checkpoint_*") if Path(p, "trainer_state.json").is_file()]
    assert [read_state_file(p)["step"] for p in complete] == [9]
    assert re.match(r"worker rank 0 \(pid \d+ on [\d.]+\) died \(Ray: ", str(failed.value))
    assert "; run.max_failures = 0 made it fatal (above 0, Ray Train restarts" in str(failed.value)
    assert str(failed.value).endswith(f"resumes it from checkpoint {complete[0]}")
    # Its data position counts rows by row group of the files the epoch began with, listed.
    files = [[f"part-{i:05d}.parquet", [512]] for i in range(ROWS // 512)]
    assert read_state_file(complete[0])["position"]["files"] == files
    snapshot = json.loads((run_dir / "checkpoint_manager_snapshot.json").read_text())
    assert len(snapshot["checkpoint_results"]) == 3
    client = MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("resume")
    first = client.search_runs(
        [experiment.experiment_id], filter_string="tags.`raydlrm.run_name` = 'resubmitted'"
    )
    assert len(first) == 1 and first[0].info.status == "FAILED"

    monkeypatch.delenv("RAYDLRM_FAULT")
    caplog.set_level(logging.WARNING, logger="raydlrm.platform.progress")
    # Failures it could recover from would be told: the first submission's is not its own.
    result = raydlrm.train(_differential(_config(root, "resubmitted", max_failures=1)))
    told = [r.getMessage() for r in caplog.records if r.name == "raydlrm.platform.progress"]
    assert not [line for line in told if line.startswith("workers failed")], told
    _assert_same_run(root, clean, result, "resubmitted")
    runs = client.search_runs(
        [experiment.experiment_id], filter_string="tags.`raydlrm.run_name` = 'resubmitted'"
    )
    assert [r.info.run_id for r in runs] == [first[0].info.run_id] == [result.run_id]
    assert runs[0].info.status == "FINISHED"
    assert runs[0].data.tags["raydlrm.submissions"] == "2"
    _assert_restored_from(result, 9)
    steps = [m.step for m in client.get_metric_history(result.run_id, "train/loss")]
    assert max(steps) == clean.metrics["step"]  # the metric steps went on

    # Finished, with retention's deletions in Ray's snapshot again: a third epoch, its model
    # registered; submitted again as it is (a scheduler's retry), it trains nothing and
    # registers no second version of the same model.
    config = _differential(_config(root, "resubmitted"))
    config["training"].update(num_epochs=EPOCHS + 1, sample_log_dir=None)
    config["tracking"]["registered_model_name"] = "resubmitted"
    more = raydlrm.train(config)
    assert more.metrics["step"] == clean.metrics["step"] * (EPOCHS + 1) // EPOCHS
    assert more.metrics["samples_seen"] == ROWS * (EPOCHS + 1)
    assert more.run_id == result.run_id and more.registered_model_version == "1"
    again = raydlrm.train(config)
    assert again.metrics["step"] == more.metrics["step"]
    assert (again.registered_model_version, again.checkpoint_path) == ("1", more.checkpoint_path)
    assert len(client.search_model_versions("name='resubmitted'")) == 1


@pytest.mark.scenario
def test_checkpoints_on_s3_resume_exactly(
    uninterrupted, s3_server, mlflow_server, monkeypatch
) -> None:
    """Run storage on the loopback S3 server: differential checkpoints written there (a
    baseline, then deltas), a killed worker restarted from the latest delta and its chain (the
    same bits as the uninterrupted run), the fault marker kept there, retention applied there
    (the newest two and the checkpoints their chains need). The model is registered on the
    tracking server by reference: its weights are the final checkpoint's chain on S3, never
    copied into MLflow's artifact store, and it loads and scores from there."""
    import s3fs

    root, clean = uninterrupted
    storage = s3_server("ckpt")
    config = _config(root, "on-s3", max_failures=1)
    config["run"].update(storage_path="s3://ckpt/runs", storage=asdict(storage))
    config["tracking"].update(tracking_uri=mlflow_server, registered_model_name="on-s3-model")
    # Deltas up to a whole baseline's bytes: these tables are small, batches touch most rows.
    config["checkpoint"].update(num_to_keep=2, differential=True, baseline_fraction=1.0)
    monkeypatch.setenv("RAYDLRM_FAULT", "rank=1,step=11")
    result = raydlrm.train(config)
    assert result.checkpoint_path.startswith("s3://ckpt/runs/on-s3/checkpoint_")
    fs = s3fs.S3FileSystem(**storage.s3fs_kwargs())
    assert fs.exists("ckpt/runs/on-s3/fault-injected.rank1.step11.step")
    kept = [
        e["name"]
        for e in fs.ls("ckpt/runs/on-s3", detail=True)
        if e["type"] == "directory" and e["name"].rsplit("/", 1)[-1].startswith("checkpoint_")
    ]
    links = {
        p.rsplit("/", 1)[-1]: json.loads(fs.cat(f"{p}/trainer_state.json"))["differential"]
        for p in kept
    }
    newest = sorted(links)[-2:]
    # The chain went on across the restart (from step 9's delta).
    assert links[newest[0]]["kind"] == "delta" and len(links[newest[0]]["chain"]) > 3
    needed = {name for n in newest for name in links[n].get("chain", [])}
    assert set(links) == {*newest, *needed}  # num_to_keep, on S3
    with local_checkpoint(result.checkpoint_path, storage) as final:  # with its chain
        _assert_same_run(root, clean, result, "on-s3", checkpoint=final)
        trained = _weights(final)
    _assert_restored_from(result, 9)
    client = MlflowClient(result.tracking_uri)
    run = client.get_run(result.run_id)
    assert run.data.tags["raydlrm.checkpoint"] == result.checkpoint_path
    assert run.data.tags["raydlrm.model_weights"] == "reference"
    stored = mlflow.artifacts.download_artifacts(
        "models:/on-s3-model/1", tracking_uri=mlflow_server, dst_path=str(root / "on-s3-model")
    )
    files = {p.name for p in Path(stored).rglob("*") if p.is_file()}
    assert "weights_ref.json" in files and "model.safetensors" not in files
    # The CLI and the model read the checkpoint on S3 (the store from the standard AWS
    # variables).
    for name, value in {
        "AWS_ENDPOINT_URL": storage.endpoint_url,
        "AWS_REGION": storage.region,
        "AWS_ACCESS_KEY_ID": storage.access_key_id,
        "AWS_SECRET_ACCESS_KEY": storage.secret_access_key,
    }.items():
        monkeypatch.setenv(name, value)
    shown = CliRunner().invoke(app, ["checkpoint", "show", result.checkpoint_path])
    assert shown.exit_code == 0, shown.output
    assert f"step {clean.metrics['step']}, epoch {EPOCHS - 1}" in shown.output
    missing = CliRunner().invoke(app, ["checkpoint", "show", "s3://ckpt/runs/nothing"])
    assert missing.exit_code == 2 and "s3://ckpt/runs/nothing does not exist" in missing.output
    # Scoring takes the registered model (its chain downloaded, its tables written out) and
    # the checkpoint on S3 alike.
    from raydlrm.platform.scoring import model_files

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    for model in ("models:/on-s3-model/1", result.checkpoint_path):
        with model_files(model) as files:
            copy = files.directory
            scored = _weights(copy)
            assert scored.keys() == trained.keys()
            assert all(torch.equal(scored[k], v) for k, v in trained.items())
            assert files.spec["model"]["arch"] == "dhen"
        assert not copy.exists()
    rows = pd.read_parquet(root / "data" / "train").head(64)
    pyfunc = mlflow.pyfunc.load_model("models:/on-s3-model/1")
    features = rows.drop(columns=[c for c in ("label", "sample_id", "session_id") if c in rows])
    probabilities = np.asarray(pyfunc.predict(features))
    assert probabilities.shape == (64,) and np.all((probabilities > 0) & (probabilities < 1))


def test_worker_killed_in_the_final_evaluation_keeps_the_final_checkpoint(
    uninterrupted, monkeypatch
) -> None:
    """The final checkpoint precedes the final evaluation: a worker dying there is restarted
    from it (no step redone, no second final checkpoint) and only the evaluation is redone; the
    result, the checkpoint (final_metrics.json) and the registered model carry its metrics."""
    root, _ = uninterrupted
    config = _config(root, "eval-killed", max_failures=1)
    config["data"].update(
        train_path=str(root / "with-eval" / "train"), eval_path=str(root / "with-eval" / "eval")
    )
    config["data"]["synthetic"].update(num_train_rows=1024, num_eval_rows=256)
    config["training"].update(num_epochs=1, sample_log_dir=None)
    config["tracking"]["registered_model_name"] = "eval-killed"
    last = 1024 // 256  # the last step: one epoch of global batches of 2 x 128 rows
    monkeypatch.setenv("RAYDLRM_FAULT", f"rank=1,step={last},during=eval")
    result = raydlrm.train(config)
    run_dir = Path(root, "runs", "eval-killed")
    assert Path(run_dir, f"fault-injected.rank1.step{last}.eval").is_file()
    assert result.metrics["step"] == last and result.metrics["samples_seen"] == 1024
    assert result.metrics["eval/num_samples"] == 256 and 0 < result.metrics["eval/auc"] < 1
    checkpoints = [p for p in run_dir.glob("checkpoint_*") if p.is_dir()]
    finals = [p for p in checkpoints if read_state_file(p)["step"] == last]
    assert [str(p) for p in finals] == [result.checkpoint_path]
    final_metrics = json.loads(Path(result.checkpoint_path, "final_metrics.json").read_text())
    assert final_metrics["eval/auc"] == result.metrics["eval/auc"]
    client = MlflowClient(result.tracking_uri)
    history = client.get_metric_history(result.run_id, "restore/from_step")
    assert {m.value for m in history} == {last}
    assert (
        client.get_metric_history(result.run_id, "eval/auc")[-1].value == final_metrics["eval/auc"]
    )
    assert result.registered_model_version == "1"
    model = mlflow.artifacts.download_artifacts(
        artifact_uri=result.model_uri,
        dst_path=str(root / "eval-killed-model"),
        tracking_uri=result.tracking_uri,
    )
    (metrics_file,) = Path(model).rglob("metrics.json")
    assert json.loads(metrics_file.read_text())["eval/auc"] == final_metrics["eval/auc"]
