"""The command line: bad input stops before training with one line naming the key, path or
column, and exit code 2; the dry-run commands print what they should."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from raydlrm.ingestion import SyntheticConfig, generate_synthetic
from raydlrm.platform.cli import app

runner = CliRunner()


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("data")
    generate_synthetic(
        SyntheticConfig(
            num_train_rows=600, num_eval_rows=200, rows_per_file=300, max_cardinality=500
        ),
        out_dir=root,
    )
    return root


def _invoke(*args: str):
    return runner.invoke(app, list(args))


def _error_line(result) -> str:
    lines = [ln for ln in result.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_missing_config_file(tmp_path: Path) -> None:
    result = _invoke("train", "--config", str(tmp_path / "nope.toml"))
    assert result.exit_code == 2
    assert "nope.toml does not exist" in _error_line(result)


def test_unknown_config_key() -> None:
    result = _invoke("train", "--set", "training.learnig_rate=0.1")
    assert result.exit_code == 2
    assert "training.learnig_rate: unknown key" in _error_line(result)


def test_missing_data_path(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-dir"
    result = _invoke("train", "--set", f"data.train_path={missing}")
    assert result.exit_code == 2
    assert str(missing) in _error_line(result)


def test_empty_data_set(tmp_path: Path, tiny_data: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    schema = pq.read_schema(next((tiny_data / "train").glob("*.parquet")))
    pq.write_table(schema.empty_table(), empty / "part-0.parquet")
    result = _invoke(
        "train",
        "--set",
        f"data.train_path={empty}",
        "--set",
        f"data.eval_path={tiny_data / 'eval'}",
    )
    assert result.exit_code == 2
    assert "empty" in _error_line(result) and str(empty) in _error_line(result)


def test_missing_column(tmp_path: Path, tiny_data: Path) -> None:
    table = pq.read_table(tiny_data / "train").drop_columns(["C7"])
    bad = tmp_path / "bad"
    bad.mkdir()
    pq.write_table(table, bad / "part-0.parquet")
    result = _invoke(
        "train", "--set", f"data.train_path={bad}", "--set", f"data.eval_path={tiny_data / 'eval'}"
    )
    assert result.exit_code == 2
    assert "C7" in _error_line(result)


def test_unknown_subcommand_and_option() -> None:
    assert _invoke("trian").exit_code == 2
    assert _invoke("train", "--no-such-option").exit_code == 2


def test_plan_prints_per_rank_table() -> None:
    result = _invoke("plan", "--set", "scaling.num_workers=3")
    assert result.exit_code == 0, result.output
    for rank in ("0", "1", "2"):
        assert any(line.split()[:1] == [rank] for line in result.stdout.splitlines())
    as_json = json.loads(_invoke("plan", "--json", "--set", "scaling.num_workers=3").stdout)
    assert as_json["world_size"] == 3


def test_plan_uses_calibrated_constants_summary_and_capacity(tmp_path: Path) -> None:
    from raydlrm.sharding import CostConstants, save_constants

    def total_cost(*args: str) -> float:
        result = _invoke("plan", "--json", *args)
        assert result.exit_code == 0, result.output
        return sum(t["cost"] for t in json.loads(result.stdout)["tables"])

    path = save_constants(
        CostConstants(lookup_bytes_per_s=1.0, comm_bytes_per_s=1.0), tmp_path / "c.json"
    )
    missing = f"sharding.cost_constants_path={tmp_path / 'none.json'}"
    slow = total_cost("--set", f"sharding.cost_constants_path={path}")
    assert slow > 1000 * total_cost("--set", missing)
    many = _invoke("plan", "--set", "scaling.num_workers=64", "--set", missing)
    assert many.exit_code == 0, many.output
    assert "26 tables on 64 ranks" in many.stdout and "max/mean" in many.stdout
    full = _invoke("plan", "--set", "sharding.device_memory_bytes=1000", "--set", missing)
    assert full.exit_code == 2 and "cannot fit anywhere" in _error_line(full)


def test_config_show_and_validate() -> None:
    shown = json.loads(_invoke("config", "show", "--set", "model.arch=dcnv2").stdout)
    assert shown["model"]["arch"] == "dcnv2"
    assert _invoke("config", "validate").exit_code == 0
    bad = _invoke("config", "validate", "--set", "model.embedding_dim=6")
    assert bad.exit_code == 2 and "model.embedding_dim" in _error_line(bad)


def test_data_generate(tmp_path: Path) -> None:
    result = _invoke(
        "data",
        "generate",
        "--out",
        str(tmp_path / "d"),
        "--set",
        "data.synthetic.num_train_rows=500",
        "--set",
        "data.synthetic.num_eval_rows=100",
    )
    assert result.exit_code == 0, result.output
    assert pq.read_table(tmp_path / "d" / "train").num_rows == 500
