"""Measured cost samples: random sets of synthetic tables timed with the job's kernel
(:func:`collect_samples`), and their store of Parquet files (one row per measured set: the
tables' features, flattened, the seconds, kernel, batch size, device and machine).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from raydlrm.sharding.planner.learned_cost.features import NUM_FEATURES, CostModelError, TableStats
from raydlrm.sharding.planner.measure import check_device, machine_description, synchronize

__all__ = [
    "SyntheticTable",
    "collect_samples",
    "draw_ids",
    "load_samples",
    "sample_sets",
    "save_samples",
    "stored_samples",
    "time_tables",
    "with_device",
]

_SAMPLE_COLUMNS = (
    "num_tables",
    "features",
    "seconds",
    "kernel",
    "batch_size",
    "device",
    "machine",
)
_DIMS = tuple(range(4, 132, 4))
"""Dims of the synthetic tables: multiples of 4 from 4 to 128 (what the kernels vectorise)."""


@dataclass(frozen=True)
class SyntheticTable:
    """A table of the synthetic family the samples (and the sharding benchmark) draw."""

    rows: int
    dim: int
    pooling: float
    skew: float
    """Zipf exponent of the ids (0: uniform)."""


def _random_table(rng: np.random.Generator, *, max_rows: int) -> SyntheticTable:
    """Rows log-uniform in [10^3, max_rows], a dim in :data:`_DIMS`, a pooling factor
    log-uniform in [1, 100], and access skew uniform in [0, 1.2] (uniform to heavy power law)."""
    rows = int(10 ** rng.uniform(3, math.log10(max(max_rows, 1001))))
    dim = int(rng.choice(_DIMS))
    pooling = float(10 ** rng.uniform(0, 2))
    return SyntheticTable(rows, dim, pooling, float(rng.uniform(0.0, 1.2)))


def _random_set(
    rng: np.random.Generator, *, max_tables: int, max_rows: int, max_bytes: int
) -> list[SyntheticTable]:
    """1 to ``max_tables`` random tables, fewer if the next would take the set's weights and
    row-wise state past ``max_bytes``."""
    count = int(rng.integers(1, max_tables + 1))
    tables: list[SyntheticTable] = []
    used = 0
    while len(tables) < count:
        table = _random_table(rng, max_rows=max_rows)
        size = table.rows * (table.dim + 1) * 4
        if used + size <= max_bytes:
            tables.append(table)
            used += size
        elif tables:
            break
    return tables


def draw_ids(
    rng: np.random.Generator, table: SyntheticTable, bags: int
) -> tuple[np.ndarray, np.ndarray]:
    """One batch of ``bags`` bags of a table: (ids, lengths); lengths 1 + Poisson(pooling - 1),
    ids Zipf-ranked rows scattered over the table (a hash of the rank)."""
    from raydlrm._sampling import zipf_ranks

    lengths = 1 + rng.poisson(max(table.pooling - 1.0, 0.0), size=bags)
    total = int(lengths.sum())
    if table.skew < 1e-3:
        ranks = rng.integers(0, table.rows, size=total)
    else:
        ranks = zipf_ranks(rng, size=total, cardinality=table.rows, s=table.skew)
    ids = (ranks.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)) % np.uint64(table.rows)
    return ids.astype(np.int64), lengths


def time_tables(
    tables: Sequence[Any],
    batches: Sequence[tuple[np.ndarray, np.ndarray]],
    *,
    kernel: str,
    repeats: int,
    device: str = "cpu",
) -> float:
    """Median seconds of a fused TBE forward + backward (row-wise Adagrad, fp32) of ``tables``
    (anything with ``rows`` and ``dim``) on ``device`` looking up ``batches`` (ids and bag
    lengths, one per table), after one warm-up (on a GPU: until its kernels finish)."""
    from raydlrm.sharding.kernel import TableSpec
    from raydlrm.sharding.planner.calibration import timed_tbe

    tbe = timed_tbe(kernel, [TableSpec(t.rows, t.dim) for t in tables], device=device)
    indices = torch.from_numpy(np.concatenate([ids for ids, _ in batches])).to(device)
    lengths = np.concatenate([lengths for _, lengths in batches])
    offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
    offsets = offsets.to(device)
    times = []
    synchronize(device)
    for i in range(repeats + 1):
        start = time.perf_counter()
        tbe(indices, offsets).sum().backward()
        synchronize(device)
        if i:  # the first is a warm-up
            times.append(time.perf_counter() - start)
    return float(np.median(times))


def collect_samples(
    n: int,
    *,
    kernel: str = "auto",
    batch_size: int = 1024,
    seed: int = 0,
    max_tables: int = 15,
    max_rows: int = 2_000_000,
    max_bytes: int = 1 << 30,
    repeats: int = 5,
    progress: Callable[[int, int], None] | None = None,
    device: str = "cpu",
) -> pa.Table:
    """Measures ``n`` random sets of synthetic tables (1 to ``max_tables`` each, at most
    ``max_bytes`` of weights and state a set) with the kernel ``kernel`` resolves to, on this
    machine's ``device`` (``cpu``, or ``cuda``: the tables in GPU memory, as GPU workers hold
    them): each set's fused forward + backward seconds over one batch of ``batch_size`` bags
    per table.

    Returns:
        One row per set: ``num_tables``, ``features`` (the tables' :class:`TableStats`
        features, flattened), ``seconds``, ``kernel``, ``batch_size``, ``device``,
        ``machine``.
    """
    from raydlrm.sharding.kernel import resolve_kernel

    smallest = 1000 * (min(_DIMS) + 1) * 4  # the smallest table a set can draw
    if max_bytes < smallest:
        raise ValueError(f"max_bytes {max_bytes} is below the smallest table's {smallest}")
    check_device(device)
    resolved = resolve_kernel(kernel)
    rng = np.random.default_rng(seed)
    machine = machine_description(device)
    rows: dict[str, list[Any]] = {"num_tables": [], "features": [], "seconds": []}
    for i in range(n):
        tables = _random_set(rng, max_tables=max_tables, max_rows=max_rows, max_bytes=max_bytes)
        batches = [draw_ids(rng, t, batch_size) for t in tables]
        stats = [
            TableStats.of_batch(rows=t.rows, dim=t.dim, ids=ids, bags=batch_size)
            for t, (ids, _) in zip(tables, batches, strict=True)
        ]
        seconds = time_tables(tables, batches, kernel=resolved, repeats=repeats, device=device)
        rows["num_tables"].append(len(tables))
        rows["features"].append([v for s in stats for v in s.features()])
        rows["seconds"].append(seconds)
        if progress is not None:
            progress(i + 1, n)
    size = len(rows["seconds"])
    return pa.table(
        {
            **rows,
            "kernel": [resolved] * size,
            "batch_size": [batch_size] * size,
            "device": [device] * size,
            "machine": [machine] * size,
        }
    )


def _store_prefix(kernel: str, batch_size: int, device: str) -> str:
    """The name of a sample file of the store, up to its time: ``<kernel>-b<batch>`` for CPU
    samples, ``<kernel>-<device>-b<batch>`` for others."""
    return f"{kernel}-b{batch_size}" if device == "cpu" else f"{kernel}-{device}-b{batch_size}"


def save_samples(samples: pa.Table, directory: str | Path) -> Path:
    """Adds measured samples to the store ``directory`` (``sharding.cost_samples_path``): a
    Parquet file named by their kernel, device, batch size and the time; returns it."""
    directory = Path(directory).expanduser()
    directory.mkdir(parents=True, exist_ok=True)
    first = {c: samples.column(c)[0].as_py() for c in ("kernel", "batch_size", "device")}
    prefix = _store_prefix(first["kernel"], first["batch_size"], first["device"])
    path = directory / f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}.parquet"
    pq.write_table(samples, path)
    return path


def stored_samples(
    directory: str | Path, *, kernel: str, batch_size: int, device: str = "cpu"
) -> pa.Table:
    """Every sample of the store ``directory`` measured with ``kernel`` at ``batch_size`` on
    ``device``.

    Raises:
        CostModelError: there are none, naming the store; or a file is malformed.
    """
    directory = Path(directory).expanduser()
    files = sorted(directory.glob(f"{_store_prefix(kernel, batch_size, device)}-*.parquet"))
    if not files:
        raise CostModelError(
            f"no cost samples of the {kernel} kernel on {device} at batch size {batch_size} "
            f"in {directory}: run raydlrm plan --collect N first"
        )
    return load_samples(files)


def with_device(samples: pa.Table) -> pa.Table:
    """``samples`` with a ``device`` column: those measured before GPU measurements were
    possible have none, and are CPU samples."""
    if "device" in samples.column_names:
        return samples
    return samples.append_column("device", pa.array(["cpu"] * samples.num_rows))


def load_samples(paths: Sequence[str | Path]) -> pa.Table:
    """The cost samples of one or more Parquet files (as :func:`collect_samples` wrote them).

    Raises:
        CostModelError: a file is missing or lacks a column, naming it.
    """
    if not paths:
        raise CostModelError("no cost samples: run raydlrm plan --collect N first")
    tables = []
    for path in paths:
        if not Path(path).is_file():
            raise CostModelError(f"cost samples {path} do not exist: run raydlrm plan --collect N")
        table = with_device(pq.read_table(path))
        missing = set(_SAMPLE_COLUMNS) - set(table.column_names)
        if missing:
            raise CostModelError(f"cost samples {path} lack the columns {sorted(missing)}")
        tables.append(table.select(list(_SAMPLE_COLUMNS)))
    return pa.concat_tables(tables)


def sample_sets(samples: pa.Table) -> list[list[list[float]]]:
    """Each sample's tables' features (:meth:`TableStats.features`)."""
    out = []
    for count, flat in zip(
        samples.column("num_tables").to_pylist(),
        samples.column("features").to_pylist(),
        strict=True,
    ):
        out.append([flat[i * NUM_FEATURES : (i + 1) * NUM_FEATURES] for i in range(count)])
    return out
