"""The per-worker training loop.

Every Ray Train worker runs :func:`train_loop_per_worker`: build the model with its tables on
the meta device, shard it with the plan the driver made (each rank creates only its own shards,
from the seed), then stream batches from this worker's split of the data: forward, loss,
backward (the embedding rows are updated inside the backward by fbgemm's fused optimizer),
dense optimizer step. Metrics are computed over all
workers and reported every ``log_every_steps``; the held-out set is evaluated every
``eval_every_steps`` and at the end. The final checkpoint (its shards are also the model's
weights: exported table by table, never gathered on one rank) is stored *before* the final
evaluation, so nothing there can lose a finished run: a worker dying in it is restarted from
that checkpoint and redoes only the evaluation, and a reading error of the held-out data ends
the evaluation on every rank alike with its error line (``eval/error``). The evaluation's
metrics go into the stored checkpoint (``final_metrics.json``) and a last, metrics-only report.

Checkpoints (``[checkpoint]``, by steps or minutes, and always at the end) hold the whole
training state (``raydlrm.trainers.state``): a run restarted by Ray Train after a worker died,
or submitted again under the same name, loads the latest one and continues from its step with
the data position it had, so every sample is trained on once and, with the same world size,
the final weights are those of a run that was never interrupted.

Sharded embeddings make every forward pass a collective (all-to-all), so all ranks must run the
same number of steps. Workers read whole row groups (``raydlrm.ingestion.reader``), so their
row counts differ a little; before each step the loop checks whether any rank still has a
batch, and a rank that ran dry steps with an empty batch (its loss and gradients are zero) until
every rank is done. Every row of the epoch is trained on; none is dropped. With
``training.pipeline = "sparse_dist"`` that check, the next batch's copy to the device and its
input all-to-all run in the background during the current step (``raydlrm.trainers.pipeline``).
"""

from __future__ import annotations

import json
import logging
import math
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
import pyarrow as pa
import torch
import torch.distributed as dist

from raydlrm._logs import configure_worker
from raydlrm.batch import Batch
from raydlrm.ingestion.loader import arrow_to_batch, iter_train_batches
from raydlrm.ingestion.reader import EpochProgress, WorkerSource
from raydlrm.ingestion.schema import RowGroup
from raydlrm.models import RecModel, build_model
from raydlrm.sharding import ShardingPlan, shard_model
from raydlrm.sharding.tiers import major_page_faults, resident_bytes
from raydlrm.trainers.checkpoint import FINAL_METRICS_FILE, METRICS_FILE, save_model_metadata
from raydlrm.trainers.hooks import Moment, TrainerHook, default_hooks
from raydlrm.trainers.metrics import PredictionBuffer
from raydlrm.trainers.pipeline import Lockstep, SparseDistPipeline
from raydlrm.trainers.spec import SourceDescription, WorkerJob, WorkerSpec
from raydlrm.trainers.state import (
    dense_module,
    load_training_state,
    save_training_state,
    verify_checkpoint,
)

__all__ = ["StepResult", "Trainer", "train_loop_per_worker"]

logger = logging.getLogger(__name__)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _all_reduce_scalar(
    value: float, device: torch.device, *, op: dist.ReduceOp = dist.ReduceOp.SUM
) -> float:
    """``value`` reduced over all ranks (``value`` itself without a process group)."""
    if not _distributed():
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return float(t.item())


@runtime_checkable
class BatchSource(Protocol):
    """A worker's stream of preprocessed Arrow batches (a Ray ``DataIterator`` is one)."""

    def iter_batches(self, **kwargs: Any) -> Iterator[pa.Table]: ...


@runtime_checkable
class EpochSource(BatchSource, Protocol):
    """A source that knows epochs (``raydlrm.ingestion.reader.WorkerSource``): it deals each
    epoch's row groups (resuming from a data position) and makes empty batches of its schema
    (for a rank whose data ends before the others')."""

    def start(
        self, epoch: int, *, resume: EpochProgress | None, world_size: int | None
    ) -> None: ...

    def empty_table(self) -> pa.Table: ...


@dataclass
class StepResult:
    """What one training step produced."""

    logits: torch.Tensor
    """Detached logits, shape ``(B,)``."""
    loss: torch.Tensor
    """This rank's mean loss over the batch (detached, 0-d, on the device: reading it is a
    host synchronization on a GPU)."""


_OVERHEAD_REPORTS = 3
"""Metrics reports timed before the report overhead is judged (the first may wait for the
controller's start)."""


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
    """

    def __init__(self, spec: WorkerSpec, *, plan: ShardingPlan, rank: int, device: torch.device):
        self.spec = spec
        self.plan = plan
        self.rank = rank
        self.device = torch.device(device)
        cfg = spec.training
        torch.set_num_threads(cfg.torch_threads)
        # The tables stay on the meta device: each rank creates only its own shards, block by
        # block from the seed, with the values of the unsharded tables (scale: no rank ever
        # holds a table it does not own). Same seed on every rank: DDP starts from agreeing
        # dense replicas.
        torch.manual_seed(cfg.seed)
        model = build_model(
            spec.model,
            tables=spec.tables(),
            num_dense=len(spec.data.dense_columns),
            embedding_device="meta",
            seed=cfg.seed,
        )
        self.model: RecModel = shard_model(
            model,
            plan=plan,
            config=spec.sharding,
            device=self.device,
            # Columns are features: the data's dedup groups are the model's.
            dedup_groups=spec.data.dedup_groups,
        )
        dense_params = list(self.model.dense.parameters())
        if cfg.dense_optimizer == "adam":
            self.optimizer: torch.optim.Optimizer = torch.optim.Adam(
                dense_params, lr=cfg.learning_rate
            )
        elif cfg.dense_optimizer == "adagrad":
            self.optimizer = torch.optim.Adagrad(dense_params, lr=cfg.learning_rate)
        else:
            self.optimizer = torch.optim.SGD(dense_params, lr=cfg.learning_rate)
        self.step = 0
        self.epoch = 0
        self.samples_seen = 0  # global, all ranks
        self.train_seconds = 0.0  # steady-state training wall time (excludes first batch)
        self.first_batch_seconds: float | None = None
        self.progress = EpochProgress(0)  # this rank's trained rows of the current epoch
        self.resume: EpochProgress | None = None  # all ranks' progress at the loaded checkpoint
        self.resume_world_size: int | None = None
        # Called after each step, at checkpoints and before the final evaluation (the sample
        # audit; the injected fault, once the run's marker path is known: train_loop_per_worker).
        self.hooks: list[TrainerHook] = default_hooks(spec, fault_marker=None, fault_storage=None)
        self._pending_samples = 0  # trained here, not yet added to samples_seen
        self._last_metrics: dict[str, float] = {}
        self._last_checkpoint = time.monotonic()
        self._report_seconds: list[float] = []  # wall time of each metrics-only report
        self._overhead_warned = False
        # Set when the loaded checkpoint is the run's final one (see fit).
        self.finished: FinishedRun | None = None

    def state_dict(self) -> dict[str, Any]:
        """The loop's own state, beside the model's and the optimizers' (which checkpoints
        hold as tensors): ``step``, ``epoch``, ``samples_seen`` (all ranks) and
        ``train_seconds``."""
        return {
            "step": self.step,
            "epoch": self.epoch,
            "samples_seen": self.samples_seen,
            "train_seconds": self.train_seconds,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores what :meth:`state_dict` returned (other keys are ignored)."""
        self.step = int(state["step"])
        self.epoch = int(state["epoch"])
        self.samples_seen = int(state["samples_seen"])
        self.train_seconds = float(state["train_seconds"])

    def load(self, directory: str, *, stored: Any = None) -> None:
        """Continues from a training-state checkpoint (any world size or plan); all ranks.
        ``stored`` is the checkpoint in the run storage (``directory`` may be a local copy):
        when it is the run's final checkpoint, the final evaluation's metrics go there.

        The reports that follow carry ``restore/from_step`` and ``restore/load_seconds``."""
        started = time.perf_counter()
        state = load_training_state(self, directory)
        metrics_file = Path(directory, METRICS_FILE)
        if metrics_file.is_file():  # only final checkpoints hold the model's metadata
            metrics = json.loads(metrics_file.read_text())
            self.finished = FinishedRun(step=self.step, metrics=metrics, checkpoint=stored)
        self._last_metrics["restore/from_step"] = float(self.step)
        self._last_metrics["restore/load_seconds"] = time.perf_counter() - started
        self.resume = EpochProgress.from_dict(state["position"])
        self.resume_world_size = state["world_size"]
        logger.info(
            "rank %d resumed from %s: step %d, epoch %d, %d rows of the epoch trained",
            self.rank,
            directory,
            self.step,
            self.epoch,
            sum(self.resume.consumed.values()),
        )

    def warm_start(self, directory: str) -> None:
        """Starts from another run's training-state checkpoint (any world size or plan): its
        embedding tables, dense weights and optimizer states (fused and dense); the step,
        epoch, sample count, data position and random state start afresh, as for a new run.
        All ranks. The reports that follow carry ``warm_start/from_step``."""
        state = load_training_state(self, directory)
        self._last_metrics["warm_start/from_step"] = float(state["step"])
        self.load_state_dict({"step": 0, "epoch": 0, "samples_seen": 0, "train_seconds": 0.0})
        torch.manual_seed(self.spec.training.seed)
        logger.info(
            "rank %d warm-started from %s (step %d of its run)", self.rank, directory, state["step"]
        )

    def train_step(self, batch: Batch) -> StepResult:
        """One optimization step on ``batch``; returns its logits and mean loss."""
        self.model.train()
        logits = self.model(batch)
        # The mean over this rank's samples, written so that an empty batch (a rank that ran
        # dry while others still train) has loss 0 and zero gradients rather than NaN.
        loss = torch.nn.functional.binary_cross_entropy_with_logits(
            logits, batch.labels, reduction="sum"
        ) / max(batch.batch_size, 1)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()  # also applies the fused embedding optimizer
        self.optimizer.step()
        self.step += 1
        loss = loss.detach()
        # On a GPU the loss stays there (no synchronization inside a step): it is checked when
        # the metrics are reported.
        if self.device.type == "cpu":
            self._check_finite(float(loss), f"step {self.step}")
        return StepResult(logits=logits.detach(), loss=loss)

    def _check_finite(self, loss: float, when: str) -> None:
        if not math.isfinite(loss):
            raise FloatingPointError(
                f"training diverged: rank {self.rank} {when} loss is {loss} (lower "
                "training.learning_rate or sharding.learning_rate)"
            )

    @torch.no_grad()
    def evaluate(
        self,
        batches: Iterable[Batch],
        empty: Batch | None = None,
        errors: list[str] | None = None,
    ) -> dict[str, float]:
        """Metrics of the model on ``batches`` over all ranks (prefix ``eval/``); ``empty`` is
        an empty batch for a rank without data, ``errors`` collects reading errors instead of
        raising them (see :class:`Lockstep`)."""
        self.model.eval()
        buffer = PredictionBuffer()
        limit = self.spec.training.max_eval_batches
        stream = Lockstep(device=self.device, rank=self.rank)
        for i, batch in enumerate(stream(batches, empty, errors)):
            buffer.add(self.model(batch), batch.labels)
            if limit is not None and i + 1 >= limit:
                break
        return buffer.compute().to_dict("eval/")

    def fit(
        self, *, train_data: BatchSource, eval_data: BatchSource | None, report: Any = None
    ) -> dict[str, Any]:
        """Trains for the configured epochs or steps; returns the final metrics.

        Args:
            train_data: this worker's stream of training data (an :class:`EpochSource`, or any
                :class:`BatchSource` such as a Ray ``DataIterator``), iterated once per epoch.
            eval_data: the same for held-out data, or None.
            report: called as ``report(metrics, checkpoint_dir=...)`` on every rank (default:
                Ray Train's, through ``raydlrm.trainers._ray``).
        """
        if report is None:
            report = _seam().report
        cfg = self.spec.training
        # Every rank makes its pipeline here (a collective when it has a process group).
        if cfg.pipeline == "sparse_dist":
            stream: Lockstep = SparseDistPipeline(self.model, device=self.device, rank=self.rank)
        else:
            stream = Lockstep(device=self.device, rank=self.rank)
        try:
            return self._fit(train_data, eval_data, report=report, stream=stream)
        finally:
            stream.close()

    def _fit(
        self,
        train_data: BatchSource,
        eval_data: BatchSource | None,
        *,
        report: Any,
        stream: Lockstep,
    ) -> dict[str, Any]:
        cfg = self.spec.training
        window = PredictionBuffer()  # predictions since the last report
        epoch_buffer = PredictionBuffer()  # predictions of the current epoch
        window_loss = torch.zeros((), device=self.device)  # summed on the device
        window_steps, window_samples = 0, 0
        window_start = time.perf_counter()
        for epoch in range(self.epoch, cfg.num_epochs):
            if self._done():
                break
            self.epoch = epoch
            epoch_buffer = PredictionBuffer()
            resume = self.resume if self.resume is not None and self.resume.epoch == epoch else None
            # Each rank starts from the progress of every rank (merging takes the maximum).
            self.progress = EpochProgress.merged([resume]) if resume else EpochProgress(epoch)
            if isinstance(train_data, EpochSource):
                train_data.start(epoch, resume=resume, world_size=self.resume_world_size)
            last = time.perf_counter()
            batches = self._batches(train_data, track_rows=True)
            for batch in stream(batches, self._empty_batch(train_data)):
                if self.first_batch_seconds is None:
                    # Start-up of the data pipeline is reported apart from the steady state.
                    self.first_batch_seconds = time.perf_counter() - last
                    last = time.perf_counter()
                result = self.train_step(batch)
                self.progress.add(batch.row_groups or {})  # trained: in the next checkpoint
                # Wall time of the step including waiting for its batch (not eval or reports).
                self.train_seconds += time.perf_counter() - last
                self._call_hooks("step", batch)
                window.add(result.logits, batch.labels)
                epoch_buffer.add(result.logits, batch.labels)
                window_loss += result.loss
                window_steps += 1
                window_samples += batch.batch_size
                self._pending_samples += batch.batch_size
                metrics: dict[str, float] | None = None
                log_step = self.step % cfg.log_every_steps == 0
                if log_step:
                    mean_loss = float(window_loss) / window_steps
                    self._check_finite(
                        mean_loss, f"steps {self.step - window_steps + 1}-{self.step}"
                    )
                    samples = _all_reduce_scalar(float(window_samples), self.device)
                    epoch_buffer.offload()  # the epoch's predictions wait on the host
                    metrics = {
                        **window.compute().to_dict("train/"),
                        "train/loss": mean_loss,
                        "train/samples_per_second": samples
                        / max(time.perf_counter() - window_start, 1e-9),
                    }
                    if (
                        eval_data is not None
                        and cfg.eval_every_steps
                        and (self.step % cfg.eval_every_steps == 0)
                    ):
                        metrics.update(self._evaluate_data(eval_data))
                    metrics.update(self._tier_metrics())
                    window_loss = torch.zeros((), device=self.device)
                    window_steps, window_samples = 0, 0
                    window_start = time.perf_counter()
                if self._checkpoint_due(log_step):
                    # No checkpoint of a diverged model (on a GPU the loss is read only here
                    # and at log steps).
                    self._check_finite(float(window_loss), f"steps up to {self.step}")
                    self._report(metrics or {}, report=report, checkpoint=True)
                elif metrics is not None:
                    self._report(metrics, report=report)
                last = time.perf_counter()
                if self._done():
                    break
        self._flush_samples()
        self._check_finite(float(window_loss), f"steps up to {self.step}")
        if self.finished is not None and self.step == self.finished.step:
            # Resumed from this run's final checkpoint (a worker died in the final evaluation;
            # every rank loaded the same one): nothing was trained, the checkpoint and its
            # metrics stand; only the evaluation is redone.
            final, persisted = dict(self.finished.metrics), self.finished.checkpoint
        else:
            # Training metrics over the last epoch, throughput over the whole run.
            final = epoch_buffer.compute().to_dict("train/")
            final["train/samples_per_second"] = self.samples_seen / max(
                _all_reduce_scalar(self.train_seconds, self.device, op=dist.ReduceOp.MAX), 1e-9
            )
            final["data/first_batch_seconds"] = _all_reduce_scalar(
                self.first_batch_seconds or 0.0, self.device, op=dist.ReduceOp.MAX
            )
            final.update(self._comm_metrics())
            # Ranks on the torch kernel (sharding.kernel "auto" resolves per worker).
            torch_kernel = float(self.model.embedding_bags.kernel == "torch")
            final["sharding/torch_kernel_ranks"] = _all_reduce_scalar(torch_kernel, self.device)
            final.update(self._dedup_metrics())
            final.update(self._tier_metrics())
            # The finished training state first: nothing after it can lose the trained model.
            persisted = self._report(final, report=report, checkpoint=True, with_model=True)
        if eval_data is not None:
            self._call_hooks("eval")
            # A reading error ends the evaluation on every rank alike and is reported.
            final.update(self._final_evaluation(eval_data))
            final.update(self._comm_metrics())  # the evaluation's all-to-alls included
            if self.rank == 0 and persisted is not None:
                # Ray Train's result holds the metrics of the last checkpoint report: the final
                # evaluation's go into the checkpoint (beside the files its manifests cover).
                _seam().add_file(persisted, FINAL_METRICS_FILE, json.dumps(final, sort_keys=True))
            self._report(final, report=report)
        return final

    def _final_evaluation(self, data: Any) -> dict[str, Any]:
        """The final evaluation's metrics; if reading the held-out data failed on any rank,
        ``eval/error`` (the first rank's error line) instead, on every rank, so the driver can
        report it while the model, already checkpointed, is kept."""
        errors: list[str] = []
        metrics = self.evaluate(self._batches(data), self._empty_batch(data), errors)
        gathered = [errors]
        if _distributed():
            gathered = [[] for _ in range(dist.get_world_size())]
            dist.all_gather_object(gathered, errors)
        failed = [e for rank_errors in gathered for e in rank_errors]
        if failed:
            return {"eval/error": failed[0]}
        return metrics

    def _done(self) -> bool:
        max_steps = self.spec.training.max_steps
        return max_steps is not None and self.step >= max_steps

    def _flush_samples(self) -> None:
        self.samples_seen += int(_all_reduce_scalar(float(self._pending_samples), self.device))
        self._pending_samples = 0

    def _checkpoint_due(self, log_step: bool) -> bool:
        """Whether to write a checkpoint after this step (the same answer on every rank)."""
        cfg = self.spec.checkpoint
        if cfg.every_steps and self.step % cfg.every_steps == 0:
            return True
        if cfg.every_minutes and log_step:
            # Rank 0's clock decides, so that the ranks agree.
            elapsed = (time.monotonic() - self._last_checkpoint) / 60 if self.rank == 0 else 0.0
            elapsed = _all_reduce_scalar(elapsed, self.device, op=dist.ReduceOp.MAX)
            return elapsed >= cfg.every_minutes
        return False

    def _call_hooks(self, moment: Moment, batch: Batch | None = None) -> None:
        for hook in self.hooks:
            hook(self, moment, batch)

    def _comm_metrics(self) -> dict[str, float]:
        """Bytes all ranks sent each other through the embedding all-to-alls, by direction and
        codec (``comm/<direction>_<kind>_bytes``); a collective."""
        counts = self.model.embedding_bags.comm_bytes()
        names = sorted(
            f"comm/{direction}_{kind}_bytes"
            for direction in ("input", "forward", "backward")
            for kind in counts.get(direction, {})
        )
        if _distributed():  # every rank must reduce the same keys, in the same order
            gathered: list[list[str]] = [[] for _ in range(dist.get_world_size())]
            dist.all_gather_object(gathered, names)
            names = sorted({n for g in gathered for n in g})
        local = {
            f"comm/{direction}_{kind}_bytes": float(n)
            for direction, by_kind in counts.items()
            for kind, n in by_kind.items()
        }
        return {name: _all_reduce_scalar(local.get(name, 0.0), self.device) for name in names}

    def _tier_metrics(self) -> dict[str, float]:
        """For the tables on the SSD tier (none: no metrics): ``tier/<table>/resident_fraction``,
        the share of the table's rows (all ranks' shards) in its files that the page cache holds
        now; ``tier/<table>/cache_hit_rate``, for a table with a DRAM row cache, the share of
        the distinct ids looked up so far that were in it (all ranks); and
        ``tier/major_page_faults``, the reads from disk the workers waited for so far (the page
        cache's misses, summed over ranks); a collective."""
        ssd = [t.name for t in self.plan.tables if t.placement == "ssd"]
        if not ssd:
            return {}
        mine = {
            name: (resident_bytes(rows), rows.numel() * rows.element_size(), hits)
            for name, (rows, hits) in self.model.embedding_bags.ssd_tables().items()
        }
        gathered = [(mine, major_page_faults())]
        if _distributed():
            entry, gathered = gathered[0], [None] * dist.get_world_size()
            dist.all_gather_object(gathered, entry)
        metrics = {"tier/major_page_faults": float(sum(faults for _, faults in gathered))}
        for name in ssd:
            held = [per_rank[name] for per_rank, _ in gathered if name in per_rank]
            total = sum(size for _, size, _ in held)
            metrics[f"tier/{name}/resident_fraction"] = sum(r for r, _, _ in held) / max(total, 1)
            cached = [hits for _, _, hits in held if hits is not None]
            if cached:
                lookups = sum(n for _, n in cached)
                metrics[f"tier/{name}/cache_hit_rate"] = sum(h for h, _ in cached) / max(lookups, 1)
        return metrics

    def _dedup_metrics(self) -> dict[str, float]:
        """Per deduplicated table: ``dedup/<table>/ratio`` (samples per unique row, over all
        ranks), ``lookups_saved`` and ``a2a_bytes_saved`` (summed over ranks); a collective."""
        stats_of = getattr(self.model.embedding_bags, "dedup_stats", None)
        if stats_of is None:
            return {}
        metrics = {}
        for table, stats in sorted(stats_of().items()):
            for name in ("lookups_saved", "a2a_bytes_saved"):
                metrics[f"dedup/{table}/{name}"] = _all_reduce_scalar(stats[name], self.device)
            # The global ratio: the mean of the ranks' ratios (their batches are alike).
            world = dist.get_world_size() if _distributed() else 1
            ratio = _all_reduce_scalar(stats["ratio"], self.device) / world
            metrics[f"dedup/{table}/ratio"] = ratio
        return metrics

    def _batches(self, data: Any, *, track_rows: bool = False) -> Iterator[Batch]:
        return iter_train_batches(data, config=self.spec.data, track_rows=track_rows)

    def _evaluate_data(self, data: Any) -> dict[str, float]:
        return self.evaluate(self._batches(data), self._empty_batch(data))

    def _empty_batch(self, data: Any) -> Batch | None:
        """An empty batch of ``data``'s structure, if the source can make one."""
        if not isinstance(data, EpochSource):
            return None
        return arrow_to_batch(data.empty_table(), config=self.spec.data)

    def _report(
        self,
        metrics: dict[str, float],
        *,
        report: Any,
        checkpoint: bool = False,
        with_model: bool = False,
    ) -> Any:
        """Reports metrics from every rank; with ``checkpoint``, every rank writes its part of
        the training state (and, ``with_model``, rank 0 the model's config, plan and metrics)
        into a directory of its own, reported with the metrics (Ray Train merges the ranks'
        directories into one checkpoint, registered only once every rank's part is stored) and
        returns what ``report`` returns for it (where it is stored)."""
        if checkpoint:
            self._flush_samples()
        # The last value of every metric rides along, so that a checkpoint-only report still
        # carries the metric that ranks checkpoints.
        self._last_metrics.update(metrics)
        metrics = {
            **self._last_metrics,
            "step": self.step,
            "epoch": self.epoch,
            "samples_seen": self.samples_seen,
        }
        if self.rank == 0 and (not checkpoint or with_model or len(metrics) > 3):
            shown = ", ".join(
                f"{k}={v:.4f}"
                for k, v in metrics.items()
                if k in ("train/loss", "train/auc", "eval/auc", "eval/log_loss")
            )
            logger.info("step %d epoch %d: %s", self.step, self.epoch, shown)
        if not checkpoint:
            started = time.perf_counter()
            report(metrics, checkpoint_dir=None)
            self._check_report_overhead(time.perf_counter() - started)
            return None
        gathered: list[Any] = [self.progress.to_dict()]
        if _distributed():
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, self.progress.to_dict())
        position = EpochProgress.merged([EpochProgress.from_dict(g) for g in gathered]).to_dict()
        with tempfile.TemporaryDirectory(prefix="raydlrm-ckpt-") as tmp:
            if with_model and self.rank == 0:
                # The model's weights are the training state's shards (stored once); exporting
                # assembles them table by table (raydlrm.trainers.checkpoint).
                save_model_metadata(tmp, spec=self.spec, plan=self.plan, metrics=metrics)
            save_training_state(self, tmp, position=position)  # its manifest covers the dir
            self._call_hooks("checkpoint")
            stored = report(metrics, checkpoint_dir=tmp)
        self._last_checkpoint = time.monotonic()
        return stored

    def _check_report_overhead(self, seconds: float) -> None:
        """Warns once (rank 0) when metrics reports dominate the run (each takes longer than
        the training between two of them): Ray Train's report is a barrier across workers that
        the controller releases when it next polls them (``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S``:
        Ray's default 2 s, 0.5 s on a local instance raydlrm starts), so a report every few
        fast steps makes the run mostly waiting. Names the ``log_every_steps`` that would keep
        reports under a tenth of the run."""
        self._report_seconds.append(seconds)
        if self._overhead_warned or len(self._report_seconds) < _OVERHEAD_REPORTS:
            return
        self._overhead_warned = True
        every = self.spec.training.log_every_steps
        per_report = float(np.median(self._report_seconds))
        per_step = self.train_seconds / max(self.step, 1)
        if self.rank != 0 or per_report <= every * per_step:
            return
        logger.warning(
            "metrics reports take %.2f s each (Ray Train's report is a barrier its controller "
            "releases when it polls the workers) against %.2f s of training between them (%d "
            "steps of %.3f s): raise training.log_every_steps to at least %d to keep reports "
            "under 10%% of the run",
            per_report,
            every * per_step,
            every,
            per_step,
            math.ceil(9 * per_report / max(per_step, 1e-6)),
        )

    def unsharded_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The full, unsharded model state on rank 0 (None elsewhere); all ranks must call.

        Every table is gathered whole onto rank 0: for small models and tests (checkpoints and
        exports never do this; they stream the shards table by table).

        Keys are those of the unsharded :class:`RecModel`: ``embedding_bags.weights.<table>``
        and ``dense.*``.
        """
        tables = self.model.embedding_bags.gather_full_tables(dst=0)
        if self.rank != 0:
            return None
        dense = dense_module(self)
        state = {f"embedding_bags.weights.{name}": t.cpu() for name, t in tables.items()}
        state.update({f"dense.{k}": v.detach().cpu() for k, v in dense.state_dict().items()})
        return state


def _seam() -> Any:
    """The one module that talks to Ray Train, imported when first needed: processes that
    drive a :class:`Trainer` themselves (gloo tests, tools) never pay for ``ray.train``."""
    from raydlrm.trainers import _ray

    return _ray


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """Ray Train entry point: ``config`` is ``{"job": WorkerJob}`` (see :class:`WorkerJob`)."""
    job: WorkerJob = config["job"]
    configure_worker(job.log_level, job.library_log_level)
    _ray = _seam()
    _ray.configure_data_output(job.library_log_level)
    spec = job.spec
    plan = ShardingPlan.from_json(job.plan)
    ctx = _ray.worker_context()
    if plan.world_size != ctx.world_size:
        raise ValueError(
            f"the sharding plan is for {plan.world_size} workers but the job has {ctx.world_size}"
        )
    trainer = Trainer(spec, plan=plan, rank=ctx.rank, device=ctx.device)
    trainer.hooks = default_hooks(
        spec, fault_marker=job.fault_marker, fault_storage=job.fault_storage
    )
    intact = _ray.latest_checkpoint(lambda d: verify_checkpoint(d, checksums=False))
    with intact as (checkpoint_dir, stored):
        if checkpoint_dir is not None:
            trainer.load(checkpoint_dir, stored=stored)
        elif job.warm_start is not None:
            # A run's own checkpoint wins: a warm-started run that restarts continues from it.
            with _ray.checkpoint_directory(job.warm_start) as warm_dir:
                trainer.warm_start(warm_dir)

    def source(description: SourceDescription | None) -> WorkerSource | None:
        if description is None:
            return None
        return WorkerSource(
            [RowGroup(**g) for g in description.row_groups],
            spec.data,
            source_path=description.path,
            rank=ctx.rank,
            world_size=ctx.world_size,
            seed=spec.training.seed,
            shuffle=description.shuffle,
            num_actors=description.num_actors,
            schema=description.schema,
            quarantine_tag=description.quarantine_tag,
        )

    source_train = source(job.train_source)
    assert source_train is not None
    trainer.fit(train_data=source_train, eval_data=source(job.eval_source))
    logger.info("worker %d finished after %d steps", ctx.rank, trainer.step)
