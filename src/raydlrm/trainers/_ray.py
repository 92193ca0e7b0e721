"""The one seam between the training loop and Ray Train.

Everything the worker needs from Ray Train (its rank and device, reporting metrics and
checkpoints) goes through here, so the rest of ``raydlrm.trainers`` runs in plain
processes and tests.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow.fs as pafs
import ray.train
import ray.train.torch

__all__ = [
    "WorkerContext",
    "add_file",
    "check_hosts",
    "configure_data_output",
    "registered_checkpoint",
    "report",
    "worker_context",
]

if TYPE_CHECKING:
    from raydlrm.sharding.topology import Topology

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


def check_hosts(topology: Topology, rank: int) -> None:
    """Warns (on rank 0) when the hosts of ``topology`` (``scaling.ranks_per_host``) are not
    the cluster's nodes as Ray Train placed the workers: the exchanges the topology keeps inside
    a host (a table-row-wise group's, a tower's) then cross nodes. Nothing on one node (hosts
    emulated on one machine). Every rank must call it (one all-gather)."""
    import torch.distributed as dist

    nodes: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(nodes, ray.get_runtime_context().get_node_id())
    if rank != 0 or len(set(nodes)) == 1:
        return
    hosts = [[nodes[r] for r in topology.host_ranks(h)] for h in range(topology.num_hosts)]
    split = [h for h, ids in enumerate(hosts) if len(set(ids)) > 1]
    if split or len({ids[0] for ids in hosts}) != len(hosts):
        logger.warning(
            "scaling.ranks_per_host = %d does not match the cluster's nodes (the workers of "
            "hosts %s are on several nodes, or hosts share one): training goes on, but the "
            "exchanges kept inside a host (table-row-wise groups, towers) cross nodes; set it "
            "to the workers per node",
            topology.ranks_per_host,
            split or "some",
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
    checkpoint as stored in the run storage (None for a metrics-only report). A run storage on
    a local file system takes the directory's files by moving them (:func:`_move_into`); an
    object store by Ray Train's upload.

    Every worker must call this the same number of times.
    """
    if checkpoint_dir is None:
        ray.train.report(metrics, checkpoint=None)
        return None
    checkpoint = ray.train.Checkpoint.from_directory(checkpoint_dir)
    storage = ray.train.get_context().get_storage()
    if isinstance(storage.storage_filesystem, pafs.LocalFileSystem):
        # Moved, not copied: no second full copy of the rank's part on the disk.
        ray.train.report(
            metrics,
            checkpoint=checkpoint,
            checkpoint_upload_fn=lambda c, name: _move_into(c, storage, name),
            delete_local_checkpoint_after_upload=False,
        )
    else:
        ray.train.report(metrics, checkpoint=checkpoint)
    return ray.train.get_checkpoint()  # Ray Train's latest: the one just stored


def _move_into(checkpoint: ray.train.Checkpoint, storage: Any, name: str) -> ray.train.Checkpoint:
    """Stores this rank's part of a checkpoint in a run storage on a local (or mounted)
    file system by moving its files there: a rename on the same disk (no copy: a large
    checkpoint is not on the disk twice while it is stored), a copy then a delete across
    disks. Every rank moves its own files into the same directory, as Ray Train merges
    them when it copies."""
    target = Path(storage.build_checkpoint_path_from_name(name))
    target.mkdir(parents=True, exist_ok=True)
    for source in Path(checkpoint.path).iterdir():
        shutil.move(source, target / source.name)  # os.rename where it can
    return ray.train.Checkpoint(path=str(target), filesystem=storage.storage_filesystem)


def registered_checkpoint() -> ray.train.Checkpoint | None:
    """The run's latest checkpoint that Ray Train registered (None: a fresh start)."""
    return ray.train.get_checkpoint()


def add_file(checkpoint: ray.train.Checkpoint, name: str, text: str) -> None:
    """Writes ``text`` as the file ``name`` of a stored checkpoint (local or remote)."""
    with checkpoint.filesystem.open_output_stream(f"{checkpoint.path.rstrip('/')}/{name}") as f:
        f.write(text.encode())
