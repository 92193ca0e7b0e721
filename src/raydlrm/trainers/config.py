"""Configuration of the per-worker training loop."""

from __future__ import annotations

import re
from typing import Literal

from raydlrm._config import config_dataclass

VALID_METRICS = {"valid/auc": "max", "valid/log_loss": "min", "valid/normalized_entropy": "min"}
"""The validation metrics early stopping can watch, with the direction that is better (a
click model's; a retrieval model's are :data:`RETRIEVAL_METRIC`)."""
RETRIEVAL_METRIC = re.compile(r"valid/(hr|ndcg)_at_(\d+)")
"""A retrieval model's validation metrics (``valid/hr_at_K``, ``valid/ndcg_at_K``, for ``K``
in ``model.retrieval_k``): higher is better."""


def metric_direction(metric: str) -> Literal["max", "min"] | None:
    """Which direction of validation metric ``metric`` is better (None: not one)."""
    if RETRIEVAL_METRIC.fullmatch(metric):
        return "max"
    return VALID_METRICS.get(metric)  # type: ignore[return-value]


@config_dataclass
class EarlyStoppingConfig:
    """Stop training where the validation metric stops improving (``[training.early_stopping]``;
    the section present is on). Needs a validation set (``data.valid_path`` or
    ``data.valid_split``), evaluated every ``training.valid_every_steps`` steps or at each
    epoch's end. Each improvement writes a checkpoint; the run stops when ``patience``
    evaluations in a row did not improve on the best by more than ``min_delta``, and ends with
    the best checkpoint's weights: that is the model registered, exported and scored on
    ``data.eval_path``."""

    enabled: bool = True
    """False turns it off (e.g. ``--set training.early_stopping.enabled=false`` on a config that
    has the section)."""
    metric: str = "valid/auc"
    """``valid/auc``, ``valid/log_loss`` or ``valid/normalized_entropy``."""
    mode: Literal["max", "min"] | None = None
    """Whether higher or lower is better (default: the metric's: AUC max, the losses min)."""
    patience: int = 2
    """Evaluations without improvement after which training stops."""
    min_delta: float = 0.0
    """An improvement is a change beyond the best by more than this (in the metric's units)."""

    def __post_init__(self) -> None:
        if metric_direction(self.metric) is None:
            raise ValueError(
                f"training.early_stopping.metric must be one of {sorted(VALID_METRICS)} or, "
                f"for a retrieval model, valid/hr_at_K or valid/ndcg_at_K; got {self.metric!r}"
            )
        if self.patience < 1:
            raise ValueError(
                f"training.early_stopping.patience must be at least 1, got {self.patience}"
            )
        if self.min_delta < 0:
            raise ValueError(
                f"training.early_stopping.min_delta must be >= 0, got {self.min_delta}"
            )

    def better(self) -> Literal["max", "min"]:
        """The direction that is better: ``mode``, else the metric's."""
        return self.mode or metric_direction(self.metric)  # type: ignore[return-value]


@config_dataclass
class TrainingConfig:
    """What the training loop does: epochs, dense optimizer, evaluation and reporting cadence."""

    num_epochs: int = 1
    """Passes over the training data."""
    max_steps: int | None = None
    """Stop after this many steps (None: run all epochs)."""
    dense_optimizer: Literal["adagrad", "adam", "sgd"] = "adam"
    """Optimizer of the data-parallel dense parameters."""
    learning_rate: float = 1e-3
    """Learning rate of the dense optimizer."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Compute precision of the dense architecture (the MLPs, cross and interaction layers):
    ``bf16`` or ``fp16`` run what autocast lowers (matmuls) in that type, on CUDA and on CPU,
    in training and evaluation; the weights and the dense optimizer's state stay fp32, the
    loss and metrics are computed in fp32, the embedding tables keep
    ``sharding.weights_precision``. ``fp16`` scales the loss (a gradient scaler, saved with
    checkpoints): a step whose gradients overflow skips the dense update, and the embedding
    update too when the pooled embeddings' gradients overflow (counted:
    ``train/skipped_steps``). Tower modules (``model.towers``) are autocast alike."""
    tf32: bool = True
    """On GPUs with TF32 (Ampere and later), fp32 matmuls and convolutions in TF32 (what
    ``precision = "fp32"`` computes with there); false: full fp32."""
    compile: bool = False
    """``torch.compile`` the dense architecture (``nn.Module.compile``, in place: checkpoints
    are unchanged). The first steps (and the first evaluation, and a last smaller batch) wait
    for the compilation. See ``benchmarks/RESULTS.md`` for when it pays."""
    embedding_l2: float = 0.0
    """L2 regularization of the embeddings: ``embedding_l2 / 2`` times each sample's squared
    pooled embeddings is added to the training loss (its mean over the batch), so every step
    pulls the rows a batch looks up toward zero (for a one-id feature, by ``embedding_l2``
    times the row, through the fused optimizer) and rows no batch looks up stay as they are.
    Any kernel, precision, tier and sharding type; ``train/loss`` stays the log loss."""
    seed: int = 0
    """Seed of model initialization; the same seed and world size give the same run."""
    log_every_steps: int = 50
    """Report training metrics every this many steps."""
    eval_every_steps: int = 0
    """Evaluate on the held-out data every this many steps, whether or not a log step (0: only
    at the end)."""
    valid_every_steps: int = 0
    """Evaluate on the validation set (``data.valid_path`` or ``data.valid_split``) every this
    many steps (0: at each epoch's end); and at the end of training when the last evaluation
    was earlier. Reported as ``valid/*`` with ``valid/step``."""
    early_stopping: EarlyStoppingConfig | None = None
    """Stop where the validation metric peaks and keep that model (see
    :class:`EarlyStoppingConfig`); None: train every epoch, keep the last model."""
    held_out_cache_mib: int = 256
    """Each worker keeps its share of the validation and of the held-out data (each) in memory
    after the first whole evaluation, up to this many MiB of preprocessed batches: the later
    evaluations (``valid_every_steps``, ``eval_every_steps``, the final one) read no files and
    start no preprocessing actors. A share over it is streamed every time (0: always)."""
    max_eval_batches: int | None = None
    """Evaluate on at most this many batches per worker (None: the whole eval set)."""
    torch_threads: int = 1
    """Intra-op threads per worker (keep CPUs for Ray Data on small machines)."""
    pipeline: Literal["none", "sparse_dist"] = "none"
    """``sparse_dist``: while a step trains, the next batch is copied to the device and its ids
    are routed to their embedding shards (the input all-to-all) in the background, on a
    process group of its own (``raydlrm.trainers.pipeline``); bit-identical results. ``none``:
    each step does that first."""
    sample_log_dir: str | None = None
    """Audit: write the sample ids of every step to ``<dir>/rank<r>-step<s>.npy`` (a local or
    shared directory; needs a ``sample_id`` column)."""

    def stopping(self) -> EarlyStoppingConfig | None:
        """The early stopping that is on, or None."""
        if self.early_stopping is None or not self.early_stopping.enabled:
            return None
        return self.early_stopping

    def __post_init__(self) -> None:
        if self.num_epochs <= 0:
            raise ValueError(f"training.num_epochs must be positive, got {self.num_epochs}")
        if self.max_steps is not None and self.max_steps <= 0:
            raise ValueError(f"training.max_steps must be positive, got {self.max_steps}")
        if self.learning_rate <= 0:
            raise ValueError(f"training.learning_rate must be positive, got {self.learning_rate}")
        if self.embedding_l2 < 0:
            raise ValueError(f"training.embedding_l2 must be >= 0, got {self.embedding_l2}")
        if self.log_every_steps <= 0:
            raise ValueError(
                f"training.log_every_steps must be positive, got {self.log_every_steps}"
            )
        if self.eval_every_steps < 0:
            raise ValueError(f"training.eval_every_steps must be >= 0, got {self.eval_every_steps}")
        if self.valid_every_steps < 0:
            raise ValueError(
                f"training.valid_every_steps must be >= 0, got {self.valid_every_steps}"
            )
        if self.held_out_cache_mib < 0:
            raise ValueError(
                f"training.held_out_cache_mib must be >= 0, got {self.held_out_cache_mib}"
            )
        if self.torch_threads <= 0:
            raise ValueError(f"training.torch_threads must be positive, got {self.torch_threads}")


@config_dataclass
class CheckpointConfig:
    """When training-state checkpoints are written and which are kept (``[checkpoint]``).

    A checkpoint holds everything needed to continue exactly: embedding shards and fused
    optimizer state, the dense model and optimizer, RNG states, step, epoch and data position.
    The run always ends with one; its shards are also the model's weights (exporting and
    registering the model assemble them table by table, never on one worker).
    """

    every_steps: int = 0
    """Write a checkpoint every this many steps (0: not by steps)."""
    every_minutes: float = 0.0
    """Write a checkpoint when this many minutes passed since the last one, checked at each log
    step (``training.log_every_steps``) (0: not by time)."""
    num_to_keep: int | None = None
    """Keep at most this many checkpoints (None: all). The latest is always kept for resume."""
    score_metric: str | None = None
    """Keep the best by this reported metric (e.g. ``train/loss``) instead of the newest."""
    score_order: Literal["max", "min"] = "max"
    """Whether a higher or lower ``score_metric`` is better."""
    differential: bool = False
    """Differential checkpoints (Check-N-Run): a checkpoint writes only the embedding rows
    training modified since the one before it (a *delta*; the dense part, optimizers and data
    position whole), on top of a full *baseline*. Resuming reads the chain (baseline, then
    every delta in order). The run's final checkpoint is always a baseline (it is the model)."""
    baseline_every: int = 10
    """With ``differential``: a baseline at least every this many checkpoints (the chain a
    resume reads is at most this long)."""
    baseline_fraction: float = 0.5
    """With ``differential``: a baseline instead of a delta once the chain's deltas would
    hold more than this fraction of a baseline's embedding bytes (above 1: longer chains, fewer
    bytes written, a slower resume). A delta that would be as large as a baseline is always
    written as one."""
    embedding_precision: Literal["fp32", "fp16", "int8"] = "fp32"
    """The precision checkpoints hold fp32 tables in: ``fp32`` (as trained: an exact resume),
    ``fp16`` (half the bytes), ``int8`` (row-wise codes with an fp16 scale and bias: a
    quarter and 4 bytes a row), rounded to nearest; fp16 tables go to ``int8`` only, ``int8``
    / ``int4`` tables are always saved as held. Optimizer state stays fp32. Resuming from a
    lower precision continues from the rounded weights (see ``benchmarks/RESULTS.md``)."""

    def __post_init__(self) -> None:
        if self.every_steps < 0:
            raise ValueError(f"checkpoint.every_steps must be >= 0, got {self.every_steps}")
        if self.every_minutes < 0:
            raise ValueError(f"checkpoint.every_minutes must be >= 0, got {self.every_minutes}")
        if self.num_to_keep is not None and self.num_to_keep <= 0:
            raise ValueError(f"checkpoint.num_to_keep must be positive, got {self.num_to_keep}")
        if self.baseline_every < 1:
            raise ValueError(
                f"checkpoint.baseline_every must be at least 1, got {self.baseline_every}"
            )
        if not self.baseline_fraction > 0:
            raise ValueError(
                f"checkpoint.baseline_fraction must be positive, got {self.baseline_fraction}"
            )
        if self.differential and self.score_metric is not None:
            raise ValueError(
                "checkpoint.differential keeps the newest checkpoints and the baselines they "
                "need; it cannot keep the best by checkpoint.score_metric: set one of them"
            )


FAULT_ENV = "RAYDLRM_FAULT"
"""``rank=R,step=S[,during=step|checkpoint|eval]``: a fault to inject, overriding ``[fault]``."""


@config_dataclass
class FaultConfig:
    """Fault injection for tests and drills (``[fault]``, or the ``RAYDLRM_FAULT`` variable).

    The chosen worker process kills itself with ``os._exit`` (no Python exception, no cleanup:
    as if the machine died) at the chosen step, once per run: a marker in the run's storage
    keeps the restarted worker from dying again.
    """

    at_step: int | None = None
    """Kill after this training step (None: no fault)."""
    rank: int = 0
    """The worker that dies."""
    during: Literal["step", "checkpoint", "eval"] = "step"
    """``step``: right after the step; ``checkpoint``: in the middle of writing the checkpoint
    of that step (its shards partly written, never reported); ``eval``: at the start of the
    final evaluation (``at_step`` the last step; the final checkpoint is already stored)."""

    def __post_init__(self) -> None:
        if self.at_step is not None and self.at_step <= 0:
            raise ValueError(f"fault.at_step must be positive, got {self.at_step}")
        if self.rank < 0:
            raise ValueError(f"fault.rank must be >= 0, got {self.rank}")

    @classmethod
    def from_env(cls, value: str) -> FaultConfig:
        """Parses ``rank=R,step=S[,during=...]``.

        Raises:
            ValueError: naming the variable and the bad part.
        """
        fields: dict[str, str] = {}
        for part in filter(None, (p.strip() for p in value.split(","))):
            key, sep, v = part.partition("=")
            if not sep or key not in ("rank", "step", "during"):
                raise ValueError(
                    f"{FAULT_ENV}={value!r}: expected rank=R,step=S[,during=step|checkpoint|eval], "
                    f"got {part!r}"
                )
            fields[key] = v
        if "step" not in fields:
            raise ValueError(f"{FAULT_ENV}={value!r}: step=S is required")
        try:
            return cls(
                at_step=int(fields["step"]),
                rank=int(fields.get("rank", "0")),
                during=fields.get("during", "step"),  # type: ignore[arg-type]
            )
        except ValueError as exc:
            raise ValueError(f"{FAULT_ENV}={value!r}: {exc}") from exc
