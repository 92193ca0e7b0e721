"""Peak memory of a managed table's fallback refresh (the whole-shard pass that runs before
every evaluation, checkpoint, export and delta) for a table at 80% of a rank's memory budget.

One process (world size 1) builds a sharded collection (``ShardedEmbeddingBagCollection``)
holding one managed table (``admit_after = 1``: its fallback rows are refreshed to their
buckets' mean rows), on each placement this machine can run: ``dram`` (fp32 rows), ``int8``
(rows quantized in DRAM behind an fp32 cache) and ``ssd`` (fp32 rows in a mapped file behind a
DRAM cache). The table's rows are sized so that what the planner counts for it in worker memory
(weights, optimizer state, id map; for ``ssd`` the rows on disk stand in for the weights) is
``--fill`` (0.8) of ``--budget-mib``. Every slot of the map is given an id (a full table: the
pass reads every row), then ``collection.local_tables()`` runs the refresh (and flushes the
caches); a thread samples the process's ``RssAnon`` (anonymous memory: what the process holds
of its own, not the page cache's pages of the ``ssd`` file) every millisecond, and the peak
above its value before the call is the pass's peak. Each (placement, repeat) runs in a process
of its own (memory the allocator kept from another measurement would hide this one's); the
median of ``--repeats`` is reported.

Run it once with the code to measure on the path (``PYTHONPATH=<tree>/src``): the script uses
only what the code before and after the streaming refresh share, so one table of both lies
side by side. ``host`` tables need a GPU (their rows in pinned host memory, the cache on the
device); they are read through the same cache path as ``int8`` and ``ssd`` ones.

    git worktree add /tmp/before <commit before>
    PYTHONPATH=/tmp/before/src .venv/bin/python benchmarks/refresh_memory.py --label before
    .venv/bin/python benchmarks/refresh_memory.py --label after
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from raydlrm.ids import MAP_BYTES_PER_ROW, ManagedIds
from raydlrm.models.embedding import EmbeddingBagCollection, EmbeddingBagConfig
from raydlrm.models.managed_ids import ID
from raydlrm.sharding import ShardingConfig, plan_sharding
from raydlrm.sharding.embedding import ShardedEmbeddingBagCollection

MIB = 2**20
PLACEMENTS = ("dram", "int8", "ssd")


def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


class _PeakSampler:
    """The largest ``RssAnon`` sampled every millisecond while it runs."""

    def __init__(self) -> None:
        self.peak = _rss_anon()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss_anon())
            time.sleep(0.001)

    def __enter__(self) -> _PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_anon())


def _row_bytes(placement: str, dim: int) -> int:
    """Bytes a row of the table counts against the budget (row-wise Adagrad, a managed map)."""
    weights = dim + 4 if placement == "int8" else 4 * dim  # int8: codes, fp16 scale and bias
    return weights + 4 + MAP_BYTES_PER_ROW


def measure(placement: str, *, budget: int, fill: float, dim: int, ssd_dir: str) -> dict:
    rows = int(budget * fill) // _row_bytes(placement, dim)
    table = EmbeddingBagConfig(
        name="t",
        num_embeddings=rows,
        embedding_dim=dim,
        feature_names=("f",),
        managed=ManagedIds(),
    )
    config = ShardingConfig(
        kernel="torch",
        optimizer="rowwise_adagrad",
        placement={"t": "ssd"} if placement == "ssd" else {},
        ssd_path=ssd_dir,
        weights_precision_per_table={"t": "int8"} if placement == "int8" else {},
    )
    plan = plan_sharding([table], world_size=1, config=config)
    ebc = EmbeddingBagCollection([table], device="meta", seed=0)
    collection = ShardedEmbeddingBagCollection(ebc, plan=plan, config=config, device="cpu")
    state = collection.id_maps()["t"].state
    slots = (state[ID] != -2).nonzero().squeeze(1)  # every row but the fallback rows
    state[ID, slots] = slots + 1
    # A step later than the refresh the construction ran (on the empty map): this one reads.
    collection.managed_clock = (1, collection.managed_clock[1])
    collection.eval()
    before = _rss_anon()
    started = time.perf_counter()
    with _PeakSampler() as sampler:
        collection.local_tables()  # the refresh, then the caches flushed
    return {
        "placement": placement,
        "rows": rows,
        "dim": dim,
        "budget_bytes": budget,
        "table_bytes": rows * _row_bytes(placement, dim),
        "peak_bytes": sampler.peak - before,
        "seconds": time.perf_counter() - started,
    }


def _one(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="raydlrm-refresh-") as ssd_dir:
        return measure(
            args.one, budget=args.budget_mib * MIB, fill=args.fill, dim=args.dim, ssd_dir=ssd_dir
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", required=True, help="names the code measured (before, after)")
    parser.add_argument("--budget-mib", type=int, default=512)
    parser.add_argument("--fill", type=float, default=0.8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--placements", default=",".join(PLACEMENTS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="append the results (JSON lines)")
    parser.add_argument("--one", choices=PLACEMENTS, help=argparse.SUPPRESS)  # a child's run
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.one:
        print(json.dumps(_one(args)))
        return 0
    print(f"code: {Path(sys.modules['raydlrm'].__file__).parent}")
    common = [f"--budget-mib={args.budget_mib}", f"--fill={args.fill}", f"--dim={args.dim}"]
    for placement in args.placements.split(","):
        runs = []
        for _ in range(args.repeats):
            child = [sys.executable, __file__, "--label", args.label, "--one", placement]
            out = subprocess.run(child + common, check=True, capture_output=True, text=True)
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        r = {**runs[0], "peak_bytes": statistics.median(x["peak_bytes"] for x in runs)}
        r["peaks"] = [x["peak_bytes"] for x in runs]
        r["label"] = args.label
        print(
            f"{args.label:>7} {placement:>5}: {r['rows']:,} rows x {r['dim']}, table "
            f"{r['table_bytes'] / MIB:.0f} MiB of a {args.budget_mib} MiB budget: refresh peak "
            f"{r['peak_bytes'] / MIB:.1f} MiB ({r['peak_bytes'] / r['budget_bytes']:.2f}x the "
            f"budget; median of {[round(p / MIB, 1) for p in r['peaks']]})",
            flush=True,
        )
        if args.out is not None:
            with args.out.open("a") as f:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
