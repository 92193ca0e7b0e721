"""Driver side of a run: job config, CLI, launching Ray Train, MLflow tracking, export, batch
scoring and scheduled retraining. The names load lazily (``raydlrm._lazy``): the command
line's help and config commands import neither torch, Ray nor MLflow."""

from __future__ import annotations

from raydlrm._lazy import lazy_exports

# The public names by the submodule that defines them (imported on first use).
_EXPORTS: dict[str, tuple[str, ...]] = {
    "config": (
        "ConfigError",
        "JobConfig",
        "load_config",
    ),
    "launch": (
        "TrainResult",
        "train",
    ),
    # Not the function retrain: it would be shadowed by this package's module of that name
    # (``raydlrm.retrain`` is the function).
    "retrain": (
        "RetrainError",
        "RetrainResult",
    ),
    "scoring": (
        "ScoreResult",
        "evaluate",
        "score",
    ),
}
__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
