"""Tests of the churn data (``data.synthetic.kind = "churn"``): daily hive partitions, the
share of new ids, the Zipf head and its drift, determinism, labels that depend on the ids, bad
input, and ``raydlrm data generate``."""

from __future__ import annotations

import json
import logging

import numpy as np
import pyarrow.parquet as pq
import pytest
from sklearn.metrics import roc_auc_score
from typer.testing import CliRunner

from raydlrm.ingestion import (
    ChurnConfig,
    DataConfig,
    SyntheticConfig,
    generate_synthetic,
    validate_data,
)
from raydlrm.platform.cli import app
from raydlrm.storage import StorageConfig, partition_values

DAYS = ["2026-01-01", "2026-01-02", "2026-01-03"]
ROWS_PER_DAY = 20_000
USERS, ITEMS = 2_000, 500


def _config(**churn) -> SyntheticConfig:
    settings = {
        "num_days": 3,
        "rows_per_day": ROWS_PER_DAY,
        "num_active_ids": {"user_id": USERS, "item_id": ITEMS},
        **churn,
    }
    return SyntheticConfig(kind="churn", rows_per_file=10_000, churn=ChurnConfig(**settings))


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    out = tmp_path_factory.mktemp("churn")
    return out, generate_synthetic(_config(), out_dir=out)


def _day(out, day: str):
    return pq.read_table(out / "train" / f"date={day}")


def test_days_are_hive_partitions_the_reader_and_retrain_read(dataset):
    out, info = dataset
    train = out / "train"
    assert sorted(p.name for p in train.iterdir()) == [f"date={d}" for d in DAYS]
    assert [f.relative_to(train).as_posix() for f in info.train_files[:2]] == [
        "date=2026-01-01/part-00000.parquet",
        "date=2026-01-01/part-00001.parquet",
    ]
    assert partition_values(str(train), StorageConfig(), "date") == DAYS
    config = DataConfig(
        train_path=str(train), eval_path=None, sparse_columns=["user_id", "item_id"]
    )
    assert validate_data(config.train_path, config, role="train").num_rows == 3 * ROWS_PER_DAY
    rows = pq.read_table(train)
    assert info.num_train_rows == rows.num_rows == 3 * ROWS_PER_DAY and info.eval_path is None
    assert len(set(rows.column("sample_id").to_pylist())) == rows.num_rows
    items = rows.column("item_id").to_numpy()
    # Raw ids are spread over the int64 range (they must be hashed or mapped), never negative.
    assert items.dtype == np.int64 and items.min() >= 0 and items.max() > 2**50
    # The counts are written to metadata.json and read back when the data set is kept.
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["churn"]["total_distinct_ids"] == info.churn.total_distinct_ids
    again = generate_synthetic(_config(), out_dir=out)
    assert again.kept and again.churn == info.churn


def test_share_of_new_ids_per_day_follows_the_setting(dataset):
    out, info = dataset
    seen: set[int] = set()
    for d, day in enumerate(DAYS):
        items = set(_day(out, day).column("item_id").to_pylist())
        new = items - seen
        assert info.churn.distinct_ids["item_id"][d] == len(items)
        assert info.churn.new_ids["item_id"][d] == len(new)
        if d:  # 20,000 rows draw nearly all of 500 active items: 1 in 5 is new each day
            assert len(new) / len(items) == pytest.approx(0.2, abs=0.03)
        seen |= items
    assert info.churn.total_distinct_ids["item_id"] == len(seen)
    assert info.churn.ids_ever_active == {"user_id": USERS + 2 * 400, "item_id": ITEMS + 2 * 100}
    # Users: the tail of 2,000 users is sparsely drawn, so old users also turn up for the
    # first time; the new ones alone are 20% of the active population.
    assert 0.2 < info.churn.new_ids["user_id"][1] / info.churn.distinct_ids["user_id"][1] < 0.5


def test_no_churn_setting_brings_no_new_ids(tmp_path):
    config = _config(new_id_share=0.0, rows_per_day=4_000, num_days=2)
    info = generate_synthetic(config, out_dir=tmp_path)
    assert info.churn.ids_ever_active == {"user_id": USERS, "item_id": ITEMS}
    assert info.churn.total_distinct_ids["item_id"] <= ITEMS


def test_zipf_head_and_rank_drift(dataset):
    out, _ = dataset
    s = SyntheticConfig().zipf_exponent
    first = np.unique(_day(out, DAYS[0]).column("item_id").to_numpy(), return_counts=True)
    counts = np.sort(first[1])[::-1]
    # The continuous Zipf law's top rank: (1 - 2^(1-s)) / (1 - (n+1)^(1-s)), about 14%.
    top = (1 - 2 ** (1 - s)) / (1 - (ITEMS + 1) ** (1 - s))
    assert counts[0] / ROWS_PER_DAY == pytest.approx(top, rel=0.1)
    slope = np.polyfit(np.log(np.arange(30) + 1.5), np.log(counts[:30]), 1)[0]
    assert slope == pytest.approx(-s, abs=0.15)
    # Popularity drifts: some of the day's 50 most popular items stay in the next day's top 50
    # (the ranks neither retired nor reshuffled), not all.
    second = np.unique(_day(out, DAYS[1]).column("item_id").to_numpy(), return_counts=True)
    heads = [set(ids[np.argsort(-c, kind="stable")[:50]]) for ids, c in (first, second)]
    assert 0.5 < len(heads[0] & heads[1]) / 50 < 0.9


def test_same_seed_gives_identical_files_and_other_seed_differs(tmp_path):
    config = _config(rows_per_day=3_000, num_days=2)
    a = generate_synthetic(config, out_dir=tmp_path / "a")
    b = generate_synthetic(config, out_dir=tmp_path / "b")
    for fa, fb in zip(a.train_files, b.train_files, strict=True):
        assert fa.read_bytes() == fb.read_bytes()
    other = SyntheticConfig(kind="churn", seed=1, churn=config.churn)
    c = generate_synthetic(other, out_dir=tmp_path / "c")
    ta, tc = pq.read_table(a.train_files[0]), pq.read_table(c.train_files[0])
    assert not ta.column("item_id").equals(tc.column("item_id"))
    assert not ta.column("label").equals(tc.column("label"))


def test_labels_depend_on_the_ids(dataset):
    """A per-id mean label fitted on day 1 ranks day 2's rows of the same ids well above
    chance; the same table with ids collided into few rows ranks them worse."""
    out, info = dataset
    train, test = _day(out, DAYS[0]), _day(out, DAYS[1])
    labels = test.column("label").to_numpy()

    def table_scores(num_rows: int | None) -> tuple[np.ndarray, np.ndarray]:
        """Day 2's scores from day 1's mean label per table row (an id's own row, or ids
        collided into ``num_rows`` rows; smoothed by 10 rows of the mean label), and which
        day 2 rows have a row seen on day 1."""
        fit, score = (t.column("user_id").to_numpy() for t in (train, test))
        if num_rows is not None:
            fit, score = fit % num_rows, score % num_rows
        keys, inverse = np.unique(fit, return_inverse=True)
        fit_labels = train.column("label").to_numpy()
        sums = np.bincount(inverse, weights=fit_labels) + 10 * fit_labels.mean()
        means = sums / (np.bincount(inverse) + 10)
        at = np.searchsorted(keys, score).clip(0, keys.size - 1)
        known = keys[at] == score
        return np.where(known, means[at], 0.0), known

    own, known = table_scores(None)
    collided, _ = table_scores(16)
    assert known.mean() > 0.5  # most of day 2's rows are of users seen on day 1
    own_auc = roc_auc_score(labels[known], own[known])
    assert own_auc > 0.6
    assert own_auc > roc_auc_score(labels[known], collided[known]) + 0.03
    assert info.churn.planted_auc[0] == pytest.approx(SyntheticConfig().target_auc, abs=0.03)


@pytest.mark.parametrize(
    ("make", "key"),
    [
        (lambda: ChurnConfig(new_id_share=1.5), "data.synthetic.churn.new_id_share"),
        (lambda: ChurnConfig(rank_drift=-0.1), "data.synthetic.churn.rank_drift"),
        (lambda: ChurnConfig(num_days=0), "data.synthetic.churn.num_days"),
        (lambda: ChurnConfig(start_date="2026-1-1"), "data.synthetic.churn.start_date"),
        (lambda: ChurnConfig(num_active_ids={"user_id": 0}), "num_active_ids.user_id"),
        (lambda: SyntheticConfig(kind="churn", partitions=["a"]), "data.synthetic.partitions"),
        (
            lambda: SyntheticConfig(kind="churn", churn=ChurnConfig(num_active_ids={"I3": 5})),
            "data.synthetic.churn.num_active_ids",
        ),
    ],
)
def test_bad_parameter_is_named(make, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        make()


def test_settings_churn_ignores_are_warned_about(caplog):
    with caplog.at_level(logging.WARNING):
        SyntheticConfig(kind="churn", num_train_rows=10)
    assert "data.synthetic.num_train_rows is ignored" in caplog.text


def test_cli_generates_the_partitions(tmp_path):
    runner = CliRunner()
    sets = [
        "--set=data.synthetic.kind=churn",
        "--set=data.synthetic.churn.num_days=2",
        "--set=data.synthetic.churn.rows_per_day=2000",
        "--set=data.synthetic.churn.num_active_ids={user_id = 300, item_id = 100}",
    ]
    result = runner.invoke(app, ["data", "generate", "--out", str(tmp_path), *sets])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (tmp_path / "train").iterdir()) == [
        "date=2026-01-01",
        "date=2026-01-02",
    ]
    assert result.stdout.startswith("wrote 4000 rows in 2 days date=2026-01-01..2026-01-02")
    assert "item_id: " in result.stdout and "distinct ids over all days" in result.stdout
    bad_set = "--set=data.synthetic.churn.new_id_share=2"
    bad = runner.invoke(app, ["data", "generate", "--out", str(tmp_path / "bad"), *sets, bad_set])
    assert bad.exit_code == 2 and "data.synthetic.churn.new_id_share" in bad.stderr
