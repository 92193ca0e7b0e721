"""Training progress on the driver: a progress bar in a terminal, plain log lines otherwise.

While ``trainer.fit()`` blocks, a thread on the driver reads the run's progress file, which the
workers' rank 0 writes every few seconds (samples, over all workers estimated from rank 0's,
and epoch: ``raydlrm.trainers.hooks.ProgressBeacon``), and the job's MLflow run, which the
workers' metrics reports reach through the Train controller (``raydlrm.platform.tracking``:
the last training loss, the exact sample count). A report is a barrier across the workers and
comes every ``training.log_every_steps``, maybe minutes apart; the file is a small write by one
worker, so the progress moves between reports. In a terminal (stderr is a TTY, or a notebook)
a ``rich`` progress bar shows the rate and time left; under ``ray job submit``, a scheduler
or a pipe one line every ``line_interval_s`` seconds when this job has trained something and
it moved. The samples shown count those restored from a checkpoint (a resume continues the
run's count); the line's samples/s count only the samples trained by this job, over the wall
time since training was launched (Ray Train's and the workers' start-up included; the
summary's throughput counts training steps only). ``run.progress`` chooses (``auto``, ``bar``,
``lines``, ``off``).

A resumed job continues its run's MLflow run, which holds the previous submission's last
metrics and worker failure: the metrics are read only once this job has changed them, and
only this submission's failures are told.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import threading
import time
from types import TracebackType
from typing import Any

import pyarrow.fs as pafs
from mlflow import MlflowClient

from raydlrm.platform.tracking import FAILURE_TAG

__all__ = ["TrainingProgress", "progress_mode"]

logger = logging.getLogger(__name__)

POLL_S = 2.0
LINE_INTERVAL_S = 15.0


def progress_mode(setting: str) -> str:
    """``bar``, ``lines`` or ``off`` for the ``run.progress`` setting."""
    if setting != "auto":
        return setting
    return "bar" if sys.stderr.isatty() or _in_notebook() else "lines"


def _in_notebook() -> bool:
    shell = sys.modules.get("IPython")
    if shell is None:
        return False
    ip = shell.get_ipython() if hasattr(shell, "get_ipython") else None
    return ip is not None and type(ip).__name__ == "ZMQInteractiveShell"


class TrainingProgress:
    """Polls a training run's MLflow metrics and shows its progress until closed.

    Args:
        client: the MLflow client of the run's tracking server.
        run_id: the job's run.
        total_samples: samples the job will train on (all epochs), or None when unknown.
        mode: ``bar``, ``lines`` or ``off``.
        progress_file: the run's progress file (its filesystem and path), or None.
        max_failures: ``run.max_failures`` (-1: no limit): the worker failures that Ray Train
            recovers from, each told in one line (the run's ``raydlrm.worker_failure`` tag).
        submission: this job's submission of the run (``raydlrm.submissions``): a failure
            recorded by another submission is not this job's to tell.
        poll_s: seconds between polls.
        line_interval_s: seconds between log lines in ``lines`` mode.
    """

    def __init__(
        self,
        client: MlflowClient,
        run_id: str,
        *,
        total_samples: int | None,
        mode: str,
        progress_file: tuple[pafs.FileSystem, str] | None = None,
        max_failures: int = 0,
        submission: int = 1,
        poll_s: float = POLL_S,
        line_interval_s: float = LINE_INTERVAL_S,
    ):
        self.client = client
        self.progress_file = progress_file
        self.run_id = run_id
        self.total = total_samples
        self.mode = mode
        self.poll_s = poll_s
        self.line_interval_s = line_interval_s
        self.max_failures = max_failures
        self.submission = submission
        self._failures_told = 0
        self._earlier: dict[str, float] = {}  # the run's metrics when this job started
        self.lines: list[str] = []
        """The lines logged in ``lines`` mode (for tests)."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._started = time.monotonic()
        self._last_line = -float("inf")
        self._last_samples = -1
        self._restored: int | None = None  # samples restored when this job started
        self._bar: Any = None
        self._task: Any = None

    def __enter__(self) -> TrainingProgress:
        if self.mode == "off":
            return self
        self._remove_stale_file()
        with contextlib.suppress(Exception):  # MLflow unreachable: none to set aside
            self._earlier = dict(self.client.get_run(self.run_id).data.metrics)
        if self.mode == "bar":
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self._bar = Progress(
                TextColumn("[bold]training[/bold] {task.fields[status]}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("samples"),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                transient=False,
            )
            self._bar.start()
            self._task = self._bar.add_task("training", total=self.total, status="starting")
        self._thread = threading.Thread(target=self._run, name="raydlrm-progress", daemon=True)
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout=10)
        self._poll(final=exc_type is None)
        if self._bar is not None:
            self._bar.stop()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self._poll(final=False)
            except Exception as exc:  # progress must never break training
                logger.debug("progress poll failed: %s", exc)

    def _remove_stale_file(self) -> None:
        """Removes the progress file a previous job of this run left (a resume): its samples
        and restored count are not this job's."""
        if self.progress_file is None:
            return
        filesystem, path = self.progress_file
        with contextlib.suppress(OSError, ValueError):  # none: a new run
            filesystem.delete_file(path)

    def _beacon(self) -> dict[str, Any]:
        """The workers' last progress record (empty before the first)."""
        if self.progress_file is None:
            return {}
        filesystem, path = self.progress_file
        try:
            with filesystem.open_input_stream(path) as f:
                return json.loads(f.read())
        except (OSError, ValueError):  # not written yet, or caught mid-write
            return {}

    def _poll(self, *, final: bool) -> None:
        try:
            data = self.client.get_run(self.run_id).data
            # A continued run's metrics are the previous submission's until this job reports.
            metrics = {k: v for k, v in data.metrics.items() if self._earlier.get(k) != v}
            self._tell_failure(data.tags.get(FAILURE_TAG))
        except Exception:
            metrics = {}
        beacon = self._beacon()
        estimate = int(beacon.get("samples", 0))
        if self.total:
            estimate = min(estimate, self.total)
        samples = max(int(metrics.get("samples_seen", 0)), estimate)
        epoch = int(max(metrics.get("epoch", 0), beacon.get("epoch") or 0))
        loss = metrics.get("train/loss")
        status = f"epoch {epoch}" + (f", loss {loss:.4f}" if loss is not None else "")
        if self._restored is None and "restored" in beacon:
            # The first record of this job: the count its workers restored. Workers that
            # restart after a failure restore samples this job trained; those stay counted.
            self._restored = int(beacon["restored"])
            if self._bar is not None:  # the time left from this job's rate, not the jump
                self._bar.reset(self._task, completed=self._restored, status=status)
        if self._bar is not None:
            self._bar.update(self._task, completed=samples, status=status)
            return
        self._line(samples, status=status, final=final)

    def _tell_failure(self, tag: str | None) -> None:
        """One warning line per worker failure of this submission that Ray Train recovers from
        (the last one, which ends the job, is the job's error)."""
        if tag is None:
            return
        record = json.loads(tag)
        if record.get("submission") != self.submission:  # an earlier submission's failure
            return
        failures = int(record["failures"])
        if failures <= self._failures_told:
            return
        self._failures_told = failures
        if 0 <= self.max_failures < failures:
            return
        limit = "" if self.max_failures < 0 else f" of run.max_failures = {self.max_failures}"
        start = record.get("checkpoint") or "the start of the run (no checkpoint yet)"
        message = (
            f"workers failed ({record.get('cause')}): restarting the workers from {start} "
            f"(failure {failures}{limit})"
        )
        self.lines.append(message)
        if self._bar is not None:
            self._bar.console.print(message, markup=False, highlight=False)
        else:
            logger.warning(message)

    def _line(self, samples: int, *, status: str, final: bool) -> None:
        """Logs a progress line when one is due and this job has trained samples since the
        last one."""
        trained = samples - (self._restored or 0)
        now = time.monotonic()
        moved = samples != self._last_samples and trained > 0
        if not moved or (now - self._last_line < self.line_interval_s and not final):
            return
        self._last_line, self._last_samples = now, samples
        elapsed = now - self._started
        done = f"{samples}/{self.total}" if self.total else str(samples)
        share = f" ({100 * samples / self.total:.1f}%)" if self.total else ""
        restored = f" ({self._restored} restored)" if self._restored else ""
        rate = trained / elapsed if elapsed > 0 else 0.0
        line = (
            f"training: {done} samples{share}{restored}, {status}, {rate:.0f} samples/s "
            f"since the start, {elapsed:.0f}s"
        )
        self.lines.append(line)
        logger.info(line)
