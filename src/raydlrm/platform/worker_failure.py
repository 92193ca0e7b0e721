"""What a job says when a dead or hung training worker ends it.

Ray Train ends a run when a worker's process dies or stops answering its health checks more
often than ``run.max_failures`` allows (a ``WorkerGroupError`` holding, per rank, a
``WorkerHealthCheckFailedError`` or ``WorkerHealthCheckTimeoutError``), and when a worker dies
while Ray Train starts or stops the worker group (a ``ControllerError`` around an
``ActorDiedError``), which it never retries. Its own message, "A worker health check failed.",
names neither the rank nor what to do. :func:`fatal_worker_failure` says it in one line: the
rank, its process and host as Ray recorded them, what Ray said of the death, why the run ended,
and the checkpoint that a submission of the same run resumes from.

A worker that failed with a Python exception is not this module's: the job's error line is
that exception's (:func:`raydlrm._errors.cause_line`).
"""

from __future__ import annotations

import logging
import re

import pyarrow.fs as pafs
from ray.exceptions import RayActorError
from ray.train import WorkerGroupError
from ray.train.v2._internal.exceptions import (
    WorkerHealthCheckFailedError,
    WorkerHealthCheckTimeoutError,
)

from raydlrm.storage import with_scheme
from raydlrm.trainers.checkpoints import newest_intact_path

__all__ = ["WorkerDiedError", "fatal_worker_failure"]

logger = logging.getLogger(__name__)


class WorkerDiedError(RuntimeError):
    """A training worker's process died or hung, and the run ended; the message names the
    rank and process, why the run ended and what a re-submission resumes from. The error Ray
    Train raised is its ``__cause__``."""


# In Ray's texts of a worker: its ActorMetadata (``pid=4711``, ``node_ip='10.0.0.5'``) and an
# ActorDiedError (``\tpid: 4711``, ``\tip: 10.0.0.5``, ``Worker exit detail: ...``).
_PID = re.compile(r"\bpid(?:=|: )(\d+)")
_HOST = re.compile(r"(?:\bnode_ip=['\"]|\bip: )([^'\"\s,]+)")
_EXIT_DETAIL = re.compile(r"Worker exit detail: (.+?)(?:\.\s|\.?$)", re.MULTILINE)
_HUNG_FOR = re.compile(r"hanging for ([\d.]+) seconds")


def _deaths(error: BaseException) -> tuple[dict[int | None, BaseException], bool]:
    """The dead or hung workers' errors by rank (None: unknown), and whether Ray Train counted
    the failure against ``run.max_failures`` (a worker group error) or never retries it."""
    if isinstance(error, WorkerGroupError):
        dead = (WorkerHealthCheckFailedError, WorkerHealthCheckTimeoutError)
        failures = error.worker_failures.items()
        return {rank: e for rank, e in sorted(failures) if isinstance(e, dead)}, True
    cause = getattr(error, "controller_failure", None)
    if isinstance(cause, RayActorError) and "RayTrainWorker" in str(cause):
        return {None: cause}, False
    return {}, False


def _worker(rank: int | None, error: BaseException) -> str:
    """``worker rank 1 (pid 4711 on 10.0.0.5) died (<Ray's exit detail>)``, from Ray's text of
    the worker's error (what it does not give is left out)."""
    text = str(error)
    pid, host = _PID.search(text), _HOST.search(text)
    where = " ".join(
        ([f"pid {pid.group(1)}"] if pid else []) + ([f"on {host.group(1)}"] if host else [])
    )
    who = f"worker rank {rank}" if rank is not None else "a training worker"
    who += f" ({where})" if where else ""
    if isinstance(error, WorkerHealthCheckTimeoutError):
        hung = _HUNG_FOR.search(text)
        seconds = f" for {float(hung.group(1)):.0f} s" if hung else ""
        return f"{who} hung (no answer to Ray Train's health checks{seconds})"
    detail = _EXIT_DETAIL.search(text)
    cause = getattr(error, "health_check_failure", error)
    said = (detail.group(1) if detail else next(iter(str(cause).splitlines()), "")).strip()
    return f"{who} died" + (f" (Ray: {said})" if said else "")


def _resumes_from(run_directory: str, filesystem: pafs.FileSystem, scheme: str | None) -> str:
    """Where a submission of the same run starts: the newest intact checkpoint, as the
    workers choose it, or the start."""
    try:
        path = newest_intact_path(filesystem, run_directory)
    except Exception as exc:  # the message must not fail; the storage may be the trouble
        logger.debug("could not list the checkpoints of %s: %s", run_directory, exc)
        return f"resumes it from its newest intact checkpoint under {run_directory}"
    if path is None:
        return "starts it from the beginning (it has no intact checkpoint)"
    return f"resumes it from checkpoint {with_scheme(path, scheme)}"


def fatal_worker_failure(
    error: BaseException,
    *,
    max_failures: int,
    run_directory: str,
    filesystem: pafs.FileSystem,
    scheme: str | None = None,
) -> WorkerDiedError | None:
    """The one-line error for a run that a dead or hung worker ended, or None when ``error``
    is not one (a worker's Python exception, a controller error of another kind).

    Args:
        error: what ``TorchTrainer.fit`` raised.
        max_failures: ``run.max_failures`` of the job.
        run_directory: the run's directory (its checkpoints), on ``filesystem``.
        filesystem: the run storage's filesystem.
        scheme: the run storage's URI scheme (``s3``) when it is remote, for the path shown.
    """
    deaths, counted = _deaths(error)
    if not deaths:
        return None
    workers = "; ".join(_worker(rank, e) for rank, e in deaths.items())
    if not counted:
        why = (
            "Ray Train ends a run when a worker dies while it starts or stops the workers "
            "(run.max_failures counts failures during training)"
        )
    elif max_failures == 0:
        why = (
            "run.max_failures = 0 made it fatal (above 0, Ray Train restarts the workers from "
            "the latest checkpoint instead)"
        )
    else:
        why = f"run.max_failures = {max_failures} made it fatal (its restarts were used up)"
    resume = _resumes_from(run_directory.rstrip("/"), filesystem, scheme)
    return WorkerDiedError(
        f"{workers}; {why}; submitting the same run again (run.name, run.storage_path) {resume}"
    )
