"""The command line: bad input stops before training with one line naming the key, path or
column, and exit code 2; the dry-run commands print what they should."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
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
    assert f"data.train_path: {missing} does not exist" in _error_line(result)


def test_the_quickstart_with_a_wrong_base_dir_trains_on_no_made_up_data(
    tmp_path: Path, monkeypatch
) -> None:
    """The shipped config, its relative paths under a ``RAYDLRM_BASE_DIR`` that does not exist:
    exit 2 naming the key and the resolved path, how to write the synthetic data set, and
    nothing written (it once generated 200,000 rows there, trained and registered a model)."""
    base = tmp_path / "no-such-base"
    monkeypatch.setenv("RAYDLRM_BASE_DIR", str(base))
    config = Path(__file__).resolve().parents[2] / "configs" / "quickstart.toml"
    result = _invoke("train", "--config", str(config))
    assert result.exit_code == 2, result.output
    line = _error_line(result)
    assert f"data.train_path: {base}/data/synthetic/train does not exist" in line
    assert f"RAYDLRM_BASE_DIR={base}" in line and "raydlrm data generate" in line
    assert not base.exists()


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


@pytest.fixture
def no_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    """Starting Ray fails the test (the session's own cluster may already run in this
    process, so ``ray.is_initialized()`` cannot tell)."""

    def refuse(job) -> None:
        raise AssertionError("Ray started before the job was refused")

    monkeypatch.setattr("raydlrm.platform.launch.init_ray", refuse)


def test_a_statistic_the_data_cannot_give_is_bad_input_before_ray(
    tmp_path: Path, no_ray: None
) -> None:
    """``data.dense_fill = "mean"`` on a column with no present value: the plain ValueError of
    the statistics pass, before Ray starts, is exit 2 and one line naming the column and the
    data (it was exit 1, "training failed" and a traceback: the command line tells bad input
    by its type, and planning now gives every such error that type)."""
    data = tmp_path / "data"
    data.mkdir()
    nulls = pa.array([None] * 100, pa.float64())
    pq.write_table(
        pa.table({"label": [i % 2 for i in range(100)], "I1": nulls, "C1": list(range(100))}),
        data / "part-0.parquet",
    )
    result = _invoke(
        "train",
        f"--set=data.train_path={data}",
        f"--set=data.eval_path={data}",
        '--set=data.dense_columns=["I1"]',
        '--set=data.sparse_columns=["C1"]',
        "--set=data.dense_fill=mean",
        f"--set=run.storage_path={tmp_path / 'runs'}",
        f"--set=tracking.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
    )
    assert result.exit_code == 2, result.output
    line = _error_line(result)
    assert line.startswith("error: data.dense_fill = 'mean': dense column 'I1' has no present")
    assert f"in the data at {data} " in line
    assert "Traceback" not in result.output and "failed" not in line


def _managed_run(tmp_path: Path, *, batch_size: int) -> list[str]:
    """A data set of 2,000 rows whose ids of C1 are nearly all distinct, and the settings of
    a run whose managed table of C1 holds 199 of them (200 rows, one bucket)."""
    import numpy as np

    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    rng = np.random.default_rng(0)
    table = {"label": rng.integers(0, 2, 2000), "I1": rng.random(2000)}
    pq.write_table(pa.table({**table, "C1": rng.integers(0, 10**6, 2000)}), data / "p.parquet")
    return [
        f"--set=data.train_path={data}",
        f"--set=data.eval_path={data}",
        '--set=data.dense_columns=["I1"]',
        '--set=data.sparse_columns=["C1"]',
        "--set=data.table_sizes.C1=200",
        "--set=data.managed_ids.C1.eviction=lru",
        f"--set=data.batch_size={batch_size}",
        f"--set=run.storage_path={tmp_path / 'runs'}",
        f"--set=tracking.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
    ]


def test_a_managed_table_below_one_steps_ids_stops_before_ray(tmp_path: Path, no_ray: None) -> None:
    """One step's distinct ids (512 rows, about 512 ids) outnumber the table's 199 slots: no
    eviction can make room, since a row looked up in a step stays its id's for the step. It
    was found by the first step, after Ray started, suggesting a wider probe_window (here 128,
    already wider than the bucket's 199 slots... of which none can be freed)."""
    from raydlrm.platform.config import load_config
    from raydlrm.platform.job_data import check_managed_capacity

    result = _invoke("train", *_managed_run(tmp_path, batch_size=512))
    assert result.exit_code == 2, result.output
    line = _error_line(result)
    assert line.startswith(
        "error: data.managed_ids.t_C1: one training step looks up more distinct ids of table "
        "'t_C1' than the 199 it holds (200 rows less a fallback row per bucket): 1,024 rows "
        "drawn at random from the first 2,000 of"
    )
    assert "hold 1,024 (a step trains 1,024: data.batch_size 512 x 2 workers)" in line
    assert "raise data.table_sizes.t_C1 well above 1,024" in line
    # About 199 of the rows drawn hold 199 ids: a worker's batch of 99 (of the 2 workers).
    assert line.endswith("or lower data.batch_size to at most 99")
    # A batch whose ids fit passes the check (it reads only the sample).
    sets = [s.removeprefix("--set=") for s in _managed_run(tmp_path, batch_size=64)]
    sample = pq.read_table(tmp_path / "data")
    check_managed_capacity(load_config(None, overrides=sets), sample, where="data")


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
    off = "sharding.memory_budget=off"  # 64 workers do not fit this machine
    many = _invoke("plan", "--set", "scaling.num_workers=64", "--set", missing, "--set", off)
    assert many.exit_code == 0, many.output
    assert "26 tables on 64 ranks" in many.stdout and "max/mean" in many.stdout
    full = _invoke("plan", "--set", "sharding.device_memory_bytes=1000", "--set", missing)
    assert full.exit_code == 2 and "cannot fit anywhere" in _error_line(full)


def _node_memory(monkeypatch: pytest.MonkeyPatch, total: int) -> None:
    """This machine has ``total`` bytes and runs a local Ray cluster."""
    import psutil

    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(total=total))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


def test_plan_shows_memory_against_the_default_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    _node_memory(monkeypatch, 24 * 2**30)
    result = _invoke("plan")  # 26 tables of 100,000 x 16 on 2 workers
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].endswith("memory / budget")
    assert all(ln.endswith("84.30 MiB / 11.00 GiB") for ln in lines[2:4])
    assert lines[-1] == (
        "memory budget 11.00 GiB per worker = 24.00 GiB node memory / 2 workers - 1.00 GiB overhead"
    )
    many = _invoke(
        "plan", "--set", "scaling.num_workers=64", "--set", "sharding.worker_overhead_bytes=0"
    )
    assert "memory / budget: max 6.48 MiB / 384.00 MiB (1.7%)" in many.stdout, many.output


def test_a_plan_over_the_budget_stops_before_ray_starts(
    monkeypatch: pytest.MonkeyPatch, tiny_data: Path
) -> None:
    # 50 MiB per worker holds 7 of the 13 tables (6,800,000 bytes each) a rank needs.
    _node_memory(monkeypatch, 2 * (2**30 + 50 * 2**20))
    line = (
        r"error: table 't_C\d+' \(table_wise, 6800000 bytes of weights and optimizer state\) does "
        r"not fit on rank [01]: .* short by 1971200 bytes \(1\.88 MiB\); budget 50\.00 MiB per "
        r"worker = 2\.10 GiB node memory / 2 workers - 1\.00 GiB overhead$"
    )
    planned = _invoke("plan")
    assert planned.exit_code == 2
    assert re.match(line, _error_line(planned))

    def no_ray(job) -> None:
        raise AssertionError("Ray started before the plan was checked")

    monkeypatch.setattr("raydlrm.platform.launch.init_ray", no_ray)
    data = [f"data.train_path={tiny_data / 'train'}", f"data.eval_path={tiny_data / 'eval'}"]
    trained = _invoke("train", "--set", data[0], "--set", data[1])
    assert trained.exit_code == 2, trained.output
    assert re.match(line, _error_line(trained))
    # The API's Ray ScalingConfig sets the workers' memory resource, hence the budget.
    from ray.train import ScalingConfig

    from raydlrm.platform.config import ConfigError
    from raydlrm.platform.launch import train

    scaling = ScalingConfig(
        num_workers=2, resources_per_worker={"CPU": 0.5, "memory": 2**30 + 50 * 2**20}
    )
    with pytest.raises(ConfigError, match=r"short by 1971200 bytes .* = 1\.05 GiB scaling\."):
        train(overrides=data, scaling_config=scaling)


def test_unwritable_run_storage_stops_before_ray_starts(
    monkeypatch: pytest.MonkeyPatch, tiny_data: Path, tmp_path: Path
) -> None:
    """A storage path that cannot be written is found before Ray starts (it took a Ray start
    and left a FAILED MLflow run behind), in one line naming the key."""

    def no_ray(job) -> None:
        raise AssertionError("Ray started before the run storage was checked")

    monkeypatch.setattr("raydlrm.platform.launch.init_ray", no_ray)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    trained = _invoke(
        "train",
        "--set",
        f"data.train_path={tiny_data / 'train'}",
        "--set",
        f"data.eval_path={tiny_data / 'eval'}",
        "--set",
        f"run.storage_path={blocker / 'runs'}",
    )
    assert trained.exit_code == 2, trained.output
    assert re.match(
        r"error: run\.storage_path: cannot write checkpoints to .*a-file", _error_line(trained)
    )


def test_unwritable_or_too_small_ssd_path_stops_before_ray_starts(
    monkeypatch: pytest.MonkeyPatch, tiny_data: Path, tmp_path: Path
) -> None:
    """SSD-tier tables whose directory cannot be written, or whose disk is too small, stop the
    job before Ray starts, in one line naming the tables and the path."""

    def no_ray(job) -> None:
        raise AssertionError("Ray started before the SSD path was checked")

    monkeypatch.setattr("raydlrm.platform.launch.init_ray", no_ray)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    data = ["--set", f"data.train_path={tiny_data / 'train'}"]
    data += ["--set", f"data.eval_path={tiny_data / 'eval'}"]
    ssd = ["--set", 'sharding.placement={ t_C1 = "ssd" }']
    unwritable = _invoke("train", *data, *ssd, "--set", f"sharding.ssd_path={blocker / 'ssd'}")
    assert unwritable.exit_code == 2, unwritable.output
    assert re.match(
        r"error: ssd tables \['t_C1'\]: cannot write to .*a-file/ssd \(sharding\.ssd_path\)",
        _error_line(unwritable),
    )
    huge = ["--set", "data.table_size=100000000000", "--set", "sharding.memory_budget=off"]
    too_small = _invoke("train", *data, *ssd, *huge, "--set", f"sharding.ssd_path={tmp_path}")
    assert too_small.exit_code == 2, too_small.output
    assert re.match(
        rf"error: ssd tables \['t_C1'\] need .* TiB on {tmp_path} \(sharding\.ssd_path\) but",
        _error_line(too_small),
    )


_RAY_TIMES_OUT = """
import os, sys
import psutil
# Ray waits this long for its GCS to start (30 s by default, which a busy machine exceeds).
os.environ["RAY_gcs_server_port_wait_time_s"] = "0"
from raydlrm.platform.cli import app
data = sys.argv[1]
try:
    app(["train", "--set", f"data.train_path={data}/train", "--set", f"data.eval_path={data}/eval"])
except SystemExit as e:
    print("exit", e.code)
print("left", [p.name() for p in psutil.Process().children(recursive=True)])
"""


@pytest.mark.ray
@pytest.mark.slow
def test_a_local_ray_that_does_not_start_is_retried_once_then_one_line(
    tiny_data: Path, tmp_path: Path
) -> None:
    """A local Ray whose start-up times out (here Ray's wait for its GCS is made zero) is
    started once more, the failed start's processes stopped first; failed twice, the command
    stops with exit 2 and one line saying that Ray did not start (it was "training failed",
    exit 1 and a traceback)."""
    import os
    import subprocess
    import sys

    env = {
        k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")
    }
    done = subprocess.run(
        [sys.executable, "-c", _RAY_TIMES_OUT, str(tiny_data)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    out = done.stdout.splitlines()
    assert out[0] == "exit 2", done.stdout + done.stderr[-3000:]
    assert out[1] == "left []"  # the failed starts' GCS processes are stopped
    errors = [ln for ln in done.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in done.stderr
    assert errors[0].startswith(
        "error: Ray did not start: a new local Ray instance failed to start twice "
        "(RuntimeError: Timed out waiting for file "
    )
    assert errors[0].endswith(
        "the machine may be too busy for Ray's start-up timeouts: run the command again "
        "when it is quieter, or set ray.address to a running cluster"
    )
    retries = [ln for ln in done.stderr.splitlines() if "trying once more" in ln]
    assert len(retries) == 1, done.stderr[-3000:]


def test_a_local_ray_start_that_fails_once_is_tried_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """A start that times out once (as a busy machine's did) and then succeeds gives the job
    its Ray: the second ``ray.init`` is the first's, what the first set up is undone, and
    nothing is stopped that ran before. A start that fails otherwise is not tried again."""
    import ray

    from raydlrm.platform import ray_init

    calls: list[dict] = []
    shutdowns: list[None] = []
    failure = RuntimeError("Timed out waiting for file /tmp/ray/session_1/node_ip_address.json")

    def init(**kwargs) -> None:
        calls.append(kwargs)
        if len(calls) == 1:
            raise failure

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: shutdowns.append(None))
    stopped: list = []
    monkeypatch.setattr(ray_init._reaper, "stop", lambda processes, **_: stopped.extend(processes))
    ray_init._start_local({"num_cpus": 2})
    assert calls == [{"address": "local", "num_cpus": 2}] * 2
    assert len(shutdowns) == 1
    assert stopped == []  # this process's Ray processes from before (the session's) stay
    calls.clear()
    failure = OSError("[Errno 28] No space left on device: '/dev/shm/plasma'")
    with pytest.raises(ray_init.RayStartError, match=r"failed to start \(OSError: \[Errno 28\]"):
        ray_init._start_local({"num_cpus": 2})
    assert len(calls) == 1


def test_config_show_and_validate() -> None:
    shown = json.loads(_invoke("config", "show", "--set", "model.arch=dcnv2").stdout)
    assert shown["model"]["arch"] == "dcnv2"
    assert _invoke("config", "validate").exit_code == 0
    bad = _invoke("config", "validate", "--set", "model.embedding_dim=6")
    assert bad.exit_code == 2 and "model.embedding_dim" in _error_line(bad)


def test_data_generate(tmp_path: Path) -> None:
    sets = [
        "--set",
        "data.synthetic.num_train_rows=500",
        "--set",
        "data.synthetic.num_eval_rows=100",
    ]
    result = _invoke("data", "generate", "--out", str(tmp_path / "d"), *sets)
    assert result.exit_code == 0, result.output
    assert pq.read_table(tmp_path / "d" / "train").num_rows == 500
    assert result.stdout.startswith("wrote 500 train and 100 eval rows to ")
    # The same data set again: kept, and said so (not "wrote").
    written = {p: p.stat().st_mtime_ns for p in (tmp_path / "d").rglob("*.parquet")}
    same = _invoke("data", "generate", "--out", str(tmp_path / "d"), *sets)
    assert same.exit_code == 0, same.output
    assert "already holds this data set (500 train and 100 eval rows" in same.stdout
    assert "kept, nothing written" in same.stdout and "wrote" not in same.stdout
    assert {p: p.stat().st_mtime_ns for p in written} == written
    # Another data set over it: one line naming the flag that replaces it, exit 2.
    again = _invoke("data", "generate", "--out", str(tmp_path / "d"))
    assert again.exit_code == 2, again.output
    assert _error_line(again).endswith(
        "holds a different synthetic data set (of another "
        "[data.synthetic]): --overwrite replaces it"
    )
    assert "Traceback" not in again.output
    assert "inspect" in _invoke("data", "--help").output  # the group names both commands


def test_data_inspect(tmp_path: Path, tiny_data: Path) -> None:
    train = tiny_data / "train"
    args = ["data", "inspect", "--set", f"data.train_path={train}", "--json"]
    group = '--set=data.dedup_groups=[["C1", "C2", "C3", "C4", "C5", "C6", "C7", "C8"]]'
    result = _invoke(*args, group)
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    table = pq.read_table(train)
    assert report["rows"] == 600 and report["files"] == 2 and report["sampled_rows"] == 600
    assert report["bad_rows_in_sample"] == 0
    assert report["sparse"]["C1"]["distinct_ids"] == len(set(table.column("C1").to_pylist()))
    lengths = [len(v) for v in table.column("C26").to_pylist()]
    assert report["sparse"]["C26"]["mean_length"] == pytest.approx(sum(lengths) / 600)
    assert abs(report["label_rate"] - sum(table.column("label").to_pylist()) / 600) < 1e-9
    # The user features repeat across a session's samples: a batch dedups them.
    assert report["dedup"][0]["ratio"] > 1.5
    # A bad row is counted; a missing data set is a clear error.
    broken = tmp_path / "broken"
    broken.mkdir()
    rows = table.to_pylist()
    rows[3]["I2"] = float("nan")
    pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), broken / "part-0.parquet")
    result = _invoke("data", "inspect", "--set", f"data.train_path={broken}", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["bad_rows_in_sample"] == 1 and report["dense"]["I2"]["non_finite"] == 1
    missing = _invoke("data", "inspect", "--path", str(tmp_path / "nothing"))
    assert missing.exit_code == 2 and "nothing" in missing.output


def test_data_inspect_warns_of_a_fill_that_dominates_a_dense_column(tmp_path: Path) -> None:
    values = [None if i % 5 == 0 else 1000.0 + i % 7 for i in range(100)]  # 20% missing
    table = {"label": [i % 2 for i in range(100)], "I1": values, "C1": list(range(100))}
    pq.write_table(pa.table(table), tmp_path / "part-0.parquet")
    sets = [
        f"--set=data.train_path={tmp_path}",
        '--set=data.dense_columns=["I1"]',
        '--set=data.sparse_columns=["C1"]',
    ]
    result = _invoke("data", "inspect", *sets)
    assert result.exit_code == 0, result.output
    assert "I1           nulls 20 (20.0% missing)" in result.output
    (warning,) = [ln for ln in result.output.splitlines() if ln.startswith("  warning:")]
    assert "dense column 'I1' is 20.0% missing, filled with zero (data.dense_fill)" in warning
    assert 'data.dense_fill = "median"' in warning
    median = _invoke("data", "inspect", *sets, "--set=data.dense_fill=median")
    assert median.exit_code == 0, median.output
    assert "warning:" not in median.output


def test_failed_run_is_one_line_naming_the_workers_error() -> None:
    from raydlrm._errors import cause_line as _cause

    text = (
        "Training failed due to worker errors:\n[Rank 0,1 Error Snippet]:\n"
        'Traceback (most recent call last):\n  File "loop.py", line 3, in train_step\n'
        "FloatingPointError: training diverged: rank 0 step 3 loss is nan (lower ...)\n"
    )
    assert _cause(RuntimeError(text)) == (
        "FloatingPointError: training diverged: rank 0 step 3 loss is nan (lower ...)"
    )
    assert _cause(RuntimeError("plain\nsecond")) == "RuntimeError: plain"
    # A bad row found in a Ray Data actor: Ray wraps it, the line shown names the culprit.
    wrapped = (
        "Training failed due to worker errors:\n"
        "raydlrm.ingestion.badinput.BadInputError: data/part-7.parquet, row group 3, row 2: "
        "label column 'label': label outside [0, 1] (1 bad rows in this batch)\n\n"
        "The above exception was the direct cause of the following exception:\n"
        "ray.exceptions.UserCodeException: UDF failed to process a data block.\n"
    )
    assert _cause(RuntimeError(wrapped)) == (
        "BadInputError: data/part-7.parquet, row group 3, row 2: label column 'label': label "
        "outside [0, 1] (1 bad rows in this batch)"
    )


def test_checkpoint_commands_name_a_path_that_does_not_exist(tmp_path: Path) -> None:
    missing = str(tmp_path / "runs" / "nope")
    for command in ("show", "verify"):
        result = _invoke("checkpoint", command, missing)
        assert result.exit_code == 2, result.output
        assert result.stderr.strip() == f"error: checkpoint {missing} does not exist"


def test_export_of_a_run_without_a_checkpoint_says_why(tmp_path: Path) -> None:
    """A run directory with no checkpoint: the run has none, why (its job ended or still runs,
    how far it trained) and what to do; not the advice to give the run directory it was
    given."""
    import os
    import socket
    import time

    from raydlrm.platform.run_lock import LOCK_FILE
    from raydlrm.trainers.hooks import PROGRESS_FILE

    run = tmp_path / "runs" / "r1"
    run.mkdir(parents=True)
    progress = {"step": 40, "epoch": 0, "samples": 5120, "restored": 0, "time": time.time()}
    (run / PROGRESS_FILE).write_text(json.dumps(progress))
    result = _invoke("export", str(run), "--output", str(tmp_path / "model"))
    assert result.exit_code == 2, result.output
    line = _error_line(result)
    assert line.startswith(f"error: run {run} has no checkpoint: its job ended before its first")
    assert "it trained 40 steps (5,120 samples" in line and "checkpoint.every_steps" in line
    assert "runs/<run>" not in line
    holder = {"token": "t", "host": socket.gethostname(), "pid": os.getpid()}
    (run / LOCK_FILE).write_text(json.dumps({**holder, "started": 0.0, "heartbeat": time.time()}))
    running = _error_line(_invoke("export", str(run), "--output", str(tmp_path / "model")))
    assert f"its job still runs (pid {os.getpid()} on {socket.gethostname()}" in running
    other = tmp_path / "elsewhere"
    other.mkdir()
    line = _error_line(_invoke("export", str(other), "--output", str(tmp_path / "model")))
    assert "holds no run's files: give a checkpoint directory" in line


@pytest.mark.parametrize("command", ["train", "retrain"])
def test_a_config_typo_stops_before_torch_and_ray_load(command: str) -> None:
    """The config is validated before the command imports what it runs (seconds of torch, Ray
    and MLflow): an unknown key is one line at once."""
    import subprocess
    import sys

    probe = (
        "import sys\n"
        "from raydlrm.platform.cli import app\n"
        "try:\n"
        f"    app([{command!r}, '--set', 'training.max_stesp=3'])\n"
        "except SystemExit as e:\n"
        "    print('exit', e.code, sorted({'torch', 'ray', 'mlflow'} & set(sys.modules)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == "exit 2 []", done.stdout + done.stderr
    assert "training.max_stesp: unknown key" in done.stderr


@pytest.mark.parametrize("command", ["score", "evaluate"])
def test_a_local_model_that_does_not_exist_is_named_by_its_full_path(
    command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(MLflow read a relative path as an artifact URI: "No such artifact: 'model'".)"""
    monkeypatch.chdir(tmp_path)
    args = [command, "runs/nope/model", str(tmp_path / "data")]
    result = _invoke(*args, *([str(tmp_path / "out")] if command == "score" else []))
    assert result.exit_code == 2, result.output
    line = _error_line(result)
    assert line.startswith(f"error: model {tmp_path / 'runs/nope/model'} does not exist: ")
    assert "artifact" not in line


@pytest.mark.parametrize("command", ["score", "evaluate"])
def test_scoring_sizes_below_one_name_the_option(command: str, tmp_path: Path) -> None:
    """(Ray Data's own message named no option.) Checked before the model is read."""
    args = [command, str(tmp_path / "model"), str(tmp_path / "data")]
    if command == "score":
        args.append(str(tmp_path / "out"))
    for option, name in (("--batch-size", "batch_size"), ("--num-actors", "num_actors")):
        result = _invoke(*args, option, "0")
        assert result.exit_code == 2, result.output
        assert _error_line(result) == f"error: {name} ({option}) must be at least 1, got 0"
