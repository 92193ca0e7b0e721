"""The summary's hint to open the MLflow UI runs as printed, with or without an activated
virtual environment."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from raydlrm.platform.summary import mlflow_command

BESIDE = Path(sys.executable).parent / "mlflow"


@pytest.mark.skipif(not BESIDE.is_file(), reason="no mlflow script beside this Python")
def test_mlflow_hint_names_the_venvs_mlflow_when_it_is_not_on_path(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # a shell whose venv is not activated
    monkeypatch.chdir(tmp_path)
    command = mlflow_command()
    assert Path(command) == BESIDE
    done = subprocess.run([command, "--version"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "mlflow" in done.stdout.lower(), done.stderr
    monkeypatch.chdir(BESIDE.parents[2])  # beside .venv/: the shorter, relative form
    assert mlflow_command() == os.path.relpath(BESIDE)
    (tmp_path / "mlflow").write_text("#!/bin/sh\n")
    (tmp_path / "mlflow").chmod(0o755)
    assert mlflow_command() == "mlflow"  # on PATH: as the user types it


def test_dedup_line_sums_the_deduplicated_tables() -> None:
    from raydlrm.platform.summary import _dedup_line

    assert _dedup_line({"train/auc": 0.7, "comm/fwd_bytes": 10.0}) is None
    metrics = {
        "dedup/t_C1/ratio": 6.0,
        "dedup/t_C1/lookups_saved": 1000.0,
        "dedup/t_C1/a2a_bytes_saved": 2**20,
        "dedup/t_C2/ratio": 4.0,
        "dedup/t_C2/lookups_saved": 500.0,
        "dedup/t_C2/a2a_bytes_saved": 2**21,
    }
    assert _dedup_line(metrics) == (
        "deduplicated (RecD): 2 tables, 5.00 samples per unique row; 1,500 lookups and 3.0 "
        "MiB of all-to-all saved (dedup/* in the run)"
    )


def test_the_stop_reason_names_what_ended_training() -> None:
    """Early stopping (where, and the step whose weights the model holds), ``max_steps``, or
    the epochs; with early stopping that ran every epoch, the best step when not the last."""
    from raydlrm.platform.config import load_config
    from raydlrm.platform.launch import stop_reason

    stopping = ["data.valid_split=random", "training.early_stopping.patience=3"]
    job = load_config(overrides=stopping)
    stopped = {"step": 40, "early_stopping/stopped_step": 40, "early_stopping/best_step": 10}
    stopped |= {"early_stopping/best": 0.75, "early_stopping/stopped_early": 1.0}
    assert stop_reason(job, stopped) == (
        "early stopping at step 40: valid/auc did not improve by more than 0 in 3 evaluations; "
        "the model is step 10's (best valid/auc 0.750000)"
    )
    # The patience spent at the last evaluation (step 50) cut nothing.
    ran = {"step": 50, "early_stopping/best_step": 30, "early_stopping/best": 0.7}
    ran["early_stopping/stopped_step"] = 50
    assert stop_reason(job, ran) == (
        "training.num_epochs = 1 done; the model is step 30's, the best valid/auc"
    )
    capped = load_config(overrides=["training.max_steps=5"])
    assert stop_reason(capped, {"step": 5}) == "training.max_steps = 5 reached"
