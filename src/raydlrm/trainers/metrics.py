"""Click-prediction metrics computed over all workers, and when the training loop logs them.

:class:`MetricsWindow` decides when to log (every ``training.log_every_steps``) and holds what
a log step reports: the window's predictions, its loss summed on the device (no host
synchronization inside a step on a GPU), samples and step time; and the current epoch's
predictions, for the final training metrics. :class:`StepClock` times the steps.

Metrics: AUC, log loss, normalized entropy.

Each worker holds the predictions of its own samples; the metrics of a global window are
computed from all of them, gathered to every rank (so every rank reports the same numbers).
AUC is the rank statistic (Mann-Whitney U, tied scores sharing their average rank), computed
here with torch: it equals scikit-learn's ``roc_auc_score`` (tested), whose import would add
about a second to every worker's start. Normalized entropy (He et al., 2014) is the log loss
divided by the entropy of the window's positive rate: 1.0 means no better than predicting the
base rate.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from raydlrm.trainers._dist import all_reduce_scalar

__all__ = [
    "BinaryMetrics",
    "MetricsWindow",
    "PredictionBuffer",
    "StepClock",
    "all_gather_varlen",
    "binary_metrics",
    "check_finite",
]


def all_gather_varlen(tensor: torch.Tensor) -> torch.Tensor:
    """Concatenates a 1-D tensor of any length from every rank, in rank order.

    Works without an initialized process group (returns ``tensor``). With NCCL (GPU workers)
    the exchange runs on the current GPU and the result comes back to ``tensor``'s device.
    """
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return tensor
    if dist.get_backend() == "nccl" and tensor.device.type != "cuda":
        home = tensor.device
        return all_gather_varlen(tensor.to(torch.cuda.current_device())).to(home)
    world = dist.get_world_size()
    size = torch.tensor([tensor.numel()], dtype=torch.int64, device=tensor.device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size)
    max_size = int(max(int(s) for s in sizes))
    padded = torch.zeros(max_size, dtype=tensor.dtype, device=tensor.device)
    padded[: tensor.numel()] = tensor
    gathered = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded)
    return torch.cat([g[: int(s)] for g, s in zip(gathered, sizes, strict=True)])


@dataclass
class BinaryMetrics:
    """Metrics of a set of binary predictions."""

    auc: float
    log_loss: float
    normalized_entropy: float
    num_samples: int
    positive_rate: float

    def to_dict(self, prefix: str) -> dict[str, float]:
        return {f"{prefix}{k}": float(v) for k, v in asdict(self).items()}


def binary_metrics(logits: torch.Tensor, labels: torch.Tensor) -> BinaryMetrics:
    """Metrics of ``logits`` (shape ``(N,)``) against 0/1 ``labels`` (shape ``(N,)``).

    AUC is NaN when only one class is present or a logit is not finite (a diverged model).
    """
    logits = logits.detach().double().cpu()
    labels = labels.detach().double().cpu()
    n = labels.numel()
    if n == 0:
        return BinaryMetrics(math.nan, math.nan, math.nan, 0, math.nan)
    log_loss = float(torch.nn.functional.binary_cross_entropy_with_logits(logits, labels))
    p = float(labels.mean())
    base = -(p * math.log(p) + (1 - p) * math.log(1 - p)) if 0 < p < 1 else math.nan
    both = 0 < p < 1
    finite = bool(torch.isfinite(logits).all())
    auc = _roc_auc(logits, labels) if both and finite else math.nan
    return BinaryMetrics(
        auc=auc,
        log_loss=log_loss,
        normalized_entropy=log_loss / base if both else math.nan,
        num_samples=n,
        positive_rate=p,
    )


def _roc_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """The area under the ROC curve of ``scores`` against 0/1 ``labels`` (both classes
    present): the probability that a positive outscores a negative, ties counting half."""
    ordered, order = torch.sort(scores, stable=True)
    _, counts = torch.unique_consecutive(ordered, return_counts=True)
    # The 1-based ranks of a run of equal scores, first+1 .. first+count, average to this.
    first = torch.cumsum(counts, 0) - counts
    ranks = torch.repeat_interleave(first.double() + (counts.double() + 1) / 2, counts)
    positive = labels[order] > 0.5
    n_pos = float(positive.sum())
    n_neg = float(positive.numel()) - n_pos
    return (float(ranks[positive].sum()) - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


def _on_host(parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """``parts`` as one host tensor, in order (an earlier offload's host tensor first, then
    those added since: on a GPU, joined there and copied in one transfer)."""
    host = [t for t in parts if t.device.type == "cpu"]
    added = [t for t in parts if t.device.type != "cpu"]
    if added:
        host.append(torch.cat(added).cpu())
    return [torch.cat(host)] if len(host) > 1 else host


class PredictionBuffer:
    """Collects a worker's logits and labels over a window; computes global metrics.

    Added tensors stay where they are (on a GPU: no copy to the host, no synchronization, in
    the step); :meth:`offload` moves what was added so far to the host, :meth:`compute` all.
    """

    def __init__(self) -> None:
        self._logits: list[torch.Tensor] = []
        self._labels: list[torch.Tensor] = []

    def add(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        self._logits.append(logits.detach().float())
        self._labels.append(labels.detach().float())

    def offload(self) -> None:
        """Moves the predictions collected so far to the host, as one tensor each."""
        self._logits, self._labels = _on_host(self._logits), _on_host(self._labels)

    def compute(self) -> BinaryMetrics:
        """Global metrics over every rank's buffer (a collective: all ranks must call); clears."""
        self.offload()
        logits = self._logits[0] if self._logits else torch.zeros(0)
        labels = self._labels[0] if self._labels else torch.zeros(0)
        self._logits, self._labels = [], []
        return binary_metrics(all_gather_varlen(logits), all_gather_varlen(labels))


def check_finite(loss: float, *, rank: int, when: str) -> None:
    """Raises FloatingPointError naming the rank and steps when ``loss`` is not finite."""
    if not math.isfinite(loss):
        raise FloatingPointError(
            f"training diverged: rank {rank} {when} loss is {loss} (lower "
            "training.learning_rate or sharding.learning_rate)"
        )


class StepClock:
    """Training wall time: each step with the wait for its batch, apart from the reports,
    evaluations and checkpoints between steps; the wait for the run's first batch (the data
    pipeline's start-up) is kept apart.

    Args:
        train_seconds: the time trained before (a resumed run's).
    """

    def __init__(self, train_seconds: float = 0.0) -> None:
        self.train_seconds = train_seconds
        self.first_batch_seconds: float | None = None
        self._mark = time.perf_counter()

    def restart(self) -> None:
        """Starts timing the next step (its batch's wait included)."""
        self._mark = time.perf_counter()

    def batch_arrived(self) -> None:
        """The step's batch is here; the run's first one ends the start-up."""
        if self.first_batch_seconds is None:
            self.first_batch_seconds = time.perf_counter() - self._mark
            self._mark = time.perf_counter()

    def step_done(self) -> float:
        """Ends the step: its seconds, added to ``train_seconds``."""
        seconds = time.perf_counter() - self._mark
        self.train_seconds += seconds
        return seconds


class MetricsWindow:
    """What the training loop reports at its log steps (see the module docstring).

    Args:
        every: log every this many steps (``training.log_every_steps``).
        device: the worker's device (the loss sum stays there).
        rank: this worker's rank (for messages).
        clicks: the steps' click metrics (``train/auc``, ...): not for a retrieval model,
            whose steps have no logits (only its loss is reported).
    """

    def __init__(self, *, every: int, device: torch.device, rank: int, clicks: bool = True) -> None:
        self.every = every
        self.device = device
        self.rank = rank
        self._window = PredictionBuffer()
        self._epoch = PredictionBuffer()
        self._binary = clicks
        self._reset()

    def _reset(self) -> None:
        self._loss = torch.zeros((), device=self.device)
        self._steps, self._samples, self._seconds = 0, 0, 0.0

    def should_log(self, step: int) -> bool:
        return step % self.every == 0

    def start_epoch(self) -> None:
        self._epoch = PredictionBuffer()

    def add(
        self,
        *,
        logits: torch.Tensor | None,
        labels: torch.Tensor,
        loss: torch.Tensor,
        seconds: float,
    ) -> None:
        """One step: its logits and labels ``(B,)`` (no logits: a retrieval model's step,
        whose window reports no click metrics), mean loss (0-d, on the device) and time."""
        if logits is not None:
            self._window.add(logits, labels)
            self._epoch.add(logits, labels)
        self._loss += loss
        self._steps += 1
        self._samples += labels.numel()
        self._seconds += seconds

    def check_finite(self, *, step: int) -> None:
        """Raises FloatingPointError when a step since the last log step diverged (on a GPU
        the loss is read only here and at log steps: before a checkpoint, at the end)."""
        check_finite(float(self._loss), rank=self.rank, when=f"steps up to {step}")

    def compute(self, *, step: int) -> dict[str, float]:
        """The window's metrics over all ranks (a collective): ``train/*`` of its predictions,
        ``train/loss`` (the mean of this rank's step losses) and ``train/samples_per_second``
        (all ranks' samples over the slowest rank's step time); starts the next window.

        Raises:
            FloatingPointError: the window's loss is not finite.
        """
        mean_loss = float(self._loss) / max(self._steps, 1)
        check_finite(mean_loss, rank=self.rank, when=f"steps {step - self._steps + 1}-{step}")
        samples = all_reduce_scalar(float(self._samples), self.device)
        seconds = all_reduce_scalar(self._seconds, self.device, op="max")
        self._epoch.offload()  # the epoch's predictions wait on the host
        clicks = self._window.compute().to_dict("train/") if self._binary else {}
        metrics = {
            **clicks,
            "train/loss": mean_loss,
            "train/samples_per_second": samples / max(seconds, 1e-9),
        }
        self._reset()
        return metrics

    def epoch_metrics(self) -> dict[str, float]:
        """``train/*`` over the current epoch's predictions, all ranks (a collective); none
        for a retrieval model."""
        return self._epoch.compute().to_dict("train/") if self._binary else {}
