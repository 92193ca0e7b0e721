"""The dense side's compute in the training loop: its precision (``training.precision``,
``tf32``) and its compilation (``training.compile``).

``bf16`` and ``fp16`` autocast the dense module (:attr:`RecModel.dense_dtype
<raydlrm.models.dlrm.RecModel>`); its weights and the dense optimizer stay fp32 and the logits
come back in fp32, so the loss and the metrics are fp32.

``fp16`` needs the loss scaled (its gradients underflow otherwise), and a step whose scaled
gradients overflow must move nothing. The embedding tables' fused optimizer updates the rows
inside the backward pass, so the backward is split at the lookups' output
(:class:`~raydlrm.sharding.types.EmbeddingCut`): the scaled loss's backward first runs
everything above the lookups (the dense side, and tower modules that a tower collection runs
on their hosts), then every rank checks its dense and pooled gradients, and one all-reduce
makes the decision the same on every rank. Unless some rank found an overflow, the gradients
are unscaled once, the lookups' backward updates the rows and the dense optimizer steps;
otherwise nothing is updated on any rank, in any table (no row, no optimizer state), and the
step is counted (``train/skipped_steps``). What a skipped step's forward pass did stays done:
managed tables admitted, counted and evicted its ids, row caches hold its rows, and
differential checkpoints write its rows (unchanged). The scale follows ``torch.amp.GradScaler``'s
rule (halved after a skipped step, doubled after 2,000 in a row without one) and is
checkpointed in its state format.

Tower modules that a tower collection runs on their hosts (``model.towers`` on several hosts)
are autocast alike (their ``dense_dtype``). ``training.compile`` compiles the module that runs
the dense architecture (the one DDP wraps) in place with ``nn.Module.compile``, so its
parameters keep their names and checkpoints do not change.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from raydlrm.models.dlrm import RecModel
from raydlrm.sharding.types import EmbeddingCut, ShardedTables
from raydlrm.trainers._dist import distributed
from raydlrm.trainers.config import TrainingConfig

__all__ = ["DensePrecision", "LossScale", "bf16_refusal"]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class LossScale:
    """fp16's dynamic loss scale: ``torch.amp.GradScaler``'s rule and state dict, with the
    decision taken by the caller (every rank the same).

    Args:
        init_scale: the first scale.
        growth_factor: the scale's factor after ``growth_interval`` steps in a row that did not
            overflow.
        backoff_factor: its factor after a step that overflowed.
        growth_interval: see ``growth_factor``.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        *,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ):
        self.scale = float(init_scale)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval = growth_interval
        self.growth_tracker = 0  # steps in a row without an overflow

    def update(self, *, overflow: bool) -> None:
        """The scale after a step that did (or did not) overflow."""
        if overflow:
            self.scale *= self.backoff_factor
            self.growth_tracker = 0
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            self.scale *= self.growth_factor
            self.growth_tracker = 0

    def state_dict(self) -> dict[str, Any]:
        """GradScaler's state dict (checkpoints of either load into the other)."""
        return {
            "scale": self.scale,
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "_growth_tracker": self.growth_tracker,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.growth_factor = float(state["growth_factor"])
        self.backoff_factor = float(state["backoff_factor"])
        self.growth_interval = int(state["growth_interval"])
        self.growth_tracker = int(state["_growth_tracker"])


def _unscale(grads: Sequence[torch.Tensor], scale: float, device: torch.device) -> torch.Tensor:
    """Divides ``grads`` (on ``device``: the dense side's and the pooled rows') by ``scale``
    in place; 1 (on ``device``) when any was not finite."""
    found = torch.zeros(1, device=device)
    inverse = torch.full((1,), 1.0 / scale, device=device)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = defaultdict(list)
    for g in grads:
        by_dtype[g.dtype].append(g)
    for tensors in by_dtype.values():
        # One fused kernel a dtype (GradScaler's): unscales and flags non-finite values.
        torch._amp_foreach_non_finite_check_and_unscale_(tensors, found, inverse)
    return found


def bf16_refusal(device: torch.device | int) -> str | None:
    """Why ``training.precision = "bf16"`` cannot run on CUDA device ``device``: it has no bf16
    units (compute capability below 8.0; torch's emulation does not count), else None."""
    if torch.cuda.get_device_capability(device)[0] >= 8:
        return None
    name = torch.cuda.get_device_name(device)
    return f"training.precision = 'bf16': {name} has no bf16; set it to 'fp16' or 'fp32'"


def _compile_dense(model: RecModel) -> None:
    """Compiles, in place, the module that runs ``model``'s dense architecture (inside DDP)."""
    dense = model.dense
    if isinstance(dense, DistributedDataParallel):
        dense = dense.module
    dense.compile()


class DensePrecision:
    """``training.precision`` of one worker's model (set on it here) and its backward pass.

    Attributes:
        loss_scale: fp16's loss scale (None otherwise).
        skipped_steps: steps whose scaled gradients overflowed on some rank (``fp16``): nothing
            was updated, on any rank.
    """

    def __init__(self, config: TrainingConfig, model: RecModel, device: torch.device):
        if config.precision == "bf16" and device.type == "cuda":
            refusal = bf16_refusal(device)
            if refusal is not None:
                raise ValueError(refusal)
        for module in model.modules():  # the model, and tower modules run on their hosts
            if hasattr(module, "dense_dtype"):
                module.dense_dtype = _DTYPES.get(config.precision)
        if config.compile:
            _compile_dense(model)
        self.device = device
        self.loss_scale = LossScale() if config.precision == "fp16" else None
        self._cut: EmbeddingCut | None = None
        if self.loss_scale is not None:
            assert isinstance(model.embedding_bags, ShardedTables), "fp16 needs sharded tables"
            self._cut = EmbeddingCut()
            model.embedding_bags.cut_embeddings(self._cut)
        self.skipped_steps = 0
        if device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = config.tf32
            torch.backends.cudnn.allow_tf32 = config.tf32

    def begin_step(self) -> None:
        """A training step's forward pass begins: lookups cut before it, by a training-mode
        forward that no backward of this step's followed (a hook's, a measurement's), are
        forgotten, so the step's backward runs its own lookups' alone."""
        if self._cut is not None:
            self._cut.discard()

    def backward_and_step(self, objective: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
        """Backward through the model (the fused embedding optimizer updates the rows) and the
        dense optimizer's step; with fp16, both or neither, the same on every rank (see the
        module docstring)."""
        if self.loss_scale is None:
            objective.backward()
            optimizer.step()
            return
        assert self._cut is not None
        scale = self.loss_scale.scale
        (objective * scale).backward()  # stops at the lookups' output (the cut)
        dense = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        pooled = self._cut.gradients()
        found = _unscale([*dense, *pooled], scale, self.device)
        if distributed():  # one decision: the pooled gradients differ across ranks
            dist.all_reduce(found, op=dist.ReduceOp.MAX)
        overflow = bool(found.item())  # one host synchronization a step
        if overflow:
            self._cut.discard()
            self.skipped_steps += 1
        else:
            self._cut.backward(pooled)
            optimizer.step()
        self.loss_scale.update(overflow=overflow)

    def metrics(self) -> dict[str, float]:
        """``train/skipped_steps`` with a loss scale, else nothing."""
        if self.loss_scale is None:
            return {}
        return {"train/skipped_steps": float(self.skipped_steps)}

    def state_dict(self) -> dict[str, Any]:
        """The loss scale's state (``torch.amp.GradScaler``'s format) and the skipped steps
        (checkpointed with the loop's state)."""
        if self.loss_scale is None:
            return {}
        return {"scaler": self.loss_scale.state_dict(), "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.loss_scale is not None and state:
            self.loss_scale.load_state_dict(state["scaler"])
            self.skipped_steps = int(state["skipped_steps"])
