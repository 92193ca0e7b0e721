"""Planner balance and speed: max/mean per-rank cost of a skewed 100-table set on 8 ranks (greedy
placement, greedy + refinement moves/swaps, and with ``auto`` splitting), and the time to plan
500 tables on 256 ranks.

Run: ``.venv/bin/python benchmarks/planner.py``
"""

from __future__ import annotations

import random
import time

from raydlrm.models.embedding import EmbeddingBagConfig
from raydlrm.sharding import ShardingConfig, plan_sharding


def skewed(num_tables: int, *, seed: int = 0) -> tuple[list[EmbeddingBagConfig], dict]:
    """Random sizes and dims; power-law pooling factors (a few hot tables)."""
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


def main() -> None:
    tables, pooling = skewed(100)
    runs = [
        ("greedy (table_wise)", ShardingConfig(), "greedy"),
        ("greedy + moves/swaps (table_wise)", ShardingConfig(), "refine"),
        ("greedy + moves/swaps + splits (auto)", ShardingConfig(default_type="auto"), "refine"),
    ]
    print("skewed 100 tables on 8 ranks: max/mean per-rank cost")
    for label, config, search in runs:
        plan = plan_sharding(
            tables, world_size=8, config=config, pooling_factors=pooling, search=search
        )
        print(f"  {label:40s} {plan.imbalance():.3f}")
    # Without one dominant table, moves and swaps alone fix greedy's tail.
    mild = {t.name: 1.0 + 9.0 * random.Random(t.name).random() for t in tables}
    print("same 100 tables, pooling factors uniform in [1, 10), 8 ranks: max/mean")
    for label, config, search in runs[:2]:
        plan = plan_sharding(
            tables, world_size=8, config=config, pooling_factors=mild, search=search
        )
        print(f"  {label:40s} {plan.imbalance():.4f}")
    tables, pooling = skewed(500)
    for label, config in (
        ("table_wise", ShardingConfig()),
        ("auto", ShardingConfig(default_type="auto")),
    ):
        start = time.perf_counter()
        plan = plan_sharding(tables, world_size=256, config=config, pooling_factors=pooling)
        elapsed = time.perf_counter() - start
        print(
            f"500 tables on 256 ranks ({label}): {elapsed:.2f} s, max/mean {plan.imbalance():.3f}"
        )


if __name__ == "__main__":
    main()
