"""The per-worker training loop.

Every Ray Train worker runs :func:`~raydlrm.trainers.worker_entry.train_loop_per_worker`, which
drives a :class:`Trainer`: build the model with its tables on
the meta device, shard it with the plan the driver made (each rank creates only its own shards,
from the seed), then stream batches from this worker's split of the data: forward, loss,
backward (the embedding rows are updated inside the backward by the kernel's fused optimizer),
dense optimizer step.

The loop reads top to bottom in :meth:`Trainer._train`; each cadence belongs to its owner:
when to log (:class:`~raydlrm.trainers.metrics.MetricsWindow`), when to evaluate
(:class:`~raydlrm.trainers.evaluation.Evaluator`), when to validate and stop early
(:class:`~raydlrm.trainers.validation.Validation`: an epoch's end is a None between its
batches), when to checkpoint (:class:`~raydlrm.trainers.checkpoint_cadence.Checkpointer`).
The final checkpoint (its shards are also the model's weights) is stored *before* the final
evaluation, so nothing there can lose a finished run: a worker dying in it is restarted from
that checkpoint and redoes only the evaluation. The evaluation's metrics go into the stored
checkpoint (``final_metrics.json``) and a last, metrics-only report.

A run restarted by Ray Train after a worker died, or submitted again under the same name, loads
its latest checkpoint and continues from its step with the data position it had, so every
sample is trained on once and, with the same world size, the final weights are those of a run
that was never interrupted.

Sharded embeddings make every forward pass a collective (all-to-all), so all ranks must run the
same number of steps: a rank that ran dry steps with an empty batch until every rank is done
(:mod:`raydlrm.trainers.pipeline`, which also runs the next batch's input all-to-all during the
current step with ``training.pipeline = "sparse_dist"``). Every row of the epoch is trained on.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from raydlrm.batch import Batch
from raydlrm.ids import DAY_SHIFT
from raydlrm.ingestion.loader import iter_train_batches
from raydlrm.ingestion.reader import EpochProgress
from raydlrm.models import RecModel, build_model
from raydlrm.models.managed_ids import LAST
from raydlrm.sharding import ShardingPlan, shard_model
from raydlrm.sharding.parallelize import unwrap_dense
from raydlrm.sharding.telemetry import Family, local_counters, metrics_of
from raydlrm.sharding.topology import Topology
from raydlrm.trainers._dist import all_reduce_scalar, sum_over_ranks, world_size
from raydlrm.trainers.checkpoint_cadence import Checkpointer
from raydlrm.trainers.checkpoints import TrainingParts
from raydlrm.trainers.config import TrainingConfig
from raydlrm.trainers.evaluation import EVAL_STEP, Evaluator
from raydlrm.trainers.hooks import TrainerHook, default_hooks
from raydlrm.trainers.metrics import MetricsWindow, StepClock, check_finite
from raydlrm.trainers.model_dir import FINAL_METRICS_FILE
from raydlrm.trainers.objective import objective, step_draws
from raydlrm.trainers.pipeline import Lockstep, SparseDistPipeline
from raydlrm.trainers.precision import DensePrecision
from raydlrm.trainers.reporting import Reporter, ReportFn
from raydlrm.trainers.sources import BatchSource, EpochSource, empty_batch_of
from raydlrm.trainers.spec import WorkerSpec
from raydlrm.trainers.validation import Validation

__all__ = ["STOPPED_EARLY", "StepResult", "Trainer"]

STOPPED_EARLY = "early_stopping/stopped_early"
"""A final metric, 1 when early stopping ended training before its epochs' data ran out (absent
otherwise: a patience spent at the last evaluation cut nothing)."""

logger = logging.getLogger(__name__)


@dataclass
class StepResult:
    """What one training step produced."""

    logits: torch.Tensor | None
    """Detached logits, shape ``(B,)`` (None: a retrieval model's step)."""
    loss: torch.Tensor
    """This rank's mean loss over the batch (detached, 0-d, on the device: reading it is a
    host synchronization on a GPU)."""


@dataclass
class FinishedRun:
    """The run's final checkpoint, loaded to redo the final evaluation only."""

    step: int
    metrics: dict[str, Any]  # the checkpoint's (final training) metrics
    checkpoint: Any  # where it is stored (a Ray Train checkpoint), or None


class Trainer:
    """The state of one worker's training: the sharded model, the dense optimizer, counters.

    Args:
        spec: data, model, sharding and training configs.
        plan: the sharding plan (the same on every rank).
        rank: this worker's rank.
        device: this worker's device.
        hooks: called at the loop's moments (default: those the config asks for, without an
            injected fault, which needs the run's marker path:
            :func:`~raydlrm.trainers.worker_entry.train_loop_per_worker`).
        report: called as ``report(metrics, checkpoint_dir=...)`` on every rank (default: Ray
            Train's, through ``raydlrm.trainers._ray``).
        storage: where the run's checkpoints are stored (for messages).
        topology: the hosts of the ranks (:class:`~raydlrm.sharding.topology.Topology`; None:
            one host), which :func:`~raydlrm.sharding.shard_model` places the model on.
    """

    def __init__(
        self,
        spec: WorkerSpec,
        *,
        plan: ShardingPlan,
        rank: int,
        device: torch.device,
        hooks: Sequence[TrainerHook] | None = None,
        report: ReportFn | None = None,
        storage: str | None = None,
        topology: Topology | None = None,
    ):
        self.spec, self.plan, self.rank = spec, plan, rank
        self.topology = topology
        self.device = torch.device(device)
        torch.set_num_threads(spec.training.torch_threads)
        self.model = self._sharded_model()
        self.optimizer = _dense_optimizer(self.model, spec.training, self.device)
        self.precision = DensePrecision(spec.training, self.model, self.device)
        self.step, self.epoch, self.samples_seen = 0, 0, 0  # samples: global, all ranks
        self._pending_samples = 0  # trained here, not yet added to samples_seen
        self.clock = StepClock()
        self.progress = EpochProgress(0)  # this rank's trained rows of the current epoch
        self.resume: EpochProgress | None = None  # all ranks' progress at the loaded checkpoint
        self.resume_world_size: int | None = None
        self.finished: FinishedRun | None = None  # the loaded checkpoint is the run's final one
        self.stopped_early = False  # early stopping ended training before its data did
        self.hooks = list(default_hooks(spec) if hooks is None else hooks)
        self.draw_seed = spec.training.seed  # a sequence model's draws (step_draws)
        self.window = MetricsWindow(
            every=spec.training.log_every_steps,
            device=self.device,
            rank=rank,
            clicks=not spec.model.retrieval,  # a retrieval model's steps have no logits
        )
        self.reporter = Reporter(
            report or _ray_report, rank=rank, log_every_steps=spec.training.log_every_steps
        )
        self.checkpointer = Checkpointer(
            config=spec.checkpoint,
            parts=self.parts(),
            reporter=self.reporter,
            hooks=self.hooks,
            device=self.device,
            storage=storage,
        )
        # Its data is given to fit; its state (early stopping) is loaded before that.
        self.validation = Validation(
            Evaluator(
                self.model,
                data=None,
                spec=spec,
                device=self.device,
                rank=rank,
                prefix="valid/",
                every=spec.training.valid_every_steps,
            ),
            config=spec.training,
        )

    def _sharded_model(self) -> RecModel:
        # The tables stay on the meta device: each rank creates only its own shards, block by
        # block from the seed, with the values of the unsharded tables (scale: no rank ever
        # holds a table it does not own). Same seed on every rank: DDP starts from agreeing
        # dense replicas.
        spec = self.spec
        torch.manual_seed(spec.training.seed)
        model = build_model(
            spec.model,
            tables=spec.tables(),
            num_dense=spec.data.num_dense_inputs(),
            embedding_device="meta",
            seed=spec.training.seed,
            **spec.sequence_inputs(),
        )
        sharded = shard_model(
            model,
            plan=self.plan,
            config=spec.sharding,
            device=self.device,
            topology=self.topology,
            # Columns are features: the data's dedup groups are the model's.
            dedup_groups=spec.data.dedup_groups,
        )
        sharded.embedding_bags.managed_day = spec.data.data_day()  # managed tables' ttl_days
        return sharded

    def parts(self) -> TrainingParts:
        """What a training checkpoint of this worker holds (by reference)."""
        return TrainingParts(
            spec=self.spec,
            plan=self.plan,
            rank=self.rank,
            collection=self.model.embedding_bags,
            dense=unwrap_dense(self.model),
            optimizer=self.optimizer,
        )

    def state_dict(self) -> dict[str, Any]:
        """The loop's own state, beside the model's and the optimizers' (which checkpoints
        hold as tensors): ``step``, ``epoch``, ``samples_seen`` (all ranks) and
        ``train_seconds``; ``precision`` with fp16 (the loss scaler) and ``validation`` with a
        validation set (its last evaluation, early stopping)."""
        state = {
            "step": self.step,
            "epoch": self.epoch,
            "samples_seen": self.samples_seen,
            "train_seconds": self.clock.train_seconds,
        }
        if precision := self.precision.state_dict():  # fp16: the loss scaler
            state["precision"] = precision
        if self.validation.active:
            state["validation"] = self.validation.state_dict()
        if self.spec.model.reads_sequences:  # what a step's draws derive from
            state["draw_seed"] = self.draw_seed
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores what :meth:`state_dict` returned (other keys are ignored)."""
        self.step = int(state["step"])
        self.epoch = int(state["epoch"])
        self.samples_seen = int(state["samples_seen"])
        self.clock.train_seconds = float(state["train_seconds"])
        self.precision.load_state_dict(state.get("precision", {}))
        self.draw_seed = int(state.get("draw_seed", self.draw_seed))

    def load(self, directory: str, *, stored: Any = None) -> None:
        """Continues from a training checkpoint (any world size or plan); all ranks.
        ``stored`` is the checkpoint in the run storage (``directory`` may be a local copy):
        when it is the run's final checkpoint, the final evaluation's metrics go there.

        The reports that follow carry ``restore/from_step`` and ``restore/load_seconds``."""
        started = time.perf_counter()
        restored = self.checkpointer.load(directory, stored=stored)
        self.load_state_dict(restored.loop_state)
        self.validation.load_state_dict(restored.loop_state.get("validation", {}), stored=stored)
        if restored.final_metrics is not None:
            self.finished = FinishedRun(self.step, restored.final_metrics, stored)
        self.resume, self.resume_world_size = restored.position, restored.world_size
        self._keep_managed_clock()
        self.reporter.note(
            {
                "restore/from_step": float(self.step),
                "restore/load_seconds": time.perf_counter() - started,
            }
        )
        logger.info(
            "rank %d resumed from %s: step %d, epoch %d, %d rows of the epoch trained",
            self.rank,
            directory,
            self.step,
            self.epoch,
            sum(self.resume.consumed.values()),
        )

    def warm_start(self, directory: str, *, stored: Any = None) -> None:
        """Starts from another run's training checkpoint (any world size or plan): its
        embedding tables, dense weights and optimizer states (fused and dense); the step,
        epoch, sample count, data position and random state start afresh, as for a new run.
        All ranks. The reports that follow carry ``warm_start/from_step``."""
        step = self.checkpointer.warm_start(directory, stored=stored)
        self._keep_managed_clock()
        self.reporter.note({"warm_start/from_step": float(step)})
        logger.info("rank %d warm-started from %s (step %d of its run)", self.rank, directory, step)

    def _keep_managed_clock(self) -> None:
        """The managed tables' clock never goes back (all ranks): loaded maps whose newest
        lookup is on a later data day than the job's (a warm start without
        ``data.data_date``, a backfill of an older slot) keep that day, so LRU still sees the
        loaded rows as older than this run's lookups and ``ttl_days`` ages stay positive.
        Their steps go on from the checkpoint's."""
        if not any(t.buckets for t in self.plan.tables):
            return
        collection = self.model.embedding_bags
        last = [int(m.state[LAST].max()) for m in collection.id_maps().values() if m.rows]
        newest = int(
            all_reduce_scalar(float(max(last, default=0) >> DAY_SHIFT), self.device, op="max")
        )
        if newest > collection.managed_day:
            if self.rank == 0:
                logger.warning(
                    "managed tables: the loaded id maps were last looked up on data day %d, "
                    "after this run's (data.data_date: %s); their clock stays on day %d (it "
                    "never goes back)",
                    newest,
                    self.spec.data.data_date,
                    newest,
                )
            collection.managed_day = newest

    def train_step(self, batch: Batch) -> StepResult:
        """One optimization step on ``batch``; returns its logits and mean loss."""
        self.model.train()
        self.precision.begin_step()
        draws = None
        if self.spec.model.reads_sequences:  # dropout, sampled negatives
            draws = step_draws(self.draw_seed, step=self.step, rank=self.rank)
        step = objective(self.model, batch, spec=self.spec, draws=draws)
        self.optimizer.zero_grad(set_to_none=True)
        # The backward pass also applies the fused embedding optimizer.
        self.precision.backward_and_step(step.minimized, self.optimizer)
        self.step += 1
        loss = step.loss.detach()
        # On a GPU the loss stays there (no synchronization inside a step): the metrics window
        # checks it at log steps and before checkpoints.
        if self.device.type == "cpu":
            check_finite(float(loss), rank=self.rank, when=f"step {self.step}")
        logits = None if step.logits is None else step.logits.detach()
        return StepResult(logits=logits, loss=loss)

    def fit(
        self,
        *,
        train_data: BatchSource,
        eval_data: BatchSource | None,
        valid_data: BatchSource | None = None,
    ) -> dict[str, Any]:
        """Trains for the configured epochs or steps, or until early stopping stops it;
        returns the final metrics.

        Args:
            train_data: this worker's stream of training data (an :class:`EpochSource`, or any
                :class:`BatchSource` such as a Ray ``DataIterator``), iterated once per epoch.
            eval_data: the same for held-out data, or None.
            valid_data: the same for the validation set, or None.

        Raises:
            ValueError: ``training.early_stopping`` without ``valid_data``.
        """
        if valid_data is None and self.validation.stopping is not None:
            raise ValueError(
                "training.early_stopping needs a validation set (data.valid_path or "
                "data.valid_split)"
            )
        self.validation.evaluator.data = valid_data
        evaluator = Evaluator(
            self.model, data=eval_data, spec=self.spec, device=self.device, rank=self.rank
        )
        # Every rank makes its pipeline here (a collective when it has a process group).
        if self.spec.training.pipeline == "sparse_dist":
            stream: Lockstep = SparseDistPipeline(self.model, device=self.device, rank=self.rank)
        else:
            stream = Lockstep(device=self.device, rank=self.rank)
        try:
            self._train(train_data, stream=stream, evaluator=evaluator)
            return self._finish(evaluator)
        finally:
            stream.close()

    def _train(self, train_data: BatchSource, *, stream: Lockstep, evaluator: Evaluator) -> None:
        """Every step of the run, with its log steps, evaluations and checkpoints."""
        for batch in self._batches(train_data, stream):
            if batch is None:  # an epoch's end
                if self.validation.due_at_epoch_end(self.step):
                    self._validate({}, cadence=False)
                continue
            self._train_on(batch)
            log_step = self.window.should_log(self.step)
            metrics = (
                {**self.window.compute(step=self.step), **self.precision.metrics()}
                if log_step
                else {}
            )
            if evaluator.should_evaluate(self.step):
                # eval/step: which evaluation the eval/* metrics of later reports come from.
                metrics.update({**evaluator.run(), EVAL_STEP: self.step})
            if log_step:
                metrics.update(self._tier_metrics())  # the evaluation's lookups included
            if self.validation.due(self.step):
                self._validate(metrics, cadence=True, log_step=log_step)
            elif self.checkpointer.should_save(self.step, log_step=log_step):
                self._checkpoint(metrics)
            elif metrics:
                self.reporter.report(metrics, loop_state=self.state_dict())
            self.clock.restart()

    def _validate(
        self, metrics: dict[str, float], *, cadence: bool, log_step: bool = False
    ) -> None:
        """Evaluates on the validation set and reports it with ``metrics``: in a checkpoint
        when it is the best so far (early stopping ends with it) or, with ``cadence``, when
        the checkpoint cadence asks for one at this step."""
        valid, improved = self.validation.run(self.step)
        metrics = {**metrics, **valid}
        if improved or (cadence and self.checkpointer.should_save(self.step, log_step=log_step)):
            stored = self._checkpoint(metrics)
            if improved:
                self.validation.stored(stored)
        else:
            self.reporter.report(metrics, loop_state=self.state_dict())
        self.clock.restart()

    def _batches(self, train_data: BatchSource, stream: Lockstep) -> Iterator[Batch | None]:
        """The run's batches, epoch after epoch, each epoch followed by None (its end), until
        the last epoch, ``max_steps`` or early stopping."""
        for epoch in range(self.epoch, self.spec.training.num_epochs):
            if self._done():
                self.stopped_early = self.validation.stopped  # an epoch left unread
                return
            self._start_epoch(epoch, train_data)
            self.clock.restart()
            batches = iter_train_batches(train_data, config=self.spec.data, track_rows=True)
            empty = empty_batch_of(train_data, config=self.spec.data)
            with contextlib.closing(stream(batches, empty)) as steps:
                for batch in steps:
                    self.clock.batch_arrived()
                    yield batch
                    if self._done():
                        self.stopped_early = self.validation.stopped  # rows left unread
                        return
            yield None

    def _start_epoch(self, epoch: int, train_data: BatchSource) -> None:
        self.epoch = epoch
        self.window.start_epoch()
        resume = self.resume if self.resume is not None and self.resume.epoch == epoch else None
        # Each rank starts from the progress of every rank (merging takes the maximum). The
        # source says what the epoch is read from: a resumed one, its files and window.
        if isinstance(train_data, EpochSource):
            self.progress = train_data.start(
                epoch, resume=resume, world_size=self.resume_world_size
            )
        elif resume is not None:
            self.progress = EpochProgress.merged([resume])
        else:
            window = self.spec.data.shuffle_window_rows
            self.progress = EpochProgress(epoch, window_rows=window)

    def _train_on(self, batch: Batch) -> None:
        result = self.train_step(batch)
        self.progress.add(batch.row_groups or {})  # trained: in the next checkpoint
        self._pending_samples += batch.batch_size
        seconds = self.clock.step_done()
        for hook in self.hooks:
            hook(
                "step",
                rank=self.rank,
                step=self.step,
                epoch=self.epoch,
                batch=batch,
                loss=result.loss,
                samples_seen=self.samples_seen,
            )
        self.window.add(
            logits=result.logits, labels=batch.labels, loss=result.loss, seconds=seconds
        )

    def _tier_metrics(self) -> dict[str, float]:
        """The SSD tier's and the managed tables' metrics (none, and no collective, without
        ``ssd`` or managed tables: the plan is the same on every rank)."""
        families: list[Family] = []
        if any(t.placement == "ssd" for t in self.plan.tables):
            families.append("tier")
        if any(t.buckets for t in self.plan.tables):
            families.append("managed")
        return self._telemetry(*families) if families else {}

    def _checkpoint(self, metrics: dict[str, float], *, final: bool = False) -> Any:
        self.window.check_finite(step=self.step)  # no checkpoint of a diverged model
        self._flush_samples()
        self.checkpointer.protected = self.validation.protected()
        return self.checkpointer.save(
            metrics, loop_state=self.state_dict(), progress=self.progress, final=final
        )

    def _finish(self, evaluator: Evaluator) -> dict[str, Any]:
        """The final checkpoint (unless it was loaded: a worker died in the final evaluation,
        and every rank loaded it), then the final evaluation."""
        if self.finished is not None and self.step == self.finished.step:
            self.window.check_finite(step=self.step)
            final, persisted = dict(self.finished.metrics), self.finished.checkpoint
        else:
            self._end_validation()
            final = {
                **self.window.epoch_metrics(),
                **self._run_metrics(),
                **self.validation.final_metrics(),
            }
            if self.stopped_early:
                final[STOPPED_EARLY] = 1.0
            persisted = self._checkpoint(final, final=True)
        if evaluator.data is None:
            return final
        for hook in self.hooks:
            hook("eval", rank=self.rank, step=self.step)
        final.update(evaluator.final())
        final.update(self._telemetry("comm"))  # the evaluation's all-to-alls included
        if self.rank == 0 and persisted is not None:
            # Ray Train's result holds the metrics of the last checkpoint report: the final
            # evaluation's go into the checkpoint (beside the files its manifests cover).
            _seam().add_file(persisted, FINAL_METRICS_FILE, json.dumps(final, sort_keys=True))
        self.reporter.report(final, loop_state=self.state_dict())
        return final

    def _end_validation(self) -> None:
        """The last evaluation on the validation set, if the last one was earlier; with early
        stopping, the best checkpoint's weights loaded (all ranks) for the final checkpoint
        and evaluation, when they are not the current ones."""
        if self.validation.due_at_end(self.step):
            valid, _ = self.validation.run(self.step)
            self.reporter.note(valid)
        best = self.validation.best_checkpoint(self.step)
        if best is None:
            return
        with best.as_directory() as directory:
            self.checkpointer.warm_start(directory, stored=best)
        self.checkpointer.restart_chain()  # the final checkpoint holds every row
        if self.rank == 0:
            assert self.validation.stopping is not None
            logger.info(
                "the run ends with the weights of step %s, its best %s (%.6f), not step %d's",
                self.validation.stopping.best_step,
                self.validation.stopping.config.metric,
                self.validation.stopping.best,
                self.step,
            )

    def _run_metrics(self) -> dict[str, float]:
        """Throughput over the whole run, start-up, and the collection's telemetry."""
        self._flush_samples()
        train_seconds = all_reduce_scalar(self.clock.train_seconds, self.device, op="max")
        first_batch = self.clock.first_batch_seconds or 0.0
        return {
            "train/samples_per_second": self.samples_seen / max(train_seconds, 1e-9),
            "data/first_batch_seconds": all_reduce_scalar(first_batch, self.device, op="max"),
            **self._telemetry("comm", "kernel", "dedup", "tier", "managed"),
            **self.precision.metrics(),
        }

    def _telemetry(self, *families: Family) -> dict[str, float]:
        """The collection's metrics over all ranks (:mod:`raydlrm.sharding.telemetry`)."""
        local = local_counters(self.model.embedding_bags, families=families)
        return metrics_of(sum_over_ranks(local, self.device), world_size=world_size())

    def _done(self) -> bool:
        max_steps = self.spec.training.max_steps
        return self.validation.stopped or (max_steps is not None and self.step >= max_steps)

    def _flush_samples(self) -> None:
        self.samples_seen += int(all_reduce_scalar(float(self._pending_samples), self.device))
        self._pending_samples = 0


def _dense_optimizer(
    model: RecModel, config: TrainingConfig, device: torch.device
) -> torch.optim.Optimizer:
    """The optimizer of the dense parameters (``training.dense_optimizer``): the unsharded
    model's dense part (:func:`~raydlrm.sharding.parallelize.unwrap_dense`), which may hold
    modules that the sharded collection runs and syncs outside the dense side's DDP. On a GPU,
    Adam and SGD run torch's fused kernels (one launch a step for all parameters), Adagrad its
    multi-tensor (``foreach``) one; on CPU, torch's defaults."""
    params = list(unwrap_dense(model).parameters())
    fused = {"fused": True} if device.type == "cuda" else {}
    if config.dense_optimizer == "adam":
        return torch.optim.Adam(params, lr=config.learning_rate, **fused)
    if config.dense_optimizer == "adagrad":
        return torch.optim.Adagrad(params, lr=config.learning_rate)
    return torch.optim.SGD(params, lr=config.learning_rate, **fused)


def _seam() -> Any:
    """The one module that talks to Ray Train, imported when first needed: processes that
    drive a :class:`Trainer` themselves (gloo tests, tools) never pay for ``ray.train``."""
    from raydlrm.trainers import _ray

    return _ray


def _ray_report(metrics: dict[str, Any], *, checkpoint_dir: str | None = None) -> Any:
    return _seam().report(metrics, checkpoint_dir=checkpoint_dir)
