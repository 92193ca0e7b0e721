"""One job per run: a lock in the run's storage directory, held while the job runs.

Two jobs with the same ``run.name`` and ``run.storage_path`` would train side by side into one
run directory (checkpoints interleaved) and one MLflow run. The first to start writes
``<run.storage_path>/<run>/.raydlrm-run-lock.json`` (who holds it: host, pid, start, a random
token) and refreshes its heartbeat every :data:`HEARTBEAT_S` seconds from a thread; a second
job finds a live lock and stops at once, naming the run and its holder. A holder that died
leaves its lock behind, which is then taken over: at once on the same host (its pid is gone),
after :data:`STALE_AFTER_S` seconds without a heartbeat elsewhere.

On local storage the lock file is created atomically (``O_EXCL``). An object store has no
atomic create here, so the lock is written, then read back after :data:`SETTLE_S` seconds: of
two jobs that start within that time, the one whose write landed last proceeds. A holder that
finds another token in its lock at a heartbeat (it lost the lock) logs an error.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass

import pyarrow as pa
import pyarrow.fs as pafs

from raydlrm.platform.config import ConfigError, JobConfig
from raydlrm.platform.preflight import run_storage

__all__ = [
    "HEARTBEAT_S",
    "LOCK_FILE",
    "STALE_AFTER_S",
    "LockHolder",
    "RunLock",
    "RunLockedError",
    "run_lock",
]

logger = logging.getLogger(__name__)

LOCK_FILE = ".raydlrm-run-lock.json"
HEARTBEAT_S = 10.0
"""How often the holder refreshes its lock."""
STALE_AFTER_S = 60.0
"""A lock whose heartbeat is older than this is taken over (a holder on another host)."""
SETTLE_S = 0.5
"""Between writing a lock to an object store and reading it back."""


class RunLockedError(ConfigError):
    """Another job holds the run's lock."""


@dataclass(frozen=True)
class LockHolder:
    """Who holds a run's lock."""

    token: str
    host: str
    pid: int
    started: float
    heartbeat: float

    def is_stale(self, now: float) -> bool:
        """The holder is gone: its process on this host has ended, or it has not refreshed
        the lock for :data:`STALE_AFTER_S` seconds."""
        if self.host == socket.gethostname() and not _pid_alive(self.pid):
            return True
        return now - self.heartbeat > STALE_AFTER_S

    def describe(self, now: float) -> str:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return (
            f"pid {self.pid} on {self.host}, running since {started}, last heartbeat "
            f"{max(now - self.heartbeat, 0):.0f} s ago"
        )


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


class RunLock:
    """The lock of one run, as a context manager (see the module docstring).

    Args:
        filesystem: the run storage's filesystem.
        directory: the run's directory on it.
        run_name: the run (for messages).
    """

    def __init__(self, filesystem: pafs.FileSystem, directory: str, *, run_name: str) -> None:
        self.filesystem = filesystem
        self.path = f"{directory.rstrip('/')}/{LOCK_FILE}"
        self.run_name = run_name
        self.local = isinstance(filesystem, pafs.LocalFileSystem)
        self.holder = LockHolder(
            token=uuid.uuid4().hex,
            host=socket.gethostname(),
            pid=os.getpid(),
            started=time.time(),
            heartbeat=time.time(),
        )
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *_: object) -> None:
        self.release()

    def acquire(self) -> None:
        """Takes the lock (or a dead holder's) and starts the heartbeat.

        Raises:
            RunLockedError: a live job holds it, named.
        """
        current = self.read()
        if current is not None:
            if not current.is_stale(time.time()):
                raise self._locked(current)
            logger.warning(
                "run %s: taking over the lock of a job that is gone (%s)",
                self.run_name,
                current.describe(time.time()),
            )
            self.filesystem.delete_file(self.path)
        self._write(self.holder, exclusive=True)
        if not self.local:
            time.sleep(SETTLE_S)
            winner = self.read()
            if winner is None or winner.token != self.holder.token:
                raise self._locked(winner or self.holder)
        self._thread = threading.Thread(target=self._beat, name="raydlrm-run-lock", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Stops the heartbeat and removes the lock if it is still this job's."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        current = self.read()
        if current is not None and current.token == self.holder.token:
            self.filesystem.delete_file(self.path)

    def read(self) -> LockHolder | None:
        """The lock's holder, or None when there is no lock (or an unreadable one, taken as
        none: a write that was cut short)."""
        try:
            with self.filesystem.open_input_stream(self.path) as f:
                return LockHolder(**json.loads(f.read()))
        except FileNotFoundError:
            return None
        except (ValueError, TypeError, OSError, pa.ArrowException) as exc:
            logger.warning(
                "run %s: ignoring the unreadable lock %s (%s)", self.run_name, self.path, exc
            )
            return None

    def _write(self, holder: LockHolder, *, exclusive: bool = False) -> None:
        data = json.dumps(asdict(holder)).encode()
        if self.local and exclusive:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:  # another job created it since it was read
                raise self._locked(self.read() or holder) from None
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            return
        self.filesystem.create_dir(self.path.rsplit("/", 1)[0], recursive=True)
        with self.filesystem.open_output_stream(self.path) as f:
            f.write(data)

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            current = self.read()
            if current is not None and current.token != self.holder.token:
                logger.error(
                    "run %s: its lock %s was taken by another job (%s); two jobs now write this "
                    "run",
                    self.run_name,
                    self.path,
                    current.describe(time.time()),
                )
                return
            self.holder = LockHolder(**{**asdict(self.holder), "heartbeat": time.time()})
            try:
                self._write(self.holder)
            except (OSError, pa.ArrowException) as exc:  # the next beat tries again
                logger.warning("run %s: could not refresh its lock: %s", self.run_name, exc)

    def _locked(self, holder: LockHolder) -> RunLockedError:
        return RunLockedError(
            f"run {self.run_name} is already running: its lock {self.path} is held by "
            f"{holder.describe(time.time())}; wait for that job to end, or give this one "
            "another run.name (a lock whose holder died is taken over: at once on the same "
            f"host, after {STALE_AFTER_S:.0f} s without a heartbeat elsewhere)"
        )


def run_lock(job: JobConfig, run_name: str) -> RunLock:
    """The lock of the job's run in its ``run.storage_path``."""
    root, filesystem = run_storage(job)
    return RunLock(
        filesystem or pafs.LocalFileSystem(), f"{root.rstrip('/')}/{run_name}", run_name=run_name
    )
