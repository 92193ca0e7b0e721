"""Sharding plans (JSON, validation, printing) and the greedy planner."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest

from raydlrm.ids import MAP_BYTES_PER_ROW, ManagedIds
from raydlrm.models.embedding import EmbeddingBagConfig
from raydlrm.sharding import (
    MemoryBudget,
    Shard,
    ShardingConfig,
    ShardingPlan,
    TablePlan,
    plan_sharding,
)
from raydlrm.sharding.planner.planners import table_cost
from raydlrm.sharding.sizes import refresh_bytes, table_memory_bytes
from tests.sharding._fixtures import make_tables


def _skewed_tables() -> list[EmbeddingBagConfig]:
    """One heavy table, a few medium ones and many small ones."""
    dims = [128, 64, 64, 32] + [8] * 12
    return [
        EmbeddingBagConfig(
            name=f"t{i:02d}",
            num_embeddings=100 * (i + 1),
            embedding_dim=d,
            feature_names=(f"f{i:02d}",),
        )
        for i, d in enumerate(dims)
    ]


def test_plan_json_round_trip() -> None:
    plan = plan_sharding(make_tables(), world_size=3, config=ShardingConfig())
    restored = ShardingPlan.from_json(plan.to_json())
    assert restored == plan
    assert isinstance(restored.tables[0].shards[0], Shard)


def test_plan_format_table_lists_every_rank() -> None:
    plan = plan_sharding(make_tables(), world_size=3, config=ShardingConfig())
    lines = plan.format_table().splitlines()
    assert lines[0].split() == ["rank", "tables", "est.", "cost", "memory"]
    assert len(lines) == 2 + 3
    for rank in range(3):
        names = plan.tables_on_rank(rank)
        assert lines[2 + rank].startswith(str(rank))
        assert all(n in lines[2 + rank] for n in names)


def test_per_rank_cost_and_memory_sum_to_table_totals() -> None:
    config = ShardingConfig(optimizer="adagrad")
    tables = make_tables()
    plan = plan_sharding(tables, world_size=2, config=config)
    assert sum(plan.per_rank_cost()) == pytest.approx(sum(table_cost(t) for t in tables))
    assert sum(plan.per_rank_memory()) == sum(
        table_memory_bytes(t, optimizer="adagrad") for t in tables
    )
    # Adagrad keeps one state value per weight: twice the weights' bytes.
    assert table_memory_bytes(tables[0], optimizer="adagrad") == 2 * 50 * 8 * 4
    assert table_memory_bytes(tables[0], optimizer="rowwise_adagrad") == (50 * 8 + 50) * 4


def test_fp16_weights_halve_the_weights_not_the_optimizer_state() -> None:
    t0 = make_tables()[0]  # 50 x 8
    weights_fp32, weights_fp16 = 50 * 8 * 4, 50 * 8 * 2
    for optimizer, state in (("rowwise_adagrad", 50 * 4), ("adagrad", 50 * 8 * 4), ("sgd", 0)):
        assert table_memory_bytes(t0, optimizer=optimizer) == weights_fp32 + state
        fp16 = table_memory_bytes(t0, optimizer=optimizer, weights_precision="fp16")
        assert fp16 == weights_fp16 + state, optimizer


def test_a_managed_table_counts_its_map_and_its_refresh_peak_not_a_copy_of_itself() -> None:
    """A managed table adds its id map (32 bytes a row) and, admitting at the first lookup, the
    bounded peak of its fallback refresh: a few chunks of float64 rows (streamed), the same
    for a table 100x larger, never a float64 copy of the table (3x it, as it once was)."""

    def managed(rows: int, admit_after: int = 1) -> EmbeddingBagConfig:
        policy = ManagedIds(buckets=8, admit_after=admit_after)
        return EmbeddingBagConfig(
            name="m", num_embeddings=rows, embedding_dim=64, feature_names=("f",), managed=policy
        )

    def extra(rows: int) -> int:  # beside the same table hashed
        plain = dataclasses.replace(managed(rows), managed=None)
        return table_memory_bytes(managed(rows), optimizer="sgd") - table_memory_bytes(
            plain, optimizer="sgd"
        )

    small, large = 10**5, 10**7
    assert table_memory_bytes(managed(small, 2), optimizer="sgd") == small * (64 * 4 + 32)
    assert extra(small) - refresh_bytes(managed(small)) == small * MAP_BYTES_PER_ROW
    assert refresh_bytes(managed(large)) == refresh_bytes(managed(small)) < 64 << 20
    assert refresh_bytes(managed(large)) < large * 64 * 8 // 100
    assert refresh_bytes(managed(small, admit_after=2)) == 0


def test_planner_counts_each_table_at_its_weights_precision() -> None:
    tables = make_tables()
    config = ShardingConfig(weights_precision="fp16", weights_precision_per_table={"t1": "fp32"})
    assert (config.weights_precision_of("t0"), config.weights_precision_of("t1")) == (
        "fp16",
        "fp32",
    )
    plan = plan_sharding(tables, world_size=2, config=config)
    assert plan.table("t0").memory_bytes == 50 * 8 * 2 + 50 * 4
    assert plan.table("t1").memory_bytes == 30 * 4 * 4 + 30 * 4
    unknown = ShardingConfig(weights_precision_per_table={"nope": "fp16"})
    with pytest.raises(ValueError, match=r"sharding\.weights_precision_per_table.*\['nope'\]"):
        plan_sharding(tables, world_size=2, config=unknown)


def test_plan_shows_memory_against_its_budget() -> None:
    budget = MemoryBudget(2**20, "1.00 GiB node memory / 2 workers - 0.50 GiB overhead")
    plan = plan_sharding(make_tables(), world_size=2, config=ShardingConfig(), memory_budget=budget)
    assert plan.memory_budget == budget
    memory = plan.per_rank_memory()
    lines = plan.format_table().splitlines()
    assert lines[0].split()[-3:] == ["memory", "/", "budget"]
    for rank in range(2):
        assert lines[2 + rank].endswith(f"{memory[rank] / 2**10:.2f} KiB / 1.00 MiB")
    assert lines[-1] == (
        "memory budget 1.00 MiB per worker = 1.00 GiB node memory / 2 workers - 0.50 GiB overhead"
    )
    summary = plan.format_summary()
    peak = max(memory)
    assert f"memory / budget: max {peak / 2**10:.2f} KiB / 1.00 MiB " in summary
    assert f"({100 * peak / 2**20:.1f}%); budget 1.00 MiB per worker = 1.00 GiB" in summary
    assert ShardingPlan.from_json(plan.to_json()) == plan
    # A plan written before budgets reads back without one.
    data = json.loads(plan.to_json())
    del data["memory_budget"]
    old_plan = ShardingPlan.from_json(json.dumps(data))
    assert old_plan.memory_budget is None
    assert "budget" not in old_plan.format_table()


def _plan_with(tables: list[EmbeddingBagConfig], **changes) -> ShardingPlan:
    plan = plan_sharding(tables, world_size=2, config=ShardingConfig())
    first = plan.tables[0]
    plan.tables[0] = dataclasses.replace(first, **changes)
    return plan


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"shards": []}, "table 't0'.*exactly one shard"),
        ({"shards": [Shard(0, 0, 50, 0, 8), Shard(1, 0, 50, 0, 8)]}, "table 't0'.*covered twice"),
        ({"shards": [Shard(2, 0, 50, 0, 8)]}, "table 't0'.*rank 2"),
        ({"shards": [Shard(0, 0, 40, 0, 8)]}, "table 't0'.*do not cover"),
        ({"num_embeddings": 51}, "table 't0'.*shape"),
    ],
)
def test_plan_validation_errors_name_the_table(changes: dict, message: str) -> None:
    tables = make_tables()
    with pytest.raises(ValueError, match=message):
        _plan_with(tables, **changes).validate(tables)


def test_plan_validation_missing_and_duplicate_tables() -> None:
    tables = make_tables()
    plan = plan_sharding(tables, world_size=2, config=ShardingConfig())
    missing = ShardingPlan(world_size=2, tables=plan.tables[1:])
    with pytest.raises(ValueError, match="table 't0' is not covered"):
        missing.validate(tables)
    twice = ShardingPlan(world_size=2, tables=[*plan.tables, plan.tables[0]])
    with pytest.raises(ValueError, match="table 't0' is planned more than once"):
        twice.validate(tables)
    extra = TablePlan("tz", "table_wise", 4, 4, [Shard(0, 0, 4, 0, 4)])
    with pytest.raises(ValueError, match=r"table 'tz'.*not a model table"):
        ShardingPlan(world_size=2, tables=[*plan.tables, extra]).validate(tables)


def test_planner_is_deterministic_and_order_independent() -> None:
    tables = _skewed_tables()
    shuffled = list(tables)
    random.Random(0).shuffle(shuffled)
    config = ShardingConfig()
    first = plan_sharding(tables, world_size=4, config=config)
    again = plan_sharding(tables, world_size=4, config=config)
    other = plan_sharding(shuffled, world_size=4, config=config)
    assert first.to_json() == again.to_json()
    assert {t.name: t.ranks for t in first.tables} == {t.name: t.ranks for t in other.tables}


def test_planner_balances_skewed_tables() -> None:
    tables = _skewed_tables()
    pooling = {"t00": 20.0}  # the heaviest table by far
    plan = plan_sharding(tables, world_size=4, config=ShardingConfig(), pooling_factors=pooling)
    costs = plan.per_rank_cost()
    heavy_rank = plan.table("t00").ranks[0]
    # The heavy table is alone on its rank; the others share the remaining three evenly
    # (greedy placement is within one table's cost of the best balance).
    assert plan.tables_on_rank(heavy_rank) == ["t00"]
    rest = [c for r, c in enumerate(costs) if r != heavy_rank]
    largest_other = max(t.cost for t in plan.tables if t.name != "t00")
    assert max(rest) - min(rest) <= largest_other
    assert all(plan.tables_on_rank(r) for r in range(4))


def test_planner_honors_pinned_ranks() -> None:
    tables = _skewed_tables()
    config = ShardingConfig(pinned_ranks={"t00": [3], "t01": [3], "t05": [1, 2]})
    plan = plan_sharding(tables, world_size=4, config=config)
    assert plan.table("t00").ranks == [3]
    assert plan.table("t01").ranks == [3]
    assert plan.table("t05").ranks[0] in (1, 2)


def test_planner_rejects_unknown_pinned_table_and_bad_rank() -> None:
    tables = make_tables()
    with pytest.raises(ValueError, match=r"pinned_ranks names unknown tables \['nope'\]"):
        plan_sharding(tables, world_size=2, config=ShardingConfig(pinned_ranks={"nope": [0]}))
    with pytest.raises(ValueError, match=r"pinned_types names unknown tables \['nope'\]"):
        plan_sharding(
            tables, world_size=2, config=ShardingConfig(pinned_types={"nope": "table_wise"})
        )
    with pytest.raises(ValueError, match=r"pinned_ranks\.t0: ranks \[5\]"):
        plan_sharding(tables, world_size=2, config=ShardingConfig(pinned_ranks={"t0": [5]}))
