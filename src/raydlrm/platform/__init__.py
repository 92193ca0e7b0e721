"""Driver side of a run: job config, CLI, launching Ray Train, MLflow tracking, export, batch
scoring and scheduled retraining."""

from raydlrm.platform.config import ConfigError, JobConfig, load_config
from raydlrm.platform.launch import TrainResult, train
from raydlrm.platform.retrain import RetrainError, RetrainResult, retrain
from raydlrm.platform.scoring import ScoreResult, evaluate, score

__all__ = [
    "ConfigError",
    "JobConfig",
    "RetrainError",
    "RetrainResult",
    "ScoreResult",
    "TrainResult",
    "evaluate",
    "load_config",
    "retrain",
    "score",
    "train",
]
