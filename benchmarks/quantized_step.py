"""Step time of int8 / int4 tables behind their fp32 cache against fp32 tables, one process.

Builds the same sharded collection (world size 1, table-wise) once per variant: fp32 tables,
and each ``precision@factor`` (``sharding.weights_precision``, ``sharding.cache_load_factor``),
and times forward plus backward (the fused update, and for quantized tables the cache's
prefetch: distinct ids, fills, write-backs quantized with stochastic rounding) of the same
batches. Ids are skewed (``u ** skew`` of the rows, ``u`` uniform), as real ids are. Variants
are timed in rounds (each round runs every variant's ``--steps`` steps back to back), so load
changes on a shared machine hit every variant alike; prints the median ms per step over rounds,
the ratio to fp32's median, and the cache hit rate.

Usage::

    python benchmarks/quantized_step.py [--tables 26] [--rows 50000] [--dim 16]
        [--batch 2048] [--variants fp32,int8@0.1,int4@0.1] [--kernel torch] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from raydlrm.batch import KeyedJaggedTensor
from raydlrm.models.embedding import EmbeddingBagCollection, EmbeddingBagConfig
from raydlrm.sharding import ShardedEmbeddingBagCollection, ShardingConfig, plan_sharding


def _collection(tables, variant: str, kernel: str) -> ShardedEmbeddingBagCollection:
    precision, _, factor = variant.partition("@")
    config = ShardingConfig(
        weights_precision=precision, cache_load_factor=float(factor or 1.0), kernel=kernel
    )
    plan = plan_sharding(tables, world_size=1, config=config)
    ebc = EmbeddingBagCollection(tables, device="meta")
    return ShardedEmbeddingBagCollection(ebc, plan=plan, config=config, device="cpu")


def _batches(args, count: int) -> list[KeyedJaggedTensor]:
    gen = torch.Generator().manual_seed(0)
    keys = [f"f{i}" for i in range(args.tables)]
    ones = torch.ones(args.tables * args.batch, dtype=torch.long)
    return [
        KeyedJaggedTensor.from_lengths(
            keys,
            (torch.rand(args.tables * args.batch, generator=gen) ** args.skew * args.rows).long(),
            ones,
        )
        for _ in range(count)
    ]


def _step(collection, kjt) -> None:
    collection(kjt).values.sum().backward()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tables", type=int, default=26)
    parser.add_argument("--rows", type=int, default=50000)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--skew", type=float, default=2.0)
    parser.add_argument("--variants", default="fp32,int8@0.1,int4@0.1")
    parser.add_argument("--kernel", default="torch")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tables = [
        EmbeddingBagConfig(
            name=f"t{i}", num_embeddings=args.rows, embedding_dim=args.dim, feature_names=(f"f{i}",)
        )
        for i in range(args.tables)
    ]
    variants = args.variants.split(",")
    collections = {v: _collection(tables, v, args.kernel) for v in variants}
    batches = _batches(args, args.steps)
    for c in collections.values():  # warm up: fill the caches
        for kjt in batches[:3]:
            _step(c, kjt)
    times: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(args.rounds):
        for v, c in collections.items():
            start = time.perf_counter()
            for kjt in batches:
                _step(c, kjt)
            times[v].append((time.perf_counter() - start) / len(batches) * 1000)
    print(
        f"{args.tables} tables x {args.rows} x {args.dim}, batch {args.batch}, ids u**{args.skew},"
        f" kernel {args.kernel}, {args.threads} thread(s), {args.rounds} rounds x {args.steps} "
        f"steps; load average {os.getloadavg()[0]:.1f}"
    )
    base = statistics.median(times[variants[0]])
    print("| variant | ms/step median [min, max] | / first | cache hit rate |")
    print("|---|---|---|---|")
    for v in variants:
        rates = collections[v].cache_hit_rates().values()
        hits = sum(h for h, _ in rates) / max(sum(n for _, n in rates), 1) if rates else None
        median = statistics.median(times[v])
        print(
            f"| {v} | {median:.1f} [{min(times[v]):.1f}, {max(times[v]):.1f}] | "
            f"{median / base:.2f} | {'-' if hits is None else f'{hits:.3f}'} |"
        )


if __name__ == "__main__":
    main()
