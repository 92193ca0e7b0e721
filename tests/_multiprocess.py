"""Runs a function on N local processes joined by a gloo process group (the distributed tier).

``run_distributed(fn, world_size=N, args=...)`` runs ``fn(rank, world_size, *args)`` on N
processes, each in a gloo process group on a free loopback port, and returns the results in rank
order. ``fn`` must be a module-level function (it is pickled by name). Results travel back
serialized with ``torch.save``, so they may hold tensors. If a rank raises, the other ranks are
stopped and a ``RuntimeError`` carrying every failing rank's traceback is raised. A run whose
port was taken by another process before the group could bind it (``EADDRINUSE``, a race of
picking a free port) or could not form is started again on another port, up to 3 times.

The processes are spawned once per world size and kept for the session (spawning one costs
seconds: it imports torch, fbgemm and the test module; the suite runs about 25 such calls):
each call makes a new process group and destroys it after, and restores the process's initial
torch RNG state before ``fn`` runs, so a call sees what a fresh process would. A pool in which a
rank failed, died or timed out is discarded (its processes may hang in a collective) and the next
call spawns a new one.
"""

from __future__ import annotations

import io
import multiprocessing
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["close_pools", "run_distributed"]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_INIT_FAILED = "init_process_group failed: "


def _serve(rank: int, world_size: int, tasks: Any, results: Any) -> None:
    """A pool process: runs the tasks it is sent until it gets None."""
    torch.set_num_threads(1)
    os.environ["RAYDLRM_DEBUG"] = "1"
    initial_rng = torch.get_rng_state()
    while True:
        task = tasks.get()
        if task is None:
            return
        call, fn, port, args = task
        try:
            dist.init_process_group(
                "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
            )
        except BaseException:
            results.put((call, rank, False, _INIT_FAILED + traceback.format_exc()))
            continue
        try:
            torch.set_rng_state(initial_rng)
            try:
                value = fn(rank, world_size, *args)
            finally:
                dist.destroy_process_group()
            buffer = io.BytesIO()
            torch.save(value, buffer)
            results.put((call, rank, True, buffer.getvalue()))
        except BaseException:
            results.put((call, rank, False, traceback.format_exc()))


class _Pool:
    def __init__(self, world_size: int):
        ctx = multiprocessing.get_context("spawn")
        self.world_size = world_size
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        self.procs = [
            ctx.Process(
                target=_serve, args=(rank, world_size, self.tasks[rank], self.results), daemon=True
            )
            for rank in range(world_size)
        ]
        for p in self.procs:
            p.start()
        self.calls = 0

    def run(
        self, fn: Callable[..., Any], args: tuple[Any, ...], timeout_s: float
    ) -> tuple[dict[int, Any], dict[int, str], bool]:
        """Each rank's value and error; the last item says whether the pool can be reused."""
        self.calls += 1
        port = _free_port()
        for rank in range(self.world_size):
            self.tasks[rank].put((self.calls, fn, port, args))
        values: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout_s
        first_error = float("inf")  # when the first rank failed
        while len(values) + len(errors) < self.world_size:
            try:
                call, rank, ok, payload = self.results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
                now = time.monotonic()
                if errors and now > first_error + 5.0:
                    break  # the other ranks hang in a collective: stop them
                if dead and not errors:
                    for r in dead:
                        errors[r] = f"rank {r} died (exit code {self.procs[r].exitcode})"
                    first_error = now
                elif now > deadline:
                    raise RuntimeError(
                        f"distributed test timed out after {timeout_s}s; ranks finished: "
                        f"{sorted(values)}"
                    ) from None
                continue
            if call != self.calls:
                continue  # a late answer of an earlier, failed call
            if ok:
                values[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                if not errors:
                    first_error = time.monotonic()
                errors[rank] = payload
        return values, errors, not errors

    def close(self) -> None:
        """Asks idle processes to stop (they exit cleanly, removing their temporary files);
        terminates those that do not within seconds (a rank stuck in a collective)."""
        for tasks, p in zip(self.tasks, self.procs, strict=True):
            if p.is_alive():
                tasks.put(None)
        for p in self.procs:
            p.join(timeout=5.0)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5.0)
        for q in (*self.tasks, self.results):
            q.close()
            q.join_thread()


_pools: dict[int, _Pool] = {}


def close_pools() -> None:
    """Stops every pool's processes (at the end of the session)."""
    while _pools:
        _pools.popitem()[1].close()


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
        pool = _pools.get(world_size)
        if pool is None or not all(p.is_alive() for p in pool.procs):
            pool = _pools[world_size] = _Pool(world_size)
        try:
            values, errors, reusable = pool.run(fn, args, timeout_s)
        except BaseException:
            _pools.pop(world_size).close()
            raise
        if not reusable:
            _pools.pop(world_size).close()
        # The group could not form (its free port taken by another process before rank 0 bound
        # it, a peer of a discarded pool still closing): try again on another port.
        if errors and not values and all(tb.startswith(_INIT_FAILED) for tb in errors.values()):
            continue
        break
    if errors:
        details = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
        raise RuntimeError(f"{len(errors)} of {world_size} ranks failed:\n{details}")
    return [values[r] for r in range(world_size)]
