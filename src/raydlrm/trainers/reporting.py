"""Reporting metrics (and checkpoints) from every worker to the driver.

Every report goes through Ray Train's ``report`` (``raydlrm.trainers._ray``), a barrier across
the workers: every rank must report the same number of times. The last value of every metric
rides along with each report, so that a checkpoint-only report still carries the metric that
ranks checkpoints.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["Reporter"]

logger = logging.getLogger(__name__)

_OVERHEAD_REPORTS = 3
"""Metrics reports timed before the report overhead is judged (the first may wait for the
controller's start)."""

ReportFn = Callable[..., Any]
"""``report(metrics, checkpoint_dir=...)``: returns the stored checkpoint (or None)."""


class Reporter:
    """Reports a worker's metrics, with the loop's counters and the last value of each metric.

    Args:
        report: called as ``report(metrics, checkpoint_dir=...)`` on every rank.
        rank: this worker's rank (rank 0 logs a line per report).
        log_every_steps: the metrics cadence (named in the overhead warning).
    """

    def __init__(self, report: ReportFn, *, rank: int, log_every_steps: int) -> None:
        self._report = report
        self.rank = rank
        self.log_every_steps = log_every_steps
        self._last: dict[str, float] = {}
        self._seconds: list[float] = []  # wall time of each metrics-only report
        self._overhead_warned = False

    def note(self, metrics: dict[str, float]) -> None:
        """Metrics to carry in the next reports (e.g. where a run was restored from)."""
        self._last.update(metrics)

    def merged(self, metrics: dict[str, float], *, loop_state: dict[str, Any]) -> dict[str, Any]:
        """What a report of ``metrics`` sends: the last value of every metric, ``metrics``, and
        ``step``, ``epoch`` and ``samples_seen`` of ``loop_state``."""
        return {
            **self._last,
            **metrics,
            "step": loop_state["step"],
            "epoch": loop_state["epoch"],
            "samples_seen": loop_state["samples_seen"],
        }

    def report(
        self,
        metrics: dict[str, float],
        *,
        loop_state: dict[str, Any],
        checkpoint_dir: str | None = None,
        final: bool = False,
    ) -> Any:
        """Reports ``metrics`` with ``step``, ``epoch`` and ``samples_seen`` of ``loop_state``
        (and ``checkpoint_dir``, this rank's part of a checkpoint); returns what ``report``
        returns (the stored checkpoint)."""
        merged = self.merged(metrics, loop_state=loop_state)
        self._last.update(metrics)
        if self.rank == 0 and (checkpoint_dir is None or final or len(merged) > 3):
            shown = ", ".join(
                f"{k}={v:.4f}"
                for k, v in merged.items()
                if k in ("train/loss", "train/auc", "eval/auc", "eval/log_loss")
            )
            logger.info("step %d epoch %d: %s", merged["step"], merged["epoch"], shown)
        if checkpoint_dir is not None:
            return self._report(merged, checkpoint_dir=checkpoint_dir)
        started = time.perf_counter()
        self._report(merged, checkpoint_dir=None)
        self._check_overhead(time.perf_counter() - started, loop_state=loop_state)
        return None

    def _check_overhead(self, seconds: float, *, loop_state: dict[str, Any]) -> None:
        """Warns once (rank 0) when metrics reports dominate the run (each takes longer than
        the training between two of them): Ray Train's report is a barrier across workers that
        the controller releases when it next polls them (``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S``:
        Ray's default 2 s, 0.5 s on a local instance raydlrm starts), so a report every few
        fast steps makes the run mostly waiting. Names the ``log_every_steps`` that would keep
        reports under a tenth of the run."""
        self._seconds.append(seconds)
        if self._overhead_warned or len(self._seconds) < _OVERHEAD_REPORTS:
            return
        self._overhead_warned = True
        every = self.log_every_steps
        per_report = float(np.median(self._seconds))
        per_step = loop_state["train_seconds"] / max(loop_state["step"], 1)
        if self.rank != 0 or per_report <= every * per_step:
            return
        logger.warning(
            "metrics reports take %.2f s each (Ray Train's report is a barrier its controller "
            "releases when it polls the workers) against %.2f s of training between them (%d "
            "steps of %.3f s): raise training.log_every_steps to at least %d to keep reports "
            "under 10%% of the run",
            per_report,
            every * per_step,
            every,
            per_step,
            math.ceil(9 * per_report / max(per_step, 1e-6)),
        )
