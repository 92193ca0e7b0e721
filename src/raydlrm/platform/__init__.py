"""Driver side of a run: job config, CLI, launching Ray Train, MLflow tracking and export."""

from raydlrm.platform.config import ConfigError, JobConfig, load_config
from raydlrm.platform.launch import TrainResult, train

__all__ = ["ConfigError", "JobConfig", "TrainResult", "load_config", "train"]
