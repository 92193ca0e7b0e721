"""RecD training-step speedup: the same model trained on the same batches, user features
deduplicated or not.

Two ``Trainer`` s (the real training step: sharded embeddings with the fused optimizer, the
dense side under DDP, Adam) on 2 gloo ranks, built from a job config (default
``configs/recd.toml``: user-history id lists repeated by every sample of a session), side by
side in one run: one with the synthetic data's user features (``C1..C<num_user_features>``) as a
dedup group (looked up, routed and sent back on unique rows, in the same all-to-alls as the
other features), one without. Both train on the same session-ordered batches of
``data.batch_size`` samples per rank, in interleaved, rotating repeats; medians, and the median
of the per-repeat ratios.

Also reported, from rank 0's batches and counters: the batch's dedup factor over all sparse
features (occurrences per distinct (feature, id) pair) and of the user group's rows (samples per
unique row), the user features' share of the lookups, the lookups and all-to-all bytes per
step of each variant, the largest difference between the two variants' losses (every step,
both trained the same batches in the same order), and with ``--profile`` where the step's time
goes.

Usage::

    python benchmarks/dedup_step.py [--config configs/recd.toml] [--set key=value ...]
        [--steps 4] [--repeats 3] [--profile]
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
BATCHES = 6  # distinct batches per rank, trained in turn


def _user_features(job) -> list[str]:
    n = job.data.synthetic.num_user_features
    return [job.data.sparse_columns[i] for i in range(n)]


def _job(job, data: Path, dedup: bool):
    from raydlrm.platform.config import replaced

    groups = [_user_features(job)] if dedup else []
    data_config = replaced(
        job.data, train_path=str(data), eval_path=None, dedup_groups=groups, dedup="groups"
    )
    return replaced(job, data=data_config)


def _plan(job):
    """The plan training makes: pooling factors and dedup ratios read off the data."""
    from raydlrm.ingestion import validate_data
    from raydlrm.platform.job_data import JobData, data_shape
    from raydlrm.sharding.planner.planners import plan_sharding

    summary = validate_data(job.data.train_path, job.data, role="train")
    shape = data_shape(job, JobData(train=summary, evaluation=None))
    spec = job.worker_spec()
    plan = plan_sharding(
        spec.tables(),
        world_size=WORLD_SIZE,
        config=spec.sharding,
        batch_size=job.data.batch_size * WORLD_SIZE,
        pooling_factors=shape.pooling_factors,
        dedup_ratios=shape.dedup_ratios,
    )
    return plan, shape


def _sparse_stats(batch, user: list[str]) -> dict[str, float]:
    """Occurrences per distinct (feature, id) pair over all sparse features of one batch (the
    groups expanded), and the user features' share of the ids."""
    kjt = batch.all_sparse()
    per_key = kjt.length_per_key().tolist()
    distinct, user_ids = 0, 0
    for key, values in zip(kjt.keys, kjt.values.split(per_key), strict=True):
        distinct += int(torch.unique(values).numel())
        user_ids += values.numel() if key in user else 0
    return {
        "factor": kjt.values.numel() / max(distinct, 1),
        "user_share": user_ids / max(kjt.values.numel(), 1),
        "ids": float(kjt.values.numel()),
    }


def _run_rank(rank: int, port: int, job, data: Path, args: argparse.Namespace) -> dict:
    import pyarrow.parquet as pq

    from raydlrm.ingestion import Preprocessor
    from raydlrm.ingestion.loader import arrow_to_batch
    from raydlrm.trainers.loop import Trainer

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE
    )
    raw = pq.read_table(data)
    trainers, batches = {}, {}
    b = job.data.batch_size
    shapes = {}
    for name, dedup in (("plain", False), ("dedup", True)):
        variant = _job(job, data, dedup)
        spec = variant.worker_spec()
        table = Preprocessor(spec.data)(raw)
        starts = range(rank * b, table.num_rows - b + 1, WORLD_SIZE * b)
        batches[name] = [arrow_to_batch(table.slice(s, b), config=spec.data) for s in starts]
        batches[name] = batches[name][:BATCHES]
        plan, shapes[name] = _plan(variant)
        trainers[name] = Trainer(spec, plan=plan, rank=rank, device=torch.device("cpu"))
    losses: dict[str, list[float]] = {n: [] for n in trainers}

    def steps(name: str, n: int) -> None:
        for _ in range(n):
            trainer = trainers[name]
            batch = batches[name][trainer.step % len(batches[name])]
            losses[name].append(float(trainer.train_step(batch).loss))

    names = list(trainers)
    for name in names:  # warm-up (and the first steps' losses)
        steps(name, 2)
    times: dict[str, list[float]] = {n: [] for n in trainers}
    for repeat in range(args.repeats):
        for name in names[repeat % 2 :] + names[: repeat % 2]:
            dist.barrier()
            start = time.perf_counter()
            steps(name, args.steps)
            dist.barrier()
            times[name].append(time.perf_counter() - start)
    profiles = {}
    if args.profile:
        profiles = {name: _profile(lambda name=name: steps(name, args.steps)) for name in names}
    stats = trainers["dedup"].model.embedding_bags.dedup_stats()
    group = batches["dedup"][0].dedup_groups[0]
    out = {
        "times": times,
        "losses": losses,
        "profiles": profiles,
        "group_ratio": group.inverse.numel() / group.unique.batch_size,
        "sparse": _sparse_stats(batches["dedup"][0], _user_features(job)),
        "lookups_saved": sum(s["lookups_saved"] for s in stats.values()),
        "ids_per_batch": statistics.mean(
            float(bt.all_sparse().values.numel()) for bt in batches["plain"]
        ),
        "bytes": {n: t.model.embedding_bags.comm_bytes() for n, t in trainers.items()},
        "trained_steps": {n: t.step for n, t in trainers.items()},
        "shape": shapes["dedup"],
        "plans": {n: t.plan.format_table() for n, t in trainers.items()},
    }
    dist.destroy_process_group()
    return out


def _profile(fn) -> list[tuple[str, float]]:
    """Self CPU seconds of the ten costliest operators of ``fn``, and the total."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in events) / 1e6
    return [("total", total)] + [(e.key, e.self_cpu_time_total / 1e6) for e in events[:10]]


def _rank_main(rank, port, job, data, args, results) -> None:
    try:
        results.put((rank, _run_rank(rank, port, job, data, args), None))
    except BaseException:
        results.put((rank, None, traceback.format_exc()))
        raise


def _generate(job, rows: int) -> Path:
    from raydlrm.ingestion import generate_synthetic
    from raydlrm.platform.config import replaced

    synthetic = replaced(
        job.data.synthetic,
        num_train_rows=rows,
        num_eval_rows=0,
        rows_per_file=rows,
        layout="samples",
    )
    out = Path(tempfile.mkdtemp()) / "data"
    generate_synthetic(synthetic, out_dir=out)
    return out / "train"


def _per_step_bytes(sent: dict[str, dict[str, int]], steps: int) -> dict[str, float]:
    return {d: sum(kinds.values()) / steps for d, kinds in sent.items()}


def _report(r0: dict, job, args: argparse.Namespace) -> None:
    times = r0["times"]
    step_ms = {n: 1000 * statistics.median(t) / args.steps for n, t in times.items()}
    paired = [p / d for p, d in zip(times["plain"], times["dedup"], strict=True)]
    sparse = r0["sparse"]
    print(
        f"\n{WORLD_SIZE} gloo ranks x 1 thread, {job.model.arch} dim {job.model.embedding_dim}, "
        f"{len(job.data.sparse_columns)} sparse features ({len(_user_features(job))} user "
        f"features, history length {job.data.synthetic.user_history_length:g}), sessions of "
        f"mean length {job.data.synthetic.mean_session_length:g}, batch {job.data.batch_size} "
        f"per rank, {args.steps} steps x {args.repeats} repeats"
    )
    print(
        f"batch (rank 0): {sparse['factor']:.2f} occurrences per distinct (feature, id) over all "
        f"sparse features; user features {100 * sparse['user_share']:.1f}% of the ids; user "
        f"group {r0['group_ratio']:.2f} samples per unique row"
    )
    shape = r0["shape"]
    print(
        f"planned with the data's pooling factors and dedup ratios ({shape.rows} rows): user "
        f"tables {sorted(shape.dedup_ratios.items())}"
    )
    print("\n| variant | ms/step (median) |")
    print("|---|---|")
    for n, ms in step_ms.items():
        print(f"| {n} | {ms:.1f} |")
    print(
        f"\ntraining-step speedup: median of per-repeat ratios {statistics.median(paired):.2f}, "
        f"ratio of medians {step_ms['plain'] / step_ms['dedup']:.2f}"
    )
    steps = r0["trained_steps"]
    ids_per_step = r0["ids_per_batch"]  # the steps cycle through the batches: their mean
    saved_per_step = r0["lookups_saved"] / steps["dedup"]
    print(
        f"lookups per step (rank 0's samples): plain {ids_per_step:,.0f}, dedup "
        f"{ids_per_step - saved_per_step:,.0f} "
        f"({(ids_per_step - saved_per_step) / ids_per_step:.3f}x)"
    )
    plain = _per_step_bytes(r0["bytes"]["plain"], steps["plain"])
    dedup = _per_step_bytes(r0["bytes"]["dedup"], steps["dedup"])
    for direction, sent in plain.items():
        ours = dedup.get(direction, 0.0)
        print(
            f"all-to-all bytes per step, rank 0, {direction}: plain {sent:,.0f}, "
            f"dedup {ours:,.0f} ({ours / sent:.3f}x)"
        )
    diffs = [abs(p - d) for p, d in zip(r0["losses"]["plain"], r0["losses"]["dedup"], strict=True)]
    print(
        f"loss difference dedup - plain: first 2 steps max {max(diffs[:2]):.2e}, all "
        f"{len(diffs)} steps max {max(diffs):.2e}"
    )
    for name, rows in r0["profiles"].items():
        total = rows[0][1]
        print(f"\n[profile rank 0, {name}, {args.steps} steps] self CPU {total:.3f} s")
        for key, seconds in rows[1:]:
            print(f"  {key:<50} {seconds:7.3f} s  {100 * seconds / total:5.1f}%")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/recd.toml")
    parser.add_argument("--set", action="append", default=[], help="config override key=value")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="profile both on rank 0")
    args = parser.parse_args()

    from raydlrm.platform.config import load_config

    job = load_config(args.config, overrides=args.set)
    data = _generate(job, WORLD_SIZE * job.data.batch_size * BATCHES)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_rank_main, args=(r, port, job, data, args, results))
        for r in range(WORLD_SIZE)
    ]
    for p in procs:
        p.start()
    per_rank = {}
    for _ in procs:
        rank, out, error = results.get(timeout=3600)
        if out is None:
            raise RuntimeError(f"rank {rank} failed:\n{error}")
        per_rank[rank] = out
    for p in procs:
        p.join()
    _report(per_rank[0], job, args)


if __name__ == "__main__":
    main()
