"""Training-state checkpoint save and load time and size against model size.

Saves the state of a ``Trainer`` (26 tables of ``--rows`` rows, dim 64, row-wise Adagrad, the
DLRM dense side with Adam) from 2 gloo ranks, table-wise, then loads it into 2 table-wise ranks
(the restart case) and into 3 row-wise ranks (resharding). Prints one line per size: model
bytes, checkpoint bytes on disk, median seconds of save, load and resharded load.

    .venv/bin/python benchmarks/checkpoint_io.py --rows 10000 50000 150000 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from raydlrm.sharding import plan_sharding
from raydlrm.trainers.checkpoints import load_training_state, save_training_state
from raydlrm.trainers.loop import Trainer
from raydlrm.trainers.spec import WorkerSpec


def _spec(rows: int, sharding_type: str) -> WorkerSpec:
    spec = WorkerSpec(
        data={"train_path": "unused", "table_size": rows},
        model={"embedding_dim": 64, "bottom_mlp": [256, 64], "top_mlp": [256, 64]},
    )
    spec.sharding.default_type = sharding_type
    return spec


def _trainer(rank: int, world: int, rows: int, sharding_type: str) -> Trainer:
    spec = _spec(rows, sharding_type)
    plan = plan_sharding(spec.tables(), world_size=world, config=spec.sharding)
    return Trainer(spec, plan=plan, rank=rank, device=torch.device("cpu"))


def _timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def _worker(rank: int, world: int, port: int, task: tuple, out) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    torch.set_num_threads(1)
    kind, rows, path = task
    if kind == "save":
        trainer = _trainer(rank, world, rows, "table_wise")
        seconds = _timed(
            lambda: save_training_state(
                path,
                parts=trainer.parts(),
                loop_state=trainer.state_dict(),
                position={"epoch": 0, "consumed": {}, "totals": {}},
            )
        )
    else:
        trainer = _trainer(rank, world, rows, "table_wise" if kind == "load" else "row_wise")
        seconds = _timed(lambda: load_training_state(path, parts=trainer.parts()))
    if rank == 0:
        out.put(seconds)
    dist.destroy_process_group()


def _run(world: int, task: tuple) -> float:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, world, port, task, out)) for r in range(world)]
    for p in procs:
        p.start()
    seconds = out.get(timeout=900)
    for p in procs:
        p.join()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[10_000, 50_000, 150_000])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"machine: {os.cpu_count()} CPUs; torch {torch.__version__}")
    print("rows/table | model MB | checkpoint MB | save s | load s (2 tw) | load s (3 rw)")
    for rows in args.rows:
        saves, loads, reshards, size = [], [], [], 0
        for _ in range(args.repeats):
            path = tempfile.mkdtemp(prefix="raydlrm-ckptbench-")
            try:
                saves.append(_run(2, ("save", rows, path)))
                size = sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())
                loads.append(_run(2, ("load", rows, path)))
                reshards.append(_run(3, ("reshard", rows, path)))
            finally:
                shutil.rmtree(path, ignore_errors=True)
        model = 26 * rows * 64 * 4
        print(
            f"{rows} | {model / 1e6:.0f} | {size / 1e6:.0f} | {statistics.median(saves):.2f} | "
            f"{statistics.median(loads):.2f} | {statistics.median(reshards):.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
