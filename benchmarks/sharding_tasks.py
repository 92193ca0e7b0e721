"""Sharding tasks: the measured cost of each planner's plans (issue 30, NeuroShard).

A pool of synthetic tables (rows log-uniform in 10^3..10^6, dims 4..128 in steps of 4, pooling
factors log-normal around 10 ids a bag clipped to 1..100 -- Meta's open DLRM traces report a
mean pooling of about 8-16 --, ids Zipf-distributed with an exponent uniform in 0.3..1.2, each
with one fixed batch of ``--batch-size`` bags drawn once) and tasks of 10-60 tables drawn from
it, on 2 and 4 ranks. The learned model was trained on random sets drawn independently of this
pool (``raydlrm plan --collect``), so its training sets and these tasks are disjoint.

Planners: ``random`` (each table on a random rank), ``size-greedy`` (largest table first on the
rank with the fewest bytes), ``lookup-greedy`` (most bytes looked up first -- pooling x dim --
on the rank with the fewest looked up), ``analytic`` (raydlrm's planner, ``default_type =
"auto"``, calibrated constants when given), ``torchrec`` (TorchRec's
``EmbeddingShardingPlanner``, table-wise and column-wise, its CPU topology; benchmark-only
dependency: ``make bench-deps``), ``neural`` (raydlrm's planner with the learned model:
greedy grid and beam search).

A plan's **measured** cost: each rank's shards are looked up together by one fused kernel
(forward + backward, the median of ``--repeats``, one process on the whole machine, one rank at
a time), then the ranks' forward and backward all-to-all of their dim sums is timed on W gloo
processes, each rank arriving late by its extra lookup time; the cost is the max over ranks of
lookups plus all-to-all. Identical rank sets are measured once.

    .venv/bin/python benchmarks/sharding_tasks.py --model ~/.cache/raydlrm/learned_cost.json \
        --tasks 30 --out /tmp/bench/sharding_tasks.json
    .venv/bin/python benchmarks/sharding_tasks.py --model M --planning-time-only

On one GPU (``--device cuda --no-comm``): each rank's set is looked up on the GPU (a model
trained on GPU samples), one rank at a time; the all-to-all of GPU ranks needs a GPU per rank,
so the cost is the max over ranks of the lookups alone, and the planners plan for that cost:
their transfer is free (the analytic comm rate infinite, no learned all-to-all model).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from raydlrm.models.embedding import EmbeddingBagConfig
from raydlrm.sharding.config import ShardingConfig
from raydlrm.sharding.plan import Shard, ShardingPlan, TablePlan
from raydlrm.sharding.planner.comm_samples import time_all_to_all
from raydlrm.sharding.planner.cost import CostConstants, load_constants
from raydlrm.sharding.planner.learned_cost import (
    LearnedCostModel,
    SyntheticTable,
    TableStats,
    draw_ids,
    time_tables,
)
from raydlrm.sharding.planner.planners import plan_sharding

PLANNERS = ("random", "size-greedy", "lookup-greedy", "analytic", "torchrec", "neural")


@dataclass(frozen=True)
class PoolTable:
    name: str
    table: SyntheticTable
    ids: np.ndarray
    lengths: np.ndarray
    stats: TableStats


def make_pool(size: int, *, batch_size: int, seed: int, max_rows: int) -> list[PoolTable]:
    rng = np.random.default_rng(seed)
    pool = []
    for i in range(size):
        rows = int(10 ** rng.uniform(3, math.log10(max_rows)))
        dim = int(4 * rng.integers(1, 33))
        pooling = float(np.clip(rng.lognormal(math.log(10), 0.8), 1, 100))
        table = SyntheticTable(rows, dim, pooling, float(rng.uniform(0.3, 1.2)))
        ids, lengths = draw_ids(rng, table, batch_size)
        stats = TableStats.of_batch(rows=rows, dim=dim, ids=ids, bags=batch_size)
        pool.append(PoolTable(f"t{i}", table, ids, lengths, stats))
    return pool


def _configs(tables: list[PoolTable]) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(
            name=t.name,
            num_embeddings=t.table.rows,
            embedding_dim=t.table.dim,
            feature_names=[f"f_{t.name}"],
        )
        for t in tables
    ]


def _plan_of(tables: list[PoolTable], owners: list[int], world_size: int) -> ShardingPlan:
    return ShardingPlan(
        world_size=world_size,
        tables=[
            TablePlan(
                t.name,
                "table_wise",
                t.table.rows,
                t.table.dim,
                [Shard(r, 0, t.table.rows, 0, t.table.dim)],
            )
            for t, r in zip(tables, owners, strict=True)
        ],
    )


def _greedy(tables: list[PoolTable], world_size: int, weight) -> ShardingPlan:
    load = np.zeros(world_size)
    owners = [0] * len(tables)
    for i in sorted(range(len(tables)), key=lambda i: -weight(tables[i])):
        r = int(np.argmin(load))
        owners[i] = r
        load[r] += weight(tables[i])
    return _plan_of(tables, owners, world_size)


def _torchrec_plan(tables: list[PoolTable], world_size: int, batch_size: int) -> ShardingPlan:
    import torch
    import torchrec
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import ParameterConstraints

    ebc = torchrec.EmbeddingBagCollection(
        tables=[
            torchrec.EmbeddingBagConfig(
                name=t.name,
                embedding_dim=t.table.dim,
                num_embeddings=t.table.rows,
                feature_names=[f"f_{t.name}"],
                pooling=torchrec.PoolingType.SUM,
            )
            for t in tables
        ],
        device=torch.device("meta"),
    )
    constraints = {
        t.name: ParameterConstraints(
            sharding_types=["table_wise", "column_wise"],
            compute_kernels=[EmbeddingComputeKernel.FUSED.value],
            pooling_factors=[t.stats.pooling],
        )
        for t in tables
    }
    sharder = EmbeddingBagCollectionSharder(
        fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05}
    )
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world_size, local_world_size=world_size, compute_device="cpu"),
        batch_size=batch_size // world_size,
        constraints=constraints,
    )
    plan = planner.plan(ebc, [sharder])
    by_name = {t.name: t for t in tables}
    out = []
    for name, ps in next(iter(plan.plan.values())).items():
        t = by_name[name]
        shards = [
            Shard(
                int(m.placement.rank()),
                m.shard_offsets[0],
                m.shard_offsets[0] + m.shard_sizes[0],
                m.shard_offsets[1],
                m.shard_offsets[1] + m.shard_sizes[1],
            )
            for m in ps.sharding_spec.shards
        ]
        out.append(TablePlan(name, ps.sharding_type, t.table.rows, t.table.dim, shards))
    return ShardingPlan(world_size=world_size, tables=out)


def make_plans(
    tables: list[PoolTable],
    world_size: int,
    *,
    batch_size: int,
    model: LearnedCostModel,
    constants,
    rng: np.random.Generator,
    planners: list[str],
) -> tuple[dict[str, ShardingPlan], dict[str, float]]:
    configs = _configs(tables)
    config = ShardingConfig(default_type="auto", memory_budget="off")
    pooling = {t.name: t.stats.pooling for t in tables}
    plans, seconds = {}, {}
    for name in planners:
        start = time.perf_counter()
        if name == "random":
            plan = _plan_of(tables, rng.integers(0, world_size, len(tables)).tolist(), world_size)
        elif name == "size-greedy":
            plan = _greedy(tables, world_size, lambda t: t.table.rows * t.table.dim)
        elif name == "lookup-greedy":
            plan = _greedy(tables, world_size, lambda t: t.stats.pooling * t.table.dim)
        elif name == "torchrec":
            plan = _torchrec_plan(tables, world_size, batch_size)
        else:
            plan = plan_sharding(
                configs,
                world_size=world_size,
                config=config,
                pooling_factors=pooling,
                batch_size=batch_size,
                constants=constants,
                learned=model if name == "neural" else None,
                table_stats={t.name: t.stats for t in tables},
            )
        seconds[name] = time.perf_counter() - start
        plan.validate(configs)
        plans[name] = plan
    return plans, seconds


def _shard_batch(t: PoolTable, s: Shard, sharding_type: str, world_size: int):
    """The shard's rows and its batch: the ids in its row range (renumbered), per bag; a
    replica looks up its rank's share of the bags."""
    ids, lengths = t.ids, t.lengths
    if sharding_type == "data_parallel":
        bags = len(lengths) // world_size
        lengths = lengths[s.rank * bags : (s.rank + 1) * bags]
        start = int(t.lengths[: s.rank * bags].sum())
        ids = ids[start : start + int(lengths.sum())]
        return t.table.rows, ids, lengths
    keep = (ids >= s.row_start) & (ids < s.row_end)
    bag = np.repeat(np.arange(len(lengths)), lengths)
    new_lengths = np.bincount(bag[keep], minlength=len(lengths))
    return s.row_end - s.row_start, ids[keep] - s.row_start, new_lengths


def rank_sets(plan: ShardingPlan, pool: dict[str, PoolTable]) -> list[tuple]:
    sets: list[list] = [[] for _ in range(plan.world_size)]
    for tp in plan.tables:
        for s in tp.shards:
            sets[s.rank].append((tp.name, tp.sharding_type, s))
    return [tuple(sorted(x, key=lambda e: (e[0], e[2]))) for x in sets]


def measure_set(
    key: tuple,
    pool: dict[str, PoolTable],
    world_size: int,
    *,
    kernel: str,
    repeats: int,
    device: str = "cpu",
) -> float:
    if not key:
        return 0.0
    tables, batches = [], []
    for name, kind, s in key:
        rows, ids, lengths = _shard_batch(pool[name], s, kind, world_size)
        tables.append(SyntheticTable(rows, s.col_end - s.col_start, 0.0, 0.0))
        batches.append((ids.astype(np.int64), lengths.astype(np.int64)))
    return time_tables(tables, batches, kernel=kernel, repeats=repeats, device=device)


def dim_sums(plan: ShardingPlan) -> list[int]:
    out = [0] * plan.world_size
    for tp in plan.tables:
        if tp.sharding_type == "data_parallel":
            continue
        for s in tp.shards:
            out[s.rank] += s.col_end - s.col_start
    return out


def planning_time(
    model: LearnedCostModel, *, tables: int, ranks: int, batch_size: int, seed: int
) -> dict:
    pool = make_pool(tables, batch_size=batch_size, seed=seed, max_rows=10**6)
    configs = _configs(pool)
    out = {}
    for name, learned in (("analytic", None), ("neural", model)):
        start = time.perf_counter()
        plan_sharding(
            configs,
            world_size=ranks,
            config=ShardingConfig(default_type="auto", memory_budget="off"),
            pooling_factors={t.name: t.stats.pooling for t in pool},
            batch_size=batch_size,
            learned=learned,
            table_stats={t.name: t.stats for t in pool},
        )
        out[name] = time.perf_counter() - start
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a learned cost model (JSON)")
    parser.add_argument("--constants", help="calibrated cost constants (JSON) for 'analytic'")
    parser.add_argument("--tasks", type=int, default=30, help="tasks per world size")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--min-tables", type=int, default=10)
    parser.add_argument("--max-tables", type=int, default=60)
    parser.add_argument("--pool", type=int, default=300)
    parser.add_argument("--max-rows", type=int, default=10**6)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5, help="timed lookups of a rank set")
    parser.add_argument("--comm-repeats", type=int, default=7, help="timed all-to-alls a plan")
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument("--planners", default=",".join(PLANNERS))
    parser.add_argument("--planning-time-only", action="store_true")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="lookups on")
    parser.add_argument(
        "--no-comm", action="store_true", help="lookups only: no all-to-all measured"
    )
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench/sharding_tasks.json"))
    args = parser.parse_args()
    model = LearnedCostModel.load(args.model)
    constants = load_constants(args.constants) if args.constants else None
    if args.no_comm:  # plan for what is measured: lookups alone
        base = constants or CostConstants()
        constants = replace(base, comm_bytes_per_s=1e18, collective_latency_s=0.0)
        model.comm = None
    timing = {
        f"{t} tables / {r} ranks": planning_time(
            model, tables=t, ranks=r, batch_size=args.batch_size, seed=args.seed
        )
        for t, r in ((60, 4), (856, 128))
    }
    print("planning seconds:", json.dumps(timing))
    if args.planning_time_only:
        return
    pool = make_pool(args.pool, batch_size=args.batch_size, seed=args.seed, max_rows=args.max_rows)
    by_name = {t.name: t for t in pool}
    rng = np.random.default_rng(args.seed + 1)
    planners = args.planners.split(",")
    measured_sets: dict[tuple, float] = {}
    results, references = [], []

    def measure(key: tuple, world_size: int) -> float:
        return measure_set(
            key,
            by_name,
            world_size,
            kernel=model.kernel,
            repeats=args.repeats,
            device=args.device,
        )

    for world_size in args.ranks:
        tasks = []
        for task in range(args.tasks):
            count = int(rng.integers(args.min_tables, args.max_tables + 1))
            tables = [pool[i] for i in sorted(rng.choice(len(pool), count, replace=False))]
            plans, seconds = make_plans(
                tables,
                world_size,
                batch_size=args.batch_size,
                model=model,
                constants=constants,
                rng=rng,
                planners=planners,
            )
            compute = {}
            for name, plan in plans.items():
                times = []
                for key in rank_sets(plan, by_name):
                    if key not in measured_sets:
                        measured_sets[key] = measure(key, world_size)
                    times.append(measured_sets[key])
                compute[name] = times
            # References: the analytic plan's sets measured again (the noise of one
            # comparison), and every table in one fused set over W (what perfect balance of a
            # sub-additive kernel could reach).
            again = [measure(k, world_size) for k in rank_sets(plans["analytic"], by_name)]
            whole = _plan_of(tables, [0] * len(tables), 1)
            (everything,) = rank_sets(whole, by_name)
            fused = measure(everything, world_size)
            references.append(
                {
                    "world_size": world_size,
                    "task": task,
                    "analytic_again": max(again),
                    "analytic": max(compute["analytic"]),
                    "bound": fused / world_size,
                }
            )
            tasks.append((count, plans, seconds, compute))
            print(f"W={world_size} task {task}: {count} tables planned and looked up", flush=True)
        # All-to-all of every plan of this world size in one set of gloo processes.
        layouts = [(t, name) for t in range(len(tasks)) for name in planners]
        dims = np.array([dim_sums(tasks[t][1][name]) for t, name in layouts])
        compute = np.array([tasks[t][3][name] for t, name in layouts])
        delays = compute - compute.min(axis=1, keepdims=True)
        if args.no_comm:
            a2a = np.zeros_like(compute)
        else:
            comm = time_all_to_all(
                dims, delays, batch_size=args.batch_size, repeats=args.comm_repeats
            )
            a2a = comm[:, 0, :].T + comm[:, 1, :].T  # (layout, rank)
        for j, (t, name) in enumerate(layouts):
            count, plans, seconds, _ = tasks[t]
            plan = plans[name]
            results.append(
                {
                    "world_size": world_size,
                    "task": t,
                    "tables": count,
                    "planner": name,
                    "measured": float((compute[j] + a2a[j]).max()),
                    "compute": compute[j].tolist(),
                    "all_to_all": a2a[j].tolist(),
                    "predicted": plan.predicted_seconds,
                    "planning_s": seconds[name],
                    "column_wise": sum(tp.sharding_type == "column_wise" for tp in plan.tables),
                    "row_wise": sum(tp.sharding_type == "row_wise" for tp in plan.tables),
                }
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {"planning_time": timing, "results": results, "references": references}, indent=1
        )
    )
    summarize(results, planners)
    _references(references, results)


def summarize(results: list[dict], planners: list[str]) -> None:
    print("measured cost (max over ranks of lookups + all-to-all):")
    _summarize(
        {(r["world_size"], r["task"], r["planner"]): r["measured"] for r in results}, planners
    )
    print("lookups only (max over ranks):")
    _summarize(
        {(r["world_size"], r["task"], r["planner"]): max(r["compute"]) for r in results}, planners
    )


def _references(references: list[dict], results: list[dict]) -> None:
    """The noise of one comparison and the distance of each planner's lookups to the bound."""
    again = np.array([r["analytic_again"] / r["analytic"] for r in references])
    print(
        f"noise: the analytic plan's max-rank lookups measured twice differ by "
        f"{100 * np.median(np.abs(again - 1)):.1f}% (median; 90th percentile "
        f"{100 * np.quantile(np.abs(again - 1), 0.9):.1f}%)"
    )
    bound = {(r["world_size"], r["task"]): r["bound"] for r in references}
    for ws in sorted({r["world_size"] for r in references}):
        gaps: dict[str, list[float]] = {}
        for r in results:
            if r["world_size"] == ws:
                gaps.setdefault(r["planner"], []).append(
                    max(r["compute"]) / bound[(ws, r["task"])] - 1
                )
        print(
            f"{ws} ranks, max-rank lookups above (all tables fused) / W, mean: "
            + ", ".join(f"{p} {100 * np.mean(g):+.1f}%" for p, g in gaps.items())
        )


def _summarize(costs: dict[tuple, float], planners: list[str]) -> None:
    by: dict[tuple, dict[str, float]] = {}
    for (world_size, task, planner), cost in costs.items():
        by.setdefault((world_size, task), {})[planner] = cost
    keys = sorted(by)
    for ws in [*sorted({k[0] for k in keys}), None]:
        pick = [k for k in keys if ws is None or k[0] == ws]
        label = f"{ws} ranks" if ws else "all"
        means = {p: float(np.mean([by[k][p] for k in pick])) for p in planners}
        print(
            f"{label} ({len(pick)} tasks): "
            + ", ".join(f"{p} {1e3 * m:.1f} ms" for p, m in means.items())
        )
        if "neural" in planners:
            for other in ("analytic", "torchrec"):
                if other not in planners:
                    continue
                ratios = np.array([by[k]["neural"] / by[k][other] for k in pick])
                wins = int((ratios < 1).sum())
                print(
                    f"  neural vs {other}: mean cost "
                    f"{100 * (means['neural'] / means[other] - 1):+.1f}% (negative: neural "
                    f"cheaper), median task ratio {np.median(ratios):.3f}, neural cheaper in "
                    f"{wins}/{len(pick)} tasks"
                )


if __name__ == "__main__":
    main()
