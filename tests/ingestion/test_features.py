"""Tests of the feature spec: string ids, shared tables, per-id weights, dense clipping,
standardization and bucketization, dedup groups from the preprocessor to the loader's
DedupGroups."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from raydlrm.ingestion import DataConfig, DataValidationError, Preprocessor, validate_data
from raydlrm.ingestion.loader import arrow_to_batch
from raydlrm.ingestion.preprocess import hash_strings, mix64
from raydlrm.ingestion.stats import (
    bucket_boundaries_of,
    compute_bucket_boundaries,
    compute_dense_fill_values,
    compute_dense_stats,
    dense_stats_of,
    training_statistics,
)
from raydlrm.models import ModelConfig
from raydlrm.trainers.spec import WorkerSpec


def _config(**overrides) -> DataConfig:
    fields = {
        "dense_columns": ["I1", "I2"],
        "sparse_columns": ["user", "item", "tags"],
        "table_size": 1009,
    }
    return DataConfig(**{**fields, **overrides})


def _table(sessions: list[int] | None = None) -> pa.Table:
    """Rows of ``sessions[i]`` samples per session: the user (a string) and the tags (a list of
    strings) repeat inside a session; items are ints."""
    sessions = sessions or [3, 1, 2, 4]
    users, tags, items, tag_weights = [], [], [], []
    for s, n in enumerate(sessions):
        for _ in range(n):
            users.append(f"user-{s}")
            tags.append([f"tag-{s}", f"tag-{s + 1}"][: 1 + s % 2])
            tag_weights.append([0.5, 2.0][: 1 + s % 2])
            items.append(len(items) * 7)
    n = len(users)
    rng = np.random.default_rng(0)
    return pa.table(
        {
            "label": pa.array(rng.integers(0, 2, n)),
            "I1": pa.array(rng.uniform(-5, 50, n)),
            "I2": pa.array(rng.integers(0, 100, n)),
            "user": pa.array(users),
            "item": pa.array(items, pa.int64()),
            "tags": pa.array(tags, pa.list_(pa.string())),
            "tag_weight": pa.array(tag_weights, pa.list_(pa.float32())),
            "sample_id": pa.array(np.arange(n, dtype=np.int64)),
        }
    )


def test_string_hash_is_pinned_and_stable_across_processes() -> None:
    strings = pa.array(["", "a", "user-1", "ünïcode", "a much longer string id " * 4])
    here = hash_strings(strings)
    code = (
        "import pyarrow as pa; from raydlrm.ingestion.preprocess import hash_strings; "
        f"print([int(h) for h in hash_strings(pa.array({strings.to_pylist()!r}))])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert [int(x) for x in out.strip("[]\n").split(",")] == [int(x) for x in here]
    # FNV-1a of the empty string is the offset basis; then the splitmix64 finalizer.
    assert int(here[0]) == int(mix64(np.array([0xCBF29CE484222325], dtype=np.uint64))[0])
    assert len(set(here.tolist())) == len(here)
    # Slices hash like the strings they hold (offsets honoured).
    assert hash_strings(strings.slice(2, 2)).tolist() == here[2:4].tolist()
    large = hash_strings(strings.cast(pa.large_string()))
    assert large.tolist() == here.tolist()


def test_string_and_list_of_string_ids_hash_into_their_tables() -> None:
    config = _config()
    out = Preprocessor(config)(_table())
    users = out.column("user").to_numpy()
    assert users.dtype == np.int64 and ((users >= 0) & (users < 1009)).all()
    raw = _table().column("user").to_pylist()
    # Equal strings, equal rows; different users (here) different rows.
    for i in range(len(raw)):
        for j in range(len(raw)):
            assert (users[i] == users[j]) == (raw[i] == raw[j])
    tags = out.column("tags").combine_chunks()
    assert pa.types.is_list(tags.type) and tags.type.value_type == pa.int64()
    assert tags.value_lengths().to_pylist() == [len(t) for t in _table().column("tags").to_pylist()]


def test_shared_tables_and_sizes() -> None:
    config = _config(
        sparse_columns=["user", "item", "tags", "item2"],
        sparse_specs={"item2": {"table": "items"}, "item": {"table": "items"}},
        table_sizes={"items": 50, "user": 7},
    )
    model = ModelConfig(embedding_dim=8, bottom_mlp=[16, 8])
    tables = WorkerSpec(data=config, model=model).tables()
    assert [(t.name, t.num_embeddings, t.feature_names) for t in tables] == [
        ("t_user", 7, ("user",)),
        ("items", 50, ("item", "item2")),
        ("t_tags", 1009, ("tags",)),
    ]
    # The same raw id in two columns of one table lands on the same row.
    table = _table().append_column("item2", _table().column("item"))
    out = Preprocessor(config)(table)
    assert out.column("item").to_pylist() == out.column("item2").to_pylist()
    assert max(out.column("item").to_pylist()) < 50


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"sparse_specs": {"item": {"table": "t_user"}}, "table_sizes": {"item": 5, "user": 6}},
            "table 't_user'.*sizes",
        ),
        ({"sparse_specs": {"nope": {"table": "x"}}}, "sparse_specs.nope"),
        ({"dense_specs": {"I9": {"clip": [0, 1]}}}, "dense_specs.I9"),
        ({"dense_specs": {"I1": {"clip": [2, 1]}}}, "lo <= hi"),
        ({"sparse_specs": {"item": {"weight_column": "I1"}}}, "weight_column"),
        ({"dedup_groups": [["user", "nope"]]}, r"dedup_groups\[0\].*nope"),
        ({"dedup_groups": [["user"], ["user", "tags"]]}, "'user' is in groups 0 and 1"),
        (
            {"dedup_groups": [["user"]], "sparse_specs": {"item": {"table": "t_user"}}},
            "table 't_user' is shared",
        ),
        ({"table_sizes": {"t_nope": 3}}, "table_sizes.t_nope"),
        ({"dense_stats": {"I1": [0.0, 1.0]}}, "not a standardized"),
        ({"dense_buckets": 1}, "dense_buckets must be 0 .none. or at least 2"),
        ({"dense_specs": {"I1": {"buckets": 1}}}, "buckets must be 0"),
        ({"bucket_boundaries": {"I1": [1.0]}}, r"bucket_boundaries\.I1: not a bucketized"),
        (
            {"dense_buckets": 3, "bucket_boundaries": {"I1": [1.0, 2.0, 3.0]}},
            r"bucket_boundaries\.I1: 3 boundaries make more than its 3 buckets",
        ),
        (
            {"dense_buckets": 4, "bucket_boundaries": {"I2": [2.0, 1.0]}},
            r"bucket_boundaries\.I2: not strictly ascending",
        ),
        (
            {"dense_buckets": 4, "sparse_columns": ["user", "I1_bucket"]},
            "'I1' would become the sparse feature 'I1_bucket'",
        ),
        ({"dense_buckets": 4, "table_sizes": {"t_I2_bucket": 9}}, "a bucket table has"),
        (
            {"dense_buckets": 4, "bucket_boundaries": {"I2": [1.0, float("nan")]}},
            r"bucket_boundaries\.I2: a boundary is NaN or infinite",
        ),
    ],
)
def test_bad_feature_specs_name_the_key(overrides, message) -> None:
    with pytest.raises(ValueError, match=message):
        _config(**overrides)


def test_dense_clip_and_standardize_with_stats_computed_once() -> None:
    config = _config(
        dense_specs={
            "I1": {"transform": "standardize", "clip": [0.0, 40.0]},
            "I2": {"clip": [0, 9]},
        }
    )
    raw = _table()
    with pytest.raises(ValueError, match=r"\['I1'\] have no data.dense_stats"):
        Preprocessor(config)
    batches = [raw.slice(0, 4), raw.slice(4)]
    stats = compute_dense_stats(batches, config)
    x = np.clip(raw.column("I1").to_numpy(), 0, 40)
    assert stats["I1"] == pytest.approx((x.mean(), x.std()))
    config = _config(
        dense_specs={
            "I1": {"transform": "standardize", "clip": [0.0, 40.0]},
            "I2": {"clip": [0, 9]},
        },
        dense_stats=stats,
    )
    dense = Preprocessor(config)(raw).column("dense").combine_chunks().flatten()
    dense = dense.to_numpy().reshape(-1, 2)
    np.testing.assert_allclose(dense[:, 0], (x - x.mean()) / x.std(), rtol=1e-5, atol=1e-6)
    i2 = np.clip(raw.column("I2").to_numpy(), 0, 9)
    np.testing.assert_allclose(dense[:, 1], np.log1p(i2), rtol=1e-6)


def test_an_int64_dense_column_beyond_float32s_exact_range_is_read_rounded() -> None:
    """A timestamp as a dense column (int64 seconds, beyond float32's exact integers) is read at
    float32 precision, by the statistics and the preprocessor alike; the cast once refused it
    ("Integer value ... not in range")."""
    raw = _table()
    seconds = 874_965_478 + 86_400 * np.arange(raw.num_rows, dtype=np.int64)
    raw = raw.set_column(raw.schema.get_field_index("I1"), "I1", pa.array(seconds))
    config = _config(dense_specs={"I1": {"transform": "standardize"}})
    stats = compute_dense_stats([raw], config)
    x = seconds.astype(np.float32).astype(np.float64)
    assert stats["I1"] == pytest.approx((x.mean(), x.std()))
    config = _config(dense_specs={"I1": {"transform": "standardize"}}, dense_stats=stats)
    dense = Preprocessor(config)(raw).column("dense").combine_chunks().flatten()
    dense = dense.to_numpy().reshape(-1, 2)[:, 0]
    np.testing.assert_allclose(dense, (x - x.mean()) / x.std(), rtol=1e-4, atol=1e-4)


def test_dense_stats_of_a_parquet_directory(tmp_path) -> None:
    pq.write_table(_table(), tmp_path / "a.parquet")
    pq.write_table(_table([5, 5]), tmp_path / "b.parquet")
    config = _config(dense_transform="standardize")
    stats = dense_stats_of(str(tmp_path), config)
    both = np.concatenate(
        [_table().column("I1").to_numpy(), _table([5, 5]).column("I1").to_numpy()]
    )
    assert stats["I1"] == pytest.approx((both.mean(), both.std()))
    assert set(stats) == {"I1", "I2"}


def test_bucketized_dense_columns_become_features_of_their_own() -> None:
    """A bucketized column keeps its dense input and adds the feature ``<column>_bucket``: one
    bucket per distinct training value when they are few enough (boundaries halfway), else
    quantiles of the distinct values; values are clipped first, unseen ones land between."""
    config = _config(dense_buckets=4, dense_specs={"I1": {"buckets": 64, "clip": [0.0, 40.0]}})
    assert config.feature_columns() == ["user", "item", "tags", "I1_bucket", "I2_bucket"]
    assert config.table_size_of("I1_bucket") == 64 and config.table_size_of("I2_bucket") == 4
    raw = _table()
    with pytest.raises(ValueError, match=r"\['I1', 'I2'\] have no data.bucket_boundaries"):
        Preprocessor(config)
    bounds = compute_bucket_boundaries([raw.slice(0, 4), raw.slice(4)], config)
    i1 = np.clip(raw.column("I1").to_numpy(), 0, 40)
    distinct = np.unique(i1)  # 10 values, fewer than 64: one bucket each
    np.testing.assert_allclose(bounds["I1"], (distinct[1:] + distinct[:-1]) / 2)
    i2 = np.unique(raw.column("I2").to_numpy()).astype(float)  # 10 values, more than 4
    np.testing.assert_allclose(bounds["I2"], np.quantile(i2, [0.25, 0.5, 0.75]))
    assert compute_bucket_boundaries([raw.slice(0, 1)], config)["I1"] == []  # one value
    config = _config(
        dense_buckets=4,
        dense_specs={"I1": {"buckets": 64, "clip": [0.0, 40.0]}},
        bucket_boundaries=bounds,
    )
    out = Preprocessor(config)(raw)
    ranks = {v: k for k, v in enumerate(distinct)}
    assert out.column("I1_bucket").to_pylist() == [ranks[v] for v in i1]
    assert out.column("I2_bucket").to_pylist() == list(
        np.searchsorted(bounds["I2"], raw.column("I2").to_numpy(), side="right")
    )
    dense = out.column("dense").combine_chunks().flatten().to_numpy().reshape(-1, 2)
    np.testing.assert_allclose(dense[:, 0], np.log1p(i1), rtol=1e-6)  # still a dense input
    batch = arrow_to_batch(out, config=config)
    assert batch.sparse.keys == config.feature_columns()
    tables = WorkerSpec(data=config).tables()
    assert [(t.name, t.num_embeddings) for t in tables][-2:] == [
        ("t_I1_bucket", 64),
        ("t_I2_bucket", 4),
    ]
    unseen = raw.set_column(1, "I1", pa.array([-3.0, 100.0, 7.0] + [0.0] * (raw.num_rows - 3)))
    got = Preprocessor(config)(unseen).column("I1_bucket").to_pylist()[:3]
    assert got == [0, len(distinct) - 1, int(np.searchsorted(bounds["I1"], 7.0, side="right"))]


def test_statistics_skip_non_finite_values_and_sampling_ignores_row_order(monkeypatch) -> None:
    """A NaN or infinite value (a bad row, which training skips) counts in neither the mean nor
    the buckets; beyond MAX_DISTINCT distinct values a value-hash sample is kept, the same
    whatever the order of the rows."""
    from raydlrm.ingestion import stats

    config = _config(dense_buckets=8, dense_specs={"I1": {"transform": "standardize"}})
    x = np.arange(100, dtype=np.float64)
    dirty = pa.table({"I1": np.r_[x, np.nan, np.inf], "I2": np.r_[x, -np.inf, 3.0]})
    assert compute_dense_stats([dirty], config)["I1"] == pytest.approx((x.mean(), x.std()))
    clean = compute_bucket_boundaries([pa.table({"I1": x, "I2": x})], config)
    assert compute_bucket_boundaries([dirty], config) == clean
    assert all(np.isfinite(b).all() for b in clean.values())
    values = np.random.default_rng(0).normal(size=1000)
    table = pa.table({"I1": values, "I2": values})
    every = compute_bucket_boundaries([table], config)
    monkeypatch.setattr(stats, "MAX_DISTINCT", 40)
    forward = compute_bucket_boundaries(table.to_batches(max_chunksize=64), config)
    backward = table.take(pa.array(np.arange(999, -1, -1)))
    assert compute_bucket_boundaries(backward.to_batches(max_chunksize=50), config) == forward
    assert len(forward["I1"]) == 7 and forward != every  # a sample's quantiles


def test_bucket_boundaries_of_a_parquet_directory(tmp_path) -> None:
    pq.write_table(_table(), tmp_path / "a.parquet")
    pq.write_table(_table([5, 5]), tmp_path / "b.parquet")
    config = _config(dense_specs={"I2": {"buckets": 200}})
    both = np.concatenate(
        [_table().column("I2").to_numpy(), _table([5, 5]).column("I2").to_numpy()]
    )
    values = np.unique(both).astype(float)
    assert bucket_boundaries_of(str(tmp_path), config) == {
        "I2": ((values[1:] + values[:-1]) / 2).tolist()
    }


def test_weights_travel_aligned_with_their_ids() -> None:
    config = _config(sparse_specs={"tags": {"weight_column": "tag_weight"}})
    out = Preprocessor(config)(_table())
    batch = arrow_to_batch(out, config=config)
    kjt = batch.sparse
    assert kjt.weights is not None and kjt.weights.dtype == torch.float32
    assert kjt.weights.numel() == kjt.values.numel()
    # user and item are unweighted (weight 1); tags carry their column's weights, in order.
    num_single = 2 * batch.batch_size
    assert torch.all(kjt.weights[:num_single] == 1)
    expected = [w for ws in _table().column("tag_weight").to_pylist() for w in ws]
    assert kjt.weights[num_single:].tolist() == expected


def test_misaligned_weights_are_an_error_naming_both_columns(tmp_path) -> None:
    config = _config(sparse_specs={"item": {"weight_column": "tag_weight"}})
    with pytest.raises(ValueError, match="'tag_weight' is not aligned with sparse column 'item'"):
        Preprocessor(config)(_table())
    pq.write_table(_table(), tmp_path / "a.parquet")
    with pytest.raises(DataValidationError, match=r"'tag_weight'.*does not match.*'item'"):
        validate_data(str(tmp_path), config)


def test_schema_accepts_string_ids_and_names_bad_weight_types(tmp_path) -> None:
    pq.write_table(_table(), tmp_path / "a.parquet")
    summary = validate_data(str(tmp_path), _config())
    assert summary.list_columns == ["tags"]
    bad = _table().set_column(6, "tag_weight", pa.array([["x"]] * _table().num_rows))
    pq.write_table(bad, tmp_path / "a.parquet")
    config = _config(sparse_specs={"tags": {"weight_column": "tag_weight"}})
    with pytest.raises(DataValidationError, match=r"'tag_weight'.*list<element: string>"):
        validate_data(str(tmp_path), config)


def test_dedup_groups_hold_unique_rows_and_expand_to_the_plain_features() -> None:
    sessions = [3, 1, 2, 4]
    plain_config = _config(sparse_specs={"tags": {"weight_column": "tag_weight"}})
    config = _config(
        sparse_specs={"tags": {"weight_column": "tag_weight"}}, dedup_groups=[["user", "tags"]]
    )
    plain = arrow_to_batch(Preprocessor(plain_config)(_table(sessions)), config=plain_config)
    batch = arrow_to_batch(Preprocessor(config)(_table(sessions)), config=config)
    assert batch.sparse.keys == ["item"]
    (group,) = batch.dedup_groups
    assert group.keys == ["user", "tags"]
    assert group.unique.batch_size == len(sessions) < batch.batch_size
    expanded = group.expand()
    reference = plain.sparse.select(["user", "tags"])
    assert torch.equal(expanded.lengths, reference.lengths)
    assert torch.equal(expanded.values, reference.values)
    assert torch.equal(expanded.weights, reference.weights)
    everything = batch.all_sparse().select(plain.sparse.keys)
    assert torch.equal(everything.values, plain.sparse.values)
    # A slice (as Ray Data re-batches) deduplicates within the slice.
    part = arrow_to_batch(Preprocessor(config)(_table(sessions)).slice(2, 5), config=config)
    assert part.dedup_groups[0].unique.batch_size == 4  # rows 2-6: sessions 0, 1, 2, 2, 3


def test_dedup_key_collision_falls_back_to_no_dedup() -> None:
    config = _config(dedup_groups=[["user"]])
    out = Preprocessor(config)(_table())
    collided = out.set_column(
        out.schema.get_field_index("dedup:0"), "dedup:0", pa.array(np.zeros(out.num_rows, np.int64))
    )
    with pytest.warns(UserWarning, match="collision"):
        batch = arrow_to_batch(collided, config=config)
    group = batch.dedup_groups[0]
    assert group.unique.batch_size == batch.batch_size
    assert torch.equal(
        group.expand().values,
        arrow_to_batch(out, config=config).all_sparse().select(["user"]).values,
    )


def _with_missing(num_rows: int = 500, share: float = 0.16) -> pa.Table:
    """``_table()``-like rows whose I1 (around 1000, deviation 10) is missing in ``share`` of
    them and whose I2 has no missing value."""
    rng = np.random.default_rng(1)
    missing = np.arange(num_rows) < int(share * num_rows)
    rng.shuffle(missing)
    return pa.table(
        {
            "label": pa.array(rng.integers(0, 2, num_rows)),
            "I1": pa.array(rng.normal(1000.0, 10.0, num_rows), mask=missing),
            "I2": pa.array(rng.integers(0, 100, num_rows)),
            "user": pa.array([f"u{i % 7}" for i in range(num_rows)]),
            "item": pa.array(np.arange(num_rows, dtype=np.int64)),
            "tags": pa.array([["t"]] * num_rows, pa.list_(pa.string())),
        }
    )


def _dense(out: pa.Table, width: int) -> np.ndarray:
    return out.column("dense").combine_chunks().flatten().to_numpy().reshape(-1, width)


@pytest.mark.parametrize("policy", ["zero", "mean", "median"])
def test_missing_dense_values_are_filled_and_statistics_use_present_values(policy) -> None:
    """Whatever the fill, the standardization uses the present values' mean and deviation (a
    16%-missing column keeps its spread); ``mean`` and ``median`` fill with that statistic of
    the present, clipped values in raw units, which is then clipped and standardized."""
    clip = {"clip": [0.0, 1010.0]}
    config = _config(dense_fill=policy, dense_specs={"I1": {"transform": "standardize", **clip}})
    raw = _with_missing()
    i1 = raw.column("I1").to_numpy(zero_copy_only=False)
    missing = np.isnan(i1)
    present = np.clip(i1[~missing].astype(np.float32), 0.0, 1010.0).astype(np.float64)
    batches = [raw.slice(0, 123), raw.slice(123)]
    stats = compute_dense_stats(batches, config)
    assert stats["I1"] == pytest.approx((present.mean(), present.std()))
    fills = compute_dense_fill_values(batches, config)
    expected_fill = {"zero": 0.0, "mean": present.mean(), "median": np.median(present)}[policy]
    if policy == "zero":
        assert fills == {} and config.fill_value_of("I1") == 0.0
    else:
        assert set(fills) == {"I1", "I2"} and fills["I1"] == pytest.approx(expected_fill)
    with_stats = _config(
        dense_fill=policy,
        dense_specs={"I1": {"transform": "standardize", **clip}},
        dense_stats=stats,
        dense_fill_values=fills,
    )
    dense = _dense(Preprocessor(with_stats)(raw), 2)
    mean, std = stats["I1"]
    np.testing.assert_allclose(dense[~missing, 0], (present - mean) / std, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(dense[missing, 0], (expected_fill - mean) / std, rtol=1e-4)
    assert dense[~missing, 0].std() == pytest.approx(1.0, rel=1e-3)  # no collapse
    if policy == "mean":
        np.testing.assert_allclose(dense[missing, 0], 0.0, atol=1e-4)


def test_zero_fill_transforms_exactly_as_before_with_given_statistics() -> None:
    """``zero`` (the default) fills with 0 before clipping and the transform, bit for bit."""
    raw = _with_missing(num_rows=64)
    config = _config(dense_specs={"I1": {"transform": "standardize"}}, dense_stats={"I1": (3, 2)})
    assert config.dense_fill == "zero" and config.num_dense_inputs() == 2
    x = np.nan_to_num(raw.column("I1").to_numpy(zero_copy_only=False), nan=0.0)
    expected = (x.astype(np.float32) - np.float32(3.0)) / np.float32(2.0)
    np.testing.assert_array_equal(_dense(Preprocessor(config)(raw), 2)[:, 0], expected)


def test_missing_indicators_widen_the_dense_input_and_the_model_follows() -> None:
    config = _config(
        dense_missing_indicator=True,
        dense_fill="median",
        dense_specs={"I2": {"missing_indicator": False, "fill": "zero"}},
    )
    assert config.missing_indicator_columns() == ["I1"] and config.num_dense_inputs() == 3
    raw = _with_missing(num_rows=50)
    with pytest.raises(ValueError, match=r"\['I1'\] filled with their mean or median"):
        Preprocessor(config)
    fills = compute_dense_fill_values([raw], config)
    assert set(fills) == {"I1"}
    config = _config(
        dense_missing_indicator=True,
        dense_fill="median",
        dense_specs={"I2": {"missing_indicator": False, "fill": "zero"}},
        dense_fill_values=fills,
    )
    out = Preprocessor(config)(raw)
    assert out.schema.field("dense").type == pa.list_(pa.float32(), 3)
    dense = _dense(out, 3)
    missing = raw.column("I1").is_null().to_numpy(zero_copy_only=False)
    np.testing.assert_array_equal(dense[:, 2], missing.astype(np.float32))
    np.testing.assert_allclose(dense[missing, 0], np.log1p(fills["I1"]), rtol=1e-6)
    # Per column: an indicator on I2 alone, the global switch off.
    only = _config(dense_specs={"I2": {"missing_indicator": True}})
    assert only.missing_indicator_columns() == ["I2"] and only.num_dense_inputs() == 3
    batch = arrow_to_batch(out, config=config)
    assert tuple(batch.dense.shape) == (50, 3)
    from raydlrm.models.dlrm import build_model

    spec = WorkerSpec(data=config, model=ModelConfig(embedding_dim=8, bottom_mlp=[16, 8]))
    model = build_model(spec.model, tables=spec.tables(), num_dense=config.num_dense_inputs())
    assert model(batch).shape == (50,)


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"dense_fill": "median"}, "data.dense_fill = 'median'"),
        ({"dense_fill": "mean"}, "data.dense_fill = 'mean'"),
        ({"dense_specs": {"I1": {"fill": "median"}}}, r"data.dense_specs.I1.fill = 'median'"),
    ],
)
def test_a_fill_statistic_of_an_entirely_missing_column_names_it(overrides, key) -> None:
    raw = _with_missing(num_rows=20, share=1.0)
    assert raw.column("I1").null_count == 20
    with pytest.raises(ValueError, match=rf"{key}: dense column 'I1' has no present"):
        compute_dense_fill_values([raw], _config(**overrides))
    # A fill policy on a column without missing values changes nothing.
    raw = _with_missing(num_rows=20, share=0.0)
    plain = Preprocessor(_config())(raw)
    config = _config(**overrides)
    config = _config(**overrides, dense_fill_values=compute_dense_fill_values([raw], config))
    assert Preprocessor(config)(raw).equals(plain)


def test_bad_fill_settings_name_the_key() -> None:
    with pytest.raises(ValueError, match="dense_fill"):
        _config(dense_fill="mode")
    with pytest.raises(ValueError, match=r"dense_specs\.I1\.fill"):
        _config(dense_specs={"I1": {"fill": "mode"}})
    with pytest.raises(ValueError, match=r"data\.dense_fill_values\.I1: not a dense column"):
        _config(dense_fill_values={"I1": 1.0})
    with pytest.raises(ValueError, match=r"data\.dense_fill_values\.I1: must be finite"):
        _config(dense_fill="mean", dense_fill_values={"I1": float("nan")})


def test_medians_are_exact_weighted_and_sampled_medians_stay_close(monkeypatch) -> None:
    """A median counts every occurrence of a value (from each value's count) and is exact up
    to MAX_DISTINCT distinct values; beyond, the value-hash sample's median is close."""
    from raydlrm.ingestion import stats

    config = _config(dense_fill="median")
    skewed = np.r_[np.zeros(60), np.arange(1.0, 41.0), [1e6]]  # 101 values: median 0
    table = pa.table({"I1": skewed, "I2": np.r_[skewed[:-1], 7.0, 8.0][:101]})
    fills = compute_dense_fill_values(table.to_batches(max_chunksize=17), config)
    assert fills["I1"] == np.median(skewed) == 0.0
    assert fills["I2"] == pytest.approx(np.median(table.column("I2").to_numpy()))
    values = np.random.default_rng(0).normal(size=2000)
    table = pa.table({"I1": values, "I2": values})
    exact = compute_dense_fill_values([table], config)["I1"]
    assert exact == pytest.approx(np.median(values.astype(np.float32)))
    monkeypatch.setattr(stats, "MAX_DISTINCT", 200)
    sampled = compute_dense_fill_values(table.to_batches(max_chunksize=64), config)["I1"]
    assert sampled != exact and abs(sampled - exact) < 0.2


def test_bucket_boundaries_count_the_fill_as_a_value() -> None:
    """A column with missing values buckets its fill (as the bucketizer sees it): 0 for
    ``zero`` (as before), the mean for ``mean``; the present values alone otherwise."""
    table = pa.table({"I1": pa.array([10.0, None, 20.0, 30.0, 20.0]), "I2": [1.0, 2, 3, 4, 5]})
    zero = _config(dense_specs={"I1": {"buckets": 8}})
    assert compute_bucket_boundaries([table], zero)["I1"] == [5.0, 15.0, 25.0]
    mean = _config(dense_specs={"I1": {"buckets": 8, "fill": "mean", "clip": [0.0, 18.0]}})
    # Present values clipped: 10, 18, 18, 18 (mean 16); the fill is one more distinct value.
    assert compute_bucket_boundaries([table], mean)["I1"] == [13.0, 17.0]
    recorded = _config(
        dense_specs={"I1": {"buckets": 8, "fill": "mean"}}, dense_fill_values={"I1": 25.0}
    )
    assert compute_bucket_boundaries([table], recorded)["I1"] == [15.0, 22.5, 27.5]
    full = table.set_column(0, "I1", pa.array([10.0, 15.0, 20.0, 30.0, 20.0]))
    assert compute_bucket_boundaries([full], zero)["I1"] == [12.5, 17.5, 25.0]


def test_training_statistics_compute_the_missing_fill_values_of_a_directory(tmp_path) -> None:
    pq.write_table(_with_missing(num_rows=100), tmp_path / "a.parquet")
    pq.write_table(_with_missing(num_rows=60, share=0.5), tmp_path / "b.parquet")
    both = pa.concat_tables([_with_missing(num_rows=100), _with_missing(num_rows=60, share=0.5)])
    present = both.column("I1").drop_null().to_numpy().astype(np.float32)
    config = _config(dense_fill="median", dense_specs={"I2": {"fill": "mean"}})
    computed = training_statistics(str(tmp_path), config)
    assert computed.dense_fill_values == {
        "I1": pytest.approx(np.median(present)),
        "I2": pytest.approx(both.column("I2").to_numpy().mean()),
    }
    recorded = _config(dense_fill="median", dense_fill_values={"I1": 5.0})
    assert training_statistics(str(tmp_path), recorded).dense_fill_values == {
        "I2": np.median(both.column("I2").to_numpy())  # only the one it lacks
    }


def test_inspect_reports_missing_shares_and_flags_a_fill_that_dominates(tmp_path) -> None:
    """A column 16% missing around 1000 and filled with 0: its present values spread over a
    sliver of the column as the model sees it (log1p or standardized alike), which inspect
    flags naming the column and the settings; a median fill does not collapse it."""
    from raydlrm.ingestion.inspect import COLLAPSED_SPREAD, inspect_data

    pq.write_table(_with_missing(), tmp_path / "part-0.parquet")
    for transform in ("log1p", "standardize"):
        report = inspect_data(str(tmp_path), _config(dense_transform=transform))["dense"]
        i1 = report["I1"]
        assert i1["nulls"] == 80 and i1["missing_share"] == pytest.approx(0.16)
        assert i1["present_spread"] < COLLAPSED_SPREAD
        assert i1["flag"].startswith(
            "dense column 'I1' is 16.0% missing, filled with zero (data.dense_fill)"
        )
        assert 'data.dense_fill = "median"' in i1["flag"]
        assert "data.dense_missing_indicator = true" in i1["flag"]
        assert report["I2"]["missing_share"] == 0.0 and report["I2"]["flag"] is None
    x = _with_missing().column("I1").to_numpy(zero_copy_only=False)
    inputs = np.nan_to_num(x, nan=0.0)  # standardized: an affine map of the filled values
    expected = inputs[~np.isnan(x)].std() / inputs.std()
    assert i1["present_spread"] == pytest.approx(expected, rel=1e-3)
    median = inspect_data(str(tmp_path), _config(dense_specs={"I1": {"fill": "median"}}))
    assert median["dense"]["I1"]["flag"] is None
    assert median["dense"]["I1"]["present_spread"] > 1.0
