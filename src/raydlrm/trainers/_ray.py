"""The one seam between the training loop and Ray Train.

Everything the worker needs from Ray Train (its rank and device, reporting metrics and
checkpoints) goes through here, so the rest of ``raydlrm.trainers`` runs in plain
processes and tests.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow.fs as pafs
import ray.train
import ray.train.torch

__all__ = [
    "WorkerContext",
    "configure_data_output",
    "latest_checkpoint",
    "report",
    "worker_context",
]

logger = logging.getLogger(__name__)


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


def configure_data_output(library_level: int) -> None:
    """Ray Data's per-data-set output in this worker (it builds its data sets here): execution
    plans and progress bars only when ``library_level`` lets INFO through. Without bars Ray
    Data logs its progress at INFO on its own logger (bars drawn through the driver print blank
    lines when tqdm is missing; turning progress off altogether makes Ray Data warn that it is
    off)."""
    import ray.data

    if library_level <= logging.INFO:
        return
    context = ray.data.DataContext.get_current()
    context.print_on_execution_start = False  # "Execution plan of ...", "Starting execution"
    context.use_ray_tqdm = False


def report(
    metrics: dict[str, Any], *, checkpoint_dir: str | None = None
) -> ray.train.Checkpoint | None:
    """Reports metrics (and, from the ranks that pass one, a checkpoint directory); returns the
    checkpoint as stored in the run storage (None for a metrics-only report).

    Every worker must call this the same number of times.
    """
    if checkpoint_dir is None:
        ray.train.report(metrics, checkpoint=None)
        return None
    ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(checkpoint_dir))
    return ray.train.get_checkpoint()  # Ray Train's latest: the one just stored


def add_file(checkpoint: ray.train.Checkpoint, name: str, text: str) -> None:
    """Writes ``text`` as the file ``name`` of a stored checkpoint (local or remote)."""
    with checkpoint.filesystem.open_output_stream(f"{checkpoint.path.rstrip('/')}/{name}") as f:
        f.write(text.encode())


@contextlib.contextmanager
def latest_checkpoint(
    problems_of: Callable[[str], list[str]], latest: ray.train.Checkpoint | None = None
) -> Iterator[tuple[str, ray.train.Checkpoint] | tuple[None, None]]:
    """The run's newest intact checkpoint as a local directory (downloaded if remote) and as
    stored, or (None, None) when the run has none (a fresh start).

    Ray Train's latest registered checkpoint and every other ``checkpoint_*`` directory of the
    run are tried newest first (Ray names them by time): one complete but never registered
    (a crash between writing and registering) is taken rather than redoing its steps, and a
    damaged one (``problems_of`` names what is wrong) is passed over with a warning naming it.
    Every rank checks the same directories the same way, so all ranks pick the same one.

    Args:
        problems_of: what is wrong with a checkpoint directory (empty when intact).
        latest: the run's latest registered checkpoint (default: Ray Train's).

    Raises:
        RuntimeError: the run has checkpoints but none is intact (each named with its damage).
    """
    latest = latest or ray.train.get_checkpoint()
    if latest is None:
        yield None, None
        return
    damaged = []
    for checkpoint in _newest_first(latest):
        with checkpoint.as_directory() as directory:
            problems = problems_of(directory)
            if not problems:
                if damaged or checkpoint.path != latest.path:
                    logger.warning(
                        "taking %s rather than the latest registered checkpoint %s",
                        checkpoint.path,
                        latest.path,
                    )
                yield directory, checkpoint
                return
        damaged.append(f"{checkpoint.path}: {'; '.join(problems[:3])}")
        logger.warning("checkpoint %s is damaged, passed over: %s", checkpoint.path, damaged[-1])
    raise RuntimeError("no intact checkpoint to resume from: " + " | ".join(damaged))


def _newest_first(latest: ray.train.Checkpoint) -> list[ray.train.Checkpoint]:
    """Every ``checkpoint_*`` directory beside ``latest``, newest first (by Ray's time-stamped
    names)."""
    filesystem = latest.filesystem
    parent = latest.path.rstrip("/").rsplit("/", 1)[0]
    infos = filesystem.get_file_info(pafs.FileSelector(parent))
    paths = sorted(
        (
            i.path
            for i in infos
            if i.type == pafs.FileType.Directory and i.base_name.startswith("checkpoint_")
        ),
        reverse=True,
    )
    if latest.path.rstrip("/") not in paths:
        paths.insert(0, latest.path)
    return [ray.train.Checkpoint(path=p, filesystem=filesystem) for p in paths]


@contextlib.contextmanager
def checkpoint_directory(checkpoint: ray.train.Checkpoint) -> Iterator[str]:
    """A checkpoint given by the driver (e.g. a warm start) as a local directory."""
    with checkpoint.as_directory() as directory:
        yield directory
