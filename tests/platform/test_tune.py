"""Hyperparameter sweeps (``raydlrm tune``): the search-space parser, the checks before any
trial starts, and a 3-trial sweep with ASHA on the session's local Ray cluster, its driver
killed once and the sweep continued (child MLflow runs under one parent, the best model
registered, the trials' table)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from typer.testing import CliRunner

from raydlrm.platform.config import ConfigError, load_config
from raydlrm.platform.search_space import Dimension, check_space, parse_search


def test_the_parser_reads_every_distribution() -> None:
    space = parse_search(
        [
            "training.learning_rate=loguniform(1e-4, 1e-2)",
            "model.arch=choice(dlrm, dcnv2)",
            "model.top_mlp=grid([16], [32, 16])",
            "training.seed=randint(0, 10)",
        ]
    )
    assert space["training.learning_rate"] == Dimension(
        "training.learning_rate", "loguniform", (1e-4, 1e-2)
    )
    assert space["model.arch"].values == ("dlrm", "dcnv2")  # bare words are strings
    assert space["model.top_mlp"].values == ([16], [32, 16])
    assert space["training.seed"].corners() == [0, 9]  # randint excludes its high end
    assert parse_search({"training.learning_rate": 'choice(0.1, "x")'})[
        "training.learning_rate"
    ].values == (0.1, "x")
    assert parse_search(["tracking.registered_model_name=choice(null, m)"])[
        "tracking.registered_model_name"
    ].values == (None, "m")  # a bare null is None, as --set reads it
    for bad, message in (
        ("training.learning_rate=normal(0, 1)", "is not a distribution"),
        ("training.learning_rate=uniform(1)", "needs two numbers"),
        ("training.learning_rate=uniform(2, 1)", "is empty"),
        ("training.learning_rate=loguniform(0, 1)", "needs lo > 0"),
        # It passed the checks and failed inside Ray Tune, leaving a FAILED parent run.
        ("training.learning_rate=loguniform(1e-4, inf)", r"needs finite ends"),
        ("training.seed=randint(0.5, 3)", "needs integers"),
        ("model.arch=choice()", "at least one value"),
        ("no distribution", "not of the form key=distribution"),
    ):
        with pytest.raises(ConfigError, match=message):
            parse_search([bad])


def test_the_space_is_checked_against_the_config_before_any_trial() -> None:
    job = load_config(None)

    def check(*expressions: str) -> None:
        check_space(job, parse_search(list(expressions)))

    check("training.learning_rate=loguniform(1e-4, 1e-2)", "model.arch=choice(dlrm, dcnv2)")
    check("training.precision=choice(fp32, bf16, fp16)", "training.compile=choice(true, false)")
    with pytest.raises(ConfigError, match=r"tune\.search\.training\.precision = 'fp8'"):
        check("training.precision=choice(fp32, fp8)")
    with pytest.raises(ConfigError, match=r"tune.search.training.learnin_rate: unknown config key"):
        check("training.learnin_rate=uniform(0.1, 0.2)")
    with pytest.raises(ConfigError, match=r"tune.search.model.arch: uniform\(\) needs a numeric"):
        check("model.arch=uniform(1, 2)")
    with pytest.raises(ConfigError, match=r"tune\.search\.model\.embedding_dim: an integer key"):
        check("model.embedding_dim=uniform(4, 16)")
    with pytest.raises(ConfigError, match=r"tune.search.model.arch = 'mlp'"):
        check("model.arch=choice(dlrm, mlp)")
    with pytest.raises(ConfigError, match=r"tune\.search\.training\.learning_rate = -1"):
        check("training.learning_rate=uniform(-1, 1)")
    # Keys unset by default (a default per kind of row cache) are numbers all the same.
    check("sharding.cache_load_factor=uniform(0.01, 0.3)", "sharding.cache_min_rows=randint(1, 9)")
    with pytest.raises(ConfigError, match=r"tune\.search\.sharding\.cache_min_rows: an integer"):
        check("sharding.cache_min_rows=uniform(1, 9)")


def test_a_trial_that_cannot_fit_the_cluster_is_refused_before_any_starts(caplog) -> None:
    """A trial's workers (at the largest searched count) must fit the cluster's resources: a
    local cluster that cannot hold them is an error naming the keys, a remote one a warning."""
    from raydlrm.platform.tune import check_trial_fits

    job = load_config(overrides=["scaling.resources_per_worker={ CPU = 1.5 }"])
    space = parse_search(["scaling.num_workers=choice(1, 3)"])
    check_trial_fits(job, {}, cluster={"CPU": 3.0}, local=True)  # 2 workers x 1.5
    with pytest.raises(
        ConfigError,
        match=r"one trial does not fit the cluster: 3 workers x 1\.5 CPU = 4\.5 CPU "
        r"\(scaling\.num_workers, scaling\.resources_per_worker\.CPU\), the cluster has 3",
    ):
        check_trial_fits(job, space, cluster={"CPU": 3.0}, local=True)
    gpu = load_config(overrides=["scaling.use_gpu=true"])
    with pytest.raises(ConfigError, match=r"= 2 GPU \(scaling.num_workers, scaling.use_gpu\)"):
        check_trial_fits(gpu, {}, cluster={"CPU": 8.0}, local=True)
    check_trial_fits(gpu, {}, cluster={"CPU": 8.0}, local=False)
    assert "waiting for an autoscaler" in caplog.text
    # randint's high end is excluded: randint(1, 3) is 1 or 2 workers, which fit (3 were
    # counted, and the sweep refused).
    check_trial_fits(
        job, parse_search(["scaling.num_workers=randint(1, 3)"]), cluster={"CPU": 3.0}, local=True
    )


def test_a_grid_runs_each_point_once_unless_asked_and_evaluations_reach_asha(
    caplog, monkeypatch
) -> None:
    """``grid`` alone: each point one trial (8 identical copies of each ran, silently); asked
    for more, a warning says they repeat. ASHA gets every evaluation, also one whose metric
    repeats the last exactly (a collapsed model's AUC): keyed by the evaluation's step, not
    by its value, which left such a trial at its first rung, never stopped."""
    from raydlrm.platform.search_space import num_samples
    from raydlrm.platform.tune import _evaluation_reports

    grid = parse_search(["model.top_mlp=grid([16], [32])", "model.arch=grid(dlrm, dcnv2)"])
    mixed = {**grid, **parse_search(["training.learning_rate=loguniform(1e-4, 1e-2)"])}
    assert num_samples(None, grid) == 1 and num_samples(None, mixed) == 8
    assert num_samples(3, mixed) == 3 and "runs each point" not in caplog.text
    assert num_samples(3, grid) == 3
    assert "every searched key is a grid (4 points): tune.num_trials = 3 runs each" in caplog.text

    from ray.tune.integration.ray_train import TuneReportCallback

    passed = []  # Tune's side of the callback (it needs a Tune session), standing in
    monkeypatch.setattr(TuneReportCallback, "__init__", lambda self: None)
    monkeypatch.setattr(
        TuneReportCallback, "after_report", lambda self, c, m, k: passed.append(m[0]["step"])
    )
    callback = _evaluation_reports("eval/auc")
    for step, evaluated in ((1, None), (2, 2), (3, 2), (4, 4), (5, 4), (6, 6)):
        report = {"step": step, "train/loss": 0.6}
        if evaluated is not None:  # reports after an evaluation carry its metrics
            report |= {"eval/auc": 0.5, "eval/step": evaluated}
        callback.after_report(None, [report], None)
    assert passed == [2, 4, 6]


def _sweep_config(tmp_path: Path) -> dict:
    return {
        "data": {
            "train_path": str(tmp_path / "data" / "train"),
            "eval_path": str(tmp_path / "data" / "eval"),
            "batch_size": 128,
            "table_size": 500,
            "synthetic": {
                "generate": "if_missing",
                "num_train_rows": 3072,
                "num_eval_rows": 512,
                "rows_per_file": 1024,
                "max_cardinality": 400,
            },
            # One of the three training files is the validation set the trials are ranked on.
            "valid_split": "random",
            "valid_fraction": 0.3,
        },
        "model": {"arch": "dlrm", "embedding_dim": 8, "bottom_mlp": [16, 8], "top_mlp": [16]},
        "training": {
            "max_steps": 6,
            "log_every_steps": 2,
            "valid_every_steps": 2,
            "early_stopping": {"patience": 2},
        },
        "scaling": {"num_workers": 2, "resources_per_worker": {"CPU": 0.5}},
        "run": {"storage_path": str(tmp_path / "runs"), "name": "sweep"},
        "tracking": {
            "tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}",
            "experiment_name": "tune",
            "registered_model_name": "tuned",
        },
        "tune": {"num_trials": 3, "seed": 0, "reduction_factor": 2, "max_concurrent_trials": 2},
    }


def test_trials_reuse_the_statistics_unless_the_search_changes_them(tmp_path: Path) -> None:
    """The sweep computes the dense statistics and bucket boundaries once for its trials; a
    search over the buckets (or the transform, the columns, the data) leaves each trial its
    own: reused, a trial with other buckets would fail or keep the base's."""
    from raydlrm.platform.tune import _prepared

    config = _sweep_config(tmp_path)
    config["data"] |= {"dense_buckets": 8, "dense_specs": {"I1": {"transform": "standardize"}}}
    job = load_config(config)
    reused = _prepared(job, "s", parse_search(["training.learning_rate=choice(0.1, 0.2)"]))
    assert set(reused.data.bucket_boundaries) == set(reused.data.dense_columns)
    assert set(reused.data.dense_stats) == {"I1"}
    own = _prepared(job, "s", parse_search(["data.dense_buckets=choice(4, 16)"]))
    assert own.data.bucket_boundaries == {} and own.data.dense_stats == {}


def test_searches_the_settings_would_fail_or_ignore(tmp_path: Path) -> None:
    """A search over the global batch with a learned cost model trained at one batch failed
    every trial but one: refused before the sweep, naming both keys. A search with auto towers
    resolved the towers once for every trial, whatever the search changed: each trial now
    resolves its own."""
    from raydlrm.platform.tune import _prepared

    config = _sweep_config(tmp_path)
    neural = load_config(config, overrides=["sharding.cost_model=neural"])
    for key in ("data.batch_size", "scaling.num_workers"):
        with pytest.raises(
            ConfigError,
            match=rf"sharding\.cost_model = 'neural' with a search "
            rf"over {re.escape(key)}",
        ):
            _prepared(neural, "s", parse_search([f"{key}=choice(1, 2)"]))
    config["model"] |= {"towers": "auto", "tower_warmup_steps": 2}
    config["scaling"] |= {"ranks_per_host": 1}
    auto = load_config(config)
    shared = _prepared(auto, "s", {})
    assert isinstance(shared.model.towers, list)  # resolved once, for every trial
    own = _prepared(auto, "s", parse_search(["model.num_towers=choice(2, 3)"]))
    assert own.model.towers == "auto"


def _killed_after_a_trial(config: dict, search: list[str], ray_cluster) -> float:
    """Runs the sweep in a driver process of its own on the session's cluster and kills it
    (SIGKILL) once Tune has recorded a finished trial; returns the time of the kill."""
    runs = Path(config["run"]["storage_path"]) / config["run"]["name"]
    script = "import json, sys, raydlrm; raydlrm.tune(json.loads(sys.argv[1]), search=sys.argv[2:])"
    env = {**os.environ, "RAY_ADDRESS": ray_cluster.get_runtime_context().gcs_address}
    driver = subprocess.Popen(
        [sys.executable, "-c", script, json.dumps(config), *search],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 600
    try:
        while time.monotonic() < deadline and driver.poll() is None:
            states = [p.read_text() for p in runs.glob("experiment_state-*.json")]
            if any("TERMINATED" in s for s in states):
                break
            time.sleep(1)
        assert driver.poll() is None, "the sweep ended before it could be killed"
    finally:
        driver.kill()
        driver.wait()
    killed = time.time()
    _wait_for_trials_to_end(Path(config["run"]["storage_path"]))
    return killed


def _wait_for_trials_to_end(storage: Path, timeout_s: float = 120.0) -> None:
    """Waits until no process holds a run lock under ``storage``: Ray ends a killed driver's
    trial actors after it (their owner is gone), which may take seconds under load, and a trial
    run again meanwhile finds its run still locked by the old one's process (what a user who
    runs the sweep again a moment later never sees)."""
    import psutil

    from raydlrm.platform.run_lock import LOCK_FILE

    deadline = time.monotonic() + timeout_s
    for lock in storage.glob(f"*/{LOCK_FILE}"):
        try:
            pid = json.loads(lock.read_text())["pid"]
        except (OSError, ValueError):
            continue  # released meanwhile, or caught mid-write
        while psutil.pid_exists(pid) and time.monotonic() < deadline:
            time.sleep(0.5)


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.scenario
def test_a_sweep_killed_with_its_driver_continues_and_registers_the_best(
    tmp_path: Path, ray_cluster
) -> None:
    """A sweep whose driver is killed once a trial has finished continues when run again
    (Tune's experiment restore): the finished trial is kept, the others run, every trial is
    one child run, at most ``tune.max_concurrent_trials`` at a time, the best (on the
    validation set, with early stopping in every trial) is registered once; run again after it
    finished, it reports the same result."""
    import raydlrm

    config = _sweep_config(tmp_path)
    search = [
        "training.learning_rate=loguniform(1e-4, 1e-1)",
        "model.top_mlp=choice([16], [32, 16])",
    ]
    killed_at = _killed_after_a_trial(config, search, ray_cluster)
    result = raydlrm.tune(config, search=search)
    assert len(result.trials) == 3
    statuses = [t["status"] for t in result.trials]
    assert set(statuses) <= {"done", "stopped early"} and "done" in statuses
    done = [t for t in result.trials if t["status"] == "done"]
    # Ranked on validation (tune.metric's default with a validation set): each trial by its
    # best checkpoint, the model it registers; then scored on the eval data.
    assert result.best_metrics["valid/auc"] == max(t["valid/auc"] for t in done)
    best = result.best_metrics
    assert best["valid/auc"] == best["early_stopping/best"] and "eval/auc" in best
    assert set(result.best_config) == {"training.learning_rate", "model.top_mlp"}
    client = MlflowClient(config["tracking"]["tracking_uri"])
    children = client.search_runs(
        [client.get_run(result.run_id).info.experiment_id],
        filter_string=f"tags.mlflow.parentRunId = '{result.run_id}'",
    )
    assert len(children) == 3  # every trial a child run, none left running
    assert {r.info.status for r in children} <= {"FINISHED", "KILLED"}
    kill_ms = killed_at * 1000
    # A trial's last training report (ASHA-stopped trials' runs are ended with the sweep).
    last = {
        r.info.run_id: max(
            m.timestamp for m in client.get_metric_history(r.info.run_id, "train/loss")
        )
        for r in children
    }
    assert any(last[r.info.run_id] < kill_ms for r in children)  # kept, not run again
    # tune.max_concurrent_trials held before the kill: at most 2 of the 3 trials trained at a
    # time (it was once ignored, and all 3 started at once). A trial cut by the kill continued
    # its run after it: cut it there.
    before = [r for r in children if r.info.start_time < kill_ms]
    events = sorted(
        [(r.info.start_time, 1) for r in before]
        + [(min(last[r.info.run_id], kill_ms), -1) for r in before]
    )
    running = [sum(step for _, step in events[: i + 1]) for i in range(len(events))]
    assert max(running) <= 2, events
    parent = client.get_run(result.run_id)
    assert parent.data.tags["raydlrm.tune.best_run_id"] == result.best_run_id
    assert parent.data.metrics["valid/auc"] == result.best_metrics["valid/auc"]
    version = client.get_model_version("tuned", result.registered_model_version)
    assert version.run_id == result.best_run_id
    assert result.summary.splitlines()[-1].startswith("best: ")
    # The same sweep again (same run.name and storage) continues Tune's experiment: nothing is
    # left to run, the same best trial, no second registered version.
    again = raydlrm.tune(config, search=search)
    assert again.best_run_id == result.best_run_id and again.run_id == result.run_id
    assert again.registered_model_version == result.registered_model_version
    assert len(client.search_model_versions("name='tuned'")) == 1
    # From the command line: a bad search space is one line before any trial starts.
    from raydlrm.platform.cli import app

    bad = CliRunner().invoke(
        app, ["tune", "--search", "model.arch=uniform(1, 2)", "--set", "run.name=x"]
    )
    assert bad.exit_code == 2 and "needs a numeric key" in bad.output
