"""Training-step throughput of sharded embeddings: raydlrm against TorchRec and the no-comm limit.

Every variant trains the same tables on the same batches, side by side in one run: 2 gloo ranks
(spawned processes, one thread each), each variant built once per rank, then timed in
interleaved repeats (the variant order rotates each repeat) so that the noise of a shared machine
falls on all of them alike. A step is the forward lookups, a trivial dense loss on the pooled
output (``mean(pooled ** 2)``), the backward with the fused row-wise Adagrad update inside it,
and all the communication the sharding needs.

Variants:

- ``raydlrm-tw`` / ``raydlrm-cw``: :class:`raydlrm.sharding.ShardedEmbeddingBagCollection` with
  every table pinned ``table_wise`` / ``column_wise`` (:func:`raydlrm.sharding.plan_sharding`).
- ``torchrec-tw`` / ``torchrec-cw``: TorchRec's ``DistributedModelParallel`` over an
  ``EmbeddingBagCollection``, its planner constrained to the same sharding type (column-wise with
  ``min_partition = dim / 2``, so two column shards per table as raydlrm makes), the ``FUSED``
  kernel with the same row-wise Adagrad through the sharder's fused params.
- ``raydlrm-tw-fp16`` (any codec name after the type): the same with compressed all-to-all
  (``sharding.comm_precision``); not in the default set.
- ``raydlrm-tw-ssd`` (``ssd`` after the type, with or without a codec): every table on the SSD
  tier (``sharding.default_placement = "ssd"``, files under ``--ssd-path``); the timing line
  adds each repeat's major page faults per step on rank 0 (reads the page cache missed), and
  the end the share of rank 0's table bytes in the page cache. Not in the default set.
- ``-ssd`` and ``-auto`` variants put a DRAM row cache of ``--cache-load-factor`` of each
  ssd shard's rows (``sharding.cache_load_factor``, default 0.2) in front of the files;
  ``-nocache`` after them turns it off (the kernels update the mapped files in place). The end
  adds the cache's hit rate over the distinct ids looked up on rank 0.
- ``raydlrm-tw-auto``: the planner's tiers (``sharding.default_placement = "auto"``) within a
  memory budget of ``--budget-gb`` per rank: tables stay in DRAM until the budget is full, the
  rest go to SSD (the planner's order). With ``--budget-gb``, every raydlrm variant prints its
  plan's modelled step time (the most loaded rank's estimated cost, with the constants of
  ``--constants``, e.g. written by ``raydlrm plan --calibrate``), beside the measured one.
- ``limit``: one fbgemm ``SplitTableBatchedEmbeddingBagsCodegen`` over all tables in each
  process, on that rank's batch, with no communication: the same work per rank as the sharded
  variants, minus the communication (the upper bound on their throughput).
- ``torch`` after a raydlrm variant or ``limit`` (``raydlrm-tw-torch``, ``limit-torch``): the
  PyTorch embedding kernel (``sharding.kernel = "torch"``) instead of fbgemm's. Not in the
  default set.

Ids follow a power law (log-uniform, Zipf's law with exponent 1: id ``k`` has probability about
``1 / (k + 1)``), or with ``--ids uniform`` are uniform over the rows; bag lengths are uniform
in ``[1, 2 * pooling - 1]``. Each rank cycles through a few pre-built batches of its own, or
with ``--fresh-batches`` (for caches: a few batches cycled are a small working set) takes a new
one every step, the same sequence for every variant.
TorchRec is only needed here (``make bench-deps``); a failure to import or run it is reported
and the other variants still run.

Usage::

    python benchmarks/sharded_step.py [--batch-size 2048] [--rows 100000] [--steps 10]
        [--repeats 5] [--variants raydlrm-tw,raydlrm-cw,torchrec-tw,torchrec-cw,limit]
        [--profile] [--ids powerlaw|uniform] [--ssd-path DIR] [--budget-gb G]
        [--constants PATH]
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import socket
import statistics
import time
import traceback

import torch
import torch.distributed as dist

WORLD_SIZE = 2
NUM_TABLES = 26
DIMS = (64, 128)  # alternating: tables 0, 2, ... are 64 wide, 1, 3, ... are 128 wide
LEARNING_RATE = 0.05
EPS = 1e-8
NUM_BATCHES = 4  # distinct batches per rank, cycled
ALL_VARIANTS = "raydlrm-tw,raydlrm-cw,torchrec-tw,torchrec-cw,limit"


def _tables(rows: int) -> list[tuple[str, int, int]]:
    """(name, rows, dim) of every table; table ``t`` is looked up by feature ``f{t}``."""
    return [(f"t{t}", rows, DIMS[t % len(DIMS)]) for t in range(NUM_TABLES)]


def _batches(
    rank: int,
    *,
    rows: int,
    batch_size: int,
    pooling: int,
    distribution: str = "powerlaw",
    count: int = NUM_BATCHES,
) -> list[dict]:
    """``count`` batches of this rank: feature-major ids and lengths, shape (F, B, L)."""
    gen = torch.Generator().manual_seed(1000 + rank)
    batches = []
    for _ in range(count):
        lengths = torch.randint(1, 2 * pooling, (NUM_TABLES * batch_size,), generator=gen)
        u = torch.rand(int(lengths.sum()), generator=gen, dtype=torch.float64)
        if distribution == "uniform":
            ids = (u * rows).long().clamp_(0, rows - 1)
        else:
            ids = (torch.exp(u * math.log(rows)) - 1).long().clamp_(0, rows - 1)
        batches.append({"values": ids, "lengths": lengths})
    return batches


def _loss(pooled: torch.Tensor) -> torch.Tensor:
    return pooled.pow(2).mean()


# ---------------------------------------------------------------------------------------------
# Variants: each builder returns a step function of one batch (dict of values and lengths).


def _raydlrm(
    sharding_type: str,
    *,
    rows: int,
    pooling: int,
    kernel: str = "fbgemm",
    comm_precision: str = "fp32",
    placement: str = "dram",
    ssd_path: str | None = None,
    budget_gb: float | None = None,
    constants_path: str | None = None,
    batch_size: int = 2048,
    cache_load_factor: float = 0.2,
):
    from raydlrm.batch import KeyedJaggedTensor
    from raydlrm.models.embedding import EmbeddingBagCollection, EmbeddingBagConfig
    from raydlrm.sharding import (
        MemoryBudget,
        ShardedEmbeddingBagCollection,
        ShardingConfig,
        load_constants,
        plan_sharding,
    )

    tables = [
        EmbeddingBagConfig(name=n, num_embeddings=r, embedding_dim=d, feature_names=(f"f{n[1:]}",))
        for n, r, d in _tables(rows)
    ]
    config = ShardingConfig(
        pinned_types={t.name: sharding_type for t in tables},
        optimizer="rowwise_adagrad",
        learning_rate=LEARNING_RATE,
        eps=EPS,
        comm_precision=comm_precision,
        default_placement=placement,
        ssd_path=ssd_path,
        cache_load_factor=cache_load_factor,
        kernel=kernel,
    )
    budget = None
    if budget_gb is not None and placement != "dram":  # all in DRAM need not fit the budget
        budget = MemoryBudget(int(budget_gb * 2**30), f"--budget-gb {budget_gb}")
    plan = plan_sharding(
        tables,
        world_size=WORLD_SIZE,
        config=config,
        pooling_factors={t.name: float(pooling) for t in tables},
        batch_size=WORLD_SIZE * batch_size,
        constants=load_constants(constants_path) if constants_path else None,
        memory_budget=budget,
    )
    ebc = EmbeddingBagCollection(tables, device="meta")
    sebc = ShardedEmbeddingBagCollection(ebc, plan=plan, config=config, device="cpu")
    keys = ebc.feature_names

    def step(batch: dict) -> None:
        kjt = KeyedJaggedTensor.from_lengths(keys, batch["values"], batch["lengths"])
        _loss(sebc(kjt).values).backward()

    step.ssd_tables = sebc.ssd_tables  # type: ignore[attr-defined]
    step.modelled_s = max(plan.per_rank_cost())  # type: ignore[attr-defined]
    return step, plan.format_table()


def _torchrec(sharding_type: str, *, rows: int, pooling: int):
    import torchrec
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.distributed.types import ShardingEnv
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    specs = _tables(rows)
    ebc = torchrec.EmbeddingBagCollection(
        tables=[
            torchrec.EmbeddingBagConfig(
                name=n,
                embedding_dim=d,
                num_embeddings=r,
                feature_names=[f"f{n[1:]}"],
                pooling=torchrec.PoolingType.SUM,
            )
            for n, r, d in specs
        ],
        device=torch.device("meta"),
    )
    constraints = {
        n: ParameterConstraints(
            sharding_types=[sharding_type],
            compute_kernels=[EmbeddingComputeKernel.FUSED.value],
            min_partition=d // 2 if sharding_type == "column_wise" else None,
            pooling_factors=[float(pooling)],
        )
        for n, _, d in specs
    }
    sharder = EmbeddingBagCollectionSharder(
        fused_params={
            "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
            "learning_rate": LEARNING_RATE,
            "eps": EPS,
        }
    )
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=WORLD_SIZE, local_world_size=WORLD_SIZE, compute_device="cpu"),
        constraints=constraints,
    )
    pg = dist.GroupMember.WORLD
    plan = planner.collective_plan(ebc, [sharder], pg)
    model = DistributedModelParallel(
        ebc,
        env=ShardingEnv.from_process_group(pg),
        device=torch.device("cpu"),
        plan=plan,
        sharders=[sharder],
    )
    keys = [f"f{n[1:]}" for n, _, _ in specs]

    def step(batch: dict) -> None:
        kjt = KeyedJaggedTensor(keys=keys, values=batch["values"], lengths=batch["lengths"])
        _loss(model(kjt).values()).backward()

    return step, str(plan)


def _limit(*, rows: int, pooling: int, kernel: str = "fbgemm"):
    from raydlrm.sharding.kernel import TableSpec, build_tbe

    specs = _tables(rows)
    tbe = build_tbe(
        kernel,
        tables=[TableSpec(r, d) for _, r, d in specs],
        feature_table_map=list(range(len(specs))),
        optimizer="rowwise_adagrad",
        learning_rate=LEARNING_RATE,
        eps=EPS,
        pooling="sum",
        precision="fp32",
        device=torch.device("cpu"),
    )
    with torch.no_grad():
        for (_, r, _), w in zip(specs, tbe.split_embedding_weights(), strict=True):
            w.uniform_(-math.sqrt(1.0 / r), math.sqrt(1.0 / r))

    def step(batch: dict) -> None:
        offsets = torch.zeros(batch["lengths"].numel() + 1, dtype=torch.int64)
        torch.cumsum(batch["lengths"], 0, out=offsets[1:])
        _loss(tbe(batch["values"], offsets)).backward()

    return step, f"{NUM_TABLES} tables in one TBE on every rank"


def _build(variant: str, *, args: argparse.Namespace):
    rows, pooling = args.rows, args.pooling
    if variant.startswith("limit"):
        return _limit(
            rows=rows,
            pooling=pooling,
            kernel="torch" if variant == "limit-torch" else "fbgemm",
        )
    library, kind, *options = variant.split("-")
    sharding_type = {"tw": "table_wise", "cw": "column_wise"}[kind]
    if library == "raydlrm":
        tiers = [o for o in options if o in ("ssd", "auto")]
        codecs = [o for o in options if o not in (*tiers, "nocache", "torch")]
        return _raydlrm(
            sharding_type,
            rows=rows,
            pooling=pooling,
            kernel="torch" if "torch" in options else "fbgemm",
            comm_precision=codecs[0] if codecs else "fp32",
            placement=tiers[0] if tiers else "dram",
            ssd_path=args.ssd_path,
            budget_gb=args.budget_gb,
            constants_path=args.constants,
            batch_size=args.batch_size,
            cache_load_factor=0.0 if "nocache" in options else args.cache_load_factor,
        )
    return _torchrec(sharding_type, rows=rows, pooling=pooling)


# ---------------------------------------------------------------------------------------------


def _rank_main(rank: int, port: int, args: argparse.Namespace, results) -> None:
    try:
        results.put((rank, *_run_rank(rank, port, args)))
    except BaseException:
        results.put((rank, None, traceback.format_exc()))
        raise


def _run_rank(rank: int, port: int, args: argparse.Namespace) -> tuple[dict, dict]:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE
    )
    batches = _batches(
        rank,
        rows=args.rows,
        batch_size=args.batch_size,
        pooling=args.pooling,
        distribution=args.ids,
        count=args.warmup + args.steps * args.repeats if args.fresh_batches else NUM_BATCHES,
    )

    def batch(i: int) -> dict:  # the i-th batch a variant trains on (every variant alike)
        return batches[i % len(batches)]

    steps, errors = {}, {}
    for variant in args.variants.split(","):
        start = time.perf_counter()
        try:
            steps[variant], plan = _build(variant, args=args)
            for i in range(args.warmup):
                steps[variant](batch(i))
        except Exception as e:  # a variant that fails (TorchRec on CPU) is reported, not fatal
            errors[variant] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"
            steps.pop(variant, None)
            plan = None
        # Every rank must agree on which variants run, or the collectives of the next one hang.
        ok = torch.tensor([variant in steps], dtype=torch.int32)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if not bool(ok) and variant in steps:
            steps.pop(variant)
            errors.setdefault(variant, "failed on another rank")
        if rank == 0:
            took = time.perf_counter() - start
            status = "ok" if variant in steps else "FAILED"
            print(f"[build] {variant}: {status} ({took:.1f}s build + warm-up)", flush=True)
            modelled = getattr(steps.get(variant), "modelled_s", None)
            if modelled is not None and args.budget_gb is not None:
                print(f"[model] {variant}: {1000 * modelled:.1f} ms/step modelled", flush=True)
            if args.show_plans and plan:
                print(plan, flush=True)

    from raydlrm.sharding.tiers import major_page_faults, resident_bytes

    times: dict[str, list[float]] = {v: [] for v in steps}
    tiered = {v for v in steps if {"ssd", "auto"} & set(v.split("-"))}
    faults: dict[str, list[float]] = {v: [] for v in steps if v in tiered}
    names = list(steps)
    for repeat in range(args.repeats):
        order = names[repeat % len(names) :] + names[: repeat % len(names)] if names else []
        for variant in order:
            dist.barrier()
            before = major_page_faults()
            start = time.perf_counter()
            first = args.warmup + repeat * args.steps if args.fresh_batches else 0
            for i in range(args.steps):
                steps[variant](batch(first + i))
            dist.barrier()
            times[variant].append(time.perf_counter() - start)
            if variant in faults:
                faults[variant].append((major_page_faults() - before) / args.steps)
        if rank == 0:
            shown = " ".join(
                f"{v}={args.batch_size * args.steps / times[v][-1]:,.0f}" for v in names
            )
            missed = " ".join(f"{v}={f[-1]:,.0f}" for v, f in faults.items())
            print(f"[repeat {repeat}] samples/s per rank: {shown}", flush=True)
            if missed:
                print(f"[repeat {repeat}] major page faults per step, rank 0: {missed}", flush=True)
    if rank == 0:
        for variant in faults:
            ssd = steps[variant].ssd_tables()
            held = sum(resident_bytes(rows) for rows, _ in ssd.values())
            total = sum(rows.numel() * rows.element_size() for rows, _ in ssd.values())
            print(
                f"[page cache] {variant}: {held / 2**30:.2f} of {total / 2**30:.2f} GiB of rank "
                f"0's ssd tables' files resident ({held / max(total, 1):.1%})",
                flush=True,
            )
            counts = [hits for _, hits in ssd.values() if hits is not None]
            if counts:
                hit_rate = sum(h for h, _ in counts) / max(sum(n for _, n in counts), 1)
                print(f"[row cache] {variant}: {hit_rate:.1%} of distinct ids hit", flush=True)

    if args.profile and rank == 0:
        _profile(steps, batches, args)
    elif args.profile:
        for variant in steps:
            if variant.startswith("raydlrm"):
                for i in range(args.steps):
                    steps[variant](batches[i % len(batches)])
    dist.barrier()
    dist.destroy_process_group()
    return times, errors


def _profile(steps: dict, batches: list[dict], args: argparse.Namespace) -> None:
    from torch.profiler import ProfilerActivity, profile

    for variant in steps:
        if not variant.startswith("raydlrm"):
            continue
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for i in range(args.steps):
                steps[variant](batches[i % len(batches)])
        print(f"\n[profile rank 0] {variant}, {args.steps} steps, by self CPU time", flush=True)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25), flush=True)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default=ALL_VARIANTS)
    parser.add_argument("--batch-size", type=int, default=2048, help="samples per rank")
    parser.add_argument("--rows", type=int, default=100_000, help="rows per table")
    parser.add_argument("--pooling", type=int, default=2, help="mean ids per bag")
    parser.add_argument("--steps", type=int, default=10, help="steps per timed segment")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--show-plans", action="store_true")
    parser.add_argument("--timeout-s", type=float, default=1800.0)
    parser.add_argument("--profile", action="store_true", help="profile raydlrm on rank 0")
    parser.add_argument("--ids", choices=["powerlaw", "uniform"], default="powerlaw")
    parser.add_argument("--ssd-path", default=None, help="directory of the -ssd variants' files")
    parser.add_argument(
        "--budget-gb", type=float, default=None, help="memory budget per rank of -ssd/-auto"
    )
    parser.add_argument("--constants", default=None, help="cost constants JSON for the plans")
    parser.add_argument(
        "--fresh-batches",
        action="store_true",
        help=f"every step a batch not seen before (default: {NUM_BATCHES} batches, cycled)",
    )
    parser.add_argument(
        "--cache-load-factor",
        type=float,
        default=0.2,
        help="sharding.cache_load_factor of the -ssd/-auto variants (-nocache: 0)",
    )
    args = parser.parse_args()

    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(rank, port, args, results))
        for rank in range(WORLD_SIZE)
    ]
    for p in procs:
        p.start()
    per_rank = {}
    for _ in procs:
        rank, times, errors = results.get(timeout=args.timeout_s)
        if times is None:
            raise RuntimeError(f"rank {rank} failed:\n{errors}")
        per_rank[rank] = (times, errors)
    for p in procs:
        p.join()

    times, errors = per_rank[0]
    for variant, error in errors.items():
        print(f"\n{variant} FAILED:\n{error}")
    print(
        f"\n{WORLD_SIZE} gloo ranks x 1 thread, {NUM_TABLES} tables of {args.rows:,} rows "
        f"(dims {'/'.join(map(str, DIMS))}), batch {args.batch_size} per rank, pooling "
        f"~{args.pooling}, {args.steps} steps x {args.repeats} interleaved repeats (medians)"
    )
    rate = {v: args.batch_size * args.steps / statistics.median(ts) for v, ts in times.items()}
    step_ms = {v: 1000 * statistics.median(ts) / args.steps for v, ts in times.items()}
    print("| variant | samples/s per rank | ms/step | vs limit |")
    print("|---|---|---|---|")
    for v in rate:
        vs = f"{rate[v] / rate['limit']:.2f}" if "limit" in rate else "-"
        print(f"| {v} | {rate[v]:,.0f} | {step_ms[v]:.1f} | {vs} |")
    # Ratios of throughputs measured in the same repeat (time of the other / time of raydlrm),
    # then the median: the load of a shared machine changes between repeats, less within one.
    print("\nsamples/s ratios, median of per-repeat ratios (>= 1 means raydlrm is faster)")
    for kind in ("tw", "cw"):
        for ours in [v for v in times if v.startswith(f"raydlrm-{kind}")]:
            for other in (f"torchrec-{kind}", "limit"):
                if other in times:
                    paired = [o / r for r, o in zip(times[ours], times[other], strict=True)]
                    print(f"{ours} / {other}: {statistics.median(paired):.2f}")
    # The torch kernel against fbgemm's, on the same variant.
    for ours in [v for v in times if v.endswith("-torch")]:
        fbgemm = ours.removesuffix("-torch")
        if fbgemm in times:
            paired = [f / t for t, f in zip(times[ours], times[fbgemm], strict=True)]
            print(f"{ours} / {fbgemm}: {statistics.median(paired):.2f}")
    # The tiers against the same sharding type in DRAM.
    for kind in ("tw", "cw"):
        dram = f"raydlrm-{kind}"
        for tier in [
            v for v in times if v.startswith(f"{dram}-") and {"ssd", "auto"} & set(v.split("-"))
        ]:
            if dram in times:
                paired = [d / t for d, t in zip(times[dram], times[tier], strict=True)]
                print(f"{tier} / {dram}: {statistics.median(paired):.2f}")


if __name__ == "__main__":
    main()
