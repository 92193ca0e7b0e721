"""The dense side's compute in the training loop: its precision (``training.precision``,
``tf32``) and its compilation (``training.compile``).

``bf16`` and ``fp16`` autocast the dense module (:attr:`RecModel.dense_dtype
<raydlrm.models.dlrm.RecModel>`); its weights and the dense optimizer stay fp32 and the logits
come back in fp32, so the loss and the metrics are fp32. ``fp16`` needs the loss scaled (its
gradients underflow otherwise): :class:`DensePrecision` scales the objective with a
``torch.amp.GradScaler``, which unscales the dense gradients and skips the dense step when
they overflow. The embedding tables' fused optimizer updates the rows inside the backward pass,
before the scaler sees anything, so a hook on the pooled embeddings unscales their gradient
there, and zeroes it when it overflowed (the rows then do not move: SGD, Adagrad and row-wise
Adagrad leave a row with a zero gradient as it is).

Tower modules that a tower collection runs on their hosts (``model.towers`` on several hosts)
are autocast alike (their ``dense_dtype``). ``training.compile`` compiles the module that runs
the dense architecture (the one DDP wraps) in place with ``nn.Module.compile``, so its
parameters keep their names and checkpoints do not change.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from raydlrm.models.dlrm import RecModel
from raydlrm.trainers.config import TrainingConfig

__all__ = ["DensePrecision", "bf16_refusal"]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _unscaled(grad: torch.Tensor, scale: float) -> torch.Tensor:
    """``grad / scale``, or zeros when any of it is not finite (no host synchronization)."""
    grad = grad / scale
    return torch.where(torch.isfinite(grad).all(), grad, torch.zeros_like(grad))


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
        skipped_steps: steps whose scaled gradients overflowed (``fp16``; the dense update
            was skipped, the same on every rank: the dense gradients are all-reduced first).
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
        self.scaler = torch.amp.GradScaler(device.type) if config.precision == "fp16" else None
        self.skipped_steps = 0
        self._scale: float | None = None  # the scale after the last step (read once a step)
        if device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = config.tf32
            torch.backends.cudnn.allow_tf32 = config.tf32

    def backward_and_step(
        self, objective: torch.Tensor, pooled: torch.Tensor, optimizer: torch.optim.Optimizer
    ) -> None:
        """Backward through the model (the fused embedding optimizer updates the rows) and the
        dense optimizer's step."""
        if self.scaler is None:
            objective.backward()
            optimizer.step()
            return
        scale = self.scaler.get_scale() if self._scale is None else self._scale
        if pooled.requires_grad:
            pooled.register_hook(lambda grad: _unscaled(grad, scale))
        self.scaler.scale(objective).backward()
        self.scaler.step(optimizer)
        self.scaler.update()
        self._scale = self.scaler.get_scale()  # one host synchronization a step
        if self._scale < scale:  # the scaler backs off after an overflow only
            self.skipped_steps += 1

    def metrics(self) -> dict[str, float]:
        """``train/skipped_steps`` with a loss scaler, else nothing."""
        return {} if self.scaler is None else {"train/skipped_steps": float(self.skipped_steps)}

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state and the skipped steps (checkpointed with the loop's state)."""
        if self.scaler is None:
            return {}
        return {"scaler": self.scaler.state_dict(), "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state["scaler"])
            self.skipped_steps = int(state["skipped_steps"])
            self._scale = None
