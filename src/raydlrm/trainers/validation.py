"""Evaluations on the validation set, and the early stopping they drive.

:class:`Validation` evaluates the model on the validation set (``data.valid_path`` or
``data.valid_split``; reported as ``valid/*`` with ``valid/step``) every
``training.valid_every_steps`` steps, or at each epoch's end when that is 0, and once more at
the end of training when the last evaluation was earlier. With ``[training.early_stopping]``
each evaluation updates :class:`~raydlrm.trainers.early_stopping.EarlyStopping`: an improvement
is checkpointed by the loop (:meth:`Validation.stored` records where) and kept by retention; the
run stops when the patience is spent; and the run ends with the best checkpoint's weights
(:meth:`Validation.best_checkpoint`), which the final checkpoint (the model) then holds and the
final evaluation on ``data.eval_path`` scores. Its state travels in every checkpoint's loop
state, so a killed run resumes with its best checkpoint and patience counter.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from raydlrm.trainers.config import TrainingConfig
from raydlrm.trainers.early_stopping import EarlyStopping
from raydlrm.trainers.evaluation import VALID_STEP, Evaluator

__all__ = ["Validation"]

logger = logging.getLogger(__name__)


class Validation:
    """The validation set's evaluations for one worker's loop (see the module docstring).

    Args:
        evaluator: evaluates on the validation set (``valid/`` metrics; its data None: no
            validation set, and this does nothing).
        config: ``training.valid_every_steps`` and ``training.early_stopping``.
    """

    def __init__(self, evaluator: Evaluator, *, config: TrainingConfig) -> None:
        self.evaluator = evaluator
        self.every = config.valid_every_steps
        stopping = config.stopping()
        self.stopping = None if stopping is None else EarlyStopping(stopping)
        self.last_step: int | None = None  # of the last evaluation
        self.last: dict[str, float] = {}  # its metrics
        self._best_stored: Any = None  # the best evaluation's checkpoint, as stored

    @property
    def active(self) -> bool:
        return self.evaluator.data is not None

    @property
    def stopped(self) -> bool:
        return self.stopping is not None and self.stopping.stopped

    def due(self, step: int) -> bool:
        """Whether to evaluate after training step ``step`` (``valid_every_steps``)."""
        return self.active and self.every > 0 and step % self.every == 0 and not self._done(step)

    def due_at_epoch_end(self, step: int) -> bool:
        """Whether to evaluate at an epoch's end, after step ``step`` (``valid_every_steps``
        0)."""
        return self.active and self.every == 0 and not self._done(step)

    def due_at_end(self, step: int) -> bool:
        """Whether to evaluate once more when training ends at ``step``: the last evaluation
        was earlier (``max_steps`` mid-epoch, steps after the last periodic one)."""
        return self.active and not self.stopped and not self._done(step)

    def _done(self, step: int) -> bool:
        return self.last_step == step

    def run(self, step: int) -> tuple[dict[str, float], bool]:
        """Evaluates (a collective: every rank, in lock-step) after step ``step``; returns the
        metrics to report and whether it is the best so far (to be checkpointed: the caller
        passes the stored checkpoint to :meth:`stored`)."""
        metrics = {**self.evaluator.run(), VALID_STEP: float(step)}
        self.last_step, self.last = step, metrics
        if self.stopping is None:
            return metrics, False
        improved = self.stopping.update(metrics, step=step)
        if self.stopping.stopped and self.evaluator.rank == 0:
            config = self.stopping.config
            logger.info(
                "early stopping at step %d: %s did not improve on %.6f (step %s) by more than "
                "%g in %d evaluations",
                step,
                config.metric,
                self.stopping.best,
                self.stopping.best_step,
                config.min_delta,
                config.patience,
            )
        return {**metrics, **self.stopping.metrics()}, improved

    def stored(self, checkpoint: Any) -> None:
        """The checkpoint of the best evaluation, as stored (None: the report stored none)."""
        assert self.stopping is not None
        self._best_stored = checkpoint
        self.stopping.best_checkpoint = None if checkpoint is None else str(checkpoint.path)

    def protected(self) -> list[str]:
        """The checkpoint retention must keep: the best one's name."""
        best = self.stopping.best_checkpoint if self.stopping else None
        return [] if best is None else [Path(best).name]

    def best_checkpoint(self, step: int) -> Any | None:
        """The stored checkpoint whose weights the run ends with, when the model at ``step``
        is not the best (None: it is, or there is no early stopping).

        Raises:
            RuntimeError: the best evaluation's checkpoint was not stored (a report function
                that stores nothing), so the run cannot end with its weights.
        """
        if self.stopping is None or self.stopping.best_step in (None, step):
            return None
        if self._best_stored is None:
            raise RuntimeError(
                f"early stopping: the best checkpoint (step {self.stopping.best_step}) was not "
                "stored, so the run cannot end with its weights"
            )
        return self._best_stored

    def final_metrics(self) -> dict[str, float]:
        """The last evaluation's ``valid/*`` metrics (the curve's last point: a report of the
        best one's at the final step would put a false point on it) and, with early stopping,
        ``early_stopping/*``: the best value and step, the model's."""
        return {**self.last, **(self.stopping.metrics() if self.stopping else {})}

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"last_step": self.last_step, "last": dict(self.last)}
        if self.stopping is not None:
            state["early_stopping"] = self.stopping.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any], *, stored: Any = None) -> None:
        """Restores :meth:`state_dict`; ``stored`` is the loaded checkpoint as stored, whose
        place names the best checkpoint when it is the loaded one (its own state could not
        hold its path) or gives the file system of the one recorded."""
        self.last_step = state.get("last_step")
        self.last = dict(state.get("last", {}))
        if self.stopping is None:
            return
        self.stopping.load_state_dict(state.get("early_stopping", {}))
        best = self.stopping.best_checkpoint
        if self.stopping.best_step is not None and best is None:
            # The best evaluation was checkpointed in the loaded checkpoint itself.
            self.stored(stored)
        elif best is not None and stored is not None:
            self._best_stored = type(stored)(path=best, filesystem=stored.filesystem)
