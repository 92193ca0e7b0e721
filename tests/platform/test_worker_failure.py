"""The error of a run that a dead or hung worker ended: built from Ray Train's own exception
objects (as ``TorchTrainer.fit`` raises them), it names the rank, the process and host, why
the failure was fatal and the checkpoint a re-submission resumes from. (The Ray path itself:
``tests/platform/test_resume.py::test_kill_while_checkpointing_then_resubmit``.)"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.fs as pafs
from ray._raylet import ActorID
from ray.core.generated.common_pb2 import ActorDiedErrorContext
from ray.exceptions import ActorDiedError
from ray.train import ControllerError, WorkerGroupError
from ray.train.v2._internal.exceptions import (
    WorkerHealthCheckFailedError,
    WorkerHealthCheckTimeoutError,
)
from ray.train.v2._internal.execution.worker_group.worker import ActorMetadata, Worker

from raydlrm._errors import cause_line
from raydlrm.platform.worker_failure import WorkerDiedError, fatal_worker_failure

# Ray's words for a worker process that exited under it (os._exit, SIGKILL, the OOM killer).
_EXIT = (
    "The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR "
    "Worker exit detail: Worker unexpectedly exits with a connection error code 2. End of "
    "file. Some common causes include: (1) the process was killed by the OOM killer"
)


def _died(pid: int = 4711) -> ActorDiedError:
    """What ``ray.get`` raises for a call to a training worker whose process died."""
    context = ActorDiedErrorContext(
        class_name="RayTrainWorker",
        actor_id=ActorID.from_random().binary(),
        pid=pid,
        node_ip_address="10.0.0.5",
        error_message=_EXIT,
    )
    return ActorDiedError(context)


def _worker_info(pid: int = 4711) -> str:
    """Ray Train's ``Worker info:`` (the worker group's record of the worker)."""
    metadata = ActorMetadata(
        hostname="node-a", node_id="n1", node_ip="10.0.0.5", pid=pid, accelerator_ids={}
    )
    return repr(Worker(actor=None, metadata=metadata, resources={"CPU": 1.0}))


def _health_check_failed() -> WorkerHealthCheckFailedError:
    message = f"A worker health check failed.\nWorker info: {_worker_info()}"
    return WorkerHealthCheckFailedError(message, failure=_died())


def _run_directory(tmp_path: Path) -> Path:
    """A run with an intact checkpoint (step 9) and a newer one cut short (no state file)."""
    run = tmp_path / "runs" / "r"
    intact = run / "checkpoint_2026-11-28_10-00-09.000000"
    intact.mkdir(parents=True)
    (intact / "trainer_state.json").write_text(json.dumps({"step": 9}))
    (run / "checkpoint_2026-11-28_10-00-12.000000").mkdir()
    return run


def _fatal(error: BaseException, run: Path, *, max_failures: int = 0) -> WorkerDiedError | None:
    return fatal_worker_failure(
        error,
        max_failures=max_failures,
        run_directory=str(run),
        filesystem=pafs.LocalFileSystem(),
    )


def test_a_dead_worker_names_its_rank_process_why_and_the_checkpoint(tmp_path: Path) -> None:
    run = _run_directory(tmp_path)
    # Rank 1's process died; rank 0 failed in a collective with it.
    error = WorkerGroupError(
        "Training failed due to worker errors:\n...",
        {0: RuntimeError("Connection closed by peer"), 1: _health_check_failed()},
    )
    assert cause_line(error) == "WorkerHealthCheckFailedError: A worker health check failed."
    fatal = _fatal(error, run)
    assert isinstance(fatal, WorkerDiedError)
    assert str(fatal) == (
        "worker rank 1 (pid 4711 on 10.0.0.5) died (Ray: Worker unexpectedly exits with a "
        "connection error code 2); run.max_failures = 0 made it fatal (above 0, Ray Train "
        "restarts the workers from the latest checkpoint instead); submitting the same run "
        f"again (run.name, run.storage_path) resumes it from checkpoint "
        f"{run}/checkpoint_2026-11-28_10-00-09.000000"
    )
    # The command's one line (error: training failed: ...) is this one, whole.
    assert cause_line(fatal) == f"WorkerDiedError: {fatal}"
    used_up = _fatal(error, tmp_path / "none", max_failures=3)
    assert "run.max_failures = 3 made it fatal (its restarts were used up)" in str(used_up)
    assert str(used_up).endswith("starts it from the beginning (it has no intact checkpoint)")


def test_a_hung_worker_and_one_dead_at_start_are_told_as_such(tmp_path: Path) -> None:
    run = _run_directory(tmp_path)
    hanging = WorkerHealthCheckTimeoutError(
        "A worker health check has been hanging for 61.53 seconds. Marking the worker as "
        f"dead.\nWorker info: {_worker_info(pid=99)}"
    )
    fatal = _fatal(WorkerGroupError("...", {0: hanging}), run)
    assert str(fatal).startswith(
        "worker rank 0 (pid 99 on 10.0.0.5) hung (no answer to Ray Train's health checks for "
        "62 s); run.max_failures = 0 made it fatal"
    )
    # A worker that dies while Ray Train starts the worker group: a controller error, which
    # Ray Train never retries (the rank is not known there).
    fatal = _fatal(ControllerError(_died(pid=5)), run, max_failures=3)
    assert str(fatal).startswith(
        "a training worker (pid 5 on 10.0.0.5) died (Ray: Worker unexpectedly exits with a "
        "connection error code 2); Ray Train ends a run when a worker dies while it starts or "
        "stops the workers (run.max_failures counts failures during training); submitting"
    )


def test_a_workers_own_error_is_left_as_it_is(tmp_path: Path) -> None:
    """A Python exception in a worker is the job's error line as before (its cause_line)."""
    error = WorkerGroupError("...", {0: FloatingPointError("training diverged")})
    assert _fatal(error, tmp_path) is None
    assert _fatal(ControllerError(ValueError("a bad callback")), tmp_path) is None
