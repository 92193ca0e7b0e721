"""Measured all-to-all samples for the learned communication cost model (NeuroShard).

A table-wise plan's forward all-to-all sends, from every rank ``r`` to every rank ``q``, the
pooled vectors of ``r``'s tables for ``q``'s samples: ``B / W`` rows of ``d_r`` values, ``d_r``
the sum of ``r``'s tables' dims; the backward all-to-all sends the gradients back (the same
sizes, reversed). How long each rank waits in it depends on every rank's dim sum and on how
late each rank arrives (the compute imbalance before it). :func:`collect_comm_samples` times
both on ``world_size`` gloo processes of this machine for random dim-sum layouts and arrival
delays, as NeuroShard's communication cost models are trained on.

:class:`CommCostModel` (:func:`train_comm_model`) learns from them a rank's *transfer* time,
forward plus backward: the measured time less the wait for the latest rank (a rank arriving
``delay`` before the latest waits that long first). The search adds the wait back as the
slowest rank's lookups, so the model need not extrapolate to imbalances larger than the
delays it was measured with. Its input is a rank's dim sum beside the mean and the largest of
all ranks' and the number of ranks (:func:`comm_features`), so one model serves any rank of
any layout; it is trained on every world size collected.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch import nn

from raydlrm.sharding.planner.measure import machine_description, mape
from raydlrm.storage import scratch_directory

__all__ = [
    "CommCostModel",
    "CommCostNet",
    "collect_comm_samples",
    "comm_features",
    "stored_comm_samples",
    "time_all_to_all",
    "train_comm_model",
    "transfer_targets",
]

_MAX_DIM_SUM = 2048
_MAX_DELAY_S = 0.005


def _layouts(n: int, world_size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` random layouts: dim sums per rank (multiples of 4 in [4, 2048]) and arrival
    delays per rank (uniform in [0, 5 ms])."""
    rng = np.random.default_rng(seed)
    dims = 4 * rng.integers(1, _MAX_DIM_SUM // 4 + 1, size=(n, world_size))
    return dims, rng.uniform(0.0, _MAX_DELAY_S, size=(n, world_size))


def _comm_worker(rank: int, world_size: int, init: str, job: dict[str, Any]) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world_size)
    try:
        dims, delays = np.asarray(job["dims"]), np.asarray(job["delays"])
        local = max(job["batch_size"] // world_size, 1)
        forward, backward = [], []
        for sample in range(-1, len(dims)):  # -1: a warm-up of the first layout
            d = dims[max(sample, 0)]
            send = torch.zeros(world_size * local * int(d[rank]))
            recv = torch.empty(local * int(d.sum()))
            splits_out = [local * int(d[rank])] * world_size
            splits_in = [local * int(x) for x in d]
            times = []
            for _ in range(job["repeats"]):
                dist.barrier()
                time.sleep(float(delays[max(sample, 0)][rank]))  # its compute, arriving late
                start = time.perf_counter()
                dist.all_to_all_single(recv, send, splits_in, splits_out)
                middle = time.perf_counter()
                dist.all_to_all_single(send, recv, splits_out, splits_in)  # the gradients back
                times.append((middle - start, time.perf_counter() - middle))
            if sample >= 0:
                forward.append(float(np.median([t[0] for t in times])))
                backward.append(float(np.median([t[1] for t in times])))
        times = torch.tensor([forward, backward], dtype=torch.float64)
        gathered = [torch.empty_like(times) for _ in range(world_size)]
        dist.all_gather(gathered, times)
        if rank == 0:
            out = torch.stack(gathered)  # (rank, forward/backward, sample)
            Path(job["out"]).write_text(json.dumps(out.tolist()))
    finally:
        dist.destroy_process_group()


def time_all_to_all(
    dim_sums: np.ndarray, delays: np.ndarray, *, batch_size: int, repeats: int = 1
) -> np.ndarray:
    """Seconds of the forward and backward all-to-all of each layout on ``W`` gloo processes of
    this machine (the median of ``repeats``): ``dim_sums`` ``(n, W)`` values a sample each rank
    sends, ``delays`` ``(n, W)`` seconds each rank arrives late; ``batch_size`` samples a step
    over all ranks, fp32 values. Returns ``(W, 2, n)``: rank, forward / backward, layout."""
    import torch.multiprocessing as mp

    world_size = np.shape(dim_sums)[1]
    with scratch_directory("comm") as tmp:
        job = {
            "dims": np.asarray(dim_sums).tolist(),
            "delays": np.asarray(delays).tolist(),
            "batch_size": batch_size,
            "repeats": repeats,
            "out": os.path.join(tmp, "t.json"),
        }
        mp.start_processes(
            _comm_worker,
            args=(world_size, os.path.join(tmp, "init"), job),
            nprocs=world_size,
            start_method="spawn",
        )
        return np.asarray(json.loads(Path(job["out"]).read_text()))


def collect_comm_samples(
    n: int, *, world_size: int = 2, batch_size: int = 1024, seed: int = 0, repeats: int = 5
) -> pa.Table:
    """Times the forward and backward all-to-all of ``n`` random dim-sum layouts on
    ``world_size`` gloo processes of this machine (``batch_size`` samples a step over all
    ranks; fp32 values; the median of ``repeats`` each).

    Returns:
        One row per layout: ``world_size``, ``dim_sums`` and ``delays`` (seconds) per rank,
        ``forward_seconds`` and ``backward_seconds`` per rank, ``batch_size``, ``machine``.
    """
    dims, delays = _layouts(n, world_size, seed)
    times = time_all_to_all(dims, delays, batch_size=batch_size, repeats=repeats)
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


# --- the model ---------------------------------------------------------------------------------

_COMM_FEATURES = 4
_COMM_HIDDEN = 32
_MIN_TRANSFER_S = 1e-5
_COMM_COLUMNS = ("world_size", "dim_sums", "delays", "forward_seconds", "backward_seconds")


def comm_features(dim_sums: np.ndarray) -> np.ndarray:
    """Each rank's features of layouts ``(K, W)`` of dim sums: log2 of the ranks, the rank's
    own dim sum, the mean and the largest (sums in units of 1024 values) -> ``(K, W, 4)``."""
    dims = np.asarray(dim_sums, dtype=np.float64) / 1024.0
    k, w = dims.shape
    return np.stack(
        [
            np.full((k, w), math.log2(w)),
            dims,
            np.broadcast_to(dims.mean(axis=1, keepdims=True), (k, w)),
            np.broadcast_to(dims.max(axis=1, keepdims=True), (k, w)),
        ],
        axis=-1,
    )


def transfer_targets(samples: pa.Table) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per layout: its dim sums ``(W,)`` and the seconds ``(W,)`` each rank spent in the forward
    and backward all-to-all beyond waiting for the latest rank to arrive (a rank that arrives
    ``delay`` before the latest waits that long first; at least 10 us)."""
    dims, seconds = [], []
    for d, delay, fwd, bwd in zip(
        *(samples.column(c).to_pylist() for c in _COMM_COLUMNS[1:]), strict=True
    ):
        wait = max(delay) - np.asarray(delay)
        transfer = np.maximum(np.asarray(fwd) - wait, _MIN_TRANSFER_S) + np.asarray(bwd)
        dims.append(np.asarray(d, dtype=np.float64))
        seconds.append(transfer)
    return dims, seconds


class CommCostNet(nn.Module):
    """A rank's log transfer seconds (forward + backward all-to-all) from its
    :func:`comm_features`, normalised: 4 -> 32 -> 32 -> 1."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(
            nn.Linear(_COMM_FEATURES, _COMM_HIDDEN),
            nn.ReLU(),
            nn.Linear(_COMM_HIDDEN, _COMM_HIDDEN),
            nn.ReLU(),
            nn.Linear(_COMM_HIDDEN, 1),
        )

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.mlp(features).squeeze(-1)


@dataclass
class CommCostModel:
    """A trained :class:`CommCostNet` and what it was trained on."""

    net: CommCostNet
    mean: list[float]
    std: list[float]
    world_sizes: list[int]
    batch_size: int
    report: dict[str, float] = field(default_factory=dict)
    """Held-out ``comm_mape`` and the sample counts."""

    def predict(self, dim_sums: np.ndarray) -> np.ndarray:
        """Predicted transfer seconds ``(K, W)`` of layouts ``(K, W)`` of dim sums."""
        features = (comm_features(dim_sums) - np.asarray(self.mean)) / np.asarray(self.std)
        with torch.no_grad():
            out = self.net(torch.from_numpy(features.astype(np.float32)))
        return np.exp(out.numpy().astype(np.float64))

    def meta(self) -> dict[str, Any]:
        """Everything but the weights, for JSON."""
        return {k: getattr(self, k) for k in ("mean", "std", "world_sizes", "batch_size", "report")}


def stored_comm_samples(directory: str | Path, *, batch_size: int) -> pa.Table | None:
    """The all-to-all samples at ``batch_size`` of the store ``directory`` (any world size), or
    None if there are none."""
    files = sorted(Path(directory).expanduser().glob(f"comm-w*-b{batch_size}-*.parquet"))
    if not files:
        return None
    return pa.concat_tables(pq.read_table(f).select(list(_COMM_COLUMNS)) for f in files)


def train_comm_model(
    samples: pa.Table,
    *,
    batch_size: int,
    epochs: int = 1000,
    held_out: float = 0.2,
    seed: int = 0,
) -> CommCostModel:
    """Trains a :class:`CommCostModel` on all-to-all samples (one row per rank of each layout),
    holding ``held_out`` of the layouts out to report its error."""
    dims, seconds = transfer_targets(samples)
    order = np.random.default_rng(seed).permutation(len(dims))
    cut = max(1, round(len(dims) * held_out)) if held_out > 0 and len(dims) > 1 else 0

    test, train = order[:cut], order[cut:]
    x_train = np.concatenate([comm_features(dims[i][None])[0] for i in train])
    y_train = np.concatenate([seconds[i] for i in train])
    mean, std = x_train.mean(axis=0), np.maximum(x_train.std(axis=0), 1e-6)
    torch.manual_seed(seed)
    net = CommCostNet()
    optimizer = torch.optim.Adam(net.parameters(), lr=3e-3)
    features = torch.tensor((x_train - mean) / std, dtype=torch.float32)
    target = torch.tensor(np.log(y_train), dtype=torch.float32)
    for _ in range(epochs):
        optimizer.zero_grad()
        torch.mean((net(features) - target) ** 2).backward()
        optimizer.step()
    model = CommCostModel(
        net=net.eval(),
        mean=mean.tolist(),
        std=std.tolist(),
        world_sizes=sorted(set(samples.column("world_size").to_pylist())),
        batch_size=batch_size,
        report={"comm_train_layouts": float(len(dims) - cut), "comm_held_out_layouts": float(cut)},
    )
    if cut:
        predicted = np.concatenate([model.predict(dims[i][None])[0] for i in test])
        model.report["comm_mape"] = mape(predicted, np.concatenate([seconds[i] for i in test]))
    return model
