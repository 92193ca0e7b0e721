"""End-to-end ingestion on a local Ray cluster: Parquet -> actor pool -> split -> Batches."""

from __future__ import annotations

import threading

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from raydlrm.ingestion import (
    DataConfig,
    DataValidationError,
    Preprocessor,
    SyntheticConfig,
    build_dataset,
    generate_synthetic,
    iter_train_batches,
)


@pytest.mark.ray
def test_every_sample_reaches_exactly_one_worker(ray_cluster, tmp_path):
    info = generate_synthetic(
        SyntheticConfig(num_train_rows=3000, num_eval_rows=0, rows_per_file=1000),
        out_dir=tmp_path,
    )
    config = DataConfig(
        train_path=str(info.train_path),
        table_size=1000,
        batch_size=256,
        num_preprocess_actors=1,
        preprocess_batch_size=500,
    )
    ds = build_dataset(str(info.train_path), config)
    shards = ds.streaming_split(2, equal=True)
    batches: list[list] = [[], []]

    def consume(rank: int) -> None:
        batches[rank] = list(iter_train_batches(shards[rank], config=config))

    threads = [threading.Thread(target=consume, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert all(batches), "a worker got no batches"

    sizes = [sum(b.batch_size for b in worker) for worker in batches]
    assert sizes == [1500, 1500]
    ids = torch.cat([b.sample_ids for worker in batches for b in worker]).numpy()
    np.testing.assert_array_equal(np.sort(ids), np.arange(3000))
    assert all(b.batch_size <= 256 for worker in batches for b in worker)

    # The batches hold what the preprocessor makes of the raw rows.
    raw = pa.concat_tables([pq.read_table(f) for f in info.train_files])
    expected = Preprocessor(config)(raw)
    first = batches[0][0]
    rows = first.sample_ids.numpy()
    c1 = first.sparse.values[: first.batch_size].numpy()
    np.testing.assert_array_equal(c1, expected.column("C1").to_numpy()[rows])
    np.testing.assert_array_equal(first.labels.numpy(), expected.column("label").to_numpy()[rows])
    dense = expected.column("dense").combine_chunks().flatten().to_numpy().reshape(-1, 13)
    np.testing.assert_allclose(first.dense.numpy(), dense[rows])


@pytest.mark.ray
def test_bad_path_fails_before_reading(ray_cluster, tmp_path):
    with pytest.raises(DataValidationError, match="does not exist"):
        build_dataset(str(tmp_path / "missing"), DataConfig())
