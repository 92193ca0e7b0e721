"""Multi-node fault tolerance: a simulated two-node cluster (``ray.cluster_utils.Cluster``) loses
the node its training workers run on mid-epoch; the job restarts them on the other node from the
latest checkpoint and completes, every sample trained exactly once."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from mlflow.tracking import MlflowClient

from tests.platform._multinode import ROWS

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.scenario]

REPO = Path(__file__).resolve().parents[2]


def test_job_survives_losing_a_node(tmp_path: Path) -> None:
    # Its own process: the simulated cluster cannot share the test session's Ray.
    proc = subprocess.run(
        [sys.executable, "-m", "tests.platform._multinode", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    out = json.loads(lines[-1])
    assert out["error"] is None and out["finished"], out["error"]
    # The workers' node was removed, and is gone from the cluster.
    assert out["removed"] and set(out["removed"]) <= set(out["workers_before"])
    assert not set(out["removed"]) & set(out["live_nodes"])
    # Training went on from a checkpoint, not from scratch, and trained every sample once.
    history = MlflowClient(out["tracking_uri"]).get_metric_history(
        out["run_id"], "restore/from_step"
    )
    assert history and min(m.value for m in history) >= 16
    assert out["metrics"]["samples_seen"] == ROWS
    logs = [np.load(p) for p in sorted(Path(tmp_path, "samples", "multinode").glob("*.npy"))]
    counts = Counter(np.concatenate(logs).tolist())
    assert len(counts) == ROWS and set(counts.values()) == {1}
