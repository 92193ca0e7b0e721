"""Measured all-to-all samples for the learned communication cost model (NeuroShard).

A table-wise plan's forward all-to-all sends, from every rank ``r`` to every rank ``q``, the
pooled vectors of ``r``'s tables for ``q``'s samples: ``B / W`` rows of ``d_r`` values, ``d_r``
the sum of ``r``'s tables' dims; the backward all-to-all sends the gradients back (the same
sizes, reversed). How long each rank waits in it depends on every rank's dim sum and on how
late each rank arrives (the compute imbalance before it). :func:`collect_comm_samples` times
both on ``world_size`` gloo processes of this machine for random dim-sum layouts and arrival
delays, as NeuroShard's communication cost models are trained on.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

__all__ = ["collect_comm_samples"]

_MAX_DIM_SUM = 2048
_MAX_DELAY_S = 0.005


def _layouts(n: int, world_size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` random layouts: dim sums per rank (multiples of 4 in [4, 2048]) and arrival
    delays per rank (uniform in [0, 5 ms])."""
    rng = np.random.default_rng(seed)
    dims = 4 * rng.integers(1, _MAX_DIM_SUM // 4 + 1, size=(n, world_size))
    return dims, rng.uniform(0.0, _MAX_DELAY_S, size=(n, world_size))


def _comm_worker(rank: int, world_size: int, init: str, job: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world_size)
    try:
        dims, delays = _layouts(job["n"], world_size, job["seed"])
        local = max(job["batch_size"] // world_size, 1)
        forward, backward = [], []
        for sample in range(-1, job["n"]):  # -1: a warm-up of the first layout
            d = dims[max(sample, 0)]
            send = torch.zeros(world_size * local * int(d[rank]))
            recv = torch.empty(local * int(d.sum()))
            splits_out = [local * int(d[rank])] * world_size
            splits_in = [local * int(x) for x in d]
            dist.barrier()
            time.sleep(float(delays[max(sample, 0)][rank]))  # this rank's compute, arriving late
            start = time.perf_counter()
            dist.all_to_all_single(recv, send, splits_in, splits_out)
            middle = time.perf_counter()
            dist.all_to_all_single(send, recv, splits_out, splits_in)  # the gradients back
            end = time.perf_counter()
            if sample >= 0:
                forward.append(middle - start)
                backward.append(end - middle)
        times = torch.tensor([forward, backward], dtype=torch.float64)
        gathered = [torch.empty_like(times) for _ in range(world_size)]
        dist.all_gather(gathered, times)
        if rank == 0:
            out = torch.stack(gathered)  # (rank, forward/backward, sample)
            Path(job["out"]).write_text(json.dumps(out.tolist()))
    finally:
        dist.destroy_process_group()


def collect_comm_samples(
    n: int, *, world_size: int = 2, batch_size: int = 1024, seed: int = 0
) -> pa.Table:
    """Times the forward and backward all-to-all of ``n`` random dim-sum layouts on
    ``world_size`` gloo processes of this machine (``batch_size`` samples a step over all
    ranks; fp32 values).

    Returns:
        One row per layout: ``world_size``, ``dim_sums`` and ``delays`` (seconds) per rank,
        ``forward_seconds`` and ``backward_seconds`` per rank, ``batch_size``, ``machine``.
    """
    import torch.multiprocessing as mp

    from raydlrm.sharding.learned_cost import machine_description

    dims, delays = _layouts(n, world_size, seed)
    with tempfile.TemporaryDirectory(prefix="raydlrm-comm-") as tmp:
        job = {"n": n, "seed": seed, "batch_size": batch_size, "out": os.path.join(tmp, "t.json")}
        mp.start_processes(
            _comm_worker,
            args=(world_size, os.path.join(tmp, "init"), job),
            nprocs=world_size,
            start_method="spawn",
        )
        times = np.asarray(json.loads(Path(job["out"]).read_text()))  # (rank, 2, sample)
    machine = machine_description()
    return pa.table(
        {
            "world_size": [world_size] * n,
            "dim_sums": dims.tolist(),
            "delays": delays.tolist(),
            "forward_seconds": times[:, 0, :].T.tolist(),
            "backward_seconds": times[:, 1, :].T.tolist(),
            "batch_size": [batch_size] * n,
            "machine": [machine] * n,
        }
    )
