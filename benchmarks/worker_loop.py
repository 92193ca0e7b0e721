"""Training-step throughput of the worker loop, without Ray: kernels, pipelining, a reference.

The ranks are processes driven with plain ``torch.distributed`` (gloo on CPU, NCCL on CUDA; a
machine without Ray, such as the lent GPU machine, runs it as is). Every rank builds a
:class:`raydlrm.trainers.loop.Trainer` per variant (the sharded model, its dense optimizer)
and times its steps on the same pre-built batches (the synthetic data set's rows,
preprocessed once, so reading is not timed), variants interleaved over repeats so that a
shared machine's noise falls on all alike. A step is what ``Trainer.fit`` runs per batch: the
any-rank check, the copy to the device, the input all-to-all, forward, loss, backward with
the fused embedding update, the dense optimizer step.

Variants (``--variants``), ``<kernel>-<pipeline>[-<precision>][+<option>...]``:

- ``fbgemm-none``, ``fbgemm-sparse_dist``, ``torch-none``, ``torch-sparse_dist``: raydlrm with
  ``sharding.kernel`` and ``training.pipeline`` set so; a third part sets
  ``training.precision`` (``torch-none-bf16``, ``torch-none-fp16``; default fp32);
- options: ``+compile`` sets ``training.compile`` (the dense architecture compiled; its
  compilation happens in the warm-up steps, untimed), ``+host<N>`` places every table
  ``host`` with a row cache of 1/N of its rows (``sharding.cache_load_factor``; at least a
  step's rows), e.g. ``torch-none-bf16+host10``; a ``host`` variant's row also records its
  caches' miss rate and the rows copied in per step (the JSON's ``caches``);
- ``reference`` (world size 1 only): plain PyTorch, one ``nn.EmbeddingBag`` per table (sum),
  the same dense model, one dense optimizer (Adagrad at the fused optimizer's rate for the
  tables, the trainer's for the rest) over all parameters: what a user writes without raydlrm.

Architectures (``--archs``): ``dlrm`` and ``dcnv2`` with small layers, or with ``--mlperf`` the
MLPerf DCNv2 sizes (bottom MLP 512-256-128, top 1024-1024-512-256, dim 128, 3 cross layers of
rank 512).

Usage::

    python benchmarks/worker_loop.py [--world-size 2] [--device cpu|cuda] [--archs dlrm,dcnv2]
        [--variants fbgemm-none,fbgemm-sparse_dist,torch-none,torch-sparse_dist]
        [--rows 100000] [--batch-size 2048] [--steps 20] [--repeats 3] [--mlperf]
        [--cardinality 100000]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

NUM_SPARSE = 26


def _knobs(arch: str, mlperf: bool) -> dict:
    if mlperf:
        model = {
            "embedding_dim": 128,
            "bottom_mlp": [512, 256, 128],
            "top_mlp": [1024, 1024, 512, 256],
        }
        return {
            **model,
            "arch": arch,
            **({"dcn_num_layers": 3, "dcn_low_rank": 512} if arch == "dcnv2" else {}),
        }
    model = {"embedding_dim": 16, "bottom_mlp": [64, 16], "top_mlp": [64, 32]}
    return {
        **model,
        "arch": arch,
        **({"dcn_num_layers": 2, "dcn_low_rank": 16} if arch == "dcnv2" else {}),
    }


def _spec(data_dir: Path, args: argparse.Namespace, arch: str, variant: str):
    from raydlrm.trainers.spec import WorkerSpec

    base, *options = variant.split("+")
    kernel, pipeline, precision = [*base.split("-"), "", ""][:3]
    tiers = {}
    for option in options:
        share = option.removeprefix("host")
        if share != option and share.isdigit() and int(share) > 0:
            tiers = {"default_placement": "host", "cache_load_factor": 1 / int(share)}
        elif option != "compile":
            raise SystemExit(f"variant {variant!r}: unknown option {option!r} (compile, host<N>)")
    return WorkerSpec(
        data={
            "train_path": str(data_dir / "train"),
            "eval_path": None,
            "table_size": args.rows,
            "batch_size": args.batch_size,
        },
        model=_knobs(arch, args.mlperf),
        sharding={
            "kernel": kernel if kernel != "reference" else "torch",
            "learning_rate": 0.05,
            **tiers,
        },
        training={
            "seed": 0,
            "learning_rate": 0.001,
            "pipeline": pipeline or "none",
            "precision": precision or "fp32",
            "compile": "compile" in options,
        },
    )


def _batches(data_dir: Path, spec, rank: int, world_size: int, steps: int) -> list:
    import pyarrow.parquet as pq

    from raydlrm.ingestion import Preprocessor
    from raydlrm.ingestion.loader import arrow_to_batch

    table = Preprocessor(spec.data)(pq.read_table(data_dir / "train"))
    b = spec.data.batch_size
    return [
        arrow_to_batch(table.slice(((step * world_size) + rank) * b, b), config=spec.data)
        for step in range(steps)
    ]


class _Reference(torch.nn.Module):
    """One ``nn.EmbeddingBag`` per table and the raydlrm model's dense side."""

    def __init__(self, spec, device: torch.device):
        from raydlrm.models import build_model

        super().__init__()
        torch.manual_seed(0)
        model = build_model(
            spec.model, tables=spec.tables(), num_dense=spec.data.num_dense_inputs()
        )
        self.dense = model.dense.to(device)
        self.tables = spec.tables()
        self.bags = torch.nn.ModuleList(
            torch.nn.EmbeddingBag(t.num_embeddings, t.embedding_dim, mode="sum", device=device)
            for t in self.tables
        )
        self.feature_table = {f: i for i, t in enumerate(self.tables) for f in t.feature_names}

    def forward(self, batch) -> torch.Tensor:
        kjt = batch.sparse
        offsets = kjt.offset_per_key()
        lengths = kjt.lengths.view(len(kjt.keys), kjt.batch_size)
        pooled = []
        for f, key in enumerate(kjt.keys):
            bag_offsets = torch.zeros(kjt.batch_size + 1, dtype=torch.int64, device=lengths.device)
            torch.cumsum(lengths[f], 0, out=bag_offsets[1:])
            ids = kjt.values[int(offsets[f]) : int(offsets[f + 1])]
            pooled.append(self.bags[self.feature_table[key]](ids, bag_offsets[:-1]))
        return self.dense(batch.dense, torch.cat(pooled, dim=1))


def _reference_step(spec, device):
    model = _Reference(spec, device)
    optimizer = torch.optim.Adagrad(
        [
            {"params": model.bags.parameters(), "lr": spec.sharding.learning_rate},
            {"params": model.dense.parameters(), "lr": spec.training.learning_rate},
        ]
    )

    def run(batches):
        for batch in batches:
            batch = batch.to(device)
            logits = model(batch)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()

    return run


def _max_bag_sizes(spec, batches: list, device: torch.device) -> dict[str, int]:
    """Table name -> the most ids one sample of ``batches`` (every rank's) looks up in it (all
    its features): every rank plans the same caches."""
    longest: dict[str, int] = {}
    for batch in batches:
        kjt = batch.sparse
        lengths = kjt.lengths.view(len(kjt.keys), kjt.batch_size).amax(1).tolist()
        for key, n in zip(kjt.keys, lengths, strict=True):
            longest[key] = max(longest.get(key, 0), int(n))
    tables = spec.tables()
    sizes = torch.tensor(
        [sum(longest.get(f, 0) for f in t.feature_names) for t in tables], device=device
    )
    if dist.is_initialized():
        dist.all_reduce(sizes, op=dist.ReduceOp.MAX)
    return {t.name: int(n) for t, n in zip(tables, sizes.tolist(), strict=True)}


def _raydlrm_step(spec, device, rank, world_size, batches):
    from raydlrm.sharding import plan_sharding
    from raydlrm.trainers.loop import Trainer
    from raydlrm.trainers.pipeline import Lockstep, SparseDistPipeline

    plan = plan_sharding(  # a row cache holds at least a step's rows (its most, as planned)
        spec.tables(),
        world_size=world_size,
        config=spec.sharding,
        batch_size=spec.data.batch_size * world_size,
        max_bag_sizes=_max_bag_sizes(spec, batches, device),
    )
    trainer = Trainer(spec, plan=plan, rank=rank, device=device)
    if spec.training.pipeline == "sparse_dist":
        stream = SparseDistPipeline(trainer.model, device=device, rank=rank)
    else:
        stream = Lockstep(device=device, rank=rank)

    def run(batches):
        for batch in stream(batches):
            trainer.train_step(batch)

    run.kernel = trainer.model.embedding_bags.kernel  # type: ignore[attr-defined]
    run.trainer = trainer  # type: ignore[attr-defined]
    return run


def _cache_figures(run, steps: int) -> dict | None:
    """A ``host`` variant's caches after its ``steps`` steps: distinct ids looked up and
    missed, the miss rate, bytes copied in per step (rows with their optimizer state), the
    tables' rows, device and host memory; None for a variant without ``host`` tables."""
    from raydlrm.sharding.sizes import stored_row_bytes

    trainer = run.trainer
    tables = trainer.plan.tables
    if not any(t.placement == "host" for t in tables):
        return None
    ebc, sharding = trainer.model.embedding_bags, trainer.spec.sharding
    rates = ebc.cache_hit_rates()
    hits = sum(h for h, _ in rates.values())
    lookups = sum(n for _, n in rates.values())
    row_bytes = {
        t.name: stored_row_bytes(
            t.embedding_dim,
            precision=sharding.weights_precision_of(t.name),
            optimizer=sharding.optimizer,
        )
        for t in tables
    }
    missed_bytes = sum((n - h) * row_bytes[name] for name, (h, n) in rates.items())
    return {
        "lookups": lookups,
        "misses": lookups - hits,
        "miss_rate": (lookups - hits) / max(lookups, 1),
        "bytes_in_per_step": missed_bytes / steps,
        "table_rows": sum(t.num_embeddings for t in tables),
        "memory_bytes": ebc.memory_bytes(),
        "host_bytes": ebc.host_bytes(),
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if dist.is_initialized():
        dist.barrier()


def _rank_main(rank: int, args: argparse.Namespace, data_dir: str, port: int, out: str) -> None:
    device = torch.device(f"cuda:{rank}" if args.device == "cuda" else "cpu")
    if args.device == "cuda":
        torch.cuda.set_device(device)
    if args.world_size > 1:
        dist.init_process_group(
            "nccl" if args.device == "cuda" else "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=args.world_size,
        )
    torch.set_num_threads(args.threads)
    results: dict = {}
    try:
        for arch in args.archs.split(","):
            variants = args.variants.split(",")
            runs = {}
            spec = _spec(Path(data_dir), args, arch, variants[0])
            batches = _batches(Path(data_dir), spec, rank, args.world_size, args.steps + 2)
            for variant in variants:
                spec = _spec(Path(data_dir), args, arch, variant)
                if variant == "reference":
                    runs[variant] = _reference_step(spec, device)
                else:
                    runs[variant] = _raydlrm_step(spec, device, rank, args.world_size, batches)
            times = {v: [] for v in variants}
            for repeat in range(args.repeats):
                order = variants[repeat % len(variants) :] + variants[: repeat % len(variants)]
                for variant in order:
                    runs[variant](batches[:2])  # warm-up (and the first batch's one-time work)
                    _sync(device)
                    start = time.perf_counter()
                    runs[variant](batches[2:])
                    _sync(device)
                    times[variant].append(time.perf_counter() - start)
            steps = args.repeats * (args.steps + 2)
            caches = {v: _cache_figures(r, steps) for v, r in runs.items() if hasattr(r, "trainer")}
            results[arch] = {
                "times": times,
                "kernels": {v: getattr(r, "kernel", "torch") for v, r in runs.items()},
                "caches": {v: c for v, c in caches.items() if c is not None},
            }
        if rank == 0:
            Path(out).write_text(json.dumps(results))
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--archs", default="dlrm,dcnv2")
    parser.add_argument(
        "--variants", default="fbgemm-none,fbgemm-sparse_dist,torch-none,torch-sparse_dist"
    )
    parser.add_argument("--rows", type=int, default=100_000, help="rows per table")
    parser.add_argument("--batch-size", type=int, default=2048, help="samples per rank")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--mlperf", action="store_true", help="MLPerf DCNv2 layer sizes")
    parser.add_argument("--data-dir", default=None, help="where the synthetic rows are kept")
    parser.add_argument(
        "--cardinality", type=int, default=100_000, help="most distinct raw ids of a feature"
    )
    args = parser.parse_args()
    if "reference" in args.variants and args.world_size != 1:
        parser.error("the reference variant is unsharded: use --world-size 1")

    from raydlrm.ingestion import SyntheticConfig, generate_synthetic

    data_dir = Path(args.data_dir or tempfile.mkdtemp(prefix="raydlrm-loop-"))
    rows = (args.steps + 2) * args.batch_size * args.world_size
    generate_synthetic(
        SyntheticConfig(
            num_train_rows=rows,
            num_eval_rows=0,
            rows_per_file=rows,
            seed=5,
            max_cardinality=args.cardinality,
        ),
        out_dir=data_dir,
        overwrite=True,
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(data_dir / "results.json")
    mp.start_processes(
        _rank_main,
        args=(args, str(data_dir), port, out),
        nprocs=args.world_size,
        start_method="spawn",
    )
    results = json.loads(Path(out).read_text())
    device = torch.cuda.get_device_name(0) if args.device == "cuda" else f"{os.cpu_count()} CPUs"
    print(
        f"\n{args.world_size} rank(s) on {args.device} ({device}), {NUM_SPARSE} tables x "
        f"{args.rows:,} rows, batch {args.batch_size} per rank, {args.steps} steps x "
        f"{args.repeats} interleaved repeats (medians), {args.threads} thread(s) per rank"
    )
    print("| arch | variant | kernel | samples/s per rank | ms/step |")
    print("|---|---|---|---|---|")
    for arch, r in results.items():
        for variant, ts in r["times"].items():
            median = statistics.median(ts)
            print(
                f"| {arch} | {variant} | {r['kernels'][variant]} | "
                f"{args.batch_size * args.steps / median:,.0f} | {1000 * median / args.steps:.1f} |"
            )
    print("\nratios of per-repeat times, median (>= 1: the first is faster)")
    pairs = [
        ("fbgemm-sparse_dist", "fbgemm-none"),
        ("torch-sparse_dist", "torch-none"),
        ("torch-none", "fbgemm-none"),
        ("fbgemm-none", "reference"),
        ("torch-none", "reference"),
        ("torch-sparse_dist", "reference"),
    ]
    for arch, r in results.items():
        # Each variant with options against the same one without (a /: >= 1, it is faster).
        optioned = [(v, v.split("+")[0]) for v in r["times"] if "+" in v]
        for a, b in pairs + optioned:
            if a in r["times"] and b in r["times"]:
                paired = [tb / ta for ta, tb in zip(r["times"][a], r["times"][b], strict=True)]
                print(f"{arch}: {a} / {b}: {statistics.median(paired):.2f}")
        for variant, c in r.get("caches", {}).items():
            print(
                f"{arch}: {variant}: miss rate {c['miss_rate']:.3f} of {c['lookups']:,} distinct "
                f"ids looked up, {c['bytes_in_per_step'] / 1e6:.1f} MB copied in per step; "
                f"{c['memory_bytes'] / 2**30:.2f} GiB on the device, "
                f"{c['host_bytes'] / 2**30:.2f} GiB in host memory"
            )


if __name__ == "__main__":
    main()
