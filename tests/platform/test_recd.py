"""RecD on the driver: `raydlrm data cluster`, and the dedup groups `data.dedup = "infer"`
resolves before the plan is made."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from raydlrm.ingestion import SyntheticConfig, generate_synthetic
from raydlrm.platform.cli import app
from raydlrm.platform.config import ConfigError, load_config
from raydlrm.platform.job_data import resolve_dedup_groups, validate_job_data

USERS = [f"C{i}" for i in range(1, 9)]  # the default synthetic config's user features

runner = CliRunner()


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("recd")
    generate_synthetic(
        SyntheticConfig(
            num_train_rows=900,
            num_eval_rows=300,
            rows_per_file=300,
            max_cardinality=500,
            user_history_length=6,
        ),
        out_dir=root,
    )
    return root


def test_data_cluster_writes_the_clustered_set_once(data: Path, tmp_path: Path) -> None:
    out = tmp_path / "clustered"
    args = ["data", "cluster", "--out", str(out), "--set", f"data.train_path={data / 'train'}"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "wrote 900 samples and " in result.output
    assert f"({'+'.join(USERS)} once per session) in 3 files to {out}" in result.output
    assert json.loads((out / "_clustered.json").read_text())["session_columns"] == USERS
    again = runner.invoke(app, args)
    assert again.exit_code == 2 and "already holds files" in again.stderr
    inspect = runner.invoke(app, ["data", "inspect", "--path", str(out), "--json"])
    assert inspect.exit_code == 0, inspect.output
    report = json.loads(inspect.output)
    assert report["rows"] == 900 and report["recd"]["layout"] == "clustered"
    assert report["recd"]["user_columns"] == USERS


def _job(data: Path, *overrides: str):
    paths = [f"data.train_path={data / 'train'}", f"data.eval_path={data / 'eval'}"]
    return load_config(None, overrides=[*paths, *overrides])


def test_inferred_dedup_groups_are_resolved_from_the_training_data(data: Path) -> None:
    job = _job(data, "data.dedup=infer")
    resolved = resolve_dedup_groups(job, validate_job_data(job))
    assert resolved.data.dedup_groups == [USERS]
    assert resolved.worker_spec().data.dedup_groups == [USERS]  # what the workers get
    named = _job(data, "data.dedup=infer", 'data.dedup_groups=[["C1"]]')
    assert resolve_dedup_groups(named, validate_job_data(named)).data.dedup_groups == [["C1"]]
    off = _job(data)
    assert resolve_dedup_groups(off, validate_job_data(off)).data.dedup_groups == []
    no_sessions = _job(data, "data.dedup=infer", "data.session_column=visit")
    with pytest.raises(ConfigError, match=r"data.dedup = 'infer' needs sessions"):
        resolve_dedup_groups(no_sessions, validate_job_data(no_sessions))
