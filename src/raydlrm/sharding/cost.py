"""A cost model of one embedding table under one sharding type, and its calibration.

Per training step of ``B`` samples, a table of ``N`` rows and ``D`` columns looked up by ``F``
features with ``L`` ids per bag (the pooling factor), split into ``k`` shards on ``W`` ranks:

- lookup compute: ``F * B * L * D * w`` bytes of rows read, ``w`` the weights' bytes (4 fp32, 2
  fp16; the backward pass touches the same rows; the calibrated throughput, measured on fp32
  rows, covers forward plus backward and is taken as the same for fp16: lookups are
  memory-bound);
- input communication (the ids, 8 bytes each, plus one 4-byte length per bag and shard):
  table-wise sends each id to its one owner, row-wise and table-row-wise to the one row owner
  (lengths go to every shard), column-wise one copy of every id per column shard, data-parallel
  none (each rank looks up its own samples);
- output communication (pooled vectors, each of ``D`` values, at the comm precision, counted
  once: the backward gradients are the same size): table-wise and column-wise ``F * B`` vectors,
  row-wise and table-row-wise ``k`` partial sums of each, data-parallel none but an all-reduce of
  the table's gradient (``2 (W - 1) N D 4`` bytes);
- memory: ``N * D`` weights at their precision (4 bytes fp32, 2 bytes fp16) plus the fp32
  optimizer state (row-wise Adagrad one float per row, Adagrad one per weight, SGD none).

Its estimated time is ``compute / lookup_bytes_per_s + comm / comm_bytes_per_s + k *
collective_latency_s`` (each shard takes part in the collectives). A table on the ``ssd`` tier
adds its disk time: each distinct row a step touches (``N (1 - exp(-ids / N))`` of ``ids``
lookups drawn uniformly: the most a step can touch; skewed ids touch fewer) misses the page
cache with probability ``1 - page_cache_hit`` and is then read from disk, and every updated
row's page is written back once (``ssd_row_reads_per_s``, ``ssd_row_writes_per_s``: random 4
KiB pages through a mapped file). Column-wise shards each touch every distinct row;
data-parallel replicas each touch their own samples' rows. The constants come from
:class:`CostConstants`: defaults, or :func:`calibrate` on this machine (saved as JSON).
The planner charges each shard ``1 / k`` of the table's time.
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from raydlrm.models.embedding import EmbeddingBagConfig

__all__ = [
    "CostConstants",
    "TableCost",
    "cache_rows",
    "calibrate",
    "estimate_table_cost",
    "expected_distinct_rows",
    "load_constants",
    "save_constants",
    "table_memory_bytes",
    "wire_bytes_per_vector",
]

logger = logging.getLogger(__name__)

_FP32_BYTES = 4
_WEIGHT_BYTES = {"fp32": 4, "fp16": 2}
_ID_BYTES = 8
_LENGTH_BYTES = 4
# (bytes per value, bytes per row) on the wire of each codec in :mod:`raydlrm.sharding.codecs`;
# kept here so a dry-run plan does not import torch.
_WIRE = {"fp32": (4, 0), "fp16": (2, 0), "bf16": (2, 0), "fp8": (1, 4), "int8": (1, 8)}


@dataclass(frozen=True)
class CostConstants:
    """Throughputs and latency that turn bytes into seconds.

    Attributes:
        lookup_bytes_per_s: fp32 embedding bytes read per second by a fused lookup, forward
            plus backward with the optimizer update.
        comm_bytes_per_s: bytes per second of an all-to-all between ranks.
        collective_latency_s: fixed seconds per collective a shard takes part in.
        ssd_row_reads_per_s: rows of an ``ssd`` table read per second when the page cache
            misses them (random 4 KiB pages faulted in from the disk).
        ssd_row_writes_per_s: updated rows of an ``ssd`` table written back per second
            (random dirty 4 KiB pages synced to the disk).
        source: where the numbers come from (``default`` or a calibration note).
    """

    lookup_bytes_per_s: float = 8e8
    comm_bytes_per_s: float = 5e8
    collective_latency_s: float = 1e-4
    ssd_row_reads_per_s: float = 5e4
    ssd_row_writes_per_s: float = 2e4
    source: str = "default"

    def __post_init__(self) -> None:
        for name in (
            "lookup_bytes_per_s",
            "comm_bytes_per_s",
            "ssd_row_reads_per_s",
            "ssd_row_writes_per_s",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(
                    f"CostConstants.{name} must be positive, got {getattr(self, name)}"
                )
        if self.collective_latency_s < 0:
            raise ValueError(
                f"CostConstants.collective_latency_s must be >= 0, got {self.collective_latency_s}"
            )


@dataclass(frozen=True)
class TableCost:
    """Estimated work of one table under one sharding type, per training step (all shards)."""

    compute_bytes: float
    """Embedding bytes read by the lookups."""
    input_comm_bytes: float
    """Ids and lengths sent to the shards' owners."""
    output_comm_bytes: float
    """Pooled vectors (or, for data-parallel, the gradient all-reduce) on the wire."""
    memory_bytes: int
    """Weights plus optimizer state of one copy of the table."""
    seconds: float
    """Estimated step time of the table, summed over its shards."""
    disk_rows: float = 0.0
    """Distinct rows the step touches on the ``ssd`` tier (0 in DRAM), all shards."""
    disk_seconds: float = 0.0
    """The part of ``seconds`` spent reading and writing back those rows."""


def wire_bytes_per_vector(dim: int, *, precision: str = "fp32") -> int:
    """Bytes of one pooled ``dim``-vector on the wire with codec ``precision``."""
    per_value, per_row = _WIRE[precision]
    return dim * per_value + per_row


def cache_rows(rows: int, *, load_factor: float, min_rows: int) -> int:
    """Rows of the DRAM cache of an ``ssd`` table (shard) of ``rows`` rows: ``load_factor``
    of them, at least ``min_rows``, at most all; 0 when ``load_factor`` is 0 (no cache)
    (``sharding.ssd_cache_load_factor``, ``ssd_cache_min_rows``)."""
    if load_factor <= 0:
        return 0
    return min(rows, max(math.ceil(load_factor * rows), min_rows))


def table_memory_bytes(
    table: EmbeddingBagConfig,
    *,
    optimizer: str,
    weights_precision: str = "fp32",
    placement: str = "dram",
    cache_rows: int = 0,
) -> int:
    """Bytes of worker memory the table takes: its weights plus its fused optimizer state
    (always fp32); for an ``ssd`` table only what stays in memory: row-wise Adagrad's one float
    per row (a per-weight state goes to disk with the weights) and, with a DRAM row cache of
    ``cache_rows`` rows, the cached rows with their state, plus 4 bytes per row and 16 per
    cached row of bookkeeping.

    Args:
        table: the table.
        optimizer: ``rowwise_adagrad`` (one float per row), ``adagrad`` (one per weight) or
            ``sgd`` (no state).
        weights_precision: ``fp32`` (4 bytes per weight) or ``fp16`` (2 bytes).
        placement: ``dram`` or ``ssd``.
        cache_rows: rows of an ``ssd`` table's DRAM cache (:func:`cache_rows`).
    """
    rows, dim = table.num_embeddings, table.embedding_dim
    state_per_row = {"rowwise_adagrad": _FP32_BYTES, "adagrad": dim * _FP32_BYTES, "sgd": 0}
    row_bytes = dim * _WEIGHT_BYTES[weights_precision] + state_per_row[optimizer]
    if placement != "ssd":
        return rows * row_bytes
    in_memory = rows * _FP32_BYTES if optimizer == "rowwise_adagrad" else 0
    if cache_rows:
        in_memory += rows * _FP32_BYTES + cache_rows * (row_bytes + 16)
    return in_memory


def table_disk_bytes(
    table: EmbeddingBagConfig, *, optimizer: str, weights_precision: str = "fp32"
) -> int:
    """Bytes of local disk an ``ssd`` table takes: its weights, and a per-weight optimizer
    state (Adagrad's) beside them."""
    weights = table.num_embeddings * table.embedding_dim
    state = weights * _FP32_BYTES if optimizer == "adagrad" else 0
    return weights * _WEIGHT_BYTES[weights_precision] + state


def expected_distinct_rows(num_rows: int, lookups: float) -> float:
    """Expected distinct rows among ``lookups`` ids drawn uniformly from ``num_rows`` rows:
    ``N (1 - exp(-ids / N))``, the most a step can touch (skewed ids touch fewer)."""
    if num_rows <= 0 or lookups <= 0:
        return 0.0
    return num_rows * -math.expm1(-lookups / num_rows)


def ssd_seconds_per_row(constants: CostConstants, *, page_cache_hit: float) -> float:
    """Disk seconds per distinct row an ``ssd`` table's step touches: a read when the page
    cache misses it, and one write-back of its page."""
    miss = 1.0 - min(max(page_cache_hit, 0.0), 1.0)
    return miss / constants.ssd_row_reads_per_s + 1.0 / constants.ssd_row_writes_per_s


def estimate_table_cost(
    table: EmbeddingBagConfig,
    *,
    sharding_type: str,
    num_shards: int,
    world_size: int,
    batch_size: int,
    pooling_factor: float = 1.0,
    optimizer: str = "rowwise_adagrad",
    weights_precision: str = "fp32",
    comm_precision: str = "fp32",
    constants: CostConstants | None = None,
    placement: str = "dram",
    page_cache_hit: float = 0.0,
    cache_rows: int = 0,
) -> TableCost:
    """The cost of ``table`` sharded as ``sharding_type`` in ``num_shards`` shards.

    Args:
        table: the table.
        sharding_type: one of :data:`~raydlrm.sharding.config.ShardingType`.
        num_shards: shards of the table (``world_size`` for data-parallel).
        world_size: ranks in the job.
        batch_size: global samples per step.
        pooling_factor: average ids per bag of each of the table's features.
        optimizer: the fused optimizer (for the state's memory).
        weights_precision: precision of the weights (their memory and the bytes a lookup
            reads).
        comm_precision: codec of the pooled vectors on the wire.
        constants: throughputs and latency (defaults if None).
        placement: ``dram`` or ``ssd`` (adds the disk time of the rows a step touches).
        page_cache_hit: for ``ssd``, the fraction of touched rows the page cache holds.
        cache_rows: for ``ssd``, rows of its DRAM row cache (0: none): with ids drawn
            uniformly, ``cache_rows / rows`` of the touched rows are there, cost no disk time,
            and each other one is read in and evicts one row, written back.

    Returns:
        The table's compute, communication, disk, memory and estimated seconds per step.
    """
    constants = constants or CostConstants()
    bags = len(table.feature_names) * batch_size
    ids = bags * pooling_factor
    dim = table.embedding_dim
    compute = ids * dim * _WEIGHT_BYTES[weights_precision]
    vectors = bags * wire_bytes_per_vector(dim, precision=comm_precision)
    if sharding_type == "data_parallel":
        inputs = 0.0
        outputs = 2.0 * (world_size - 1) * table.num_embeddings * dim * _FP32_BYTES
    elif sharding_type == "column_wise":
        inputs = num_shards * (ids * _ID_BYTES + bags * _LENGTH_BYTES)
        # Each column shard sends its slice; the slices add up to one vector (plus per-row
        # scales for the row-wise codecs, once per shard).
        per_row = _WIRE[comm_precision][1]
        outputs = vectors + (num_shards - 1) * bags * per_row
    elif sharding_type in ("row_wise", "table_row_wise"):
        inputs = ids * _ID_BYTES + num_shards * bags * _LENGTH_BYTES
        outputs = num_shards * vectors
    else:
        assert sharding_type == "table_wise", sharding_type
        inputs = ids * _ID_BYTES + bags * _LENGTH_BYTES
        outputs = vectors
    disk_rows = 0.0
    if placement == "ssd":
        if sharding_type == "data_parallel":
            disk_rows = world_size * expected_distinct_rows(table.num_embeddings, ids / world_size)
        else:
            per_copy = expected_distinct_rows(table.num_embeddings, ids)
            disk_rows = per_copy * (num_shards if sharding_type == "column_wise" else 1)
        disk_rows *= 1.0 - min(cache_rows / table.num_embeddings, 1.0)
    disk_seconds = disk_rows * ssd_seconds_per_row(constants, page_cache_hit=page_cache_hit)
    seconds = (
        compute / constants.lookup_bytes_per_s
        + (inputs + outputs) / constants.comm_bytes_per_s
        + num_shards * constants.collective_latency_s
        + disk_seconds
    )
    return TableCost(
        compute_bytes=compute,
        input_comm_bytes=inputs,
        output_comm_bytes=outputs,
        memory_bytes=table_memory_bytes(
            table,
            optimizer=optimizer,
            weights_precision=weights_precision,
            placement=placement,
            cache_rows=cache_rows,
        ),
        seconds=seconds,
        disk_rows=disk_rows,
        disk_seconds=disk_seconds,
    )


def save_constants(constants: CostConstants, path: str | Path) -> Path:
    """Writes ``constants`` as JSON to ``path`` (``~`` expanded, parents created)."""
    target = Path(path).expanduser()
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(asdict(constants), indent=2) + "\n")
    return target


def load_constants(path: str | Path) -> CostConstants:
    """Reads constants written by :func:`save_constants`.

    Raises:
        FileNotFoundError: if ``path`` does not exist.
        ValueError: if the file is not a constants JSON object.
    """
    target = Path(path).expanduser()
    data = json.loads(target.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{target}: cost constants must be a JSON object, got {data!r}")
    try:
        return CostConstants(**data)
    except TypeError as e:
        raise ValueError(f"{target}: not a cost constants file ({e})") from e


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


def _lookup_rate(sizes: list[tuple[int, int, int]], *, repeats: int, kernel: str) -> float:
    """fp32 bytes per second of a CPU TBE forward + backward (row-wise Adagrad) of ``kernel``."""
    import torch

    from raydlrm.sharding.kernel import TableSpec, build_tbe

    gen = torch.Generator().manual_seed(0)
    volumes, seconds = [], []
    for rows, dim, ids_per_step in sizes:
        tbe = build_tbe(
            kernel,
            tables=[TableSpec(rows, dim)],
            feature_table_map=[0],
            optimizer="rowwise_adagrad",
            learning_rate=0.01,
            eps=1e-8,
            pooling="sum",
            precision="fp32",
            device=torch.device("cpu"),
        )
        bags = max(ids_per_step // 8, 1)
        indices = torch.randint(0, rows, (bags * 8,), generator=gen)
        offsets = torch.arange(0, bags * 8 + 1, 8)

        def step(tbe=tbe, indices=indices, offsets=offsets) -> None:
            tbe(indices, offsets).sum().backward()

        volumes.append(float(bags * 8 * dim * _FP32_BYTES))
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


def calibrate(
    *,
    sizes: CalibrationSizes | None = None,
    comm: bool = True,
    ssd_directory: str | Path | None = None,
    kernel: str = "auto",
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

    Returns:
        The measured constants.

    Raises:
        TierError: ``ssd_directory`` cannot be written or lacks the space for the test file.
    """
    from raydlrm.sharding.kernel import resolve_kernel

    sizes = sizes or CalibrationSizes()
    resolved = resolve_kernel(kernel)
    measured = {
        "lookup_bytes_per_s": _lookup_rate(
            list(sizes.lookups), repeats=sizes.repeats, kernel=resolved
        )
    }
    notes = [f"calibrated {time.strftime('%Y-%m-%d %H:%M:%S')} on {os.uname().nodename}"]
    notes.append(f"lookups: {resolved} TBE fwd+bwd")
    if not comm:
        notes.append("comm constants are defaults (comm calibration skipped)")
    else:
        try:
            bandwidth, latency = _comm_constants(list(sizes.comm_bytes), repeats=sizes.repeats)
        except Exception as e:  # any failure to make a process group means: skip the comm part
            logger.warning("comm calibration skipped, no gloo process group: %s", e)
            notes.append(f"comm constants are defaults (no process group: {e})")
        else:
            measured.update(comm_bytes_per_s=bandwidth, collective_latency_s=latency)
            notes.append("comm: 2-process gloo all_to_all")
    if ssd_directory is None:
        notes.append("ssd constants are defaults (no ssd directory)")
    else:
        directory = Path(ssd_directory).expanduser()
        reads, writes = _ssd_rates(
            directory, file_bytes=sizes.ssd_file_bytes, pages=sizes.ssd_pages
        )
        measured.update(ssd_row_reads_per_s=reads, ssd_row_writes_per_s=writes)
        notes.append(f"ssd: random 4 KiB pages of a mapped file in {directory}")
    return replace(CostConstants(), **measured, source="; ".join(notes))
