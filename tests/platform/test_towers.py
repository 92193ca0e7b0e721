"""Disaggregated Multi-Tower end to end on the local Ray cluster: ``model.towers = "auto"``
(the driver's warm-up and partitioner), compressing tower modules on DCNv2, 2 workers as 2
hosts of one rank (``scaling.ranks_per_host``): each tower's tables on its host, the cross-host
bytes counted, and the final checkpoint scoring in one process, without Ray, as the run
evaluated it. The config's refusals (before Ray starts) and a resumed run taking its
checkpoint's towers are in ``tests/platform/test_config.py``; that a tower run's checkpoint
continues exactly (weights, optimizer state, logits two steps later), also on another
topology, is ``tests/trainers/test_checkpoint.py::test_towers_on_hosts_reshard_and_continue``
(gloo), and that a killed worker resumes exactly through Ray is ``test_resume.py``'s.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from mlflow.tracking import MlflowClient
from sklearn.metrics import roc_auc_score

import raydlrm
from raydlrm.ingestion import Preprocessor
from raydlrm.ingestion.loader import arrow_to_batch
from raydlrm.trainers.checkpoints import read_state_file
from raydlrm.trainers.model_dir import ModelWeights, load_model_checkpoint

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ROWS = 1536  # 2 workers x 128: 6 steps an epoch


def _config(root: Path, name: str) -> dict:
    return {
        "data": {
            "train_path": str(root / "data" / "train"),
            "eval_path": str(root / "data" / "eval"),
            "batch_size": 128,
            "table_size": 500,
            "synthetic": {
                "generate": "if_missing",
                "num_train_rows": ROWS,
                "num_eval_rows": 512,
                "rows_per_file": 512,
                "max_cardinality": 400,
            },
        },
        "model": {
            "arch": "dcnv2",
            "embedding_dim": 8,
            "bottom_mlp": [16, 8],
            "top_mlp": [16],
            "dcn_num_layers": 1,
            "dcn_low_rank": 8,
            "towers": "auto",
            "num_towers": 3,
            "tower_dim": 16,
            "tower_warmup_steps": 4,
        },
        "training": {"num_epochs": 2, "log_every_steps": 2},
        "checkpoint": {"every_steps": 3},
        "scaling": {"num_workers": 2, "ranks_per_host": 1},
        "run": {"storage_path": str(root / "runs"), "name": name},
        "tracking": {
            "tracking_uri": f"sqlite:///{root / 'mlflow.db'}",
            "experiment_name": "towers",
            "registered_model_name": None,
        },
    }


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory, ray_cluster):
    root = tmp_path_factory.mktemp("towers")
    return root, raydlrm.train(_config(root, "clean"))


def _towers(result: raydlrm.TrainResult) -> list[list[str]]:
    return read_state_file(result.checkpoint_path)["spec"]["model"]["towers"]


def test_auto_towers_put_each_towers_tables_on_its_host(uninterrupted) -> None:
    _, clean = uninterrupted
    towers = _towers(clean)
    features = [f"C{i}" for i in range(1, 27)]
    assert len(towers) == 3 and sorted(f for t in towers for f in t) == sorted(features)
    # Each tower's tables on its host: tower i on host (here rank) i % 2.
    ranks = {s.rank for t in clean.plan.tables for s in t.shards}
    for i, tower in enumerate(towers):
        assert {s.rank for t in clean.plan.tables if t.name[2:] in tower for s in t.shards} == {
            i % 2
        }, tower
    assert ranks == {0, 1}
    assert any(
        k.startswith("dense.blocks.tower2.") for k, _ in ModelWeights(clean.checkpoint_path).items()
    )
    # Cross-host bytes are counted and named apart from the host's own all-to-all.
    metrics = MlflowClient(clean.tracking_uri).get_run(clean.run_id).data.metrics
    assert any(k.startswith("comm/cross_forward") for k in metrics), sorted(metrics)


def test_tower_model_scores_in_one_process(uninterrupted) -> None:
    """The final checkpoint, unsharded without Ray: the same AUC as the run's evaluation."""
    root, clean = uninterrupted
    loaded = load_model_checkpoint(clean.checkpoint_path)
    data = loaded.spec.data
    table = Preprocessor(data)(pq.read_table(root / "data" / "eval"))
    batch = arrow_to_batch(table, config=data)
    with torch.no_grad():
        scores = torch.sigmoid(loaded.model(batch))
    auc = roc_auc_score(batch.labels.numpy(), scores.numpy())
    assert auc == pytest.approx(clean.metrics["eval/auc"], abs=1e-6)
