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
