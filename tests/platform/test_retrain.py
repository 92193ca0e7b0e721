"""Scheduled retraining against a real ``mlflow server`` on loopback (registry, aliases,
artifacts on a loopback S3 bucket): no champion -> trains from scratch and becomes it; the same
slot again trains nothing; the next slot warm-starts from the champion on another number of
workers and, not better by the margin, becomes the challenger with its reason; a model with
non-finite weights is rejected and the champion stays. Plus the decision rule and bad input."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import shutil
from pathlib import Path

import pytest
import safetensors.torch
import torch
from mlflow import MlflowClient
from typer.testing import CliRunner

import raydlrm
from raydlrm.platform import retrain as retrain_module
from raydlrm.platform.cli import app
from raydlrm.platform.config import ConfigError, RetrainConfig
from raydlrm.platform.retrain import (
    TAG_DECISION,
    TAG_REASON,
    TAG_SLOT,
    RetrainError,
    decide,
    non_finite_tensors,
)
from raydlrm.platform.scoring import model_files
from raydlrm.storage import StorageError

DAYS = ["2026-11-19", "2026-11-20", "2026-11-21", "2026-11-22"]
ROWS_PER_DAY = 2000
MODEL = "retrain-test"


def _config(root: Path, tracking_uri: str) -> dict:
    return {
        "data": {
            "train_path": str(root / "data" / "train"),
            "eval_path": None,
            # One step covers a whole day on 2 or 3 workers: the warm-started run's first
            # (and only) training metrics are the champion's, on the same day.
            "batch_size": 1024,
            "table_size": 2000,
            "synthetic": {
                "generate": "if_missing",
                "num_train_rows": ROWS_PER_DAY * len(DAYS),
                "num_eval_rows": 0,
                "rows_per_file": 1000,
                "max_cardinality": 1500,
                "partitions": DAYS,
            },
        },
        # Wukong: warm start, evaluation, registration and scoring of its dense side.
        "model": {
            "arch": "wukong",
            "embedding_dim": 8,
            "bottom_mlp": [16, 8],
            "top_mlp": [16],
            "wukong_num_fm": 4,
            "wukong_num_lc": 4,
            "wukong_rank": 4,
            "wukong_fm_mlp": [16],
        },
        "training": {"num_epochs": 1, "log_every_steps": 1},
        "run": {"storage_path": str(root / "runs")},
        "tracking": {
            "tracking_uri": tracking_uri,
            "experiment_name": "retrain-test",
            "registered_model_name": MODEL,
        },
        "retrain": {"train_partitions": 1, "holdout_partitions": 1},
    }


def _cli(*args: str):
    return CliRunner().invoke(app, list(args))


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.scenario  # 4 slots, 3 trained, on a server of its own: the default tier's longest
def test_retraining_slots_against_mlflow_server(
    tmp_path: Path, ray_cluster, mlflow_server: str, caplog, capfd, monkeypatch
) -> None:
    config = _config(tmp_path, mlflow_server)
    client = MlflowClient(mlflow_server)

    # 1. No champion yet: trains from scratch on the day before the slot, says so, and becomes
    # the champion.
    caplog.set_level(logging.INFO, logger="raydlrm.platform.retrain")
    first = raydlrm.retrain(config, slot=DAYS[1])
    assert "has no champion version: training from scratch" in caplog.text
    assert first.from_scratch and not first.skipped
    assert (first.train_partitions, first.holdout_partitions) == ([DAYS[0]], [DAYS[1]])
    assert first.decision == "champion" and "no champion before" in first.reason
    champion = client.get_model_version_by_alias(MODEL, "champion")
    assert champion.version == first.version == "1"
    assert champion.tags[TAG_SLOT] == DAYS[1] and champion.tags[TAG_DECISION] == "champion"
    assert champion.run_id == first.run_id
    # The held-out AUC comes from scoring the registered model; the run holds it too.
    run = client.get_run(first.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.metrics["retrain/new_auc"] == pytest.approx(first.metrics["new/auc"])
    assert run.info.artifact_uri.startswith("mlflow-artifacts:")  # proxied to the S3 bucket
    # Registered without MLflow's "Successfully registered model ..." on the screen.
    assert "Successfully registered" not in capfd.readouterr().err

    # 2. The same slot again (the CLI, as a scheduler runs it): nothing is trained.
    runs_before = len(client.search_runs([run.info.experiment_id]))
    again = _cli("retrain", "--slot", DAYS[1], *_sets(config))
    assert again.exit_code == 0, again.output
    assert "already retrained" in again.stdout and "version 1 (champion)" in again.stdout
    assert len(client.search_runs([run.info.experiment_id])) == runs_before
    assert len(client.search_model_versions(f"name='{MODEL}'")) == 1
    repeat = raydlrm.retrain(config, slot=DAYS[1])  # the API gives the stored decision's metrics
    assert repeat.skipped and repeat.metrics == pytest.approx(first.metrics)

    # 3. The next slot, on 3 workers instead of 2: warm-started from the champion (resharded);
    # with an unreachable margin it becomes the challenger, with the comparison as reason.
    config["scaling"] = {"num_workers": 3}
    config["retrain"]["min_improvement"] = 1.0
    config["retrain"]["max_regression"] = 1.0
    second = raydlrm.retrain(config, slot=DAYS[2])
    assert not second.from_scratch and second.champion_version == "1"
    assert (second.train_partitions, second.holdout_partitions) == ([DAYS[1]], [DAYS[2]])
    assert second.decision == "challenger" and second.version == "2"
    assert "does not beat retrain.min_improvement=1.0" in second.reason
    assert set(second.metrics) == {"new/auc", "champion/auc"}
    assert client.get_model_version_by_alias(MODEL, "champion").version == "1"
    challenger = client.get_model_version_by_alias(MODEL, "challenger")
    assert challenger.version == "2" and challenger.tags[TAG_REASON] == second.reason
    # Warm start: the first step trains on DAYS[1] with the champion's exact weights, so its
    # training metrics are the champion's held-out metrics on that day (from a 2-worker
    # checkpoint on 3 workers).
    trained = second.train.metrics
    assert trained["warm_start/from_step"] == first.train.metrics["step"]
    assert trained["train/log_loss"] == pytest.approx(
        first.train.metrics["eval/log_loss"], rel=1e-5
    )
    assert trained["train/auc"] == pytest.approx(first.train.metrics["eval/auc"], abs=1e-6)

    # 4. A model that blows up: rejected, not registered, the champion untouched, exit 1 with
    # one error line. The slot's training job is stood in for by the champion's model with an
    # infinite row, as a step with an infinite embedding learning rate leaves it (training a
    # whole job for that cost about 30 s; the guard is what is tested here).
    config["scaling"] = {"num_workers": 2}
    monkeypatch.setattr(retrain_module, "run_training", _blown_up(first.train, tmp_path))
    failed = _cli("retrain", "--slot", DAYS[3], *_sets(config))
    assert failed.exit_code == 1, failed.output
    errors = [ln for ln in failed.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "champion unchanged" in errors[0]
    assert "non-finite" in errors[0]
    assert len(client.search_model_versions(f"name='{MODEL}'")) == 2
    assert client.get_model_version_by_alias(MODEL, "champion").version == "1"
    (rejected,) = client.search_runs(
        [run.info.experiment_id], filter_string=f"tags.`{TAG_DECISION}` = 'rejected'"
    )
    assert (
        rejected.data.tags[TAG_SLOT] == DAYS[3] and "non-finite" in rejected.data.tags[TAG_REASON]
    )


def _blown_up(trained: raydlrm.TrainResult, root: Path):
    """A stand-in for the slot's training job: returns the run of ``trained`` as a new MLflow
    run whose model is ``trained``'s with an infinite row."""

    def run_training(job) -> raydlrm.TrainResult:
        model = root / "blown-up"
        with model_files(trained.model_uri) as files:
            shutil.copytree(files.directory, model)
        weights = safetensors.torch.load_file(model / "model.safetensors")
        name = next(k for k in weights if k.startswith("embedding_bags.weights."))
        weights[name][3] = math.inf
        safetensors.torch.save_file(weights, model / "model.safetensors")
        client = MlflowClient(trained.tracking_uri)
        experiment = client.get_experiment_by_name(job.tracking.experiment_name)
        run = client.create_run(experiment.experiment_id)
        client.set_terminated(run.info.run_id)
        return dataclasses.replace(trained, run_id=run.info.run_id, model_uri=str(model))

    return run_training


def _sets(config: dict) -> list[str]:
    """``--set`` options that reproduce ``config`` on the command line."""
    out = []
    for section, values in config.items():
        for key, value in values.items():
            if value is None:
                continue
            text = _inline(value) if isinstance(value, dict) else json.dumps(value)
            out += ["--set", f"{section}.{key}={text}"]
    return out


def _inline(table: dict) -> str:
    return "{" + ", ".join(f"{k} = {json.dumps(v)}" for k, v in table.items()) + "}"


def test_decision_rule() -> None:
    auc = RetrainConfig(min_improvement=0.01, max_regression=0.05)
    assert decide(0.75, None, auc)[0] == "champion"
    assert decide(0.771, 0.76, auc)[0] == "champion"
    decision, reason = decide(0.765, 0.76, auc)
    assert decision == "challenger" and "0.765000 vs champion 0.760000 (+0.005000)" in reason
    assert decide(0.72, 0.76, auc)[0] == "challenger"  # worse, within the guard
    with pytest.raises(RetrainError, match=r"regressed beyond retrain\.max_regression=0\.05"):
        decide(0.70, 0.76, auc)
    with pytest.raises(RetrainError, match="nan"):
        decide(math.nan, 0.76, auc)
    loss = RetrainConfig(metric="log_loss", min_improvement=0.0, max_regression=0.1)
    assert decide(0.40, 0.45, loss)[0] == "champion"  # lower is better
    assert decide(0.45, 0.40, loss)[0] == "challenger"
    with pytest.raises(RetrainError):
        decide(0.60, 0.45, loss)


def test_non_finite_weights_are_named(tmp_path: Path) -> None:
    weights = {"dense.top.0.weight": torch.ones(2, 2), "embedding_bags.weights.t0": torch.ones(3)}
    weights["embedding_bags.weights.t0"][1] = math.inf
    safetensors.torch.save_file(weights, tmp_path / "model.safetensors")
    (tmp_path / "spec.json").write_text("{}")
    (tmp_path / "plan.json").write_text("{}")
    with model_files(str(tmp_path)) as files:
        assert non_finite_tensors(files) == ["embedding_bags.weights.t0"]
    weights["embedding_bags.weights.t0"][1] = 0.0
    safetensors.torch.save_file(weights, tmp_path / "model.safetensors")
    with model_files(str(tmp_path)) as files:
        assert non_finite_tensors(files) == []


@pytest.fixture(scope="module")
def daily(tmp_path_factory: pytest.TempPathFactory) -> dict:
    from raydlrm.ingestion import generate_synthetic
    from raydlrm.ingestion.synthetic_config import SyntheticConfig

    root = tmp_path_factory.mktemp("daily")
    config = _config(root, f"sqlite:///{root / 'mlflow.db'}")
    generate_synthetic(SyntheticConfig(**config["data"]["synthetic"]), out_dir=root / "data")
    return config


def test_missing_slot_partition_is_one_line_exit_2(daily: dict) -> None:
    result = _cli("retrain", "--slot", "2030-01-01", *_sets(daily))
    assert result.exit_code == 2, result.output
    (line,) = [ln for ln in result.stderr.splitlines() if ln.startswith("error:")]
    assert "partition date=2030-01-01 does not exist" in line and DAYS[-1] in line


def test_too_few_partitions_before_the_slot(daily: dict) -> None:
    with pytest.raises(StorageError, match=r"needs 2 partitions up to it .* found 1"):
        raydlrm.retrain(daily, slot=DAYS[0])


def test_unpartitioned_data_and_missing_model_name(daily: dict, tmp_path: Path) -> None:
    flat = {**daily, "data": {**daily["data"], "train_path": str(tmp_path / "flat")}}
    del flat["data"]["synthetic"]
    (tmp_path / "flat").mkdir()
    (tmp_path / "flat" / "part-0.parquet").write_bytes(
        next(Path(daily["data"]["train_path"]).rglob("*.parquet")).read_bytes()
    )
    with pytest.raises(StorageError, match="has no hive partitions date=<value>"):
        raydlrm.retrain(flat)
    nameless = {**daily, "tracking": {**daily["tracking"], "registered_model_name": None}}
    with pytest.raises(ConfigError, match=r"tracking\.registered_model_name"):
        raydlrm.retrain(nameless)


def test_cli_prints_a_skipped_slots_decision_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The decision is the command's result, printed once (not also logged by the library)."""
    from types import SimpleNamespace

    import raydlrm.platform.retrain as retrain_module

    version = SimpleNamespace(
        version="1",
        run_id="r1",
        tags={TAG_SLOT: "2026-01-02", TAG_DECISION: "challenger", TAG_REASON: "no better"},
    )
    client = SimpleNamespace(
        get_run=lambda run_id: SimpleNamespace(data=SimpleNamespace(metrics={})),
    )
    monkeypatch.setattr(
        retrain_module,
        "retrain",
        lambda config, **_: retrain_module._finish_slot(client, "m", version, RetrainConfig()),
    )
    result = _cli("retrain", "--slot", "2026-01-02")
    assert result.exit_code == 0, result.output
    assert (result.stdout + result.stderr).count("already retrained") == 1, result.output
