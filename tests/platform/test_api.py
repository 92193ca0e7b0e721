"""The Python API (what notebooks use): ``raydlrm.train`` on the session's local Ray cluster,
and bad input stopping before anything runs."""

from __future__ import annotations

import dataclasses
import logging
import signal
import time
from pathlib import Path

import mlflow
import pyarrow.parquet as pq
import pytest
from mlflow.tracking import MlflowClient

import raydlrm
from raydlrm.ingestion import DataValidationError

_ALL_COLUMNS = [
    "sample_id",
    "label",
    *(f"I{i}" for i in range(1, 14)),
    *(f"C{i}" for i in range(1, 27)),
]


def _config(tmp_path: Path) -> dict:
    return {
        "data": {
            "train_path": str(tmp_path / "data" / "train"),
            "eval_path": None,
            "batch_size": 128,
            "table_size": 500,
            "synthetic": {
                "generate": "if_missing",
                "num_train_rows": 2048,
                "num_eval_rows": 0,
                "rows_per_file": 1024,
                "max_cardinality": 400,
            },
        },
        "model": {
            "arch": "dcnv2",
            "embedding_dim": 8,
            "bottom_mlp": [16, 8],
            "top_mlp": [16],
            "dcn_num_layers": 1,
            "dcn_low_rank": 4,
        },
        "training": {"max_steps": 4, "log_every_steps": 2},
        "run": {"storage_path": str(tmp_path / "runs"), "name": "api-run"},
        "tracking": {
            "tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}",
            "experiment_name": "api",
            "registered_model_name": None,
        },
    }


def _train_controllers_end(timeout_s: float = 60.0) -> bool:
    """Whether no Ray Train controller is alive on the session's cluster within ``timeout_s``
    (an actor's end, once its last handle is gone, is Ray's to carry out)."""
    from ray._private import state

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = state.actors(actor_state_name="ALIVE").values()
        if not [a for a in alive if "TrainController" in a["ActorClassName"]]:
            return True
        time.sleep(0.5)
    return False


@pytest.mark.ray
@pytest.mark.slow
def test_train_from_python_returns_result(tmp_path: Path, ray_cluster, caplog) -> None:
    """``raydlrm.train`` from Python: the result, the MLflow run, progress lines, and, on a
    session-clustered data set (RecD) with the dedup group inferred, the savings."""
    caplog.set_level(logging.INFO, logger="raydlrm.platform.progress")
    config = _config(tmp_path)
    # The synthetic user features C1-C8 repeat over a session (about 4 samples): stored once
    # per session, and deduplicated as the group inferred from the layout.
    config["data"]["synthetic"]["layout"] = "clustered"
    config["data"]["dedup"] = "infer"
    # Two tables on the SSD tier, one of them deduplicated, behind DRAM row caches of 250 of
    # their 500 rows (rows evicted and read back): trained, checkpointed, exported.
    config["sharding"] = {
        "placement": {"t_C1": "ssd", "t_C20": "ssd"},
        "cache_load_factor": 0.5,
        "cache_min_rows": 200,
    }
    # The logged model holds its own copy of the weights (the default here would reference
    # the checkpoint).
    config["tracking"]["model_weights"] = "copy"
    handler = signal.getsignal(signal.SIGINT)
    result = raydlrm.train(config)
    # Ray Train's Ctrl-C handler, which holds the run's controller, is gone with the run: the
    # controller ends now (it lived on until the next run or the session's end), and a later
    # Ctrl-C is the caller's again (it was swallowed twice, then exited with status 0).
    assert signal.getsignal(signal.SIGINT) is handler
    assert _train_controllers_end(), "the run's Train controller outlives the run"
    assert [t.name for t in result.plan.tables if t.placement == "ssd"] == ["t_C1", "t_C20"]
    for name in ("t_C1", "t_C20"):  # the page cache holds the tables (small, just trained)
        assert 0 < result.metrics[f"tier/{name}/resident_fraction"] <= 1
        assert 0 < result.metrics[f"tier/{name}/cache_hit_rate"] < 1
    assert float(result.metrics["tier/major_page_faults"]).is_integer()  # reported: a count
    assert "tier/t_C2/resident_fraction" not in result.metrics  # in DRAM
    # Not a terminal: progress comes as log lines, the last one when training ended.
    lines = [r.getMessage() for r in caplog.records if r.name == "raydlrm.platform.progress"]
    assert lines and lines[-1].startswith("training: 1024/1024 samples (100.0%)")
    assert isinstance(result, raydlrm.TrainResult)
    assert result.metrics["step"] == 4
    assert result.metrics["sharding/torch_kernel_ranks"] == 0  # fbgemm here: "auto" takes it
    assert "eval/auc" not in result.metrics  # no eval path configured
    assert Path(result.checkpoint_path, "spec.json").is_file()
    assert result.registered_model_name is None and result.registered_model_version is None
    assert result.registered_model_uri is None
    registered = dataclasses.replace(
        result, registered_model_name="ctr", registered_model_version="3"
    )
    assert registered.registered_model_uri == "models:/ctr/3"
    client = MlflowClient(result.tracking_uri)
    run = client.get_run(result.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["model.arch"] == "dcnv2"
    assert [m.step for m in client.get_metric_history(result.run_id, "train/loss")] == [2, 4]
    assert result.plan.world_size == 2
    m = result.metrics
    assert m["dedup/t_C1/ratio"] > 1.5
    assert m["dedup/t_C1/lookups_saved"] > 0 and m["dedup/t_C8/a2a_bytes_saved"] > 0
    assert "dedup/t_C9/ratio" not in m  # C9 is not deduplicated
    assert run.data.metrics["dedup/t_C1/ratio"] == pytest.approx(m["dedup/t_C1/ratio"])
    assert run.data.params["data.dedup_groups"] == str([[f"C{i}" for i in range(1, 9)]])
    # Scoring a clustered set joins each sample with its session: the same predictions as
    # for the same rows stored sample-level.
    from raydlrm.ingestion import DataConfig
    from raydlrm.ingestion.clustered import read_rows

    clustered = config["data"]["train_path"]
    rows = read_rows(clustered, DataConfig(), columns=list(_ALL_COLUMNS), max_rows=10**6)
    flat = tmp_path / "flat"
    flat.mkdir()
    pq.write_table(rows, flat / "part-0.parquet")
    ours = raydlrm.score(result.checkpoint_path, clustered, str(tmp_path / "p-c"))
    theirs = raydlrm.score(result.checkpoint_path, str(flat), str(tmp_path / "p-f"))
    assert ours.rows == theirs.rows == 2048
    ours, theirs = (pq.read_table(tmp_path / p).sort_by("sample_id") for p in ("p-c", "p-f"))
    assert ours.column("sample_id").to_pylist() == list(range(2048))
    assert ours.column("prediction").equals(theirs.column("prediction"))
    # The logged model, with its copy of the weights, scores alike.
    assert run.data.tags["raydlrm.model_weights"] == "copy"
    mlflow.set_tracking_uri(result.tracking_uri)
    stored = Path(
        mlflow.artifacts.download_artifacts(result.model_uri, dst_path=str(tmp_path / "logged"))
    )
    assert len(list(stored.rglob("model.safetensors"))) == 1
    assert not list(stored.rglob("weights_ref.json"))
    raydlrm.score(result.model_uri, str(flat), str(tmp_path / "p-m"))
    logged = pq.read_table(tmp_path / "p-m").sort_by("sample_id")
    assert logged.column("prediction").equals(theirs.column("prediction"))


def test_bad_config_raises_before_running(tmp_path: Path) -> None:
    config = _config(tmp_path)
    config["training"]["max_stesp"] = 4
    with pytest.raises(raydlrm.platform.ConfigError, match=r"training\.max_stesp: unknown key"):
        raydlrm.train(config)


def test_missing_data_raises_before_running(tmp_path: Path) -> None:
    config = _config(tmp_path)
    del config["data"]["synthetic"]
    with pytest.raises(DataValidationError, match=str(tmp_path / "data" / "train")):
        raydlrm.train(config)
    assert not (tmp_path / "mlflow.db").exists()  # nothing was tracked


@pytest.mark.ray
@pytest.mark.slow
def test_bad_held_out_row_fails_the_final_evaluation_but_keeps_the_model(
    tmp_path: Path, ray_cluster
) -> None:
    """Under ``fail``, a -inf in the held-out data stops the job in the final evaluation, after
    all training: the trained model is kept (checkpointed before the evaluation, logged on the
    run, not registered) and the error names the file, row and column."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from raydlrm.platform.config import load_config
    from raydlrm.platform.job_data import prepare_data
    from raydlrm.platform.launch import EvaluationError

    config = _config(tmp_path)
    config["data"]["synthetic"]["num_eval_rows"] = 512
    config["data"]["eval_path"] = str(tmp_path / "data" / "eval")
    config["tracking"]["registered_model_name"] = "kept"
    prepare_data(load_config(config))
    held_out = next((tmp_path / "data" / "eval").glob("*.parquet"))
    table = pq.read_table(held_out)
    dense = table.column("I1").fill_null(0.0).to_numpy().copy()
    dense[7] = -np.inf
    pq.write_table(
        table.set_column(table.schema.get_field_index("I1"), "I1", pa.array(dense)), held_out
    )
    with pytest.raises(
        EvaluationError,
        match=r"final evaluation failed: BadInputError: .*"
        rf"{held_out.name}.*row 7: dense column 'I1'.*the trained model is kept",
    ):
        raydlrm.train(config)
    client = MlflowClient(config["tracking"]["tracking_uri"])
    (run,) = client.search_runs(client.get_experiment_by_name("api").experiment_id)
    assert run.info.status == "FAILED"
    assert "BadInputError" in run.data.tags["raydlrm.eval_error"]
    checkpoint = Path(run.data.tags["raydlrm.checkpoint"])
    assert (checkpoint / "trainer_state.json").is_file() and (checkpoint / "spec.json").is_file()
    assert client.list_artifacts(run.info.run_id, "model")  # logged: the model is kept
    assert not client.search_registered_models()  # not registered: it was not evaluated


_DRIVER = """
import sys, time
from raydlrm.platform.config import load_config
from raydlrm.platform.ray_init import init_ray
ray_config = {"num_cpus": 2, "object_store_memory": 80 * 1024**2, "include_dashboard": False}
init_ray(load_config({"ray": ray_config}))
import ray
# A worker process too (it runs raydlrm._ray_setup.without_dashboard as it starts).
assert ray.get(ray.remote(lambda: __import__("logging").getLogger(
    "ray.train.v2._internal.execution.controller.placement_group_cleaner").level).remote()) == 40
print("READY", flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_local_cluster_is_torn_down_when_its_driver_is_killed(tmp_path: Path) -> None:
    """A SIGKILLed driver's local Ray instance goes with it: without the watcher, Ray's
    dashboard and runtime-env agents outlive the driver by about a minute. (The instance is
    started without its dashboard: its workers run raydlrm's set-up hook.)"""
    import os
    import signal
    import subprocess
    import sys
    import time

    import psutil

    env = {**os.environ, "RAY_API_SERVER_ADDRESS": ""}
    env.pop("RAY_API_SERVER_ADDRESS")
    env.pop("RAY_ADDRESS", None)
    driver = subprocess.Popen(
        [sys.executable, "-c", _DRIVER], stdout=subprocess.PIPE, text=True, cwd=tmp_path, env=env
    )
    try:
        assert driver.stdout is not None and driver.stdout.readline().strip() == "READY"
        processes = psutil.Process(driver.pid).children(recursive=True)
        names = {p.name() for p in processes}
        assert any("raylet" in n for n in names) and any("Agent" in n for n in names), names
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait()

    def running(p: psutil.Process) -> bool:
        try:
            return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    deadline = time.monotonic() + 15  # measured: 5 s
    while time.monotonic() < deadline and any(running(p) for p in processes):
        time.sleep(0.5)
    left = [p for p in processes if running(p)]
    for p in left:
        p.kill()
    assert not left, [p.name() for p in left]
