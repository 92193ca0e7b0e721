"""End to end: ``python -m raydlrm train`` on a tiny synthetic data set with 2 Ray Train workers.

Checks that the model learns (held-out AUC well above 0.5), that the job made exactly one MLflow
run with the resolved config as params and the metrics by step, that the sharding plan is an
artifact, and that the registered model loads and scores raw rows without Ray. The run holds out
a validation set (one of the four training row groups, ``data.valid_split = "random"``) and
stops early on it: its registered model is the best validation checkpoint's weights.

The job runs where fbgemm cannot be imported (driver and Ray workers): the base install, on
the PyTorch embedding kernel (``sharding.kernel = "auto"`` falls back to it with one line).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import mlflow
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tomllib
import torch
from mlflow.tracking import MlflowClient
from typer.testing import CliRunner

from raydlrm.platform.cli import app
from raydlrm.trainers.model_dir import ModelWeights

pytestmark = [pytest.mark.ray, pytest.mark.slow]

CONFIG = """
[data]
train_path = "data/train"
eval_path = "data/eval"
batch_size = 500
table_size = 2000
valid_split = "random"
valid_fraction = 0.25

[data.synthetic]
generate = "if_missing"
num_train_rows = 40000
num_eval_rows = 8000
rows_per_file = 10000
max_cardinality = 3000
seed = 11

[model]
embedding_dim = 8
bottom_mlp = [32, 8]
top_mlp = [32]

[sharding]
learning_rate = 0.1

[training]
num_epochs = 2
learning_rate = 0.005
log_every_steps = 10
valid_every_steps = 60

# min_delta so large that only the first evaluation improves (step 60 of 80: 40 steps an epoch,
# two row groups on one worker); the one at the end (step 80) does not, and the model is step
# 60's.
[training.early_stopping]
patience = 1
min_delta = 0.5

[ray]
num_cpus = 4
object_store_memory = 400000000

[tracking]
experiment_name = "e2e"
registered_model_name = "e2e-model"
"""

AUC_THRESHOLD = 0.68  # the planted model's ceiling is ~0.80; chance is 0.5


@pytest.fixture(scope="module")
def finished_run(
    tmp_path_factory: pytest.TempPathFactory, no_fbgemm_path: str
) -> tuple[Path, subprocess.CompletedProcess]:
    workdir = tmp_path_factory.mktemp("e2e")
    (workdir / "run.toml").write_text(CONFIG)
    # What the screen shows depends on none of the suite's settings (Ray Data's progress).
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("MLFLOW_TRACKING_URI", "RAY_ADDRESS", "RAYDLRM_LOG_LEVEL")
        and not k.startswith("RAY_DATA_")
    }
    env["PYTHONPATH"] = os.pathsep.join([no_fbgemm_path, env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "raydlrm",
            "train",
            "--config",
            "run.toml",
            "--set",
            "run.name=e2e-run",
            # One int8 table (trained through its fp32 cache): exported and scored quantized.
            "--set",
            'sharding.weights_precision_per_table={ t_C3 = "int8" }',
            "--set",
            "sharding.cache_load_factor_per_table={ t_C3 = 0.5 }",
            # One bucketized dense column (a feature of its own): scored and exported with
            # the boundaries computed once over the training data.
            "--set",
            "data.dense_specs={ I1 = { buckets = 16 } }",
        ],
        cwd=workdir,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,  # the screen as a user sees it, in order
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-5000:]
    return workdir, proc


def test_summary_is_printed(finished_run) -> None:
    _, proc = finished_run
    out = proc.stdout
    for needle in (
        "raydlrm training summary",
        "auc",
        "samples/s",
        "sharding plan",
        "MLflow run:",
        "mlflow ui --backend-store-uri",
        "registered model: e2e-model",
        # Where fbgemm cannot be imported, the workers say which kernel they run instead.
        "sharding.kernel 'auto': using the torch kernel (fbgemm_gpu made unimportable)",
        "torch kernels",
    ):
        assert needle in out, out


def test_the_screen_is_quiet_and_ends_with_the_summary(finished_run) -> None:
    """What ``raydlrm train`` prints by default: progress lines, warnings and the summary,
    last; not fbgemm's, Ray Train's, Ray Data's or MLflow's INFO chatter (issue: a first
    screen of ~145 lines, most of them noise, worker lines after the summary)."""
    _, proc = finished_run
    lines = proc.stdout.splitlines()
    assert len(lines) <= 40, proc.stdout
    assert lines[-1].startswith("open the MLflow UI:"), proc.stdout
    for noise in (
        "TBE",  # fbgemm's argument dump, per table group and worker
        "Execution plan",  # Ray Data, per data set
        "progress UI",
        "Reporting training result",  # Ray Train, per report
        "Started training worker group",
        "Creating initial MLflow database tables",
        "Successfully registered model",
        "CloudPickle",
        "Inferred schema contains integer",
        "Token authentication",
        "Started a local Ray instance",
        # Ray's core, per preprocessing actor: a warning that reads as a failure (ray#53727).
        "constructor arguments in the object store",
    ):
        assert noise not in proc.stdout, proc.stdout


def test_one_mlflow_run_with_params_metrics_and_model(finished_run) -> None:
    workdir, _ = finished_run
    uri = f"sqlite:///{workdir / 'mlflow.db'}"
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("e2e")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1, "one MLflow run per job, not one per worker"
    run = runs[0]
    assert run.info.status == "FINISHED"
    params = run.data.params
    assert params["model.arch"] == "dlrm"
    assert params["scaling.num_workers"] == "2"
    # One of the four row groups of 10,000 rows is the validation set, never trained on.
    assert params["data.train_rows"] == "30000" and params["data.valid_rows"] == "10000"
    metrics = run.data.metrics
    assert metrics["eval/auc"] > AUC_THRESHOLD
    assert metrics["train/auc"] > 0.6
    # Every row of every epoch trained exactly once (no quarantine, nothing unaccounted).
    assert metrics["rows_unaccounted"] == 0
    assert metrics["data/rows_trained"] == metrics["data/rows_read"] == 2 * 30000
    assert metrics["data/rows_quarantined"] == 0
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert len(history) >= 3
    assert [m.step for m in history] == sorted(m.step for m in history)
    # The validation curve, the best step and why the run stopped.
    curve = client.get_metric_history(run.info.run_id, "valid/auc")
    assert sorted({m.step for m in curve}) == [60, 80]
    assert metrics["early_stopping/best_step"] == 60
    assert metrics["early_stopping/stopped_step"] == 80
    assert metrics["early_stopping/best"] == next(m.value for m in curve if m.step == 60)
    reason = run.data.tags["raydlrm.stop_reason"]
    assert reason.startswith("early stopping at step 80: valid/auc") and "step 60's" in reason
    # The model (the final checkpoint, registered) holds the best checkpoint's weights.
    final = Path(run.data.tags["raydlrm.checkpoint"].removeprefix("file://"))
    best = json.loads((final / "trainer_state.json").read_text())["validation"]
    best_dir = Path(best["early_stopping"]["best_checkpoint"])
    assert json.loads((best_dir / "trainer_state.json").read_text())["step"] == 60
    model, at_best = dict(ModelWeights(final).items()), dict(ModelWeights(best_dir).items())
    assert model.keys() == at_best.keys()
    assert all(torch.equal(model[k], at_best[k]) for k in model)
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "sharding")}
    assert artifacts == {"sharding/plan.json", "sharding/plan.txt"}
    plan = json.loads(
        Path(
            client.download_artifacts(run.info.run_id, "sharding/plan.json", str(workdir))
        ).read_text()
    )
    bucket_table = next(t for t in plan["tables"] if t["name"] == "t_I1_bucket")
    assert bucket_table["num_embeddings"] == 16
    versions = client.search_model_versions("name='e2e-model'")
    assert len(versions) == 1 and versions[0].run_id == run.info.run_id


def test_registered_model_scores_raw_rows(finished_run) -> None:
    """The run's model is registered by reference (a local run storage, a local tracking
    store): MLflow's artifact store holds its config and the checkpoint's URI, no weights; it
    loads them from the final checkpoint and scores raw rows."""
    workdir, _ = finished_run
    mlflow.set_tracking_uri(f"sqlite:///{workdir / 'mlflow.db'}")
    client = MlflowClient()
    (version,) = client.search_model_versions("name='e2e-model'")
    run = client.get_run(version.run_id)
    assert run.data.tags["raydlrm.model_weights"] == "reference"
    (workdir / "registered").mkdir()
    stored = Path(
        mlflow.artifacts.download_artifacts(
            "models:/e2e-model/1", dst_path=str(workdir / "registered")
        )
    )
    files = {p.name for p in stored.rglob("*") if p.is_file()}
    assert "weights_ref.json" in files and "model.safetensors" not in files
    assert not any(n.endswith(".distcp") for n in files)
    (ref,) = stored.rglob("weights_ref.json")
    assert json.loads(ref.read_text()) == {"checkpoint": run.data.tags["raydlrm.checkpoint"]}
    model = mlflow.pyfunc.load_model("models:/e2e-model/1")
    rows = pd.read_parquet(workdir / "data" / "eval").head(2000)
    probs = np.asarray(model.predict(rows.drop(columns=["label", "sample_id", "session_id"])))
    assert probs.shape == (2000,)
    assert np.all((probs > 0) & (probs < 1))
    # The registered model is the trained one: it ranks held-out clicks well.
    from sklearn.metrics import roc_auc_score

    assert roc_auc_score(rows["label"], probs) > AUC_THRESHOLD


def _cli(workdir: Path, *args: str, ray_address: str | None = None) -> subprocess.CompletedProcess:
    """``python -m raydlrm <args>`` in ``workdir``; on the Ray cluster at ``ray_address`` (the
    session's: a local instance for each of these runs cost seconds to start), else none."""
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "RAY_ADDRESS")}
    env["RAY_DATA_DISABLE_PROGRESS_BARS"] = "1"
    if ray_address:
        env["RAY_ADDRESS"] = ray_address
    return subprocess.run(
        [sys.executable, "-m", "raydlrm", *args],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_batch_scoring_and_evaluation(finished_run, ray_cluster) -> None:
    """``raydlrm score`` writes one prediction per row, equal to the registered model's;
    ``raydlrm evaluate`` gives the AUC of those predictions; a bad row stops scoring, named
    (on the session's Ray cluster, as on a cluster the job names)."""
    workdir, _ = finished_run
    cluster = ray_cluster.get_runtime_context().gcs_address
    proc = _cli(workdir, "score", "models:/e2e-model/1", "data/eval", "preds", ray_address=cluster)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "scored 8000 rows" in proc.stdout
    preds = pd.read_parquet(workdir / "preds")
    assert len(preds) == 8000 and set(preds.columns) == {"sample_id", "label", "prediction"}
    assert preds["sample_id"].is_unique
    rows = pd.read_parquet(workdir / "data" / "eval")
    mlflow.set_tracking_uri(f"sqlite:///{workdir / 'mlflow.db'}")
    model = mlflow.pyfunc.load_model("models:/e2e-model/1")
    expected = np.asarray(model.predict(rows.drop(columns=["label", "sample_id", "session_id"])))
    merged = rows[["sample_id"]].assign(expected=expected).merge(preds, on="sample_id")
    assert len(merged) == 8000
    np.testing.assert_allclose(merged["prediction"], merged["expected"], rtol=1e-5, atol=1e-6)

    from sklearn.metrics import roc_auc_score

    proc = _cli(workdir, "evaluate", "models:/e2e-model/1", "data/eval", ray_address=cluster)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads(proc.stdout.strip().splitlines()[-1])
    assert metrics["rows"] == 8000 and metrics["auc"] > AUC_THRESHOLD
    assert abs(metrics["auc"] - roc_auc_score(rows["label"], expected)) < 1e-4

    bad = workdir / "bad"
    bad.mkdir()
    table = pq.read_table(next((workdir / "data" / "eval").glob("*.parquet")))
    column = table.column("C3").to_pylist()
    column[7] = None
    table = table.set_column(table.schema.get_field_index("C3"), "C3", pa.array(column))
    pq.write_table(table, bad / "broken.parquet")
    proc = _cli(workdir, "score", "models:/e2e-model/1", "bad", "bad-preds", ray_address=cluster)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "broken.parquet" in proc.stderr and "C3" in proc.stderr
    assert "row group 0, row 7:" in proc.stderr and "quarantine" not in proc.stderr


def test_ids_of_another_kind_are_refused_naming_the_column(finished_run, ray_cluster) -> None:
    """The model records each sparse column's id kind; the same ids as strings would hash to
    other rows: ``score`` (exit 2) and the MLflow model refuse them, naming column and kinds."""
    workdir, _ = finished_run
    client = MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    (version,) = client.search_model_versions("name='e2e-model'")
    checkpoint = client.get_run(version.run_id).data.tags["raydlrm.checkpoint"]
    spec = json.loads(Path(checkpoint, "spec.json").read_text())
    assert spec["data"]["id_kinds"]["C1"] == "integer"
    strings = workdir / "strings"
    strings.mkdir()
    table = pq.read_table(next((workdir / "data" / "eval").glob("*.parquet")))
    index = table.schema.get_field_index("C1")
    table = table.set_column(index, "C1", table.column("C1").cast(pa.string()))
    pq.write_table(table, strings / "part-0.parquet")
    cluster = ray_cluster.get_runtime_context().gcs_address
    proc = _cli(
        workdir, "score", "models:/e2e-model/1", "strings", "string-preds", ray_address=cluster
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert "sparse column 'C1' holds string ids" in line and "trained on integer ids" in line
    mlflow.set_tracking_uri(f"sqlite:///{workdir / 'mlflow.db'}")
    model = mlflow.pyfunc.load_model("models:/e2e-model/1")
    rows = table.to_pandas().drop(columns=["label", "sample_id", "session_id"]).head(20)
    with pytest.raises(Exception, match=r"C1"):  # MLflow's signature check, or the model's
        model.predict(rows)


def test_export_checkpoint_to_directory_and_registry(finished_run) -> None:
    """``raydlrm export`` turns the run's final checkpoint (recorded on the MLflow run) into a
    self-contained model directory and a new registered model, both scoring like the model
    the job registered, and neither carrying the training state."""
    workdir, _ = finished_run
    client = MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    (version,) = client.search_model_versions("name='e2e-model'")
    checkpoint = client.get_run(version.run_id).data.tags["raydlrm.checkpoint"]
    assert Path(checkpoint, "trainer_state.json").is_file()
    # The weights are stored once, as the training state's shards: no second copy beside them.
    assert not any(Path(checkpoint, n).exists() for n in ("model.pt", "model.safetensors"))
    proc = _cli(workdir, "export", checkpoint, "--output", "exported", "--register", "e2e-exported")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "registered: e2e-exported version 1" in proc.stdout
    mlflow.set_tracking_uri(f"sqlite:///{workdir / 'mlflow.db'}")
    rows = pd.read_parquet(workdir / "data" / "eval").head(500)
    features = rows.drop(columns=["label", "sample_id", "session_id"])
    expected = np.asarray(mlflow.pyfunc.load_model("models:/e2e-model/1").predict(features))
    for uri in (str(workdir / "exported"), "models:/e2e-exported/1"):
        np.testing.assert_array_equal(mlflow.pyfunc.load_model(uri).predict(features), expected)
    # The signature types each column: ids, dense values, and the multi-valued C26 as a list.
    types = {
        c.name: str(c.type).removeprefix("DataType.")
        for c in mlflow.models.get_model_info("models:/e2e-exported/1").signature.inputs.inputs
    }
    assert (types["C1"], types["I1"], types["C26"]) == ("long", "float", "Array(long)"), types
    exported = {p.name for p in (workdir / "exported").rglob("*") if p.is_file()}
    assert "model.safetensors" in exported and not any(n.endswith(".distcp") for n in exported)
    # The int8 table is exported as its codes (and fp16 scale, bias), not as an fp32 weight.
    from safetensors import safe_open

    weights = next((workdir / "exported").rglob("model.safetensors"))
    with safe_open(str(weights), framework="pt") as f:
        names = set(f.keys())
        codes = f.get_slice("embedding_bags.quantized.t_C3.codes")
        assert (codes.get_dtype(), codes.get_shape()) == ("U8", [2000, 8])
    assert "embedding_bags.weights.t_C3" not in names
    assert "embedding_bags.weights.t_C4" in names
    assert "trainer_state.json" not in exported
    missing = _cli(workdir, "export", str(workdir / "data"), "--output", "x")
    assert missing.returncode == 2 and "is not a checkpoint directory" in missing.stderr
    # An output directory in the way, and a damaged checkpoint: one line each, before any
    # weight is read or written.
    runner = CliRunner()
    taken = runner.invoke(app, ["export", checkpoint, "--output", str(workdir / "exported")])
    assert taken.exit_code == 2, taken.output
    assert _one_error(taken).endswith("exported exists and is not empty: give a new directory")
    damaged = workdir / "damaged"
    shutil.copytree(checkpoint, damaged)
    shard = max(damaged.glob("*.distcp"), key=lambda p: p.stat().st_size)
    shard.write_bytes(shard.read_bytes()[:-16])
    for args in (
        ["export", str(damaged), "--output", str(workdir / "from-damaged")],
        ["score", str(damaged), str(workdir / "data" / "eval"), str(workdir / "damaged-preds")],
    ):
        result = runner.invoke(app, args)
        assert result.exit_code == 2, result.output
        line = _one_error(result)
        assert f"checkpoint {damaged} is damaged: {shard.name} has" in line, line
    assert not (workdir / "from-damaged").exists()


def _one_error(result) -> str:
    lines = [ln for ln in result.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    return lines[0]


def test_warm_start_names_a_registered_model(finished_run) -> None:
    """``run.warm_start = "models:/<name>@<alias>"`` (or ``/<version>``) means the training
    checkpoint of the version's run (its tag, however the model holds its weights); a missing
    version is a config error naming it. Relative-path resolution leaves the URI alone."""
    from raydlrm.platform.config import ConfigError, load_config
    from raydlrm.platform.preflight import resolve_paths
    from raydlrm.platform.tracking import registered_checkpoint

    workdir, _ = finished_run
    uri = f"sqlite:///{workdir / 'mlflow.db'}"
    client = MlflowClient(uri)
    (version,) = client.search_model_versions("name='e2e-model'")
    client.set_registered_model_alias("e2e-model", "champion", version.version)
    checkpoint = client.get_run(version.run_id).data.tags["raydlrm.checkpoint"]
    for model in ("models:/e2e-model/1", "models:/e2e-model@champion"):
        assert registered_checkpoint(model, uri) == checkpoint
    with pytest.raises(ConfigError, match="models:/e2e-model/7"):
        registered_checkpoint("models:/e2e-model/7", uri)
    job = load_config({"run": {"warm_start": "models:/e2e-model@champion"}})
    assert resolve_paths(job).run.warm_start == "models:/e2e-model@champion"


def test_a_warm_start_from_another_model_is_refused_naming_the_keys(finished_run) -> None:
    """A warm start checks the model its checkpoint was trained with, not only its tables
    and optimizer: another top MLP, or towers the checkpoint's model has not, would load its
    weights into other layers (towers of equal sizes over other features loaded silently).
    Refused before Ray starts, naming each key with both values."""
    import raydlrm
    from raydlrm.platform.config import ConfigError

    workdir, _ = finished_run
    client = MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    (version,) = client.search_model_versions("name='e2e-model'")
    checkpoint = client.get_run(version.run_id).data.tags["raydlrm.checkpoint"]
    halves = [
        [f"C{i}" for i in range(1, 27, 2)],
        [f"C{i}" for i in range(2, 27, 2)] + ["I1_bucket"],
    ]
    for overrides, named in (
        ({"top_mlp": [16]}, "model.top_mlp: [32] in the checkpoint, [16] in the config"),
        ({"towers": halves}, "model.towers: None in the checkpoint"),
    ):
        config = tomllib.loads(CONFIG)
        config["data"].update(
            train_path=str(workdir / "data" / "train"),
            eval_path=str(workdir / "data" / "eval"),
            dense_specs={"I1": {"buckets": 16}},  # as the run was trained
        )
        config["model"].update(overrides)
        config["run"] = {"warm_start": checkpoint, "storage_path": str(workdir / "runs")}
        config["tracking"]["tracking_uri"] = f"sqlite:///{workdir / 'mlflow.db'}"
        with pytest.raises(ConfigError, match=re.escape(named)):
            raydlrm.train(config, overrides=["run.name=warm-start-refused"])
