"""The one seam between the training loop and Ray Train.

Everything the worker needs from Ray Train (its rank and device, reporting metrics and
checkpoints) goes through here, so the rest of ``raydlrm.trainers`` runs in plain
processes and tests.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import ray.train
import ray.train.torch

__all__ = ["WorkerContext", "latest_checkpoint", "report", "worker_context"]


@dataclass(frozen=True)
class WorkerContext:
    """Where this worker sits in the job."""

    rank: int
    world_size: int
    local_rank: int
    device: Any


def worker_context() -> WorkerContext:
    ctx = ray.train.get_context()
    return WorkerContext(
        rank=ctx.get_world_rank(),
        world_size=ctx.get_world_size(),
        local_rank=ctx.get_local_rank(),
        device=ray.train.torch.get_device(),
    )


def report(metrics: dict[str, Any], *, checkpoint_dir: str | None = None) -> None:
    """Reports metrics (and, from the ranks that pass one, a checkpoint directory).

    Every worker must call this the same number of times.
    """
    checkpoint = (
        ray.train.Checkpoint.from_directory(checkpoint_dir) if checkpoint_dir is not None else None
    )
    ray.train.report(metrics, checkpoint=checkpoint)


@contextlib.contextmanager
def latest_checkpoint() -> Iterator[str | None]:
    """The run's latest complete checkpoint as a local directory (downloaded if remote), or
    None when the run has none (a fresh start)."""
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        yield None
        return
    with checkpoint.as_directory() as directory:
        yield directory


@contextlib.contextmanager
def checkpoint_directory(checkpoint: ray.train.Checkpoint) -> Iterator[str]:
    """A checkpoint given by the driver (e.g. a warm start) as a local directory."""
    with checkpoint.as_directory() as directory:
        yield directory
