"""Tests of the user-history data (``data.synthetic.kind = "sequences"``): the layout
``raydlrm data sequences`` writes, history lengths within their bounds, Zipf-skewed items spread
over the item rows, labels from the planted model, row groups of a bounded size, determinism,
bad parameters, and ``raydlrm data generate``."""

from __future__ import annotations

import json
import logging

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from raydlrm.ingestion import SequencesConfig, SyntheticConfig, generate_synthetic
from raydlrm.ingestion.synthetic_sequences import CHUNK_ROWS
from raydlrm.platform.cli import app

ITEMS, SHORTEST, LONGEST = 20_000, 20, 120


def _config(**settings) -> SyntheticConfig:
    sequences = SequencesConfig(
        num_items=ITEMS, min_length=SHORTEST, max_length=LONGEST, num_categories=50
    )
    return SyntheticConfig(
        kind="sequences",
        num_train_rows=5000,
        num_eval_rows=3000,
        rows_per_file=3000,
        num_dense=2,
        sequences=sequences,
        **settings,
    )


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    out = tmp_path_factory.mktemp("sequences")
    return out, generate_synthetic(_config(), out_dir=out)


def test_layout_and_columns(dataset):
    out, info = dataset
    assert [f.name for f in info.train_files] == ["part-00000.parquet", "part-00001.parquet"]
    train, evaluation = pq.read_table(out / "train"), pq.read_table(out / "eval")
    assert (train.num_rows, evaluation.num_rows) == (5000, 3000)
    assert train.column_names == ["user_id", "item_id", "label", "I1", "I2", "hist_item_id"]
    assert train.schema.field("hist_item_id").type == pa.list_(pa.int64())
    users = np.concatenate([train["user_id"].to_numpy(), evaluation["user_id"].to_numpy()])
    assert np.array_equal(users, np.arange(8000))
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["sequences"]["num_items"] == ITEMS
    assert meta["sequences"]["history_ids"] == info.sequences.history_ids


def test_history_lengths_are_within_bounds_and_cover_them(dataset):
    out, info = dataset
    history = pq.read_table(out / "train")["hist_item_id"].combine_chunks()
    lengths = np.diff(history.offsets.to_numpy())
    assert lengths.min() == SHORTEST and lengths.max() == LONGEST
    assert abs(lengths.mean() - (SHORTEST + LONGEST) / 2) < 2
    assert (info.sequences.min_history_length, info.sequences.max_history_length) == (20, 120)


def test_items_are_zipf_skewed_and_spread_over_the_rows(dataset):
    out, _ = dataset
    table = pq.read_table(out / "train")
    ids = np.concatenate(
        [table["hist_item_id"].combine_chunks().values.to_numpy(), table["item_id"].to_numpy()]
    )
    assert ids.min() >= 0 and ids.max() < ITEMS
    counts = np.sort(np.bincount(ids, minlength=ITEMS))[::-1]
    top = counts[: ITEMS // 100].sum() / counts.sum()
    assert top > 0.2  # the top 1% of the items: over 20x their uniform share
    # The popular items are not the first rows (a row-wise shard of them would be hot).
    head = np.argsort(np.bincount(ids, minlength=ITEMS))[::-1][:100]
    assert np.median(head) > ITEMS / 10


def test_labels_follow_the_planted_model(dataset):
    _, info = dataset
    config = _config()
    assert abs(info.planted_auc - config.target_auc) < 0.04
    assert abs(info.positive_rate - config.positive_rate) < 0.03


def test_files_are_written_a_bounded_row_group_at_a_time(dataset):
    out, _ = dataset
    footer = pq.ParquetFile(out / "train" / "part-00000.parquet").metadata
    sizes = [footer.row_group(g).num_rows for g in range(footer.num_row_groups)]
    assert sizes == [CHUNK_ROWS, 3000 - CHUNK_ROWS]


def test_same_seed_gives_identical_files(dataset, tmp_path):
    out, _ = dataset
    small = _config()
    again = generate_synthetic(small, out_dir=tmp_path / "a")
    assert (tmp_path / "a" / "eval" / "part-00000.parquet").read_bytes() == (
        out / "eval" / "part-00000.parquet"
    ).read_bytes()
    other = generate_synthetic(_config(seed=1), out_dir=tmp_path / "b")
    assert other.sequences.history_ids != again.sequences.history_ids


@pytest.mark.parametrize(
    ("make", "key"),
    [
        (lambda: SequencesConfig(min_length=10, max_length=5), "sequences.max_length"),
        (lambda: SequencesConfig(num_items=5, num_categories=10), "sequences.num_categories"),
        (lambda: SequencesConfig(taste_share=2), "sequences.taste_share"),
    ],
)
def test_bad_parameter_is_named(make, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        make()


def test_settings_sequences_ignores_are_warned_about(caplog):
    with caplog.at_level(logging.WARNING):
        SyntheticConfig(kind="sequences", max_cardinality=10)
        SyntheticConfig(kind="criteo", sequences=SequencesConfig(num_items=1000))
    assert "data.synthetic.max_cardinality is ignored" in caplog.text
    assert "data.synthetic.sequences is ignored" in caplog.text


def test_cli_generates_the_histories(tmp_path):
    sets = [
        "--set=data.synthetic.kind=sequences",
        "--set=data.synthetic.num_train_rows=300",
        "--set=data.synthetic.num_eval_rows=100",
        "--set=data.synthetic.sequences={num_items = 1000, min_length = 5, max_length = 9}",
    ]
    result = CliRunner().invoke(app, ["data", "generate", "--out", str(tmp_path), *sets])
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("wrote 300 train and 100 eval rows")
    assert "per user (5..9); 1000 items" in result.stdout


def test_cli_generates_without_eval_rows(tmp_path):
    """No eval rows: no planted-model AUC to print (it used to stop the command)."""
    sets = [
        "--set=data.synthetic.kind=sequences",
        "--set=data.synthetic.num_train_rows=50",
        "--set=data.synthetic.num_eval_rows=0",
        "--set=data.synthetic.sequences={num_items = 100, min_length = 5, max_length = 9}",
    ]
    result = CliRunner().invoke(app, ["data", "generate", "--out", str(tmp_path), *sets])
    assert result.exit_code == 0, result.output
    assert "no eval rows to measure the planted model on" in result.stdout
