"""Configuration of the per-worker training loop."""

from __future__ import annotations

from typing import Literal

from raydlrm._config import config_dataclass


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
    seed: int = 0
    """Seed of model initialization; the same seed and world size give the same run."""
    log_every_steps: int = 50
    """Report training metrics every this many steps."""
    eval_every_steps: int = 0
    """Evaluate on the held-out data every this many steps (0: only at the end)."""
    max_eval_batches: int | None = None
    """Evaluate on at most this many batches per worker (None: the whole eval set)."""
    torch_threads: int = 1
    """Intra-op threads per worker (keep CPUs for Ray Data on small machines)."""

    def __post_init__(self) -> None:
        if self.num_epochs <= 0:
            raise ValueError(f"training.num_epochs must be positive, got {self.num_epochs}")
        if self.max_steps is not None and self.max_steps <= 0:
            raise ValueError(f"training.max_steps must be positive, got {self.max_steps}")
        if self.learning_rate <= 0:
            raise ValueError(f"training.learning_rate must be positive, got {self.learning_rate}")
        if self.log_every_steps <= 0:
            raise ValueError(
                f"training.log_every_steps must be positive, got {self.log_every_steps}"
            )
        if self.eval_every_steps < 0:
            raise ValueError(f"training.eval_every_steps must be >= 0, got {self.eval_every_steps}")
        if self.torch_threads <= 0:
            raise ValueError(f"training.torch_threads must be positive, got {self.torch_threads}")
