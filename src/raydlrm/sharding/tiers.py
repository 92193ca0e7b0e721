"""Memory tiers of a worker's embedding tables: ``dram``, on CPU workers ``ssd``, and on GPU
workers ``host`` (rows in the host's page-locked memory behind a GPU row cache,
:func:`host_buffer`).

An ``ssd`` table's weights live in a file on the worker's local disk, memory-mapped shared:
fbgemm's TBE reads and updates them in place (its CPU kernels take the host weights as one
flat buffer, and since fbgemm 1.8 the constructor accepts that buffer preallocated:
``preallocated_host_buffers``), the operating system's page cache keeps the hot rows in DRAM
and writes the updated ones back, and the rest stays on disk. Nothing is copied and no kernel
changes: a mapped buffer is an ordinary tensor to fbgemm, to the checkpoint code (which reads
the table views) and to resuming (which writes into them), so checkpoints hold the rows, never
a path.

Optimizer state: row-wise Adagrad's one float per row stays in DRAM (4 bytes per row against
``4 * dim`` of weights: 1/16 of a 64-dim fp32 table; it is touched for every looked-up row,
and keeping it apart costs nothing). Adagrad's per-weight state is as large as the weights and
goes to disk beside them.

The file's blocks are allocated up front (``posix_fallocate``), so a disk too small fails when
the table is built, naming it, instead of as a bus error in the middle of training when the
page cache writes back a row with nowhere to go. The file is unlinked as soon as it is mapped:
its space is freed when the worker exits, however it exits, and nothing is left behind.
"""

from __future__ import annotations

import ctypes
import functools
import os
import resource
import shutil
import tempfile
import weakref
from pathlib import Path

import numpy as np
import torch

from raydlrm.sharding.plan import format_bytes

__all__ = [
    "TierError",
    "check_space",
    "host_buffer",
    "major_page_faults",
    "mapped_buffer",
    "resident_bytes",
    "ssd_directory",
]


class TierError(ValueError):
    """A table's tier cannot be set up: an unknown or unavailable tier, a directory that cannot
    be written, a disk too small. The message names the tables and the path."""


def host_buffer(numel: int, dtype: torch.dtype, *, pinned: bool) -> torch.Tensor:
    """A flat zeroed buffer in the host's memory, page-locked when ``pinned`` (a GPU worker's
    ``host`` tables, copied to and from the GPU): registered with CUDA in place
    (``cudaHostRegister``) rather than taken from torch's pinned-memory allocator, which rounds
    each allocation up to a power of two (a 20 GiB table would lock 32 GiB, beyond what the
    planner counts); unregistered when the buffer (and every view of it) is gone."""
    buffer = torch.zeros(numel, dtype=dtype)
    if not pinned or not numel:
        return buffer
    cudart = torch.cuda.cudart()
    pointer, nbytes = buffer.data_ptr(), buffer.numel() * buffer.element_size()
    error = cudart.cudaHostRegister(pointer, nbytes, 0)
    if int(error) != 0:
        raise TierError(
            f"cannot page-lock {format_bytes(nbytes)} of host memory for a 'host' table "
            f"(cudaHostRegister error {int(error)}): lower sharding.host_memory_bytes, or the "
            "tables' placement 'host'"
        )
    weakref.finalize(buffer, cudart.cudaHostUnregister, pointer)
    return buffer


def ssd_directory(ssd_path: str | None) -> Path:
    """Where the ``ssd`` tables' files go: ``sharding.ssd_path``, else ``raydlrm-ssd`` in this
    process's temporary directory."""
    if ssd_path:
        return Path(ssd_path).expanduser()
    return Path(tempfile.gettempdir(), "raydlrm-ssd")


def check_space(directory: Path, nbytes: int, *, tables: list[str]) -> None:
    """Checks that ``directory`` can be created and written and has ``nbytes`` free.

    Raises:
        TierError: naming ``tables``, the directory (``sharding.ssd_path``) and the shortfall.
    """
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as exc:
        raise TierError(
            f"ssd tables {tables}: cannot write to {directory} (sharding.ssd_path): {exc}"
        ) from None
    free = shutil.disk_usage(directory).free
    if nbytes > free:
        raise TierError(
            f"ssd tables {tables} need {format_bytes(nbytes)} on {directory} "
            f"(sharding.ssd_path) but {format_bytes(free)} are free there"
        )


def mapped_buffer(
    directory: Path, numel: int, dtype: torch.dtype, *, tables: list[str]
) -> torch.Tensor:
    """A 1-D tensor of ``numel`` zeros backed by a new file in ``directory``, mapped shared
    (writes go to the file through the page cache), its blocks allocated, the file unlinked.

    Raises:
        TierError: the directory cannot be written, or has too little space (naming
            ``tables`` and the directory).
    """
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    check_space(directory, nbytes, tables=tables)
    fd, path = tempfile.mkstemp(prefix="raydlrm-ssd-", suffix=".bin", dir=directory)
    try:
        os.posix_fallocate(fd, 0, max(nbytes, 1))
        return torch.from_file(path, shared=True, size=numel, dtype=dtype)
    except OSError as exc:  # e.g. the disk filled up since the check
        raise TierError(
            f"ssd tables {tables}: cannot allocate {format_bytes(nbytes)} in {directory} "
            f"(sharding.ssd_path): {exc}"
        ) from None
    finally:
        os.close(fd)
        os.unlink(path)


@functools.cache
def _mincore() -> ctypes._CFuncPtr:
    libc = ctypes.CDLL(None, use_errno=True)
    fn = libc.mincore
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    fn.restype = ctypes.c_int
    return fn


def resident_bytes(tensor: torch.Tensor) -> int:
    """Bytes of ``tensor`` (contiguous, on CPU) in DRAM now: its memory pages that are resident
    (``mincore(2)``; for a mapped table, the rows the page cache holds), counted in whole
    pages, at most the tensor's size.

    Raises:
        OSError: ``mincore`` failed (with its errno).
    """
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return 0
    page = os.sysconf("SC_PAGE_SIZE")
    start = tensor.data_ptr() // page * page
    length = tensor.data_ptr() + nbytes - start
    pages = -(-length // page)
    vector = (ctypes.c_ubyte * pages)()
    if _mincore()(start, length, vector) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mincore: {os.strerror(errno)}")
    resident = int(np.count_nonzero(np.frombuffer(vector, dtype=np.uint8) & 1))
    return min(resident * page, nbytes)


def major_page_faults() -> int:
    """Major page faults of this process so far: pages it had to wait for from disk (for a
    worker with ``ssd`` tables, mostly rows the page cache did not hold)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_majflt
