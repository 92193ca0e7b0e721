"""Peak resident memory of TorchRec's ``DistributedModelParallel`` CPU training against table size.

The TorchRec side of "the largest table set 2 CPU processes train on this machine", to set
beside raydlrm's (``benchmarks/memory_scale.py``). For each ``--rows`` size, a fresh pair of
processes (``multiprocessing`` spawn, 2 gloo ranks, ``--threads`` torch threads each) builds a
TorchRec ``EmbeddingBagCollection`` of ``--tables`` tables (default 26, as raydlrm's quickstart
model) of ``rows`` x ``--dim`` (default 64), sum pooling, on the meta device, with a small dense
part (one ``Linear`` from the pooled output to a logit, binary cross-entropy on random labels),
and wraps it in ``DistributedModelParallel``: the planner is constrained to ``table_wise`` and the
``FUSED`` kernel for every table (on CPU TorchRec shards data-parallel, table-wise, column-wise
and table-column-wise only), the sharder's fused params give the row-wise Adagrad update inside
the backward (fbgemm ``EXACT_ROWWISE_ADAGRAD``, as ``benchmarks/sharded_step.py``), and the
dense part is data-parallel (DDP over gloo) with ``torch.optim.Adagrad``. The planner keeps its
default per-rank memory cap (128 GiB of host memory: it does not refuse a plan for this
machine's memory, so what is measured is what the processes really use). Then ``--steps``
training steps of ``--batch-size`` samples per rank, uniform random ids, bag lengths uniform in
``[1, 2 * pooling - 1]`` (``--pooling 1``, the default: one id per feature per sample), cycling
over 4 batches built beforehand.

Measured in each rank: seconds to build and shard (from the meta-device model to the
``DistributedModelParallel`` ready, planning included), the median seconds of a step (forward,
loss, backward with the fused update, dense optimizer step; per rank, no barrier), the fp32 bytes
of embedding weights its shards hold (the local shards of its state dict; the row-wise Adagrad
state adds 4 bytes per row), and ``VmHWM`` (peak resident set size since the process started)
of ``/proc/self/status``: after ``import torchrec`` and the process group (the baseline), after
the build, and at the end (the rank's peak). Each rank writes its figures as it goes, and the
parent polls the ranks' ``VmHWM`` every ``--interval`` s as well, so a rank that is killed
keeps the figures it had and the last peak seen (marked "polled" in the table). A size that
fails (an exception, a rank killed by the kernel's OOM killer, ``--timeout-s``) is recorded
(exit code or signal, the error's tail), the other rank is killed if it has not failed on its
own 15 s later, and the benchmark goes on with the next size. The ranks set their
``oom_score_adj`` to 1000, so that when memory runs out the kernel kills a rank rather than
another process on the machine (on a shared machine other jobs' memory moves the point where
a size fails: note what else runs).

Finding the largest size that trains is left to the caller: pass a ``--rows`` list that brackets
it (embedding bytes are ``tables x rows x dim x 4``: 6.66 KB per row at the defaults, so
``--rows 1000000`` is 6.7 GB of tables, 3.3 GB per rank), and narrow it in a second run.
TorchRec is only needed here (``make bench-deps``). Prints a Markdown table, one line per rank
and size; writes every figure to ``--out`` (JSON).

    .venv/bin/python benchmarks/torchrec_memory.py --rows 100000,500000,1000000,1500000 \
        --steps 20 --out /tmp/torchrec-memory.json
    .venv/bin/python benchmarks/torchrec_memory.py --rows 20000 --steps 5   # a smoke test
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import platform
import signal
import socket
import statistics
import tempfile
import time
import traceback
from importlib import metadata
from pathlib import Path
from typing import Any

WORLD_SIZE = 2
NUM_BATCHES = 4  # distinct batches per rank, cycled
LEARNING_RATE = 0.05
EPS = 1e-8
GB = 1e9
TAIL_CHARS = 3000
KILL_GRACE_S = 15.0  # how long the other rank may take to fail on its own after one dies


def _ints(text: str) -> list[int]:
    return [int(x.replace("_", "")) for x in text.split(",") if x]


def _status_kb(pid: int | str = "self") -> dict[str, int]:
    """VmHWM and VmRSS (kB) of a process; empty once it is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    found = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS"):
            found[key] = int(value.split()[0])
    return found


def _hwm_bytes() -> int:
    return _status_kb().get("VmHWM", 0) * 1024


def _meminfo() -> dict[str, int]:
    found = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("MemTotal", "MemAvailable", "SwapTotal"):
            found[key] = int(value.split()[0]) * 1024
    return found


# ---------------------------------------------------------------------------------------------
# One rank.


def _rank_main(rank: int, port: int, rows: int, args: argparse.Namespace, out: str) -> None:
    result: dict[str, Any] = {"rank": rank, "ok": False}
    with contextlib.suppress(OSError):
        Path("/proc/self/oom_score_adj").write_text("1000")

    def save() -> None:
        """Writes what is known so far, so that a rank killed later keeps its earlier figures."""
        result["peak_rss_bytes"] = _hwm_bytes()
        Path(out + ".tmp").write_text(json.dumps(result))
        os.replace(out + ".tmp", out)

    try:
        _run_rank(rank, port, rows, args, result, save)
        result["ok"] = True
    except BaseException as e:
        result["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-TAIL_CHARS:]}"
        raise
    finally:
        save()


def _run_rank(
    rank: int, port: int, rows: int, args: argparse.Namespace, result: dict, save
) -> None:
    import torch
    import torch.distributed as dist
    import torchrec
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.distributed.types import ShardedTensor, ShardingEnv
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    torch.set_num_threads(args.threads)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE
    )
    names = [f"t{t}" for t in range(args.tables)]
    keys = [f"f{t}" for t in range(args.tables)]
    gen = torch.Generator().manual_seed(1000 + rank)
    batches = []
    for _ in range(NUM_BATCHES):
        n = args.tables * args.batch_size
        lengths = torch.randint(1, 2 * args.pooling, (n,), generator=gen)
        values = torch.randint(0, rows, (int(lengths.sum()),), generator=gen)
        labels = torch.randint(0, 2, (args.batch_size, 1), generator=gen).float()
        batches.append((values, lengths, labels))
    dist.barrier()
    result["baseline_rss_bytes"] = _hwm_bytes()
    save()

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.sparse = torchrec.EmbeddingBagCollection(
                tables=[
                    torchrec.EmbeddingBagConfig(
                        name=name,
                        embedding_dim=args.dim,
                        num_embeddings=rows,
                        feature_names=[key],
                        pooling=torchrec.PoolingType.SUM,
                    )
                    for name, key in zip(names, keys, strict=True)
                ],
                device=torch.device("meta"),
            )
            self.dense = torch.nn.Linear(args.tables * args.dim, 1)

        def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
            return self.dense(self.sparse(kjt).values())

    start = time.perf_counter()
    model = Model()
    dense = model.dense  # DDP wraps it in place: the same parameters
    sharder = EmbeddingBagCollectionSharder(
        fused_params={
            "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
            "learning_rate": LEARNING_RATE,
            "eps": EPS,
        }
    )
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=WORLD_SIZE, local_world_size=WORLD_SIZE, compute_device="cpu"),
        batch_size=args.batch_size,
        constraints={
            name: ParameterConstraints(
                sharding_types=["table_wise"],
                compute_kernels=[EmbeddingComputeKernel.FUSED.value],
                pooling_factors=[float(args.pooling)],
            )
            for name in names
        },
    )
    pg = dist.GroupMember.WORLD
    plan = planner.collective_plan(model, [sharder], pg)
    dmp = DistributedModelParallel(
        model,
        env=ShardingEnv.from_process_group(pg),
        device=torch.device("cpu"),
        plan=plan,
        sharders=[sharder],
    )
    dist.barrier()
    result["build_s"] = time.perf_counter() - start
    result["build_rss_bytes"] = _hwm_bytes()

    owned, tables = 0, []
    for key, value in dmp.state_dict().items():
        if isinstance(value, ShardedTensor) and key.endswith(".weight"):
            shards = value.local_shards()
            owned += sum(s.tensor.numel() * s.tensor.element_size() for s in shards)
            if shards:
                tables.append(key.split(".")[-2])
    result["owned_embedding_bytes"] = owned
    result["owned_tables"] = tables
    save()

    optimizer = torch.optim.Adagrad(dense.parameters(), lr=LEARNING_RATE, eps=EPS)
    before = dense.weight.detach().clone()
    step_s, losses = [], []
    for i in range(args.steps):
        values, lengths, labels = batches[i % NUM_BATCHES]
        t0 = time.perf_counter()
        kjt = KeyedJaggedTensor(keys=keys, values=values, lengths=lengths)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(dmp(kjt), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step_s.append(time.perf_counter() - t0)
        losses.append(loss.item())
    result["step_s"] = step_s
    result["median_step_s"] = statistics.median(step_s) if step_s else None
    result["losses"] = losses
    result["dense_updated"] = bool(not torch.equal(before, dense.weight.detach()))
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# The parent: one fresh pair of ranks per size.


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _exit(code: int | None) -> dict[str, Any]:
    if code is None:
        return {"exitcode": None, "signal": None}
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = str(-code)
        return {"exitcode": code, "signal": name}
    return {"exitcode": code, "signal": None}


def _run_size(rows: int, args: argparse.Namespace) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="torchrec-memory-") as tmp:
        outs = [os.path.join(tmp, f"rank{r}.json") for r in range(WORLD_SIZE)]
        procs = [
            ctx.Process(target=_rank_main, args=(r, port, rows, args, outs[r]), daemon=True)
            for r in range(WORLD_SIZE)
        ]
        start = time.perf_counter()
        for p in procs:
            p.start()
        seen_hwm = [0] * WORLD_SIZE
        killed: dict[int, str] = {}
        first_failure = None
        while any(p.is_alive() for p in procs):
            now = time.perf_counter()
            for r, p in enumerate(procs):
                if p.is_alive():
                    seen_hwm[r] = max(seen_hwm[r], _status_kb(p.pid).get("VmHWM", 0) * 1024)
                elif p.exitcode != 0 and first_failure is None:
                    first_failure = now
            timed_out = now - start > args.timeout_s
            grace_over = first_failure is not None and now - first_failure > KILL_GRACE_S
            if timed_out or grace_over:
                for r, p in enumerate(procs):
                    if p.is_alive():
                        killed[r] = "timeout" if timed_out else "another rank failed"
                        p.kill()
                break
            time.sleep(args.interval)
        for p in procs:
            p.join()
        wall = time.perf_counter() - start
        ranks = []
        for r, p in enumerate(procs):
            try:
                rank = json.loads(Path(outs[r]).read_text())
            except (OSError, ValueError):
                rank = {"rank": r, "ok": False}
            rank.update(_exit(p.exitcode))
            rank["ok"] = bool(rank.get("ok")) and p.exitcode == 0
            rank["polled_peak_rss_bytes"] = seen_hwm[r]
            if r in killed:
                rank["killed_by_benchmark"] = killed[r]
            ranks.append(rank)
    return {
        "rows": rows,
        "embedding_bytes": args.tables * rows * args.dim * 4,
        "ok": all(r["ok"] for r in ranks),
        "wall_s": wall,
        "ranks": ranks,
    }


def _status_text(rank: dict) -> str:
    if rank["ok"]:
        return "ok"
    if rank.get("killed_by_benchmark"):
        return f"killed ({rank['killed_by_benchmark']})"
    if rank.get("signal"):
        return f"signal {rank['signal']}"
    if rank.get("error"):
        return f"exit {rank['exitcode']}: {rank['error'].split(':')[0]}"
    return f"exit {rank['exitcode']}"


def _gb(value: int | None) -> str:
    return f"{value / GB:.2f}" if value else "-"


def _table(runs: list[dict]) -> str:
    lines = [
        "| rows/table | tables GB | rank | status | owned GB | tables owned "
        "| RSS base GB | RSS build GB | peak RSS GB | build s | s/step |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        for rank in run["ranks"]:
            # A rank killed has no final reading of its own: the last peak the parent polled.
            killed = rank.get("signal") or rank.get("killed_by_benchmark")
            peak = None if killed else rank.get("peak_rss_bytes")
            peak_text = _gb(peak) if peak else f"{_gb(rank.get('polled_peak_rss_bytes'))} (polled)"
            step = rank.get("median_step_s")
            build = rank.get("build_s")
            owned = rank.get("owned_tables")
            lines.append(
                f"| {run['rows']:,} | {run['embedding_bytes'] / GB:.2f} | {rank['rank']} "
                f"| {_status_text(rank)} | {_gb(rank.get('owned_embedding_bytes'))} "
                f"| {len(owned) if owned is not None else '-'} "
                f"| {_gb(rank.get('baseline_rss_bytes'))} | {_gb(rank.get('build_rss_bytes'))} "
                f"| {peak_text} | {f'{build:.1f}' if build is not None else '-'} "
                f"| {f'{step:.3f}' if step is not None else '-'} |"
            )
    return "\n".join(lines)


def _versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {"python": platform.python_version()}
    for dist in ("torch", "torchrec", "fbgemm-gpu-cpu", "fbgemm-gpu"):
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            found[dist] = None
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=_ints, default=[100_000], help="e.g. 100000,500000")
    parser.add_argument("--tables", type=int, default=26)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=1024, help="samples per rank")
    parser.add_argument("--pooling", type=int, default=1, help="mean ids per bag")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--interval", type=float, default=0.2, help="parent's poll interval, s")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="per size")
    parser.add_argument("--out", type=Path, default=None, help="JSON results")
    args = parser.parse_args()

    report: dict[str, Any] = {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "world_size": WORLD_SIZE,
        "versions": _versions(),
        "machine": {"cpus": os.cpu_count(), **_meminfo()},
        "runs": [],
    }
    for rows in args.rows:
        run = _run_size(rows, args)
        report["runs"].append(run)
        status = "ok" if run["ok"] else "FAILED"
        peaks = ", ".join(
            _gb(max(r.get("peak_rss_bytes") or 0, r["polled_peak_rss_bytes"])) for r in run["ranks"]
        )
        print(
            f"[{rows:,} rows/table, {run['embedding_bytes'] / GB:.2f} GB of tables] {status} "
            f"in {run['wall_s']:.1f}s, peak RSS per rank (GB): {peaks}",
            flush=True,
        )
        for rank in run["ranks"]:
            if rank.get("error"):  # the traceback is in the rank's stderr and in the JSON
                print(f"  rank {rank['rank']}: {rank['error'].splitlines()[0]}", flush=True)
        if args.out:
            args.out.write_text(json.dumps(report, indent=2))

    print(
        f"\nTorchRec DistributedModelParallel, {WORLD_SIZE} gloo ranks x {args.threads} thread(s), "
        f"{args.tables} tables x dim {args.dim} (fp32), table-wise, FUSED row-wise Adagrad, "
        f"batch {args.batch_size} per rank, pooling ~{args.pooling}, {args.steps} steps; "
        f"machine {report['machine'].get('MemTotal', 0) / GB:.1f} GB, "
        f"{report['machine'].get('MemAvailable', 0) / GB:.1f} GB available at start\n"
    )
    print(_table(report["runs"]))
    if args.out:
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
