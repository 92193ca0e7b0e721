"""Throughput of per-position (unpooled) lookups against pooled ones, on the same ids (issue 59).

The sharded embedding collection (:class:`raydlrm.sharding.ShardedEmbeddingBagCollection`) on
2 gloo ranks (spawned processes, one thread each, no Ray), over the histories of a synthetic
sequence data set (``raydlrm data generate`` with ``data.synthetic.kind = "sequences"``: Zipf
items, histories of 50 to 1,000 events). Two tables of ``--rows`` rows each (``t_item`` and
``t_side``, the item and a side attribute of every event, as a sequence's parallel id columns
are), each looked up by one feature holding the history: ``t_item`` by the item ids,
``t_side`` by an affine permutation of them. Every variant looks up exactly the same ids:

- ``pooled``: the tables pool each history (``pooling = "sum"``), a row per sample;
- ``position``: the tables return a row per id (``pooling = "none"``, ``KeyedTensor.jagged``).

A step is the collection's forward (input all-to-all, lookups, output all-to-all) and the
backward from a fixed gradient of its outputs (no loss: what is timed is the collection alone),
with the fused row-wise Adagrad update inside it. Variants are
``<type>-<pooled|position>[-torch]``: ``tw`` (table-wise: one table per rank), ``rw``
(row-wise), ``cw`` (column-wise, two column shards per table); ``-torch`` runs the PyTorch
kernel (``sharding.kernel = "torch"``) instead of fbgemm's. Each variant is built once per rank
and timed in interleaved repeats (the variant order rotates every repeat), so that the noise of
a shared machine falls on all of them alike; the unpooled/pooled ratios are taken within each
repeat, then their median.

Reported per variant (medians over the repeats, rank 0's clock; the steps end in collectives,
so both ranks' steps take the same time): samples/s per rank, time per id looked up (a rank's
step time over the ids of its samples, averaged over the two ranks), the bytes rank 0 sent per
step by direction (``collection.comm_bytes()``), and where the time went: ``input`` (the input
all-to-all and its routing), ``lookup`` (the kernels' forward), ``out_a2a`` (the output
all-to-all), ``out_rest`` (the rest of the output distribution and the jagged outputs),
``bwd_a2a`` (the gradient all-to-all), ``bwd_rest`` (the rest of the backward: the kernels'
backward with the optimizer update, the gradient's copies). Phases that end in a collective
include the wait for the other rank.

``--ids uniform`` keeps the histories' lengths but draws their ids uniformly over the rows: with
``--rows`` large, nearly every id of a batch is distinct (the worst case for the per-position
path's deduplication, which then saves nothing).

``--memory`` instead runs each variant alone in a fresh pair of processes (``--warmup`` plus
``--steps`` steps) and reports the peak resident set size (``ru_maxrss``) of each rank, and its
growth over the RSS measured just before the collection was built (the batches are loaded by
then): the growth is the tables and their optimizer state, the kernels' and the exchanges'
buffers, the step's outputs and gradients, and the fixed output gradients the step backwards
from (standing in for the model's: per-position ``2 x max ids x dim x 4`` bytes, about 36 MiB
at the defaults; pooled ``batch x 2 dim x 4``).

Usage::

    python -m raydlrm data generate --set data.synthetic.kind=sequences \\
        --set data.synthetic.num_train_rows=4096 --set data.synthetic.num_eval_rows=2048 \\
        --set data.synthetic.rows_per_file=4096 --out /tmp/seqthru_data
    python benchmarks/sequence_step.py --data /tmp/seqthru_data [--batch-size 128] [--dim 64]
        [--rows 100000] [--steps 5] [--repeats 5] [--variants tw-pooled,tw-position,...]
        [--ids data|uniform] [--memory] [--profile]
"""

from __future__ import annotations

import argparse
import multiprocessing
import resource
import socket
import statistics
import time
import traceback
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist

WORLD_SIZE = 2
LEARNING_RATE = 0.05
EPS = 1e-8
NUM_BATCHES = 4  # distinct batches per rank, cycled
FEATURES = ("hist_item", "hist_side")
TABLES = ("t_item", "t_side")
TYPES = {"tw": "table_wise", "rw": "row_wise", "cw": "column_wise"}
ALL_VARIANTS = ",".join(
    f"{kind}-{mode}{kernel}"
    for kernel in ("", "-torch")
    for kind in TYPES
    for mode in ("pooled", "position")
)
PHASES = ("input", "lookup", "out_a2a", "out_rest", "bwd_a2a", "bwd_rest")


def _load_batches(
    data: Path, rank: int, *, batch_size: int, rows: int, uniform: bool = False
) -> list[dict]:
    """``NUM_BATCHES`` batches of this rank: ``batch_size`` histories each (rows of the train
    split, ranks and batches disjoint), both features' ids and lengths, feature-major; with
    ``uniform``, the histories' lengths with ids drawn uniformly over the rows instead."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    files = sorted((data / "train").glob("*.parquet"))
    if not files:
        raise FileNotFoundError(f"{data / 'train'}: no Parquet files (see --help)")
    column = pq.read_table(files, columns=["hist_item_id"]).column("hist_item_id").combine_chunks()
    needed = WORLD_SIZE * NUM_BATCHES * batch_size
    if len(column) < needed:
        raise ValueError(f"{data}: {len(column)} train rows, the benchmark needs {needed}")
    batches = []
    for b in range(NUM_BATCHES):
        start = (b * WORLD_SIZE + rank) * batch_size
        part = column.slice(start, batch_size)
        lengths = torch.from_numpy(pc.list_value_length(part).to_numpy().astype("int64"))
        items = torch.from_numpy(pc.list_flatten(part).to_numpy().astype("int64")) % rows
        if uniform:
            gen = torch.Generator().manual_seed(b * WORLD_SIZE + rank)
            items = torch.randint(0, rows, items.shape, generator=gen)
        side = (items * 7919 + 13) % rows  # a second id column of the same events
        batches.append(
            {
                "values": torch.cat([items, side]),
                "lengths": torch.cat([lengths, lengths]),
                "ids": 2 * items.numel(),
            }
        )
    return batches


class _Phases:
    """Per-phase wall time of the current step, accumulated by wrapped methods."""

    def __init__(self) -> None:
        self.seconds: defaultdict[str, float] = defaultdict(float)

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start

        return timed


def _build(variant: str, *, args: argparse.Namespace, batches: list[dict]):
    """The step function of ``variant`` and its collection, phases timed."""
    from raydlrm.batch import KeyedJaggedTensor
    from raydlrm.models.embedding import EmbeddingBagCollection, EmbeddingBagConfig
    from raydlrm.sharding import ShardedEmbeddingBagCollection, ShardingConfig, plan_sharding

    kind, mode, *options = variant.split("-")
    pooling = "sum" if mode == "pooled" else "none"
    tables = [
        EmbeddingBagConfig(
            name=t,
            num_embeddings=args.rows,
            embedding_dim=args.dim,
            feature_names=(f,),
            pooling=pooling,
        )
        for t, f in zip(TABLES, FEATURES, strict=True)
    ]
    config = ShardingConfig(
        pinned_types={t: TYPES[kind] for t in TABLES},
        optimizer="rowwise_adagrad",
        learning_rate=LEARNING_RATE,
        eps=EPS,
        kernel="torch" if "torch" in options else "fbgemm",
    )
    plan = plan_sharding(tables, world_size=WORLD_SIZE, config=config)
    sebc = ShardedEmbeddingBagCollection(
        EmbeddingBagCollection(tables, device="meta"), plan=plan, config=config, device="cpu"
    )
    phases = _Phases()
    sebc._lookup = phases.wrap("lookup", sebc._lookup)
    output = sebc._output
    output.forward_blocks = phases.wrap("out_a2a", output.forward_blocks)
    output.backward_pooled = phases.wrap("bwd_a2a", output.backward_pooled)
    # One gradient buffer per output, as large as the largest batch needs (sliced per batch).
    grads = {f: torch.randn(max(b["ids"] for b in batches) // 2, args.dim) * 1e-3 for f in FEATURES}
    pooled_grad = torch.randn(args.batch_size, 2 * args.dim) * 1e-3

    def step(batch: dict) -> None:
        kjt = KeyedJaggedTensor.from_lengths(list(FEATURES), batch["values"], batch["lengths"])
        start = time.perf_counter()
        routed = sebc.input_dist(kjt)
        routed_at = time.perf_counter()
        out = sebc.compute_and_output_dist(routed)
        forward_at = time.perf_counter()
        if mode == "pooled":
            torch.autograd.backward([out.values], [pooled_grad])
        else:
            values = [out.jagged[f].values for f in FEATURES]
            torch.autograd.backward(
                values, [grads[f][: v.shape[0]] for f, v in zip(FEATURES, values, strict=True)]
            )
        end = time.perf_counter()
        s = phases.seconds
        s["input"] += routed_at - start
        s["out_rest"] += forward_at - routed_at
        s["bwd_rest"] += end - forward_at

    def phase_totals() -> dict[str, float]:
        """Seconds per phase since the last call (nested phases subtracted)."""
        s = dict(phases.seconds)
        phases.seconds.clear()
        out = {p: s.get(p, 0.0) for p in PHASES}
        out["out_rest"] -= out["lookup"] + out["out_a2a"]
        out["bwd_rest"] -= out["bwd_a2a"]
        return out

    step.phases = phase_totals  # type: ignore[attr-defined]
    step.comm_bytes = sebc.comm_bytes  # type: ignore[attr-defined]
    return step


# ---------------------------------------------------------------------------------------------


def _rank_main(rank: int, port: int, args: argparse.Namespace, variants: list[str], results):
    try:
        results.put((rank, _run_rank(rank, port, args, variants), None))
    except BaseException:
        results.put((rank, None, traceback.format_exc()))
        raise


def _run_rank(rank: int, port: int, args: argparse.Namespace, variants: list[str]) -> dict:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE
    )
    batches = _load_batches(
        Path(args.data),
        rank,
        batch_size=args.batch_size,
        rows=args.rows,
        uniform=args.ids == "uniform",
    )
    # Ids per step, averaged over both ranks' batches (the time per id is of the global step).
    ids = torch.tensor([float(sum(b["ids"] for b in batches) / len(batches))])
    dist.all_reduce(ids)
    # The share of a rank's ids of a table in a step that are distinct (what the per-position
    # path routes, looks up and exchanges).
    halves = [b["values"].view(2, -1) for b in batches]
    distinct = [torch.unique(h[f]).numel() / h.shape[1] for h in halves for f in range(2)]
    result = {
        "ids_per_rank_step": float(ids) / WORLD_SIZE,
        "distinct_share": statistics.mean(distinct),
        "variants": {},
    }
    del ids
    rss_before = _rss_bytes()
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    steps = {}
    for variant in variants:
        steps[variant] = _build(variant, args=args, batches=batches)
        for i in range(args.warmup):
            steps[variant](batches[i % len(batches)])
        steps[variant].phases()
    if args.memory:
        for i in range(args.steps):
            steps[variants[0]](batches[i % len(batches)])
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        result["memory"] = {"rss_before": rss_before, "peak_before": peak_before, "peak": peak}
    else:
        result["variants"] = _time(steps, batches, args, rank)
        if args.profile:
            _profile(steps, batches, args, rank)
    dist.barrier()
    dist.destroy_process_group()
    return result


def _time(steps: dict, batches: list[dict], args: argparse.Namespace, rank: int) -> dict:
    """Per variant and repeat: seconds, per-phase seconds, bytes sent per direction."""
    names = list(steps)
    record = {v: {"seconds": [], "phases": [], "bytes": []} for v in names}
    for repeat in range(args.repeats):
        order = names[repeat % len(names) :] + names[: repeat % len(names)]
        for variant in order:
            step = steps[variant]
            before = step.comm_bytes()
            dist.barrier()
            start = time.perf_counter()
            for i in range(args.steps):
                step(batches[i % len(batches)])
            dist.barrier()
            record[variant]["seconds"].append(time.perf_counter() - start)
            record[variant]["phases"].append(step.phases())
            after = step.comm_bytes()
            record[variant]["bytes"].append(
                {
                    d: sum(after.get(d, {}).values()) - sum(before.get(d, {}).values())
                    for d in ("input", "forward", "backward")
                }
            )
        if rank == 0:
            shown = " ".join(
                f"{v}={1000 * record[v]['seconds'][-1] / args.steps:.0f}" for v in names
            )
            print(f"[repeat {repeat}] ms/step: {shown}", flush=True)
    return record


def _profile(steps: dict, batches: list[dict], args: argparse.Namespace, rank: int) -> None:
    """Rank 0's operators by self CPU time over ``--steps`` steps of each variant, and the
    call sites of the costliest."""
    from contextlib import nullcontext

    from torch.profiler import ProfilerActivity, profile

    for variant, step in steps.items():
        prof = (
            profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_stack=True)
            if rank == 0
            else nullcontext()
        )
        with prof:
            for i in range(args.steps):
                step(batches[i % len(batches)])
        if rank != 0:
            continue
        print(f"\n[profile rank 0] {variant}, {args.steps} steps, by self CPU time", flush=True)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
        sites: defaultdict[tuple, list[float]] = defaultdict(lambda: [0.0, 0])
        for event in prof.events():
            if event.name.startswith("aten::") and event.self_cpu_time_total > 0:
                site = [f for f in event.stack if "raydlrm" in f or "benchmarks" in f][:2]
                key = (event.name, str(event.input_shapes)[:60], " <- ".join(site))
                sites[key][0] += event.self_cpu_time_total / 1000
                sites[key][1] += 1
        print("self ms | calls | operator | input shapes | call site")
        for (name, shapes, site), (ms, calls) in sorted(sites.items(), key=lambda x: -x[1][0])[:15]:
            print(f"{ms:8.1f} | {calls} | {name} | {shapes} | {site}")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(args: argparse.Namespace, variants: list[str]) -> dict[int, dict]:
    """Runs the ranks on ``variants``; every rank's result."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(rank, port, args, variants, results))
        for rank in range(WORLD_SIZE)
    ]
    for p in procs:
        p.start()
    per_rank = {}
    for _ in procs:
        rank, result, error = results.get(timeout=args.timeout_s)
        if result is None:
            for p in procs:
                p.kill()
            raise RuntimeError(f"rank {rank} failed:\n{error}")
        per_rank[rank] = result
    for p in procs:
        p.join()
    return per_rank


def _report_times(result: dict, args: argparse.Namespace) -> None:
    record, ids = result["variants"], result["ids_per_rank_step"]
    print(
        f"\n{WORLD_SIZE} gloo ranks x 1 thread; tables {', '.join(TABLES)}: {args.rows:,} rows x "
        f"dim {args.dim}, row-wise Adagrad fused; batch {args.batch_size} histories per rank, "
        f"{ids:,.0f} ids per rank-step (both features; ids {args.ids}, "
        f"{result['distinct_share']:.0%} of a rank's ids of a table in a step distinct); "
        f"{args.steps} steps x {args.repeats} interleaved repeats (medians)"
    )
    print(
        "| variant | samples/s per rank | ms/step | ns per id | "
        + " | ".join(f"{p} ms" for p in PHASES)
        + " | input MB | forward MB | backward MB |"
    )
    print("|---" * (7 + len(PHASES)) + "|")
    for v, r in record.items():
        seconds = statistics.median(r["seconds"]) / args.steps
        phases = [statistics.median(p[name] for p in r["phases"]) / args.steps for name in PHASES]
        sent = [
            statistics.median(b[d] for b in r["bytes"]) / args.steps / 2**20
            for d in ("input", "forward", "backward")
        ]
        print(
            f"| {v} | {args.batch_size / seconds:,.0f} | {1000 * seconds:.1f} | "
            f"{1e9 * seconds / ids:.0f} | "
            + " | ".join(f"{1000 * p:.1f}" for p in phases)
            + " | "
            + " | ".join(f"{m:.2f}" for m in sent)
            + " |"
        )
    print("\nunpooled / pooled time per id (equal ids): median of per-repeat ratios [min, max]")
    for v in record:
        if "-position" not in v:
            continue
        pooled = v.replace("-position", "-pooled")
        if pooled in record:
            ratios = [
                p / q for p, q in zip(record[v]["seconds"], record[pooled]["seconds"], strict=True)
            ]
            print(
                f"{v} / {pooled}: {statistics.median(ratios):.2f} "
                f"[{min(ratios):.2f}, {max(ratios):.2f}]"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="a sequences data set (train/*.parquet)")
    parser.add_argument("--variants", default=ALL_VARIANTS)
    parser.add_argument("--batch-size", type=int, default=128, help="histories per rank")
    parser.add_argument("--rows", type=int, default=100_000, help="rows per table")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5, help="steps per timed segment")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--ids",
        choices=["data", "uniform"],
        default="data",
        help="the histories' ids (Zipf), or ids uniform over --rows (mostly distinct)",
    )
    parser.add_argument("--memory", action="store_true", help="peak RSS, a process per variant")
    parser.add_argument("--profile", action="store_true", help="torch.profiler on rank 0")
    parser.add_argument("--timeout-s", type=float, default=3600.0)
    args = parser.parse_args()
    variants = args.variants.split(",")
    if not args.memory:
        _report_times(_spawn(args, variants)[0], args)
        return
    print(
        "| variant | rank | RSS before build MiB | peak before build | peak RSS MiB | growth MiB |"
    )
    print("|---|---|---|---|---|---|")
    for variant in variants:
        for rank, result in sorted(_spawn(args, [variant]).items()):
            m = result["memory"]
            print(
                f"| {variant} | {rank} | {m['rss_before'] / 2**20:,.0f} | "
                f"{m['peak_before'] / 2**20:,.0f} | "
                f"{m['peak'] / 2**20:,.0f} | {(m['peak'] - m['rss_before']) / 2**20:,.0f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
