"""Worker side of a training run: the loop and its cadences (metrics, evaluation,
checkpoints), training checkpoints and model directories.

Only ``raydlrm.trainers._ray`` imports Ray; the rest runs in plain processes.
"""

from raydlrm.trainers.config import CheckpointConfig, FaultConfig, TrainingConfig
from raydlrm.trainers.metrics import BinaryMetrics, binary_metrics
from raydlrm.trainers.model_dir import LoadedModel, load_model_checkpoint, save_model_metadata
from raydlrm.trainers.spec import WorkerSpec

__all__ = [
    "BinaryMetrics",
    "CheckpointConfig",
    "FaultConfig",
    "LoadedModel",
    "TrainingConfig",
    "WorkerSpec",
    "binary_metrics",
    "load_model_checkpoint",
    "save_model_metadata",
]
