"""Tests of the synthetic data generator: reproducibility, shape, distributions, planted model."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from sklearn.metrics import roc_auc_score

from raydlrm.ingestion import SyntheticConfig, generate_synthetic

SMALL = {
    "num_train_rows": 24_000,
    "num_eval_rows": 12_000,
    "rows_per_file": 10_000,
    "max_cardinality": 20_000,
}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    config = SyntheticConfig(**SMALL)
    return config, generate_synthetic(config, out_dir=tmp_path_factory.mktemp("syn"))


def _read(files) -> pa.Table:
    return pa.concat_tables([pq.read_table(f) for f in files])


def test_same_seed_gives_identical_files_and_other_seed_differs(tmp_path):
    config = SyntheticConfig(num_train_rows=3000, num_eval_rows=1000, rows_per_file=1500)
    a = generate_synthetic(config, out_dir=tmp_path / "a")
    b = generate_synthetic(config, out_dir=tmp_path / "b")
    assert [f.name for f in a.train_files] == ["part-00000.parquet", "part-00001.parquet"]
    for fa, fb in zip(a.train_files + a.eval_files, b.train_files + b.eval_files, strict=True):
        assert fa.read_bytes() == fb.read_bytes()
    reseeded = SyntheticConfig(num_train_rows=3000, num_eval_rows=1000, rows_per_file=1500, seed=1)
    other = generate_synthetic(reseeded, out_dir=tmp_path / "c")
    ta, tc = pq.read_table(a.train_files[0]), pq.read_table(other.train_files[0])
    assert not ta.column("C1").equals(tc.column("C1"))
    assert not ta.column("label").equals(tc.column("label"))


def test_columns_types_and_ids(dataset):
    config, info = dataset
    assert info.num_train_rows == 24_000 and info.num_eval_rows == 12_000
    assert len(info.train_files) == 3 and len(info.eval_files) == 2
    train, evals = _read(info.train_files), _read(info.eval_files)
    assert train.num_rows == 24_000 and evals.num_rows == 12_000
    names = ["sample_id", "session_id", "label"]
    names += [f"I{i}" for i in range(1, 14)] + [f"C{i}" for i in range(1, 27)]
    assert train.column_names == names
    for i in range(1, 14):
        assert train.schema.field(f"I{i}").type == pa.float32()
    for i in range(1, 23):
        assert train.schema.field(f"C{i}").type == pa.int64()
    for i in range(23, 27):
        assert train.schema.field(f"C{i}").type == pa.list_(pa.int64())
        lengths = train.column(f"C{i}").combine_chunks().value_lengths().to_numpy()
        assert lengths.min() >= 1 and lengths.max() <= config.max_list_length
    ids = np.concatenate(
        [train.column("sample_id").to_numpy(), evals.column("sample_id").to_numpy()]
    )
    np.testing.assert_array_equal(ids, np.arange(36_000))
    labels = train.column("label").to_numpy()
    assert set(np.unique(labels)) == {0, 1}
    assert 0.2 < labels.mean() < 0.3
    dense = np.stack([train.column(f"I{i}").to_numpy(zero_copy_only=False) for i in range(1, 14)])
    null_fraction = np.isnan(dense).mean()
    assert 0.01 < null_fraction < 0.03
    values = dense[~np.isnan(dense)]
    assert values.min() >= 0 and np.all(values == np.floor(values))
    assert values.max() > 100 * np.median(values)  # heavy tail
    # Raw ids are scrambled into the int64 range, not 0..n-1.
    assert train.column("C1").to_numpy().max() > 2**40


def test_power_law_ids(dataset):
    _, info = dataset
    train = _read(info.train_files)
    # The column with the most distinct ids: its head is far more frequent than its median id.
    best = max(range(9, 23), key=lambda i: len(np.unique(train.column(f"C{i}").to_numpy())))
    _, counts = np.unique(train.column(f"C{best}").to_numpy(), return_counts=True)
    counts = np.sort(counts)[::-1]
    assert len(counts) > 1000
    assert counts[0] > 50 * np.median(counts)
    assert counts[:10].sum() > 0.1 * counts.sum()


def test_user_features_constant_within_sessions(dataset):
    config, info = dataset
    train = pq.read_table(info.train_files[0])
    session = train.column("session_id").to_numpy()
    assert np.all(np.diff(session) >= 0)  # sessions are runs of consecutive rows
    starts = np.flatnonzero(np.diff(session)) + 1
    mean_length = len(session) / (len(starts) + 1)
    assert 0.7 * config.mean_session_length < mean_length < 1.3 * config.mean_session_length
    for i in range(1, config.num_user_features + 1):
        ids = train.column(f"C{i}").to_numpy()
        first = ids[np.searchsorted(session, session, side="left")]
        np.testing.assert_array_equal(ids, first)
    # A non-user feature changes within sessions.
    item = train.column(f"C{config.num_user_features + 1}").to_numpy()
    within = np.diff(session) == 0
    assert np.mean(np.diff(item)[within] != 0) > 0.3


def _target_encoding_auc(train: pa.Table, evals: pa.Table, labels: np.ndarray) -> float:
    """AUC on eval of a naive-Bayes-like score summing per-id log-odds learned on train."""
    prior = labels.mean()
    score = np.zeros(evals.num_rows)
    for i in range(1, 23):
        ids_train = train.column(f"C{i}").to_numpy()
        ids_eval = evals.column(f"C{i}").to_numpy()
        uniq, inverse = np.unique(ids_train, return_inverse=True)
        pos = np.bincount(inverse, weights=labels, minlength=len(uniq))
        cnt = np.bincount(inverse, minlength=len(uniq))
        rate = (pos + 20 * prior) / (cnt + 20)
        where = np.clip(np.searchsorted(uniq, ids_eval), 0, len(uniq) - 1)
        known = uniq[where] == ids_eval
        r = np.where(known, rate[where], prior)
        score += np.log(r / (1 - r)) - np.log(prior / (1 - prior))
    return roc_auc_score(evals.column("label").to_numpy(), score)


def test_labels_depend_on_features_and_planted_auc(dataset):
    _, info = dataset
    assert 0.77 < info.planted_auc < 0.83
    train, evals = _read(info.train_files), _read(info.eval_files)
    labels = train.column("label").to_numpy().astype(np.float64)
    learned = _target_encoding_auc(train, evals, labels)
    shuffled = _target_encoding_auc(train, evals, np.random.default_rng(0).permutation(labels))
    assert learned > 0.62, learned
    assert abs(shuffled - 0.5) < 0.03, shuffled
    assert learned < info.planted_auc


def test_metadata_marks_complete_data_set_and_overwrite_rules(tmp_path):
    config = SyntheticConfig(num_train_rows=1000, num_eval_rows=0, rows_per_file=1000)
    info = generate_synthetic(config, out_dir=tmp_path)
    assert info.eval_path is None and info.planted_auc is None
    meta = json.loads((tmp_path / "metadata.json").read_text())
    assert meta["num_train_rows"] == 1000 and meta["config"]["seed"] == 0
    mtime = info.train_files[0].stat().st_mtime_ns
    again = generate_synthetic(config, out_dir=tmp_path)  # complete, same config: reused
    assert again == dataclasses.replace(info, kept=True) and not info.kept
    assert info.train_files[0].stat().st_mtime_ns == mtime
    different = SyntheticConfig(num_train_rows=1000, num_eval_rows=0, rows_per_file=1000, seed=3)
    with pytest.raises(FileExistsError, match="different"):
        generate_synthetic(different, out_dir=tmp_path)
    (tmp_path / "metadata.json").unlink()
    with pytest.raises(FileExistsError, match="incomplete"):
        generate_synthetic(config, out_dir=tmp_path)
    replaced = generate_synthetic(different, out_dir=tmp_path, overwrite=True)
    assert replaced.train_files == info.train_files
    assert (tmp_path / "metadata.json").exists()


def test_interaction_terms_orders_features_and_share():
    from raydlrm.ingestion._planted import plant, sample_rows, terms

    default = plant(SyntheticConfig(**SMALL))
    # The default keeps the one pairwise term: the first user feature and the first item one.
    assert [[f for f, _ in term] for term in default.interactions] == [[0, 8]]

    config = SyntheticConfig(**SMALL, interaction_orders=[2, 3, 4], interaction_share=0.5)
    model = plant(config)
    assert [len(term) for term in model.interactions] == [2, 3, 4]
    features = [f for term in model.interactions for f, _ in term]
    assert features[:2] == [0, 8] and len(set(features)) == 9
    rows = sample_rows(config, model, np.random.default_rng(7), 20_000)
    dense, effects, interaction = terms(model, rows)
    parts = [
        dense @ model.dense_weights,
        effects @ model.effect_weights,
        model.interaction_weight * interaction,
    ]
    variances = np.array([p.var() for p in parts])
    share = variances[2] / variances.sum()
    assert 0.4 < share < 0.6, share

    none = plant(SyntheticConfig(**SMALL, interaction_orders=[]))
    assert none.interactions == () and none.interaction_weight == 0.0


@pytest.mark.parametrize(
    ("knobs", "match"),
    [
        ({"interaction_orders": [1]}, r"synthetic\.interaction_orders: orders must be in \[2"),
        ({"interaction_orders": [27]}, r"synthetic\.interaction_orders"),
        ({"interaction_orders": [9, 9, 9]}, r"need 27 distinct features"),
        ({"interaction_share": 0.95}, r"synthetic\.interaction_share"),
    ],
)
def test_invalid_interaction_knobs_name_the_key(knobs, match):
    with pytest.raises(ValueError, match=match):
        SyntheticConfig(**knobs)
