"""Tears down a local Ray instance when the driver that started it dies.

``ray.init()`` without an address starts a Ray instance whose processes are the driver's
descendants: GCS, raylet, dashboard, log monitor, workers, and the raylet's dashboard and
runtime-env agents. A driver that exits normally shuts them down; a SIGKILLed (or OOM-killed)
driver does not. Most of them notice within seconds, but the two agents, which see their raylet
die at once, hang in their shutdown for about a minute, and on a machine whose ``init`` does not
reap orphans they stay behind as zombies (measured on this project's CI machine).

:func:`start` runs this file as a small watcher process (only the standard library and
``psutil``; run by path so that it imports neither raydlrm nor Ray nor torch). Once a second it
records the driver's descendants; when the driver is gone it gives Ray ``GRACE_S`` to stop by
itself, then terminates (and after ``GRACE_S`` more, kills) every recorded process still
running, with their descendants, and exits. ``psutil`` compares each process's start time, so a
PID reused by an unrelated process is never signalled. The watcher starts in its own session:
a Ctrl-C in the driver's terminal reaches the driver, not the watcher.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterable

import psutil

POLL_S = 1.0
GRACE_S = 2.0

_started_for: int | None = None


def start() -> None:
    """Starts the watcher for this process (once per process; a no-op afterwards)."""
    global _started_for
    if _started_for == os.getpid():
        return
    subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), str(os.getpid())],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        close_fds=True,
    )
    _started_for = os.getpid()


def _running(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _descendants(process: psutil.Process) -> list[psutil.Process]:
    try:
        return process.children(recursive=True)
    except psutil.Error:
        return []


def watch(driver_pid: int) -> None:
    """Returns once the driver has died and its recorded descendants are stopped."""
    try:
        driver = psutil.Process(driver_pid)
    except psutil.NoSuchProcess:
        return
    me = os.getpid()
    seen: dict[int, psutil.Process] = {}
    while _running(driver):
        for process in _descendants(driver):
            if process.pid != me and process.pid not in seen:
                seen[process.pid] = process
        time.sleep(POLL_S)
    time.sleep(GRACE_S)
    # Processes started since the last look are children of those already seen.
    left = {p.pid: p for p in seen.values() if _running(p)}
    for process in list(left.values()):
        left.update({p.pid: p for p in _descendants(process) if p.pid != me})
    stop(p for p in left.values() if _running(p))


def stop(processes: Iterable[psutil.Process], *, grace_s: float = GRACE_S) -> None:
    """Terminates ``processes``, then kills those still running after ``grace_s``."""
    processes = list(processes)
    for process in processes:
        with contextlib.suppress(psutil.Error):
            process.terminate()
    _, alive = psutil.wait_procs(processes, timeout=grace_s)
    for process in alive:
        with contextlib.suppress(psutil.Error):
            process.kill()


if __name__ == "__main__":
    watch(int(sys.argv[1]))
