"""One family of keys sizes every row cache (``sharding.cache_load_factor``, its per-table
override, ``sharding.cache_min_rows``): defaults per kind of cache, one value for every kind,
and errors that name the keys which sized the cache at fault."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from raydlrm.batch import KeyedJaggedTensor
from raydlrm.models.embedding import EmbeddingBagCollection, EmbeddingBagConfig
from raydlrm.sharding import (
    MemoryBudget,
    ShardedEmbeddingBagCollection,
    ShardingConfig,
    plan_sharding,
)
from raydlrm.sharding.planner.storage import table_cache_rows
from raydlrm.sharding.tiers import TierError


def _table(name: str, rows: int, dim: int = 4) -> EmbeddingBagConfig:
    return EmbeddingBagConfig(
        name=name, num_embeddings=rows, embedding_dim=dim, feature_names=(f"f_{name}",)
    )


def _collection(tables: list, config: ShardingConfig) -> ShardedEmbeddingBagCollection:
    plan = plan_sharding(tables, world_size=1, config=config)
    ebc = EmbeddingBagCollection(tables, device="meta", seed=5)
    return ShardedEmbeddingBagCollection(ebc, plan=plan, config=config, device="cpu")


def test_each_kind_of_cache_keeps_its_default_and_one_value_sizes_every_kind() -> None:
    """Unset, the caches are sized as before the merge (ssd 0.2 and 65,536 rows; int8 / int4
    and host 0.05 and no minimum); a value set sizes every kind, a table's own overrides it."""
    ssd, q, host = _table("ssd", 100_000), _table("q", 100_000), _table("host", 100_000)
    tables = [ssd, q, host]

    def rows(**settings) -> list[int]:
        config = ShardingConfig(
            placement={"ssd": "ssd", "host": "host"},
            weights_precision_per_table={"q": "int8"},
            **settings,
        )
        return [table_cache_rows(t, config) for t in tables]

    assert rows() == [65_536, 5_000, 5_000]
    assert rows(cache_load_factor=0.1) == [65_536, 10_000, 10_000]
    assert rows(cache_min_rows=20_000) == [20_000, 20_000, 20_000]  # host has a minimum now
    assert rows(cache_load_factor_per_table={"ssd": 0.9, "host": 0.3}) == [90_000, 5_000, 30_000]
    assert rows(cache_load_factor=0.0, cache_load_factor_per_table={"q": 0.5, "host": 0.5}) == [
        0,  # an ssd table without a cache
        50_000,
        50_000,
    ]


def test_no_cache_is_refused_for_the_kinds_that_need_one_naming_the_key() -> None:
    """A load factor of 0 means no cache: an fp32 / fp16 ssd table trains on its file; an
    int8 / int4 or host table cannot, and is refused with the key, before any plan or where
    the planner places it."""
    with pytest.raises(
        ValueError,
        match=r"sharding\.cache_load_factor = 0 \(no row cache\) is for fp32 / fp16 ssd "
        r"tables; the tables by default train through a row cache \(int8 / int4 tables\)",
    ):
        ShardingConfig(weights_precision="int8", cache_load_factor=0.0)
    with pytest.raises(
        ValueError,
        match=r"sharding\.cache_load_factor_per_table\.t0 = 0 .* table 't0' trains through a "
        r"row cache \(host tables\)",
    ):
        ShardingConfig(placement={"t0": "host"}, cache_load_factor_per_table={"t0": 0.0})
    ShardingConfig(placement={"t0": "ssd"}, cache_load_factor_per_table={"t0": 0.0})
    # Spilled to host by the planner: the table is named as its cache is sized.
    config = ShardingConfig(default_placement="auto", spill_placement="host", cache_load_factor=0.0)
    with pytest.raises(ValueError, match=r"cache_load_factor = 0 .* table 'big' trains"):
        plan_sharding(
            [_table("big", 100_000, 16), _table("small", 100)],
            world_size=1,
            config=config,
            memory_budget=MemoryBudget(4_000_000, "test"),
        )


def test_a_host_cache_too_small_for_a_step_names_the_keys_that_sized_it() -> None:
    """The error of a step beyond a cache names the keys that sized that table's cache, with
    their values (a host table's, not the ssd keys it once named)."""
    config = ShardingConfig(placement={"t_big": "host"}, cache_load_factor_per_table={"t_big": 0.1})
    collection = _collection([_table("t_big", 100)], config)
    kjt = KeyedJaggedTensor.from_lengths(
        ["f_t_big"], torch.arange(20), torch.ones(20, dtype=torch.long)
    )
    with pytest.raises(
        TierError,
        match=r"cache holds 10 .* or raise sharding\.cache_load_factor_per_table\.t_big = 0\.1 "
        r"or sharding\.cache_min_rows \(unset: 1 for host tables\)$",
    ):
        collection(kjt)
    # With a minimum, the same step fits.
    roomy = dataclasses.replace(config, cache_min_rows=20)
    assert _collection([_table("t_big", 100)], roomy)(kjt).values.shape == (20, 4)


def test_ssd_tables_with_and_without_a_cache_train_side_by_side(tmp_path: Path) -> None:
    """A table's own load factor of 0 leaves it without a cache while another ssd table of the
    same precision keeps one: they are looked up by two kernels, and train as in DRAM."""
    tables = [_table("a", 300, 8), _table("b", 300, 8)]
    settings = {"optimizer": "adagrad", "learning_rate": 0.1, "ssd_path": str(tmp_path)}
    dram = _collection(tables, ShardingConfig(**settings))
    ssd = _collection(
        tables,
        ShardingConfig(
            default_placement="ssd",
            cache_load_factor_per_table={"a": 0.0, "b": 0.1},
            cache_min_rows=40,
            **settings,
        ),
    )
    assert [c is not None for c in ssd._caches] == [False, True]
    gen = torch.Generator().manual_seed(0)
    for _ in range(6):
        ids = torch.randint(0, 300, (64,), generator=gen)
        outputs = []
        for collection in (dram, ssd):
            kjt = KeyedJaggedTensor.from_lengths(["f_a", "f_b"], ids, torch.full((32,), 2))
            pooled = collection(kjt).values
            pooled.square().sum().backward()
            outputs.append(pooled.detach())
        assert torch.equal(*outputs)
    assert ssd._caches[1].written_rows()["b"] > 0  # evicted and written back
    for name, weight in dram.local_tables().items():
        assert torch.equal(ssd.local_tables()[name], weight), name
