"""When the training loop checkpoints, and how a run is restored or warm-started.

:class:`Checkpointer` decides when to write a training checkpoint (``[checkpoint]``: every
``every_steps`` steps, or when ``every_minutes`` passed since the last one, checked at the
log steps (``training.log_every_steps``); always at the end), writes this rank's part of it with
the merged data position (:mod:`raydlrm.trainers.checkpoint`), and reports it: Ray Train
merges the ranks' directories into one checkpoint, registered only once every rank's part is
stored. The final
checkpoint also holds the model's config, plan and metrics (:mod:`raydlrm.trainers.model_dir`):
its shards are the model's weights. It sees the training loop only through its state dict.
"""

from __future__ import annotations

import errno
import json
import logging
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from raydlrm.ingestion.reader import EpochProgress
from raydlrm.trainers._dist import all_gather_object, all_reduce_scalar
from raydlrm.trainers.checkpoint import TrainingParts, load_training_state, save_training_state
from raydlrm.trainers.config import CheckpointConfig
from raydlrm.trainers.hooks import TrainerHook
from raydlrm.trainers.model_dir import METRICS_FILE, save_model_metadata
from raydlrm.trainers.reporting import Reporter

__all__ = ["Checkpointer", "Restored"]

logger = logging.getLogger(__name__)

_NO_SPACE = "No space left on device"  # strerror(ENOSPC)
_FULL_BYTES = 1 << 20
"""Free bytes below which a failed write is put down to a full staging disk."""


def _disk_full(exc: BaseException) -> bool:
    """Whether writing a checkpoint failed for a full disk: ``ENOSPC`` (as such, or in the
    text of DCP's wrapper), or any error with the staging directory's disk full (torch's zip
    writer reports a short write as a position mismatch)."""
    if getattr(exc, "errno", None) == errno.ENOSPC or _NO_SPACE in str(exc):
        return True
    if isinstance(exc, KeyboardInterrupt | SystemExit):
        return False
    return shutil.disk_usage(tempfile.gettempdir()).free < _FULL_BYTES


@dataclass
class Restored:
    """What a loaded checkpoint gives the training loop back.

    Attributes:
        loop_state: the loop's own state (``step``, ``epoch``, ``samples_seen``,
            ``train_seconds``).
        position: every rank's data position at the checkpoint.
        world_size: the world size that wrote it.
        final_metrics: the run's final metrics when it is the run's final checkpoint, else None.
    """

    loop_state: dict[str, Any]
    position: EpochProgress
    world_size: int
    final_metrics: dict[str, Any] | None


class Checkpointer:
    """Training checkpoints of one worker (see the module docstring).

    Args:
        config: the ``[checkpoint]`` cadence.
        parts: what the checkpoints hold.
        reporter: reports each checkpoint with its metrics.
        hooks: called at the ``checkpoint`` moment (files written, not yet reported).
        device: the worker's device (for the collectives).
        storage: where the run's checkpoints are stored (named when a disk is full).
    """

    def __init__(
        self,
        *,
        config: CheckpointConfig,
        parts: TrainingParts,
        reporter: Reporter,
        hooks: Sequence[TrainerHook],
        device: torch.device,
        storage: str | None = None,
    ) -> None:
        self.config = config
        self.storage = storage
        self.parts = parts
        self.reporter = reporter
        self.hooks = hooks
        self.device = device
        self._last = time.monotonic()

    def should_save(self, step: int, *, log_step: bool) -> bool:
        """Whether to write a checkpoint after ``step`` (the same answer on every rank: by
        time, rank 0's clock decides, read at log steps)."""
        if self.config.every_steps and step % self.config.every_steps == 0:
            return True
        if self.config.every_minutes and log_step:
            elapsed = (time.monotonic() - self._last) / 60 if self.parts.rank == 0 else 0.0
            return all_reduce_scalar(elapsed, self.device, op="max") >= self.config.every_minutes
        return False

    def save(
        self,
        metrics: dict[str, float],
        *,
        loop_state: dict[str, Any],
        progress: EpochProgress,
        final: bool = False,
    ) -> Any:
        """Writes and reports this rank's part of a checkpoint (every rank must call); with
        ``final``, rank 0 also writes the model's config, plan and metrics. Returns the
        checkpoint as stored."""
        merged = EpochProgress.merged(
            [EpochProgress.from_dict(p) for p in all_gather_object(progress.to_dict())]
        )
        try:
            stored = self._write(metrics, loop_state=loop_state, position=merged, final=final)
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            if not _disk_full(exc):
                raise
            raise OSError(
                errno.ENOSPC,
                f"no space left on device for the checkpoint of step {loop_state['step']}: "
                f"staged in {tempfile.gettempdir()} (this worker's temporary directory), "
                f"stored under {self.storage or 'the run storage'} (run.storage_path): {exc}",
            ) from exc
        self._last = time.monotonic()
        return stored

    def _write(
        self,
        metrics: dict[str, float],
        *,
        loop_state: dict[str, Any],
        position: EpochProgress,
        final: bool,
    ) -> Any:
        with tempfile.TemporaryDirectory(prefix="raydlrm-ckpt-") as tmp:
            if final and self.parts.rank == 0:
                save_model_metadata(
                    tmp,
                    spec=self.parts.spec,
                    plan=self.parts.plan,
                    metrics=self.reporter.merged(metrics, loop_state=loop_state),
                )
            save_training_state(
                tmp, parts=self.parts, loop_state=loop_state, position=position.to_dict()
            )
            for hook in self.hooks:
                hook("checkpoint", rank=self.parts.rank, step=loop_state["step"])
            return self.reporter.report(
                metrics, loop_state=loop_state, checkpoint_dir=tmp, final=final
            )

    def load(self, directory: str) -> Restored:
        """Restores the parts from a training checkpoint (any world size or plan); all ranks."""
        state = load_training_state(directory, parts=self.parts)
        metrics_file = Path(directory, METRICS_FILE)  # only final checkpoints hold it
        return Restored(
            loop_state={k: state[k] for k in ("step", "epoch", "samples_seen", "train_seconds")},
            position=EpochProgress.from_dict(state["position"]),
            world_size=state["world_size"],
            final_metrics=json.loads(metrics_file.read_text()) if metrics_file.is_file() else None,
        )

    def warm_start(self, directory: str) -> int:
        """Restores the parts from another run's checkpoint (any world size or plan): its
        tables, dense weights and optimizer states; the RNG starts afresh from the seed. All
        ranks. Returns the step the checkpoint was written at."""
        state = load_training_state(directory, parts=self.parts)
        torch.manual_seed(self.parts.spec.training.seed)
        return int(state["step"])
