"""When the training loop checkpoints, and how a run is restored or warm-started.

:class:`Checkpointer` decides when to write a training checkpoint (``[checkpoint]``: every
``every_steps`` steps, or when ``every_minutes`` passed since the last one, checked at the
log steps (``training.log_every_steps``); always at the end), writes this rank's part of it with
the merged data position (:mod:`raydlrm.trainers.checkpoints`), and reports it: Ray Train
merges the ranks' directories into one checkpoint, registered only once every rank's part is
stored. The final
checkpoint also holds the model's config, plan and metrics (:mod:`raydlrm.trainers.model_dir`):
its shards are the model's weights. It sees the training loop only through its state dict.

With ``checkpoint.differential`` it also keeps the chain (:class:`~raydlrm.trainers.checkpoints.
ChainLink`): a baseline first, then deltas of the rows modified since the last checkpoint, a
baseline again after ``baseline_every`` checkpoints, when the chain's deltas would pass
``baseline_fraction`` of a baseline's bytes, or when a delta would be as large as a
baseline. The final checkpoint follows the same rule (a delta's model is its chain, read as
one checkpoint: no extra full write at the end of a run). A resume with the same plan and
precisions goes on with the chain it loaded. With differential checkpoints or early stopping,
rank 0 deletes what retention (``num_to_keep``) no longer needs, keeping the chains of the kept
ones and the best validation checkpoint (:attr:`Checkpointer.protected`).
"""

from __future__ import annotations

import errno
import json
import logging
import shutil
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from raydlrm.ingestion.reader import EpochProgress
from raydlrm.sharding.sizes import stored_row_bytes
from raydlrm.storage import scratch_directory
from raydlrm.trainers._dist import all_gather_object, all_reduce_scalar, sum_over_ranks
from raydlrm.trainers.checkpoints import (
    ChainLink,
    TrainingParts,
    checkpoint_precisions,
    load_training_state,
    open_chain,
    prune_checkpoints,
    save_training_state,
)
from raydlrm.trainers.config import CheckpointConfig
from raydlrm.trainers.hooks import TrainerHook
from raydlrm.trainers.model_dir import METRICS_FILE, save_model_metadata
from raydlrm.trainers.reporting import Reporter

__all__ = ["Checkpointer", "Restored"]

logger = logging.getLogger(__name__)

_NO_SPACE = "No space left on device"  # strerror(ENOSPC)
_FULL_BYTES = 1 << 20
"""Free bytes below which a failed write is put down to a full staging disk."""


LOOP_KEYS = ("step", "epoch", "samples_seen", "train_seconds", "precision", "validation")
"""The training loop's own state in a checkpoint's state file (``Trainer.state_dict``): the
counters, the fp16 loss scaler (``precision``) and the validation's early stopping
(``validation``), the last two when the run had them."""


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
        loop_state: the loop's own state (:data:`LOOP_KEYS`).
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
        # Differential checkpoints: the last checkpoint written of the current chain, and the
        # names of the chain's checkpoints so far (None: the next one is a baseline).
        self._link: ChainLink | None = None
        self._names: list[str] | None = None
        if config.differential:
            parts.collection.track_modified_rows()
        # Retention by the workers (Ray Train's would delete by its own rule): a chain's
        # baselines, and the best validation checkpoint early stopping ends with, stay.
        self.prunes = config.differential or parts.spec.training.stopping() is not None
        self.protected: list[str] = []  # names of checkpoints kept whatever their age

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
            [EpochProgress.from_dict(p) for p in all_gather_object(progress.to_dict(files=False))],
            files=progress.files,  # the same on every rank
        )
        link = self._next_link() if self.config.differential else None
        try:
            stored = self._write(
                metrics, loop_state=loop_state, position=merged, final=final, link=link
            )
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
        if link is not None:
            self._chained(link, stored)
        if self.prunes and self.parts.rank == 0 and self.config.num_to_keep and stored:
            deleted = prune_checkpoints(stored, keep=self.config.num_to_keep, also=self.protected)
            if deleted:
                logger.debug("deleted checkpoints no kept one needs: %s", deleted)
        return stored

    def restart_chain(self) -> None:
        """The next checkpoint is a baseline (all ranks): after weights were loaded from
        elsewhere (the best checkpoint), rows changed that no delta would hold."""
        self._link, self._names = None, None
        if self.config.differential:
            self.parts.collection.clear_modified_rows()

    def _next_link(self) -> ChainLink:
        """The next checkpoint's place in its chain (the same on every rank): a delta of the
        rows modified since the last checkpoint, or a baseline (none yet, ``baseline_every``
        reached, the deltas past ``baseline_fraction``, or a delta as large as a baseline)."""
        rows = self.parts.collection.modified_rows()
        sizes = sum_over_ranks(_embedding_bytes(self.parts, rows), self.device)
        last, config = self._link, self.config
        if (
            last is None
            or self._names is None
            or len(self._names) >= config.baseline_every
            or last.delta_bytes + sizes["delta"] > config.baseline_fraction * last.baseline_bytes
            or sizes["delta"] >= sizes["full"]  # nothing to save: most rows were modified
        ):
            chain_id = all_gather_object(uuid.uuid4().hex)[0]
            return ChainLink("baseline", chain_id=chain_id, baseline_bytes=sizes["full"])
        return ChainLink(
            "delta",
            chain=list(self._names),
            chain_id=last.chain_id,
            rows=rows,
            delta_bytes=last.delta_bytes + sizes["delta"],
            baseline_bytes=last.baseline_bytes,
        )

    def _chained(self, link: ChainLink, stored: Any) -> None:
        """After writing ``link``'s checkpoint (stored as ``stored``): the chain goes on from
        it and the modified rows start afresh."""
        self.parts.collection.clear_modified_rows()
        if stored is None:  # not stored where a delta could find it: no chain
            self._link, self._names = None, None
            return
        self._link = link
        self._names = [*link.chain, Path(stored.path).name]

    def _write(
        self,
        metrics: dict[str, float],
        *,
        loop_state: dict[str, Any],
        position: EpochProgress,
        final: bool,
        link: ChainLink | None,
    ) -> Any:
        # A worker killed while it writes leaves its part here: the next scratch directory
        # made on the machine (its restarted successor's next checkpoint) removes it.
        with scratch_directory("ckpt") as tmp:
            if final and self.parts.rank == 0:
                save_model_metadata(
                    tmp,
                    spec=self.parts.spec,
                    plan=self.parts.plan,
                    metrics=self.reporter.merged(metrics, loop_state=loop_state),
                )
            save_training_state(
                tmp,
                parts=self.parts,
                loop_state=loop_state,
                position=position.to_dict(),
                link=link,
            )
            for hook in self.hooks:
                hook("checkpoint", rank=self.parts.rank, step=loop_state["step"])
            return self.reporter.report(
                metrics, loop_state=loop_state, checkpoint_dir=tmp, final=final
            )

    def load(self, directory: str, *, stored: Any = None) -> Restored:
        """Restores the parts from a training checkpoint (any world size or plan; a delta with
        its chain, found beside ``stored``, the checkpoint as stored, or else beside
        ``directory``); all ranks. Differential checkpoints go on with its chain when the plan
        and precisions are the same."""
        with open_chain(directory, stored) as chain:
            state = load_training_state(directory, parts=self.parts, chain=chain)
        self._continue_chain(state, name=Path(stored.path if stored else directory).name)
        metrics_file = Path(directory, METRICS_FILE)  # only final checkpoints hold it
        return Restored(
            loop_state={k: state[k] for k in LOOP_KEYS if k in state},
            position=EpochProgress.from_dict(state["position"]),
            world_size=state["world_size"],
            final_metrics=json.loads(metrics_file.read_text()) if metrics_file.is_file() else None,
        )

    def _continue_chain(self, state: dict[str, Any], *, name: str) -> None:
        link = state.get("differential")
        if self.config.differential:
            self.parts.collection.clear_modified_rows()
        same = (
            link is not None
            and state["plan"] == json.loads(self.parts.plan.to_json())
            and state.get("saved_precisions") == checkpoint_precisions(self.parts)
        )
        if not (self.config.differential and same):
            self._link, self._names = None, None
            return
        self._link = ChainLink(
            link["kind"],
            chain=link["chain"],
            chain_id=link["chain_id"],
            delta_bytes=link["delta_bytes"],
            baseline_bytes=link["baseline_bytes"],
        )
        self._names = [*link["chain"], name]

    def warm_start(self, directory: str, *, stored: Any = None) -> int:
        """Restores the parts from another run's checkpoint (any world size or plan; a delta
        with its chain, as :meth:`load`): its tables, dense weights and optimizer states; the
        RNG starts afresh from the seed. All ranks. Returns the step the checkpoint was
        written at."""
        with open_chain(directory, stored) as chain:
            state = load_training_state(directory, parts=self.parts, chain=chain)
        torch.manual_seed(self.parts.spec.training.seed)
        return int(state["step"])


def _embedding_bytes(parts: TrainingParts, rows: dict[str, torch.Tensor]) -> dict[str, float]:
    """This rank's estimated embedding bytes of a ``full`` checkpoint and of a ``delta`` of
    ``rows`` (weights at the checkpoint's precision, fused optimizer state, a delta's row
    ids): a data-parallel table counts on its first replica's rank only."""
    precisions = checkpoint_precisions(parts)
    optimizer = parts.spec.sharding.optimizer
    shards = parts.collection.local_shards()
    full = delta = 0.0
    for table in parts.plan.tables:
        s = shards.get(table.name)
        if s is None or (
            table.sharding_type == "data_parallel" and parts.rank != table.shards[0].rank
        ):
            continue
        row = stored_row_bytes(
            s.col_end - s.col_start, precision=precisions[table.name], optimizer=optimizer
        )
        full += row * (s.row_end - s.row_start)
        delta += (row + 8) * rows[table.name].numel()
    return {"full": full, "delta": delta}
