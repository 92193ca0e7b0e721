"""Driver side of a run: job config, CLI, launching Ray Train, MLflow tracking, export and
batch scoring."""

from raydlrm.platform.config import ConfigError, JobConfig, load_config
from raydlrm.platform.launch import TrainResult, train
from raydlrm.platform.scoring import ScoreResult, evaluate, score

__all__ = [
    "ConfigError",
    "JobConfig",
    "ScoreResult",
    "TrainResult",
    "evaluate",
    "load_config",
    "score",
    "train",
]
