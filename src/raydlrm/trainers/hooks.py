"""What the training loop calls at its moments, kept out of the loop itself.

A hook is called with the moment, the rank and the step: after a step (with the step's batch and
its loss), when a checkpoint's files are written but not yet reported, and before the final
evaluation. Two ship with raydlrm, made from the job's config by :func:`default_hooks`:

- :class:`SampleAudit` (``training.sample_log_dir``): the sample ids of every step, one file per
  rank and step (a step redone after a restart overwrites its file);
- :class:`FaultInjection` (``[fault]``, ``RAYDLRM_FAULT``): kills the process at a chosen rank,
  step and moment, once per run (a marker object in the run storage records that it fired).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Literal, Protocol

import numpy as np
import pyarrow.fs as pafs
import torch

from raydlrm.batch import Batch
from raydlrm.storage import StorageConfig, filesystem_for
from raydlrm.trainers.spec import WorkerSpec

__all__ = ["FaultInjection", "Moment", "SampleAudit", "TrainerHook", "default_hooks"]

logger = logging.getLogger(__name__)

Moment = Literal["step", "checkpoint", "eval"]
"""``step``: after a training step; ``checkpoint``: a checkpoint's files written, not yet
reported; ``eval``: before the final evaluation."""


class TrainerHook(Protocol):
    """Called by the loop at each :data:`Moment`, on every rank.

    Args:
        moment: when.
        rank: the caller's rank.
        step: the steps trained so far.
        batch: the step's batch (``step`` moments), else None.
        loss: the step's mean loss over this rank's batch (0-d, on the device), else None.
    """

    def __call__(
        self,
        moment: Moment,
        *,
        rank: int,
        step: int,
        batch: Batch | None = None,
        loss: torch.Tensor | None = None,
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


def default_hooks(
    spec: WorkerSpec, *, fault_marker: str | None, fault_storage: StorageConfig | None
) -> list[TrainerHook]:
    """The hooks the job's config asks for: the sample audit, the injected fault (which needs
    the run's marker path)."""
    hooks: list[TrainerHook] = []
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
                storage=fault_storage or spec.data.storage,
            )
        )
    return hooks
