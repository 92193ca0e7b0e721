"""Worker side of a training run: the loop and its cadences (metrics, evaluation,
checkpoints), training checkpoints and model directories.

Only ``raydlrm.trainers._ray`` imports Ray; the rest runs in plain processes.
The names load lazily (``raydlrm._lazy``).
"""

from __future__ import annotations

from raydlrm._lazy import lazy_exports

# The public names by the submodule that defines them (imported on first use).
_EXPORTS: dict[str, tuple[str, ...]] = {
    "config": (
        "CheckpointConfig",
        "FaultConfig",
        "TrainingConfig",
    ),
    "metrics": (
        "BinaryMetrics",
        "binary_metrics",
    ),
    "model_dir": (
        "LoadedModel",
        "load_model_checkpoint",
        "save_model_metadata",
    ),
    "spec": ("WorkerSpec",),
}
__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
