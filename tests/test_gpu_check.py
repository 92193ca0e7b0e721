"""``make gpu-check`` (benchmarks/gpu_check.py) where there is no CUDA: one line, exit 0."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_check.py"


def _check(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path / "out")],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_without_cuda_says_so_in_one_line_and_exits_0(tmp_path: Path) -> None:
    done = _check(tmp_path, CUDA_VISIBLE_DEVICES="")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [done.stdout.strip()]
    assert done.stdout.startswith("gpu-check: no CUDA device here")
    assert not (tmp_path / "out").exists()  # nothing run, nothing written


def test_without_torch_says_so_in_one_line_and_exits_0(tmp_path: Path) -> None:
    fake = tmp_path / "no_torch" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('raise ImportError("torch made unimportable")\n')
    done = _check(tmp_path, PYTHONPATH=str(fake.parent))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "gpu-check: torch is not installed here, so there is no CUDA to check; nothing run"
    ]
