"""The Ray Train entry point of every training worker (:func:`train_loop_per_worker`).

It reads what the driver sent (:class:`~raydlrm.trainers.spec.WorkerJob`), checks the worker
group against the plan and the hosts, builds the worker's
:class:`~raydlrm.trainers.loop.Trainer`, resumes its run's newest intact checkpoint (or
warm-starts from another run's), and trains on this worker's share of the training, held-out
and validation data (:class:`~raydlrm.ingestion.reader.WorkerSource`).
"""

from __future__ import annotations

import logging
from typing import Any

from raydlrm._logs import configure_worker
from raydlrm.ingestion.reader import WorkerSource
from raydlrm.trainers.checkpoints import newest_intact
from raydlrm.trainers.hooks import default_hooks
from raydlrm.trainers.loop import Trainer
from raydlrm.trainers.spec import SourceDescription, WorkerJob

__all__ = ["train_loop_per_worker"]

logger = logging.getLogger(__name__)


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """Ray Train entry point: ``config`` is ``{"job": WorkerJob}`` (see :class:`WorkerJob`)."""
    job: WorkerJob = config["job"]
    configure_worker(job.log_level, job.library_log_level)
    from raydlrm.trainers import _ray  # the one module that talks to Ray Train

    _ray.configure_data_output(job.library_log_level)
    ctx = _ray.worker_context()
    if job.plan.world_size != ctx.world_size:
        raise ValueError(
            f"the sharding plan is for {job.plan.world_size} workers but the job has "
            f"{ctx.world_size}"
        )
    if job.topology is not None and job.topology.num_hosts > 1:
        _ray.check_hosts(job.topology, ctx.rank)
    hooks = default_hooks(
        job.spec,
        fault_marker=job.fault_marker,
        run_directory=job.run_directory,
        run_storage=job.run_storage,
        world_size=ctx.world_size,
    )
    trainer = Trainer(
        job.spec,
        plan=job.plan,
        rank=ctx.rank,
        device=ctx.device,
        hooks=hooks,
        storage=job.run_directory,
        topology=job.topology,
    )
    with newest_intact(_ray.registered_checkpoint()) as (checkpoint_dir, stored):
        if checkpoint_dir is not None:
            trainer.load(checkpoint_dir, stored=stored)
        elif job.warm_start is not None:
            # A run's own checkpoint wins: a warm-started run that restarts continues from it.
            with job.warm_start.as_directory() as warm_dir:
                trainer.warm_start(warm_dir, stored=job.warm_start)

    trainer.fit(
        train_data=_source(job, ctx, job.train_source),
        eval_data=_source(job, ctx, job.eval_source),
        valid_data=_source(job, ctx, job.valid_source),
    )
    logger.info("worker %d finished after %d steps", ctx.rank, trainer.step)


def _source(job: WorkerJob, ctx: Any, description: SourceDescription | None) -> WorkerSource | None:
    """This worker's share of a data set the driver described (None: no such data set)."""
    if description is None:
        return None
    return WorkerSource(
        description.row_groups,
        job.spec.data,
        source_path=description.path,
        rank=ctx.rank,
        world_size=ctx.world_size,
        seed=job.spec.training.seed,
        shuffle=description.shuffle,
        num_actors=description.num_actors,
        schema=description.schema,
        quarantine_tag=description.quarantine_tag,
    )
