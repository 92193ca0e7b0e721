"""What a test session leaves behind on the machine, and removing it.

A session that leaves processes running (a Ray instance, a server, a kernel), network namespaces
or ``tc`` rules of the emulated hosts, or temporary files of its own slows every later run on
the machine, or fills its disk. ``tests/conftest.py`` marks every process of the session
through an environment variable that they all inherit (:data:`MARK`), takes a
:func:`snapshot` at the start, and at the end fails the run on what :func:`find` reports.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from raydlrm.storage import scratch_owner

__all__ = [
    "MARK",
    "Leftover",
    "Snapshot",
    "find",
    "multiprocessing_dirs",
    "other_sessions",
    "remove",
    "snapshot",
]

MARK = "RAYDLRM_TEST_SESSION"
"""The environment variable, set to a value of its own by each session, that its processes
inherit."""

# Temporary entries of this project's code and tests (the SSD tier's default directory stays,
# empty: it is shared by the runs of the machine).
_TMP_PREFIXES = ("raydlrm-", "rj-")
# multiprocessing's directories. Ray 2.60's dashboard serves its modules from a multiprocessing
# forkserver, which Ray kills when it stops, leaving its directory (a listening socket) behind:
# one per Ray instance with a dashboard. Removed, not counted against the session.
_MULTIPROCESSING_PREFIX = "pymp-"
_SHARED_TMP = "raydlrm-ssd"
_SHM = Path("/dev/shm")
_NAMESPACE_PREFIX = "rd"  # raydlrm._netem's namespaces
# Processes that exit with the test process itself, not before it.
_EXITS_WITH_PYTEST = ("multiprocessing.resource_tracker",)


@dataclass(frozen=True)
class Snapshot:
    """What the machine had before the session."""

    namespaces: frozenset[str]
    qdiscs: frozenset[str]
    tmp: frozenset[str]
    shm: frozenset[str]


@dataclass(frozen=True)
class Leftover:
    """One thing the session left behind."""

    kind: str
    """``process``, ``namespace``, ``qdisc`` or ``file``."""
    name: str
    pid: int | None = None

    def __str__(self) -> str:
        return f"{self.kind} {self.name}" + (f" (pid {self.pid})" if self.pid else "")


def _run(*argv: str) -> str:
    if shutil.which(argv[0]) is None:
        return ""
    done = subprocess.run(argv, capture_output=True, text=True)
    return done.stdout if done.returncode == 0 else ""


def _namespaces() -> frozenset[str]:
    return frozenset(
        line.split()[0]
        for line in _run("ip", "netns", "list").splitlines()
        if line.startswith(_NAMESPACE_PREFIX)
    )


def _qdiscs() -> frozenset[str]:
    """The machine's own queueing disciplines, without their reference counts."""
    return frozenset(
        line.split(" refcnt")[0].strip() for line in _run("tc", "qdisc", "show").splitlines()
    )


def _tmp() -> frozenset[str]:
    return frozenset(p.name for p in Path(tempfile.gettempdir()).iterdir())


def _shm() -> frozenset[str]:
    if not _SHM.is_dir():
        return frozenset()
    # Semaphores of live multiprocessing queues go with the test process.
    return frozenset(p.name for p in _SHM.iterdir() if not p.name.startswith("sem."))


def snapshot() -> Snapshot:
    """The namespaces, qdiscs and temporary entries the machine has now."""
    return Snapshot(namespaces=_namespaces(), qdiscs=_qdiscs(), tmp=_tmp(), shm=_shm())


def _marked_processes() -> list[psutil.Process]:
    """Running processes that inherited this session's mark, but the test process, its
    ancestors and what exits with it."""
    mark = os.environ[MARK]
    me = psutil.Process()
    skip = {me.pid, *(p.pid for p in me.parents())}
    found = []
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        if p.pid in skip or p.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        try:
            if p.environ().get(MARK) != mark:
                continue
        except (psutil.Error, OSError):
            continue
        if any(part in " ".join(p.info["cmdline"] or []) for part in _EXITS_WITH_PYTEST):
            continue
        found.append(p)
    return found


def _describe(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())[:160] or p.name()
    except psutil.Error:
        return "(exited)"


def other_sessions() -> list[int]:
    """The test processes (pytest) of other sessions running on the machine: those without
    this session's mark, other than this process and its parents. While one runs, what appears
    in the temporary directory, the namespaces or the qdiscs may be its own, so only this
    session's processes can be told apart.

    A session's main process shows no mark: its conftest sets it after the process started,
    and ``/proc/<pid>/environ`` keeps the environment a process started with. (Counting only
    marked ones missed every session started from a shell, and one session's end then deleted
    the checkpoint staging of another's running workers.)"""
    mark = os.environ[MARK]
    own = {os.getpid(), *(p.pid for p in psutil.Process().parents())}
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        if p.pid in own or "pytest" not in " ".join(p.info["cmdline"] or []):
            continue
        try:
            other = p.environ().get(MARK)
        except (psutil.Error, OSError):
            continue
        if other != mark:
            found.append(p.pid)
    return found


def find(before: Snapshot, *, wait_s: float = 30.0, alone: bool = True) -> list[Leftover]:
    """What the session left behind since ``before``; processes get ``wait_s`` seconds to
    exit (Ray's take a few after its shutdown). Not ``alone`` (another session ran beside
    it): its processes only."""
    deadline = time.monotonic() + wait_s
    while (processes := _marked_processes()) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = [Leftover("process", _describe(p), p.pid) for p in processes]
    if not alone:
        return left
    left += [Leftover("namespace", n) for n in sorted(_namespaces() - before.namespaces)]
    left += [Leftover("qdisc", q) for q in sorted(_qdiscs() - before.qdiscs)]
    tmp = Path(tempfile.gettempdir())
    for name in sorted(_tmp() - before.tmp):
        path = tmp / name
        if name == _SHARED_TMP and path.is_dir() and not any(path.iterdir()):
            continue
        if name.startswith(_TMP_PREFIXES) and not _running_elsewhere(name):
            left.append(Leftover("file", str(path)))
    left += [Leftover("file", str(_SHM / n)) for n in sorted(_shm() - before.shm)]
    return left


def _running_elsewhere(name: str) -> bool:
    """Whether ``name`` is the scratch directory (``raydlrm.storage.scratch_directory``) of a
    running process that is not this session's (a benchmark or a job beside the tests)."""
    pid = scratch_owner(name)
    if pid is None or pid == os.getpid():  # this process shows no mark (see other_sessions)
        return False
    try:
        return psutil.Process(pid).environ().get(MARK) != os.environ[MARK]
    except (psutil.Error, OSError):
        return False  # gone (then it is a leftover), or not ours to read


def multiprocessing_dirs(before: Snapshot) -> list[Path]:
    """multiprocessing's temporary directories made since ``before`` whose process is gone
    (see :data:`_MULTIPROCESSING_PREFIX`); this process's own goes when it exits."""
    tmp = Path(tempfile.gettempdir())
    own = multiprocessing.current_process()._config.get("tempdir")
    return [
        tmp / name
        for name in sorted(_tmp() - before.tmp)
        if name.startswith(_MULTIPROCESSING_PREFIX) and not (own and tmp / name == Path(own))
    ]


def remove(left: list[Leftover]) -> None:
    """Kills the processes and deletes the namespaces and files of ``left`` (a qdisc of the
    machine's own interfaces is reported, not removed: which rule to restore is unknown)."""
    for item in left:
        if item.kind == "process" and item.pid:
            with contextlib.suppress(psutil.Error):
                psutil.Process(item.pid).kill()
        elif item.kind == "namespace":
            _run("ip", "netns", "del", item.name)
        elif item.kind == "file":
            path = Path(item.name)
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
