"""End-to-end training-step speedup from RecD deduplication.

Two ``Trainer`` s (the real training step: sharded embeddings with fused row-wise Adagrad, the
DLRM dense side under DDP, Adam) on 2 gloo ranks, side by side in one run: one with the 8 user
features of the synthetic data declared as a dedup group (looked up and exchanged on unique
rows), one without. Both train on the same session-structured batches (synthetic data, sessions
of mean length ``--session-length``, samples of a session adjacent), timed in interleaved,
rotating repeats; medians. Also reported: the dedup ratio and the lookups and all-to-all bytes
saved.

Usage::

    python benchmarks/dedup_step.py [--batch-size 4096] [--session-length 4] [--steps 5]
        [--repeats 5] [--dim 64] [--table-size 100000] [--user-features 8] [--profile]
"""

from __future__ import annotations

import argparse
import multiprocessing
import socket
import statistics
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

WORLD_SIZE = 2


def _spec(args: argparse.Namespace, data: Path, dedup: bool):
    from raydlrm.trainers.spec import WorkerSpec

    return WorkerSpec(
        data={
            "train_path": str(data / "train"),
            "eval_path": None,
            "table_size": args.table_size,
            "batch_size": args.batch_size,
            "dedup_groups": [[f"C{i}" for i in range(1, args.user_features + 1)]] if dedup else [],
        },
        model={
            "embedding_dim": args.dim,
            "bottom_mlp": [128, args.dim],
            "top_mlp": [256, 64],
        },
        sharding={"default_type": "table_wise"},
        training={"seed": 0},
    )


def _run_rank(rank: int, port: int, args: argparse.Namespace, data: Path) -> dict:
    import pyarrow.parquet as pq

    from raydlrm.ingestion import Preprocessor
    from raydlrm.ingestion.loader import arrow_to_batch
    from raydlrm.sharding.planner import plan_feature_sets
    from raydlrm.trainers.loop import Trainer

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE
    )
    raw = pq.read_table(data / "train")
    trainers, batches = {}, {}
    for name, dedup in (("plain", False), ("dedup", True)):
        spec = _spec(args, data, dedup)
        plan = plan_feature_sets(
            spec.tables(),
            spec.data.dedup_groups,
            world_size=WORLD_SIZE,
            config=spec.sharding,
            batch_size=args.batch_size * WORLD_SIZE,
        )
        trainers[name] = Trainer(spec, plan=plan, rank=rank, device=torch.device("cpu"))
        table = Preprocessor(spec.data)(raw)
        b = args.batch_size
        starts = range(rank * b, table.num_rows - b + 1, WORLD_SIZE * b)
        batches[name] = [arrow_to_batch(table.slice(s, b), config=spec.data) for s in starts][:4]
    for name in trainers:  # warm-up
        for batch in batches[name][:2]:
            trainers[name].train_step(batch)
    times: dict[str, list[float]] = {n: [] for n in trainers}
    names = list(trainers)
    for repeat in range(args.repeats):
        for name in names[repeat % 2 :] + names[: repeat % 2]:
            dist.barrier()
            start = time.perf_counter()
            for i in range(args.steps):
                trainers[name].train_step(batches[name][i % len(batches[name])])
            dist.barrier()
            times[name].append(time.perf_counter() - start)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        for name in names:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for i in range(args.steps):
                    trainers[name].train_step(batches[name][i % len(batches[name])])
            if rank == 0:
                print(f"\n[profile rank 0] {name}", flush=True)
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))
    group = batches["dedup"][0].dedup_groups[0]
    stats = trainers["dedup"].model.embedding_bags.dedup_stats()
    out = {
        "times": times,
        "ratio": group.inverse.numel() / group.unique.batch_size,
        "lookups_saved": sum(s["lookups_saved"] for s in stats.values()),
        "bytes_saved": sum(s["a2a_bytes_saved"] for s in stats.values()),
        "bytes": {n: t.model.embedding_bags.comm_bytes() for n, t in trainers.items()},
    }
    dist.destroy_process_group()
    return out


def _rank_main(rank, port, args, data, results) -> None:
    try:
        results.put((rank, _run_rank(rank, port, args, data), None))
    except BaseException:
        results.put((rank, None, traceback.format_exc()))
        raise


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=4096, help="samples per rank")
    parser.add_argument("--session-length", type=float, default=4.0)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--table-size", type=int, default=100_000)
    parser.add_argument("--profile", action="store_true", help="profile both on rank 0")
    parser.add_argument(
        "--user-features",
        type=int,
        default=8,
        help="synthetic user features (C1..Cn, repeated over a session), all deduplicated",
    )
    args = parser.parse_args()

    from raydlrm.ingestion import SyntheticConfig, generate_synthetic

    data = Path(tempfile.mkdtemp()) / "sessions"
    generate_synthetic(
        SyntheticConfig(
            num_train_rows=WORLD_SIZE * args.batch_size * 4,
            num_eval_rows=0,
            rows_per_file=WORLD_SIZE * args.batch_size * 4,
            mean_session_length=args.session_length,
            num_user_features=args.user_features,
            seed=5,
        ),
        out_dir=data,
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_rank_main, args=(r, port, args, data, results))
        for r in range(WORLD_SIZE)
    ]
    for p in procs:
        p.start()
    per_rank = {}
    for _ in procs:
        rank, out, error = results.get(timeout=1800)
        if out is None:
            raise RuntimeError(f"rank {rank} failed:\n{error}")
        per_rank[rank] = out
    for p in procs:
        p.join()
    r0 = per_rank[0]
    times = r0["times"]
    step_ms = {n: 1000 * statistics.median(t) / args.steps for n, t in times.items()}
    paired = [p / d for p, d in zip(times["plain"], times["dedup"], strict=True)]
    print(
        f"\n{WORLD_SIZE} gloo ranks x 1 thread, DLRM dim {args.dim}, 26 tables of "
        f"{args.table_size:,} rows ({args.user_features} user features deduplicated), "
        f"batch {args.batch_size} per rank, sessions of mean length {args.session_length}, "
        f"{args.steps} steps x {args.repeats} repeats"
    )
    print("| variant | ms/step (median) |")
    print("|---|---|")
    for n, ms in step_ms.items():
        print(f"| {n} | {ms:.1f} |")
    plain_out = sum(sum(r0["bytes"]["plain"].get(d, {}).values()) for d in ("forward", "backward"))
    dedup_out = sum(sum(r0["bytes"]["dedup"].get(d, {}).values()) for d in ("forward", "backward"))
    print(f"\ndedup ratio of the user group (rank 0, one batch): {r0['ratio']:.2f}")
    print(f"output all-to-all bytes, rank 0: plain {plain_out:,}, dedup {dedup_out:,}")
    print(f"lookups saved (rank 0, all steps): {r0['lookups_saved']:,.0f}")
    print(f"training-step speedup (median of per-repeat ratios): {statistics.median(paired):.2f}")


if __name__ == "__main__":
    main()
