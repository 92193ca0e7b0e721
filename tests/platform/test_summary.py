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
