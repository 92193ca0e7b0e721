"""NeuroShard's search with the learned cost model: the greedy grid and the column-halving beam
search on a cost model whose answers are known, and the planner's learned path on a trained
model: valid plans, every table once, memory budgets, tiers and pins kept."""

from __future__ import annotations

import numpy as np
import pytest

from raydlrm.models.embedding import EmbeddingBagConfig
from raydlrm.sharding.config import ShardingConfig
from raydlrm.sharding.plan import MemoryBudget, ShardingPlan
from raydlrm.sharding.planner.learned_cost import TableStats, collect_samples, train_cost_model
from raydlrm.sharding.planner.neural_search import NeuralSearch
from raydlrm.sharding.planner.planners import plan_sharding
from raydlrm.sharding.planner.request import BudgetError


def _lookup_search(dims, pooling, *, world_size, room=None, memory=None):
    """A search whose compute model is exact: a rank's cost is the sum of its pieces'
    ``dim x pooling`` (a one-value latent, the identity head); no transfer."""
    pooling = np.asarray(pooling, dtype=float)
    return NeuralSearch(
        latent=lambda dim: (dim * pooling)[:, None],
        head=lambda sums: sums[..., 0],
        transfer=lambda sums: np.zeros(sums.shape),
        dims=dims,
        memory=memory or [1] * len(dims),
        base_latent=np.zeros((world_size, 1)),
        base_dims=np.zeros(world_size),
        room=np.asarray(room if room is not None else [10**12] * world_size),
    )


def test_the_greedy_grid_balances_and_the_beam_search_halves_the_bottleneck() -> None:
    # One table of 64 x 10 = 640 beside four of 16 x 1: table-wise, one rank carries 640.
    search = _lookup_search([64, 16, 16, 16, 16], [10, 1, 1, 1, 1], world_size=2)
    whole = search.table_wise()
    assert whole.cost == pytest.approx(640)
    assert sorted(whole.compute.tolist()) == pytest.approx([64, 640])
    split = search.column_wise()  # the big table in two halves of 320, one on each rank
    assert split.cost == pytest.approx(352)
    halves = [r for p, r in zip(split.pieces, split.ranks, strict=True) if p.table == 0]
    assert sorted(halves) == [0, 1] and all(p.dim == 32 for p in split.pieces if p.table == 0)


def test_the_search_keeps_to_the_memory_left_and_fails_when_nothing_fits() -> None:
    # Rank 0 has no room: everything goes to rank 1 however unbalanced.
    search = _lookup_search([8, 8, 8], [1, 1, 1], world_size=2, room=[0, 100], memory=[10] * 3)
    result = search.table_wise()
    assert result.ranks == [1, 1, 1]
    tight = _lookup_search([8, 8], [1, 1], world_size=2, room=[5, 15], memory=[10, 10])
    assert tight.table_wise() is None  # the second table fits nowhere once the first is placed


@pytest.fixture(scope="module")
def model():
    """A learned model trained on a few measured sets of small tables (its predictions are
    rough; the plans' validity is what is tested)."""
    samples = collect_samples(
        24, kernel="auto", batch_size=64, seed=5, max_tables=6, max_rows=20000, repeats=1
    )
    return train_cost_model(samples, epochs=50, held_out=0)


def _tables(n):
    return [
        EmbeddingBagConfig(
            name=f"t{i}",
            num_embeddings=1000 * (i + 1),
            embedding_dim=8 * (1 + i % 4),
            feature_names=[f"f{i}"],
        )
        for i in range(n)
    ]


def test_the_learned_planner_covers_every_table_within_the_budget(model, caplog) -> None:
    tables = _tables(12)
    rng = np.random.default_rng(0)
    stats = {
        t.name: TableStats.of_batch(
            rows=t.num_embeddings,
            dim=t.embedding_dim,
            ids=rng.integers(0, 50, size=64 * 3),
            bags=64,
        )
        for t in tables[:6]  # the rest are costed as uniform lookups
    }
    config = ShardingConfig(
        default_type="auto",
        pinned_ranks={"t0": [1]},
        placement={"t11": "ssd"},
        weights_precision_per_table={"t10": "int8"},
    )
    budget = MemoryBudget(4_000_000, "test budget")
    plan = plan_sharding(
        tables,
        world_size=2,
        config=config,
        batch_size=64,
        memory_budget=budget,
        learned=model,
        table_stats=stats,
    )
    plan.validate(tables)  # every table covered exactly once
    plan.check_memory_budget()
    assert plan.cost_model == "learned" and len(plan.predicted_seconds) == 2
    assert all(s > 0 for s in plan.predicted_seconds)
    assert plan.table("t0").ranks == [1]  # pinned
    assert plan.table("t11").placement == "ssd"  # the tier is kept
    assert {plan.table(t.name).sharding_type for t in tables} <= {"table_wise", "column_wise"}
    again = ShardingPlan.from_json(plan.to_json())
    assert again.predicted_seconds == plan.predicted_seconds and again.cost_model == "learned"
    assert "predicted s" in plan.format_table()
    # A budget the tables cannot fit is an error naming the budget.
    with pytest.raises(BudgetError, match="test budget"):
        plan_sharding(
            tables,
            world_size=2,
            config=ShardingConfig(default_type="table_wise"),
            batch_size=64,
            memory_budget=MemoryBudget(100_000, "test budget"),
            learned=model,
        )


def test_table_statistics_from_a_batch_of_the_data() -> None:
    """Each table's ids per sample and access histogram, from its columns' ids (lists
    flattened, nulls dropped; columns sharing a table counted together)."""
    import pyarrow as pa

    from raydlrm.platform.config import load_config
    from raydlrm.platform.job_data import table_stats
    from raydlrm.sharding.planner.learned_cost import histogram_of_counts

    job = load_config(
        None,
        overrides=[
            'data.sparse_columns=["a", "b", "c"]',
            'data.sparse_specs={a = {table = "ab"}, b = {table = "ab"}}',
            "data.table_size=1000",
        ],
    )
    batch = pa.table(
        {
            "a": [1, 1, 2, 3],
            "b": [1, 5, None, 3],
            "c": [["x", "y"], ["x"], ["x", "x", "z"], []],
        }
    )
    stats = table_stats(job, batch)
    assert set(stats) == {"ab", "t_c"}
    # ab: ids 1, 1, 2, 3, 1, 5, 3 (the null dropped) over 4 samples: 1 three times, 3 twice.
    assert stats["ab"].pooling == 7 / 4 and stats["ab"].rows == 1000
    assert stats["ab"].histogram == histogram_of_counts(np.array([3, 1, 2, 1]))
    assert stats["t_c"].pooling == 6 / 4
    assert stats["t_c"].histogram == histogram_of_counts(np.array([4, 1, 1]))


def test_the_search_path_predicts_as_the_model_and_warns_outside_its_range(model, caplog) -> None:
    shard = [
        TableStats(3000, 16, 2.0, (1.0,) + (0.0,) * 16),
        TableStats(9000, 32, 4.0, (0.5, 0.5) + (0.0,) * 15),
    ]
    latents = model.latents([t.features() for t in shard])
    assert model.head_seconds(latents.sum(axis=0)) == pytest.approx(model.predict([shard])[0])
    huge = TableStats(10**9, 512, 1000.0, (1.0,) + (0.0,) * 16)
    with caplog.at_level("WARNING"):
        model.warn_outside(
            {"huge": huge.features(), "fine": shard[0].features()},
            world_size=2,
            set_sizes=[1, 1000],
        )
    text = caplog.text
    assert (
        "not trained on tables like 1 of these: huge (log10 rows 9" in text and "fine" not in text
    )
    assert "a rank holds 1000 tables" in text
    assert "has no all-to-all samples" in text
