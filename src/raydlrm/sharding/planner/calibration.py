"""Calibration of the cost model: measures
:class:`~raydlrm.sharding.planner.cost.CostConstants` here.

:func:`calibrate` times micro-benchmarks on this machine: TBE forward + backward passes (the
lookup throughput of the DRAM tier), a 2-process gloo all-to-all (comm bandwidth and latency)
and random page reads and write-backs of a mapped file (the SSD tier). Each size is run a few
times and the fastest kept; throughputs come from a least-squares fit over the sizes. torch and
numpy are imported only when a measurement runs, so the cost model stays cheap to import.
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from raydlrm.sharding.planner.cost import CostConstants

__all__ = ["CalibrationSizes", "calibrate", "timed_tbe"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CalibrationSizes:
    """Micro-benchmark sizes of :func:`calibrate`."""

    lookups: tuple[tuple[int, int, int], ...] = (
        (100_000, 64, 16_384),
        (100_000, 128, 65_536),
        (100_000, 128, 262_144),
    )
    """(rows, dim, ids per step) of each TBE forward + backward measured."""
    comm_bytes: tuple[int, ...] = (1 << 10, 1 << 20, 1 << 23)
    """Bytes each rank sends its peer in each measured all-to-all."""
    repeats: int = 5
    """Timed repetitions of each size (the fastest is kept)."""
    ssd_file_bytes: int = 256 << 20
    """Size of the file whose random pages the SSD tier's calibration reads and writes."""
    ssd_pages: int = 4096
    """Random pages read, and written back, in each of its measurements."""


@dataclass(frozen=True)
class _Measurement:
    """What one part of the calibration measured, and the note ``source`` records of it."""

    note: str
    values: dict[str, float] = field(default_factory=dict)
    """:class:`CostConstants` field -> measured value (none: the part kept its defaults)."""


def calibrate(
    *,
    sizes: CalibrationSizes | None = None,
    comm: bool = True,
    ssd_directory: str | Path | None = None,
    kernel: str = "auto",
    device: str = "cpu",
) -> CostConstants:
    """Measures the cost constants on this machine.

    Fits the lookup throughput (the DRAM tier) from TBE forward + backward passes of a few
    sizes (the kernel ``kernel`` resolves to here), the comm bandwidth and latency from a
    2-process gloo all-to-all of a few sizes, and, given ``ssd_directory``, the SSD tier's
    random row reads and write-backs per second through a mapped file there. What is not
    measured keeps its default and ``source`` says so (no process group, ``comm`` False, no
    directory).

    Args:
        sizes: the micro-benchmark sizes (defaults: a few seconds in all).
        comm: measure the all-to-all too.
        ssd_directory: where to measure the SSD tier (the workers' ``sharding.ssd_path``).
        kernel: the workers' ``sharding.kernel``.
        device: where the workers' tables are (``cpu``, or ``cuda``: the lookups are timed on
            this machine's GPU).

    Returns:
        The measured constants.

    Raises:
        TierError: ``ssd_directory`` cannot be written or lacks the space for the test file.
    """
    sizes = sizes or CalibrationSizes()
    lookups = _measure_lookups(sizes, kernel=kernel, device=device)
    stamp = f"calibrated {time.strftime('%Y-%m-%d %H:%M:%S')} on {os.uname().nodename}"
    if comm:
        comms = _measure_comm(sizes)
    else:
        comms = _Measurement("comm constants are defaults (comm calibration skipped)")
    if ssd_directory is None:
        ssd = _Measurement("ssd constants are defaults (no ssd directory)")
    else:
        ssd = _measure_ssd(sizes, directory=Path(ssd_directory).expanduser())
    parts = (lookups, comms, ssd)
    measured = {name: value for part in parts for name, value in part.values.items()}
    return CostConstants(
        **measured, source="; ".join([stamp, *(p.note for p in parts)]), device=device
    )


def _measure_lookups(sizes: CalibrationSizes, *, kernel: str, device: str) -> _Measurement:
    """The lookup throughput of the kernel ``kernel`` resolves to, on ``device``."""
    from raydlrm.sharding.kernel import resolve_kernel
    from raydlrm.sharding.planner.measure import check_device

    check_device(device)
    resolved = resolve_kernel(kernel)
    rate = _lookup_rate(list(sizes.lookups), repeats=sizes.repeats, kernel=resolved, device=device)
    return _Measurement(
        f"lookups: {resolved} TBE fwd+bwd on {device}", {"lookup_bytes_per_s": rate}
    )


def _measure_comm(sizes: CalibrationSizes) -> _Measurement:
    """The all-to-all's bandwidth and latency; the defaults if no process group can be made."""
    try:
        bandwidth, latency = _comm_constants(list(sizes.comm_bytes), repeats=sizes.repeats)
    except Exception as e:  # any failure to make a process group means: skip the comm part
        logger.warning("comm calibration skipped, no gloo process group: %s", e)
        return _Measurement(f"comm constants are defaults (no process group: {e})")
    return _Measurement(
        "comm: 2-process gloo all_to_all",
        {"comm_bytes_per_s": bandwidth, "collective_latency_s": latency},
    )


def _measure_ssd(sizes: CalibrationSizes, *, directory: Path) -> _Measurement:
    """The SSD tier's row reads and write-backs per second through a file in ``directory``."""
    reads, writes = _ssd_rates(directory, file_bytes=sizes.ssd_file_bytes, pages=sizes.ssd_pages)
    return _Measurement(
        f"ssd: random 4 KiB pages of a mapped file in {directory}",
        {"ssd_row_reads_per_s": reads, "ssd_row_writes_per_s": writes},
    )


def _fit(sizes: list[float], seconds: list[float]) -> tuple[float, float]:
    """Least-squares ``seconds = intercept + size / rate``: returns ``(rate, intercept >= 0)``."""
    n = len(sizes)
    mean_x, mean_y = sum(sizes) / n, sum(seconds) / n
    var = sum((x - mean_x) ** 2 for x in sizes)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(sizes, seconds, strict=True)) / var
    if slope <= 0:  # noise swamped the size dependence: fall back to the largest size's rate
        return sizes[-1] / seconds[-1], 0.0
    return 1.0 / slope, max(mean_y - slope * mean_x, 0.0)


def _best_of(fn, *, repeats: int) -> float:
    fn()  # warm-up
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def timed_tbe(kernel: str, tables: list[Any], *, device: str = "cpu") -> Any:
    """The TBE the cost measurements time: ``tables`` (``TableSpec``), one feature each,
    row-wise Adagrad, fp32 weights, sum pooling, of the resolved ``kernel``, on ``device``."""
    import torch

    from raydlrm.sharding.kernel import build_tbe

    return build_tbe(
        kernel,  # type: ignore[arg-type]
        tables=tables,
        feature_table_map=list(range(len(tables))),
        optimizer="rowwise_adagrad",
        learning_rate=0.01,
        eps=1e-8,
        pooling="sum",
        precision="fp32",
        device=torch.device(device),
    )


def _lookup_rate(
    sizes: list[tuple[int, int, int]], *, repeats: int, kernel: str, device: str = "cpu"
) -> float:
    """fp32 bytes per second of a TBE forward + backward (row-wise Adagrad) of ``kernel`` on
    ``device``."""
    import torch

    from raydlrm.sharding.kernel import TableSpec
    from raydlrm.sharding.planner.measure import synchronize

    gen = torch.Generator().manual_seed(0)
    volumes, seconds = [], []
    for rows, dim, ids_per_step in sizes:
        tbe = timed_tbe(kernel, [TableSpec(rows, dim)], device=device)
        bags = max(ids_per_step // 8, 1)
        indices = torch.randint(0, rows, (bags * 8,), generator=gen).to(device)
        offsets = torch.arange(0, bags * 8 + 1, 8).to(device)

        def step(tbe=tbe, indices=indices, offsets=offsets) -> None:
            tbe(indices, offsets).sum().backward()
            synchronize(device)

        volumes.append(float(bags * 8 * dim * torch.float32.itemsize))
        seconds.append(_best_of(step, repeats=repeats))
    return _fit(volumes, seconds)[0]


def _all_to_all_worker(rank: int, init_file: str, sizes: list[int], repeats: int, out: str):
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        result = []
        for size in sizes:
            send = torch.zeros(2 * (size // 8), dtype=torch.float64)  # ``size`` bytes per peer
            recv = torch.empty_like(send)

            def exchange(send=send, recv=recv) -> None:
                dist.all_to_all_single(recv, send)
                dist.barrier()

            result.append(_best_of(exchange, repeats=repeats))
        if rank == 0:
            Path(out).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _comm_constants(sizes: list[int], *, repeats: int) -> tuple[float, float]:
    """(bytes per second, latency) of a 2-process gloo all-to-all on this machine."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.json")
        mp.start_processes(
            _all_to_all_worker,
            args=(os.path.join(tmp, "init"), sizes, repeats, out),
            nprocs=2,
            start_method="spawn",
        )
        seconds = json.loads(Path(out).read_text())
    # Each rank sends ``size`` bytes to its peer: ``size`` bytes cross the link each way.
    return _fit([float(s) for s in sizes], seconds)


def _ssd_rates(directory: Path, *, file_bytes: int, pages: int) -> tuple[float, float]:
    """(rows read per second, rows written back per second) of the ``ssd`` tier: random 4 KiB
    pages of a mapped file in ``directory``, read from the disk (dropped from the page cache
    first), and dirtied then synced (``msync``), as a table's rows are."""
    import mmap

    import numpy as np

    from raydlrm.sharding.tiers import check_space

    page = mmap.PAGESIZE
    n_pages = max(file_bytes // page, 2 * pages)
    check_space(directory, n_pages * page, tables=["(plan --calibrate)"])
    rng = np.random.default_rng(0)
    reads, writes = rng.permutation(n_pages)[: 2 * pages].reshape(2, pages) * page
    fd, path = tempfile.mkstemp(prefix="raydlrm-calibrate-", dir=directory)
    try:
        os.unlink(path)
        # Written for real: unwritten (fallocated) blocks read as zeros without the disk.
        block = b"\1" * (8 << 20)
        for offset in range(0, n_pages * page, len(block)):
            os.pwrite(fd, block[: n_pages * page - offset], offset)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        with mmap.mmap(fd, n_pages * page) as mapped:
            view = np.frombuffer(mapped, dtype=np.uint8)
            start = time.perf_counter()
            int(view[reads].sum())  # each a page fault served by the disk
            read_s = time.perf_counter() - start
            int(view[writes].sum())  # in the page cache before the write-back is timed
            start = time.perf_counter()
            view[writes] = 2
            mapped.flush()  # msync: the dirty pages written back
            write_s = time.perf_counter() - start
            del view
    finally:
        os.close(fd)
    return pages / read_s, pages / write_s
