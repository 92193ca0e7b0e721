"""The planner's search and cost model: balance, capacity, determinism, scale, calibration."""

from __future__ import annotations

import math
import random
import time
from dataclasses import replace
from pathlib import Path

import pytest
import tomllib

from raydlrm.models.embedding import EmbeddingBagConfig
from raydlrm.sharding import MemoryBudget, ShardingConfig, plan_sharding
from raydlrm.sharding.planner.calibration import CalibrationSizes, calibrate
from raydlrm.sharding.planner.cost import (
    CostConstants,
    estimate_table_cost,
    expected_distinct_rows,
    load_constants,
    save_constants,
)
from raydlrm.sharding.tiers import TierError

_ROOT = Path(__file__).resolve().parents[2]


def _skewed(num_tables: int, *, seed: int = 0) -> tuple[list[EmbeddingBagConfig], dict]:
    """Power-law pooling factors and sizes: a few hot tables, many cold ones."""
    rng = random.Random(seed)
    tables = [
        EmbeddingBagConfig(
            name=f"t{i:03d}",
            num_embeddings=rng.randint(1_000, 1_000_000),
            embedding_dim=rng.choice([16, 32, 64, 128]),
            feature_names=(f"f{i:03d}",),
        )
        for i in range(num_tables)
    ]
    pooling = {t.name: 100.0 / (i + 1) ** 1.2 + 1.0 for i, t in enumerate(tables)}
    return tables, pooling


def test_refinement_balances_skewed_tables_better_than_greedy() -> None:
    tables, pooling = _skewed(100)
    kwargs = {"world_size": 8, "pooling_factors": pooling}
    greedy = plan_sharding(tables, config=ShardingConfig(), search="greedy", **kwargs)
    refined = plan_sharding(tables, config=ShardingConfig(), **kwargs)
    auto = plan_sharding(tables, config=ShardingConfig(default_type="auto"), **kwargs)
    assert max(refined.per_rank_cost()) <= max(greedy.per_rank_cost())
    # The hottest table alone outweighs a fair share; only splitting it balances the ranks.
    assert greedy.imbalance() > 1.5
    assert auto.imbalance() < 1.1
    assert auto.imbalance() < greedy.imbalance()
    assert any(t.sharding_type != "table_wise" for t in auto.tables)


def test_refinement_never_increases_the_max() -> None:
    for seed in range(8):
        rng = random.Random(seed)
        tables, pooling = _skewed(rng.randint(5, 60), seed=seed)
        world_size = rng.choice([2, 3, 5, 8])
        for default_type in ("table_wise", "auto"):
            config = ShardingConfig(default_type=default_type)
            kwargs = {"world_size": world_size, "config": config, "pooling_factors": pooling}
            greedy = plan_sharding(tables, search="greedy", **kwargs)
            refined = plan_sharding(tables, **kwargs)
            assert max(refined.per_rank_cost()) <= max(greedy.per_rank_cost()) * (1 + 1e-9)


def test_capacity_is_respected_and_violations_name_the_table() -> None:
    tables, pooling = _skewed(40)
    capacity = 1 + max(
        estimate_table_cost(
            t, sharding_type="table_wise", num_shards=1, world_size=4, batch_size=512
        ).memory_bytes
        for t in tables
    )
    total = sum(
        estimate_table_cost(
            t, sharding_type="table_wise", num_shards=1, world_size=4, batch_size=512
        ).memory_bytes
        for t in tables
    )
    capacity = max(capacity, total // 3)
    config = ShardingConfig(device_memory_bytes=capacity)
    plan = plan_sharding(tables, world_size=4, config=config, pooling_factors=pooling)
    assert max(plan.per_rank_memory()) <= capacity
    big = EmbeddingBagConfig(
        name="huge", num_embeddings=10_000_000, embedding_dim=128, feature_names=("fh",)
    )
    small = ShardingConfig(device_memory_bytes=10**9)
    with pytest.raises(ValueError, match=r"'huge' \(5160000000 bytes.*cannot fit anywhere"):
        plan_sharding([*tables, big], world_size=4, config=small)
    # auto splits it row-wise when the pieces fit, and still respects the capacity.
    auto = ShardingConfig(default_type="auto", device_memory_bytes=2 * 10**9)
    plan = plan_sharding([big], world_size=4, config=auto)
    assert plan.table("huge").sharding_type == "row_wise"
    assert max(plan.per_rank_memory()) <= 2 * 10**9
    with pytest.raises(ValueError, match="'huge'"):
        plan_sharding([big], world_size=2, config=auto)


def _rows(name: str, num_embeddings: int) -> EmbeddingBagConfig:
    """A dim-4 table: 20 bytes per row with fp32 weights and row-wise Adagrad, 12 with fp16."""
    return EmbeddingBagConfig(
        name=name, num_embeddings=num_embeddings, embedding_dim=4, feature_names=(name,)
    )


def test_budget_errors_name_the_table_rank_shortfall_and_source() -> None:
    budget = MemoryBudget(1_000_000, "2.00 GiB node memory / 2 workers - 1.00 GiB overhead")
    source = r"budget 976\.56 KiB per worker = 2\.00 GiB node memory / 2 workers - 1\.00 GiB"
    # 600 kB each: the first fits rank 0, the second is 200 kB short there.
    two = [_rows("a", 30_000), _rows("b", 30_000)]
    with pytest.raises(
        ValueError,
        match=r"^table 'b' \(table_wise, 600000 bytes .*\) does not fit on rank 0: its shard "
        r"needs 600000 bytes, 400000 bytes .* free there, short by 200000 bytes "
        rf"\(195\.31 KiB\); {source}",
    ):
        plan_sharding(two, world_size=1, config=ShardingConfig(), memory_budget=budget)
    # Larger than a whole rank's budget: named, whichever rank.
    with pytest.raises(
        ValueError,
        match=r"^table 'big' \(1200000 bytes in at most 1 shard\(s\)\) is short by 200000 bytes "
        rf"\(195\.31 KiB\) on any rank: cannot fit anywhere, {source}",
    ):
        plan_sharding(
            [_rows("big", 60_000)], world_size=2, config=ShardingConfig(), memory_budget=budget
        )
    # fp16 weights: 12 bytes per row, so both fit on the one rank.
    fp16 = ShardingConfig(weights_precision="fp16")
    plan = plan_sharding(two, world_size=1, config=fp16, memory_budget=budget)
    assert plan.per_rank_memory() == [720_000]
    # The argument overrides sharding.device_memory_bytes, which is the default budget.
    explicit = ShardingConfig(device_memory_bytes=10**9)
    assert plan_sharding(two, world_size=1, config=explicit).memory_budget == MemoryBudget(
        10**9, "sharding.device_memory_bytes"
    )
    with pytest.raises(ValueError, match="short by 200000 bytes"):
        plan_sharding(two, world_size=1, config=explicit, memory_budget=budget)


def test_planner_is_deterministic_and_input_order_free() -> None:
    tables, pooling = _skewed(60)
    shuffled = list(tables)
    random.Random(1).shuffle(shuffled)
    config = ShardingConfig(default_type="auto", device_memory_bytes=4 * 10**9)
    first = plan_sharding(tables, world_size=7, config=config, pooling_factors=pooling)
    again = plan_sharding(tables, world_size=7, config=config, pooling_factors=pooling)
    other = plan_sharding(shuffled, world_size=7, config=config, pooling_factors=pooling)
    assert first.to_json() == again.to_json()
    other.tables.sort(key=lambda t: t.name)
    first.tables.sort(key=lambda t: t.name)
    assert first.to_json() == other.to_json()


def test_pins_are_kept_by_the_search() -> None:
    tables, pooling = _skewed(20)
    config = ShardingConfig(
        default_type="auto",
        pinned_types={"t000": "table_wise", "t001": "column_wise"},
        pinned_ranks={"t002": [3]},
    )
    plan = plan_sharding(tables, world_size=4, config=config, pooling_factors=pooling)
    assert plan.table("t000").sharding_type == "table_wise"
    assert plan.table("t001").sharding_type == "column_wise"
    assert plan.table("t002").ranks == [3]


def test_scale_500_tables_on_256_ranks() -> None:
    tables, pooling = _skewed(500)
    start = time.perf_counter()
    plan = plan_sharding(
        tables, world_size=256, config=ShardingConfig(default_type="auto"), pooling_factors=pooling
    )
    assert time.perf_counter() - start < 10.0
    assert len(plan.tables) == 500


def test_paper_scale_dry_run() -> None:
    raw = tomllib.loads((_ROOT / "configs" / "paper_scale.toml").read_text())
    dim = raw["model"]["embedding_dim"]
    sizes = raw["data"]["table_sizes"]
    tables = [
        EmbeddingBagConfig(name=c, num_embeddings=n, embedding_dim=dim, feature_names=(c,))
        for c, n in sizes.items()
    ]
    assert sum(t.num_embeddings for t in tables) * dim == pytest.approx(1.2e13, rel=0.01)
    config = ShardingConfig(**raw["sharding"])
    start = time.perf_counter()
    plan = plan_sharding(
        tables, world_size=raw["scaling"]["num_workers"], config=config, batch_size=65536
    )
    assert time.perf_counter() - start < 20.0
    assert max(plan.per_rank_memory()) <= config.device_memory_bytes
    assert "row_wise" in plan.format_summary()


def test_constants_round_trip_and_tiny_calibration(tmp_path: Path) -> None:
    constants = CostConstants(lookup_bytes_per_s=1.5e9, comm_bytes_per_s=2e8, source="test")
    path = save_constants(constants, tmp_path / "sub" / "c.json")
    assert load_constants(path) == constants
    (tmp_path / "bad.json").write_text('{"nope": 1}')
    with pytest.raises(ValueError, match="not a cost constants file"):
        load_constants(tmp_path / "bad.json")
    sizes = CalibrationSizes(
        lookups=((1000, 16, 1024), (1000, 32, 4096)),
        repeats=1,
        ssd_file_bytes=4 << 20,
        ssd_pages=64,
    )
    measured = calibrate(sizes=sizes, comm=False, ssd_directory=tmp_path / "ssd")
    assert measured.lookup_bytes_per_s > 0
    assert "comm calibration skipped" in measured.source
    assert f"ssd: random 4 KiB pages of a mapped file in {tmp_path / 'ssd'}" in measured.source
    defaults = CostConstants()
    assert measured.ssd_row_reads_per_s != defaults.ssd_row_reads_per_s
    assert measured.ssd_row_writes_per_s != defaults.ssd_row_writes_per_s
    assert not list((tmp_path / "ssd").iterdir())  # the test file is gone
    assert load_constants(save_constants(measured, tmp_path / "m.json")) == measured
    (tmp_path / "a-file").write_text("")
    with pytest.raises(TierError, match=r"cannot write to .*a-file/ssd \(sharding\.ssd_path\)"):
        calibrate(sizes=sizes, comm=False, ssd_directory=tmp_path / "a-file" / "ssd")


def test_cost_formulas() -> None:
    t = EmbeddingBagConfig(name="t", num_embeddings=100, embedding_dim=8, feature_names=("a",))
    free = CostConstants(lookup_bytes_per_s=1.0, comm_bytes_per_s=1.0, collective_latency_s=0.0)

    def cost(kind: str, k: int, precision: str = "fp32"):
        return estimate_table_cost(
            t,
            sharding_type=kind,
            num_shards=k,
            world_size=4,
            batch_size=10,
            pooling_factor=2.0,
            comm_precision=precision,
            constants=free,
        )

    tw = cost("table_wise", 1)
    assert tw.compute_bytes == 10 * 2 * 8 * 4
    assert tw.input_comm_bytes == 10 * 2 * 8 + 10 * 4
    assert tw.output_comm_bytes == 10 * 8 * 4
    assert cost("table_wise", 1, "fp16").output_comm_bytes == 10 * 8 * 2
    assert cost("row_wise", 4).output_comm_bytes == 4 * 10 * 8 * 4
    assert cost("column_wise", 2).input_comm_bytes == 2 * tw.input_comm_bytes
    assert cost("data_parallel", 4).output_comm_bytes == 2 * 3 * 100 * 8 * 4
    assert tw.seconds == tw.compute_bytes + tw.input_comm_bytes + tw.output_comm_bytes
    # fp16 weights: half the bytes read by the lookups (and stored), the same on the wire.
    half = estimate_table_cost(
        t,
        sharding_type="table_wise",
        num_shards=1,
        world_size=4,
        batch_size=10,
        pooling_factor=2.0,
        weights_precision="fp16",
        constants=free,
    )
    assert half.compute_bytes == tw.compute_bytes / 2
    assert half.output_comm_bytes == tw.output_comm_bytes
    # Looked up per position (a sequence): every id is an output row, so the output bytes
    # grow with the ids (2 per sample), the lookups do not change and a bag of one is sent
    # per id.
    seq = estimate_table_cost(
        replace(t, pooling="none"),
        sharding_type="table_wise",
        num_shards=1,
        world_size=4,
        batch_size=10,
        pooling_factor=2.0,
        constants=free,
    )
    assert seq.compute_bytes == tw.compute_bytes
    assert seq.output_comm_bytes == 2 * tw.output_comm_bytes
    assert seq.input_comm_bytes == 10 * 2 * 8 + 10 * 2 * 4
    # Row-wise per position: each id goes to its one row shard and comes back as its one row
    # (not a partial sum from every shard, nor a length to every shard).
    seq_rw = estimate_table_cost(
        replace(t, pooling="none"),
        sharding_type="row_wise",
        num_shards=4,
        world_size=4,
        batch_size=10,
        pooling_factor=2.0,
        constants=free,
    )
    assert seq_rw.output_comm_bytes == seq.output_comm_bytes
    assert seq_rw.input_comm_bytes == seq.input_comm_bytes


def test_ssd_tier_cost_is_the_disk_time_of_the_rows_a_step_touches() -> None:
    t = EmbeddingBagConfig(name="t", num_embeddings=1000, embedding_dim=8, feature_names=("a",))
    disk = CostConstants(ssd_row_reads_per_s=100.0, ssd_row_writes_per_s=400.0)

    def cost(kind: str = "table_wise", k: int = 1, **kwargs):
        return estimate_table_cost(
            t,
            sharding_type=kind,
            num_shards=k,
            world_size=2,
            batch_size=500,
            pooling_factor=2.0,
            constants=disk,
            **kwargs,
        )

    dram, cold = cost(), cost(placement="ssd")
    distinct = 1000 * (1 - math.exp(-1000 / 1000))  # 1,000 uniform ids over 1,000 rows
    assert expected_distinct_rows(1000, 1000) == pytest.approx(distinct)
    assert dram.disk_rows == dram.disk_seconds == 0.0
    assert cold.disk_rows == pytest.approx(distinct)
    assert cold.disk_seconds == pytest.approx(distinct * (1 / 100 + 1 / 400))
    assert cold.seconds == pytest.approx(dram.seconds + cold.disk_seconds)
    assert cold.memory_bytes == 1000 * 4  # only row-wise Adagrad's state stays in DRAM
    # Rows the page cache holds are not read; every updated page is still written back.
    warm = cost(placement="ssd", page_cache_hit=0.75)
    assert warm.disk_seconds == pytest.approx(distinct * (0.25 / 100 + 1 / 400))
    assert cost("column_wise", 2, placement="ssd").disk_rows == pytest.approx(2 * distinct)
    assert cost("row_wise", 2, placement="ssd").disk_rows == pytest.approx(distinct)
    per_replica = 1000 * (1 - math.exp(-500 / 1000))
    assert cost("data_parallel", 2, placement="ssd").disk_rows == pytest.approx(2 * per_replica)


def test_a_row_cache_as_large_as_its_table_is_warned_about(caplog) -> None:
    """An ssd table whose DRAM cache would hold every row costs more memory than in DRAM: the
    planner says so, naming the table and the key; a cache smaller than the table is quiet."""
    import logging

    table = EmbeddingBagConfig(
        "t_big", num_embeddings=50_000, embedding_dim=16, feature_names=("f",)
    )
    for min_rows, warned in ((65536, True), (8192, False)):
        caplog.clear()
        config = ShardingConfig(placement={"t_big": "ssd"}, cache_min_rows=min_rows)
        with caplog.at_level(logging.WARNING, logger="raydlrm.sharding.planner"):
            plan_sharding([table], world_size=1, config=config)
        messages = [r.getMessage() for r in caplog.records]
        assert bool(messages) == warned, messages
        if warned:
            assert "t_big" in messages[0] and "sharding.cache_min_rows = " in messages[0]
