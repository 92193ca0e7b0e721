"""Order diagnostics: data sorted by user (then time), data sorted by time, and data whose label
rate drifts over row groups, are found and told apart (column and what to try named); the same
rows shuffled are not."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raydlrm.ingestion import DataConfig, validate_data
from raydlrm.ingestion.inspect import inspect_data
from raydlrm.ingestion.order import order_findings

ROWS_PER_GROUP = 500
CONFIG = DataConfig(dense_columns=["I1"], sparse_columns=["user_id", "item_id"], table_size=1000)


def _logs(seed: int = 0) -> pa.Table:
    """About 2,000 rows of 200 users' events, sorted by user and time, as logs are written."""
    rng = np.random.default_rng(seed)
    users = np.repeat(np.arange(200), rng.integers(5, 16, size=200))
    n = len(users)
    times = rng.integers(1_700_000_000, 1_700_086_400, size=n)
    order = np.lexsort((times, users))
    return pa.table(
        {
            "label": pa.array((rng.random(n) < 0.3).astype(np.int64)),
            "I1": pa.array(rng.random(n)),
            "user_id": pa.array(users[order]),
            "item_id": pa.array(rng.integers(0, 5_000, size=n)),
            "timestamp": pa.array(times[order], pa.timestamp("s")),
        }
    )


def _write(table: pa.Table, root: Path) -> str:
    """Two files of row groups of ``ROWS_PER_GROUP`` rows."""
    root.mkdir()
    half = table.num_rows // 2
    for i, part in enumerate([table.slice(0, half), table.slice(half)]):
        pq.write_table(part, root / f"part-{i}.parquet", row_group_size=ROWS_PER_GROUP)
    return str(root)


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The same events written sorted by user then time (as logs often are), sorted by time
    (as a stream is), sorted by time in files that are not (the later half first), and
    shuffled: their data sets' paths."""
    root = tmp_path_factory.mktemp("logs")
    events = _logs()
    by_time = events.take(
        pa.array(np.argsort(events.column("timestamp").to_numpy(), kind="stable"))
    )
    half = by_time.num_rows // 2
    swapped = pa.concat_tables([by_time.slice(half), by_time.slice(0, half)])
    return {
        "user": _write(events, root / "user"),
        "time": _write(by_time, root / "time"),
        "files_out_of_time": _write(swapped, root / "files_out_of_time"),
        "shuffled": _write(_shuffled(events), root / "shuffled"),
    }


def _findings(path: str, config: DataConfig = CONFIG):
    return order_findings(validate_data(path, config), config)


def _shuffled(table: pa.Table, seed: int = 1) -> pa.Table:
    return table.take(pa.array(np.random.default_rng(seed).permutation(table.num_rows)))


def test_sorted_by_user_sorted_by_time_and_shuffled_are_told_apart(logs: dict[str, str]) -> None:
    found = {(f.kind, f.column): f for f in _findings(logs["user"])}
    assert set(found) == {("runs", "user_id"), ("trend", "timestamp")}
    runs = found["runs", "user_id"]
    assert runs.value > 5  # runs of about 10 rows, against about 1 in a random order
    assert "user_id" in runs.message and "random order" in runs.statistic
    # Sorted by user, then by time inside each user's history: the time rises inside the runs
    # only, and what to try is the window (which mixes both), not time order.
    trend = found["trend", "timestamp"]
    assert "inside row groups" in trend.statistic
    assert "time order is not what to try" in trend.suggestion
    assert "data.order" not in trend.suggestion
    # The default window (262,144 rows) holds the whole data set: it mixes both.
    assert all(f.handled for f in found.values())
    assert "data.shuffle_window_rows = 262144 mixes it" in trend.suggestion
    # Sorted by time: a trend through the files, no runs; time order is what to try, with the
    # column named and a split by time, as something to measure.
    by_time = _findings(logs["time"])
    assert [(f.kind, f.column) for f in by_time] == [("trend", "timestamp")]
    assert "through the files" in by_time[0].statistic and by_time[0].value > 0.9
    assert by_time[0].suggestion.startswith(
        'try data.order = "time" with data.time_column = "timestamp"'
    )
    assert "split by time" in by_time[0].suggestion
    assert "not settled" in by_time[0].suggestion
    assert not by_time[0].handled  # the window mixes the whole history: a warning
    assert _findings(logs["shuffled"]) == []


def test_under_time_order_a_time_trend_is_handled_and_runs_still_checked(
    logs: dict[str, str],
) -> None:
    config = dataclasses.replace(
        CONFIG, order="time", time_column="timestamp", shuffle_window_rows=ROWS_PER_GROUP
    )
    [by_time] = _findings(logs["time"], config)
    assert by_time.handled
    assert by_time.suggestion == (
        'data.order = "time" reads the row groups in time order (data.time_column = '
        f'"timestamp"), mixing {ROWS_PER_GROUP} rows at a time'
    )
    found = {f.kind: f for f in _findings(logs["user"], config)}
    # The window mixes consecutive row groups in time order: runs of ~10 rows need ~1,000 rows.
    assert not found["runs"].handled
    assert found["runs"].suggestion.startswith("raise data.shuffle_window_rows to 2048 (now 500)")
    # Sorted by user: the row groups are not in time order; the shuffled order is what to try.
    assert not found["trend"].handled
    assert 'try data.order = "shuffled"' in found["trend"].suggestion
    # Rows in time order inside files that are not: the column's statistics put them in order.
    [inside] = _findings(logs["files_out_of_time"], dataclasses.replace(config, time_column=None))
    assert "inside row groups" in inside.statistic and not inside.handled
    assert (
        'try data.time_column = "timestamp", which deals the row groups by it' in inside.suggestion
    )
    [inside] = _findings(logs["files_out_of_time"], config)
    assert inside.handled and inside.suggestion.startswith('data.order = "time" reads')
    [inside] = _findings(logs["files_out_of_time"])
    assert inside.suggestion.startswith('try data.order = "time" with data.time_column')


@pytest.mark.parametrize(
    ("window", "advice"),
    [
        (0, "turn on data.shuffle_window_rows (e.g. 262144)"),
        (ROWS_PER_GROUP, "raise data.shuffle_window_rows to 2048 (now 500)"),
    ],
)
def test_suggestion_follows_the_window(logs: dict[str, str], window: int, advice: str) -> None:
    config = dataclasses.replace(CONFIG, shuffle_window_rows=window)
    found = {f.kind: f for f in _findings(logs["user"], config)}
    # Runs of ~10 rows need ~1,000 rows mixed together: more than one row group of 500 rows.
    assert not found["runs"].handled
    assert found["runs"].suggestion.startswith(advice)
    assert found["runs"].suggestion.endswith(
        "what to try, not settled: compare the eval metric both ways"
    )
    # Sorted inside row groups: any window mixes it, none does not.
    assert found["trend"].handled == bool(window)


def test_label_drift_over_row_groups_is_found(tmp_path: Path) -> None:
    logs = _shuffled(_logs())
    rng = np.random.default_rng(2)
    rates = np.repeat([0.1, 0.2, 0.3, 0.4, 0.5], ROWS_PER_GROUP)[: logs.num_rows]
    drifting = logs.set_column(0, "label", pa.array((rng.random(len(rates)) < rates).astype(int)))
    findings = _findings(_write(drifting, tmp_path / "drift"))
    assert [(f.kind, f.column) for f in findings] == [("label_drift", "label")]
    assert "positive rate" in findings[0].statistic


def test_sessions_are_the_units(tmp_path: Path) -> None:
    """With a session column, sessions of one user in a row are what counts, not the rows of
    one session, nor the order inside a session (which the reader keeps anyway)."""
    logs = _shuffled(_logs())
    sessions = np.arange(logs.num_rows) // 5
    table = logs.append_column("session_id", pa.array(sessions))
    table = table.append_column("position", pa.array(np.arange(logs.num_rows) % 5))
    # One user per session, in random order: no runs beyond the sessions.
    user = np.random.default_rng(3).integers(0, 300, size=sessions.max() + 1)[sessions]
    path = _write(table.set_column(2, "user_id", pa.array(user)), tmp_path / "sessions")
    assert _findings(path) == []
    # Without the session column, a session's rows are runs of one user, its positions rise
    # (4 steps of 5) and the session ids, written in order, rise through the files.
    rows = dataclasses.replace(CONFIG, session_column=None)
    found = {(f.kind, f.column) for f in _findings(path, rows)}
    assert found == {("runs", "user_id"), ("trend", "position"), ("trend", "session_id")}


def _users_sessions(*, shuffled: bool) -> pa.Table:
    """About 4,900 rows of 500 users' whole sessions (3 to 7 rows), a user holding 1 to 3
    sessions (1.85 on average), sorted by user (or the sessions shuffled)."""
    rng = np.random.default_rng(4)
    per_user = rng.choice([1, 2, 3], size=500, p=[0.4, 0.35, 0.25])
    session_user = np.repeat(np.arange(500), per_user)
    if shuffled:
        session_user = rng.permutation(session_user)
    sessions = np.repeat(np.arange(len(session_user)), rng.integers(3, 8, len(session_user)))
    n = len(sessions)
    return pa.table(
        {
            "label": pa.array((rng.random(n) < 0.3).astype(np.int64)),
            "I1": pa.array(rng.random(n)),
            "user_id": pa.array(session_user[sessions]),
            "item_id": pa.array(rng.integers(0, 5_000, size=n)),
            "session_id": pa.array(sessions),
        }
    )


def test_a_sort_by_user_with_whole_sessions_is_found_by_significance(tmp_path: Path) -> None:
    """Sorted by user, sessions whole: runs of a user's sessions, 1.85 sessions on average,
    below twice a random order's but far beyond chance, are found; the sessions shuffled are
    not."""
    config = dataclasses.replace(CONFIG, session_column="session_id")
    found = _findings(_write(_users_sessions(shuffled=False), tmp_path / "sorted"), config)
    assert [(f.kind, f.column) for f in found] == [("runs", "user_id")]
    assert 1.6 < found[0].value < 2.0
    assert "sessions on average" in found[0].statistic
    assert "standard deviations away" in found[0].statistic
    shuffled = _write(_users_sessions(shuffled=True), tmp_path / "shuffled")
    assert _findings(shuffled, config) == []


def test_inspect_lists_the_file_order(logs: dict[str, str]) -> None:
    report = inspect_data(logs["user"], CONFIG)
    columns = {(f["kind"], f["column"]) for f in report["file_order"]}
    assert columns == {("runs", "user_id"), ("trend", "timestamp")}


def _warnings(summary, *, config: DataConfig, caplog) -> list[str]:
    from raydlrm.platform.job_data import warn_file_order

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="raydlrm.platform.job_data"):
        warn_file_order(summary, config=config)
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_training_warns_about_unmixed_order(logs: dict[str, str], tmp_path: Path, caplog) -> None:
    config = dataclasses.replace(CONFIG, shuffle_window_rows=0)
    warnings = _warnings(validate_data(logs["user"], config), config=config, caplog=caplog)
    assert len(warnings) == 2
    assert any("user_id" in w and "data.shuffle_window_rows" in w for w in warnings)
    assert any("timestamp" in w and "time order is not what to try" in w for w in warnings)
    # Sorted by time: the same rule as inspect. Read shuffled, a warning says what to try; read
    # in time order, the trend is handled (information only).
    summary = validate_data(logs["time"], CONFIG)
    [warning] = _warnings(summary, config=CONFIG, caplog=caplog)
    assert warning.startswith("training data order: timestamp: rises through the files")
    assert 'try data.order = "time" with data.time_column = "timestamp"' in warning
    in_time = dataclasses.replace(CONFIG, order="time")
    assert _warnings(summary, config=in_time, caplog=caplog) == []
    assert 'data.order = "time" reads the row groups in time order (the file order)' in caplog.text
    # Every column sorted alike (user columns of data sorted by user): one warning naming all.
    with_user_columns = _logs()
    with_user_columns = with_user_columns.append_column(
        "age", with_user_columns.column("user_id")
    ).append_column("zip", with_user_columns.column("user_id"))
    config = dataclasses.replace(config, sparse_columns=[*config.sparse_columns, "age", "zip"])
    summary = validate_data(_write(with_user_columns, tmp_path / "users"), config)
    warnings = _warnings(summary, config=config, caplog=caplog)
    assert len(warnings) == 2
    assert any("user_id, age, zip:" in w and "3 columns alike" in w for w in warnings)


def test_data_inspect_prints_the_file_order(logs: dict[str, str]) -> None:
    from typer.testing import CliRunner

    from raydlrm.platform.cli import app

    overrides = [
        '--set=data.dense_columns=["I1"]',
        '--set=data.sparse_columns=["user_id", "item_id"]',
        "--set=data.shuffle_window_rows=0",
    ]
    for name, path in logs.items():
        result = CliRunner().invoke(app, ["data", "inspect", "--path", path, *overrides])
        assert result.exit_code == 0, result.output
        section = result.output.split("file order:")[1]
        if name == "user":
            assert "runs user_id:" in section and "trend timestamp:" in section
            assert "turn on data.shuffle_window_rows" in section
        elif name in ("time", "files_out_of_time"):
            assert "trend timestamp: rises" in section
            assert 'try data.order = "time" with data.time_column = "timestamp"' in section
        else:
            assert section.strip() == "no order found"
