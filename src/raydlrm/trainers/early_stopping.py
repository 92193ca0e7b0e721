"""Early stopping: the state that decides when training stops (``[training.early_stopping]``).

:class:`EarlyStopping` watches one validation metric over the evaluations of a run: the best
value and its step, and how many evaluations in a row have not improved on it by more than
``min_delta``. When that count reaches ``patience`` the run is stopped at that evaluation's step.
It is plain state (no tensors, no collectives: every rank sees the same metrics, computed over
all ranks), saved with every checkpoint's loop state, so a killed run resumes with its best
value, its best checkpoint and its patience counter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from raydlrm.trainers.config import EarlyStoppingConfig

__all__ = ["EarlyStopping"]


@dataclass
class EarlyStopping:
    """Where the watched metric peaked and whether to stop (see the module docstring).

    Attributes:
        config: the metric, its direction, patience and minimum change.
        best: the best value so far (None: no evaluation yet).
        best_step: the step of the best evaluation.
        bad: evaluations in a row without improvement.
        stopped_step: the step training stopped at (None: not stopped).
        best_checkpoint: where the best evaluation's checkpoint is stored (its path in the run
            storage), once known.
    """

    config: EarlyStoppingConfig
    best: float | None = None
    best_step: int | None = None
    bad: int = 0
    stopped_step: int | None = None
    best_checkpoint: str | None = None

    @property
    def stopped(self) -> bool:
        return self.stopped_step is not None

    def update(self, metrics: dict[str, Any], *, step: int) -> bool:
        """Takes an evaluation's metrics at ``step``; returns whether it is the new best. A
        value that is not a number (a diverged model's NaN) never improves."""
        value = float(metrics[self.config.metric])
        sign = 1.0 if self.config.better() == "max" else -1.0
        improved = not math.isnan(value) and (
            self.best is None or sign * (value - self.best) > self.config.min_delta
        )
        if improved:
            self.best, self.best_step, self.bad = value, step, 0
            self.best_checkpoint = None  # this evaluation's checkpoint is not stored yet
            return True
        self.bad += 1
        if self.bad >= self.config.patience:
            self.stopped_step = step
        return False

    def metrics(self) -> dict[str, float]:
        """``early_stopping/best_step``, ``early_stopping/best`` (the watched metric's best
        value), ``early_stopping/stopped_step`` once stopped."""
        out: dict[str, float] = {}
        if self.best_step is not None and self.best is not None:
            out["early_stopping/best_step"] = float(self.best_step)
            out["early_stopping/best"] = self.best
        if self.stopped_step is not None:
            out["early_stopping/stopped_step"] = float(self.stopped_step)
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            "best": self.best,
            "best_step": self.best_step,
            "bad": self.bad,
            "stopped_step": self.stopped_step,
            "best_checkpoint": self.best_checkpoint,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores :meth:`state_dict` (an empty dict: a fresh start)."""
        self.best = state.get("best")
        self.best_step = state.get("best_step")
        self.bad = int(state.get("bad", 0))
        self.stopped_step = state.get("stopped_step")
        self.best_checkpoint = state.get("best_checkpoint")
