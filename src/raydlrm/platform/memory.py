"""A worker's memory as the driver knows it, before Ray starts: the embedding tables' budget
(``sharding.memory_budget``) and the shuffle window's share of it."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import psutil

from raydlrm.ingestion import DataSummary
from raydlrm.ingestion.reader import (
    WINDOW_COPIES,
    default_num_actors,
    resumed_window,
    window_bytes,
)
from raydlrm.platform.config import ConfigError, JobConfig
from raydlrm.platform.ray_init import ray_address
from raydlrm.sharding import MemoryBudget
from raydlrm.sharding.plan import format_bytes

__all__ = [
    "check_shuffle_window",
    "host_memory_budget",
    "worker_memory",
    "worker_memory_budget",
]

logger = logging.getLogger(__name__)


def worker_memory_budget(job: JobConfig) -> MemoryBudget | None:
    """The bytes of embedding tables each worker may hold (see ``sharding.memory_budget``).

    ``sharding.device_memory_bytes`` when set. Otherwise, with ``sharding.memory_budget =
    "auto"``: the worker's Ray ``memory`` resource (``scaling.resources_per_worker``), else this
    machine's memory shared by all ``scaling.num_workers`` workers (a local Ray cluster runs
    them all here), less ``sharding.worker_overhead_bytes``.

    Returns:
        The budget and how it was derived; None when the budget is ``off``, or cannot be derived
        here: GPU workers (tables live in GPU memory) and a remote cluster (its nodes' memory
        is unknown to this machine), each with a warning.

    Raises:
        ConfigError: if the derived budget is not positive.
    """
    sharding, scaling = job.sharding, job.scaling
    if sharding.device_memory_bytes is not None:
        return MemoryBudget(sharding.device_memory_bytes, "sharding.device_memory_bytes")
    if sharding.memory_budget == "off":
        return None
    if scaling.use_gpu:
        return _no_budget(
            "the tables live in the workers' GPU memory, which the driver does not know: set "
            "sharding.device_memory_bytes"
        )
    known = worker_memory(job)
    if known is None:
        return _no_budget(
            f"the workers run on the Ray cluster at {ray_address(job)}, whose memory the driver "
            "does not know: set sharding.device_memory_bytes or scaling.resources_per_worker.memory"
        )
    memory, source = known
    overhead = sharding.worker_overhead_bytes
    source = f"{source} - {format_bytes(overhead)} overhead"
    if memory - overhead <= 0:
        raise ConfigError(
            f"sharding.memory_budget: no memory left for embedding tables ({source}); lower "
            "sharding.worker_overhead_bytes or scaling.num_workers, set "
            "sharding.device_memory_bytes, or sharding.memory_budget = 'off' to plan for other "
            "machines"
        )
    return MemoryBudget(memory - overhead, source)


def host_memory_budget(job: JobConfig) -> MemoryBudget | None:
    """The bytes of host memory each GPU worker's ``host`` tables may take:
    ``sharding.host_memory_bytes``, else :func:`worker_memory` less
    ``sharding.worker_overhead_bytes``; None with ``sharding.memory_budget = "off"`` (a plan
    for other machines), and (with a warning) on a remote cluster without a ``memory``
    resource, whose nodes' memory is unknown here."""
    sharding = job.sharding
    if sharding.host_memory_bytes is not None:
        return MemoryBudget(sharding.host_memory_bytes, "sharding.host_memory_bytes")
    if sharding.memory_budget == "off":
        return None
    known = worker_memory(job)
    if known is None:
        logger.warning(
            "the host memory of the 'host' tables is not checked: the workers run on the Ray "
            "cluster at %s, whose memory the driver does not know (set "
            "sharding.host_memory_bytes or scaling.resources_per_worker.memory)",
            ray_address(job),
        )
        return None
    memory, source = known
    overhead = sharding.worker_overhead_bytes
    return MemoryBudget(max(memory - overhead, 1), f"{source} - {format_bytes(overhead)} overhead")


def worker_memory(job: JobConfig) -> tuple[int, str] | None:
    """A worker's memory as the driver knows it, and how it was derived: its Ray ``memory``
    resource (``scaling.resources_per_worker``), else this machine's memory shared by all
    ``scaling.num_workers`` workers (a local Ray cluster runs them all here); None on a remote
    cluster, whose nodes' memory is unknown here."""
    scaling = job.scaling
    if "memory" in scaling.resources_per_worker:
        memory = int(scaling.resources_per_worker["memory"])
        return memory, f"{format_bytes(memory)} scaling.resources_per_worker.memory"
    if ray_address(job) != "local":
        return None
    node = psutil.virtual_memory().total
    return node // scaling.num_workers, (
        f"{format_bytes(node)} node memory / {scaling.num_workers} workers"
    )


def check_shuffle_window(
    job: JobConfig, train: DataSummary, *, resumed: dict[str, Any] | None = None
) -> None:
    """Refuses a shuffle window whose preprocessing actors would hold over half a worker's
    memory (:func:`worker_memory`): each actor of a worker's pool reads one window at a time
    (:func:`~raydlrm.ingestion.reader.window_bytes`). The window checked is the largest the run
    reads with: ``data.shuffle_window_rows``, or, when the run resumes (``resumed``: its
    checkpoint's ``trainer_state.json``) in its last epoch, that epoch's
    (:func:`~raydlrm.ingestion.reader.resumed_window`: never larger).

    Raises:
        ConfigError: naming the key, the memory it needs and the largest window that fits.
    """
    memory = worker_memory(job)
    if memory is None:
        return
    rows, which = _largest_window(job, resumed)
    data = job.data
    if rows != data.shuffle_window_rows:
        data = dataclasses.replace(data, shuffle_window_rows=rows)
    need = window_bytes(train, data)  # a footer read: only when there is a budget
    if not need:
        return
    actors = job.data.num_preprocess_actors or default_num_actors()
    budget, source = memory
    if need * actors <= budget // 2:
        return
    fits = int(min(rows, train.num_rows) * (budget // 2) / (need * actors))
    raise ConfigError(
        f"data.shuffle_window_rows = {job.data.shuffle_window_rows}{which}: {actors} "
        f"preprocessing actor(s) per worker would each hold about {format_bytes(need)} of "
        f"window rows ({WINDOW_COPIES} copies of the rows of {train.path} it mixes), over half "
        f"a worker's memory ({source}); set it to at most {fits} (0: off), or lower "
        "data.num_preprocess_actors"
    )


def _largest_window(job: JobConfig, resumed: dict[str, Any] | None) -> tuple[int, str]:
    """The largest shuffle window the run reads with, and how it differs from the config's
    (a phrase, empty when it is the config's)."""
    configured = job.data.shuffle_window_rows
    position = (resumed or {}).get("position")
    if position is None or position["epoch"] + 1 < job.training.num_epochs:
        return configured, ""
    window = resumed_window(position.get("window_rows", 0), configured=configured)
    if window == configured:
        return configured, ""
    return window, f" (the resumed last epoch {position['epoch']} reads with {window} rows)"


def _no_budget(why: str) -> None:
    logger.warning(
        "no memory budget for the embedding tables: %s (or sharding.memory_budget = 'off')", why
    )
