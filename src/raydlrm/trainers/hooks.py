"""What the training loop calls at its moments, kept out of the loop itself.

A hook is called with the moment, the rank and the step: after a step (with the step's batch and
its loss), when a checkpoint's files are written but not yet reported, and before the final
evaluation. Two ship with raydlrm, made from the job's config by :func:`default_hooks`:

- :class:`SampleAudit` (``training.sample_log_dir``): the sample ids of every step, one file per
  rank and step (a step redone after a restart overwrites its file);
- :class:`FaultInjection` (``[fault]``, ``RAYDLRM_FAULT``): kills the process at a chosen rank,
  step and moment, once per run (a marker object in the run storage records that it fired);
- :class:`ProgressBeacon`: rank 0 writes the run's progress to ``progress.json`` in its run
  directory every few seconds, which the driver's progress line reads (a metrics report, a
  barrier across the workers, comes only every ``training.log_every_steps``).
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Literal, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import torch

from raydlrm.batch import Batch
from raydlrm.storage import StorageConfig, filesystem_for
from raydlrm.trainers.spec import WorkerSpec

__all__ = [
    "PROGRESS_FILE",
    "FaultInjection",
    "Moment",
    "ProgressBeacon",
    "SampleAudit",
    "TrainerHook",
    "default_hooks",
]

logger = logging.getLogger(__name__)

PROGRESS_FILE = "progress.json"
"""The run's progress, in its run directory: ``step``, ``epoch``, ``samples`` (an estimate over
all workers: the samples restored from the checkpoint the workers started from plus rank 0's
since then times the world size), ``restored`` (those restored samples: 0 without a
checkpoint), ``time`` (seconds since the epoch)."""

Moment = Literal["step", "checkpoint", "eval"]
"""``step``: after a training step; ``checkpoint``: a checkpoint's files written, not yet
reported; ``eval``: before the final evaluation."""


class TrainerHook(Protocol):
    """Called by the loop at each :data:`Moment`, on every rank.

    Args:
        moment: when.
        rank: the caller's rank.
        step: the steps trained so far.
        epoch: the current epoch (``step`` moments), else None.
        batch: the step's batch (``step`` moments), else None.
        loss: the step's mean loss over this rank's batch (0-d, on the device), else None.
        samples_seen: the samples of all ranks counted at the last report, those restored
            from a checkpoint included (``step`` moments), else None.
    """

    def __call__(
        self,
        moment: Moment,
        *,
        rank: int,
        step: int,
        epoch: int | None = None,
        batch: Batch | None = None,
        loss: torch.Tensor | None = None,
        samples_seen: int | None = None,
    ) -> None: ...


class SampleAudit:
    """Writes each step's sample ids under ``directory``: ``rank<r>-step<s>.npy``."""

    def __init__(self, directory: str):
        self.directory = directory

    def __call__(
        self, moment: Moment, *, rank: int, step: int, batch: Batch | None = None, **_: object
    ) -> None:
        if moment != "step" or batch is None or batch.sample_ids is None:
            return
        os.makedirs(self.directory, exist_ok=True)
        np.save(
            os.path.join(self.directory, f"rank{rank:04d}-step{step:09d}.npy"),
            batch.sample_ids.cpu().numpy(),
        )


class FaultInjection:
    """Kills this process (``os._exit``, no cleanup) at ``rank``, ``step`` and ``during``, once
    per run: a marker object beside ``marker`` (in the run storage) records that it fired.

    Args:
        rank: the rank that dies.
        step: the step after (or at) which it dies.
        during: the :data:`Moment`.
        marker: the marker objects' path prefix.
        storage: the marker's object store (None: local or default credentials).
    """

    def __init__(
        self,
        *,
        rank: int,
        step: int,
        during: Moment,
        marker: str,
        storage: StorageConfig | None,
    ):
        self.rank, self.step, self.during = rank, step, during
        self.marker, self.storage = marker, storage

    def __call__(self, moment: Moment, *, rank: int, step: int, **_: object) -> None:
        if (rank, step, moment) != (self.rank, self.step, self.during):
            return
        filesystem, marker = filesystem_for(
            f"{self.marker}.rank{self.rank}.step{self.step}.{moment}", self.storage
        )
        if filesystem.get_file_info(marker).type != pafs.FileType.NotFound:
            return
        filesystem.create_dir(marker.rsplit("/", 1)[0], recursive=True)
        with filesystem.open_output_stream(marker) as f:
            f.write(f"{time.time()}\n".encode())
        logger.warning(
            "fault injection: rank %d dies at step %d (%s)", self.rank, self.step, moment
        )
        os._exit(17)


class ProgressBeacon:
    """Writes the run's progress (:data:`PROGRESS_FILE`) from rank 0 at most every
    ``every_s`` seconds: a small write, no collective; an error writing it is logged, not
    raised (progress never stops training).

    Args:
        directory: the run's directory (local or an object-store path).
        storage: its object store (None: local or default credentials).
        world_size: the workers (rank 0's samples times this is the estimate).
        every_s: the least seconds between writes.
    """

    def __init__(
        self,
        directory: str,
        *,
        storage: StorageConfig | None,
        world_size: int,
        every_s: float = 5.0,
    ):
        self.path, self.storage, self.world_size = (
            f"{directory.rstrip('/')}/{PROGRESS_FILE}",
            storage,
            world_size,
        )
        self.every_s = every_s
        self._samples = 0
        self._restored: int | None = None  # samples_seen at this process's first step
        self._last = -float("inf")

    def __call__(
        self,
        moment: Moment,
        *,
        rank: int,
        step: int,
        epoch: int | None = None,
        batch: Batch | None = None,
        samples_seen: int | None = None,
        **_: object,
    ) -> None:
        if moment != "step" or rank != 0 or batch is None:
            return
        if self._restored is None:  # no report yet: the checkpoint's count, or 0
            self._restored = samples_seen or 0
        self._samples += batch.batch_size
        now = time.monotonic()
        if now - self._last < self.every_s:
            return
        self._last = now
        record = {
            "step": step,
            "epoch": epoch,
            "samples": self._restored + self._samples * self.world_size,
            "restored": self._restored,
            "time": time.time(),
        }
        try:
            filesystem, path = filesystem_for(self.path, self.storage)
            with filesystem.open_output_stream(path) as f:
                f.write(json.dumps(record).encode())
        except (OSError, pa.ArrowException) as exc:
            logger.debug("progress not written to %s: %s", self.path, exc)


def default_hooks(
    spec: WorkerSpec,
    *,
    fault_marker: str | None = None,
    run_directory: str | None = None,
    run_storage: StorageConfig | None = None,
    world_size: int = 1,
) -> list[TrainerHook]:
    """The hooks the job's config asks for: the sample audit, the injected fault (which needs
    the run's marker path), the progress beacon (which needs the run's directory)."""
    hooks: list[TrainerHook] = []
    if run_directory is not None:
        hooks.append(ProgressBeacon(run_directory, storage=run_storage, world_size=world_size))
    if spec.training.sample_log_dir is not None:
        hooks.append(SampleAudit(spec.training.sample_log_dir))
    fault = spec.fault
    if fault.at_step is not None and fault_marker is not None:
        hooks.append(
            FaultInjection(
                rank=fault.rank,
                step=fault.at_step,
                during=fault.during,
                marker=fault_marker,
                storage=run_storage or spec.data.storage,
            )
        )
    return hooks
