"""Runs a function on N local processes joined by a gloo process group (the distributed tier).

``run_distributed(fn, world_size=N, args=...)`` spawns N processes, initializes a gloo process
group on a free loopback port in each, calls ``fn(rank, world_size, *args)`` and returns the
results in rank order. ``fn`` must be a module-level function (it is pickled by name). Results
travel back serialized with ``torch.save``, so they may hold tensors. If a rank raises, the other
ranks are stopped and a ``RuntimeError`` carrying every failing rank's traceback is raised. A
run whose port was taken by another process before the group could bind it (``EADDRINUSE``,
a race of picking a free port) is started again on another port, up to 3 times.
"""

from __future__ import annotations

import io
import multiprocessing
import os
import queue
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["run_distributed"]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    args: tuple[Any, ...],
    results: multiprocessing.Queue,
) -> None:
    torch.set_num_threads(1)
    os.environ["RAYDLRM_DEBUG"] = "1"
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
        )
        try:
            value = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        buffer = io.BytesIO()
        torch.save(value, buffer)
        results.put((rank, True, buffer.getvalue()))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def run_distributed(
    fn: Callable[..., Any],
    *,
    world_size: int,
    args: tuple[Any, ...] = (),
    timeout_s: float = 120.0,
) -> list[Any]:
    """Runs ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes.

    Args:
        fn: a module-level function.
        world_size: number of processes.
        args: extra arguments (picklable).
        timeout_s: time allowed for all ranks to finish.

    Returns:
        Each rank's return value, in rank order.

    Raises:
        RuntimeError: with the tracebacks of the failing ranks, or on timeout.
    """
    for _attempt in range(3):
        values, errors = _run_once(fn, world_size, args, timeout_s)
        # The free port was taken by another process before rank 0 bound it: try another.
        if errors and not values and any("EADDRINUSE" in tb for tb in errors.values()):
            continue
        break
    if errors:
        details = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
        raise RuntimeError(f"{len(errors)} of {world_size} ranks failed:\n{details}")
    return [values[r] for r in range(world_size)]


def _run_once(
    fn: Callable[..., Any], world_size: int, args: tuple[Any, ...], timeout_s: float
) -> tuple[dict[int, Any], dict[int, str]]:
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_worker, args=(fn, rank, world_size, port, args, results), daemon=True)
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    values: dict[int, Any] = {}
    errors: dict[int, str] = {}
    try:
        while len(values) + len(errors) < world_size:
            # After the first failure, the other ranks may hang in a collective: give them a
            # moment to report their own errors, then stop them.
            wait = 5.0 if errors else timeout_s
            try:
                rank, ok, payload = results.get(timeout=wait)
            except queue.Empty:
                if errors:
                    break
                raise RuntimeError(
                    f"distributed test timed out after {timeout_s}s; ranks finished: "
                    f"{sorted(values)}"
                ) from None
            if ok:
                values[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                errors[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=5.0 if not errors else 0.5)
            if p.is_alive():
                p.terminate()
                p.join()
    return values, errors
