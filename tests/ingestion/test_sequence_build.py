"""Tests of ``raydlrm data sequences`` (:mod:`raydlrm.ingestion.sequences`): the histories
equal a plain Python reference for both split kinds and both example kinds, no example sees an
event from its own future, ``max_length`` keeps the newest events, the item remap round-trips,
and bad input is named. The vectorized partition build is checked without Ray; one small
Ray Data build through the command line (shared by the module) checks the job end to end."""

from __future__ import annotations

import dataclasses
import json
from collections import defaultdict
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

import raydlrm
from raydlrm.ingestion import DataValidationError, SequenceBuildConfig, write_sequences
from raydlrm.ingestion._histories import SEQ_COLUMN, Cutoffs, build_examples, example_tables
from raydlrm.ingestion.badinput import BadInputError
from raydlrm.platform.cli import app
from raydlrm.storage import filesystem_for

SPLITS = ("train", "valid", "test")


def _log(num_events: int = 300, *, seed: int = 0, users: int = 25) -> pa.Table:
    """A log with many ties in time (times in [0, 40)) and string users."""
    rng = np.random.default_rng(seed)
    return pa.table(
        {
            "user": pa.array([f"u{u:02d}" for u in rng.integers(0, users, num_events)]),
            "item": pa.array(rng.integers(0, 50, num_events) * 7 + 1000),
            "ts": pa.array(rng.integers(0, 40, num_events)),
            "rating": pa.array(rng.integers(1, 6, num_events)),
        }
    )


def _config(**options) -> SequenceBuildConfig:
    columns = {"user_column": "user", "item_column": "item", "time_column": "ts"}
    return SequenceBuildConfig(**{**columns, **options})


def reference(
    events: list[dict], config: SequenceBuildConfig, *, cuts: tuple | None = None
) -> dict[str, list[dict]]:
    """The examples per split, by the definitions, one user and one event at a time.
    ``events`` carry their log row as ``seq``; ``cuts`` are (test, valid) of a time split."""
    by_user = defaultdict(list)
    for event in events:
        by_user[event["user"]].append(event)
    out: dict[str, list[dict]] = {s: [] for s in SPLITS}
    for user in sorted(by_user):
        history = sorted(by_user[user], key=lambda e: (e["ts"], e["seq"]))
        n = len(history)
        splits = []
        for i, event in enumerate(history):
            if config.split == "leave_last_out":
                splits.append(0 if n < 3 else 2 if i == n - 1 else 1 if i == n - 2 else 0)
            else:
                test, valid = cuts
                is_valid = valid is not None and event["ts"] >= valid
                splits.append(2 if event["ts"] >= test else 1 if is_valid else 0)
        for i, event in enumerate(history):
            if config.examples == "last" and i + 1 < n and splits[i + 1] == splits[i]:
                continue
            before = history[max(0, i - config.max_length) : i]
            if len(before) < config.min_history:
                continue
            row = {c: event[c] for c in config.target_columns()}
            if config.label_column is not None:
                row["label"] = int(event[config.label_column] >= config.label_min)
            for c in config.history_columns():
                row[f"hist_{c}"] = [e[c] for e in before]
            out[SPLITS[splits[i]]].append(row)
    return out


def _with_rows(log: pa.Table) -> list[dict]:
    return [{**row, "seq": i} for i, row in enumerate(log.to_pylist())]


def _remap(expected: dict[str, list[dict]], catalogue: list[int]) -> dict[str, list[dict]]:
    rows = {item: row for row, item in enumerate(catalogue)}
    for examples in expected.values():
        for example in examples:
            example["item"] = rows[example["item"]]
            example["hist_item"] = [rows[i] for i in example["hist_item"]]
    return expected


@pytest.mark.parametrize(
    "options",
    [
        {"split": "leave_last_out", "examples": "all"},
        {"split": "leave_last_out", "examples": "last", "min_history": 0},
        {"split": "time", "examples": "all", "max_length": 1000},
        {"split": "time", "examples": "last", "extra_columns": ["ts", "rating"]},
        {"split": "time", "examples": "all", "item_ids": "raw"},
    ],
    ids=["llo-all", "llo-last", "time-all", "time-last", "time-all-raw-ids"],
)
def test_histories_equal_the_reference(options):
    defaults = {"max_length": 4, "extra_columns": ["rating"]}
    config = _config(label_column="rating", label_min=4, **{**defaults, **options})
    log = _log()
    cuts = (30, 24) if config.split == "time" else None
    events = log.append_column(SEQ_COLUMN, pa.array(np.arange(log.num_rows)))
    # Shuffled: the build must not depend on the order the events arrive in.
    events = events.take(np.random.default_rng(1).permutation(log.num_rows))
    catalogue = sorted(set(log["item"].to_pylist()))
    config = dataclasses.replace(config, row_group_rows=16)
    built = build_examples(
        events,
        config=config,
        cutoffs=None if cuts is None else Cutoffs(test=pa.scalar(30), valid=pa.scalar(24)),
        catalogue=pa.array(catalogue) if config.item_ids == "rows" else None,
    )
    expected = reference(_with_rows(log), config, cuts=cuts)
    if config.item_ids == "rows":
        expected = _remap(expected, catalogue)
    for code, split in enumerate(SPLITS):
        tables = list(example_tables(built, code, config=config))
        assert all(t.num_rows <= 16 for t in tables)
        got = pa.concat_tables(tables).to_pylist()
        assert got == expected[split], split
        assert len(got) > 20


def test_max_length_keeps_the_newest_events_and_ties_follow_the_log_order():
    log = pa.table(
        {
            "user": ["a"] * 6,
            "item": [10, 11, 12, 13, 14, 15],
            "ts": [5, 1, 3, 3, 2, 9],  # 13 and 12 share a time: 12 comes first in the log
        }
    )
    events = log.append_column(SEQ_COLUMN, pa.array(np.arange(6)))
    config = _config(max_length=3, examples="last")
    built = build_examples(events, config=config)
    (test,) = pa.concat_tables(example_tables(built, 2, config=config)).to_pylist()
    assert test["item"] == 15 and test["hist_item"] == [12, 13, 10]  # time order 11 14 12 13 10
    (valid,) = pa.concat_tables(example_tables(built, 1, config=config)).to_pylist()
    assert valid["item"] == 10 and valid["hist_item"] == [14, 12, 13]


def test_bad_input_before_ray_names_the_file_and_column(tmp_path: Path):
    log_dir = tmp_path / "log"
    log_dir.mkdir()
    pq.write_table(_log(20), log_dir / "a.parquet")
    pq.write_table(_log(20).drop_columns(["rating"]), log_dir / "b.parquet")
    config = _config(extra_columns=["rating"])
    with pytest.raises(DataValidationError, match=r"b\.parquet has no column 'rating' "):
        write_sequences(str(log_dir), out=str(tmp_path / "out"), config=config)
    text_times = _log(20).set_column(2, "ts", pa.array(["x"] * 20))
    pq.write_table(text_times, log_dir / "b.parquet")
    with pytest.raises(DataValidationError, match=r"b\.parquet: column 'ts' .*time_column"):
        write_sequences(str(log_dir), out=str(tmp_path / "out"), config=config)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "metadata.json").write_text("{}")
    pq.write_table(_log(20), log_dir / "b.parquet")
    with pytest.raises(FileExistsError, match=r"metadata\.json"):
        write_sequences(str(log_dir), out=str(tmp_path / "out"), config=config)


def test_cli_stops_bad_options_and_input_with_one_line_before_ray_starts(tmp_path: Path):
    import ray

    ray_before = ray.is_initialized()
    pq.write_table(_log(20), tmp_path / "log.parquet")
    base = ["data", "sequences", "--out", str(tmp_path / "out"), "--user-column", "user"]
    cases = {
        "--item-column=movie": "no column 'movie' (data.sequence_build.item_column)",
        "--examples=first": "data.sequence_build.examples",
        "--max-length=0": "data.sequence_build.max_length must be positive",
    }
    for flag, message in cases.items():
        args = [*base, "--log", str(tmp_path / "log.parquet"), flag]
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 2, result.output
        (line,) = [ln for ln in result.stderr.splitlines() if ln.startswith("error:")]
        assert message in line
    no_log = CliRunner().invoke(app, base)
    assert no_log.exit_code == 2 and "error: no interaction log" in no_log.stderr
    assert ray.is_initialized() == ray_before


def test_options_are_checked_naming_the_key():
    with pytest.raises(ValueError, match=r"data\.sequence_build\.label_column"):
        _config(label_column="rating")
    with pytest.raises(ValueError, match=r"data\.sequence_build\.extra_columns"):
        _config(extra_columns=["item"])
    with pytest.raises(ValueError, match="cutoff_time applies to split = 'time'"):
        _config(cutoff_time=5)
    with pytest.raises(ValueError, match=r"output columns \['label'\]"):
        _config(extra_columns=["label"], label_column="rating", label_min=4)


# The Ray Data build, through the command line, shared by the tests below.
CLI_LOG_EVENTS = 600


@pytest.fixture(scope="module")
def cli_build(tmp_path_factory, ray_cluster):
    root = tmp_path_factory.mktemp("sequences")
    log = _log(CLI_LOG_EVENTS, seed=3, users=40)
    (root / "log").mkdir()
    pq.write_table(log.slice(0, 350), root / "log" / "a.parquet", row_group_size=100)
    pq.write_table(log.slice(350), root / "log" / "b.parquet", row_group_size=100)
    args = ["data", "sequences", "--log", str(root / "log"), "--out", str(root / "out")]
    args += ["--user-column", "user", "--item-column", "item", "--time-column", "ts"]
    args += ["--extra-columns", "rating", "--extra-columns", "ts", "--max-length", "5"]
    args += ["--split", "time", "--eval-fraction", "0.1", "--label-column", "rating"]
    args += ["--label-min", "4", "--num-partitions", "3", "--row-group-rows", "64"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    return root, log, result.stdout


CLI_CONFIG = _config(
    extra_columns=["rating", "ts"], max_length=5, split="time", label_column="rating", label_min=4
)


def _split(root: Path, split: str) -> list[dict]:
    """The examples of a split, by user (a user's examples keep their file order)."""
    rows = pq.read_table(root / "out" / split).to_pylist()
    return sorted(rows, key=lambda row: row["user"])


def _expected(root: Path, log: pa.Table) -> dict[str, list[dict]]:
    """The reference's examples of the command line's build, with the log's item ids."""
    cutoffs = json.loads((root / "out" / "metadata.json").read_text())["cutoffs"]
    return reference(_with_rows(log), CLI_CONFIG, cuts=(cutoffs["test"], cutoffs["valid"]))


@pytest.mark.ray
def test_cli_build_equals_the_reference(cli_build):
    root, log, stdout = cli_build
    meta = json.loads((root / "out" / "metadata.json").read_text())
    options = dataclasses.asdict(CLI_CONFIG)
    assert {k: meta["options"][k] for k in options if k != "log_path"} == {
        **{k: v for k, v in options.items() if k != "log_path"},
        "num_partitions": 3,
        "row_group_rows": 64,
        "label_min": 4.0,
    }
    times = np.sort(log["ts"].to_numpy())
    # The latest 10% of the events are test events, the 10% before them validation events.
    assert (meta["cutoffs"]["test"], meta["cutoffs"]["valid"]) == (times[-60], times[-120])
    items = pq.read_table(root / "out" / "items.parquet")
    expected = _remap(_expected(root, log), items["item"].to_pylist())
    for split in SPLITS:
        assert _split(root, split) == expected[split], split
        assert meta["rows"][split] == len(expected[split]) > 20
    assert meta["num_items"] == items.num_rows == len(set(log["item"].to_pylist()))
    assert meta["num_events"] == CLI_LOG_EVENTS and meta["num_partitions"] == 3
    assert stdout.startswith(f"wrote {meta['rows']['train']} train, ")


@pytest.mark.ray
def test_no_example_sees_its_future_and_eval_histories_hold_earlier_eval_events(cli_build):
    root, _, _ = cli_build
    cut = json.loads((root / "out" / "metadata.json").read_text())["cutoffs"]["test"]
    saw_eval_event = False
    for split in SPLITS:
        for row in _split(root, split):
            assert all(t <= row["ts"] for t in row["hist_ts"])
            assert len(row["hist_item"]) == len(row["hist_rating"]) <= 5
            assert (row["ts"] >= cut) == (split == "test")
            saw_eval_event |= split == "test" and any(t >= cut for t in row["hist_ts"])
    assert saw_eval_event


@pytest.mark.ray
def test_item_rows_map_back_to_the_log_ids_and_files_have_row_groups(cli_build):
    root, log, _ = cli_build
    items = pq.read_table(root / "out" / "items.parquet")
    assert items["row"].to_pylist() == list(range(items.num_rows))
    assert items["item"].to_pylist() == sorted(set(log["item"].to_pylist()))
    counts = dict(zip(*np.unique(log["item"].to_numpy(), return_counts=True), strict=True))
    assert items["events"].to_pylist() == [counts[i] for i in items["item"].to_pylist()]
    ids = items["item"].to_pylist()
    expected = _expected(root, log)
    for split in SPLITS:
        got = _split(root, split)
        assert [ids[r["item"]] for r in got] == [e["item"] for e in expected[split]]
        assert [[ids[i] for i in r["hist_item"]] for r in got] == [
            e["hist_item"] for e in expected[split]
        ]
    files = sorted((root / "out" / "train").glob("*.parquet"))
    assert 1 < len(files) <= 3
    assert any(pq.ParquetFile(f).metadata.num_row_groups > 1 for f in files)
    schema = pq.read_schema(files[0])
    assert schema.field("item").type == pa.int64()
    assert schema.field("hist_item").type == pa.list_(pa.int64())


@pytest.mark.ray
def test_a_null_is_named_by_file_row_group_row_and_column(tmp_path: Path, ray_cluster):
    log = _log(50)
    items = log["item"].to_pylist()
    items[37] = None
    path = tmp_path / "log.parquet"
    pq.write_table(log.set_column(1, "item", pa.array(items)), path, row_group_size=20)
    with pytest.raises(BadInputError, match=r"log\.parquet, row group 1, row 17: column 'item' "):
        raydlrm.build_sequences(str(path), out=str(tmp_path / "out"), config=_config())


@pytest.mark.ray
def test_log_and_output_on_s3(s3_server, ray_cluster):
    storage = s3_server("sequences")
    filesystem, _ = filesystem_for("s3://sequences/log", storage)
    log = _log(200)
    with filesystem.open_output_stream("sequences/log/a.parquet") as f:
        pq.write_table(log, f, row_group_size=50)
    config = _config(examples="last", num_partitions=2)
    for overwrite in (False, True):  # a second build replaces the first
        info = write_sequences(
            "s3://sequences/log",
            out="s3://sequences/out",
            config=config,
            storage=storage,
            overwrite=overwrite,
        )
    items = pq.read_table("sequences/out/items.parquet", filesystem=filesystem)
    expected = _remap(reference(_with_rows(log), config), items["item"].to_pylist())
    for split in SPLITS:
        rows = pq.read_table(f"sequences/out/{split}", filesystem=filesystem).to_pylist()
        assert sorted(rows, key=lambda row: row["user"]) == expected[split]
        assert info.rows[split] == len(expected[split])
